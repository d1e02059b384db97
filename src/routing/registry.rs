//! Live per-endpoint state, keyed by endpoint name so it survives config reloads: outcome window,
//! latency, cooldown, retirement, failed keys. Each endpoint's state sits behind its own short
//! `std::sync::Mutex` (never held across an await). Transitions that matter to operators are sent
//! to the audit store as `endpoint_events`.

use std::collections::BTreeSet;

/// Maps looked up by endpoint name on every request: foldhash, several times cheaper than
/// SipHash for short keys (the names come from the operator's config, not from clients).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::config::{Config, Endpoint, Policy};
use crate::routing::observed::Fact;
pub use crate::routing::router::Avail;
use crate::routing::stats::{Counts, Ewma, LatencySample, RollingWindow};
use crate::store::{EndpointEvent, PersistedStats, StoreHandle};

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

/// The per-request draw slow start compares with its share. A debug build whose environment
/// sets `AUTOHEDGE_TEST_SEED` draws from one seeded sequence instead (splitmix64 over a shared
/// counter), so a test of the share is reproducible rather than failing one run in hundreds.
fn roll() -> f64 {
    #[cfg(debug_assertions)]
    {
        static SEEDED: std::sync::LazyLock<Option<std::sync::atomic::AtomicU64>> =
            std::sync::LazyLock::new(|| {
                std::env::var("AUTOHEDGE_TEST_SEED")
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(std::sync::atomic::AtomicU64::new)
            });
        if let Some(state) = SEEDED.as_ref() {
            let mut z = state
                .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
                .wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            return (z >> 11) as f64 / (1u64 << 53) as f64;
        }
    }
    fastrand::f64()
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

/// How stale the sorted latencies behind a hedge's percentile delay may be.
const SORTED_TTL: Duration = Duration::from_millis(250);

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
            limits: HashMap::default(),
            recovered_at: None,
            been_serving: true,
            sorted: None,
        }
    }

    /// The share of its traffic the endpoint takes now, when it is in its slow start.
    pub fn slow_start(&self, now: Instant, window: Duration) -> Option<f64> {
        let cooldown = self.cooldown_from.zip(self.cooldown_until);
        crate::routing::router::slow_start_share(self.recovered_at, cooldown, now, window)
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
}

/// Which API key an attempt uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyPick {
    /// The endpoint has no keys configured (a local server).
    NotNeeded,
    /// Use key number `n` of the endpoint's list.
    Use(usize),
    /// Keys are configured but none is usable.
    Exhausted,
    /// Usable keys exist, but every one's rate-limit budget is predicted too small for this
    /// request for at least this long.
    Limited(Duration, crate::routing::ratelimit::Short),
}

/// Longest endpoint name [`Registry::get`] remembers (longer ones are looked up every time).
const MEMO_NAME: usize = 48;

/// The endpoint [`Registry::get`] found last on this thread.
struct Got {
    generation: u64,
    len: usize,
    bytes: [u8; MEMO_NAME],
    runtime: Arc<Mutex<EndpointRuntime>>,
}

impl Got {
    fn name(&self) -> Option<&[u8]> {
        self.bytes.get(..self.len)
    }
}

thread_local! {
    static LAST_GOT: std::cell::RefCell<Option<Got>> = const { std::cell::RefCell::new(None) };
}

/// A generation no registry has had: registries start with one and every sync takes a new one.
fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What one attempt's outcome does to the endpoint's state.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Served: counts as a success.
    Success { latency_ms: f64 },
    /// Counts against the endpoint (connect error, timeout, 5xx, broken stream).
    Failure {
        class: crate::routing::outcome::Outcome,
        detail: String,
    },
    /// 429: no health penalty, but no traffic until the cooldown ends.
    Cooldown { for_: Duration, detail: String },
    /// 410: out of rotation until the config changes it or an operator clears it.
    Retire { detail: String },
    /// 401/403 with key `key`.
    KeyRejected { key: usize, detail: String },
}

impl Registry {
    pub fn new(store: StoreHandle) -> Self {
        Registry {
            map: RwLock::new(HashMap::default()),
            generation: AtomicU64::new(next_generation()),
            store,
            alerts: None,
            facts: std::sync::OnceLock::new(),
        }
    }

    /// Shares what this replica learns from now on (`cluster:`).
    pub fn share_with(&self, tx: tokio::sync::mpsc::Sender<Fact>) {
        let _ = self.facts.set(tx);
    }

    fn share(&self, fact: Fact) {
        if let Some(tx) = self.facts.get() {
            // A full queue loses a fact for the other replicas only: they learn it themselves.
            let _ = tx.try_send(fact);
        }
    }

    /// What this replica knows about `endpoints` that the fleet shares (a cooldown still
    /// running, a retirement, rejected keys, a learned window), as facts: a store restarted
    /// empty is filled again from them.
    pub fn known_facts<'a>(&self, endpoints: impl IntoIterator<Item = &'a Endpoint>) -> Vec<Fact> {
        let now = Instant::now();
        let mut out = Vec::new();
        for ep in endpoints {
            let Some(rt) = self.get(&ep.name) else {
                continue;
            };
            let rt = lock(&rt);
            let (endpoint, fingerprint) = (ep.name.clone(), ep.fingerprint.clone());
            if let Some(until) = rt.cooldown_until.filter(|u| *u > now) {
                out.push(Fact::Cooldown {
                    endpoint: endpoint.clone(),
                    fingerprint: fingerprint.clone(),
                    until_unix_ms: (SystemTime::now() + (until - now))
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(0),
                    detail: rt.cooldown_reason.clone().unwrap_or_default(),
                });
            }
            if let Some(r) = rt
                .retired
                .as_ref()
                .filter(|r| r.fingerprint == ep.fingerprint)
            {
                out.push(Fact::Retired {
                    endpoint: endpoint.clone(),
                    fingerprint: fingerprint.clone(),
                    detail: r.reason.clone(),
                });
            }
            for key in &rt.dead_keys {
                out.push(Fact::KeyRejected {
                    endpoint: endpoint.clone(),
                    fingerprint: fingerprint.clone(),
                    key: key.clone(),
                    detail: "rejected (as this replica knew it when the store restarted)".into(),
                });
            }
            if let Some(w) = &rt.learned_window {
                out.push(Fact::Window {
                    endpoint: endpoint.clone(),
                    fingerprint: fingerprint.clone(),
                    tokens: w.tokens,
                    request_id: w.request_id.clone(),
                });
            }
        }
        out
    }

    /// Applies what another replica learned, when this replica's endpoint of that name has the
    /// same definition. Nothing is shared back. Values are bounded as if from an upstream: a
    /// cooldown of at most an hour, a window no smaller than [`MIN_LEARNED_WINDOW`] nor than
    /// what the endpoint served here.
    pub fn apply_fact(&self, ep: &Endpoint, fact: Fact) {
        let Some(rt) = self.get(&ep.name) else {
            return;
        };
        let same = |fp: &str| fp == ep.fingerprint;
        match fact {
            Fact::Cooldown {
                fingerprint,
                until_unix_ms,
                detail,
                ..
            } if same(&fingerprint) => {
                let now_ms = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                let left = Duration::from_millis(until_unix_ms.saturating_sub(now_ms))
                    .min(Duration::from_secs(3600));
                if left.is_zero() {
                    return;
                }
                let now = Instant::now();
                let mut rt = lock(&rt);
                if rt.cooldown_until.is_none_or(|u| u <= now) {
                    rt.cooldown_from = Some(now);
                }
                rt.cooldown_until =
                    Some(rt.cooldown_until.map_or(now + left, |u| u.max(now + left)));
                rt.cooldown_reason = Some(format!("{detail} (seen by another replica)"));
            }
            Fact::Retired {
                fingerprint,
                detail,
                ..
            } if same(&fingerprint) => {
                let mut rt = lock(&rt);
                if rt.retired.is_some() {
                    return;
                }
                rt.retired = Some(Retirement {
                    reason: detail.clone(),
                    fingerprint: ep.fingerprint.clone(),
                });
                drop(rt);
                self.store
                    .send_flag(&ep.name, Some(&detail), Some(&ep.fingerprint));
                self.event(
                    &ep.name,
                    "retired",
                    &format!("{detail} (seen by another replica)"),
                );
            }
            Fact::KeyRejected {
                fingerprint,
                key,
                detail,
                ..
            } if same(&fingerprint) => {
                let mut rt = lock(&rt);
                if !ep.keys.iter().any(|k| k.hash == key) || !rt.dead_keys.insert(key) {
                    return;
                }
                let left = ep
                    .keys
                    .iter()
                    .any(|k| k.value.is_some() && !rt.dead_keys.contains(&k.hash));
                if !left {
                    rt.auth_failed = Some(format!("{detail} (seen by another replica)"));
                }
            }
            Fact::Window {
                fingerprint,
                tokens,
                request_id,
                ..
            } if same(&fingerprint) => {
                self.learn_window_from(ep, tokens, &request_id, false);
            }
            Fact::Cleared { .. } => {
                self.clear_from(&ep.name, false);
            }
            Fact::RateLimit {
                fingerprint,
                key,
                requests,
                tokens,
                at_unix_ms,
                ..
            } if same(&fingerprint) => {
                if !(key.is_empty() || ep.keys.iter().any(|k| k.hash == key)) {
                    return;
                }
                // An hour at most, as every reset the gateway reads.
                let budget = |b: Option<(Option<u64>, u64, u64)>| {
                    b.map(|(l, r, ms)| (l, r, Duration::from_millis(ms.min(3_600_000))))
                };
                let seen = crate::routing::ratelimit::Observed {
                    requests: budget(requests),
                    tokens: budget(tokens),
                };
                let now = Instant::now();
                let age =
                    Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(at_unix_ms));
                let Some(at) = now.checked_sub(age) else {
                    return;
                };
                let mut rt = lock(&rt);
                match rt.limits.get_mut(&key) {
                    Some(l) => l.observe_shared(&seen, at, now),
                    None => {
                        let mut l = crate::routing::ratelimit::Limits::default();
                        l.observe_shared(&seen, at, now);
                        rt.limits.insert(key, l);
                    }
                }
            }
            _ => {}
        }
    }

    pub fn with_alerts(mut self, alerts: crate::ops::alerts::Alerts) -> Self {
        self.alerts = Some(alerts);
        self
    }

    /// An endpoint's runtime state. A request asks for the same endpoint's several times (its
    /// view, key pick, rate-limit reading, outcome, tokens): the last one found is remembered
    /// per thread, with the name (as bytes, when short) and the generation of the map it came
    /// from, and given again without the lock and the hash while both still match.
    pub fn get(&self, name: &str) -> Option<Arc<Mutex<EndpointRuntime>>> {
        let generation = self.generation.load(Ordering::Acquire);
        let hit = LAST_GOT.with_borrow(|last| {
            last.as_ref()
                .filter(|l| l.generation == generation && l.name() == Some(name.as_bytes()))
                .map(|l| l.runtime.clone())
        });
        if hit.is_some() {
            return hit;
        }
        let runtime = self.map.read().ok()?.get(name).cloned()?;
        if name.len() <= MEMO_NAME {
            let mut bytes = [0; MEMO_NAME];
            bytes[..name.len()].copy_from_slice(name.as_bytes());
            LAST_GOT.set(Some(Got {
                generation,
                len: name.len(),
                bytes,
                runtime: runtime.clone(),
            }));
        }
        Some(runtime)
    }

    /// Brings the registry in line with a new config: new endpoints get fresh state, removed
    /// ones are dropped, and kept ones keep their stats. A retirement or auth failure made under
    /// a different endpoint definition is lifted: the operator changed what the endpoint is.
    pub fn sync(&self, cfg: &Config, persisted: &[PersistedStats]) {
        let now = Instant::now();
        let Ok(mut map) = self.map.write() else {
            return;
        };
        // What any thread remembers of the map before this sync is not given again.
        self.generation.store(next_generation(), Ordering::Release);
        map.retain(|name, _| cfg.endpoints.contains_key(name));
        for (name, ep) in &cfg.endpoints {
            let fresh = |persisted: &[PersistedStats]| {
                let mut rt = EndpointRuntime::new(&cfg.policy, &ep.fingerprint);
                if ep.discover {
                    rt.health
                        .observe_docker(now, Some("not discovered yet".into()));
                    rt.been_serving = false;
                }
                if let Some(p) = persisted.iter().find(|p| &p.endpoint == name) {
                    rt.latency = Ewma::seeded(0.2, p.ewma_latency_ms);
                    rt.requests = p.requests;
                    rt.successes = p.successes;
                    rt.failures = p.failures;
                    // Only what was learned from the server this definition names.
                    if p.learned_window_fingerprint.as_deref() == Some(ep.fingerprint.as_str()) {
                        rt.learned_window = p.learned_context_window.map(|tokens| LearnedWindow {
                            tokens,
                            request_id: p.learned_window_request.clone().unwrap_or_default(),
                        });
                    }
                    if let Some(reason) = &p.retired_reason {
                        if p.retired_fingerprint.as_deref() == Some(ep.fingerprint.as_str()) {
                            rt.retired = Some(Retirement {
                                reason: reason.clone(),
                                fingerprint: ep.fingerprint.clone(),
                            });
                        } else {
                            // Retired under another definition, changed while we were down.
                            self.event(
                                name,
                                "unretired",
                                "endpoint definition changed in the config",
                            );
                            self.store.send_flag(name, None, None);
                        }
                    }
                }
                rt
            };
            let entry = map
                .entry(name.clone())
                .or_insert_with(|| Arc::new(Mutex::new(fresh(persisted))));
            let mut rt = lock(entry);
            rt.window.resize(cfg.policy.window, now);
            if rt.fingerprint != ep.fingerprint {
                // Another server (type, base URL, model, or discovered ↔ static) under the same
                // name: nothing learned about the old one — its window, cooldown, health,
                // ejection, retirement, rejected keys, Docker's word — is true of this one.
                let old = std::mem::replace(&mut *rt, fresh(&[]));
                drop(rt);
                if old.learned_window.is_some() {
                    self.store.send(crate::store::Record::LearnedWindow {
                        endpoint: name.clone(),
                        learned: None,
                    });
                }
                if old.retired.is_some() {
                    self.store.send_flag(name, None, None);
                }
                self.event(
                    name,
                    "redefined",
                    "endpoint definition changed in the config: its learned state starts afresh",
                );
                continue;
            }
            // A rejection stays with the value it was made against: a key whose value was
            // replaced (file rewritten, env var changed, literal edited) starts afresh.
            rt.dead_keys
                .retain(|h| ep.keys.iter().any(|k| k.value.is_some() && &k.hash == h));
            let usable = ep
                .keys
                .iter()
                .any(|k| k.value.is_some() && !rt.dead_keys.contains(&k.hash));
            if rt.auth_failed.is_some() && usable {
                rt.auth_failed = None;
                self.event(name, "auth_cleared", "a rejected key's value was replaced");
            }
        }
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

    /// Picks the key for the next call: round-robin over keys that resolved and have not been
    /// rejected.
    pub fn pick_key(&self, ep: &Endpoint) -> KeyPick {
        if !ep.needs_key() {
            return KeyPick::NotNeeded;
        }
        let Some(rt) = self.get(&ep.name) else {
            return KeyPick::Exhausted;
        };
        let mut rt = lock(&rt);
        let n = ep.keys.len();
        for step in 0..n {
            let i = (rt.key_cursor + step) % n;
            if ep.keys[i].value.is_some() && !rt.dead_keys.contains(&ep.keys[i].hash) {
                rt.key_cursor = (i + 1) % n;
                return KeyPick::Use(i);
            }
        }
        KeyPick::Exhausted
    }

    /// Like [`Registry::pick_key`], skipping keys whose rate-limit budget is predicted too small
    /// for a request of `tokens` (prompt + completion, when counted), and debiting the budget of
    /// the key picked. With every usable key predicted short: `Limited` with the shortest wait.
    pub fn pick_key_predicted(&self, ep: &Endpoint, tokens: Option<u64>) -> KeyPick {
        let Some(rt) = self.get(&ep.name) else {
            return if ep.needs_key() {
                KeyPick::Exhausted
            } else {
                KeyPick::NotNeeded
            };
        };
        let now = Instant::now();
        let mut rt = lock(&rt);
        rt.limits.retain(|_, l| !l.expired(now));
        if !ep.needs_key() {
            if let Some(l) = rt.limits.get_mut("") {
                if let Some((d, short)) = l.wait_for(tokens, now) {
                    return KeyPick::Limited(d, short);
                }
                l.debit(tokens);
            }
            return KeyPick::NotNeeded;
        }
        let n = ep.keys.len();
        let mut soonest: Option<(Duration, crate::routing::ratelimit::Short)> = None;
        for step in 0..n {
            let i = (rt.key_cursor + step) % n;
            let k = &ep.keys[i];
            if k.value.is_none() || rt.dead_keys.contains(&k.hash) {
                continue;
            }
            if let Some(w) = rt.limits.get(&k.hash).and_then(|l| l.wait_for(tokens, now)) {
                soonest = Some(soonest.map_or(w, |s| if w.0 < s.0 { w } else { s }));
                continue;
            }
            rt.key_cursor = (i + 1) % n;
            if let Some(l) = rt.limits.get_mut(&k.hash) {
                l.debit(tokens);
            }
            return KeyPick::Use(i);
        }
        match soonest {
            Some((d, short)) => KeyPick::Limited(d, short),
            None => KeyPick::Exhausted,
        }
    }

    /// Whether any key's token budget may be smaller than `upper_bound()` (so the request is
    /// worth counting before picking a key). The bound is computed only when a budget exists.
    pub fn tokens_tight(&self, ep: &Endpoint, upper_bound: impl FnOnce() -> u64) -> bool {
        let now = Instant::now();
        let least = self
            .with(&ep.name, |rt| {
                rt.limits
                    .values()
                    .filter_map(|l| l.tokens)
                    .filter(|b| b.reset_at > now)
                    .map(|b| b.available(now))
                    .reduce(f64::min)
            })
            .flatten();
        least.is_some_and(|least| least < upper_bound() as f64)
    }

    /// Takes in what a response's `x-ratelimit-*` headers said about key `key` (`None`: no key).
    pub fn observe_ratelimit(
        &self,
        ep: &Endpoint,
        key: Option<usize>,
        seen: &crate::routing::ratelimit::Observed,
    ) {
        if seen.is_empty() {
            return;
        }
        let hash = match key {
            Some(i) => match ep.keys.get(i) {
                Some(k) => k.hash.as_str(),
                None => return,
            },
            None => "",
        };
        if let Some(rt) = self.get(&ep.name) {
            let now = Instant::now();
            let mut rt = lock(&rt);
            // The common case, a key seen before, allocates nothing.
            match rt.limits.get_mut(hash) {
                Some(l) => l.observe(seen, now),
                None => {
                    let mut l = crate::routing::ratelimit::Limits::default();
                    l.observe(seen, now);
                    rt.limits.insert(hash.to_string(), l);
                }
            }
            drop(rt);
            if self.facts.get().is_some() && crate::routing::ratelimit::Limits::worth_sharing(seen)
            {
                let ms = |b: Option<(Option<u64>, u64, Duration)>| {
                    b.map(|(l, r, reset)| (l, r, reset.as_millis() as u64))
                };
                self.share(Fact::RateLimit {
                    endpoint: ep.name.clone(),
                    fingerprint: ep.fingerprint.clone(),
                    key: hash.to_string(),
                    requests: ms(seen.requests),
                    tokens: ms(seen.tokens),
                    at_unix_ms: unix_ms(SystemTime::now()),
                });
            }
        }
    }

    /// The endpoint's recent latency at percentile `p` (`None` with too few samples).
    pub fn latency_percentile(&self, endpoint: &str, p: f64) -> Option<Duration> {
        let rt = self.get(endpoint)?;
        let now = Instant::now();
        let sorted = {
            let mut rt = lock(&rt);
            match &rt.sorted {
                Some((at, v)) if now.saturating_duration_since(*at) < SORTED_TTL => v.clone(),
                _ => {
                    let v = Arc::new(rt.samples.sorted());
                    rt.sorted = Some((now, v.clone()));
                    v
                }
            }
        };
        if sorted.len() < crate::routing::hedge::MIN_SAMPLES {
            return None;
        }
        let ms = crate::routing::stats::percentile_sorted(&sorted, p)?;
        // Our own measurements, but no float reaches a panicking conversion: `as` saturates.
        (ms.is_finite() && ms >= 0.0).then(|| Duration::from_micros((ms * 1000.0) as u64))
    }

    /// The key the next request would use, without advancing the rotation (for probes: a probe
    /// must test what traffic would send, not always the first key).
    pub fn current_key(&self, ep: &Endpoint) -> KeyPick {
        if !ep.needs_key() {
            return KeyPick::NotNeeded;
        }
        let Some(rt) = self.get(&ep.name) else {
            return KeyPick::Exhausted;
        };
        let rt = lock(&rt);
        let n = ep.keys.len();
        (0..n)
            .map(|step| (rt.key_cursor + step) % n)
            .find(|&i| ep.keys[i].value.is_some() && !rt.dead_keys.contains(&ep.keys[i].hash))
            .map_or(KeyPick::Exhausted, KeyPick::Use)
    }

    /// Applies an attempt's outcome. Returns true when the endpoint has another key to try.
    pub fn apply(&self, ep: &Endpoint, policy: &Policy, effect: Effect) -> bool {
        let Some(rt) = self.get(&ep.name) else {
            return false;
        };
        let now = Instant::now();
        let mut rt = lock(&rt);
        match effect {
            Effect::Success { latency_ms } => {
                rt.health.observe_traffic(now, true, "", &policy.health);
                rt.window.record(now, true);
                rt.latency.observe(latency_ms);
                rt.samples.push(latency_ms);
                rt.requests += 1;
                rt.successes += 1;
                false
            }
            Effect::Failure { class, detail } => {
                rt.window.record(now, false);
                rt.requests += 1;
                rt.failures += 1;
                rt.last_error = Some((format!("{class}: {detail}"), SystemTime::now()));
                let tr = rt.health.observe_traffic(
                    now,
                    false,
                    &format!("{class}: {detail}"),
                    &policy.health,
                );
                drop(rt);
                if let Some(tr) = tr {
                    self.transition(&ep.name, &tr);
                }
                false
            }
            Effect::Cooldown { for_, detail } => {
                let until = now + for_;
                if rt.cooldown_until.is_none_or(|u| u <= now) {
                    rt.cooldown_from = Some(now);
                }
                rt.cooldown_until = Some(rt.cooldown_until.map_or(until, |u| u.max(until)));
                rt.cooldown_reason = Some(detail.clone());
                rt.last_error = Some((format!("rate_limited: {detail}"), SystemTime::now()));
                drop(rt);
                self.share(Fact::Cooldown {
                    endpoint: ep.name.clone(),
                    fingerprint: ep.fingerprint.clone(),
                    until_unix_ms: (SystemTime::now() + for_)
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(0),
                    detail: detail.clone(),
                });
                self.event(
                    &ep.name,
                    "cooldown",
                    &format!("{detail}; cooling down for {}ms", for_.as_millis()),
                );
                false
            }
            Effect::Retire { detail } => {
                rt.retired = Some(Retirement {
                    reason: detail.clone(),
                    fingerprint: ep.fingerprint.clone(),
                });
                rt.last_error = Some((format!("gone: {detail}"), SystemTime::now()));
                drop(rt);
                self.store
                    .send_flag(&ep.name, Some(&detail), Some(&ep.fingerprint));
                self.share(Fact::Retired {
                    endpoint: ep.name.clone(),
                    fingerprint: ep.fingerprint.clone(),
                    detail: detail.clone(),
                });
                self.event(&ep.name, "retired", &detail);
                false
            }
            Effect::KeyRejected { key, detail } => {
                // A probe and a request can both be turned away with the same key: the
                // rejection (and its event) is recorded once.
                let newly = ep
                    .keys
                    .get(key)
                    .is_some_and(|k| rt.dead_keys.insert(k.hash.clone()));
                rt.last_error = Some((format!("auth: {detail}"), SystemTime::now()));
                let left = ep
                    .keys
                    .iter()
                    .any(|k| k.value.is_some() && !rt.dead_keys.contains(&k.hash));
                if !newly {
                    return left;
                }
                if let Some(k) = ep.keys.get(key) {
                    self.share(Fact::KeyRejected {
                        endpoint: ep.name.clone(),
                        fingerprint: ep.fingerprint.clone(),
                        key: k.hash.clone(),
                        detail: detail.clone(),
                    });
                }
                if left {
                    drop(rt);
                    self.event(
                        &ep.name,
                        "key_rejected",
                        &format!(
                            "key #{} rejected ({detail}); rotating to the next key",
                            key + 1
                        ),
                    );
                } else {
                    rt.auth_failed = Some(detail.clone());
                    drop(rt);
                    self.event(&ep.name, "auth_failed", &detail);
                }
                left
            }
        }
    }

    /// Tokens a request used; `served`: it was answered in full, so the endpoint holds that many.
    pub fn record_tokens(
        &self,
        endpoint: &str,
        tokens_in: u64,
        tokens_out: u64,
        estimated: bool,
        served: bool,
    ) {
        if let Some(rt) = self.get(endpoint) {
            let mut rt = lock(&rt);
            // Only the upstream's own count: an estimate could raise the floor past the truth.
            if served && !estimated {
                rt.window
                    .served(Instant::now(), tokens_in.saturating_add(tokens_out));
            }
            rt.tokens_in += tokens_in;
            rt.tokens_out += tokens_out;
            if estimated {
                rt.tokens_estimated += tokens_in + tokens_out;
            }
        }
    }

    /// The window to plan with: the configured one, lowered by what the upstream said.
    pub fn effective_window(&self, ep: &Endpoint) -> Option<u64> {
        let learned = self
            .get(&ep.name)
            .and_then(|rt| lock(&rt).learned_window.as_ref().map(|l| l.tokens));
        match (ep.context_window, learned) {
            (Some(c), Some(l)) => Some(c.min(l)),
            (c, l) => c.or(l),
        }
    }

    /// Records a limit an upstream stated (a context-length error of the request `request_id`, or
    /// its `/tokenize`), if it teaches anything new and can be true: never below
    /// [`MIN_LEARNED_WINDOW`], nor below the largest request the endpoint served in full within
    /// the stats window.
    /// Whether `/v1/responses` passes through to `ep`: it has the `responses` capability and
    /// has not answered 404 for `/responses`.
    pub fn speaks_responses(&self, ep: &Endpoint) -> bool {
        ep.caps.contains(crate::config::Capability::Responses)
            && self
                .get(&ep.name)
                .is_none_or(|rt| lock(&rt).chat_only.is_none())
    }

    /// Whether a probe of `ep`'s `/responses` route may start now: at most one a minute an
    /// endpoint, however many clients' requests answer 404 (the caller makes it).
    pub fn responses_probe_due(&self, ep: &Endpoint) -> bool {
        const EVERY: Duration = Duration::from_secs(60);
        let Some(rt) = self.get(&ep.name) else {
            return false;
        };
        let mut rt = lock(&rt);
        if rt.chat_only.is_some() {
            return false;
        }
        let now = Instant::now();
        if rt
            .responses_probed
            .is_some_and(|t| now.saturating_duration_since(t) < EVERY)
        {
            return false;
        }
        rt.responses_probed = Some(now);
        true
    }

    /// `ep` has no `/responses` route (a probe of the gateway's own said so, never a client's
    /// answer alone): it speaks only chat, which costs nothing but translation.
    pub fn mark_chat_only(&self, ep: &Endpoint, detail: &str) {
        let Some(rt) = self.get(&ep.name) else {
            return;
        };
        let first = {
            let mut rt = lock(&rt);
            let first = rt.chat_only.is_none();
            rt.chat_only = Some(detail.chars().take(300).collect());
            first
        };
        if first {
            self.event(
                &ep.name,
                "responses_unsupported",
                "a probe with no client content answered 404/405 for /responses: /v1/responses goes to it by translation to chat",
            );
        }
    }

    pub fn learn_window(&self, ep: &Endpoint, tokens: u64, request_id: &str) {
        self.learn_window_from(ep, tokens, request_id, true);
    }

    /// [`Registry::learn_window`]; `share`: learned here (not from another replica).
    fn learn_window_from(&self, ep: &Endpoint, tokens: u64, request_id: &str, share: bool) {
        let Some(rt) = self.get(&ep.name) else {
            return;
        };
        {
            let mut rt = lock(&rt);
            let current = match (ep.context_window, rt.learned_window.as_ref()) {
                (Some(c), Some(l)) => Some(c.min(l.tokens)),
                (c, l) => c.or(l.map(|l| l.tokens)),
            };
            if current.is_some_and(|c| c <= tokens) {
                return;
            }
            let served = rt.window.counts(Instant::now()).served_max;
            if tokens < MIN_LEARNED_WINDOW || tokens < served {
                drop(rt);
                tracing::warn!(
                    endpoint = %ep.name,
                    request_id,
                    stated = tokens,
                    served,
                    "a stated context limit below what the endpoint holds is not learned"
                );
                return;
            }
            rt.learned_window = Some(LearnedWindow {
                tokens,
                request_id: request_id.to_string(),
            });
        }
        self.store.send(crate::store::Record::LearnedWindow {
            endpoint: ep.name.clone(),
            learned: Some((tokens, request_id.to_string(), ep.fingerprint.clone())),
        });
        if share {
            self.share(Fact::Window {
                endpoint: ep.name.clone(),
                fingerprint: ep.fingerprint.clone(),
                tokens,
                request_id: request_id.to_string(),
            });
        }
        self.event(
            &ep.name,
            "context_window_learned",
            &format!("upstream stated a context limit of {tokens} tokens (request {request_id})"),
        );
    }

    pub fn set_probe(&self, endpoint: &str, report: crate::routing::observed::ProbeReport) {
        if let Some(rt) = self.get(endpoint) {
            lock(&rt).probe = Some(report);
        }
    }

    fn transition(&self, endpoint: &str, tr: &crate::routing::health::Transition) {
        let serving = |s: &str| matches!(s, "healthy" | "degraded");
        if serving(tr.to)
            && !serving(tr.from)
            && let Some(rt) = self.get(endpoint)
        {
            let mut rt = lock(&rt);
            if rt.been_serving {
                rt.recovered_at = Some(Instant::now());
            }
            rt.been_serving = true;
        }
        self.event(
            endpoint,
            &format!("health:{}->{}", tr.from, tr.to),
            &tr.reason,
        );
    }

    /// Feeds an active probe's result to the health state machine.
    pub fn observe_probe(
        &self,
        endpoint: &str,
        result: &crate::routing::health::ProbeResult,
        t: &crate::routing::health::Thresholds,
    ) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let tr = lock(&rt).health.observe_probe(Instant::now(), result, t);
        if let Some(tr) = tr {
            self.transition(endpoint, &tr);
        }
    }

    /// Docker's view of an endpoint: where it runs, and whether it is down.
    pub fn observe_docker(&self, endpoint: &str, d: Option<crate::routing::observed::Discovered>) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let now = Instant::now();
        let (fresh, tr) = {
            let mut rt = lock(&rt);
            let down = d.as_ref().and_then(|d| d.down.clone());
            let addrs = |d: &Option<crate::routing::observed::Discovered>| {
                let mut a = d.as_ref().map(|d| d.addresses.clone()).unwrap_or_default();
                a.sort();
                a
            };
            let new = addrs(&d);
            // Evidence is about addresses: a replacement task must not inherit the dead one's
            // ejection or probe verdict (compared with the last non-empty set, so a gap with no
            // task in between still counts as a replacement).
            let fresh =
                if !new.is_empty() && !rt.last_addresses.is_empty() && rt.last_addresses != new {
                    // Nor its success rate: the failures of a killed or sick task would keep
                    // the healthy replacement demoted behind the others, and a demoted endpoint
                    // gets no traffic to prove itself with, for the whole window.
                    rt.window = RollingWindow::new(rt.window.window());
                    rt.health.new_addresses(now)
                } else {
                    None
                };
            if !new.is_empty() {
                rt.last_addresses = new;
            }
            rt.discovered = d;
            (fresh, rt.health.observe_docker(now, down))
        };
        for tr in [fresh, tr].into_iter().flatten() {
            self.transition(endpoint, &tr);
        }
    }

    /// A discovered address whose container just died: out of the pool at once. With none left
    /// the endpoint is down (Docker's view) until a scan finds a running task again.
    pub fn drop_address(&self, endpoint: &str, address: &str, why: &str) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let tr = {
            let mut rt = lock(&rt);
            let Some(d) = rt.discovered.as_mut() else {
                return;
            };
            let before = d.addresses.len();
            d.addresses.retain(|a| a != address);
            if d.addresses.len() == before {
                return;
            }
            d.running = d.running.saturating_sub(1);
            if d.addresses.is_empty() {
                d.down = Some(why.to_string());
                rt.health
                    .observe_docker(Instant::now(), Some(why.to_string()))
            } else {
                None
            }
        };
        tracing::info!(endpoint, address, why, "discovered address dropped");
        if let Some(tr) = tr {
            self.transition(endpoint, &tr);
        }
    }

    /// The address discovery found for the endpoint (round-robin over running tasks).
    pub fn discovered_base(&self, endpoint: &str) -> Option<String> {
        let rt = self.get(endpoint)?;
        let rt = lock(&rt);
        let d = rt.discovered.as_ref()?;
        if d.addresses.is_empty() {
            return None;
        }
        let i = fastrand::usize(..d.addresses.len());
        Some(d.addresses[i].clone())
    }

    pub fn health_reason(&self, endpoint: &str) -> Option<String> {
        self.with(endpoint, |rt| rt.health.reason().to_string())
    }

    /// What probes of the endpoint's current addresses say against it, if anything.
    pub fn probe_unhealthy(&self, endpoint: &str) -> Option<String> {
        self.with(endpoint, |rt| {
            rt.health.probe_unhealthy().map(str::to_string)
        })
        .flatten()
    }

    pub fn is_ejected(&self, endpoint: &str) -> bool {
        self.with(endpoint, |rt| rt.health.is_ejected())
            .unwrap_or(false)
    }

    /// Lifts retirement, auth failure, cooldown, rejected keys and a learned context window
    /// (operator's `endpoint clear`).
    pub fn clear(&self, name: &str) -> bool {
        self.clear_from(name, true)
    }

    /// [`Registry::clear`]; `share`: made here (not by another replica).
    fn clear_from(&self, name: &str, share: bool) -> bool {
        let Some(rt) = self.get(name) else {
            return false;
        };
        {
            let mut rt = lock(&rt);
            rt.retired = None;
            rt.auth_failed = None;
            rt.cooldown_until = None;
            rt.cooldown_reason = None;
            rt.dead_keys.clear();
            rt.learned_window = None;
            rt.chat_only = None;
            rt.responses_probed = None;
        }
        self.store.send_flag(name, None, None);
        self.store.send(crate::store::Record::LearnedWindow {
            endpoint: name.to_string(),
            learned: None,
        });
        if share {
            self.share(Fact::Cleared {
                endpoint: name.to_string(),
            });
            self.event(name, "cleared", "cleared by operator");
        } else {
            self.event(name, "cleared", "cleared by operator on another replica");
        }
        true
    }

    /// What the router needs to know about `names`, now.
    pub fn views(&self, cfg: &Config, names: &[String]) -> Vec<crate::routing::router::View> {
        let now = Instant::now();
        names
            .iter()
            .filter_map(|n| {
                let ep = cfg.endpoints.get(n)?;
                let (avail, rate, dead, slow_start) = self.with(n, |rt| {
                    let usable = ep.keys.is_empty() || ep.keys.iter().any(|k| k.value.is_some());
                    (
                        rt.avail(now),
                        rt.counts(now).rate(cfg.policy.min_samples),
                        !usable,
                        rt.slow_start(now, cfg.policy.slow_start),
                    )
                })?;
                Some(crate::routing::router::View {
                    name: n.clone(),
                    avail,
                    success_rate: rate,
                    capabilities: ep.caps,
                    no_usable_key: dead,
                    slow_start,
                    roll: if slow_start.is_some() { roll() } else { 0.0 },
                })
            })
            .collect()
    }

    /// The chains (routes by name, and `fallback_chain`) in healthy panic right now.
    pub fn chains_in_panic(&self, cfg: &Config) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, chain: &[String]| {
            if crate::routing::router::in_panic(&self.views(cfg, chain), cfg.policy.panic_threshold)
            {
                out.push(name.to_string());
            }
        };
        check("fallback_chain", &cfg.fallback_chain);
        for (name, chain) in &cfg.routes {
            check(name, chain);
        }
        out
    }

    /// Each chain as the router would try it now (a request with no special needs): the
    /// order, and what it would skip and why. For `/status` and the live page.
    pub fn ranked(&self, cfg: &Config) -> Value {
        let plan = |chain: &[String]| {
            let views = self.views(cfg, chain);
            let panic = crate::routing::router::in_panic(&views, cfg.policy.panic_threshold);
            let p = crate::routing::router::rank(
                chain,
                &views,
                &Default::default(),
                cfg.policy.success_threshold,
                panic,
            );
            json!({
                "order": p.order,
                "skipped": p.skipped.iter().map(|(n, s)| json!({"endpoint": n, "reason": s.class().as_str()})).collect::<Vec<_>>(),
                "panic": panic,
            })
        };
        let mut out = serde_json::Map::new();
        out.insert("fallback_chain".into(), plan(&cfg.fallback_chain));
        for (name, chain) in &cfg.routes {
            out.insert(name.clone(), plan(chain));
        }
        Value::Object(out)
    }

    pub fn with<R>(&self, name: &str, f: impl FnOnce(&EndpointRuntime) -> R) -> Option<R> {
        let rt = self.get(name)?;
        let g = lock(&rt);
        Some(f(&g))
    }

    /// Rows for the periodic stats snapshot in SQLite.
    pub fn snapshot(&self) -> Vec<PersistedStats> {
        let Ok(map) = self.map.read() else {
            return vec![];
        };
        map.iter()
            .map(|(name, rt)| {
                let rt = lock(rt);
                PersistedStats {
                    endpoint: name.clone(),
                    requests: rt.requests,
                    successes: rt.successes,
                    failures: rt.failures,
                    ewma_latency_ms: rt.latency.get(),
                    retired_reason: rt.retired.as_ref().map(|r| r.reason.clone()),
                    retired_fingerprint: rt.retired.as_ref().map(|r| r.fingerprint.clone()),
                    learned_context_window: rt.learned_window.as_ref().map(|l| l.tokens),
                    learned_window_request: rt
                        .learned_window
                        .as_ref()
                        .map(|l| l.request_id.clone()),
                    learned_window_fingerprint: rt
                        .learned_window
                        .as_ref()
                        .map(|_| rt.fingerprint.clone()),
                }
            })
            .collect()
    }

    /// The endpoint's state as `/status` names it (one of `ENDPOINT_STATES`), and the predicted
    /// requests and tokens its keys can take now (summed over keys with fresh
    /// `x-ratelimit-*` headers; `None` when none said). For `/metrics`.
    pub fn gauges(
        &self,
        ep: &Endpoint,
        policy: &Policy,
    ) -> (&'static str, Option<u64>, Option<u64>) {
        let now = Instant::now();
        let Some(rt) = self.get(&ep.name) else {
            return ("unknown", None, None);
        };
        let rt = lock(&rt);
        let rate = rt.window.counts(now).rate(policy.min_samples);
        let usable_keys = rt.usable_keys(ep);
        let state = state_name(
            &rt.avail(now),
            ep.needs_key() && usable_keys == 0,
            rate,
            policy,
        );
        let (mut requests, mut tokens) = (None::<u64>, None::<u64>);
        for l in rt.limits.values().filter(|l| !l.expired(now)) {
            let add = |sum: &mut Option<u64>, b: &Option<crate::routing::ratelimit::Budget>| {
                if let Some(b) = b.filter(|b| b.reset_at > now) {
                    let n = b.available(now).clamp(0.0, u64::MAX as f64) as u64;
                    *sum = Some(sum.unwrap_or(0).saturating_add(n));
                }
            };
            add(&mut requests, &l.requests);
            add(&mut tokens, &l.tokens);
        }
        (state, requests, tokens)
    }

    /// The `/status` view of one endpoint.
    pub fn status_json(&self, ep: &Endpoint, policy: &Policy) -> Value {
        let now = Instant::now();
        let Some(rt) = self.get(&ep.name) else {
            return json!({"state": "unknown"});
        };
        let rt = lock(&rt);
        let counts = rt.window.counts(now);
        let rate = counts.rate(policy.min_samples);
        let avail = rt.avail(now);
        let usable_keys = rt.usable_keys(ep);
        let state = state_name(&avail, ep.needs_key() && usable_keys == 0, rate, policy);
        let pct = rt.samples.percentiles(&[50.0, 95.0, 99.0]);
        // Per key (by its place in the list, never its value): what its last `x-ratelimit-*`
        // headers said and how long the gateway predicts it cannot take a request.
        let ratelimit: Vec<Value> = ep
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| (format!("#{}", i + 1), k.hash.as_str()))
            .chain(std::iter::once(("no key".to_string(), "")))
            .filter_map(|(label, hash)| {
                let l = rt.limits.get(hash)?;
                if l.expired(now) {
                    return None;
                }
                let budget = |b: &Option<crate::routing::ratelimit::Budget>| {
                    b.filter(|b| b.reset_at > now).map(|b| {
                        json!({
                            "limit": b.limit,
                            "remaining_observed": b.remaining,
                            "available_now": b.available(now).min(u64::MAX as f64).floor() as u64,
                            "reset_in_ms": b.reset_at.saturating_duration_since(now).as_millis() as u64,
                        })
                    })
                };
                Some(json!({
                    "key": label,
                    "requests": budget(&l.requests),
                    "tokens": budget(&l.tokens),
                    "blocked_for_ms": l.wait_for(None, now).map(|(d, _)| d.as_millis() as u64).unwrap_or(0),
                }))
            })
            .collect();
        let cooldown_ms = match avail {
            Avail::Cooldown(d) => d.as_millis() as u64,
            _ => 0,
        };
        json!({
            "type": ep.kind.to_string(),
            "state": state,
            "success_rate": rate,
            "window": {
                "seconds": rt.window.window().as_secs_f64(),
                "ok": counts.ok,
                "failed": counts.failed,
            },
            "latency_ms": {
                "ewma": rt.latency.get(),
                "p50": pct[0],
                "p95": pct[1],
                "p99": pct[2],
            },
            "last_error": rt.last_error.as_ref().map(|(m, t)| json!({
                "message": m,
                "at_unix_ms": t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
            })),
            "cooldown_remaining_ms": cooldown_ms,
            "cooldown_reason": if cooldown_ms > 0 { rt.cooldown_reason.clone() } else { None },
            "retired_reason": rt.retired.as_ref().map(|r| r.reason.clone()),
            "auth_failed": rt.auth_failed.clone(),
            "keys": { "configured": ep.keys.len(), "usable": usable_keys },
            "ratelimit": ratelimit,
            "slow_start_share": rt.slow_start(now, policy.slow_start),
            "context_window": ep.context_window,
            "learned_context_window": rt.learned_window.as_ref().map(|l| l.tokens),
            "learned_context_window_request": rt.learned_window.as_ref().map(|l| &l.request_id),
            "tokenizer": ep.counter.method(),
            // How `/v1/responses` reaches it: passed through, or translated to chat (and why).
            "responses": if !ep.caps.contains(crate::config::Capability::Responses) {
                json!({"mode": "translated", "reason": "no_capability"})
            } else if let Some(why) = &rt.chat_only {
                json!({"mode": "translated", "reason": "chat_only", "detail": why})
            } else {
                json!({"mode": "native"})
            },
            "health_reason": rt.health.reason(),
            "discovered": rt.discovered.as_ref().map(|d| json!({
                "service": d.service,
                "addresses": d.addresses,
                "running_tasks": d.running,
                "restarts": d.restarts,
                "down": d.down,
            })),
            "probe": rt.probe.as_ref().map(|p| json!({
                "ok": p.ok,
                "age_ms": p.at.elapsed().map(|d| d.as_millis() as u64).unwrap_or(0),
                // A result older than cache_ttl is shown as stale: the prober could not refresh it.
                "stale": p.at.elapsed().map(|d| d > policy.cache_ttl).unwrap_or(false),
                "at_unix_ms": p.at.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
                "detail": p.detail,
            })),
            "totals": {
                "requests": rt.requests,
                "successes": rt.successes,
                "failures": rt.failures,
                "tokens_in": rt.tokens_in,
                "tokens_out": rt.tokens_out,
                "tokens_estimated": rt.tokens_estimated,
            },
        })
    }
}

/// Every state `/status` and `autohedge_endpoint_state` name.
pub const ENDPOINT_STATES: [&str; 10] = [
    "healthy",
    "degraded",
    "cooldown",
    "unhealthy",
    "warming",
    "ejected",
    "half_open",
    "retired",
    "auth_failed",
    "unknown",
];

fn state_name(
    avail: &Avail,
    no_usable_key: bool,
    rate: Option<f64>,
    policy: &Policy,
) -> &'static str {
    match avail {
        Avail::Retired => "retired",
        Avail::AuthFailed => "auth_failed",
        Avail::Cooldown(_) => "cooldown",
        Avail::Unhealthy { state, .. } => state,
        Avail::Degraded => "degraded",
        Avail::Ready if no_usable_key => "auth_failed",
        Avail::Ready if rate.is_some_and(|r| r < policy.success_threshold) => "degraded",
        Avail::Ready => "healthy",
    }
}

/// Locks an endpoint's state. A poisoned lock (a panic while held) still holds consistent
/// counters, so it is used rather than propagating the panic to every later request.
pub fn lock(m: &Mutex<EndpointRuntime>) -> std::sync::MutexGuard<'_, EndpointRuntime> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::observed::Discovered;

    fn found(addr: &str, down: Option<&str>) -> Option<Discovered> {
        Some(Discovered {
            service: "svc".into(),
            addresses: if down.is_some() {
                vec![]
            } else {
                vec![addr.to_string()]
            },
            running: usize::from(down.is_none()),
            restarts: 0,
            down: down.map(str::to_string),
        })
    }

    #[tokio::test]
    async fn a_first_discovery_is_no_recovery_but_coming_back_is() {
        let cfg = Config::load(
            "models:\n  d: { type: vllm, discover: docker }\n  s: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\nrouting_policy: { slow_start: 30s }\ndocker: { enabled: true }\n",
        )
        .unwrap();
        let reg = Registry::new(StoreHandle::off("test".into()));
        reg.sync(&cfg, &[]);
        let share = |name: &str| reg.views(&cfg, &[name.to_string()])[0].slow_start;
        // Discovered for the first time (the gateway just started): its full share at once.
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        assert_eq!(reg.views(&cfg, &["d".into()])[0].avail, Avail::Ready);
        assert_eq!(share("d"), None);
        assert_eq!(
            share("s"),
            None,
            "an endpoint configured healthy is no recovery either"
        );
        // Its task dies and a new one comes up: that is a recovery, slow-started.
        reg.observe_docker("d", found("", Some("no running task")));
        assert!(matches!(
            reg.views(&cfg, &["d".into()])[0].avail,
            Avail::Unhealthy { .. }
        ));
        reg.observe_docker("d", found("http://10.0.0.6:8000", None));
        assert_eq!(share("d"), Some(crate::routing::router::SLOW_START_MIN));
    }

    #[tokio::test]
    async fn a_replacement_task_does_not_inherit_the_old_ones_success_rate() {
        let cfg = Config::load(
            "models:
  d: { type: vllm, discover: docker }
routing_policy: { min_samples: 2 }
docker: { enabled: true }
",
        )
        .unwrap();
        let reg = Registry::new(StoreHandle::off("test".into()));
        reg.sync(&cfg, &[]);
        let ep = cfg.endpoints["d"].clone();
        let rate = || reg.views(&cfg, &["d".into()])[0].success_rate;
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        for _ in 0..3 {
            reg.apply(
                &ep,
                &cfg.policy,
                Effect::Failure {
                    class: crate::routing::outcome::Outcome::Connection,
                    detail: "reset".into(),
                },
            );
        }
        assert_eq!(rate(), Some(0.0), "the old task failed");
        // The same address seen again: the same task, the same record.
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        assert_eq!(rate(), Some(0.0));
        // A replacement at another address starts with no record.
        reg.observe_docker("d", found("http://10.0.0.9:8000", None));
        assert_eq!(rate(), None);
    }

    #[test]
    fn the_remembered_runtime_is_given_only_for_its_name_registry_and_generation() {
        let load = |names: &[&str]| {
            let mut yaml = String::from("models:\n");
            for n in names {
                yaml.push_str(&format!(
                    "  {n}: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\" }}\n"
                ));
            }
            Config::load(&yaml).unwrap()
        };
        let long = "l".repeat(MEMO_NAME + 5);
        let cfg = load(&["a", "ab", &long]);
        let (one, two) = (
            Registry::new(StoreHandle::off("test".into())),
            Registry::new(StoreHandle::off("test".into())),
        );
        one.sync(&cfg, &[]);
        two.sync(&cfg, &[]);
        let a = one.get("a").expect("a is there");
        // Asked again (remembered): the same state; a name that shares its first bytes, another
        // registry's endpoint of the same name, a long name: each its own.
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        let ab = one.get("ab").unwrap();
        assert!(!Arc::ptr_eq(&ab, &a));
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        assert!(
            !Arc::ptr_eq(&two.get("a").unwrap(), &a),
            "two registries, two states"
        );
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        let l = one.get(&long).unwrap();
        assert!(Arc::ptr_eq(&one.get(&long).unwrap(), &l));
        assert!(one.get("b").is_none());
        // A reload without `a`: its state is gone, remembered or not.
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &a));
        one.sync(&load(&["ab"]), &[]);
        assert!(one.get("a").is_none(), "removed by the reload");
        assert!(
            Arc::ptr_eq(&one.get("ab").unwrap(), &ab),
            "kept by the reload"
        );
        // Put back: fresh state, not the state remembered from before.
        one.sync(&load(&["a", "ab"]), &[]);
        let again = one.get("a").unwrap();
        assert!(!Arc::ptr_eq(&again, &a));
        assert!(Arc::ptr_eq(&one.get("a").unwrap(), &again));
    }
}
