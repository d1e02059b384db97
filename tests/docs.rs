//! The docs are kept true to the tree: every relative link resolves, every config key the code
//! accepts is in docs/configuration.md and every default its tables give is the code's, and the
//! shipped example configs pass `check-config`.

mod common;

use std::path::{Path, PathBuf};

use common::BIN;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn markdown_files() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut files = vec![
        root.join("README.md"),
        root.join("ARCHITECTURE.md"),
        root.join("deploy/README.md"),
    ];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files
}

/// `](target)` links of a Markdown text, outside fenced code blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with('#')
            {
                continue;
            }
            let target = link.split('#').next().unwrap();
            assert!(
                dir.join(target).exists(),
                "{}: the link `{link}` leads nowhere",
                file.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 15,
        "only {checked} relative links found: the reader is broken"
    );
}

/// Where each config struct's keys sit in the YAML (a new struct must be placed here).
const PATHS: &[(&str, &str)] = &[
    ("RawConfig", ""),
    ("RawServer", "server."),
    ("RawLimits", "limits."),
    ("RawEndpoint", "models.<name>."),
    ("RawTimeouts", "models.<name>.timeouts."),
    ("RawCost", "models.<name>.cost."),
    ("RawHealthCheck", "models.<name>.health_check."),
    ("RawHook", "models.<name>.health_check.purge."),
    ("RawRoutingPolicy", "routing_policy."),
    ("RawTruncation", "routing_policy.truncation."),
    ("RawRouteFull", "routes.<name>."),
    ("RawHedge", "hedge."),
    ("RawLastResort", "routes.<name>.last_resort."),
    ("RawCache", "routes.<name>.cache."),
    ("RawHealth", "health."),
    ("RawDocker", "docker."),
    ("RawRemediation", "docker.remediation."),
    ("RawStandby", "docker.remediation.standby[]."),
    ("RawAuth", "auth."),
    ("RawClientKey", "auth.keys[]."),
    ("RawVault", "vault."),
    ("RawCluster", "cluster."),
    ("RawTelemetry", "telemetry."),
    ("RawOtlp", "telemetry.otlp."),
    ("RawResponses", "responses."),
    ("RawAudit", "audit."),
    ("RawApprole", "vault.approle."),
    ("RawAlerts", "alerts."),
    ("RawWebhook", "alerts.webhooks[]."),
    ("RawAllFailed", "alerts.all_failed."),
];

/// Every `pub field` of every `Raw*` struct in src/config/raw.rs, as (struct, YAML key).
fn config_keys() -> Vec<(String, String)> {
    let src = std::fs::read_to_string(Path::new(ROOT).join("src/config/raw.rs")).unwrap();
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut renamed = false;
    for line in src.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("pub struct ") {
            current = Some(rest.split([' ', '{']).next().unwrap().to_string());
            continue;
        }
        if line.starts_with('}') {
            current = None;
            continue;
        }
        let Some(s) = &current else { continue };
        if t.starts_with("#[serde(rename = \"type\")]") {
            renamed = true;
            continue;
        }
        if let Some(rest) = t.strip_prefix("pub ")
            && let Some((name, _)) = rest.split_once(':')
        {
            let key = if std::mem::take(&mut renamed) {
                "type".to_string()
            } else {
                name.to_string()
            };
            out.push((s.clone(), key));
        }
    }
    out
}

#[test]
fn every_config_key_the_code_accepts_is_in_the_configuration_doc() {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/configuration.md")).unwrap();
    let keys = config_keys();
    assert!(
        keys.len() > 100,
        "only {} keys read: the reader is broken",
        keys.len()
    );
    let mut missing = Vec::new();
    for (s, key) in &keys {
        let Some((_, prefix)) = PATHS.iter().find(|(name, _)| name == s) else {
            panic!("config struct {s} has no place in PATHS (tests/docs.rs): add its YAML path");
        };
        let path = format!("`{prefix}{key}`");
        if !doc.contains(&path) {
            missing.push(path);
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md lacks {missing:?}"
    );
}

fn check_config(path: &Path) {
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_shipped_configs_and_the_readme_example_pass_check_config() {
    let root = Path::new(ROOT);
    check_config(&root.join("config/example.yaml"));
    check_config(&root.join("config/config.yaml"));
    // README's "A config" block, as written.
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = readme
        .split("## A config")
        .nth(1)
        .and_then(|s| s.split("```yaml").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("README has a yaml block under `## A config`");
    assert!(
        block.lines().count() <= 25,
        "README's config example stays short"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("readme.yaml");
    std::fs::write(&path, block).unwrap();
    check_config(&path);
}

#[test]
fn the_readme_is_a_front_page() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 250,
        "README.md has {} lines",
        readme.lines().count()
    );
    for cmd in ["cargo run --release -- demo", "bash tests/run-all.sh"] {
        assert!(readme.contains(cmd), "README's quick start lost `{cmd}`");
    }
}

/// The rows of configuration.md's key tables: (key, its default cell), backticks kept.
fn documented_defaults() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/configuration.md")).unwrap();
    let mut out = Vec::new();
    let mut in_table = false;
    for line in doc.lines() {
        if line.starts_with("| key | default |") {
            in_table = true;
            continue;
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if in_table && cells.len() > 3 && cells[1].starts_with('`') && !cells[1].starts_with("`-") {
            out.push((cells[1].trim_matches('`').to_string(), cells[2].to_string()));
        }
    }
    out
}

/// Cells that state no value one could write instead (an absent key's meaning), by their words.
const NO_VALUE: &[&str] = &[
    "required",
    "—",
    "none",
    "unlimited",
    "all",
    "all defaults",
    "open gateway",
    "off",
    "unknown",
    "the endpoint's name",
    "from the model id",
    "the policy's",
    "the type's probe",
    "the first non-ingress one",
    "SQLite in",
    "on a loopback",
    "keep_turns 2, omission_note true",
    // Another key's value: an absent key follows that key; one written stops following it.
    "routing_policy.default_cooldown",
    "health.probe_timeout",
    "OpenAI: connect",
];

/// A cell's default as YAML to write, per endpoint type where the cell says so; `None`: a cell
/// of [`NO_VALUE`] (or an error naming the cell: a new form must be taught here).
fn default_values(key: &str, cell: &str) -> Option<Vec<(Option<&'static str>, String)>> {
    let plain = |v: &str| -> String {
        let v = v.trim().trim_matches('`');
        let v = v.split(" (").next().unwrap().replace(',', "");
        // `8 MiB` → `8MiB`: one size string.
        match v.split_once(' ') {
            Some((n, unit)) if n.parse::<f64>().is_ok() && unit.ends_with('B') => {
                format!("{n}{unit}")
            }
            _ => v,
        }
    };
    let types: [(&str, &'static str); 3] =
        [("OpenAI", "openai"), ("vLLM", "vllm"), ("Ollama", "ollama")];
    if key == "models.<name>.capabilities" {
        // "OpenAI: a, b; vLLM: the same without vision, with continue; Ollama: c, d".
        let openai = cell
            .split("; ")
            .next()?
            .strip_prefix("OpenAI: ")?
            .to_string();
        let ollama = cell
            .split("; ")
            .nth(2)?
            .strip_prefix("Ollama: ")?
            .to_string();
        assert!(
            cell.contains("vLLM: the same without vision, with continue"),
            "{cell}"
        );
        let vllm: Vec<&str> = openai
            .split(", ")
            .filter(|c| *c != "vision")
            .chain(["continue"])
            .collect();
        return Some(vec![
            (Some("openai"), format!("[{openai}]")),
            (Some("vllm"), format!("[{}]", vllm.join(", "))),
            (Some("ollama"), format!("[{ollama}]")),
        ]);
    }
    if cell.starts_with("OpenAI: `") {
        // "OpenAI: `a`; vLLM: `b`; Ollama: `c`".
        return Some(
            cell.split("; ")
                .map(|part| {
                    let (name, v) = part.split_once(": ").unwrap();
                    let t = types.iter().find(|(n, _)| *n == name).unwrap().1;
                    (Some(t), plain(v))
                })
                .collect(),
        );
    }
    if cell.contains(" (OpenAI)") {
        // "10s (OpenAI), 30s (vLLM, Ollama)".
        let mut out = Vec::new();
        for part in cell.split("), ") {
            let (v, names) = part.split_once(" (").unwrap();
            for name in names.trim_end_matches(')').split(", ") {
                let t = types.iter().find(|(n, _)| *n == name).unwrap().1;
                out.push((Some(t), plain(v)));
            }
        }
        return Some(out);
    }
    let words = cell.trim_matches('`');
    if NO_VALUE
        .iter()
        .any(|w| words == *w || (w.len() > 4 && words.starts_with(w)))
        || words.starts_with("none")
    {
        return None;
    }
    // A share of another key's default.
    if let Some(of) = cell.strip_prefix("a quarter of `") {
        // A sibling key: the same parent as `key`'s.
        let parent = &key[..key.rfind('.').map_or(0, |i| i + 1)];
        let other = format!("{parent}{}", of.trim_end_matches('`'));
        let (_, c) = documented_defaults()
            .into_iter()
            .find(|(k, _)| *k == other)
            .unwrap();
        let v = plain(&c);
        let (n, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap());
        return Some(vec![(
            None,
            format!("{}{unit}", n.parse::<u64>().unwrap() / 4),
        )]);
    }
    Some(vec![(None, plain(cell))])
}

/// The smallest config a key can be written in, and where the key goes in it (`models.<name>`
/// is endpoint `m`, of type `ty`).
fn context_for(key: &str, ty: &str) -> (serde_yaml_ng::Value, Vec<String>) {
    let mut base: serde_yaml_ng::Value = serde_yaml_ng::from_str(&format!(
        "models:\n  m:\n    type: {ty}\n    base_url: http://127.0.0.1:9/v1\n    model: m\n"
    ))
    .unwrap();
    let extra: Option<&str> = [
        ("models.<name>.health_check.purge.", "models: {m: {health_check: {url: 'http://127.0.0.1:9/h', purge: {url: 'http://127.0.0.1:9/p'}}}}"),
        ("models.<name>.health_check.", "models: {m: {health_check: {url: 'http://127.0.0.1:9/h'}}}"),
        ("models.<name>.timeouts.", "models: {m: {timeouts: {}}}"),
        ("models.<name>.cost.", "models: {m: {cost: {}}}"),
        ("models.<name>.base_url", "models: {m: {base_url: null}}"),
        ("routes.<name>.last_resort.", "routes: {r: {chain: [m], last_resort: {}}}"),
        ("routes.<name>.cache.", "routes: {r: {chain: [m], cache: {}}}"),
        ("routes.<name>.", "routes: {r: {chain: [m]}}"),
        ("hedge.", "routes: {r: {chain: [m], hedge: {after: 100ms}}}"),
        ("docker.remediation.standby[].", "docker: {remediation: {standby: [{primary: m, service: s}]}}"),
        ("docker.remediation.", "docker: {remediation: {}}"),
        ("auth.keys[].", "auth: {keys: [{name: a, key: sk-client-0123456789abcdef}]}"),
        ("vault.approle.", "vault: {address: 'http://127.0.0.1:9', approle: {role_id: r, secret_id: s}}"),
        ("vault.", "vault: {address: 'http://127.0.0.1:9', token: t}"),
        ("alerts.webhooks[].", "alerts: {webhooks: [{url: 'http://127.0.0.1:9/w'}]}"),
        ("alerts.", "alerts: {}"),
        ("audit.store", "audit: {}"),
        ("audit.", "audit: {store: postgres, url: 'postgres://u@127.0.0.1:9/d'}"),
        ("cluster.", "cluster: {redis: 'redis://127.0.0.1:9/0'}"),
        ("telemetry.otlp.", "telemetry: {otlp: {endpoint: 'http://127.0.0.1:9/v1/traces'}}"),
    ]
    .iter()
    .find(|(p, _)| key.starts_with(p))
    .map(|(_, y)| *y);
    if let Some(y) = extra {
        merge(&mut base, serde_yaml_ng::from_str(y).unwrap());
    }
    let path: Vec<String> = if let Some(rest) = key.strip_prefix("models.<name>.") {
        ["models", "m"]
            .iter()
            .map(|s| s.to_string())
            .chain(rest.split('.').map(String::from))
            .collect()
    } else if let Some(rest) = key.strip_prefix("routes.<name>.") {
        ["routes", "r"]
            .iter()
            .map(|s| s.to_string())
            .chain(rest.split('.').map(String::from))
            .collect()
    } else if let Some(rest) = key.strip_prefix("hedge.") {
        vec!["routes".into(), "r".into(), "hedge".into(), rest.into()]
    } else {
        key.split('.').map(String::from).collect()
    };
    (base, path)
}

/// `b` merged into `a`, maps key by key.
fn merge(a: &mut serde_yaml_ng::Value, b: serde_yaml_ng::Value) {
    use serde_yaml_ng::Value;
    match (a, b) {
        (Value::Mapping(a), Value::Mapping(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(slot) if v.is_mapping() => merge(slot, v),
                    _ => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (a, b) => *a = b,
    }
}

/// `value` written at `path` (a `name[]` step: into the list's first item).
fn set(doc: &mut serde_yaml_ng::Value, path: &[String], value: serde_yaml_ng::Value) {
    let mut at = doc;
    for (i, step) in path.iter().enumerate() {
        let (name, item) = match step.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (step.as_str(), false),
        };
        let map = at
            .as_mapping_mut()
            .unwrap_or_else(|| panic!("{path:?}: not a map at {name}"));
        let key = serde_yaml_ng::Value::from(name);
        if i + 1 == path.len() {
            map.insert(key, value);
            return;
        }
        if !map.contains_key(&key) {
            map.insert(
                key.clone(),
                serde_yaml_ng::Value::Mapping(Default::default()),
            );
        }
        at = map.get_mut(&key).unwrap();
        if item {
            at = at.as_sequence_mut().and_then(|s| s.first_mut()).unwrap();
        }
    }
}

/// The table a config text loads to, without what records where it came from.
fn table(doc: &serde_yaml_ng::Value) -> Result<String, String> {
    let text = serde_yaml_ng::to_string(doc).unwrap();
    let mut cfg = autohedge::config::Config::load(&text).map_err(|e| e.0)?;
    cfg.source = autohedge::config::Source::None;
    cfg.source_digest = [0; 32];
    Ok(format!("{cfg:#?}"))
}

/// Every default configuration.md's tables give is the code's: a config that writes a key as
/// its documented default loads to the same table as one that leaves it out (per endpoint type
/// where the doc gives one a type). A cell that states no value (`none`, `required`, …) is
/// named in [`NO_VALUE`]; any other form the reader does not know fails the test.
#[test]
fn every_documented_default_is_the_codes() {
    let rows = documented_defaults();
    assert!(
        rows.len() > 120,
        "only {} rows read: the reader is broken",
        rows.len()
    );
    let mut checked = 0;
    let mut wrong = Vec::new();
    for (key, cell) in &rows {
        let Some(values) = default_values(key, cell) else {
            continue;
        };
        for (ty, value) in values {
            if ty.is_some() && !key.starts_with("models.<name>.") {
                panic!("{key}: a per-type default outside an endpoint");
            }
            let ty = ty.unwrap_or("openai");
            let (base, path) = context_for(key, ty);
            let without =
                table(&base).unwrap_or_else(|e| panic!("{key}: the context does not load: {e}"));
            let mut with = base.clone();
            // A text YAML would read as a map (`autohedge:`) is the text.
            let v = match serde_yaml_ng::from_str(&value).unwrap() {
                serde_yaml_ng::Value::Mapping(_) => serde_yaml_ng::Value::from(value.as_str()),
                v => v,
            };
            set(&mut with, &path, v);
            match table(&with) {
                Ok(t) if t == without => checked += 1,
                Ok(_) => wrong.push(format!("{key} ({ty}): `{value}` is not the code's default")),
                Err(e) => wrong.push(format!("{key} ({ty}): `{value}` does not load: {e}")),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "configuration.md's defaults that are not the code's:\n{}",
        wrong.join("\n")
    );
    assert!(
        checked > 80,
        "only {checked} defaults checked: the reader is broken"
    );
}
