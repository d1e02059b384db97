//! What an upstream's failure means: the error class decides the executor's action (fail over,
//! cool down, retire, rotate key, or hand the error back to the client).

use std::sync::LazyLock;
use std::time::Duration;

use regex::Regex;
use reqwest::header::HeaderMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// TCP connect failed or was refused.
    Connect,
    /// The connection broke before a full response (reset, closed early).
    Connection,
    /// No complete response within `timeouts.total`.
    Timeout,
    /// A stream produced no content within `timeouts.first_token`.
    FirstTokenTimeout,
    /// 5xx.
    Server,
    /// 429.
    RateLimited,
    /// 410.
    Gone,
    /// 401/403.
    Auth,
    /// 400-class with a context-length message.
    ContextLength,
    /// 404 for the *upstream's* model: the endpoint is misconfigured or the model not pulled.
    ModelMissing,
    /// Any other 4xx: the client's fault; returned unchanged.
    Client,
    /// An error event inside a 200 stream before any content.
    InBand,
    /// A 2xx body that is not what the protocol promises.
    Malformed,
    /// The request cannot be expressed in this endpoint's protocol (e.g. a remote image URL for
    /// Ollama): skipped, not the endpoint's fault.
    Unsupported,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Connect => "connect_error",
            Class::Connection => "connection_error",
            Class::Timeout => "timeout",
            Class::FirstTokenTimeout => "first_token_timeout",
            Class::Server => "server_error",
            Class::RateLimited => "rate_limited",
            Class::Gone => "gone",
            Class::Auth => "auth_failed",
            Class::ContextLength => "context_length",
            Class::ModelMissing => "model_missing",
            Class::Client => "client_error",
            Class::InBand => "stream_error_event",
            Class::Malformed => "malformed_response",
            Class::Unsupported => "unsupported_request",
        }
    }

    /// Whether a bounded retry on the same endpoint may help.
    pub fn retryable_same_endpoint(self) -> bool {
        matches!(
            self,
            Class::Connect
                | Class::Connection
                | Class::Timeout
                | Class::FirstTokenTimeout
                | Class::Server
                | Class::InBand
                | Class::Malformed
        )
    }

    /// Whether the failure counts against the endpoint's success rate.
    pub fn counts_against_endpoint(self) -> bool {
        !matches!(
            self,
            Class::Client | Class::ContextLength | Class::RateLimited | Class::Unsupported
        )
    }
}

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
pub fn classify_status(status: u16, body: &str) -> Class {
    match status {
        429 => Class::RateLimited,
        410 => Class::Gone,
        401 | 403 => Class::Auth,
        404 if looks_like_missing_model(body) => Class::ModelMissing,
        400..=499 if CONTEXT_RE.is_match(body) => Class::ContextLength,
        400..=499 => Class::Client,
        // Some servers (older Ollama, llama.cpp) report context overflow as 500.
        500..=599 if CONTEXT_RE.is_match(body) && !body.contains("out of memory") => {
            Class::ContextLength
        }
        _ => Class::Server,
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
    LIMIT_RE
        .captures(body)
        .and_then(|c| c.get(1))
        .and_then(|m| m.as_str().parse().ok())
}

/// How long a 429 asks us to stay away: `retry-after-ms`, then `Retry-After` (seconds or an
/// HTTP date), then OpenAI's `x-ratelimit-reset-*` for whichever budget is exhausted.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let get = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    if let Some(v) = get("retry-after") {
        if let Ok(s) = v.parse::<f64>()
            && s.is_finite()
            && s >= 0.0
        {
            return Some(Duration::from_secs_f64(s));
        }
        if let Ok(t) = httpdate_parse(v) {
            return Some(
                t.duration_since(std::time::SystemTime::now())
                    .unwrap_or(Duration::ZERO),
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
    best
}

/// OpenAI's reset headers use Go's duration text: `1s`, `6m0s`, `20ms`, `1h2m3.5s`.
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = 0f64;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let value: f64 = rest[..num_end].parse().ok()?;
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
    Some(Duration::from_secs_f64(total))
}

/// Minimal IMF-fixdate parser (`Sun, 06 Nov 1994 08:49:37 GMT`), the only form RFC 9110 says to
/// send.
fn httpdate_parse(s: &str) -> Result<std::time::SystemTime, ()> {
    let parts: Vec<&str> = s.split_whitespace().collect();
    if parts.len() != 6 || parts[5] != "GMT" {
        return Err(());
    }
    let day: u64 = parts[1].parse().map_err(|_| ())?;
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| *m == parts[2])
    .ok_or(())? as u64
        + 1;
    let year: u64 = parts[3].parse().map_err(|_| ())?;
    let hms: Vec<u64> = parts[4]
        .split(':')
        .map(|p| p.parse().map_err(|_| ()))
        .collect::<Result<_, _>>()?;
    if hms.len() != 3 || year < 1970 {
        return Err(());
    }
    // Days from civil (Howard Hinnant's algorithm).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2];
    Ok(std::time::UNIX_EPOCH + Duration::from_secs(secs))
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

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn classifies_statuses() {
        assert_eq!(classify_status(429, ""), Class::RateLimited);
        assert_eq!(classify_status(410, ""), Class::Gone);
        assert_eq!(classify_status(401, ""), Class::Auth);
        assert_eq!(classify_status(503, ""), Class::Server);
        assert_eq!(
            classify_status(400, "{\"error\":{\"message\":\"bad temperature\"}}"),
            Class::Client
        );
        assert_eq!(
            classify_status(404, "{\"error\":\"model 'qwen' not found\"}"),
            Class::ModelMissing
        );
        for msg in [
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion).",
            "the request exceeds the available context size, try increasing it",
            "{\"error\":{\"code\":400,\"message\":\"...\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":900,\"n_ctx\":512}}",
            "input length exceeds the context length",
        ] {
            assert_eq!(classify_status(400, msg), Class::ContextLength, "{msg}");
        }
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
    }

    #[test]
    fn retry_after_forms() {
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
        assert_eq!(parse_go_duration("x"), None);
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
        assert_eq!(retry_after(&h), Some(Duration::ZERO));
        assert_eq!(
            httpdate_parse("Sun, 06 Nov 1994 08:49:37 GMT").unwrap(),
            std::time::UNIX_EPOCH + Duration::from_secs(784111777)
        );
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
    }
}
