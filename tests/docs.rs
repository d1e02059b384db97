//! The docs are kept true to the tree: every relative link resolves, every config key the code
//! accepts is in docs/configuration.md, and the shipped example configs pass `check-config`.

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
    ("RawHealth", "health."),
    ("RawDocker", "docker."),
    ("RawRemediation", "docker.remediation."),
    ("RawStandby", "docker.remediation.standby[]."),
    ("RawAuth", "auth."),
    ("RawClientKey", "auth.keys[]."),
    ("RawVault", "vault."),
    ("RawCluster", "cluster."),
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
