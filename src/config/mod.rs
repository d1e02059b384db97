//! The routing table: YAML parsed strictly into `Raw*` structs (unknown keys are errors that name
//! their path), then validated and resolved into the runtime [`Config`] that requests read from
//! one frozen snapshot. Everything that can fail happens in [`Config::load`]; swapping the result
//! in (see [`reload`]) cannot fail.

pub mod duration;
pub mod reload;

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    pub models: BTreeMap<String, RawEndpoint>,
    #[serde(default)]
    pub routing_policy: RawRoutingPolicy,
    #[serde(default)]
    pub routes: BTreeMap<String, RawRoute>,
    #[serde(default)]
    pub health: RawHealth,
    #[serde(default)]
    pub docker: RawDocker,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDocker {
    #[serde(default)]
    pub enabled: bool,
    pub interval: Option<Dur>,
    pub timeout: Option<Dur>,
    /// The network whose addresses tasks are reached at (default: the first non-ingress one).
    pub network: Option<String>,
    /// Only services and containers of this stack (`com.docker.stack.namespace`) are
    /// discovered or managed: labels are not trust.
    pub stack: Option<String>,
    /// A labelled service the config does not name becomes an endpoint only when true.
    #[serde(default)]
    pub adopt_unconfigured: bool,
    #[serde(default)]
    pub remediation: RawRemediation,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRemediation {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default)]
    pub dry_run: bool,
    pub unhealthy_after: Option<u32>,
    pub min_interval: Option<Dur>,
    #[serde(default)]
    pub manage: Vec<String>,
    #[serde(default)]
    pub standby: Vec<RawStandby>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStandby {
    /// The endpoint whose trouble brings the standby up.
    pub primary: String,
    /// The Swarm service scaled 0 -> 1 -> 0.
    pub service: String,
    pub healthy_for: Option<Dur>,
}

#[derive(Clone, Debug)]
pub struct Standby {
    pub primary: String,
    pub service: String,
    pub healthy_for: Duration,
}

#[derive(Clone, Debug)]
pub struct Remediation {
    pub enabled: bool,
    pub dry_run: bool,
    pub unhealthy_after: u32,
    pub min_interval: Duration,
    pub manage: Vec<String>,
    pub standby: Vec<Standby>,
}

#[derive(Clone, Debug)]
pub struct DockerConfig {
    pub enabled: bool,
    pub interval: Duration,
    pub timeout: Duration,
    pub network: Option<String>,
    pub stack: Option<String>,
    pub adopt_unconfigured: bool,
    pub remediation: Remediation,
}

/// A route: a plain chain (`chat: [a, b]`) or a chain with its own settings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawRoute {
    Chain(Vec<String>),
    Full(RawRouteFull),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRouteFull {
    pub chain: Vec<String>,
    pub on_context_overflow: Option<Overflow>,
}

/// What to do when no endpoint's context window holds a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Overflow {
    /// 400 in OpenAI's shape with the counted tokens and the largest window.
    Reject,
    /// Trim the conversation (see `tokens::truncate`) to fit the largest window.
    Truncate,
}

/// Characters some APIs reject, handled before forwarding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Hygiene {
    #[default]
    Off,
    Strip,
    Escape,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendTokenize {
    Vllm,
    Llamacpp,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTruncation {
    pub keep_turns: Option<usize>,
    pub omission_note: Option<bool>,
}

/// Background probing of the backends (read-only: what each server says about itself).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    /// How often each endpoint is probed (default 15s).
    pub probe_interval: Option<Dur>,
    /// Timeout of one probe request (default 2s).
    pub probe_timeout: Option<Dur>,
    /// Consecutive agreeing probe results before a state flips (default 2).
    pub flip_after: Option<u32>,
    /// How long a just-restarted backend is held out (default 3m).
    pub warmup: Option<Dur>,
    /// Consecutive live-traffic failures that eject an endpoint (default 5).
    pub eject_after: Option<u32>,
    /// First ejection time, doubled on each failed half-open probe (default 10s, at most eject_max).
    pub eject_base: Option<Dur>,
    pub eject_max: Option<Dur>,
    /// vLLM: more waiting requests than this → degraded (default 16).
    pub vllm_max_waiting: Option<f64>,
    /// vLLM: KV-cache usage above this share → degraded (default 0.95).
    pub vllm_max_kv_cache: Option<f64>,
}

#[derive(Clone, Copy, Debug)]
pub struct HealthPolicy {
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    pub vllm_max_waiting: f64,
    pub vllm_max_kv_cache: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<String>,
    pub max_body_bytes: Option<usize>,
    /// Capacity of the audit queue in records; a full queue drops records (counted), never stalls.
    pub audit_queue: Option<usize>,
    /// Audit rows older than this are deleted (hourly). Default 30d; 0 keeps everything.
    pub audit_retention: Option<Dur>,
    /// How long SIGTERM waits for in-flight requests before closing.
    pub shutdown_grace: Option<Dur>,
    /// A client must send its request headers within this (slowloris guard). Default 10s.
    pub header_timeout: Option<Dur>,
    /// A client must send its whole request body within this. Default 30s.
    pub body_timeout: Option<Dur>,
    /// Requests served at once; above it new ones get 503 `overloaded` at once. 0: unlimited.
    pub max_concurrent_requests: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointKind {
    Openai,
    Vllm,
    Ollama,
}

impl fmt::Display for EndpointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EndpointKind::Openai => "openai",
            EndpointKind::Vllm => "vllm",
            EndpointKind::Ollama => "ollama",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    Chat,
    Completions,
    Embeddings,
    Tools,
    Vision,
}

impl Capability {
    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// A set of capabilities as a bitmask: checked on every request, so no allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps(u8);

impl Caps {
    pub fn contains(self, c: Capability) -> bool {
        self.0 & c.bit() != 0
    }
    pub fn insert(&mut self, c: Capability) {
        self.0 |= c.bit();
    }
}

impl FromIterator<Capability> for Caps {
    fn from_iter<I: IntoIterator<Item = Capability>>(it: I) -> Self {
        let mut caps = Caps::default();
        for c in it {
            caps.insert(c);
        }
        caps
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEndpoint {
    #[serde(rename = "type")]
    pub kind: EndpointKind,
    pub base_url: Option<String>,
    /// Ollama users write `host`; it means the same as `base_url`.
    pub host: Option<String>,
    pub api_key: Option<String>,
    pub api_keys: Option<Vec<String>>,
    pub model: Option<String>,
    pub context_window: Option<u64>,
    pub max_tokens: Option<u64>,
    pub timeouts: Option<RawTimeouts>,
    /// Shorthand for `timeouts.total` (the seed configs' `timeout: 3`).
    pub timeout: Option<Dur>,
    pub capabilities: Option<Vec<Capability>>,
    /// Extra attempts on this same endpoint after a connect error, timeout or 5xx (default 0).
    pub retries: Option<u32>,
    pub retry_backoff: Option<Dur>,
    /// Cooldown after a 429 that carries no `Retry-After`.
    pub cooldown: Option<Dur>,
    pub cost: Option<RawCost>,
    /// A Hugging Face `tokenizer.json` for exact local counts (read from disk, never fetched).
    pub tokenizer: Option<String>,
    /// The tiktoken encoding (`o200k_base`, `cl100k_base`), when the model id does not tell.
    pub encoding: Option<String>,
    pub on_context_overflow: Option<Overflow>,
    /// `strip` or `escape` U+2028, U+2029 and control characters (except \n and \t) in message
    /// text before forwarding. Off by default.
    pub payload_hygiene: Option<Hygiene>,
    /// Ask the backend for an exact prompt count (`vllm`: POST /tokenize with the messages;
    /// `llamacpp`: POST /tokenize with the text), falling back to the local count.
    pub backend_tokenize: Option<BackendTokenize>,
    /// Timeout of that call (default 300ms).
    pub tokenize_timeout: Option<Dur>,
    /// Extra headers sent upstream (e.g. `OpenAI-Organization`). Values may use `env:`/`file:`.
    pub headers: Option<BTreeMap<String, String>>,
    /// A PEM file of extra CA certificates trusted for this endpoint (a private CA); the
    /// system's store and the bundled web roots are trusted too.
    pub ca_file: Option<String>,
    /// A custom health endpoint that replaces the type's default probe.
    pub health_check: Option<RawHealthCheck>,
    /// Opt-in: also send a real one-token completion each probe (bills one token per probe).
    pub semantic_probe: Option<bool>,
    /// `docker`: the address comes from Swarm services / containers labelled
    /// `autohedge.endpoint=<this name>` (see `docker:`).
    pub discover: Option<Discover>,
}

/// `health_check:` for services that report themselves as JSON, e.g.
/// `{"status":"healthy","gpu_memory_used_mb":4210,"kv_cache_size_mb":187,"uptime_seconds":3621}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    /// Absolute URL, or a path under the endpoint's root (`/health`).
    pub url: String,
    #[serde(default = "default_get")]
    pub method: String,
    pub timeout: Option<Dur>,
    /// Fields that must have these values (`status: healthy`).
    #[serde(default)]
    pub expect: BTreeMap<String, serde_json::Value>,
    /// GPU memory above 92% of this → degraded.
    pub gpu_memory_total_mb: Option<f64>,
    /// KV cache growing with no fall across this many probes → call `purge` once (default 5).
    pub kv_growth_probes: Option<usize>,
    pub purge: Option<RawHook>,
}

fn default_get() -> String {
    "GET".into()
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHook {
    pub url: String,
    #[serde(default = "default_post")]
    pub method: String,
}

fn default_post() -> String {
    "POST".into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Discover {
    Docker,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect: Option<Dur>,
    pub first_token: Option<Dur>,
    pub total: Option<Dur>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawCost {
    /// US dollars per million prompt tokens.
    #[serde(default)]
    pub input_per_mtok: f64,
    /// US dollars per million completion tokens.
    #[serde(default)]
    pub output_per_mtok: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoutingPolicy {
    #[serde(default)]
    pub fallback_chain: Vec<String>,
    pub success_threshold: Option<f64>,
    pub cache_ttl: Option<Dur>,
    pub max_wait: Option<Dur>,
    /// Length of the rolling window the success rate is computed over.
    pub window: Option<Dur>,
    /// Outcomes needed in the window before the success rate can demote an endpoint.
    pub min_samples: Option<u32>,
    pub default_cooldown: Option<Dur>,
    /// An endpoint is skipped when prompt + max_tokens exceed this share of its window.
    pub context_fill: Option<f64>,
    pub on_context_overflow: Option<Overflow>,
    pub truncation: Option<RawTruncation>,
    /// Upstream-supplied cooldowns (`Retry-After`, `x-ratelimit-reset-*`) are clamped to this.
    pub max_cooldown: Option<Dur>,
    /// Envoy's healthy-panic threshold: when fewer than this share of a chain's endpoints are
    /// available by health, health is ignored for the request.
    pub panic_threshold: Option<f64>,
    /// One deadline for the whole request: attempts, retries, backoff and `max_wait`.
    pub request_timeout: Option<Dur>,
}

/// Where an API key comes from. Only the source is ever printed; the value lives in [`Secret`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    Env(String),
    File(String),
    Literal,
}

impl KeySource {
    fn parse(spec: &str) -> KeySource {
        if let Some(name) = spec.strip_prefix("env:") {
            KeySource::Env(name.trim().to_string())
        } else if let Some(path) = spec.strip_prefix("file:") {
            KeySource::File(path.trim().to_string())
        } else {
            KeySource::Literal
        }
    }

    fn resolve(&self, spec: &str) -> Result<Secret, String> {
        match self {
            KeySource::Env(name) => match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => Ok(Secret(v.trim().to_string())),
                _ => Err(format!("environment variable {name} is not set")),
            },
            KeySource::File(path) => match std::fs::read_to_string(path) {
                Ok(v) if !v.trim().is_empty() => Ok(Secret(v.trim().to_string())),
                Ok(_) => Err(format!("key file {path} is empty")),
                Err(e) => Err(format!("key file {path} cannot be read: {e}")),
            },
            KeySource::Literal => Ok(Secret(spec.to_string())),
        }
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Env(n) => write!(f, "env:{n}"),
            KeySource::File(p) => write!(f, "file:{p}"),
            KeySource::Literal => f.write_str("literal (inline in the config)"),
        }
    }
}

/// A secret value. `Debug` and `Display` never show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Secret(value)
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Clone, Debug)]
pub struct ApiKey {
    pub source: KeySource,
    /// A hash of the value (never the value): a rejection is remembered against it, so
    /// replacing the value (file rewritten, env var changed) starts that key afresh.
    pub hash: String,
    /// `None` when the source could not be resolved; the reason is in `problem`.
    pub value: Option<Secret>,
    pub problem: Option<String>,
}

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_token: Duration,
    pub total: Duration,
}

/// One upstream endpoint, resolved.
#[derive(Debug)]
pub struct Endpoint {
    pub name: String,
    pub kind: EndpointKind,
    /// Root of the API without a trailing slash: `…/v1` for OpenAI-type servers, the bare host
    /// for Ollama.
    pub base_url: String,
    pub upstream_model: String,
    pub keys: Vec<ApiKey>,
    pub context_window: Option<u64>,
    pub max_tokens: Option<u64>,
    pub timeouts: Timeouts,
    pub capabilities: BTreeSet<Capability>,
    pub caps: Caps,
    pub retries: u32,
    pub retry_backoff: Duration,
    pub cooldown: Option<Duration>,
    pub cost: RawCost,
    pub headers: Vec<(String, String)>,
    pub counter: crate::tokens::Counter,
    pub on_context_overflow: Option<Overflow>,
    pub payload_hygiene: Hygiene,
    pub backend_tokenize: Option<(BackendTokenize, Duration)>,
    /// Counts the backend gave, by a hash of the body (bounded; cleared when full).
    pub tokenize_cache: std::sync::Mutex<std::collections::HashMap<u64, u64>>,
    /// The address is resolved by Docker discovery.
    pub discover: bool,
    pub health_check: Option<RawHealthCheck>,
    pub semantic_probe: bool,
    /// Changes whenever what this endpoint *is* changes (URL, model, type, keys). A retirement is
    /// stored with the fingerprint it was made under and lifted when the config changes it.
    pub fingerprint: String,
    /// The HTTP client for this endpoint (its own connect timeout).
    pub client: reqwest::Client,
    /// Upstream URL per operation (indexed by `Op as usize`), parsed once per load.
    pub urls: [reqwest::Url; 3],
}

impl Endpoint {
    pub fn usable_keys(&self) -> usize {
        self.keys.iter().filter(|k| k.value.is_some()).count()
    }
    pub fn needs_key(&self) -> bool {
        !self.keys.is_empty()
    }
}

#[derive(Clone, Debug)]
pub struct Policy {
    pub success_threshold: f64,
    pub cache_ttl: Duration,
    pub max_wait: Duration,
    pub window: Duration,
    pub min_samples: u32,
    pub default_cooldown: Duration,
    pub context_fill: f64,
    pub on_context_overflow: Overflow,
    pub truncation: crate::tokens::truncate::Options,
    pub health: crate::health::Thresholds,
    pub max_cooldown: Duration,
    pub panic_threshold: f64,
    pub request_timeout: Duration,
}

/// The runtime routing table. Requests hold an `Arc<Config>` for their whole life.
#[derive(Debug)]
pub struct Config {
    pub listen: String,
    pub max_body_bytes: usize,
    pub audit_queue: usize,
    /// `None`: keep the audit trail forever.
    pub audit_retention: Option<Duration>,
    pub shutdown_grace: Duration,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    /// 0: unlimited.
    pub max_concurrent_requests: usize,
    pub endpoints: BTreeMap<String, Arc<Endpoint>>,
    pub fallback_chain: Vec<String>,
    pub routes: BTreeMap<String, Vec<String>>,
    /// Per-route overflow settings (routes written in the long form).
    pub route_overflow: BTreeMap<String, Overflow>,
    pub policy: Policy,
    pub health: HealthPolicy,
    pub docker: DockerConfig,
    /// The YAML text this table was built from (to rebuild it when discovery changes).
    pub source: String,
    /// Endpoints that exist because Docker discovery found them, not because the file names them.
    pub discovered_extra: Vec<String>,
    /// Problems that do not stop the gateway (an unset `env:` key) — reported at start.
    pub warnings: Vec<String>,
}

/// A labelled service or container Docker discovery found that the config file does not name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredEndpoint {
    pub name: String,
    pub kind: EndpointKind,
    pub model: Option<String>,
}

/// A config error that says where it is.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl Config {
    /// Reads and loads a config file.
    pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
        Config::load_file_with(path, &[])
    }

    pub fn load_file_with(
        path: &Path,
        discovered: &[DiscoveredEndpoint],
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        Config::load_with(&text, discovered)
            .map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses, validates and resolves a config text.
    pub fn load(text: &str) -> Result<Config, ConfigError> {
        Config::load_with(text, &[])
    }

    /// Like `load`, plus endpoints Docker discovery found that the file does not name: each is
    /// added with `discover: docker` and appended to the fallback chain (when docker is on).
    pub fn load_with(text: &str, discovered: &[DiscoveredEndpoint]) -> Result<Config, ConfigError> {
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
        let mut cfg = build(raw)?;
        cfg.source = text.to_string();
        cfg.discovered_extra = extra;
        Ok(cfg)
    }

    /// The chain a requested model name resolves to, or `None` (404 `model_not_found`).
    pub fn chain_for(&self, requested: &str) -> Option<Vec<String>> {
        if let Some(route) = self.routes.get(requested) {
            return Some(route.clone());
        }
        if self.endpoints.contains_key(requested) {
            // Start at the named endpoint, then continue along the fallback chain.
            let mut chain = vec![requested.to_string()];
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
            return Some(chain);
        }
        None
    }
}

pub fn parse(text: &str) -> Result<RawConfig, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = scrub_scalars(&e.into_inner().to_string());
        if path == "." || path.is_empty() {
            ConfigError(inner)
        } else {
            ConfigError(format!("at `{path}`: {inner}"))
        }
    })
}

/// Removes every scalar of the file from a parse error, keeping the path and the expected type.
/// serde echoes the offending value (`invalid type: string "sk-…", expected a sequence`), and
/// that value is often a key written where a list belongs: the error goes to the log, `/status`
/// and `check-config`, so it must never carry it.
pub fn scrub_scalars(msg: &str) -> String {
    const HIDDEN: &str = "(value hidden)";
    // serde quotes the file's values — `string "…"`, `integer `…``, `unknown variant `…`` — and
    // the schema's names: `unknown field `…``, `expected one of `…`, `…``. Keep only the latter.
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(i) = rest.find(['"', '`']) {
        out.push_str(&rest[..i]);
        let quoted = &rest[i..];
        let backtick = quoted.starts_with('`');
        let inner = &quoted[1..];
        let close = if backtick {
            inner.find('`')
        } else {
            closing_quote(inner)
        };
        let Some(close) = close else {
            out.push_str(HIDDEN);
            return out;
        };
        let schema_name = backtick && (out.ends_with("unknown field ") || out.contains("expected"));
        if schema_name {
            out.push_str(&quoted[..close + 2]);
        } else {
            out.push_str(HIDDEN);
        }
        rest = &inner[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The byte index of the first `"` in `s` not escaped by a backslash.
fn closing_quote(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

/// The TLS settings upstream clients share: the bundled web roots plus the system's CA store,
/// built once per process (loading the system store per client would cost every reload tens of
/// milliseconds per endpoint). `extra_pem` (an endpoint's `ca_file`) gets its own config.
fn tls_config(extra_pem: Option<&[u8]>) -> Result<rustls::ClientConfig, String> {
    use std::sync::LazyLock;
    static ROOTS: LazyLock<Arc<rustls::RootCertStore>> = LazyLock::new(|| {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            tracing::debug!(error = %e, "system CA store: entry skipped");
        }
        let (added, _) = roots.add_parsable_certificates(native.certs);
        tracing::debug!(added, "system CA certificates trusted");
        Arc::new(roots)
    });
    let roots = match extra_pem {
        None => ROOTS.clone(),
        Some(pem) => {
            use rustls::pki_types::pem::PemObject;
            let mut roots = (**ROOTS).clone();
            let mut n = 0;
            for cert in rustls::pki_types::CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|_| "not a PEM certificate bundle".to_string())?;
                roots
                    .add(cert)
                    .map_err(|e| format!("certificate rejected: {e}"))?;
                n += 1;
            }
            if n == 0 {
                return Err("holds no PEM certificate".into());
            }
            Arc::new(roots)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A configured duration, or its default.
fn or_default(v: Option<Dur>, default: Duration) -> Duration {
    v.map_or(default, |d| d.0)
}

/// A short, stable hash of a secret's value: enough to tell values apart, useless to recover one.
fn value_hash(v: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(v.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn default_timeouts(kind: EndpointKind) -> Timeouts {
    // Local servers load models lazily: their first token can take far longer than a cloud's.
    match kind {
        EndpointKind::Openai => Timeouts {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(10),
            total: Duration::from_secs(120),
        },
        EndpointKind::Vllm | EndpointKind::Ollama => Timeouts {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(30),
            total: Duration::from_secs(300),
        },
    }
}

fn default_capabilities(kind: EndpointKind) -> BTreeSet<Capability> {
    use Capability::*;
    match kind {
        EndpointKind::Openai => [Chat, Completions, Embeddings, Tools, Vision].into(),
        // Vision depends on the model a local server runs: opt in with `capabilities:`.
        EndpointKind::Vllm | EndpointKind::Ollama => [Chat, Completions, Embeddings, Tools].into(),
    }
}

fn build(raw: RawConfig) -> Result<Config, ConfigError> {
    let mut warnings = Vec::new();
    if raw.models.is_empty() {
        return Err(ConfigError(
            "at `models`: at least one endpoint is required".into(),
        ));
    }
    let mut endpoints = BTreeMap::new();
    for (name, ep) in raw.models {
        let at = format!("models.{name}");
        let base = match (ep.base_url, ep.host) {
            (Some(_), Some(_)) => {
                return Err(ConfigError(format!(
                    "at `{at}`: give either `base_url` or `host` (its alias), not both"
                )));
            }
            (Some(u), None) | (None, Some(u)) => u,
            (None, None) if ep.discover.is_some() => "http://discovered.invalid".to_string(),
            (None, None) => match ep.kind {
                EndpointKind::Ollama => "http://127.0.0.1:11434".to_string(),
                EndpointKind::Vllm => "http://127.0.0.1:8000/v1".to_string(),
                EndpointKind::Openai => "https://api.openai.com/v1".to_string(),
            },
        };
        let base_url = base.trim_end_matches('/').to_string();
        // The URL is not echoed: it may carry credentials (`https://user:pass@host`).
        let parsed = reqwest::Url::parse(&base_url)
            .map_err(|e| ConfigError(format!("at `{at}.base_url`: invalid URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(ConfigError(format!(
                "at `{at}.base_url`: scheme must be http or https"
            )));
        }
        let specs: Vec<String> = match (ep.api_key, ep.api_keys) {
            (Some(_), Some(_)) => {
                return Err(ConfigError(format!(
                    "at `{at}`: give either `api_key` or `api_keys`, not both"
                )));
            }
            (Some(k), None) => vec![k],
            (None, Some(ks)) => ks,
            (None, None) => vec![],
        };
        let mut keys = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let source = KeySource::parse(spec);
            match source.resolve(spec) {
                Ok(v) => keys.push(ApiKey {
                    source,
                    hash: value_hash(v.expose()),
                    value: Some(v),
                    problem: None,
                }),
                Err(problem) => {
                    warnings.push(format!("{at}: api key #{} ({source}): {problem}", i + 1));
                    keys.push(ApiKey {
                        source,
                        hash: String::new(),
                        value: None,
                        problem: Some(problem),
                    });
                }
            }
        }
        let mut timeouts = default_timeouts(ep.kind);
        if let Some(t) = ep.timeout {
            timeouts.total = t.0;
        }
        if let Some(t) = ep.timeouts {
            if let Some(v) = t.connect {
                timeouts.connect = v.0;
            }
            if let Some(v) = t.first_token {
                timeouts.first_token = v.0;
            }
            if let Some(v) = t.total {
                timeouts.total = v.0;
            }
        }
        for (what, d) in [
            ("connect", timeouts.connect),
            ("first_token", timeouts.first_token),
            ("total", timeouts.total),
        ] {
            if d.is_zero() {
                return Err(ConfigError(format!(
                    "at `{at}.timeouts.{what}`: must be greater than zero"
                )));
            }
        }
        if let Some(0) = ep.context_window {
            return Err(ConfigError(format!(
                "at `{at}.context_window`: must be greater than zero"
            )));
        }
        let mut headers = Vec::new();
        for (k, v) in ep.headers.unwrap_or_default() {
            if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
                return Err(ConfigError(format!(
                    "at `{at}.headers`: invalid header name {k:?}"
                )));
            }
            let source = KeySource::parse(&v);
            let value = match source {
                KeySource::Literal => v.clone(),
                _ => match source.resolve(&v) {
                    Ok(s) => s.expose().to_string(),
                    Err(problem) => {
                        warnings.push(format!("{at}.headers.{k}: {problem}"));
                        continue;
                    }
                },
            };
            headers.push((k, value));
        }
        let upstream_model = ep.model.unwrap_or_else(|| name.clone());
        // What the endpoint *is*: a retirement (410) is about the model at this address, not
        // about the key, so keys are tracked separately (by value hash, see `ApiKey::hash`).
        let fingerprint = format!("{}|{}|{}", ep.kind, base_url, upstream_model);
        let tls = match &ep.ca_file {
            None => tls_config(None).map_err(|e| ConfigError(format!("at `{at}`: {e}")))?,
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    ConfigError(format!("at `{at}.ca_file`: cannot read {path}: {e}"))
                })?;
                tls_config(Some(&pem))
                    .map_err(|e| ConfigError(format!("at `{at}.ca_file`: {path}: {e}")))?
            }
        };
        let client = reqwest::Client::builder().use_preconfigured_tls(tls);
        let client = client
            .connect_timeout(timeouts.connect)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ConfigError(format!("at `{at}`: cannot build HTTP client: {e}")))?;
        let counter = match (&ep.tokenizer, &ep.encoding) {
            (Some(path), _) => {
                let path = std::path::PathBuf::from(path);
                let tok = crate::tokens::load_hf(&path)
                    .map_err(|e| ConfigError(format!("at `{at}.tokenizer`: {e}")))?;
                crate::tokens::Counter::Hf { path, tok }
            }
            (None, Some(enc)) => match enc.as_str() {
                "o200k_base" => crate::tokens::Counter::Tiktoken(crate::tokens::Family::O200k),
                "cl100k_base" => crate::tokens::Counter::Tiktoken(crate::tokens::Family::Cl100k),
                other => {
                    return Err(ConfigError(format!(
                        "at `{at}.encoding`: unknown encoding {other:?} (o200k_base or cl100k_base)"
                    )));
                }
            },
            (None, None) => match crate::tokens::family_for_model(&upstream_model) {
                Some(f) => crate::tokens::Counter::Tiktoken(f),
                None => crate::tokens::Counter::Estimate,
            },
        };
        let mut urls = Vec::with_capacity(3);
        for op in crate::wire::Op::ALL {
            let u = crate::upstream::url_for(ep.kind, &base_url, op);
            urls.push(
                reqwest::Url::parse(&u)
                    .map_err(|e| ConfigError(format!("at `{at}.base_url`: invalid URL: {e}")))?,
            );
        }
        let urls: [reqwest::Url; 3] = urls
            .try_into()
            .map_err(|_| ConfigError(format!("at `{at}`: internal URL table error")))?;
        let capabilities: BTreeSet<Capability> = ep
            .capabilities
            .map(|c| c.into_iter().collect())
            .unwrap_or_else(|| default_capabilities(ep.kind));
        endpoints.insert(
            name.clone(),
            Arc::new(Endpoint {
                name: name.clone(),
                kind: ep.kind,
                base_url,
                upstream_model,
                keys,
                context_window: ep.context_window,
                max_tokens: ep.max_tokens,
                timeouts,
                caps: capabilities.iter().copied().collect(),
                capabilities,
                retries: ep.retries.unwrap_or(0),
                retry_backoff: or_default(ep.retry_backoff, Duration::from_millis(100)),
                cooldown: ep.cooldown.map(|d| d.0),
                cost: ep.cost.unwrap_or_default(),
                headers,
                fingerprint,
                client,
                urls,
                counter,
                on_context_overflow: ep.on_context_overflow,
                payload_hygiene: ep.payload_hygiene.unwrap_or_default(),
                backend_tokenize: ep.backend_tokenize.map(|b| {
                    (
                        b,
                        or_default(ep.tokenize_timeout, Duration::from_millis(300)),
                    )
                }),
                tokenize_cache: Default::default(),
                discover: ep.discover.is_some(),
                health_check: ep.health_check,
                semantic_probe: ep.semantic_probe.unwrap_or(false),
            }),
        );
    }

    let p = raw.routing_policy;
    let mut fallback_chain = p.fallback_chain;
    if fallback_chain.is_empty() {
        // No chain given: every endpoint, in name order, so the gateway still fails over.
        fallback_chain = endpoints.keys().cloned().collect();
    }
    check_chain("routing_policy.fallback_chain", &fallback_chain, &endpoints)?;
    let mut routes = BTreeMap::new();
    let mut route_overflow = BTreeMap::new();
    for (route, r) in raw.routes {
        match r {
            RawRoute::Chain(c) => {
                routes.insert(route, c);
            }
            RawRoute::Full(f) => {
                if let Some(o) = f.on_context_overflow {
                    route_overflow.insert(route.clone(), o);
                }
                routes.insert(route, f.chain);
            }
        }
    }
    for (route, chain) in &routes {
        if endpoints.contains_key(route) {
            return Err(ConfigError(format!(
                "at `routes.{route}`: the route name is also an endpoint name; a request for it would be ambiguous"
            )));
        }
        if chain.is_empty() {
            return Err(ConfigError(format!(
                "at `routes.{route}`: the chain is empty"
            )));
        }
        check_chain(&format!("routes.{route}"), chain, &endpoints)?;
    }
    let success_threshold = p.success_threshold.unwrap_or(0.85);
    if !(0.0..=1.0).contains(&success_threshold) {
        return Err(ConfigError(
            "at `routing_policy.success_threshold`: must be between 0 and 1".into(),
        ));
    }
    let policy = Policy {
        success_threshold,
        cache_ttl: or_default(p.cache_ttl, Duration::from_secs(300)),
        max_wait: or_default(p.max_wait, Duration::ZERO),
        window: or_default(p.window, Duration::from_secs(300)),
        min_samples: p.min_samples.unwrap_or(10),
        default_cooldown: or_default(p.default_cooldown, Duration::from_secs(30)),
        context_fill: p.context_fill.unwrap_or(0.95),
        on_context_overflow: p.on_context_overflow.unwrap_or(Overflow::Reject),
        truncation: crate::tokens::truncate::Options {
            keep_turns: p.truncation.and_then(|t| t.keep_turns).unwrap_or(2),
            note: p.truncation.and_then(|t| t.omission_note).unwrap_or(true),
        },
        // Filled from `health:` below.
        health: crate::health::Thresholds::default(),
        max_cooldown: or_default(p.max_cooldown, Duration::from_secs(600)),
        panic_threshold: p.panic_threshold.unwrap_or(0.5),
        request_timeout: or_default(p.request_timeout, Duration::from_secs(300)),
    };
    if !(0.0..=1.0).contains(&policy.panic_threshold) {
        return Err(ConfigError(
            "at `routing_policy.panic_threshold`: must be between 0 and 1".into(),
        ));
    }
    if policy.request_timeout.is_zero() {
        return Err(ConfigError(
            "at `routing_policy.request_timeout`: must be greater than zero".into(),
        ));
    }
    if !(policy.context_fill > 0.0 && policy.context_fill <= 1.0) {
        return Err(ConfigError(
            "at `routing_policy.context_fill`: must be in (0, 1]".into(),
        ));
    }
    if policy.window.is_zero() {
        return Err(ConfigError(
            "at `routing_policy.window`: must be greater than zero".into(),
        ));
    }
    let rh = &raw.health;
    let thresholds = crate::health::Thresholds {
        flip_after: rh.flip_after.unwrap_or(2).max(1),
        warmup: or_default(rh.warmup, Duration::from_secs(180)),
        eject_after: rh.eject_after.unwrap_or(5).max(1),
        eject_base: or_default(rh.eject_base, Duration::from_secs(10)),
        eject_max: or_default(rh.eject_max, Duration::from_secs(300)),
    };
    let rd = raw.docker;
    let docker = DockerConfig {
        enabled: rd.enabled,
        interval: or_default(rd.interval, Duration::from_secs(5)).max(Duration::from_millis(200)),
        timeout: or_default(rd.timeout, Duration::from_secs(5)),
        network: rd.network,
        stack: rd.stack,
        adopt_unconfigured: rd.adopt_unconfigured,
        remediation: Remediation {
            enabled: rd.remediation.enabled,
            dry_run: rd.remediation.dry_run,
            unhealthy_after: rd.remediation.unhealthy_after.unwrap_or(3).max(1),
            min_interval: or_default(rd.remediation.min_interval, Duration::from_secs(60)),
            manage: rd.remediation.manage,
            standby: rd
                .remediation
                .standby
                .into_iter()
                .map(|s| Standby {
                    primary: s.primary,
                    service: s.service,
                    healthy_for: or_default(s.healthy_for, Duration::from_secs(60)),
                })
                .collect(),
        },
    };
    for (i, sb) in docker.remediation.standby.iter().enumerate() {
        if !endpoints.contains_key(&sb.primary) {
            return Err(ConfigError(format!(
                "at `docker.remediation.standby[{i}].primary`: unknown endpoint {:?}",
                sb.primary
            )));
        }
    }
    if let Some(ep) = endpoints.values().find(|e| e.discover)
        && !docker.enabled
    {
        return Err(ConfigError(format!(
            "at `models.{}.discover`: discovery needs `docker: {{ enabled: true }}`",
            ep.name
        )));
    }
    let health = HealthPolicy {
        probe_interval: or_default(raw.health.probe_interval, Duration::from_secs(15))
            .max(Duration::from_millis(100)),
        probe_timeout: or_default(raw.health.probe_timeout, Duration::from_secs(2)),
        vllm_max_waiting: raw.health.vllm_max_waiting.unwrap_or(16.0),
        vllm_max_kv_cache: raw.health.vllm_max_kv_cache.unwrap_or(0.95),
    };
    let listen = raw
        .server
        .listen
        .unwrap_or_else(|| "127.0.0.1:8000".to_string());
    Ok(Config {
        listen,
        max_body_bytes: raw.server.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY),
        audit_queue: raw.server.audit_queue.unwrap_or(10_000).max(1),
        audit_retention: match raw.server.audit_retention {
            Some(d) if d.0.is_zero() => None,
            Some(d) => Some(d.0),
            None => Some(Duration::from_secs(30 * 86_400)),
        },
        shutdown_grace: or_default(raw.server.shutdown_grace, Duration::from_secs(30)),
        header_timeout: or_default(raw.server.header_timeout, Duration::from_secs(10)),
        body_timeout: or_default(raw.server.body_timeout, Duration::from_secs(30)),
        max_concurrent_requests: raw.server.max_concurrent_requests.unwrap_or(0),
        endpoints,
        fallback_chain,
        routes,
        route_overflow,
        policy: Policy {
            health: thresholds,
            ..policy
        },
        health,
        docker,
        source: String::new(),
        discovered_extra: Vec::new(),
        warnings,
    })
}

fn check_chain(
    at: &str,
    chain: &[String],
    endpoints: &BTreeMap<String, Arc<Endpoint>>,
) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for (i, name) in chain.iter().enumerate() {
        if !endpoints.contains_key(name) {
            return Err(ConfigError(format!(
                "at `{at}[{i}]`: unknown endpoint {name:?} (defined under `models`: {})",
                endpoints.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        if !seen.insert(name) {
            return Err(ConfigError(format!(
                "at `{at}[{i}]`: {name:?} is listed twice"
            )));
        }
    }
    Ok(())
}

/// A printable summary for `check-config`: chains, endpoints and key *sources*, never values.
pub fn describe(cfg: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "listen: {}", cfg.listen);
    let _ = writeln!(out, "fallback_chain: {}", cfg.fallback_chain.join(" -> "));
    for (name, chain) in &cfg.routes {
        let _ = writeln!(out, "route {name}: {}", chain.join(" -> "));
    }
    let _ = writeln!(
        out,
        "policy: success_threshold={} window={:?} min_samples={} max_wait={:?} cache_ttl={:?} default_cooldown={:?}",
        cfg.policy.success_threshold,
        cfg.policy.window,
        cfg.policy.min_samples,
        cfg.policy.max_wait,
        cfg.policy.cache_ttl,
        cfg.policy.default_cooldown
    );
    let _ = writeln!(out, "endpoints:");
    for ep in cfg.endpoints.values() {
        let caps: Vec<String> = ep
            .capabilities
            .iter()
            .map(|c| format!("{c:?}").to_lowercase())
            .collect();
        let _ = writeln!(
            out,
            "  {}: type={} url={} model={} context_window={} timeouts(connect={:?}, first_token={:?}, total={:?}) retries={} capabilities=[{}]",
            ep.name,
            ep.kind,
            ep.base_url,
            ep.upstream_model,
            ep.context_window
                .map(|c| c.to_string())
                .unwrap_or_else(|| "unknown".into()),
            ep.timeouts.connect,
            ep.timeouts.first_token,
            ep.timeouts.total,
            ep.retries,
            caps.join(",")
        );
        if ep.keys.is_empty() {
            let _ = writeln!(out, "    keys: none");
        }
        for (i, k) in ep.keys.iter().enumerate() {
            let state = match &k.problem {
                None => "ok".to_string(),
                Some(p) => format!("UNRESOLVED: {p}"),
            };
            let _ = writeln!(out, "    key #{}: {} ({state})", i + 1, k.source);
        }
    }
    for w in &cfg.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
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
    fn loads_the_contract_shape() {
        let cfg = Config::load(SEED).unwrap();
        assert_eq!(cfg.fallback_chain, vec!["gpt-4o-mini", "qwen2.5-7b"]);
        let q = &cfg.endpoints["qwen2.5-7b"];
        assert_eq!(q.base_url, "http://127.0.0.1:11434");
        assert_eq!(q.timeouts.total, Duration::from_secs(3));
        assert_eq!(cfg.policy.cache_ttl, Duration::from_secs(300));
        assert_eq!(
            cfg.chain_for("chat").unwrap(),
            vec!["gpt-4o-mini", "qwen2.5-7b"]
        );
        assert_eq!(
            cfg.chain_for("qwen2.5-7b").unwrap(),
            vec!["qwen2.5-7b", "gpt-4o-mini"]
        );
        assert!(cfg.chain_for("nope").is_none());
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.contains("AUTOHEDGE_TEST_SURELY_UNSET"))
        );
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
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
