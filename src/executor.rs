//! The failover executor: a plain loop over the ranked candidates, each attempt under its own
//! timeouts, each outcome mapped to one action (fail over, cool down, retire, rotate key, or give
//! the client its own error back). Every attempt is recorded.
//!
//! Streams are committed only when an upstream has produced its first content chunk: until then
//! nothing reaches the client, so any failure — connection, status, in-band error event, no first
//! chunk within `first_token` — fails over invisibly. After the commit, bytes pass straight
//! through; a failure then ends the stream with an OpenAI-style error event.

use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde_json::Value;
use tokio::time::{Instant, timeout_at};

use crate::config::{Config, Endpoint, EndpointKind, Overflow};
use crate::error::{ApiError, AttemptReport, stream_error_event};
use crate::registry::{Effect, KeyPick};
use crate::router::{self, View};
use crate::state::AppState;
use crate::store::{AttemptRow, Record, RequestRow};
use crate::tokens::{self, Count, truncate};
use crate::upstream::{self, classify, classify::Class};
use crate::wire::sse::SseParser;
use crate::wire::{self, ChunkKind, Inbound, Op, Usage};

/// Bodies with more text than this are counted on the blocking pool (≈16k tokens: a few
/// milliseconds of BPE work that should not hold an async worker).
const BLOCKING_COUNT_CHARS: usize = 64 * 1024;

/// Test hooks are on only in a debug build whose environment sets `AUTOHEDGE_TEST_HOOKS`.
#[cfg(debug_assertions)]
static TEST_HOOKS: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os("AUTOHEDGE_TEST_HOOKS").is_some());

/// The shortest wait before an endpoint that answered 429 in this request is tried again, so a
/// `Retry-After: 0` cannot turn `max_wait` into a tight loop against the upstream.
const MIN_REWAIT: Duration = Duration::from_millis(100);

/// Longest upstream error body we read before classifying it.
const MAX_ERROR_BODY: usize = 64 * 1024;

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A failed attempt, with what the executor needs to act on it.
struct Failure {
    class: Class,
    status: Option<u16>,
    detail: String,
    retry_after: Option<Duration>,
    /// The detail with internal addresses, for the audit row only (never a client's body).
    internal: Option<String>,
    /// For client errors, the upstream's own response, returned unchanged.
    /// Boxed: it is rare, and keeps `Failure` small on the common paths.
    passthrough: Option<Box<(StatusCode, HeaderMap, Bytes)>>,
}

impl Failure {
    fn new(class: Class, status: Option<u16>, detail: impl Into<String>) -> Self {
        Failure {
            class,
            status,
            detail: detail.into(),
            retry_after: None,
            internal: None,
            passthrough: None,
        }
    }
}

enum Success {
    Full {
        status: StatusCode,
        content_type: Option<HeaderValue>,
        body: Bytes,
        usage: Option<Usage>,
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
    },
}

/// One request's journey.
struct Run {
    app: Arc<AppState>,
    cfg: Arc<Config>,
    req: Inbound,
    request_id: String,
    started: Instant,
    started_wall: SystemTime,
    attempts: Vec<AttemptReport>,
    /// Upstream calls made (skips excluded): the `x-autohedge-attempts` header.
    calls: u32,
    /// The response of the latest context-length refusal, returned if nothing larger exists.
    last_context: Option<(StatusCode, HeaderMap, Bytes)>,
    /// Generated characters of the served full response, for estimating usage.
    estimated_out_chars: usize,
    /// Prompt tokens per counting method (endpoints that count alike share one count).
    counts: HashMap<String, Count>,
    /// The first count made, for the audit row.
    counted_prompt: Option<u64>,
    /// Endpoints skipped because the prompt did not fit, with their windows.
    context_skipped: Vec<(String, u64)>,
    /// The response of the latest context-length refusal, returned if nothing larger exists.
    last_context_error: Option<(StatusCode, HeaderMap, Bytes)>,
    /// (messages, tokens) dropped by truncation.
    truncation: Option<(usize, u64)>,
    /// Characters payload hygiene changed in the body sent upstream.
    sanitized: u64,
    /// `routing_policy.request_timeout` from the start: nothing of this request outlives it.
    deadline: Instant,
    /// The audit row was written (or handed to a `StreamGuard`): `Drop` writes one otherwise.
    row_written: bool,
    /// The upstream call in flight, for the record when the request is cut off mid-attempt.
    current: Option<(String, Instant)>,
    /// Endpoints tried although health said to skip them (healthy panic, last resort).
    panic_mode: HashSet<String>,
    /// Endpoints whose backend `/tokenize` failed in this request (the local count is used).
    backend_failed: HashSet<String>,
}

/// Every request that reached the router has exactly one `requests` row. A `Run` dropped before
/// it wrote one was cut off: the client left (hyper drops the handler future), shutdown cut it,
/// or a bug panicked through it.
impl Drop for Run {
    fn drop(&mut self) {
        if self.row_written {
            return;
        }
        let (status, class) = if std::thread::panicking() {
            (500, "internal_panic")
        } else if self.app.shutting_down() {
            (503, "shutdown")
        } else {
            (499, "client_closed")
        };
        if let Some((endpoint, t0)) = self.current.take() {
            self.attempts.push(AttemptReport {
                endpoint,
                status: None,
                class: class.into(),
                latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
                error: Some("the request ended while this attempt was in flight".into()),
                panic_mode: false,
                internal: None,
            });
        }
        let row = self.base_row(None, status, Some(class.into()));
        self.send_row(row);
    }
}

/// Serves one validated request and returns the response. Always writes exactly one audit row.
pub async fn execute(
    app: Arc<AppState>,
    cfg: Arc<Config>,
    req: Inbound,
    chain: Vec<String>,
    request_id: String,
) -> Response {
    let mut run = Run {
        app,
        cfg,
        req,
        request_id,
        started: Instant::now(),
        started_wall: SystemTime::now(),
        attempts: Vec::new(),
        calls: 0,
        last_context: None,
        estimated_out_chars: 0,
        counts: HashMap::new(),
        counted_prompt: None,
        context_skipped: Vec::new(),
        last_context_error: None,
        truncation: None,
        sanitized: 0,
        deadline: Instant::now(),
        row_written: false,
        current: None,
        panic_mode: HashSet::new(),
        backend_failed: HashSet::new(),
    };
    run.deadline = run.started + run.cfg.policy.request_timeout;
    let deadline = run.deadline;
    match timeout_at(deadline, run.go(chain)).await {
        Ok(resp) => resp,
        Err(_) => run.request_timed_out(),
    }
}

enum EndpointOutcome {
    Served(Box<Success>),
    /// The client's own error, to return unchanged.
    ClientError(StatusCode, HeaderMap, Bytes),
    /// Failed; go on. `context` is set when the endpoint refused the prompt as too long,
    /// `rate_limited` when it answered 429.
    Failed {
        context: bool,
        rate_limited: bool,
    },
}

impl Run {
    async fn go(&mut self, chain: Vec<String>) -> Response {
        // Debug builds started with AUTOHEDGE_TEST_HOOKS only: lets the test suite prove that a
        // panic inside a request becomes a 500 with its audit row. A client's model name alone
        // cannot reach it, and the release binary has no such code.
        #[cfg(debug_assertions)]
        if *TEST_HOOKS && self.req.model == "__autohedge_test_panic__" {
            panic!("test-triggered panic inside the executor");
        }
        let mut truncated_once = false;
        loop {
            if let Some(resp) = self.pass(&chain).await {
                return resp;
            }
            // Nothing served. If the only obstacle was context size, apply the overflow policy.
            let only_context = !self.context_skipped.is_empty()
                && !self.attempts.iter().any(|a| {
                    !matches!(a.class.as_str(), "context_length" | "context_skip")
                        && !a.class.starts_with("skipped_")
                });
            if !only_context {
                break;
            }
            match self.overflow_policy() {
                Overflow::Truncate if !truncated_once && self.req.op == Op::Chat => {
                    truncated_once = true;
                    if let Err(resp) = self.truncate_to_fit().await {
                        return resp;
                    }
                    self.context_skipped.clear();
                    self.last_context_error = None;
                }
                _ => return self.reject_overflow(&chain),
            }
        }
        if let Some((status, headers, body)) = self.last_context_error.take()
            && !self.attempts.iter().any(|a| {
                !matches!(a.class.as_str(), "context_length" | "context_skip")
                    && !a.class.starts_with("skipped_")
            })
        {
            let ep = self
                .attempts
                .iter()
                .rev()
                .find(|a| a.class == "context_length")
                .map(|a| a.endpoint.clone())
                .unwrap_or_default();
            return self.respond_passthrough(&ep, status, headers, body);
        }
        self.all_failed()
    }

    /// `routes.<name>.on_context_overflow`, else the named endpoint's, else the policy's.
    fn overflow_policy(&self) -> Overflow {
        self.cfg
            .route_overflow
            .get(&self.req.model)
            .copied()
            .or_else(|| {
                self.cfg
                    .endpoints
                    .get(&self.req.model)
                    .and_then(|e| e.on_context_overflow)
            })
            .unwrap_or(self.cfg.policy.on_context_overflow)
    }

    fn requested_max_tokens(&self) -> u64 {
        self.req
            .body
            .get("max_completion_tokens")
            .or_else(|| self.req.body.get("max_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// Prompt tokens as `ep` counts them. Large bodies are counted on the blocking pool so the
    /// async workers keep serving.
    async fn prompt_tokens(&mut self, ep: &Endpoint) -> Count {
        if ep.backend_tokenize.is_some() && !self.backend_failed.contains(&ep.name) {
            let key = format!("backend:{}", ep.name);
            if let Some(c) = self.counts.get(&key) {
                return c.clone();
            }
            // Asked once per request: a failing backend costs one timeout, not one per check.
            self.backend_failed.insert(ep.name.clone());
            if let Some(b) = tokens::backend_count(ep, self.req.op, &self.req.body).await {
                self.backend_failed.remove(&ep.name);
                if let Some(max) = b.max_model_len {
                    self.app.registry.learn_window(ep, max);
                }
                let count = Count {
                    tokens: b.tokens,
                    exact: true,
                };
                self.counted_prompt.get_or_insert(count.tokens);
                self.counts.insert(key, count.clone());
                return count;
            }
        }
        let key = ep.counter.method();
        if let Some(c) = self.counts.get(&key) {
            return c.clone();
        }
        let count = if wire::prompt_chars(&self.req.body) > BLOCKING_COUNT_CHARS {
            let counter = ep.counter.clone();
            let body = self.req.body.clone();
            let op = self.req.op;
            tokio::task::spawn_blocking(move || counter.request(op, &body))
                .await
                .unwrap_or(Count {
                    tokens: 0,
                    exact: false,
                })
        } else {
            ep.counter.request(self.req.op, &self.req.body)
        };
        self.counted_prompt.get_or_insert(count.tokens);
        self.counts.insert(key, count.clone());
        count
    }

    /// The 400 for a request no endpoint's window holds.
    fn reject_overflow(&mut self, chain: &[String]) -> Response {
        let largest = chain
            .iter()
            .filter_map(|n| {
                let ep = self.cfg.endpoints.get(n)?;
                Some((n.clone(), self.app.registry.effective_window(ep)?))
            })
            .max_by_key(|(_, w)| *w);
        let counted = self.counted_prompt.unwrap_or(0);
        let max = self.requested_max_tokens();
        let message = match largest {
            Some((name, w)) => format!(
                "This request needs {counted} prompt tokens plus {max} for the completion; the largest context window in its chain is {w} tokens (endpoint `{name}`), of which {:.0}% may be used. Shorten the messages or set on_context_overflow: truncate.",
                self.cfg.policy.context_fill * 100.0
            ),
            None => format!(
                "This request needs {counted} prompt tokens plus {max} for the completion, more than any endpoint in its chain accepts."
            ),
        };
        self.context_error(message)
    }

    /// A 400 `context_length_exceeded` the gateway itself decided, recorded in the audit trail.
    fn context_error(&mut self, message: String) -> Response {
        let err = ApiError::InvalidRequest {
            message,
            param: Some("messages"),
            code: Some("context_length_exceeded"),
        };
        let row = self.base_row(None, 400, Some("context_length_exceeded".into()));
        self.send_row(row);
        let mut resp = err.into_response();
        self.headers(&mut resp, None);
        resp
    }

    /// Trims the conversation to the largest window that refused it; `Err` is the response when
    /// even the protected part does not fit.
    async fn truncate_to_fit(&mut self) -> Result<(), Response> {
        let Some((name, window)) = self.context_skipped.iter().max_by_key(|(_, w)| *w).cloned()
        else {
            return Err(self.all_failed());
        };
        let Some(ep) = self.cfg.endpoints.get(&name).cloned() else {
            return Err(self.all_failed());
        };
        let budget = ((window as f64 * self.cfg.policy.context_fill).floor() as u64)
            .saturating_sub(self.requested_max_tokens());
        let messages = self
            .req
            .body
            .get("messages")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let tools = self
            .req
            .body
            .get("tools")
            .and_then(Value::as_array)
            .map(|t| ep.counter.tools(t))
            .unwrap_or(0);
        let counter = ep.counter.clone();
        let opts = self.cfg.policy.truncation;
        let result = tokio::task::spawn_blocking(move || {
            truncate::truncate(
                &messages,
                budget,
                tokens::REPLY_PRIMING + tools,
                &counter,
                opts,
            )
        })
        .await;
        match result {
            Ok(Ok(t)) => {
                tracing::info!(request_id = %self.request_id, endpoint = %name, dropped_messages = t.dropped_messages, dropped_tokens = t.dropped_tokens, "conversation truncated to fit");
                self.truncation = Some((t.dropped_messages, t.dropped_tokens));
                self.req
                    .body
                    .insert("messages".into(), Value::Array(t.messages));
                self.counts.clear();
                Ok(())
            }
            Ok(Err(e)) => Err(self.context_error(format!(
                "This conversation cannot be truncated to fit: its system messages and latest {} turns alone need {} tokens, and the largest window allows {budget} for the prompt (endpoint `{name}`, {window} tokens).",
                self.cfg.policy.truncation.keep_turns, e.minimum
            ))),
            Err(_) => Err(self.all_failed()),
        }
    }

    /// One pass over the chain. `Some` is the response; `None` means nothing served.
    async fn pass(&mut self, chain: &[String]) -> Option<Response> {
        let policy = self.cfg.policy.clone();
        let wait_until = self.started + policy.max_wait;
        let mut tried: HashSet<String> = HashSet::new();
        let mut reported_skip: HashSet<String> = HashSet::new();
        // Endpoints that answered 429 in this request: `max_wait` may wait for them too.
        let mut rate_limited: HashSet<String> = HashSet::new();
        // After a context-length refusal, only endpoints with a larger window may be tried.
        let mut context_floor: Option<Option<u64>> = None;
        loop {
            let remaining: Vec<String> = chain
                .iter()
                .filter(|n| !tried.contains(*n))
                .cloned()
                .collect();
            // Healthy panic is judged on the whole chain, not on what is left of it.
            let all = self.views(chain);
            let panic = router::in_panic(&all, policy.panic_threshold);
            let left: Vec<View> = all
                .into_iter()
                .filter(|v| !tried.contains(&v.name))
                .collect();
            let mut plan = router::rank(
                &remaining,
                &left,
                &self.req.needs,
                policy.success_threshold,
                panic,
            );
            if plan.order.is_empty() {
                // Health can lower a rank; it must never alone turn a servable request into a
                // 503. With nothing else left, endpoints skipped only for health are the last
                // resort, tried in chain order.
                let last_resort: Vec<String> = plan
                    .skipped
                    .iter()
                    .filter(|(_, s)| matches!(s, router::Skip::Unhealthy { .. }))
                    .map(|(n, _)| n.clone())
                    .collect();
                if !last_resort.is_empty() {
                    plan.skipped
                        .retain(|(_, s)| !matches!(s, router::Skip::Unhealthy { .. }));
                    plan.panic_admitted = last_resort.clone();
                    plan.order = last_resort;
                }
            }
            for (name, skip) in &plan.skipped {
                if reported_skip.insert(name.clone()) {
                    self.skipped(name.clone(), skip.class(), skip.detail());
                }
            }
            self.panic_mode.extend(plan.panic_admitted.iter().cloned());
            if plan.order.is_empty() {
                // Everything left is cooling down — including endpoints that answered 429
                // earlier in this request: wait for the first to come back, within
                // `max_wait`, instead of failing at once.
                let rate_limited: Vec<String> = rate_limited.drain().collect();
                let again = self.views(&rate_limited);
                let soonest = plan
                    .soonest_cooldown()
                    .into_iter()
                    .chain(again.iter().map(|v| match v.avail {
                        crate::registry::Avail::Cooldown(d) => d,
                        _ => Duration::ZERO,
                    }))
                    .min();
                if let Some(d) = soonest {
                    // A floor, so a `Retry-After: 0` loop cannot spin against the upstream.
                    let d = d.max(MIN_REWAIT);
                    if Instant::now() + d <= wait_until {
                        tokio::time::sleep(d).await;
                        for n in rate_limited {
                            tried.remove(&n);
                        }
                        // The wait is reported again if the endpoint is still unusable.
                        reported_skip.clear();
                        continue;
                    }
                }
                return None;
            }
            for name in plan.order {
                if Instant::now() >= self.deadline {
                    // `request_timeout` passed: no new attempt starts; the caller's deadline
                    // answers 504 with what was tried.
                    std::future::pending::<()>().await;
                }
                tried.insert(name.clone());
                let Some(ep) = self.cfg.endpoints.get(&name).cloned() else {
                    continue;
                };
                if ep.backend_tokenize.is_some() && self.req.op != Op::Embeddings {
                    // The backend's count may also teach its window (vLLM's max_model_len).
                    self.prompt_tokens(&ep).await;
                }
                let window = self.app.registry.effective_window(&ep);
                if let Some(floor) = context_floor {
                    // Only a window known to be larger qualifies. When the refusing
                    // endpoint's window is unknown there is nothing to compare: trying the
                    // next one is the only way to find out.
                    let larger = match (window, floor) {
                        (Some(w), Some(f)) => w > f,
                        (_, None) => true,
                        (None, Some(_)) => false,
                    };
                    if !larger {
                        self.skipped(name.clone(), "context_skip", format!(
                                "context window {} is not larger than the {} that refused the prompt",
                                fmt_window(window),
                                fmt_window(floor)
                            ));
                        if let Some(w) = window {
                            self.context_skipped.push((name.clone(), w));
                        }
                        continue;
                    }
                }
                if let Some(w) = window
                    && self.req.op != Op::Embeddings
                {
                    let prompt = self.prompt_tokens(&ep).await;
                    let need = prompt.tokens + self.requested_max_tokens();
                    let allowed = (w as f64 * policy.context_fill).floor() as u64;
                    if need > allowed {
                        self.skipped(name.clone(), "context_skip", format!(
                                "needs {} prompt + {} completion tokens ({}); window {w}, {:.0}% usable = {allowed}",
                                prompt.tokens,
                                self.requested_max_tokens(),
                                if prompt.exact { ep.counter.method() } else { "estimated".into() },
                                policy.context_fill * 100.0
                            ));
                        self.context_skipped.push((name.clone(), w));
                        continue;
                    }
                }
                match self.try_endpoint(&ep).await {
                    EndpointOutcome::Served(s) => return Some(self.respond(ep, *s)),
                    EndpointOutcome::ClientError(status, headers, body) => {
                        return Some(self.respond_passthrough(&ep.name, status, headers, body));
                    }
                    EndpointOutcome::Failed {
                        context,
                        rate_limited: limited,
                    } => {
                        if limited && !policy.max_wait.is_zero() {
                            rate_limited.insert(ep.name.clone());
                        }
                        if context {
                            let w = self.app.registry.effective_window(&ep);
                            context_floor = Some(w);
                            if let Some(w) = w {
                                self.context_skipped.push((ep.name.clone(), w));
                            }
                        }
                    }
                }
                // A context refusal remembers its response: if nothing larger exists, the
                // client gets that 400 rather than a 503.
                if let Some(last) = self.last_context.take() {
                    self.last_context_error = Some(last);
                }
            }
        }
    }

    /// Records an endpoint that was not called (skipped, or ruled out by context size).
    fn skipped(&mut self, endpoint: String, class: impl Into<String>, detail: String) {
        self.attempts.push(AttemptReport {
            endpoint,
            status: None,
            class: class.into(),
            latency_ms: 0.0,
            error: Some(detail),
            panic_mode: false,
            internal: None,
        });
    }

    /// Sends the request's one audit row.
    fn send_row(&mut self, row: RequestRow) {
        self.row_written = true;
        self.app.store.send(Record::Request(Box::new(row)));
    }

    /// The 504 when `routing_policy.request_timeout` passed before anything was served.
    fn request_timed_out(&mut self) -> Response {
        if let Some((endpoint, t0)) = self.current.take() {
            let panic_mode = self.panic_mode.contains(&endpoint);
            self.attempts.push(AttemptReport {
                endpoint,
                status: None,
                class: Class::Timeout.as_str().into(),
                latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
                error: Some("cut off by routing_policy.request_timeout".into()),
                panic_mode,
                internal: None,
            });
        }
        let err = ApiError::RequestTimeout {
            message: format!(
                "No upstream served this request for model `{}` within routing_policy.request_timeout ({}ms); see attempts.",
                self.req.model,
                self.cfg.policy.request_timeout.as_millis()
            ),
            attempts: self.attempts.clone(),
        };
        let row = self.base_row(None, 504, Some(err.class().into()));
        self.send_row(row);
        tracing::warn!(request_id = %self.request_id, model = %self.req.model, attempts = self.attempts.len(), "request timed out");
        let mut resp = err.into_response();
        self.headers(&mut resp, None);
        resp
    }

    /// The upstream request for one attempt (discovered address, payload hygiene, adapter).
    fn build_request(
        &mut self,
        ep: &Endpoint,
        key: Option<&crate::config::Secret>,
        stream: bool,
    ) -> Result<reqwest::RequestBuilder, Failure> {
        let base = self.discovered_base(ep).map_err(|e| *e)?;
        let (rb, sanitized) = upstream::request(
            ep,
            self.req.op,
            &self.req.body,
            stream,
            key,
            &self.request_id,
            base.as_deref(),
        )
        .map_err(|u| Failure::new(Class::Unsupported, None, u.0))?;
        self.sanitized = sanitized;
        // Counted here: a request the adapter could not express never left the gateway.
        self.calls += 1;
        Ok(rb)
    }

    /// For a discovered endpoint, a running task's address; `Err` when there is none.
    fn discovered_base(&self, ep: &Endpoint) -> Result<Option<String>, Box<Failure>> {
        if !ep.discover {
            return Ok(None);
        }
        match self.app.registry.discovered_base(&ep.name) {
            Some(b) => Ok(Some(b)),
            None => Err(Box::new(Failure::new(
                Class::Connect,
                None,
                "no running task discovered for this endpoint",
            ))),
        }
    }

    fn views(&self, names: &[String]) -> Vec<View> {
        self.app.registry.views(&self.cfg, names)
    }

    async fn try_endpoint(&mut self, ep: &Arc<Endpoint>) -> EndpointOutcome {
        let mut retries_left = ep.retries;
        let mut backoff = ep.retry_backoff;
        loop {
            let key_idx = match self.app.registry.pick_key(ep) {
                KeyPick::NotNeeded => None,
                KeyPick::Use(i) => Some(i),
                KeyPick::Exhausted => {
                    self.skipped(
                        ep.name.clone(),
                        "skipped_auth_failed",
                        "no usable API key".into(),
                    );
                    return EndpointOutcome::Failed {
                        context: false,
                        rate_limited: false,
                    };
                }
            };
            let key = key_idx.and_then(|i| ep.keys[i].value.as_ref());
            let t0 = Instant::now();
            self.current = Some((ep.name.clone(), t0));
            let result = if self.req.stream {
                self.call_stream(ep, key).await
            } else {
                self.call_full(ep, key).await
            };
            self.current = None;
            let panic_mode = self.panic_mode.contains(&ep.name);
            let latency = t0.elapsed();
            let latency_ms = latency.as_secs_f64() * 1000.0;
            match result {
                Ok(success) => {
                    let status = match &success {
                        Success::Full { status, .. } => status.as_u16(),
                        Success::Stream { .. } => 200,
                    };
                    self.attempts.push(AttemptReport {
                        endpoint: ep.name.clone(),
                        status: Some(status),
                        class: "ok".into(),
                        latency_ms,
                        error: None,
                        panic_mode,
                        internal: None,
                    });
                    if !self.req.stream {
                        // Streams report their outcome when they end (see `StreamGuard`).
                        self.app.registry.apply(
                            ep,
                            &self.cfg.policy,
                            Effect::Success { latency_ms },
                        );
                    }
                    return EndpointOutcome::Served(Box::new(success));
                }
                Err(f) => {
                    let secrets: Vec<&str> = ep
                        .keys
                        .iter()
                        .filter_map(|k| k.value.as_ref().map(|s| s.expose()))
                        .collect();
                    let detail = classify::redact(&f.detail, &secrets);
                    let internal = f.internal.as_deref().map(|d| classify::redact(d, &secrets));
                    tracing::info!(
                        request_id = %self.request_id,
                        endpoint = %ep.name,
                        class = f.class.as_str(),
                        status = ?f.status,
                        latency_ms,
                        error = %detail,
                        "attempt failed"
                    );
                    self.attempts.push(AttemptReport {
                        endpoint: ep.name.clone(),
                        status: f.status,
                        class: f.class.as_str().into(),
                        latency_ms,
                        error: Some(detail.clone()),
                        panic_mode,
                        internal,
                    });
                    match f.class {
                        Class::Client => {
                            let (s, h, b) = f.passthrough.map(|p| *p).unwrap_or_else(|| {
                                (StatusCode::BAD_REQUEST, HeaderMap::new(), Bytes::new())
                            });
                            return EndpointOutcome::ClientError(s, h, b);
                        }
                        Class::ContextLength => {
                            if let Some(limit) = classify::context_limit(&f.detail) {
                                self.app.registry.learn_window(ep, limit);
                            }
                            self.last_context = f.passthrough.map(|p| *p);
                            return EndpointOutcome::Failed {
                                context: true,
                                rate_limited: false,
                            };
                        }
                        Class::RateLimited => {
                            let for_ = f
                                .retry_after
                                .or(ep.cooldown)
                                .unwrap_or(self.cfg.policy.default_cooldown);
                            self.app.registry.apply(
                                ep,
                                &self.cfg.policy,
                                Effect::Cooldown { for_, detail },
                            );
                            return EndpointOutcome::Failed {
                                context: false,
                                rate_limited: true,
                            };
                        }
                        Class::Unsupported => {
                            return EndpointOutcome::Failed {
                                context: false,
                                rate_limited: false,
                            };
                        }
                        Class::Gone => {
                            self.app.registry.apply(
                                ep,
                                &self.cfg.policy,
                                Effect::Retire { detail },
                            );
                            return EndpointOutcome::Failed {
                                context: false,
                                rate_limited: false,
                            };
                        }
                        Class::Auth => {
                            let more = match key_idx {
                                Some(key) => self.app.registry.apply(
                                    ep,
                                    &self.cfg.policy,
                                    Effect::KeyRejected { key, detail },
                                ),
                                None => {
                                    self.app.registry.apply(
                                        ep,
                                        &self.cfg.policy,
                                        Effect::Failure {
                                            class: f.class.as_str(),
                                            detail,
                                        },
                                    );
                                    false
                                }
                            };
                            if more {
                                continue;
                            }
                            return EndpointOutcome::Failed {
                                context: false,
                                rate_limited: false,
                            };
                        }
                        _ => {
                            self.app.registry.apply(
                                ep,
                                &self.cfg.policy,
                                Effect::Failure {
                                    class: f.class.as_str(),
                                    detail,
                                },
                            );
                            if retries_left > 0 && f.class.retryable_same_endpoint() {
                                retries_left -= 1;
                                // Full jitter: a herd of clients retrying in step is what
                                // keeps a struggling server down.
                                let sleep = backoff.mul_f64(fastrand::f64());
                                tokio::time::sleep(sleep).await;
                                backoff = (backoff * 2).min(Duration::from_secs(5));
                                continue;
                            }
                            return EndpointOutcome::Failed {
                                context: false,
                                rate_limited: false,
                            };
                        }
                    }
                }
            }
        }
    }

    async fn read_error(
        ep: &Endpoint,
        resp: reqwest::Response,
        deadline: Instant,
        max_cooldown: Duration,
    ) -> Failure {
        let status = resp.status();
        let headers = resp.headers().clone();
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
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
        if class == Class::RateLimited {
            f.retry_after = classify::retry_after(&headers, max_cooldown);
        }
        if matches!(class, Class::Client | Class::ContextLength) {
            let mut h = HeaderMap::new();
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
            f.passthrough = Some(Box::new((status, h, body)));
        }
        f
    }

    async fn call_full(
        &mut self,
        ep: &Endpoint,
        key: Option<&crate::config::Secret>,
    ) -> Result<Success, Failure> {
        // Each attempt's timeouts are capped by what is left of the request's own deadline.
        let deadline = (Instant::now() + ep.timeouts.total).min(self.deadline);
        let rb = self.build_request(ep, key, false)?;
        let resp = match timeout_at(deadline, rb.send()).await {
            Err(_) => {
                return Err(Failure::new(
                    Class::Timeout,
                    None,
                    "no response within timeouts.total",
                ));
            }
            Ok(Err(e)) => return Err(send_error(&e)),
            Ok(Ok(r)) => r,
        };
        if !resp.status().is_success() {
            return Err(Self::read_error(ep, resp, deadline, self.cfg.policy.max_cooldown).await);
        }
        let status = resp.status();
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let body = match timeout_at(deadline, resp.bytes()).await {
            Err(_) => {
                return Err(Failure::new(
                    Class::Timeout,
                    Some(status.as_u16()),
                    "body not complete within timeouts.total",
                ));
            }
            Ok(Err(e)) => {
                return Err(Failure::new(
                    Class::Connection,
                    Some(status.as_u16()),
                    format!("reading body: {}", error_chain(&e)),
                ));
            }
            Ok(Ok(b)) => b,
        };
        if ep.kind == EndpointKind::Ollama {
            let parsed: Value = serde_json::from_slice(&body).map_err(|e| {
                Failure::new(
                    Class::Malformed,
                    Some(status.as_u16()),
                    format!("2xx body is not JSON: {e}"),
                )
            })?;
            let translated = upstream::ollama::response_body(
                self.req.op,
                &self.req.model,
                &self.req.body,
                &parsed,
            )
            .map_err(|m| {
                let class = if classify::is_context_message(&m) {
                    Class::ContextLength
                } else {
                    Class::InBand
                };
                Failure::new(class, Some(status.as_u16()), m)
            })?;
            let usage = wire::usage_of(&translated);
            if usage.is_none() {
                self.estimated_out_chars = response_text_chars(&translated);
            }
            return Ok(Success::Full {
                status,
                content_type: Some(HeaderValue::from_static("application/json")),
                body: Bytes::from(translated.to_string()),
                usage,
            });
        }
        let probe: wire::ResponseProbe = serde_json::from_slice(&body).map_err(|e| {
            Failure::new(
                Class::Malformed,
                Some(status.as_u16()),
                format!("2xx body is not JSON: {e}"),
            )
        })?;
        let usage = probe.usage();
        if probe.is_error() || usage.is_none() {
            // Rare paths (an error inside a 200, or no usage to record): read the whole tree.
            let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if let ChunkKind::Error(msg) = wire::classify_chunk(&parsed) {
                return Err(Failure::new(Class::InBand, Some(status.as_u16()), msg));
            }
            self.estimated_out_chars = response_text_chars(&parsed);
        }
        Ok(Success::Full {
            status,
            content_type,
            body,
            usage,
        })
    }

    async fn call_stream(
        &mut self,
        ep: &Endpoint,
        key: Option<&crate::config::Secret>,
    ) -> Result<Success, Failure> {
        let t0 = Instant::now();
        let first_deadline = (t0 + ep.timeouts.first_token)
            .min(t0 + ep.timeouts.total)
            .min(self.deadline);
        let rb = self.build_request(ep, key, true)?;
        let resp = match timeout_at(first_deadline, rb.send()).await {
            Err(_) => {
                return Err(Failure::new(
                    Class::FirstTokenTimeout,
                    None,
                    "no response headers within timeouts.first_token",
                ));
            }
            Ok(Err(e)) => return Err(send_error(&e)),
            Ok(Ok(r)) => r,
        };
        if !resp.status().is_success() {
            let deadline = (t0 + ep.timeouts.total).min(self.deadline);
            return Err(Self::read_error(ep, resp, deadline, self.cfg.policy.max_cooldown).await);
        }
        let status = resp.status().as_u16();
        let mut usage_tap = None;
        let mut rest: ByteStream = if ep.kind == EndpointKind::Ollama {
            let include_usage = self
                .req
                .body
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let tr = upstream::ollama::StreamTranslator::new(
                self.req.op,
                &self.req.model,
                include_usage,
            );
            let (s, tap) = upstream::ollama::SseFromNdjson::new(Box::pin(resp.bytes_stream()), tr);
            usage_tap = Some(tap);
            Box::pin(s)
        } else {
            let is_sse = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            if !is_sse {
                // A JSON body on a stream request is an error some servers send with 200.
                let body = timeout_at(first_deadline, resp.bytes()).await;
                let detail = match body {
                    Ok(Ok(b)) => match serde_json::from_slice::<Value>(&b) {
                        Ok(v) => match wire::classify_chunk(&v) {
                            ChunkKind::Error(m) => {
                                return Err(Failure::new(Class::InBand, Some(status), m));
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
                return Err(Failure::new(Class::Malformed, Some(status), detail));
            }
            Box::pin(resp.bytes_stream())
        };
        let mut parser = SseParser::new();
        let mut prelude = Vec::new();
        let mut usage = None;
        let mut out_chars = 0usize;
        loop {
            let next = match timeout_at(first_deadline, rest.next()).await {
                Err(_) => {
                    return Err(Failure::new(
                        Class::FirstTokenTimeout,
                        Some(status),
                        format!(
                            "no content within timeouts.first_token ({}ms)",
                            ep.timeouts.first_token.as_millis()
                        ),
                    ));
                }
                Ok(None) => {
                    return Err(Failure::new(
                        Class::Connection,
                        Some(status),
                        "stream ended before any content",
                    ));
                }
                Ok(Some(Err(e))) => {
                    return Err(Failure::new(
                        Class::Connection,
                        Some(status),
                        format!("stream broke before any content: {}", error_chain(&e)),
                    ));
                }
                Ok(Some(Ok(b))) => b,
            };
            let events = parser.push(&next).map_err(|e| {
                Failure::new(
                    Class::Malformed,
                    Some(status),
                    format!("invalid SSE: {}", e.0),
                )
            })?;
            prelude.push(next);
            let mut commit = false;
            let mut done_seen = false;
            for ev in events {
                if ev.data.trim() == "[DONE]" {
                    done_seen = true;
                    commit = true;
                    continue;
                }
                let v: Value = match serde_json::from_str(&ev.data) {
                    Ok(v) => v,
                    Err(_) if ev.event.as_deref() == Some("error") => {
                        return Err(Failure::new(Class::InBand, Some(status), ev.data));
                    }
                    Err(e) => {
                        return Err(Failure::new(
                            Class::Malformed,
                            Some(status),
                            format!("SSE data is not JSON: {e}"),
                        ));
                    }
                };
                if let Some(u) = wire::usage_of(&v) {
                    usage = Some(u);
                }
                match wire::classify_chunk(&v) {
                    ChunkKind::Error(m) => {
                        let class = if classify::is_context_message(&m) {
                            Class::ContextLength
                        } else {
                            Class::InBand
                        };
                        return Err(Failure::new(class, Some(status), m));
                    }
                    ChunkKind::Content => {
                        out_chars += chunk_text_chars(&v);
                        commit = true;
                    }
                    ChunkKind::Preamble => {}
                }
            }
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
                });
            }
        }
    }

    fn base_row(
        &self,
        endpoint: Option<&str>,
        status: u16,
        error_class: Option<String>,
    ) -> RequestRow {
        RequestRow {
            request_id: self.request_id.clone(),
            ts: self.started_wall,
            operation: self.req.op.name(),
            requested_model: Some(self.req.model.clone()),
            endpoint: endpoint.map(str::to_string),
            status,
            error_class,
            stream: self.req.stream,
            latency_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            ttft_ms: None,
            tokens_in: None,
            tokens_out: None,
            tokens_estimated: false,
            cost_usd: None,
            prompt_tokens_counted: self.counted_prompt,
            truncated_messages: self.truncation.map(|t| t.0 as u64).unwrap_or(0),
            truncated_tokens: self.truncation.map(|t| t.1).unwrap_or(0),
            sanitized_chars: self.sanitized,
            attempts: self
                .attempts
                .iter()
                .enumerate()
                .map(|(i, a)| AttemptRow {
                    seq: i as u32 + 1,
                    endpoint: a.endpoint.clone(),
                    class: a.class.clone(),
                    status: a.status,
                    // The audit row keeps the internal detail (a task's address); the client's
                    // body has the redacted one.
                    error: a.internal.clone().or_else(|| a.error.clone()),
                    latency_ms: a.latency_ms,
                    panic_mode: a.panic_mode,
                })
                .collect(),
        }
    }

    fn headers(&self, resp: &mut Response, endpoint: Option<&str>) {
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            h.insert("x-request-id", v);
        }
        if let Some(ep) = endpoint.and_then(|e| HeaderValue::from_str(e).ok()) {
            h.insert("x-autohedge-endpoint", ep);
        }
        h.insert("x-autohedge-attempts", HeaderValue::from(self.calls));
        if let Some((m, t)) = self.truncation
            && let Ok(v) = HeaderValue::from_str(&format!("{m}/{t}"))
        {
            h.insert("x-autohedge-truncated", v);
        }
    }

    fn respond_passthrough(
        &mut self,
        endpoint: &str,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        let class = classify::classify_status(status.as_u16(), &String::from_utf8_lossy(&body));
        let row = self.base_row(Some(endpoint), status.as_u16(), Some(class.as_str().into()));
        self.send_row(row);
        let mut resp = (status, body).into_response();
        for (k, v) in headers.iter() {
            resp.headers_mut().insert(k.clone(), v.clone());
        }
        if !resp.headers().contains_key(header::CONTENT_TYPE) {
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        self.headers(&mut resp, Some(endpoint));
        resp
    }

    fn all_failed(&mut self) -> Response {
        let real: Vec<&AttemptReport> = self
            .attempts
            .iter()
            .filter(|a| !a.class.starts_with("skipped_") && a.class != "context_skip")
            .collect();
        let message = if real.is_empty() {
            format!(
                "No endpoint could take this request for model `{}`: every candidate was skipped (see attempts).",
                self.req.model
            )
        } else {
            format!(
                "All {} upstream attempts for model `{}` failed (see attempts).",
                real.len(),
                self.req.model
            )
        };
        let err = ApiError::AllFailed {
            message,
            attempts: self.attempts.clone(),
        };
        let row = self.base_row(None, 503, Some(err.class().into()));
        self.send_row(row);
        tracing::warn!(request_id = %self.request_id, model = %self.req.model, attempts = self.attempts.len(), "all upstreams failed");
        let mut resp = err.into_response();
        self.headers(&mut resp, None);
        resp
    }

    fn respond(&mut self, ep: Arc<Endpoint>, success: Success) -> Response {
        match success {
            Success::Full {
                status,
                content_type,
                body,
                usage,
            } => {
                let mut row = self.base_row(Some(&ep.name), status.as_u16(), None);
                let prompt_estimate = self
                    .counted_prompt
                    .unwrap_or_else(|| wire::estimate_tokens(wire::prompt_chars(&self.req.body)));
                let out_estimate = wire::estimate_tokens(self.estimated_out_chars);
                fill_usage(
                    &mut row,
                    &ep,
                    usage,
                    prompt_estimate,
                    out_estimate,
                    self.req.op,
                );
                self.app.registry.record_tokens(
                    &ep.name,
                    row.tokens_in.unwrap_or(0),
                    row.tokens_out.unwrap_or(0),
                    row.tokens_estimated,
                );
                self.send_row(row);
                let mut resp = (status, body).into_response();
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    content_type.unwrap_or(HeaderValue::from_static("application/json")),
                );
                self.headers(&mut resp, Some(&ep.name));
                resp
            }
            Success::Stream {
                prelude,
                rest,
                parser,
                done_seen,
                ttft,
                usage,
                out_chars,
                usage_tap,
            } => {
                let mut row = self.base_row(Some(&ep.name), 200, None);
                row.ttft_ms = Some(self.started.elapsed().as_secs_f64() * 1000.0);
                let guard = StreamGuard {
                    app: self.app.clone(),
                    cfg: self.cfg.clone(),
                    ep: ep.clone(),
                    row: Some(row),
                    started: self.started,
                    ttft,
                    usage,
                    out_chars,
                    prompt_estimate: self.counted_prompt.unwrap_or_else(|| {
                        wire::estimate_tokens(wire::prompt_chars(&self.req.body))
                    }),
                    usage_tap,
                    op: self.req.op,
                };
                // The StreamGuard owns the row from here on.
                self.row_written = true;
                let idle = ep.timeouts.first_token;
                let deadline =
                    (Instant::now() + ep.timeouts.total.saturating_sub(ttft)).min(self.deadline);
                let state = PassThrough {
                    prelude: prelude.into(),
                    rest,
                    parser,
                    done_seen,
                    finished: false,
                    idle,
                    deadline,
                    guard,
                    // One waiter for the stream's life, not one per chunk.
                    stop: Box::pin(self.app.hard_stop.clone().cancelled_owned()),
                };
                let body = Body::from_stream(futures_util::stream::unfold(state, pump));
                let mut resp = Response::new(body);
                let h = resp.headers_mut();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                );
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                self.headers(&mut resp, Some(&ep.name));
                resp
            }
        }
    }
}

fn fmt_window(w: Option<u64>) -> String {
    w.map(|w| w.to_string()).unwrap_or_else(|| "unknown".into())
}

fn fill_usage(
    row: &mut RequestRow,
    ep: &Endpoint,
    usage: Option<Usage>,
    prompt_estimate: u64,
    out_estimate: u64,
    op: Op,
) {
    let (tin, tout, est) = match usage {
        Some(u) => (u.prompt, u.completion, false),
        None => (
            prompt_estimate,
            if op == Op::Embeddings {
                0
            } else {
                out_estimate
            },
            true,
        ),
    };
    row.tokens_in = Some(tin);
    row.tokens_out = Some(tout);
    row.tokens_estimated = est;
    if ep.cost.input_per_mtok > 0.0 || ep.cost.output_per_mtok > 0.0 {
        row.cost_usd = Some(
            (tin as f64 * ep.cost.input_per_mtok + tout as f64 * ep.cost.output_per_mtok) / 1e6,
        );
    }
}

/// Characters of generated text in a full response, for estimating completion tokens.
fn response_text_chars(v: &Value) -> usize {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return 0;
    };
    choices
        .iter()
        .map(|c| {
            c.pointer("/message/content")
                .and_then(Value::as_str)
                .map(str::len)
                .unwrap_or(0)
                + c.get("text")
                    .and_then(Value::as_str)
                    .map(str::len)
                    .unwrap_or(0)
        })
        .sum()
}

fn chunk_text_chars(v: &Value) -> usize {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return 0;
    };
    choices
        .iter()
        .map(|c| {
            c.pointer("/delta/content")
                .and_then(Value::as_str)
                .map(str::len)
                .unwrap_or(0)
                + c.get("text")
                    .and_then(Value::as_str)
                    .map(str::len)
                    .unwrap_or(0)
        })
        .sum()
}

/// The message inside an upstream error body, whatever its shape (OpenAI's `error.message`,
/// vLLM's top-level `message`, Ollama's `error` string), else the body itself.
fn error_message(body: &str) -> String {
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

fn error_chain(e: &dyn std::error::Error) -> String {
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

fn send_error(e: &reqwest::Error) -> Failure {
    let class = if e.is_connect() {
        Class::Connect
    } else if e.is_timeout() {
        Class::Timeout
    } else {
        Class::Connection
    };
    // reqwest's Display includes the URL: a discovered task's internal address, which belongs in
    // the audit row, not in a client's 503 body.
    let full = error_chain(e);
    let shown = match e.url() {
        Some(u) => full.replace(&format!(" for url ({u})"), ""),
        None => full.clone(),
    };
    let mut f = Failure::new(class, None, shown);
    f.internal = Some(full);
    f
}

/// Owns a committed stream's audit row and reports the outcome exactly once: when the stream
/// ends, fails, or is dropped because the client went away.
struct StreamGuard {
    app: Arc<AppState>,
    cfg: Arc<Config>,
    ep: Arc<Endpoint>,
    row: Option<RequestRow>,
    started: Instant,
    ttft: Duration,
    usage: Option<Usage>,
    out_chars: usize,
    prompt_estimate: u64,
    /// Exact counts a translating adapter saw (Ollama's final object).
    usage_tap: Option<upstream::ollama::UsageTap>,
    op: Op,
}

impl StreamGuard {
    fn finish(&mut self, failure: Option<(&'static str, String)>) {
        let Some(mut row) = self.row.take() else {
            return;
        };
        // In-band error texts are upstream bytes: redacted like every other upstream error.
        let failure = failure.map(|(class, detail)| {
            let secrets: Vec<&str> = self
                .ep
                .keys
                .iter()
                .filter_map(|k| k.value.as_ref().map(|s| s.expose()))
                .collect();
            (class, classify::redact(&detail, &secrets))
        });
        row.latency_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let out_estimate = wire::estimate_tokens(self.out_chars);
        let tapped = self
            .usage_tap
            .as_ref()
            .and_then(|t| t.lock().ok().and_then(|u| *u));
        fill_usage(
            &mut row,
            &self.ep,
            self.usage.or(tapped),
            self.prompt_estimate,
            out_estimate,
            self.op,
        );
        self.app.registry.record_tokens(
            &self.ep.name,
            row.tokens_in.unwrap_or(0),
            row.tokens_out.unwrap_or(0),
            row.tokens_estimated,
        );
        let ttft_ms = self.ttft.as_secs_f64() * 1000.0;
        match failure {
            None => {
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Success {
                        latency_ms: ttft_ms,
                    },
                );
            }
            Some((class @ ("client_closed" | "shutdown"), _)) => {
                // The client left, or shutdown cut the stream: not the endpoint's fault, but
                // the record says so.
                row.error_class = Some(class.into());
            }
            Some((class, detail)) => {
                row.error_class = Some(class.into());
                let n = row.attempts.len() as u32 + 1;
                row.attempts.push(AttemptRow {
                    seq: n,
                    endpoint: self.ep.name.clone(),
                    class: class.into(),
                    status: Some(200),
                    error: Some(detail.clone()),
                    latency_ms: row.latency_ms,
                    panic_mode: false,
                });
                tracing::warn!(request_id = %row.request_id, endpoint = %self.ep.name, class, error = %detail, "stream failed after commit");
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Failure { class, detail },
                );
            }
        }
        self.app.store.send(Record::Request(Box::new(row)));
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.row.is_some() {
            self.finish(Some((
                "client_closed",
                "client disconnected mid-stream".into(),
            )));
        }
    }
}

struct PassThrough {
    prelude: VecDeque<Bytes>,
    rest: ByteStream,
    parser: SseParser,
    done_seen: bool,
    finished: bool,
    idle: Duration,
    deadline: Instant,
    guard: StreamGuard,
    /// Cancelled when shutdown cuts the requests still running.
    stop: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl PassThrough {
    /// Watches the passing bytes for usage, `[DONE]` and in-band errors without holding them.
    fn scan(&mut self, b: &Bytes) -> Option<String> {
        let events = match self.parser.push(b) {
            Ok(e) => e,
            Err(e) => return Some(e.0),
        };
        let mut err = None;
        for ev in events {
            if ev.data.trim() == "[DONE]" {
                self.done_seen = true;
                continue;
            }
            if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                if let Some(u) = wire::usage_of(&v) {
                    self.guard.usage = Some(u);
                }
                match wire::classify_chunk(&v) {
                    ChunkKind::Error(m) => err = Some(m),
                    ChunkKind::Content => self.guard.out_chars += chunk_text_chars(&v),
                    ChunkKind::Preamble => {}
                }
            }
        }
        err
    }
}

async fn pump(mut st: PassThrough) -> Option<(Result<Bytes, std::io::Error>, PassThrough)> {
    if let Some(b) = st.prelude.pop_front() {
        if st.prelude.is_empty() && st.done_seen && !st.finished {
            // `[DONE]` came with the first chunks: the stream is complete for the client.
            st.finished = true;
            st.guard.finish(None);
        }
        return Some((Ok(b), st));
    }
    if st.finished {
        return None;
    }
    let wait_until = (Instant::now() + st.idle).min(st.deadline);
    let next = tokio::select! {
        r = timeout_at(wait_until, st.rest.next()) => r,
        _ = &mut st.stop => {
            st.finished = true;
            st.guard.finish(Some(("shutdown", "cut by shutdown after shutdown_grace".into())));
            let ev = stream_error_event("The gateway is shutting down.", "shutdown");
            return Some((Ok(Bytes::from(ev)), st));
        }
    };
    match next {
        Ok(Some(Ok(b))) => {
            if let Some(err) = st.scan(&b) {
                // The upstream's own error event passes through to the client as sent.
                st.finished = true;
                st.guard.finish(Some(("stream_error_event", err)));
            } else if st.done_seen {
                // `data: [DONE]` ends the stream for the client; whatever the upstream does
                // with its connection afterwards is not the client's problem, nor a failure.
                st.finished = true;
                st.guard.finish(None);
            }
            Some((Ok(b), st))
        }
        Ok(None) => {
            st.finished = true;
            if st.done_seen {
                st.guard.finish(None);
                None
            } else {
                st.guard.finish(Some((
                    "stream_truncated",
                    "upstream closed the stream without [DONE]".into(),
                )));
                let ev = stream_error_event(
                    "The upstream closed the stream before it finished.",
                    "stream_truncated",
                );
                Some((Ok(Bytes::from(ev)), st))
            }
        }
        Ok(Some(Err(e))) => {
            st.finished = true;
            let detail = error_chain(&e);
            st.guard.finish(Some(("stream_broken", detail)));
            let ev = stream_error_event(
                "The upstream connection failed mid-stream.",
                "stream_broken",
            );
            Some((Ok(Bytes::from(ev)), st))
        }
        Err(_) => {
            st.finished = true;
            let total = Instant::now() >= st.deadline;
            let (code, msg) = if total {
                ("stream_timeout", "The stream exceeded timeouts.total.")
            } else {
                ("stream_stalled", "The upstream stalled mid-stream.")
            };
            st.guard.finish(Some((code, msg.into())));
            Some((Ok(Bytes::from(stream_error_event(msg, code))), st))
        }
    }
}
