//! What the background watchers observed, as plain data: a probe's report and Docker's view of
//! where an endpoint runs. The registry keeps them per endpoint and `/status` shows them; the
//! prober and the Docker watcher produce them. A module of its own so the registry needs neither
//! watcher (they sit above it, on `AppState`), and no import circle runs through them.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde_json::{Value, json};

use crate::routing::health::ProbeResult;

/// What one probe found.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub at: SystemTime,
    pub ok: bool,
    pub detail: Value,
    pub result: ProbeResult,
    /// False when the probe says nothing about health (no probe route on this server, or the
    /// probe's key was rejected while others remain): the result is shown, not fed to health.
    pub counts: bool,
    /// The probe's 401/403 rejected this key (index into the endpoint's keys).
    pub rejected_key: Option<usize>,
}

impl ProbeReport {
    pub(crate) fn new(at: SystemTime, result: ProbeResult, detail: Value) -> Self {
        ProbeReport {
            at,
            ok: result == ProbeResult::Healthy,
            detail,
            result,
            counts: true,
            rejected_key: None,
        }
    }
}

/// Where and how an endpoint runs, as Docker sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Discovered {
    /// Service (or container) name.
    pub service: String,
    /// `http://ip:port` of each running task.
    pub addresses: Vec<String>,
    pub running: usize,
    /// Tasks that failed or were restarted (Swarm), or the container's restart count.
    pub restarts: u64,
    /// Why it is down, if it is: no running task, or the engine reports it unhealthy.
    pub down: Option<String>,
}

/// The watcher's last view, for `/status`.
#[derive(Clone, Debug, Default)]
pub struct DockerStatus {
    pub enabled: bool,
    pub reachable: Option<bool>,
    pub error: Option<String>,
    pub last_scan: Option<SystemTime>,
    /// Endpoints that exist only because discovery found them.
    pub added: Vec<String>,
    pub actions: u64,
}

impl DockerStatus {
    /// The watcher's view with what each endpoint discovery backs found (`found`, from the
    /// registry): `discovered_endpoints` names every endpoint whose tasks discovery found (the
    /// configured `discover: docker` ones and the adopted), `added_endpoints` the adopted only,
    /// `services` each one's service, running tasks and addresses.
    pub fn to_json(&self, found: &[(String, Discovered)]) -> Value {
        let mut names: Vec<&str> = found
            .iter()
            .filter(|(_, d)| !d.service.is_empty())
            .map(|(n, _)| n.as_str())
            .chain(self.added.iter().map(String::as_str))
            .collect();
        names.sort_unstable();
        names.dedup();
        let services: serde_json::Map<String, Value> = found
            .iter()
            .filter(|(_, d)| !d.service.is_empty())
            .map(|(n, d)| {
                (
                    n.clone(),
                    json!({
                        "service": d.service,
                        "running": d.running,
                        "addresses": d.addresses,
                        "down": d.down,
                    }),
                )
            })
            .collect();
        json!({
            "enabled": self.enabled,
            "status": match self.reachable {
                None => if self.enabled { "starting" } else { "disabled" },
                Some(true) => "ok",
                Some(false) => "docker_daemon_unreachable",
            },
            "error": self.error,
            "last_scan_unix_ms": self.last_scan.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok()).map(|d| d.as_millis() as u64),
            "discovered_endpoints": names,
            "added_endpoints": self.added,
            "services": services,
            "remediation_actions": self.actions,
        })
    }
}

pub type SharedStatus = Arc<Mutex<DockerStatus>>;

/// What one replica learned about an endpoint that the others should know (with `cluster:`):
/// shared through the store and applied by every replica whose endpoint of that name has the
/// same definition (`fingerprint`). Plain data, so the registry needs nothing of the cluster.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
pub enum Fact {
    /// A 429: no traffic until then (Unix ms).
    Cooldown {
        endpoint: String,
        fingerprint: String,
        until_unix_ms: u64,
        detail: String,
    },
    /// A 410: out of rotation until cleared or redefined.
    Retired {
        endpoint: String,
        fingerprint: String,
        detail: String,
    },
    /// A 401/403 for the key whose value hashes to `key` (never the key).
    KeyRejected {
        endpoint: String,
        fingerprint: String,
        key: String,
        detail: String,
    },
    /// A context window the upstream stated.
    Window {
        endpoint: String,
        fingerprint: String,
        tokens: u64,
        request_id: String,
    },
    /// `autohedge endpoint clear`: everything above is lifted.
    Cleared { endpoint: String },
    /// The upstream's `x-ratelimit-*` headers for one key (by its value's hash; "" without a
    /// key), as seen at `at_unix_ms`: (limit, remaining, ms until full) per budget. Published,
    /// not stored: it is stale within seconds.
    RateLimit {
        endpoint: String,
        fingerprint: String,
        key: String,
        requests: Option<(Option<u64>, u64, u64)>,
        tokens: Option<(Option<u64>, u64, u64)>,
        at_unix_ms: u64,
    },
}

impl Fact {
    pub fn endpoint(&self) -> &str {
        match self {
            Fact::Cooldown { endpoint, .. }
            | Fact::Retired { endpoint, .. }
            | Fact::KeyRejected { endpoint, .. }
            | Fact::Window { endpoint, .. }
            | Fact::RateLimit { endpoint, .. }
            | Fact::Cleared { endpoint } => endpoint,
        }
    }
}
