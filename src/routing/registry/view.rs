//! What the router reads of the endpoints: their views (with slow start's draw), the chains in
//! healthy panic, the ranked plan for `/status`, and recent latencies for hedge delays.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::{Registry, lock};
use crate::config::Config;

/// The per-request draw slow start compares with its share. A debug build whose environment
/// sets `AUTOHEDGE_TEST_SEED` draws from one seeded sequence instead (splitmix64 over a shared
/// counter), so a test of the share is reproducible rather than failing one run in hundreds.
fn roll() -> f64 {
    #[cfg(debug_assertions)]
    {
        static SEEDED: std::sync::LazyLock<Option<std::sync::atomic::AtomicU64>> =
            std::sync::LazyLock::new(|| {
                std::env::var("AUTOHEDGE_TEST_SEED")
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(std::sync::atomic::AtomicU64::new)
            });
        if let Some(state) = SEEDED.as_ref() {
            let mut z = state
                .fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed)
                .wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            return (z >> 11) as f64 / (1u64 << 53) as f64;
        }
    }
    fastrand::f64()
}

/// How stale the sorted latencies behind a hedge's percentile delay may be.
const SORTED_TTL: Duration = Duration::from_millis(250);

impl Registry {
    /// The endpoint's recent latency at percentile `p` (`None` with too few samples).
    pub fn latency_percentile(&self, endpoint: &str, p: f64) -> Option<Duration> {
        let rt = self.get(endpoint)?;
        let now = Instant::now();
        let sorted = {
            let mut rt = lock(&rt);
            match &rt.sorted {
                Some((at, v)) if now.saturating_duration_since(*at) < SORTED_TTL => v.clone(),
                _ => {
                    let v = Arc::new(rt.samples.sorted());
                    rt.sorted = Some((now, v.clone()));
                    v
                }
            }
        };
        if sorted.len() < crate::routing::hedge::MIN_SAMPLES {
            return None;
        }
        let ms = crate::routing::stats::percentile_sorted(&sorted, p)?;
        // Our own measurements, but no float reaches a panicking conversion: `as` saturates.
        (ms.is_finite() && ms >= 0.0).then(|| Duration::from_micros((ms * 1000.0) as u64))
    }

    /// What the router needs to know about `names`, now.
    pub fn views(&self, cfg: &Config, names: &[String]) -> Vec<crate::routing::router::View> {
        let now = Instant::now();
        names
            .iter()
            .filter_map(|n| {
                let ep = cfg.endpoints.get(n)?;
                let (avail, rate, dead, slow_start) = self.with(n, |rt| {
                    let usable = ep.keys.is_empty() || ep.keys.iter().any(|k| k.value.is_some());
                    (
                        rt.avail(now),
                        rt.counts(now).routing_rate(cfg.policy.min_samples),
                        !usable,
                        rt.slow_start(now, cfg.policy.slow_start, cfg.policy.health.warmup),
                    )
                })?;
                Some(crate::routing::router::View {
                    name: n.clone(),
                    avail,
                    success_rate: rate,
                    capabilities: ep.caps,
                    no_usable_key: dead,
                    slow_start,
                    roll: if slow_start.is_some() { roll() } else { 0.0 },
                })
            })
            .collect()
    }

    /// The chains (routes by name, and `fallback_chain`) in healthy panic right now.
    pub fn chains_in_panic(&self, cfg: &Config) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, chain: &[String]| {
            if crate::routing::router::in_panic(&self.views(cfg, chain), cfg.policy.panic_threshold)
            {
                out.push(name.to_string());
            }
        };
        check("fallback_chain", &cfg.fallback_chain);
        for (name, chain) in &cfg.routes {
            check(name, chain);
        }
        out
    }

    /// Each chain as the router would try it now (a request with no special needs): the
    /// order, and what it would skip and why. For `/status` and the live page.
    pub fn ranked(&self, cfg: &Config) -> Value {
        let plan = |chain: &[String]| {
            let views = self.views(cfg, chain);
            let panic = crate::routing::router::in_panic(&views, cfg.policy.panic_threshold);
            let p = crate::routing::router::rank(
                chain,
                &views,
                &Default::default(),
                cfg.policy.success_threshold,
                panic,
            );
            json!({
                "order": p.order,
                "skipped": p.skipped.iter().map(|(n, s)| json!({"endpoint": n, "reason": s.class().as_str()})).collect::<Vec<_>>(),
                "panic": panic,
            })
        };
        let mut out = serde_json::Map::new();
        out.insert("fallback_chain".into(), plan(&cfg.fallback_chain));
        for (name, chain) in &cfg.routes {
            out.insert(name.clone(), plan(chain));
        }
        Value::Object(out)
    }
}
