//! Shared state: the live config snapshot (swapped atomically on reload), the endpoint registry,
//! and the audit store's handle.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;

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
        })
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
