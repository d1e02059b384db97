//! Shared state: the live config snapshot (swapped atomically on reload), the endpoint registry,
//! and the audit store's handle.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::routing::registry::Registry;
use crate::store::{PersistedStats, StoreHandle};

#[derive(Debug, Default, Clone)]
pub struct ReloadStatus {
    pub reloads: u64,
    pub last_ok: Option<SystemTime>,
    pub last_error: Option<String>,
}

pub struct AppState {
    pub config: ArcSwap<Config>,
    pub registry: Registry,
    pub store: StoreHandle,
    pub config_path: Option<PathBuf>,
    pub reload: Mutex<ReloadStatus>,
    pub started: std::time::Instant,
    /// The Docker watcher's last view.
    pub docker: crate::routing::observed::SharedStatus,
    /// Endpoints discovery added to the table (kept across file reloads).
    pub discovered: Mutex<Vec<crate::config::DiscoveredEndpoint>>,
    /// Cancelled when `shutdown_grace` is over: requests still running are cut (and recorded
    /// with class `shutdown`) so the audit trail is complete before the process exits.
    pub hard_stop: CancellationToken,
    /// Cancelled when SIGTERM starts the drain: `/health` answers 503 `draining`, HTTP/1
    /// responses carry `Connection: close`, HTTP/2 connections get GOAWAY; accepting goes on
    /// for `server.drain_delay`.
    pub draining: CancellationToken,
    /// Requests being served (handler running or stream body alive).
    inflight: Arc<AtomicUsize>,
    /// Serializes config installs (file reloads, SIGHUP, discovery): each builds from the
    /// newest inputs under this lock, so none installs a table older than another's.
    pub install_lock: Mutex<()>,
    /// Hedge budgets by `route:NAME` / `endpoint:NAME` (kept across reloads).
    pub hedges: Mutex<std::collections::BTreeMap<String, crate::routing::hedge::Budget>>,
    /// Client keys' limits and spend (kept across reloads, by key name).
    pub clients: crate::clients::Clients,
    /// Vault transit for `x-encrypted-key`, for the current `vault:` settings.
    transit: Mutex<Option<(String, Arc<crate::config::vault::Transit>)>>,
    /// The last Vault refresh that failed, for `/status` (the last good values stay in use).
    pub vault_error: Mutex<Option<String>>,
    /// Raises webhook alerts (never blocks); the task in `alerts::run` delivers them.
    pub alerts: crate::ops::alerts::Alerts,
    /// The alert task's receiver, taken once when the gateway starts its tasks.
    pub alerts_rx: Mutex<Option<tokio::sync::mpsc::Receiver<crate::ops::alerts::Signal>>>,
    /// Metrics, recent failovers, per-endpoint 4xx counts: the operator's figures.
    pub telemetry: crate::ops::telemetry::Telemetry,
    /// Finished requests' spans waiting for the OTLP export task (`telemetry.otlp`).
    pub traces: crate::ops::otel::Traces,
    /// The listener is on a loopback address: `/v1/*` then answers only `localhost` and IP
    /// literals as `Host` unless `server.allowed_hosts` says otherwise. Set once the socket is
    /// bound; true until then, the safe reading.
    pub listen_loopback: std::sync::atomic::AtomicBool,
    /// Standby services remediation scaled up and has not scaled down yet (read from the audit
    /// database at start), so a restarted gateway still scales them down.
    pub standbys_up: Mutex<std::collections::BTreeSet<String>>,
    /// Whether the gateway knows its endpoints yet (`Startup`): `/health` says `starting` and
    /// requests wait until the first discovery scan and probe round are done, or a bound passed.
    pub startup: Startup,
    /// The shared store of `cluster:` (set once at start; `cluster:` changes take effect at the
    /// next start).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// `/v1/responses`: which endpoint produced each response id, and the kept history.
    /// Answers kept to serve when every attempt fails (`last_resort:`).
    pub last_resort: crate::executor::last_resort::LastResort,
    /// Captured bodies waiting for the audit writer (`audit.capture_bodies`).
    pub bodies: crate::store::bodies::Budget,
    /// Where this gateway's audit trail is (set once at start), for `replay` to read.
    pub trail: std::sync::OnceLock<crate::store::bodies::Trail>,
    pub conversations: crate::routing::conversations::Conversations,
}

/// A new gateway's first moments: it must not turn requests away (503: "no running task
/// discovered") or be put into rotation before it has looked at its endpoints once.
pub struct Startup {
    ready: AtomicBool,
    probed: AtomicBool,
    scanned: AtomicBool,
    /// Notified (`true`) once ready.
    tx: tokio::sync::watch::Sender<bool>,
    /// Ready by this at the latest (`docker.timeout` + `health.probe_timeout` after the start):
    /// a watcher that hangs cannot keep the gateway out of service.
    by: std::sync::OnceLock<tokio::time::Instant>,
}

impl Default for Startup {
    fn default() -> Self {
        Startup {
            ready: AtomicBool::new(false),
            probed: AtomicBool::new(false),
            scanned: AtomicBool::new(false),
            tx: tokio::sync::watch::Sender::new(false),
            by: std::sync::OnceLock::new(),
        }
    }
}

impl Startup {
    /// Starts the clock: ready by `bound` from now at the latest. A gateway without Docker
    /// discovery has nothing to scan.
    pub fn begin(&self, bound: Duration, docker: bool) {
        let _ = self.by.set(tokio::time::Instant::now() + bound);
        if !docker {
            self.scanned();
        }
    }

    /// The first discovery scan is done (it found something, nothing, or failed).
    pub fn scanned(&self) {
        self.scanned.store(true, Ordering::Release);
        self.check();
    }

    /// The first probe round is done.
    pub fn probed(&self) {
        self.probed.store(true, Ordering::Release);
        self.check();
    }

    fn check(&self) {
        if self.probed.load(Ordering::Acquire) && self.scanned.load(Ordering::Acquire) {
            self.ready.store(true, Ordering::Release);
            self.tx.send_replace(true);
        }
    }

    /// Ready to serve: both done, or the bound passed (never started: ready, as in tests that
    /// build state by hand).
    pub fn is_ready(&self) -> bool {
        if self.ready.load(Ordering::Acquire) {
            return true;
        }
        match self.by.get() {
            Some(by) if tokio::time::Instant::now() < *by => false,
            _ => {
                self.ready.store(true, Ordering::Release);
                true
            }
        }
    }

    /// Waits until ready (at most until the bound).
    pub async fn wait(&self) {
        if self.is_ready() {
            return;
        }
        let Some(by) = self.by.get().copied() else {
            return;
        };
        let mut rx = self.tx.subscribe();
        let _ = tokio::time::timeout_at(by, rx.wait_for(|r| *r)).await;
    }
}

impl crate::ops::alerts::Source for AppState {
    fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }
    fn audit_dropped(&self) -> u64 {
        self.store.dropped()
    }
}

/// A request slot: counts the request as in flight until dropped.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl AppState {
    pub fn new(
        cfg: Config,
        store: StoreHandle,
        config_path: Option<PathBuf>,
        persisted: &[PersistedStats],
        spend: Vec<(String, String, f64)>,
    ) -> Arc<AppState> {
        let (alerts, alerts_rx) = crate::ops::alerts::Alerts::channel();
        let registry = Registry::new(store.clone()).with_alerts(alerts.clone());
        registry.sync(&cfg, persisted);
        Arc::new(AppState {
            config: ArcSwap::from_pointee(cfg),
            registry,
            store,
            config_path,
            reload: Mutex::new(ReloadStatus::default()),
            started: std::time::Instant::now(),
            docker: Default::default(),
            discovered: Mutex::new(Vec::new()),
            hard_stop: CancellationToken::new(),
            draining: CancellationToken::new(),
            inflight: Arc::new(AtomicUsize::new(0)),
            install_lock: Mutex::new(()),
            hedges: Mutex::new(Default::default()),
            clients: crate::clients::Clients::new(spend),
            transit: Mutex::new(None),
            vault_error: Mutex::new(None),
            alerts,
            alerts_rx: Mutex::new(Some(alerts_rx)),
            telemetry: crate::ops::telemetry::Telemetry::new(),
            traces: Default::default(),
            listen_loopback: std::sync::atomic::AtomicBool::new(true),
            startup: Startup::default(),
            cluster: std::sync::OnceLock::new(),
            conversations: Default::default(),
            last_resort: Default::default(),
            bodies: Default::default(),
            trail: std::sync::OnceLock::new(),
            standbys_up: Mutex::new(Default::default()),
        })
    }

    /// The gauges `/metrics` shows, read now.
    pub fn gauges(&self) -> crate::ops::telemetry::Gauges {
        let cfg = self.config.load();
        let endpoints = cfg
            .endpoints
            .iter()
            .map(|(name, ep)| {
                let (state, requests, tokens) = self.registry.gauges(ep, &cfg.policy);
                crate::ops::telemetry::EndpointGauges {
                    name: name.clone(),
                    state,
                    requests,
                    tokens,
                    addresses: self.registry.address_gauges(name),
                }
            })
            .collect();
        crate::ops::telemetry::Gauges {
            states: &crate::routing::registry::ENDPOINT_STATES,
            endpoints,
            docker_up: self
                .docker
                .lock()
                .map(|d| d.reachable == Some(true))
                .unwrap_or(false),
            audit_dropped: self.store.dropped(),
            alerts_dropped: self.alerts.dropped(),
        }
    }

    /// Runs `f` on the hedge budget named `key` (created empty on first use).
    pub fn hedge_budget<R>(
        &self,
        key: &str,
        f: impl FnOnce(&mut crate::routing::hedge::Budget) -> R,
    ) -> R {
        let mut budgets = self.hedges.lock().unwrap_or_else(|e| e.into_inner());
        match budgets.get_mut(key) {
            Some(b) => f(b),
            None => f(budgets.entry(key.to_string()).or_default()),
        }
    }

    /// The transit decrypter for `cfg`'s `vault:` settings (one per address and key, so its
    /// login and cache survive requests and reloads that keep them); `None` without a
    /// `transit_key`.
    pub fn transit(&self, cfg: &Config) -> Option<Arc<crate::config::vault::Transit>> {
        let settings = cfg.vault.as_ref()?;
        settings.transit_key.as_ref()?;
        let id = crate::config::vault::transit_id(settings);
        let mut slot = self.transit.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some((current, t)) if *current == id => Some(t.clone()),
            _ => {
                let t = Arc::new(crate::config::vault::Transit::new(settings.clone()));
                *slot = Some((id, t.clone()));
                Some(t)
            }
        }
    }

    /// Takes a request slot; `None` when `limit` (> 0) requests are already in flight: the
    /// caller sheds the request at once rather than queueing it.
    pub fn admit(&self, limit: usize) -> Option<Slot> {
        let before = self.inflight.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.inflight.clone());
        if limit > 0 && before >= limit {
            return None;
        }
        Some(slot)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// True once shutdown cut the requests still running.
    pub fn shutting_down(&self) -> bool {
        self.hard_stop.is_cancelled()
    }

    /// Installs a validated config: endpoint state first (so the new table never sees an
    /// endpoint without state), then one atomic swap. Requests already running keep the
    /// snapshot they started with.
    pub fn install(&self, cfg: Config) {
        self.registry.sync(&cfg, &[]);
        let running = self.cluster.get().map(|c| c.settings());
        if running != cfg.cluster.as_ref() {
            tracing::warn!(
                "`cluster:` changed: the running gateway keeps its store until it restarts"
            );
        }
        self.config.store(Arc::new(cfg));
        crate::ops::telemetry::config_reload(true);
        let mut r = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        r.reloads += 1;
        r.last_ok = Some(SystemTime::now());
        r.last_error = None;
    }

    /// Adds the endpoints Docker discovery found to the *current* table and installs it, under
    /// the install lock: the table is rebuilt from the newest source, so a discovery scan that
    /// began before a file reload cannot reinstall the old file. Returns the names it added.
    pub fn install_discovered(
        &self,
        wanted: Vec<crate::config::DiscoveredEndpoint>,
    ) -> Result<Vec<String>, crate::config::ConfigError> {
        let _serial = self.install_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.config.load_full();
        let Some(built) = current.rebuild_with(&wanted) else {
            return Ok(Vec::new());
        };
        let new_cfg = built?;
        let added: Vec<String> = wanted
            .iter()
            .filter(|w| !current.endpoints.contains_key(&w.name))
            .map(|w| w.name.clone())
            .collect();
        if let Ok(mut d) = self.discovered.lock() {
            *d = wanted;
        }
        self.install(new_cfg);
        Ok(added)
    }

    /// The one place a request's end is recorded: its client key's admission settled (the cost
    /// spent and persisted, the completion charged), metrics, the access line, alerts, then the
    /// audit row (queued, never waited for).
    pub fn record_request(
        &self,
        row: crate::store::RequestRow,
        admission: Option<crate::clients::Admission>,
    ) {
        if let Some(mut a) = admission
            && let Some(total) =
                a.settle_usage(row.cost_usd, row.tokens_in, row.tokens_out.unwrap_or(0))
        {
            self.store.send(crate::store::Record::Spend(vec![total]));
        }
        let cfg = self.config.load();
        self.telemetry.request(&cfg, &row);
        self.traces.record(&cfg, &row);
        // A last resort's answer is a 200, but every upstream failed it: an outage all the same.
        if row.status == 503 || row.error_class.as_deref() == Some("last_resort") {
            self.alerts.unavailable();
        }
        self.store
            .send(crate::store::Record::Request(Box::new(row)));
    }

    pub fn reload_failed(&self, error: String) {
        crate::ops::telemetry::config_reload(false);
        self.alerts
            .raise(crate::config::AlertEvent::ConfigReloadFailed, None, &error);
        let mut r = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        r.last_error = Some(error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiscoveredEndpoint, EndpointKind};

    fn text(model: &str) -> String {
        format!(
            "docker: {{ enabled: true, adopt_unconfigured: true }}\nmodels:\n  a: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\", model: {model} }}\n"
        )
    }

    /// File reloads and discovery installs interleave freely; the file's newest text always
    /// wins, and discovery's endpoints are kept on top of it.
    #[test]
    fn discovery_never_reverts_a_file_reload() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, text("v1")).unwrap();
        let cfg = Config::load_file(&path).unwrap();
        let state = AppState::new(
            cfg,
            StoreHandle::off("test".into()),
            Some(path.clone()),
            &[],
            vec![],
        );
        let svc = DiscoveredEndpoint {
            name: "svc".into(),
            kind: EndpointKind::Vllm,
            model: None,
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..200 {
                    let wanted = if i % 2 == 0 {
                        vec![svc.clone()]
                    } else {
                        vec![]
                    };
                    state.install_discovered(wanted).unwrap();
                }
                state.install_discovered(vec![svc.clone()]).unwrap();
            });
            s.spawn(|| {
                for i in 0..50 {
                    std::fs::write(&path, text(&format!("v{}", i + 2))).unwrap();
                    assert!(crate::ops::reload::reload_now(&state, &path));
                }
            });
        });
        let live = state.config.load();
        assert_eq!(
            live.endpoints["a"].upstream_model, "v51",
            "the newest file text is live"
        );
        assert!(
            live.endpoints.contains_key("svc"),
            "discovery's endpoint is kept"
        );
        assert!(
            matches!(&live.source, crate::config::Source::File(p) if *p == path),
            "{:?}",
            live.source
        );
    }
}
