//! Where discovery says an endpoint runs: Docker's view taken in, a dead task's address dropped,
//! and the address a request goes to (`discovered_base`).

use tokio::time::Instant;

use super::{Registry, lock};
use crate::routing::stats::RollingWindow;

impl Registry {
    /// Docker's view of an endpoint: where it runs, and whether it is down.
    pub fn observe_docker(&self, endpoint: &str, d: Option<crate::routing::observed::Discovered>) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let now = Instant::now();
        let (fresh, tr) = {
            let mut rt = lock(&rt);
            let down = d.as_ref().and_then(|d| d.down.clone());
            let addrs = |d: &Option<crate::routing::observed::Discovered>| {
                let mut a = d.as_ref().map(|d| d.addresses.clone()).unwrap_or_default();
                a.sort();
                a
            };
            let new = addrs(&d);
            // Evidence is about addresses: a replacement task must not inherit the dead one's
            // ejection or probe verdict (compared with the last non-empty set, so a gap with no
            // task in between still counts as a replacement).
            let fresh =
                if !new.is_empty() && !rt.last_addresses.is_empty() && rt.last_addresses != new {
                    // Nor its success rate: the failures of a killed or sick task would keep
                    // the healthy replacement demoted behind the others, and a demoted endpoint
                    // gets no traffic to prove itself with, for the whole window.
                    rt.window = RollingWindow::new(rt.window.window());
                    rt.health.new_addresses(now)
                } else {
                    None
                };
            // The balancer's view: the tasks running now, each keeping its load and ejection.
            rt.addresses
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .update(&new, now, &crate::routing::balance::Tuning::default());
            if !new.is_empty() {
                rt.last_addresses = new;
            }
            rt.discovered = d;
            (fresh, rt.health.observe_docker(now, down))
        };
        for tr in [fresh, tr].into_iter().flatten() {
            self.transition(endpoint, &tr);
        }
    }

    /// A discovered address whose container just died: out of the pool at once. With none left
    /// the endpoint is down (Docker's view) until a scan finds a running task again.
    pub fn drop_address(&self, endpoint: &str, address: &str, why: &str) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let tr = {
            let mut guard = lock(&rt);
            // Its fields borrowed apart (the discovered tasks and the balancer's list).
            let rt = &mut *guard;
            let Some(d) = rt.discovered.as_mut() else {
                return;
            };
            let before = d.addresses.len();
            d.addresses.retain(|a| a != address);
            if d.addresses.len() == before {
                return;
            }
            d.running = d.running.saturating_sub(1);
            let left = d.addresses.clone();
            rt.addresses
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .update(
                    &left,
                    Instant::now(),
                    &crate::routing::balance::Tuning::default(),
                );
            if d.addresses.is_empty() {
                d.down = Some(why.to_string());
                rt.health
                    .observe_docker(Instant::now(), Some(why.to_string()))
            } else {
                None
            }
        };
        tracing::info!(endpoint, address, why, "discovered address dropped");
        if let Some(tr) = tr {
            self.transition(endpoint, &tr);
        }
    }

    /// The address discovery found for the endpoint (round-robin over running tasks).
    /// Every endpoint discovery backs now, with what it found (`/status.docker`), by name.
    pub fn discovered_all(&self) -> Vec<(String, crate::routing::observed::Discovered)> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = map
            .iter()
            .filter_map(|(name, rt)| Some((name.clone(), lock(rt).discovered.clone()?)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    pub fn discovered_base(&self, endpoint: &str) -> Option<String> {
        let rt = self.get(endpoint)?;
        let rt = lock(&rt);
        let d = rt.discovered.as_ref()?;
        if d.addresses.is_empty() {
            return None;
        }
        let i = fastrand::usize(..d.addresses.len());
        Some(d.addresses[i].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::routing::observed::Discovered;
    use crate::routing::registry::{Avail, Effect};
    use crate::store::StoreHandle;

    fn found(addr: &str, down: Option<&str>) -> Option<Discovered> {
        Some(Discovered {
            service: "svc".into(),
            addresses: if down.is_some() {
                vec![]
            } else {
                vec![addr.to_string()]
            },
            running: usize::from(down.is_none()),
            restarts: 0,
            down: down.map(str::to_string),
        })
    }

    #[tokio::test]
    async fn a_first_discovery_is_no_recovery_but_coming_back_is() {
        let cfg = Config::load(
            "models:\n  d: { type: vllm, discover: docker }\n  s: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\nrouting_policy: { slow_start: 30s }\ndocker: { enabled: true }\n",
        )
        .unwrap();
        let reg = Registry::new(StoreHandle::off("test".into()));
        reg.sync(&cfg, &[]);
        let share = |name: &str| reg.views(&cfg, &[name.to_string()])[0].slow_start;
        // Discovered for the first time (the gateway just started): its full share at once.
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        assert_eq!(reg.views(&cfg, &["d".into()])[0].avail, Avail::Ready);
        assert_eq!(share("d"), None);
        assert_eq!(
            share("s"),
            None,
            "an endpoint configured healthy is no recovery either"
        );
        // Its task dies and a new one comes up: that is a recovery, slow-started.
        reg.observe_docker("d", found("", Some("no running task")));
        assert!(matches!(
            reg.views(&cfg, &["d".into()])[0].avail,
            Avail::Unhealthy { .. }
        ));
        reg.observe_docker("d", found("http://10.0.0.6:8000", None));
        assert_eq!(share("d"), Some(crate::routing::router::SLOW_START_MIN));
    }

    #[tokio::test]
    async fn a_replacement_task_does_not_inherit_the_old_ones_success_rate() {
        let cfg = Config::load(
            "models:
  d: { type: vllm, discover: docker }
routing_policy: { min_samples: 2 }
docker: { enabled: true }
",
        )
        .unwrap();
        let reg = Registry::new(StoreHandle::off("test".into()));
        reg.sync(&cfg, &[]);
        let ep = cfg.endpoints["d"].clone();
        let rate = || reg.views(&cfg, &["d".into()])[0].success_rate;
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        for _ in 0..3 {
            reg.apply(
                &ep,
                &cfg.policy,
                Effect::Failure {
                    class: crate::routing::outcome::Outcome::Connection,
                    detail: "reset".into(),
                    who: crate::routing::blame::Witness::Sure,
                },
            );
        }
        assert_eq!(rate(), Some(0.0), "the old task failed");
        // The same address seen again: the same task, the same record.
        reg.observe_docker("d", found("http://10.0.0.5:8000", None));
        assert_eq!(rate(), Some(0.0));
        // A replacement at another address starts with no record.
        reg.observe_docker("d", found("http://10.0.0.9:8000", None));
        assert_eq!(rate(), None);
    }
}
