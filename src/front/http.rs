//! The front door: the route table and thin handlers. Each proxy handler validates the body
//! (one extractor path, so every rejection is OpenAI-shaped) and hands it to the executor.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use futures_util::FutureExt;

use crate::clients;
use crate::config::{Auth, ClientKey};
use crate::error::ApiError;
use crate::executor;
use crate::state::AppState;
use crate::store::RequestRow;
use crate::wire::{self, Op};

pub fn router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route(
            "/v1/responses/{id}",
            get(get_response).delete(delete_response),
        )
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/docs", get(docs))
        .route("/admin/endpoints/{name}/clear", post(clear_endpoint))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(fallback)
        .with_state(app)
}

/// The three proxy routes, matched before axum's router: the same handlers with the same
/// arguments, without the router's per-request layers (route lookup, boxed service, matched
/// path and URL-parameter extensions) that cost more than the rest of the front door. Any other
/// method or path — a `GET` on these paths included, for its 405 — goes to [`router`].
pub async fn dispatch(
    app: &Arc<AppState>,
    router: &Router,
    req: axum::http::Request<hyper::body::Incoming>,
    peer: SocketAddr,
) -> Response {
    use tower::ServiceExt;
    let op = match req.uri().path() {
        "/v1/chat/completions" => Some(Op::Chat),
        "/v1/completions" => Some(Op::Completions),
        "/v1/embeddings" => Some(Op::Embeddings),
        "/v1/responses" => Some(Op::Responses),
        _ => None,
    };
    match op {
        Some(op) if req.method() == axum::http::Method::POST => {
            // Only the headers go on; the URI is dropped here, not held across the request
            // (see `release_read_buffer`).
            let (headers, body) = {
                let (parts, body) = req.into_parts();
                (parts.headers, body)
            };
            proxy(app.clone(), op, headers, Body::new(body)).await
        }
        _ => {
            // The peer address for the handlers that check it (`/status`, `/metrics`, admin).
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(ConnectInfo(peer));
            match router.clone().oneshot(req).await {
                Ok(r) => r,
                Err(e) => match e {},
            }
        }
    }
}

async fn chat(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    proxy(app, Op::Chat, headers, body).await
}

async fn completions(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    proxy(app, Op::Completions, headers, body).await
}

async fn embeddings(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    proxy(app, Op::Embeddings, headers, body).await
}

async fn responses(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    proxy(app, Op::Responses, headers, body).await
}

/// The client's `x-request-id` when it is a sane token, else a fresh UUID.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(wire::names::X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(new_request_id)
}

/// A random UUID v4. fastrand instead of the OS generator: request ids need uniqueness, not
/// cryptographic strength, and `getrandom` costs a syscall per request.
pub(super) fn new_request_id() -> String {
    let mut b = fastrand::u128(..).to_be_bytes();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    // Encoded into a buffer: `to_string` went through `fmt` (0.5k instructions a request).
    let mut text = uuid::Uuid::encode_buffer();
    uuid::Uuid::from_bytes(b)
        .hyphenated()
        .encode_lower(&mut text)
        .to_owned()
}

async fn proxy(app: Arc<AppState>, op: Op, headers: HeaderMap, body: Body) -> Response {
    let id = request_id(&headers);
    // Everything logged while this request is served carries its id (`logctx`).
    let ctx: Arc<str> = Arc::from(id.as_str());
    crate::ops::logctx::InRequest::new(ctx.clone(), serve(app, op, headers, body, id, ctx, None))
        .await
}

/// A replay's identity inside the front door: whose request it runs as, what it replays, and
/// the endpoint the operator sent it to.
pub struct ReplayAs {
    pub key: Option<String>,
    pub of: String,
    pub to: Option<String>,
}

/// The client key a replay runs as, checked against the config as it is now: `Err` when the key
/// is gone (or the gateway's keys changed so that it cannot be named).
pub fn client_of<'a>(auth: &'a Auth, r: &ReplayAs) -> Result<Option<&'a ClientKey>, ApiError> {
    match (&auth.keys, &r.key) {
        (None, None) => Ok(None),
        (Some(keys), Some(name)) => keys.iter().find(|k| &k.name == name).map(Some).ok_or_else(|| {
            ApiError::Forbidden(format!(
                "client key `{name}` that sent request {} is no longer one of auth.keys: it is not replayed",
                r.of
            ))
        }),
        (Some(_), None) => Err(ApiError::Forbidden(format!(
            "request {} was sent without a client key, and the gateway now has auth.keys: it is not replayed under any key",
            r.of
        ))),
        (None, Some(name)) => Err(ApiError::Forbidden(format!(
            "client key `{name}` that sent request {} is gone (the gateway has no auth.keys now): it is not replayed",
            r.of
        ))),
    }
}

/// A request through the front door: a client's, or a replay of a kept one (`replay`: it runs
/// as the key that sent it, named, not presented).
pub(super) async fn serve(
    app: Arc<AppState>,
    op: Op,
    headers: HeaderMap,
    body: Body,
    id: String,
    ctx: Arc<str>,
    replay: Option<Box<ReplayAs>>,
) -> Response {
    let arrived = tokio::time::Instant::now();
    let cfg = app.config.load_full();
    let loopback = app
        .listen_loopback
        .load(std::sync::atomic::Ordering::Relaxed);
    if replay.is_none() && !clients::host_allowed(cfg.allowed_hosts.as_deref(), loopback, &headers)
    {
        return with_request_id(ApiError::HostNotAllowed.into_response(), &id);
    }
    // Who is asking comes first: an unknown caller gets nothing else of the gateway's work.
    let identified = match &replay {
        None => clients::identify(&cfg.auth, &headers),
        Some(r) => client_of(&cfg.auth, r),
    };
    let client = match identified {
        Ok(c) => c,
        Err(e) => return with_request_id(e.into_response(), &id),
    };
    // Shed, never queue: a gateway that queues past its capacity turns a spike into timeouts
    // for everyone; an immediate 503 with Retry-After lets clients back off or go elsewhere.
    // A request that comes before the gateway knows its endpoints waits for it (bounded), rather
    // than getting a 503 for an endpoint discovery has not found yet.
    if !app.startup.is_ready() {
        app.startup.wait().await;
    }
    let Some(slot) = app.admit(cfg.max_concurrent_requests) else {
        return with_request_id(
            ApiError::Overloaded(cfg.max_concurrent_requests).into_response(),
            &id,
        );
    };
    // The body has usually come with the head: its timer is made only when it has not.
    let read = {
        let mut read = std::pin::pin!(read_json(&headers, body, cfg.max_body_bytes));
        match futures_util::poll!(read.as_mut()) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => tokio::time::timeout(cfg.body_timeout, read)
                .await
                .unwrap_or(Err(ApiError::BodyTimeout(cfg.body_timeout))),
        }
    };
    let inbound = read.and_then(|raw| wire::read_request(op, raw));
    let client_name = client.map(|c| c.name.clone());
    let mut inbound = match inbound {
        Ok(i) => i,
        Err(e) => {
            // A body the gateway cannot read is a call of the key all the same: it counts.
            let e = counted(&app, client, e).await;
            app.record_request(
                RequestRow {
                    status: e.status().as_u16(),
                    error_class: Some(e.class().into()),
                    client_key: client_name,
                    ..RequestRow::new(id.clone(), std::time::SystemTime::now(), op.name())
                },
                None,
            );
            return with_request_id(e.into_response(), &id);
        }
    };
    if let Some(c) = client
        && let Some(allowed) = &c.models
        && !allowed.contains(&inbound.model)
    {
        let err = ApiError::ModelNotAllowed {
            model: inbound.model.clone(),
            client: c.name.clone(),
        };
        let err = counted(&app, client, err).await;
        return refused(&app, &id, op, &inbound, client_name, err);
    }
    let Some(chain) = cfg.chain_for(&inbound.model) else {
        let err = ApiError::ModelNotFound(inbound.model.clone());
        let err = counted(&app, client, err).await;
        return refused(&app, &id, op, &inbound, client_name, err);
    };
    // A replay the operator sent to one endpoint goes there alone (below, once a Responses
    // conversation has been planned; the key's allow-list still applies).
    if let Some(to) = replay.as_ref().and_then(|r| r.to.as_ref())
        && !cfg.endpoints.contains_key(to)
    {
        let err = ApiError::invalid(format!("`to`: there is no endpoint named `{to}`"));
        return refused(&app, &id, op, &inbound, client_name, err);
    }
    // What the audit row keeps of the request (`audit.capture_bodies`): the body as it came
    // (a Responses continuation is joined to its conversation below) and the presented key,
    // which no kept body may hold.
    // (Boxed: the request's future holds it across its waits, and is moved whole.)
    let capture = (cfg.capture_bodies != crate::config::CaptureBodies::None).then(|| {
        Box::new(executor::capture::CaptureIn {
            original: (op == Op::Responses).then(|| inbound.clone()),
            presented: clients::presented(&headers)
                .map(|k| crate::config::Secret::new(k.to_string())),
        })
    });
    let allowed = client
        .and_then(|c| c.models.as_ref())
        .map(|m| cfg.covered_by(m));
    // The key's limits before anything else is done for the request (a conversation is looked
    // up only for a key its `rpm` admitted). The conversation a Responses request continues is
    // read again by the upstream: its tokens are charged from the answer's `usage`.
    let mut admission = match client {
        None => None,
        Some(c) => {
            let ask = ask_of(&cfg, &chain, &inbound);
            let admitted = match app.cluster.get() {
                // Boxed: its 1.7 KB would size every request's future, and each move of
                // that future copies all of it.
                Some(cluster) => Box::pin(app.clients.admit_shared(c, ask, cluster)).await,
                None => app.clients.admit(c, ask),
            };
            match admitted {
                Ok(a) => Some(a),
                Err(err) => return refused(&app, &id, op, &inbound, client_name, err),
            }
        }
    };
    // A Responses request: its id, and the conversation it continues (pinned endpoint first;
    // with `cluster:`, a conversation another replica served is read from the shared store).
    let (chain, responses) = if op == Op::Responses {
        if let Some(prev) = inbound
            .body()
            .get("previous_response_id")
            .and_then(|v| v.as_str())
        {
            executor::responses::fetch_shared(&app, &cfg, prev).await;
        }
        match executor::responses::plan(
            &app,
            &cfg,
            &mut inbound,
            client_name.as_deref(),
            allowed.as_ref(),
            chain,
        ) {
            Ok((chain, ctx)) => {
                // The conversation the upstream reads again counts against `tpm` as the
                // prompt does (the gateway's kept copy of it, where it kept one).
                if let (Some(c), Some(a), Some(replay)) =
                    (client, admission.as_mut(), ctx.replay.as_ref())
                {
                    let tokens = wire::estimate_tokens(replay.billed_chars())
                        .saturating_sub(wire::estimate_tokens(inbound.billed_chars()));
                    if let Err(err) = app.clients.take_more(c, a, tokens, app.cluster.get()).await {
                        return refused(&app, &id, op, &inbound, client_name, err);
                    }
                }
                (chain, Some(ctx))
            }
            Err(err) => return refused(&app, &id, op, &inbound, client_name, err),
        }
    } else {
        (chain, None)
    };
    // A per-request upstream key, encrypted with Vault's transit engine.
    let own_key = match own_key(&app, &cfg, &headers, arrived, &id).await {
        Ok(k) => k,
        Err(err) => return refused(&app, &id, op, &inbound, client_name, err),
    };
    let chain = match replay.as_ref().and_then(|r| r.to.as_ref()) {
        Some(to) => Arc::from(vec![to.clone()]),
        None => chain,
    };
    let trace = crate::ops::otel::of_request(&cfg, &headers, &inbound);
    let caller = executor::Caller {
        client: client_name,
        admission,
        key: own_key,
        arrived: Some(arrived),
        allowed,
        responses,
        trace,
        replay_of: replay.map(|r| r.of),
        capture,
    };
    // Nothing below reads the client's headers (see `release_read_buffer`).
    drop(headers);
    // Belt and braces: a panic anywhere below becomes a 500 in OpenAI's shape (the executor's
    // drop guard writes its audit row), never a reset connection.
    // Boxed where it is made: the executor's future is large, and `catch_unwind` and
    // `until_stopped` would otherwise move it by value.
    let run = std::panic::AssertUnwindSafe(Box::pin(executor::execute(
        app.clone(),
        cfg,
        inbound,
        chain,
        id.clone(),
        caller,
    )))
    .catch_unwind();
    // Cut at the end of `shutdown_grace`: the dropped run records itself as `shutdown`.
    let resp = match crate::front::stop::until_stopped(&app.hard_stop, run).await {
        Some(Ok(resp)) => resp,
        Some(Err(_)) => {
            tracing::error!(request_id = %id, "request handler panicked; answered 500");
            with_request_id(
                ApiError::Internal(
                    "The gateway hit an internal error while serving this request; it has been recorded.".into(),
                )
                .into_response(),
                &id,
            )
        }
        None => with_request_id(
            ApiError::Unavailable(
                "The gateway is shutting down; retry on another instance.".into(),
            )
            .into_response(),
            &id,
        ),
    };
    // The slot lives as long as the body: a stream counts until it ends.
    let (parts, body) = resp.into_parts();
    Response::from_parts(
        parts,
        Body::new(WithSlot {
            body,
            ctx,
            _slot: slot,
        }),
    )
}

/// `GET /v1/responses/{id}`: the response as its endpoint holds it now (with the gateway's id),
/// else as the gateway kept it. Only the client key that made it may read it.
async fn get_response(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    stored_response(app, headers, id, false).await
}

/// `DELETE /v1/responses/{id}`: forgotten by its endpoint (when it holds it) and the gateway.
async fn delete_response(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    stored_response(app, headers, id, true).await
}

async fn stored_response(
    app: Arc<AppState>,
    headers: HeaderMap,
    id: String,
    delete: bool,
) -> Response {
    let cfg = app.config.load_full();
    let operation = if delete {
        "responses_delete"
    } else {
        "responses_get"
    };
    let (call, client) = match SideCall::start(&app, &cfg, &headers, operation).await {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    let client = client.map(|c| c.name);
    let (endpoint, resp) = stored_response_of(&app, &cfg, id, client, delete).await;
    call.finish(&app, endpoint, resp)
}

/// What `GET`/`DELETE /v1/responses/{id}` answer `client`, and the endpoint asked (if any).
async fn stored_response_of(
    app: &Arc<AppState>,
    cfg: &Arc<crate::config::Config>,
    id: String,
    client: Option<String>,
    delete: bool,
) -> (Option<String>, Response) {
    executor::responses::fetch_shared(app, cfg, &id).await;
    let Some(found) = app
        .conversations
        .find(&id, client.as_deref(), cfg.responses.history_ttl)
    else {
        return (None, ApiError::ResponseNotFound(id).into_response());
    };
    let turn = found.turn;
    let ep = cfg.endpoints.get(&turn.endpoint);
    let upstream = match (ep, &turn.upstream_id) {
        (Some(ep), Some(up)) => executor::responses::upstream_call(app, cfg, ep, up, delete).await,
        _ => None,
    };
    let asked = upstream.is_some();
    let endpoint = asked.then(|| turn.endpoint.clone());
    if delete {
        app.conversations.remove(&id, client.as_deref());
        if let Some(cluster) = app.cluster.get() {
            cluster.delete_turn(&id, client.as_deref()).await;
        }
        let resp = axum::Json(json!({"id": id, "object": "response", "deleted": true}));
        return (endpoint, resp.into_response());
    }
    if let Some((200, mut v)) = upstream
        && v.is_object()
    {
        crate::upstream::responses::rewrite_id(&mut v, &id, turn.previous.as_deref());
        return (endpoint, axum::Json(v).into_response());
    }
    let resp = match turn.response {
        Some(kept) => axum::Json(kept.as_ref().clone()).into_response(),
        None if !asked && turn.upstream_id.is_some() => ApiError::Unavailable(format!(
            "The endpoint `{}` that holds this response could not be asked for it, and the gateway kept no copy (responses.history: keep).",
            turn.endpoint
        ))
        .into_response(),
        None => ApiError::ResponseNotFound(id).into_response(),
    };
    (endpoint, resp)
}

/// A request refused at the front door after it was read: its audit row, then the error.
fn refused(
    app: &AppState,
    id: &str,
    op: Op,
    inbound: &wire::Inbound,
    client: Option<String>,
    err: ApiError,
) -> Response {
    // An admission made before the refusal (Vault could not decrypt the key) is dropped with
    // the request, letting its reservation go.
    app.record_request(
        RequestRow {
            requested_model: Some(inbound.model.clone()),
            status: err.status().as_u16(),
            error_class: Some(err.class().into()),
            stream: inbound.stream,
            client_key: client,
            ..RequestRow::new(id.to_string(), std::time::SystemTime::now(), op.name())
        },
        None,
    );
    with_request_id(err.into_response(), id)
}

/// A call of `client`'s that is refused before its admission still counts against its `rpm`
/// (a key cannot probe model names, or send bodies the gateway refuses, past its limit): one
/// request of no tokens is admitted. The refusal stands, unless the key is out of requests (or
/// budget): then that is what it gets.
async fn counted(app: &AppState, client: Option<&ClientKey>, err: ApiError) -> ApiError {
    let Some(c) = client else {
        return err;
    };
    match admit_call(app, c).await {
        Ok(admission) => {
            drop(admission);
            err
        }
        Err(limited) => limited,
    }
}

/// Admits one call of `c` that asks for no tokens and reserves nothing: its `rpm` (and a budget
/// already spent) decide.
async fn admit_call(app: &AppState, c: &ClientKey) -> Result<clients::Admission, ApiError> {
    let ask = clients::Ask::default();
    match app.cluster.get() {
        Some(cluster) => Box::pin(app.clients.admit_shared(c, ask, cluster)).await,
        None => app.clients.admit(c, ask),
    }
}

/// A call of a key that is not an operation (`GET /v1/models`, `GET`/`DELETE
/// /v1/responses/{id}`): identified, given a concurrency slot, admitted against its `rpm`, and
/// recorded (`operation`: one of [`crate::op::SIDE_CALLS`]) with its status — like every call.
struct SideCall {
    id: String,
    operation: &'static str,
    client: Option<String>,
    started: std::time::Instant,
    _slot: crate::state::Slot,
    admission: Option<clients::Admission>,
}

impl SideCall {
    /// `Err`: the refusal (host, key, overload, limits), recorded when the key was known.
    async fn start(
        app: &Arc<AppState>,
        cfg: &crate::config::Config,
        headers: &HeaderMap,
        operation: &'static str,
    ) -> Result<(SideCall, Option<ClientKey>), Response> {
        let id = request_id(headers);
        let loopback = app
            .listen_loopback
            .load(std::sync::atomic::Ordering::Relaxed);
        if !clients::host_allowed(cfg.allowed_hosts.as_deref(), loopback, headers) {
            return Err(with_request_id(
                ApiError::HostNotAllowed.into_response(),
                &id,
            ));
        }
        let client = match clients::identify(&cfg.auth, headers) {
            Ok(c) => c.cloned(),
            Err(e) => return Err(with_request_id(e.into_response(), &id)),
        };
        let refuse = |err: ApiError| {
            app.record_request(
                RequestRow {
                    status: err.status().as_u16(),
                    error_class: Some(err.class().into()),
                    client_key: client.as_ref().map(|c| c.name.clone()),
                    ..RequestRow::new(id.clone(), std::time::SystemTime::now(), operation)
                },
                None,
            );
            with_request_id(err.into_response(), &id)
        };
        let Some(slot) = app.admit(cfg.max_concurrent_requests) else {
            return Err(refuse(ApiError::Overloaded(cfg.max_concurrent_requests)));
        };
        let admission = match &client {
            None => None,
            Some(c) => match admit_call(app, c).await {
                Ok(a) => Some(a),
                Err(e) => return Err(refuse(e)),
            },
        };
        Ok((
            SideCall {
                id,
                operation,
                client: client.as_ref().map(|c| c.name.clone()),
                started: std::time::Instant::now(),
                _slot: slot,
                admission,
            },
            client,
        ))
    }

    /// The call's answer, recorded (`endpoint`: the upstream it asked, if any).
    fn finish(self, app: &AppState, endpoint: Option<String>, resp: Response) -> Response {
        let status = resp.status().as_u16();
        app.record_request(
            RequestRow {
                status,
                endpoint,
                latency_ms: self.started.elapsed().as_secs_f64() * 1000.0,
                client_key: self.client,
                ..RequestRow::new(
                    self.id.clone(),
                    std::time::SystemTime::now(),
                    self.operation,
                )
            },
            self.admission,
        );
        with_request_id(resp, &self.id)
    }
}

/// A response body that holds its request's slot until it is dropped, and is polled and dropped
/// as its request (`logctx`: a stream outlives the handler, and what it logs, its audit row
/// included, still carries the request id). Everything else is the inner body's: in particular
/// its size, so a full answer keeps its `content-length` instead of turning into a chunked one.
struct WithSlot {
    body: Body,
    ctx: Arc<str>,
    _slot: crate::state::Slot,
}

impl Drop for WithSlot {
    fn drop(&mut self) {
        let _in = crate::ops::logctx::enter(&self.ctx);
        drop(std::mem::take(&mut self.body));
    }
}

impl hyper::body::Body for WithSlot {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let _in = crate::ops::logctx::enter(&this.ctx);
        std::pin::Pin::new(&mut this.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(wire::names::X_REQUEST_ID, v);
    }
    resp
}

/// Reads a JSON body within `limit`, mapping every failure to the right status: its bytes
/// (`wire::read_request` checks they are UTF-8 and parses them).
async fn read_json(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // Compared without a lowercased copy: `to_str` let only visible ASCII through.
    let mime = ct.split(';').next().unwrap_or("").trim().as_bytes();
    let json = mime.eq_ignore_ascii_case(b"application/json")
        || (mime.len() >= 5 && mime[mime.len() - 5..].eq_ignore_ascii_case(b"+json"));
    if !json {
        return Err(ApiError::UnsupportedMediaType(ct.to_string()));
    }
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        && len > limit
    {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        // `to_bytes` fails for an over-long body or a broken connection.
        if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit")
        {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::invalid(format!("could not read the request body: {e}"))
        }
    })?;
    Ok(release_read_buffer(bytes))
}

/// A request body below this is copied out of the connection's read buffer.
const COPY_BODY_BELOW: usize = 8 * 1024;

/// The body in an allocation of its own when it is small. hyper parses a request out of the
/// connection's read buffer (8 KiB at first) and hands the URI, the header values and a body
/// that came in the same read out as slices of it: while any of them lives, the buffer stays
/// allocated, and the next read (hyper watches for the client leaving while the response is
/// pending) must allocate a new one. A request held while its upstream answers — the whole of a
/// stall — would pin 8 KiB for a body of a few hundred bytes, and every request would cost a
/// second buffer. So the URI and the headers are dropped before the upstream is called
/// (`dispatch`, `serve`) and a small body is copied (typically a few hundred bytes). A larger
/// one is kept as it came: it spans several reads, which `to_bytes` gathers into a buffer of its
/// own, or fills a read buffer that grew to its size. Measured in README, Benchmark (session 15).
fn release_read_buffer(body: Bytes) -> Bytes {
    if body.len() < COPY_BODY_BELOW {
        Bytes::copy_from_slice(&body)
    } else {
        body
    }
}

/// The request's own upstream key: `x-encrypted-key` decrypted by Vault's transit engine, within
/// the request's own deadline (the executor's runs from `arrived` too) and cut by shutdown, so a
/// slow Vault holds this request only.
async fn own_key(
    app: &AppState,
    cfg: &crate::config::Config,
    headers: &HeaderMap,
    arrived: tokio::time::Instant,
    id: &str,
) -> Result<Option<crate::config::Secret>, ApiError> {
    use crate::config::vault::DecryptError;
    let Some(v) = headers.get("x-encrypted-key") else {
        return Ok(None);
    };
    let deadline = executor::after(arrived, cfg.policy.request_timeout);
    let decrypted = match (app.transit(cfg), v.to_str()) {
        (Some(t), Ok(text)) => tokio::select! {
            r = tokio::time::timeout_at(deadline, t.decrypt(text)) => r.unwrap_or_else(|_| {
                Err(DecryptError::Unavailable(
                    "no answer within routing_policy.request_timeout".into(),
                ))
            }),
            () = app.hard_stop.cancelled() => {
                return Err(ApiError::Unavailable("The gateway is shutting down.".into()));
            }
        },
        _ => Err(DecryptError::Invalid),
    };
    match decrypted {
        Ok(k) => Ok(Some(crate::config::Secret::new(k.as_str().to_string()))),
        Err(DecryptError::Invalid) => Err(ApiError::InvalidEncryptedKey),
        Err(DecryptError::Unavailable(why)) => {
            tracing::warn!(request_id = %id, error = %why, "vault unavailable for x-encrypted-key");
            Err(ApiError::VaultUnavailable)
        }
    }
}

/// What a request asks of its client key: OpenAI's own rule for tokens per minute (the prompt
/// plus `max_tokens` at once; without `max_tokens`, the completion is charged when it ends), and
/// the most it can cost on the dearest endpoint of its chain (`max_tokens`, else that endpoint's
/// own cap), reserved against the budget while it runs.
/// What admitting `inbound` asks of its key: the billed prompt ([`wire::Inbound::billed_chars`]:
/// tools, schemas and formats with the prompt) plus `max_tokens`, and the worst cost. What the
/// upstream counts beyond it (a continued conversation it reads again) is charged from its
/// `usage` when the request ends.
fn ask_of(cfg: &crate::config::Config, chain: &[String], inbound: &wire::Inbound) -> clients::Ask {
    let max_tokens = [
        wire::TokenField::MaxCompletionTokens,
        wire::TokenField::MaxTokens,
    ]
    .into_iter()
    .find_map(|f| inbound.token_field(f).flatten());
    let prompt = wire::estimate_tokens(inbound.billed_chars());
    let reserve_usd = chain
        .iter()
        .filter_map(|n| cfg.endpoints.get(n))
        .map(|ep| {
            let out = max_tokens.or(ep.max_tokens).unwrap_or(0);
            (prompt as f64 * ep.cost.input_per_mtok + out as f64 * ep.cost.output_per_mtok) / 1e6
        })
        .fold(0.0, f64::max);
    clients::Ask {
        tokens: prompt.saturating_add(max_tokens.unwrap_or(0)),
        prompt_tokens: prompt,
        charge_completion: max_tokens.is_none(),
        reserve_usd,
    }
}

/// The model list. With `auth.keys` set it needs a client key, and lists only what that key may
/// ask for (a route's chain only as far as the key covers it).
async fn models(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let cfg = app.config.load_full();
    let (call, client) = match SideCall::start(&app, &cfg, &headers, "models").await {
        Ok(c) => c,
        Err(refused) => return refused,
    };
    let resp = model_list(&cfg, client.as_ref());
    call.finish(&app, None, resp)
}

fn model_list(cfg: &crate::config::Config, client: Option<&ClientKey>) -> Response {
    let allowed = client.and_then(|c| c.models.as_ref());
    let covered = allowed.map(|m| cfg.covered_by(m));
    let may_ask = |name: &str| allowed.is_none_or(|m| m.contains(name));
    let created = 0;
    let mut data = Vec::new();
    for (name, chain) in cfg.routes.iter().filter(|(n, _)| may_ask(n)) {
        let chain: Vec<&String> = chain
            .iter()
            .filter(|e| covered.as_ref().is_none_or(|c| c.contains(*e)))
            .collect();
        data.push(json!({"id": name, "object": "model", "created": created, "owned_by": "autohedge", "autohedge": {"kind": "route", "chain": chain}}));
    }
    for (name, ep) in cfg.endpoints.iter().filter(|(n, _)| may_ask(n)) {
        data.push(json!({"id": name, "object": "model", "created": created, "owned_by": "autohedge", "autohedge": {"kind": "endpoint", "type": ep.kind.to_string(), "upstream_model": ep.upstream_model}}));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Liveness for orchestrators: 200 while the gateway serves, `degraded` (still 200) when a part
/// that does not stop serving is off, such as the audit trail.
async fn health(State(app): State<Arc<AppState>>) -> Response {
    // Stopping: load balancers and Swarm take it out of rotation while it still serves.
    if app.draining.is_cancelled() {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "draining"})),
        )
            .into_response();
    }
    // A new gateway that has not looked at its endpoints yet is not one to send traffic to
    // (Swarm's health check and a start-first update keep it out until then).
    if !app.startup.is_ready() {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "starting"})),
        )
            .into_response();
    }
    let mut reasons = Vec::new();
    if let Some(r) = app.store.off_reason() {
        reasons.push(format!("audit trail off: {r}"));
    }
    if app.cluster.get().is_some_and(|c| c.unreachable()) {
        reasons.push("cluster_store_unreachable".to_string());
    }
    if reasons.is_empty() {
        axum::Json(json!({"status": "ok"})).into_response()
    } else {
        axum::Json(json!({"status": "degraded", "reasons": reasons})).into_response()
    }
}

async fn status(
    State(app): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    let cfg = app.config.load();
    if let Err(e) = clients::admin(&cfg.auth, &headers, peer) {
        return e.into_response();
    }
    let mut endpoints = serde_json::Map::new();
    for (name, ep) in &cfg.endpoints {
        let mut v = app.registry.status_json(ep, &cfg.policy);
        // The share of its answers in the last five minutes that were 4xx (429 included).
        if let Some(o) = v.as_object_mut() {
            let rate = app.telemetry.client_error_rate(name);
            o.insert(
                "client_error_rate".into(),
                json!(rate.map(|(r, _)| (r * 1e4).round() / 1e4)),
            );
            o.insert(
                "recent_answers".into(),
                json!(rate.map(|(_, n)| n).unwrap_or(0)),
            );
            // Its addresses (several, or the discovered tasks), each with its own load,
            // latency and ejection; `[]` for an endpoint of one static address.
            o.insert(
                "addresses".into(),
                app.registry
                    .addresses_json(name, &crate::routing::registry::tuning(&cfg, ep)),
            );
        }
        endpoints.insert(name.clone(), v);
    }
    let reload = app.reload.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let hedging: serde_json::Map<String, serde_json::Value> = app
        .hedges
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(k, b)| {
            (
                k.clone(),
                json!({
                    "requests": b.requests,
                    "sent": b.sent,
                    "won": b.won,
                    "budget_left": (b.left() * 100.0).floor() / 100.0,
                }),
            )
        })
        .collect();
    let ms = |t: Option<std::time::SystemTime>| {
        t.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
    };
    let found = app.registry.discovered_all();
    let docker = app
        .docker
        .lock()
        .map(|d| d.to_json(&found))
        .unwrap_or_default();
    axum::Json(json!({
        "status": "ok",
        "uptime_seconds": app.started.elapsed().as_secs(),
        "endpoints": endpoints,
        "chains": {
            "fallback_chain": cfg.fallback_chain,
            "routes": cfg.routes,
            // Chains where fewer than panic_threshold of the endpoints are healthy: health is
            // ignored for their requests.
            "in_panic": app.registry.chains_in_panic(&cfg),
            // Each chain in the order the router would try it now.
            "ranked": app.registry.ranked(&cfg),
        },
        // The last 50 moves from a failed endpoint to the next (newest first).
        "failovers": app.telemetry.failovers_json(),
        // The last 15 minutes in ten-second buckets: requests, errors by class, failovers,
        // hedges, and per endpoint the p50/p95 latency and time to first token (the charts on
        // `/docs`).
        "timeline": app.telemetry.timeline_json(),
        // Per hedged route (`route:NAME`) or endpoint (`endpoint:NAME`): requests seen, hedged
        // copies sent, copies that won, and whole hedges the budget holds now.
        "hedging": hedging,
        // OpenTelemetry export (`telemetry.otlp`): where spans go, and how many went, were
        // dropped (queue full, collector refused or away) or wait.
        "telemetry": app.traces.status(&cfg),
        "policy": {
            "success_threshold": cfg.policy.success_threshold,
            "window_seconds": cfg.policy.window.as_secs_f64(),
            "min_samples": cfg.policy.min_samples,
            "max_wait_ms": cfg.policy.max_wait.as_millis() as u64,
            "max_cooldown_ms": cfg.policy.max_cooldown.as_millis() as u64,
            "panic_threshold": cfg.policy.panic_threshold,
            "request_timeout_ms": cfg.policy.request_timeout.as_millis() as u64,
            "slow_start_ms": cfg.policy.slow_start.as_millis() as u64,
            "predict_rate_limits": cfg.policy.predict_rate_limits,
        },
        "in_flight": app.inflight(),
        "server": {
            "max_concurrent_requests": cfg.max_concurrent_requests,
            "allowed_hosts": cfg.allowed_hosts,
        },
        // Who may use it: counts and names only, never a key or a digest.
        "auth": {
            "client_keys": cfg.auth.keys.as_ref().map(|k| k.len()),
            "admin_key": cfg.auth.admin.is_some(),
            "spend_this_month_usd": app.clients.spend().into_iter().map(|(n, usd)| (n, json!((usd * 1e6).round() / 1e6))).collect::<serde_json::Map<_, _>>(),
        },
        "vault": cfg.vault.as_ref().map(|v| json!({
            "address": v.address,
            "transit": v.transit_key.is_some(),
            "refresh_seconds": v.refresh.as_secs_f64(),
            "last_error": app.vault_error.lock().map(|e| e.clone()).unwrap_or(None),
        })),
        "docker": docker,
        "cluster": app.cluster.get().map(|c| c.status_json()),
        "audit": {
            "store": match &cfg.audit_pg {
                Some(pg) => pg.display.clone(),
                None => "sqlite".to_string(),
            },
            "state": match app.store.off_reason() {
                None => "ok".to_string(),
                Some(r) => format!("off: {r}"),
            },
            "written": app.store.written(),
            "dropped": app.store.dropped(),
            "spooled": app.store.held().0,
            "spooled_bytes": app.store.held().1,
            "set_aside": app.store.held().2,
        },
        "config": {
            "path": app.config_path.as_ref().map(|p| p.display().to_string()),
            "reloads": reload.reloads,
            "last_reload_unix_ms": ms(reload.last_ok),
            "last_reload_error": reload.last_error,
            "warnings": cfg.warnings,
        },
    }))
    .into_response()
}

/// Prometheus text (`autohedge_*`), behind the same guard as `/status`: the admin key, or
/// without one, loopback only.
async fn metrics(
    State(app): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = clients::admin(&app.config.load().auth, &headers, peer) {
        return e.into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.telemetry.render(&app.gauges()),
    )
        .into_response()
}

/// The live status page. The page itself holds no data (it is the same for everyone); its
/// script reads `/status` every 2 s, so the data stays behind `/status`'s guard — the page asks
/// for the admin key when `/status` wants one and keeps it in the tab's session storage only.
async fn docs() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        DOCS_PAGE,
    )
        .into_response()
}

const DOCS_PAGE: &str = include_str!("../docs.html");

/// Operator call behind `autohedge endpoint clear`: the admin key (or, without one, loopback
/// only), and a JSON content type — a cross-site form in a browser cannot send one, so a web
/// page cannot make an operator's browser change routing.
async fn clear_endpoint(
    State(app): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    let cfg = app.config.load();
    if let Err(e) = clients::admin(&cfg.auth, &headers, peer) {
        return e.into_response();
    }
    if let Err(e) = json_only(&headers) {
        return e.into_response();
    }
    if app.registry.clear(&name) {
        axum::Json(json!({"cleared": name})).into_response()
    } else {
        ApiError::NotFound(format!("/admin/endpoints/{name} (no such endpoint)")).into_response()
    }
}

/// Admin calls that change something take `application/json` only: a page elsewhere cannot make
/// a browser send that without a preflight the gateway never answers.
pub(super) fn json_only(headers: &HeaderMap) -> Result<(), ApiError> {
    let kind = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    if kind.is_some_and(|v| v.trim_start().starts_with("application/json")) {
        return Ok(());
    }
    Err(ApiError::UnsupportedMediaType(
        kind.unwrap_or("none").chars().take(100).collect(),
    ))
}

pub(super) async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}

async fn fallback(uri: Uri) -> Response {
    ApiError::NotFound(uri.path().to_string()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_request_id_is_a_random_lower_case_uuid_v4() {
        let ids: Vec<String> = (0..200).map(|_| new_request_id()).collect();
        for id in &ids {
            let u = uuid::Uuid::parse_str(id).unwrap();
            assert_eq!(u.get_version_num(), 4, "{id}");
            assert_eq!(u.get_variant(), uuid::Variant::RFC4122, "{id}");
            assert_eq!(*id, u.hyphenated().to_string(), "lower case, hyphenated");
        }
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }

    fn within(inner: &Bytes, outer: &Bytes) -> bool {
        let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
        i >= o && i < o + outer.len()
    }

    #[test]
    fn a_small_body_no_longer_pins_the_read_buffer() {
        // As hyper hands a body out: a slice of the connection's 8 KiB read buffer.
        let read_buffer = Bytes::from(vec![b'x'; 8192]);
        let body = read_buffer.slice(300..700);
        assert!(within(&body, &read_buffer));
        let own = release_read_buffer(body.clone());
        assert_eq!(own, body);
        assert!(!within(&own, &read_buffer), "copied out");
        // A large one is kept as it came (it pins at most a buffer of about its size).
        let big = Bytes::from(vec![b'y'; 64 * 1024]);
        let kept = release_read_buffer(big.slice(10..));
        assert!(within(&kept, &big));
        assert_eq!(kept.len(), 64 * 1024 - 10);
    }
}
