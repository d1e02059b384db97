//! The YAML contract as written: `Raw*` structs with `deny_unknown_fields`, parsed through
//! `serde_path_to_error` so every error names its path, and `scrub_scalars`, which hides every
//! value of the file from an error message (a key written where a list belongs must not reach a
//! log). Nothing here resolves or validates: that is `resolve`.

use super::*;

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
    #[serde(default)]
    pub auth: RawAuth,
    pub vault: Option<RawVault>,
    pub alerts: Option<RawAlerts>,
    #[serde(default)]
    pub limits: RawLimits,
    pub cluster: Option<RawCluster>,
    #[serde(default)]
    pub responses: RawResponses,
    pub audit: Option<RawAudit>,
    #[serde(default)]
    pub telemetry: RawTelemetry,
}

/// `telemetry:`: what the gateway exports of its requests.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    pub otlp: Option<RawOtlp>,
}

/// `telemetry.otlp:`: OpenTelemetry traces over OTLP/HTTP (protobuf).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOtlp {
    /// The collector's traces URL (`http://collector:4318/v1/traces`); a URL without a path
    /// gets `/v1/traces`.
    pub endpoint: String,
    /// Headers sent with every export (`authorization`, an API key): `env:`, `file:`, `vault:`
    /// or literal values.
    pub headers: Option<BTreeMap<String, String>>,
    /// The share of new traces recorded (default 1.0); a trace the client continues keeps the
    /// client's decision.
    pub sample_ratio: Option<f64>,
    /// `service.name` of the spans (default `autohedge`).
    pub service_name: Option<String>,
    /// Export prompt and completion text (default false: never).
    pub capture_content: Option<bool>,
    /// The most spans waiting to be exported (default 4096): past it spans are dropped
    /// (counted), never waited for.
    pub max_queue_spans: Option<usize>,
    /// The most bytes of spans waiting to be exported (default 32 MiB).
    pub max_queue_bytes: Option<ByteSize>,
}

/// `audit:`: where the audit trail is kept.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAudit {
    /// `sqlite` (default: `<data-dir>/autohedge.db`) or `postgres`.
    pub store: Option<AuditStoreKind>,
    /// `postgres://user:pass@host:5432/db`; `env:`, `file:`, `vault:` or a literal.
    pub url: Option<String>,
    /// The most connections the gateway opens to the store (default 8).
    pub pool: Option<usize>,
    /// While PostgreSQL is away, records wait in a spool in the data dir, at most this many
    /// bytes (default 1GiB); past it records are dropped (counted).
    pub spool_max_bytes: Option<ByteSize>,
    /// Which requests keep their bodies in the trail, for `autohedge replay`: `none`
    /// (default), `failed` (an error, or any failed attempt), `all`.
    pub capture_bodies: Option<CaptureBodies>,
    /// The most of each body kept (default 256KiB; 1KiB to 16MiB): a longer one is cut, and a
    /// cut request cannot be replayed.
    pub max_body_bytes: Option<ByteSize>,
}

/// `audit.capture_bodies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CaptureBodies {
    #[default]
    None,
    Failed,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditStoreKind {
    Sqlite,
    Postgres,
}

/// `responses:`: what the gateway keeps of the answers it gives on `/v1/responses`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResponses {
    /// `keep`: keep every response's input and output items (not those of `store: false`
    /// requests), so a conversation outlives its endpoint; `off` (default): keep only the
    /// conversations the gateway itself answered by translation.
    pub history: Option<HistoryMode>,
    /// How long a kept response (and its pin) is remembered (default 1h).
    pub history_ttl: Option<Dur>,
    /// The most kept responses may take together, bytes or `256MiB` (default 256MiB): the oldest
    /// go first.
    pub history_max_bytes: Option<ByteSize>,
    /// One client key's share of `history_max_bytes` (default a quarter of it): a key over it
    /// loses its own oldest turns, never another key's.
    pub history_max_bytes_per_key: Option<ByteSize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HistoryMode {
    Keep,
    Off,
}

/// A size in bytes: a number, or a string such as `64KiB`, `256MiB`, `1GiB` (or `KB`, `MB`,
/// `GB`, powers of 1,000).
#[derive(Debug, Clone, Copy)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            N(u64),
            S(String),
        }
        match Either::deserialize(d)? {
            Either::N(n) => Ok(ByteSize(n)),
            Either::S(s) => parse_bytes(&s)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Parses `1024`, `64KiB`, `256MiB`, `1GiB`, `10MB`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| "a size: bytes, or e.g. 64KiB, 256MiB, 1GiB".to_string())?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err("a size unit: B, KiB, MiB, GiB, KB, MB or GB".into()),
    };
    n.checked_mul(scale)
        .ok_or_else(|| "size out of range".to_string())
}

/// `cluster:`: the store replicas share client limits through (Redis).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    /// `redis://[user:pass@]host:6379/0` or `rediss://`; `env:`, `file:`, `vault:` or a literal.
    pub redis: String,
    /// Prefix of every key (default `autohedge:`): several fleets can share one Redis.
    pub key_prefix: Option<String>,
    /// The most a request ever waits on the store (default 25ms).
    pub timeout: Option<Dur>,
    /// The fleet's replica count for a replica that never saw the store (the stack file sets
    /// it): while the store is away, limits are split by the larger of this and the count last
    /// seen (kept in the data dir across restarts).
    pub replicas: Option<u64>,
}

/// `limits:`: how much of an upstream's bytes the gateway holds at once.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// The most one SSE event of an upstream stream may take (default 4 MiB): before the first
    /// content chunk a larger one fails over; after it the stream ends with `stream_broken`.
    pub max_event_bytes: Option<ByteSize>,
}

/// `alerts:`: webhooks told about what an operator must act on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAlerts {
    #[serde(default)]
    pub webhooks: Vec<RawWebhook>,
    /// Which events to send (default: all).
    pub events: Option<Vec<String>>,
    /// `all_failed` fires when more than `count` requests got a 503 within `window`.
    pub all_failed: Option<RawAllFailed>,
    /// At most one alert per event and endpoint this often (default 5m); what was held back is
    /// counted into the next one.
    pub repeat: Option<Dur>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWebhook {
    /// `env:`/`file:` or a literal URL (a Slack webhook URL is a secret: prefer `env:`).
    pub url: String,
    /// `slack` or `json` (default `json`).
    pub format: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAllFailed {
    pub count: u64,
    pub window: Dur,
}

/// `auth:`: who may use the gateway.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    /// For `/status` and `/admin/*` (and `/metrics`, `/docs`); `/health` stays open.
    pub admin_key: Option<String>,
    /// When present, every `/v1/*` request needs one of these.
    pub keys: Option<Vec<RawClientKey>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientKey {
    /// Goes into audit rows and stats (never the key).
    pub name: String,
    /// `env:`, `file:`, `vault:`, a literal, or `sha256:<hex digest of the key>`.
    pub key: String,
    /// Routes or endpoints it may ask for (default: all).
    pub models: Option<Vec<String>>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Prompt + completion tokens per minute.
    pub tpm: Option<u64>,
    /// US dollars per calendar month (UTC), from the endpoints' `cost:` prices.
    pub budget_usd: Option<f64>,
}

/// `vault:`: where `vault:MOUNT/PATH#FIELD` secrets and `x-encrypted-key` decryption come from.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawVault {
    pub address: String,
    /// `env:`/`file:`/a literal.
    pub token: Option<String>,
    pub approle: Option<RawApprole>,
    pub namespace: Option<String>,
    /// Re-read `vault:` secrets this often (default 5m; and on every reload).
    pub refresh: Option<Dur>,
    /// Enables the `x-encrypted-key` request header.
    pub transit_key: Option<String>,
    /// The transit engine's mount (default `transit`).
    pub transit_mount: Option<String>,
    /// Decrypted per-request keys are cached this long (default 60s).
    pub cache_ttl: Option<Dur>,
    /// One Vault call's timeout (default 5s).
    pub timeout: Option<Dur>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApprole {
    pub role_id: String,
    /// `env:`/`file:`/a literal.
    pub secret_id: String,
    /// The auth mount (default `approle`).
    pub mount: Option<String>,
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
    pub hedge: Option<RawHedge>,
    /// Carry a committed stream that breaks on at the next endpoint able to continue an
    /// assistant message (requests without tools).
    pub continue_streams: Option<bool>,
    /// Answers kept to serve when every attempt of a request fails.
    pub last_resort: Option<RawLastResort>,
    /// Answers kept to serve the same temperature-0 request before any upstream call.
    pub cache: Option<RawCache>,
}

/// `cache:` on a route: a kept answer (the same key as `last_resort:`'s) serves the very same
/// request of a `temperature: 0` before any upstream is called.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCache {
    /// How old a kept answer may be to serve (default 5m).
    pub ttl: Option<Dur>,
    /// Requests without `temperature` are served from the cache too (default false).
    pub temperature_absent: Option<bool>,
}

/// `last_resort:` (a route's, or an endpoint's for requests that name it): 2xx answers kept
/// under an exact key, served only when every attempt of the same request failed.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLastResort {
    /// How long a kept answer may serve (default 24h).
    pub ttl: Option<Dur>,
    /// The most bytes kept for this route (default 256MiB).
    pub max_bytes: Option<ByteSize>,
    /// The most bytes kept for one client key (default a quarter of `max_bytes`).
    pub max_bytes_per_key: Option<ByteSize>,
    /// Serve one key's kept answers to another key's same request (default false).
    pub shared: Option<bool>,
}

/// `hedge:` (a route's, or an endpoint's for requests where it is tried first).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHedge {
    /// A duration (`800ms`) or a percentile of the endpoint's recent time to first byte (`p95`).
    pub after: StrOrNum,
    /// Hedged copies at most this share of the requests: `5%` or `0.05` (default 5%).
    pub max_extra: Option<StrOrNum>,
    /// Never hedge sooner than this (default 50ms).
    pub min_after: Option<Dur>,
    /// Hedge requests that carry `tools` too (default false: a tool call may have side effects).
    pub tools: Option<bool>,
}

/// A scalar written as text or as a number (`after: 2` is two seconds, `max_extra: 0.05`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StrOrNum {
    Num(f64),
    Str(String),
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<String>,
    pub max_body_bytes: Option<ByteSize>,
    /// An upstream's whole answer (a non-stream 2xx body) larger than this is refused as
    /// `malformed_response` and the request fails over, instead of being held in memory however
    /// large it grows. Default 128 MiB.
    pub max_response_bytes: Option<ByteSize>,
    /// Capacity of the audit queue in records; a full queue drops records (counted), never stalls.
    pub audit_queue: Option<usize>,
    /// Audit rows older than this are deleted (hourly). Default 30d; 0 keeps everything.
    pub audit_retention: Option<Dur>,
    /// How long SIGTERM waits for in-flight requests before closing.
    pub shutdown_grace: Option<Dur>,
    /// After SIGTERM, how long the gateway keeps accepting and serving (answering `/health` 503
    /// `draining`, every response `Connection: close`) before it stops accepting. Default 5s.
    pub drain_delay: Option<Dur>,
    /// A client must send its request headers within this (slowloris guard); a keep-alive
    /// connection (HTTP/1 or HTTP/2) idle this long is closed, and an HTTP/2 peer that leaves a
    /// PING unanswered this long is dropped. Default 10s.
    pub header_timeout: Option<Dur>,
    /// A client must send its whole request body within this. Default 30s.
    pub body_timeout: Option<Dur>,
    /// A write to a client that makes no progress for this long (the client reads nothing)
    /// closes its connection. Default 60s (nginx's `send_timeout`).
    pub send_timeout: Option<Dur>,
    /// Requests served at once; above it new ones get 503 `overloaded` at once. 0: unlimited.
    /// Default 4096.
    pub max_concurrent_requests: Option<usize>,
    /// `Host` names `/v1/*` answers (DNS rebinding): a name, `.name` for it and the names under
    /// it, or `*`. Default: on a loopback `listen`, `localhost` and IP literals; else any.
    pub allowed_hosts: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEndpoint {
    #[serde(rename = "type")]
    pub kind: EndpointKind,
    pub base_url: Option<String>,
    /// Several servers of one model (replicas): the endpoint's addresses, balanced by load.
    pub base_urls: Option<Vec<String>>,
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
    /// Hedge requests first tried on this endpoint (a route's own `hedge:` takes precedence).
    pub hedge: Option<RawHedge>,
    /// Answers kept to serve when every attempt of a request naming this endpoint fails.
    pub last_resort: Option<RawLastResort>,
    /// How attempts spread over the endpoint's addresses: `random`, `least_loaded`, or a map
    /// (`strategy`, `affinity`, `affinity_load`, `max_ejection_percent`); read by
    /// `resolve::balance`, which names what is wrong.
    pub balance: Option<serde_json::Value>,
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
    /// An endpoint back from unhealthy, ejection or cooldown takes a rising share of its traffic
    /// over this long (Envoy's `slow_start_window`; default 30s, 0 turns it off).
    pub slow_start: Option<Dur>,
    /// Skip an endpoint (or key) whose last `x-ratelimit-remaining-*` says this request would get
    /// a 429 (default true).
    pub predict_rate_limits: Option<bool>,
}

pub fn parse(text: &str) -> Result<RawConfig, ConfigError> {
    if flow_depth(text) > MAX_FLOW_DEPTH {
        return Err(ConfigError(format!(
            "`[`/`{{` nested deeper than {MAX_FLOW_DEPTH} levels: not a config"
        )));
    }
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
/// How deep flow collections (`[…]`, `{…}`) may nest in a config; a real one nests a handful.
pub const MAX_FLOW_DEPTH: usize = 256;

/// The deepest nesting of flow collections in `text`, counted before the YAML parser runs: its
/// time grows with the square of the depth (a 200 KB file of 100,000 `[` took 15 s, and a
/// reload would have spun that long). Quoted scalars (to the end of their line) and comments are
/// skipped; a bracket the scan miscounts can only make the depth look smaller, except inside a
/// quoted scalar broken across lines, where hundreds of unclosed brackets would be needed.
pub fn flow_depth(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    for line in text.lines() {
        let mut quote: Option<u8> = None;
        let mut prev = b' ';
        let mut bytes = line.bytes();
        while let Some(b) = bytes.next() {
            match (quote, b) {
                (Some(b'"'), b'\\') => {
                    bytes.next();
                }
                (Some(q), _) if b == q => quote = None,
                (Some(_), _) => {}
                (None, b'\'' | b'"')
                    if matches!(prev, b' ' | b'\t' | b'[' | b'{' | b',' | b':') =>
                {
                    quote = Some(b)
                }
                (None, b'#') if matches!(prev, b' ' | b'\t') => break,
                (None, b'[' | b'{') => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                (None, b']' | b'}') => depth = depth.saturating_sub(1),
                _ => {}
            }
            prev = b;
        }
    }
    deepest
}

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
