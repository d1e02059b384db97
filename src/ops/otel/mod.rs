//! OpenTelemetry traces of the gateway's requests, exported over OTLP/HTTP (protobuf) with the
//! ecosystem's exporter (`opentelemetry-otlp`).
//!
//! A request's spans are built when it ends, from its audit row and the ids chosen on the way
//! (the server span's when the request came, each attempt's when it was sent, so the upstream
//! got its `traceparent`): the request path keeps no span objects, takes no lock and allocates
//! nothing for tracing until its row is written. The spans then wait in a bounded queue for the
//! export task: a collector that is slow or away costs dropped spans (counted in `/status` and
//! `/metrics`), never a request's time. The trace context itself (ids, `traceparent`) is
//! [`crate::wire::trace`]'s.

mod export;
mod spans;

pub use export::{Traces, run};

use crate::wire::trace::{MAX_CONTENT, Trace, TraceContext, json_prefix, parse_traceparent};

/// A request's trace: with `telemetry.otlp`, the client's trace continued or a new one
/// (sampled by `sample_ratio`); without it, only a client's valid `traceparent`, passed on
/// to the upstream as it came (nothing exported). `None`: no trace, no header.
pub fn of_request(
    cfg: &crate::config::Config,
    headers: &http::HeaderMap,
    req: &crate::wire::Inbound,
) -> Option<Box<Trace>> {
    let parent = headers.get("traceparent").map(|v| v.as_bytes());
    let state = headers.get("tracestate").map(|v| v.as_bytes());
    let otlp = cfg.otlp.as_deref();
    if otlp.is_none() && parent.and_then(parse_traceparent).is_none() {
        return None;
    }
    let ctx = TraceContext::start(parent, state, otlp.map_or(0.0, |o| o.sample_ratio));
    let export = otlp.is_some() && ctx.recorded;
    let body = req.body();
    let max_tokens = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(serde_json::Value::as_u64));
    let input = otlp
        .filter(|o| o.capture_content && export)
        .and_then(|_| {
            ["messages", "input", "prompt"]
                .iter()
                .find_map(|k| body.get(*k))
        })
        .map(|v| json_prefix(v, MAX_CONTENT));
    Some(Box::new(Trace {
        id: ctx.trace_id.to_hex(),
        ctx,
        max_tokens,
        export,
        input,
        finish_reasons: Vec::new(),
        output: None,
    }))
}
