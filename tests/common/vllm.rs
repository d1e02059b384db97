//! An upstream that answers like vLLM's OpenAI server, and the window it teaches.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

/// An upstream that answers like vLLM's OpenAI server: a request whose `temperature` is not a
/// number gets vLLM's validation 400, which quotes the invalid input back; a message `overflow:N`
/// gets vLLM's context-length 400 stating a limit of N; a message `ratelimited` gets a 429 with
/// no hint (what a proxy in front of it says when full); anything else is served, with
/// `usage.prompt_tokens` N for a message `served:N` (else 10). Counts the requests it got.
pub struct VllmLike {
    pub base: String,
    pub requests: Arc<AtomicU64>,
}

impl VllmLike {
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

pub async fn vllm_like() -> VllmLike {
    use axum::routing::post;
    let requests = Arc::new(AtomicU64::new(0));
    let seen = requests.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<Value>| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                let bad = |msg: String| {
                    (
                        axum::http::StatusCode::BAD_REQUEST,
                        axum::Json(json!({"error": {"message": msg, "type": "BadRequestError", "param": null, "code": 400}})),
                    )
                };
                if let Some(t) = body.get("temperature").filter(|t| !t.is_number()) {
                    return bad(format!(
                        "1 validation error for ChatCompletionRequest\ntemperature\n  Input should be a valid number, unable to parse string as a number [type=float_parsing, input_value={t}, input_type=str]"
                    ));
                }
                let text = body
                    .pointer("/messages/0/content")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if text == "ratelimited" {
                    return (
                        axum::http::StatusCode::TOO_MANY_REQUESTS,
                        axum::Json(json!({"error": {"message": "rate limited", "type": "rate_limit_error", "param": null, "code": 429}})),
                    );
                }
                if let Some(n) = text.strip_prefix("overflow:") {
                    return bad(format!(
                        "This model's maximum context length is {n} tokens. However, you requested 99999 tokens (99990 in the messages, 9 in the completion). Please reduce the length of the messages or completion."
                    ));
                }
                let prompt: u64 = text
                    .strip_prefix("served:")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(10);
                (
                    axum::http::StatusCode::OK,
                    axum::Json(json!({
                        "id": "chatcmpl-v", "object": "chat.completion", "created": 1, "model": "tiny",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
                    })),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    VllmLike {
        base: format!("http://{addr}/v1"),
        requests,
    }
}

pub fn learned(st: &Value, name: &str) -> Value {
    st["endpoints"][name]["learned_context_window"].clone()
}
