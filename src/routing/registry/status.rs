//! One endpoint as `/status` shows it and `/metrics` counts it: its named state, its totals, and
//! what its keys' rate-limit budgets allow now.

use std::time::SystemTime;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::{Avail, Registry, lock};
use crate::config::{Endpoint, Policy};

impl Registry {
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
        let rate = rt.window.counts(now).routing_rate(policy.min_samples);
        let usable_keys = rt.usable_keys(ep);
        let state = warming_or(
            &rt.health,
            now,
            state_name(
                &rt.avail(now),
                ep.needs_key() && usable_keys == 0,
                rate,
                policy,
            ),
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
        // The state is what routing does (one key's failures alone demote nothing); the
        // success rate shown is every request's.
        let state = warming_or(
            &rt.health,
            now,
            state_name(
                &avail,
                ep.needs_key() && usable_keys == 0,
                counts.routing_rate(policy.min_samples),
                policy,
            ),
        );
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
            "slow_start_share": rt.slow_start(now, policy.slow_start, policy.health.warmup),
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

/// A serving endpoint that is warming says so (it takes a share of its traffic:
/// `slow_start_share`).
fn warming_or(
    h: &crate::routing::health::Health,
    now: Instant,
    state: &'static str,
) -> &'static str {
    if state == "healthy" && h.state_name(now) == "warming" {
        "warming"
    } else {
        state
    }
}

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
