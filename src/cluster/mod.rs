//! `cluster:` — the store several replicas share client limits through (Redis).
//!
//! A client key's `rpm`, `tpm` and `budget_usd` are admitted by one script a request
//! (`admit.lua`: budget, then `rpm`, then `tpm`, nothing taken unless all pass), so the fleet
//! together allows exactly what one process would. A request ends with `settle.lua`, queued off
//! the request path: its reservation let go, its cost spent, its completion tokens charged.
//!
//! The store is never the cause of an outage. A request waits on it at most `cluster.timeout`;
//! past that, or while the store is known to be away, the replica admits on its own with each
//! limit split by the live replica count it last saw ([`Cluster::replicas`]). A keeper task
//! heartbeats every second (which also counts the replicas), marks the store down on a failure
//! (`/health` `degraded`, `/status.cluster`, the `cluster_store_down` alert once an outage),
//! retries with backoff, and on its return raises the shared month's spend to what this
//! replica knows (`seed.lua`) before requests use the store again. Settles made while it was
//! away wait in a bounded queue and are applied when it is back.
//!
//! The URL is a secret (it may carry a password): only [`Settings::display`] is ever shown, and
//! store errors are scrubbed of it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::config::AlertEvent;
use crate::routing::observed::Fact;

/// How often a replica says it is alive; it counts as gone after [`ALIVE_FOR`].
const HEARTBEAT: Duration = Duration::from_secs(1);
const ALIVE_FOR: Duration = Duration::from_secs(5);
/// The most the keeper's own calls (heartbeat, seeding, settles) wait on the store.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);
/// Retries while the store is away: from this, doubling, to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Settles waiting for the store; more are dropped (and counted).
const SETTLE_QUEUE: usize = 100_000;
/// A reservation of a replica that died before settling is let go after this.
const HOLD: Duration = Duration::from_secs(3600);
/// How long the store remembers a settle's name (so one sent again is applied once): as long
/// as a reservation is held (a settle sent again after a longer outage would count twice).
const SETTLED_FOR: Duration = Duration::from_secs(3600);
/// A month's spend outlives its month by this.
const SPEND_TTL: Duration = Duration::from_secs(40 * 86_400);
/// An endpoint's shared facts outlive their last change by this.
const FACTS_TTL: Duration = Duration::from_secs(30 * 86_400);
/// The largest fact message read from the store; larger ones are ignored.
const MAX_FACT_BYTES: usize = 64 * 1024;
/// Facts waiting to be shared; more are dropped (the other replicas learn them themselves).
pub const FACT_QUEUE: usize = 4096;

pub use crate::config::ClusterSettings as Settings;
pub use crate::config::cluster_display as display_url;

/// One admission asked of the store.
#[derive(Debug, Clone, Copy)]
pub struct Admit<'a> {
    pub client: &'a str,
    pub rpm: Option<u32>,
    pub tpm: Option<u64>,
    /// Taken from `tpm` at once.
    pub tokens: u64,
    pub budget: Option<f64>,
    /// Held against `budget` until the request settles.
    pub reserve: f64,
    /// The reservation's name (the request's id).
    pub request: &'a str,
    /// `YYYY-MM`.
    pub month: &'a str,
}

/// What admissions share to go in one call: the key, its limits and the month.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Batch {
    client: String,
    rpm: u32,
    tpm: u64,
    /// The budget's bits (`None`: no budget).
    budget: Option<u64>,
    month: String,
}

/// What waits for a key's next call: admissions, and settles of the key that ride along.
#[derive(Default)]
struct Group {
    waiting: Vec<Waiting>,
    settles: Vec<Settle>,
}

/// One admission waiting for its call.
struct Waiting {
    ask: Ask,
    tx: tokio::sync::oneshot::Sender<Result<Verdict, ()>>,
}

/// What one admission takes: tokens, a reservation, and the reservation's name.
struct Ask {
    tokens: u64,
    reserve: f64,
    request: String,
}

/// An admission's part: the call for its quiet key, or a place in the key's next call.
enum Turn {
    Call(Ask),
    Wait(tokio::sync::oneshot::Receiver<Result<Verdict, ()>>),
}

/// The first asker's call for a key: when it ends (or is dropped), those who queued meanwhile
/// are handed to a flusher.
struct Lead<'a> {
    cluster: &'a Arc<Cluster>,
    key: Option<Batch>,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.cluster.hand_over(key);
        }
    }
}

/// How long a lease may be spent; what is left after goes back to the store.
const LEASE_FOR: Duration = Duration::from_millis(250);
/// The requests a lease asks for: twice what the last one spent, within these.
const LEASE_FIRST: u64 = 16;
const LEASE_MOST: u64 = 1024;
/// The fewest requests a lease is worth (fewer: the key is too near its limits or too small to
/// lease, and each request asks the store).
const LEASE_FEWEST: u64 = 8;
/// How long the store counts a lease as outstanding when its replica does not give it back:
/// longer than the replica spends it, whatever the call took or the clocks drift.
const LEASE_STORE_LIFE: Duration = Duration::from_millis(1250);

/// A share of a key's buckets taken from the store ahead of its requests, spent here without a
/// call. Taken only while the key is far from its limits (`admit.lua` says how far), so the fleet
/// never admits more than the buckets hold; what is not spent within [`LEASE_FOR`] goes back.
#[derive(Debug, Clone)]
struct Lease {
    /// The key, limits and month it was taken for.
    key: Batch,
    /// Its name in the store (this replica's id and a count).
    id: String,
    /// Requests left (keys with `rpm`).
    requests: u64,
    /// Tokens left (keys with `tpm`).
    tokens: u64,
    until: std::time::Instant,
    /// Requests admitted on it.
    used: u64,
    /// The key's spend as the store last said (keys with a lease have no budget).
    usd: f64,
}

impl Lease {
    /// Whether it was taken for these limits and month.
    fn is_for(&self, rpm: u32, tpm: u64, month: &str) -> bool {
        self.key.rpm == rpm && self.key.tpm == tpm && self.key.month == month
    }

    /// Spends one request of `tokens` on the lease, if it holds them and has not run out.
    fn take(&mut self, tokens: u64, now: std::time::Instant) -> bool {
        let (rpm, tpm) = (self.key.rpm, self.key.tpm);
        if now >= self.until || (rpm > 0 && self.requests == 0) || (tpm > 0 && tokens > self.tokens)
        {
            return false;
        }
        if rpm > 0 {
            self.requests -= 1;
        }
        if tpm > 0 {
            self.tokens -= tokens;
        }
        self.used += 1;
        true
    }

    /// What goes back to the store: the requests and tokens left.
    fn left(&self) -> (u64, u64) {
        (
            if self.key.rpm > 0 { self.requests } else { 0 },
            if self.key.tpm > 0 { self.tokens } else { 0 },
        )
    }
}

/// A lease that ends: its name, and the requests and tokens left of it.
type GivenBack = (String, (u64, u64));

/// What the admission script answered: a verdict a request, and the lease granted (requests,
/// tokens), if any.
type LeasedVerdicts = Result<(Vec<Result<Verdict, ()>>, Option<(u64, u64)>), String>;

/// Admissions of one key waiting for the next call at most; more are admitted on local state
/// (the store is not keeping up).
const MAX_BATCH_WAITING: usize = 4096;

/// What the shared store said about one admission.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Admitted; the key's spend this month as the store holds it.
    Admitted {
        usd: f64,
    },
    Budget {
        usd: f64,
    },
    /// `requests` or `tokens` refused: tokens left, when the take would pass, when full.
    Limited {
        kind: &'static str,
        remaining: u64,
        retry_after: Duration,
        reset: Duration,
    },
}

/// A request's end, to be applied to the store.
#[derive(Debug, Clone)]
pub struct Settle {
    pub client: String,
    pub month: String,
    /// The reservation to let go (`None`: the request held none in the store). A request
    /// admitted on its own while the store was slow still names the reservation it asked for:
    /// the store's late run of that admission is rolled back by it.
    pub request: Option<String>,
    /// The settle's own name (unique: the gateway makes it, never the client): the store
    /// applies a settle of a name once, so one sent again after a call that timed out (and ran)
    /// charges nothing twice.
    pub id: String,
    /// Sent once already in a call whose answer was lost: kept apart (never merged into a new
    /// name) so the store can tell it was applied.
    pub sent: bool,
    pub usd: f64,
    pub completion_tokens: u64,
    pub tpm: u64,
    /// The key's `rpm` (0: none) and budget: with `tpm` and the month, the admissions a settle
    /// can ride along with.
    pub rpm: u32,
    pub budget: Option<f64>,
}

impl Settle {
    fn batch(&self) -> Batch {
        Batch {
            client: self.client.clone(),
            rpm: self.rpm,
            tpm: self.tpm,
            budget: self.budget.filter(|b| b.is_finite()).map(f64::to_bits),
            month: self.month.clone(),
        }
    }
}

/// The store's state as `/status` shows it.
#[derive(Debug, Default)]
struct Status {
    last_error: Option<String>,
    /// When `last_error` happened (it stays after the store is back).
    last_error_at: Option<SystemTime>,
    down_since: Option<SystemTime>,
    last_ok: Option<SystemTime>,
    /// Up without a break since.
    up_since: Option<std::time::Instant>,
    outages: u64,
}

pub struct Cluster {
    settings: Settings,
    client: redis::Client,
    /// This process among the replicas.
    replica: String,
    conn: ConnectionManager,
    /// The store answered the last call (requests use it only then).
    up: AtomicBool,
    /// Connected once at least: until then requests admit on their own, split by one.
    ever_up: AtomicBool,
    replicas: AtomicU64,
    /// Where the count last seen is kept (the data dir), if anywhere.
    replicas_file: Option<std::path::PathBuf>,
    status: Mutex<Status>,
    settles: mpsc::Sender<Settle>,
    settles_rx: Mutex<Option<mpsc::Receiver<Settle>>>,
    settles_dropped: AtomicU64,
    /// Woken when a request finds the store away, so the keeper retries at once.
    wake: Notify,
    /// Notified when the store is back.
    back: Notify,
    admit: redis::Script,
    settle: redis::Script,
    seed: redis::Script,
    heartbeat: redis::Script,
    share: redis::Script,
    turn: redis::Script,
    facts_shared: AtomicU64,
    facts_applied: AtomicU64,
    alerts: crate::ops::alerts::Alerts,
    /// Store waits of requests that found the store answering: the longest, in µs.
    longest_wait_us: AtomicU64,
    fallbacks: AtomicU64,
    /// Requests the store did not answer within `cluster.timeout`.
    slow_answers: AtomicU64,
    /// Admissions the store decided, and the calls that carried them.
    store_admissions: AtomicU64,
    admission_calls: AtomicU64,
    /// Settles that went with their key's admissions (no call of their own).
    settles_carried: AtomicU64,
    /// Costs of settles not yet known to be in the store, by key and month: what this
    /// replica's own view of a month holds beyond the store's. Seeding after an outage raises
    /// the store to that view less these (the settles bring them, each once), so a month is
    /// never counted twice.
    unsettled_usd: Mutex<std::collections::HashMap<(String, String), f64>>,
    /// Admissions waiting for their key's next call; an entry exists while its flusher runs.
    batches: Mutex<std::collections::HashMap<Batch, Group>>,
    /// Leases of keys without a budget, by key name (one a key: a lease for other limits or
    /// another month goes to `ended`).
    leases: Mutex<std::collections::HashMap<String, Lease>>,
    /// Leases replaced by one for other limits or month, to be given back.
    ended: Mutex<Vec<Lease>>,
    /// Leases asked for so far (names them).
    lease_count: AtomicU64,
    /// Admissions spent on leases, leases granted, and leases that went back with units left.
    lease_admissions: AtomicU64,
    leases_granted: AtomicU64,
    leases_returned: AtomicU64,
}

impl Cluster {
    /// Builds the client; nothing is connected until the keeper's first heartbeat (a store
    /// away at start is an outage like any other: the gateway starts and serves).
    /// `data_dir` keeps the replica count last seen (`cluster-replicas`), so a replica
    /// restarted while the store is away still splits limits by the fleet, not by one.
    pub fn new(
        settings: Settings,
        alerts: crate::ops::alerts::Alerts,
        data_dir: Option<&std::path::Path>,
    ) -> anyhow::Result<Cluster> {
        let replicas_file = data_dir.map(|d| d.join("cluster-replicas"));
        let kept = replicas_file
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|n| (1..=10_000).contains(n));
        let replicas = kept.unwrap_or(1).max(settings.replicas.unwrap_or(1));
        let client = redis::Client::open(settings.url.expose().trim())
            .map_err(|_| anyhow::anyhow!("cluster.redis: not a redis URL"))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(BACKGROUND_TIMEOUT))
            .set_response_timeout(Some(BACKGROUND_TIMEOUT))
            .set_number_of_retries(1)
            .set_max_delay(MAX_BACKOFF);
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map_err(|e| anyhow::anyhow!("cluster.redis: {}", scrub(&settings, &e.to_string())))?;
        let (tx, rx) = mpsc::channel(SETTLE_QUEUE);
        Ok(Cluster {
            client,
            replica: uuid::Uuid::new_v4().to_string(),
            conn,
            up: AtomicBool::new(false),
            ever_up: AtomicBool::new(false),
            replicas: AtomicU64::new(replicas),
            replicas_file,
            status: Mutex::new(Status::default()),
            settles: tx,
            settles_rx: Mutex::new(Some(rx)),
            settles_dropped: AtomicU64::new(0),
            wake: Notify::new(),
            back: Notify::new(),
            admit: redis::Script::new(include_str!("admit.lua")),
            settle: redis::Script::new(include_str!("settle.lua")),
            seed: redis::Script::new(include_str!("seed.lua")),
            heartbeat: redis::Script::new(include_str!("heartbeat.lua")),
            share: redis::Script::new(include_str!("share.lua")),
            turn: redis::Script::new(include_str!("turn.lua")),
            facts_shared: AtomicU64::new(0),
            facts_applied: AtomicU64::new(0),
            alerts,
            longest_wait_us: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            slow_answers: AtomicU64::new(0),
            batches: Mutex::new(Default::default()),
            unsettled_usd: Mutex::new(Default::default()),
            store_admissions: AtomicU64::new(0),
            admission_calls: AtomicU64::new(0),
            settles_carried: AtomicU64::new(0),
            leases: Mutex::new(Default::default()),
            ended: Mutex::new(Vec::new()),
            lease_count: AtomicU64::new(0),
            lease_admissions: AtomicU64::new(0),
            leases_granted: AtomicU64::new(0),
            leases_returned: AtomicU64::new(0),
            settings,
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

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

    fn key(&self, parts: &[&str]) -> String {
        let mut k = self.settings.key_prefix.clone();
        k.push_str(&parts.join(":"));
        k
    }

    /// Asks the store to admit one request, within `cluster.timeout`. `Err` (the store away or
    /// slow) means: admit on local state.
    ///
    /// Requests for one key (with the same limits and month) that ask while a call for that key
    /// is on its way go together in the next call (group commit): the script takes them in
    /// order, each as if alone, so the counts stay exact; under load a call carries many.
    pub async fn admit(self: &Arc<Self>, a: &Admit<'_>) -> Result<Verdict, ()> {
        if !self.is_up() {
            self.fallbacks.fetch_add(1, Ordering::Relaxed);
            return Err(());
        }
        let budget = a.budget.filter(|b| b.is_finite()).map(f64::to_bits);
        if budget.is_none()
            && let Some(usd) = self.admit_on_lease(
                a.client,
                a.rpm.unwrap_or(0),
                a.tpm.unwrap_or(0),
                a.month,
                a.tokens,
            )
        {
            return Ok(Verdict::Admitted { usd });
        }
        let key = Batch {
            client: a.client.to_string(),
            rpm: a.rpm.unwrap_or(0),
            tpm: a.tpm.unwrap_or(0),
            budget,
            month: a.month.to_string(),
        };
        let ask = Ask {
            tokens: a.tokens,
            reserve: if a.reserve.is_finite() {
                a.reserve.max(0.0)
            } else {
                0.0
            },
            request: a.request.to_string(),
        };
        let started = std::time::Instant::now();
        // The first to ask for a key calls at once, for itself alone (no hop through another
        // task when the key is quiet); those who ask while that call is out wait together for
        // the next, which a flusher makes for them.
        let turn = {
            let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
            match batches.get_mut(&key) {
                Some(g) if g.waiting.len() < MAX_BATCH_WAITING => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    g.waiting.push(Waiting { ask, tx });
                    Turn::Wait(rx)
                }
                Some(_) => {
                    drop(batches);
                    self.fallbacks.fetch_add(1, Ordering::Relaxed);
                    self.slow_answers.fetch_add(1, Ordering::Relaxed);
                    self.wake.notify_one();
                    return Err(());
                }
                None => {
                    batches.insert(key.clone(), Group::default());
                    Turn::Call(ask)
                }
            }
        };
        let answer = match turn {
            Turn::Call(ask) => {
                // Whoever queues meanwhile goes in the next call, or the key is quiet again —
                // also when this request is dropped mid-call (its client gone).
                let lead = Lead {
                    cluster: self,
                    key: Some(key.clone()),
                };
                let answer = tokio::time::timeout(
                    self.settings.timeout,
                    self.admit_batch(&key, &[&ask], &[]),
                )
                .await;
                drop(lead);
                match answer {
                    Ok(Ok(mut v)) => Ok(Ok(v.pop().unwrap_or(Err(())))),
                    Ok(Err(e)) => {
                        self.down(&e);
                        Ok(Ok(Err(())))
                    }
                    Err(elapsed) => Err(elapsed),
                }
            }
            Turn::Wait(rx) => tokio::time::timeout(self.settings.timeout, rx).await,
        };
        let verdict = match answer {
            Ok(Ok(Ok(v))) => v,
            Ok(Ok(Err(()))) | Ok(Err(_)) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                return Err(());
            }
            Err(_) => {
                // Slow is not down: this request is admitted alone (its place in the batch is
                // given up if the call has not left yet), and the keeper asks the store at once
                // (with its own, longer timeout) whether it is away.
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                self.slow_answers.fetch_add(1, Ordering::Relaxed);
                self.note_error(&format!(
                    "no answer within cluster.timeout ({} ms)",
                    self.settings.timeout.as_millis()
                ));
                self.wake.notify_one();
                return Err(());
            }
        };
        let waited = started.elapsed().as_micros() as u64;
        self.longest_wait_us.fetch_max(waited, Ordering::Relaxed);
        Ok(verdict)
    }

    /// After a call for `key`: the admissions that queued meanwhile get a flusher, or the key is
    /// quiet again (the next to ask calls at once).
    fn hand_over(self: &Arc<Self>, key: Batch) {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = batches.get_mut(&key) {
            g.waiting.retain(|w| !w.tx.is_closed());
            if g.waiting.is_empty() {
                // Settles that waited for admissions that did not come go the settler's way.
                let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                drop(batches);
                self.to_settler(settles);
            } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
                drop(batches);
                rt.spawn(self.clone().flush(key));
            } else {
                // No runtime (shutting down): the waiting give up at their timeout.
                let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                drop(batches);
                self.to_settler(settles);
            }
        }
    }

    /// Sends the admissions waiting for `key`, call after call, until none is left.
    async fn flush(self: Arc<Self>, key: Batch) {
        loop {
            let (batch, settles) = {
                let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
                let Some(g) = batches.get_mut(&key) else {
                    return;
                };
                // A request that stopped waiting (past `cluster.timeout`) was admitted on its
                // own: it takes nothing from the store.
                g.waiting.retain(|w| !w.tx.is_closed());
                if g.waiting.is_empty() {
                    let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                    drop(batches);
                    self.to_settler(settles);
                    return;
                }
                (
                    std::mem::take(&mut g.waiting),
                    std::mem::take(&mut g.settles),
                )
            };
            // Those the lease the last call brought can hold take nothing from the store.
            let batch: Vec<Waiting> = batch
                .into_iter()
                .filter_map(|w| match self.lease_for(&key, w.ask.tokens) {
                    Some(usd) => {
                        let _ = w.tx.send(Ok(Verdict::Admitted { usd }));
                        None
                    }
                    None => Some(w),
                })
                .collect();
            if batch.is_empty() {
                if !settles.is_empty() {
                    self.to_settler(settles);
                }
                continue;
            }
            let asks: Vec<&Ask> = batch.iter().map(|w| &w.ask).collect();
            let verdicts = self.admit_batch(&key, &asks, &settles).await;
            match verdicts {
                Ok(vs) => {
                    self.unsettled(&settles, -1.0);
                    self.settles_carried
                        .fetch_add(settles.len() as u64, Ordering::Relaxed);
                    for (w, v) in batch.into_iter().zip(vs) {
                        let _ = w.tx.send(v);
                    }
                }
                Err(e) => {
                    self.down(&e);
                    // Not known to be applied (the call may have run): the settler sends them
                    // again when the store is back, each under its own name, so the store
                    // applies each once.
                    self.to_settler(settles.into_iter().map(|mut s| {
                        s.sent = true;
                        s
                    }));
                    for w in batch {
                        let _ = w.tx.send(Err(()));
                    }
                }
            }
        }
    }

    /// [`Cluster::admit_on_lease`] for a queued admission of `key`.
    fn lease_for(&self, key: &Batch, tokens: u64) -> Option<f64> {
        if key.budget.is_some() {
            return None;
        }
        self.admit_on_lease(&key.client, key.rpm, key.tpm, &key.month, tokens)
    }

    /// Admits one request of a key without a budget on its lease, if it has one for these
    /// limits and month that holds it: the key's spend as last seen.
    fn admit_on_lease(
        &self,
        client: &str,
        rpm: u32,
        tpm: u64,
        month: &str,
        tokens: u64,
    ) -> Option<f64> {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        if leases.is_empty() {
            return None;
        }
        let lease = leases.get_mut(client)?;
        if !lease.is_for(rpm, tpm, month) || !lease.take(tokens, std::time::Instant::now()) {
            return None;
        }
        let usd = lease.usd;
        drop(leases);
        self.lease_admissions.fetch_add(1, Ordering::Relaxed);
        Some(usd)
    }

    /// One call of the admission script for `batch`; a verdict for each, in order. A key
    /// without a budget gives back what is left of its lease and asks for a new one, sized by
    /// what the last one spent.
    async fn admit_batch(
        &self,
        key: &Batch,
        batch: &[&Ask],
        settles: &[Settle],
    ) -> Result<Vec<Result<Verdict, ()>>, String> {
        let leasing = key.budget.is_none() && (key.rpm > 0 || key.tpm > 0) && !batch.is_empty();
        let (ask, back) = if leasing {
            let old = self
                .leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key.client);
            // One for other limits or another month (a reload, a new month) ends by itself.
            let old = match old {
                Some(l) if !l.is_for(key.rpm, key.tpm, &key.month) => {
                    self.ended.lock().unwrap_or_else(|e| e.into_inner()).push(l);
                    None
                }
                old => old,
            };
            let n = old.as_ref().map_or(LEASE_FIRST, |l| {
                l.used.saturating_mul(2).clamp(LEASE_FIRST, LEASE_MOST)
            });
            let per = batch.iter().map(|w| w.tokens).max().unwrap_or(0).max(1);
            let back = old.map(|l| {
                let left = l.left();
                if left != (0, 0) {
                    self.leases_returned.fetch_add(1, Ordering::Relaxed);
                }
                (l.id, left)
            });
            (
                Some([
                    n,
                    n.saturating_mul(per),
                    LEASE_FEWEST,
                    LEASE_FEWEST.saturating_mul(per),
                ]),
                back,
            )
        } else {
            (None, None)
        };
        let id = ask.map(|_| {
            format!(
                "{}:{}",
                self.replica,
                self.lease_count.fetch_add(1, Ordering::Relaxed)
            )
        });
        // The lease's time counts from before the call: it ends here before it ends in the
        // store, whatever the call took.
        let asked_at = std::time::Instant::now();
        let (verdicts, lease) = self
            .invoke_admit(key, batch, settles, ask.zip(id.as_deref()), back)
            .await?;
        if let (Some((requests, tokens)), Some(id)) = (lease, id) {
            let usd = verdicts
                .iter()
                .rev()
                .find_map(|v| match v {
                    Ok(Verdict::Admitted { usd } | Verdict::Budget { usd }) => Some(*usd),
                    _ => None,
                })
                .unwrap_or(0.0);
            self.leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    key.client.clone(),
                    Lease {
                        key: key.clone(),
                        id,
                        requests,
                        tokens,
                        until: asked_at + LEASE_FOR,
                        used: 0,
                        usd,
                    },
                );
            self.leases_granted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(verdicts)
    }

    /// Gives back what is left of leases that ran out of time (or all, `all`), one call a key.
    async fn give_back(&self, all: bool) -> Result<(), String> {
        let now = std::time::Instant::now();
        let mut expired: Vec<Lease> =
            std::mem::take(&mut *self.ended.lock().unwrap_or_else(|e| e.into_inner()));
        {
            let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            let names: Vec<String> = leases
                .iter()
                .filter(|(_, l)| all || l.until <= now)
                .map(|(k, _)| k.clone())
                .collect();
            expired.extend(names.into_iter().filter_map(|k| leases.remove(&k)));
        }
        // Spent whole, a lease that ran out of time ends in the store by its expiry.
        for l in expired {
            let left = l.left();
            if left == (0, 0) {
                continue;
            }
            self.invoke_admit(&l.key, &[], &[], None, Some((l.id, left)))
                .await?;
            self.leases_returned.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The admission script itself: verdicts in order, and the lease granted if one was asked
    /// (`ask`: requests, tokens, and the fewest of each worth a lease; the lease's name) and
    /// given. `back`: a lease that ends, and what is left of it.
    async fn invoke_admit(
        &self,
        key: &Batch,
        batch: &[&Ask],
        settles: &[Settle],
        ask: Option<([u64; 4], &str)>,
        back: Option<GivenBack>,
    ) -> LeasedVerdicts {
        let client = key.client.as_str();
        let ([lr, lt, minr, mint], lease_id) = ask.unwrap_or(([0; 4], ""));
        let (back_id, (backr, backt)) = back.unwrap_or_default();
        let limits = format!("{}:{}", key.rpm, key.tpm);
        let mut inv = self.admit.prepare_invoke();
        inv.key(self.key(&["rpm", client, &key.rpm.to_string()]))
            .key(self.key(&["tpm", client, &key.tpm.to_string()]))
            .key(self.key(&["spend", client, &key.month]))
            .key(self.key(&["resv", client]))
            .key(self.key(&["resvamt", client]))
            .key(self.key(&["resvtot", client]))
            .key(self.key(&["lease", client, &limits]))
            .key(self.key(&["leaseamt", client, &limits]))
            .key(self.key(&["settled", client]))
            .arg(key.rpm)
            .arg(key.tpm)
            .arg(key.budget.map(f64::from_bits).unwrap_or(-1.0))
            .arg(HOLD.as_millis() as u64)
            .arg(settles.len())
            .arg(SPEND_TTL.as_secs())
            .arg(lr)
            .arg(lt)
            .arg(self.replicas())
            .arg(minr)
            .arg(mint)
            .arg(lease_id)
            .arg(LEASE_STORE_LIFE.as_millis() as u64)
            .arg(back_id)
            .arg(backr)
            .arg(backt)
            .arg(SETTLED_FOR.as_millis() as u64);
        for s in settles {
            inv.arg(s.request.as_deref().unwrap_or(""))
                .arg(if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                })
                .arg(s.completion_tokens)
                .arg(&s.id);
        }
        for w in batch {
            inv.arg(w.tokens).arg(w.reserve).arg(&w.request);
        }
        let mut conn = self.conn.clone();
        let answer = tokio::time::timeout(
            BACKGROUND_TIMEOUT,
            inv.invoke_async::<Vec<redis::Value>>(&mut conn),
        )
        .await
        .map_err(|_| format!("no answer within {} ms", BACKGROUND_TIMEOUT.as_millis()))?
        .map_err(|e| e.to_string())?;
        self.admission_calls.fetch_add(1, Ordering::Relaxed);
        self.store_admissions
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if answer.len() != batch.len() * 5 + 3 {
            return Err(format!(
                "the admission script answered {} values for {} requests",
                answer.len(),
                batch.len()
            ));
        }
        let (answer, lease) = answer.split_at(batch.len() * 5);
        let (granted, requests, tokens): (u64, u64, u64) =
            redis::from_redis_value(redis::Value::Array(lease.to_vec()))
                .map_err(|e| e.to_string())?;
        // Never more than was asked, whatever the store says.
        let lease = (ask.is_some() && granted == 1).then_some((requests.min(lr), tokens.min(lt)));
        let verdicts = answer
            .chunks(5)
            .map(|c| {
                let (v, usd, retry, reset, remaining): (String, String, u64, u64, String) =
                    redis::from_redis_value(redis::Value::Array(c.to_vec()))
                        .map_err(|e| e.to_string())?;
                let usd = usd
                    .parse::<f64>()
                    .ok()
                    .filter(|u| u.is_finite())
                    .unwrap_or(0.0);
                let remaining = remaining.parse::<f64>().unwrap_or(0.0).max(0.0) as u64;
                let limited = |kind| Verdict::Limited {
                    kind,
                    remaining,
                    retry_after: Duration::from_millis(retry),
                    reset: Duration::from_millis(reset),
                };
                Ok(Ok(match v.as_str() {
                    "ok" => Verdict::Admitted { usd },
                    "budget" => Verdict::Budget { usd },
                    "requests" => limited("requests"),
                    "tokens" => limited("tokens"),
                    other => {
                        return Err(format!(
                            "unexpected answer from the admission script: {other:.40}"
                        ));
                    }
                }))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok((verdicts, lease))
    }

    /// Queues a request's end for the store (never waits). Completion tokens of a key holding a
    /// lease are charged to the lease first (its tokens are the fleet's, taken from the bucket).
    pub fn settle(&self, mut s: Settle) {
        if s.completion_tokens > 0 && s.tpm > 0 && s.budget.is_none() {
            self.charge_lease(&mut s);
        }
        if s.request.is_none() && s.usd <= 0.0 && s.completion_tokens == 0 {
            return;
        }
        self.unsettled(std::slice::from_ref(&s), 1.0);
        // While a call for the key is out, the settle goes in the key's next call (the same
        // keys, one call instead of two under load).
        let s = {
            let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
            // No call out (the quiet case): no key to build.
            if batches.is_empty() {
                drop(batches);
                self.queue_settle(s);
                return;
            }
            match batches.get_mut(&s.batch()) {
                Some(g) if g.settles.len() < MAX_BATCH_WAITING => {
                    g.settles.push(s);
                    return;
                }
                _ => s,
            }
        };
        self.to_settler(std::iter::once(s));
    }

    /// Takes `s`'s completion tokens from its key's lease, as many as it holds.
    fn charge_lease(&self, s: &mut Settle) {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        if leases.is_empty() {
            return;
        }
        let Some(lease) = leases.get_mut(&s.client) else {
            return;
        };
        if !lease.is_for(s.rpm, s.tpm, &s.month) || std::time::Instant::now() >= lease.until {
            return;
        }
        let t = lease.tokens.min(s.completion_tokens);
        lease.tokens -= t;
        s.completion_tokens -= t;
    }

    /// Counts `settles`' costs as not yet in the store (`sign` 1) or as applied (-1).
    fn unsettled(&self, settles: &[Settle], sign: f64) {
        let mut map = self.unsettled_usd.lock().unwrap_or_else(|e| e.into_inner());
        for s in settles {
            if !(s.usd.is_finite() && s.usd > 0.0) {
                continue;
            }
            let k = (s.client.clone(), s.month.clone());
            let v = map.entry(k.clone()).or_insert(0.0);
            *v += sign * s.usd;
            if *v <= 1e-12 {
                map.remove(&k);
            }
        }
    }

    /// Queues settles for the settler (never waits; a full queue drops and counts).
    fn to_settler(&self, settles: impl IntoIterator<Item = Settle>) {
        for s in settles {
            self.queue_settle(s);
        }
    }

    fn queue_settle(&self, s: Settle) {
        if let Err(e) = self.settles.try_send(s) {
            // Lost: the next seeding carries its cost instead.
            let (tokio::sync::mpsc::error::TrySendError::Full(s)
            | tokio::sync::mpsc::error::TrySendError::Closed(s)) = e;
            self.unsettled(std::slice::from_ref(&s), -1.0);
            let n = self.settles_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n == 1 || n.is_multiple_of(1000) {
                tracing::warn!(
                    dropped_total = n,
                    "cluster settle queue full: a request's cost was not sent to the shared store"
                );
            }
        }
    }

    fn note_error(&self, error: &str) {
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
    fn down(&self, error: &str) {
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

    async fn call<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, String> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(BACKGROUND_TIMEOUT, inv.invoke_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {} ms",
                BACKGROUND_TIMEOUT.as_millis()
            )),
        }
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

    /// Applies `settles` in one call.
    async fn apply(&self, settles: &[Settle]) -> Result<(), String> {
        let mut inv = self.settle.prepare_invoke();
        inv.arg(SPEND_TTL.as_secs())
            .arg(SETTLED_FOR.as_millis() as u64);
        for s in settles {
            inv.key(self.key(&["spend", &s.client, &s.month]))
                .key(self.key(&["resv", &s.client]))
                .key(self.key(&["resvamt", &s.client]))
                .key(self.key(&["resvtot", &s.client]))
                .key(self.key(&["tpm", &s.client, &s.tpm.to_string()]))
                .key(self.key(&["settled", &s.client]))
                .arg(&s.id)
                .arg(s.request.as_deref().unwrap_or(""))
                .arg(if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                })
                .arg(s.completion_tokens)
                .arg(s.tpm);
        }
        self.call::<i64>(&inv).await.map(|_| ())
    }

    /// Waits until the store is back (or [`MAX_BACKOFF`] passed, to look again); false when
    /// the gateway is stopping.
    async fn until_back(&self, cancel: &CancellationToken) -> bool {
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

/// Where a fact is stored among its endpoint's, and whether it is a clear.
fn fact_field(f: &Fact) -> String {
    match f {
        Fact::Cooldown { .. } => "cooldown".into(),
        Fact::Retired { .. } => "retired".into(),
        Fact::KeyRejected { key, .. } => format!("key:{key}"),
        Fact::Window { .. } => "window".into(),
        Fact::Cleared { .. } => String::new(),
        // Published only: stale within seconds.
        Fact::RateLimit { .. } => "-".into(),
    }
}

/// A fact message: who learned it, and what.
#[derive(serde::Serialize, serde::Deserialize)]
struct Message {
    origin: String,
    fact: Fact,
}

impl Cluster {
    async fn publish(&self, fact: &Fact) -> Result<(), String> {
        self.share_fact(fact, true).await
    }

    /// Stores `fact`, and publishes it when `publish` (the running replicas apply it at once).
    async fn share_fact(&self, fact: &Fact, publish: bool) -> Result<(), String> {
        let body = serde_json::to_string(fact).map_err(|e| e.to_string())?;
        let msg = serde_json::to_string(&Message {
            origin: self.replica.clone(),
            fact: fact.clone(),
        })
        .map_err(|e| e.to_string())?;
        let mut inv = self.share.prepare_invoke();
        inv.key(self.key(&["facts", fact.endpoint()]))
            .arg(fact_field(fact))
            .arg(body)
            .arg(msg)
            .arg(if publish {
                self.key(&["facts"])
            } else {
                String::new()
            })
            .arg(FACTS_TTL.as_secs());
        self.call::<i64>(&inv).await.map(|_| ())
    }

    /// `autohedge endpoint clear` with no gateway answering: drops what the fleet stored about
    /// `endpoint` and tells the replicas that run (one that starts later finds nothing to apply).
    pub async fn clear_endpoint(&self, endpoint: &str) -> Result<(), String> {
        self.publish(&Fact::Cleared {
            endpoint: endpoint.to_string(),
        })
        .await
        .map_err(|e| scrub(&self.settings, &e))
    }

    /// Stores one `/v1/responses` turn (its JSON, from `routing::conversations`) for `ttl`, so
    /// another replica can continue the conversation. Off the request path (a task of its own);
    /// a store away loses the share, never the request.
    /// Keeps a turn for the other replicas (`turn.lua`), bounded in the store as in each
    /// replica: `bounds.max_bytes` in all, `max_bytes_per_key` for `client`'s turns (its own
    /// oldest go first), each for `bounds.ttl`.
    pub async fn put_turn(
        &self,
        id: &str,
        client: Option<&str>,
        json: String,
        bounds: crate::routing::conversations::Bounds,
    ) {
        if !self.is_up() {
            return;
        }
        let ms = bounds.ttl.as_millis().clamp(1, u64::MAX as u128) as u64;
        let inv = self.turn_call(id, client, &json, ms, bounds, "put");
        if self.call::<i64>(&inv).await.is_err() {
            tracing::debug!("a /v1/responses turn was not shared (store away or slow)");
        }
    }

    /// The turn another replica stored under `id`, within `cluster.timeout` (`deadline`);
    /// `None` when there is none, it is larger than `max_bytes`, or the store did not answer.
    pub async fn get_turn(
        &self,
        id: &str,
        max_bytes: u64,
        deadline: tokio::time::Instant,
    ) -> Option<String> {
        if !self.is_up() {
            return None;
        }
        let mut conn = self.conn.clone();
        let got = tokio::time::timeout_at(
            deadline,
            redis::cmd("GET")
                .arg(self.key(&["resp", id]))
                .query_async::<Option<String>>(&mut conn),
        )
        .await
        .ok()?
        .ok()??;
        (got.len() as u64 <= max_bytes).then_some(got)
    }

    /// `turn.lua` for `id` of `client`'s: `put` keeps `json` for `ms`, within `bounds`;
    /// `delete` forgets it.
    fn turn_call(
        &self,
        id: &str,
        client: Option<&str>,
        json: &str,
        ms: u64,
        bounds: crate::routing::conversations::Bounds,
        mode: &str,
    ) -> redis::ScriptInvocation<'_> {
        let who = client.unwrap_or("");
        let mut inv = self.turn.prepare_invoke();
        inv.key(self.key(&["turns"]))
            .key(self.key(&["turns", "k", who]))
            .key(self.key(&["turnsize"]))
            .key(self.key(&["turnbytes"]))
            .arg(id)
            .arg(json)
            .arg(ms)
            .arg(bounds.max_bytes)
            .arg(bounds.max_bytes_per_key)
            .arg(who)
            .arg(self.key(&["resp", ""]))
            .arg(self.key(&["turns", "k", ""]))
            .arg(mode);
        inv
    }

    /// Forgets a shared turn (`DELETE /v1/responses/{id}`), its bytes with it.
    pub async fn delete_turn(&self, id: &str, client: Option<&str>) {
        let none = crate::config::HistoryBounds {
            ttl: Duration::from_millis(1),
            max_bytes: 0,
            max_bytes_per_key: 0,
        };
        let inv = self.turn_call(id, client, "", 1, none, "delete");
        let _ = self.call::<i64>(&inv).await;
    }

    /// Every stored fact about `endpoints` (a replica that starts or reconnects catches up).
    async fn stored_facts(&self, endpoints: &[String]) -> Result<Vec<Fact>, String> {
        let mut out = Vec::new();
        for e in endpoints {
            let mut conn = self.conn.clone();
            let got = tokio::time::timeout(
                BACKGROUND_TIMEOUT,
                redis::cmd("HGETALL")
                    .arg(self.key(&["facts", e]))
                    .query_async::<Vec<(String, String)>>(&mut conn),
            )
            .await
            .map_err(|_| "no answer reading shared facts".to_string())?
            .map_err(|e| e.to_string())?;
            for (_, v) in got {
                if v.len() <= MAX_FACT_BYTES
                    && let Ok(f) = serde_json::from_str::<Fact>(&v)
                    && f.endpoint() == e
                {
                    out.push(f);
                }
            }
        }
        Ok(out)
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

/// The message without the store's URL or its password.
fn scrub(settings: &Settings, msg: &str) -> String {
    let mut out = msg.to_string();
    let url = settings.url.expose().trim();
    if !url.is_empty() {
        out = out.replace(url, &settings.display);
    }
    if let Ok(u) = reqwest::Url::parse(url)
        && let Some(p) = u.password()
        && !p.is_empty()
    {
        out = out.replace(p, "[redacted]");
        if let Ok(decoded) = urlencoding_decode(p)
            && !decoded.is_empty()
        {
            out = out.replace(&decoded, "[redacted]");
        }
    }
    out.chars().take(300).collect()
}

fn urlencoding_decode(s: &str) -> Result<String, std::string::FromUtf8Error> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(h) = b.get(i + 1..i + 3)
            && let Ok(v) = u8::from_str_radix(std::str::from_utf8(h).unwrap_or("zz"), 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
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

/// Shares what this replica learns, in order; while the store is away facts wait in the queue.
async fn sharer(cluster: Arc<Cluster>, mut rx: mpsc::Receiver<Fact>, cancel: CancellationToken) {
    loop {
        let fact = tokio::select! {
            _ = cancel.cancelled() => return,
            f = rx.recv() => match f {
                Some(f) => f,
                None => return,
            },
        };
        loop {
            if !cluster.is_up() {
                if !cluster.until_back(&cancel).await {
                    return;
                }
                continue;
            }
            match cluster.publish(&fact).await {
                Ok(()) => {
                    cluster.facts_shared.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) => cluster.down(&e),
            }
        }
    }
}

/// Applies what the other replicas learn: subscribes to the facts channel, then reads every
/// stored fact (what was learned before this replica started or while it was cut off), then
/// applies each message as it comes. Starts over, with backoff, when the subscription breaks.
async fn listener(
    cluster: Arc<Cluster>,
    endpoints: Arc<dyn Fn() -> Vec<String> + Send + Sync>,
    apply: Arc<dyn Fn(Fact) + Send + Sync>,
    cancel: CancellationToken,
) {
    use futures_util::StreamExt;
    let mut backoff = FIRST_BACKOFF;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        let subscribed = async {
            let mut ps =
                tokio::time::timeout(BACKGROUND_TIMEOUT, cluster.client.get_async_pubsub())
                    .await
                    .map_err(|_| "no answer subscribing".to_string())?
                    .map_err(|e| e.to_string())?;
            tokio::time::timeout(BACKGROUND_TIMEOUT, ps.subscribe(cluster.key(&["facts"])))
                .await
                .map_err(|_| "no answer subscribing".to_string())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(ps)
        }
        .await;
        let ps = match subscribed {
            Ok(ps) => ps,
            Err(e) => {
                cluster.note_error(&e);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        // Subscribed first, then read: a fact published in between is seen twice, never missed
        // (applying one twice changes nothing).
        match cluster.stored_facts(&endpoints()).await {
            Ok(facts) => {
                for f in facts {
                    cluster.facts_applied.fetch_add(1, Ordering::Relaxed);
                    apply(f);
                }
            }
            Err(e) => {
                cluster.note_error(&e);
                continue;
            }
        }
        backoff = FIRST_BACKOFF;
        let mut messages = ps.into_on_message();
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => return,
                m = messages.next() => m,
            };
            let Some(msg) = msg else {
                break;
            };
            let payload: Vec<u8> = msg.get_payload_bytes().to_vec();
            if payload.len() > MAX_FACT_BYTES {
                continue;
            }
            let Ok(m) = serde_json::from_slice::<Message>(&payload) else {
                continue;
            };
            if m.origin == cluster.replica {
                continue;
            }
            cluster.facts_applied.fetch_add(1, Ordering::Relaxed);
            apply(m.fact);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}

/// Applies settles in order; while the store is away they wait (in the queue) for it.
/// Settles sent in one call at most.
const SETTLE_BATCH: usize = 128;
/// How long the settler lets settles gather after the first of a batch arrives.
const SETTLE_LINGER: Duration = Duration::from_millis(2);

/// Gives back what leases left when their time ran out, so a key whose traffic stopped does not
/// keep units from the rest of the fleet.
async fn lease_keeper(cluster: Arc<Cluster>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(LEASE_FOR);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if cluster.is_up()
            && let Err(e) = cluster.give_back(false).await
        {
            cluster.down(&e);
        }
    }
}

/// Settles that hold no reservation, merged per key, month and `tpm` (their costs and tokens
/// add up): one entry each in the call instead of one a request. Those with a reservation stay
/// as they are.
fn merge_settles(batch: &[Settle]) -> Vec<Settle> {
    let mut out: Vec<Settle> = Vec::with_capacity(batch.len());
    let mut at: std::collections::HashMap<(&str, &str, u64), usize> = Default::default();
    for s in batch {
        // A settle that may have been applied keeps its own name (a merged one takes a new).
        if s.request.is_some() || s.sent {
            out.push(s.clone());
            continue;
        }
        match at.get(&(s.client.as_str(), s.month.as_str(), s.tpm)) {
            Some(&i) => {
                let m = &mut out[i];
                if !m.id.starts_with("m:") {
                    m.id = format!("m:{}", uuid::Uuid::new_v4());
                }
                m.usd += if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                };
                m.completion_tokens = m.completion_tokens.saturating_add(s.completion_tokens);
            }
            None => {
                at.insert((s.client.as_str(), s.month.as_str(), s.tpm), out.len());
                let mut s = s.clone();
                s.usd = if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                };
                out.push(s);
            }
        }
    }
    out
}

async fn settler(cluster: Arc<Cluster>, cancel: CancellationToken) {
    let Some(mut rx) = cluster
        .settles_rx
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    else {
        return;
    };
    let mut pending: VecDeque<Settle> = VecDeque::new();
    // A call that failed is sent again as it was (the same merged settles under the same
    // names): it may have run, and the store tells a name it applied.
    let mut unanswered: Option<(Vec<Settle>, usize)> = None;
    loop {
        if pending.is_empty() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                s = rx.recv() => match s {
                    Some(s) => pending.push_back(s),
                    None => return,
                },
            }
            // A moment for more to gather: under load one call carries many (a settle is off
            // the request path; this delays a reservation's release by as much at most).
            if rx.len() + 1 < SETTLE_BATCH {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(SETTLE_LINGER) => {}
                }
            }
        }
        while let Ok(s) = rx.try_recv() {
            pending.push_back(s);
        }
        if pending.is_empty() {
            continue;
        }
        if !cluster.is_up() {
            if !cluster.until_back(&cancel).await {
                return;
            }
            continue;
        }
        // What queued while the last call ran goes in the next: one call, in order.
        let (batch, n) = unanswered.take().unwrap_or_else(|| {
            let n = pending.len().min(SETTLE_BATCH);
            (merge_settles(&pending.make_contiguous()[..n]), n)
        });
        match cluster.apply(&batch).await {
            Ok(()) => {
                let done: Vec<Settle> = pending.drain(..n).collect();
                cluster.unsettled(&done, -1.0);
            }
            Err(e) => {
                cluster.down(&e);
                unanswered = Some((batch, n));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn settings(url: &str) -> Settings {
        Settings {
            url: Secret::new(url.into()),
            display: display_url(url).unwrap_or_default(),
            key_prefix: "autohedge:".into(),
            timeout: Duration::from_millis(25),
            replicas: None,
        }
    }

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

    fn key(rpm: u32, tpm: u64, budget: Option<f64>) -> Batch {
        Batch {
            client: "k".into(),
            rpm,
            tpm,
            budget: budget.map(f64::to_bits),
            month: "2026-12".into(),
        }
    }

    #[test]
    fn a_lease_admits_what_it_holds_and_no_more() {
        let now = std::time::Instant::now();
        let lease = |key: Batch, requests: u64, tokens: u64, until| Lease {
            key,
            id: "r:0".into(),
            requests,
            tokens,
            until,
            used: 0,
            usd: 0.0,
        };
        let mut l = lease(key(100, 1000, None), 3, 250, now + LEASE_FOR);
        assert!(l.is_for(100, 1000, "2026-12"));
        assert!(!l.is_for(100, 1000, "2027-01") && !l.is_for(60, 1000, "2026-12"));
        assert!(l.take(100, now));
        assert!(l.take(100, now));
        // 50 tokens left: a request of 60 is not held (it asks the store), one of 50 is.
        assert!(!l.take(60, now));
        assert!(l.take(50, now));
        // No request left.
        assert!(!l.take(0, now));
        assert_eq!((l.used, l.left()), (3, (0, 0)));
        // Out of time, whatever it holds.
        let mut l = lease(key(100, 0, None), 5, 0, now);
        assert!(!l.take(0, now));
        assert_eq!(l.left(), (5, 0));
        // A key without `rpm` counts tokens only (and gives back no requests).
        let mut l = lease(key(0, 1000, None), 0, 10, now + LEASE_FOR);
        assert!(l.take(10, now));
        assert!(!l.take(1, now));
        assert_eq!(l.left(), (0, 0));
    }

    /// A leased key's completion tokens are charged to its lease first; what the lease cannot
    /// hold goes to the store (the settle queue), and a key without a lease sends them all.
    #[tokio::test]
    async fn completion_tokens_are_charged_to_the_lease_first() {
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let c = Cluster::new(settings("redis://127.0.0.1:1/0"), alerts, None).unwrap();
        let k = key(600, 6000, None);
        c.leases.lock().unwrap().insert(
            k.client.clone(),
            Lease {
                key: k.clone(),
                id: "r:0".into(),
                requests: 10,
                tokens: 20,
                until: std::time::Instant::now() + LEASE_FOR,
                used: 0,
                usd: 0.0,
            },
        );
        let settle = |tokens: u64, client: &str| Settle {
            client: client.into(),
            month: k.month.clone(),
            request: None,
            id: uuid::Uuid::new_v4().to_string(),
            sent: false,
            usd: 0.0,
            completion_tokens: tokens,
            tpm: 6000,
            rpm: 600,
            budget: None,
        };
        c.settle(settle(15, "k"));
        c.settle(settle(15, "k"));
        c.settle(settle(7, "other"));
        assert_eq!(c.leases.lock().unwrap()["k"].tokens, 0);
        let mut rx = c.settles_rx.lock().unwrap().take().unwrap();
        let queued: Vec<(String, u64)> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|s| (s.client, s.completion_tokens))
            .collect();
        assert_eq!(queued, vec![("k".into(), 10), ("other".into(), 7)]);
    }

    #[test]
    fn settles_without_a_reservation_merge_per_key_and_month() {
        let s = |client: &str, month: &str, request: Option<&str>, usd: f64, tokens: u64| Settle {
            client: client.into(),
            month: month.into(),
            request: request.map(str::to_string),
            id: uuid::Uuid::new_v4().to_string(),
            sent: false,
            usd,
            completion_tokens: tokens,
            tpm: 600,
            rpm: 0,
            budget: None,
        };
        let merged = merge_settles(&[
            s("a", "2026-12", None, 0.5, 10),
            s("b", "2026-12", None, 1.0, 1),
            s("a", "2026-12", Some("r1"), 0.25, 0),
            s("a", "2026-12", None, f64::NAN, 5),
            s("a", "2027-01", None, 2.0, 7),
            s("a", "2026-12", None, 0.5, 10),
        ]);
        let got: Vec<_> = merged
            .iter()
            .map(|m| {
                (
                    m.client.as_str(),
                    m.month.as_str(),
                    m.request.as_deref(),
                    m.usd,
                    m.completion_tokens,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", "2026-12", None, 1.0, 25),
                ("b", "2026-12", None, 1.0, 1),
                ("a", "2026-12", Some("r1"), 0.25, 0),
                ("a", "2027-01", None, 2.0, 7),
            ]
        );
    }

    #[test]
    fn the_url_is_shown_without_credentials() {
        assert_eq!(
            display_url("redis://user:s3cret@cache.internal:6380/2").as_deref(),
            Some("redis://cache.internal:6380/2")
        );
        assert_eq!(display_url("rediss://:pw@h").as_deref(), Some("rediss://h"));
        assert_eq!(display_url("http://h:6379"), None);
        assert_eq!(display_url("not a url"), None);
    }

    #[test]
    fn errors_are_scrubbed_of_the_url_and_password() {
        let s = settings("redis://user:p%40ss@h:6379/0");
        let msg = scrub(
            &s,
            "failed redis://user:p%40ss@h:6379/0: auth p@ss and p%40ss refused",
        );
        assert!(!msg.contains("p@ss") && !msg.contains("p%40ss"), "{msg}");
        assert!(msg.contains("redis://h:6379/0"), "{msg}");
    }
}
