//! The gateway's own errors and the one place they become HTTP responses, always in OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` shape so SDKs raise their matching exception.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Value, json};

/// One attempt (or skip) as reported to clients in a 503 and stored in the audit trail.
#[derive(Clone, Debug, Serialize)]
pub struct AttemptReport {
    pub endpoint: String,
    /// Upstream HTTP status, if one was received.
    pub status: Option<u16>,
    /// What happened (serialised as `connect_error`, `timeout`, `skipped_cooldown`, …, or `ok`).
    pub class: crate::routing::outcome::Outcome,
    pub latency_ms: f64,
    /// Redacted detail; never contains a key or an internal address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Tried although health said to skip it (healthy panic, or the last resort).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub panic_mode: bool,
    /// Made with the request's own key (`x-encrypted-key`): its failures are the client's, and
    /// change nothing the gateway knows about the endpoint.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub own_key: bool,
    /// The detail with what only operators may see (an upstream task's address): audit row only.
    #[serde(skip)]
    pub internal: Option<String>,
    /// The address the attempt went to, when its endpoint has several (`base_urls`, discovered
    /// tasks): audit row only (an internal address is never a client's to see).
    #[serde(skip)]
    pub address: Option<std::sync::Arc<str>>,
    /// Its span, when the request is traced: audit row and trace only.
    #[serde(skip)]
    pub trace: Option<crate::wire::trace::AttemptTrace>,
}

/// Every class [`ApiError::class`] gives: a closed set, as the charts' series need.
pub const GATEWAY_CLASSES: &[&str] = &[
    "invalid_request",
    "model_not_found",
    "not_found",
    "method_not_allowed",
    "payload_too_large",
    "unsupported_media_type",
    "all_failed",
    "request_timeout",
    "overloaded",
    "body_timeout",
    "shutdown",
    "forbidden",
    "host_not_allowed",
    "internal",
    "invalid_api_key",
    "model_not_allowed",
    "rate_limit_exceeded",
    "insufficient_quota",
    "invalid_encrypted_key",
    "vault_unavailable",
    "previous_response_not_found",
    "previous_response_unavailable",
    "response_not_found",
    "replay_not_found",
    "not_replayable",
];

#[derive(Debug)]
pub enum ApiError {
    /// 400: the request is malformed or misses a required field.
    InvalidRequest {
        message: String,
        param: Option<&'static str>,
        code: Option<&'static str>,
    },
    /// 404: the model names no route or endpoint.
    ModelNotFound(String),
    /// 404: no such path.
    NotFound(String),
    /// 405
    MethodNotAllowed,
    /// 413: the body is over `server.max_body_bytes`.
    PayloadTooLarge(usize),
    /// 415: the body is not JSON.
    UnsupportedMediaType(String),
    /// 503: every candidate failed or was unusable.
    AllFailed {
        message: String,
        attempts: Vec<AttemptReport>,
    },
    /// 504: `routing_policy.request_timeout` passed before anything was served.
    RequestTimeout {
        message: String,
        attempts: Vec<AttemptReport>,
    },
    /// 503 at once: over `server.max_concurrent_requests` (shed, never queued).
    Overloaded(usize),
    /// 408: the client did not send its body within `server.body_timeout`.
    BodyTimeout(std::time::Duration),
    /// 503: the gateway cannot serve now (shutting down).
    Unavailable(String),
    /// 403: an admin call from a non-loopback peer.
    Forbidden(String),
    /// 403: the request's `Host` is not one of `server.allowed_hosts` (DNS rebinding).
    HostNotAllowed,
    /// 401: no client key, or not one of `auth.keys` (or the admin key, for admin paths).
    Unauthorized(String),
    /// 403: the client key may not use this model.
    ModelNotAllowed { model: String, client: String },
    /// 429: the client key is over its `rpm` or `tpm`.
    ClientRateLimited(Box<ClientLimit>),
    /// 429: the client key spent its monthly `budget_usd`.
    QuotaExceeded { client: String, budget: f64 },
    /// 400: `x-encrypted-key` is not a ciphertext Vault's transit key decrypts.
    InvalidEncryptedKey,
    /// 503: Vault could not be reached to decrypt `x-encrypted-key`.
    VaultUnavailable,
    /// 500: a bug; the message is safe to show.
    Internal(String),
    /// 404: `previous_response_id` names no response this client key may continue (unknown,
    /// expired, made with `store: false`, or another key's).
    PreviousResponseNotFound(String),
    /// 503: the conversation lives on an endpoint that could not serve, and no history was kept
    /// to replay it on another.
    PreviousResponseUnavailable {
        endpoint: String,
        attempts: Vec<AttemptReport>,
    },
    /// 404: `GET`/`DELETE /v1/responses/{id}` for an id this client key does not own.
    ResponseNotFound(String),
    /// 404: `POST /admin/replay/{id}` for a request whose body the trail does not hold.
    ReplayNotFound(String),
    /// 409: a kept request that cannot be replayed as it was (its body was cut, it was made
    /// with the client's own upstream key, its id is several keys' requests).
    NotReplayable(String),
}

/// Which limit a client key hit, with OpenAI's own headers for it.
#[derive(Debug)]
pub struct ClientLimit {
    pub client: String,
    /// `requests` or `tokens`.
    pub kind: &'static str,
    pub limit: u64,
    pub remaining: u64,
    /// Until the budget is full again (`x-ratelimit-reset-*`).
    pub reset: std::time::Duration,
    /// Until the request could be admitted (`retry-after`).
    pub retry_after: std::time::Duration,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_)
            | ApiError::NotFound(_)
            | ApiError::PreviousResponseNotFound(_)
            | ApiError::ResponseNotFound(_)
            | ApiError::ReplayNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::NotReplayable(_) => StatusCode::CONFLICT,
            ApiError::PreviousResponseUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::AllFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::RequestTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Forbidden(_) | ApiError::HostNotAllowed => StatusCode::FORBIDDEN,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotAllowed { .. } => StatusCode::FORBIDDEN,
            ApiError::ClientRateLimited(_) | ApiError::QuotaExceeded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::InvalidEncryptedKey => StatusCode::BAD_REQUEST,
            ApiError::VaultUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The error class recorded in the audit trail.
    /// The audit class of this error (one of [`GATEWAY_CLASSES`]).
    pub fn class(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::AllFailed { .. } => "all_failed",
            ApiError::RequestTimeout { .. } => "request_timeout",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::Unavailable(_) => "shutdown",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::HostNotAllowed => "host_not_allowed",
            ApiError::Internal(_) => "internal",
            ApiError::Unauthorized(_) => "invalid_api_key",
            ApiError::ModelNotAllowed { .. } => "model_not_allowed",
            ApiError::ClientRateLimited(_) => "rate_limit_exceeded",
            ApiError::QuotaExceeded { .. } => "insufficient_quota",
            ApiError::InvalidEncryptedKey => "invalid_encrypted_key",
            ApiError::VaultUnavailable => "vault_unavailable",
            ApiError::PreviousResponseNotFound(_) => "previous_response_not_found",
            ApiError::PreviousResponseUnavailable { .. } => "previous_response_unavailable",
            ApiError::ResponseNotFound(_) => "response_not_found",
            ApiError::ReplayNotFound(_) => "replay_not_found",
            ApiError::NotReplayable(_) => "not_replayable",
        }
    }

    pub fn body(&self) -> Value {
        let (message, kind, param, code): (String, &str, Option<&str>, Option<&str>) = match self {
            ApiError::InvalidRequest {
                message,
                param,
                code,
            } => (message.clone(), "invalid_request_error", *param, *code),
            ApiError::ModelNotFound(m) => (
                format!(
                    "The model `{m}` does not exist: it names no route or endpoint of this gateway (GET /v1/models lists them)."
                ),
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            ApiError::NotFound(path) => (
                format!(
                    "Unknown request URL: {path}. Supported: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/models."
                ),
                "invalid_request_error",
                None,
                Some("unknown_url"),
            ),
            ApiError::MethodNotAllowed => (
                "Method not allowed for this URL.".into(),
                "invalid_request_error",
                None,
                Some("method_not_allowed"),
            ),
            ApiError::PayloadTooLarge(limit) => (
                format!(
                    "Request body is larger than the gateway's limit of {limit} bytes (server.max_body_bytes)."
                ),
                "invalid_request_error",
                None,
                Some("payload_too_large"),
            ),
            ApiError::UnsupportedMediaType(ct) => (
                format!("Content-Type must be application/json, got {ct:?}."),
                "invalid_request_error",
                None,
                Some("unsupported_media_type"),
            ),
            ApiError::AllFailed { message, .. } => (
                message.clone(),
                "upstream_error",
                None,
                Some("all_upstreams_failed"),
            ),
            ApiError::RequestTimeout { message, .. } => (
                message.clone(),
                "timeout_error",
                None,
                Some("request_timeout"),
            ),
            ApiError::Overloaded(limit) => (
                format!(
                    "The gateway is serving its limit of {limit} requests at once (server.max_concurrent_requests); retry shortly."
                ),
                "server_error",
                None,
                Some("overloaded"),
            ),
            ApiError::BodyTimeout(d) => (
                format!(
                    "The request body did not arrive within {}ms (server.body_timeout).",
                    d.as_millis()
                ),
                "invalid_request_error",
                None,
                Some("body_timeout"),
            ),
            ApiError::Unavailable(m) => (m.clone(), "server_error", None, Some("shutdown")),
            ApiError::Forbidden(m) => (m.clone(), "permission_error", None, Some("forbidden")),
            ApiError::ReplayNotFound(m) => (
                m.clone(),
                "invalid_request_error",
                None,
                Some("replay_not_found"),
            ),
            ApiError::NotReplayable(m) => (
                m.clone(),
                "invalid_request_error",
                None,
                Some("not_replayable"),
            ),
            ApiError::HostNotAllowed => (
                "This request's Host is not one this gateway serves (server.allowed_hosts): a page whose name was pointed at this address (DNS rebinding) may not use it.".into(),
                "permission_error",
                None,
                Some("host_not_allowed"),
            ),
            ApiError::Internal(m) => (m.clone(), "server_error", None, Some("internal_error")),
            ApiError::Unauthorized(m) => (
                m.clone(),
                "invalid_request_error",
                None,
                Some("invalid_api_key"),
            ),
            ApiError::ModelNotAllowed { model, client } => (
                format!("The key `{client}` may not use the model `{model}`."),
                "invalid_request_error",
                Some("model"),
                Some("model_not_allowed"),
            ),
            ApiError::ClientRateLimited(l) => (
                format!(
                    "Rate limit reached for key `{}` on {} per min: Limit {}, Remaining {}. Please try again in {}ms.",
                    l.client,
                    l.kind,
                    l.limit,
                    l.remaining,
                    l.retry_after.as_millis()
                ),
                l.kind,
                None,
                Some("rate_limit_exceeded"),
            ),
            ApiError::QuotaExceeded { client, budget } => (
                format!(
                    "The key `{client}` has spent its monthly budget of ${budget:.2} (auth.keys[].budget_usd); it renews on the 1st (UTC)."
                ),
                "insufficient_quota",
                None,
                Some("insufficient_quota"),
            ),
            ApiError::InvalidEncryptedKey => (
                "x-encrypted-key is not a ciphertext this gateway's Vault transit key can decrypt."
                    .into(),
                "invalid_request_error",
                None,
                Some("invalid_encrypted_key"),
            ),
            ApiError::VaultUnavailable => (
                "Vault could not be reached to decrypt x-encrypted-key; retry shortly.".into(),
                "server_error",
                None,
                Some("vault_unavailable"),
            ),
            ApiError::PreviousResponseNotFound(id) => (
                format!("Previous response with id '{id}' not found."),
                "invalid_request_error",
                Some("previous_response_id"),
                Some("previous_response_not_found"),
            ),
            ApiError::PreviousResponseUnavailable { endpoint, .. } => (
                format!(
                    "The conversation (previous_response_id) lives on endpoint `{endpoint}`, which could not serve this request, and the gateway kept no history to replay it on another (responses.history: keep); see attempts."
                ),
                "server_error",
                Some("previous_response_id"),
                Some("previous_response_unavailable"),
            ),
            ApiError::ResponseNotFound(id) => (
                format!("Response with id '{id}' not found."),
                "invalid_request_error",
                None,
                Some("response_not_found"),
            ),
        };
        let mut err = json!({
            "message": message,
            "type": kind,
            "param": param,
            "code": code,
        });
        if let ApiError::AllFailed { attempts, .. }
        | ApiError::RequestTimeout { attempts, .. }
        | ApiError::PreviousResponseUnavailable { attempts, .. } = self
        {
            err["attempts"] = serde_json::to_value(attempts).unwrap_or(Value::Null);
        }
        json!({ "error": err })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        let mut resp = (self.status(), body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let ApiError::Overloaded(_) = self {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let ApiError::ClientRateLimited(l) = &self {
            let h = resp.headers_mut();
            let secs = l.retry_after.as_secs() + u64::from(l.retry_after.subsec_nanos() > 0);
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
            h.insert(
                "retry-after-ms",
                HeaderValue::from(l.retry_after.as_millis() as u64),
            );
            let name = |what: &str| format!("x-ratelimit-{what}-{}", l.kind);
            for (what, value) in [
                ("limit", l.limit.to_string()),
                ("remaining", l.remaining.to_string()),
                ("reset", format!("{}ms", l.reset.as_millis())),
            ] {
                if let (Ok(n), Ok(v)) = (
                    axum::http::HeaderName::try_from(name(what)),
                    HeaderValue::try_from(value),
                ) {
                    h.insert(n, v);
                }
            }
        }
        resp
    }
}

/// An OpenAI-style SSE error event, sent when a stream fails after bytes reached the client.
pub fn stream_error_event(message: &str, code: &str) -> String {
    let body = json!({
        "error": {
            "message": message,
            "type": "upstream_error",
            "param": null,
            "code": code,
        }
    });
    format!("data: {body}\n\n")
}
