//! W3C Trace Context (`traceparent`, `tracestate`): what a client's span hands the gateway, and
//! what the gateway hands each upstream call; and what a request's trace carries to its spans
//! (`crate::ops::otel` builds and exports them). A header that is not exactly the spec's shape is
//! ignored (a new trace starts), never an error: a client's tracing must not fail its request.

use std::fmt::Write as _;

/// A trace's id (16 bytes, never all zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// A span's id (8 bytes, never all zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

/// Where a request's spans hang: its trace, the parent it continues (the client's span), whether
/// they are recorded, and the vendors' `tracestate` passed along as it came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: TraceId,
    /// The client's span, when a valid `traceparent` came with the request.
    pub parent: Option<SpanId>,
    /// The gateway's server span.
    pub span: SpanId,
    /// The sampled flag passed on: the client's when it sent one, else the gateway's draw.
    pub sampled: bool,
    /// Recorded and exported: the gateway's draw by `sample_ratio`, for a continued trace only
    /// when the client sampled it too (a client's flag can lower its share, never raise it).
    pub recorded: bool,
    /// The incoming `tracestate`, when it is well-formed enough to pass on (at most 512 bytes of
    /// visible ASCII).
    pub tracestate: Option<String>,
}

/// The most `tracestate` bytes passed on (the spec's 32 members fit in 512 for common vendors).
const MAX_TRACESTATE: usize = 512;

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// Lower-case hex of exactly `N` bytes (the spec forbids upper case).
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = hex_val(pair[0])? << 4 | hex_val(pair[1])?;
    }
    Some(out)
}

/// A `traceparent` value: its trace, the parent span and whether the parent sampled. `None`
/// for anything but version `00`'s exact shape (or a later version's first four fields, as the
/// spec asks), an all-zero id, or version `ff`.
pub fn parse_traceparent(value: &[u8]) -> Option<(TraceId, SpanId, bool)> {
    let value = value.trim_ascii();
    if value.len() < 55 {
        return None;
    }
    let version = hex::<1>(&value[..2])?[0];
    if version == 0xff || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    // Version 00 is exactly 55 bytes; a later version may add fields after a dash.
    if version == 0 && value.len() != 55 || version > 0 && value.len() > 55 && value[55] != b'-' {
        return None;
    }
    let trace = hex::<16>(&value[3..35])?;
    let span = hex::<8>(&value[36..52])?;
    let flags = hex::<1>(&value[53..55])?[0];
    if trace == [0; 16] || span == [0; 8] {
        return None;
    }
    Some((TraceId(trace), SpanId(span), flags & 1 == 1))
}

/// A `tracestate` worth passing on: visible ASCII, spaces, commas and `=`, at most
/// [`MAX_TRACESTATE`] bytes; `None` otherwise (dropped, as the spec allows).
pub fn clean_tracestate(value: &[u8]) -> Option<String> {
    let value = value.trim_ascii();
    if value.is_empty()
        || value.len() > MAX_TRACESTATE
        || !value.iter().all(|b| (0x20..0x7f).contains(b))
    {
        return None;
    }
    std::str::from_utf8(value).ok().map(str::to_string)
}

/// `00-{trace}-{span}-{flags}`.
pub fn traceparent(trace: TraceId, span: SpanId, sampled: bool) -> String {
    let mut s = String::with_capacity(55);
    s.push_str("00-");
    for b in trace.0 {
        let _ = write!(s, "{b:02x}");
    }
    s.push('-');
    for b in span.0 {
        let _ = write!(s, "{b:02x}");
    }
    s.push_str(if sampled { "-01" } else { "-00" });
    s
}

impl TraceId {
    pub fn random() -> TraceId {
        TraceId(fastrand::u128(1..).to_be_bytes())
    }

    /// 32 lower-case hex digits, not all zero.
    pub fn from_hex(s: &str) -> Option<TraceId> {
        hex::<16>(s.as_bytes())
            .filter(|b| *b != [0; 16])
            .map(TraceId)
    }

    pub fn to_hex(self) -> String {
        let mut s = String::with_capacity(32);
        for b in self.0 {
            let _ = write!(s, "{b:02x}");
        }
        s
    }
}

impl SpanId {
    pub fn random() -> SpanId {
        SpanId(fastrand::u64(1..).to_be_bytes())
    }
}

/// True with probability `ratio`.
fn draw(ratio: f64) -> bool {
    ratio >= 1.0 || (ratio > 0.0 && fastrand::f64() < ratio)
}

impl TraceContext {
    /// The context of a request with these headers' values: the client's trace continued, or a
    /// new one. `ratio` samples a new trace (a continued one keeps the client's decision).
    pub fn start(traceparent: Option<&[u8]>, tracestate: Option<&[u8]>, ratio: f64) -> Self {
        match traceparent.and_then(parse_traceparent) {
            Some((trace_id, parent, sampled)) => TraceContext {
                trace_id,
                parent: Some(parent),
                span: SpanId::random(),
                sampled,
                recorded: sampled && draw(ratio),
                tracestate: tracestate.and_then(clean_tracestate),
            },
            None => {
                let sampled = draw(ratio);
                TraceContext {
                    trace_id: TraceId::random(),
                    parent: None,
                    span: SpanId::random(),
                    sampled,
                    recorded: sampled,
                    tracestate: None,
                }
            }
        }
    }
}

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
    /// Why the answer ended, per choice ([`finish_name`]'s closed set; distinct, at most
    /// [`MAX_FINISH`]): a full answer's, read when it is served; a stream's, as its chunks go by.
    pub finish_reasons: Vec<&'static str>,
    /// A full answer's text, with `capture_content: true` only (cut to [`MAX_CONTENT`]).
    pub output: Option<String>,
}

/// Finish reasons a trace keeps.
pub const MAX_FINISH: usize = 8;

/// A finish reason by the name OpenAI's answers give it; any other is `other` (no upstream
/// string becomes an attribute value).
pub fn finish_name(s: &[u8]) -> &'static str {
    match s {
        b"stop" => "stop",
        b"length" => "length",
        b"tool_calls" => "tool_calls",
        b"content_filter" => "content_filter",
        b"function_call" => "function_call",
        _ => "other",
    }
}

/// Adds `name` to `reasons`, once, up to [`MAX_FINISH`].
pub fn note_finish(reasons: &mut Vec<&'static str>, name: &'static str) {
    if reasons.len() < MAX_FINISH && !reasons.contains(&name) {
        reasons.push(name);
    }
}

/// A full answer's finish reasons and, with `capture`, its text (choices' `message.content` or
/// `text`, joined): read by a typed parse that borrows its strings and skips the rest. An answer
/// of another shape gives nothing (the spans then carry no finish reason).
pub fn answered(body: &[u8], capture: bool) -> (Vec<&'static str>, Option<String>) {
    use std::borrow::Cow;
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        #[serde(default, borrow)]
        choices: Vec<Choice<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Choice<'a> {
        #[serde(default, borrow)]
        finish_reason: Option<Cow<'a, str>>,
        #[serde(default, borrow)]
        message: Option<Message<'a>>,
        #[serde(default, borrow)]
        text: Option<Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Message<'a> {
        #[serde(default, borrow)]
        content: Option<Cow<'a, str>>,
    }
    let Ok(a) = serde_json::from_slice::<Answer<'_>>(body) else {
        return (Vec::new(), None);
    };
    let mut reasons = Vec::new();
    let mut text = String::new();
    for c in &a.choices {
        if let Some(f) = &c.finish_reason {
            note_finish(&mut reasons, finish_name(f.as_bytes()));
        }
        if capture && text.len() < MAX_CONTENT {
            let part = c.message.as_ref().and_then(|m| m.content.as_deref());
            text.push_str(part.or(c.text.as_deref()).unwrap_or(""));
        }
    }
    let output = (capture && !text.is_empty()).then(|| cut(&text, MAX_CONTENT).to_string());
    (reasons, output)
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
                recorded: false,
                tracestate: None,
            },
            max_tokens: None,
            export: false,
            input: None,
            finish_reasons: Vec::new(),
            output: None,
        }))
    }
}

/// The most content bytes a span carries (`capture_content: true`).
pub const MAX_CONTENT: usize = 16 * 1024;

impl Trace {
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

/// The first `max` bytes (at most, at a character boundary) of `v` as JSON, without writing
/// the rest: a prompt of megabytes costs a span's capture no more than its cut.
pub(crate) fn json_prefix(v: &serde_json::Value, max: usize) -> String {
    /// A writer that takes `max` bytes and then refuses (which stops serialising).
    struct Capped(Vec<u8>, usize);
    impl std::io::Write for Capped {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let room = self.1 - self.0.len();
            if room == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            let n = buf.len().min(room);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut w = Capped(Vec::with_capacity(max.min(4096)), max);
    // An error only says the cap was reached: what was written is the prefix.
    let _ = serde_json::to_writer(&mut w, v);
    match String::from_utf8(w.0) {
        Ok(s) => s,
        Err(e) => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The capped JSON is the full JSON's own prefix, cut as [`cut`] cuts it.
        #[test]
        fn a_capped_json_is_the_full_ones_cut(
            text in "\\PC{0,300}",
            n in 0usize..40,
            max in 0usize..600,
        ) {
            let v = serde_json::json!([{"role": "user", "content": text}, n]);
            let full = v.to_string();
            prop_assert_eq!(json_prefix(&v, max), cut(&full, max));
        }
    }

    const EXAMPLE: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specs_examples() {
        let (t, s, sampled) = parse_traceparent(EXAMPLE).unwrap();
        assert_eq!(t.to_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s.0, [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(sampled);
        assert_eq!(traceparent(t, s, true).as_bytes(), EXAMPLE);
        let (_, _, sampled) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!sampled);
        // A later version: its first fields are read, what follows a dash ignored.
        assert!(
            parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra")
                .is_some()
        );
    }

    #[test]
    fn what_the_spec_refuses_is_ignored() {
        for bad in [
            &b""[..],
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            b"0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(
                parse_traceparent(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(clean_tracestate(b"vendor=a\n"), Some("vendor=a".into()));
        assert_eq!(clean_tracestate(b"v=\x01"), None);
        assert_eq!(clean_tracestate(&[b'a'; 600]), None);
    }

    #[test]
    fn a_new_trace_follows_the_ratio_a_continued_one_the_client() {
        let c = TraceContext::start(None, None, 1.0);
        assert!(c.sampled && c.parent.is_none());
        assert!(!TraceContext::start(None, None, 0.0).sampled);
        let c = TraceContext::start(
            Some(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
            Some(b"congo=t61rcWkgMzE"),
            1.0,
        );
        assert!(!c.sampled && !c.recorded, "the client's decision");
        // A client that samples everything is recorded at the gateway's ratio, no more.
        let sampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(TraceContext::start(Some(sampled), None, 1.0).recorded);
        assert!(!TraceContext::start(Some(sampled), None, 0.0).recorded);
        assert!(
            TraceContext::start(Some(sampled), None, 0.0).sampled,
            "passed on as it came"
        );
        assert_eq!(c.trace_id.to_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(Some(c.span), c.parent, "a span of its own");
        assert_eq!(c.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    }

    #[test]
    fn an_answers_finish_reasons_and_text() {
        let body = br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"},{"index":1,"message":{"content":" there"},"finish_reason":"length"},{"index":2,"finish_reason":"stop"}]}"#;
        assert_eq!(
            answered(body, true),
            (vec!["stop", "length"], Some("Hi there".into()))
        );
        assert_eq!(answered(body, false), (vec!["stop", "length"], None));
        let odd = br#"{"choices":[{"finish_reason":"<script>","text":"t"}]}"#;
        assert_eq!(answered(odd, true), (vec!["other"], Some("t".into())));
        assert_eq!(answered(b"not json", true), (Vec::new(), None));
        assert_eq!(answered(br#"{"choices":7}"#, true), (Vec::new(), None));
    }

    proptest! {
        #[test]
        fn any_bytes_give_a_context_or_none(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = parse_traceparent(&b);
            let _ = clean_tracestate(&b);
        }

        #[test]
        fn what_is_written_reads_back(t in any::<[u8; 16]>(), s in any::<[u8; 8]>(), sampled: bool) {
            prop_assume!(t != [0; 16] && s != [0; 8]);
            let text = traceparent(TraceId(t), SpanId(s), sampled);
            prop_assert_eq!(parse_traceparent(text.as_bytes()), Some((TraceId(t), SpanId(s), sampled)));
        }
    }
}
