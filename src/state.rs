//! Shared state: the live config snapshot (swapped atomically on reload), the endpoint registry,
//! and the audit store's handle.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use std::sync::atomic::{AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::registry::Registry;
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
    pub docker: crate::discovery::SharedStatus,
    /// Endpoints discovery added to the table (kept across file reloads).
    pub discovered: Mutex<Vec<crate::config::DiscoveredEndpoint>>,
    /// Cancelled when `shutdown_grace` is over: requests still running are cut (and recorded
    /// with class `shutdown`) so the audit trail is complete before the process exits.
    pub hard_stop: CancellationToken,
    /// Requests being served (handler running or stream body alive).
    inflight: Arc<AtomicUsize>,
    /// Serializes config installs (file reloads, SIGHUP, discovery): each builds from the
    /// newest inputs under this lock, so none installs a table older than another's.
    pub install_lock: tokio::sync::Mutex<()>,
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
    ) -> Arc<AppState> {
        let registry = Registry::new(store.clone());
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
            inflight: Arc::new(AtomicUsize::new(0)),
            install_lock: tokio::sync::Mutex::new(()),
        })
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
        self.config.store(Arc::new(cfg));
        let mut r = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        r.reloads += 1;
        r.last_ok = Some(SystemTime::now());
        r.last_error = None;
    }

    pub fn reload_failed(&self, error: String) {
        let mut r = self.reload.lock().unwrap_or_else(|e| e.into_inner());
        r.last_error = Some(error);
    }
}
