//! The per-endpoint health state machine, pure and clock-injected so it is tested with a paused
//! clock.
//!
//! Two inputs drive it:
//! - **Active probes** (`observe_probe`): a state flips only after `flip_after` consecutive results
//!   agreeing on it, so one blip neither ejects nor restores. `warming` (a backend that just
//!   restarted, its probe answering) serves a share of its traffic rising over `warmup` (a slow
//!   start, [`Health::warming_share`]): it is never held out, so a standby brought up for an
//!   outage carries it as soon as it answers.
//! - **Passive outlier detection** (`observe_traffic`): `eject_after` consecutive failures of real
//!   traffic eject the endpoint for an exponentially growing time (`eject_base` doubling up to
//!   `eject_max`). When that time is over the endpoint is *half-open*: real traffic still skips it
//!   and the next probe decides — success closes it (and resets the backoff), failure ejects it
//!   again for twice as long. Recovery never comes from a flood of real requests. A run of
//!   failures only one client key saw ejects nothing (`blame`): its content may be the cause.
//!
//! Docker's view (`observe_docker`) is authoritative and immediate: no running task, or the engine
//! reporting the container unhealthy, makes the endpoint unhealthy at once.

use std::time::Duration;

use tokio::time::Instant;

use crate::routing::blame::{Witness, Witnesses};

/// The least share of its traffic a warming endpoint takes (as a slow start's least).
const WARMING_MIN_SHARE: f64 = 0.1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Healthy,
    /// Served, but ranked behind healthy endpoints.
    Degraded,
    /// Skipped.
    Unhealthy,
    /// Just restarted: skipped while it warms up.
    Warming,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::Degraded => "degraded",
            State::Unhealthy => "unhealthy",
            State::Warming => "warming",
        }
    }
}

/// What one active probe found.
#[derive(Clone, Debug, PartialEq)]
pub enum ProbeResult {
    Healthy,
    Degraded(String),
    Unhealthy(String),
    Warming(String),
}

impl ProbeResult {
    fn state(&self) -> State {
        match self {
            ProbeResult::Healthy => State::Healthy,
            ProbeResult::Degraded(_) => State::Degraded,
            ProbeResult::Unhealthy(_) => State::Unhealthy,
            ProbeResult::Warming(_) => State::Warming,
        }
    }
    fn reason(&self) -> &str {
        match self {
            ProbeResult::Healthy => "probe healthy",
            ProbeResult::Degraded(r) | ProbeResult::Unhealthy(r) | ProbeResult::Warming(r) => r,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Thresholds {
    /// Consecutive agreeing probe results before the state flips.
    pub flip_after: u32,
    /// How long a warming endpoint is held out.
    pub warmup: Duration,
    /// Consecutive failures of real traffic that eject an endpoint.
    pub eject_after: u32,
    pub eject_base: Duration,
    pub eject_max: Duration,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            flip_after: 2,
            warmup: Duration::from_secs(180),
            eject_after: 5,
            eject_base: Duration::from_secs(10),
            eject_max: Duration::from_secs(300),
        }
    }
}

/// A state change, for `endpoint_events` and the log.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    pub from: &'static str,
    pub to: &'static str,
    pub reason: String,
}

#[derive(Clone, Debug)]
pub struct Health {
    state: State,
    reason: String,
    /// The state probes are currently agreeing on, and how many times in a row.
    candidate: Option<(State, u32)>,
    warming_until: Option<Instant>,
    consecutive_failures: u32,
    /// Who saw the failures in a row: one client key's alone eject nothing ([`Witnesses`]).
    witnesses: Witnesses,
    ejected_until: Option<Instant>,
    ejections: u32,
    docker_down: Option<String>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            state: State::Healthy,
            reason: "no evidence against it".into(),
            candidate: None,
            warming_until: None,
            consecutive_failures: 0,
            witnesses: Witnesses::default(),
            ejected_until: None,
            ejections: 0,
            docker_down: None,
        }
    }
}

/// What routing sees.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Healthy,
    Degraded,
    /// Serving a share of its traffic that rises over `warmup` ([`Health::warming_share`]).
    Warming {
        remaining: Option<Duration>,
    },
    /// Skip, with why and for how long (when known).
    Skip {
        state: &'static str,
        reason: String,
        remaining: Option<Duration>,
    },
}

impl Health {
    /// The state shown in `/status` and the verdict for routing, at `now`.
    pub fn verdict(&self, now: Instant) -> Verdict {
        if let Some(r) = &self.docker_down {
            return Verdict::Skip {
                state: "unhealthy",
                reason: r.clone(),
                remaining: None,
            };
        }
        if let Some(until) = self.ejected_until {
            if until > now {
                return Verdict::Skip {
                    state: "ejected",
                    reason: self.reason.clone(),
                    remaining: Some(until - now),
                };
            }
            return Verdict::Skip {
                state: "half_open",
                reason: "ejection over; waiting for a probe to confirm recovery".into(),
                remaining: None,
            };
        }
        match self.state {
            State::Healthy => Verdict::Healthy,
            State::Degraded => Verdict::Degraded,
            State::Unhealthy => Verdict::Skip {
                state: "unhealthy",
                reason: self.reason.clone(),
                remaining: None,
            },
            State::Warming => Verdict::Warming {
                remaining: self.warming_until.map(|u| u.saturating_duration_since(now)),
            },
        }
    }

    pub fn state_name(&self, now: Instant) -> &'static str {
        match self.verdict(now) {
            Verdict::Healthy => "healthy",
            Verdict::Degraded => "degraded",
            Verdict::Warming { .. } => "warming",
            Verdict::Skip { state, .. } => state,
        }
    }

    /// The share of its traffic a warming endpoint takes at `now`: rising from a tenth to all
    /// of it over `warmup` (`None` when it is not warming).
    pub fn warming_share(&self, now: Instant, warmup: Duration) -> Option<f64> {
        // Only a warming endpoint (not ejected, not down) has a share: checked without
        // building a verdict, which clones reasons (this runs for every request's view).
        if self.state != State::Warming
            || self.docker_down.is_some()
            || self.ejected_until.is_some()
        {
            return None;
        }
        let remaining = self.warming_until.map(|u| u.saturating_duration_since(now));
        let left = remaining.unwrap_or_default().as_secs_f64();
        let whole = warmup.as_secs_f64().max(1e-3);
        Some((1.0 - left / whole).clamp(WARMING_MIN_SHARE, 1.0))
    }

    pub fn reason(&self) -> &str {
        self.docker_down.as_deref().unwrap_or(&self.reason)
    }

    fn set(&mut self, now: Instant, to: State, reason: &str) -> Option<Transition> {
        let from = self.state_name(now);
        self.state = to;
        self.reason = reason.to_string();
        let to_name = self.state_name(now);
        (from != to_name).then(|| Transition {
            from,
            to: to_name,
            reason: reason.to_string(),
        })
    }

    pub fn observe_probe(
        &mut self,
        now: Instant,
        result: &ProbeResult,
        t: &Thresholds,
    ) -> Option<Transition> {
        // Half-open: the probe decides at once.
        if let Some(until) = self.ejected_until {
            if until > now {
                return None;
            }
            return match result {
                ProbeResult::Healthy | ProbeResult::Degraded(_) => {
                    let from = self.state_name(now);
                    self.ejected_until = None;
                    self.ejections = 0;
                    self.consecutive_failures = 0;
                    self.witnesses = Witnesses::default();
                    self.candidate = None;
                    self.state = result.state();
                    self.reason = format!("half-open probe succeeded: {}", result.reason());
                    Some(Transition {
                        from,
                        to: self.state_name(now),
                        reason: self.reason.clone(),
                    })
                }
                _ => {
                    let from = self.state_name(now);
                    self.eject(
                        now,
                        t,
                        &format!("half-open probe failed: {}", result.reason()),
                    );
                    Some(Transition {
                        from,
                        to: "ejected",
                        reason: self.reason.clone(),
                    })
                }
            };
        }
        let want = result.state();
        if want == State::Warming {
            // Warming starts at once: a restarted backend must not take traffic while it loads.
            self.warming_until = Some(now + t.warmup);
            self.candidate = None;
            return self.set(now, State::Warming, result.reason());
        }
        if self.state == State::Warming {
            if let Some(until) = self.warming_until
                && until > now
            {
                return None;
            }
            self.warming_until = None;
        }
        let streak = match self.candidate {
            Some((s, n)) if s == want => n + 1,
            _ => 1,
        };
        self.candidate = Some((want, streak));
        if want == self.state && self.state != State::Warming {
            self.reason = result.reason().to_string();
            return None;
        }
        if streak >= t.flip_after.max(1) {
            self.candidate = None;
            return self.set(now, want, result.reason());
        }
        None
    }

    /// Passive detection from live traffic.
    pub fn observe_traffic(
        &mut self,
        now: Instant,
        failed: Option<Witness>,
        detail: &str,
        t: &Thresholds,
    ) -> Option<Transition> {
        let Some(who) = failed else {
            self.consecutive_failures = 0;
            self.witnesses = Witnesses::default();
            return None;
        };
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.witnesses.add(who);
        if self.witnesses.counted() >= u64::from(t.eject_after.max(1))
            && self.ejected_until.is_none()
        {
            let from = self.state_name(now);
            self.eject(
                now,
                t,
                &format!(
                    "{} consecutive failures; last: {detail}",
                    self.consecutive_failures
                ),
            );
            return Some(Transition {
                from,
                to: "ejected",
                reason: self.reason.clone(),
            });
        }
        None
    }

    fn eject(&mut self, now: Instant, t: &Thresholds, reason: &str) {
        let factor = 2u32.saturating_pow(self.ejections.min(16));
        let d = t.eject_base.saturating_mul(factor).min(t.eject_max);
        self.ejections += 1;
        self.ejected_until = Some(now + d);
        self.consecutive_failures = 0;
        self.witnesses = Witnesses::default();
        self.reason = format!("{reason}; ejected for {}s", d.as_secs_f64());
    }

    /// Docker's view: `Some(reason)` when no task runs or the engine reports the container
    /// unhealthy; `None` when it is fine.
    pub fn observe_docker(&mut self, now: Instant, down: Option<String>) -> Option<Transition> {
        let from = self.state_name(now);
        let changed = self.docker_down != down;
        self.docker_down = down.clone();
        let to = self.state_name(now);
        (changed && from != to).then(|| Transition {
            from,
            to,
            reason: down.unwrap_or_else(|| "docker reports a running task again".into()),
        })
    }

    pub fn is_ejected(&self) -> bool {
        self.ejected_until.is_some()
    }

    /// Probes (not Docker, not passive ejection, not warming) say the endpoint is unhealthy:
    /// the evidence remediation may act on.
    pub fn probe_unhealthy(&self) -> Option<&str> {
        (self.state == State::Unhealthy).then_some(self.reason.as_str())
    }

    /// The endpoint now runs at other addresses (a replacement task): what was learned about the
    /// old ones — passive ejection, probe verdicts — no longer applies. Docker's own view stays.
    pub fn new_addresses(&mut self, now: Instant) -> Option<Transition> {
        let from = self.state_name(now);
        self.state = State::Healthy;
        self.reason = "new task address; no evidence against it yet".into();
        self.candidate = None;
        self.consecutive_failures = 0;
        self.witnesses = Witnesses::default();
        self.ejected_until = None;
        self.ejections = 0;
        self.warming_until = None;
        let to = self.state_name(now);
        (from != to).then(|| Transition {
            from,
            to,
            reason: self.reason.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Thresholds {
        Thresholds {
            flip_after: 3,
            warmup: Duration::from_secs(180),
            eject_after: 3,
            eject_base: Duration::from_secs(10),
            eject_max: Duration::from_secs(40),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_replacement_address_starts_fresh() {
        let mut h = Health::default();
        let now = Instant::now();
        for _ in 0..3 {
            h.observe_traffic(now, Some(Witness::Sure), "connect_error: refused", &t());
        }
        assert_eq!(h.state_name(now), "ejected");
        assert_eq!(h.probe_unhealthy(), None, "ejection is not probe evidence");
        let tr = h.new_addresses(now).unwrap();
        assert_eq!((tr.from, tr.to), ("ejected", "healthy"));
        assert_eq!(h.verdict(now), Verdict::Healthy);
        // Docker's authoritative view is kept.
        h.observe_docker(now, Some("no running task".into()));
        h.new_addresses(now);
        assert_eq!(h.state_name(now), "unhealthy");
    }

    #[tokio::test(start_paused = true)]
    async fn flips_only_after_n_consecutive_probes() {
        let mut h = Health::default();
        let bad = ProbeResult::Unhealthy("GET /health: 503".into());
        assert_eq!(h.observe_probe(Instant::now(), &bad, &t()), None);
        assert_eq!(h.observe_probe(Instant::now(), &bad, &t()), None);
        // One good blip resets the streak.
        assert_eq!(
            h.observe_probe(Instant::now(), &ProbeResult::Healthy, &t()),
            None
        );
        assert_eq!(h.observe_probe(Instant::now(), &bad, &t()), None);
        assert_eq!(h.observe_probe(Instant::now(), &bad, &t()), None);
        let tr = h.observe_probe(Instant::now(), &bad, &t()).unwrap();
        assert_eq!((tr.from, tr.to), ("healthy", "unhealthy"));
        assert!(matches!(h.verdict(Instant::now()), Verdict::Skip { .. }));
        for _ in 0..2 {
            assert_eq!(
                h.observe_probe(Instant::now(), &ProbeResult::Healthy, &t()),
                None
            );
        }
        let tr = h
            .observe_probe(Instant::now(), &ProbeResult::Healthy, &t())
            .unwrap();
        assert_eq!(tr.to, "healthy");
    }

    #[tokio::test(start_paused = true)]
    async fn warming_serves_a_rising_share_for_the_warmup() {
        let mut h = Health::default();
        let tr = h
            .observe_probe(
                Instant::now(),
                &ProbeResult::Warming("uptime 12s".into()),
                &t(),
            )
            .unwrap();
        assert_eq!(tr.to, "warming");
        tokio::time::advance(Duration::from_secs(60)).await;
        for _ in 0..5 {
            assert_eq!(
                h.observe_probe(Instant::now(), &ProbeResult::Healthy, &t()),
                None,
                "still warming"
            );
        }
        assert!(matches!(h.verdict(Instant::now()), Verdict::Warming { .. }));
        assert_eq!(h.state_name(Instant::now()), "warming");
        // Served all along, a share rising over the warmup.
        let share = h.warming_share(Instant::now(), t().warmup).unwrap();
        assert!((share - 60.0 / 180.0).abs() < 1e-6, "{share}");
        tokio::time::advance(Duration::from_secs(121)).await;
        let mut last = None;
        for _ in 0..3 {
            last = h
                .observe_probe(Instant::now(), &ProbeResult::Healthy, &t())
                .or(last);
        }
        assert_eq!(last.unwrap().to, "healthy");
    }

    #[tokio::test(start_paused = true)]
    async fn passive_ejection_backs_off_and_recovers_through_half_open() {
        let mut h = Health::default();
        let th = t();
        assert_eq!(
            h.observe_traffic(Instant::now(), Some(Witness::Sure), "503", &th),
            None
        );
        assert_eq!(
            h.observe_traffic(Instant::now(), Some(Witness::Sure), "503", &th),
            None
        );
        let tr = h
            .observe_traffic(Instant::now(), Some(Witness::Sure), "503", &th)
            .unwrap();
        assert_eq!(tr.to, "ejected");
        assert!(
            matches!(h.verdict(Instant::now()), Verdict::Skip { state: "ejected", remaining: Some(d), .. } if d == Duration::from_secs(10))
        );
        tokio::time::advance(Duration::from_secs(11)).await;
        // Half-open: real traffic still skips it; a failed probe doubles the ejection.
        assert!(matches!(
            h.verdict(Instant::now()),
            Verdict::Skip {
                state: "half_open",
                ..
            }
        ));
        h.observe_probe(Instant::now(), &ProbeResult::Unhealthy("503".into()), &th)
            .unwrap();
        assert!(
            matches!(h.verdict(Instant::now()), Verdict::Skip { state: "ejected", remaining: Some(d), .. } if d == Duration::from_secs(20))
        );
        tokio::time::advance(Duration::from_secs(21)).await;
        h.observe_probe(Instant::now(), &ProbeResult::Unhealthy("503".into()), &th)
            .unwrap();
        // Capped at eject_max.
        assert!(
            matches!(h.verdict(Instant::now()), Verdict::Skip { remaining: Some(d), .. } if d == Duration::from_secs(40))
        );
        tokio::time::advance(Duration::from_secs(41)).await;
        let tr = h
            .observe_probe(Instant::now(), &ProbeResult::Healthy, &th)
            .unwrap();
        assert_eq!((tr.from, tr.to), ("half_open", "healthy"));
        assert_eq!(h.verdict(Instant::now()), Verdict::Healthy);
        // Backoff reset: the next ejection is short again.
        for _ in 0..3 {
            h.observe_traffic(Instant::now(), Some(Witness::Sure), "503", &th);
        }
        assert!(
            matches!(h.verdict(Instant::now()), Verdict::Skip { remaining: Some(d), .. } if d == Duration::from_secs(10))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_keys_failures_in_a_row_eject_nothing_two_keys_do() {
        let mut h = Health::default();
        let now = Instant::now();
        for _ in 0..20 {
            assert_eq!(
                h.observe_traffic(now, Some(Witness::Key(1)), "500", &t()),
                None
            );
        }
        assert!(!h.is_ejected());
        assert_eq!(
            h.observe_traffic(now, Some(Witness::Key(2)), "500", &t()),
            None,
            "one failure of a second key lets one of the first key's twenty count: 2 of 3"
        );
        let tr = h.observe_traffic(now, Some(Witness::Key(3)), "500", &t());
        assert_eq!(tr.map(|t| t.to), Some("ejected"), "a third key's: 4 count");
        // An answer ends the run and its witnesses: one key alone again ejects nothing.
        let mut h = Health::default();
        h.observe_traffic(now, Some(Witness::Key(1)), "500", &t());
        h.observe_traffic(now, None, "", &t());
        for _ in 0..5 {
            assert_eq!(
                h.observe_traffic(now, Some(Witness::Key(2)), "500", &t()),
                None
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn docker_down_is_immediate() {
        let mut h = Health::default();
        let tr = h
            .observe_docker(Instant::now(), Some("no running task".into()))
            .unwrap();
        assert_eq!(tr.to, "unhealthy");
        assert_eq!(
            h.observe_docker(Instant::now(), Some("no running task".into())),
            None
        );
        let tr = h.observe_docker(Instant::now(), None).unwrap();
        assert_eq!(tr.to, "healthy");
    }
}
