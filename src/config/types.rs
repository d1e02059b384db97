//! The runtime routing table that requests read: resolved, validated, immutable once built.
//! Requests hold an `Arc<Config>` for their whole life.

use super::*;
use crate::op::Op;

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

#[derive(Clone, Copy, Debug)]
pub struct HealthPolicy {
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    pub vllm_max_waiting: f64,
    pub vllm_max_kv_cache: f64,
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
    /// Continues a final assistant message (vLLM's `continue_final_message`; llama.cpp's
    /// server continues one by itself): a broken stream may be carried on here.
    Continue,
    /// Speaks OpenAI's Responses API (`/responses`): `/v1/responses` passes through. Without it
    /// (or once the endpoint answered 404 for `/responses`) the gateway translates to chat.
    Responses,
}

impl Capability {
    /// The capability an operation needs.
    pub fn of(op: Op) -> Capability {
        match op {
            Op::Chat => Capability::Chat,
            Op::Completions => Capability::Completions,
            Op::Embeddings => Capability::Embeddings,
            // Any endpoint that chats can answer a Responses request (by translation).
            Op::Responses => Capability::Chat,
        }
    }

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

/// `audit:` with `store: postgres`, resolved.
#[derive(Clone)]
pub struct PgSettings {
    pub url: Secret,
    /// The URL without its password: what logs and `/status` show.
    pub display: String,
    pub pool: usize,
    /// The most the spool in the data dir holds while the store is away (bytes).
    pub spool_max_bytes: u64,
}

impl std::fmt::Debug for PgSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSettings")
            .field("store", &self.display)
            .field("pool", &self.pool)
            .finish()
    }
}

/// `responses:` resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponsesSettings {
    /// `history: keep`: every response's items are kept (not `store: false` ones).
    pub keep_history: bool,
    pub history_ttl: Duration,
    pub history_max_bytes: u64,
    /// One client key's share of `history_max_bytes` (default a quarter of it).
    pub history_max_bytes_per_key: u64,
}

/// What the kept `/v1/responses` turns may take: for how long, in all, and one client key's
/// share of it (in memory and in the shared store alike).
#[derive(Clone, Copy, Debug)]
pub struct HistoryBounds {
    pub ttl: Duration,
    pub max_bytes: u64,
    pub max_bytes_per_key: u64,
}

impl ResponsesSettings {
    /// The bounds of what is kept, in memory and in the shared store alike.
    pub fn bounds(&self) -> HistoryBounds {
        HistoryBounds {
            ttl: self.history_ttl,
            max_bytes: self.history_max_bytes,
            max_bytes_per_key: self.history_max_bytes_per_key,
        }
    }
}

impl Default for ResponsesSettings {
    fn default() -> Self {
        ResponsesSettings {
            keep_history: false,
            history_ttl: Duration::from_secs(3600),
            history_max_bytes: 256 << 20,
            history_max_bytes_per_key: 64 << 20,
        }
    }
}

/// Where an API key comes from. Only the source is ever printed; the value lives in [`Secret`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    Env(String),
    File(String),
    /// `vault:MOUNT/PATH#FIELD`, read when the config is loaded.
    Vault(crate::config::vault::Ref),
    Literal,
}

/// Secrets read from Vault for one config load.
pub type Fetched = std::collections::HashMap<crate::config::vault::Ref, zeroize::Zeroizing<String>>;

impl KeySource {
    pub(super) fn parse(spec: &str) -> KeySource {
        if let Some(name) = spec.strip_prefix("env:") {
            KeySource::Env(name.trim().to_string())
        } else if let Some(path) = spec.strip_prefix("file:") {
            KeySource::File(path.trim().to_string())
        } else if let Some(r) = spec
            .strip_prefix("vault:")
            .and_then(|r| crate::config::vault::Ref::parse(r).ok())
        {
            KeySource::Vault(r)
        } else {
            KeySource::Literal
        }
    }

    pub(super) fn resolve(&self, spec: &str, fetched: &Fetched) -> Result<Secret, String> {
        match self {
            KeySource::Vault(r) => fetched
                .get(r)
                .map(|v| Secret(v.as_str().to_string()))
                .ok_or_else(|| format!("{r} was not read (no `vault:` section?)")),
            KeySource::Env(name) => match std::env::var(name) {
                Ok(v) if !v.trim().is_empty() => Ok(Secret(v.trim().to_string())),
                _ => Err(format!("environment variable {name} is not set")),
            },
            // A key is a few hundred bytes; a path to something endless must not be read whole.
            KeySource::File(path) => match super::read_text_bounded(path.as_ref(), 64 * 1024) {
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
            KeySource::Vault(r) => write!(f, "{r}"),
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

/// A key's bytes are wiped when the last copy is dropped (a reload, a request's own key).
impl Drop for Secret {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
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

/// A plain-`http` endpoint's own HTTP/1.1 connections ([`crate::upstream::h1pool`]): what its requests
/// go over, with the operations' paths in origin form and the `Host` header they carry (hyper
/// writes a request as it is given).
#[derive(Debug)]
pub struct Plain {
    pub pool: PlainPool,
    pub paths: [http::Uri; Op::ALL.len()],
    pub host: http::HeaderValue,
}

pub type PlainPool = crate::upstream::h1pool::H1Pool<TimedConnector>;

/// hyper-util's pooled client over rustls: what requests to `https` upstreams are sent with.
pub type DirectClient =
    hyper_util::client::legacy::Client<TimedConnector, http_body_util::Full<bytes::Bytes>>;

type HttpsConnector =
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>;

/// The HTTPS connector under `timeouts.connect` as a whole — TCP connect *and* TLS handshake, as
/// reqwest's connect timeout was — so a server that accepts and then stalls the handshake is a
/// connect error after `connect`, not a timeout after `first_token`.
#[derive(Clone)]
pub struct TimedConnector {
    pub(super) inner: HttpsConnector,
    pub(super) timeout: Duration,
}

type Connecting = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<
                    hyper_rustls::MaybeHttpsStream<hyper_util::rt::TokioIo<tokio::net::TcpStream>>,
                    Box<dyn std::error::Error + Send + Sync>,
                >,
            > + Send,
    >,
>;

impl tower::Service<http::Uri> for TimedConnector {
    type Response = hyper_rustls::MaybeHttpsStream<hyper_util::rt::TokioIo<tokio::net::TcpStream>>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Connecting;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let limit = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(r) => r,
                Err(_) => Err(format!("connect timed out after {}ms", limit.as_millis()).into()),
            }
        })
    }
}

/// One upstream endpoint, resolved.
#[derive(Debug)]
pub struct Endpoint {
    pub name: String,
    /// `name` as the `x-autohedge-endpoint` value, built once at load (`None`: not a valid
    /// header value, and the header is left out).
    pub name_header: Option<http::HeaderValue>,
    pub kind: EndpointKind,
    /// Root of the API without a trailing slash: `…/v1` for OpenAI-type servers, the bare host
    /// for Ollama.
    pub base_url: String,
    /// `base_urls`: the endpoint's several addresses (the first is `base_url`); empty for an
    /// endpoint of one (`base_url`) or of discovered tasks.
    pub addresses: Vec<String>,
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
    /// `headers:`, resolved (a value may come from `env:`, `file:` or `vault:`).
    pub headers: Vec<(String, Secret)>,
    /// The `headers:` values that are credentials — read from `env:`, `file:` or `vault:`, or
    /// under a name such as `authorization` or `api-key` (with a `Bearer`/`Basic` value's
    /// token alone besides) — redacted from upstream texts like the keys.
    pub header_secrets: Vec<Secret>,
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
    /// The direct client requests use (`None`: a proxy is configured, requests use `client`).
    pub direct: Option<DirectClient>,
    /// For a plain-`http` base URL (and no proxy configured): the connections requests to the
    /// configured address go over instead of `direct`.
    pub plain: Option<Plain>,
    /// `hedge:`: hedging for requests that try this endpoint first (unless their route has one).
    pub hedge: Option<crate::routing::hedge::Spec>,
    /// `balance:`: how attempts spread over the endpoint's addresses (several `base_urls`, or
    /// discovered tasks).
    pub balance: Balance,
    /// Upstream URL per operation (indexed by `Op as usize`), parsed once per load.
    pub urls: [reqwest::Url; Op::ALL.len()],
    /// The same as `http::Uri`s, for the direct client.
    pub uris: [http::Uri; Op::ALL.len()],
}

impl Endpoint {
    /// Every resolved key value and credential header value, for redacting upstream texts
    /// before they are stored or shown.
    pub fn secret_values(&self) -> Vec<&str> {
        self.keys
            .iter()
            .filter_map(|k| k.value.as_ref().map(|s| s.expose()))
            .chain(self.header_secrets.iter().map(Secret::expose))
            .collect()
    }

    /// [`Self::secret_values`] and the key a request sent of its own (`x-encrypted-key`).
    pub fn secret_values_with<'a>(&'a self, own: Option<&'a Secret>) -> Vec<&'a str> {
        let mut s = self.secret_values();
        s.extend(own.map(Secret::expose));
        s
    }

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
    pub health: crate::routing::health::Thresholds,
    pub max_cooldown: Duration,
    pub panic_threshold: f64,
    pub request_timeout: Duration,
    /// 0: off.
    pub slow_start: Duration,
    pub predict_rate_limits: bool,
}

/// Where a table's YAML comes from when it is built again (discovery found other endpoints).
/// A file is read again rather than kept as text: its literal keys stay in the file, not in a
/// copy in memory that a `Debug` or a dump could show.
#[derive(Clone, Default)]
pub enum Source {
    /// Built from parts (tests), not from YAML: never rebuilt.
    #[default]
    None,
    /// A config file, read again on every rebuild (the newest text, as a reload would read).
    File(std::path::PathBuf),
    /// YAML given as text: the embedded default or the demo's, which hold no secrets.
    Text(Arc<str>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::None => f.write_str("None"),
            Source::File(p) => write!(f, "File({})", p.display()),
            Source::Text(t) => write!(f, "Text({} bytes)", t.len()),
        }
    }
}

/// The runtime routing table. Requests hold an `Arc<Config>` for their whole life.
#[derive(Debug)]
pub struct Config {
    pub listen: String,
    /// `responses:`: what is kept of `/v1/responses` answers.
    pub responses: ResponsesSettings,
    /// `audit: { store: postgres }`: the trail in PostgreSQL; `None`: SQLite in the data dir.
    pub audit_pg: Option<PgSettings>,
    pub max_body_bytes: usize,
    /// `server.max_response_bytes`: the most of an upstream's answer read whole.
    pub max_response_bytes: usize,
    pub audit_queue: usize,
    /// `None`: keep the audit trail forever.
    pub audit_retention: Option<Duration>,
    /// `audit.capture_bodies`: which requests keep their (redacted) bodies for replay.
    pub capture_bodies: CaptureBodies,
    /// `audit.max_body_bytes`: the most of each kept body.
    pub capture_max_bytes: usize,
    pub shutdown_grace: Duration,
    /// `server.drain_delay`.
    pub drain_delay: Duration,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    /// `server.send_timeout`: the longest a write to a client may wait (`send_deadline`).
    pub send_timeout: Duration,
    /// 0: unlimited.
    pub max_concurrent_requests: usize,
    /// `limits.max_event_bytes`: the most one upstream SSE event may take.
    pub max_event_bytes: usize,
    /// `server.allowed_hosts`, lower-cased; `None`: the default by listen address
    /// (`clients::host_allowed`).
    pub allowed_hosts: Option<Vec<String>>,
    pub endpoints: BTreeMap<String, Arc<Endpoint>>,
    pub fallback_chain: Vec<String>,
    pub routes: BTreeMap<String, Vec<String>>,
    /// The chain every name a request may ask for resolves to (a route's own; an endpoint, then
    /// the fallback chain from it), built when the config is: a request takes a reference
    /// count, not a copy of the names. [`Config::chain_for`] reads it.
    pub chains: BTreeMap<String, Arc<[String]>>,
    /// Per-route overflow settings (routes written in the long form).
    pub route_overflow: BTreeMap<String, Overflow>,
    /// Per-route hedging (routes written in the long form).
    pub route_hedge: BTreeMap<String, crate::routing::hedge::Spec>,
    /// Routes with `continue_streams: true`.
    pub route_continue: BTreeSet<String>,
    /// `last_resort:` by the model a request names (a route, or an endpoint).
    pub last_resort: BTreeMap<String, LastResortSpec>,
    /// `auth:`: client keys and the admin key, as digests only.
    pub auth: Auth,
    /// `vault:`, resolved; `None` without one.
    pub vault: Option<crate::config::vault::Settings>,
    /// A digest of the values read from Vault for this table (a refresh compares it).
    pub vault_digest: Option<String>,
    pub policy: Policy,
    pub health: HealthPolicy,
    pub docker: DockerConfig,
    /// Where this table was built from, to rebuild it when discovery changes.
    pub source: Source,
    /// SHA-256 of the YAML text it was built from: the file watcher compares the file with it.
    pub source_digest: [u8; 32],
    /// Endpoints that exist because Docker discovery found them, not because the file names them.
    pub discovered_extra: Vec<String>,
    /// Problems that do not stop the gateway (an unset `env:` key) — reported at start.
    pub warnings: Vec<String>,
    /// `cluster:`, resolved; `None`: limits stay in this process.
    pub cluster: Option<ClusterSettings>,
    /// `alerts:`; `None` without one (nothing is sent).
    pub alerts: Option<Alerts>,
    /// `telemetry.otlp:`; `None`: no trace is exported.
    pub otlp: Option<Arc<OtlpSettings>>,
}

/// What an alert is about. The names are the `alerts.events` contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AlertEvent {
    EndpointRetired,
    EndpointAuthFailed,
    EndpointUnhealthy,
    AllFailed,
    AuditDropped,
    ConfigReloadFailed,
    DockerUnreachable,
    Remediation,
    ClusterStoreDown,
}

impl AlertEvent {
    pub const ALL: [AlertEvent; 9] = [
        AlertEvent::EndpointRetired,
        AlertEvent::EndpointAuthFailed,
        AlertEvent::EndpointUnhealthy,
        AlertEvent::AllFailed,
        AlertEvent::AuditDropped,
        AlertEvent::ConfigReloadFailed,
        AlertEvent::DockerUnreachable,
        AlertEvent::Remediation,
        AlertEvent::ClusterStoreDown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AlertEvent::EndpointRetired => "endpoint_retired",
            AlertEvent::EndpointAuthFailed => "endpoint_auth_failed",
            AlertEvent::EndpointUnhealthy => "endpoint_unhealthy",
            AlertEvent::AllFailed => "all_failed",
            AlertEvent::AuditDropped => "audit_dropped",
            AlertEvent::ConfigReloadFailed => "config_reload_failed",
            AlertEvent::DockerUnreachable => "docker_unreachable",
            AlertEvent::Remediation => "remediation",
            AlertEvent::ClusterStoreDown => "cluster_store_down",
        }
    }

    pub fn parse(s: &str) -> Option<AlertEvent> {
        AlertEvent::ALL.into_iter().find(|e| e.as_str() == s)
    }
}

/// `alerts:`, resolved.
#[derive(Clone, Debug)]
pub struct Alerts {
    pub webhooks: Vec<Webhook>,
    pub events: BTreeSet<AlertEvent>,
    pub all_failed_count: u64,
    pub all_failed_window: Duration,
    pub repeat: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WebhookFormat {
    Slack,
    Json,
}

#[derive(Clone, Debug)]
pub struct Webhook {
    /// The whole URL is a secret (Slack's carries its token in the path).
    pub url: Secret,
    pub format: WebhookFormat,
    /// `scheme://host:port` only: what logs and `/status` may show.
    pub label: String,
}

/// Who may use the gateway. Keys are held as SHA-256 digests only.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    pub admin: Option<[u8; 32]>,
    /// `admin_key` is configured but could not be read (an unset env var, a missing secret
    /// file): the admin surface is closed to everyone rather than open to loopback.
    pub admin_locked: bool,
    /// `Some`: every `/v1/*` request needs one of these.
    pub keys: Option<Vec<ClientKey>>,
}

#[derive(Clone, Debug)]
pub struct ClientKey {
    pub name: String,
    pub digest: [u8; 32],
    /// Routes or endpoints it may ask for; `None`: all.
    pub models: Option<BTreeSet<String>>,
    pub rpm: Option<u32>,
    pub tpm: Option<u64>,
    pub budget_usd: Option<f64>,
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

/// `telemetry.otlp:`, resolved.
#[derive(Clone, PartialEq)]
pub struct OtlpSettings {
    /// Where spans are posted.
    pub endpoint: reqwest::Url,
    /// The endpoint without credentials or query: what logs and `/status` show.
    pub display: String,
    pub headers: Vec<(String, Secret)>,
    pub sample_ratio: f64,
    pub service_name: String,
    pub capture_content: bool,
    pub max_queue_spans: usize,
    pub max_queue_bytes: usize,
}

impl std::fmt::Debug for OtlpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtlpSettings")
            .field("endpoint", &self.display)
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("sample_ratio", &self.sample_ratio)
            .field("service_name", &self.service_name)
            .field("capture_content", &self.capture_content)
            .field("max_queue_spans", &self.max_queue_spans)
            .field("max_queue_bytes", &self.max_queue_bytes)
            .finish()
    }
}

/// `cluster:`, resolved.
#[derive(Clone)]
pub struct ClusterSettings {
    pub url: Secret,
    /// The URL without credentials: what logs and `/status` show.
    pub display: String,
    pub key_prefix: String,
    pub timeout: Duration,
    /// `cluster.replicas`: the fleet's size for a replica that never saw the store.
    pub replicas: Option<u64>,
}

impl std::fmt::Debug for ClusterSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSettings")
            .field("store", &self.display)
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl PartialEq for ClusterSettings {
    fn eq(&self, o: &Self) -> bool {
        self.url.expose() == o.url.expose()
            && self.key_prefix == o.key_prefix
            && self.timeout == o.timeout
    }
}

/// `redis://host:port/db` of a `redis://` or `rediss://` URL (credentials dropped), or `None`
/// when it is not one the client accepts.
pub fn cluster_display(url: &str) -> Option<String> {
    let parsed = reqwest::Url::parse(url.trim()).ok()?;
    if !matches!(parsed.scheme(), "redis" | "rediss") || parsed.host_str().is_none() {
        return None;
    }
    redis::Client::open(url.trim()).ok()?;
    let mut shown = format!("{}://{}", parsed.scheme(), parsed.host_str()?);
    if let Some(p) = parsed.port() {
        shown.push_str(&format!(":{p}"));
    }
    shown.push_str(parsed.path());
    Some(shown)
}

/// `models.<name>.balance`: `random`, `least_loaded`, or a map of the knobs below.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balance {
    /// `least_loaded` (the default: the cheaper of two usable addresses drawn at random, by
    /// latency × load) or `random` (any usable address; no affinity unless `affinity` is given).
    pub random: bool,
    /// `affinity: prefix` (the default): a conversation goes back to the address that served
    /// its earlier turns while that one is not overloaded; `none`: every request balanced anew.
    pub affinity: bool,
    /// `affinity_load` (default 1.25): a conversation stays on its address while that address's
    /// in-flight requests are at most this times the average.
    pub affinity_load: f64,
    /// `max_ejection_percent` (default 50): at most this share of the addresses ejected at once.
    pub max_ejection_percent: f64,
}

impl Default for Balance {
    fn default() -> Self {
        Balance {
            random: false,
            affinity: true,
            affinity_load: 1.25,
            max_ejection_percent: 50.0,
        }
    }
}

/// `last_resort:` and `cache:`, resolved: how a model's answers are kept, and what serves them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LastResortSpec {
    /// How long an answer is kept: the longer of its uses'.
    pub ttl: Duration,
    pub max_bytes: u64,
    pub max_bytes_per_key: u64,
    pub shared: bool,
    /// `last_resort:`: served where every attempt failed, this old at most.
    pub last_resort: Option<Duration>,
    /// `cache:`: served before any attempt.
    pub cache: Option<CacheSpec>,
}

/// `cache:`, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheSpec {
    /// How old a kept answer may be to serve.
    pub ttl: Duration,
    /// Requests without `temperature` are served too.
    pub temperature_absent: bool,
}
