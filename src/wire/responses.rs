//! OpenAI's Responses API on the wire: what a `/v1/responses` request must look like, what its
//! stream events mean for the commit decision, and the translation to and from chat completions
//! for endpoints that speak only chat (Ollama, llama.cpp's server, or an endpoint found to answer
//! 404 for `/responses`). Pure functions and one state machine ([`ChatToEvents`]): no I/O.
//!
//! Into chat: `instructions` and `input` (a string, or items: messages with `input_text`,
//! `output_text` and `input_image` parts, `function_call` and `function_call_output` items)
//! become messages; function `tools` chat tools; `text.format` `response_format`;
//! `max_output_tokens` `max_tokens`. Fields OpenAI documents as optional hints with no chat
//! equivalent are dropped ([`DROPPED`]); fields that would change the answer and cannot be
//! expressed make translation fail, naming the field ([`Untranslatable`]).

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use super::{ChunkKind, Usage};
use crate::config::Capability;
use crate::error::ApiError;

/// Request fields with no chat equivalent that OpenAI documents as optional hints (storage,
/// metadata, caching and tracing keys, what to include in the answer, truncation, the service
/// tier, reasoning settings): translation drops them.
pub const DROPPED: &[&str] = &[
    "store",
    "metadata",
    "include",
    "truncation",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "top_logprobs",
    "stream_options",
    "background",
];

/// Request fields translation carries over to chat unchanged.
const KEPT: &[&str] = &["temperature", "top_p", "parallel_tool_calls", "user"];

/// Why a Responses request cannot be said in chat: the field (or item) that has no equivalent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untranslatable(pub String);

impl std::fmt::Display for Untranslatable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} has no chat-completions equivalent, and this endpoint speaks only chat",
            self.0
        )
    }
}

/// Validates a Responses request's fields the way OpenAI types them, and notes what it needs.
pub fn inspect(
    body: &Map<String, Value>,
    needs: &mut BTreeSet<Capability>,
) -> Result<(), ApiError> {
    let wrong = |param: &'static str, what: &str| ApiError::InvalidRequest {
        message: format!("'{param}' must be {what}"),
        param: Some(param),
        code: Some("invalid_type"),
    };
    match body.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let Some(obj) = item.as_object() else {
                    return Err(ApiError::InvalidRequest {
                        message: format!("input[{i}] must be an object"),
                        param: Some("input"),
                        code: Some("invalid_type"),
                    });
                };
                if let Some(Value::Array(parts)) = obj.get("content")
                    && parts
                        .iter()
                        .any(|p| p.get("type").and_then(Value::as_str) == Some("input_image"))
                {
                    needs.insert(Capability::Vision);
                }
            }
        }
        Some(_) => return Err(wrong("input", "a string or an array of items")),
    }
    for (key, what) in [
        ("instructions", "a string"),
        ("previous_response_id", "a string"),
    ] {
        if !matches!(
            body.get(key),
            None | Some(Value::Null) | Some(Value::String(_))
        ) {
            return Err(wrong(key, what));
        }
    }
    match body.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(t)) => {
            if !t.is_empty() {
                needs.insert(Capability::Tools);
            }
        }
        Some(_) => return Err(wrong("tools", "an array")),
    }
    if !matches!(body.get("max_output_tokens"), None | Some(Value::Null))
        && body
            .get("max_output_tokens")
            .and_then(Value::as_u64)
            .is_none()
    {
        return Err(wrong("max_output_tokens", "a non-negative integer"));
    }
    Ok(())
}

/// The request's `input` as items: a string is one user message.
pub fn input_items(body: &Map<String, Value>) -> Vec<Value> {
    match body.get("input") {
        Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    }
}

/// What a Responses stream event means before the commit: output (a text, refusal, reasoning or
/// function-call argument delta, or the response's end) commits; an `error` or
/// `response.failed` event fails the attempt over; anything else (`response.created`,
/// `response.in_progress`, an item or part opening) is held.
pub fn classify_event(v: &Value) -> ChunkKind {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "error" => ChunkKind::Error(
            v.get("message")
                .and_then(Value::as_str)
                .or_else(|| v.pointer("/error/message").and_then(Value::as_str))
                .unwrap_or("upstream error event")
                .to_string(),
        ),
        "response.failed" => ChunkKind::Error(
            v.pointer("/response/error/message")
                .and_then(Value::as_str)
                .unwrap_or("the upstream's response failed")
                .to_string(),
        ),
        "response.completed" | "response.incomplete" => ChunkKind::Content,
        k if k.ends_with(".delta") => {
            let delta = v.get("delta");
            let non_empty = match delta {
                Some(Value::String(s)) => !s.is_empty(),
                Some(Value::Null) | None => false,
                Some(_) => true,
            };
            if non_empty {
                ChunkKind::Content
            } else {
                ChunkKind::Preamble
            }
        }
        _ => {
            // A chat-shaped error object some servers send in any stream.
            if v.get("error").is_some_and(|e| !e.is_null()) && v.get("type").is_none() {
                return super::classify_chunk(v);
            }
            ChunkKind::Preamble
        }
    }
}

/// Whether this event ends a Responses stream (the stream's `[DONE]`).
pub fn is_terminal(v: &Value) -> bool {
    matches!(
        v.get("type").and_then(Value::as_str),
        Some("response.completed" | "response.incomplete")
    )
}

/// The characters of output text an event carries (for estimating usage when none comes).
pub fn delta_chars(v: &Value) -> usize {
    match v.get("type").and_then(Value::as_str) {
        Some(k) if k.ends_with(".delta") => {
            v.get("delta").and_then(Value::as_str).map_or(0, str::len)
        }
        _ => 0,
    }
}

/// A Response object's usage (`input_tokens`, `output_tokens`), or that of the response an
/// event carries.
pub fn usage_of(v: &Value) -> Option<Usage> {
    let u = v
        .get("usage")
        .or_else(|| v.get("response").and_then(|r| r.get("usage")))
        .filter(|u| u.is_object())?;
    Some(Usage {
        prompt: u.get("input_tokens").and_then(Value::as_u64).unwrap_or(0),
        completion: u.get("output_tokens").and_then(Value::as_u64).unwrap_or(0),
    })
}

/// The text of a Response object's output, for estimating usage.
pub fn output_chars(v: &Value) -> usize {
    fn walk(v: &Value) -> usize {
        match v {
            Value::Array(a) => a.iter().map(walk).sum(),
            Value::Object(o) => ["text", "arguments", "content"]
                .iter()
                .filter_map(|k| o.get(*k))
                .map(|x| match x {
                    Value::String(s) => s.len(),
                    other => walk(other),
                })
                .sum(),
            _ => 0,
        }
    }
    v.get("output").map_or(0, walk)
}

/// Why a full Response object is a failure although it came with a 2xx: its `status` is
/// `failed`, or it carries an `error`.
pub fn failed(v: &Value) -> Option<String> {
    let err = v.get("error").filter(|e| !e.is_null());
    if v.get("status").and_then(Value::as_str) == Some("failed") || err.is_some() {
        return Some(
            err.and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("the upstream's response failed")
                .to_string(),
        );
    }
    None
}

// ── Into chat ───────────────────────────────────────────────────────────────────────────────

/// The chat request that says what `body` (a Responses request, its `input` already holding
/// the whole conversation) asks. `model` and `stream` are the caller's.
pub fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, Untranslatable> {
    let mut out = Map::new();
    let mut messages = Vec::new();
    for (key, v) in body {
        match key.as_str() {
            "model" | "input" | "instructions" | "stream" => {}
            "previous_response_id" if !v.is_null() => {
                return Err(Untranslatable(
                    "`previous_response_id` (the conversation was not kept by the gateway)".into(),
                ));
            }
            "max_output_tokens" => {
                if !v.is_null() {
                    out.insert("max_tokens".into(), v.clone());
                }
            }
            "tools" => {
                if let Some(tools) = v.as_array()
                    && !tools.is_empty()
                {
                    out.insert("tools".into(), Value::Array(tools_to_chat(tools)?));
                }
            }
            "tool_choice" => {
                if let Some(c) = tool_choice_to_chat(v)? {
                    out.insert("tool_choice".into(), c);
                }
            }
            "text" => {
                if let Some(f) = format_to_chat(v)? {
                    out.insert("response_format".into(), f);
                }
                // `text.verbosity` is a hint.
            }
            k if KEPT.contains(&k) => {
                if !v.is_null() {
                    out.insert(k.into(), v.clone());
                }
            }
            k if DROPPED.contains(&k) => {
                if k == "background" && v.as_bool() == Some(true) {
                    return Err(Untranslatable("`background: true`".into()));
                }
            }
            _ if v.is_null() => {}
            other => return Err(Untranslatable(format!("`{other}`"))),
        }
    }
    if let Some(Value::String(s)) = body.get("instructions") {
        messages.push(json!({"role": "system", "content": s}));
    }
    items_to_messages(&input_items(body), &mut messages)?;
    if messages.is_empty() {
        return Err(Untranslatable("an empty `input`".into()));
    }
    out.insert("messages".into(), Value::Array(messages));
    Ok(out)
}

fn items_to_messages(items: &[Value], out: &mut Vec<Value>) -> Result<(), Untranslatable> {
    for (i, item) in items.iter().enumerate() {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") | Some("system") => "system",
                    Some("assistant") => "assistant",
                    Some("user") => "user",
                    other => {
                        return Err(Untranslatable(format!(
                            "`input[{i}].role` {}",
                            other.map_or("(missing)".to_string(), |r| format!("`{r}`"))
                        )));
                    }
                };
                let content = content_to_chat(item.get("content"), i)?;
                out.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": item.get("arguments").cloned().unwrap_or(json!("")),
                    },
                });
                // Calls in a row are one assistant turn.
                let joined = out.last_mut().and_then(|m| {
                    (m.get("role").and_then(Value::as_str) == Some("assistant"))
                        .then(|| m.get_mut("tool_calls").and_then(Value::as_array_mut))
                        .flatten()
                });
                match joined {
                    Some(calls) => calls.push(call),
                    None => out
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "content": output,
                }));
            }
            // A model's reasoning is not sent back to a chat model.
            "reasoning" => {}
            other => {
                return Err(Untranslatable(format!("`input[{i}]` of type `{other}`")));
            }
        }
    }
    Ok(())
}

/// A message's content in chat: a string, or parts (text joined into one string when there are
/// no images, which every chat server takes).
fn content_to_chat(content: Option<&Value>, i: usize) -> Result<Value, Untranslatable> {
    let parts = match content {
        Some(Value::String(s)) => return Ok(json!(s)),
        Some(Value::Array(parts)) => parts,
        None | Some(Value::Null) => return Ok(json!("")),
        Some(_) => return Err(Untranslatable(format!("`input[{i}].content`"))),
    };
    let mut out = Vec::new();
    for (j, p) in parts.iter().enumerate() {
        match p.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => out.push(json!({
                "type": "text",
                "text": p.get("text").and_then(Value::as_str).unwrap_or(""),
            })),
            Some("refusal") => out.push(json!({
                "type": "text",
                "text": p.get("refusal").and_then(Value::as_str).unwrap_or(""),
            })),
            Some("input_image") => {
                let Some(url) = p.get("image_url").and_then(Value::as_str) else {
                    return Err(Untranslatable(format!(
                        "`input[{i}].content[{j}]` (an image by `file_id`)"
                    )));
                };
                let mut image = json!({"url": url});
                if let Some(d) = p.get("detail").and_then(Value::as_str) {
                    image["detail"] = json!(d);
                }
                out.push(json!({"type": "image_url", "image_url": image}));
            }
            other => {
                return Err(Untranslatable(format!(
                    "`input[{i}].content[{j}]` of type `{}`",
                    other.unwrap_or("(missing)")
                )));
            }
        }
    }
    if out.iter().all(|p| p["type"] == "text") {
        let text: String = out
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("");
        return Ok(json!(text));
    }
    Ok(Value::Array(out))
}

fn tools_to_chat(tools: &[Value]) -> Result<Vec<Value>, Untranslatable> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = Map::new();
                for k in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                        f.insert(k.into(), v.clone());
                    }
                }
                Ok(json!({"type": "function", "function": f}))
            }
            other => Err(Untranslatable(format!(
                "`tools[{i}]` of type `{}`",
                other.unwrap_or("(missing)")
            ))),
        })
        .collect()
}

fn tool_choice_to_chat(v: &Value) -> Result<Option<Value>, Untranslatable> {
    match v {
        Value::Null => Ok(None),
        Value::String(_) => Ok(Some(v.clone())),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => Ok(Some(
            json!({"type": "function", "function": {"name": o.get("name").cloned().unwrap_or(Value::Null)}}),
        )),
        _ => Err(Untranslatable("`tool_choice`".into())),
    }
}

fn format_to_chat(text: &Value) -> Result<Option<Value>, Untranslatable> {
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for k in ["name", "description", "schema", "strict"] {
                if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
                    schema.insert(k.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(Untranslatable("`text.format`".into())),
    }
}

// ── Out of chat ─────────────────────────────────────────────────────────────────────────────

/// What a Response object the gateway writes says of itself beyond its output: its id, when it
/// was made, the model the client asked for, and the request (whose settings it echoes).
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// The request's fields a Response echoes.
    pub echo: Map<String, Value>,
}

impl Meta {
    pub fn new(id: &str, model: &str, request: &Map<String, Value>) -> Meta {
        let mut echo = Map::new();
        for k in [
            "instructions",
            "max_output_tokens",
            "previous_response_id",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "text",
            "metadata",
            "store",
            "user",
        ] {
            if let Some(v) = request.get(k) {
                echo.insert(k.into(), v.clone());
            }
        }
        Meta {
            id: id.to_string(),
            created_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            echo,
        }
    }

    /// The Response object with `status`, `output`, `usage` (null while in progress).
    pub fn response(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let e = |k: &str, default: Value| self.echo.get(k).cloned().unwrap_or(default);
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "instructions": e("instructions", Value::Null),
            "max_output_tokens": e("max_output_tokens", Value::Null),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e("parallel_tool_calls", json!(true)),
            "previous_response_id": e("previous_response_id", Value::Null),
            "reasoning": {"effort": null, "summary": null},
            "store": e("store", json!(true)),
            "temperature": e("temperature", json!(1.0)),
            "text": e("text", json!({"format": {"type": "text"}})),
            "tool_choice": e("tool_choice", json!("auto")),
            "tools": e("tools", json!([])),
            "top_p": e("top_p", json!(1.0)),
            "truncation": "disabled",
            "usage": usage,
            "user": e("user", Value::Null),
            "metadata": e("metadata", json!({})),
        })
    }
}

/// A Responses `usage` object from chat's counts.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt.saturating_add(u.completion),
    })
}

/// A fresh item id with OpenAI's prefixes (`msg_`, `fc_`).
pub fn item_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", fastrand::u128(..))
}

/// The Response object for a chat completion (choice 0): a message item with `output_text`
/// when there is text (or nothing else), a `function_call` item per tool call, and usage.
pub fn from_chat(chat: &Value, meta: &Meta) -> Value {
    let choice = chat.get("choices").and_then(|c| c.get(0));
    let message = choice.and_then(|c| c.get("message"));
    let text = message
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or("");
    let calls = message
        .and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut output = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(&item_id("msg"), text, "completed"));
    }
    for c in &calls {
        output.push(call_item(
            &item_id("fc"),
            c.get("id").and_then(Value::as_str).unwrap_or(""),
            c.pointer("/function/name")
                .and_then(Value::as_str)
                .unwrap_or(""),
            c.pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or(""),
            "completed",
        ));
    }
    let usage = super::usage_of(chat).map_or(Value::Null, usage_json);
    let finish = choice
        .and_then(|c| c.get("finish_reason"))
        .and_then(Value::as_str);
    let mut r = meta.response(status_for(finish), output, usage);
    if let Some(reason) = incomplete_reason(finish) {
        r["incomplete_details"] = json!({"reason": reason});
    }
    r
}

fn status_for(finish: Option<&str>) -> &'static str {
    if incomplete_reason(finish).is_some() {
        "incomplete"
    } else {
        "completed"
    }
}

fn incomplete_reason(finish: Option<&str>) -> Option<&'static str> {
    match finish {
        Some("length") => Some("max_output_tokens"),
        Some("content_filter") => Some("content_filter"),
        _ => None,
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// One SSE event of a Responses stream, named by its type.
pub fn event(kind: &str, seq: u64, mut body: Value) -> String {
    if let Some(o) = body.as_object_mut() {
        o.insert("type".into(), json!(kind));
        o.insert("sequence_number".into(), json!(seq));
    }
    format!("event: {kind}\ndata: {body}\n\n")
}

/// The `response.failed` event that ends a committed stream the gateway could not finish:
/// `code` is the outcome (`stream_broken`, `stream_stalled`, …).
pub fn failed_event(meta: &Meta, seq: u64, code: &str, message: &str) -> String {
    let mut r = meta.response("failed", Vec::new(), Value::Null);
    r["error"] = json!({"code": code, "message": message});
    event("response.failed", seq, json!({"response": r}))
}

/// Chat completion chunks in, the Responses event sequence out: `response.created`,
/// `response.in_progress`, then per output item `response.output_item.added` (and for text
/// `response.content_part.added`), its deltas (`response.output_text.delta`,
/// `response.function_call_arguments.delta`), its dones, and `response.completed` with the whole
/// response and its usage. A chat error chunk becomes an `error` event.
pub struct ChatToEvents {
    meta: Meta,
    seq: u64,
    started: bool,
    next_index: u64,
    /// The message item: (id, output index, text so far).
    text: Option<(String, u64, String)>,
    /// Function calls by chat's tool-call index: (item id, output index, call id, name, args).
    calls: Vec<(u64, String, u64, String, String, String)>,
    usage: Option<Usage>,
    finish: Option<String>,
    done: bool,
    /// The most text and arguments kept for the closing events (`server.max_response_bytes`),
    /// and how much is kept: past it the response ends `response.failed`
    /// (`response_too_large`), whatever more the upstream sends.
    max_kept: usize,
    kept: usize,
}

/// The `code` of the `response.failed` that ends a translated response larger than
/// `server.max_response_bytes`.
pub const TOO_LARGE: &str = "response_too_large";

/// How that `response.failed`'s message begins (the executor passes its code on to the client).
pub const TOO_LARGE_MESSAGE: &str =
    "The upstream's answer grew past what a translated response keeps (server.max_response_bytes";

/// The most a translated response keeps for its closing events whatever
/// `server.max_response_bytes` allows: those events repeat the whole output about five times
/// (the text's done, its part's, its item's, `response.completed`), so one such stream stays
/// within 100 MB of the gateway's idle memory.
pub const TRANSLATED_MAX: usize = 16 << 20;

impl ChatToEvents {
    pub fn new(meta: Meta) -> Self {
        Self::bounded(meta, usize::MAX)
    }

    /// A translator that keeps at most `max_kept` bytes of output for its closing events.
    pub fn bounded(meta: Meta, max_kept: usize) -> Self {
        ChatToEvents {
            meta,
            seq: 0,
            started: false,
            next_index: 0,
            text: None,
            calls: Vec::new(),
            usage: None,
            finish: None,
            done: false,
            max_kept,
            kept: 0,
        }
    }

    /// The response has ended (completed, failed, or an error): nothing more comes of it.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Takes `n` more bytes of output to keep; past the bound, ends the response with
    /// `response.failed` (its items as they stand are not repeated: the deltas had them).
    fn keep(&mut self, out: &mut String, n: usize) -> bool {
        if self.kept.saturating_add(n) <= self.max_kept {
            self.kept += n;
            return true;
        }
        self.done = true;
        self.text = None;
        self.calls.clear();
        let usage = self.usage.map_or(Value::Null, usage_json);
        let mut r = self.meta.response("failed", Vec::new(), usage);
        r["error"] = json!({
            "code": TOO_LARGE,
            "message": format!("{TOO_LARGE_MESSAGE}, at most 16 MiB: {} bytes): the response ends here.", self.max_kept),
        });
        self.emit(out, "response.failed", json!({"response": r}));
        false
    }

    fn emit(&mut self, out: &mut String, kind: &str, body: Value) {
        out.push_str(&event(kind, self.seq, body));
        self.seq += 1;
    }

    fn start(&mut self, out: &mut String) {
        if self.started {
            return;
        }
        self.started = true;
        let r = self.meta.response("in_progress", Vec::new(), Value::Null);
        self.emit(out, "response.created", json!({"response": r.clone()}));
        self.emit(out, "response.in_progress", json!({"response": r}));
    }

    /// The events one chat chunk makes.
    pub fn chunk(&mut self, v: &Value) -> String {
        let mut out = String::new();
        if self.done {
            return out;
        }
        if let ChunkKind::Error(message) = super::classify_chunk(v) {
            self.done = true;
            self.emit(
                &mut out,
                "error",
                json!({"code": "upstream_error", "message": message, "param": null}),
            );
            return out;
        }
        self.start(&mut out);
        if let Some(u) = super::usage_of(v) {
            self.usage = Some(u);
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            return out;
        };
        let delta = choice.get("delta");
        if let Some(t) = delta
            .and_then(|d| d.get("content"))
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            if self.text.is_none() {
                let id = item_id("msg");
                let index = self.next_index;
                self.next_index += 1;
                self.emit(
                    &mut out,
                    "response.output_item.added",
                    json!({"output_index": index, "item": message_item(&id, "", "in_progress")}),
                );
                self.emit(
                    &mut out,
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}}),
                );
                self.text = Some((id, index, String::new()));
            }
            if !self.keep(&mut out, t.len()) {
                return out;
            }
            if let Some((id, index, text)) = self.text.as_mut() {
                text.push_str(t);
                let body = json!({"item_id": id, "output_index": *index, "content_index": 0, "delta": t, "logprobs": []});
                self.emit(&mut out, "response.output_text.delta", body);
            }
        }
        if let Some(calls) = delta
            .and_then(|d| d.get("tool_calls"))
            .and_then(Value::as_array)
        {
            for c in calls {
                let k = c.get("index").and_then(Value::as_u64).unwrap_or(0);
                let pos = match self.calls.iter().position(|x| x.0 == k) {
                    Some(p) => p,
                    None => {
                        let id = item_id("fc");
                        let index = self.next_index;
                        self.next_index += 1;
                        let call_id = c.get("id").and_then(Value::as_str).map_or_else(
                            || format!("call_{:016x}", fastrand::u64(..)),
                            str::to_string,
                        );
                        let name = c
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string();
                        self.emit(
                            &mut out,
                            "response.output_item.added",
                            json!({"output_index": index, "item": call_item(&id, &call_id, &name, "", "in_progress")}),
                        );
                        self.calls
                            .push((k, id, index, call_id, name, String::new()));
                        self.calls.len() - 1
                    }
                };
                if let Some(a) = c
                    .pointer("/function/arguments")
                    .and_then(Value::as_str)
                    .filter(|a| !a.is_empty())
                {
                    if !self.keep(&mut out, a.len()) {
                        return out;
                    }
                    let Some(call) = self.calls.get_mut(pos) else {
                        continue;
                    };
                    call.5.push_str(a);
                    let (id, index) = (call.1.clone(), call.2);
                    self.emit(
                        &mut out,
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": a}),
                    );
                }
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(f.to_string());
        }
        out
    }

    /// The events that close the response (chat's `[DONE]`): each item's dones, then
    /// `response.completed` (or `response.incomplete` when chat stopped at its token limit).
    pub fn finish(&mut self) -> String {
        let mut out = String::new();
        if self.done {
            return out;
        }
        self.start(&mut out);
        self.done = true;
        let mut output: Vec<(u64, Value)> = Vec::new();
        if let Some((id, index, text)) = self.text.take() {
            self.emit(
                &mut out,
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
            );
            self.emit(
                &mut out,
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": text, "annotations": []}}),
            );
            let item = message_item(&id, &text, "completed");
            self.emit(
                &mut out,
                "response.output_item.done",
                json!({"output_index": index, "item": item.clone()}),
            );
            output.push((index, item));
        }
        for (_, id, index, call_id, name, args) in std::mem::take(&mut self.calls) {
            self.emit(
                &mut out,
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": args}),
            );
            let item = call_item(&id, &call_id, &name, &args, "completed");
            self.emit(
                &mut out,
                "response.output_item.done",
                json!({"output_index": index, "item": item.clone()}),
            );
            output.push((index, item));
        }
        output.sort_by_key(|(i, _)| *i);
        let output = output.into_iter().map(|(_, v)| v).collect();
        let usage = self.usage.map_or(Value::Null, usage_json);
        let finish = self.finish.as_deref();
        let mut r = self.meta.response(status_for(finish), output, usage);
        let kind = match incomplete_reason(finish) {
            Some(reason) => {
                r["incomplete_details"] = json!({"reason": reason});
                "response.incomplete"
            }
            None => "response.completed",
        };
        self.emit(&mut out, kind, json!({"response": r}));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn a_conversation_of_items_becomes_chat_messages() {
        let body = map(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "reasoning", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "input_text", "text": "And this?"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]},
            ],
            "tools": [{"type": "function", "name": "weather", "description": "d", "parameters": {"type": "object"}, "strict": null}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
            "max_output_tokens": 50,
            "temperature": 0.2,
            "store": false,
            "metadata": {"a": "b"},
        }));
        let chat = to_chat(&body).unwrap();
        assert_eq!(
            Value::Object(chat),
            json!({
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
                        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    {"role": "assistant", "content": "It is sunny."},
                    {"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]},
                ],
                "tools": [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "weather"}},
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": true}},
                "max_tokens": 50,
                "temperature": 0.2,
            })
        );
        // A string input is one user message.
        let chat = to_chat(&map(json!({"model": "m", "input": "Hi"}))).unwrap();
        assert_eq!(chat["messages"], json!([{"role": "user", "content": "Hi"}]));
    }

    #[test]
    fn what_chat_cannot_say_is_refused_by_name() {
        for (body, named) in [
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "`tools[0]` of type `web_search`",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "x"}]}),
                "`input[0]` of type `item_reference`",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
                "`input[0].content[0]` of type `input_file`",
            ),
            (json!({"input": "x", "conversation": "c"}), "`conversation`"),
            (
                json!({"input": "x", "background": true}),
                "`background: true`",
            ),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "`previous_response_id`",
            ),
        ] {
            let err = to_chat(&map(body.clone())).unwrap_err();
            assert!(err.0.starts_with(named), "{body}: {err}");
        }
        // Hints are dropped.
        assert!(to_chat(&map(json!({"input": "x", "background": false, "include": ["x"], "reasoning": {"effort": "low"}}))).is_ok());
    }

    #[test]
    fn a_chat_answer_becomes_a_response() {
        let meta = Meta::new("resp_gw", "route-a", &map(json!({"instructions": "I"})));
        let chat = json!({"choices": [{"message": {"role": "assistant", "content": "Hi!", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2}});
        let r = from_chat(&chat, &meta);
        assert_eq!(r["id"], "resp_gw");
        assert_eq!(r["model"], "route-a");
        assert_eq!(r["status"], "completed");
        assert_eq!(r["instructions"], "I");
        assert_eq!(r["output"][0]["content"][0]["text"], "Hi!");
        assert_eq!(r["output"][1]["type"], "function_call");
        assert_eq!(r["output"][1]["call_id"], "call_9");
        assert_eq!(r["usage"]["input_tokens"], 5);
        assert_eq!(r["usage"]["total_tokens"], 7);
        assert_eq!(
            usage_of(&r),
            Some(Usage {
                prompt: 5,
                completion: 2
            })
        );
        let cut = json!({"choices": [{"message": {"content": "Hi"}, "finish_reason": "length"}]});
        let r = from_chat(&cut, &meta);
        assert_eq!(
            (
                r["status"].as_str(),
                r["incomplete_details"]["reason"].as_str()
            ),
            (Some("incomplete"), Some("max_output_tokens"))
        );
    }

    /// The events of a translated stream, parsed back.
    fn events(s: &str) -> Vec<Value> {
        s.split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[test]
    fn a_chat_stream_becomes_the_responses_event_sequence() {
        let meta = Meta::new("resp_gw", "m", &Map::new());
        let mut tr = ChatToEvents::new(meta);
        let mut all = String::new();
        for c in [
            json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            json!({"choices": [{"delta": {"content": "Hel"}}]}),
            json!({"choices": [{"delta": {"content": "lo"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        ] {
            all.push_str(&tr.chunk(&c));
        }
        all.push_str(&tr.finish());
        let evs = events(&all);
        let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = evs
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(
            seqs,
            (0..seqs.len() as u64).collect::<Vec<_>>(),
            "rising from 0"
        );
        let done = evs.last().unwrap();
        assert_eq!(done["response"]["id"], "resp_gw");
        assert_eq!(done["response"]["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["response"]["output"][1]["arguments"], "{}");
        assert_eq!(done["response"]["usage"]["output_tokens"], 4);
        // The commit rule reads them: created and in_progress are held, a delta commits.
        assert_eq!(classify_event(&evs[0]), ChunkKind::Preamble);
        assert_eq!(classify_event(&evs[3]), ChunkKind::Preamble);
        assert_eq!(classify_event(&evs[4]), ChunkKind::Content);
        assert_eq!(classify_event(&evs[7]), ChunkKind::Content);
        assert!(is_terminal(done));
        // A chat error chunk is an `error` event, which fails over before the commit.
        let mut tr = ChatToEvents::new(Meta::new("r", "m", &Map::new()));
        let evs = events(&tr.chunk(&json!({"error": {"message": "quota"}})));
        assert_eq!(classify_event(&evs[0]), ChunkKind::Error("quota".into()));
        assert_eq!(tr.finish(), "", "nothing after the error");
    }

    #[test]
    fn failure_events_fail_over_and_deltas_commit() {
        assert_eq!(
            classify_event(
                &json!({"type": "response.failed", "response": {"error": {"message": "quota"}}})
            ),
            ChunkKind::Error("quota".into())
        );
        assert_eq!(
            classify_event(&json!({"type": "error", "message": "boom"})),
            ChunkKind::Error("boom".into())
        );
        assert_eq!(
            classify_event(&json!({"type": "response.output_text.delta", "delta": ""})),
            ChunkKind::Preamble
        );
        assert_eq!(
            classify_event(&json!({"type": "response.reasoning_text.delta", "delta": "hm"})),
            ChunkKind::Content
        );
        assert_eq!(
            failed(&json!({"status": "failed", "error": {"message": "x"}})),
            Some("x".into())
        );
        assert_eq!(failed(&json!({"status": "completed", "error": null})), None);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// JSON with the Responses API's keys in arbitrary places and shapes.
        fn values() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                (-1e6f64..1e6).prop_map(Value::from),
                "[a-z_.é😀]{0,10}".prop_map(Value::String),
                prop::sample::select(vec![
                    "message",
                    "function_call",
                    "function_call_output",
                    "input_text",
                    "input_image",
                    "output_text",
                    "function",
                    "user",
                    "assistant",
                    "developer",
                    "json_schema",
                    "response.completed",
                    "response.failed",
                    "error",
                    "response.output_text.delta",
                ])
                .prop_map(|s| Value::String(s.into())),
            ];
            leaf.prop_recursive(4, 40, 6, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    proptest::collection::vec(
                        (
                            prop::sample::select(vec![
                                "type",
                                "role",
                                "content",
                                "input",
                                "instructions",
                                "tools",
                                "tool_choice",
                                "text",
                                "format",
                                "name",
                                "arguments",
                                "call_id",
                                "output",
                                "image_url",
                                "choices",
                                "delta",
                                "tool_calls",
                                "index",
                                "function",
                                "usage",
                                "error",
                                "message",
                                "response",
                                "sequence_number",
                                "finish_reason",
                                "max_output_tokens",
                                "previous_response_id",
                                "background",
                                "x",
                            ]),
                            inner
                        ),
                        0..6
                    )
                    .prop_map(|kv| Value::Object(
                        kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
                    )),
                ]
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Arbitrary requests, answers and chunks give a value or an error, never a panic.
            #[test]
            fn arbitrary_input_never_panics(v in values(), w in values()) {
                let body = match &v { Value::Object(m) => m.clone(), _ => Map::new() };
                let mut needs = BTreeSet::new();
                let _ = inspect(&body, &mut needs);
                let _ = to_chat(&body);
                let _ = input_items(&body);
                let meta = Meta::new("resp_x", "m", &body);
                let r = from_chat(&w, &meta);
                prop_assert_eq!(r["id"].as_str(), Some("resp_x"));
                let _ = (classify_event(&w), usage_of(&w), failed(&w), output_chars(&w), delta_chars(&w), is_terminal(&w));
                let mut tr = ChatToEvents::new(meta);
                let out = tr.chunk(&w) + &tr.chunk(&v) + &tr.finish();
                // Whatever came in, what goes out is events whose data is JSON.
                for ev in out.split("\n\n").filter(|e| !e.is_empty()) {
                    let data = ev.lines().find_map(|l| l.strip_prefix("data: "));
                    prop_assert!(data.is_some_and(|d| serde_json::from_str::<Value>(d).is_ok()), "{}", ev);
                }
            }
        }
    }
}
