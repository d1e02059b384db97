//! Ollama's native API behind the OpenAI wire format: `/api/chat`, `/api/generate` and
//! `/api/embed`, requests translated on the way in and answers, NDJSON streams and errors
//! translated on the way out, so a client cannot tell an Ollama answer from an OpenAI one.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use base64::Engine;
use bytes::Bytes;
use futures_util::Stream;
use serde_json::{Map, Value, json};

use crate::config::Endpoint;
use crate::wire::{Op, Usage};

/// Why a request cannot be expressed in Ollama's API (the executor skips the endpoint).
#[derive(Debug, PartialEq, Eq)]
pub struct Unsupported(pub String);

/// Sampling options: OpenAI names → Ollama's `options`.
fn options(ep: &Endpoint, body: &Map<String, Value>) -> Map<String, Value> {
    let mut o = Map::new();
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
    ] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            o.insert(to.into(), v.clone());
        }
    }
    let max = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64);
    let max = match (max, ep.max_tokens) {
        (Some(m), Some(cap)) => Some(m.min(cap)),
        (m, _) => m,
    };
    if let Some(m) = max {
        o.insert("num_predict".into(), json!(m));
    }
    match body.get("stop") {
        Some(Value::String(s)) => {
            o.insert("stop".into(), json!([s]));
        }
        Some(Value::Array(a)) if !a.is_empty() => {
            o.insert("stop".into(), Value::Array(a.clone()));
        }
        _ => {}
    }
    o
}

fn format_of(body: &Map<String, Value>) -> Option<Value> {
    let rf = body.get("response_format")?;
    match rf.get("type").and_then(Value::as_str) {
        Some("json_object") => Some(json!("json")),
        Some("json_schema") => rf
            .pointer("/json_schema/schema")
            .cloned()
            .or(Some(json!("json"))),
        _ => None,
    }
}

/// An image part's payload as Ollama wants it: bare base64.
fn image_base64(url: &str) -> Result<String, Unsupported> {
    if let Some(rest) = url.strip_prefix("data:") {
        return rest
            .split_once(";base64,")
            .map(|(_, b64)| b64.to_string())
            .ok_or_else(|| Unsupported("image data URLs must be base64".into()));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(Unsupported(
            "Ollama cannot fetch remote image URLs; send the image as a data URL".into(),
        ));
    }
    Ok(url.to_string())
}

fn translate_message(
    m: &Value,
    tool_names: &std::collections::HashMap<String, String>,
) -> Result<Value, Unsupported> {
    let role = match m.get("role").and_then(Value::as_str).unwrap_or("user") {
        "developer" => "system",
        r => r,
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    let mut images = Vec::new();
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") | Some("input_text") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                    ),
                    Some("image_url") => {
                        let url = p
                            .pointer("/image_url/url")
                            .or_else(|| p.get("image_url"))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        images.push(image_base64(url)?);
                    }
                    Some(other) => {
                        return Err(Unsupported(format!(
                            "content part type {other:?} has no Ollama equivalent"
                        )));
                    }
                    None => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    out.insert("content".into(), json!(content));
    if !images.is_empty() {
        out.insert("images".into(), json!(images));
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls") {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let args = c
                    .pointer("/function/arguments")
                    .map(|a| match a {
                        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| json!({})),
                        other => other.clone(),
                    })
                    .unwrap_or_else(|| json!({}));
                json!({"function": {"name": c.pointer("/function/name").cloned().unwrap_or(json!("")), "arguments": args}})
            })
            .collect();
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if role == "tool"
        && let Some(name) = m
            .get("tool_call_id")
            .and_then(Value::as_str)
            .and_then(|id| tool_names.get(id))
    {
        out.insert("tool_name".into(), json!(name));
    }
    Ok(Value::Object(out))
}

/// `stream`, `format` and sampling `options`, shared by `/api/chat` and `/api/generate`.
fn generation_fields(
    out: &mut Map<String, Value>,
    ep: &Endpoint,
    body: &Map<String, Value>,
    stream: bool,
) {
    out.insert("stream".into(), json!(stream));
    if let Some(f) = format_of(body) {
        out.insert("format".into(), f);
    }
    let o = options(ep, body);
    if !o.is_empty() {
        out.insert("options".into(), Value::Object(o));
    }
}

/// The body for `/api/chat`, `/api/generate` or `/api/embed`.
pub fn request_body(
    ep: &Endpoint,
    op: Op,
    body: &Map<String, Value>,
    stream: bool,
) -> Result<Value, Unsupported> {
    let mut out = Map::new();
    out.insert("model".into(), json!(ep.upstream_model));
    match op {
        Op::Chat => {
            // tool_call_id → function name, for Ollama's `tool_name` on tool results.
            let mut tool_names = std::collections::HashMap::new();
            let msgs = body
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            for m in &msgs {
                if let Some(Value::Array(calls)) = m.get("tool_calls") {
                    for c in calls {
                        if let (Some(id), Some(name)) = (
                            c.get("id").and_then(Value::as_str),
                            c.pointer("/function/name").and_then(Value::as_str),
                        ) {
                            tool_names.insert(id.to_string(), name.to_string());
                        }
                    }
                }
            }
            let messages = msgs
                .iter()
                .map(|m| translate_message(m, &tool_names))
                .collect::<Result<Vec<_>, _>>()?;
            out.insert("messages".into(), Value::Array(messages));
            if let Some(tools) = body
                .get("tools")
                .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
            {
                out.insert("tools".into(), tools.clone());
            }
            generation_fields(&mut out, ep, body, stream);
        }
        Op::Completions => {
            let prompt = match body.get("prompt") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or("").to_string()
                }
                _ => {
                    return Err(Unsupported(
                        "Ollama's /api/generate takes one string prompt".into(),
                    ));
                }
            };
            out.insert("prompt".into(), json!(prompt));
            if let Some(s) = body.get("suffix").filter(|v| v.is_string()) {
                out.insert("suffix".into(), s.clone());
            }
            generation_fields(&mut out, ep, body, stream);
        }
        Op::Embeddings => {
            let input = body.get("input").cloned().unwrap_or(Value::Null);
            if let Value::Array(a) = &input
                && a.iter().any(|v| !v.is_string())
            {
                return Err(Unsupported(
                    "Ollama's /api/embed takes text input, not token arrays".into(),
                ));
            }
            out.insert("input".into(), input);
            if let Some(d) = body.get("dimensions").filter(|v| v.is_u64()) {
                out.insert("dimensions".into(), d.clone());
            }
        }
        Op::Responses => {
            // Translated to chat before it gets here (`upstream::request`).
            return Err(Unsupported(
                "a Responses request reaches Ollama's native API only as chat".into(),
            ));
        }
    }
    Ok(Value::Object(out))
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn new_id(op: Op) -> String {
    let prefix = match op {
        Op::Chat => "chatcmpl",
        Op::Completions => "cmpl",
        Op::Embeddings => "embd",
        Op::Responses => "resp",
    };
    format!("{prefix}-{:024x}", fastrand::u128(..) >> 32)
}

fn usage_json(v: &Value) -> Option<Value> {
    let p = v.get("prompt_eval_count").and_then(Value::as_u64);
    let c = v.get("eval_count").and_then(Value::as_u64);
    if p.is_none() && c.is_none() {
        return None;
    }
    let (p, c) = (p.unwrap_or(0), c.unwrap_or(0));
    Some(json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}))
}

fn openai_tool_calls(calls: &[Value], start_index: usize, with_index: bool) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let args = match c.pointer("/function/arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "{}".into(),
            };
            let mut call = json!({
                "id": format!("call_{:016x}", fastrand::u64(..)),
                "type": "function",
                "function": {"name": c.pointer("/function/name").cloned().unwrap_or(json!("")), "arguments": args},
            });
            if with_index {
                call["index"] = json!(start_index + i);
            }
            call
        })
        .collect()
}

fn finish_reason(v: &Value, tool_calls: bool) -> &'static str {
    if tool_calls {
        "tool_calls"
    } else if v.get("done_reason").and_then(Value::as_str) == Some("length") {
        "length"
    } else {
        "stop"
    }
}

/// Error text of an Ollama error body (`{"error": "..."}`), if it is one.
pub fn error_text(v: &Value) -> Option<String> {
    match v.get("error") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("message").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// Converts a 2xx non-stream answer. `Err` carries an in-band error message.
pub fn response_body(
    op: Op,
    requested_model: &str,
    client_body: &Map<String, Value>,
    v: &Value,
) -> Result<Value, String> {
    if let Some(e) = error_text(v) {
        return Err(e);
    }
    let created = now_secs();
    match op {
        // A Responses request reaches Ollama as chat (`upstream::request`).
        Op::Chat | Op::Responses => {
            let msg = v.get("message").ok_or("Ollama answer has no `message`")?;
            let calls = msg
                .get("tool_calls")
                .and_then(Value::as_array)
                .filter(|c| !c.is_empty());
            let mut message = json!({
                "role": "assistant",
                "content": msg.get("content").and_then(Value::as_str).unwrap_or(""),
                "refusal": null,
            });
            if let Some(calls) = calls {
                message["tool_calls"] = Value::Array(openai_tool_calls(calls, 0, false));
                if message["content"] == "" {
                    message["content"] = Value::Null;
                }
            }
            if let Some(t) = msg
                .get("thinking")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
            {
                message["reasoning_content"] = json!(t);
            }
            let mut out = json!({
                "id": new_id(op),
                "object": "chat.completion",
                "created": created,
                "model": requested_model,
                "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish_reason(v, calls.is_some())}],
            });
            if let Some(u) = usage_json(v) {
                out["usage"] = u;
            }
            Ok(out)
        }
        Op::Completions => {
            let text = v
                .get("response")
                .and_then(Value::as_str)
                .ok_or("Ollama answer has no `response`")?;
            let mut out = json!({
                "id": new_id(op),
                "object": "text_completion",
                "created": created,
                "model": requested_model,
                "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish_reason(v, false)}],
            });
            if let Some(u) = usage_json(v) {
                out["usage"] = u;
            }
            Ok(out)
        }
        Op::Embeddings => {
            let embs = v
                .get("embeddings")
                .and_then(Value::as_array)
                .ok_or("Ollama answer has no `embeddings`")?;
            let base64 =
                client_body.get("encoding_format").and_then(Value::as_str) == Some("base64");
            let data: Vec<Value> = embs
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let floats: Vec<f32> = e
                        .as_array()
                        .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(0.0) as f32).collect())
                        .unwrap_or_default();
                    let embedding = if base64 {
                        let bytes: Vec<u8> = floats.iter().flat_map(|f| f.to_le_bytes()).collect();
                        json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                    } else {
                        json!(floats)
                    };
                    json!({"object": "embedding", "index": i, "embedding": embedding})
                })
                .collect();
            let n = v.get("prompt_eval_count").and_then(Value::as_u64);
            let mut out = json!({"object": "list", "data": data, "model": requested_model});
            if let Some(n) = n {
                out["usage"] = json!({"prompt_tokens": n, "total_tokens": n});
            }
            Ok(out)
        }
    }
}

/// An Ollama error body in OpenAI's error shape, for errors returned to the client.
pub fn error_body(status: u16, body: &[u8]) -> Bytes {
    let msg = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| error_text(&v))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(500).collect());
    let (kind, code) = match status {
        404 => ("invalid_request_error", Some("model_not_found")),
        400..=499 => ("invalid_request_error", None),
        _ => ("server_error", None),
    };
    Bytes::from(
        json!({"error": {"message": msg, "type": kind, "param": null, "code": code}}).to_string(),
    )
}

/// Splits a byte stream into newline-delimited JSON values, however the bytes arrive.
#[derive(Debug, Default)]
pub struct NdjsonParser {
    buf: Vec<u8>,
}

/// A line longer than this is not an Ollama stream object; refusing bounds memory on garbage.
const MAX_LINE: usize = 4 * 1024 * 1024;

impl NdjsonParser {
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Value>, String> {
        let mut out = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.buf);
                let text = std::str::from_utf8(&line)
                    .map_err(|_| "NDJSON line is not UTF-8".to_string())?;
                let t = text.trim();
                if !t.is_empty() {
                    out.push(
                        serde_json::from_str(t)
                            .map_err(|e| format!("NDJSON line is not JSON: {e}"))?,
                    );
                }
            } else {
                if self.buf.len() >= MAX_LINE {
                    return Err("NDJSON line over 4 MiB".into());
                }
                self.buf.push(b);
            }
        }
        Ok(out)
    }

    /// A final line without a newline, when the stream ends.
    pub fn finish(&mut self) -> Result<Option<Value>, String> {
        let line = std::mem::take(&mut self.buf);
        let t = String::from_utf8_lossy(&line);
        if t.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(t.trim())
            .map(Some)
            .map_err(|e| format!("NDJSON line is not JSON: {e}"))
    }
}

/// Turns Ollama stream objects into OpenAI SSE events, one for one as they arrive.
#[derive(Debug)]
pub struct StreamTranslator {
    op: Op,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    sent_role: bool,
    tool_calls: usize,
    pub done: bool,
    pub usage: Option<Usage>,
}

impl StreamTranslator {
    pub fn new(op: Op, requested_model: &str, include_usage: bool) -> Self {
        StreamTranslator {
            op,
            id: new_id(op),
            created: now_secs(),
            model: requested_model.to_string(),
            include_usage,
            sent_role: false,
            tool_calls: 0,
            done: false,
            usage: None,
        }
    }

    fn chat_chunk(&self, delta: Value, finish: Value) -> String {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        .to_string()
    }

    fn text_chunk(&self, text: &str, finish: Value) -> String {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}]})
        .to_string()
    }

    /// The SSE `data:` payloads for one Ollama object.
    pub fn on_object(&mut self, v: &Value) -> Vec<String> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if let Some(e) = error_text(v) {
            out.push(json!({"error": {"message": e, "type": "upstream_error", "param": null, "code": null}}).to_string());
            self.done = true;
            return out;
        }
        match self.op {
            Op::Chat | Op::Responses => {
                if !self.sent_role {
                    self.sent_role = true;
                    out.push(self.chat_chunk(
                        json!({"role": "assistant", "content": "", "refusal": null}),
                        Value::Null,
                    ));
                }
                if let Some(t) = v
                    .pointer("/message/thinking")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    out.push(self.chat_chunk(json!({"reasoning_content": t}), Value::Null));
                }
                if let Some(t) = v
                    .pointer("/message/content")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    out.push(self.chat_chunk(json!({"content": t}), Value::Null));
                }
                if let Some(calls) = v
                    .pointer("/message/tool_calls")
                    .and_then(Value::as_array)
                    .filter(|c| !c.is_empty())
                {
                    let calls_json = openai_tool_calls(calls, self.tool_calls, true);
                    self.tool_calls += calls.len();
                    out.push(self.chat_chunk(json!({"tool_calls": calls_json}), Value::Null));
                }
            }
            Op::Completions => {
                if let Some(t) = v
                    .get("response")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    out.push(self.text_chunk(t, Value::Null));
                }
            }
            Op::Embeddings => {}
        }
        if v.get("done").and_then(Value::as_bool) == Some(true) {
            self.done = true;
            let finish = json!(finish_reason(v, self.tool_calls > 0));
            out.push(match self.op {
                Op::Completions => self.text_chunk("", finish),
                _ => self.chat_chunk(json!({}), finish),
            });
            let usage = usage_json(v);
            if let Some(u) = &usage {
                self.usage = Some(Usage {
                    prompt: u["prompt_tokens"].as_u64().unwrap_or(0),
                    completion: u["completion_tokens"].as_u64().unwrap_or(0),
                });
            }
            if self.include_usage {
                let object = if self.op == Op::Completions {
                    "text_completion"
                } else {
                    "chat.completion.chunk"
                };
                out.push(json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage}).to_string());
            }
            out.push("[DONE]".into());
        }
        out
    }
}

/// Shared with the executor so the audit row gets Ollama's exact counts even when the client
/// did not ask for a usage chunk.
pub type UsageTap = Arc<Mutex<Option<Usage>>>;

type Inner = super::ByteStream;

/// NDJSON in, SSE out. A connection that ends without `done: true` simply ends: the executor
/// sees no `[DONE]` and treats it as the failure it is.
pub struct SseFromNdjson {
    inner: Inner,
    parser: NdjsonParser,
    tr: StreamTranslator,
    tap: UsageTap,
    ended: bool,
}

impl SseFromNdjson {
    pub fn new(inner: Inner, tr: StreamTranslator) -> (Self, UsageTap) {
        let tap: UsageTap = Arc::new(Mutex::new(None));
        (
            SseFromNdjson {
                inner,
                parser: NdjsonParser::default(),
                tr,
                tap: tap.clone(),
                ended: false,
            },
            tap,
        )
    }

    fn render(&mut self, objs: Vec<Value>) -> Bytes {
        let mut s = String::new();
        for v in &objs {
            for ev in self.tr.on_object(v) {
                s.push_str("data: ");
                s.push_str(&ev);
                s.push_str("\n\n");
            }
        }
        if let Some(u) = self.tr.usage
            && let Ok(mut t) = self.tap.lock()
        {
            *t = Some(u);
        }
        Bytes::from(s)
    }
}

impl Stream for SseFromNdjson {
    type Item = Result<Bytes, super::BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            match self.inner.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(b))) => {
                    let objs = match self.parser.push(&b) {
                        Ok(o) => o,
                        Err(e) => {
                            self.ended = true;
                            let ev = json!({"error": {"message": format!("malformed Ollama stream: {e}"), "type": "upstream_error", "param": null, "code": "malformed_stream"}});
                            return Poll::Ready(Some(Ok(Bytes::from(format!("data: {ev}\n\n")))));
                        }
                    };
                    if objs.is_empty() {
                        continue;
                    }
                    let out = self.render(objs);
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(None) => {
                    self.ended = true;
                    let last = self.parser.finish().ok().flatten();
                    if let Some(v) = last {
                        let out = self.render(vec![v]);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(out)));
                        }
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn ep() -> Arc<Endpoint> {
        let cfg = Config::load(
            "models:\n  q: { type: ollama, host: \"http://127.0.0.1:11434\", model: \"qwen2.5:7b\", max_tokens: 512 }\n",
        )
        .unwrap();
        cfg.endpoints["q"].clone()
    }

    fn fixture(name: &str) -> Value {
        let path = format!(
            "{}/tests/fixtures/ollama/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    /// Removes fields that differ per call (ids, timestamps).
    fn stable(mut v: Value) -> Value {
        fn walk(v: &mut Value) {
            match v {
                Value::Object(o) => {
                    for k in ["id", "created"] {
                        if o.contains_key(k) {
                            o.insert(k.into(), json!("*"));
                        }
                    }
                    o.values_mut().for_each(walk);
                }
                Value::Array(a) => a.iter_mut().for_each(walk),
                _ => {}
            }
        }
        walk(&mut v);
        v
    }

    #[test]
    fn golden_chat_request() {
        let case = fixture("chat_request.json");
        let body = case["openai"].as_object().unwrap();
        let got = request_body(&ep(), Op::Chat, body, false).unwrap();
        assert_eq!(got, case["ollama"]);
    }

    #[test]
    fn golden_generate_and_embed_requests() {
        for name in ["generate_request.json", "embed_request.json"] {
            let case = fixture(name);
            let op = if case["op"] == "completions" {
                Op::Completions
            } else {
                Op::Embeddings
            };
            let stream = case["stream"].as_bool().unwrap();
            let got = request_body(&ep(), op, case["openai"].as_object().unwrap(), stream).unwrap();
            assert_eq!(got, case["ollama"], "{name}");
        }
    }

    #[test]
    fn golden_chat_response_and_tool_call() {
        for name in [
            "chat_response.json",
            "chat_tool_response.json",
            "generate_response.json",
            "embed_response.json",
        ] {
            let case = fixture(name);
            let op = match case["op"].as_str().unwrap() {
                "chat" => Op::Chat,
                "completions" => Op::Completions,
                _ => Op::Embeddings,
            };
            let client = case["client"].as_object().cloned().unwrap_or_default();
            let got = response_body(op, "local", &client, &case["ollama"]).unwrap();
            assert_eq!(stable(got), stable(case["openai"].clone()), "{name}");
        }
    }

    #[test]
    fn golden_stream() {
        let case = fixture("chat_stream.json");
        let ndjson = case["ollama_ndjson"].as_str().unwrap();
        let mut p = NdjsonParser::default();
        let mut tr = StreamTranslator::new(Op::Chat, "local", true);
        let mut events = Vec::new();
        for v in p.push(ndjson.as_bytes()).unwrap() {
            events.extend(tr.on_object(&v));
        }
        let got: Vec<Value> = events
            .iter()
            .map(|e| {
                if e == "[DONE]" {
                    json!("[DONE]")
                } else {
                    stable(serde_json::from_str(e).unwrap())
                }
            })
            .collect();
        let want: Vec<Value> = case["openai_events"]
            .as_array()
            .unwrap()
            .iter()
            .cloned()
            .map(stable)
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            tr.usage,
            Some(Usage {
                prompt: 26,
                completion: 3
            })
        );
    }

    #[test]
    fn ndjson_any_split_gives_the_same_objects() {
        let text = "{\"a\":1}\n{\"b\":\"x\\ny\"}\n\n{\"c\":[1,2,3]}\n{\"d\":\"é😀\"}\n";
        let whole = NdjsonParser::default().push(text.as_bytes()).unwrap();
        assert_eq!(whole.len(), 4);
        let bytes = text.as_bytes();
        for i in 0..=bytes.len() {
            for j in i..=bytes.len() {
                let mut p = NdjsonParser::default();
                let mut got = p.push(&bytes[..i]).unwrap();
                got.extend(p.push(&bytes[i..j]).unwrap());
                got.extend(p.push(&bytes[j..]).unwrap());
                assert_eq!(got, whole, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn ndjson_garbage_is_an_error_not_a_panic() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut buf = Vec::new();
            for _ in 0..48 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                buf.push(match seed % 5 {
                    0 => b'\n',
                    1 => b'{',
                    _ => (seed >> 8) as u8,
                });
            }
            let _ = NdjsonParser::default().push(&buf);
        }
        assert!(NdjsonParser::default().push(b"{not json}\n").is_err());
    }

    #[test]
    fn remote_images_are_unsupported_and_data_urls_translate() {
        let body = json!({"model": "q", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]});
        assert!(request_body(&ep(), Op::Chat, body.as_object().unwrap(), false).is_err());
        let body = json!({"model": "q", "messages": [{"role": "user", "content": [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]});
        let got = request_body(&ep(), Op::Chat, body.as_object().unwrap(), true).unwrap();
        assert_eq!(got["messages"][0]["images"], json!(["iVBORw0KGgo="]));
        assert_eq!(got["messages"][0]["content"], "what");
        assert_eq!(got["stream"], true);
    }

    #[test]
    fn errors_map_to_openai_shape() {
        let b = error_body(
            404,
            br#"{"error":"model 'qwen9' not found, try pulling it first"}"#,
        );
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert!(v["error"]["message"].as_str().unwrap().contains("qwen9"));
        let mut tr = StreamTranslator::new(Op::Chat, "m", false);
        let ev =
            tr.on_object(&json!({"error": "an error was encountered while running the model"}));
        assert!(ev[0].contains("upstream_error"));
        assert!(tr.done);
    }

    proptest::proptest! {
        #[test]
        fn ndjson_arbitrary_bytes_never_panic(chunks in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..64), 0..8)) {
            let mut p = NdjsonParser::default();
            for c in &chunks {
                let _ = p.push(c);
            }
            let _ = p.finish();
        }

        #[test]
        fn ndjson_arbitrary_splits_give_the_same_objects(cuts in proptest::collection::vec(0usize..300, 0..6)) {
            let text = "{\"a\":1}\n{\"b\":\"x\\ny\"}\n\n{\"c\":[1,2,{\"d\":null}]}\n{\"e\":\"\u{00e9}\u{1F600}\"}";
            let bytes = text.as_bytes();
            let mut whole = NdjsonParser::default();
            let mut want = whole.push(bytes).unwrap();
            want.extend(whole.finish().unwrap());
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut p = NdjsonParser::default();
            let mut got = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                got.extend(p.push(&bytes[at..c]).unwrap());
                at = c;
            }
            got.extend(p.finish().unwrap());
            proptest::prop_assert_eq!(got, want);
        }
    }
}
