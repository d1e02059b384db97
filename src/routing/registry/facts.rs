//! What replicas share with `cluster:`: the facts this one learns (sent, never waited on), what
//! it knows for a store restarted empty, and what another replica learned, applied here.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::{Registry, Retirement, lock, unix_ms};
use crate::config::Endpoint;
use crate::routing::observed::Fact;

impl Registry {
    /// Shares what this replica learns from now on (`cluster:`).
    pub fn share_with(&self, tx: tokio::sync::mpsc::Sender<Fact>) {
        let _ = self.facts.set(tx);
    }

    pub(super) fn share(&self, fact: Fact) {
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
}
