//! What an attempt's outcome does to its endpoint's state (`Effect`), the tokens it used, and an
//! operator's `endpoint clear`.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::{Registry, Retirement, lock};
use crate::config::{Endpoint, Policy};
use crate::routing::blame::Witness;
use crate::routing::observed::Fact;

/// What one attempt's outcome does to the endpoint's state.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Served: counts as a success, seen by `who` (the request's key, [`Witness`]).
    Success { latency_ms: f64, who: Witness },
    /// Counts against the endpoint (connect error, timeout, 5xx, broken stream), as `who` saw
    /// it: a run of failures one client key alone saw ejects nothing ([`Witness`]).
    Failure {
        class: crate::routing::outcome::Outcome,
        detail: String,
        who: Witness,
    },
    /// 429: no health penalty, but no traffic until the cooldown ends.
    Cooldown { for_: Duration, detail: String },
    /// 410: out of rotation until the config changes it or an operator clears it.
    Retire { detail: String },
    /// 401/403 with key `key`.
    KeyRejected { key: usize, detail: String },
}

impl Registry {
    /// Applies an attempt's outcome. Returns true when the endpoint has another key to try.
    pub fn apply(&self, ep: &Endpoint, policy: &Policy, effect: Effect) -> bool {
        let Some(rt) = self.get(&ep.name) else {
            return false;
        };
        let now = Instant::now();
        let mut rt = lock(&rt);
        match effect {
            Effect::Success { latency_ms, who } => {
                rt.health.observe_traffic(now, None, "", &policy.health);
                rt.window.record(now, who, false);
                rt.latency.observe(latency_ms);
                rt.samples.push(latency_ms);
                rt.requests += 1;
                rt.successes += 1;
                false
            }
            Effect::Failure { class, detail, who } => {
                rt.window.record(now, who, true);
                rt.requests += 1;
                rt.failures += 1;
                rt.last_error = Some((format!("{class}: {detail}"), SystemTime::now()));
                // An endpoint of several addresses with one still usable: the failure is its
                // address's (ejected alone, `address_failed`), not the endpoint's — it is
                // unhealthy only when no address serves.
                let another = {
                    let g = rt.addresses.lock().unwrap_or_else(|e| e.into_inner());
                    g.list.len() > 1 && g.list.iter().any(|a| a.usable(now))
                };
                let tr = if another {
                    None
                } else {
                    rt.health.observe_traffic(
                        now,
                        Some(who),
                        &format!("{class}: {detail}"),
                        &policy.health,
                    )
                };
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

    /// Lifts retirement, auth failure, cooldown, rejected keys and a learned context window
    /// (operator's `endpoint clear`).
    pub fn clear(&self, name: &str) -> bool {
        self.clear_from(name, true)
    }

    /// [`Registry::clear`]; `share`: made here (not by another replica).
    pub(super) fn clear_from(&self, name: &str, share: bool) -> bool {
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
}
