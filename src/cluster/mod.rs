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

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::{Notify, mpsc};

mod admit;
mod facts;
mod keeper;
mod kept;
mod lease;
mod settle;
mod turns;

use admit::Group;
use keeper::Status;
use lease::Lease;

pub use admit::Admit;
pub use facts::FACT_QUEUE;
pub use keeper::{Hooks, run};
pub use settle::Settle;

/// The most the keeper's own calls (heartbeat, seeding, settles) wait on the store.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);
/// Retries while the store is away: from this, doubling, to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Settles waiting for the store; more are dropped (and counted).
const SETTLE_QUEUE: usize = 100_000;
/// How long the store remembers a settle's name (so one sent again is applied once): as long
/// as a reservation is held (a settle sent again after a longer outage would count twice).
const SETTLED_FOR: Duration = Duration::from_secs(3600);
/// A month's spend outlives its month by this.
const SPEND_TTL: Duration = Duration::from_secs(40 * 86_400);

/// What admissions share to go in one call: the key, its limits and the month.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Batch {
    client: String,
    rpm: u32,
    tpm: u64,
    /// The budget's bits (`None`: no budget).
    budget: Option<u64>,
    month: String,
    /// [`Admit::more`].
    more: bool,
}

/// What one admission takes: tokens, a reservation, and the reservation's name.
struct Ask {
    tokens: u64,
    reserve: f64,
    request: String,
}

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

pub use crate::config::ClusterSettings as Settings;
pub use crate::config::cluster_display as display_url;

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

    fn key(&self, parts: &[&str]) -> String {
        let mut k = self.settings.key_prefix.clone();
        k.push_str(&parts.join(":"));
        k
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

#[cfg(test)]
mod test_util {
    use std::time::Duration;

    use super::{Settings, display_url};
    use crate::config::Secret;

    pub(super) fn settings(url: &str) -> Settings {
        Settings {
            url: Secret::new(url.into()),
            display: display_url(url).unwrap_or_default(),
            key_prefix: "autohedge:".into(),
            timeout: Duration::from_millis(25),
            replicas: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::settings;
    use super::*;

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
