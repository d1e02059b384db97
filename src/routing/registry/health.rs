//! The registry's side of health: probe results fed to each endpoint's state machine, the
//! transitions it makes (a recovery starts slow start), and what it says now.

use tokio::time::Instant;

use super::{Registry, lock};

impl Registry {
    pub fn set_probe(&self, endpoint: &str, report: crate::routing::observed::ProbeReport) {
        if let Some(rt) = self.get(endpoint) {
            lock(&rt).probe = Some(report);
        }
    }

    pub(super) fn transition(&self, endpoint: &str, tr: &crate::routing::health::Transition) {
        // Warming serves (at a rising share): coming out of it starts no slow start again.
        let serving = |s: &str| matches!(s, "healthy" | "degraded" | "warming");
        if serving(tr.to)
            && !serving(tr.from)
            && let Some(rt) = self.get(endpoint)
        {
            let mut rt = lock(&rt);
            if rt.been_serving {
                rt.recovered_at = Some(Instant::now());
            }
            rt.been_serving = true;
        }
        self.event(
            endpoint,
            &format!("health:{}->{}", tr.from, tr.to),
            &tr.reason,
        );
        if tr.to == "ejected" {
            self.ejections.notify_waiters();
        }
    }

    /// Resolves when an endpoint is next ejected (the prober's wait for it).
    pub async fn ejected(&self) {
        self.ejections.notified().await
    }

    /// Feeds an active probe's result to the health state machine.
    pub fn observe_probe(
        &self,
        endpoint: &str,
        result: &crate::routing::health::ProbeResult,
        t: &crate::routing::health::Thresholds,
    ) {
        let Some(rt) = self.get(endpoint) else {
            return;
        };
        let tr = lock(&rt).health.observe_probe(Instant::now(), result, t);
        if let Some(tr) = tr {
            self.transition(endpoint, &tr);
        }
    }

    pub fn health_reason(&self, endpoint: &str) -> Option<String> {
        self.with(endpoint, |rt| rt.health.reason().to_string())
    }

    /// What probes of the endpoint's current addresses say against it, if anything.
    pub fn probe_unhealthy(&self, endpoint: &str) -> Option<String> {
        self.with(endpoint, |rt| {
            rt.health.probe_unhealthy().map(str::to_string)
        })
        .flatten()
    }

    pub fn is_ejected(&self, endpoint: &str) -> bool {
        self.with(endpoint, |rt| rt.health.is_ejected())
            .unwrap_or(false)
    }
}
