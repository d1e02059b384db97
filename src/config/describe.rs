//! The human summary `autohedge check-config` prints.

use super::*;

/// A printable summary for `check-config`: chains, endpoints and key *sources*, never values.
pub fn describe(cfg: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "listen: {}", cfg.listen);
    let _ = writeln!(
        out,
        "server: max_concurrent_requests={} allowed_hosts={}",
        match cfg.max_concurrent_requests {
            0 => "unlimited".to_string(),
            n => n.to_string(),
        },
        match &cfg.allowed_hosts {
            Some(h) => h.join(","),
            None => "default (on a loopback listen: localhost and IP literals)".into(),
        }
    );
    let _ = writeln!(
        out,
        "audit: {}",
        match &cfg.audit_pg {
            Some(pg) => format!("postgres {} (pool {})", pg.display, pg.pool),
            None => "sqlite in the data dir".to_string(),
        }
    );
    let _ = writeln!(
        out,
        "responses: history={} ttl={:?} max_bytes={}",
        if cfg.responses.keep_history {
            "keep"
        } else {
            "off"
        },
        cfg.responses.history_ttl,
        cfg.responses.history_max_bytes
    );
    let _ = writeln!(out, "fallback_chain: {}", cfg.fallback_chain.join(" -> "));
    for (name, chain) in &cfg.routes {
        let mut extra = String::new();
        if let Some(h) = cfg.route_hedge.get(name) {
            extra.push_str(&format!(" [{}]", hedge_text(h)));
        }
        if cfg.route_continue.contains(name) {
            extra.push_str(" [continue_streams]");
        }
        let _ = writeln!(out, "route {name}: {}{extra}", chain.join(" -> "));
    }
    for (name, l) in &cfg.last_resort {
        let _ = writeln!(
            out,
            "last_resort {name}: ttl={:?} max_bytes={} max_bytes_per_key={} shared={}",
            l.ttl, l.max_bytes, l.max_bytes_per_key, l.shared
        );
    }
    let _ = writeln!(
        out,
        "policy: success_threshold={} window={:?} min_samples={} max_wait={:?} cache_ttl={:?} default_cooldown={:?}",
        cfg.policy.success_threshold,
        cfg.policy.window,
        cfg.policy.min_samples,
        cfg.policy.max_wait,
        cfg.policy.cache_ttl,
        cfg.policy.default_cooldown
    );
    let _ = writeln!(
        out,
        "tail: slow_start={:?} predict_rate_limits={}",
        cfg.policy.slow_start, cfg.policy.predict_rate_limits
    );
    if let Some(a) = &cfg.alerts {
        let _ = writeln!(
            out,
            "alerts: {} webhook(s) [{}] events [{}] all_failed > {} in {:?}, repeat {:?}",
            a.webhooks.len(),
            a.webhooks
                .iter()
                .map(|w| format!("{} {:?}", w.label, w.format).to_lowercase())
                .collect::<Vec<_>>()
                .join(", "),
            a.events
                .iter()
                .map(|e| e.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            a.all_failed_count,
            a.all_failed_window,
            a.repeat
        );
    }
    let _ = writeln!(out, "endpoints:");
    for ep in cfg.endpoints.values() {
        let caps: Vec<String> = ep
            .capabilities
            .iter()
            .map(|c| format!("{c:?}").to_lowercase())
            .collect();
        let _ = writeln!(
            out,
            "  {}: type={} url={} model={} context_window={} timeouts(connect={:?}, first_token={:?}, total={:?}) retries={} capabilities=[{}]",
            ep.name,
            ep.kind,
            ep.base_url,
            ep.upstream_model,
            ep.context_window
                .map(|c| c.to_string())
                .unwrap_or_else(|| "unknown".into()),
            ep.timeouts.connect,
            ep.timeouts.first_token,
            ep.timeouts.total,
            ep.retries,
            caps.join(",")
        );
        if let Some(h) = &ep.hedge {
            let _ = writeln!(out, "    {}", hedge_text(h));
        }
        if ep.keys.is_empty() {
            let _ = writeln!(out, "    keys: none");
        }
        for (i, k) in ep.keys.iter().enumerate() {
            let state = match &k.problem {
                None => "ok".to_string(),
                Some(p) => format!("UNRESOLVED: {p}"),
            };
            let _ = writeln!(out, "    key #{}: {} ({state})", i + 1, k.source);
        }
    }
    for w in &cfg.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

fn hedge_text(h: &crate::routing::hedge::Spec) -> String {
    let after = match h.after {
        crate::routing::hedge::After::Fixed(d) => format!("{d:?}"),
        crate::routing::hedge::After::Percentile(p) => format!("p{p}"),
    };
    format!(
        "hedge after {after} (min {:?}), at most {}% extra{}",
        h.min_after,
        h.max_extra * 100.0,
        if h.tools { ", tools too" } else { "" }
    )
}
