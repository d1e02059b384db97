//! The routing table, in four parts: `raw` (the YAML contract: `Raw*` structs, unknown keys are
//! errors that name their path), `resolve` (validation and resolution into the runtime types:
//! secrets, HTTP clients, token counters, URLs), `types` (the runtime [`Config`] requests read from
//! one frozen snapshot) and `describe` (what `check-config` prints). Everything that can fail
//! happens in [`Config::load`]; swapping the result in (the reload watcher, `AppState::install`)
//! cannot fail. The module imports nothing of the request path (checked by a test in `lib.rs`).

mod describe;
pub mod duration;
mod raw;
mod resolve;
mod types;
pub mod vault;

pub use describe::describe;
pub use raw::*;
use resolve::build;
pub use resolve::{
    DEFAULT_MAX_EVENT_BYTES, MAX_ADDRESSES, key_digest, listen_is_loopback, url_for,
};
pub use types::*;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

pub use duration::Dur;

/// The default config compiled into the binary, used when no file is given and none exists.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../config/config.yaml");

/// Request bodies larger than this are refused with 413 unless `server.max_body_bytes` says
/// otherwise: 8 MiB holds a long conversation with a few base64 images.
const DEFAULT_MAX_BODY: usize = 8 * 1024 * 1024;

/// An upstream answer read whole (a non-stream 2xx body) larger than this is refused unless
/// `server.max_response_bytes` says otherwise. The largest real answers are embeddings: 2,048
/// inputs of 3,072 floats as JSON text are about 90 MB.
const DEFAULT_MAX_RESPONSE: usize = 128 * 1024 * 1024;

/// The largest config file read: a config of hundreds of endpoints is tens of KB. A path that
/// points at something endless (`/dev/zero`, a FIFO someone keeps writing) must not grow the
/// process without bound.
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// A file's bytes, at most `limit` of them: more is an error (`InvalidData`, saying so), not a
/// truncated read. For the config file and the files it names (key files, CA bundles).
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(bytes)
}

/// [`read_bounded`] as text.
pub fn read_text_bounded(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"))
}

/// How often a rebuild reads a file again that did not load, and how far apart.
const REBUILD_RETRIES: usize = 5;
const REBUILD_RETRY_GAP: std::time::Duration = std::time::Duration::from_millis(20);

/// SHA-256 of a config text.
pub fn text_digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

impl Config {
    /// Reads and loads a config file.
    pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
        Config::load_file_with(path, &[])
    }

    pub fn load_file_with(
        path: &Path,
        discovered: &[DiscoveredEndpoint],
    ) -> Result<Config, ConfigError> {
        let text = zeroize::Zeroizing::new(
            read_text_bounded(path, MAX_CONFIG_BYTES)
                .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?,
        );
        let mut cfg = Config::build_from(&text, discovered)
            .map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))?;
        cfg.source = Source::File(path.to_path_buf());
        Ok(cfg)
    }

    /// Builds the table again from where it came from, with `discovered`; `None` when it was
    /// not built from YAML.
    pub fn rebuild_with(
        &self,
        discovered: &[DiscoveredEndpoint],
    ) -> Option<Result<Config, ConfigError>> {
        match &self.source {
            Source::None => None,
            Source::File(p) => {
                // A file caught mid-write (an editor or `cp` truncates it first) reads as
                // invalid for an instant: read it again a few times before giving up, as the
                // watcher's debounce waits out the same write.
                let mut built = Config::load_file_with(p, discovered);
                for _ in 0..REBUILD_RETRIES {
                    if built.is_ok() {
                        break;
                    }
                    std::thread::sleep(REBUILD_RETRY_GAP);
                    built = Config::load_file_with(p, discovered);
                }
                Some(built)
            }
            Source::Text(t) => Some(Config::load_with(t, discovered)),
        }
    }

    /// Parses, validates and resolves a config text.
    pub fn load(text: &str) -> Result<Config, ConfigError> {
        Config::load_with(text, &[])
    }

    /// Like `load`, plus endpoints Docker discovery found that the file does not name: each is
    /// added with `discover: docker` and appended to the fallback chain (when docker is on).
    pub fn load_with(text: &str, discovered: &[DiscoveredEndpoint]) -> Result<Config, ConfigError> {
        let mut cfg = Config::build_from(text, discovered)?;
        cfg.source = Source::Text(Arc::from(text));
        Ok(cfg)
    }

    fn build_from(text: &str, discovered: &[DiscoveredEndpoint]) -> Result<Config, ConfigError> {
        let mut cfg = Config::build_raw(text, discovered)?;
        cfg.source_digest = text_digest(text.as_bytes());
        Ok(cfg)
    }

    fn build_raw(text: &str, discovered: &[DiscoveredEndpoint]) -> Result<Config, ConfigError> {
        let mut raw = parse(text)?;
        let mut extra = Vec::new();
        if raw.docker.enabled && raw.docker.adopt_unconfigured {
            for d in discovered {
                if raw.models.contains_key(&d.name) || raw.routes.contains_key(&d.name) {
                    continue;
                }
                let ep: RawEndpoint = serde_json::from_value(serde_json::json!({
                    "type": d.kind,
                    "discover": "docker",
                    "model": d.model,
                }))
                .map_err(|e| ConfigError(format!("discovered endpoint {}: {e}", d.name)))?;
                raw.models.insert(d.name.clone(), ep);
                if !raw.routing_policy.fallback_chain.is_empty() {
                    raw.routing_policy.fallback_chain.push(d.name.clone());
                }
                extra.push(d.name.clone());
            }
        }
        // `vault:` secrets are read before anything is built: Vault unreachable at start or on a
        // reload is an error naming the secret's path (a reload keeps the last good table).
        let refs = resolve::vault_refs(&raw);
        let fetched = match (&raw.vault, refs.is_empty()) {
            (_, true) => Fetched::new(),
            (None, false) => {
                return Err(ConfigError(format!(
                    "{} is used but there is no `vault:` section",
                    refs[0]
                )));
            }
            (Some(v), false) => {
                let settings = resolve::vault_settings(v)?;
                crate::config::vault::read_blocking(&settings, &refs).map_err(ConfigError)?
            }
        };
        let mut cfg = build(raw, &fetched)?;
        cfg.discovered_extra = extra;
        Ok(cfg)
    }

    /// The chain a requested model name resolves to, or `None` (404 `model_not_found`).
    pub fn chain_for(&self, requested: &str) -> Option<Arc<[String]>> {
        self.chains.get(requested).cloned()
    }

    /// The endpoints a client key's `models` allow-list covers: a named endpoint covers itself,
    /// a named route the endpoints of its chain. Nothing else may serve, hedge or continue that
    /// key's requests.
    pub fn covered_by(
        &self,
        models: &std::collections::BTreeSet<String>,
    ) -> std::collections::BTreeSet<String> {
        let mut covered = std::collections::BTreeSet::new();
        for name in models {
            if let Some(route) = self.routes.get(name) {
                covered.extend(route.iter().cloned());
            } else if self.endpoints.contains_key(name) {
                covered.insert(name.clone());
            }
        }
        covered
    }

    /// [`Config::chains`]: every route's chain, and every endpoint's (the endpoint, then the
    /// fallback chain from the place after it, wrapping around, each name once). Route names
    /// never clash with endpoint names (loading refuses it).
    pub(crate) fn resolve_chains(&self) -> BTreeMap<String, Arc<[String]>> {
        let mut chains = BTreeMap::new();
        for requested in self.endpoints.keys() {
            let mut chain = vec![requested.clone()];
            let start = self
                .fallback_chain
                .iter()
                .position(|n| n == requested)
                .map(|i| i + 1)
                .unwrap_or(0);
            for name in self.fallback_chain[start..]
                .iter()
                .chain(self.fallback_chain[..start].iter())
            {
                if !chain.contains(name) {
                    chain.push(name.clone());
                }
            }
            chains.insert(requested.clone(), Arc::from(chain));
        }
        for (name, route) in &self.routes {
            chains.insert(name.clone(), Arc::from(route.as_slice()));
        }
        chains
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    const SEED: &str = r#"
server: { listen: 127.0.0.1:8000 }
models:
  gpt-4o-mini:
    type: openai
    base_url: https://api.openai.com/v1
    api_key: env:AUTOHEDGE_TEST_SURELY_UNSET
    model: gpt-4o-mini
    context_window: 128000
    max_tokens: 16384
    timeouts: { connect: 2s, first_token: 10s, total: 120s }
  qwen2.5-7b:
    type: ollama
    host: http://127.0.0.1:11434
    model: qwen2.5:7b
    timeout: 3
routing_policy:
  fallback_chain: [gpt-4o-mini, qwen2.5-7b]
  success_threshold: 0.85
  cache_ttl: 300
routes:
  chat: [gpt-4o-mini, qwen2.5-7b]
"#;

    #[test]
    fn alerts_in_the_issues_shape_resolve_and_never_show_the_url() {
        let yaml = format!(
            "{SEED}alerts:\n  webhooks:\n    - {{ url: 'https://hooks.slack.com/services/T0/B0/SECRETPART', format: slack }}\n    - {{ url: env:AUTOHEDGE_TEST_SURELY_UNSET_HOOK, format: json }}\n  events: [endpoint_retired, endpoint_auth_failed, endpoint_unhealthy, all_failed]\n  all_failed: {{ count: 10, window: 1m }}\n"
        );
        let cfg = Config::load(&yaml).unwrap();
        let a = cfg.alerts.as_ref().unwrap();
        // The unset env: webhook is off with a warning; the other is kept.
        assert_eq!(a.webhooks.len(), 1);
        assert_eq!(a.webhooks[0].format, WebhookFormat::Slack);
        assert_eq!(a.webhooks[0].label, "https://hooks.slack.com");
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.contains("alerts.webhooks[1].url"))
        );
        assert_eq!(a.events.len(), 4);
        assert_eq!(
            (a.all_failed_count, a.all_failed_window),
            (10, Duration::from_secs(60))
        );
        let text = describe(&cfg);
        assert!(text.contains("https://hooks.slack.com slack"), "{text}");
        assert!(!text.contains("SECRETPART") && !format!("{a:?}").contains("SECRETPART"));
        // Errors name the place, never the URL.
        let bad = format!("{SEED}alerts:\n  webhooks:\n    - {{ url: 'ftp://x/SECRETPART' }}\n");
        let e = Config::load(&bad).unwrap_err().to_string();
        assert!(
            e.contains("alerts.webhooks[0].url") && !e.contains("SECRETPART"),
            "{e}"
        );
        let bad = format!("{SEED}alerts:\n  events: [endpoint_exploded]\n");
        let e = Config::load(&bad).unwrap_err().to_string();
        assert!(
            e.contains("alerts.events[0]") && e.contains("endpoint_retired"),
            "{e}"
        );
        let bad = format!("{SEED}alerts:\n  all_failed: {{ count: 1, window: 0 }}\n");
        assert!(Config::load(&bad).is_err());
    }

    #[test]
    fn chains_start_at_the_endpoint_and_wrap_the_fallback_chain() {
        let cfg = Config::load(
            "models:\n  a: {type: openai, base_url: 'http://127.0.0.1:1/v1', model: x}\n  b: {type: openai, base_url: 'http://127.0.0.1:2/v1', model: x}\n  c: {type: openai, base_url: 'http://127.0.0.1:3/v1', model: x}\n  d: {type: openai, base_url: 'http://127.0.0.1:4/v1', model: x}\nrouting_policy: {fallback_chain: [a, b, c]}\nroutes:\n  r: [c, a]\n",
        )
        .unwrap();
        let chain = |n: &str| cfg.chain_for(n).map(|c| c.to_vec());
        assert_eq!(chain("a").unwrap(), ["a", "b", "c"]);
        assert_eq!(chain("b").unwrap(), ["b", "c", "a"]);
        assert_eq!(chain("c").unwrap(), ["c", "a", "b"]);
        assert_eq!(chain("r").unwrap(), ["c", "a"]);
        // Not in the fallback chain: the endpoint, then the whole chain.
        assert_eq!(chain("d").unwrap(), ["d", "a", "b", "c"]);
        assert_eq!(chain("e"), None);
        // Every name a request may ask for, and no other.
        assert_eq!(
            cfg.chains.keys().map(String::as_str).collect::<Vec<_>>(),
            ["a", "b", "c", "d", "r"]
        );
    }

    #[test]
    fn loads_the_contract_shape() {
        let cfg = Config::load(SEED).unwrap();
        assert_eq!(cfg.fallback_chain, vec!["gpt-4o-mini", "qwen2.5-7b"]);
        let q = &cfg.endpoints["qwen2.5-7b"];
        assert_eq!(q.base_url, "http://127.0.0.1:11434");
        assert_eq!(q.timeouts.total, Duration::from_secs(3));
        assert_eq!(cfg.policy.cache_ttl, Duration::from_secs(300));
        assert_eq!(
            cfg.chain_for("chat").unwrap().to_vec(),
            vec!["gpt-4o-mini", "qwen2.5-7b"]
        );
        assert_eq!(
            cfg.chain_for("qwen2.5-7b").unwrap().to_vec(),
            vec!["qwen2.5-7b", "gpt-4o-mini"]
        );
        assert!(cfg.chain_for("nope").is_none());
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.contains("AUTOHEDGE_TEST_SURELY_UNSET"))
        );
    }

    /// Every byte-size key reads a number or a size string alike.
    #[test]
    fn byte_sizes_read_alike() {
        let m = "models:\n  a: {type: openai, base_url: 'http://127.0.0.1:1/v1', model: x}\n";
        let cfg = Config::load(&format!(
            "{m}server: {{ max_body_bytes: 2MiB, max_response_bytes: 16MiB }}\nlimits: {{ max_event_bytes: 64KiB }}\nresponses: {{ history_max_bytes: 1GiB }}\naudit: {{ store: postgres, url: 'postgres://u@127.0.0.1:5/d', spool_max_bytes: 512MiB }}\n"
        ))
        .unwrap();
        assert_eq!(cfg.max_body_bytes, 2 << 20);
        assert_eq!(cfg.max_response_bytes, 16 << 20);
        assert_eq!(cfg.max_event_bytes, 64 << 10);
        assert_eq!(cfg.responses.history_max_bytes, 1 << 30);
        assert_eq!(cfg.audit_pg.as_ref().unwrap().spool_max_bytes, 512 << 20);
        let plain = Config::load(&format!(
            "{m}server: {{ max_body_bytes: 1000, max_response_bytes: 2000 }}\nlimits: {{ max_event_bytes: 3000 }}\n"
        ))
        .unwrap();
        assert_eq!(
            (
                plain.max_body_bytes,
                plain.max_response_bytes,
                plain.max_event_bytes
            ),
            (1000, 2000, 3000)
        );
        let bad =
            Config::load(&format!("{m}server: {{ max_response_bytes: lots }}\n")).unwrap_err();
        assert!(bad.0.contains("max_response_bytes"), "{}", bad.0);
    }

    #[test]
    fn unknown_key_names_its_path() {
        let bad = SEED.replace("model: qwen2.5:7b", "model: qwen2.5:7b\n    bogus_key: 1");
        let err = Config::load(&bad).unwrap_err().0;
        assert!(err.contains("bogus_key"), "{err}");
        assert!(err.contains("models.qwen2.5-7b"), "{err}");
    }

    #[test]
    fn unknown_endpoint_in_chain_is_an_error() {
        let bad = SEED.replace(
            "chat: [gpt-4o-mini, qwen2.5-7b]",
            "chat: [gpt-4o-mini, nope]",
        );
        let err = Config::load(&bad).unwrap_err().0;
        assert!(
            err.contains("routes.chat[1]") && err.contains("nope"),
            "{err}"
        );
    }

    #[test]
    fn example_reference_loads() {
        let cfg = Config::load(include_str!("../../config/example.yaml")).unwrap();
        assert_eq!(cfg.fallback_chain.len(), 4);
        assert_eq!(
            cfg.endpoints["llama-vllm"].timeouts.total,
            Duration::from_secs(60)
        );
        assert_eq!(cfg.endpoints["gpt-4o-backup-keys"].keys.len(), 2);
    }

    #[test]
    fn embedded_default_loads() {
        let cfg = Config::load(EMBEDDED_DEFAULT).unwrap();
        assert!(!cfg.fallback_chain.is_empty());
    }

    #[test]
    fn describe_never_prints_key_values() {
        let text = SEED.replace(
            "api_key: env:AUTOHEDGE_TEST_SURELY_UNSET",
            "api_keys: [sk-literal-secret-123, file:/nonexistent/key]",
        );
        let cfg = Config::load(&text).unwrap();
        let out = describe(&cfg);
        assert!(!out.contains("sk-literal-secret-123"), "{out}");
        assert!(out.contains("literal"), "{out}");
        assert!(out.contains("file:/nonexistent/key"), "{out}");
    }
}

#[cfg(test)]
mod discovered_tests {
    use super::*;

    #[test]
    fn discovered_endpoints_join_the_table() {
        let text = "models:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\nrouting_policy: { fallback_chain: [a] }\ndocker: { enabled: true, adopt_unconfigured: true }\n";
        let d = vec![DiscoveredEndpoint {
            name: "extra".into(),
            kind: EndpointKind::Vllm,
            model: Some("m".into()),
        }];
        let cfg = Config::load_with(text, &d).unwrap();
        assert!(cfg.endpoints["extra"].discover);
        assert_eq!(cfg.fallback_chain, vec!["a", "extra"]);
        assert_eq!(cfg.discovered_extra, vec!["extra"]);
        // Without docker enabled, nothing is added.
        let cfg = Config::load_with(&text.replace("enabled: true", "enabled: false"), &d).unwrap();
        assert!(!cfg.endpoints.contains_key("extra"));
        // Labels are not trust: without adopt_unconfigured (the default), nothing is added.
        let cfg = Config::load_with(&text.replace(", adopt_unconfigured: true", ""), &d).unwrap();
        assert!(!cfg.endpoints.contains_key("extra"));
        assert!(cfg.discovered_extra.is_empty());
    }

    /// `balance:` as a name or a map; each wrong value named with where it is.
    #[test]
    fn balance_is_read_and_each_mistake_named() {
        let at = |b: &str| {
            format!(
                "models:\n  m:\n    type: vllm\n    base_urls: [\"http://127.0.0.1:9/v1\", \"http://127.0.0.1:10/v1\"]\n    balance: {b}\n"
            )
        };
        let d =
            Config::load("models:\n  m: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\n")
                .unwrap();
        assert_eq!(d.endpoints["m"].balance, Balance::default());
        // `random`: today's balance, no affinity unless asked for.
        let b = Config::load(&at("random")).unwrap().endpoints["m"].balance;
        assert!(b.random && !b.affinity);
        let b = Config::load(&at("{ strategy: random, affinity: prefix }"))
            .unwrap()
            .endpoints["m"]
            .balance;
        assert!(b.random && b.affinity);
        let b = Config::load(&at(
            "{ strategy: least_loaded, affinity: none, affinity_load: 2, max_ejection_percent: 34 }",
        ))
        .unwrap()
        .endpoints["m"]
            .balance;
        assert_eq!(
            b,
            Balance {
                random: false,
                affinity: false,
                affinity_load: 2.0,
                max_ejection_percent: 34.0
            }
        );
        for (bad, says) in [
            (
                "roundrobin",
                "models.m.balance`: `least_loaded` or `random`",
            ),
            ("{ strategy: 3 }", "models.m.balance.strategy`"),
            (
                "{ affinity: yes }",
                "models.m.balance.affinity`: `prefix` or `none`",
            ),
            (
                "{ affinity_load: 0.5 }",
                "models.m.balance.affinity_load`: a number from 1 to 100",
            ),
            ("{ affinity_load: .nan }", "models.m.balance.affinity_load`"),
            (
                "{ max_ejection_percent: 101 }",
                "models.m.balance.max_ejection_percent`",
            ),
            ("{ sticky: true }", "models.m.balance.sticky`: unknown key"),
            ("[1, 2]", "models.m.balance`"),
        ] {
            let e = Config::load(&at(bad))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn credential_headers_are_secrets_and_plain_ones_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "tok-from-file-9876\n").unwrap();
        let text = format!(
            "models:\n  a:\n    type: openai\n    base_url: http://127.0.0.1:9/v1\n    api_key: sk-literal-key-1234\n    headers:\n      Authorization: Bearer tok-literal-5555\n      OpenAI-Organization: org-plain\n      X-Gateway: file:{}\n      X-Api-Key: abcd-literal\n",
            token.display()
        );
        let cfg = Config::load(&text).unwrap();
        let mut secrets = cfg.endpoints["a"].secret_values();
        secrets.sort();
        assert_eq!(
            secrets,
            vec![
                "Bearer tok-literal-5555",
                "abcd-literal",
                "sk-literal-key-1234",
                "tok-from-file-9876",
                "tok-literal-5555",
            ]
        );
        // The values still go upstream as configured.
        let sent: Vec<(&str, &str)> = cfg.endpoints["a"]
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.expose()))
            .collect();
        assert!(
            sent.contains(&("X-Gateway", "tok-from-file-9876")),
            "{sent:?}"
        );
        assert!(
            sent.contains(&("OpenAI-Organization", "org-plain")),
            "{sent:?}"
        );
    }

    #[test]
    fn a_base_url_with_credentials_becomes_basic_auth_and_a_url_without_them() {
        use base64::Engine as _;
        let cfg = Config::load(
            "models:\n  a: { type: vllm, base_url: \"http://us%3Aer:p%40ss-word@127.0.0.1:9/v1/\" }\n",
        )
        .unwrap();
        let ep = &cfg.endpoints["a"];
        assert_eq!(ep.base_url, "http://127.0.0.1:9/v1");
        assert!(!ep.fingerprint.contains("p%40ss"), "{}", ep.fingerprint);
        let token = base64::engine::general_purpose::STANDARD.encode("us:er:p@ss-word");
        let auth: Vec<&str> = ep
            .headers
            .iter()
            .filter(|(k, _)| k == "authorization")
            .map(|(_, v)| v.expose())
            .collect();
        assert_eq!(auth, vec![format!("Basic {token}")]);
        let secrets = ep.secret_values();
        for s in [
            format!("Basic {token}").as_str(),
            token.as_str(),
            "p@ss-word",
        ] {
            assert!(secrets.contains(&s), "{s} in {secrets:?}");
        }
        assert!(!crate::config::describe::describe(&cfg).contains("p%40ss"));
        // Two ways to authenticate is a mistake, said without the values.
        for also in [
            ", api_key: sk-abcdef",
            ", headers: { Authorization: \"Bearer x\" }",
        ] {
            let e = Config::load(&format!(
                "models:\n  a: {{ type: vllm, base_url: \"http://u:secretpw@127.0.0.1:9/v1\"{also} }}\n"
            ))
            .unwrap_err()
            .0;
            assert!(e.contains("give one of them"), "{e}");
            assert!(!e.contains("secretpw") && !e.contains("sk-abcdef"), "{e}");
        }
    }

    #[test]
    fn parse_errors_never_echo_a_scalar() {
        let secret = "sk-live-NEVERSHOWN1234567890";
        for (text, path) in [
            (
                format!("models:\n  a:\n    type: openai\n    api_keys: {secret}\n"),
                "models.a.api_keys",
            ),
            (
                format!("models:\n  a:\n    type: {secret}\n"),
                "models.a.type",
            ),
            (
                format!("models:\n  a:\n    type: openai\n    context_window: {secret}\n"),
                "models.a.context_window",
            ),
            (
                format!("models:\n  a:\n    type: openai\n    timeout: {secret}\n"),
                "models.a.timeout",
            ),
            (
                format!("models:\n  a:\n    type: openai\n    retries: [\"{secret}\"]\n"),
                "models.a.retries",
            ),
            (
                format!(
                    "models:\n  a:\n    type: openai\n    base_url: \"https://u:{secret}@[::1\"\n"
                ),
                "models.a.base_url",
            ),
        ] {
            let e = Config::load(&text).unwrap_err().0;
            assert!(!e.contains(secret) && !e.contains("NEVERSHOWN"), "{e}");
            assert!(e.contains(path), "names the path: {e}");
        }
        let e = Config::load(&format!(
            "models:\n  a:\n    type: openai\n    api_keys: {secret}\n"
        ))
        .unwrap_err()
        .0;
        assert!(
            e.contains("expected a sequence"),
            "names the expected type: {e}"
        );
    }

    #[test]
    fn scrub_keeps_schema_names_and_hides_values() {
        assert_eq!(
            scrub_scalars("invalid type: string \"sk-1\\\"x\", expected a sequence"),
            "invalid type: string (value hidden), expected a sequence"
        );
        assert_eq!(
            scrub_scalars("unknown variant `sk-live`, expected one of `openai`, `vllm`"),
            "unknown variant (value hidden), expected one of `openai`, `vllm`"
        );
        assert_eq!(
            scrub_scalars("unknown field `bogus`, expected one of `type`, `model`"),
            "unknown field `bogus`, expected one of `type`, `model`"
        );
        assert_eq!(
            scrub_scalars("invalid type: integer `42`, expected a string"),
            "invalid type: integer (value hidden), expected a string"
        );
        assert_eq!(scrub_scalars("cut \"sk-unterminated"), "cut (value hidden)");
    }

    #[test]
    fn a_file_loaded_table_keeps_no_copy_of_its_literal_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        let secret = "sk-literal-in-the-file-0123456789";
        std::fs::write(
            &path,
            format!(
                "models:\n  a: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\", api_key: \"{secret}\", headers: {{ x-api-key: \"{secret}\" }} }}\n"
            ),
        )
        .unwrap();
        let cfg = Config::load_file(&path).unwrap();
        assert!(matches!(&cfg.source, Source::File(p) if *p == path));
        let shown = format!("{cfg:?}");
        assert!(!shown.contains(secret), "Debug shows the key");
        assert!(!shown.contains("sk-literal"), "Debug shows part of the key");
        // A rebuild reads the file again, and finds the key there.
        let again = cfg.rebuild_with(&[]).unwrap().unwrap();
        assert_eq!(again.source_digest, cfg.source_digest);
        assert_eq!(again.endpoints["a"].keys.len(), 1);
    }

    #[test]
    fn zero_front_door_timeouts_are_refused() {
        for key in ["header_timeout", "body_timeout", "send_timeout"] {
            let err = Config::load(&format!(
                "server: {{ {key}: 0 }}\nmodels:\n  a: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\" }}\n"
            ))
            .unwrap_err();
            assert_eq!(
                err.0,
                format!("at `server.{key}`: must be greater than zero"),
                "{key}"
            );
            Config::load(&format!(
                "server: {{ {key}: 250ms }}\nmodels:\n  a: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\" }}\n"
            ))
            .unwrap_or_else(|e| panic!("{key}: {}", e.0));
        }
    }

    #[test]
    fn flow_collections_nested_past_the_limit_are_refused_before_parsing() {
        // 100,000 levels took the YAML parser 15 s; refused at once, saying why.
        let deep = format!("models: {}", "[".repeat(100_000));
        let t0 = std::time::Instant::now();
        let err = Config::load(&deep).unwrap_err();
        assert!(err.0.contains("nested deeper than 256 levels"), "{}", err.0);
        // The text says the pre-scan refused it; the time says it did so before the parser
        // ran (15 s). Generous, for a debug build on a busy core: "at once", not "in 15 s".
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(raw::flow_depth(&"{".repeat(300)), 300);
        // Brackets in quoted scalars and comments are not nesting.
        let quoted = format!(
            "a: \"{b}\"\nb: '{b}'\nc: x # {b}\nd: [1, [2, {{e: 3}}]]\n",
            b = "[".repeat(1000)
        );
        assert_eq!(raw::flow_depth(&quoted), 3);
        // A real config nests a handful.
        assert!(raw::flow_depth(EMBEDDED_DEFAULT) < 8);
        assert!(raw::flow_depth(include_str!("../../config/example.yaml")) < 8);
    }

    #[test]
    fn a_config_file_that_never_ends_is_refused_not_read_whole() {
        let err = Config::load_file(Path::new("/dev/zero")).unwrap_err();
        assert!(err.0.contains("larger than 16777216 bytes"), "{}", err.0);
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "k".repeat(70_000)).unwrap();
        let err = read_text_bounded(&key, 64 * 1024).unwrap_err();
        assert!(err.to_string().contains("larger than 65536 bytes"), "{err}");
        std::fs::write(&key, "sk-small\n").unwrap();
        assert_eq!(read_text_bounded(&key, 64 * 1024).unwrap(), "sk-small\n");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        #[test]
        fn depth_scan_never_panics(text in "\\PC{0,300}") {
            let _ = raw::flow_depth(&text);
        }

        #[test]
        fn scrub_never_panics(msg in "\\PC{0,200}") {
            let _ = scrub_scalars(&msg);
        }

        #[test]
        fn arbitrary_config_text_never_panics(text in "\\PC{0,300}") {
            let _ = Config::load(&text);
        }

        #[test]
        fn config_errors_never_echo_a_planted_secret(
            key in "(models|server|routing_policy|health|docker|routes)",
            field in "[a-z_]{1,16}",
            shape in 0usize..4,
        ) {
            let secret = "sk-planted-SECRETVALUE42";
            let value = match shape {
                0 => secret.to_string(),
                1 => format!("[{secret}]"),
                2 => format!("{{ x: {secret} }}"),
                _ => format!("\"{secret}\""),
            };
            let text = format!("{key}:\n  {field}: {value}\nmodels:\n  m:\n    type: openai\n    api_key: {value}\n");
            if let Err(e) = Config::load(&text) {
                proptest::prop_assert!(!e.0.contains("SECRETVALUE"), "{}", e.0);
            }
        }
    }
}
