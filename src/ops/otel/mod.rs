//! OpenTelemetry traces of the gateway's requests, exported over OTLP/HTTP (protobuf) with the
//! ecosystem's exporter (`opentelemetry-otlp`).
//!
//! A request's spans are built when it ends, from its audit row and the ids chosen on the way
//! (the server span's when the request came, each attempt's when it was sent, so the upstream
//! got its `traceparent`): the request path keeps no span objects, takes no lock and allocates
//! nothing for tracing until its row is written. The spans then wait in a bounded queue for the
//! export task: a collector that is slow or away costs dropped spans (counted in `/status` and
//! `/metrics`), never a request's time.

pub mod context;
mod export;
mod spans;

pub use context::{SpanId, TraceContext, TraceId, traceparent};
pub use export::{Traces, run};

/// What a request's trace carries besides its ids: filled on the way, read when its spans are
/// built.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub ctx: TraceContext,
    /// The trace id in hex, as the access line and the audit row (`trace_id`) write it.
    pub id: String,
    /// The completion limit the client asked for (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens`).
    pub max_tokens: Option<u64>,
    /// Whether spans are exported for it (`telemetry.otlp` set and the trace sampled): a trace
    /// that is only propagated (no exporter) builds no span.
    pub export: bool,
    /// The prompt as the client sent it, with `capture_content: true` only (cut to
    /// [`MAX_CONTENT`]).
    pub input: Option<String>,
}

/// Per-attempt trace facts, kept on its audit row: its span id (sent upstream in
/// `traceparent`), when it was sent (ms after the request began), and what kind of call it was.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttemptTrace {
    pub span: SpanId,
    pub started_ms: f64,
    pub hedge: bool,
    pub continuation: bool,
}

impl Trace {
    /// A trace known only by its id (a row read back from an export): nothing is exported or
    /// propagated from it.
    pub fn known(id: &str) -> Option<Box<Trace>> {
        let trace_id = TraceId::from_hex(id)?;
        Some(Box::new(Trace {
            id: trace_id.to_hex(),
            ctx: TraceContext {
                trace_id,
                parent: None,
                span: SpanId::random(),
                sampled: false,
                tracestate: None,
            },
            max_tokens: None,
            export: false,
            input: None,
        }))
    }
}

/// The most content bytes a span carries (`capture_content: true`).
pub const MAX_CONTENT: usize = 16 * 1024;

impl Trace {
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
        if otlp.is_none() && parent.and_then(context::parse_traceparent).is_none() {
            return None;
        }
        let ctx = TraceContext::start(parent, state, otlp.map_or(0.0, |o| o.sample_ratio));
        let export = otlp.is_some() && ctx.sampled;
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
            .map(|v| cut(&v.to_string(), MAX_CONTENT).to_string());
        Some(Box::new(Trace {
            id: ctx.trace_id.to_hex(),
            ctx,
            max_tokens,
            export,
            input,
        }))
    }

    /// The `traceparent` an upstream call made as span `span` carries: that span's, when the
    /// gateway exports its spans; the client's own span's when it does not (the upstream's spans
    /// then hang under a span that exists).
    pub fn header(&self, span: SpanId) -> String {
        let parent = if self.export {
            span
        } else {
            self.ctx.parent.unwrap_or(span)
        };
        traceparent(self.ctx.trace_id, parent, self.ctx.sampled)
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
