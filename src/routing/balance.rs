//! Balancing over one endpoint's addresses (its `base_urls`, or the tasks discovery found): the
//! policy, pure and clock-injected, for issue #46. Each address has its own in-flight count,
//! peak-EWMA latency, consecutive failures and ejection; a request goes to the cheaper of two
//! usable addresses drawn at random (power of two choices over latency × load, as linkerd and
//! Finagle balance), or — continuing a conversation — to the address its key hashes to while
//! that one's load is within a bound of the average (consistent hashing with bounded loads,
//! Mirrokni, Thorup and Zadimoghaddam, 2018), so a server's prefix cache keeps the conversation
//! warm. A bad address is ejected alone (Envoy's outlier detection: consecutive failures, a
//! doubling ejection, at most a share of the addresses out at once) and comes back half-open,
//! by a probe of its own.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::routing::blame::{Record, Witness};
use tokio::time::Instant;

/// The knobs (`balance:` and `health:`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    /// How fast the latency estimate forgets (linkerd's default: 10 s).
    pub decay: Duration,
    /// The estimate of an address never measured (a cost that lets it be tried).
    pub first_rtt: Duration,
    /// What a failure counts as, at least: an address answering 500s at once must not look
    /// like the fastest (it would draw the traffic its failures should keep away).
    pub failure_rtt: Duration,
    /// Consecutive failures that eject an address.
    pub eject_after: u32,
    /// The first ejection's length; each next one in a row doubles it, up to `eject_max`.
    pub eject_base: Duration,
    pub eject_max: Duration,
    /// The most of an endpoint's addresses out at once (0.5: half).
    pub max_ejection_percent: f64,
    /// A conversation stays on its address while that address's load is at most this times
    /// the average (`balance.affinity_load`).
    pub affinity_load: f64,
    /// A queue sample (vLLM's waiting + running) counts while at most this old.
    pub fresh_for: Duration,
    /// `balance: random`: any usable address, load aside.
    pub random: bool,
    /// Conversations go back to their address (`balance.affinity: prefix`).
    pub affinity: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            decay: Duration::from_secs(10),
            first_rtt: Duration::from_millis(100),
            failure_rtt: Duration::from_secs(1),
            eject_after: 5,
            eject_base: Duration::from_secs(10),
            eject_max: Duration::from_secs(300),
            max_ejection_percent: 0.5,
            affinity_load: 1.25,
            fresh_for: Duration::from_secs(30),
            random: false,
            affinity: true,
        }
    }
}

/// Where an address stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Takes requests.
    Active,
    /// Out until the instant.
    Ejected(Instant),
    /// Its ejection ran out: a probe of its own decides (requests do not flood it back).
    HalfOpen,
}

/// One address's state.
#[derive(Clone, Debug)]
pub struct Address {
    pub url: String,
    /// Unique to this address's life here: a request that began at an address that left is
    /// never counted out of one that came back under its URL.
    id: u64,
    pub in_flight: u32,
    /// Peak-EWMA latency, in seconds, as of `stamp`.
    rtt: f64,
    /// Whether `rtt` is measured yet (else it is `first_rtt`, a prior the first answer replaces).
    measured: bool,
    stamp: Instant,
    /// Ejections in a row (each doubles the next).
    ejections: u32,
    /// Ejections since it joined (`/metrics`).
    pub ejected_total: u64,
    standing: Standing,
    /// The server's own queue (vLLM: waiting + running) and when it was read.
    queue: Option<(u32, Instant)>,
    /// When it last failed a request or a probe.
    last_failure: Option<Instant>,
    /// Its last requests' outcomes and its failures in a row, with who saw them: an address
    /// failing a share of its requests, never enough in a row, is ejected by its failure rate
    /// (Envoy's failure-percentage detection); one client key's failures alone eject nothing.
    record: Record,
}

impl Address {
    pub fn new(url: impl Into<String>, now: Instant, t: &Tuning) -> Address {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Address {
            url: url.into(),
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            in_flight: 0,
            rtt: t.first_rtt.as_secs_f64(),
            measured: false,
            stamp: now,
            ejections: 0,
            ejected_total: 0,
            standing: Standing::Active,
            queue: None,
            last_failure: None,
            record: Record::default(),
        }
    }

    /// The standing at `now` (an ejection that ran out is half-open).
    pub fn standing(&self, now: Instant) -> Standing {
        match self.standing {
            Standing::Ejected(until) if now >= until => Standing::HalfOpen,
            s => s,
        }
    }

    pub fn usable(&self, now: Instant) -> bool {
        self.standing(now) == Standing::Active
    }

    /// Whether conversations may be kept here: usable, and no failure within the latency
    /// estimate's memory (`decay`). An address failing some of its requests (not enough in a
    /// row to be ejected) keeps no conversation — each would be one more failure to retry —
    /// and load balancing, which its failures make it dear to, sends it little.
    pub fn keeps_conversations(&self, now: Instant, t: &Tuning) -> bool {
        self.usable(now)
            && self
                .last_failure
                .is_none_or(|f| now.saturating_duration_since(f) >= t.decay)
    }

    /// The latency estimate at `now`: it decays toward zero while nothing is measured, so an
    /// address slow once is tried again in time.
    pub fn rtt(&self, now: Instant, t: &Tuning) -> f64 {
        let idle = now.saturating_duration_since(self.stamp).as_secs_f64();
        self.rtt * (-idle / t.decay.as_secs_f64().max(1e-3)).exp()
    }

    /// Requests ahead of one more sent here: this gateway's in flight, and the server's own
    /// queue while its sample is fresh (other gateways' requests are in it).
    pub fn load(&self, now: Instant, t: &Tuning) -> f64 {
        f64::from(self.in_flight) + f64::from(self.queue(now, t).unwrap_or(0))
    }

    /// A response in `rtt` to a request `who` sent: the estimate jumps to a slower one at once
    /// (the peak) and moves toward a faster one by the decay; a failure streak ends. `None`: an
    /// answer to a request made with the client's own upstream key, whose failures are not
    /// counted either — its latency only.
    pub fn observe(&mut self, rtt: Duration, now: Instant, t: &Tuning, who: Option<Witness>) {
        let measured = rtt.as_secs_f64();
        let current = self.rtt(now, t);
        self.rtt = if !std::mem::replace(&mut self.measured, true) || measured > current {
            measured
        } else {
            let w = (-now.saturating_duration_since(self.stamp).as_secs_f64()
                / t.decay.as_secs_f64().max(1e-3))
            .exp();
            current * w + measured * (1.0 - w)
        };
        self.stamp = now;
        if let Some(who) = who {
            self.record.served(who);
        }
    }

    /// Failures in a row, whoever saw them (`/status`).
    pub fn failures(&self) -> u32 {
        self.record.run_seen()
    }

    /// The server's own queue, while its sample is fresh.
    pub fn queue(&self, now: Instant, t: &Tuning) -> Option<u32> {
        match self.queue {
            Some((q, at)) if now.saturating_duration_since(at) <= t.fresh_for => Some(q),
            _ => None,
        }
    }

    /// An attempt that ran out of its time after `rtt`: its estimate takes it as a peak (a slow
    /// address loses traffic), without counting it as an answer or a failure.
    pub fn observe_slow(&mut self, rtt: Duration, now: Instant, t: &Tuning) {
        let measured = rtt.as_secs_f64();
        if !self.measured || measured > self.rtt(now, t) {
            self.rtt = measured;
            self.measured = true;
            self.stamp = now;
        }
    }

    /// The server's queue as a probe read it.
    pub fn observe_queue(&mut self, waiting_and_running: u32, now: Instant) {
        self.queue = Some((waiting_and_running, now));
    }

    /// A probe's verdict: a half-open address comes back on success, and is ejected again —
    /// for twice as long — on failure. An active address's probe failure counts as a failure.
    pub fn probed(&mut self, ok: bool, now: Instant, t: &Tuning) {
        match (self.standing(now), ok) {
            (Standing::HalfOpen, true) => {
                // Back as new: its estimate from before (a failure's) is no evidence now.
                self.standing = Standing::Active;
                self.record.clear();
                self.rtt = t.first_rtt.as_secs_f64();
                self.measured = false;
                self.stamp = now;
            }
            (Standing::HalfOpen, false) => self.eject(now, t),
            (Standing::Active, true) => {}
            (Standing::Active, false) | (Standing::Ejected(_), false) => {
                self.record.probe_failed();
                self.last_failure = Some(now);
            }
            (Standing::Ejected(_), true) => {}
        }
    }

    fn eject(&mut self, now: Instant, t: &Tuning) {
        let factor = 2u32.saturating_pow(self.ejections.min(16));
        let length = t.eject_base.saturating_mul(factor).min(t.eject_max);
        self.standing = Standing::Ejected(now + length);
        self.ejections = self.ejections.saturating_add(1);
        self.ejected_total = self.ejected_total.saturating_add(1);
        // Back from it, it is judged on what it does then.
        self.record.clear();
    }
}

/// An endpoint's addresses.
#[derive(Clone, Debug, Default)]
pub struct Addresses {
    pub list: Vec<Address>,
    /// Every address's points on the conversation ring, (point, index into `list`), sorted:
    /// made when the list changes, walked by [`Addresses::pick_affine`].
    ring: Vec<(u64, usize)>,
}

impl Addresses {
    /// The addresses `urls` names, each keeping its state when it was known (an address that
    /// joins starts fresh; one that leaves is dropped).
    pub fn update(&mut self, urls: &[String], now: Instant, t: &Tuning) {
        let mut old = std::mem::take(&mut self.list);
        // Each once, and at most `MAX` (a Docker engine may list any number of tasks).
        let mut seen = std::collections::HashSet::new();
        self.list = urls
            .iter()
            .filter(|u| seen.insert(u.as_str()))
            .take(MAX)
            .map(|u| match old.iter().position(|a| &a.url == u) {
                Some(i) => old.swap_remove(i),
                None => Address::new(u.clone(), now, t),
            })
            .collect();
        self.ring = (0..self.list.len())
            .flat_map(|i| (0..VNODES).map(move |v| (i, v)))
            .map(|(i, v)| (ring_hash(&self.list[i].url, v), i))
            .collect();
        self.ring.sort_unstable();
    }

    fn usable(&self, now: Instant) -> impl Iterator<Item = usize> + '_ {
        (0..self.list.len()).filter(move |&i| self.list[i].usable(now))
    }

    /// Where a request goes: a conversation (`key`) to its address while that one is within
    /// its load bound ([`Addresses::pick_affine`]), else the strategy's pick. `None` when no
    /// address is usable.
    pub fn pick_for(
        &self,
        key: Option<u64>,
        now: Instant,
        t: &Tuning,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        if let Some(key) = key.filter(|_| t.affinity)
            && let Some(i) = self.pick_affine(key, now, t)
        {
            return Some(i);
        }
        if t.random {
            let usable: Vec<usize> = self.usable(now).collect();
            return (!usable.is_empty()).then(|| usable[rng.usize(..usable.len())]);
        }
        self.pick(now, t, rng)
    }

    /// The address `url` for a request whose earlier turn it served: while it is usable and —
    /// unless `exact` (it alone holds the conversation) — within its load bound.
    pub fn preferred(&self, url: &str, exact: bool, now: Instant, t: &Tuning) -> Option<usize> {
        let i = self.list.iter().position(|a| a.url == url)?;
        if !self.list[i].usable(now) {
            return None;
        }
        if exact {
            return Some(i);
        }
        if !self.list[i].keeps_conversations(now, t) {
            return None;
        }
        (t.affinity && self.list[i].load(now, t) + 1.0 <= self.bound(now, t)).then_some(i)
    }

    /// The latency an address not measured yet is judged by: the fleet's (the mean of the
    /// measured usable ones), so a replica that joins is tried at once rather than held back
    /// by a guess; `first_rtt` while none is measured.
    fn prior(&self, now: Instant, t: &Tuning) -> f64 {
        let (mut n, mut sum) = (0u32, 0.0f64);
        for a in self.list.iter().filter(|a| a.measured && a.usable(now)) {
            n += 1;
            sum += a.rtt(now, t);
        }
        if n == 0 {
            t.first_rtt.as_secs_f64()
        } else {
            sum / f64::from(n)
        }
    }

    /// What one more request at `i` costs: its latency (the fleet's while it has none of its
    /// own) × the requests ahead of it and this one.
    fn cost_of(&self, i: usize, now: Instant, t: &Tuning, prior: f64) -> f64 {
        let a = &self.list[i];
        let rtt = if a.measured { a.rtt(now, t) } else { prior };
        rtt.max(1e-6) * (a.load(now, t) + 1.0)
    }

    /// The most load (in flight here and queued at the server, with one more request) an
    /// address may have and still take a conversation of its own: `affinity_load` times the
    /// usable addresses' average. Load, not latency: an LLM request's latency follows the
    /// length of its answer, and a bound on it would move conversations on every long one; a
    /// slow replica holds its requests longer, so its load reaches the bound sooner.
    fn bound(&self, now: Instant, t: &Tuning) -> f64 {
        let (mut n, mut total) = (0u32, 0.0f64);
        for a in self.list.iter().filter(|a| a.usable(now)) {
            n += 1;
            total += a.load(now, t);
        }
        (t.affinity_load * (total + 1.0) / f64::from(n.max(1))).ceil()
    }

    /// Power of two choices: two usable addresses drawn at random, the cheaper one. `None`
    /// when none is usable.
    pub fn pick(&self, now: Instant, t: &Tuning, rng: &mut fastrand::Rng) -> Option<usize> {
        let usable: Vec<usize> = self.usable(now).collect();
        self.cheaper_of_two(&usable, now, t, rng)
    }

    /// [`Addresses::pick`] among the usable addresses but those of `avoid` (a request's retry
    /// goes elsewhere than where it failed, a hedge's second copy elsewhere than its first).
    /// `None` when no other is usable.
    pub fn pick_other(
        &self,
        avoid: &[Arc<str>],
        now: Instant,
        t: &Tuning,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        let usable: Vec<usize> = self
            .usable(now)
            .filter(|&i| !avoid.iter().any(|a| **a == *self.list[i].url))
            .collect();
        self.cheaper_of_two(&usable, now, t, rng)
    }

    fn cheaper_of_two(
        &self,
        usable: &[usize],
        now: Instant,
        t: &Tuning,
        rng: &mut fastrand::Rng,
    ) -> Option<usize> {
        match usable.len() {
            0 => None,
            1 => Some(usable[0]),
            n => {
                let a = rng.usize(..n);
                let b = (a + 1 + rng.usize(..n - 1)) % n;
                let (a, b) = (usable[a], usable[b]);
                let prior = self.prior(now, t);
                Some(
                    if self.cost_of(b, now, t, prior) < self.cost_of(a, now, t, prior) {
                        b
                    } else {
                        a
                    },
                )
            }
        }
    }

    /// The address a conversation keyed `key` goes to: the first usable one clockwise from the
    /// key's place on the ring whose load (one more request) is within `affinity_load` of the
    /// average — consistent hashing with bounded loads. Addresses joining or leaving move only
    /// the keys of their own arcs.
    pub fn pick_affine(&self, key: u64, now: Instant, t: &Tuning) -> Option<usize> {
        if self.ring.is_empty() {
            return None;
        }
        let bound = self.bound(now, t);
        let start = self.ring.partition_point(|(h, _)| *h < key);
        (0..self.ring.len())
            .map(|k| self.ring[(start + k) % self.ring.len()].1)
            .find(|&i| {
                self.list
                    .get(i)
                    .is_some_and(|a| a.keeps_conversations(now, t) && a.load(now, t) + 1.0 <= bound)
            })
    }

    /// A failed attempt (connect error, 5xx, timeout) at `i`, as `who` saw it: ejected after
    /// `eject_after` in a row or by its failure rate — unless that would put more than
    /// `max_ejection_percent` of the addresses out. Only failures more than one client key saw
    /// (or a sure one: [`Witness`]) count, steer traffic away or move conversations: one key's
    /// own failures change nothing another key gets. Whether it was ejected.
    pub fn failed(&mut self, i: usize, who: Witness, now: Instant, t: &Tuning) -> bool {
        let out = self.list.iter().filter(|a| !a.usable(now)).count();
        let room = ((out + 1) as f64) <= t.max_ejection_percent * self.list.len() as f64;
        let Some(a) = self.list.get_mut(i) else {
            return false;
        };
        if !a.record.failed(who) {
            return false;
        }
        a.last_failure = Some(now);
        a.rtt = a.rtt(now, t).max(t.failure_rtt.as_secs_f64());
        a.measured = true;
        a.stamp = now;
        let rate_out = a.record.rate(RATE_MIN).is_some_and(|r| r >= RATE_EJECT);
        if a.usable(now) && (a.record.run() >= t.eject_after || rate_out) && room {
            a.eject(now, t);
            return true;
        }
        false
    }

    /// A probe of `i`: [`Address::probed`], and an active address whose probes (with its
    /// requests) failed `eject_after` times in a row is ejected — unless that would put more
    /// than `max_ejection_percent` of the addresses out. Whether it was ejected.
    pub fn probed(&mut self, i: usize, ok: bool, now: Instant, t: &Tuning) -> bool {
        let out = self.list.iter().filter(|a| !a.usable(now)).count();
        let room = ((out + 1) as f64) <= t.max_ejection_percent * self.list.len() as f64;
        let Some(a) = self.list.get_mut(i) else {
            return false;
        };
        let was_active = a.usable(now);
        a.probed(ok, now, t);
        if was_active && !ok && a.record.run() >= t.eject_after && room {
            a.eject(now, t);
            return true;
        }
        false
    }

    /// A request sent to `i`: counted in flight until the guard is dropped (answered, failed,
    /// cancelled or hedged away alike).
    pub fn start(shared: &Arc<Mutex<Addresses>>, i: usize) -> Option<InFlight> {
        let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
        let a = g.list.get_mut(i)?;
        a.in_flight = a.in_flight.saturating_add(1);
        Some(InFlight::new(shared.clone(), a))
    }
}

/// The failure rate that ejects an address: of its last [`crate::routing::blame::WINDOW`] requests, once it
/// has had [`RATE_MIN`]. Only an address failing far more than a busy server's occasional error:
/// a healthy replica's retry is rarer than one in four.
const RATE_EJECT: f64 = 0.25;
use crate::routing::blame::RATE_MIN;

/// The most addresses an endpoint holds (as `base_urls` may list: `config::MAX_ADDRESSES`).
pub const MAX: usize = 64;

/// Points an address has on the ring.
const VNODES: u64 = 64;

/// FNV-1a of the address and its point: the same on every replica and every build.
fn ring_hash(url: &str, vnode: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in url.bytes().chain(vnode.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's low bits mix poorly: a final avalanche spreads the points around the ring.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// A conversation's place on the ring, from what identifies it (its first turn's id, or its
/// leading messages).
pub fn conversation_key(text: &str) -> u64 {
    ring_hash(text, u64::MAX)
}

/// The conversation a request belongs to, by what every turn of it repeats: a chat's leading
/// system (or developer) messages and its first user message; a Responses request's
/// `instructions` and first input item. `None` for anything else (a completion, a chat with no
/// user message yet): it is balanced by load alone.
pub fn conversation_of(
    op: crate::op::Op,
    body: &serde_json::Map<String, serde_json::Value>,
) -> Option<u64> {
    use serde_json::Value;
    let mut text = String::new();
    match op {
        crate::op::Op::Chat => {
            let messages = body.get("messages")?.as_array()?;
            let mut user = false;
            for m in messages {
                text.push_str(&m.to_string());
                text.push('\u{1e}');
                match m.get("role").and_then(Value::as_str) {
                    Some("system" | "developer") => {}
                    Some("user") => {
                        user = true;
                        break;
                    }
                    _ => return None,
                }
            }
            if !user {
                return None;
            }
        }
        crate::op::Op::Responses => {
            if let Some(i) = body.get("instructions") {
                text.push_str(&i.to_string());
            }
            text.push('\u{1e}');
            match body.get("input")? {
                Value::Array(items) => text.push_str(&items.first()?.to_string()),
                v => text.push_str(&v.to_string()),
            }
        }
        _ => return None,
    }
    Some(conversation_key(&text))
}

/// A request in flight at an address: dropped, it is counted out — at that address if it is
/// still there, never below zero.
#[derive(Debug)]
pub struct InFlight {
    shared: Arc<Mutex<Addresses>>,
    id: u64,
}

impl InFlight {
    /// The guard of a request `a` counted in flight already (under the list's lock).
    pub fn new(shared: Arc<Mutex<Addresses>>, a: &Address) -> InFlight {
        InFlight { shared, id: a.id }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut g = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = g.list.iter_mut().find(|a| a.id == self.id) {
            a.in_flight = a.in_flight.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("http://10.0.0.{i}:8000/v1"))
            .collect()
    }

    fn fleet(n: usize, now: Instant, t: &Tuning) -> Addresses {
        let mut a = Addresses::default();
        a.update(&urls(n), now, t);
        a
    }

    /// Discovery's list is bounded as the config's is, and each address is there once.
    #[tokio::test(start_paused = true)]
    async fn an_engine_listing_thousands_gives_at_most_the_most() {
        assert_eq!(MAX, crate::config::MAX_ADDRESSES);
        let t = Tuning::default();
        let mut a = Addresses::default();
        let mut many = urls(1000);
        many.insert(1, many[0].clone());
        a.update(&many, Instant::now(), &t);
        assert_eq!(a.list.len(), MAX);
        assert_eq!(a.list[1].url, many[2]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_busier_or_slower_of_two_loses() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(2, now, &t);
        let mut rng = fastrand::Rng::with_seed(7);
        a.list[0].in_flight = 30;
        for _ in 0..100 {
            assert_eq!(a.pick(now, &t, &mut rng), Some(1));
        }
        a.list[0].in_flight = 0;
        a.list[1].observe(Duration::from_secs(2), now, &t, Some(Witness::Sure));
        a.list[0].observe(Duration::from_millis(50), now, &t, Some(Witness::Sure));
        assert_eq!(a.pick(now, &t, &mut rng), Some(0));
        // A stale queue sample is ignored, a fresh one counts.
        a.list[1] = Address::new(a.list[1].url.clone(), now, &t);
        a.list[0] = Address::new(a.list[0].url.clone(), now, &t);
        a.list[0].observe_queue(50, now - Duration::from_secs(60));
        a.list[1].observe_queue(3, now);
        assert_eq!(a.pick(now, &t, &mut rng), Some(0));
    }

    /// Among many, the load spreads: no address gets more than its share and a bit, and a 4x
    /// slower one gets the least.
    #[tokio::test(start_paused = true)]
    async fn two_choices_spread_the_load_and_spare_the_slow_one() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        for (i, ms) in [(0, 40), (1, 40), (2, 160)] {
            a.list[i].observe(Duration::from_millis(ms), now, &t, Some(Witness::Sure));
        }
        let mut rng = fastrand::Rng::with_seed(1);
        let mut sent = [0u32; 3];
        // Requests that stay in flight: each pick sees the ones before it.
        for _ in 0..300 {
            let i = a.pick(now, &t, &mut rng).unwrap();
            a.list[i].in_flight += 1;
            sent[i] += 1;
        }
        assert!(sent[2] < sent[0] && sent[2] < sent[1], "{sent:?}");
        assert!(sent[0].abs_diff(sent[1]) <= 10, "{sent:?}");
    }

    /// An address failing at once looks slow, not fast: the next picks go to the others.
    #[tokio::test(start_paused = true)]
    async fn a_fast_failure_costs_like_a_slow_answer() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(2, now, &t);
        a.list[0].observe(Duration::from_millis(1), now, &t, Some(Witness::Sure));
        a.list[1].observe(Duration::from_millis(50), now, &t, Some(Witness::Sure));
        assert!(!a.failed(0, Witness::Sure, now, &t));
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..20 {
            assert_eq!(a.pick(now, &t, &mut rng), Some(1));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_estimate_decays_so_the_address_is_tried_again() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = Address::new("u", now, &t);
        a.observe(Duration::from_secs(5), now, &t, Some(Witness::Sure));
        assert!((a.rtt(now, &t) - 5.0).abs() < 1e-9);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(
            a.rtt(Instant::now(), &t) < 0.3,
            "{}",
            a.rtt(Instant::now(), &t)
        );
        // A faster answer moves the estimate down by the decay; a slower one sets it at once.
        let now = Instant::now();
        a.observe(Duration::from_millis(10), now, &t, Some(Witness::Sure));
        assert!(a.rtt(now, &t) < 0.3);
        a.observe(Duration::from_secs(1), now, &t, Some(Witness::Sure));
        assert!((a.rtt(now, &t) - 1.0).abs() < 1e-9);
    }

    /// Failures in a row eject one address, for twice as long each time in a row; it comes back
    /// half-open, by a probe only; and never more than half the addresses are out.
    #[tokio::test(start_paused = true)]
    async fn a_bad_address_is_ejected_alone_and_comes_back_by_a_probe() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(4, now, &t);
        for _ in 0..4 {
            assert!(!a.failed(0, Witness::Sure, now, &t));
        }
        assert!(
            a.failed(0, Witness::Sure, now, &t),
            "the fifth in a row ejects"
        );
        assert_eq!(
            a.list[0].standing(now),
            Standing::Ejected(now + t.eject_base)
        );
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..50 {
            assert_ne!(a.pick(now, &t, &mut rng), Some(0));
        }
        // Half-open after its time: still no requests until a probe says so.
        tokio::time::advance(t.eject_base).await;
        let now = Instant::now();
        assert_eq!(a.list[0].standing(now), Standing::HalfOpen);
        assert!(!a.list[0].usable(now));
        a.list[0].probed(false, now, &t);
        assert_eq!(
            a.list[0].standing(now),
            Standing::Ejected(now + t.eject_base * 2),
            "again, twice as long"
        );
        tokio::time::advance(t.eject_base * 2).await;
        let now = Instant::now();
        a.list[0].probed(true, now, &t);
        assert!(a.list[0].usable(now));
        // At most half out: a second address may go, a third may not.
        for _ in 0..5 {
            a.failed(1, Witness::Sure, now, &t);
            a.failed(2, Witness::Sure, now, &t);
        }
        let out = a.list.iter().filter(|x| !x.usable(now)).count();
        assert_eq!(out, 2, "half of four");
        for _ in 0..10 {
            assert!(!a.failed(3, Witness::Sure, now, &t));
        }
        assert!(a.list[3].usable(now));
        assert_eq!(
            a.pick(now, &t, &mut rng).map(|i| a.list[i].usable(now)),
            Some(true)
        );
    }

    /// A conversation stays on its address while that one's load is within the bound, moves to
    /// another when it is over, and addresses joining move only a share of the conversations.
    #[tokio::test(start_paused = true)]
    async fn conversations_stay_put_within_the_load_bound() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        let keys: Vec<u64> = (0..300)
            .map(|i| conversation_key(&format!("conv-{i}")))
            .collect();
        let first: Vec<usize> = keys
            .iter()
            .map(|k| a.pick_affine(*k, now, &t).unwrap())
            .collect();
        // Idle fleet: every key, every time, the same address; all three used.
        for (k, f) in keys.iter().zip(&first) {
            assert_eq!(a.pick_affine(*k, now, &t), Some(*f));
        }
        for i in 0..3 {
            assert!(first.iter().filter(|f| **f == i).count() > 50, "{i}");
        }
        // Its address over the bound: the key goes elsewhere.
        let k = keys[0];
        let home = first[0];
        a.list[home].in_flight = 10;
        let moved = a.pick_affine(k, now, &t).unwrap();
        assert_ne!(moved, home);
        a.list[home].in_flight = 0;
        // A fourth address joins: about a quarter of the keys move, all of them to it.
        let before: Vec<String> = keys
            .iter()
            .map(|k| a.list[a.pick_affine(*k, now, &t).unwrap()].url.clone())
            .collect();
        a.update(&urls(4), now, &t);
        let mut moved = 0;
        for (k, b) in keys.iter().zip(&before) {
            let url = &a.list[a.pick_affine(*k, now, &t).unwrap()].url;
            if url != b {
                moved += 1;
                assert_eq!(url, &urls(4)[3], "a key moved between old addresses");
            }
        }
        assert!((40..=120).contains(&moved), "{moved} of 300 moved");
    }

    /// The in-flight count is released however a request ends, and never goes below zero, also
    /// when the address it was sent to left meanwhile.
    #[tokio::test(start_paused = true)]
    async fn in_flight_counts_never_leak_nor_go_negative() {
        let t = Tuning::default();
        let now = Instant::now();
        let shared = Arc::new(Mutex::new(fleet(2, now, &t)));
        let g1 = Addresses::start(&shared, 0).unwrap();
        let g2 = Addresses::start(&shared, 0).unwrap();
        let g3 = Addresses::start(&shared, 1).unwrap();
        assert!(Addresses::start(&shared, 9).is_none());
        assert_eq!(shared.lock().unwrap().list[0].in_flight, 2);
        drop(g1);
        assert_eq!(shared.lock().unwrap().list[0].in_flight, 1);
        // Address 1 leaves and comes back fresh: the old request's end takes nothing from it.
        shared.lock().unwrap().update(&urls(1), now, &t);
        shared.lock().unwrap().update(&urls(2), now, &t);
        let g4 = Addresses::start(&shared, 1).unwrap();
        drop(g3);
        assert_eq!(
            shared.lock().unwrap().list[1].in_flight,
            1,
            "g4's, untouched"
        );
        drop(g4);
        drop(g2);
        let g = shared.lock().unwrap();
        assert_eq!((g.list[0].in_flight, g.list[1].in_flight), (0, 0));
    }

    /// The address a conversation's earlier turn was served at: taken while within the bound
    /// (or whatever its load when it alone holds the conversation), never when it is out.
    #[tokio::test(start_paused = true)]
    async fn a_preferred_address_within_its_bound_or_exactly() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        let url = a.list[1].url.clone();
        assert_eq!(a.preferred(&url, false, now, &t), Some(1));
        a.list[1].in_flight = 10;
        assert_eq!(a.preferred(&url, false, now, &t), None, "over its bound");
        assert_eq!(
            a.preferred(&url, true, now, &t),
            Some(1),
            "exact: load aside"
        );
        // A queue the server reports is load too.
        a.list[1].in_flight = 0;
        a.list[1].observe_queue(40, now);
        assert_eq!(a.preferred(&url, false, now, &t), None);
        // Out: not even exactly.
        for _ in 0..t.eject_after {
            a.failed(1, Witness::Sure, now, &t);
        }
        assert!(!a.list[1].usable(now));
        assert_eq!(a.preferred(&url, true, now, &t), None);
        // An address the endpoint does not have is never picked (a turn's stored address is
        // only compared).
        assert_eq!(a.preferred("http://evil.example/v1", true, now, &t), None);
        // Affinity off: no preference.
        let off = Tuning {
            affinity: false,
            ..t
        };
        assert_eq!(a.preferred(&a.list[0].url.clone(), false, now, &off), None);
    }

    /// `balance: random` draws any usable address; affinity off ignores the conversation.
    #[tokio::test(start_paused = true)]
    async fn random_and_no_affinity_spread_one_conversation() {
        let t = Tuning {
            random: true,
            affinity: false,
            ..Tuning::default()
        };
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        // The first address much slower: P2C would all but never pick it; random does.
        a.list[0].observe(Duration::from_secs(5), now, &t, Some(Witness::Sure));
        let key = Some(conversation_key("one conversation"));
        let mut rng = fastrand::Rng::with_seed(7);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[a.pick_for(key, now, &t, &mut rng).unwrap()] += 1;
        }
        assert!(seen.iter().all(|n| *n > 50), "{seen:?}");
        // With affinity, the same conversation goes to one address every time.
        let sticky = Tuning {
            affinity: true,
            ..t
        };
        let home = a.pick_for(key, now, &sticky, &mut rng).unwrap();
        for _ in 0..50 {
            assert_eq!(a.pick_for(key, now, &sticky, &mut rng), Some(home));
        }
    }

    /// What keys a conversation: the leading system messages and the first user message, the
    /// same on every later turn; nothing for what is no conversation.
    #[test]
    fn a_conversation_is_keyed_by_what_every_turn_repeats() {
        use crate::op::Op;
        use serde_json::json;
        let body = |v: serde_json::Value| v.as_object().unwrap().clone();
        let turn1 = body(json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Plan a trip."}]}));
        let turn3 = body(json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Plan a trip."},
            {"role": "assistant", "content": "Where?"},
            {"role": "user", "content": "Oslo."}]}));
        let other = body(json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Plan a dinner."}]}));
        let k1 = conversation_of(Op::Chat, &turn1);
        assert!(k1.is_some());
        assert_eq!(k1, conversation_of(Op::Chat, &turn3));
        assert_ne!(k1, conversation_of(Op::Chat, &other));
        for hostile in [
            json!({"messages": "not a list"}),
            json!({"messages": []}),
            json!({"messages": [{"role": "system", "content": "only"}]}),
            json!({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}),
            json!({"messages": [17, null]}),
            json!({}),
        ] {
            assert_eq!(
                conversation_of(Op::Chat, &body(hostile.clone())),
                None,
                "{hostile}"
            );
        }
        assert_eq!(
            conversation_of(Op::Completions, &body(json!({"prompt": "x"}))),
            None
        );
        let r1 = body(
            json!({"instructions": "Be brief.", "input": [{"role": "user", "content": "Hi"}]}),
        );
        let r2 = body(
            json!({"instructions": "Be brief.", "input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "More"}]}),
        );
        assert_eq!(
            conversation_of(Op::Responses, &r1),
            conversation_of(Op::Responses, &r2)
        );
        assert_eq!(
            conversation_of(Op::Responses, &body(json!({"input": []}))),
            None
        );
    }

    /// A replica that joins a measured fleet is judged at the fleet's latency (tried at once,
    /// not held back by the 100 ms guess); a conversation's replica holding more than its share
    /// of the load gives its new turns to another.
    #[tokio::test(start_paused = true)]
    async fn a_new_replica_is_tried_and_a_slow_one_loses_its_conversations() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(2, now, &t);
        for i in 0..2 {
            a.list[i].observe(Duration::from_millis(2), now, &t, Some(Witness::Sure));
        }
        a.update(&urls(3), now, &t);
        let mut rng = fastrand::Rng::with_seed(3);
        let picked = (0..300)
            .filter(|_| a.pick(now, &t, &mut rng) == Some(2))
            .count();
        assert!(picked > 50, "the new replica got {picked} of 300");
        // The third holding 6 requests (a slow one piles them up): no conversation stays.
        a.list[2].in_flight = 6;
        let home: Vec<usize> = (0..300)
            .filter_map(|i| a.pick_affine(conversation_key(&format!("c{i}")), now, &t))
            .collect();
        assert_eq!(home.len(), 300);
        assert!(
            home.iter().all(|h| *h != 2),
            "an overloaded replica kept conversations"
        );
    }

    /// An address that failed a request keeps no conversation for a while (they walk on to the
    /// next on the ring), unless it alone holds one.
    #[tokio::test(start_paused = true)]
    async fn a_failing_address_keeps_no_conversation() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        let keys: Vec<u64> = (0..100)
            .map(|i| conversation_key(&format!("k{i}")))
            .collect();
        let home: Vec<usize> = keys
            .iter()
            .map(|k| a.pick_affine(*k, now, &t).unwrap())
            .collect();
        assert!(home.contains(&1));
        a.failed(1, Witness::Sure, now, &t);
        assert!(a.list[1].usable(now), "one failure ejects nothing");
        for (k, h) in keys.iter().zip(&home) {
            let at = a.pick_affine(*k, now, &t).unwrap();
            assert_ne!(at, 1);
            if *h != 1 {
                assert_eq!(at, *h, "the others' conversations stay");
            }
        }
        let url = a.list[1].url.clone();
        assert_eq!(a.preferred(&url, false, now, &t), None);
        assert_eq!(a.preferred(&url, true, now, &t), Some(1));
        // Its failure forgotten, it keeps them again.
        let later = now + t.decay;
        for (k, h) in keys.iter().zip(&home) {
            assert_eq!(a.pick_affine(*k, later, &t), Some(*h));
        }
    }

    /// An address failing every other request — never enough in a row — is ejected by its
    /// failure rate once it has had ten; one failing now and then is not.
    #[tokio::test(start_paused = true)]
    async fn a_failure_rate_ejects_what_failures_in_a_row_do_not() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(4, now, &t);
        let mut ejected_at = None;
        for n in 0..40 {
            if n % 2 == 0 {
                if a.failed(0, Witness::Sure, now, &t) {
                    ejected_at = Some(n);
                    break;
                }
            } else {
                a.list[0].observe(Duration::from_millis(20), now, &t, Some(Witness::Sure));
            }
        }
        let n = ejected_at.expect("ejected by its rate");
        assert!(n >= RATE_MIN - 1, "not before it had {RATE_MIN}: {n}");
        assert!(!a.list[0].usable(now));
        // One in ten: never.
        for n in 0..200 {
            if n % 10 == 0 {
                assert!(!a.failed(1, Witness::Sure, now, &t), "ejected at {n}");
            } else {
                a.list[1].observe(Duration::from_millis(20), now, &t, Some(Witness::Sure));
            }
        }
        assert!(a.list[1].usable(now));
    }

    /// One client key's failures (its content may cause them) eject nothing, steer nothing and
    /// move no conversation, however many; a second key's failure makes them the address's.
    #[tokio::test(start_paused = true)]
    async fn one_keys_failures_are_its_own() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        for i in 0..3 {
            a.list[i].observe(Duration::from_millis(20), now, &t, Some(Witness::Sure));
        }
        let keys: Vec<u64> = (0..64)
            .map(|c| conversation_key(&format!("c{c}")))
            .collect();
        let home: Vec<_> = keys.iter().map(|k| a.pick_affine(*k, now, &t)).collect();
        let hostile = Witness::Key(7);
        for _ in 0..100 {
            assert!(!a.failed(0, hostile, now, &t));
        }
        assert_eq!(a.list[0].failures(), 100, "the failures were seen");
        assert!(a.list[0].usable(now));
        assert!(a.list[0].keeps_conversations(now, &t));
        assert!(a.list[0].rtt(now, &t) < 0.1, "its estimate untouched");
        let again: Vec<_> = keys.iter().map(|k| a.pick_affine(*k, now, &t)).collect();
        assert_eq!(home, again, "no conversation moved");
        // Other keys' failures let as many of the hostile key's count: 2, 4, then 6 of 5.
        assert!(!a.failed(0, Witness::Key(8), now, &t));
        assert!(!a.failed(0, Witness::Key(9), now, &t));
        assert!(a.list[0].usable(now));
        assert!(a.failed(0, Witness::Key(10), now, &t));
        assert!(!a.list[0].usable(now));
    }

    /// Keys A and B fail every request at an address, key C's answers come between them (so no
    /// run of failures ever grows): it is ejected by its rate.
    #[tokio::test(start_paused = true)]
    async fn answers_between_two_keys_failures_keep_no_failing_address() {
        let t = Tuning::default();
        let now = Instant::now();
        let mut a = fleet(3, now, &t);
        let mut ejected = false;
        for _ in 0..15 {
            for k in [Witness::Key(1), Witness::Key(2)] {
                ejected |= a.failed(0, k, now, &t);
                a.list[0].observe(Duration::from_millis(20), now, &t, Some(Witness::Key(3)));
            }
        }
        assert!(ejected, "ejected by its rate");
        assert!(!a.list[0].usable(now));
    }
}
