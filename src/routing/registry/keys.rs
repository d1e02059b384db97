//! Which API key an attempt uses: round-robin over the keys not rejected, skipping those whose
//! `x-ratelimit-*` budget is predicted too small for the request.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::{Registry, lock, unix_ms};
use crate::config::Endpoint;
use crate::routing::observed::Fact;

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

impl Registry {
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
}
