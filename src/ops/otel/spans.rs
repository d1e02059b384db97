//! A finished request's spans, from its audit row: the server span (`POST /v1/chat/completions`,
//! from the first byte read to the last byte sent) and a client span per upstream call (`chat
//! {model}`), attributes by the OpenTelemetry GenAI conventions and the gateway's own under
//! `autohedge.*`. Skipped endpoints are events of the server span. Nothing secret is written:
//! keys never reach a row, the client key appears by name, content only with
//! `capture_content: true`.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Event, SpanContext, SpanId as OtelSpanId, SpanKind, Status, TraceFlags, TraceId as OtelTraceId,
    TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use crate::config::Config;
use crate::store::{AttemptRow, RequestRow};
use crate::wire::trace::{AttemptTrace, MAX_CONTENT, Trace, cut};

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("autohedge")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

fn at(t: SystemTime, ms: f64) -> SystemTime {
    // Never a panic: a value no `Duration` holds (negative, NaN, huge) adds nothing.
    let d = Duration::try_from_secs_f64((ms / 1000.0).min(1e9)).unwrap_or_default();
    t.checked_add(d).unwrap_or(t)
}

fn path_of(operation: &str) -> &'static str {
    match operation {
        "chat" => "/v1/chat/completions",
        "completions" => "/v1/completions",
        "embeddings" => "/v1/embeddings",
        "responses" => "/v1/responses",
        _ => "/v1",
    }
}

/// `gen_ai.operation.name` of a gateway operation.
fn gen_ai_operation(operation: &str) -> &'static str {
    match operation {
        "completions" => "text_completion",
        "embeddings" => "embeddings",
        // Chat Completions and Responses are both chats in the conventions.
        _ => "chat",
    }
}

fn kv_str(k: &'static str, v: impl Into<String>) -> KeyValue {
    KeyValue::new(k, v.into())
}

fn kv_i64(k: &'static str, v: u64) -> KeyValue {
    KeyValue::new(k, i64::try_from(v).unwrap_or(i64::MAX))
}

/// The spans of `row`, or none when its trace is not exported.
pub fn of(cfg: &Config, row: &RequestRow) -> Vec<SpanData> {
    let Some(trace) = row.trace.as_deref() else {
        return Vec::new();
    };
    if !trace.export {
        return Vec::new();
    }
    let capture = cfg.otlp.as_ref().is_some_and(|o| o.capture_content);
    let trace_id = OtelTraceId::from_bytes(trace.ctx.trace_id.0);
    let state = trace
        .ctx
        .tracestate
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let flags = TraceFlags::SAMPLED;
    let server_id = OtelSpanId::from_bytes(trace.ctx.span.0);
    let op = gen_ai_operation(row.operation);
    let served = row
        .endpoint
        .as_deref()
        .and_then(|name| cfg.endpoints.get(name));
    let mut spans = Vec::with_capacity(1 + row.attempts.len());
    let mut events = SpanEvents::default();

    // The attempts: a client span per upstream call; a skipped endpoint is an event.
    for (i, a) in row.attempts.iter().enumerate() {
        let Some(t) = a.trace else {
            if a.class.is_skip() {
                events.events.push(Event::new(
                    "autohedge.skipped",
                    row.ts,
                    vec![
                        kv_str("autohedge.endpoint", a.endpoint.clone()),
                        kv_str("autohedge.outcome", a.class.as_str()),
                    ],
                    0,
                ));
            }
            continue;
        };
        spans.push(attempt_span(
            cfg,
            row,
            trace,
            a,
            i,
            t,
            (trace_id, server_id, flags, &state),
        ));
    }

    // The server span.
    let mut attrs = vec![
        kv_str("http.request.method", "POST"),
        kv_str("url.path", path_of(row.operation)),
        kv_i64("http.response.status_code", u64::from(row.status)),
        kv_str("gen_ai.operation.name", op),
        kv_str("autohedge.request_id", row.request_id.clone()),
        KeyValue::new("autohedge.hedged", row.hedges > 0),
        KeyValue::new("autohedge.continuation", row.continued_from.is_some()),
        KeyValue::new(
            "autohedge.panic_mode",
            row.attempts.iter().any(|a| a.panic_mode),
        ),
        kv_i64(
            "autohedge.attempts",
            row.attempts.iter().filter(|a| a.trace.is_some()).count() as u64,
        ),
        kv_str(
            "autohedge.outcome",
            row.error_class.clone().unwrap_or_else(|| "ok".into()),
        ),
    ];
    if let Some(m) = &row.requested_model {
        attrs.push(kv_str("gen_ai.request.model", m.clone()));
    }
    if let Some(n) = trace.max_tokens {
        attrs.push(kv_i64("gen_ai.request.max_tokens", n));
    }
    if let Some(ep) = served {
        attrs.push(kv_str("gen_ai.provider.name", ep.kind.to_string()));
        attrs.push(kv_str("gen_ai.response.model", ep.upstream_model.clone()));
        attrs.push(kv_str("autohedge.endpoint", ep.name.clone()));
    }
    if let Some(k) = &row.client_key {
        attrs.push(kv_str("autohedge.client_key", k.clone()));
    }
    usage(&mut attrs, row);
    if let Some(from) = &row.continued_from {
        attrs.push(kv_str("autohedge.continued_from", from.clone()));
    }
    if capture && let Some(input) = &trace.input {
        attrs.push(kv_str("gen_ai.input.messages", cut(input, MAX_CONTENT)));
    }
    if capture && let Some(output) = &trace.output {
        attrs.push(kv_str("gen_ai.output.messages", cut(output, MAX_CONTENT)));
    }
    // A server error, or a stream that broke after its commit (the client got an error event).
    let status = if row.status >= 500 || (row.stream && row.error_class.is_some()) {
        Status::Error {
            description: Cow::Owned(row.error_class.clone().unwrap_or_else(|| "error".into())),
        }
    } else {
        Status::Unset
    };
    spans.push(SpanData {
        span_context: SpanContext::new(trace_id, server_id, flags, false, state),
        parent_span_id: trace
            .ctx
            .parent
            .map_or(OtelSpanId::INVALID, |p| OtelSpanId::from_bytes(p.0)),
        parent_span_is_remote: trace.ctx.parent.is_some(),
        span_kind: SpanKind::Server,
        name: Cow::Owned(format!("POST {}", path_of(row.operation))),
        start_time: row.ts,
        end_time: at(row.ts, row.latency_ms),
        attributes: attrs,
        dropped_attributes_count: 0,
        events,
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope(),
    });
    spans
}

/// Tokens, the time to the first chunk and why the answer ended, as the conventions name them.
fn usage(attrs: &mut Vec<KeyValue>, row: &RequestRow) {
    if let Some(t) = row.trace.as_deref()
        && !t.finish_reasons.is_empty()
    {
        attrs.push(KeyValue::new(
            "gen_ai.response.finish_reasons",
            opentelemetry::Value::Array(opentelemetry::Array::String(
                t.finish_reasons
                    .iter()
                    .map(|r| opentelemetry::StringValue::from(*r))
                    .collect(),
            )),
        ));
    }
    if let Some(n) = row.tokens_in {
        attrs.push(kv_i64("gen_ai.usage.input_tokens", n));
    }
    if let Some(n) = row.tokens_out {
        attrs.push(kv_i64("gen_ai.usage.output_tokens", n));
    }
    if let Some(ms) = row.ttft_ms.filter(|m| m.is_finite()) {
        attrs.push(KeyValue::new(
            "gen_ai.response.time_to_first_chunk",
            ms / 1000.0,
        ));
    }
}

fn attempt_span(
    cfg: &Config,
    row: &RequestRow,
    trace: &Trace,
    a: &AttemptRow,
    i: usize,
    t: AttemptTrace,
    (trace_id, parent, flags, state): (OtelTraceId, OtelSpanId, TraceFlags, &TraceState),
) -> SpanData {
    let ep = cfg.endpoints.get(&a.endpoint);
    let model = ep.map_or(a.endpoint.as_str(), |e| e.upstream_model.as_str());
    let op = gen_ai_operation(row.operation);
    let mut attrs = vec![
        kv_str("gen_ai.operation.name", op),
        kv_str("gen_ai.request.model", model),
        kv_str("autohedge.endpoint", a.endpoint.clone()),
        kv_str("autohedge.outcome", a.class.as_str()),
        kv_i64("autohedge.attempt", u64::from(a.seq)),
        KeyValue::new("autohedge.hedged", t.hedge),
        KeyValue::new("autohedge.panic_mode", a.panic_mode),
        KeyValue::new("autohedge.continuation", t.continuation),
        kv_str("autohedge.request_id", row.request_id.clone()),
    ];
    if let Some(ep) = ep {
        attrs.push(kv_str("gen_ai.provider.name", ep.kind.to_string()));
    }
    if let Some(n) = trace.max_tokens {
        attrs.push(kv_i64("gen_ai.request.max_tokens", n));
    }
    if let Some(addr) = &a.address {
        attrs.push(kv_str("autohedge.address", addr.clone()));
    }
    if let Some(s) = a.status {
        attrs.push(kv_i64("http.response.status_code", u64::from(s)));
    }
    if let Some(k) = &row.client_key {
        attrs.push(kv_str("autohedge.client_key", k.clone()));
    }
    // The call that served the request carries what it answered.
    let served = a.class == crate::routing::outcome::Outcome::Ok
        && row.endpoint.as_deref() == Some(a.endpoint.as_str())
        && row
            .attempts
            .iter()
            .skip(i + 1)
            .all(|b| b.class != crate::routing::outcome::Outcome::Ok);
    if served {
        attrs.push(kv_str("gen_ai.response.model", model));
        usage(&mut attrs, row);
    }
    let mut status = match a.class {
        crate::routing::outcome::Outcome::Ok => Status::Unset,
        c if c.as_str() == "hedge_cancelled" => Status::Unset,
        c => Status::Error {
            description: Cow::Borrowed(c.as_str()),
        },
    };
    let start = at(row.ts, t.started_ms);
    let row_end = at(row.ts, row.latency_ms);
    // A continuation's row gives its time from the request's start (the stream's guard writes
    // it); every other call's from its own.
    let mut end = if t.continuation {
        at(row.ts, a.latency_ms)
    } else {
        at(start, a.latency_ms)
    };
    if row.stream && a.class == crate::routing::outcome::Outcome::Ok {
        // A committed stream's call lasts as long as its stream: to its break (the row that
        // records it, of the same endpoint, without a span of its own), else to the end.
        let broke = row.attempts[i + 1..]
            .iter()
            .find(|b| b.trace.is_none() && b.endpoint == a.endpoint && !b.class.is_skip());
        match broke {
            Some(b) => {
                end = at(row.ts, b.latency_ms);
                status = Status::Error {
                    description: Cow::Borrowed(b.class.as_str()),
                };
            }
            None if served => end = row_end,
            None => {}
        }
    }
    let end = end.min(row_end).max(start);
    SpanData {
        span_context: SpanContext::new(
            trace_id,
            OtelSpanId::from_bytes(t.span.0),
            flags,
            false,
            state.clone(),
        ),
        parent_span_id: parent,
        parent_span_is_remote: false,
        span_kind: SpanKind::Client,
        name: Cow::Owned(format!("{op} {model}")),
        start_time: start,
        end_time: end,
        attributes: attrs,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope(),
    }
}
