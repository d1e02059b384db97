//! `autohedge mock-upstream`: a scriptable upstream that speaks the OpenAI, vLLM and Ollama wire
//! formats — success bodies, SSE streams, error bodies in each server's own shape, `Retry-After`
//! and `x-ratelimit-*` headers — and misbehaves on cue: error statuses, delays, stalls after N
//! chunks, in-band error events, truncated streams, connection resets and malformed bodies.
//! Users rehearse their fallback chains with it; the test suite and the demo use it.
//!
//! The script format is documented in README.md ("mock-upstream script").

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::config::Dur;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    Openai,
    Vllm,
    Ollama,
}

/// A mock script (YAML or JSON).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// Name used in the default reply ("Hello from NAME!").
    pub name: Option<String>,
    /// Default reply text.
    pub reply: Option<String>,
    /// Keys accepted as `Authorization: Bearer KEY`; absent means any key (or none) is accepted.
    pub keys: Option<Vec<String>>,
    /// Prompts estimated (4 characters a token) above this many tokens get the flavor's
    /// context-length error.
    pub context_window: Option<u64>,
    /// Delay between stream chunks.
    pub chunk_delay: Option<Dur>,
    /// Models an Ollama mock lists in `/api/tags` (present) and `/api/ps` (loaded).
    pub models: Option<Vec<String>>,
    pub loaded: Option<Vec<String>>,
    /// Headers every request (probes included) must carry; one missing gets 403.
    #[serde(default)]
    pub require_headers: BTreeMap<String, String>,
    /// Rules, first match wins.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// A real token bucket on inference calls, as OpenAI's limiter behaves: `requests` per
    /// `per`, refilling continuously. Every answer carries `x-ratelimit-*-requests` with the
    /// bucket's real state; an empty bucket answers 429 `rate_limit_exceeded`.
    pub rate_limit: Option<MockRateLimit>,
    /// vLLM flavor: the `vllm:num_requests_waiting` its `/metrics` reports (default 0).
    pub waiting: Option<f64>,
    /// A simulated inference server ([`super::sim`]): sequence slots with a queue, a prefix
    /// cache, prefill and decode times. Chat and completion calls are served through it.
    pub sim: Option<super::sim::SimSpec>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockRateLimit {
    pub requests: u64,
    pub per: Dur,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    pub path: Option<String>,
    pub stream: Option<bool>,
    /// Matches the bearer key.
    pub key: Option<String>,
    /// Matches the request body's `model`.
    pub model: Option<String>,
    /// Matches the request body's `conversation` (a Responses call's id, or its object's `id`).
    pub conversation: Option<String>,
    /// Matches a request whose raw body holds this text (a prompt the server fails on).
    pub contains: Option<String>,
    /// Matches every Nth request that meets the other conditions (1-based: 3 → 3rd, 6th, …).
    pub every: Option<u64>,
    /// Matches with this probability (0..1), drawn per request: heavy tails, random faults.
    pub chance: Option<f64>,
}

/// What a request asked, as a rule's `when` reads it.
#[derive(Clone, Copy)]
struct Asked<'a> {
    post: bool,
    path: &'a str,
    stream: bool,
    key: Option<&'a str>,
    model: Option<&'a str>,
    conversation: Option<&'a str>,
    raw: &'a [u8],
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    #[serde(default)]
    pub when: When,
    /// Apply to the first N matches only.
    pub times: Option<u64>,
    pub status: Option<u16>,
    /// The error message; the body takes the flavor's error shape.
    pub error: Option<String>,
    /// The OpenAI error `type` and `code`.
    pub error_type: Option<String>,
    pub error_code: Option<String>,
    /// A raw body sent as-is (for malformed responses).
    pub body: Option<String>,
    /// Response headers. They replace the flavor's standard ones of the same name (OpenAI's
    /// `x-ratelimit-*`, the `retry-after` added to every 429); an empty value removes the header.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Delay before the response headers.
    pub delay: Option<Dur>,
    /// With `delay`: the delay is drawn uniformly from [delay, delay_max].
    pub delay_max: Option<Dur>,
    /// Close the connection without answering.
    #[serde(default)]
    pub reset: bool,
    pub reply: Option<String>,
    /// Streams: after N content chunks send an in-band error event (its message: `error`, or
    /// "mock in-band error").
    pub stream_error_after: Option<usize>,
    /// Streams: after N content chunks stop sending but keep the connection open.
    pub stall_after: Option<usize>,
    /// Streams: after N content chunks end the body cleanly but without `[DONE]`.
    pub cut_after: Option<usize>,
    /// Streams: after N content chunks drop the connection.
    pub reset_after: Option<usize>,
    /// Streams: after `data: [DONE]` keep the connection open (silent) instead of ending it.
    #[serde(default)]
    pub hold_after_done: bool,
    /// Leave `usage` out of responses.
    #[serde(default)]
    pub no_usage: bool,
    /// Answer with a tool call to this function name.
    pub tool_call: Option<String>,
}

#[derive(Default)]
struct Counters {
    /// TCP connections accepted (a client that reuses its connections opens few).
    connections: u64,
    requests: u64,
    by_path: BTreeMap<String, u64>,
    rule_matches: Vec<u64>,
    rule_applied: Vec<u64>,
    last_body: Option<Value>,
    /// The same body's bytes as they came on the wire (lossily decoded): what escaping did to
    /// it, which its decoded JSON cannot show.
    last_raw_body: Option<String>,
    /// The header names of the last inference call.
    last_header_names: Vec<String>,
    /// The W3C `traceparent` of each inference call that carried one (the last 100).
    traceparents: Vec<String>,
    /// The last four characters of each key seen on inference calls, in order (never whole keys).
    key_tails: Vec<String>,
    /// The same for every request (probes included).
    key_tails_all: Vec<String>,
}

pub struct Mock {
    flavor: Flavor,
    script: Mutex<Script>,
    counters: Mutex<Counters>,
    /// `rate_limit:`'s bucket: units left, and when they were counted.
    bucket: Mutex<Option<(f64, std::time::Instant)>>,
    /// The Responses API's stored responses (not those of `store: false`), by id: a
    /// `previous_response_id` must name one, and `GET`/`DELETE /v1/responses/{id}` read them.
    stored: Mutex<std::collections::HashMap<String, Value>>,
    /// The script's `sim:`, running (made again when a new script changes it).
    sim: Mutex<Option<Arc<super::sim::Sim>>>,
}

type RespBody = BoxBody<Bytes, Infallible>;

fn full(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into()).boxed()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count().max(1) as u64
}

impl Mock {
    pub fn new(flavor: Flavor, script: Script) -> Arc<Mock> {
        let sim = script
            .sim
            .clone()
            .map(|s| Arc::new(super::sim::Sim::new(s)));
        Arc::new(Mock {
            flavor,
            script: Mutex::new(script),
            counters: Mutex::new(Counters::default()),
            bucket: Mutex::new(None),
            sim: Mutex::new(sim),
            stored: Mutex::new(Default::default()),
        })
    }

    fn sim(&self) -> Option<Arc<super::sim::Sim>> {
        self.sim.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn script(&self) -> Script {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Picks the rule for a request, advancing the counters.
    fn pick(&self, a: &Asked<'_>) -> Option<Rule> {
        let Asked {
            post,
            path,
            stream,
            key,
            model,
            conversation,
            raw,
        } = *a;
        let script = self.script();
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        c.rule_matches.resize(script.rules.len(), 0);
        c.rule_applied.resize(script.rules.len(), 0);
        for (i, r) in script.rules.iter().enumerate() {
            let w = &r.when;
            // A rule without a path targets inference calls (POST), never probes (GET).
            if (w.path.is_none() && !post)
                || w.path.as_deref().is_some_and(|p| p != path)
                || w.stream.is_some_and(|s| s != stream)
                || w.key.as_deref().is_some_and(|k| Some(k) != key)
                || w.model.as_deref().is_some_and(|m| Some(m) != model)
                || w.conversation
                    .as_deref()
                    .is_some_and(|c| Some(c) != conversation)
                || w.contains.as_deref().is_some_and(|t| {
                    !t.is_empty() && !raw.windows(t.len()).any(|x| x == t.as_bytes())
                })
                || w.chance.is_some_and(|p| fastrand::f64() >= p)
            {
                continue;
            }
            c.rule_matches[i] += 1;
            if let Some(n) = w.every
                && (n == 0 || !c.rule_matches[i].is_multiple_of(n))
            {
                continue;
            }
            if r.times.is_some_and(|t| c.rule_applied[i] >= t) {
                continue;
            }
            c.rule_applied[i] += 1;
            return Some(r.clone());
        }
        None
    }

    /// Takes one request from the `rate_limit:` bucket: the answer's `x-ratelimit-*-requests`
    /// headers tell its real state, and an empty bucket turns the answer into OpenAI's 429.
    fn rate_limit(&self, rl: &MockRateLimit, rule: &mut Rule) {
        let cap = rl.requests.max(1) as f64;
        let rate = cap / rl.per.0.as_secs_f64().max(1e-3);
        let now = std::time::Instant::now();
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, at) = b.unwrap_or((cap, now));
        let mut tokens = (tokens + now.duration_since(at).as_secs_f64() * rate).min(cap);
        let ok = tokens >= 1.0;
        if ok {
            tokens -= 1.0;
        }
        *b = Some((tokens, now));
        let to_full_ms = ((cap - tokens) / rate * 1000.0).ceil() as u64;
        let to_one_ms = ((1.0 - tokens).max(0.0) / rate * 1000.0).ceil() as u64;
        for (k, v) in [
            ("x-ratelimit-limit-requests", cap.to_string()),
            (
                "x-ratelimit-remaining-requests",
                (tokens.floor() as u64).to_string(),
            ),
            ("x-ratelimit-reset-requests", format!("{to_full_ms}ms")),
        ] {
            rule.headers.insert(k.into(), v);
        }
        if !ok {
            rule.status = Some(429);
            rule.error = Some(format!(
                "Rate limit reached for requests on requests per min (RPM): Limit {cap}, Used {cap}, Requested 1. Please try again in {to_one_ms}ms."
            ));
            rule.error_type = Some("requests".into());
            rule.error_code = Some("rate_limit_exceeded".into());
            rule.headers
                .insert("retry-after-ms".into(), to_one_ms.max(1).to_string());
        }
    }

    fn error_body(
        &self,
        path: &str,
        status: u16,
        message: &str,
        kind: Option<&str>,
        code: Option<&str>,
    ) -> Value {
        let default_type = match status {
            400 | 404 | 413 | 422 => "invalid_request_error",
            401 => "invalid_request_error",
            403 => "permission_error",
            429 => "requests",
            _ => "server_error",
        };
        match self.flavor {
            Flavor::Openai => json!({"error": {
                "message": message,
                "type": kind.unwrap_or(default_type),
                "param": null,
                "code": code,
            }}),
            Flavor::Vllm => json!({
                "object": "error",
                "message": message,
                "type": kind.unwrap_or(match status { 400 => "BadRequestError", 404 => "NotFoundError", _ => "InternalServerError" }),
                "param": null,
                "code": status,
            }),
            // Ollama's native API answers `{"error": "..."}`; its OpenAI-compatible /v1 the
            // OpenAI shape.
            Flavor::Ollama if path.starts_with("/api/") => json!({"error": message}),
            Flavor::Ollama => json!({"error": {
                "message": message,
                "type": kind.unwrap_or("api_error"),
                "param": null,
                "code": code,
            }}),
        }
    }

    fn json_response(
        &self,
        status: u16,
        body: &Value,
        extra: &BTreeMap<String, String>,
    ) -> Response<RespBody> {
        let mut b = Response::builder()
            .status(status)
            .header("content-type", "application/json");
        b = self.standard_headers(b, status, extra);
        b.body(full(body.to_string()))
            .unwrap_or_else(|_| Response::new(full("{}")))
    }

    /// OpenAI's own headers on every response, then the rule's: a scripted header replaces the
    /// standard one of the same name rather than being sent beside it.
    fn standard_headers(
        &self,
        mut b: hyper::http::response::Builder,
        status: u16,
        scripted: &BTreeMap<String, String>,
    ) -> hyper::http::response::Builder {
        if self.flavor == Flavor::Openai {
            let remaining = if status == 429 { "0" } else { "9999" };
            let request_id = format!("req_{:016x}", fastrand::u64(..));
            for (k, v) in [
                ("x-request-id", request_id.as_str()),
                ("openai-processing-ms", "1"),
                ("x-ratelimit-limit-requests", "10000"),
                ("x-ratelimit-remaining-requests", remaining),
                ("x-ratelimit-reset-requests", "6ms"),
                ("x-ratelimit-limit-tokens", "200000"),
                ("x-ratelimit-remaining-tokens", "199000"),
                ("x-ratelimit-reset-tokens", "300ms"),
            ] {
                if !scripted.keys().any(|s| s.eq_ignore_ascii_case(k)) {
                    b = b.header(k, v);
                }
            }
        }
        scripted_headers(b, scripted)
    }

    fn error(
        &self,
        path: &str,
        status: u16,
        message: &str,
        kind: Option<&str>,
        code: Option<&str>,
        extra: &BTreeMap<String, String>,
    ) -> Response<RespBody> {
        let body = self.error_body(path, status, message, kind, code);
        self.json_response(status, &body, extra)
    }

    pub async fn handle(
        self: Arc<Self>,
        kill: Arc<Notify>,
        req: Request<Incoming>,
    ) -> Response<RespBody> {
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        let key = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_string);
        // What the caller sent, by name only (never a value): tests show a header stayed away.
        let header_names: Vec<String> = req
            .headers()
            .keys()
            .map(|n| n.as_str().to_string())
            .collect();
        let traceparent = req
            .headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let missing_header = {
            let script = self.script();
            script
                .require_headers
                .iter()
                .find(|(k, v)| {
                    req.headers().get(k.as_str()).and_then(|h| h.to_str().ok()) != Some(v.as_str())
                })
                .map(|(k, _)| k.clone())
        };
        let bytes = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => Bytes::new(),
        };
        // Control plane for tests and rehearsals.
        match (method.as_str(), path.as_str()) {
            ("GET", "/__mock/stats") => {
                let c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
                let v = json!({
                    "requests": c.requests,
                    "connections": c.connections,
                    "by_path": c.by_path,
                    "rule_applied": c.rule_applied,
                    "last_body": c.last_body,
                    "last_raw_body": c.last_raw_body,
                    "last_header_names": c.last_header_names,
                    "traceparents": c.traceparents,
                    "key_tails": c.key_tails,
                    "key_tails_all": c.key_tails_all,
                    "sim": self.sim().map(|s| s.stats()),
                });
                return self.json_response(200, &v, &BTreeMap::new());
            }
            ("POST", "/__mock/script") => {
                return match parse_script(&String::from_utf8_lossy(&bytes)) {
                    Ok(s) => {
                        {
                            let mut sim = self.sim.lock().unwrap_or_else(|e| e.into_inner());
                            if sim.as_ref().map(|x| &x.spec) != s.sim.as_ref() {
                                *sim = s.sim.clone().map(|x| Arc::new(super::sim::Sim::new(x)));
                            }
                        }
                        *self.script.lock().unwrap_or_else(|e| e.into_inner()) = s;
                        *self.counters.lock().unwrap_or_else(|e| e.into_inner()) =
                            Counters::default();
                        self.json_response(200, &json!({"ok": true}), &BTreeMap::new())
                    }
                    Err(e) => self.error(&path, 400, &e, None, None, &BTreeMap::new()),
                };
            }
            _ => {}
        }
        if let Some(h) = missing_header
            && !path.starts_with("/__mock/")
        {
            return self.error(
                &path,
                403,
                &format!("missing required header {h}"),
                Some("permission_error"),
                None,
                &BTreeMap::new(),
            );
        }
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        {
            let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
            // `requests` counts inference calls; probes (GETs) show only under `by_path`.
            if method == hyper::Method::POST && path != "/tokenize" {
                c.requests += 1;
                c.last_header_names = header_names;
                if let Some(t) = traceparent {
                    if c.traceparents.len() >= 100 {
                        c.traceparents.remove(0);
                    }
                    c.traceparents.push(t);
                }
            }
            *c.by_path.entry(path.clone()).or_default() += 1;
            if !body.is_null() {
                c.last_body = Some(body.clone());
                c.last_raw_body = Some(String::from_utf8_lossy(&bytes).into_owned());
            }
            if let Some(k) = key.as_ref() {
                let tail: String = k
                    .chars()
                    .rev()
                    .take(4)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                if method == hyper::Method::POST {
                    c.key_tails.push(tail.clone());
                }
                c.key_tails_all.push(tail);
            }
        }
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let model = body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string);
        let rule = self
            .pick(&Asked {
                post: method == hyper::Method::POST && path != "/tokenize",
                path: &path,
                stream,
                key: key.as_deref(),
                model: model.as_deref(),
                conversation: body
                    .get("conversation")
                    .and_then(|c| c.as_str().or_else(|| c.get("id").and_then(Value::as_str))),
                raw: &bytes,
            })
            .unwrap_or_default();
        let mut rule = rule;
        if method == hyper::Method::POST
            && path != "/tokenize"
            && let Some(rl) = self.script().rate_limit
        {
            self.rate_limit(&rl, &mut rule);
        }
        if let Some(d) = rule.delay {
            let d = match rule.delay_max {
                Some(m) if m.0 > d.0 => d.0 + (m.0 - d.0).mul_f64(fastrand::f64()),
                _ => d.0,
            };
            tokio::time::sleep(d).await;
        }
        if rule.reset {
            kill.notify_one();
            std::future::pending::<()>().await;
        }
        if let Some(status) = rule.status
            && !(200..300).contains(&status)
        {
            let mut headers = rule.headers.clone();
            if status == 429
                && !headers
                    .keys()
                    .any(|k| k.eq_ignore_ascii_case("retry-after"))
            {
                headers.insert("retry-after".into(), "1".into());
            }
            if let Some(raw) = &rule.body {
                let mut b = Response::builder().status(status);
                b = scripted_headers(b, &headers);
                return b
                    .body(full(raw.clone()))
                    .unwrap_or_else(|_| Response::new(full("")));
            }
            let msg = rule
                .error
                .clone()
                .unwrap_or_else(|| default_message(status).into());
            return self.error(
                &path,
                status,
                &msg,
                rule.error_type.as_deref(),
                rule.error_code.as_deref(),
                &headers,
            );
        }
        if let Some(raw) = &rule.body {
            let mut b = Response::builder().status(rule.status.unwrap_or(200));
            b = scripted_headers(b, &rule.headers);
            return b
                .body(full(raw.clone()))
                .unwrap_or_else(|_| Response::new(full("")));
        }
        let script = self.script();
        if let Some(keys) = &script.keys
            && !key.as_ref().is_some_and(|k| keys.contains(k))
        {
            let shown = key.as_deref().map(mask).unwrap_or_default();
            return self.error(
&path,
                    401,
                    &format!("Incorrect API key provided: {shown}. You can find your API key at https://platform.openai.com/account/api-keys."),
                    Some("invalid_request_error"),
                    Some("invalid_api_key"),
                    &rule.headers,
                );
        }
        if let Some(window) = script.context_window.filter(|_| path != "/tokenize") {
            let chars =
                crate::wire::prompt_chars(body.as_object().unwrap_or(&serde_json::Map::new()));
            let tokens = crate::wire::estimate_tokens(chars);
            if tokens > window {
                let msg = match self.flavor {
                    Flavor::Ollama => "input length exceeds the context length".to_string(),
                    _ => format!(
                        "This model's maximum context length is {window} tokens. However, your messages resulted in {tokens} tokens. Please reduce the length of the messages."
                    ),
                };
                return self.error(
                    &path,
                    400,
                    &msg,
                    Some("invalid_request_error"),
                    Some("context_length_exceeded"),
                    &rule.headers,
                );
            }
        }
        let reply = rule
            .reply
            .clone()
            .or(script.reply.clone())
            .unwrap_or_else(|| format!("Hello from {}!", script.name.as_deref().unwrap_or("mock")));
        let model = model.unwrap_or_else(|| "mock-model".into());
        let chunk_delay = script.chunk_delay.map(|d| d.0).unwrap_or(Duration::ZERO);
        // A simulated server: the call waits for a sequence slot and its prefill, then answers
        // one token a `decode_ms` (a stream's chunks; a full answer after all of them), holding
        // its slot until the answer's last byte.
        if let Some(sim) = self.sim()
            && method == hyper::Method::POST
            && matches!(path.as_str(), "/v1/chat/completions" | "/v1/completions")
        {
            let admitted = sim.admit(&body).await;
            let reply = vec!["tok"; admitted.output_tokens as usize].join(" ");
            if !stream {
                tokio::time::sleep(
                    admitted
                        .per_token
                        .saturating_mul(admitted.output_tokens as u32),
                )
                .await;
            }
            let op = if path == "/v1/chat/completions" {
                Self::chat
            } else {
                Self::completion
            };
            let resp = op(
                &self,
                &body,
                &model,
                &reply,
                &rule,
                stream,
                admitted.per_token,
                kill,
            );
            let slot = admitted.slot;
            return resp.map(|b| {
                b.map_frame(move |f| {
                    let _held = &slot;
                    f
                })
                .boxed()
            });
        }
        match (method.as_str(), path.as_str(), self.flavor) {
            ("GET", "/v1/models", _) => {
                let v = json!({"object": "list", "data": [{"id": model, "object": "model", "created": 1700000000, "owned_by": "mock"}]});
                self.json_response(200, &v, &rule.headers)
            }
            ("POST", "/tokenize", Flavor::Vllm) => {
                // vLLM's answer shape; the count is the mock's usual estimate.
                let chars =
                    crate::wire::prompt_chars(body.as_object().unwrap_or(&serde_json::Map::new()));
                let n = crate::wire::estimate_tokens(chars);
                let v = json!({"count": n, "max_model_len": script.context_window.unwrap_or(32768), "tokens": vec![0; n as usize]});
                self.json_response(200, &v, &rule.headers)
            }
            ("GET", "/health", Flavor::Vllm) => Response::builder()
                .status(200)
                .body(full(""))
                .unwrap_or_else(|_| Response::new(full(""))),
            // Every flavor answers /health, so an image running a mock backend passes its own
            // Docker HEALTHCHECK.
            ("GET", "/health", _) => {
                self.json_response(200, &json!({"status": "ok"}), &BTreeMap::new())
            }
            ("GET", "/metrics", Flavor::Vllm) => {
                let (running, waiting, cache) = match self.sim() {
                    Some(s) => {
                        let (r, w) = s.load();
                        let (q, h) = (
                            s.queries.load(std::sync::atomic::Ordering::Relaxed),
                            s.hits.load(std::sync::atomic::Ordering::Relaxed),
                        );
                        (
                            f64::from(r),
                            f64::from(w),
                            format!(
                                "vllm:prefix_cache_queries_total{{model_name=\"mock\"}} {q}.0\nvllm:prefix_cache_hits_total{{model_name=\"mock\"}} {h}.0\n"
                            ),
                        )
                    }
                    None => (0.0, script.waiting.unwrap_or(0.0), String::new()),
                };
                Response::builder()
                    .status(200)
                    .header("content-type", "text/plain; version=0.0.4")
                    .body(full(format!("# HELP vllm:num_requests_running Number of requests running.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"mock\"}} {running:.1}\nvllm:num_requests_waiting{{model_name=\"mock\"}} {waiting:.1}\nvllm:gpu_cache_usage_perc{{model_name=\"mock\"}} 0.1\n{cache}")))
                    .unwrap_or_else(|_| Response::new(full("")))
            }
            ("GET", "/api/tags", Flavor::Ollama) => {
                let list: Vec<Value> = script.models.clone().unwrap_or_default().iter().map(|m| json!({"name": m, "model": m, "modified_at": "2024-01-01T00:00:00Z", "size": 4683087332u64, "digest": "0", "details": {"format": "gguf", "family": "qwen2", "parameter_size": "7.6B", "quantization_level": "Q4_K_M"}})).collect();
                self.json_response(200, &json!({"models": list}), &rule.headers)
            }
            ("GET", "/api/ps", Flavor::Ollama) => {
                let list: Vec<Value> = script.loaded.clone().unwrap_or_default().iter().map(|m| json!({"name": m, "model": m, "size": 5137025024u64, "digest": "0", "expires_at": "2099-01-01T00:00:00Z", "size_vram": 5137025024u64})).collect();
                self.json_response(200, &json!({"models": list}), &rule.headers)
            }
            ("GET", "/api/version", Flavor::Ollama) => {
                self.json_response(200, &json!({"version": "0.5.0"}), &rule.headers)
            }
            ("POST", "/v1/chat/completions", _) => {
                let reply = continued(self.flavor, &body, &reply);
                self.chat(&body, &model, &reply, &rule, stream, chunk_delay, kill)
            }
            ("POST", "/v1/completions", _) => {
                self.completion(&body, &model, &reply, &rule, stream, chunk_delay, kill)
            }
            ("POST", "/v1/embeddings", _) => self.embeddings(&body, &model, &rule),
            // OpenAI's Responses API (vLLM serves it too); Ollama does not.
            ("POST", "/v1/responses", Flavor::Openai | Flavor::Vllm) => {
                // OpenAI refuses a body without `model` (vLLM's validation too).
                if body.get("model").is_none_or(|m| !m.is_string()) {
                    return self.error(
                        &path,
                        400,
                        "Missing required parameter: 'model'.",
                        Some("invalid_request_error"),
                        Some("missing_required_parameter"),
                        &BTreeMap::new(),
                    );
                }
                // A conversation continues only from a response this server stored.
                if let Some(prev) = body.get("previous_response_id").and_then(Value::as_str)
                    && !self
                        .stored
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .contains_key(prev)
                {
                    return self.error(
                        &path,
                        404,
                        &format!("Previous response with id '{prev}' not found."),
                        Some("invalid_request_error"),
                        Some("previous_response_not_found"),
                        &BTreeMap::new(),
                    );
                }
                self.responses(&body, &model, &reply, &rule, stream, chunk_delay, kill)
            }
            ("GET" | "DELETE", p, Flavor::Openai | Flavor::Vllm)
                if p.starts_with("/v1/responses/") =>
            {
                let id = &p["/v1/responses/".len()..];
                let mut stored = self.stored.lock().unwrap_or_else(|e| e.into_inner());
                let found = if method == "DELETE" {
                    stored.remove(id)
                } else {
                    stored.get(id).cloned()
                };
                drop(stored);
                match found {
                    Some(_) if method == "DELETE" => self.json_response(
                        200,
                        &json!({"id": id, "object": "response", "deleted": true}),
                        &rule.headers,
                    ),
                    Some(v) => self.json_response(200, &v, &rule.headers),
                    None => self.error(
                        &path,
                        404,
                        &format!("Response with id '{id}' not found."),
                        Some("invalid_request_error"),
                        None,
                        &BTreeMap::new(),
                    ),
                }
            }
            ("POST", "/api/chat", Flavor::Ollama) => self.ollama_native(
                &body,
                &model,
                &reply,
                &rule,
                stream,
                chunk_delay,
                kill,
                true,
            ),
            ("POST", "/api/generate", Flavor::Ollama) => self.ollama_native(
                &body,
                &model,
                &reply,
                &rule,
                stream,
                chunk_delay,
                kill,
                false,
            ),
            ("POST", "/api/embed", Flavor::Ollama) => {
                let inputs: Vec<String> = match body.get("input") {
                    Some(Value::String(s)) => vec![s.clone()],
                    Some(Value::Array(a)) => a
                        .iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect(),
                    _ => vec![],
                };
                let embeddings: Vec<Vec<f32>> = inputs.iter().map(|t| embed(t)).collect();
                let n: u64 = inputs.iter().map(|t| words(t)).sum();
                let v = json!({"model": model, "embeddings": embeddings, "total_duration": 1000, "load_duration": 100, "prompt_eval_count": n});
                self.json_response(200, &v, &rule.headers)
            }
            _ => self.error(
                &path,
                404,
                &format!("Invalid URL ({method} {path})"),
                Some("invalid_request_error"),
                None,
                &BTreeMap::new(),
            ),
        }
    }

    fn usage(&self, body: &Value, reply: &str) -> Value {
        let prompt = crate::wire::estimate_tokens(crate::wire::prompt_chars(
            body.as_object().unwrap_or(&serde_json::Map::new()),
        ))
        .max(1);
        let completion = words(reply);
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        body: &Value,
        model: &str,
        reply: &str,
        rule: &Rule,
        stream: bool,
        chunk_delay: Duration,
        kill: Arc<Notify>,
    ) -> Response<RespBody> {
        let id = format!("chatcmpl-{:024x}", fastrand::u128(..));
        let created = now_secs();
        let usage = self.usage(body, reply);
        if !stream {
            let message = match &rule.tool_call {
                Some(name) => {
                    json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": [{"id": format!("call_{:016x}", fastrand::u64(..)), "type": "function", "function": {"name": name, "arguments": "{\"city\":\"Paris\"}"}}]})
                }
                None => json!({"role": "assistant", "content": reply, "refusal": null}),
            };
            let finish = if rule.tool_call.is_some() {
                "tool_calls"
            } else {
                "stop"
            };
            let mut v = json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
                "usage": usage, "system_fingerprint": "fp_mock",
            });
            if rule.no_usage {
                v.as_object_mut().map(|o| o.remove("usage"));
            }
            return self.json_response(200, &v, &rule.headers);
        }
        let include_usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false)
            && !rule.no_usage;
        let chunk = |delta: Value, finish: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "system_fingerprint": "fp_mock",
                   "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        };
        let mut events = vec![chunk(
            json!({"role": "assistant", "content": "", "refusal": null}),
            Value::Null,
        )];
        let finish = if let Some(name) = &rule.tool_call {
            events.push(chunk(json!({"tool_calls": [{"index": 0, "id": format!("call_{:016x}", fastrand::u64(..)), "type": "function", "function": {"name": name, "arguments": ""}}]}), Value::Null));
            events.push(chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Paris\"}"}}]}), Value::Null));
            "tool_calls"
        } else {
            for piece in split_words(reply) {
                events.push(chunk(json!({"content": piece}), Value::Null));
            }
            "stop"
        };
        events.push(chunk(json!({}), json!(finish)));
        if include_usage {
            events.push(json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage}));
        }
        self.sse(events, rule, chunk_delay, kill)
    }

    /// `POST /v1/responses`: a Response object, or its event stream — `response.created`,
    /// `response.in_progress`, the output item and its part added, the text deltas (or the
    /// function call's argument deltas), each done, `response.completed` — every event named
    /// (`event:`) and numbered (`sequence_number`), no `[DONE]`, as OpenAI streams them.
    #[allow(clippy::too_many_arguments)]
    fn responses(
        &self,
        body: &Value,
        model: &str,
        reply: &str,
        rule: &Rule,
        stream: bool,
        chunk_delay: Duration,
        kill: Arc<Notify>,
    ) -> Response<RespBody> {
        let id = format!("resp_{:032x}", fastrand::u128(..));
        let created = now_secs();
        let input_tokens = crate::wire::estimate_tokens(response_input_chars(body)).max(1);
        let item_id = format!(
            "{}_{:032x}",
            if rule.tool_call.is_some() {
                "fc"
            } else {
                "msg"
            },
            fastrand::u128(..)
        );
        let call_id = format!("call_{:016x}", fastrand::u64(..));
        let arguments = "{\"city\":\"Paris\"}";
        let output_tokens = match &rule.tool_call {
            Some(_) => words(arguments),
            None => words(reply),
        };
        let usage = json!({
            "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        });
        let item = |done: bool| -> Value {
            let status = if done { "completed" } else { "in_progress" };
            match &rule.tool_call {
                Some(name) => {
                    json!({"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                    "arguments": if done { arguments } else { "" }, "status": status})
                }
                None => {
                    json!({"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": if done { json!([{"type": "output_text", "text": reply, "annotations": []}]) } else { json!([]) }})
                }
            }
        };
        let response = |status: &str, output: Vec<Value>, usage: Value| -> Value {
            json!({
                "id": id, "object": "response", "created_at": created, "status": status,
                "error": null, "incomplete_details": null,
                "instructions": body.get("instructions").cloned().unwrap_or(Value::Null),
                "max_output_tokens": body.get("max_output_tokens").cloned().unwrap_or(Value::Null),
                "model": model, "output": output, "parallel_tool_calls": true,
                "previous_response_id": body.get("previous_response_id").cloned().unwrap_or(Value::Null),
                "reasoning": {"effort": null, "summary": null},
                "store": body.get("store").cloned().unwrap_or(json!(true)),
                "temperature": body.get("temperature").cloned().unwrap_or(json!(1.0)),
                "text": body.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
                "tool_choice": body.get("tool_choice").cloned().unwrap_or(json!("auto")),
                "tools": body.get("tools").cloned().unwrap_or(json!([])),
                "top_p": body.get("top_p").cloned().unwrap_or(json!(1.0)),
                "truncation": "disabled", "usage": usage, "user": null, "metadata": {},
            })
        };
        // The finished response: stored (unless `store: false` or an error rule), answered whole,
        // or the stream's last event.
        let mut done = response("completed", vec![item(true)], usage);
        if rule.no_usage {
            done["usage"] = Value::Null;
        }
        let store = body.get("store").and_then(Value::as_bool) != Some(false);
        if store && rule.status.is_none() {
            self.stored
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.clone(), done.clone());
        }
        if !stream {
            return self.json_response(200, &done, &rule.headers);
        }
        // (type, event, whether it carries output): the misbehaviours count output events.
        let mut events: Vec<(&'static str, Value, bool)> = vec![
            (
                "response.created",
                json!({"response": response("in_progress", vec![], Value::Null)}),
                false,
            ),
            (
                "response.in_progress",
                json!({"response": response("in_progress", vec![], Value::Null)}),
                false,
            ),
            (
                "response.output_item.added",
                json!({"output_index": 0, "item": item(false)}),
                false,
            ),
        ];
        match &rule.tool_call {
            Some(_) => {
                for piece in split_words(arguments) {
                    events.push((
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": 0, "delta": piece}),
                        true,
                    ));
                }
                events.push((
                    "response.function_call_arguments.done",
                    json!({"item_id": item_id, "output_index": 0, "arguments": arguments}),
                    false,
                ));
            }
            None => {
                let part =
                    |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
                events.push(("response.content_part.added", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part("")}), false));
                for piece in split_words(reply) {
                    events.push(("response.output_text.delta", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": []}), true));
                }
                events.push(("response.output_text.done", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": reply, "logprobs": []}), false));
                events.push(("response.content_part.done", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part(reply)}), false));
            }
        }
        events.push((
            "response.output_item.done",
            json!({"output_index": 0, "item": item(true)}),
            false,
        ));
        events.push(("response.completed", json!({"response": done}), false));
        let failed = response("failed", vec![], Value::Null);
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let extra_headers = rule.headers.clone();
        let rule = rule.clone();
        tokio::spawn(async move {
            // Events after `response.created`: where the misbehaviours strike.
            let mut sent = 0usize;
            for (seq, (kind, mut ev, output)) in events.into_iter().enumerate() {
                if seq > 0 {
                    let mut f = failed.clone();
                    f["error"] = json!({"code": "server_error", "message": rule.error.as_deref().unwrap_or("mock in-band error")});
                    let err =
                        json!({"type": "response.failed", "sequence_number": seq, "response": f});
                    let err = Bytes::from(format!("event: response.failed\ndata: {err}\n\n"));
                    if misbehave(&rule, sent, &tx, &kill, err).await {
                        return;
                    }
                    if output {
                        if !chunk_delay.is_zero() {
                            tokio::time::sleep(chunk_delay).await;
                        }
                        sent += 1;
                    }
                }
                ev["type"] = json!(kind);
                ev["sequence_number"] = json!(seq);
                if tx
                    .send(Bytes::from(format!("event: {kind}\ndata: {ev}\n\n")))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            if rule.hold_after_done {
                let _ = tokio::time::timeout(Duration::from_secs(600), tx.closed()).await;
            }
        });
        self.event_stream(rx, &extra_headers)
    }

    #[allow(clippy::too_many_arguments)]
    fn completion(
        &self,
        body: &Value,
        model: &str,
        reply: &str,
        rule: &Rule,
        stream: bool,
        chunk_delay: Duration,
        kill: Arc<Notify>,
    ) -> Response<RespBody> {
        let id = format!("cmpl-{:024x}", fastrand::u128(..));
        let created = now_secs();
        if !stream {
            let mut v = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"text": reply, "index": 0, "logprobs": null, "finish_reason": "stop"}], "usage": self.usage(body, reply)});
            if rule.no_usage {
                v.as_object_mut().map(|o| o.remove("usage"));
            }
            return self.json_response(200, &v, &rule.headers);
        }
        let mut events: Vec<Value> = split_words(reply)
            .into_iter()
            .map(|p| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [{"text": p, "index": 0, "logprobs": null, "finish_reason": null}]}))
            .collect();
        events.push(json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [{"text": "", "index": 0, "logprobs": null, "finish_reason": "stop"}]}));
        self.sse(events, rule, chunk_delay, kill)
    }

    fn embeddings(&self, body: &Value, model: &str, rule: &Rule) -> Response<RespBody> {
        let inputs: Vec<String> = match body.get("input") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string())
                })
                .collect(),
            _ => vec![],
        };
        let base64 = body.get("encoding_format").and_then(Value::as_str) == Some("base64");
        let data: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let vec = embed(text);
                let embedding = if base64 {
                    let bytes: Vec<u8> = vec.iter().flat_map(|f| f.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    json!(vec)
                };
                json!({"object": "embedding", "index": i, "embedding": embedding})
            })
            .collect();
        let tokens: u64 = inputs.iter().map(|t| words(t)).sum();
        let v = json!({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
        self.json_response(200, &v, &rule.headers)
    }

    /// Sends events as SSE, misbehaving as the rule says.
    fn sse(
        &self,
        events: Vec<Value>,
        rule: &Rule,
        chunk_delay: Duration,
        kill: Arc<Notify>,
    ) -> Response<RespBody> {
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let extra_headers = rule.headers.clone();
        let rule = rule.clone();
        let flavor = self.flavor;
        tokio::spawn(async move {
            // Content chunks sent so far (the role preamble does not count).
            let mut sent_content = 0usize;
            for (i, ev) in events.into_iter().enumerate() {
                if i > 0 {
                    let message = rule.error.as_deref().unwrap_or("mock in-band error");
                    let err = match flavor {
                        Flavor::Vllm => {
                            json!({"object": "error", "message": message, "type": "InternalServerError", "param": null, "code": 500})
                        }
                        _ => {
                            json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})
                        }
                    };
                    let err = Bytes::from(format!("data: {err}\n\n"));
                    if misbehave(&rule, sent_content, &tx, &kill, err).await {
                        return;
                    }
                    if !chunk_delay.is_zero() {
                        tokio::time::sleep(chunk_delay).await;
                    }
                    sent_content += 1;
                }
                if tx
                    .send(Bytes::from(format!("data: {ev}\n\n")))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            if rule.hold_after_done {
                let _ = tokio::time::timeout(Duration::from_secs(600), tx.closed()).await;
            }
        });
        self.event_stream(rx, &extra_headers)
    }

    /// A `text/event-stream` answer whose body is what `rx` yields, with the flavor's headers.
    fn event_stream(
        &self,
        rx: mpsc::Receiver<Bytes>,
        extra_headers: &BTreeMap<String, String>,
    ) -> Response<RespBody> {
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
        let mut b = Response::builder()
            .status(200)
            .header("content-type", "text/event-stream; charset=utf-8")
            .header("cache-control", "no-cache");
        b = self.standard_headers(b, 200, extra_headers);
        b.body(BodyExt::boxed(StreamBody::new(stream)))
            .unwrap_or_else(|_| Response::new(full("")))
    }

    /// Ollama's native `/api/chat` (chat) or `/api/generate`, NDJSON when streaming.
    #[allow(clippy::too_many_arguments)]
    fn ollama_native(
        &self,
        body: &Value,
        model: &str,
        reply: &str,
        rule: &Rule,
        stream: bool,
        chunk_delay: Duration,
        kill: Arc<Notify>,
        chat: bool,
    ) -> Response<RespBody> {
        let created_at = "2024-01-01T00:00:00.000000Z";
        let prompt = crate::wire::estimate_tokens(crate::wire::prompt_chars(
            body.as_object().unwrap_or(&serde_json::Map::new()),
        ))
        .max(1);
        let completion = words(reply);
        let tool_calls = rule
            .tool_call
            .as_ref()
            .map(|name| json!([{"function": {"name": name, "arguments": {"city": "Paris"}}}]));
        let piece = |text: &str, done: bool| -> Value {
            let mut v = if chat {
                json!({"model": model, "created_at": created_at, "message": {"role": "assistant", "content": text}, "done": done})
            } else {
                json!({"model": model, "created_at": created_at, "response": text, "done": done})
            };
            if done {
                v["done_reason"] = json!("stop");
                v["total_duration"] = json!(1_000_000);
                v["load_duration"] = json!(1000);
                if !rule.no_usage {
                    v["prompt_eval_count"] = json!(prompt);
                    v["eval_count"] = json!(completion);
                }
            }
            v
        };
        if !stream {
            let mut v = piece(if tool_calls.is_some() { "" } else { reply }, true);
            if let Some(tc) = &tool_calls {
                v["message"]["tool_calls"] = tc.clone();
            }
            return self.json_response(200, &v, &rule.headers);
        }
        let mut objects = Vec::new();
        if let Some(tc) = &tool_calls {
            let mut v = piece("", false);
            v["message"]["tool_calls"] = tc.clone();
            objects.push(v);
        } else {
            for w in split_words(reply) {
                objects.push(piece(&w, false));
            }
        }
        objects.push(piece("", true));
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let extra_headers = rule.headers.clone();
        let rule = rule.clone();
        tokio::spawn(async move {
            for (sent, v) in objects.into_iter().enumerate() {
                let err = Bytes::from_static(
                    b"{\"error\":\"an error was encountered while running the model: mock in-band error\"}\n",
                );
                if misbehave(&rule, sent, &tx, &kill, err).await {
                    return;
                }
                if sent > 0 && !chunk_delay.is_zero() {
                    tokio::time::sleep(chunk_delay).await;
                }
                if tx.send(Bytes::from(format!("{v}\n"))).await.is_err() {
                    return;
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
        let mut b = Response::builder()
            .status(200)
            .header("content-type", "application/x-ndjson");
        b = scripted_headers(b, &extra_headers);
        b.body(BodyExt::boxed(StreamBody::new(stream)))
            .unwrap_or_else(|_| Response::new(full("")))
    }
}

/// A rule's scripted headers; an empty value removes the header (sends nothing).
fn scripted_headers(
    mut b: hyper::http::response::Builder,
    headers: &BTreeMap<String, String>,
) -> hyper::http::response::Builder {
    for (k, v) in headers.iter().filter(|(_, v)| !v.is_empty()) {
        b = b.header(k.as_str(), v.as_str());
    }
    b
}

/// A rule's stream misbehaviour before the chunk after `sent` content chunks. Returns true when
/// the stream must end there.
async fn misbehave(
    rule: &Rule,
    sent: usize,
    tx: &mpsc::Sender<Bytes>,
    kill: &Notify,
    error_event: Bytes,
) -> bool {
    if rule.stream_error_after == Some(sent) {
        let _ = tx.send(error_event).await;
        return true;
    }
    if rule.stall_after == Some(sent) {
        // Hold the connection open, silent, until the client gives up.
        let _ = tokio::time::timeout(Duration::from_secs(600), tx.closed()).await;
        return true;
    }
    if rule.cut_after == Some(sent) {
        return true;
    }
    if rule.reset_after == Some(sent) {
        // Let hyper take the chunks already queued (however long a loaded machine makes that:
        // a fixed pause alone once lost them, and the client saw none of the stream before the
        // break), give it a moment to flush them, then drop the connection while the body is
        // still open so it cannot end cleanly.
        // Every slot of the channel free again: hyper has taken every queued chunk.
        let drained = tx.reserve_many(tx.max_capacity());
        let _ = tokio::time::timeout(Duration::from_secs(10), drained).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        kill.notify_one();
        let _ = tokio::time::timeout(Duration::from_secs(10), tx.closed()).await;
        return true;
    }
    false
}

/// The characters of a Responses request's text: `instructions`, and `input` as a string or as
/// items (messages with text parts or a string, function call outputs).
fn response_input_chars(body: &Value) -> usize {
    fn text(v: &Value) -> usize {
        match v {
            Value::String(s) => s.chars().count(),
            Value::Array(a) => a.iter().map(text).sum(),
            Value::Object(o) => ["text", "content", "output", "arguments"]
                .iter()
                .filter_map(|k| o.get(*k))
                .map(text)
                .sum(),
            _ => 0,
        }
    }
    body.get("instructions").map(text).unwrap_or(0) + body.get("input").map(text).unwrap_or(0)
}

/// vLLM continues a final assistant message when asked (`continue_final_message: true` with
/// `add_generation_prompt: false`): the mock's reply then goes on from where that message ends
/// (the rest of the reply when the message is a prefix of it). OpenAI and Ollama never continue.
fn continued(flavor: Flavor, body: &Value, reply: &str) -> String {
    let asked = body.get("continue_final_message").and_then(Value::as_bool) == Some(true)
        && body.get("add_generation_prompt").and_then(Value::as_bool) == Some(false);
    if flavor != Flavor::Vllm || !asked {
        return reply.to_string();
    }
    let last = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str);
    match last {
        Some(prefix) => reply.strip_prefix(prefix).unwrap_or(reply).to_string(),
        None => reply.to_string(),
    }
}

fn default_message(status: u16) -> &'static str {
    match status {
        400 => "Invalid request.",
        401 => "Incorrect API key provided.",
        403 => "You are not allowed to access this resource.",
        404 => "The model does not exist or you do not have access to it.",
        410 => "This model has been deprecated and is no longer available.",
        429 => "Rate limit reached for requests. Please try again in 1s.",
        500 => "The server had an error while processing your request. Sorry about that!",
        502 => "Bad gateway.",
        503 => "The engine is currently overloaded, please try again later.",
        504 => "Gateway timeout.",
        _ => "Mock error.",
    }
}

/// Shows a key the way OpenAI does in its 401: first three and last four characters.
fn mask(k: &str) -> String {
    let chars: Vec<char> = k.chars().collect();
    if chars.len() <= 8 {
        return "****".into();
    }
    let head: String = chars[..3].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}***{tail}")
}

fn split_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        cur.push(ch);
        if ch == ' ' {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A deterministic 8-dimensional unit vector from the text, so equal inputs embed equally.
fn embed(text: &str) -> Vec<f32> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut v = Vec::with_capacity(8);
    for i in 0..8u64 {
        for b in text.bytes().chain(i.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        v.push(((h >> 40) as f32 / (1u64 << 24) as f32) - 0.5);
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.iter().map(|x| x / norm).collect()
}

pub fn parse_script(text: &str) -> Result<Script, String> {
    if text.trim().is_empty() {
        return Ok(Script::default());
    }
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        format!("mock script at `{path}`: {}", e.into_inner())
    })
}

/// Serves the mock on `listener` until `cancel`.
pub async fn serve(listener: TcpListener, mock: Arc<Mock>, cancel: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "mock accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        mock.counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .connections += 1;
        let mock = mock.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let kill = Arc::new(Notify::new());
            let k = kill.clone();
            let svc = hyper::service::service_fn(move |req| {
                let m = mock.clone();
                let k = k.clone();
                async move { Ok::<_, Infallible>(m.handle(k, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc);
            // Dropping the connection future closes the socket: that is the "reset".
            tokio::select! {
                _ = conn => {}
                _ = kill.notified() => {}
                _ = cancel.cancelled() => {}
            }
        });
    }
}
