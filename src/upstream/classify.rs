//! Classification only: an upstream's status and body become an [`Outcome`]; what the executor
//! then does is `outcome::action`'s table, not this module's business.

use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use reqwest::header::HeaderMap;

pub use crate::routing::outcome::Outcome;

/// Context-length wording of OpenAI, vLLM, Ollama, llama.cpp server and a few others.
static CONTEXT_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)(context_length_exceeded|maximum context length|context length|context window|exceeds? the available context size|exceed_context_size|max_model_len|prompt is too long|input is too large|too many tokens|n_ctx)",
    )
    .expect("context regex compiles")
});

/// Numbers that state the limit, in the same servers' wording.
static LIMIT_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"(?i)(?:maximum context length is|context length (?:is|of)|context size \(|n_ctx(?:_slot)?"?\s*[=:]?\s*|max_model_len"?\s*[=:]?\s*|context window of)\s*(\d+)"#,
    )
    .expect("limit regex compiles")
});

/// Classifies a non-2xx status and its body.
pub fn classify_status(status: u16, body: &str) -> Outcome {
    match status {
        429 => Outcome::RateLimited,
        410 => Outcome::Gone,
        401 | 403 => Outcome::Auth,
        404 if looks_like_missing_model(body) => Outcome::ModelMissing,
        400..=499 if CONTEXT_RE.is_match(body) => Outcome::ContextLength,
        400..=499 => Outcome::Client,
        // Some servers (older Ollama, llama.cpp) report context overflow as 500.
        500..=599 if CONTEXT_RE.is_match(body) && !body.contains("out of memory") => {
            Outcome::ContextLength
        }
        _ => Outcome::Server,
    }
}

fn looks_like_missing_model(body: &str) -> bool {
    let b = body.to_ascii_lowercase();
    b.contains("model")
        && (b.contains("not found")
            || b.contains("does not exist")
            || b.contains("model_not_found"))
}

pub fn is_context_message(msg: &str) -> bool {
    CONTEXT_RE.is_match(msg)
}

/// The context limit a context-length error states, when it states one.
pub fn context_limit(body: &str) -> Option<u64> {
    stated_limit(body).map(|(n, _)| n)
}

/// The limit a context-length error states, with the words that state it (`maximum context
/// length is 8192`): a caller checks they are the upstream's own, not the request's quoted back.
pub fn stated_limit(body: &str) -> Option<(u64, &str)> {
    let c = LIMIT_RE.captures(body)?;
    let n = c.get(1)?.as_str().parse().ok()?;
    Some((n, c.get(0)?.as_str()))
}

/// How long a 429 asks us to stay away: `retry-after-ms`, then `Retry-After` (seconds or an
/// HTTP date), then OpenAI's `x-ratelimit-reset-*` for whichever budget is exhausted.
///
/// Whether a 429's message says the request alone is larger than the per-minute allowance
/// (OpenAI: "Request too large for gpt-4o in organization … on tokens per min (TPM): Limit
/// 30000, Requested 50000"): a fact about the request, which cools no endpoint.
pub fn request_too_large(detail: &str) -> bool {
    let d = detail.to_ascii_lowercase();
    d.contains("request too large") && d.contains("requested")
}

/// Every value is hostile input: a number too large for a `Duration`, or a date years ahead, is
/// clamped to `max` (`routing_policy.max_cooldown`) so one odd header cannot take an endpoint out
/// for a year; a malformed value is ignored (`None`: the configured cooldown applies).
pub fn retry_after(headers: &HeaderMap, max: Duration) -> Option<Duration> {
    let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && let Some(d) = secs_to_duration(ms / 1000.0)
    {
        return Some(d.min(max));
    }
    if let Some(v) = get("retry-after") {
        if let Ok(s) = v.parse::<f64>()
            && let Some(d) = secs_to_duration(s)
        {
            return Some(d.min(max));
        }
        if let Ok(t) = httpdate::parse_http_date(v) {
            return Some(
                t.duration_since(std::time::SystemTime::now())
                    .unwrap_or(Duration::ZERO)
                    .min(max),
            );
        }
    }
    let mut best: Option<Duration> = None;
    for budget in ["requests", "tokens"] {
        let exhausted = get(&format!("x-ratelimit-remaining-{budget}"))
            .and_then(|v| v.parse::<u64>().ok())
            == Some(0);
        if exhausted
            && let Some(d) = get(&format!("x-ratelimit-reset-{budget}")).and_then(parse_go_duration)
        {
            best = Some(best.map_or(d, |b| b.max(d)));
        }
    }
    best.map(|d| d.min(max))
}

/// What a response's `x-ratelimit-*` headers say (any status, not only 429s). A budget is taken
/// only with both its `remaining` and its `reset` readable; `limit` is optional. Every value is
/// hostile: malformed ones are ignored, resets are clamped to `max` (`routing_policy.max_cooldown`).
pub fn ratelimit_headers(
    headers: &HeaderMap,
    max: Duration,
) -> crate::routing::ratelimit::Observed {
    // One pass over the headers, each name matched as bytes in one `match`: six lookups by
    // name would hash each name, on every response, for what most upstreams (vLLM, Ollama,
    // llama.cpp) never send.
    let mut found: [[Option<&str>; 3]; 2] = [[None; 3]; 2];
    for (name, value) in headers {
        let Some(rest) = name.as_str().as_bytes().strip_prefix(b"x-ratelimit-") else {
            continue;
        };
        let (i, j) = match rest {
            b"remaining-requests" => (0, 0),
            b"reset-requests" => (0, 1),
            b"limit-requests" => (0, 2),
            b"remaining-tokens" => (1, 0),
            b"reset-tokens" => (1, 1),
            b"limit-tokens" => (1, 2),
            _ => continue,
        };
        // `to_str` lets through visible ASCII, spaces and tabs only: `trim_ascii` is `trim`.
        found[i][j] = value.to_str().ok().map(str::trim_ascii);
    }
    observed(found, max, parse_go_duration)
}

/// The two budgets from their `[remaining, reset, limit]` texts, resets read by `go_duration`
/// (else as seconds).
fn observed(
    found: [[Option<&str>; 3]; 2],
    max: Duration,
    go_duration: fn(&str) -> Option<Duration>,
) -> crate::routing::ratelimit::Observed {
    let budget = |[remaining, reset, limit]: [Option<&str>; 3]| {
        let remaining = remaining?.parse::<u64>().ok()?;
        let reset = reset?;
        let reset =
            go_duration(reset).or_else(|| reset.parse::<f64>().ok().and_then(secs_to_duration))?;
        let limit = limit.and_then(|v| v.parse::<u64>().ok());
        Some((limit, remaining, reset.min(max)))
    };
    crate::routing::ratelimit::Observed {
        requests: budget(found[0]),
        tokens: budget(found[1]),
    }
}

/// Seconds as a `Duration`: `None` for NaN or negative values, `Duration::MAX` for values too
/// large to represent (the caller clamps). Never panics, unlike `Duration::from_secs_f64`.
fn secs_to_duration(secs: f64) -> Option<Duration> {
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// OpenAI's reset headers use Go's duration text: `1s`, `6m0s`, `20ms`, `1h2m3.5s`. A value too
/// large to represent saturates at `Duration::MAX` (callers clamp it).
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    // What OpenAI sends (`6ms`, `1s`, `6m0s`): whole numbers of units, added up exactly in
    // nanoseconds; a fraction, `µs` or a number too long for that goes the float way.
    integer_go_duration(text.as_bytes()).or_else(|| float_go_duration(text))
}

/// [`parse_go_duration`] for ASCII text of whole numbers and units (`1h2m3s`); `None` for
/// anything else, which [`float_go_duration`] then reads.
fn integer_go_duration(text: &[u8]) -> Option<Duration> {
    let mut rest = text.trim_ascii();
    if rest.is_empty() {
        return None;
    }
    let mut nanos: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
        // Nine digits at most; a product or sum past 2^64 ns (584 years) goes the float way.
        if digits == 0 || digits > 9 {
            return None;
        }
        let n = rest[..digits]
            .iter()
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        rest = &rest[digits..];
        let unit = rest.iter().take_while(|c| c.is_ascii_lowercase()).count();
        let scale: u64 = match &rest[..unit] {
            b"h" => 3_600_000_000_000,
            b"m" => 60_000_000_000,
            b"s" => 1_000_000_000,
            b"ms" => 1_000_000,
            b"us" => 1_000,
            b"ns" => 1,
            _ => return None,
        };
        nanos = nanos.checked_add(n.checked_mul(scale)?)?;
        rest = &rest[unit..];
    }
    Some(Duration::from_nanos(nanos))
}

/// OpenAI's reset headers use Go's duration text in full: fractions (`3.5s`), `µs`, and
/// numbers of any length (a value too large saturates at `Duration::MAX`).
fn float_go_duration(text: &str) -> Option<Duration> {
    let mut total = 0f64;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        if num_end == 0 {
            return None;
        }
        let digits = &rest[..num_end];
        // Integers (`6ms`, `1s`, `20m`) are the common case: no float parse for them.
        let value: f64 = match digits.parse::<u32>() {
            Ok(n) => f64::from(n),
            Err(_) => digits.parse().ok()?,
        };
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    secs_to_duration(total)
}

/// Removes anything that looks like a credential from an upstream error text before it is
/// logged, stored or returned: OpenAI echoes part of a rejected key ("Incorrect API key
/// provided: sk-abc***xyz").
pub fn redact(text: &str, secrets: &[&str]) -> String {
    static KEYISH: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"(?i)\b(sk|pk|rk|key|api[_-]?key|bearer)[-_ :=]+[A-Za-z0-9*._\-]{6,}")
            .expect("key regex compiles")
    });
    let mut out = text.to_string();
    for s in secrets {
        if s.len() >= 4 {
            out = out.replace(s, "[REDACTED]");
        }
    }
    let out = KEYISH.replace_all(&out, "$1-[REDACTED]").into_owned();
    // Bound what we keep: an error page can be megabytes of HTML.
    if out.len() > 500 {
        let mut cut = 500;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}…", &out[..cut])
    } else {
        out
    }
}

/// `body` with every occurrence of a secret replaced by `[REDACTED]`, for an upstream's answer
/// passed to the client as it is (a 4xx): only the exact values go, so the upstream's word on
/// the request stays as it was — and only values of 8 bytes or more, so that a placeholder key
/// (`EMPTY`, `none`, as local servers are often given) does not blank that word out of the
/// client's answer. The body comes back untouched (no copy) when none occurs.
pub fn redact_exact(body: bytes::Bytes, secrets: &[&str]) -> bytes::Bytes {
    let secrets: Vec<&[u8]> = secrets
        .iter()
        .map(|s| s.as_bytes())
        .filter(|s| s.len() >= 8)
        .collect();
    if !secrets
        .iter()
        .any(|s| memchr::memmem::find(&body, s).is_some())
    {
        return body;
    }
    let mut out = body.to_vec();
    for s in secrets {
        let mut done = Vec::with_capacity(out.len());
        let mut rest = &out[..];
        while let Some(at) = memchr::memmem::find(rest, s) {
            done.extend_from_slice(&rest[..at]);
            done.extend_from_slice(b"[REDACTED]");
            rest = &rest[at + s.len()..];
        }
        done.extend_from_slice(rest);
        out = done;
    }
    bytes::Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn classifies_statuses() {
        assert_eq!(classify_status(429, ""), Outcome::RateLimited);
        assert_eq!(classify_status(410, ""), Outcome::Gone);
        assert_eq!(classify_status(401, ""), Outcome::Auth);
        assert_eq!(classify_status(503, ""), Outcome::Server);
        assert_eq!(
            classify_status(400, "{\"error\":{\"message\":\"bad temperature\"}}"),
            Outcome::Client
        );
        assert_eq!(
            classify_status(404, "{\"error\":\"model 'qwen' not found\"}"),
            Outcome::ModelMissing
        );
        for msg in [
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion).",
            "the request exceeds the available context size, try increasing it",
            "{\"error\":{\"code\":400,\"message\":\"...\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":900,\"n_ctx\":512}}",
            "input length exceeds the context length",
        ] {
            assert_eq!(classify_status(400, msg), Outcome::ContextLength, "{msg}");
        }
    }

    /// README's "What each error does" table, as the classifier states it: the audit-trail name,
    /// whether a same-endpoint retry may help, whether it counts against the endpoint.
    #[test]
    fn every_class_row() {
        use Outcome::*;
        let rows = [
            (Connect, "connect_error", true, true),
            (Connection, "connection_error", true, true),
            (Timeout, "timeout", true, true),
            (FirstTokenTimeout, "first_token_timeout", true, true),
            (Server, "server_error", true, true),
            (RateLimited, "rate_limited", false, false),
            (Gone, "gone", false, true),
            (Auth, "auth_failed", false, true),
            (ContextLength, "context_length", false, false),
            (ModelMissing, "model_missing", false, true),
            (Client, "client_error", false, false),
            (InBand, "stream_error_event", true, true),
            (Malformed, "malformed_response", true, true),
            (Unsupported, "unsupported_request", false, false),
        ];
        for (class, name, retry, counts) in rows {
            assert_eq!(class.as_str(), name);
            assert_eq!(class.retryable_same_endpoint(), retry, "{name}");
            assert_eq!(class.counts_against_endpoint(), counts, "{name}");
        }
    }

    #[test]
    fn missing_model_needs_both_words_and_context_500s() {
        // A 404 names a missing *model* only when it says so; any other 404 is the client's.
        assert_eq!(classify_status(404, "Not Found"), Outcome::Client);
        assert_eq!(
            classify_status(404, "{\"error\":\"model\"}"),
            Outcome::Client
        );
        assert_eq!(
            classify_status(404, "{\"error\":{\"code\":\"model_not_found\"}}"),
            Outcome::ModelMissing
        );
        assert_eq!(
            classify_status(404, "the model does not exist"),
            Outcome::ModelMissing
        );
        assert!(!looks_like_missing_model("page not found"));
        assert!(!looks_like_missing_model("bad model name"));
        // Some servers report context overflow as 500; an out-of-memory 500 is a server error.
        assert_eq!(
            classify_status(500, "the request exceeds the available context size"),
            Outcome::ContextLength
        );
        assert_eq!(
            classify_status(500, "context length exceeded: CUDA out of memory"),
            Outcome::Server
        );
        assert_eq!(classify_status(500, "internal error"), Outcome::Server);
        // In-band and Ollama error texts go through the same wording check.
        assert!(is_context_message(
            "input length exceeds the context length"
        ));
        assert!(is_context_message("prompt is too long"));
        assert!(!is_context_message("Rate limit reached for requests"));
        assert!(!is_context_message(""));
    }

    #[test]
    fn reads_the_limit() {
        assert_eq!(
            context_limit("This model's maximum context length is 8192 tokens."),
            Some(8192)
        );
        assert_eq!(
            context_limit("\"n_prompt_tokens\":900,\"n_ctx\":512"),
            Some(512)
        );
        assert_eq!(context_limit("nothing here"), None);
        assert_eq!(
            stated_limit("{\"message\": \"This model's maximum context length is 1 tokens.\"}"),
            Some((1, "maximum context length is 1"))
        );
    }

    const MAX: Duration = Duration::from_secs(600);

    /// The header scan as it was (split and matched as text, resets read as floats), which the
    /// one-`match` scan must agree with.
    fn reference_headers(
        headers: &HeaderMap,
        max: Duration,
    ) -> crate::routing::ratelimit::Observed {
        let mut found: [[Option<&str>; 3]; 2] = [[None; 3]; 2];
        for (name, value) in headers {
            let Some(rest) = name.as_str().strip_prefix("x-ratelimit-") else {
                continue;
            };
            let Some((field, budget)) = rest.split_once('-') else {
                continue;
            };
            let i = match budget {
                "requests" => 0,
                "tokens" => 1,
                _ => continue,
            };
            let j = match field {
                "remaining" => 0,
                "reset" => 1,
                "limit" => 2,
                _ => continue,
            };
            found[i][j] = value.to_str().ok().map(str::trim);
        }
        observed(found, max, float_go_duration)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]

        /// Any text gives what the float reading gives: `None` alike, and durations the same
        /// to the nanosecond (to the float's precision, for durations of years).
        #[test]
        fn go_durations_read_as_the_float_reading_does(
            text in "[ \t]{0,2}(([0-9]{1,12}(\\.[0-9]{0,3})?(h|m|s|ms|us|µs|ns|x|)){1,4}|[0-9a-zµ. ]{0,12})[ \t]{0,2}",
        ) {
            let (got, want) = (parse_go_duration(&text), float_go_duration(&text));
            match (got, want) {
                (Some(g), Some(w)) => {
                    // The float reading rounds: to the nanosecond, or by its 52-bit mantissa
                    // for durations of years (the exact reading is the better one there).
                    let diff = g.as_nanos().abs_diff(w.as_nanos());
                    let ulps = w.as_nanos() >> 48;
                    proptest::prop_assert!(diff <= 1 + ulps || w == Duration::MAX, "{text:?}: {g:?} vs {w:?}");
                }
                _ => proptest::prop_assert_eq!(got, want, "{:?}", text),
            }
        }

        #[test]
        fn the_header_scan_reads_what_the_text_scan_read(
            names in proptest::collection::vec(proptest::sample::select(vec![
                "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-requests", "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens", "x-ratelimit-limit-tokens",
                "x-ratelimit-reset", "x-ratelimit-remaining-requests-x", "x-ratelimit-",
                "x-ratelimit-limit-tokens2", "content-type", "x-ratelimit-reset-tokens-",
            ]), 0..10),
            values in proptest::collection::vec(
                "[ \t]?([0-9]{1,6}|[0-9]{1,3}(ms|s|m|h|us)|[0-9]\\.[0-9]s|\\PC{0,8})[ \t]?", 10),
        ) {
            let mut h = HeaderMap::new();
            for (n, v) in names.iter().zip(&values) {
                if let Ok(hv) = HeaderValue::from_str(v) {
                    h.append(*n, hv);
                }
            }
            let (got, want) = (ratelimit_headers(&h, MAX), reference_headers(&h, MAX));
            let close = |a: Option<(Option<u64>, u64, Duration)>, b: Option<(Option<u64>, u64, Duration)>| match (a, b) {
                (Some((l1, r1, d1)), Some((l2, r2, d2))) => l1 == l2 && r1 == r2 && d1.as_nanos().abs_diff(d2.as_nanos()) <= 1,
                (a, b) => a.is_none() && b.is_none(),
            };
            proptest::prop_assert!(close(got.requests, want.requests), "{h:?}: {:?} vs {:?}", got.requests, want.requests);
            proptest::prop_assert!(close(got.tokens, want.tokens), "{h:?}: {:?} vs {:?}", got.tokens, want.tokens);
        }
    }

    #[test]
    fn retry_after_forms() {
        let retry_after = |h: &HeaderMap| super::retry_after(h, MAX);
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
        let mut h = HeaderMap::new();
        h.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from_static("0"),
        );
        h.insert(
            "x-ratelimit-reset-requests",
            HeaderValue::from_static("6m0s"),
        );
        assert_eq!(retry_after(&h), Some(Duration::from_secs(360)));
        assert_eq!(parse_go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(
            parse_go_duration("1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(parse_go_duration("1.5us"), Some(Duration::from_nanos(1500)));
        assert_eq!(parse_go_duration("250ns"), Some(Duration::from_nanos(250)));
        let mut z = HeaderMap::new();
        z.insert("retry-after", HeaderValue::from_static("0"));
        assert_eq!(
            retry_after(&z),
            Some(Duration::ZERO),
            "zero is a hint, not malformed"
        );
        assert_eq!(parse_go_duration("x"), None);
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        // The obsolete RFC 850 form is a date too.
        h.insert(
            "retry-after",
            HeaderValue::from_static("Sunday, 06-Nov-94 08:49:37 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        let soon = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(90));
        h.insert("retry-after", HeaderValue::from_str(&soon).unwrap());
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(85) && d <= Duration::from_secs(90),
            "{d:?}"
        );
    }

    #[test]
    fn hostile_durations_are_clamped_or_ignored() {
        let one = |name: &'static str, v: &str| {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_str(v).unwrap());
            h.insert(
                "x-ratelimit-remaining-requests",
                HeaderValue::from_static("0"),
            );
            h.insert(
                "x-ratelimit-remaining-tokens",
                HeaderValue::from_static("0"),
            );
            super::retry_after(&h, MAX)
        };
        assert_eq!(one("retry-after", "1e20"), Some(MAX));
        assert_eq!(
            one("retry-after", "31536000"),
            Some(MAX),
            "a year is clamped"
        );
        assert_eq!(one("retry-after", "inf"), Some(MAX));
        assert_eq!(one("retry-after", "NaN"), None);
        assert_eq!(one("retry-after", "-5"), None);
        assert_eq!(one("retry-after", "soon"), None);
        assert_eq!(one("retry-after-ms", "1e308"), Some(MAX));
        assert_eq!(
            one("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
            Some(MAX)
        );
        let digits = "9".repeat(400) + "s";
        assert_eq!(one("x-ratelimit-reset-requests", &digits), Some(MAX));
        assert_eq!(
            one("x-ratelimit-reset-tokens", "1e400h"),
            None,
            "not Go syntax"
        );
        assert_eq!(parse_go_duration(&"9".repeat(400)), None, "no unit");
        assert_eq!(parse_go_duration(".s"), None);
        assert_eq!(parse_go_duration("s"), None);
    }

    proptest::proptest! {
        #[test]
        fn header_durations_never_panic(name in proptest::sample::select(vec![
            "retry-after", "retry-after-ms", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
        ]), value in "\\PC{0,60}", digits in "[0-9.]{0,400}[a-zµ]{0,3}") {
            for v in [value.as_str(), digits.as_str()] {
                if let Ok(hv) = HeaderValue::from_str(v) {
                    let mut h = HeaderMap::new();
                    h.insert(name, hv);
                    h.insert("x-ratelimit-remaining-requests", HeaderValue::from_static("0"));
                    h.insert("x-ratelimit-remaining-tokens", HeaderValue::from_static("0"));
                    if let Some(d) = super::retry_after(&h, MAX) {
                        proptest::prop_assert!(d <= MAX);
                    }
                }
                let _ = parse_go_duration(v);
            }
        }

        #[test]
        fn hostile_ratelimit_headers_give_a_value_or_nothing(
            remaining in "\\PC{0,30}|[0-9]{1,25}",
            reset in "\\PC{0,30}|[0-9.]{0,30}[a-zµ]{0,3}",
            limit in "\\PC{0,30}|[0-9]{1,25}",
            tokens_needed in proptest::option::of(0u64..u64::MAX),
        ) {
            let mut h = HeaderMap::new();
            for (n, v) in [
                ("x-ratelimit-remaining-requests", &remaining),
                ("x-ratelimit-reset-requests", &reset),
                ("x-ratelimit-limit-requests", &limit),
                ("x-ratelimit-remaining-tokens", &remaining),
                ("x-ratelimit-reset-tokens", &reset),
                ("x-ratelimit-limit-tokens", &limit),
            ] {
                if let Ok(hv) = HeaderValue::from_str(v) {
                    h.insert(n, hv);
                }
            }
            let seen = ratelimit_headers(&h, MAX);
            for (_, _, d) in [seen.requests, seen.tokens].into_iter().flatten() {
                proptest::prop_assert!(d <= MAX);
            }
            // And whatever was read, the prediction built on it gives a value, never a panic,
            // and never asks to wait longer than the clamped reset.
            let now = tokio::time::Instant::now();
            let mut l = crate::routing::ratelimit::Limits::default();
            l.observe(&seen, now);
            if let Some((d, _)) = l.wait_for(tokens_needed, now) {
                proptest::prop_assert!(d <= MAX);
            }
            l.debit(tokens_needed);
            let _ = l.tokens_tight(tokens_needed.unwrap_or(0), now);
        }

        #[test]
        fn classify_and_redact_never_panic(status in 0u16..1000, body in "\\PC{0,300}") {
            let _ = classify_status(status, &body);
            let _ = context_limit(&body);
            let out = redact(&body, &["sk-secretsecret"]);
            proptest::prop_assert!(!out.contains("sk-secretsecret"));
        }
    }

    #[test]
    fn exact_redaction_replaces_only_the_secrets_and_copies_only_when_it_must() {
        let body = bytes::Bytes::from_static(
            br#"{"error":{"message":"key sk-live-AAAA1111 and sk-live-AAAA1111 again; api_key=fine"}}"#,
        );
        let out = redact_exact(body.clone(), &["sk-live-AAAA1111", "abc"]);
        assert_eq!(
            &out[..],
            br#"{"error":{"message":"key [REDACTED] and [REDACTED] again; api_key=fine"}}"#
        );
        // Still JSON, with the upstream's message otherwise as it was.
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .ends_with("api_key=fine")
        );
        // Nothing to redact: the same bytes, not a copy; short secrets (a placeholder key such
        // as `EMPTY`, here `message`'s 7 bytes) are not matched.
        let same = redact_exact(body.clone(), &["not-there", "message", "key"]);
        assert_eq!(same.as_ptr(), body.as_ptr());
    }

    #[test]
    fn redacts_keys() {
        let out = redact(
            "Incorrect API key provided: sk-abc123456***wxyz. You can find your API key at ...",
            &["sk-abc123456secretwxyz"],
        );
        assert!(!out.contains("abc123456"), "{out}");
        let out = redact("token mysecretvalue leaked", &["mysecretvalue"]);
        assert!(!out.contains("mysecretvalue"));
        // What is not key-like survives whole.
        assert_eq!(
            redact("Rate limit reached for requests", &["sk-zzzz"]),
            "Rate limit reached for requests"
        );
        // Bounded: an error page is cut at 500 bytes (on a character boundary); 500 is kept.
        let exactly = "a".repeat(500);
        assert_eq!(redact(&exactly, &[]), exactly);
        // Three-byte characters: byte 500 falls inside one, so the cut steps back to 498.
        let long = "€".repeat(400);
        let cut = redact(&long, &[]);
        assert_eq!(cut, format!("{}…", "€".repeat(166)));
    }
}

#[cfg(test)]
mod request_too_large_tests {
    use super::request_too_large;

    #[test]
    fn a_request_larger_than_a_minute_is_told_from_load() {
        assert!(request_too_large(
            "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 50000."
        ));
        assert!(!request_too_large(
            "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000."
        ));
        assert!(!request_too_large("Too Many Requests"));
    }
}
