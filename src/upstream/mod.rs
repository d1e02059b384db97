//! Protocol adapters: how a validated OpenAI-shaped request becomes an HTTP request to each kind
//! of upstream, and how the answer comes back in OpenAI's wire format. One `match` on the
//! endpoint kind, no trait objects. vLLM and other OpenAI-compatible servers reuse the OpenAI path
//! unchanged (unknown fields pass through); Ollama goes through its native API with the
//! translation in [`ollama`].

pub mod classify;
pub mod h1pool;
pub mod metrics;
pub mod ollama;
pub mod responses;
pub mod tokenize;

use std::fmt;
use std::pin::Pin;

use bytes::Bytes;
use futures_util::{Stream, TryStreamExt};
use http_body_util::{BodyExt, Full};
use serde_json::{Map, Value};

use crate::config::{DirectClient, Endpoint, EndpointKind, PlainPool, Secret};
use crate::wire::{Inbound, Op, TokenField};

/// The body sent upstream: the client's body with `model` replaced by the endpoint's id and,
/// when the client asked for more, `max_tokens` capped at the endpoint's configured maximum. Every
/// other field passes through untouched. `raw`, the client's bytes while they say exactly what
/// `client` holds, is patched when no cap applies ([`crate::wire::patch`]); otherwise the map is
/// serialised, without copying it.
pub fn body(ep: &Endpoint, op: Op, client: &Map<String, Value>, raw: Option<&[u8]>) -> Vec<u8> {
    let cap = match op {
        Op::Chat | Op::Completions | Op::Responses => ep.max_tokens,
        Op::Embeddings => None,
    };
    let capped = cap.is_some()
        && ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .iter()
            .any(|k| {
                client
                    .get(*k)
                    .is_some_and(|v| over_cap(k, v, cap).is_some())
            });
    if !capped
        && let Some(patched) = raw.and_then(|r| crate::wire::patch::model(r, &ep.upstream_model))
    {
        return patched;
    }
    serde_json::to_vec(&Outgoing {
        map: client,
        model: &ep.upstream_model,
        cap,
    })
    .unwrap_or_default()
}

/// [`body`] for a request read as plain ([`Inbound::model_span`]), without its map: the
/// client's bytes with `model` patched at the span the read found, unless a cap applies
/// (`None`: the caller serialises the map).
fn plain_body(ep: &Endpoint, req: &Inbound) -> Option<Vec<u8>> {
    let (raw, span) = (req.raw()?, req.model_span()?);
    let cap = match req.op {
        Op::Chat | Op::Completions | Op::Responses => ep.max_tokens,
        Op::Embeddings => None,
    };
    if let Some(cap) = cap
        && TokenField::ALL
            .into_iter()
            .any(|f| req.token_field(f).flatten().is_some_and(|n| n > cap))
    {
        return None;
    }
    crate::wire::patch::at(raw, span, &ep.upstream_model)
}

/// The cap to send instead of `v` when `key` asks for more tokens than the endpoint allows.
fn over_cap(key: &str, v: &Value, cap: Option<u64>) -> Option<u64> {
    match (key, cap, v.as_u64()) {
        ("max_tokens" | "max_completion_tokens" | "max_output_tokens", Some(cap), Some(n))
            if n > cap =>
        {
            Some(cap)
        }
        _ => None,
    }
}

struct Outgoing<'a> {
    map: &'a Map<String, Value>,
    model: &'a str,
    cap: Option<u64>,
}

impl serde::Serialize for Outgoing<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if !self.map.contains_key("model") {
            m.serialize_entry("model", self.model)?;
        }
        for (k, v) in self.map {
            if k == "model" {
                m.serialize_entry(k, self.model)?;
            } else if let Some(cap) = over_cap(k, v, self.cap) {
                m.serialize_entry(k, &cap)?;
            } else {
                m.serialize_entry(k, v)?;
            }
        }
        m.end()
    }
}

/// What identifies an attempt to its upstream: the request's id (`x-request-id`) and, when the
/// request is traced, the attempt span's W3C `traceparent` and the client's `tracestate`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ids<'a> {
    pub request: &'a str,
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
}

impl<'a> Ids<'a> {
    /// A request's id alone (untraced).
    pub fn request(request: &'a str) -> Ids<'a> {
        Ids {
            request,
            ..Ids::default()
        }
    }
}

/// Builds the request for one attempt, with the endpoint's payload hygiene applied; returns it
/// with the number of characters hygiene changed. `Err` when the request cannot be expressed in
/// the endpoint's protocol (the executor skips the endpoint without holding it against it).
/// `translate`: a Responses request goes as the chat request that says the same
/// ([`crate::wire::responses::to_chat`]), to the endpoint's chat path.
pub fn request<'a>(
    ep: &'a Endpoint,
    req: &Inbound,
    stream: bool,
    key: Option<&'a Secret>,
    ids: Ids<'a>,
    discovered_base: Option<&str>,
    translate: bool,
) -> Result<(Prepared<'a>, u64), ollama::Unsupported> {
    // Hygiene reads the body only when it is on; what it changed is sent as a map (the
    // client's bytes no longer say what the body holds).
    let (cleaned, sanitized) = match ep.payload_hygiene {
        crate::config::Hygiene::Off => (None, 0),
        mode => match crate::wire::hygiene::apply(req.body(), mode) {
            (std::borrow::Cow::Owned(m), n) => (Some(m), n),
            (std::borrow::Cow::Borrowed(_), n) => (None, n),
        },
    };
    let (op, cleaned) = if req.op == Op::Responses && translate {
        let mut chat =
            crate::wire::responses::to_chat(cleaned.as_ref().unwrap_or_else(|| req.body()))
                .map_err(|e| ollama::Unsupported(e.to_string()))?;
        chat.insert("model".into(), Value::String(req.model.clone()));
        if stream {
            chat.insert("stream".into(), Value::Bool(true));
            // The usage of the answer, which the Response object carries.
            chat.insert(
                "stream_options".into(),
                serde_json::json!({"include_usage": true}),
            );
        }
        (Op::Chat, Some(chat))
    } else {
        (req.op, cleaned)
    };
    let payload = match (ep.kind, &cleaned) {
        // An Ollama endpoint given the `responses` capability: its OpenAI-compatible path.
        (EndpointKind::Ollama, _) if op == Op::Responses => {
            body(ep, op, cleaned.as_ref().unwrap_or_else(|| req.body()), None)
        }
        (EndpointKind::Openai | EndpointKind::Vllm, Some(m)) => body(ep, op, m, None),
        (EndpointKind::Openai | EndpointKind::Vllm, None) => {
            plain_body(ep, req).unwrap_or_else(|| body(ep, op, req.body(), req.raw()))
        }
        (EndpointKind::Ollama, cleaned) => serde_json::to_vec(&ollama::request_body(
            ep,
            op,
            cleaned.as_ref().unwrap_or_else(|| req.body()),
            stream,
        )?)
        .unwrap_or_default(),
    };
    let payload = Bytes::from(if ep.payload_hygiene == crate::config::Hygiene::Escape {
        crate::wire::hygiene::escape_wire(payload)
    } else {
        payload
    });
    let url = match discovered_base {
        // A discovered task's address: built per request (it moves as tasks come and go).
        Some(base) => Some(
            reqwest::Url::parse(&crate::config::url_for(ep.kind, base, op))
                .map_err(|e| ollama::Unsupported(format!("discovered address {base}: {e}")))?,
        ),
        None => None,
    };
    // The configured address of a plain-`http` endpoint: its own connections.
    if let (Some(plain), None) = (&ep.plain, &url) {
        let again = Again {
            ep,
            op,
            key,
            ids,
            payload,
            uri: None,
        };
        if let Some(req) = again.pooled(plain) {
            return Ok((Prepared::Pooled(&plain.pool, req, again), sanitized));
        }
        // A header the `http` crate refuses: reqwest reports it as it always did.
        return Ok((
            reqwest_request(ep, None, op, key, ids, again.payload),
            sanitized,
        ));
    }
    if let Some(direct) = &ep.direct {
        // A discovered task's address (kept for the copy), else the endpoint's configured one.
        let discovered = match &url {
            Some(u) => u.as_str().parse::<http::Uri>().ok().map(Some),
            None => Some(None),
        };
        if let Some(uri) = discovered {
            let again = Again {
                ep,
                op,
                key,
                ids,
                payload,
                uri,
            };
            if let Some(req) = again.direct() {
                return Ok((Prepared::Direct(direct, req, again), sanitized));
            }
            // A header the `http` crate refuses: reqwest reports it as it always did.
            return Ok((
                reqwest_request(ep, url, op, key, ids, again.payload),
                sanitized,
            ));
        }
    }
    Ok((reqwest_request(ep, url, op, key, ids, payload), sanitized))
}

/// The request through reqwest, to `url` (a discovered task's) or the endpoint's configured URL.
fn reqwest_request(
    ep: &Endpoint,
    url: Option<reqwest::Url>,
    op: Op,
    key: Option<&Secret>,
    ids: Ids<'_>,
    payload: Bytes,
) -> Prepared<'static> {
    // Parsed once per config load; cloning a `Url` skips reqwest's parse (and IDNA) per call.
    let url = url.unwrap_or_else(|| ep.urls[op as usize].clone());
    let mut rb = ep
        .client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", ids.request)
        .body(payload);
    if let Some(t) = ids.traceparent {
        rb = rb.header("traceparent", t);
        if let Some(s) = ids.tracestate {
            rb = rb.header("tracestate", s);
        }
    }
    if let Some(k) = key {
        rb = rb.bearer_auth(k.expose());
    }
    for (k, v) in &ep.headers {
        rb = rb.header(k.as_str(), v.expose());
    }
    Prepared::Reqwest(rb)
}

/// What an attempt's request was built from, to build it once more should the upstream close
/// the connection without answering it ([`send_resending`]). Only then: building the copy up
/// front, as `http::Request` has no cheap clone, cost a request's headers copied and dropped
/// on every attempt.
pub struct Again<'a> {
    ep: &'a Endpoint,
    op: Op,
    key: Option<&'a Secret>,
    ids: Ids<'a>,
    payload: Bytes,
    /// A discovered task's address; `None`: the endpoint's configured one.
    uri: Option<http::Uri>,
}

impl Again<'_> {
    /// The request for a plain-`http` endpoint's own connections, with the `Host` hyper-util's
    /// client would have added (hyper writes the request as it is), unless the endpoint's own
    /// headers set one.
    fn pooled(&self, plain: &crate::config::Plain) -> Option<http::Request<Full<Bytes>>> {
        let mut req = direct_request(
            self.ep,
            plain.paths[self.op as usize].clone(),
            self.key,
            self.ids,
            self.payload.clone(),
        )?;
        req.headers_mut()
            .entry(http::header::HOST)
            .or_insert_with(|| plain.host.clone());
        Some(req)
    }

    /// The request for the direct client.
    fn direct(&self) -> Option<http::Request<Full<Bytes>>> {
        let uri = match &self.uri {
            Some(u) => u.clone(),
            None => self.ep.uris[self.op as usize].clone(),
        };
        direct_request(self.ep, uri, self.key, self.ids, self.payload.clone())
    }
}

/// The same request for the direct client, with the headers reqwest sent (`accept: */*`
/// included); `None` when a header value cannot be expressed.
fn direct_request(
    ep: &Endpoint,
    uri: http::Uri,
    key: Option<&Secret>,
    ids: Ids<'_>,
    payload: Bytes,
) -> Option<http::Request<Full<Bytes>>> {
    use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue};
    // Built in place: the request builder moves its parts through a closure per header.
    let mut req = http::Request::new(Full::new(payload));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    let h = req.headers_mut();
    h.reserve(5 + ep.headers.len());
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(ACCEPT, HeaderValue::from_static("*/*"));
    h.insert(
        crate::wire::names::X_REQUEST_ID,
        HeaderValue::from_str(ids.request).ok()?,
    );
    if let Some(t) = ids.traceparent {
        h.insert("traceparent", HeaderValue::from_str(t).ok()?);
        if let Some(s) = ids.tracestate.and_then(|s| HeaderValue::from_str(s).ok()) {
            h.insert("tracestate", s);
        }
    }
    if let Some(k) = key {
        let mut v = HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok()?;
        v.set_sensitive(true);
        h.insert(AUTHORIZATION, v);
    }
    for (k, v) in &ep.headers {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).ok()?,
            HeaderValue::from_str(v.expose()).ok()?,
        );
    }
    Some(req)
}

/// Errors of an upstream body stream, whichever client read it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An upstream body as it arrives.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, BoxError>> + Send>>;

/// A request ready to go: on the endpoint's direct client, or through reqwest (a proxy is
/// configured, or a header only reqwest would report).
pub enum Prepared<'a> {
    Direct(&'a DirectClient, http::Request<Full<Bytes>>, Again<'a>),
    /// The same with its own handle on the client (a hedged attempt outlives the borrow).
    DirectOwned(Box<DirectClient>, http::Request<Full<Bytes>>),
    /// On a plain-`http` endpoint's own connections.
    Pooled(&'a PlainPool, http::Request<Full<Bytes>>, Again<'a>),
    /// The same, outliving the borrow (a hedged attempt).
    PooledOwned(PlainPool, http::Request<Full<Bytes>>),
    Reqwest(reqwest::RequestBuilder),
}

/// An upstream's answer: status and headers, and the body as a stream.
pub struct Answer {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: ByteStream,
}

/// Why an answer could not be read whole.
#[derive(Debug)]
pub enum BodyError {
    /// It grew past the limit given (the upstream's fault: refused, and the rest never read).
    TooLarge(usize),
    /// The connection failed while it was read.
    Read(BoxError),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::TooLarge(limit) => write!(f, "answer larger than {limit} bytes"),
            BodyError::Read(e) => f.write_str(&error_chain(&**e)),
        }
    }
}

impl Answer {
    /// The whole body, however it arrives, up to `limit` bytes: an upstream that sends more
    /// (a bug, or a body that never ends) must not grow this process's memory without bound.
    pub async fn bytes(mut self, limit: usize) -> Result<Bytes, BodyError> {
        use futures_util::StreamExt;
        let mut next = async || self.body.next().await.transpose().map_err(BodyError::Read);
        let Some(first) = next().await? else {
            return Ok(Bytes::new());
        };
        if first.len() > limit {
            return Err(BodyError::TooLarge(limit));
        }
        // The common case, one chunk: no copy.
        let Some(second) = next().await? else {
            return Ok(first);
        };
        let mut all = bytes::BytesMut::with_capacity(first.len() + second.len());
        all.extend_from_slice(&first);
        let mut more = Some(second);
        while let Some(b) = more {
            if all.len() + b.len() > limit {
                return Err(BodyError::TooLarge(limit));
            }
            all.extend_from_slice(&b);
            more = next().await?;
        }
        Ok(all.freeze())
    }
}

impl From<reqwest::Response> for Answer {
    fn from(resp: reqwest::Response) -> Answer {
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.bytes_stream().map_err(BoxError::from);
        Answer {
            status,
            headers,
            body: Box::pin(body),
        }
    }
}

/// A reqwest response's body, up to `limit` bytes (probes, `/tokenize`), read as
/// [`Answer::bytes`] reads the request path's.
pub async fn reqwest_body(r: reqwest::Response, limit: usize) -> Result<Bytes, BodyError> {
    Answer::from(r).bytes(limit).await
}

/// Times a connection to an upstream (a request's or a probe's) could not be made because this
/// process was out of file descriptors: the prober reads it to tell a round whose failures were
/// the gateway's own (see [`out_of_files`]).
static OUT_OF_FILES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times [`out_of_files`] has said yes since the process started.
pub fn out_of_files_count() -> u64 {
    OUT_OF_FILES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `e` (or an error it wraps) is this process — or the whole system — out of file
/// descriptors (`EMFILE`, `ENFILE`): the socket for a connection could not even be made. That
/// says nothing about the upstream, so it must not count against the endpoint (every endpoint
/// would be ejected at once, and stay out after the descriptors came back) nor make a probe call
/// it unhealthy. Counted (see [`out_of_files_count`]) and logged at warn when it says yes.
pub fn out_of_files(e: &(dyn std::error::Error + 'static)) -> bool {
    /// Linux's (and the BSDs') numbers; `std::io::ErrorKind` has no kind for either.
    const ENFILE: i32 = 23;
    const EMFILE: i32 = 24;
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(io.raw_os_error(), Some(ENFILE | EMFILE))
        {
            OUT_OF_FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(error = %io, "out of file descriptors: a connection to an upstream could not be made (not counted against it)");
            return true;
        }
        cur = err.source();
    }
    false
}

/// Why a request got no answer.
pub struct SendError {
    /// The connection could not be made (refused, unreachable, connect timeout, TLS).
    pub connect: bool,
    /// ...because this process was out of file descriptors ([`out_of_files`]): not the
    /// upstream's doing.
    pub out_of_files: bool,
    /// The error chain, without the URL (clients see this).
    pub shown: String,
    /// The same with the URL (a discovered task's address): for the audit row only.
    pub internal: String,
}

/// [`send_resending`] on the direct client. Not an `async fn`: it only builds
/// `send_resending`'s future, so the future the attempt boxes has one level fewer to be moved
/// through (`docs/benchmarks.md`).
fn send_direct<'c>(
    client: &'c DirectClient,
    req: http::Request<Full<Bytes>>,
    again: impl FnOnce() -> Option<http::Request<Full<Bytes>>> + 'c,
) -> impl Future<Output = Result<Answer, SendError>> + 'c {
    // Kept for the error's audit detail (a reference count).
    let uri = req.uri().clone();
    send_resending(
        req,
        again,
        move |r| client.request(r),
        closed_unanswered,
        |e| e.is_connect(),
        uri,
    )
}

/// [`send_direct`] on a plain-`http` endpoint's own connections.
fn send_pooled<'c>(
    pool: &'c PlainPool,
    req: http::Request<Full<Bytes>>,
    again: impl FnOnce() -> Option<http::Request<Full<Bytes>>> + 'c,
) -> impl Future<Output = Result<Answer, SendError>> + 'c {
    send_resending(
        req,
        again,
        move |r| pool.send(r),
        crate::upstream::h1pool::Error::closed_unanswered,
        crate::upstream::h1pool::Error::is_connect,
        pool.target(),
    )
}

/// Sends `req` with `send`, once more (`again` builds the copy) when the upstream closed the
/// connection unanswered, and gives the response as an [`Answer`] or the failure as a
/// [`SendError`] (`url` only in its audit text).
async fn send_resending<B, E, Fut>(
    req: http::Request<Full<Bytes>>,
    again: impl FnOnce() -> Option<http::Request<Full<Bytes>>>,
    send: impl Fn(http::Request<Full<Bytes>>) -> Fut,
    closed_unanswered: impl Fn(&E) -> bool,
    is_connect: impl Fn(&E) -> bool,
    url: impl fmt::Display,
) -> Result<Answer, SendError>
where
    Fut: Future<Output = Result<http::Response<B>, E>>,
    E: std::error::Error + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let result = match send(req).await {
        Err(e) if closed_unanswered(&e) => match again() {
            // A server closing a keep-alive connection just as the pool reuses it (uvicorn's
            // `timeout_keep_alive`, a proxy's idle timeout) answers nothing: the request is sent
            // once more on a fresh connection, as Go's net/http and Envoy's `reset` retry do,
            // instead of failing over from a healthy endpoint (and ejecting it after five).
            Some(copy) => {
                tracing::debug!(error = %error_chain(&e), "upstream closed the connection unanswered; sent again");
                send(copy).await
            }
            None => Err(e),
        },
        other => other,
    };
    match result {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let body = body.into_data_stream().map_err(Into::into);
            Ok(Answer {
                status: parts.status,
                headers: parts.headers,
                body: Box::pin(body),
            })
        }
        Err(e) => {
            let shown = format!("error sending request: {}", error_chain(&e));
            Err(SendError {
                connect: is_connect(&e),
                out_of_files: out_of_files(&e),
                internal: format!("{shown} (url {url})"),
                shown,
            })
        }
    }
}

/// The connection closed before any of the response arrived (hyper's "incomplete message"), or
/// the pooled connection was found closed as the request was being written ("canceled").
fn closed_unanswered(e: &hyper_util::client::legacy::Error) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(inner) = src {
        if let Some(h) = inner.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message() || h.is_canceled();
        }
        src = inner.source();
    }
    false
}

fn replay(req: &http::Request<Full<Bytes>>) -> http::Request<Full<Bytes>> {
    let mut r = http::Request::new(req.body().clone());
    *r.method_mut() = req.method().clone();
    *r.uri_mut() = req.uri().clone();
    *r.version_mut() = req.version();
    *r.headers_mut() = req.headers().clone();
    r
}

impl<'a> Prepared<'a> {
    /// The request with no borrow left (the client handle is cloned: a few reference counts).
    pub fn into_owned(self) -> Prepared<'static> {
        match self {
            Prepared::Direct(c, r, _) => Prepared::DirectOwned(Box::new(c.clone()), r),
            Prepared::DirectOwned(c, r) => Prepared::DirectOwned(c, r),
            Prepared::Pooled(p, r, _) => Prepared::PooledOwned(p.clone(), r),
            Prepared::PooledOwned(p, r) => Prepared::PooledOwned(p, r),
            Prepared::Reqwest(rb) => Prepared::Reqwest(rb),
        }
    }

    /// The request sent, as a boxed future: each kind of request boxes its own (the pooled
    /// one is the upstream call's state itself, not that state inside a future that matches on
    /// the kind), so the future an attempt awaits is one small box (`docs/benchmarks.md`).
    pub fn send(self) -> Sending<'a> {
        match self {
            Prepared::Direct(client, req, again) => {
                Box::pin(send_direct(client, req, move || again.direct()))
            }
            Prepared::DirectOwned(client, req) => {
                // Nothing left to build it from: the copy is taken now.
                let copy = replay(&req);
                Box::pin(async move { send_direct(&client, req, move || Some(copy)).await })
            }
            Prepared::Pooled(pool, req, again) => {
                let plain = again.ep.plain.as_ref();
                Box::pin(send_pooled(pool, req, move || {
                    plain.and_then(|p| again.pooled(p))
                }))
            }
            Prepared::PooledOwned(pool, req) => {
                let copy = replay(&req);
                Box::pin(async move { send_pooled(&pool, req, move || Some(copy)).await })
            }
            Prepared::Reqwest(rb) => Box::pin(async move {
                match rb.send().await {
                    Ok(resp) => Ok(Answer::from(resp)),
                    Err(e) => {
                        // reqwest's Display includes the URL: a discovered task's internal address,
                        // which belongs in the audit row, not in a client's 503 body.
                        let full = error_chain(&e);
                        let shown = match e.url() {
                            Some(u) => full.replace(&format!(" for url ({u})"), ""),
                            None => full.clone(),
                        };
                        Err(SendError {
                            connect: e.is_connect(),
                            out_of_files: out_of_files(&e),
                            shown,
                            internal: full,
                        })
                    }
                }
            }),
        }
    }
}

/// An upstream request on its way: [`Prepared::send`].
pub type Sending<'a> = Pin<Box<dyn Future<Output = Result<Answer, SendError>> + Send + 'a>>;

/// An error and its sources, each once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error wrapping another, as connectors wrap the socket's `io::Error`.
    #[derive(Debug)]
    struct Wrapped(std::io::Error);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("tcp connect error")
        }
    }
    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn out_of_files_is_emfile_or_enfile_anywhere_in_the_chain_and_nothing_else() {
        let before = out_of_files_count();
        for errno in [23, 24] {
            let e = Wrapped(std::io::Error::from_raw_os_error(errno));
            assert!(out_of_files(&e), "errno {errno}");
            assert!(out_of_files(&std::io::Error::from_raw_os_error(errno)));
        }
        assert!(out_of_files_count() >= before + 4, "each yes is counted");
        // Refused, unreachable, timed out, no route: the upstream's (or the network's) doing.
        for errno in [111, 101, 110, 113, 99] {
            let e = Wrapped(std::io::Error::from_raw_os_error(errno));
            assert!(!out_of_files(&e), "errno {errno}");
        }
        let other = std::io::Error::other("Too many open files");
        assert!(!out_of_files(&other), "by number, not by message");
    }

    fn answer(chunks: Vec<Result<&'static str, &'static str>>) -> Answer {
        let items: Vec<Result<Bytes, BoxError>> = chunks
            .into_iter()
            .map(|c| {
                c.map(|s| Bytes::from_static(s.as_bytes()))
                    .map_err(BoxError::from)
            })
            .collect();
        Answer {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: Box::pin(futures_util::stream::iter(items)),
        }
    }

    /// The client's bytes go upstream with only `model` replaced, unless the gateway changes
    /// the body: a `max_tokens` cap or payload hygiene serialise the parsed map instead.
    #[test]
    fn the_clients_bytes_are_patched_unless_the_body_changes() {
        let cfg = crate::config::Config::load(
            "models:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\", model: up, max_tokens: 100 }\n  h: { type: openai, base_url: \"http://127.0.0.1:9/v1\", model: up, payload_hygiene: strip }\n",
        )
        .unwrap();
        let (a, h) = (&cfg.endpoints["a"], &cfg.endpoints["h"]);
        let parse = |raw: &str| match serde_json::from_str(raw).unwrap() {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let raw = r#"{"model": "a", "max_tokens": 50, "messages": [{"role":"user","content":"hi"}], "temperature": 1e-1}"#;
        let sent = body(a, Op::Chat, &parse(raw), Some(raw.as_bytes()));
        assert_eq!(
            String::from_utf8(sent).unwrap(),
            raw.replace(r#""model": "a""#, r#""model": "up""#)
        );
        // Without the client's bytes (a continuation, say), the map is serialised.
        let sent = body(a, Op::Chat, &parse(raw), None);
        assert_eq!(
            serde_json::from_slice::<Value>(&sent).unwrap(),
            serde_json::json!({"model": "up", "max_tokens": 50, "messages": [{"role":"user","content":"hi"}], "temperature": 0.1})
        );
        // Over the endpoint's cap: serialised with the cap, not patched.
        let over = r#"{"model": "a", "max_tokens": 5000, "messages": []}"#;
        let sent: Value =
            serde_json::from_slice(&body(a, Op::Chat, &parse(over), Some(over.as_bytes())))
                .unwrap();
        assert_eq!(sent["max_tokens"], 100);
        assert_eq!(sent["model"], "up");
        // Hygiene that changed something: the cleaned map goes, not the client's bytes.
        let dirty =
            "{\"model\": \"a\", \"messages\": [{\"role\":\"user\",\"content\":\"x\\u0007y\"}]}";
        let dirty_req = crate::wire::read_request(Op::Chat, Bytes::from(dirty)).unwrap();
        assert!(dirty_req.model_span().is_some(), "read as plain");
        let (prepared, changed) =
            request(h, &dirty_req, false, None, Ids::request("r"), None, false).unwrap();
        assert_eq!(changed, 1);
        let Prepared::Pooled(_, req, _) = prepared else {
            panic!("a plain-http endpoint's own connections")
        };
        let sent = req.body().clone();
        let sent = futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(sent))
            .unwrap()
            .unwrap()
            .to_bytes();
        let sent: Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(sent["messages"][0]["content"], "xy");
        // A request read as plain (no map built): the same bytes as `body` patches, and over
        // the cap the map with the cap.
        let sent_by = |raw: &str| {
            let req = crate::wire::read_request(Op::Chat, Bytes::from(raw.to_string())).unwrap();
            assert!(req.model_span().is_some(), "read as plain: {raw}");
            let (prepared, _) =
                request(a, &req, false, None, Ids::request("r"), None, false).unwrap();
            let Prepared::Pooled(_, req, _) = prepared else {
                panic!("a plain-http endpoint's own connections")
            };
            futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(
                req.body().clone(),
            ))
            .unwrap()
            .unwrap()
            .to_bytes()
        };
        assert_eq!(
            sent_by(raw),
            raw.replace(r#""model": "a""#, r#""model": "up""#)
                .as_bytes()
        );
        let over = r#"{"model": "a", "max_tokens": 5000, "messages": [{"role":"user"}]}"#;
        let sent: Value = serde_json::from_slice(&sent_by(over)).unwrap();
        assert_eq!(
            (sent["max_tokens"].as_u64(), sent["model"].as_str()),
            (Some(100), Some("up"))
        );
    }

    /// The copy sent again after an unanswered close (`Again`) is the request sent the first
    /// time: method, URI, every header (the key's among them, still marked sensitive) and body.
    #[tokio::test]
    async fn the_copy_sent_again_is_the_first_request() {
        let cfg = crate::config::Config::load(
            "models:\n  plain: { type: openai, base_url: \"http://127.0.0.1:9/v1\", model: up, api_key: sk-plain, headers: { x-team: blue } }\n  tls: { type: openai, base_url: \"https://127.0.0.1:9/v1\", model: up, api_key: sk-tls }\n",
        )
        .unwrap();
        let same = |a: &http::Request<Full<Bytes>>, b: &http::Request<Full<Bytes>>| {
            let body = |r: &http::Request<Full<Bytes>>| {
                futures_util::FutureExt::now_or_never(BodyExt::collect(r.body().clone()))
                    .unwrap()
                    .unwrap()
                    .to_bytes()
            };
            assert_eq!(a.method(), b.method());
            assert_eq!(a.uri(), b.uri());
            assert_eq!(a.headers(), b.headers());
            let auth = |r: &http::Request<Full<Bytes>>| {
                r.headers()
                    .get(http::header::AUTHORIZATION)
                    .map(|v| (v.as_bytes().to_vec(), v.is_sensitive()))
            };
            assert_eq!(auth(a), auth(b));
            assert!(auth(a).is_some_and(|(_, sensitive)| sensitive));
            assert_eq!(body(a), body(b));
            assert!(!body(a).is_empty());
        };
        let req = crate::wire::read_request(
            Op::Chat,
            Bytes::from(r#"{"model": "m", "messages": [{"role":"user","content":"hi"}]}"#),
        )
        .unwrap();
        let plain = &cfg.endpoints["plain"];
        let key = plain.keys[0].value.as_ref();
        let (prepared, _) =
            request(plain, &req, false, key, Ids::request("req-1"), None, false).unwrap();
        let Prepared::Pooled(_, first, again) = prepared else {
            panic!("a plain-http endpoint's own connections")
        };
        let copy = again.pooled(plain.plain.as_ref().unwrap()).unwrap();
        same(&first, &copy);
        assert_eq!(first.headers()["x-team"], "blue");
        assert!(first.headers().contains_key(http::header::HOST));
        let tls = &cfg.endpoints["tls"];
        let key = tls.keys[0].value.as_ref();
        for base in [None, Some("http://10.0.0.7:8000")] {
            let (prepared, _) =
                request(tls, &req, false, key, Ids::request("req-2"), base, false).unwrap();
            let Prepared::Direct(_, first, again) = prepared else {
                panic!("the direct client ({base:?})")
            };
            same(&first, &again.direct().unwrap());
            if let Some(b) = base {
                assert!(first.uri().to_string().starts_with(b), "{}", first.uri());
            }
        }
    }

    #[tokio::test]
    async fn a_body_is_whole_however_it_is_split() {
        assert_eq!(answer(vec![]).bytes(10).await.unwrap(), Bytes::new());
        assert_eq!(answer(vec![Ok("abc")]).bytes(10).await.unwrap(), "abc");
        assert_eq!(
            answer(vec![Ok("a"), Ok(""), Ok("bc"), Ok("d")])
                .bytes(4)
                .await
                .unwrap(),
            "abcd"
        );
        let err = answer(vec![Ok("a"), Err("connection reset")])
            .bytes(10)
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "connection reset");
        assert!(matches!(err, BodyError::Read(_)));
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_refused_whether_in_one_chunk_or_many() {
        for chunks in [
            vec![Ok("abcde")],
            vec![Ok("ab"), Ok("cde")],
            vec![Ok("a"), Ok("b"), Ok("c"), Ok("d"), Ok("e")],
            // Refused at the limit, before a later chunk (or error) is read.
            vec![Ok("abc"), Ok("de"), Err("never read")],
        ] {
            let err = answer(chunks.clone()).bytes(4).await.unwrap_err();
            assert!(matches!(err, BodyError::TooLarge(4)), "{chunks:?}: {err}");
            assert_eq!(err.to_string(), "answer larger than 4 bytes");
        }
        // Exactly the limit is whole.
        assert_eq!(
            answer(vec![Ok("ab"), Ok("cd")]).bytes(4).await.unwrap(),
            "abcd"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_without_the_url_for_clients() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = dead.local_addr().unwrap();
        drop(dead);
        let cfg = crate::config::Config::load(&format!(
            "models:\n  a: {{ type: openai, base_url: \"http://{addr}/v1\", model: m }}\n"
        ))
        .unwrap();
        let ep = &cfg.endpoints["a"];
        assert!(
            ep.direct.is_some(),
            "no proxy in this environment: the direct client"
        );
        let body = serde_json::json!({"model": "a", "messages": []});
        let req = Inbound::new(
            Op::Chat,
            "a".into(),
            false,
            body.as_object().unwrap().clone(),
            Default::default(),
        );
        let (prepared, _) =
            request(ep, &req, false, None, Ids::request("r-1"), None, false).unwrap();
        // A plain-http address goes over the endpoint's own connections, in origin form with
        // its `Host`; an https one over the direct client.
        let Prepared::Pooled(_, req, _) = &prepared else {
            panic!("a plain-http endpoint's own connections")
        };
        assert_eq!(req.uri(), "/v1/chat/completions");
        assert_eq!(req.headers()["host"], addr.to_string());
        let tls = crate::config::Config::load(
            "models:\n  t: { type: openai, base_url: \"https://127.0.0.1:9/v1\", model: m }\n",
        )
        .unwrap();
        assert!(tls.endpoints["t"].plain.is_none());
        assert!(tls.endpoints["t"].direct.is_some());
        let Err(e) = prepared.send().await else {
            panic!("a closed port answered");
        };
        assert!(e.connect, "{}", e.shown);
        assert!(!e.shown.contains(&addr.to_string()), "{}", e.shown);
        assert!(e.internal.contains(&addr.to_string()), "{}", e.internal);
    }
}
