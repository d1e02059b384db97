//! The keeper: heartbeats that count the live replicas, the store marked down and back up, and
//! the retries with backoff while it is away.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::facts::{listener, sharer};
use super::lease::lease_keeper;
use super::settle::settler;
use super::{
    BACKGROUND_TIMEOUT, Cluster, FIRST_BACKOFF, MAX_BACKOFF, SETTLE_QUEUE, SPEND_TTL, scrub,
};
use crate::config::AlertEvent;
use crate::routing::observed::Fact;

/// How often a replica says it is alive; it counts as gone after [`ALIVE_FOR`].
const HEARTBEAT: Duration = Duration::from_secs(1);
const ALIVE_FOR: Duration = Duration::from_secs(5);

/// The store's state as `/status` shows it.
#[derive(Debug, Default)]
pub(super) struct Status {
    last_error: Option<String>,
    /// When `last_error` happened (it stays after the store is back).
    last_error_at: Option<SystemTime>,
    down_since: Option<SystemTime>,
    last_ok: Option<SystemTime>,
    /// Up without a break since.
    up_since: Option<std::time::Instant>,
    outages: u64,
}

impl Cluster {
    /// Live replicas as last seen (at least 1, at least `cluster.replicas` before the store
    /// was ever seen): what limits are split by while the store is away.
    pub fn replicas(&self) -> u64 {
        self.replicas.load(Ordering::Relaxed).max(1)
    }

    /// The store counted `n` live replicas: remembered, and kept in the data dir when it
    /// changed (written whole, then renamed over the old).
    fn saw_replicas(&self, n: u64) {
        let n = n.clamp(1, 10_000);
        if self.replicas.swap(n, Ordering::Relaxed) == n && self.ever_up.load(Ordering::Acquire) {
            return;
        }
        if let Some(path) = &self.replicas_file {
            let tmp = path.with_extension("tmp");
            let kept =
                std::fs::write(&tmp, n.to_string()).and_then(|()| std::fs::rename(&tmp, path));
            if let Err(e) = kept {
                tracing::debug!(error = %e, "the replica count could not be kept in the data dir");
            }
        }
    }

    pub(super) fn note_error(&self, error: &str) {
        let error = scrub(&self.settings, error);
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        st.last_error = Some(error);
        st.last_error_at = Some(SystemTime::now());
    }

    /// Up without a break for a minute (a bucket's whole refill): a key's shares from an outage
    /// before may be forgotten.
    pub fn stable(&self) -> bool {
        self.is_up()
            && self
                .status
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .up_since
                .is_some_and(|t| t.elapsed() >= Duration::from_secs(60))
    }

    /// The store is away: requests admit locally until the keeper sees it back.
    pub(super) fn down(&self, error: &str) {
        let error = scrub(&self.settings, error);
        let was_up = self.up.swap(false, Ordering::AcqRel);
        // Leases are not spent while the store is away: the shares split by the replicas are the
        // whole allowance then (their units stay taken: never more than the limits in total).
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).clear();
        {
            let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
            st.last_error = Some(error.clone());
            st.last_error_at = Some(SystemTime::now());
            st.up_since = None;
            if was_up || st.down_since.is_none() {
                st.down_since.get_or_insert_with(SystemTime::now);
            }
            if was_up {
                st.outages += 1;
            }
        }
        if was_up {
            tracing::warn!(store = %self.settings.display, error = %error, replicas = self.replicas(), "cluster store unreachable: client limits are split by the replicas last seen until it is back");
            self.alerts.raise(
                AlertEvent::ClusterStoreDown,
                None,
                format!(
                    "cluster store {} unreachable ({error}); replica {} admits on its own with client limits split by {}",
                    self.settings.display,
                    self.replica,
                    self.replicas()
                ),
            );
        }
        self.wake.notify_one();
    }

    fn back_up(&self) {
        {
            let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
            st.down_since = None;
            st.last_ok = Some(SystemTime::now());
            st.up_since.get_or_insert_with(std::time::Instant::now);
        }
        if !self.up.swap(true, Ordering::AcqRel) {
            let first = !self.ever_up.swap(true, Ordering::AcqRel);
            if first {
                tracing::info!(store = %self.settings.display, replicas = self.replicas(), "cluster store connected");
            } else {
                tracing::info!(store = %self.settings.display, replicas = self.replicas(), "cluster store back: client limits are shared again");
            }
        }
        self.back.notify_waiters();
    }

    /// `/status.cluster`.
    pub fn status_json(&self) -> Value {
        let st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let ms = |t: Option<SystemTime>| {
            t.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as u64)
        };
        json!({
            "state": if self.is_up() { "up" } else if self.ever_up.load(Ordering::Acquire) { "down" } else { "connecting" },
            "store": self.settings.display,
            "key_prefix": self.settings.key_prefix,
            "timeout_ms": self.settings.timeout.as_millis() as u64,
            "replica": self.replica,
            "replicas": self.replicas(),
            "last_error": st.last_error,
            "last_error_ms": ms(st.last_error_at),
            "down_since_ms": ms(st.down_since),
            "outages": st.outages,
            "local_admissions": self.fallbacks.load(Ordering::Relaxed),
            "store_admissions": self.store_admissions.load(Ordering::Relaxed),
            "admission_calls": self.admission_calls.load(Ordering::Relaxed),
            "settles_carried": self.settles_carried.load(Ordering::Relaxed),
            "lease_admissions": self.lease_admissions.load(Ordering::Relaxed),
            "leases_granted": self.leases_granted.load(Ordering::Relaxed),
            "leases_returned": self.leases_returned.load(Ordering::Relaxed),
            "slow_answers": self.slow_answers.load(Ordering::Relaxed),
            "longest_wait_ms": self.longest_wait_us.load(Ordering::Relaxed) as f64 / 1000.0,
            "settles_queued": SETTLE_QUEUE - self.settles.capacity(),
            "settles_dropped": self.settles_dropped.load(Ordering::Relaxed),
            "facts_shared": self.facts_shared.load(Ordering::Relaxed),
            "facts_applied": self.facts_applied.load(Ordering::Relaxed),
        })
    }

    /// Whether `/health` should say `degraded`: the store has been away since the last call.
    pub fn unreachable(&self) -> bool {
        !self.is_up()
    }

    /// Live replicas, and the store's epoch (it changes when the store restarts empty).
    async fn beat(&self) -> Result<(u64, String), String> {
        let mut inv = self.heartbeat.prepare_invoke();
        inv.key(self.key(&["replicas"]))
            .key(self.key(&["epoch"]))
            .arg(&self.replica)
            .arg(ALIVE_FOR.as_millis() as u64)
            .arg(uuid::Uuid::new_v4().to_string());
        self.call::<(u64, String)>(&inv).await
    }

    /// Raises the shared spend of each (key, month) to what this replica knows.
    async fn seed(&self, spend: &[(String, String, f64)]) -> Result<(), String> {
        for (client, month, usd) in spend {
            // What the settles still on their way bring themselves is left out.
            let coming = self
                .unsettled_usd
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&(client.clone(), month.clone()))
                .copied()
                .unwrap_or(0.0);
            let usd = &(usd - coming);
            if !usd.is_finite() || *usd <= 0.0 {
                continue;
            }
            let mut inv = self.seed.prepare_invoke();
            inv.key(self.key(&["spend", client, month]))
                .arg(*usd)
                .arg(SPEND_TTL.as_secs());
            self.call::<i64>(&inv).await?;
        }
        Ok(())
    }

    /// Waits until the store is back (or [`MAX_BACKOFF`] passed, to look again); false when
    /// the gateway is stopping.
    pub(super) async fn until_back(&self, cancel: &CancellationToken) -> bool {
        let back = self.back.notified();
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = back => true,
            _ = tokio::time::sleep(MAX_BACKOFF) => true,
        }
    }

    /// Leaves the replica set (a clean shutdown): the others split by one fewer at once.
    async fn leave(&self) {
        let mut conn = self.conn.clone();
        let _ = tokio::time::timeout(
            BACKGROUND_TIMEOUT,
            redis::cmd("ZREM")
                .arg(self.key(&["replicas"]))
                .arg(&self.replica)
                .query_async::<i64>(&mut conn),
        )
        .await;
    }
}

/// What the keeper needs of the gateway, as plain functions (the cluster imports nothing of the
/// state it serves).
pub struct Hooks {
    /// Each key's month as this replica knows it (seeding the store when it comes back).
    pub spend: Box<dyn Fn() -> Vec<(String, String, f64)> + Send + Sync>,
    /// The endpoints of the running table (whose stored facts to read).
    pub endpoints: Box<dyn Fn() -> Vec<String> + Send + Sync>,
    /// Applies a fact another replica learned.
    pub apply: Box<dyn Fn(Fact) + Send + Sync>,
    /// What this replica knows that the fleet shares (a store restarted empty is filled again).
    pub known: Box<dyn Fn() -> Vec<Fact> + Send + Sync>,
    /// What this replica learns (the registry's queue).
    pub facts: mpsc::Receiver<Fact>,
}

/// The keeper: heartbeats (counting the replicas), marks the store down and up, seeds the
/// shared spend when it comes back, and applies queued settles while it is up.
pub async fn run(cluster: Arc<Cluster>, hooks: Hooks, cancel: CancellationToken) {
    let Hooks {
        spend,
        endpoints,
        apply,
        known,
        facts,
    } = hooks;
    // What the store learns from this replica when it comes back (or back empty): the month's
    // spend, and what this replica knows of the endpoints (stored, not published: the running
    // replicas know it or learned it themselves).
    let refill = |cluster: Arc<Cluster>| {
        let (spend, known) = (spend(), known());
        async move {
            cluster.seed(&spend).await?;
            for f in &known {
                cluster.share_fact(f, false).await?;
            }
            Ok::<(), String>(())
        }
    };
    let apply: Arc<dyn Fn(Fact) + Send + Sync> = Arc::from(apply);
    let settler = tokio::spawn(settler(cluster.clone(), cancel.clone()));
    let lessor = tokio::spawn(lease_keeper(cluster.clone(), cancel.clone()));
    let sharer = tokio::spawn(sharer(cluster.clone(), facts, cancel.clone()));
    let listener = tokio::spawn(listener(
        cluster.clone(),
        Arc::from(endpoints),
        apply,
        cancel.clone(),
    ));
    let mut backoff = FIRST_BACKOFF;
    let mut epoch = String::new();
    loop {
        let wait = match cluster.beat().await {
            Ok((n, now_epoch)) => {
                cluster.saw_replicas(n);
                // Restarted empty between two heartbeats (the connection manager reconnected
                // on its own): seeded again as after an outage, by every replica.
                let fresh = std::mem::replace(&mut epoch, now_epoch) != epoch;
                if fresh && cluster.is_up() {
                    tracing::warn!(store = %cluster.settings.display, "cluster store restarted empty: filling it with this replica's spend and endpoint knowledge");
                    if let Err(e) = refill(cluster.clone()).await {
                        cluster.down(&e);
                    }
                }
                if !cluster.is_up() {
                    match refill(cluster.clone()).await {
                        Ok(()) => {
                            cluster.back_up();
                            backoff = FIRST_BACKOFF;
                        }
                        Err(e) => cluster.down(&e),
                    }
                }
                if cluster.is_up() { HEARTBEAT } else { backoff }
            }
            Err(e) => {
                cluster.down(&e);
                let w = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                w
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
            // A request found the store away: retry sooner than the heartbeat would.
            _ = cluster.wake.notified(), if cluster.is_up() => {}
        }
    }
    lessor.abort();
    if cluster.is_up() {
        if let Err(e) = cluster.give_back(true).await {
            tracing::debug!(error = %scrub(&cluster.settings, &e), "leases not given back at shutdown");
        }
        cluster.leave().await;
    }
    settler.abort();
    sharer.abort();
    listener.abort();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Settings, test_util::settings};

    /// The replica count outlives a restart (the data dir), and `cluster.replicas` covers a
    /// replica that never saw the store.
    #[tokio::test]
    async fn the_fleet_size_is_kept_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let c = Cluster::new(settings("redis://127.0.0.1:1/0"), alerts, Some(dir.path())).unwrap();
        assert_eq!(c.replicas(), 1);
        c.saw_replicas(3);
        drop(c);
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let c = Cluster::new(settings("redis://127.0.0.1:1/0"), alerts, Some(dir.path())).unwrap();
        assert_eq!(c.replicas(), 3, "read back after a restart");
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let fresh = tempfile::tempdir().unwrap();
        let c = Cluster::new(
            Settings {
                replicas: Some(4),
                ..settings("redis://127.0.0.1:1/0")
            },
            alerts,
            Some(fresh.path()),
        )
        .unwrap();
        assert_eq!(
            c.replicas(),
            4,
            "cluster.replicas for one that never saw the store"
        );
        // A hostile file is ignored.
        std::fs::write(fresh.path().join("cluster-replicas"), "99999999999").unwrap();
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let c = Cluster::new(
            settings("redis://127.0.0.1:1/0"),
            alerts,
            Some(fresh.path()),
        )
        .unwrap();
        assert_eq!(c.replicas(), 1);
    }
}
