//! `POST /admin/replay/{id}`: a request the trail kept (`audit.capture_bodies`) sent again
//! through this gateway, as the client key that sent it — never with wider rights: the key must
//! still exist and still cover the model (and `to`, when the operator names an endpoint), and
//! its limits and bill apply as to any of its requests. The key's plaintext is never stored;
//! the replay runs inside the gateway under the key's name. The new request's row carries
//! `replay_of`; the answer holds both the old and the new response (`autohedge replay --diff`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::http::{ReplayAs, client_of};
use crate::clients;
use crate::config::{ClientKey, Config};
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::bodies::{Source, Trail};
use crate::wire::{self, Op};

/// What the operator may say: the endpoint to send it to, and which key's request an id shared
/// by several keys' requests means.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ask {
    to: Option<String>,
    key: Option<String>,
}

/// How long reading the trail may take.
const READ_WITHIN: Duration = Duration::from_secs(5);

/// The most of a replay's answer returned (and of the old one: the trail's cut already).
const ANSWER_MAX: usize = 16 << 20;

/// Whether the key may still do what the replay asks: its `models` allow-list covers the model
/// the request named and the endpoint the operator chose.
fn still_covered(
    cfg: &Config,
    key: Option<&ClientKey>,
    model: &str,
    to: Option<&str>,
) -> Result<(), ApiError> {
    if let Some(to) = to
        && !cfg.endpoints.contains_key(to)
    {
        return Err(ApiError::invalid(format!(
            "`to`: there is no endpoint named `{to}`"
        )));
    }
    let Some(key) = key else {
        return Ok(());
    };
    let Some(models) = &key.models else {
        return Ok(());
    };
    if !models.contains(model) {
        return Err(ApiError::Forbidden(format!(
            "client key `{}` no longer covers model `{model}` (auth.keys[].models): the replay would have wider rights than the key; refused",
            key.name
        )));
    }
    if let Some(to) = to
        && !cfg.covered_by(models).contains(to)
    {
        return Err(ApiError::Forbidden(format!(
            "client key `{}` does not cover endpoint `{to}` (auth.keys[].models): refused",
            key.name
        )));
    }
    Ok(())
}

/// The kept requests of `id`, newest first, from this gateway's trail.
async fn find(app: &AppState, id: &str, key: Option<&str>) -> Result<Vec<Source>, ApiError> {
    let unreadable =
        |e: String| ApiError::Unavailable(format!("the audit trail could not be read: {e}"));
    match app.trail.get() {
        None => Err(unreadable("the gateway has no trail".into())),
        Some(Trail::Sqlite(path)) => {
            let (path, id, key) = (path.clone(), id.to_string(), key.map(str::to_string));
            let read = tokio::task::spawn_blocking(move || {
                let conn = crate::store::open_connection(&path).map_err(|e| e.to_string())?;
                crate::store::bodies::find_sqlite(&conn, &id, key.as_deref())
                    .map_err(|e| e.to_string())
            });
            match tokio::time::timeout(READ_WITHIN, read).await {
                Ok(Ok(r)) => r.map_err(unreadable),
                Ok(Err(_)) => Err(unreadable("the reader failed".into())),
                Err(_) => Err(unreadable(format!("no answer within {READ_WITHIN:?}"))),
            }
        }
        Some(Trail::Postgres(pg)) => crate::store::pg::find_kept(pg, id, key, READ_WITHIN)
            .await
            .map_err(unreadable),
    }
}

/// Picks the request to replay among those of one id: the asked key's newest; with none asked,
/// the newest when all are one key's (a client's `x-request-id` can repeat another key's: the
/// operator then names the key).
fn pick(found: Vec<Source>, id: &str, key: Option<&str>) -> Result<Source, ApiError> {
    let mut found: Vec<Source> = match key {
        Some(k) => found
            .into_iter()
            .filter(|s| s.client_key.as_deref() == Some(k))
            .collect(),
        None => found,
    };
    if found.is_empty() {
        return Err(ApiError::ReplayNotFound(format!(
            "the audit trail holds no body for request {id}{}: bodies are kept with audit.capture_bodies (failed or all), for as long as the trail",
            key.map(|k| format!(" of client key `{k}`"))
                .unwrap_or_default()
        )));
    }
    let mut keys: Vec<&str> = found
        .iter()
        .map(|s| s.client_key.as_deref().unwrap_or("(none)"))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    if keys.len() > 1 {
        return Err(ApiError::NotReplayable(format!(
            "request id {id} names requests of several client keys ({}): name the one to replay (`key`, `autohedge replay --key`)",
            keys.join(", ")
        )));
    }
    Ok(found.swap_remove(0))
}

/// A body as JSON when it is JSON, else as text.
fn shown(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// The replay route, merged into the front door's router.
pub fn routes(app: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route(
            "/admin/replay/{id}",
            axum::routing::post(replay).fallback(super::http::method_not_allowed),
        )
        .with_state(app)
}

pub async fn replay(
    State(app): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    match run(app, peer, headers, id, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    app: Arc<AppState>,
    peer: SocketAddr,
    headers: HeaderMap,
    id: String,
    body: Bytes,
) -> Result<Response, ApiError> {
    let cfg = app.config.load_full();
    clients::admin(&cfg.auth, &headers, peer)?;
    super::http::json_only(&headers)?;
    let ask: Ask = if body.iter().all(u8::is_ascii_whitespace) {
        Ask::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::invalid(format!(
                "the body must be {{\"to\": ENDPOINT?, \"key\": KEY_NAME?}}: {e}"
            ))
        })?
    };
    if id.is_empty() || id.len() > 128 {
        return Err(ApiError::invalid("a request id is 1 to 128 characters"));
    }
    let src = pick(
        find(&app, &id, ask.key.as_deref()).await?,
        &id,
        ask.key.as_deref(),
    )?;
    if src.bodies.own_key {
        return Err(ApiError::NotReplayable(format!(
            "request {id} was made with the client's own upstream key (x-encrypted-key), which is never kept: a replay would use the gateway's keys instead"
        )));
    }
    if src.bodies.request_cut {
        return Err(ApiError::NotReplayable(format!(
            "request {id}'s body was longer than audit.max_body_bytes and was kept cut: it cannot be sent again as it was"
        )));
    }
    let op = Op::ALL
        .into_iter()
        .find(|o| o.name() == src.operation)
        .ok_or_else(|| {
            ApiError::NotReplayable(format!(
                "request {id} was a `{}` call, which is not replayed",
                src.operation
            ))
        })?;
    let replay = ReplayAs {
        key: src.client_key.clone(),
        of: src.request_id.clone(),
        to: ask.to.clone(),
    };
    let key = client_of(&cfg.auth, &replay)?;
    still_covered(
        &cfg,
        key,
        src.requested_model.as_deref().unwrap_or_default(),
        ask.to.as_deref(),
    )?;
    let new_id = super::http::new_request_id();
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let ctx: Arc<str> = Arc::from(new_id.as_str());
    let resp = crate::ops::logctx::InRequest::new(
        ctx.clone(),
        super::http::serve(
            app.clone(),
            op,
            h,
            Body::from(src.bodies.request.clone()),
            new_id.clone(),
            ctx,
            Some(Box::new(replay)),
        ),
    )
    .await;
    let (parts, body) = resp.into_parts();
    let header = |name: axum::http::HeaderName| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let answer = match axum::body::to_bytes(body, ANSWER_MAX).await {
        Ok(b) => shown(&String::from_utf8_lossy(&b)),
        Err(e) => Value::String(format!("(the answer could not be read whole: {e})")),
    };
    tracing::info!(request_id = %new_id, replay_of = %src.request_id, to = ?ask.to, status = parts.status.as_u16(), "request replayed");
    let out = json!({
        "replay_of": src.request_id,
        "request_id": new_id,
        "client_key": src.client_key,
        "to": ask.to,
        "status": parts.status.as_u16(),
        "endpoint": header(wire::names::X_AUTOHEDGE_ENDPOINT),
        "attempts": header(wire::names::X_AUTOHEDGE_ATTEMPTS).and_then(|a| a.parse::<u64>().ok()),
        "response": answer,
        "original": {
            "ts_ms": src.ts_ms,
            "model": src.requested_model,
            "stream": src.stream,
            "status": src.status,
            "endpoint": src.endpoint,
            "error_class": src.error_class,
            "response": src.bodies.response.as_deref().map(shown),
            "response_cut": src.bodies.response_cut,
        },
    });
    Ok(axum::Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(key: Option<&str>) -> Source {
        Source {
            request_id: "r1".into(),
            ts_ms: 1,
            operation: "chat".into(),
            requested_model: Some("chat".into()),
            endpoint: None,
            status: 503,
            error_class: None,
            stream: false,
            client_key: key.map(str::to_string),
            bodies: crate::store::bodies::Bodies::stored("{}".into(), false, None, false),
        }
    }

    #[test]
    fn an_id_of_several_keys_needs_the_key_named() {
        let found = vec![source(Some("a")), source(Some("b"))];
        assert_eq!(pick(found.clone(), "r1", None).unwrap_err().status(), 409);
        assert_eq!(
            pick(found.clone(), "r1", Some("b"))
                .unwrap()
                .client_key
                .as_deref(),
            Some("b")
        );
        assert_eq!(pick(found, "r1", Some("c")).unwrap_err().status(), 404);
        assert_eq!(
            pick(vec![source(Some("a")), source(Some("a"))], "r1", None)
                .unwrap()
                .client_key
                .as_deref(),
            Some("a")
        );
    }
}
