//! `autohedge report`: the daily failure report, from the audit trail — totals, what failed and
//! why (with example request ids), what failing over cost, each endpoint's reliability,
//! retirements, key failures and cooldowns, and what to do about it, derived by the rules in
//! `RULES` (each stated in the report beside what it found). Markdown, or HTML with inline SVG
//! charts (no script, no external asset).
//!
//! One read-only connection a trail (several replicas' data dirs merge into one report) and
//! three sequential scans of each (requests by time index, attempts by their request-row index,
//! events), aggregated in memory in one pass each: a million requests take a few seconds
//! (`benches/report.rs`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::Connection;

use crate::routing::stats::percentile_sorted;

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Md,
    Html,
}

/// The most buckets a chart has (about): the data's span is split into the narrowest round
/// width ([`STEPS`]) that keeps it under this — a ten-minute run in minutes, a day in 2 hours.
const MAX_BUCKETS: u64 = 16;

/// The widths a chart's buckets may have, in seconds: round ones, so that a ten-minute run reads
/// in minutes and a day in hours.
const STEPS: &[u64] = &[
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
];

/// How the charts split time: `n` buckets of `width_ms` from `from_ms`, covering the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buckets {
    pub from_ms: i64,
    pub width_ms: i64,
    pub n: usize,
}

impl Buckets {
    /// Buckets over the data's span (`first..=last`, in ms): the narrowest round width that
    /// fits it in [`MAX_BUCKETS`], starting at a multiple of the width. Without data, the
    /// period's (`from..=to`).
    pub fn sized(data: Option<(i64, i64)>, from: i64, to: i64) -> Buckets {
        let (first, last) = data.unwrap_or((from, to));
        let (first, last) = (first.min(last), first.max(last));
        let span = u64::try_from(last.saturating_sub(first)).unwrap_or(0);
        let width_ms = STEPS
            .iter()
            .map(|s| s * 1000)
            .find(|w| span / w < MAX_BUCKETS)
            .unwrap_or_else(|| span.div_ceil(MAX_BUCKETS).max(1));
        let width_ms = i64::try_from(width_ms).unwrap_or(i64::MAX);
        let from_ms = first.saturating_sub(first.rem_euclid(width_ms));
        let n = usize::try_from(last.saturating_sub(from_ms) / width_ms)
            .unwrap_or(0)
            .saturating_add(1);
        Buckets {
            from_ms,
            width_ms,
            n: n.clamp(1, MAX_BUCKETS as usize + 1),
        }
    }

    /// The bucket `ts` (ms) falls in, clamped to the chart.
    pub fn of(&self, ts: i64) -> usize {
        let i = ts.saturating_sub(self.from_ms).max(0) / self.width_ms.max(1);
        usize::try_from(i).unwrap_or(usize::MAX).min(self.n - 1)
    }

    /// The width as people say it: `10 s`, `1 min`, `2 h`.
    pub fn width_text(&self) -> String {
        let s = self.width_ms / 1000;
        if s >= 3600 && s % 3600 == 0 {
            format!("{} h", s / 3600)
        } else if s >= 60 && s % 60 == 0 {
            format!("{} min", s / 60)
        } else {
            format!("{s} s")
        }
    }
}
/// Example request ids kept per failure cause.
const EXAMPLES: usize = 3;

/// The rules recommendations come from, as the report states them.
pub const RULES: &[&str] = &[
    "an endpoint that answered 429 to 5 % or more of its calls (20 calls at least): raise its limit or move it down the chain",
    "a key rejected (401/403) at least once: rotate it",
    "an endpoint retired (410 Gone, model removed): replace its model or take it out of the chains",
    "an endpoint that timed out on 5 % or more of its calls (20 at least): lower its first_token/connect timeouts or move it down",
    "an endpoint failing with 5xx or connection errors on 10 % or more of its calls (20 at least): check the backend",
    "1 % or more of the requests did not fit a context window: on_context_overflow: truncate, or a larger-window endpoint",
    "any request that no endpoint could serve (503): add an endpoint of another provider to the chain",
    "requests that failed over with a p95 latency over twice that of the others (10 failovers at least): detect the failure sooner",
    "an endpoint cooled down 10 times or more: its rate limit is too low for its place in the chain",
];

#[derive(Default, Debug)]
pub struct EndpointFigures {
    pub calls: u64,
    pub ok: u64,
    pub rate_limited: u64,
    pub timeouts: u64,
    pub server_errors: u64,
    pub context: u64,
    pub served: u64,
    /// Requests it served after another endpoint failed.
    pub landed: u64,
    pub retirements: Vec<String>,
    pub key_failures: u64,
    pub cooldowns: u64,
    pub health_changes: u64,
    /// Per bucket: calls and failed calls.
    pub series: Vec<(u64, u64)>,
}

#[derive(Default, Debug)]
pub struct Cause {
    pub count: u64,
    pub examples: Vec<String>,
}

#[derive(Debug)]
pub struct Report {
    pub since: SystemTime,
    pub until: SystemTime,
    pub requests: u64,
    pub ok: u64,
    pub client_errors: u64,
    pub failed: u64,
    /// Requests answered 503 because nothing could serve them.
    pub unavailable: u64,
    pub context_requests: u64,
    /// Failure causes over called attempts (class → count and examples).
    pub causes: BTreeMap<String, Cause>,
    pub failed_attempts: u64,
    /// Latencies (ms) of served requests that failed over, and of the others.
    pub failover_latency: (Option<f64>, Option<f64>, u64),
    pub direct_latency: (Option<f64>, Option<f64>, u64),
    pub endpoints: BTreeMap<String, EndpointFigures>,
    /// Per bucket: p50, p95, p99 of served requests' latency (ms).
    pub latency_series: Vec<[Option<f64>; 3]>,
    /// How the series split time.
    pub buckets: Buckets,
    pub recommendations: Vec<String>,
}

/// Reads the trails of `data_dirs` (one a replica) since `since` and builds one report from
/// them all.
pub fn build(data_dirs: &[PathBuf], since: SystemTime) -> anyhow::Result<Report> {
    let trails: Vec<Connection> = crate::store::open_trails(data_dirs)?
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    from_conns(&trails, since, SystemTime::now())
}

fn ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The report from one trail.
pub fn from_conn(
    conn: &Connection,
    since: SystemTime,
    until: SystemTime,
) -> anyhow::Result<Report> {
    from_conns(std::slice::from_ref(conn), since, until)
}

/// The report from several trails (one a replica): each read on its own (its request rows are
/// its own), the figures summed and the percentiles taken over all latencies together.
pub fn from_conns(
    trails: &[Connection],
    since: SystemTime,
    until: SystemTime,
) -> anyhow::Result<Report> {
    let (from_ms, to_ms) = (ms(since), ms(until).max(ms(since) + 1));
    // The charts cover the data, not the whole period: a ten-minute run in a day's report is
    // drawn over its ten minutes.
    let mut span: Option<(i64, i64)> = None;
    for conn in trails {
        let (a, b): (Option<i64>, Option<i64>) =
            conn.query_row(crate::store::sql::REQUESTS_SPAN, [from_ms, to_ms], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
        if let (Some(a), Some(b)) = (a, b) {
            span = Some(span.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
        }
    }
    let buckets = Buckets::sized(span, from_ms, to_ms);
    let bucket_of = |ts: i64| buckets.of(ts);
    let mut endpoints: BTreeMap<String, EndpointFigures> = BTreeMap::new();

    // Attempts, by request row (the index's order): which requests failed over, causes, and
    // each endpoint's calls.
    let mut causes: BTreeMap<String, Cause> = BTreeMap::new();
    let mut failed_attempts = 0u64;
    // Rows of requests that had a failed call before the end (by trail, then row).
    let mut failed_over: std::collections::HashSet<(usize, i64)> = Default::default();
    for (trail, conn) in trails.iter().enumerate() {
        let first: i64 =
            conn.query_row(crate::store::sql::FIRST_ROW_SINCE, [from_ms], |r| r.get(0))?;
        let mut stmt = conn.prepare(crate::store::sql::ATTEMPTS_FROM_ROW)?;
        let mut rows = stmt.query([first])?;
        while let Some(r) = rows.next()? {
            let row: i64 = r.get(0)?;
            let ts: i64 = r.get(2)?;
            if ts < from_ms {
                continue;
            }
            let class_ref = r.get_ref(4)?;
            let class = class_ref.as_str().unwrap_or("");
            let skip = class.starts_with("skipped_")
                || class == "context_skip"
                || class == "hedge_cancelled";
            let e = entry(
                &mut endpoints,
                r.get_ref(3)?.as_str().unwrap_or(""),
                buckets.n,
            );
            if matches!(class, "context_length" | "context_skip") {
                e.context += 1;
            }
            if skip {
                continue;
            }
            e.calls += 1;
            let b = bucket_of(ts);
            e.series[b].0 += 1;
            if class == "ok" {
                e.ok += 1;
                continue;
            }
            e.series[b].1 += 1;
            match class {
                "rate_limited" => e.rate_limited += 1,
                "timeout" | "first_token_timeout" | "stream_stalled" | "stream_timeout" => {
                    e.timeouts += 1
                }
                "server_error" | "connect_error" | "connection_error" | "malformed"
                | "stream_broken" | "stream_truncated" | "in_band_error" => e.server_errors += 1,
                _ => {}
            }
            // The client's own error or the client leaving is no failure of an endpoint.
            if matches!(class, "client_error" | "client_closed") {
                continue;
            }
            failed_attempts += 1;
            failed_over.insert((trail, row));
            let c = causes.entry(class.to_string()).or_default();
            c.count += 1;
            if c.examples.len() < EXAMPLES {
                let id: String = r.get(1)?;
                if !c.examples.contains(&id) {
                    c.examples.push(id);
                }
            }
        }
    }

    // Requests, by time.
    let (
        mut requests,
        mut ok,
        mut client_errors,
        mut failed,
        mut unavailable,
        mut context_requests,
    ) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut over_lat: Vec<f64> = Vec::new();
    let mut direct_lat: Vec<f64> = Vec::new();
    let mut per_bucket: Vec<Vec<f32>> = vec![Vec::new(); buckets.n];
    for (trail, conn) in trails.iter().enumerate() {
        let mut stmt = conn.prepare(crate::store::sql::REQUESTS_BETWEEN)?;
        let mut rows = stmt.query([from_ms, to_ms])?;
        while let Some(r) = rows.next()? {
            let id: i64 = r.get(0)?;
            let ts: i64 = r.get(1)?;
            let status: i64 = r.get(3)?;
            let latency: f64 = r.get(5)?;
            requests += 1;
            let class = r.get_ref(4)?.as_str().ok();
            if matches!(class, Some(c) if c.starts_with("context")) {
                context_requests += 1;
            }
            match status {
                200..=399 => {
                    ok += 1;
                    let endpoint = r.get_ref(2)?.as_str().unwrap_or("");
                    let over = failed_over.contains(&(trail, id));
                    if !endpoint.is_empty() {
                        let e = entry(&mut endpoints, endpoint, buckets.n);
                        e.served += 1;
                        if over {
                            e.landed += 1;
                        }
                    }
                    if over {
                        over_lat.push(latency);
                    } else {
                        direct_lat.push(latency);
                    }
                    per_bucket[bucket_of(ts)].push(latency as f32);
                }
                503 => {
                    failed += 1;
                    unavailable += 1;
                }
                s if s >= 500 || s == 429 => failed += 1,
                _ => client_errors += 1,
            }
        }
    }
    let pcts = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (
            percentile_sorted(&v, 50.0),
            percentile_sorted(&v, 95.0),
            v.len() as u64,
        )
    };
    let latency_series = per_bucket
        .into_iter()
        .map(|mut v| {
            v.sort_by(f32::total_cmp);
            let p = |q: f64| -> Option<f64> {
                if v.is_empty() {
                    return None;
                }
                let i = ((q / 100.0) * (v.len() - 1) as f64).round() as usize;
                v.get(i).map(|x| *x as f64)
            };
            [p(50.0), p(95.0), p(99.0)]
        })
        .collect();

    // Endpoint events.
    for conn in trails {
        let mut stmt = conn.prepare(crate::store::sql::EVENTS_BETWEEN)?;
        let mut rows = stmt.query([from_ms, to_ms])?;
        while let Some(r) = rows.next()? {
            let endpoint: String = r.get(0)?;
            let event: String = r.get(1)?;
            let e = entry(&mut endpoints, &endpoint, buckets.n);
            match event.as_str() {
                "retired" => {
                    let reason: String = r.get(2)?;
                    e.retirements.push(reason.chars().take(200).collect());
                }
                "key_rejected" | "auth_failed" => e.key_failures += 1,
                "cooldown" => e.cooldowns += 1,
                ev if ev.starts_with("health:") => e.health_changes += 1,
                _ => {}
            }
        }
    }

    let mut report = Report {
        since,
        until,
        requests,
        ok,
        client_errors,
        failed,
        unavailable,
        context_requests,
        causes,
        failed_attempts,
        failover_latency: pcts(over_lat),
        direct_latency: pcts(direct_lat),
        endpoints,
        latency_series,
        buckets,
        recommendations: Vec::new(),
    };
    report.recommendations = recommend(&report);
    Ok(report)
}

fn entry<'a>(
    map: &'a mut BTreeMap<String, EndpointFigures>,
    name: &str,
    buckets: usize,
) -> &'a mut EndpointFigures {
    map.entry(name.to_string())
        .or_insert_with(|| EndpointFigures {
            series: vec![(0, 0); buckets],
            ..Default::default()
        })
}

fn pct(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 * 100.0 / of as f64
    }
}

/// The recommendations `RULES` derive from the figures, most pressing first.
pub fn recommend(r: &Report) -> Vec<String> {
    let mut out = Vec::new();
    if r.unavailable > 0 {
        out.push(format!(
            "{} requests ({:.1} %) failed on every endpoint (503): add an endpoint of another provider to the chain they use.",
            r.unavailable,
            pct(r.unavailable, r.requests)
        ));
    }
    for (name, e) in &r.endpoints {
        for reason in e.retirements.iter().take(1) {
            out.push(format!(
                "`{name}` was retired ({reason}): replace its model or take it out of the chains, then `autohedge endpoint clear {name}`."
            ));
        }
        if e.key_failures > 0 {
            out.push(format!(
                "A key of `{name}` was rejected {} time{}: rotate it.",
                e.key_failures,
                if e.key_failures == 1 { "" } else { "s" }
            ));
        }
        if e.calls >= 20 && pct(e.rate_limited, e.calls) >= 5.0 {
            out.push(format!(
                "`{name}` answered 429 to {:.0} % of its calls ({} of {}): raise its rate limit or move it down the chain.",
                pct(e.rate_limited, e.calls),
                e.rate_limited,
                e.calls
            ));
        }
        if e.calls >= 20 && pct(e.timeouts, e.calls) >= 5.0 {
            out.push(format!(
                "`{name}` timed out on {:.0} % of its calls ({} of {}): lower its timeouts.first_token / connect so failover starts sooner, or move it down.",
                pct(e.timeouts, e.calls),
                e.timeouts,
                e.calls
            ));
        }
        if e.calls >= 20 && pct(e.server_errors, e.calls) >= 10.0 {
            out.push(format!(
                "`{name}` failed with 5xx or connection errors on {:.0} % of its calls ({} of {}): check the backend; each one costs a failover.",
                pct(e.server_errors, e.calls),
                e.server_errors,
                e.calls
            ));
        }
        if e.cooldowns >= 10 {
            out.push(format!(
                "`{name}` cooled down {} times: its rate limit is too low for its place in the chain.",
                e.cooldowns
            ));
        }
    }
    if r.requests > 0 && pct(r.context_requests, r.requests) >= 1.0 {
        out.push(format!(
            "{} requests ({:.1} %) did not fit a context window: set `on_context_overflow: truncate` on the route, or add an endpoint with a larger window.",
            r.context_requests,
            pct(r.context_requests, r.requests)
        ));
    }
    if let ((_, Some(over95), n), (_, Some(direct95), _)) = (r.failover_latency, r.direct_latency)
        && n >= 10
        && over95 > 2.0 * direct95
    {
        let worst = r
            .causes
            .iter()
            .max_by_key(|(_, c)| c.count)
            .map(|(k, _)| k.as_str())
            .unwrap_or("?");
        out.push(format!(
            "Requests that failed over took {over95:.0} ms at p95 against {direct95:.0} ms for the others: the most common cause is `{worst}` — detect it sooner (tighter connect/first_token timeouts, health probes) or put the endpoint that causes it lower."
        ));
    }
    out
}

fn when(t: SystemTime) -> String {
    httpdate::fmt_http_date(t)
}

fn opt_ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.0}")).unwrap_or_else(|| "—".into())
}

/// Markdown text: escapes what a table cell or emphasis would take as markup.
fn md(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

pub fn markdown(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# AutoHedge failure report\n");
    let _ = writeln!(o, "From {} to {}.\n", when(r.since), when(r.until));
    let _ = writeln!(o, "## Totals\n");
    let _ = writeln!(
        o,
        "| requests | served | client errors (4xx) | failed (5xx, 429) | of which nothing could serve (503) | success rate |"
    );
    let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        o,
        "| {} | {} | {} | {} | {} | {:.2} % |\n",
        r.requests,
        r.ok,
        r.client_errors,
        r.failed,
        r.unavailable,
        pct(r.ok, r.ok + r.failed)
    );
    let _ = writeln!(o, "## What to do\n");
    if r.recommendations.is_empty() {
        let _ = writeln!(o, "Nothing: no rule below fired.\n");
    }
    for rec in &r.recommendations {
        let _ = writeln!(o, "- {}", md(rec));
    }
    let _ = writeln!(o, "\n<details><summary>The rules</summary>\n");
    for rule in RULES {
        let _ = writeln!(o, "- {rule}");
    }
    let _ = writeln!(o, "\n</details>\n");
    let _ = writeln!(o, "## Top failure causes\n");
    if r.causes.is_empty() {
        let _ = writeln!(o, "No endpoint call failed.\n");
    } else {
        let _ = writeln!(
            o,
            "| cause | calls | share of failed calls | example request ids |"
        );
        let _ = writeln!(o, "|---|---:|---:|---|");
        for (class, c) in sorted_causes(r) {
            let _ = writeln!(
                o,
                "| `{}` | {} | {:.1} % | {} |",
                class,
                c.count,
                pct(c.count, r.failed_attempts),
                c.examples
                    .iter()
                    .map(|e| format!("`{}`", md(e)))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "## Failover performance\n");
    let _ = writeln!(o, "| served requests | count | p50 ms | p95 ms |");
    let _ = writeln!(o, "|---|---:|---:|---:|");
    let (a50, a95, an) = r.failover_latency;
    let (b50, b95, bn) = r.direct_latency;
    let _ = writeln!(
        o,
        "| after a failover | {an} | {} | {} |",
        opt_ms(a50),
        opt_ms(a95)
    );
    let _ = writeln!(
        o,
        "| first endpoint served | {bn} | {} | {} |\n",
        opt_ms(b50),
        opt_ms(b95)
    );
    let landed: Vec<String> = r
        .endpoints
        .iter()
        .filter(|(_, e)| e.landed > 0)
        .map(|(n, e)| format!("`{}` {}", md(n), e.landed))
        .collect();
    if !landed.is_empty() {
        let _ = writeln!(
            o,
            "Where failed-over requests landed: {}.\n",
            landed.join(", ")
        );
    }
    let _ = writeln!(o, "## Endpoints\n");
    let _ = writeln!(o, "| endpoint | {} |", ENDPOINT_COLUMNS.join(" | "));
    let _ = writeln!(o, "|---|{}", "---:|".repeat(ENDPOINT_COLUMNS.len()));
    for (name, e) in &r.endpoints {
        let _ = writeln!(o, "| `{}` | {} |", md(name), endpoint_cells(e).join(" | "));
    }
    o
}

/// The per-endpoint table's columns (after the name), and one endpoint's cells: one model for
/// the Markdown and the HTML table.
const ENDPOINT_COLUMNS: [&str; 11] = [
    "calls",
    "success",
    "429",
    "timeouts",
    "5xx/connection",
    "served",
    "landed after failover",
    "retirements",
    "key failures",
    "cooldowns",
    "health changes",
];

fn endpoint_cells(e: &EndpointFigures) -> [String; 11] {
    [
        e.calls.to_string(),
        if e.calls > 0 {
            format!("{:.1} %", pct(e.ok, e.calls))
        } else {
            "—".into()
        },
        e.rate_limited.to_string(),
        e.timeouts.to_string(),
        e.server_errors.to_string(),
        e.served.to_string(),
        e.landed.to_string(),
        e.retirements.len().to_string(),
        e.key_failures.to_string(),
        e.cooldowns.to_string(),
        e.health_changes.to_string(),
    ]
}

fn sorted_causes(r: &Report) -> Vec<(&String, &Cause)> {
    let mut v: Vec<_> = r.causes.iter().collect();
    v.sort_by(|a, b| b.1.count.cmp(&a.1.count).then(a.0.cmp(b.0)));
    v
}

/// HTML text.
fn h(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

const PALETTE: &[&str] = &[
    "#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bc4c00", "#1b7c83", "#57606a",
];

/// What a chart's y axis counts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    /// Whole things (calls): ticks at whole numbers.
    Count,
    /// A measure with its unit (`%`, ` ms`).
    Measure(&'static str),
}

/// The axis' top and tick step: for counts a whole step (1, 2, 5, 10, …) and a top that is a
/// multiple of it; for measures a tenth of headroom over the largest value, in quarters.
fn axis(max: f64, kind: Axis) -> (f64, f64) {
    match kind {
        Axis::Count => {
            let max = max.ceil().max(1.0);
            let mut step = 1.0;
            'outer: loop {
                for m in [1.0, 2.0, 5.0] {
                    if max / (step * m) <= 5.0 {
                        step *= m;
                        break 'outer;
                    }
                }
                step *= 10.0;
            }
            ((max / step).ceil() * step, step)
        }
        Axis::Measure(_) => {
            let top = if max <= 0.0 { 1.0 } else { max * 1.1 };
            (top, top / 4.0)
        }
    }
}

/// `HH:MM` (or `HH:MM:SS` for buckets under a minute) of `ms`, UTC.
fn clock(ms: i64, width_ms: i64) -> String {
    let secs = ms.div_euclid(1000).rem_euclid(86_400);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if width_ms < 60_000 {
        format!("{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

/// A line chart: one line per series over the buckets, every value marked by a dot (so a
/// series of one bucket still shows), y from 0, x labelled with the first and last bucket's
/// start (UTC).
fn svg_chart(
    title: &str,
    kind: Axis,
    buckets: &Buckets,
    series: &[(String, Vec<Option<f64>>)],
) -> String {
    let (w, hgt, left, bottom, top, right) = (640.0, 236.0, 56.0, 44.0, 24.0, 16.0);
    let largest = series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied())
        .filter(|x| x.is_finite())
        .fold(0.0f64, f64::max);
    let (max, step) = axis(largest, kind);
    let n = series.first().map(|(_, v)| v.len()).unwrap_or(0).max(1);
    let x = |i: usize| {
        if n == 1 {
            left + (w - left - right) / 2.0
        } else {
            left + (w - left - right) * i as f64 / (n - 1) as f64
        }
    };
    let y = |v: f64| top + (hgt - top - bottom) * (1.0 - v / max);
    let unit = match kind {
        Axis::Count => "",
        Axis::Measure(u) => u,
    };
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{w}" height="{hgt}" viewBox="0 0 {w} {hgt}"><title>{}</title><text x="{left}" y="15" font-size="13" font-weight="600">{}</text>"#,
        h(title),
        h(title)
    );
    let ticks = (max / step).round() as usize;
    for k in 0..=ticks.min(10) {
        let v = step * k as f64;
        let yy = y(v);
        let label = match kind {
            Axis::Count => format!("{v:.0}"),
            Axis::Measure(_) => format!("{}{unit}", short(v)),
        };
        let _ = write!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#eaeef2"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end" fill="#57606a">{}</text>"##,
            w - right,
            left - 4.0,
            yy + 3.0,
            h(&label)
        );
    }
    // Time along the bottom: the first and the last bucket.
    let base = hgt - bottom + 13.0;
    let _ = write!(
        s,
        r##"<text x="{:.1}" y="{base:.1}" font-size="10" text-anchor="middle" fill="#57606a">{}</text>"##,
        x(0),
        clock(buckets.from_ms, buckets.width_ms)
    );
    if n > 1 {
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{base:.1}" font-size="10" text-anchor="middle" fill="#57606a">{}</text>"##,
            x(n - 1),
            clock(
                buckets
                    .from_ms
                    .saturating_add(buckets.width_ms.saturating_mul(n as i64 - 1)),
                buckets.width_ms
            )
        );
    }
    for (i, (name, values)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = values
            .iter()
            .enumerate()
            .filter_map(|(j, v)| v.filter(|v| v.is_finite()).map(|v| (x(j), y(v))))
            .collect();
        if points.len() > 1 {
            let line: Vec<String> = points
                .iter()
                .map(|(a, b)| format!("{a:.1},{b:.1}"))
                .collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
                line.join(" "),
                h(name)
            );
        }
        for (a, b) in &points {
            let _ = write!(
                s,
                r#"<circle cx="{a:.1}" cy="{b:.1}" r="3" fill="{color}"><title>{}</title></circle>"#,
                h(name)
            );
        }
        let lx = left + 8.0 + (i as f64 % 4.0) * 140.0;
        let ly = hgt - 8.0;
        let _ = write!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="3" fill="{color}"/><text x="{:.1}" y="{ly:.1}" font-size="11">{}</text>"#,
            ly - 4.0,
            lx + 14.0,
            h(&name.chars().take(20).collect::<String>())
        );
    }
    s.push_str("</svg>");
    s
}

fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

pub fn html(r: &Report) -> String {
    let mut o = String::new();
    o.push_str("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>AutoHedge failure report</title><style>body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1f2328;max-width:1100px}table{border-collapse:collapse;margin:8px 0 16px}th,td{border-bottom:1px solid #d0d7de;padding:4px 10px;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}code{background:#f6f8fa;padding:0 3px}.recs li{margin:4px 0}svg{display:block;margin:8px 0 18px;border:1px solid #eaeef2}</style></head><body>");
    let _ = write!(
        o,
        "<h1>AutoHedge failure report</h1><p>From {} to {} (charts over the requests' span, in buckets of {}, times UTC).</p>",
        h(&when(r.since)),
        h(&when(r.until)),
        h(&r.buckets.width_text())
    );
    let _ = write!(
        o,
        "<h2>Totals</h2><table><tr><th>requests</th><th>served</th><th>client errors (4xx)</th><th>failed (5xx, 429)</th><th>nothing could serve (503)</th><th>success rate</th></tr><tr><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{:.2} %</td></tr></table>",
        r.requests,
        r.ok,
        r.client_errors,
        r.failed,
        r.unavailable,
        pct(r.ok, r.ok + r.failed)
    );
    o.push_str("<h2>What to do</h2><ul class=recs>");
    if r.recommendations.is_empty() {
        o.push_str("<li>Nothing: no rule fired.</li>");
    }
    for rec in &r.recommendations {
        let _ = write!(o, "<li>{}</li>", h(rec));
    }
    o.push_str("</ul><details><summary>The rules</summary><ul>");
    for rule in RULES {
        let _ = write!(o, "<li>{}</li>", h(rule));
    }
    o.push_str("</ul></details>");
    // Charts.
    let requests: Vec<(String, Vec<Option<f64>>)> = r
        .endpoints
        .iter()
        .filter(|(_, e)| e.calls > 0)
        .map(|(n, e)| {
            (
                n.clone(),
                e.series.iter().map(|(c, _)| Some(*c as f64)).collect(),
            )
        })
        .collect();
    let errors: Vec<(String, Vec<Option<f64>>)> = r
        .endpoints
        .iter()
        .filter(|(_, e)| e.calls > 0)
        .map(|(n, e)| {
            (
                n.clone(),
                e.series
                    .iter()
                    .map(|(c, f)| (*c > 0).then(|| *f as f64 * 100.0 / *c as f64))
                    .collect(),
            )
        })
        .collect();
    let latency: Vec<(String, Vec<Option<f64>>)> = ["p50", "p95", "p99"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            (
                name.to_string(),
                r.latency_series.iter().map(|p| p[i]).collect(),
            )
        })
        .collect();
    o.push_str("<h2>Over time</h2>");
    let b = &r.buckets;
    o.push_str(&svg_chart("Calls per endpoint", Axis::Count, b, &requests));
    o.push_str(&svg_chart(
        "Error rate per endpoint",
        Axis::Measure("%"),
        b,
        &errors,
    ));
    o.push_str(&svg_chart(
        "Latency of served requests",
        Axis::Measure(" ms"),
        b,
        &latency,
    ));
    o.push_str("<h2>Top failure causes</h2>");
    if r.causes.is_empty() {
        o.push_str("<p>No endpoint call failed.</p>");
    } else {
        o.push_str("<table><tr><th>cause</th><th>calls</th><th>share</th><th>example request ids</th></tr>");
        for (class, c) in sorted_causes(r) {
            let _ = write!(
                o,
                "<tr><td><code>{}</code></td><td class=n>{}</td><td class=n>{:.1} %</td><td>{}</td></tr>",
                h(class),
                c.count,
                pct(c.count, r.failed_attempts),
                c.examples
                    .iter()
                    .map(|e| format!("<code>{}</code>", h(e)))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        o.push_str("</table>");
    }
    let (a50, a95, an) = r.failover_latency;
    let (b50, b95, bn) = r.direct_latency;
    let _ = write!(
        o,
        "<h2>Failover performance</h2><table><tr><th>served requests</th><th>count</th><th>p50 ms</th><th>p95 ms</th></tr><tr><td>after a failover</td><td class=n>{an}</td><td class=n>{}</td><td class=n>{}</td></tr><tr><td>first endpoint served</td><td class=n>{bn}</td><td class=n>{}</td><td class=n>{}</td></tr></table>",
        opt_ms(a50),
        opt_ms(a95),
        opt_ms(b50),
        opt_ms(b95)
    );
    o.push_str("<h2>Endpoints</h2><table><tr><th>endpoint</th>");
    for c in ENDPOINT_COLUMNS {
        let _ = write!(o, "<th>{}</th>", h(c));
    }
    o.push_str("</tr>");
    for (name, e) in &r.endpoints {
        let _ = write!(o, "<tr><td><code>{}</code></td>", h(name));
        for cell in endpoint_cells(e) {
            let _ = write!(o, "<td class=n>{}</td>", h(&cell));
        }
        o.push_str("</tr>");
    }
    o.push_str("</table></body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn report_with(endpoints: Vec<(&str, EndpointFigures)>) -> Report {
        Report {
            since: UNIX_EPOCH,
            until: UNIX_EPOCH + Duration::from_secs(86_400),
            requests: 1000,
            ok: 990,
            client_errors: 0,
            failed: 10,
            unavailable: 0,
            context_requests: 0,
            causes: BTreeMap::new(),
            failed_attempts: 0,
            failover_latency: (None, None, 0),
            direct_latency: (None, None, 0),
            endpoints: endpoints
                .into_iter()
                .map(|(n, e)| (n.to_string(), e))
                .collect(),
            latency_series: vec![[None; 3]; 24],
            buckets: Buckets {
                from_ms: 0,
                width_ms: 3_600_000,
                n: 24,
            },
            recommendations: vec![],
        }
    }

    #[test]
    fn each_rule_fires_on_its_evidence_and_not_below_it() {
        let r = report_with(vec![(
            "primary",
            EndpointFigures {
                calls: 100,
                ok: 80,
                rate_limited: 12,
                ..Default::default()
            },
        )]);
        let recs = recommend(&r);
        assert_eq!(recs.len(), 1, "{recs:?}");
        assert!(
            recs[0].contains("`primary` answered 429 to 12 %"),
            "{recs:?}"
        );
        // 4 % is under the rule's 5 %; 19 calls are too few to judge.
        let r = report_with(vec![
            (
                "a",
                EndpointFigures {
                    calls: 100,
                    ok: 96,
                    rate_limited: 4,
                    ..Default::default()
                },
            ),
            (
                "b",
                EndpointFigures {
                    calls: 19,
                    ok: 9,
                    rate_limited: 10,
                    ..Default::default()
                },
            ),
        ]);
        assert!(recommend(&r).is_empty());
        let r = report_with(vec![(
            "k",
            EndpointFigures {
                key_failures: 3,
                retirements: vec!["410 gone".into()],
                cooldowns: 10,
                ..Default::default()
            },
        )]);
        let recs = recommend(&r).join("\n");
        assert!(
            recs.contains("A key of `k` was rejected 3 times: rotate it"),
            "{recs}"
        );
        assert!(recs.contains("`k` was retired (410 gone)"), "{recs}");
        assert!(recs.contains("cooled down 10 times"), "{recs}");
        let mut r = report_with(vec![]);
        r.unavailable = 7;
        r.context_requests = 20;
        r.failover_latency = (Some(900.0), Some(3000.0), 12);
        r.direct_latency = (Some(100.0), Some(400.0), 900);
        let recs = recommend(&r).join("\n");
        assert!(
            recs.contains("7 requests (0.7 %) failed on every endpoint"),
            "{recs}"
        );
        assert!(recs.contains("20 requests (2.0 %) did not fit"), "{recs}");
        assert!(recs.contains("3000 ms at p95 against 400 ms"), "{recs}");
    }

    #[test]
    fn buckets_fit_the_data_in_round_widths() {
        let min = 60_000;
        // A ten-minute run in an hour's report: minutes, from the run's first minute.
        let b = Buckets::sized(Some((5 * min + 1234, 15 * min)), 0, 60 * min);
        assert_eq!((b.from_ms, b.width_ms, b.n), (5 * min, min, 11));
        assert_eq!(b.width_text(), "1 min");
        assert_eq!(b.of(5 * min + 1234), 0);
        assert_eq!(b.of(15 * min), 10);
        assert_eq!(b.of(i64::MAX), 10, "clamped");
        assert_eq!(b.of(i64::MIN), 0, "clamped");
        // The demo's few seconds: seconds.
        let b = Buckets::sized(Some((1_000_500, 1_004_000)), 0, 3_600_000);
        assert_eq!((b.width_ms, b.n), (1000, 5));
        assert_eq!(b.width_text(), "1 s");
        // One request: one bucket.
        assert_eq!(Buckets::sized(Some((7, 7)), 0, 10).n, 1);
        // A day without data: 2 hours.
        let b = Buckets::sized(None, 0, 86_400_000);
        assert_eq!((b.width_ms, b.width_text().as_str()), (7_200_000, "2 h"));
        assert!(b.n <= 17);
        // Beyond the largest step, still at most about thirty buckets; nothing panics.
        let b = Buckets::sized(Some((0, 365 * 86_400_000)), 0, 1);
        assert!(b.n <= 17 && b.width_ms > 86_400_000, "{b:?}");
        let b = Buckets::sized(Some((i64::MIN, i64::MAX)), i64::MIN, i64::MAX);
        assert!(b.n >= 1);
    }

    #[test]
    fn count_axes_tick_at_whole_numbers() {
        assert_eq!(axis(5.26, Axis::Count), (6.0, 2.0));
        assert_eq!(axis(0.0, Axis::Count), (1.0, 1.0));
        assert_eq!(axis(3.0, Axis::Count), (3.0, 1.0));
        assert_eq!(axis(48.0, Axis::Count), (50.0, 10.0));
        assert_eq!(axis(1234.0, Axis::Count), (1500.0, 500.0));
        let (top, step) = axis(7.0, Axis::Measure("%"));
        assert!((top - 7.7).abs() < 1e-9 && (step - top / 4.0).abs() < 1e-9);
    }

    #[test]
    fn a_single_bucket_is_drawn_as_points() {
        let e = EndpointFigures {
            calls: 3,
            ok: 2,
            series: vec![(3, 1)],
            ..Default::default()
        };
        let mut r = report_with(vec![("a", e)]);
        r.latency_series = vec![[Some(10.0), Some(20.0), Some(30.0)]];
        r.buckets = Buckets {
            from_ms: 0,
            width_ms: 1000,
            n: 1,
        };
        let page = html(&r);
        assert!(!page.contains("<polyline"), "one point is no line");
        // calls (1) + error rate (1) + latency (3).
        assert_eq!(page.matches("<circle").count(), 5, "{page}");
        assert!(page.contains(">00:00:00<"), "{page}");
        assert!(page.contains("buckets of 1 s"));
        assert!(
            !page.contains(">5.78<") && page.contains(">3<"),
            "whole ticks"
        );
    }

    #[test]
    fn html_escapes_names_and_charts_have_no_script() {
        let mut e = EndpointFigures {
            calls: 3,
            ok: 2,
            series: vec![(0, 0); 24],
            ..Default::default()
        };
        e.series[3] = (3, 1);
        let mut r = report_with(vec![("<script>x</script>", e)]);
        r.causes.insert(
            "server_error".into(),
            Cause {
                count: 1,
                examples: vec!["<img src=x>".into()],
            },
        );
        let page = html(&r);
        assert!(!page.contains("<script"), "{page}");
        assert!(!page.contains("<img"));
        assert!(page.contains("&lt;script&gt;x&lt;/script&gt;"));
        assert_eq!(page.matches("<svg").count(), 3);
        assert!(page.contains("<polyline"));
        let text = markdown(&r);
        assert!(text.contains("| `server_error` | 1 | "), "{text}");
    }
}
