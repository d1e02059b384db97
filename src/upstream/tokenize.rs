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
        serde_json::from_slice::<Answer>(&body).ok()
    };
    let v = tokio::time::timeout(timeout, call).await.ok()??;
    let mut tokens = v
        .count
        .as_ref()
        .and_then(Value::as_u64)
        .or(v.tokens.and_then(|l| l.0))?;
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
        max_model_len: v.max_model_len.as_ref().and_then(Value::as_u64),
    })
}

/// What a `/tokenize` answer says, read without holding its token list: a list of millions of
/// ids is counted as it is read (a `Value` of it would take 30 times its bytes).
#[derive(serde::Deserialize)]
struct Answer {
    count: Option<Value>,
    tokens: Option<Len>,
    max_model_len: Option<Value>,
}

/// A list's length, its items read and dropped one by one; `None` for anything not a list.
struct Len(Option<u64>);

impl<'de> serde::Deserialize<'de> for Len {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Len, D::Error> {
        struct Counting;
        impl<'de> serde::de::Visitor<'de> for Counting {
            type Value = Len;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Len, A::Error> {
                let mut n = 0u64;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Len(Some(n)))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Len, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Len(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Len, E> {
                Ok(Len(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Len, E> {
                Ok(Len(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Len, E> {
                Ok(Len(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Len, E> {
                Ok(Len(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Len, E> {
                Ok(Len(None))
            }
            fn visit_unit<E>(self) -> Result<Len, E> {
                Ok(Len(None))
            }
        }
        d.deserialize_any(Counting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the answer says, read the way it was before `Answer` (a whole `Value`).
    fn by_value(text: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
        let v: Value = serde_json::from_slice(text).ok()?;
        let tokens = v.get("count").and_then(Value::as_u64).or_else(|| {
            v.get("tokens")
                .and_then(Value::as_array)
                .map(|t| t.len() as u64)
        });
        Some((tokens, v.get("max_model_len").and_then(Value::as_u64)))
    }

    fn by_answer(text: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
        let a: Answer = serde_json::from_slice(text).ok()?;
        let tokens = a
            .count
            .as_ref()
            .and_then(Value::as_u64)
            .or(a.tokens.and_then(|l| l.0));
        Some((tokens, a.max_model_len.as_ref().and_then(Value::as_u64)))
    }

    #[test]
    fn a_token_list_is_counted_and_odd_shapes_say_nothing() {
        assert_eq!(by_answer(br#"{"count":3}"#), Some((Some(3), None)));
        assert_eq!(
            by_answer(br#"{"tokens":[1,[2],{"a":3}],"max_model_len":8192}"#),
            Some((Some(3), Some(8192)))
        );
        assert_eq!(
            by_answer(br#"{"count":"x","tokens":{"a":1}}"#),
            Some((None, None))
        );
        assert_eq!(by_answer(br#"{"tokens":null}"#), Some((None, None)));
        assert_eq!(by_answer(b"[1,2]"), None);
    }

    proptest! {
        /// Any bytes: an answer or nothing, never a panic; and what it says is what the whole
        /// `Value` said.
        #[test]
        fn any_answer_reads_as_the_value_did(
            count in proptest::option::of(prop_oneof![
                any::<u64>().prop_map(|n| n.to_string()),
                Just("\"7\"".to_string()),
                Just("-1".to_string()),
                Just("1.5".to_string()),
            ]),
            tokens in proptest::option::of(prop_oneof![
                proptest::collection::vec(any::<u32>(), 0..50)
                    .prop_map(|v| serde_json::to_string(&v).unwrap()),
                Just("{\"a\":[1,2]}".to_string()),
                Just("\"abc\"".to_string()),
                Just("null".to_string()),
            ]),
            max in proptest::option::of(any::<u64>()),
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut fields = Vec::new();
            if let Some(c) = &count {
                fields.push(format!("\"count\":{c}"));
            }
            if let Some(t) = &tokens {
                fields.push(format!("\"tokens\":{t}"));
            }
            if let Some(m) = max {
                fields.push(format!("\"max_model_len\":{m}"));
            }
            fields.push("\"other\":{\"x\":[true,null]}".to_string());
            let text = format!("{{{}}}", fields.join(","));
            prop_assert_eq!(by_answer(text.as_bytes()), by_value(text.as_bytes()));
            let _ = by_answer(&junk);
        }
    }
}
