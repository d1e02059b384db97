//! Pure ranking: given a chain and each endpoint's current view, which endpoints to try and in
//! what order, and why the others were skipped. No I/O, no clock: the caller passes the views.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::config::{Capability, Caps};
use crate::outcome::Outcome;
use crate::registry::Avail;

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

/// Envoy's healthy-panic rule: true when fewer than `threshold` of the chain's endpoints are
/// available by health state (unhealthy, ejected, half-open and warming count as unavailable).
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
pub fn rank(
    chain: &[String],
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
    let mut demoted = Vec::new();
    for name in chain {
        let Some(v) = views.iter().find(|v| &v.name == name) else {
            continue;
        };
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
                } else {
                    healthy.push(name.clone());
                }
            }
        }
    }
    plan.order = healthy;
    plan.order.extend(demoted.iter().cloned());
    plan.demoted = demoted;
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
