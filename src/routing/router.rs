//! Pure ranking: given a chain and each endpoint's current view, which endpoints to try and in
//! what order, and why the others were skipped. No I/O, no clock: the caller passes the views.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::{Capability, Caps};
use crate::routing::outcome::Outcome;

/// Why an endpoint cannot take a request right now.
#[derive(Clone, Debug, PartialEq)]
pub enum Avail {
    Ready,
    /// Served, but ranked behind healthy endpoints (probes say so).
    Degraded,
    Cooldown(Duration),
    Retired,
    AuthFailed,
    /// Unhealthy, ejected or half-open: skipped (warming is `Ready` at a share: `slow_start`).
    Unhealthy {
        state: &'static str,
        reason: String,
    },
}

/// What the ranking needs to know about one endpoint.
#[derive(Clone, Debug)]
pub struct View {
    pub name: String,
    pub avail: Avail,
    /// Success rate over the window, `None` until enough samples exist.
    pub success_rate: Option<f64>,
    pub capabilities: Caps,
    /// Configured keys exist but none is usable (unset env var, all rejected).
    pub no_usable_key: bool,
    /// In its slow start after a recovery: the share of its traffic it takes now (0.1..1).
    pub slow_start: Option<f64>,
    /// A uniform draw in [0, 1) for this request: with `roll >= slow_start` the endpoint lets
    /// this request go to the next candidates first.
    pub roll: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Skip {
    Retired,
    AuthFailed,
    Cooldown(Duration),
    MissingCapability(Capability),
    Unhealthy { state: &'static str, reason: String },
}

impl Skip {
    /// The error class recorded for the skip in the attempts list.
    pub fn class(&self) -> Outcome {
        match self {
            Skip::Retired => Outcome::SkippedRetired,
            Skip::AuthFailed => Outcome::SkippedAuthFailed,
            Skip::Cooldown(_) => Outcome::SkippedCooldown,
            Skip::MissingCapability(_) => Outcome::SkippedCapability,
            Skip::Unhealthy { .. } => Outcome::SkippedUnhealthy,
        }
    }
    pub fn detail(&self) -> String {
        match self {
            Skip::Retired => "endpoint is retired (410 Gone)".into(),
            Skip::AuthFailed => "no usable API key".into(),
            Skip::Cooldown(d) => format!("cooling down for {}ms more", d.as_millis()),
            Skip::MissingCapability(c) => {
                format!("endpoint lacks the {c:?} capability").to_lowercase()
            }
            Skip::Unhealthy { state, reason } => format!("{state}: {reason}"),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Endpoints to try, in order.
    pub order: Vec<String>,
    pub skipped: Vec<(String, Skip)>,
    /// Endpoints moved behind the healthy ones for a success rate under the threshold.
    pub demoted: Vec<String>,
    /// Healthy panic: health was ignored, every otherwise usable endpoint is in `order`.
    pub panic: bool,
    /// In panic, the endpoints in `order` that health alone would have skipped.
    pub panic_admitted: Vec<String>,
    /// Endpoints in their slow start moved behind the healthy ones for this request.
    pub slowed: Vec<String>,
}

impl Plan {
    /// The shortest remaining cooldown among skipped endpoints, for `max_wait`.
    pub fn soonest_cooldown(&self) -> Option<Duration> {
        self.skipped
            .iter()
            .filter_map(|(_, s)| match s {
                Skip::Cooldown(d) => Some(*d),
                _ => None,
            })
            .min()
    }
}

/// The share of its traffic an endpoint takes at the start of its slow start (Envoy's
/// `min_weight_percent`, 10%).
pub const SLOW_START_MIN: f64 = 0.1;

/// Cooldowns shorter than this end without a slow start: a few milliseconds away (a token
/// bucket's refill) do not gather a flood of failed-over traffic to return.
pub const SLOW_START_AFTER_COOLDOWN: Duration = Duration::from_secs(1);

/// The share of its traffic an endpoint takes at `now` when it is in its slow start: it came back
/// from unhealthy, warming or ejection at `recovered_at`, or a cooldown of at least
/// [`SLOW_START_AFTER_COOLDOWN`] (`(from, until)`) ended, less than `window` ago. Rises linearly
/// from [`SLOW_START_MIN`] to 1.
pub fn slow_start_share(
    recovered_at: Option<Instant>,
    cooldown: Option<(Instant, Instant)>,
    now: Instant,
    window: Duration,
) -> Option<f64> {
    if window.is_zero() {
        return None;
    }
    let cooled = cooldown
        .filter(|(from, until)| *until <= now && *until - *from >= SLOW_START_AFTER_COOLDOWN)
        .map(|(_, until)| until);
    let since = match (recovered_at, cooled) {
        (Some(a), Some(b)) => a.max(b),
        (a, b) => a.or(b)?,
    };
    let elapsed = now.saturating_duration_since(since);
    (elapsed < window)
        .then(|| (elapsed.as_secs_f64() / window.as_secs_f64()).clamp(SLOW_START_MIN, 1.0))
}

/// Envoy's healthy-panic rule: true when fewer than `threshold` of the chain's endpoints are
/// available by health state (unhealthy, ejected and half-open count as unavailable; warming serves at its share).
/// Health bookkeeping must never take away every endpoint: in panic, health is ignored.
pub fn in_panic(views: &[View], threshold: f64) -> bool {
    if views.is_empty() {
        return false;
    }
    let available = views
        .iter()
        .filter(|v| !matches!(v.avail, Avail::Unhealthy { .. }))
        .count();
    (available as f64) < threshold * views.len() as f64
}

/// Ranks `chain`: unusable endpoints are skipped; the rest keep chain order, except that those
/// whose success rate is below `threshold` go behind the healthy ones (keeping their relative
/// order). A demoted endpoint is still tried: a degraded backend beats none.
///
/// With `panic` (see [`in_panic`]) health is ignored: every endpoint that is not retired,
/// `auth_failed`, cooling down or lacking a capability is tried, in chain order.
///
/// Slow start (Envoy's `slow_start_window`): an endpoint that recently recovered keeps its place
/// for only its current share of requests; for the others it goes behind the healthy endpoints
/// (still ahead of demoted ones). It is never skipped, so slow start cannot cause a 503.
pub fn rank<N: AsRef<str>>(
    chain: &[N],
    views: &[View],
    needs: &BTreeSet<Capability>,
    threshold: f64,
    panic: bool,
) -> Plan {
    let mut plan = Plan {
        panic,
        ..Plan::default()
    };
    let mut healthy = Vec::new();
    let mut slowed = Vec::new();
    let mut demoted = Vec::new();
    for name in chain {
        let Some(v) = views.iter().find(|v| v.name == name.as_ref()) else {
            continue;
        };
        let name = &v.name;
        if let Some(missing) = needs.iter().find(|c| !v.capabilities.contains(**c)) {
            plan.skipped
                .push((name.clone(), Skip::MissingCapability(*missing)));
            continue;
        }
        match &v.avail {
            Avail::Retired => plan.skipped.push((name.clone(), Skip::Retired)),
            Avail::AuthFailed => plan.skipped.push((name.clone(), Skip::AuthFailed)),
            Avail::Cooldown(d) => plan.skipped.push((name.clone(), Skip::Cooldown(*d))),
            Avail::Unhealthy { .. } if panic && v.no_usable_key => {
                plan.skipped.push((name.clone(), Skip::AuthFailed))
            }
            Avail::Unhealthy { .. } if panic => {
                plan.panic_admitted.push(name.clone());
                healthy.push(name.clone());
            }
            Avail::Ready | Avail::Degraded if panic && v.no_usable_key => {
                plan.skipped.push((name.clone(), Skip::AuthFailed))
            }
            Avail::Ready | Avail::Degraded if panic => healthy.push(name.clone()),
            Avail::Unhealthy { state, reason } => plan.skipped.push((
                name.clone(),
                Skip::Unhealthy {
                    state,
                    reason: reason.clone(),
                },
            )),
            Avail::Ready | Avail::Degraded if v.no_usable_key => {
                plan.skipped.push((name.clone(), Skip::AuthFailed))
            }
            Avail::Ready | Avail::Degraded => {
                if v.avail == Avail::Degraded || v.success_rate.is_some_and(|r| r < threshold) {
                    demoted.push(name.clone());
                } else if v.slow_start.is_some_and(|share| v.roll >= share) {
                    slowed.push(name.clone());
                } else {
                    healthy.push(name.clone());
                }
            }
        }
    }
    plan.order = healthy;
    plan.order.extend(slowed.iter().cloned());
    plan.order.extend(demoted.iter().cloned());
    plan.demoted = demoted;
    plan.slowed = slowed;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(name: &str, avail: Avail, rate: Option<f64>) -> View {
        View {
            name: name.into(),
            avail,
            success_rate: rate,
            capabilities: [Capability::Chat, Capability::Tools].into_iter().collect(),
            no_usable_key: false,
            slow_start: None,
            roll: 0.0,
        }
    }

    fn chain(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn sick(name: &str) -> View {
        view(
            name,
            Avail::Unhealthy {
                state: "ejected",
                reason: "5 failures".into(),
            },
            None,
        )
    }

    #[test]
    fn panic_threshold_counts_health_only() {
        let views = vec![
            sick("a"),
            view("b", Avail::Cooldown(Duration::from_secs(1)), None),
            view("c", Avail::Retired, None),
        ];
        // One of three unavailable by health: 2/3 >= 0.5.
        assert!(!in_panic(&views, 0.5));
        let views = vec![sick("a"), sick("b"), view("c", Avail::Ready, None)];
        assert!(in_panic(&views, 0.5), "1/3 available");
        assert!(!in_panic(&views, 0.3));
        assert!(!in_panic(&views, 0.0), "threshold 0 turns panic off");
        assert!(in_panic(&[sick("a")], 1.0));
        assert!(!in_panic(&[], 0.5));
        // Exactly the threshold is not a panic: "fewer than" the share.
        let half = vec![sick("a"), view("b", Avail::Ready, None)];
        assert!(!in_panic(&half, 0.5));
        assert!(in_panic(&half, 0.51));
    }

    #[test]
    fn no_usable_key_is_skipped_in_and_out_of_panic() {
        let mut nokey = view("k", Avail::Ready, None);
        nokey.no_usable_key = true;
        let mut degraded_nokey = view("dk", Avail::Degraded, None);
        degraded_nokey.no_usable_key = true;
        let views = vec![nokey, degraded_nokey, view("ok", Avail::Ready, None)];
        for panic in [false, true] {
            let p = rank(
                &chain(&["k", "dk", "ok"]),
                &views,
                &BTreeSet::new(),
                0.85,
                panic,
            );
            assert_eq!(p.order, chain(&["ok"]), "panic={panic}");
            assert_eq!(
                p.skipped,
                vec![
                    ("k".to_string(), Skip::AuthFailed),
                    ("dk".to_string(), Skip::AuthFailed)
                ],
                "panic={panic}"
            );
        }
    }

    #[test]
    fn skip_details_say_why() {
        let cases = [
            (Skip::Retired, "endpoint is retired (410 Gone)"),
            (Skip::AuthFailed, "no usable API key"),
            (
                Skip::Cooldown(Duration::from_millis(1500)),
                "cooling down for 1500ms more",
            ),
            (
                Skip::MissingCapability(Capability::Vision),
                "endpoint lacks the vision capability",
            ),
            (
                Skip::Unhealthy {
                    state: "ejected",
                    reason: "5 failures".into(),
                },
                "ejected: 5 failures",
            ),
        ];
        for (skip, want) in cases {
            assert_eq!(skip.detail(), want);
        }
    }

    #[test]
    fn panic_tries_every_usable_endpoint_in_chain_order() {
        let mut nokey = sick("k");
        nokey.no_usable_key = true;
        let views = vec![
            sick("a"),
            view("b", Avail::Ready, Some(0.1)),
            view("c", Avail::Cooldown(Duration::from_secs(2)), None),
            sick("d"),
            view("r", Avail::Retired, None),
            view("f", Avail::AuthFailed, None),
            nokey,
        ];
        let p = rank(
            &chain(&["a", "b", "c", "d", "r", "f", "k"]),
            &views,
            &BTreeSet::new(),
            0.85,
            true,
        );
        assert!(p.panic);
        assert_eq!(p.order, chain(&["a", "b", "d"]), "chain order, no demotion");
        assert_eq!(p.panic_admitted, chain(&["a", "d"]));
        let classes: Vec<_> = p
            .skipped
            .iter()
            .map(|(n, s)| (n.as_str(), s.class().as_str()))
            .collect();
        assert_eq!(
            classes,
            vec![
                ("c", "skipped_cooldown"),
                ("r", "skipped_retired"),
                ("f", "skipped_auth_failed"),
                ("k", "skipped_auth_failed")
            ]
        );
        let p = rank(
            &chain(&["a", "b", "c", "d"]),
            &views,
            &BTreeSet::new(),
            0.85,
            false,
        );
        assert_eq!(p.order, chain(&["b"]), "outside panic health skips");
    }

    #[test]
    fn slow_start_yields_its_place_for_the_share_it_does_not_take_and_is_never_skipped() {
        let mut a = view("a", Avail::Ready, None);
        a.slow_start = Some(0.25);
        let b = view("b", Avail::Ready, None);
        let d = view("d", Avail::Degraded, None);
        let order = |a: &View| {
            rank(
                &chain(&["a", "b", "d"]),
                &[a.clone(), b.clone(), d.clone()],
                &BTreeSet::new(),
                0.85,
                false,
            )
        };
        a.roll = 0.2;
        assert_eq!(order(&a).order, chain(&["a", "b", "d"]), "within its share");
        a.roll = 0.3;
        let plan = order(&a);
        assert_eq!(
            plan.order,
            chain(&["b", "a", "d"]),
            "behind healthy, ahead of demoted"
        );
        assert_eq!(plan.slowed, chain(&["a"]));
        assert!(plan.skipped.is_empty());
        // Alone in its chain it still takes every request: slow start never causes a 503.
        let alone = rank(&chain(&["a"]), &[a.clone()], &BTreeSet::new(), 0.85, false);
        assert_eq!(alone.order, chain(&["a"]));
    }

    #[tokio::test(start_paused = true)]
    async fn slow_start_share_rises_linearly_from_ten_percent_after_recovery_or_cooldown() {
        let w = Duration::from_secs(30);
        let t0 = Instant::now();
        assert_eq!(
            slow_start_share(None, None, t0, w),
            None,
            "never down: no slow start"
        );
        assert_eq!(
            slow_start_share(Some(t0), None, t0, w),
            Some(SLOW_START_MIN)
        );
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(slow_start_share(Some(t0), None, at(15), w), Some(0.5));
        assert_eq!(
            slow_start_share(Some(t0), None, at(30), w),
            None,
            "window over"
        );
        // A cooldown still running is not a recovery; one that ended is.
        assert_eq!(slow_start_share(None, Some((t0, at(10))), at(5), w), None);
        assert_eq!(
            slow_start_share(None, Some((t0, at(10))), at(13), w),
            Some(0.1)
        );
        // A cooldown of a few milliseconds is no outage: no slow start after it.
        let blip = Some((at(10), at(10) + Duration::from_millis(6)));
        assert_eq!(slow_start_share(None, blip, at(11), w), None);
        // The later of the two counts.
        assert_eq!(
            slow_start_share(Some(t0), Some((t0, at(20))), at(26), w),
            Some(0.2)
        );
        assert_eq!(
            slow_start_share(Some(t0), None, at(1), Duration::ZERO),
            None,
            "0 turns it off"
        );
    }

    #[test]
    fn keeps_chain_order_when_healthy() {
        let views = vec![
            view("a", Avail::Ready, Some(0.99)),
            view("b", Avail::Ready, None),
            view("c", Avail::Ready, Some(0.9)),
        ];
        let p = rank(
            &chain(&["c", "a", "b"]),
            &views,
            &BTreeSet::new(),
            0.85,
            false,
        );
        assert_eq!(p.order, chain(&["c", "a", "b"]));
    }

    #[test]
    fn demotes_below_threshold_behind_healthy() {
        let views = vec![
            view("a", Avail::Ready, Some(0.5)),
            view("b", Avail::Ready, Some(0.6)),
            view("c", Avail::Ready, Some(0.95)),
        ];
        let p = rank(
            &chain(&["a", "b", "c"]),
            &views,
            &BTreeSet::new(),
            0.85,
            false,
        );
        assert_eq!(p.order, chain(&["c", "a", "b"]));
        assert_eq!(p.demoted, chain(&["a", "b"]));
    }

    #[test]
    fn a_rate_exactly_at_the_threshold_is_not_demoted() {
        let views = vec![
            view("a", Avail::Ready, Some(0.85)),
            view("b", Avail::Ready, Some(0.99)),
        ];
        let p = rank(&chain(&["a", "b"]), &views, &BTreeSet::new(), 0.85, false);
        assert_eq!(p.order, chain(&["a", "b"]));
        assert!(p.demoted.is_empty());
    }

    #[test]
    fn skips_unusable_and_missing_capabilities() {
        let mut vision = view("v", Avail::Ready, None);
        vision.capabilities.insert(Capability::Vision);
        let mut nokey = view("k", Avail::Ready, None);
        nokey.no_usable_key = true;
        let views = vec![
            view("r", Avail::Retired, None),
            view("cd", Avail::Cooldown(Duration::from_secs(3)), None),
            view("plain", Avail::Ready, None),
            vision,
            nokey,
        ];
        let needs: BTreeSet<_> = [Capability::Vision].into();
        let p = rank(
            &chain(&["r", "cd", "plain", "v", "k"]),
            &views,
            &needs,
            0.85,
            false,
        );
        assert_eq!(p.order, chain(&["v"]));
        assert_eq!(p.skipped.len(), 4);
        assert_eq!(
            p.skipped[2],
            (
                "plain".to_string(),
                Skip::MissingCapability(Capability::Vision)
            )
        );
        let p = rank(&chain(&["r", "cd"]), &views, &BTreeSet::new(), 0.85, false);
        assert!(p.order.is_empty());
        assert_eq!(p.soonest_cooldown(), Some(Duration::from_secs(3)));
    }
}
