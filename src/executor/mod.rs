//! The failover executor: a plain loop over the ranked candidates, each attempt under its own
//! timeouts, each outcome mapped to one action (fail over, cool down, retire, rotate key, or give
//! the client its own error back). Every attempt is recorded.
//!
//! Streams are committed only when an upstream has produced its first content chunk: until then
//! nothing reaches the client, so any failure — connection, status, in-band error event, no first
//! chunk within `first_token` — fails over invisibly. After the commit, bytes pass straight
//! through; a failure then ends the stream with an OpenAI-style error event.

/// Sets and maps of endpoint names (config names, a handful a request): foldhash, several times
/// cheaper than the standard library's SipHash for a short name, looked up a few times a request.
type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use tokio::time::Instant;

use crate::config::{Config, Endpoint, Overflow, Secret};
use crate::error::AttemptReport;
use crate::routing::balance;
use crate::routing::blame::Witness;
use crate::routing::outcome::{self, Action, Hints, Outcome};
use crate::routing::registry::{Effect, KeyPick, Picked, Want, tuning};
use crate::routing::router::{self, View};
use crate::state::AppState;
use crate::store::RequestRow;
use crate::tokens::{self, Count};
use crate::upstream::classify;
use crate::wire::{Inbound, Op};

mod attempt;
pub mod capture;
mod context;
mod deadline;
pub mod last_resort;
mod race;
mod respond;
pub mod responses;
mod stream;
mod usage;

use attempt::{Attempt, Failure, Success};

/// `start + d`, saturating: config durations are capped at load (365 days), but a deadline is
/// never where an outsized value may panic a request.
pub fn after(start: Instant, d: Duration) -> Instant {
    start
        .checked_add(d)
        .unwrap_or_else(|| start + Duration::from_secs(crate::config::duration::MAX_SECS))
}
use context::fmt_window;
use race::Racing;

/// Bodies with more text than this are counted on the counting threads (`tokens::pool`), not
/// on an async worker: 16 KiB of prose is about 0.1 ms of counting (`cargo bench --bench
/// tokens` prints the figures), text in varied scripts up to 0.5 ms — the most a small request
/// queued behind it on the same worker may wait; past it, the hand-off (tens of µs) is cheaper.
const BLOCKING_COUNT_CHARS: usize = 16 * 1024;

/// Test hooks are on only in a debug build whose environment sets `AUTOHEDGE_TEST_HOOKS`.
#[cfg(debug_assertions)]
static TEST_HOOKS: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var_os("AUTOHEDGE_TEST_HOOKS").is_some());

/// The shortest wait before an endpoint that answered 429 in this request is tried again, so a
/// `Retry-After: 0` cannot turn `max_wait` into a tight loop against the upstream.
const MIN_REWAIT: Duration = Duration::from_millis(100);

/// Who is asking, as the front door established it.
#[derive(Default)]
pub struct Caller {
    /// The client key's name (`auth.keys[].name`), for the audit row and the key's spend.
    pub client: Option<String>,
    /// The key's hold on its limits, settled with the request's audit row.
    pub admission: Option<crate::clients::Admission>,
    /// The plaintext of a valid `x-encrypted-key`: the upstream key of OpenAI-type endpoints
    /// for this request only.
    pub key: Option<Secret>,
    /// When the front door began on the request (the gateway's own time is measured from it).
    pub arrived: Option<Instant>,
    /// The endpoints the client key's `models` allow-list covers ([`Config::covered_by`]);
    /// `None`: every endpoint.
    pub allowed: Option<std::collections::BTreeSet<String>>,
    /// A `/v1/responses` request's id and conversation ([`responses::plan`]).
    pub responses: Option<responses::ResponsesCtx>,
    /// Its trace, when it has one (`telemetry.otlp`, or a client's `traceparent` passed on).
    pub trace: Option<Box<crate::wire::trace::Trace>>,
    /// `autohedge replay`: the request id this request replays.
    pub replay_of: Option<String>,
    /// For `audit.capture_bodies`: what the front door saw of the request.
    pub capture: Option<Box<capture::CaptureIn>>,
}

/// One request's journey.
struct Run {
    app: Arc<AppState>,
    cfg: Arc<Config>,
    /// Shared so a hedged attempt (a future of its own) can hold it; truncation copies on write.
    req: Arc<Inbound>,
    request_id: String,
    started: Instant,
    started_wall: SystemTime,
    attempts: Vec<AttemptReport>,
    /// Upstream calls made (skips excluded): the `x-autohedge-attempts` header.
    calls: u32,
    /// Prompt tokens per counting method (endpoints that count alike share one count).
    counts: HashMap<String, Count>,
    /// The first count made, for the audit row.
    counted_prompt: Option<u64>,
    /// The prompt's byte bound on its tokens, once computed ([`Run::fits_by_bound`]).
    prompt_bound: Option<u64>,
    /// Endpoints skipped because the prompt did not fit, with their windows.
    context_skipped: Vec<(String, u64)>,
    /// The response of the latest context-length refusal, returned if nothing larger exists.
    last_context_error: Option<(StatusCode, HeaderMap, Bytes)>,
    /// What failed attempts the upstream billed (their answers reported `usage`) used and cost:
    /// added to the request's row and its key's bill.
    billed: Option<usage::Leg>,
    /// The last failure of the request's own key (429, 404, 410) and its endpoint: the answer
    /// when no endpoint serves, instead of a 503.
    own_key_answer: Option<(String, (StatusCode, HeaderMap, Bytes))>,
    /// (messages, tokens) dropped by truncation.
    truncation: Option<(usize, u64)>,
    /// Characters payload hygiene changed in the body sent upstream.
    sanitized: u64,
    /// `routing_policy.request_timeout` from the start: nothing of this request outlives it.
    deadline: Instant,
    /// The audit row was written (or handed to a `StreamGuard`): `Drop` writes one otherwise.
    row_written: bool,
    /// The upstream call in flight, for the record when the request is cut off mid-attempt.
    /// (The endpoint's `Arc`, not its name: set on every attempt, it costs a refcount.)
    /// Its span, when known here (a raced attempt's; a plain one's is `last_span`).
    current: Option<(Arc<Endpoint>, Instant, Option<crate::wire::trace::SpanId>)>,
    /// A hedged copy in flight beside `current`.
    current_hedge: Option<(Arc<Endpoint>, Instant, Option<crate::wire::trace::SpanId>)>,
    /// This request's hedging (`route:NAME` or `endpoint:NAME` budget, and the spec).
    hedge: Option<(String, crate::routing::hedge::Spec)>,
    hedges_sent: u32,
    /// A hedged copy served the request (`x-autohedge-hedged: true`).
    hedge_won: bool,
    /// The current pass over the chain.
    pass: PassState,
    /// Endpoints tried although their rate-limit budget was predicted short (the last resort).
    forced: HashSet<String>,
    /// The chain, when the route continues broken streams (`continue_streams: true`).
    continue_chain: Option<Arc<[String]>>,
    /// The client key's name, when `auth.keys` is set.
    client: Option<String>,
    /// The client key's hold on its limits: settled with the audit row (or by a committed
    /// stream's guard, which takes it).
    admission: Option<crate::clients::Admission>,
    /// The request's own upstream key (`x-encrypted-key`), for OpenAI-type endpoints.
    own_key: Option<Secret>,
    /// Endpoints tried although health said to skip them (healthy panic, last resort).
    panic_mode: HashSet<String>,
    /// Endpoints whose backend `/tokenize` failed in this request (the local count is used).
    backend_failed: HashSet<String>,
    /// Time spent waiting on upstreams (attempts, backend counts) and deliberate waits
    /// (`max_wait`, retry backoff, the hedge delay): the rest is the gateway's own overhead.
    waited: Duration,
    /// A `/v1/responses` request's own part: its response id, pin and replay.
    responses: Option<Arc<responses::ResponsesCtx>>,
    /// The pinned endpoint said it no longer holds the conversation: it gets the replay too.
    pin_lost: bool,
    /// Addresses that failed this request for a reason of their own: its later attempts go
    /// elsewhere while another address can take them.
    failed_at: Vec<Arc<str>>,
    /// Endpoints that answered this request's `/responses` with a 404 that may be about the
    /// request alone: this request goes to them translated, the others as the endpoint speaks.
    chat_here: Vec<String>,
    /// The request's trace: each attempt's span id goes upstream in `traceparent`.
    trace: Option<Box<crate::wire::trace::Trace>>,
    /// The span of the attempt `attempt` last sent (read back when it is settled).
    last_span: Option<crate::wire::trace::SpanId>,
    /// Where its answer is kept and looked up, when its model has `last_resort:`.
    last_resort: Option<Box<last_resort::Slot>>,
    /// Its bodies for the audit row (`audit.capture_bodies`).
    audit: Option<Box<capture::Audit>>,
    /// The full answer the client gets, for `audit` (set just before the row is sent).
    audit_response: Option<Bytes>,
    /// `autohedge replay`: the request this one replays.
    replay_of: Option<String>,
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
            (500, Outcome::InternalPanic)
        } else if self.app.shutting_down() {
            (503, Outcome::Shutdown)
        } else {
            (499, Outcome::ClientClosed)
        };
        for (ep, t0, trace) in self.in_flight() {
            self.attempts.push(AttemptReport {
                endpoint: ep.name.clone(),
                status: None,
                class,
                latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
                error: Some("the request ended while this attempt was in flight".into()),
                panic_mode: false,
                own_key: false,
                internal: None,
                address: None,
                trace,
            });
        }
        let row = self.base_row(None, status, Some(class.as_str().into()));
        self.send_row(row);
    }
}

/// Serves one validated request and returns the response. Always writes exactly one audit row
/// (also when the future is dropped, polled or not: the `Run` exists from this call on).
///
/// The request's state is built here, outside the future, and boxed: the future the front door
/// boxes (and so copies, once a request) holds a pointer to it and the attempt's own state, not
/// the arguments a second time beside the `Run` they became. At 8.6 KB it was copied by
/// `rep movsb` — 8.6k of callgrind's instructions a request —, now well under the 4 KiB at which
/// glibc's memcpy switches to it.
pub fn execute(
    app: Arc<AppState>,
    cfg: Arc<Config>,
    req: Inbound,
    chain: Arc<[String]>,
    request_id: String,
    caller: Caller,
) -> impl Future<Output = Response> + Send + 'static {
    let arrived = caller.arrived;
    // The allow-list holds over the whole path: endpoints the key does not cover leave the chain
    // here, so neither the first attempt, a hedge, a retry nor a continuation can reach them.
    let mut not_allowed = Vec::new();
    let chain = match &caller.allowed {
        Some(allowed) if chain.iter().any(|n| !allowed.contains(n)) => {
            let (kept, out): (Vec<String>, Vec<String>) =
                chain.iter().cloned().partition(|n| allowed.contains(n));
            not_allowed = out;
            Arc::from(kept)
        }
        _ => chain,
    };
    let hedge = hedge_for(&app, &cfg, &req, &chain);
    let continue_chain = (req.stream
        && req.op == Op::Chat
        && cfg.route_continue.contains(&req.model)
        && !req.has_tools_key())
    .then(|| chain.clone());
    let started = Instant::now();
    let mut run = Box::new(Run {
        app,
        cfg,
        req: Arc::new(req),
        request_id,
        started,
        started_wall: SystemTime::now(),
        // Every request records at least one attempt (or skip).
        attempts: Vec::with_capacity(1),
        calls: 0,
        counts: HashMap::default(),
        counted_prompt: None,
        prompt_bound: None,
        context_skipped: Vec::new(),
        last_context_error: None,
        own_key_answer: None,
        billed: None,
        truncation: None,
        sanitized: 0,
        // Set below, from the request's arrival.
        deadline: started,
        row_written: false,
        current: None,
        current_hedge: None,
        hedge,
        hedges_sent: 0,
        hedge_won: false,
        pass: PassState::default(),
        forced: HashSet::default(),
        continue_chain,
        client: caller.client,
        admission: caller.admission,
        own_key: caller.key,
        panic_mode: HashSet::default(),
        backend_failed: HashSet::default(),
        waited: Duration::ZERO,
        responses: caller.responses.map(Arc::new),
        pin_lost: false,
        failed_at: Vec::new(),
        chat_here: Vec::new(),
        trace: caller.trace,
        last_span: None,
        last_resort: None,
        audit: None,
        audit_response: None,
        replay_of: caller.replay_of,
    });
    run.audit = capture::Audit::of(
        &run.cfg,
        &run.req,
        run.own_key.is_some(),
        run.client.as_deref(),
        caller.capture,
    );
    if let Some(spec) = run.cfg.last_resort.get(&run.req.model) {
        run.last_resort = last_resort::Slot::of(
            run.req.op,
            &run.req.model,
            run.client.as_deref(),
            run.req.body(),
            *spec,
        )
        .map(Box::new);
    }
    let client = run.client.clone().unwrap_or_default();
    for name in not_allowed {
        run.skipped(
            name,
            Outcome::SkippedNotAllowed,
            format!("client key `{client}` may not use this endpoint (auth.keys[].models)"),
        );
    }
    let arrived = arrived.unwrap_or(run.started);
    // From the front door's start: the wait for Vault's decrypt of `x-encrypted-key` counts.
    run.deadline = after(arrived, run.cfg.policy.request_timeout);
    let deadline = run.deadline;
    async move {
        match deadline::within(deadline, run.go(chain)).await {
            Ok(resp) => {
                // Until the response (a stream: its commit) started, less the waiting.
                crate::ops::telemetry::overhead(arrived.elapsed().saturating_sub(run.waited));
                resp
            }
            Err(_) => run.request_timed_out(),
        }
    }
}

/// This request's hedging: its route's `hedge:`, else that of the endpoint its chain starts
/// with. The request is counted into the budget (it pays `max_extra` of a hedge). Requests with
/// `tools` hedge only with `hedge.tools: true`.
fn hedge_for(
    app: &AppState,
    cfg: &Config,
    req: &Inbound,
    chain: &[String],
) -> Option<(String, crate::routing::hedge::Spec)> {
    let (key, spec) = match cfg.route_hedge.get(&req.model) {
        Some(s) => (format!("route:{}", req.model), *s),
        None => {
            // Checked before the key is formatted: the common case allocates nothing.
            let first = chain.first()?;
            let spec = cfg.endpoints.get(first)?.hedge?;
            (format!("endpoint:{first}"), spec)
        }
    };
    if req.has_tools_key() && !spec.tools {
        return None;
    }
    app.hedge_budget(&key, |b| b.on_request(spec.max_extra));
    Some((key, spec))
}

/// What one pass over the chain has learnt so far.
#[derive(Default)]
struct PassState {
    tried: HashSet<String>,
    reported_skip: HashSet<String>,
    /// Endpoints that answered 429 in this request: `max_wait` may wait for them too.
    rate_limited: HashSet<String>,
    /// After a context-length refusal, only endpoints with a larger window may be tried.
    context_floor: Option<Option<u64>>,
    /// Endpoints skipped because their rate-limit budget was predicted short, with the wait.
    deferred: Vec<(String, Duration)>,
}

/// One finished attempt, before its outcome is applied.
struct Finished {
    key_idx: Option<usize>,
    t0: Instant,
    result: Result<Success, Failure>,
    /// Its span, when the request is traced.
    span: Option<crate::wire::trace::SpanId>,
    /// A hedged copy.
    hedge: bool,
}

/// What applying one attempt's outcome leads to.
enum Settled {
    Done(EndpointOutcome),
    /// The key was rejected and the endpoint has another: try it at once.
    NextKey,
    /// A failure that a retry on the same endpoint may cure (if `retries` are left).
    Retry,
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
    /// Not called: every usable key's rate-limit budget is predicted short for this long.
    Predicted(Duration),
}

const FAILED: EndpointOutcome = EndpointOutcome::Failed {
    context: false,
    rate_limited: false,
};

impl Run {
    async fn go(&mut self, chain: Arc<[String]>) -> Response {
        // Debug builds started with AUTOHEDGE_TEST_HOOKS only: lets the test suite prove that a
        // panic inside a request becomes a 500 with its audit row. A client's model name alone
        // cannot reach it, and the release binary has no such code.
        #[cfg(debug_assertions)]
        if *TEST_HOOKS && self.req.model == "__autohedge_test_panic__" {
            panic!("test-triggered panic inside the executor");
        }
        if let Some(resp) = self.served_from_cache() {
            return resp;
        }
        let mut truncated_once = false;
        loop {
            if let Some(resp) = self.pass(&chain).await {
                return resp;
            }
            // Nothing served. If the only obstacle was context size, apply the overflow policy.
            let only_context = !self.context_skipped.is_empty() && self.only_context_refusals();
            if !only_context {
                break;
            }
            match self.overflow_policy() {
                Overflow::Truncate if !truncated_once && self.req.op == Op::Chat => {
                    truncated_once = true;
                    if let Err(resp) = Box::pin(self.truncate_to_fit()).await {
                        return resp;
                    }
                    self.context_skipped.clear();
                    self.last_context_error = None;
                }
                _ => return self.reject_overflow(&chain).await,
            }
        }
        if let Some((status, headers, body)) = self.last_context_error.take()
            && self.only_context_refusals()
        {
            let ep = self
                .attempts
                .iter()
                .rev()
                .find(|a| a.class == Outcome::ContextLength)
                .map(|a| a.endpoint.clone())
                .unwrap_or_default();
            return self.respond_passthrough(&ep, status, headers, body);
        }
        if let Some((ep, (status, headers, body))) = self.own_key_answer.take() {
            return self.respond_passthrough(&ep, status, headers, body);
        }
        if let Some(resp) = self.responses_refusal() {
            return resp;
        }
        if let Some(resp) = self.served_from_last_resort().await {
            return resp;
        }
        self.all_failed()
    }

    /// Why a `/v1/responses` request nothing served is not a plain 503: every endpoint that was
    /// not skipped could not express it in chat (400 naming the field: no endpoint of the
    /// chain could have served it), or its conversation lives on an endpoint that failed and
    /// was not kept (503 `previous_response_unavailable`).
    fn responses_refusal(&mut self) -> Option<Response> {
        let ctx = self.responses.clone()?;
        let unsupported = self
            .attempts
            .iter()
            .find(|a| a.class == Outcome::Unsupported)
            .and_then(|a| a.error.clone());
        if let Some(detail) = unsupported
            && self
                .attempts
                .iter()
                .all(|a| a.class == Outcome::Unsupported || a.class.is_skip())
        {
            let err = crate::error::ApiError::InvalidRequest {
                message: format!("This request cannot be served: {detail}."),
                param: None,
                code: Some("unsupported_parameter"),
            };
            return Some(self.gateway_error(err, Outcome::Unsupported.as_str()));
        }
        if let Some(pinned) = &ctx.pinned
            && ctx.replay.is_none()
        {
            let err = crate::error::ApiError::PreviousResponseUnavailable {
                endpoint: pinned.clone(),
                attempts: self.attempts.clone(),
            };
            let class = err.class();
            return Some(self.gateway_error(err, class));
        }
        None
    }

    /// Every attempt so far was refused or skipped on size (or skipped for another reason):
    /// no endpoint failed, so the overflow policy — not a 503 — decides.
    fn only_context_refusals(&self) -> bool {
        self.attempts
            .iter()
            .all(|a| a.class.is_context() || a.class.is_skip())
    }

    /// One pass over the chain. `Some` is the response; `None` means nothing served.
    async fn pass(&mut self, chain: &[String]) -> Option<Response> {
        // The two thresholds, not a copy of the policy: what this future holds across its
        // awaits is copied each time a future containing it moves (`docs/benchmarks.md`).
        let (panic_threshold, success_threshold) = (
            self.cfg.policy.panic_threshold,
            self.cfg.policy.success_threshold,
        );
        let wait_until = self.started + self.cfg.policy.max_wait;
        self.pass = PassState::default();
        loop {
            let remaining: Vec<&str> = chain
                .iter()
                .filter(|n| !self.pass.tried.contains(*n))
                .map(String::as_str)
                .collect();
            // Healthy panic is judged on the whole chain, not on what is left of it.
            let all = self.views(chain);
            let panic = router::in_panic(&all, panic_threshold);
            let left: Vec<View> = all
                .into_iter()
                .filter(|v| !self.pass.tried.contains(&v.name))
                .collect();
            let mut plan =
                router::rank(&remaining, &left, &self.req.needs, success_threshold, panic);
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
                if self.pass.reported_skip.insert(name.clone()) {
                    self.skipped(name.clone(), skip.class(), skip.detail());
                }
            }
            self.panic_mode.extend(plan.panic_admitted.iter().cloned());
            if plan.order.is_empty() && !self.pass.deferred.is_empty() {
                // Only endpoints whose rate-limit budget was predicted short are left. A
                // prediction must never alone turn a servable request into a 503: wait for the
                // soonest refill within `max_wait`, else try them anyway (the upstream decides).
                let deferred = std::mem::take(&mut self.pass.deferred);
                let soonest = deferred.iter().map(|(_, d)| *d).min().unwrap_or_default();
                let names: Vec<String> = deferred.into_iter().map(|(n, _)| n).collect();
                for n in &names {
                    self.pass.tried.remove(n);
                    self.pass.reported_skip.remove(n);
                }
                if after(Instant::now(), soonest) <= wait_until {
                    tokio::time::sleep(soonest).await;
                    self.waited += soonest;
                } else {
                    self.forced.extend(names);
                }
                continue;
            }
            if plan.order.is_empty() {
                // Everything left is cooling down — including endpoints that answered 429
                // earlier in this request: wait for the first to come back, within
                // `max_wait`, instead of failing at once.
                let rate_limited: Vec<String> = self.pass.rate_limited.drain().collect();
                let again = self.views(&rate_limited);
                let soonest = plan
                    .soonest_cooldown()
                    .into_iter()
                    .chain(again.iter().map(|v| match v.avail {
                        crate::routing::registry::Avail::Cooldown(d) => d,
                        _ => Duration::ZERO,
                    }))
                    .min();
                if let Some(d) = soonest {
                    // A floor, so a `Retry-After: 0` loop cannot spin against the upstream.
                    let d = d.max(MIN_REWAIT);
                    if after(Instant::now(), d) <= wait_until {
                        tokio::time::sleep(d).await;
                        self.waited += d;
                        for n in rate_limited {
                            self.pass.tried.remove(&n);
                        }
                        // The wait is reported again if the endpoint is still unusable.
                        self.pass.reported_skip.clear();
                        continue;
                    }
                }
                return None;
            }
            let order = plan.order;
            for (i, name) in order.iter().enumerate() {
                if Instant::now() >= self.deadline {
                    // `request_timeout` passed: no new attempt starts; the caller's deadline
                    // answers 504 with what was tried.
                    std::future::pending::<()>().await;
                }
                if !self.pass.tried.insert(name.clone()) {
                    // Already raced as a hedge.
                    continue;
                }
                let Some(ep) = self.admit(name).await else {
                    continue;
                };
                let delay = self.hedge.as_ref().and_then(|(_, spec)| {
                    spec.delay(|p| self.app.registry.latency_percentile(&ep.name, p))
                });
                // The rare sub-futures (this race, truncation, a backend count) are boxed where
                // awaited, so the executor's future — moved into its box on every request — is
                // not sized by them.
                let (ep, outcome) = match delay {
                    Some(delay) => Box::pin(self.try_hedged(&ep, delay, &order[i + 1..])).await,
                    None => {
                        let outcome = self.try_endpoint(&ep, None).await;
                        (ep, outcome)
                    }
                };
                match outcome {
                    EndpointOutcome::Served(s) => return Some(self.respond(ep, *s)),
                    EndpointOutcome::ClientError(status, headers, body) => {
                        return Some(self.respond_passthrough(&ep.name, status, headers, body));
                    }
                    other => self.note(&ep, other),
                }
            }
        }
    }

    /// What a failed or deferred endpoint teaches the rest of the pass.
    fn note(&mut self, ep: &Endpoint, outcome: EndpointOutcome) {
        match outcome {
            EndpointOutcome::Failed {
                context,
                rate_limited,
            } => {
                if rate_limited && !self.cfg.policy.max_wait.is_zero() {
                    self.pass.rate_limited.insert(ep.name.clone());
                }
                if context {
                    let w = self.app.registry.effective_window(ep);
                    self.pass.context_floor = Some(w);
                    if let Some(w) = w {
                        self.context_skipped.push((ep.name.clone(), w));
                    }
                }
            }
            EndpointOutcome::Predicted(wait) => {
                self.pass.deferred.push((ep.name.clone(), wait));
            }
            EndpointOutcome::Served(_) | EndpointOutcome::ClientError(..) => {}
        }
    }

    /// The context checks before an endpoint is called: `None` (the skip recorded) when the
    /// prompt cannot fit it, or when a larger window is needed than it has.
    async fn admit(&mut self, name: &str) -> Option<Arc<Endpoint>> {
        let ep = self.cfg.endpoints.get(name).cloned()?;
        if let Some(ctx) = &self.responses
            && ctx
                .request_for(&self.req, &ep, self.translates(&ep), self.pin_lost)
                .is_none()
        {
            let pinned = ctx.pinned.clone().unwrap_or_default();
            self.skipped(
                name.to_string(),
                Outcome::SkippedPinned,
                format!(
                    "the conversation (previous_response_id) lives on `{pinned}`, and no history was kept to replay it here (responses.history: keep)"
                ),
            );
            return None;
        }
        if ep.backend_tokenize.is_some() && self.req.op != Op::Embeddings {
            // The backend's count may also teach its window (vLLM's max_model_len).
            self.prompt_tokens(&ep).await;
        }
        let window = self.app.registry.effective_window(&ep);
        if let Some(floor) = self.pass.context_floor {
            // Only a window known to be larger qualifies. When the refusing endpoint's window
            // is unknown there is nothing to compare: trying the next one is the only way to
            // find out.
            let larger = match (window, floor) {
                (Some(w), Some(f)) => w > f,
                (_, None) => true,
                (None, Some(_)) => false,
            };
            if !larger {
                self.skipped(
                    name.to_string(),
                    Outcome::ContextSkip,
                    format!(
                        "context window {} is not larger than the {} that refused the prompt",
                        fmt_window(window),
                        fmt_window(floor)
                    ),
                );
                if let Some(w) = window {
                    self.context_skipped.push((name.to_string(), w));
                }
                return None;
            }
        }
        if let Some(w) = window
            && self.req.op != Op::Embeddings
        {
            let policy = &self.cfg.policy;
            let context_fill = policy.context_fill;
            let allowed = (w as f64 * context_fill).floor() as u64;
            if self.fits_by_bound(&ep, allowed) {
                return Some(ep);
            }
            let prompt = self.prompt_tokens(&ep).await;
            let need = prompt.tokens + self.requested_max_tokens();
            if need > allowed {
                self.skipped(
                    name.to_string(),
                    Outcome::ContextSkip,
                    format!(
                        "needs {} prompt + {} completion tokens ({}); window {w}, {:.0}% usable = {allowed}",
                        prompt.tokens,
                        self.requested_max_tokens(),
                        if prompt.exact {
                            ep.counter.method()
                        } else {
                            "estimated".into()
                        },
                        context_fill * 100.0
                    ),
                );
                self.context_skipped.push((name.to_string(), w));
                return None;
            }
        }
        Some(ep)
    }

    /// Whether the prompt fits `allowed` tokens (completion included) without counting it: its
    /// byte bound ([`tokens::tiktoken_bound`], computed once a request) already fits, and the
    /// endpoint counts with a byte-level BPE. Most prompts are far smaller than their windows,
    /// and the exact count (BPE work and the encoder's tables) is only needed near the edge.
    fn fits_by_bound(&mut self, ep: &Endpoint, allowed: u64) -> bool {
        if !ep.counter.bounded_by_bytes() || ep.backend_tokenize.is_some() {
            return false;
        }
        let req = &self.req;
        let bound = *self.prompt_bound.get_or_insert_with(|| {
            req.plain_token_bound()
                .unwrap_or_else(|| tokens::tiktoken_bound(req.op, req.body()))
        });
        bound.saturating_add(self.requested_max_tokens()) <= allowed
    }

    /// Records an endpoint that was not called (skipped, or ruled out by context size).
    fn skipped(&mut self, endpoint: String, class: Outcome, detail: String) {
        self.attempts.push(AttemptReport {
            endpoint,
            status: None,
            class,
            latency_ms: 0.0,
            error: Some(detail),
            panic_mode: false,
            own_key: false,
            internal: None,
            address: None,
            trace: None,
        });
    }

    /// Sends the request's one audit row (and counts its cost against the client key).
    fn send_row(&mut self, mut row: RequestRow) {
        self.row_written = true;
        if let Some(billed) = self.billed.take() {
            billed.add_to(&mut row);
        }
        if let Some(audit) = self.audit.take() {
            let response = self.audit_response.take();
            audit.attach(
                &self.app,
                &self.cfg,
                &mut row,
                response.as_deref(),
                self.own_key.as_ref(),
            );
        }
        self.app.record_request(row, self.admission.take());
    }

    fn views(&self, names: &[String]) -> Vec<View> {
        self.app.registry.views(&self.cfg, names)
    }

    /// Where an attempt at `ep` goes: its `base_url`, unless it has several addresses or
    /// discovered tasks — then one picked by load (a conversation's to where its earlier turns
    /// were, a pinned Responses conversation's to the address that holds it), counted in flight
    /// while the attempt runs; `Err` when none is usable.
    fn address_for(
        &self,
        ep: &Endpoint,
        translate: bool,
        avoid: &[Arc<str>],
    ) -> Result<Option<Picked>, Failure> {
        let t = tuning(&self.cfg, ep);
        let mut want = Want {
            avoid,
            ..Want::default()
        };
        if ep.discover || ep.addresses.len() > 1 {
            if let Some(ctx) = &self.responses
                && ctx.pinned.as_deref() == Some(ep.name.as_str())
            {
                want.prefer = ctx.pinned_address.as_deref();
                want.exact = ctx.native_pin && !translate && !self.pin_lost;
            }
            if t.affinity && !want.exact {
                want.key = balance::conversation_of(self.req.op, self.req.body());
            }
        }
        self.app.registry.pick_address(ep, &t, &want).map_err(|_| {
            Failure::new(
                Outcome::Connect,
                None,
                if ep.discover {
                    "no running task discovered for this endpoint"
                } else {
                    "no usable address: every address of this endpoint is out"
                },
            )
        })
    }

    /// Runs one attempt against `ep` with `key`: builds it, counts the call, sends it.
    async fn attempt(&mut self, ep: &Endpoint, key: Option<&Secret>) -> Result<Success, Failure> {
        let t0 = Instant::now();
        let span = self.new_span();
        let translate = self.translates(ep);
        let picked = self.address_for(ep, translate, &self.failed_at)?;
        let base = picked.as_ref().map(|p| p.base.clone());
        // Only a Responses request may go as another (its pinned form or replay): the others'
        // attempts borrow the request, without a reference count taken and given back.
        let other = self
            .responses
            .is_some()
            .then(|| self.request_for(ep, translate));
        let attempt = Attempt {
            ep,
            key,
            req: other.as_deref().unwrap_or(&self.req),
            translate,
            responses: self.responses.as_deref(),
            ids: attempt_ids(&self.request_id, self.trace.as_deref(), span.as_ref()),
            deadline: self.deadline,
            max_cooldown: self.cfg.policy.max_cooldown,
            max_answer: self.cfg.max_response_bytes,
            base: base.as_deref(),
            own_key: self.own_key_for(ep).is_some(),
            max_event: self.cfg.max_event_bytes,
        };
        let (rb, sanitized) = attempt.prepare(self.req.stream)?;
        // Counted here: a request the adapter could not express never left the gateway (nor
        // has it a span).
        self.sanitized = sanitized;
        self.calls += 1;
        self.last_span = span.as_ref().map(|s| s.0);
        let sent = Instant::now();
        let result = if self.req.stream {
            attempt.stream(rb, t0).await
        } else {
            attempt.full(rb, sent).await
        };
        self.waited += sent.elapsed();
        let mut result = result;
        if let Some(p) = &picked {
            address_feedback(
                &self.app,
                (&ep.name, &p.base),
                &result,
                sent,
                self.own_key_for(ep).is_some(),
                (&self.cfg, self.client.as_deref()),
            );
        }
        stamp(&mut result, picked);
        result
    }

    /// Starts an attempt as a future of its own (it borrows nothing of the `Run`), so it can be
    /// raced against a hedge; dropping it closes its upstream connection.
    /// `avoid`: an address of `ep` not to go to (the one the first copy of a hedged request
    /// went to), besides those that failed this request.
    fn start(
        &mut self,
        ep: &Arc<Endpoint>,
        key_idx: Option<usize>,
        avoid: Option<Arc<str>>,
    ) -> Result<Racing, Failure> {
        let t0 = Instant::now();
        let translate = self.translates(ep);
        let mut not_there = self.failed_at.clone();
        not_there.extend(avoid);
        let picked = self.address_for(ep, translate, &not_there)?;
        let base = picked.as_ref().map(|p| p.base.clone());
        let address: Option<Arc<str>> = base.as_deref().map(Arc::from);
        // The request's own key (x-encrypted-key) for OpenAI-type endpoints, else key `key_idx`.
        let key = self.key_for(ep, key_idx).cloned();
        let key = key.as_ref();
        let req = self.request_for(ep, translate);
        let span = self.new_span();
        let attempt = Attempt {
            ep,
            key,
            req: &req,
            translate,
            responses: self.responses.as_deref(),
            ids: attempt_ids(&self.request_id, self.trace.as_deref(), span.as_ref()),
            deadline: self.deadline,
            max_cooldown: self.cfg.policy.max_cooldown,
            max_answer: self.cfg.max_response_bytes,
            base: base.as_deref(),
            own_key: self.own_key_for(ep).is_some(),
            max_event: self.cfg.max_event_bytes,
        };
        let (rb, sanitized) = attempt.prepare(self.req.stream)?;
        let rb = rb.into_owned();
        self.sanitized = sanitized;
        self.calls += 1;
        let own_key = self.own_key_for(ep).is_some();
        let (ep, request_id) = (ep.clone(), self.request_id.clone());
        let responses = self.responses.clone();
        let (deadline, max_cooldown, max_answer, max_event) = (
            self.deadline,
            self.cfg.policy.max_cooldown,
            self.cfg.max_response_bytes,
            self.cfg.max_event_bytes,
        );
        let (app, cfg, client) = (self.app.clone(), self.cfg.clone(), self.client.clone());
        let fut = async move {
            let sent = Instant::now();
            // The key is in the prepared request already.
            let attempt = Attempt {
                ep: &ep,
                key: None,
                req: &req,
                translate,
                responses: responses.as_deref(),
                // The traceparent is in the prepared request already.
                ids: crate::upstream::Ids::request(&request_id),
                deadline,
                max_cooldown,
                max_answer,
                base: base.as_deref(),
                own_key,
                max_event,
            };
            let mut result = if req.stream {
                attempt.stream(rb, t0).await
            } else {
                attempt.full(rb, sent).await
            };
            // (A hedge raced away drops this future: its address is counted out all the same.)
            if let Some(p) = &picked {
                address_feedback(
                    &app,
                    (&ep.name, &p.base),
                    &result,
                    sent,
                    own_key,
                    (&cfg, client.as_deref()),
                );
            }
            stamp(&mut result, picked);
            result
        };
        Ok(Racing {
            key_idx,
            t0,
            address,
            fut: Box::pin(fut),
            span: span.map(|s| s.0),
            hedge: false,
        })
    }

    /// A new attempt's span, when the request is traced: its id and the `traceparent` it sends.
    fn new_span(&self) -> Option<(crate::wire::trace::SpanId, String)> {
        self.trace.as_ref().map(|t| {
            let s = crate::wire::trace::SpanId::random();
            (s, t.header(s))
        })
    }

    /// The calls in flight (the current one and a hedged copy), taken for the record of a
    /// request cut off while they ran, with their spans (their upstreams got their ids).
    fn in_flight(
        &mut self,
    ) -> Vec<(
        Arc<Endpoint>,
        Instant,
        Option<crate::wire::trace::AttemptTrace>,
    )> {
        let last = self.last_span.take();
        let first = self
            .current
            .take()
            .map(|(ep, t0, span)| (ep, t0, span.or(last), false));
        let hedge = self
            .current_hedge
            .take()
            .map(|(ep, t0, span)| (ep, t0, span, true));
        first
            .into_iter()
            .chain(hedge)
            .map(|(ep, t0, span, hedge)| {
                let trace = self.attempt_trace(span, t0, hedge);
                (ep, t0, trace)
            })
            .collect()
    }

    /// An attempt's trace facts for its audit row: its span, when it was sent.
    fn attempt_trace(
        &self,
        span: Option<crate::wire::trace::SpanId>,
        t0: Instant,
        hedge: bool,
    ) -> Option<crate::wire::trace::AttemptTrace> {
        span.map(|span| crate::wire::trace::AttemptTrace {
            span,
            started_ms: t0.saturating_duration_since(self.started).as_secs_f64() * 1000.0,
            hedge,
            continuation: false,
        })
    }

    /// Whether a Responses request goes to `ep` translated to chat.
    fn translates(&self, ep: &Endpoint) -> bool {
        self.req.op == Op::Responses
            && (!self.app.registry.speaks_responses(ep) || self.chat_here.contains(&ep.name))
    }

    /// The request `ep` gets: the client's, or for a conversation the pinned form or its replay.
    fn request_for(&self, ep: &Endpoint, translate: bool) -> Arc<Inbound> {
        match &self.responses {
            Some(ctx) => ctx
                .request_for(&self.req, ep, translate, self.pin_lost)
                .unwrap_or_else(|| self.req.clone()),
            None => self.req.clone(),
        }
    }

    /// Whether this request brings its own key for `ep` (`x-encrypted-key`, OpenAI-type only).
    fn own_key_for(&self, ep: &Endpoint) -> Option<&Secret> {
        self.own_key
            .as_ref()
            .filter(|_| ep.kind == crate::config::EndpointKind::Openai)
    }

    /// The key an attempt sends: the request's own for OpenAI-type endpoints, else key `idx`.
    fn key_for<'k>(&'k self, ep: &'k Endpoint, idx: Option<usize>) -> Option<&'k Secret> {
        self.own_key_for(ep).or_else(|| {
            idx.and_then(|i| ep.keys.get(i))
                .and_then(|k| k.value.as_ref())
        })
    }

    /// The key for the next call to `ep`. Unless the endpoint is forced (the last resort), keys
    /// whose rate-limit budget is predicted too small for this request are passed over.
    async fn pick(&mut self, ep: &Arc<Endpoint>) -> Result<Option<usize>, EndpointOutcome> {
        if self.own_key_for(ep).is_some() {
            // The request's own key: none of the endpoint's keys, nor their budgets, apply.
            return Ok(None);
        }
        let predict = self.cfg.policy.predict_rate_limits && !self.forced.contains(&ep.name);
        let pick = if predict {
            let tokens = self.ratelimit_tokens(ep).await;
            self.app.registry.pick_key_predicted(ep, tokens)
        } else {
            self.app.registry.pick_key(ep)
        };
        match pick {
            KeyPick::NotNeeded => Ok(None),
            KeyPick::Use(i) => Ok(Some(i)),
            KeyPick::Exhausted => {
                self.skipped(
                    ep.name.clone(),
                    Outcome::SkippedAuthFailed,
                    "no usable API key".into(),
                );
                Err(FAILED)
            }
            KeyPick::Limited(wait, short) => {
                self.skipped(
                    ep.name.clone(),
                    Outcome::SkippedRatelimitPredicted,
                    format!(
                        "x-ratelimit-remaining-{} too low for this request{}; predicted to refill in {}ms",
                        short.as_str(),
                        if ep.keys.len() > 1 { " on every key" } else { "" },
                        wait.as_millis()
                    ),
                );
                Err(EndpointOutcome::Predicted(wait))
            }
        }
    }

    /// Prompt + completion tokens, counted only when some key's token budget may be too small
    /// for a generous bound on them (most of the time nothing is counted).
    async fn ratelimit_tokens(&mut self, ep: &Arc<Endpoint>) -> Option<u64> {
        let max_tokens = self.requested_max_tokens();
        // Byte-level BPE spends at most a few tokens a character; messages add a few each.
        let req = &self.req;
        let bound = || {
            (req.prompt_chars() as u64)
                .saturating_mul(4)
                .saturating_add(1024)
                .saturating_add(max_tokens)
        };
        if !self.app.registry.tokens_tight(ep, bound) {
            return None;
        }
        let prompt = self.prompt_tokens(ep).await;
        Some(prompt.tokens.saturating_add(max_tokens))
    }

    /// Tries one endpoint (with its `retries` and its other keys) and applies what
    /// `outcome::action` says about each attempt's outcome. `first` is an attempt already made
    /// (a hedged race's survivor), boxed: held inline, its 344 bytes were in this future three
    /// times over, and in every future that awaits it.
    async fn try_endpoint(
        &mut self,
        ep: &Arc<Endpoint>,
        mut first: Option<Box<Finished>>,
    ) -> EndpointOutcome {
        let mut retries_left = ep.retries;
        let mut backoff = ep.retry_backoff;
        // An endpoint of several addresses: a failure another address may not share is tried
        // there at once (the failed one now costs like a slow one), up to two others.
        let mut other_addresses = self
            .app
            .registry
            .address_count(&ep.name)
            .saturating_sub(1)
            .min(2);
        loop {
            let done = match first.take() {
                Some(f) => *f,
                None => {
                    let key_idx = match self.pick(ep).await {
                        Ok(k) => k,
                        Err(outcome) => return outcome,
                    };
                    let key = self.key_for(ep, key_idx).cloned();
                    let t0 = Instant::now();
                    self.current = Some((ep.clone(), t0, None));
                    let result = self.attempt(ep, key.as_ref()).await;
                    self.current = None;
                    Finished {
                        key_idx,
                        t0,
                        result,
                        span: self.last_span.take(),
                        hedge: false,
                    }
                }
            };
            match self.settle(ep, done) {
                Settled::Done(outcome) => return outcome,
                Settled::NextKey => continue,
                Settled::Retry if retries_left > 0 => {
                    retries_left -= 1;
                    // Full jitter: a herd of clients retrying in step is what keeps a
                    // struggling server down.
                    let sleep = backoff.mul_f64(fastrand::f64());
                    tokio::time::sleep(sleep).await;
                    self.waited += sleep;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Settled::Retry if other_addresses > 0 => other_addresses -= 1,
                Settled::Retry => return FAILED,
            }
        }
    }

    /// Records one finished attempt and applies what `outcome::action` says about it.
    fn settle(&mut self, ep: &Arc<Endpoint>, done: Finished) -> Settled {
        let Finished {
            key_idx,
            t0,
            result,
            span,
            hedge,
        } = done;
        let trace = self.attempt_trace(span, t0, hedge);
        let panic_mode = self.panic_mode.contains(&ep.name);
        let latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let own_key = self.own_key_for(ep).is_some();
        let f = match result {
            Ok(success) => {
                if !own_key {
                    self.app
                        .registry
                        .observe_ratelimit(ep, key_idx, success.ratelimit());
                }
                let status = match &success {
                    Success::Full { status, .. } => status.as_u16(),
                    Success::Stream { .. } => 200,
                };
                self.attempts.push(AttemptReport {
                    endpoint: ep.name.clone(),
                    status: Some(status),
                    class: Outcome::Ok,
                    latency_ms,
                    error: None,
                    panic_mode,
                    own_key,
                    internal: None,
                    address: success.address().cloned(),
                    trace,
                });
                if !self.req.stream {
                    // Streams report their outcome when they end (see `StreamGuard`).
                    let who = answered_by(&self.cfg, self.client.as_deref());
                    self.app.registry.apply(
                        ep,
                        &self.cfg.policy,
                        Effect::Success { latency_ms, who },
                    );
                }
                return Settled::Done(EndpointOutcome::Served(Box::new(success)));
            }
            Err(f) => f,
        };
        if let Some(seen) = &f.ratelimit
            && !own_key
        {
            self.app.registry.observe_ratelimit(ep, key_idx, seen);
        }
        if let Some(usage) = f.usage.as_deref().copied() {
            let leg = usage::Leg::of(ep, Some(usage), 0, 0, self.req.op);
            self.billed = Some(self.billed.map_or(leg, |b| b.plus(leg)));
        }
        let secrets = ep.secret_values_with(self.own_key_for(ep));
        let detail = classify::redact(&f.detail, &secrets);
        let internal = f.internal.as_deref().map(|d| classify::redact(d, &secrets));
        // A per-request fact: the access line carries the attempts' classes; the detail is
        // for debugging (state changes it causes are logged as endpoint events).
        tracing::debug!(
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
            class: f.class,
            latency_ms,
            error: Some(detail.clone()),
            panic_mode,
            own_key,
            internal,
            address: f.address.clone(),
            trace,
        });
        // An address that failed for a reason of its own gets no other attempt of this request
        // while another address can take it.
        if let Some(at) = &f.address
            && (address_fault(f.class) || f.class == Outcome::Timeout)
            && self.failed_at.len() < 64
        {
            self.failed_at.push(at.clone());
        }
        let hints = Hints {
            retry_after: f.retry_after,
            endpoint_cooldown: ep.cooldown,
            default_cooldown: self.cfg.policy.default_cooldown,
            with_key: key_idx.is_some(),
        };
        if own_key && f.class == Outcome::Auth {
            // The client's own key was refused: its problem, not the endpoint's, and the
            // upstream's message (which may quote part of the key) is not passed on.
            let err = crate::error::ApiError::Unauthorized(
                "The upstream rejected the key sent in x-encrypted-key.".into(),
            );
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            return Settled::Done(EndpointOutcome::ClientError(
                err.status(),
                h,
                Bytes::from(err.body().to_string()),
            ));
        }
        if own_key
            && matches!(
                f.class,
                Outcome::RateLimited | Outcome::Gone | Outcome::ModelMissing
            )
        {
            // The request's own key was limited (429, `insufficient_quota`), or its account
            // cannot reach the model (404, 410): the client's business. Nothing is learned about
            // the shared endpoint; the request fails over, and should nothing serve it, the
            // client gets this answer (with its `retry-after`), not a 503.
            if let Some(p) = f.passthrough {
                self.own_key_answer = Some((ep.name.clone(), *p));
            }
            return Settled::Done(FAILED);
        }
        match outcome::action(f.class, hints) {
            Action::Serve => Settled::Done(unreachable_serve()),
            Action::ReturnToClient => {
                let (s, h, b) = f
                    .passthrough
                    .map(|p| *p)
                    .unwrap_or_else(|| (StatusCode::BAD_REQUEST, HeaderMap::new(), Bytes::new()));
                Settled::Done(EndpointOutcome::ClientError(s, h, b))
            }
            Action::ContextSkip => {
                // Learned only from the upstream's own words: a validation error that quotes
                // the request (vLLM's do) would let one client shrink the window for all.
                if let Some((limit, phrase)) = classify::stated_limit(&f.detail)
                    && !own_key
                {
                    if self.req.quotes(phrase) {
                        tracing::warn!(
                            request_id = %self.request_id,
                            endpoint = %ep.name,
                            "a context limit stated in words the request itself holds is not learned"
                        );
                    } else {
                        self.app.registry.learn_window(ep, limit, &self.request_id);
                    }
                }
                // If nothing larger exists, the client gets this 400 rather than a 503.
                if let Some(p) = f.passthrough {
                    self.last_context_error = Some(*p);
                }
                Settled::Done(EndpointOutcome::Failed {
                    context: true,
                    rate_limited: false,
                })
            }
            Action::CoolDown(for_) => {
                // A 429 that says this one request is larger than the key's whole per-minute
                // allowance (OpenAI's "Request too large … on tokens per min") is about the
                // request, not the endpoint's load: it fails over without cooling the endpoint
                // for everyone else.
                if !classify::request_too_large(&detail) {
                    self.app.registry.apply(
                        ep,
                        &self.cfg.policy,
                        Effect::Cooldown { for_, detail },
                    );
                }
                Settled::Done(EndpointOutcome::Failed {
                    context: false,
                    rate_limited: true,
                })
            }
            Action::FailOver => Settled::Done(FAILED),
            Action::Replay => {
                // The pinned endpoint lost the conversation (a restart, a server that keeps
                // none): it gets the whole of it at once, when the gateway kept it.
                let replay = self.responses.as_ref().is_some_and(|c| c.replay.is_some());
                if replay && !self.pin_lost {
                    self.pin_lost = true;
                    Settled::NextKey
                } else {
                    Settled::Done(FAILED)
                }
            }
            Action::SpeakChat => {
                // A 404 (or 405) for `/responses` that names nothing the request carried: this
                // request goes on to the endpoint in chat at once. Whether the endpoint has no
                // such route for anyone is for a request of the gateway's own to say — a
                // client's answer can be about its own content — made in the background.
                if self.chat_here.contains(&ep.name) {
                    return Settled::Done(FAILED);
                }
                self.chat_here.push(ep.name.clone());
                if self.app.registry.responses_probe_due(ep)
                    && let Ok(rt) = tokio::runtime::Handle::try_current()
                {
                    let (app, ep) = (self.app.clone(), ep.clone());
                    let timeout = self.cfg.health.probe_timeout;
                    rt.spawn(async move {
                        match crate::discovery::probe::responses_route_missing(&app, &ep, timeout)
                            .await
                        {
                            // The detail is the probe's own answer: the client's words
                            // (what its request carried) are never shown as the endpoint's.
                            Ok(Some(status)) => app.registry.mark_chat_only(
                                &ep,
                                &format!(
                                    "POST /responses answered {status} to the gateway's own probe"
                                ),
                            ),
                            Ok(None) => tracing::info!(endpoint = %ep.name, "a 404 for /responses was about the request: the endpoint serves the route"),
                            Err(e) => tracing::debug!(endpoint = %ep.name, error = %e, "the /responses route probe had no answer"),
                        }
                    });
                }
                Settled::NextKey
            }
            Action::Retire => {
                self.app
                    .registry
                    .apply(ep, &self.cfg.policy, Effect::Retire { detail });
                Settled::Done(FAILED)
            }
            Action::RejectKey => {
                let key = key_idx.unwrap_or_default();
                let more = self.app.registry.apply(
                    ep,
                    &self.cfg.policy,
                    Effect::KeyRejected { key, detail },
                );
                if more {
                    Settled::NextKey
                } else {
                    Settled::Done(FAILED)
                }
            }
            Action::Fail { retry } => {
                self.app.registry.apply(
                    ep,
                    &self.cfg.policy,
                    Effect::Failure {
                        class: f.class,
                        detail,
                        who: witness(&self.cfg, self.client.as_deref(), f.class),
                    },
                );
                if retry {
                    Settled::Retry
                } else {
                    Settled::Done(FAILED)
                }
            }
        }
    }
}

/// `action` answers `Serve` only for `Outcome::Ok`, which a `Failure` never carries; should that
/// ever change, failing over is the safe reading.
#[cold]
fn unreachable_serve() -> EndpointOutcome {
    debug_assert!(false, "a failure classified as served");
    FAILED
}

/// The future the front door boxes, once a request, stays under 4 KiB: glibc's memcpy copies
/// larger blocks with `rep movsb`, which callgrind counts a byte at a time (8.6k of the 1.6x goal's
/// instructions a request when it was 8.6 KB). Release builds only: debug builds lay futures out
/// differently. `cargo test --release --lib executor::size_tests`.
#[cfg(all(test, not(debug_assertions)))]
mod size_tests {
    use super::*;

    #[test]
    fn the_executor_future_stays_under_four_kib() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(
            &path,
            "models:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\", model: m }\n",
        )
        .unwrap();
        let app = AppState::new(
            Config::load_file(&path).unwrap(),
            crate::store::StoreHandle::off("test".into()),
            None,
            &[],
            vec![],
        );
        let cfg = Config::load_file(&path).unwrap();
        let req = crate::wire::read_request(
            Op::Chat,
            bytes::Bytes::from_static(
                br#"{"model":"a","messages":[{"role":"user","content":"hi"}]}"#,
            ),
        )
        .unwrap();
        let fut = execute(
            app,
            Arc::new(cfg),
            req,
            Arc::from(vec!["a".to_string()]),
            "id".into(),
            Caller::default(),
        );
        let size = std::mem::size_of_val(&fut);
        assert!(size < 4096, "the executor's future is {size} bytes");
        // It serves (the endpoint refuses connections: 503), and writes its row.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(fut).status(), 503);
    }
}

/// Marks an attempt's result with the address it went to (its audit row, a conversation's
/// next turn); a stream keeps the address's in-flight count until its last byte is read or
/// the stream is dropped (a stream is load on the server for as long as it runs).
fn stamp(result: &mut Result<Success, Failure>, picked: Option<Picked>) {
    use futures_util::StreamExt;
    let Some(Picked { base, in_flight }) = picked else {
        return;
    };
    let base: Arc<str> = Arc::from(base);
    match result {
        Ok(Success::Stream { rest, address, .. }) => {
            *address = Some(base);
            let inner = std::mem::replace(rest, Box::pin(futures_util::stream::empty()));
            *rest = Box::pin(inner.map(move |item| {
                let _held = &in_flight;
                item
            }));
        }
        Ok(Success::Full { address, .. }) => *address = Some(base),
        Err(f) => f.address = Some(base),
    }
}

/// A failure that is the address's own (no connection, the connection lost, a 5xx, no first
/// byte in time): it counts toward ejecting the address, and the request tries another. A
/// request that ran out of its total time is not one: its length may be the request's (a long
/// answer), so the address learns it as latency — a slow address loses traffic through its
/// estimate, not by ejection.
fn address_fault(class: Outcome) -> bool {
    matches!(
        class,
        Outcome::Connect | Outcome::Connection | Outcome::FirstTokenTimeout | Outcome::Server
    )
}

/// What identifies an attempt made as `span` to its upstream: the request's id, the span's
/// `traceparent` and the client's `tracestate`.
fn attempt_ids<'a>(
    request_id: &'a str,
    trace: Option<&'a crate::wire::trace::Trace>,
    span: Option<&'a (crate::wire::trace::SpanId, String)>,
) -> crate::upstream::Ids<'a> {
    crate::upstream::Ids {
        request: request_id,
        traceparent: span.map(|s| s.1.as_str()),
        tracestate: trace.and_then(|t| t.ctx.tracestate.as_deref()),
    }
}

/// Who saw a failure of a request of `client` ([`Witness`]): one key's failures alone eject
/// nothing and demote nothing for the others.
pub(crate) fn witness(cfg: &Config, client: Option<&str>, class: Outcome) -> Witness {
    let sure = class == Outcome::Connect;
    Witness::of(client, cfg.auth.keys.as_ref().map_or(0, Vec::len), sure)
}

/// Who saw an answer to a request of `client` ([`Witness`]): one key's answers weigh no more
/// than the others' in a failure rate.
pub(crate) fn answered_by(cfg: &Config, client: Option<&str>) -> Witness {
    Witness::of(client, cfg.auth.keys.as_ref().map_or(0, Vec::len), false)
}

/// How an attempt's address did: an answer teaches its latency; a failure of the address's own
/// (no connection, the connection lost, a 5xx, a timeout) counts toward ejecting it alone as its
/// client key saw it ([`witness`]) — unless the attempt was made with the request's own key
/// (`x-encrypted-key`), whose failures are the client's and change nothing the others get.
fn address_feedback(
    app: &AppState,
    (endpoint, base): (&str, &str),
    result: &Result<Success, Failure>,
    sent: Instant,
    own_key: bool,
    (cfg, client): (&Config, Option<&str>),
) {
    let ep = cfg.endpoints.get(endpoint);
    let Some(ep) = ep else { return };
    let t = &tuning(cfg, ep);
    match result {
        Ok(_) => app.registry.address_answered(
            endpoint,
            base,
            sent.elapsed(),
            (!own_key).then(|| answered_by(cfg, client)),
            t,
        ),
        Err(f) if address_fault(f.class) && !own_key => {
            app.registry
                .address_failed(endpoint, base, witness(cfg, client, f.class), t)
        }
        Err(f) if f.class == Outcome::Timeout => {
            app.registry.address_slow(endpoint, base, sent.elapsed(), t)
        }
        Err(_) => {}
    }
}
