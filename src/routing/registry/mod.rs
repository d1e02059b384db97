//! Live per-endpoint state, keyed by endpoint name so it survives config reloads: outcome window,
//! latency, cooldown, retirement, failed keys. Each endpoint's state sits behind its own short
//! `std::sync::Mutex` (never held across an await). Transitions that matter to operators are sent
//! to the audit store as `endpoint_events`.

use std::collections::BTreeSet;

/// Maps looked up by endpoint name on every request: foldhash, several times cheaper than
/// SipHash for short keys (the names come from the operator's config, not from clients).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::config::{Endpoint, Policy};
use crate::routing::observed::Fact;
pub use crate::routing::router::Avail;
use crate::routing::stats::{Counts, Ewma, LatencySample, RollingWindow};
use crate::store::{EndpointEvent, StoreHandle};

mod addresses;
mod apply;
mod discovered;
mod facts;
mod health;
mod keys;
mod learned;
mod memo;
mod status;
mod sync;
mod view;

pub use addresses::{Picked, Want, tuning};
pub use apply::Effect;
pub use keys::KeyPick;
use memo::next_generation;
pub use status::ENDPOINT_STATES;

/// Recent latencies kept per endpoint for percentiles.
const LATENCY_SAMPLES: usize = 512;

#[derive(Debug)]
struct Retirement {
    reason: String,
    fingerprint: String,
}

#[derive(Debug)]
pub struct EndpointRuntime {
    window: RollingWindow,
    latency: Ewma,
    samples: LatencySample,
    cooldown_until: Option<Instant>,
    /// When the current (or last) cooldown began.
    cooldown_from: Option<Instant>,
    cooldown_reason: Option<String>,
    retired: Option<Retirement>,
    auth_failed: Option<String>,
    /// Hashes of rejected key values (see `ApiKey::hash`): a replaced value starts afresh.
    dead_keys: BTreeSet<String>,
    key_cursor: usize,
    last_error: Option<(String, SystemTime)>,
    requests: u64,
    successes: u64,
    failures: u64,
    tokens_in: u64,
    tokens_out: u64,
    tokens_estimated: u64,
    fingerprint: String,
    probe: Option<crate::routing::observed::ProbeReport>,
    /// A context limit an upstream's own error stated (smaller than configured, or none was).
    learned_window: Option<LearnedWindow>,
    /// A probe of the gateway's own (`POST /responses` with no client content) answered 404
    /// (or 405): `/v1/responses` goes to it by translation to chat from now on (until its
    /// fingerprint changes or an operator clears it). The client answer that raised the
    /// question, for `/status`.
    chat_only: Option<String>,
    /// When the last probe of its `/responses` route started (at most one a minute).
    responses_probed: Option<Instant>,
    health: crate::routing::health::Health,
    /// Where Docker discovery says the endpoint runs now (`http://ip:port`), if it does.
    discovered: Option<crate::routing::observed::Discovered>,
    /// The last non-empty set of discovered addresses (sorted).
    last_addresses: Vec<String>,
    /// The endpoint's addresses and each one's load, latency and ejection (`base_urls`, or the
    /// discovered tasks; empty for one static address).
    addresses: Arc<Mutex<crate::routing::balance::Addresses>>,
    /// Rate-limit budgets the upstream's headers announced, per key (its value's hash; `""` for
    /// an endpoint without keys).
    limits: HashMap<String, crate::routing::ratelimit::Limits>,
    /// When the endpoint last came back from unhealthy, warming or ejection (slow start).
    recovered_at: Option<Instant>,
    /// It has been available before: only then is becoming available a *recovery*. An endpoint
    /// discovered for the first time (or a gateway starting) takes its full share at once, as
    /// Envoy does not slow-start the hosts a cluster starts with.
    been_serving: bool,
    /// Recent latencies sorted, for hedge delays (re-sorted at most every `SORTED_TTL`).
    sorted: Option<(Instant, Arc<Vec<f64>>)>,
}

/// A context window learned from an upstream's context-length error, and the request whose error
/// taught it (shown in `/status`, so an operator can find the answer that did it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LearnedWindow {
    pub tokens: u64,
    pub request_id: String,
}

/// No window is learned below this: a stated limit of a few tokens is a message quoting something
/// else, not a model (the smallest served models hold 512).
pub const MIN_LEARNED_WINDOW: u64 = 64;

impl EndpointRuntime {
    fn new(policy: &Policy, fingerprint: &str) -> Self {
        EndpointRuntime {
            window: RollingWindow::new(policy.window),
            latency: Ewma::new(0.2),
            samples: LatencySample::new(LATENCY_SAMPLES),
            cooldown_until: None,
            cooldown_from: None,
            cooldown_reason: None,
            retired: None,
            auth_failed: None,
            dead_keys: BTreeSet::new(),
            key_cursor: 0,
            last_error: None,
            requests: 0,
            successes: 0,
            failures: 0,
            tokens_in: 0,
            tokens_out: 0,
            tokens_estimated: 0,
            fingerprint: fingerprint.to_string(),
            probe: None,
            learned_window: None,
            chat_only: None,
            responses_probed: None,
            health: crate::routing::health::Health::default(),
            discovered: None,
            last_addresses: Vec::new(),
            addresses: Default::default(),
            limits: HashMap::default(),
            recovered_at: None,
            been_serving: true,
            sorted: None,
        }
    }

    /// The share of its traffic the endpoint takes now, when it is in its slow start (after a
    /// recovery, over `window`) or warming (over `warmup`): the smaller.
    pub fn slow_start(&self, now: Instant, window: Duration, warmup: Duration) -> Option<f64> {
        let cooldown = self.cooldown_from.zip(self.cooldown_until);
        let slow =
            crate::routing::router::slow_start_share(self.recovered_at, cooldown, now, window);
        let warming = self.health.warming_share(now, warmup);
        match (slow, warming) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Keys of `ep` that resolved and have not been rejected.
    fn usable_keys(&self, ep: &Endpoint) -> usize {
        ep.keys
            .iter()
            .filter(|k| k.value.is_some() && !self.dead_keys.contains(&k.hash))
            .count()
    }

    pub fn avail(&self, now: Instant) -> Avail {
        if self.retired.is_some() {
            return Avail::Retired;
        }
        if self.auth_failed.is_some() {
            return Avail::AuthFailed;
        }
        if let Some(until) = self.cooldown_until
            && until > now
        {
            return Avail::Cooldown(until - now);
        }
        match self.health.verdict(now) {
            crate::routing::health::Verdict::Healthy => Avail::Ready,
            crate::routing::health::Verdict::Degraded => Avail::Degraded,
            // Served at its warming share (`slow_start`).
            crate::routing::health::Verdict::Warming { .. } => Avail::Ready,
            crate::routing::health::Verdict::Skip { state, reason, .. } => {
                Avail::Unhealthy { state, reason }
            }
        }
    }

    pub fn counts(&self, now: Instant) -> Counts {
        self.window.counts(now)
    }
}

/// All endpoints' live state.
pub struct Registry {
    map: RwLock<HashMap<String, Arc<Mutex<EndpointRuntime>>>>,
    /// Which map [`Registry::get`]'s per-thread memo may answer for: unique to this registry
    /// and changed by every [`Registry::sync`] (a process-wide count, so two registries never
    /// share one).
    generation: AtomicU64,
    store: StoreHandle,
    /// Endpoint events an operator must hear about become alerts.
    alerts: Option<crate::ops::alerts::Alerts>,
    /// With `cluster:`: where what this replica learns goes, for the others (never waited on).
    facts: std::sync::OnceLock<tokio::sync::mpsc::Sender<Fact>>,
    /// Told when an endpoint is ejected: the prober, waiting out its interval, probes sooner.
    ejections: tokio::sync::Notify,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Registry {
    pub fn new(store: StoreHandle) -> Self {
        Registry {
            map: RwLock::new(HashMap::default()),
            generation: AtomicU64::new(next_generation()),
            store,
            alerts: None,
            facts: std::sync::OnceLock::new(),
            ejections: tokio::sync::Notify::new(),
        }
    }

    pub fn with_alerts(mut self, alerts: crate::ops::alerts::Alerts) -> Self {
        self.alerts = Some(alerts);
        self
    }

    /// Records an endpoint event from outside the registry (probes, hooks).
    pub fn record_event(&self, endpoint: &str, event: &str, reason: &str) {
        self.event(endpoint, event, reason);
    }

    fn event(&self, endpoint: &str, event: &str, reason: &str) {
        tracing::info!(endpoint, event, reason, "endpoint event");
        if let Some(a) = &self.alerts {
            a.endpoint_event(endpoint, event, reason);
        }
        self.store.send(crate::store::Record::Event(EndpointEvent {
            ts: SystemTime::now(),
            endpoint: endpoint.to_string(),
            event: event.to_string(),
            reason: reason.to_string(),
        }));
    }

    pub fn with<R>(&self, name: &str, f: impl FnOnce(&EndpointRuntime) -> R) -> Option<R> {
        let rt = self.get(name)?;
        let g = lock(&rt);
        Some(f(&g))
    }
}

/// Locks an endpoint's state. A poisoned lock (a panic while held) still holds consistent
/// counters, so it is used rather than propagating the panic to every later request.
pub fn lock(m: &Mutex<EndpointRuntime>) -> std::sync::MutexGuard<'_, EndpointRuntime> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
