//! The registry kept in line with the config (new endpoints seeded from persisted stats,
//! redefined ones started afresh), and the stats rows it persists.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::memo::next_generation;
use super::{EndpointRuntime, LearnedWindow, Registry, Retirement, lock};
use crate::config::Config;
use crate::routing::stats::Ewma;
use crate::store::PersistedStats;

impl Registry {
    /// Brings the registry in line with a new config: new endpoints get fresh state, removed
    /// ones are dropped, and kept ones keep their stats. A retirement or auth failure made under
    /// a different endpoint definition is lifted: the operator changed what the endpoint is.
    pub fn sync(&self, cfg: &Config, persisted: &[PersistedStats]) {
        let now = Instant::now();
        let Ok(mut map) = self.map.write() else {
            return;
        };
        // What any thread remembers of the map before this sync is not given again.
        self.generation.store(next_generation(), Ordering::Release);
        map.retain(|name, _| cfg.endpoints.contains_key(name));
        for (name, ep) in &cfg.endpoints {
            let fresh = |persisted: &[PersistedStats]| {
                let mut rt = EndpointRuntime::new(&cfg.policy, &ep.fingerprint);
                if ep.discover {
                    rt.health
                        .observe_docker(now, Some("not discovered yet".into()));
                    rt.been_serving = false;
                }
                if let Some(p) = persisted.iter().find(|p| &p.endpoint == name) {
                    rt.latency = Ewma::seeded(0.2, p.ewma_latency_ms);
                    rt.requests = p.requests;
                    rt.successes = p.successes;
                    rt.failures = p.failures;
                    // Only what was learned from the server this definition names.
                    if p.learned_window_fingerprint.as_deref() == Some(ep.fingerprint.as_str()) {
                        rt.learned_window = p.learned_context_window.map(|tokens| LearnedWindow {
                            tokens,
                            request_id: p.learned_window_request.clone().unwrap_or_default(),
                        });
                    }
                    if let Some(reason) = &p.retired_reason {
                        if p.retired_fingerprint.as_deref() == Some(ep.fingerprint.as_str()) {
                            rt.retired = Some(Retirement {
                                reason: reason.clone(),
                                fingerprint: ep.fingerprint.clone(),
                            });
                        } else {
                            // Retired under another definition, changed while we were down.
                            self.event(
                                name,
                                "unretired",
                                "endpoint definition changed in the config",
                            );
                            self.store.send_flag(name, None, None);
                        }
                    }
                }
                rt
            };
            let entry = map
                .entry(name.clone())
                .or_insert_with(|| Arc::new(Mutex::new(fresh(persisted))));
            let mut rt = lock(entry);
            rt.window.resize(cfg.policy.window, now);
            if !ep.addresses.is_empty() {
                rt.addresses
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .update(&ep.addresses, now, &super::tuning(cfg, ep));
            }
            if rt.fingerprint != ep.fingerprint {
                // Another server (type, base URL, model, or discovered ↔ static) under the same
                // name: nothing learned about the old one — its window, cooldown, health,
                // ejection, retirement, rejected keys, Docker's word — is true of this one.
                let old = std::mem::replace(&mut *rt, fresh(&[]));
                drop(rt);
                if old.learned_window.is_some() {
                    self.store.send(crate::store::Record::LearnedWindow {
                        endpoint: name.clone(),
                        learned: None,
                    });
                }
                if old.retired.is_some() {
                    self.store.send_flag(name, None, None);
                }
                self.event(
                    name,
                    "redefined",
                    "endpoint definition changed in the config: its learned state starts afresh",
                );
                continue;
            }
            // A rejection stays with the value it was made against: a key whose value was
            // replaced (file rewritten, env var changed, literal edited) starts afresh.
            rt.dead_keys
                .retain(|h| ep.keys.iter().any(|k| k.value.is_some() && &k.hash == h));
            let usable = ep
                .keys
                .iter()
                .any(|k| k.value.is_some() && !rt.dead_keys.contains(&k.hash));
            if rt.auth_failed.is_some() && usable {
                rt.auth_failed = None;
                self.event(name, "auth_cleared", "a rejected key's value was replaced");
            }
        }
    }

    /// Rows for the periodic stats snapshot in SQLite.
    pub fn snapshot(&self) -> Vec<PersistedStats> {
        let Ok(map) = self.map.read() else {
            return vec![];
        };
        map.iter()
            .map(|(name, rt)| {
                let rt = lock(rt);
                PersistedStats {
                    endpoint: name.clone(),
                    requests: rt.requests,
                    successes: rt.successes,
                    failures: rt.failures,
                    ewma_latency_ms: rt.latency.get(),
                    retired_reason: rt.retired.as_ref().map(|r| r.reason.clone()),
                    retired_fingerprint: rt.retired.as_ref().map(|r| r.fingerprint.clone()),
                    learned_context_window: rt.learned_window.as_ref().map(|l| l.tokens),
                    learned_window_request: rt
                        .learned_window
                        .as_ref()
                        .map(|l| l.request_id.clone()),
                    learned_window_fingerprint: rt
                        .learned_window
                        .as_ref()
                        .map(|_| rt.fingerprint.clone()),
                }
            })
            .collect()
    }
}
