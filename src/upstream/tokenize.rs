//! The backend's own count of a prompt: vLLM's and llama.cpp server's `/tokenize` (an upstream
//! call, so it lives with the adapters, not with the local counters in `tokens`).

use serde_json::{Map, Value};

use crate::config::{BackendTokenize, Endpoint};
use crate::tokens::{REPLY_PRIMING, TOKENS_PER_MESSAGE};
use crate::wire::Op;

/// What a backend's own tokenizer said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendCount {
    pub tokens: u64,
    /// vLLM also reports the model's context length.
    pub max_model_len: Option<u64>,
}

/// Bounded size of each endpoint's cache of backend counts.
const BACKEND_CACHE: usize = 1024;

/// Asks the backend to count the prompt (vLLM's or llama.cpp server's `/tokenize`), with the
/// endpoint's short timeout and a cache. `None` on any failure: the caller counts locally.
pub async fn backend_count(
    ep: &Endpoint,
    op: Op,
    body: &Map<String, Value>,
) -> Option<BackendCount> {
    use std::hash::{Hash, Hasher};
    let (kind, timeout) = ep.backend_tokenize?;
    // A Responses request is counted as the chat request it translates to.
    let chat;
    let (op, body) = if op == Op::Responses {
        chat = crate::wire::responses::to_chat(body).ok()?;
        (Op::Chat, &chat)
    } else {
        (op, body)
    };
    let text_of = |v: &Value| -> String {
        match v {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str()))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        }
    };
    let payload = match (kind, op) {
        (BackendTokenize::Vllm, Op::Chat) => serde_json::json!({
            "model": ep.upstream_model,
            "messages": body.get("messages").cloned().unwrap_or(Value::Null),
            "add_generation_prompt": true,
        }),
        (BackendTokenize::Vllm, _) => serde_json::json!({
            "model": ep.upstream_model,
            "prompt": text_of(body.get("prompt").or_else(|| body.get("input")).unwrap_or(&Value::Null)),
        }),
        (BackendTokenize::Llamacpp, Op::Chat) => {
            let text = body
                .get("messages")
                .and_then(Value::as_array)
                .map(|m| {
                    m.iter()
                        .map(|m| text_of(m.get("content").unwrap_or(&Value::Null)))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default();
            serde_json::json!({"content": text})
        }
        (BackendTokenize::Llamacpp, _) => serde_json::json!({
            "content": text_of(body.get("prompt").or_else(|| body.get("input")).unwrap_or(&Value::Null)),
        }),
    };
    let key = {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        payload.to_string().hash(&mut h);
        h.finish()
    };
    if let Some(n) = ep
        .tokenize_cache
        .lock()
        .ok()
        .and_then(|c| c.get(&key).copied())
    {
        return Some(BackendCount {
            tokens: n,
            max_model_len: None,
        });
    }
    let root = ep.base_url.trim_end_matches('/').trim_end_matches("/v1");
    let call = async {
        let r = ep
            .client
            .post(format!("{root}/tokenize"))
            .json(&payload)
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        // A token list is a few bytes a token: 64 MiB is millions of tokens.
        let body = super::reqwest_body(r, 64 * 1024 * 1024).await.ok()?;
        serde_json::from_slice::<Value>(&body).ok()
    };
    let v = tokio::time::timeout(timeout, call).await.ok()??;
    let mut tokens = v.get("count").and_then(Value::as_u64).or_else(|| {
        v.get("tokens")
            .and_then(Value::as_array)
            .map(|t| t.len() as u64)
    })?;
    if kind == BackendTokenize::Llamacpp && op == Op::Chat {
        // /tokenize applies no chat template: add the framing OpenAI-style models use.
        let n = body
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::len)
            .unwrap_or(0) as u64;
        tokens += n * TOKENS_PER_MESSAGE + REPLY_PRIMING;
    }
    if let Ok(mut c) = ep.tokenize_cache.lock() {
        if c.len() >= BACKEND_CACHE {
            c.clear();
        }
        c.insert(key, tokens);
    }
    Some(BackendCount {
        tokens,
        max_model_len: v.get("max_model_len").and_then(Value::as_u64),
    })
}
