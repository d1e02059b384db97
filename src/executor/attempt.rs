//! One upstream attempt: the request as the endpoint's adapter builds it, its timeouts, and the
//! classification of whatever comes back — a value with no access to the request's bookkeeping,
//! so two can run at once (hedging) and dropping one cancels it (its connection is closed,
//! so a metered API stops generating).

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::time::{Instant, sleep_until, timeout_at};

use crate::config::{Endpoint, EndpointKind, Secret};
use crate::routing::outcome::Outcome;
use crate::routing::ratelimit::Observed;
use crate::upstream::{self, Answer, Prepared, SendError, classify};
use crate::wire::sse::SseParser;
use crate::wire::{self, ChunkKind, Inbound, Op, Usage};

/// Longest upstream error body we read before classifying it.
const MAX_ERROR_BODY: usize = 64 * 1024;

pub(super) use crate::upstream::ByteStream;

/// A failed attempt, with what the policy needs to decide on it.
pub(super) struct Failure {
    pub class: Outcome,
    pub status: Option<u16>,
    pub detail: String,
    pub retry_after: Option<Duration>,
    /// The detail with internal addresses, for the audit row only (never a client's body).
    pub internal: Option<String>,
    /// For client errors, the upstream's own response, returned unchanged.
    /// Boxed: it is rare, and keeps `Failure` small on the common paths.
    pub passthrough: Option<Box<(StatusCode, HeaderMap, Bytes)>>,
    /// What the response's `x-ratelimit-*` headers said, if it said anything (boxed: rare).
    pub ratelimit: Option<Box<Observed>>,
    /// The `usage` a failed answer reported: the upstream billed it, so the client's key pays
    /// (boxed: rare).
    pub usage: Option<Box<Usage>>,
    /// The address the attempt went to, when the endpoint has several (its audit attempt row).
    pub address: Option<Arc<str>>,
}

impl Failure {
    pub fn new(class: Outcome, status: Option<u16>, detail: impl Into<String>) -> Self {
        Failure {
            class,
            status,
            detail: detail.into(),
            retry_after: None,
            internal: None,
            passthrough: None,
            ratelimit: None,
            usage: None,
            address: None,
        }
    }

    /// The same, with the `usage` the failed answer reported.
    fn billed(mut self, usage: Option<Usage>) -> Self {
        self.usage = usage.map(Box::new);
        self
    }
}

/// Who made a `/v1/responses` answer: the endpoint in its own Responses API (with the
/// upstream's id for it, or the tap a stream reports it through), or the gateway by
/// translation from chat.
pub(super) struct Produced {
    pub translated: bool,
    pub upstream_id: Option<String>,
    pub tap: Option<upstream::responses::IdTap>,
}

impl Produced {
    /// The upstream's id, once known; `None` for a translated answer (the gateway's own).
    pub fn upstream_id(&self) -> Option<String> {
        if self.translated {
            return None;
        }
        self.upstream_id
            .clone()
            .or_else(|| self.tap.as_ref().and_then(|t| t.lock().ok()?.clone()))
            .or_else(|| Some(String::new()))
    }
}

pub(super) enum Success {
    Full {
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Bytes,
        usage: Option<Usage>,
        /// Generated characters, for estimating usage when the upstream reported none.
        out_chars: usize,
        ratelimit: Observed,
        /// `/v1/responses` only.
        produced: Option<Box<Produced>>,
        /// The address that answered, when the endpoint has several.
        address: Option<Arc<str>>,
    },
    Stream {
        prelude: Vec<Bytes>,
        rest: ByteStream,
        parser: SseParser,
        done_seen: bool,
        ttft: Duration,
        usage: Option<Usage>,
        out_chars: usize,
        usage_tap: Option<upstream::ollama::UsageTap>,
        ratelimit: Observed,
        /// `/v1/responses` only.
        produced: Option<Box<Produced>>,
        /// The address that answered, when the endpoint has several.
        address: Option<Arc<str>>,
    },
}

impl Success {
    /// The address that answered, when the endpoint has several.
    pub fn address(&self) -> Option<&Arc<str>> {
        match self {
            Success::Full { address, .. } | Success::Stream { address, .. } => address.as_ref(),
        }
    }

    /// What the response's `x-ratelimit-*` headers said.
    pub fn ratelimit(&self) -> &Observed {
        match self {
            Success::Full { ratelimit, .. } | Success::Stream { ratelimit, .. } => ratelimit,
        }
    }
}

/// `$f`, unless `$timer` (a pinned `Sleep`) fires first (`None`): [`tokio::time::timeout_at`]
/// with a timer given, so that the waits of one attempt under one deadline share one timer (a
/// tokio timer registered and removed costs about as much as reading an answer's headers). A
/// macro, not an `async fn`: a function's future would hold `$f` twice (its argument and the
/// `select!` inside), and the executor's future, moved into its box on every request, with it.
///
/// `$request` is the request's deadline, which caps `$timer`'s: while `$timer` is pending it
/// covers it, and the request's own timer is not made ([`super::deadline`]).
macro_rules! within {
    ($timer:expr, $request:expr, $f:expr) => {
        tokio::select! {
            biased;
            v = $f => Some(v),
            () = super::deadline::Covering { timer: $timer.as_mut(), request: $request } => None,
        }
    };
}

/// The upstream call (`Prepared::send`, 3 KB of state through the connection pool and
/// hyper's) is boxed where `full` and `stream` await it, so it does not size every future that
/// awaits an attempt (`docs/benchmarks.md`).
///
/// Everything one attempt needs, borrowed from the request.
pub(super) struct Attempt<'a> {
    pub ep: &'a Endpoint,
    pub key: Option<&'a Secret>,
    pub req: &'a Inbound,
    /// The request's id, and the attempt span's `traceparent` when it is traced.
    pub ids: upstream::Ids<'a>,
    /// The request's own deadline (`routing_policy.request_timeout`): caps every timeout here.
    pub deadline: Instant,
    /// `routing_policy.max_cooldown`: the longest stay-away an upstream's hint may ask for.
    pub max_cooldown: Duration,
    /// `server.max_response_bytes`: the most of an answer read whole.
    pub max_answer: usize,
    /// A discovered task's address, for `discover: docker` endpoints.
    pub base: Option<&'a str>,
    /// `key` is the request's own (`x-encrypted-key`).
    pub own_key: bool,
    /// `limits.max_event_bytes`: one SSE event larger than this fails the attempt over.
    pub max_event: usize,
    /// A Responses request goes to this endpoint translated to chat.
    pub translate: bool,
    /// The Responses request's own part (its response id, the echo its answers carry).
    pub responses: Option<&'a super::responses::ResponsesCtx>,
}

impl<'a> Attempt<'a> {
    /// A non-2xx answer to this attempt, read (within `deadline`) and classified. Its callers
    /// box it: held inline, its 0.9 KB sized every attempt's future and every future above it.
    async fn failed(&self, resp: Answer, deadline: Instant) -> Failure {
        let status = resp.status.as_u16();
        let mut f = read_error(
            self.ep,
            self.key,
            self.own_key,
            resp,
            deadline,
            self.max_cooldown,
        )
        .await;
        if self.req.op == Op::Responses && !self.translate && matches!(status, 404 | 405) {
            f.class = responses_404(&f.detail, self.req, f.class);
            if f.class != Outcome::Client {
                f.passthrough = None;
            }
        }
        f
    }

    /// The upstream request (payload hygiene, adapter) and how many characters hygiene changed.
    /// Synchronous, so the caller counts the call before anything is awaited; `Err` means the
    /// request cannot be expressed for this endpoint and never left the gateway.
    pub(super) fn prepare(&self, stream: bool) -> Result<(Prepared<'a>, u64), Failure> {
        upstream::request(
            self.ep,
            self.req,
            stream,
            self.key,
            self.ids,
            self.base,
            self.translate,
        )
        .map_err(|u| Failure::new(Outcome::Unsupported, None, u.0))
    }

    /// A non-stream attempt sent `now`: the whole answer under `timeouts.total` from then.
    pub(super) async fn full(&self, rb: Prepared<'_>, now: Instant) -> Result<Success, Failure> {
        let ep = self.ep;
        // Each attempt's timeouts are capped by what is left of the request's own deadline.
        let deadline = (super::after(now, ep.timeouts.total)).min(self.deadline);
        let timer = sleep_until(deadline);
        tokio::pin!(timer);
        let resp = match within!(timer, self.deadline, rb.send()) {
            None => {
                return Err(Failure::new(
                    Outcome::Timeout,
                    None,
                    "no response within timeouts.total",
                ));
            }
            Some(Err(e)) => return Err(send_error(e)),
            Some(Ok(r)) => r,
        };
        if !resp.status.is_success() {
            return Err(Box::pin(self.failed(resp, deadline)).await);
        }
        let ratelimit = classify::ratelimit_headers(&resp.headers, self.max_cooldown);
        let status = resp.status;
        let content_type = resp.headers.get(header::CONTENT_TYPE).cloned();
        let body = match within!(timer, self.deadline, resp.bytes(self.max_answer)) {
            None => {
                return Err(Failure::new(
                    Outcome::Timeout,
                    Some(status.as_u16()),
                    "body not complete within timeouts.total",
                ));
            }
            Some(Err(e @ upstream::BodyError::TooLarge(_))) => {
                // The upstream's doing; the rest is never read (the connection is dropped).
                return Err(Failure::new(
                    Outcome::Malformed,
                    Some(status.as_u16()),
                    format!("2xx {e} (server.max_response_bytes)"),
                ));
            }
            Some(Err(e)) => {
                return Err(Failure::new(
                    Outcome::Connection,
                    Some(status.as_u16()),
                    format!("reading body: {e}"),
                ));
            }
            Some(Ok(b)) => b,
        };
        if self.req.op == Op::Responses {
            return self.full_response(status, content_type, &body, ratelimit);
        }
        if ep.kind == EndpointKind::Ollama {
            let parsed: Value = serde_json::from_slice(&body).map_err(|e| {
                Failure::new(
                    Outcome::Malformed,
                    Some(status.as_u16()),
                    format!("2xx body is not JSON: {e}"),
                )
            })?;
            let translated = upstream::ollama::response_body(
                self.req.op,
                &self.req.model,
                self.req.body(),
                &parsed,
            )
            .map_err(|m| {
                let class = if classify::is_context_message(&m) {
                    Outcome::ContextLength
                } else {
                    Outcome::InBand
                };
                Failure::new(class, Some(status.as_u16()), m)
            })?;
            let usage = wire::usage_of(&translated);
            let out_chars = if usage.is_none() {
                response_text_chars(&translated)
            } else {
                0
            };
            return Ok(Success::Full {
                status,
                content_type: Some(HeaderValue::from_static("application/json")),
                body: Bytes::from(translated.to_string()),
                usage,
                out_chars,
                ratelimit,
                produced: None,
                address: None,
            });
        }
        let answer = wire::answer::read(&body).map_err(|e| {
            Failure::new(
                Outcome::Malformed,
                Some(status.as_u16()),
                format!("2xx body is not JSON: {e}"),
            )
        })?;
        let usage = answer.usage;
        let mut out_chars = 0;
        if answer.error || usage.is_none() {
            // Rare paths (an error inside a 200, or no usage to record): read the whole tree.
            let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if let ChunkKind::Error(msg) = wire::classify_chunk(&parsed) {
                return Err(Failure::new(Outcome::InBand, Some(status.as_u16()), msg).billed(usage));
            }
            out_chars = response_text_chars(&parsed);
        }
        Ok(Success::Full {
            status,
            content_type,
            body,
            usage,
            out_chars,
            ratelimit,
            produced: None,
            address: None,
        })
    }

    /// A whole `/v1/responses` answer: the endpoint's Response object with the gateway's id, or
    /// the chat answer (Ollama's translated to chat first) as a Response object.
    fn full_response(
        &self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: &Bytes,
        ratelimit: Observed,
    ) -> Result<Success, Failure> {
        let code = Some(status.as_u16());
        let Some(ctx) = self.responses else {
            return Err(Failure::new(Outcome::Malformed, code, "no response id"));
        };
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            Failure::new(
                Outcome::Malformed,
                code,
                format!("2xx body is not JSON: {e}"),
            )
        })?;
        let in_band = |m: String, usage: Option<Usage>| {
            let class = if classify::is_context_message(&m) {
                Outcome::ContextLength
            } else {
                Outcome::InBand
            };
            Failure::new(class, code, m).billed(usage)
        };
        let (answer, produced) = if self.translate {
            let chat = if self.ep.kind == EndpointKind::Ollama {
                upstream::ollama::response_body(Op::Chat, &self.req.model, self.req.body(), &v)
                    .map_err(|m| in_band(m, None))?
            } else {
                if let ChunkKind::Error(m) = wire::classify_chunk(&v) {
                    return Err(in_band(m, wire::usage_of(&v)));
                }
                v
            };
            let r = wire::responses::from_chat(&chat, &ctx.meta);
            (
                r,
                Produced {
                    translated: true,
                    upstream_id: None,
                    tap: None,
                },
            )
        } else {
            if let Some(m) = wire::responses::failed(&v) {
                return Err(in_band(m, wire::responses::usage_of(&v)));
            }
            let mut v = v;
            let up = upstream::responses::rewrite_id(&mut v, &ctx.id, ctx.previous.as_deref());
            (
                v,
                Produced {
                    translated: false,
                    upstream_id: up,
                    tap: None,
                },
            )
        };
        let usage = wire::responses::usage_of(&answer);
        let out_chars = if usage.is_none() {
            wire::responses::output_chars(&answer)
        } else {
            0
        };
        Ok(Success::Full {
            status,
            content_type: if self.translate { None } else { content_type },
            body: Bytes::from(answer.to_string()),
            usage,
            out_chars,
            ratelimit,
            produced: Some(Box::new(produced)),
            address: None,
        })
    }

    /// A stream attempt, up to its commit: the first content chunk (or `[DONE]`). Nothing of it
    /// has reached the client when this returns, so any `Err` can fail over invisibly.
    pub(super) async fn stream(&self, rb: Prepared<'_>, t0: Instant) -> Result<Success, Failure> {
        let ep = self.ep;
        let first_deadline = (t0 + ep.timeouts.first_token)
            .min(t0 + ep.timeouts.total)
            .min(self.deadline);
        // One timer for every wait up to the first content chunk.
        let timer = sleep_until(first_deadline);
        tokio::pin!(timer);
        let resp = match within!(timer, self.deadline, rb.send()) {
            None => {
                return Err(Failure::new(
                    Outcome::FirstTokenTimeout,
                    None,
                    "no response headers within timeouts.first_token",
                ));
            }
            Some(Err(e)) => return Err(send_error(e)),
            Some(Ok(r)) => r,
        };
        if !resp.status.is_success() {
            let deadline = (t0 + ep.timeouts.total).min(self.deadline);
            return Err(Box::pin(self.failed(resp, deadline)).await);
        }
        let ratelimit = classify::ratelimit_headers(&resp.headers, self.max_cooldown);
        let status = resp.status.as_u16();
        let mut usage_tap = None;
        let mut rest: ByteStream = if ep.kind == EndpointKind::Ollama {
            let include_usage = self
                .req
                .body()
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let responses = self.req.op == Op::Responses;
            let tr = upstream::ollama::StreamTranslator::new(
                if responses { Op::Chat } else { self.req.op },
                &self.req.model,
                include_usage || responses,
            );
            let (s, tap) = upstream::ollama::SseFromNdjson::new(resp.body, tr);
            usage_tap = Some(tap);
            Box::pin(s)
        } else {
            let is_sse = resp
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            if !is_sse {
                // A JSON body on a stream request is an error some servers send with 200.
                // Only an error's message is wanted from it: read no more than an error body.
                let body = within!(timer, self.deadline, resp.bytes(MAX_ERROR_BODY));
                let detail = match body {
                    Some(Ok(b)) => match serde_json::from_slice::<Value>(&b) {
                        Ok(v) => match wire::classify_chunk(&v) {
                            ChunkKind::Error(m) => {
                                return Err(Failure::new(Outcome::InBand, Some(status), m));
                            }
                            _ => "stream requested but the upstream answered with a non-SSE body"
                                .to_string(),
                        },
                        Err(_) => "stream requested but the upstream answered with a non-SSE body"
                            .to_string(),
                    },
                    _ => {
                        "stream requested but the upstream answered with a non-SSE body".to_string()
                    }
                };
                return Err(Failure::new(Outcome::Malformed, Some(status), detail));
            }
            resp.body
        };
        let mut produced = None;
        if self.req.op == Op::Responses {
            let Some(ctx) = self.responses else {
                return Err(Failure::new(
                    Outcome::Malformed,
                    Some(status),
                    "no response id",
                ));
            };
            if self.translate {
                rest = Box::pin(upstream::responses::FromChat::new(
                    rest,
                    ctx.meta.clone(),
                    self.max_event,
                    self.max_answer.min(crate::wire::responses::TRANSLATED_MAX),
                ));
                produced = Some(Box::new(Produced {
                    translated: true,
                    upstream_id: None,
                    tap: None,
                }));
            } else {
                let (s, tap) = upstream::responses::Rewrite::new(
                    rest,
                    ctx.id.clone(),
                    ctx.previous.clone(),
                    self.max_event,
                );
                rest = Box::pin(s);
                produced = Some(Box::new(Produced {
                    translated: false,
                    upstream_id: None,
                    tap: Some(tap),
                }));
            }
        }
        let mut parser = SseParser::with_max_event(self.max_event);
        let mut prelude = Vec::new();
        let mut held = 0usize;
        let mut usage = None;
        let mut out_chars = 0usize;
        let mut skim = wire::scan::Skim::default();
        loop {
            let next = match within!(timer, self.deadline, rest.next()) {
                None => {
                    return Err(Failure::new(
                        Outcome::FirstTokenTimeout,
                        Some(status),
                        format!(
                            "no content within timeouts.first_token ({}ms)",
                            ep.timeouts.first_token.as_millis()
                        ),
                    ));
                }
                Some(None) => {
                    return Err(Failure::new(
                        Outcome::Connection,
                        Some(status),
                        "stream ended before any content",
                    ));
                }
                Some(Some(Err(e))) => {
                    return Err(Failure::new(
                        Outcome::Connection,
                        Some(status),
                        format!("stream broke before any content: {}", error_chain(&*e)),
                    ));
                }
                Some(Some(Ok(b))) => b,
            };
            // Held until the first content chunk: bounded like a whole answer, so an upstream
            // sending preamble (role chunks, comments) without end cannot grow it for the whole
            // of `timeouts.first_token`.
            held += next.len();
            if held > self.max_answer {
                return Err(Failure::new(
                    Outcome::Malformed,
                    Some(status),
                    format!(
                        "stream preamble larger than {} bytes before any content (server.max_response_bytes)",
                        self.max_answer
                    ),
                ));
            }
            let mut commit = false;
            let mut done_seen = false;
            // The first failure an event gives; the events after it are not read.
            let mut failed: Option<Failure> = None;
            let read = parser.push_each(&next, |ev| {
                if failed.is_some() {
                    return;
                }
                if ev.data.trim() == "[DONE]" {
                    done_seen = true;
                    commit = true;
                    return;
                }
                // The plain chunk, read without a `Value` tree, as the committed stream reads it
                // (an upstream that writes fast puts much of its stream in this first read).
                if produced.is_none()
                    && ev.event != Some("error")
                    && let Some(p) = wire::chunk::read_next(&mut skim, ev.data)
                {
                    if let Some(u) = p.usage {
                        usage = Some(u);
                    }
                    if p.content {
                        out_chars += p.text_bytes;
                        commit = true;
                    }
                    return;
                }
                let v: Value = match serde_json::from_str(ev.data) {
                    Ok(v) => v,
                    Err(_) if ev.event == Some("error") => {
                        failed = Some(Failure::new(
                            Outcome::InBand,
                            Some(status),
                            ev.data.to_string(),
                        ));
                        return;
                    }
                    Err(e) => {
                        failed = Some(Failure::new(
                            Outcome::Malformed,
                            Some(status),
                            format!("SSE data is not JSON: {e}"),
                        ));
                        return;
                    }
                };
                if produced.is_some() {
                    // A Responses event: the response's usage comes with its end.
                    if let Some(u) = wire::responses::usage_of(&v) {
                        usage = Some(u);
                    }
                    if wire::responses::is_terminal(&v) {
                        done_seen = true;
                    }
                } else if let Some(u) = wire::usage_of(&v) {
                    usage = Some(u);
                }
                let kind = if produced.is_some() {
                    wire::responses::classify_event(&v)
                } else {
                    wire::classify_chunk(&v)
                };
                match kind {
                    ChunkKind::Error(m) => {
                        let class = if classify::is_context_message(&m) {
                            Outcome::ContextLength
                        } else {
                            Outcome::InBand
                        };
                        failed = Some(Failure::new(class, Some(status), m).billed(usage));
                    }
                    ChunkKind::Content => {
                        out_chars += if produced.is_some() {
                            wire::responses::delta_chars(&v)
                        } else {
                            chunk_text_chars(&v)
                        };
                        commit = true;
                    }
                    ChunkKind::Preamble => {}
                }
            });
            // Bytes that are not SSE fail the attempt whatever their events said.
            read.map_err(|e| {
                Failure::new(
                    Outcome::Malformed,
                    Some(status),
                    format!("invalid SSE: {}", e.0),
                )
            })?;
            if let Some(f) = failed {
                return Err(f);
            }
            prelude.push(next);
            if commit {
                return Ok(Success::Stream {
                    prelude,
                    rest,
                    parser,
                    done_seen,
                    ttft: t0.elapsed(),
                    usage,
                    out_chars,
                    usage_tap,
                    ratelimit,
                    produced,
                    address: None,
                });
            }
        }
    }
}

/// What a 404 (or 405) to a `/responses` call means: the upstream lost the response a
/// `previous_response_id` names (its message says so), the model is missing (its message names
/// a model), or — anything else, a server with no such route — it speaks only chat.
fn responses_404(detail: &str, req: &Inbound, class: Outcome) -> Outcome {
    let d = detail.to_ascii_lowercase();
    let continues = req
        .body()
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null());
    // An id the request carried, named in the answer: the 404 is about the request (its
    // conversation, a stored item, a file), the client's own business.
    let names_own_id = request_ids(req.body()).any(|id| id.len() >= 3 && detail.contains(id));
    if continues && (d.contains("previous") || d.contains("response")) {
        Outcome::PreviousResponseLost
    } else if names_own_id {
        Outcome::Client
    } else if d.contains("model") {
        class
    } else {
        Outcome::ResponsesUnsupported
    }
}

/// The ids a Responses request names: `conversation` (a string, or an object's `id`),
/// `previous_response_id`, and the `id`s and `file_id`s of its input items and tools (one level
/// down, where the API puts them).
fn request_ids(body: &serde_json::Map<String, Value>) -> impl Iterator<Item = &str> {
    let conv = match body.get("conversation") {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str),
        _ => None,
    };
    let prev = body.get("previous_response_id").and_then(Value::as_str);
    let items = ["input", "tools"]
        .into_iter()
        .filter_map(|k| body.get(k).and_then(Value::as_array))
        .flatten()
        .filter_map(Value::as_object)
        .flat_map(|o| {
            ["id", "file_id", "vector_store_ids"]
                .into_iter()
                .filter_map(|k| o.get(k))
                .flat_map(|v| match v {
                    Value::String(s) => vec![s.as_str()],
                    Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                    _ => Vec::new(),
                })
        });
    conv.into_iter().chain(prev).chain(items)
}

/// A non-2xx answer: its class, the upstream's hint, and for client errors its own response.
async fn read_error(
    ep: &Endpoint,
    key: Option<&Secret>,
    own_key: bool,
    resp: Answer,
    deadline: Instant,
    max_cooldown: Duration,
) -> Failure {
    let status = resp.status;
    let headers = resp.headers;
    let mut body = Vec::new();
    let mut stream = resp.body;
    while body.len() < MAX_ERROR_BODY {
        match timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(b))) => body.extend_from_slice(&b),
            _ => break,
        }
    }
    body.truncate(MAX_ERROR_BODY);
    let text = String::from_utf8_lossy(&body).into_owned();
    let class = classify::classify_status(status.as_u16(), &text);
    let mut f = Failure::new(class, Some(status.as_u16()), error_message(&text));
    let seen = classify::ratelimit_headers(&headers, max_cooldown);
    if !seen.is_empty() {
        f.ratelimit = Some(Box::new(seen));
    }
    if class == Outcome::RateLimited {
        f.retry_after = classify::retry_after(&headers, max_cooldown);
    }
    // Client errors and context refusals may go back to the client as they are; so may what an
    // upstream said of the request's own key (`x-encrypted-key`): its 429 (with the headers
    // that say when to come back), 404 or 410.
    let own_key_answer = own_key
        && matches!(
            class,
            Outcome::RateLimited | Outcome::Gone | Outcome::ModelMissing
        );
    if matches!(class, Outcome::Client | Outcome::ContextLength) || own_key_answer {
        let mut h = HeaderMap::new();
        if own_key_answer {
            for (name, value) in &headers {
                let n = name.as_str();
                if n == "retry-after" || n == "retry-after-ms" || n.starts_with("x-ratelimit-") {
                    h.insert(name.clone(), value.clone());
                }
            }
        }
        let body = if ep.kind == EndpointKind::Ollama {
            // Ollama's `{"error": "..."}` becomes OpenAI's error shape for the client.
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            upstream::ollama::error_body(status.as_u16(), &body)
        } else {
            if let Some(ct) = headers.get(header::CONTENT_TYPE) {
                h.insert(header::CONTENT_TYPE, ct.clone());
            }
            Bytes::from(body)
        };
        // Passed on as it is — but an upstream that quotes the endpoint's key, a credential
        // header or the request's own key (`x-encrypted-key`) must not hand it to the client.
        let body = classify::redact_exact(body, &ep.secret_values_with(key));
        f.passthrough = Some(Box::new((status, h, body)));
    }
    f
}

/// Characters of generated text in a full response, for estimating completion tokens.
fn response_text_chars(v: &Value) -> usize {
    choices_text_chars(v, "message")
}

/// The same for one stream chunk.
pub(super) fn chunk_text_chars(v: &Value) -> usize {
    choices_text_chars(v, "delta")
}

/// Characters of every choice's `content` (in `message` or `delta`) and legacy `text`. Looked
/// up key by key: `Value::pointer` allocates two strings a path segment (its `~` unescaping),
/// which made it the costliest step of a streamed chunk.
fn choices_text_chars(v: &Value, inner: &str) -> usize {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return 0;
    };
    let len = |x: Option<&Value>| x.and_then(Value::as_str).map_or(0, str::len);
    choices
        .iter()
        .map(|c| len(c.get(inner).and_then(|m| m.get("content"))) + len(c.get("text")))
        .sum()
}

/// The message inside an upstream error body, whatever its shape (OpenAI's `error.message`,
/// vLLM's top-level `message`, Ollama's `error` string), else the body itself.
pub(super) fn error_message(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        if let Some(m) = v.pointer("/error/message").and_then(Value::as_str) {
            return m.to_string();
        }
        if let Some(m) = v.get("error").and_then(Value::as_str) {
            return m.to_string();
        }
        if let Some(m) = v.get("message").and_then(Value::as_str) {
            return m.to_string();
        }
        if let Some(m) = v.get("detail").and_then(Value::as_str) {
            return m.to_string();
        }
    }
    body.chars().take(300).collect()
}

pub(super) use crate::upstream::error_chain;

fn send_error(e: SendError) -> Failure {
    let class = if e.out_of_files {
        Outcome::OutOfFiles
    } else if e.connect {
        Outcome::Connect
    } else {
        Outcome::Connection
    };
    let mut f = Failure::new(class, None, e.shown);
    f.internal = Some(e.internal);
    f
}
