//! An endpoint's addresses (`base_urls`, or the tasks discovery found): kept in line with the
//! config and Docker's view, picked by load for each attempt, told how each attempt and probe
//! went (the policy is `routing::balance`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::{Registry, lock};
use crate::config::Endpoint;
use crate::routing::balance::{InFlight, Standing, Tuning};
use crate::routing::blame::Witness;

/// No address of the endpoint is usable (all out, or none discovered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoAddress;

/// What a request asks of the choice of address.
#[derive(Debug, Default, Clone, Copy)]
pub struct Want<'a> {
    /// Its conversation's place on the ring ([`crate::routing::balance::conversation_of`]).
    pub key: Option<u64>,
    /// The address its earlier turn was served at: preferred while not overloaded.
    pub prefer: Option<&'a str>,
    /// `prefer` is where the conversation is (the upstream holds it under its own id): that
    /// address whatever its load, while it is usable.
    pub exact: bool,
    /// Addresses not to go to, while another is usable: those that failed this request, the
    /// one a hedge's first copy went to. The rest are picked by load alone.
    pub avoid: &'a [Arc<str>],
}

/// The address an attempt goes to, counted in flight while it runs.
#[derive(Debug)]
pub struct Picked {
    pub base: String,
    pub in_flight: InFlight,
}

/// The balancing knobs of an endpoint: its `balance:`, and ejection as `health:` sets it for
/// endpoints; a vLLM queue sample counts for two probe intervals.
pub fn tuning(cfg: &crate::config::Config, ep: &Endpoint) -> Tuning {
    let h = &cfg.policy.health;
    let b = &ep.balance;
    Tuning {
        eject_after: h.eject_after.max(1),
        eject_base: h.eject_base,
        eject_max: h.eject_max,
        max_ejection_percent: b.max_ejection_percent / 100.0,
        affinity_load: b.affinity_load,
        random: b.random,
        affinity: b.affinity,
        fresh_for: cfg.health.probe_interval.saturating_mul(2),
        ..Tuning::default()
    }
}

impl Registry {
    /// Where an attempt at `ep` goes: `Ok(None)` for an endpoint of one static address (its
    /// `base_url`, as ever); for one of several or of discovered tasks, the cheaper of two usable
    /// addresses (`Err` when none is usable: all ejected or half-open, or none discovered).
    pub fn pick_address(
        &self,
        ep: &Endpoint,
        t: &Tuning,
        want: &Want,
    ) -> Result<Option<Picked>, NoAddress> {
        if ep.addresses.is_empty() && !ep.discover {
            return Ok(None);
        }
        let rt = self.get(&ep.name).ok_or(NoAddress)?;
        let shared = lock(&rt).addresses.clone();
        let now = Instant::now();
        // Picked, read and counted under one lock: a discovery update between them could
        // shrink or reorder the list.
        let (base, in_flight) = {
            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
            let mut rng = fastrand::Rng::new();
            let i = match want.prefer {
                Some(u)
                    if want.exact
                        && !want.avoid.iter().any(|a| &**a == u)
                        && let Some(i) = g.preferred(u, true, now, t) =>
                {
                    i
                }
                _ if let Some(i) = (!want.avoid.is_empty())
                    .then(|| g.pick_other(want.avoid, now, t, &mut rng))
                    .flatten() =>
                {
                    i
                }
                // Nothing but avoided addresses usable: one of them, rather than none.
                Some(u) if let Some(i) = g.preferred(u, want.exact, now, t) => i,
                _ => g.pick_for(want.key, now, t, &mut rng).ok_or(NoAddress)?,
            };
            let a = &mut g.list[i];
            a.in_flight = a.in_flight.saturating_add(1);
            (a.url.clone(), InFlight::new(shared.clone(), a))
        };
        Ok(Some(Picked { base, in_flight }))
    }

    /// An attempt at `base` answered in `rtt`, to a request `who` sent (`None`: made with the
    /// client's own upstream key): its latency estimate learns it.
    pub fn address_answered(
        &self,
        endpoint: &str,
        base: &str,
        rtt: Duration,
        who: Option<Witness>,
        t: &Tuning,
    ) {
        self.with_address(endpoint, base, |a, now| a.observe(rtt, now, t, who));
    }

    /// An attempt at `base` ran out of its time after `rtt`: learned as latency only.
    pub fn address_slow(&self, endpoint: &str, base: &str, rtt: Duration, t: &Tuning) {
        self.with_address(endpoint, base, |a, now| a.observe_slow(rtt, now, t));
    }

    /// An attempt at `base` failed for a reason of the address's own (no connection, a 5xx, a
    /// timeout), as `who` saw it: after `eject_after` in a row (or by its failure rate) that
    /// more than one client key saw, it is ejected alone (an event says so).
    pub fn address_failed(&self, endpoint: &str, base: &str, who: Witness, t: &Tuning) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let shared = lock(&rt).addresses.clone();
        let ejected = {
            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            match g.list.iter().position(|a| a.url == base) {
                Some(i) => g.failed(i, who, now, t),
                None => false,
            }
        };
        if ejected {
            // The prober, waiting out its interval, comes within `eject_base` of it.
            self.ejections.notify_waiters();
            self.event(
                endpoint,
                "address_ejected",
                &format!("{base}: its requests failed (in a row, or a quarter of its last 20); the endpoint's other addresses serve"),
            );
        }
    }

    /// A probe of `base`: a half-open address comes back on success; an active one whose
    /// probes fail `eject_after` times in a row (a process that died) is ejected.
    pub fn address_probed(&self, endpoint: &str, base: &str, ok: bool, t: &Tuning) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let shared = lock(&rt).addresses.clone();
        let (back, ejected) = {
            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let Some(i) = g.list.iter().position(|a| a.url == base) else {
                return;
            };
            let was = g.list[i].standing(now);
            let ejected = g.probed(i, ok, now, t);
            (was == Standing::HalfOpen && g.list[i].usable(now), ejected)
        };
        if back {
            self.event(
                endpoint,
                "address_back",
                &format!("{base}: its probe passed"),
            );
        }
        if ejected {
            self.ejections.notify_waiters();
            self.event(
                endpoint,
                "address_ejected",
                &format!(
                    "{base}: its probes failed in a row; the endpoint's other addresses serve"
                ),
            );
        }
    }

    /// A probe read the server's own queue at `base` (vLLM: waiting + running).
    pub fn address_queue(&self, endpoint: &str, base: &str, queued: u32) {
        self.with_address(endpoint, base, |a, now| a.observe_queue(queued, now));
    }

    /// The addresses to probe: every one the endpoint has (none for one static address).
    pub fn address_list(&self, endpoint: &str) -> Vec<String> {
        let Some(rt) = self.get(endpoint) else {
            return vec![];
        };
        let shared = lock(&rt).addresses.clone();
        let g = shared.lock().unwrap_or_else(|e| e.into_inner());
        g.list.iter().map(|a| a.url.clone()).collect()
    }

    /// How many addresses the endpoint has (0 for one static address): read on every request,
    /// so nothing is copied.
    pub fn address_count(&self, endpoint: &str) -> usize {
        let Some(rt) = self.get(endpoint) else {
            return 0;
        };
        let shared = lock(&rt).addresses.clone();
        shared.lock().unwrap_or_else(|e| e.into_inner()).list.len()
    }

    /// `/metrics`' per-address series: (url, in flight, ejections so far) of each address.
    pub fn address_gauges(&self, endpoint: &str) -> Vec<(String, u32, u64)> {
        let Some(rt) = self.get(endpoint) else {
            return vec![];
        };
        let shared = lock(&rt).addresses.clone();
        let g = shared.lock().unwrap_or_else(|e| e.into_inner());
        g.list
            .iter()
            .map(|a| (a.url.clone(), a.in_flight, a.ejected_total))
            .collect()
    }

    /// `/status.endpoints.<name>.addresses`.
    pub fn addresses_json(&self, endpoint: &str, t: &Tuning) -> Value {
        let Some(rt) = self.get(endpoint) else {
            return json!([]);
        };
        let shared = lock(&rt).addresses.clone();
        let g = shared.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        Value::Array(
            g.list
                .iter()
                .map(|a| {
                    let (state, until) = match a.standing(now) {
                        Standing::Active => ("active", Value::Null),
                        Standing::HalfOpen => ("half_open", Value::Null),
                        Standing::Ejected(u) => (
                            "ejected",
                            json!(u.saturating_duration_since(now).as_millis() as u64),
                        ),
                    };
                    json!({
                        "url": a.url,
                        "state": state,
                        "in_flight": a.in_flight,
                        "failures_in_a_row": a.failures(),
                        "ewma_ms": (a.rtt(now, t) * 1000.0 * 10.0).round() / 10.0,
                        "ejected_until": until,
                        "queue": a.queue(now, t),
                    })
                })
                .collect(),
        )
    }

    fn with_address<R>(
        &self,
        endpoint: &str,
        base: &str,
        f: impl FnOnce(&mut crate::routing::balance::Address, Instant) -> R,
    ) -> Option<R> {
        let rt = self.get(endpoint)?;
        let shared = lock(&rt).addresses.clone();
        let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
        let a = g.list.iter_mut().find(|a| a.url == base)?;
        Some(f(a, Instant::now()))
    }
}
