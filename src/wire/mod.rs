//! OpenAI wire format: validating what clients send, and reading what upstreams return (usage,
//! whether a stream chunk carries content, in-band errors). Bodies stay `serde_json` maps so
//! unknown fields pass through to OpenAI-type upstreams untouched.

pub mod answer;
pub mod chunk;
pub mod hygiene;
pub mod patch;
pub mod request;
pub mod responses;
pub mod scan;
pub mod sse;
pub mod trace;

use std::collections::BTreeSet;
use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::config::Capability;
use crate::error::ApiError;

pub use crate::op::Op;

/// Header names the gateway sets on every request and response, parsed at compile time (a
/// `&str` name is parsed and validated again on every insert).
pub mod names {
    use http::HeaderName;
    pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
    pub const X_AUTOHEDGE_ENDPOINT: HeaderName = HeaderName::from_static("x-autohedge-endpoint");
    pub const X_AUTOHEDGE_ATTEMPTS: HeaderName = HeaderName::from_static("x-autohedge-attempts");
    pub const X_AUTOHEDGE_HEDGED: HeaderName = HeaderName::from_static("x-autohedge-hedged");
    pub const X_AUTOHEDGE_SERVED_FROM: HeaderName =
        HeaderName::from_static("x-autohedge-served-from");
    pub const X_AUTOHEDGE_TRUNCATED: HeaderName = HeaderName::from_static("x-autohedge-truncated");
}

/// A validated client request.
#[derive(Clone, Debug)]
pub struct Inbound {
    pub op: Op,
    pub model: String,
    pub stream: bool,
    /// The body as a map when it was given so or changed: parsed with the request when
    /// [`request::read`] declined it, made by the gateway, or taken over by `body_mut`.
    body: Option<Map<String, Value>>,
    /// Else the map parsed from `raw` on first use (a plain request to an OpenAI-type endpoint
    /// never needs it).
    parsed: OnceLock<Map<String, Value>>,
    /// The client's bytes that `body` was parsed from, while `body` is unchanged: an
    /// OpenAI-type upstream then gets them with `model` patched ([`patch`]) rather than `body`
    /// serialised again. Dropped by [`Inbound::body_mut`].
    raw: Option<Bytes>,
    /// What [`request::read`] found in `raw`, while `raw` is kept.
    plain: Option<request::Plain>,
    pub needs: BTreeSet<Capability>,
}

impl Inbound {
    /// A request the gateway makes up itself (a stream's continuation): no client bytes.
    pub fn new(
        op: Op,
        model: String,
        stream: bool,
        body: Map<String, Value>,
        needs: BTreeSet<Capability>,
    ) -> Self {
        Inbound {
            op,
            model,
            stream,
            body: Some(body),
            parsed: OnceLock::new(),
            raw: None,
            plain: None,
            needs,
        }
    }

    /// Keeps `raw`, the bytes the body was parsed from, for [`Inbound::raw`].
    pub fn with_raw(mut self, raw: Bytes) -> Self {
        self.raw = Some(raw);
        self
    }

    pub fn body(&self) -> &Map<String, Value> {
        match &self.body {
            Some(map) => map,
            None => self.parsed.get_or_init(|| parse_raw(self.raw.as_deref())),
        }
    }

    /// The body to change; the client's bytes no longer say what it holds, so they are let go.
    pub fn body_mut(&mut self) -> &mut Map<String, Value> {
        let (parsed, raw) = (&mut self.parsed, self.raw.take());
        self.plain = None;
        self.body.get_or_insert_with(|| {
            std::mem::take(parsed)
                .into_inner()
                .unwrap_or_else(|| parse_raw(raw.as_deref()))
        })
    }

    /// The client's bytes, while they still say exactly what [`Inbound::body`] holds.
    pub fn raw(&self) -> Option<&[u8]> {
        self.raw.as_deref()
    }

    /// Where the top-level `model` value is in [`Inbound::raw`], when the request was read as
    /// plain (the bytes then qualify for [`patch::at`]).
    pub fn model_span(&self) -> Option<std::ops::Range<usize>> {
        self.plain.as_ref().map(|p| p.model_span.clone())
    }

    /// The characters of the prompt ([`prompt_chars`] of the body).
    /// At least as many tokens as any byte-level BPE counts for the prompt, from the scan of a
    /// plain request alone (no parse): the body's length bounds the bytes of every string in
    /// it, to which each message adds its framing (3, and 1 for a `name`) and the reply its
    /// priming (3). `None` when the body must be walked ([`crate::tokens::tiktoken_bound`]):
    /// not a plain request, or one with tool definitions.
    pub fn plain_token_bound(&self) -> Option<u64> {
        let plain = self.plain.as_ref()?;
        let raw = self.raw.as_ref()?.len() as u64;
        if plain.tools_key {
            return None;
        }
        Some(match self.op {
            Op::Chat => {
                use crate::tokens::{REPLY_PRIMING, TOKENS_PER_MESSAGE, TOKENS_PER_NAME};
                raw + (TOKENS_PER_MESSAGE + TOKENS_PER_NAME) * plain.messages as u64 + REPLY_PRIMING
            }
            Op::Completions | Op::Embeddings | Op::Responses => raw,
        })
    }

    pub fn prompt_chars(&self) -> usize {
        match &self.plain {
            Some(p) => p.prompt_chars,
            None => prompt_chars(self.body()),
        }
    }

    /// Whether `phrase` occurs (ASCII case aside) in any string or key of the request as decoded
    /// JSON: then an upstream's message that holds it may only be quoting the request back.
    pub fn quotes(&self, phrase: &str) -> bool {
        let needle = phrase.to_ascii_lowercase();
        if needle.is_empty() {
            return true;
        }
        fn any(v: &Value, needle: &str) -> bool {
            let has = |s: &str| s.to_ascii_lowercase().contains(needle);
            match v {
                Value::String(s) => has(s),
                Value::Array(a) => a.iter().any(|v| any(v, needle)),
                Value::Object(m) => m.iter().any(|(k, v)| has(k) || any(v, needle)),
                _ => false,
            }
        }
        self.body()
            .iter()
            .any(|(k, v)| k.to_ascii_lowercase().contains(&needle) || any(v, &needle))
    }

    /// The characters a token count reads: the prompt's ([`Inbound::prompt_chars`]) and the
    /// tools' (names, descriptions, JSON schemas). What decides whether counting runs on the
    /// blocking pool: a request whose size is all in its tools must not hold an async worker.
    pub fn tokenized_chars(&self) -> usize {
        let tools = if self.has_tools_key() {
            self.body().get("tools").map_or(0, schema_chars)
        } else {
            0
        };
        self.prompt_chars().saturating_add(tools)
    }

    /// The characters the upstream reads into the model's context, and bills as prompt: the
    /// prompt's ([`Inbound::prompt_chars`]) and every other field it tokenizes — `tools` (and
    /// the legacy `functions`: names, descriptions, JSON schemas), `response_format`, and the
    /// Responses API's `text.format` — with keys. What a key's `tpm` and budget are asked for.
    pub fn billed_chars(&self) -> usize {
        let prompt = self.prompt_chars();
        // A plain request's top-level keys have no escapes: when its bytes name none of these
        // fields, it has none (the common request pays a scan of its bytes, not a parse).
        if self.plain.is_some()
            && !self.has_tools_key()
            && let Some(raw) = self.raw.as_deref()
            && memchr::memmem::find(raw, b"\"functions\"").is_none()
            && memchr::memmem::find(raw, b"\"response_format\"").is_none()
        {
            return prompt;
        }
        let b = self.body();
        let fields: usize = ["tools", "functions", "response_format"]
            .iter()
            .filter_map(|k| b.get(*k))
            .map(schema_chars)
            .sum();
        let text_format = b
            .get("text")
            .and_then(|t| t.get("format"))
            .map_or(0, schema_chars);
        prompt.saturating_add(fields).saturating_add(text_format)
    }

    /// Whether the body has a `tools` key.
    pub fn has_tools_key(&self) -> bool {
        match &self.plain {
            Some(p) => p.tools_key,
            None => self.body().contains_key("tools"),
        }
    }

    /// A token limit field (`max_tokens` or `max_completion_tokens`): `None` when absent, else
    /// its value as `Value::as_u64` reads it.
    pub fn token_field(&self, field: TokenField) -> Option<Option<u64>> {
        match (&self.plain, field) {
            (Some(p), TokenField::MaxTokens) => p.max_tokens,
            (Some(p), TokenField::MaxCompletionTokens) => p.max_completion_tokens,
            // The Responses API's one limit, `max_output_tokens`, reads as `max_tokens`.
            (None, TokenField::MaxTokens) if self.op == Op::Responses => {
                self.body().get("max_output_tokens").map(Value::as_u64)
            }
            (None, TokenField::MaxCompletionTokens) if self.op == Op::Responses => None,
            (None, f) => self.body().get(f.key()).map(Value::as_u64),
        }
    }
}

/// The map of a request read as plain, from its bytes. `request::read` answers only for bytes
/// that parse (its differential test): an empty map here would be a bug, logged, never a panic.
fn parse_raw(raw: Option<&[u8]>) -> Map<String, Value> {
    match raw.map(serde_json::from_slice) {
        Some(Ok(map)) => map,
        _ => {
            tracing::error!("a request read as plain did not parse as a map");
            Map::new()
        }
    }
}

/// The two fields a request limits its completion with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenField {
    MaxTokens,
    MaxCompletionTokens,
}

impl TokenField {
    pub const ALL: [TokenField; 2] = [TokenField::MaxTokens, TokenField::MaxCompletionTokens];

    pub fn key(self) -> &'static str {
        match self {
            TokenField::MaxTokens => "max_tokens",
            TokenField::MaxCompletionTokens => "max_completion_tokens",
        }
    }
}

/// Reads and validates a client's JSON body: a plain request in one pass ([`request::read`]),
/// anything else parsed into a `Value` and [`inspect`]ed, with the same answer either way.
pub fn read_request(op: Op, raw: Bytes) -> Result<Inbound, ApiError> {
    let text = std::str::from_utf8(&raw).map_err(|e| ApiError::InvalidRequest {
        message: format!(
            "The request body is not valid UTF-8 (at byte {}).",
            e.valid_up_to()
        ),
        param: None,
        code: Some("invalid_utf8"),
    })?;
    if let Some(mut plain) = request::read(op, text) {
        let mut needs = BTreeSet::from([Capability::of(op)]);
        if plain.tools {
            needs.insert(Capability::Tools);
        }
        return Ok(Inbound {
            op,
            model: std::mem::take(&mut plain.model),
            stream: plain.stream,
            body: None,
            parsed: OnceLock::new(),
            raw: Some(raw),
            plain: Some(plain),
            needs,
        });
    }
    let value = serde_json::from_str(text).map_err(|e| ApiError::InvalidRequest {
        message: format!(
            "We could not parse the JSON body of your request: {e}. (The OpenAI API expects a JSON payload.)"
        ),
        param: None,
        code: Some("invalid_json"),
    })?;
    inspect(op, value).map(|i| i.with_raw(raw))
}

/// Validates a parsed body the way OpenAI does, so clients get the same 400s.
pub fn inspect(op: Op, value: Value) -> Result<Inbound, ApiError> {
    let Value::Object(body) = value else {
        return Err(ApiError::invalid("The request body must be a JSON object."));
    };
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(ApiError::InvalidRequest {
                message: "you must provide a model parameter".into(),
                param: Some("model"),
                code: None,
            });
        }
        Some(_) => {
            return Err(ApiError::InvalidRequest {
                message: "'model' must be a string".into(),
                param: Some("model"),
                code: Some("invalid_type"),
            });
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::InvalidRequest {
                message: "'stream' must be a boolean".into(),
                param: Some("stream"),
                code: Some("invalid_type"),
            });
        }
    };
    let mut needs = BTreeSet::from([Capability::of(op)]);
    match op {
        Op::Chat => {
            match body.get("messages") {
                Some(Value::Array(m)) if !m.is_empty() => {
                    for (i, msg) in m.iter().enumerate() {
                        let Some(obj) = msg.as_object() else {
                            return Err(ApiError::InvalidRequest {
                                message: format!("messages[{i}] must be an object"),
                                param: Some("messages"),
                                code: Some("invalid_type"),
                            });
                        };
                        if !obj.get("role").is_some_and(Value::is_string) {
                            return Err(ApiError::InvalidRequest {
                                message: format!(
                                    "messages[{i}].role is required and must be a string"
                                ),
                                param: Some("messages"),
                                code: None,
                            });
                        }
                        if let Some(Value::Array(parts)) = obj.get("content")
                            && parts.iter().any(|p| {
                                matches!(
                                    p.get("type").and_then(Value::as_str),
                                    Some("image_url" | "input_image" | "image")
                                )
                            })
                        {
                            needs.insert(Capability::Vision);
                        }
                    }
                }
                Some(Value::Array(_)) => {
                    return Err(ApiError::InvalidRequest {
                        message:
                            "'messages' must contain at least one message (got an empty array)"
                                .into(),
                        param: Some("messages"),
                        code: Some("empty_array"),
                    });
                }
                Some(_) => {
                    return Err(ApiError::InvalidRequest {
                        message: "'messages' must be an array".into(),
                        param: Some("messages"),
                        code: Some("invalid_type"),
                    });
                }
                None => {
                    return Err(ApiError::InvalidRequest {
                        message: "Missing required parameter: 'messages'.".into(),
                        param: Some("messages"),
                        code: Some("missing_required_parameter"),
                    });
                }
            }
            if matches!(body.get("tools"), Some(Value::Array(t)) if !t.is_empty())
                || matches!(body.get("functions"), Some(Value::Array(t)) if !t.is_empty())
            {
                needs.insert(Capability::Tools);
            }
        }
        Op::Completions => {
            if body.get("prompt").is_none_or(Value::is_null) {
                return Err(ApiError::InvalidRequest {
                    message: "Missing required parameter: 'prompt'.".into(),
                    param: Some("prompt"),
                    code: Some("missing_required_parameter"),
                });
            }
        }
        Op::Responses => responses::inspect(&body, &mut needs)?,
        Op::Embeddings => {
            let ok = match body.get("input") {
                Some(Value::String(_)) => true,
                Some(Value::Array(a)) => !a.is_empty(),
                _ => false,
            };
            if !ok {
                return Err(ApiError::InvalidRequest {
                    message: "'input' must be a non-empty string or array".into(),
                    param: Some("input"),
                    code: Some("missing_required_parameter"),
                });
            }
        }
    }
    Ok(Inbound::new(
        op,
        model,
        stream && op != Op::Embeddings,
        body,
        needs,
    ))
}

/// Token usage read from a response or final stream chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
}

/// A stream chunk's or a translated answer's `usage`, when it is an object (as
/// [`answer::read`] reads a full answer's).
pub fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    Some(Usage {
        prompt: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
        completion: u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    })
}

/// What a stream chunk's JSON means for the commit decision.
#[derive(Debug, PartialEq, Eq)]
pub enum ChunkKind {
    /// Carries content (text, tool calls, refusal, reasoning) or a finish reason: commit.
    Content,
    /// Role-only or empty delta: buffer and keep waiting.
    Preamble,
    /// An in-band error object.
    Error(String),
}

pub fn classify_chunk(v: &Value) -> ChunkKind {
    // `"error": null` is no error: some compatible servers send it on every success.
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| err.as_str().map(str::to_string))
            .unwrap_or_else(|| err.to_string());
        return ChunkKind::Error(msg);
    }
    if v.get("object").and_then(Value::as_str) == Some("error") {
        let msg = v
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("upstream error event")
            .to_string();
        return ChunkKind::Error(msg);
    }
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        // A usage-only chunk (stream_options.include_usage) is content-neutral.
        return ChunkKind::Preamble;
    };
    for c in choices {
        if c.get("finish_reason").is_some_and(|f| !f.is_null()) {
            return ChunkKind::Content;
        }
        // Legacy completions stream `text`.
        if c.get("text")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
        {
            return ChunkKind::Content;
        }
        if let Some(d) = c.get("delta") {
            for key in ["content", "refusal", "reasoning_content", "reasoning"] {
                if d.get(key)
                    .and_then(Value::as_str)
                    .is_some_and(|t| !t.is_empty())
                {
                    return ChunkKind::Content;
                }
            }
            if d.get("tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty())
                || d.get("function_call").is_some_and(|f| !f.is_null())
            {
                return ChunkKind::Content;
            }
        }
    }
    ChunkKind::Preamble
}

/// A rough token estimate for bodies whose upstream reported no usage: four characters a token,
/// OpenAI's own rule of thumb for English. Marked as estimated wherever it is stored.
pub fn estimate_tokens(text_len: usize) -> u64 {
    (text_len as u64).div_ceil(4)
}

/// The characters of a schema-like value (tools, response formats): its keys and strings, and
/// one a scalar.
fn schema_chars(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().map(schema_chars).sum(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() + schema_chars(v)).sum(),
        _ => 1,
    }
}

/// A number in a prompt is a token id (`"prompt": [1, 2, …]`, lists of them, `input` of ids):
/// one token, counted as the characters [`estimate_tokens`] makes one of.
pub const TOKEN_ID_CHARS: usize = 4;

/// The characters of message contents and prompt, for estimating prompt tokens (a token id
/// counts as [`TOKEN_ID_CHARS`]).
pub fn prompt_chars(body: &Map<String, Value>) -> usize {
    fn walk(v: &Value) -> usize {
        match v {
            Value::String(s) => s.len(),
            Value::Number(_) => TOKEN_ID_CHARS,
            Value::Array(a) => a.iter().map(walk).sum(),
            Value::Object(o) => o
                .iter()
                .filter(|(k, _)| k.as_str() != "image_url")
                .map(|(_, v)| walk(v))
                .sum(),
            _ => 0,
        }
    }
    ["messages", "prompt", "input", "instructions"]
        .iter()
        .filter_map(|k| body.get(*k))
        .map(walk)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_size_that_decides_where_counting_runs_includes_the_tools() {
        let schema = "x".repeat(100_000);
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "description": schema,
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]});
        let raw = Bytes::from(serde_json::to_vec(&body).unwrap());
        let req = read_request(Op::Chat, raw).unwrap();
        assert!(req.prompt_chars() < 10);
        assert!(req.tokenized_chars() > 100_000, "{}", req.tokenized_chars());
        // Token ids count as tokens in the prompt's size.
        let ids = json!({"model": "m", "prompt": [[1, 2, 3], [4, 5]]});
        let req = read_request(Op::Completions, Bytes::from(ids.to_string())).unwrap();
        assert_eq!(estimate_tokens(req.prompt_chars()), 5);
    }

    /// What a key's limits are asked for counts every field the upstream tokenizes: the same
    /// 20 KB in a tool's description, a response format's schema or a message counts alike,
    /// on the plain path and the map path.
    #[test]
    fn the_billed_prompt_counts_tools_and_formats() {
        let text = "x".repeat(20_000);
        let msg = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (
                Op::Chat,
                json!({"model": "m", "messages": msg, "tools": [{"type": "function", "function": {"name": "f", "description": text}}]}),
            ),
            (
                Op::Chat,
                json!({"model": "m", "messages": msg, "functions": [{"name": "f", "description": text}]}),
            ),
            (
                Op::Chat,
                json!({"model": "m", "messages": msg, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"description": text}}}}),
            ),
            (
                Op::Responses,
                json!({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "schema": {"description": text}}}}),
            ),
            (
                Op::Responses,
                json!({"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "description": text}]}),
            ),
        ];
        for (op, body) in cases {
            let req = read_request(op, Bytes::from(body.to_string())).unwrap();
            assert!(req.prompt_chars() < 100, "{body}");
            assert!(
                req.billed_chars() > 20_000,
                "{}: {body}",
                req.billed_chars()
            );
        }
        // Nothing but the prompt: the same figure, on the plain path.
        let plain = json!({"model": "m", "messages": [{"role": "user", "content": text}]});
        let req = read_request(Op::Chat, Bytes::from(plain.to_string())).unwrap();
        assert_eq!(req.billed_chars(), req.prompt_chars());
        assert!(req.billed_chars() >= 20_000);
    }

    #[test]
    fn validates_like_openai() {
        assert!(inspect(Op::Chat, json!([])).is_err());
        assert!(
            inspect(
                Op::Chat,
                json!({"messages": [{"role":"user","content":"x"}]})
            )
            .is_err()
        );
        assert!(inspect(Op::Chat, json!({"model": 3, "messages": []})).is_err());
        assert!(inspect(Op::Chat, json!({"model": "m", "messages": []})).is_err());
        let ok = inspect(
            Op::Chat,
            json!({"model": "m", "stream": true, "messages": [{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}], "tools": [{"type":"function"}]}),
        )
        .unwrap();
        assert!(ok.stream);
        assert!(ok.needs.contains(&Capability::Vision));
        assert!(ok.needs.contains(&Capability::Tools));
        assert!(inspect(Op::Embeddings, json!({"model": "m", "input": []})).is_err());
        assert!(
            !inspect(
                Op::Embeddings,
                json!({"model": "m", "input": "x", "stream": true})
            )
            .unwrap()
            .stream
        );
    }

    #[test]
    fn chunk_kinds() {
        assert_eq!(
            classify_chunk(&json!({"choices":[{"delta":{"role":"assistant","content":""}}]})),
            ChunkKind::Preamble
        );
        assert_eq!(
            classify_chunk(&json!({"choices":[{"delta":{"content":"Hi"}}]})),
            ChunkKind::Content
        );
        assert_eq!(
            classify_chunk(&json!({"choices":[{"delta":{"tool_calls":[{"index":0}]}}]})),
            ChunkKind::Content
        );
        assert_eq!(
            classify_chunk(&json!({"error":{"message":"boom"}})),
            ChunkKind::Error("boom".into())
        );
        assert_eq!(
            classify_chunk(&json!({"object":"error","message":"vllm boom"})),
            ChunkKind::Error("vllm boom".into())
        );
        // Some compatible servers send `"error": null` beside a real answer.
        assert_eq!(
            classify_chunk(&json!({"error":null,"choices":[{"delta":{"content":"Hi"}}]})),
            ChunkKind::Content
        );
        assert_eq!(
            classify_chunk(&json!({"error":null,"choices":[]})),
            ChunkKind::Preamble
        );
    }

    #[test]
    fn usage_is_read_only_from_an_object() {
        assert_eq!(usage_of(&json!({"usage":null})), None);
        assert_eq!(usage_of(&json!({"usage":5})), None);
        assert_eq!(
            usage_of(&json!({"usage":{"prompt_tokens":2,"completion_tokens":-1}})),
            Some(Usage {
                prompt: 2,
                completion: 0
            })
        );
    }
}
