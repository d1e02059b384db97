//! The operator's figures, from the one place every request ends (`AppState::record_request`):
//! Prometheus metrics through the `metrics` facade and `metrics-exporter-prometheus` (the
//! exposition format is the exporter's, never written by hand), the JSON access line, the last
//! failovers and per-endpoint 4xx rates `/status` and `/docs` show, and the 503s `all_failed`
//! alerts count.
//!
//! Label values are bounded: routes and endpoints are names from the config (a model the
//! config does not name is `other`), classes come from `Outcome`'s closed set, statuses are
//! three digits. No client-chosen string becomes a series.

use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, SystemTime};

use metrics::{Counter, Histogram, counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::store::RequestRow;

/// Series handles and answer windows looked up by config names on every request (foldhash; no
/// client-chosen key reaches these maps).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Failovers `/status` keeps (the live page shows them).
const RECENT_FAILOVERS: usize = 50;
/// The window of the per-endpoint 4xx rate.
const RATE_WINDOW: Duration = Duration::from_secs(300);
/// Attempts kept per endpoint for it (the rate is over the last this many within the window).
const RATE_SAMPLES: usize = 1000;
/// Histograms are folded into their buckets this often, scraped or not (memory stays flat).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The process's Prometheus recorder, installed on first use. `None` if another recorder was
/// installed first (an embedding program's): metrics then go there.
fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full("autohedge_request_duration_seconds".into()),
                    LATENCY_BUCKETS,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("autohedge_ttft_seconds".into()),
                        LATENCY_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("autohedge_overhead_seconds".into()),
                        OVERHEAD_BUCKETS,
                    )
                })
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            describe();
            Some(handle)
        })
        .as_ref()
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "autohedge_requests_total",
        "Requests answered, by route, the endpoint that answered (none) and status."
    );
    describe_counter!(
        "autohedge_attempts_total",
        "Attempts (skips included), by endpoint and outcome class."
    );
    describe_counter!(
        "autohedge_failovers_total",
        "Moves from an endpoint that failed to the next one tried (to=none: nothing was left)."
    );
    describe_counter!(
        "autohedge_otlp_spans_exported_total",
        "Spans the OTLP collector accepted (telemetry.otlp)."
    );
    describe_counter!(
        "autohedge_otlp_spans_dropped_total",
        "Spans not exported: the queue was full, or the collector refused them or did not answer."
    );
    describe_counter!(
        "autohedge_otlp_export_failures_total",
        "OTLP exports that failed (each drops its batch)."
    );
    describe_gauge!(
        "autohedge_endpoint_state",
        "1 for the endpoint's current state, 0 for the others."
    );
    describe_histogram!(
        "autohedge_request_duration_seconds",
        Unit::Seconds,
        "Request latency (streams: to the last byte), by route."
    );
    describe_histogram!(
        "autohedge_ttft_seconds",
        Unit::Seconds,
        "Time to the first streamed token, by route."
    );
    describe_histogram!(
        "autohedge_overhead_seconds",
        Unit::Seconds,
        "Time spent in the gateway itself until the response started, upstream waits excluded."
    );
    describe_counter!(
        "autohedge_tokens_total",
        "Tokens by endpoint and direction (in = prompt, out = completion)."
    );
    describe_counter!(
        "autohedge_audit_dropped_total",
        "Audit records dropped (queue full or the database failing)."
    );
    describe_counter!(
        "autohedge_config_reloads_total",
        "Config reloads by result (ok, error)."
    );
    describe_gauge!(
        "autohedge_docker_up",
        "1 when the Docker engine answered the last scan."
    );
    describe_gauge!(
        "autohedge_upstream_ratelimit_remaining",
        "Requests or tokens the endpoint's keys are predicted to take now, from x-ratelimit-* headers."
    );
    describe_counter!(
        "autohedge_log_dropped_total",
        "Log lines dropped because stderr could not keep up."
    );
    describe_counter!(
        "autohedge_alerts_dropped_total",
        "Alerts dropped because the alert queue was full."
    );
    describe_gauge!(
        "autohedge_http1_connections_parked",
        "HTTP/1 keep-alive client connections parked: idle, holding their socket and no buffers."
    );
    describe_counter!(
        "autohedge_http1_parks_total",
        "Times an idle HTTP/1 keep-alive client connection was parked."
    );
    describe_counter!(
        "autohedge_out_of_files_total",
        "Upstream connections (requests' and probes') not made because the process was out of file descriptors."
    );
}

/// Folds histograms into buckets every few seconds whether or not anyone scrapes.
pub async fn upkeep(cancel: CancellationToken) {
    let Some(h) = handle() else { return };
    let mut tick = tokio::time::interval(UPKEEP_EVERY);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => h.run_upkeep(),
        }
    }
}

pub fn config_reload(ok: bool) {
    counter!("autohedge_config_reloads_total", "result" => if ok { "ok" } else { "error" })
        .increment(1);
}

/// Time spent in the gateway for one request, upstream waits excluded.
pub fn overhead(d: Duration) {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| {
        handle();
        histogram!("autohedge_overhead_seconds")
    })
    .record(d.as_secs_f64());
}

/// Registered series handles, looked up by borrowed names: a request's metrics cost a few map
/// lookups under read locks and atomic adds — no label allocation, no hashing of label sets in
/// the recorder. Bounded like the series themselves (names from the config, closed sets).
#[derive(Default)]
struct Handles {
    routes: RwLock<HashMap<String, RouteHandles>>,
    endpoints: RwLock<HashMap<String, EndpointHandles>>,
}

struct RouteHandles {
    duration: Histogram,
    ttft: Histogram,
    /// By the endpoint that answered, then the status label.
    requests: RwLock<HashMap<String, HashMap<&'static str, Counter>>>,
}

struct EndpointHandles {
    tokens_in: Counter,
    tokens_out: Counter,
    /// By `Outcome` (its place in `Outcome::ALL`).
    attempts: Vec<OnceLock<Counter>>,
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

impl Handles {
    fn route<R>(&self, route: &str, f: impl FnOnce(&RouteHandles) -> R) -> R {
        if let Some(h) = read(&self.routes).get(route) {
            return f(h);
        }
        let h = RouteHandles {
            duration: histogram!("autohedge_request_duration_seconds", "route" => route.to_string()),
            ttft: histogram!("autohedge_ttft_seconds", "route" => route.to_string()),
            requests: RwLock::default(),
        };
        let mut map = write(&self.routes);
        f(map.entry(route.to_string()).or_insert(h))
    }

    fn endpoint<R>(&self, ep: &str, f: impl FnOnce(&EndpointHandles) -> R) -> R {
        if let Some(h) = read(&self.endpoints).get(ep) {
            return f(h);
        }
        let h = EndpointHandles {
            tokens_in: counter!("autohedge_tokens_total", "endpoint" => ep.to_string(), "direction" => "in"),
            tokens_out: counter!("autohedge_tokens_total", "endpoint" => ep.to_string(), "direction" => "out"),
            attempts: crate::routing::outcome::Outcome::ALL
                .iter()
                .map(|_| OnceLock::new())
                .collect(),
        };
        let mut map = write(&self.endpoints);
        f(map.entry(ep.to_string()).or_insert(h))
    }
}

impl RouteHandles {
    fn request(&self, route: &str, endpoint: &str, status: &'static str) {
        if let Some(c) = read(&self.requests)
            .get(endpoint)
            .and_then(|m| m.get(status))
        {
            c.increment(1);
            return;
        }
        let c = counter!("autohedge_requests_total", "route" => route.to_string(), "endpoint" => endpoint.to_string(), "status" => status);
        c.increment(1);
        write(&self.requests)
            .entry(endpoint.to_string())
            .or_default()
            .insert(status, c);
    }
}

impl EndpointHandles {
    fn attempt(&self, ep: &str, class: crate::routing::outcome::Outcome) {
        let Some(i) = crate::routing::outcome::Outcome::ALL
            .iter()
            .position(|o| *o == class)
        else {
            return;
        };
        if let Some(slot) = self.attempts.get(i) {
            slot.get_or_init(|| counter!("autohedge_attempts_total", "endpoint" => ep.to_string(), "class" => class.as_str()))
                .increment(1);
        }
    }
}

/// One move from a failed endpoint to the next.
#[derive(Clone, Debug)]
struct Failover {
    at: SystemTime,
    request_id: String,
    from: String,
    to: Option<String>,
    class: &'static str,
    status: Option<u16>,
}

#[derive(Default)]
pub struct Telemetry {
    handles: Handles,
    failovers: Mutex<VecDeque<Failover>>,
    /// Per endpoint: (when, answered 4xx) for called attempts in the last `RATE_WINDOW`.
    answers: Mutex<HashMap<String, VecDeque<(Instant, bool)>>>,
    /// The last 15 minutes in ten-second buckets, for the charts on `/docs`.
    timeline: Mutex<super::timeline::Timeline>,
}

impl Telemetry {
    pub fn new() -> Telemetry {
        handle();
        Telemetry::default()
    }

    /// Everything one finished request tells the operator. Called once per request, before
    /// its audit row is queued.
    pub fn request(&self, cfg: &Config, row: &RequestRow) {
        let route = route_label(cfg, row.requested_model.as_deref());
        let endpoint = row.endpoint.as_deref().unwrap_or("none");
        let status = status_label(row.status);
        self.handles.route(route, |h| {
            h.request(route, endpoint, status);
            h.duration.record(row.latency_ms / 1000.0);
            if let Some(t) = row.ttft_ms {
                h.ttft.record(t / 1000.0);
            }
        });
        // The common request, one attempt at the endpoint that served it: one lookup for both.
        let (first, rest) = match (&row.endpoint, row.attempts.split_first()) {
            (Some(ep), Some((a, rest))) if a.endpoint == *ep => (Some(a), rest),
            _ => (None, &row.attempts[..]),
        };
        if let Some(ep) = &row.endpoint {
            self.handles.endpoint(ep, |h| {
                if let Some(n) = row.tokens_in {
                    h.tokens_in.increment(n);
                }
                if let Some(n) = row.tokens_out {
                    h.tokens_out.increment(n);
                }
                if let Some(a) = first {
                    h.attempt(&a.endpoint, a.class);
                }
            });
        }
        let now = Instant::now();
        let answered = |a: &&crate::store::AttemptRow| !a.class.is_skip() && a.status.is_some();
        for a in rest {
            self.handles
                .endpoint(&a.endpoint, |h| h.attempt(&a.endpoint, a.class));
        }
        // Read twice rather than gathered into a `Vec`: no allocation a request.
        if row.attempts.iter().any(|a| answered(&a)) {
            let mut map = self.answers.lock().unwrap_or_else(|e| e.into_inner());
            for a in row.attempts.iter().filter(answered) {
                let is_4xx = a.status.is_some_and(|s| (400..500).contains(&s));
                let q = match map.get_mut(a.endpoint.as_str()) {
                    Some(q) => q,
                    None => map.entry(a.endpoint.clone()).or_default(),
                };
                q.push_back((now, is_4xx));
                while q.len() > RATE_SAMPLES {
                    q.pop_front();
                }
            }
        }
        let moves = failovers(row);
        {
            // A stream that broke after its commit (200, with an error class) is an error too.
            let failed = row.status >= 400 || row.error_class.is_some();
            let served = row
                .endpoint
                .as_deref()
                .filter(|_| !failed)
                .map(|ep| (ep, row.latency_ms, row.ttft_ms));
            let sample = super::timeline::Sample {
                error: failed.then(|| row.error_class.as_deref().unwrap_or("other")),
                failovers: moves.len() as u32,
                hedges: row.hedges,
                served,
            };
            self.timeline
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(unix_now(), &sample);
        }
        if !moves.is_empty() {
            let mut recent = self.failovers.lock().unwrap_or_else(|e| e.into_inner());
            for f in moves {
                counter!("autohedge_failovers_total", "from" => f.from.clone(), "to" => f.to.clone().unwrap_or_else(|| "none".into()))
                    .increment(1);
                recent.push_back(f);
                while recent.len() > RECENT_FAILOVERS {
                    recent.pop_front();
                }
            }
        }
        access_log(row, route);
    }

    /// The last 15 minutes in ten-second buckets (`/status.timeline`).
    pub fn timeline_json(&self) -> Value {
        self.timeline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .json(unix_now())
    }

    /// The last failovers, newest first, for `/status`.
    pub fn failovers_json(&self) -> Value {
        let recent = self.failovers.lock().unwrap_or_else(|e| e.into_inner());
        Value::Array(
            recent
                .iter()
                .rev()
                .map(|f| {
                    json!({
                        "at_unix_ms": f.at.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
                        "request_id": f.request_id,
                        "from": f.from,
                        "to": f.to,
                        "reason": f.class,
                        "status": f.status,
                    })
                })
                .collect(),
        )
    }

    /// The share of an endpoint's answers in the last five minutes that were 4xx (429s
    /// included), and how many answers that is over. `None` before it answered.
    pub fn client_error_rate(&self, endpoint: &str) -> Option<(f64, usize)> {
        let now = Instant::now();
        let mut map = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        let q = map.get_mut(endpoint)?;
        while q
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > RATE_WINDOW)
        {
            q.pop_front();
        }
        if q.is_empty() {
            return None;
        }
        let bad = q.iter().filter(|(_, b)| *b).count();
        Some((bad as f64 / q.len() as f64, q.len()))
    }

    /// The Prometheus text: the gauges as read now (`Gauges`, gathered by the caller from the
    /// registry and the other tasks), then the exporter's rendering.
    pub fn render(&self, g: &Gauges) -> String {
        let Some(h) = handle() else {
            return "# metrics are recorded by another recorder in this process\n".into();
        };
        for e in &g.endpoints {
            for s in g.states {
                gauge!("autohedge_endpoint_state", "endpoint" => e.name.clone(), "state" => *s)
                    .set(if *s == e.state { 1.0 } else { 0.0 });
            }
            for (kind, v) in [("requests", e.requests), ("tokens", e.tokens)] {
                if let Some(v) = v {
                    gauge!("autohedge_upstream_ratelimit_remaining", "endpoint" => e.name.clone(), "kind" => kind)
                        .set(v as f64);
                }
            }
        }
        gauge!("autohedge_docker_up").set(if g.docker_up { 1.0 } else { 0.0 });
        counter!("autohedge_audit_dropped_total").absolute(g.audit_dropped);
        counter!("autohedge_alerts_dropped_total").absolute(g.alerts_dropped);
        counter!("autohedge_out_of_files_total").absolute(crate::upstream::out_of_files_count());
        gauge!("autohedge_http1_connections_parked").set(crate::front::idle::parked_now() as f64);
        counter!("autohedge_http1_parks_total").absolute(crate::front::idle::parks_total());
        if let Some((w, _)) = ACCESS_LOG.get() {
            counter!("autohedge_log_dropped_total").absolute(w.dropped_lines());
        }
        let mut text = h.render();
        text.push_str(&address_series(g));
        text
    }
}

/// The gauges `/metrics` shows, read at scrape time by whoever holds the gateway's state (plain
/// data: telemetry reaches into nothing).
pub struct Gauges {
    /// Every state name an endpoint can be in (each gets its series, 1 for the current one).
    pub states: &'static [&'static str],
    pub endpoints: Vec<EndpointGauges>,
    pub docker_up: bool,
    pub audit_dropped: u64,
    pub alerts_dropped: u64,
}

pub struct EndpointGauges {
    pub name: String,
    pub state: &'static str,
    /// What its keys' fresh `x-ratelimit-*` headers predict it can take now.
    pub requests: Option<u64>,
    pub tokens: Option<u64>,
    /// Its addresses, when it has several: (url, in flight, ejections so far).
    pub addresses: Vec<(String, u32, u64)>,
}

/// The per-address series, written beside the exporter's rendering rather than recorded in
/// it: only the addresses the config and discovery give now are shown (a recorded series
/// would stay after its task left, one more for every task Swarm ever ran).
fn address_series(g: &Gauges) -> String {
    use std::fmt::Write;
    let label = |s: &str| {
        s.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    let mut out = String::new();
    if g.endpoints.iter().all(|e| e.addresses.is_empty()) {
        return out;
    }
    out.push_str("# HELP autohedge_address_in_flight Requests in flight at each address of an endpoint of several (streams until their last byte).\n# TYPE autohedge_address_in_flight gauge\n");
    for e in &g.endpoints {
        for (url, n, _) in &e.addresses {
            let _ = writeln!(
                out,
                "autohedge_address_in_flight{{endpoint=\"{}\",address=\"{}\"}} {n}",
                label(&e.name),
                label(url)
            );
        }
    }
    out.push_str("# HELP autohedge_address_ejections_total Times each address of an endpoint of several was ejected (failures in a row, or its failure rate) since it joined.\n# TYPE autohedge_address_ejections_total counter\n");
    for e in &g.endpoints {
        for (url, _, n) in &e.addresses {
            let _ = writeln!(
                out,
                "autohedge_address_ejections_total{{endpoint=\"{}\",address=\"{}\"}} {n}",
                label(&e.name),
                label(url)
            );
        }
    }
    out
}

/// The route label: the requested model when the config names it (a route or an endpoint),
/// else `other`.
/// Seconds since the epoch (0 for a clock before it).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn route_label<'a>(cfg: &'a Config, model: Option<&str>) -> &'a str {
    match model {
        Some(m) => cfg
            .routes
            .get_key_value(m)
            .map(|(k, _)| k.as_str())
            .or_else(|| cfg.endpoints.get_key_value(m).map(|(k, _)| k.as_str()))
            .unwrap_or("other"),
        None => "other",
    }
}

fn status_label(s: u16) -> &'static str {
    // Interned: the common statuses cost no allocation.
    const COMMON: [(u16, &str); 13] = [
        (200, "200"),
        (400, "400"),
        (401, "401"),
        (403, "403"),
        (404, "404"),
        (408, "408"),
        (413, "413"),
        (429, "429"),
        (499, "499"),
        (500, "500"),
        (502, "502"),
        (503, "503"),
        (504, "504"),
    ];
    if let Some((_, c)) = COMMON.iter().find(|(code, _)| *code == s) {
        return c;
    }
    match s {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

/// The moves a request made: each called attempt that failed, to the next endpoint called
/// after it (a retry on the same endpoint is no move; skips are not calls). A last failure with
/// nothing after it moves to `None`.
fn failovers(row: &RequestRow) -> Vec<Failover> {
    // Most requests: nothing failed, nothing to gather.
    if row
        .attempts
        .iter()
        .all(|a| a.class == crate::routing::outcome::Outcome::Ok)
    {
        return Vec::new();
    }
    let called: Vec<_> = row
        .attempts
        .iter()
        .filter(|a| {
            !a.class.is_skip() && a.class != crate::routing::outcome::Outcome::HedgeCancelled
        })
        .collect();
    let mut out = Vec::new();
    for (i, a) in called.iter().enumerate() {
        if a.class == crate::routing::outcome::Outcome::Ok {
            continue;
        }
        let next = called[i + 1..].iter().find(|b| b.endpoint != a.endpoint);
        let retried_here = called.get(i + 1).is_some_and(|b| b.endpoint == a.endpoint);
        if retried_here {
            continue;
        }
        if next.is_none() && row.status < 500 {
            // The client's own error or a request that ended here: no move.
            continue;
        }
        out.push(Failover {
            at: row.ts,
            request_id: row.request_id.clone(),
            from: a.endpoint.clone(),
            to: next.map(|b| b.endpoint.clone()),
            class: a.class.as_str(),
            status: a.status,
        });
    }
    out
}

/// The log writer and whether lines are JSON, set by `cli::init_tracing`: access lines go
/// straight to it, and `/metrics` reads its drop counter. Without it (the library embedded,
/// tests in-process) access lines go through `tracing::info!`.
pub static ACCESS_LOG: OnceLock<(crate::ops::logwriter::LogWriter, bool)> = OnceLock::new();

/// The access line: one per request, at info (`RUST_LOG` filters it like any line), with the
/// request's figures and the request span's `request_id`. Written straight to the log writer in
/// the subscriber's own shapes — the JSON line `tracing-subscriber`'s JSON formatter makes with
/// `flatten_event` and the current span, or its text line — because the generic formatter
/// spent more instructions on this one line than the rest of the request's gateway work.
fn access_log(row: &RequestRow, route: &str) {
    if !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let Some((writer, json)) = ACCESS_LOG.get() else {
        let classes = classes(row);
        tracing::info!(
            request_id = %row.request_id,
            route,
            endpoint = row.endpoint.as_deref().unwrap_or(""),
            status = row.status,
            attempts = calls(row),
            attempt_classes = %classes,
            error_class = row.error_class.as_deref(),
            latency_ms = round1(row.latency_ms),
            ttft_ms = row.ttft_ms.map(round1),
            tokens_in = row.tokens_in,
            tokens_out = row.tokens_out,
            stream = row.stream,
            hedged = row.hedges > 0,
            client_key = row.client_key.as_deref(),
            "request"
        );
        return;
    };
    thread_local! {
        static LINE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    LINE.with(|line| {
        let Ok(mut buf) = line.try_borrow_mut() else {
            return;
        };
        buf.clear();
        if *json {
            json_line(&mut buf, row, route, SystemTime::now());
        } else {
            text_line(&mut buf, row, route, SystemTime::now());
        }
        writer.line(&buf);
    });
}

fn calls(row: &RequestRow) -> usize {
    row.attempts.iter().filter(|a| !a.class.is_skip()).count()
}

fn classes(row: &RequestRow) -> String {
    let mut out = String::new();
    for (i, a) in row.attempts.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(a.class.as_str());
    }
    out
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// `2026-12-01T05:32:07.501525Z`, as `tracing-subscriber` prints its timestamps.
pub(crate) fn rfc3339(buf: &mut Vec<u8>, t: SystemTime) {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    // The date and time to the second, kept a thread's second: most lines of a busy second
    // write only their microseconds.
    thread_local! {
        static SECOND: std::cell::Cell<Option<(u64, [u8; 19])>> = const { std::cell::Cell::new(None) };
    }
    if let Some((at, text)) = SECOND.get()
        && at == secs
    {
        buf.extend_from_slice(&text);
    } else {
        let start = buf.len();
        date_time(buf, secs);
        if let Ok(text) = <[u8; 19]>::try_from(&buf[start..]) {
            SECOND.set(Some((secs, text)));
        }
    }
    buf.push(b'.');
    digits(buf, u64::from(d.subsec_micros()), 6);
    buf.push(b'Z');
}

/// Digits pushed by hand, zero-padded to `width` (at most 6): `write!` with seven padded fields
/// cost more than the rest of the access line.
fn digits(buf: &mut Vec<u8>, mut n: u64, width: usize) {
    let mut d = [b'0'; 6];
    for slot in d[..width].iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
    }
    buf.extend_from_slice(&d[..width]);
}

/// `2026-12-01T05:32:07` for `secs` after the epoch (19 bytes: the year is clamped to 4 digits).
fn date_time(buf: &mut Vec<u8>, secs: u64) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = crate::clients::civil_from_days(days);
    digits(buf, year.clamp(0, 9999) as u64, 4);
    buf.push(b'-');
    digits(buf, month as u64, 2);
    buf.push(b'-');
    digits(buf, day as u64, 2);
    buf.push(b'T');
    digits(buf, rem / 3600, 2);
    buf.push(b':');
    digits(buf, rem % 3600 / 60, 2);
    buf.push(b':');
    digits(buf, rem % 60, 2);
}

fn json_str(buf: &mut Vec<u8>, s: &str) {
    // Names and request ids rarely hold anything to escape: copy those as they are. The test
    // folds every byte without stopping early, so the compiler runs it 32 bytes a step.
    let plain = !s.bytes().fold(false, |bad, b| {
        bad | (b < 0x20) | (b == b'"') | (b == b'\\') | (b >= 0x7f)
    });
    if plain {
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    } else {
        // A `&str` always serialises.
        let _ = serde_json::to_writer(&mut *buf, s);
    }
}

/// `v` as `{}` prints it when it is a whole number of tenths (what [`round1`] gives), by
/// integer digits: `12.3`, `-0.5`. False, writing nothing, for any other value (the caller
/// formats it with ryu).
fn tenths(buf: &mut Vec<u8>, v: f64) -> bool {
    let n = (v * 10.0).round();
    // NaN and infinities are left to ryu.
    if !n.is_finite() || n.abs() >= 1e15 || n / 10.0 != v || n % 10.0 == 0.0 {
        return false;
    }
    let n = n as i64;
    if n < 0 {
        buf.push(b'-');
    }
    let n = n.unsigned_abs();
    buf.extend_from_slice(itoa::Buffer::new().format(n / 10).as_bytes());
    buf.push(b'.');
    buf.push(b'0' + (n % 10) as u8);
    true
}

fn json_uint(buf: &mut Vec<u8>, name: &str, n: u64) {
    buf.extend_from_slice(b",\"");
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\":");
    buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

fn json_line(buf: &mut Vec<u8>, row: &RequestRow, route: &str, now: SystemTime) {
    buf.extend_from_slice(b"{\"timestamp\":\"");
    rfc3339(buf, now);
    buf.extend_from_slice(b"\",\"level\":\"INFO\",\"message\":\"request\",\"request_id\":");
    json_str(buf, &row.request_id);
    buf.extend_from_slice(b",\"route\":");
    json_str(buf, route);
    buf.extend_from_slice(b",\"endpoint\":");
    json_str(buf, row.endpoint.as_deref().unwrap_or(""));
    json_uint(buf, "status", u64::from(row.status));
    json_uint(buf, "attempts", calls(row) as u64);
    buf.extend_from_slice(b",\"attempt_classes\":\"");
    for (i, a) in row.attempts.iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        // Class names are plain ASCII identifiers: nothing to escape.
        buf.extend_from_slice(a.class.as_str().as_bytes());
    }
    buf.push(b'"');
    if let Some(c) = &row.error_class {
        buf.extend_from_slice(b",\"error_class\":");
        json_str(buf, c);
    }
    // The shape `{}` gives an f64 (`1`, `0.3`), without the formatting machinery.
    let num = |buf: &mut Vec<u8>, name: &str, v: f64| {
        if v.is_finite() {
            buf.extend_from_slice(b",\"");
            buf.extend_from_slice(name.as_bytes());
            buf.extend_from_slice(b"\":");
            if v.fract() == 0.0 && v.abs() < 1e15 {
                buf.extend_from_slice(itoa::Buffer::new().format(v as i64).as_bytes());
            } else if !tenths(buf, v) {
                buf.extend_from_slice(ryu::Buffer::new().format_finite(v).as_bytes());
            }
        }
    };
    num(buf, "latency_ms", round1(row.latency_ms));
    if let Some(t) = row.ttft_ms {
        num(buf, "ttft_ms", round1(t));
    }
    if let Some(n) = row.tokens_in {
        json_uint(buf, "tokens_in", n);
    }
    if let Some(n) = row.tokens_out {
        json_uint(buf, "tokens_out", n);
    }
    buf.extend_from_slice(if row.stream {
        b",\"stream\":true"
    } else {
        b",\"stream\":false"
    });
    buf.extend_from_slice(if row.hedges > 0 {
        b",\"hedged\":true"
    } else {
        b",\"hedged\":false"
    });
    if let Some(k) = &row.client_key {
        buf.extend_from_slice(b",\"client_key\":");
        json_str(buf, k);
    }
    if let Some(t) = &row.trace {
        buf.extend_from_slice(b",\"trace_id\":\"");
        buf.extend_from_slice(t.id.as_bytes());
        buf.push(b'"');
    }
    buf.extend_from_slice(b",\"span\":{\"request_id\":");
    json_str(buf, &row.request_id);
    buf.extend_from_slice(b",\"name\":\"request\"}}\n");
}

fn text_line(buf: &mut Vec<u8>, row: &RequestRow, route: &str, now: SystemTime) {
    use std::io::Write as _;
    rfc3339(buf, now);
    // Request ids are printable ASCII without spaces (the front door sees to it); names come
    // from the config.
    let _ = write!(
        buf,
        "  INFO request{{request_id={id}}}: request request_id={id} route={route} endpoint={} status={} attempts={} attempt_classes={}",
        row.endpoint.as_deref().unwrap_or(""),
        row.status,
        calls(row),
        classes(row),
        id = row.request_id,
    );
    if let Some(c) = &row.error_class {
        let _ = write!(buf, " error_class={c}");
    }
    let _ = write!(buf, " latency_ms={}", round1(row.latency_ms));
    if let Some(t) = row.ttft_ms {
        let _ = write!(buf, " ttft_ms={}", round1(t));
    }
    if let Some(n) = row.tokens_in {
        let _ = write!(buf, " tokens_in={n}");
    }
    if let Some(n) = row.tokens_out {
        let _ = write!(buf, " tokens_out={n}");
    }
    let _ = write!(buf, " stream={} hedged={}", row.stream, row.hedges > 0);
    if let Some(k) = &row.client_key {
        let _ = write!(buf, " client_key={k}");
    }
    if let Some(t) = &row.trace {
        let _ = write!(buf, " trace_id={}", t.id);
    }
    buf.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::outcome::Outcome;
    use crate::store::AttemptRow;

    fn row(attempts: &[(&str, Outcome)], status: u16) -> RequestRow {
        RequestRow {
            requested_model: Some("m".into()),
            status,
            latency_ms: 1.0,
            attempts: attempts
                .iter()
                .enumerate()
                .map(|(i, (e, c))| AttemptRow {
                    seq: i as u32 + 1,
                    endpoint: e.to_string(),
                    class: *c,
                    status: None,
                    error: None,
                    latency_ms: 1.0,
                    panic_mode: false,
                    own_key: false,
                    address: None,
                    trace: None,
                })
                .collect(),
            ..RequestRow::new("r".into(), SystemTime::UNIX_EPOCH, "chat")
        }
    }

    fn moves(r: &RequestRow) -> Vec<(String, Option<String>, &'static str)> {
        failovers(r)
            .into_iter()
            .map(|f| (f.from, f.to, f.class))
            .collect()
    }

    #[test]
    fn failovers_are_moves_between_called_endpoints() {
        let r = row(
            &[
                ("a", Outcome::RateLimited),
                ("b", Outcome::ContextSkip),
                ("c", Outcome::Server),
                ("c", Outcome::Server),
                ("d", Outcome::Ok),
            ],
            200,
        );
        assert_eq!(
            moves(&r),
            vec![
                ("a".into(), Some("c".into()), "rate_limited"),
                ("c".into(), Some("d".into()), "server_error"),
            ]
        );
        // All failed: the last one moves to nothing.
        let r = row(&[("a", Outcome::Server), ("b", Outcome::Connect)], 503);
        assert_eq!(
            moves(&r),
            vec![
                ("a".into(), Some("b".into()), "server_error"),
                ("b".into(), None, "connect_error"),
            ]
        );
        // Served first time, or the client's own error: none.
        assert!(moves(&row(&[("a", Outcome::Ok)], 200)).is_empty());
        assert!(moves(&row(&[("a", Outcome::Client)], 400)).is_empty());
    }

    #[test]
    fn the_json_access_line_is_valid_json_with_hostile_values() {
        let mut r = row(&[("a", Outcome::Server), ("b", Outcome::Ok)], 200);
        r.request_id = "id-\"quoted\"\\".into();
        r.endpoint = Some("b".into());
        r.client_key = Some("team \"x\"\n".into());
        r.ttft_ms = Some(12.345);
        r.tokens_in = Some(7);
        let mut buf = Vec::new();
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_796_103_127_501_525);
        json_line(&mut buf, &r, "chat", t);
        assert_eq!(buf.last(), Some(&b'\n'));
        let v: Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["timestamp"], "2026-12-01T05:32:07.501525Z");
        assert_eq!(v["request_id"], "id-\"quoted\"\\");
        assert_eq!(v["span"]["request_id"], v["request_id"]);
        assert_eq!(v["client_key"], "team \"x\"\n");
        assert_eq!(v["attempts"], 2);
        assert_eq!(v["attempt_classes"], "server_error,ok");
        assert_eq!(v["ttft_ms"], 12.3);
        assert_eq!(v["tokens_in"], 7);
        assert!(v.get("tokens_out").is_none());
        // Numbers in the shape `{}` gives them (what the subscriber's own JSON lines have).
        for (ms, text) in [(1.0, "1"), (0.25, "0.3"), (1234.56, "1234.6"), (0.0, "0")] {
            r.latency_ms = ms;
            let mut b = Vec::new();
            json_line(&mut b, &r, "chat", t);
            let line = String::from_utf8(b).unwrap();
            assert!(
                line.contains(&format!(",\"latency_ms\":{text},")),
                "{ms}: {line}"
            );
            assert_eq!(text, format!("{}", round1(ms)));
        }
        // Dates across eras and leap days, against chrono-free known values.
        for (secs, micros, text) in [
            (0u64, 0u64, "1970-01-01T00:00:00.000000Z"),
            (951_782_400, 7, "2000-02-29T00:00:00.000007Z"),
            (1_764_567_127, 501_525, "2025-12-01T05:32:07.501525Z"),
            (4_107_542_399, 999_999, "2100-02-28T23:59:59.999999Z"),
        ] {
            let mut b = Vec::new();
            let t = Duration::from_secs(secs) + Duration::from_micros(micros);
            rfc3339(&mut b, SystemTime::UNIX_EPOCH + t);
            assert_eq!(String::from_utf8(b).unwrap(), text);
        }
    }

    /// The thread's cached second is used only for that second: times within one second, the
    /// next, and back again each print their own date and time.
    #[test]
    fn timestamps_stay_true_across_seconds_in_any_order() {
        let at = |secs: u64, micros: u64| {
            let mut b = Vec::new();
            let t = Duration::from_secs(secs) + Duration::from_micros(micros);
            rfc3339(&mut b, SystemTime::UNIX_EPOCH + t);
            String::from_utf8(b).unwrap()
        };
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2000 {
            let secs = 1_764_547_199 + rng.u64(0..3);
            let micros = rng.u64(0..1_000_000);
            let mut fresh = Vec::new();
            date_time(&mut fresh, secs);
            let want = format!("{}.{micros:06}Z", String::from_utf8(fresh).unwrap());
            assert_eq!(at(secs, micros), want);
        }
        assert_eq!(at(1_764_547_199, 1), "2025-11-30T23:59:59.000001Z");
        assert_eq!(at(1_764_547_200, 2), "2025-12-01T00:00:00.000002Z");
        assert_eq!(at(1_764_547_199, 3), "2025-11-30T23:59:59.000003Z");
    }

    /// Tenths print as `{}` prints them; anything else is left to ryu.
    #[test]
    fn tenths_print_as_display_does() {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut values: Vec<f64> = (0..20_000)
            .map(|i| match i % 4 {
                0 => rng.f64() * 10.0,
                1 => rng.f64() * 100_000.0,
                2 => -rng.f64() * 1_000.0,
                _ => rng.f64() * 1e16,
            })
            .map(round1)
            .collect();
        values.extend([
            0.1,
            0.3,
            0.7,
            1.5,
            99.9,
            -0.5,
            1e14 + 0.5,
            123_456_789_012.3,
        ]);
        let mut printed = 0;
        for v in values {
            let mut b = Vec::new();
            if tenths(&mut b, v) {
                printed += 1;
                assert_eq!(String::from_utf8(b).unwrap(), format!("{v}"), "{v:?}");
            } else {
                assert!(b.is_empty());
            }
        }
        assert!(printed > 10_000, "the fast path took {printed}");
        for v in [1.0, 0.0, 0.25, 1.0 / 3.0, f64::NAN, f64::INFINITY, 1e300] {
            assert!(!tenths(&mut Vec::new(), v), "{v}");
        }
    }

    #[test]
    fn route_labels_are_names_from_the_config_only() {
        let cfg = Config::load(
            "models:\n  a: {type: openai, base_url: 'http://127.0.0.1:1/v1', model: x}\nrouting_policy: {fallback_chain: [a]}\nroutes:\n  r: [a]\n",
        );
        let cfg = match cfg {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(route_label(&cfg, Some("r")), "r");
        assert_eq!(route_label(&cfg, Some("a")), "a");
        assert_eq!(route_label(&cfg, Some("attacker-chosen\n")), "other");
        assert_eq!(route_label(&cfg, None), "other");
        assert_eq!(status_label(418), "4xx");
        assert_eq!(status_label(599), "5xx");
        assert_eq!(status_label(503), "503");
    }
}
