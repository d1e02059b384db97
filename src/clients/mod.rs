//! Who may use the gateway: client keys (`auth.keys`), compared as SHA-256 digests in constant
//! time; what each may ask for; its `rpm`/`tpm` limits (governor's GCRA, a burst of one minute's
//! worth) and monthly budget; and the admin key for `/status` and `/admin/*`.
//!
//! Without `cluster:` limits and budgets are enforced per gateway process. With it,
//! [`Clients::admit_shared`] asks the shared store (`crate::cluster`) first, so the whole fleet
//! allows what one process would; when the store is away or slower than `cluster.timeout`, the
//! replica admits on its own with every limit split by the replicas it last saw. Spend is
//! persisted by the audit writer (`client_spend`, one row per key and month) and read back at
//! start, so a restart does not reset a budget (with `cluster:`, the row tracks the fleet's spend
//! as this replica last saw it, and seeds the store when it comes back empty).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::http::HeaderMap;
use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use subtle::ConstantTimeEq;
use tokio::time::Instant;

use crate::config::{Auth, ClientKey, key_digest};
use crate::error::{ApiError, ClientLimit};

type Limiter = RateLimiter<NotKeyed, InMemoryState, DefaultClock, StateInformationMiddleware>;

/// The key a request presents: `Authorization: Bearer …` (what the OpenAI SDKs send as
/// `api_key`) or `x-api-key`.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

/// Compares the digest of `key` with every digest in `digests`, in constant time (no early
/// exit: how long it takes says nothing about which key, or how much of one, matched).
fn find<'a, T>(key: &str, digests: impl Iterator<Item = (&'a [u8; 32], T)>) -> Option<T> {
    let d = key_digest(key);
    let mut found = None;
    for (candidate, item) in digests {
        if bool::from(candidate.ct_eq(&d)) && found.is_none() {
            found = Some(item);
        }
    }
    found
}

/// The calling client: `Ok(None)` when `auth.keys` is not set (the gateway is open).
pub fn identify<'a>(
    auth: &'a Auth,
    headers: &HeaderMap,
) -> Result<Option<&'a ClientKey>, ApiError> {
    let Some(keys) = &auth.keys else {
        return Ok(None);
    };
    let Some(key) = presented(headers) else {
        return Err(ApiError::Unauthorized(
            "You didn't provide an API key. Send one of this gateway's client keys as `Authorization: Bearer <key>` (the OpenAI SDK's api_key) or `x-api-key`.".into(),
        ));
    };
    find(key, keys.iter().map(|k| (&k.digest, k)))
        .map(Some)
        .ok_or_else(|| {
            ApiError::Unauthorized(
                "Incorrect API key provided: it is not one of this gateway's client keys.".into(),
            )
        })
}

/// The admin surface (`/status`, `/admin/*`): with `auth.admin_key` set, `Authorization: Bearer
/// <admin key>` from anywhere; without one, loopback clients only.
pub fn admin(auth: &Auth, headers: &HeaderMap, peer: SocketAddr) -> Result<(), ApiError> {
    if auth.admin_locked {
        return Err(ApiError::Unauthorized(
            "auth.admin_key is configured but could not be read; the admin surface is closed."
                .into(),
        ));
    }
    match &auth.admin {
        Some(digest) => match presented(headers) {
            Some(key) if find(key, std::iter::once((digest, ()))).is_some() => Ok(()),
            _ => Err(ApiError::Unauthorized(
                "This path needs the admin key: `Authorization: Bearer <auth.admin_key>`.".into(),
            )),
        },
        None if peer.ip().is_loopback() && !relayed(headers) && local_host(headers) => Ok(()),
        // A page a browser loaded from elsewhere, whose name was then pointed at 127.0.0.1 (DNS
        // rebinding), reaches the gateway as a loopback peer with that name as its Host.
        None if peer.ip().is_loopback() && !local_host(headers) => Err(ApiError::Forbidden(
            "This request names a host other than localhost or an IP address (a browser page's, through DNS rebinding?): without auth.admin_key this path answers local clients only.".into(),
        )),
        // A reverse proxy on this host (TLS in front of the gateway, as README suggests) makes
        // every client a loopback peer: what it relays is not a local operator's request.
        None if peer.ip().is_loopback() => Err(ApiError::Forbidden(
            "This request came through a proxy (it carries Forwarded, X-Forwarded-For, X-Real-IP or Via): without auth.admin_key this path answers local clients only.".into(),
        )),
        None => Err(ApiError::Forbidden(
            "This path answers loopback clients only unless auth.admin_key is set.".into(),
        )),
    }
}

/// Headers a reverse proxy adds to what it relays: RFC 7239's `Forwarded`, the de facto
/// `X-Forwarded-*` and `X-Real-IP`, and RFC 9110's `Via`.
const RELAY_HEADERS: &[&str] = &[
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-real-ip",
    "via",
];

/// Whether the request's `Host` is one a local client uses: `localhost` (or a name under
/// `.localhost`, which resolves to loopback by RFC 6761) or an IP address — anything but a
/// domain name a web page could have been loaded from. No `Host` (HTTP/1.0, HTTP/2's
/// `:authority`, which browsers send only over TLS) passes.
fn local_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(http::header::HOST) else {
        return true;
    };
    // A client sends the same `Host` on every request: the last value found local on this
    // thread is remembered (its bytes, not a handle on the request's buffer), so the common
    // request compares bytes instead of parsing an address.
    thread_local! {
        static LAST_LOCAL: std::cell::Cell<(u8, [u8; 63])> = const { std::cell::Cell::new((0, [0; 63])) };
    }
    let bytes = host.as_bytes();
    let (len, last) = LAST_LOCAL.get();
    if len != 0 && bytes == &last[..usize::from(len)] {
        return true;
    }
    let local = host.to_str().is_ok_and(local_host_name);
    if local
        && let Ok(len) = u8::try_from(bytes.len())
        && len > 0
        && bytes.len() <= 63
    {
        let mut copy = [0; 63];
        copy[..bytes.len()].copy_from_slice(bytes);
        LAST_LOCAL.set((len, copy));
    }
    local
}

/// [`local_host`] for a `Host` value's text.
fn local_host_name(host: &str) -> bool {
    // `[::1]:8080`, `127.0.0.1:8080`, `localhost:8080`, `localhost`.
    let name = match host.strip_prefix('[') {
        Some(rest) => {
            return rest
                .split(']')
                .next()
                .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok());
        }
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    // Compared without a lower-cased copy: this runs on every request to a loopback listener.
    let name = name.trim_end_matches('.');
    let suffix = |s: &str| {
        name.len() >= s.len()
            && name.is_char_boundary(name.len() - s.len())
            && name[name.len() - s.len()..].eq_ignore_ascii_case(s)
    };
    name.eq_ignore_ascii_case("localhost")
        || suffix(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok()
}

/// `/v1/*` against DNS rebinding (`server.allowed_hosts`): whether the request's `Host` may be
/// served. `allowed` set: its name (port aside, ASCII case aside) is one of them, a `.name` entry
/// also covering names under it, `*` every name. Unset: on a loopback listener only `localhost`
/// and IP literals ([`local_host`]), elsewhere every name.
pub fn host_allowed(allowed: Option<&[String]>, loopback: bool, headers: &HeaderMap) -> bool {
    match allowed {
        None => !loopback || local_host(headers),
        Some(list) => {
            let Some(host) = headers.get(http::header::HOST) else {
                // HTTP/1.0 without Host, or HTTP/2 (no browser sends it in clear text).
                return true;
            };
            let Some(name) = host.to_str().ok().map(host_name) else {
                return false;
            };
            list.iter().any(|a| {
                a == "*"
                    || *a == name
                    || a.strip_prefix('.')
                        .is_some_and(|d| name == d || name.ends_with(a.as_str()))
            })
        }
    }
}

/// The name of a `Host` value, lower-cased, without its port or trailing dot (`[::1]` keeps its
/// brackets off: `::1`).
fn host_name(host: &str) -> String {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether a request was relayed by a proxy (see [`RELAY_HEADERS`]).
fn relayed(headers: &HeaderMap) -> bool {
    RELAY_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// One client's limiters and spend.
struct State {
    rpm: Option<(u32, Limiter)>,
    tpm: Option<(u64, Mutex<TokenBucket>)>,
    spend: Mutex<Spend>,
}

/// A key's limits while the shared store is away: each a `1/n` share (at least 1) of the
/// configured one, and of the budget left when the store was last seen.
struct Split {
    replicas: u64,
    rpm: Option<u32>,
    tpm: Option<u64>,
    budget: Option<f64>,
    state: Arc<State>,
}

/// An admission the shared store knows about (or would have, had it answered).
struct Shared {
    cluster: Arc<crate::cluster::Cluster>,
    /// The key's own state (its spend as this replica last saw the fleet's).
    normal: Arc<State>,
    /// The reservation's name in the store (also when admitted locally after the store was
    /// slow: its late run of the admission is rolled back by it); `None` without one.
    request: Option<String>,
    /// The settle's name: the store applies it once.
    id: String,
    month: String,
    /// The fleet's spend this month when admitted.
    usd_seen: f64,
    /// The key's `tpm` (the bucket to charge completion tokens to), 0 without one.
    tpm: u64,
    /// The key's `rpm` (0 without one) and budget: with `tpm` and the month, what its
    /// admissions share in the store's calls (a settle rides along with them).
    rpm: u32,
    budget: Option<f64>,
    /// Completion tokens are charged when the request ends.
    charge_completion: bool,
}

/// A key's spend this month, and what requests still running have reserved of its budget.
#[derive(Clone, Debug, Default)]
struct Spend {
    /// `YYYY-MM`, UTC.
    month: String,
    usd: f64,
    reserved: f64,
}

impl Spend {
    fn roll(&mut self, month: String) {
        if self.month != month {
            self.month = month;
            self.usd = 0.0;
        }
    }
}

fn limiter(per_minute: u32) -> Option<(u32, Limiter)> {
    let n = NonZeroU32::new(per_minute)?;
    Some((
        per_minute,
        RateLimiter::direct(Quota::per_minute(n)).with_middleware::<StateInformationMiddleware>(),
    ))
}

/// A key's `tpm`: a bucket of a minute's tokens, refilled continuously, that a request's
/// completion may take below zero when it ends (its tokens were spent; the next requests wait
/// until the debt is refilled). governor's GCRA, used for `rpm`, can only refuse, never owe.
#[derive(Debug)]
pub struct TokenBucket {
    per_minute: u64,
    level: f64,
    at: Instant,
}

/// A wait in seconds as a `Duration`, never panicking: negative or NaN is none, and more than
/// a day (a debt the bucket caps at a day's tokens, refilling) is a day.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.clamp(0.0, 86_400.0)).unwrap_or_default()
}

/// What a refused take says: tokens left now, and how long until the take would pass.
#[derive(Debug, PartialEq)]
pub struct Refused {
    pub remaining: u64,
    pub retry_after: Duration,
}

impl TokenBucket {
    pub fn new(per_minute: u64, now: Instant) -> Self {
        TokenBucket {
            per_minute,
            level: per_minute as f64,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let rate = self.per_minute as f64 / 60.0;
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * rate).min(self.per_minute as f64);
        self.at = now;
    }

    /// Takes `n` tokens if the bucket holds them. More than a minute's worth never passes.
    pub fn take(&mut self, n: u64, now: Instant) -> Result<(), Refused> {
        self.refill(now);
        if n as f64 <= self.level {
            self.level -= n as f64;
            return Ok(());
        }
        let rate = (self.per_minute as f64 / 60.0).max(1e-9);
        let retry_after = if n > self.per_minute {
            Duration::from_secs(60)
        } else {
            secs((n as f64 - self.level) / rate)
        };
        Err(Refused {
            remaining: self.remaining(),
            retry_after,
        })
    }

    /// Takes `n` tokens that were spent already, below zero if need be.
    pub fn charge(&mut self, n: u64, now: Instant) {
        self.refill(now);
        // Bounded: a debt of more than a day's tokens would only mean a key locked out for a
        // day; it says the same at a day.
        self.level = (self.level - n as f64).max(-(self.per_minute as f64) * 1440.0);
    }

    pub fn remaining(&self) -> u64 {
        self.level.max(0.0) as u64
    }

    /// Until the bucket is full again.
    pub fn reset(&self) -> Duration {
        let rate = (self.per_minute as f64 / 60.0).max(1e-9);
        secs((self.per_minute as f64 - self.level) / rate)
    }
}

/// What admitting a request asks of its key.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ask {
    /// Tokens taken from `tpm` at once: the prompt, plus `max_tokens` when the request gives one
    /// (OpenAI's own rule).
    pub tokens: u64,
    /// The prompt's part of `tokens` (the gateway's estimate): the upstream's `usage` beyond
    /// it is taken from `tpm` when the request ends.
    pub prompt_tokens: u64,
    /// The request gave no `max_tokens`: its completion tokens are taken from `tpm` when it
    /// ends.
    pub charge_completion: bool,
    /// The most the request can cost (US dollars), reserved against `budget_usd` while it runs.
    pub reserve_usd: f64,
}

/// An admitted request's hold on its key, settled once when the request ends: its real cost is
/// spent, its reservation let go, its completion tokens charged. Dropped unsettled (refused
/// after admission, or never served), it lets the reservation go.
pub struct Admission {
    state: Arc<State>,
    name: String,
    reserved: f64,
    /// The prompt tokens asked at admission: the upstream's count beyond them is charged.
    prompt_asked: u64,
    charge_completion: bool,
    settled: bool,
    shared: Option<Shared>,
}

impl Admission {
    /// The request ended (now: the month of its end is the one charged) having cost `usd` and
    /// produced `completion_tokens`. Returns the key's spend this month as it now stands (key
    /// name, month, dollars) when the request cost anything, for the audit writer to persist.
    pub fn settle(
        &mut self,
        usd: Option<f64>,
        completion_tokens: u64,
    ) -> Option<(String, String, f64)> {
        self.settle_usage(usd, None, completion_tokens)
    }

    /// [`Admission::settle`] with the upstream's prompt tokens (`usage`): what it counted
    /// beyond the admission's estimate is taken from `tpm` too, so a key is charged the prompt
    /// it was billed, not the gateway's guess.
    pub fn settle_usage(
        &mut self,
        usd: Option<f64>,
        prompt_tokens: Option<u64>,
        completion_tokens: u64,
    ) -> Option<(String, String, f64)> {
        if std::mem::replace(&mut self.settled, true) {
            return None;
        }
        // What the upstream counted beyond the estimate costs a key at most a minute of its
        // tokens: a broken or hostile upstream's count cannot lock a key out for the day.
        let minute = self
            .state
            .tpm
            .as_ref()
            .map_or(0, |(t, _)| *t)
            .max(self.shared.as_ref().map_or(0, |sh| sh.tpm));
        let prompt_over = prompt_tokens
            .map_or(0, |p| p.saturating_sub(self.prompt_asked))
            .min(minute);
        let total = {
            let mut spend = self.state.spend.lock().unwrap_or_else(|e| e.into_inner());
            spend.reserved = (spend.reserved - self.reserved).max(0.0);
            usd.filter(|u| u.is_finite() && *u > 0.0).map(|usd| {
                spend.roll(month_of(SystemTime::now()));
                spend.usd += usd;
                (self.name.clone(), spend.month.clone(), spend.usd)
            })
        };
        // Here, what this replica's own buckets admitted (the store's admissions are charged
        // in the store).
        let charged = if self.charge_completion {
            completion_tokens
        } else {
            0
        }
        .saturating_add(if self.shared.is_none() {
            prompt_over
        } else {
            0
        });
        if charged > 0
            && let Some((_, bucket)) = &self.state.tpm
        {
            bucket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .charge(charged, Instant::now());
        }
        let Some(sh) = &self.shared else {
            return total;
        };
        // The store learns the request's end (queued, never awaited): its reservation let go,
        // its cost spent, its completion tokens charged. The key's own state keeps the fleet's
        // spend as last seen plus this cost, which the audit trail persists.
        let usd = usd.filter(|u| u.is_finite() && *u > 0.0).unwrap_or(0.0);
        sh.cluster.settle(crate::cluster::Settle {
            client: self.name.clone(),
            month: sh.month.clone(),
            request: sh.request.clone(),
            id: sh.id.clone(),
            sent: false,
            usd,
            completion_tokens: if sh.charge_completion {
                completion_tokens
            } else {
                0
            }
            .saturating_add(if sh.tpm > 0 { prompt_over } else { 0 }),
            tpm: sh.tpm,
            rpm: sh.rpm,
            budget: sh.budget,
        });
        if usd <= 0.0 {
            return total;
        }
        let mut spend = sh.normal.spend.lock().unwrap_or_else(|e| e.into_inner());
        spend.roll(month_of(SystemTime::now()));
        if Arc::ptr_eq(&self.state, &sh.normal) {
            // Admitted by the store: the cost is in `spend.usd` already (above); the fleet's
            // month is at least what was seen plus it.
            if spend.month == sh.month {
                spend.usd = spend.usd.max(sh.usd_seen + usd);
            }
        } else {
            // Admitted on the share: counted there; the key's own state learns it here.
            spend.usd = if spend.month == sh.month {
                spend.usd.max(sh.usd_seen) + usd
            } else {
                usd
            };
        }
        Some((self.name.clone(), spend.month.clone(), spend.usd))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.settled {
            self.settle(None, 0);
        }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("reserved", &self.reserved)
            .field("charge_completion", &self.charge_completion)
            .field("settled", &self.settled)
            .finish()
    }
}

/// Per-key limits and spend, kept across config reloads (by key name).
pub struct Clients {
    map: Mutex<HashMap<String, Arc<State>>>,
    /// Keys' shares while the shared store is away (forgotten once it has answered for a
    /// minute).
    split: Mutex<HashMap<String, Split>>,
    split_active: std::sync::atomic::AtomicBool,
    /// Spend read from the audit database at start: (key name, month, dollars).
    persisted: Mutex<HashMap<(String, String), f64>>,
}

impl Clients {
    pub fn new(persisted: Vec<(String, String, f64)>) -> Clients {
        Clients {
            map: Mutex::new(HashMap::new()),
            split: Mutex::new(HashMap::new()),
            split_active: std::sync::atomic::AtomicBool::new(false),
            persisted: Mutex::new(
                persisted
                    .into_iter()
                    .map(|(name, month, usd)| ((name, month), usd))
                    .collect(),
            ),
        }
    }

    fn state(&self, key: &ClientKey) -> Arc<State> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = map.get(&key.name)
            && s.rpm.as_ref().map(|r| r.0) == key.rpm
            && s.tpm.as_ref().map(|t| t.0) == key.tpm
        {
            return s.clone();
        }
        // New, or its limits changed in a reload: fresh limiters, the spend carried over.
        let month = month_of(SystemTime::now());
        let spend = map
            .get(&key.name)
            .map(|s| s.spend.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_else(|| {
                let usd = self
                    .persisted
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&(key.name.clone(), month.clone()))
                    .copied()
                    .unwrap_or(0.0);
                Spend {
                    month,
                    usd,
                    reserved: 0.0,
                }
            });
        let s = Arc::new(State {
            rpm: key.rpm.and_then(limiter),
            tpm: key
                .tpm
                .filter(|t| *t > 0)
                .map(|t| (t, Mutex::new(TokenBucket::new(t, Instant::now())))),
            spend: Mutex::new(spend),
        });
        map.insert(key.name.clone(), s.clone());
        s
    }

    /// Admits one request: the budget (with what running requests reserved), then `rpm`, then
    /// `tpm`; then reserves the request's worst-case cost until it is settled.
    pub fn admit(&self, key: &ClientKey, ask: Ask) -> Result<Admission, ApiError> {
        Self::admit_on(self.state(key), key, key.budget_usd, ask)
    }

    /// Admits one request for the fleet through the shared store, or, when it is away or slower
    /// than `cluster.timeout`, on this replica's share of every limit. The store's being away
    /// never refuses a request by itself.
    pub async fn admit_shared(
        &self,
        key: &ClientKey,
        ask: Ask,
        cluster: &Arc<crate::cluster::Cluster>,
    ) -> Result<Admission, ApiError> {
        use crate::cluster::{Admit, Verdict};
        if key.rpm.is_none_or(|r| r == 0)
            && key.tpm.is_none_or(|t| t == 0)
            && key.budget_usd.is_none()
        {
            // Nothing to share: no round trip.
            return self.admit(key, ask);
        }
        let month = month_of(SystemTime::now());
        // The request's name in the store: its settle's, and (only a budget reserves) its
        // reservation's.
        let id = uuid::Uuid::new_v4().to_string();
        let request = if key.budget_usd.is_some() {
            id.clone()
        } else {
            String::new()
        };
        let reserve = if key.budget_usd.is_some() && ask.reserve_usd.is_finite() {
            ask.reserve_usd.max(0.0)
        } else {
            0.0
        };
        let tpm = key.tpm.filter(|t| *t > 0);
        let normal = self.state(key);
        let shared = |request: Option<String>, usd_seen: f64| Shared {
            cluster: cluster.clone(),
            normal: normal.clone(),
            request,
            id: id.clone(),
            month: month.clone(),
            usd_seen,
            tpm: tpm.unwrap_or(0),
            rpm: key.rpm.unwrap_or(0),
            budget: key.budget_usd,
            charge_completion: ask.charge_completion && tpm.is_some(),
        };
        let asked = Admit {
            client: &key.name,
            rpm: key.rpm.filter(|r| *r > 0),
            tpm,
            tokens: ask.tokens,
            budget: key.budget_usd,
            reserve,
            request: &request,
            month: &month,
            more: false,
        };
        let seen = |usd: f64| {
            let mut spend = normal.spend.lock().unwrap_or_else(|e| e.into_inner());
            spend.roll(month.clone());
            if spend.month == month && usd > spend.usd {
                spend.usd = usd;
            }
        };
        match cluster.admit(&asked).await {
            Ok(Verdict::Admitted { usd }) => {
                seen(usd);
                if cluster.stable() {
                    self.end_split();
                }
                Ok(Admission {
                    state: normal.clone(),
                    name: key.name.clone(),
                    reserved: 0.0,
                    prompt_asked: ask.prompt_tokens,
                    charge_completion: false,
                    settled: false,
                    // A reservation to let go at the end only where one was made.
                    shared: Some(shared((reserve > 0.0).then(|| request.clone()), usd)),
                })
            }
            Ok(Verdict::Budget { usd }) => {
                seen(usd);
                Err(ApiError::QuotaExceeded {
                    client: key.name.clone(),
                    budget: key.budget_usd.unwrap_or(0.0),
                })
            }
            Ok(Verdict::Limited {
                kind,
                remaining,
                retry_after,
                reset,
            }) => Err(ApiError::ClientRateLimited(Box::new(ClientLimit {
                client: key.name.clone(),
                kind,
                limit: if kind == "tokens" {
                    tpm.unwrap_or(0)
                } else {
                    u64::from(key.rpm.unwrap_or(0))
                },
                remaining,
                reset,
                retry_after,
            }))),
            Err(()) => {
                let (state, budget) = self.split_state(key, cluster.replicas(), &normal);
                let usd_seen = normal.spend.lock().unwrap_or_else(|e| e.into_inner()).usd;
                let mut a = Self::admit_on(state, key, budget, ask)?;
                a.shared = Some(Shared {
                    // Its completion tokens are charged here (the share's bucket) and in the
                    // store when it is back.
                    charge_completion: a.charge_completion,
                    // The admission asked of the store may still run there (a call that timed
                    // out was written): its reservation is let go by name when this settles.
                    ..shared((reserve > 0.0).then(|| request.clone()), usd_seen)
                });
                Ok(a)
            }
        }
    }

    /// A key's share of its limits while the shared store is away: made on the first request
    /// of an outage (or when the replicas seen or the limits change), from the spend last seen.
    fn split_state(
        &self,
        key: &ClientKey,
        replicas: u64,
        normal: &Arc<State>,
    ) -> (Arc<State>, Option<f64>) {
        let n = replicas.max(1);
        let mut map = self.split.lock().unwrap_or_else(|e| e.into_inner());
        self.split_active
            .store(true, std::sync::atomic::Ordering::Release);
        if let Some(s) = map.get(&key.name)
            && s.replicas == n
            && s.rpm == key.rpm
            && s.tpm == key.tpm
        {
            return (s.state.clone(), s.budget);
        }
        let spend = normal
            .spend
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let share = |v: u64| (v / n).max(1);
        let budget = key.budget_usd.map(|b| {
            let left = (b - spend.usd).max(0.0);
            spend.usd + left / n as f64
        });
        let state = Arc::new(State {
            rpm: key
                .rpm
                .filter(|r| *r > 0)
                .and_then(|r| limiter(share(u64::from(r)) as u32)),
            tpm: key.tpm.filter(|t| *t > 0).map(|t| {
                (
                    share(t),
                    Mutex::new(TokenBucket::new(share(t), Instant::now())),
                )
            }),
            spend: Mutex::new(Spend {
                reserved: 0.0,
                ..spend
            }),
        });
        map.insert(
            key.name.clone(),
            Split {
                replicas: n,
                rpm: key.rpm,
                tpm: key.tpm,
                budget,
                state: state.clone(),
            },
        );
        (state, budget)
    }

    /// The store has answered for a minute: the next outage starts from fresh shares (a share
    /// kept across a short break stays drained by what it admitted).
    fn end_split(&self) {
        if self
            .split_active
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            self.split.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// Takes `tokens` more of an admitted request's key `tpm` (the conversation a Responses
    /// request continues, which the upstream reads again: known only once the key's limits
    /// admitted the request and its conversation was looked up). Refused like an admission;
    /// with the shared store away, taken from this replica's share. The tokens count as asked:
    /// the answer's `usage` beyond them is what is charged at the end.
    pub async fn take_more(
        &self,
        key: &ClientKey,
        a: &mut Admission,
        tokens: u64,
        cluster: Option<&Arc<crate::cluster::Cluster>>,
    ) -> Result<(), ApiError> {
        let Some(tpm) = key.tpm.filter(|t| *t > 0) else {
            return Ok(());
        };
        if tokens == 0 {
            return Ok(());
        }
        let limited = |remaining: u64, retry_after: Duration, reset: Duration| {
            ApiError::ClientRateLimited(Box::new(ClientLimit {
                client: key.name.clone(),
                kind: "tokens",
                limit: tpm,
                remaining,
                reset,
                retry_after,
            }))
        };
        let store_admitted = a
            .shared
            .as_ref()
            .is_some_and(|sh| Arc::ptr_eq(&a.state, &sh.normal));
        if let (Some(cluster), true) = (cluster, store_admitted) {
            use crate::cluster::{Admit, Verdict};
            let month = month_of(SystemTime::now());
            let asked = Admit {
                client: &key.name,
                rpm: None,
                tpm: Some(tpm),
                tokens,
                budget: None,
                reserve: 0.0,
                request: "",
                month: &month,
                more: true,
            };
            // Taken in the store, or refused there. With the store away (or this replica's
            // queue for it full) nothing was taken: `prompt_asked` stays, so the answer's usage
            // charges them when the request settles.
            match cluster.admit(&asked).await {
                Ok(Verdict::Limited {
                    remaining,
                    retry_after,
                    reset,
                    ..
                }) => return Err(limited(remaining, retry_after, reset)),
                Ok(_) => {}
                Err(()) => return Ok(()),
            }
        } else if let Some((_, bucket)) = &a.state.tpm {
            let mut b = bucket.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(r) = b.take(tokens, Instant::now()) {
                return Err(limited(r.remaining, r.retry_after, b.reset()));
            }
        }
        a.prompt_asked = a.prompt_asked.saturating_add(tokens);
        Ok(())
    }

    /// Admits on `s` with `budget` as the line (the error names the key's configured budget).
    fn admit_on(
        s: Arc<State>,
        key: &ClientKey,
        budget: Option<f64>,
        ask: Ask,
    ) -> Result<Admission, ApiError> {
        let over_budget = |spend: &mut Spend| {
            spend.roll(month_of(SystemTime::now()));
            budget
                .filter(|b| spend.usd + spend.reserved >= *b)
                .map(|_| ApiError::QuotaExceeded {
                    client: key.name.clone(),
                    budget: key.budget_usd.unwrap_or(0.0),
                })
        };
        if let Some(e) = over_budget(&mut s.spend.lock().unwrap_or_else(|e| e.into_inner())) {
            return Err(e);
        }
        if let Some((limit, l)) = &s.rpm {
            Self::take(l, *limit, 1, "requests", &key.name)?;
        }
        if let Some((limit, bucket)) = &s.tpm
            && ask.tokens > 0
        {
            let mut b = bucket.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(r) = b.take(ask.tokens, Instant::now()) {
                return Err(ApiError::ClientRateLimited(Box::new(ClientLimit {
                    client: key.name.clone(),
                    kind: "tokens",
                    limit: *limit,
                    remaining: r.remaining,
                    reset: b.reset(),
                    retry_after: r.retry_after,
                })));
            }
        }
        let reserved = if budget.is_some() && ask.reserve_usd.is_finite() {
            ask.reserve_usd.max(0.0)
        } else {
            0.0
        };
        {
            // Checked again under the same lock as the reservation: concurrent admissions
            // overshoot the budget by at most one reservation.
            let mut spend = s.spend.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = over_budget(&mut spend) {
                return Err(e);
            }
            spend.reserved += reserved;
        }
        let charge_completion = ask.charge_completion && s.tpm.is_some();
        Ok(Admission {
            state: s,
            name: key.name.clone(),
            reserved,
            prompt_asked: ask.prompt_tokens,
            charge_completion,
            settled: false,
            shared: None,
        })
    }

    fn take(
        l: &Limiter,
        limit: u32,
        n: u64,
        kind: &'static str,
        client: &str,
    ) -> Result<(), ApiError> {
        let per_unit = Duration::from_secs(60) / limit.max(1);
        let refused = |remaining: u32, retry_after: Duration| {
            ApiError::ClientRateLimited(Box::new(ClientLimit {
                client: client.to_string(),
                kind,
                limit: u64::from(limit),
                remaining: u64::from(remaining),
                reset: per_unit * (limit - remaining.min(limit)),
                retry_after,
            }))
        };
        let n32 = NonZeroU32::new(n.min(u64::from(u32::MAX)) as u32).unwrap_or(NonZeroU32::MIN);
        match l.check_n(n32) {
            Ok(Ok(_)) => Ok(()),
            // The limiter's own clock: no clock is built (and calibrated) until a limit exists.
            Ok(Err(not_until)) => Err(refused(0, not_until.wait_time_from(l.clock().now()))),
            // More than a whole minute's budget in one request: it can never pass.
            Err(_) => Err(refused(0, Duration::from_secs(60))),
        }
    }

    /// Spend this month per key name, for `/status`.
    pub fn spend(&self) -> Vec<(String, f64)> {
        let month = month_of(SystemTime::now());
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(String, f64)> = map
            .iter()
            .map(|(n, s)| {
                let spend = s.spend.lock().unwrap_or_else(|e| e.into_inner());
                (
                    n.clone(),
                    if spend.month == month { spend.usd } else { 0.0 },
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every key's spend per month as it stands, for the audit writer to persist (its own record,
    /// on the stats persister's tick and at shutdown: not lost with a dropped audit row).
    pub fn spend_snapshot(&self) -> Vec<(String, String, f64)> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .filter_map(|(n, s)| {
                let spend = s.spend.lock().unwrap_or_else(|e| e.into_inner());
                (spend.usd > 0.0).then(|| (n.clone(), spend.month.clone(), spend.usd))
            })
            .collect()
    }
}

/// `YYYY-MM` (UTC) of a moment: budgets are per calendar month.
pub fn month_of(t: SystemTime) -> String {
    let days = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    let (year, month, _) = civil_from_days(days);
    format!("{year:04}-{month:02}")
}

/// (year, month, day) of a count of days since 1970-01-01: Howard Hinnant's civil_from_days.
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_localhost_and_ip_addresses_are_local_hosts() {
        let with = |h: &str| {
            let mut m = HeaderMap::new();
            m.insert(http::header::HOST, h.parse().unwrap());
            local_host(&m)
        };
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost:3000",
            "App.LocalHost:3000",
            "10.0.0.5:8080",
            "localhost.",
        ] {
            assert!(with(ok), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "evil.example",
            "localhost.evil.example",
            "evillocalhost",
            "evillocalhost:80",
            "[evil]:80",
            "::1",
        ] {
            assert!(!with(bad), "{bad}");
        }
        assert!(local_host(&HeaderMap::new()), "no Host at all");
    }

    #[test]
    fn the_remembered_local_host_answers_only_for_the_same_bytes() {
        let with = |h: &str| {
            let mut m = HeaderMap::new();
            m.insert(http::header::HOST, h.parse().unwrap());
            local_host(&m)
        };
        // Each a local name remembered, then names that differ from it by a byte, a prefix or a
        // suffix: every answer is the parse's, whatever was remembered before it.
        for (ok, bad) in [
            ("127.0.0.1:8080", "127.0.0.1x:8080"),
            ("localhost:8080", "localhostx:8080"),
            ("localhost", "localhost.evil.example"),
            ("[::1]:8080", "[::1x]:8080"),
            ("app.localhost", "app.localhos"),
        ] {
            assert!(with(ok), "{ok}");
            assert!(with(ok), "{ok}, remembered");
            assert!(!with(bad), "{bad} after {ok}");
            assert!(with(ok), "{ok} again");
        }
        // Longer than what is remembered: parsed every time, and right.
        let long = format!("{}.localhost", "a".repeat(70));
        assert!(with(&long) && with(&long));
        assert!(!with(&format!("{}.example", "a".repeat(70))));
    }

    fn key(name: &str, rpm: Option<u32>, tpm: Option<u64>, budget: Option<f64>) -> ClientKey {
        ClientKey {
            name: name.into(),
            digest: key_digest(&format!("sk-{name}")),
            models: None,
            rpm,
            tpm,
            budget_usd: budget,
        }
    }

    #[test]
    fn months_are_utc_calendar_months() {
        let at = |secs: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(month_of(at(0)), "1970-01");
        assert_eq!(month_of(at(951_782_400)), "2000-02", "2000-02-29");
        assert_eq!(month_of(at(951_868_800)), "2000-03");
        assert_eq!(
            month_of(at(1_798_761_599)),
            "2026-12",
            "2026-12-31 23:59:59"
        );
        assert_eq!(month_of(at(1_798_761_600)), "2027-01");
    }

    #[test]
    fn keys_are_found_by_digest_from_either_header() {
        let auth = Auth {
            admin: None,
            admin_locked: false,
            keys: Some(vec![key("a", None, None, None), key("b", None, None, None)]),
        };
        let mut h = HeaderMap::new();
        assert!(matches!(
            identify(&auth, &h),
            Err(ApiError::Unauthorized(_))
        ));
        h.insert("authorization", "Bearer sk-b".parse().unwrap());
        assert_eq!(identify(&auth, &h).unwrap().unwrap().name, "b");
        h.insert("authorization", "Bearer sk-c".parse().unwrap());
        assert!(identify(&auth, &h).is_err());
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "sk-a".parse().unwrap());
        assert_eq!(identify(&auth, &h).unwrap().unwrap().name, "a");
        let open = Auth::default();
        assert!(identify(&open, &HeaderMap::new()).unwrap().is_none());
    }

    #[test]
    fn admin_needs_the_key_when_set_else_loopback() {
        let local: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let remote: SocketAddr = "10.0.0.9:1".parse().unwrap();
        let open = Auth::default();
        assert!(admin(&open, &HeaderMap::new(), local).is_ok());
        assert!(matches!(
            admin(&open, &HeaderMap::new(), remote),
            Err(ApiError::Forbidden(_))
        ));
        let locked = Auth {
            admin: Some(key_digest("admin-secret")),
            admin_locked: false,
            keys: None,
        };
        assert!(
            admin(&locked, &HeaderMap::new(), local).is_err(),
            "the key, even on loopback"
        );
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer admin-secret".parse().unwrap());
        assert!(admin(&locked, &h, remote).is_ok());
        h.insert("authorization", "Bearer admin-secreT".parse().unwrap());
        assert!(admin(&locked, &h, remote).is_err());
        // Configured but unreadable: closed to everyone, loopback included.
        let unread = Auth {
            admin: None,
            admin_locked: true,
            keys: None,
        };
        assert!(admin(&unread, &HeaderMap::new(), local).is_err());
    }

    fn ask(tokens: u64) -> Ask {
        Ask {
            tokens,
            ..Ask::default()
        }
    }

    #[test]
    fn rpm_admits_exactly_the_limit_in_a_burst() {
        let c = Clients::new(vec![]);
        let k = key("a", Some(5), None, None);
        let admitted = (0..20).filter(|_| c.admit(&k, ask(0)).is_ok()).count();
        assert_eq!(admitted, 5);
        match c.admit(&k, ask(0)) {
            Err(ApiError::ClientRateLimited(l)) => {
                assert_eq!((l.kind, l.limit, l.remaining), ("requests", 5, 0));
                assert!(l.retry_after > Duration::ZERO && l.retry_after <= Duration::from_secs(12));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn tpm_counts_tokens_and_refuses_a_request_larger_than_a_minute() {
        let c = Clients::new(vec![]);
        let k = key("a", None, Some(1000), None);
        assert!(c.admit(&k, ask(600)).is_ok());
        match c.admit(&k, ask(600)) {
            Err(ApiError::ClientRateLimited(l)) => {
                assert_eq!((l.kind, l.limit, l.remaining), ("tokens", 1000, 400));
                // 200 tokens short at 1000 a minute: 12 s.
                assert_eq!(l.retry_after, Duration::from_secs(12));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            c.admit(&k, ask(5000)).is_err(),
            "over a whole minute's budget"
        );
        tokio::time::advance(Duration::from_secs(12)).await;
        assert!(c.admit(&k, ask(600)).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn completion_tokens_without_max_tokens_are_charged_when_the_request_ends() {
        let c = Clients::new(vec![]);
        let k = key("a", None, Some(100), None);
        let open = Ask {
            tokens: 10,
            charge_completion: true,
            reserve_usd: 0.0,
            ..Ask::default()
        };
        let mut a = c.admit(&k, open).unwrap();
        // Its completion was 500 tokens: the key owes 410 and waits for them.
        a.settle(None, 500);
        match c.admit(&k, open) {
            Err(ApiError::ClientRateLimited(l)) => {
                assert_eq!(l.remaining, 0);
                // 420 tokens short (410 owed and these 10) at 100 a minute.
                assert_eq!(l.retry_after, Duration::from_secs(252));
            }
            other => panic!("{other:?}"),
        }
        tokio::time::advance(Duration::from_secs(252)).await;
        assert!(c.admit(&k, open).is_ok());
        // With max_tokens counted at admission, nothing more is charged.
        let k = key("b", None, Some(100), None);
        let counted = Ask {
            tokens: 60,
            charge_completion: false,
            reserve_usd: 0.0,
            ..Ask::default()
        };
        c.admit(&k, counted).unwrap().settle(None, 500);
        assert!(c.admit(&k, ask(40)).is_ok());
    }

    /// The upstream's prompt count beyond the admission's estimate is charged when the request
    /// ends: a key pays the prompt it was billed.
    #[tokio::test(start_paused = true)]
    async fn the_billed_prompt_beyond_the_estimate_is_charged() {
        let c = Clients::new(vec![]);
        let k = key("a", None, Some(1000), None);
        let asked = Ask {
            tokens: 110,
            prompt_tokens: 10,
            charge_completion: false,
            reserve_usd: 0.0,
        };
        // The upstream counted 900 prompt tokens: 890 more than asked are owed.
        c.admit(&k, asked)
            .unwrap()
            .settle_usage(None, Some(900), 100);
        match c.admit(&k, ask(1)) {
            Err(ApiError::ClientRateLimited(l)) => assert_eq!(l.remaining, 0),
            other => panic!("{other:?}"),
        }
        // Fewer than asked: nothing given back, nothing more taken.
        let k = key("b", None, Some(1000), None);
        c.admit(&k, asked).unwrap().settle_usage(None, Some(5), 100);
        assert!(c.admit(&k, ask(890)).is_ok());
    }

    /// An upstream that says a prompt of a trillion tokens costs the key a minute of its tokens,
    /// not the day's debt the bucket could hold.
    #[tokio::test(start_paused = true)]
    async fn an_upstreams_prompt_count_costs_at_most_a_minute_of_tokens() {
        let c = Clients::new(vec![]);
        let k = key("a", None, Some(600), None);
        let asked = Ask {
            tokens: 10,
            prompt_tokens: 10,
            charge_completion: false,
            reserve_usd: 0.0,
        };
        c.admit(&k, asked)
            .unwrap()
            .settle_usage(None, Some(1_000_000_000_000), 0);
        // Charged: the bucket is empty...
        let retry = match c.admit(&k, ask(1)) {
            Err(ApiError::ClientRateLimited(l)) => l.retry_after,
            other => panic!("{other:?}"),
        };
        // ...by a minute's tokens (600 a minute: 10 a second), not by a day's.
        assert!(retry <= Duration::from_secs(62), "{retry:?}");
        tokio::time::advance(Duration::from_secs(62)).await;
        assert!(c.admit(&k, ask(1)).is_ok());
    }

    #[test]
    fn concurrent_requests_overshoot_a_budget_by_at_most_one_reservation() {
        let c = Clients::new(vec![]);
        let k = key("a", None, None, Some(1.0));
        let reserve = Ask {
            tokens: 0,
            charge_completion: false,
            reserve_usd: 0.3,
            ..Ask::default()
        };
        // Four at once: each reserves 0.30; the fourth finds 0.90 held and is still admitted
        // (0.90 < 1.00); the fifth finds 1.20 and is refused.
        let mut running: Vec<Admission> = (0..4).map(|_| c.admit(&k, reserve).unwrap()).collect();
        assert!(matches!(
            c.admit(&k, reserve),
            Err(ApiError::QuotaExceeded { .. })
        ));
        // They settle at their real cost; the spend is what they cost, at most budget + 0.30.
        for a in &mut running {
            assert!(a.settle(Some(0.3), 0).is_some());
        }
        let spent = c.spend()[0].1;
        assert!((spent - 1.2).abs() < 1e-9, "{spent}");
        assert!(spent <= 1.0 + 0.3 + 1e-9);
        assert!(c.admit(&k, reserve).is_err());
        // An admission dropped unsettled (refused later, or never served) lets its hold go.
        let k = key("b", None, None, Some(1.0));
        for _ in 0..10 {
            drop(c.admit(&k, reserve).unwrap());
        }
        assert!(c.admit(&k, reserve).is_ok());
    }

    #[test]
    fn a_budget_is_spent_persisted_per_month_and_survives_a_restart() {
        let month = month_of(SystemTime::now());
        let k = key("a", None, None, Some(1.0));
        let c = Clients::new(vec![("a".into(), month.clone(), 0.75)]);
        let mut a = c
            .admit(&k, ask(0))
            .expect("0.75 of 1.00 spent before the restart");
        assert_eq!(
            a.settle(Some(0.30), 0),
            Some(("a".to_string(), month.clone(), 1.05))
        );
        assert!(matches!(
            c.admit(&k, ask(0)),
            Err(ApiError::QuotaExceeded { .. })
        ));
        assert_eq!(c.spend(), vec![("a".to_string(), 1.05)]);
        assert_eq!(c.spend_snapshot(), vec![("a".to_string(), month, 1.05)]);
        // Last month's spend does not count.
        let c = Clients::new(vec![("a".into(), "1999-12".into(), 50.0)]);
        // Hostile costs are ignored.
        assert_eq!(c.admit(&k, ask(0)).unwrap().settle(Some(f64::NAN), 0), None);
        assert_eq!(c.admit(&k, ask(0)).unwrap().settle(Some(-5.0), 0), None);
        assert!(c.admit(&k, ask(0)).is_ok());
    }
}
