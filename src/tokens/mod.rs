//! Token counting, the way each backend counts: tiktoken (o200k_base for the gpt-4o/4.1/o-series
//! family, cl100k_base for gpt-4/3.5 and the embeddings models) with OpenAI's documented chat
//! overhead, tool-definition and image rules; a Hugging Face `tokenizer.json` for local models;
//! otherwise a documented estimate, marked as such. Tokenizers are loaded once and shared.

pub mod truncate;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use base64::Engine;
use serde_json::{Map, Value};
use tiktoken_rs::CoreBPE;

use crate::op::Op;

/// Per-message framing tokens in OpenAI chat models (`<|start|>role ... <|end|>`), from OpenAI's
/// cookbook "How to count tokens with tiktoken".
pub const TOKENS_PER_MESSAGE: u64 = 3;
/// A `name` field costs one more token.
pub const TOKENS_PER_NAME: u64 = 1;
/// Every reply is primed with `<|start|>assistant<|message|>`.
pub const REPLY_PRIMING: u64 = 3;

/// Characters per token for the estimate: OpenAI's rule of thumb for English text.
const CHARS_PER_TOKEN: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    O200k,
    Cl100k,
}

/// A counter, chosen per endpoint when the config loads.
#[derive(Clone)]
pub enum Counter {
    Tiktoken(Family),
    Hf {
        path: PathBuf,
        tok: Arc<tokenizers::Tokenizer>,
    },
    Estimate,
}

impl Counter {
    /// Builds what this counter needs now (a tiktoken encoder takes 250–350 ms to build and holds
    /// about 40 MB). Built lazily: only a prompt whose [`tiktoken_bound`] does not already fit
    /// its window needs the exact count, so a gateway whose prompts are small next to their
    /// windows never holds the tables.
    pub fn warm(&self) {
        if let Counter::Tiktoken(f) = self {
            let _ = bpe(*f);
        }
    }

    /// Whether counting now would not stall on building an encoder.
    pub fn ready(&self) -> bool {
        match self {
            Counter::Tiktoken(f) => BUILT[*f as usize].get().is_some(),
            _ => true,
        }
    }

    /// Whether [`tiktoken_bound`] bounds this counter's count (byte-level BPE).
    pub fn bounded_by_bytes(&self) -> bool {
        matches!(self, Counter::Tiktoken(_))
    }
}

/// Encoders built so far, by family (`Family as usize`).
static BUILT: [std::sync::OnceLock<&'static CoreBPE>; 2] =
    [std::sync::OnceLock::new(), std::sync::OnceLock::new()];

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.method())
    }
}

/// A count and how it was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Count {
    pub tokens: u64,
    pub exact: bool,
}

/// The tiktoken encoding of an OpenAI model id, if it is one.
pub fn family_for_model(model: &str) -> Option<Family> {
    let m = model.to_ascii_lowercase();
    let m = m.rsplit('/').next().unwrap_or(&m);
    const O200K: &[&str] = &[
        "gpt-4o",
        "gpt-4.1",
        "gpt-4.5",
        "gpt-5",
        "o1",
        "o3",
        "o4",
        "chatgpt-4o",
        "gpt-oss",
    ];
    const CL100K: &[&str] = &[
        "gpt-4",
        "gpt-3.5",
        "gpt-35",
        "text-embedding-3",
        "text-embedding-ada-002",
    ];
    if O200K.iter().any(|p| m.starts_with(p)) {
        Some(Family::O200k)
    } else if CL100K.iter().any(|p| m.starts_with(p)) {
        Some(Family::Cl100k)
    } else {
        None
    }
}

fn bpe(f: Family) -> &'static CoreBPE {
    BUILT[f as usize].get_or_init(|| match f {
        Family::O200k => tiktoken_rs::o200k_base_singleton(),
        Family::Cl100k => tiktoken_rs::cl100k_base_singleton(),
    })
}

/// Loaded tokenizer files, shared across endpoints and reloads; reloaded when the file changes.
/// A loaded tokenizer and the file time it was loaded at.
type Loaded = (Option<std::time::SystemTime>, Arc<tokenizers::Tokenizer>);

static HF: LazyLock<Mutex<HashMap<PathBuf, Loaded>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Loads (or reuses) a `tokenizer.json`. No network: a path only.
pub fn load_hf(path: &Path) -> Result<Arc<tokenizers::Tokenizer>, String> {
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut cache = HF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((t, tok)) = cache.get(path)
        && *t == mtime
    {
        return Ok(tok.clone());
    }
    let tok = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| format!("cannot load tokenizer {}: {e}", path.display()))?;
    let tok = Arc::new(tok);
    cache.insert(path.to_path_buf(), (mtime, tok.clone()));
    Ok(tok)
}

impl Counter {
    pub fn method(&self) -> String {
        match self {
            Counter::Tiktoken(Family::O200k) => "tiktoken o200k_base".into(),
            Counter::Tiktoken(Family::Cl100k) => "tiktoken cl100k_base".into(),
            Counter::Hf { path, .. } => format!("tokenizer {}", path.display()),
            Counter::Estimate => format!("estimate ({CHARS_PER_TOKEN} characters a token)"),
        }
    }

    pub fn is_exact(&self) -> bool {
        !matches!(self, Counter::Estimate)
    }

    /// Tokens of a plain text.
    pub fn text(&self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        match self {
            Counter::Tiktoken(f) => bpe(*f).encode_ordinary(text).len() as u64,
            Counter::Hf { tok, .. } => tok
                .encode(text, false)
                .map(|e| e.len() as u64)
                .unwrap_or_else(|_| estimate(text)),
            Counter::Estimate => estimate(text),
        }
    }

    /// Tokens of one chat message, framing included (but not the reply priming).
    pub fn message(&self, m: &Value) -> u64 {
        Measure::Tokens(self).message(m)
    }

    /// Tool definitions, by the rule in OpenAI's cookbook (`num_tokens_for_tools`).
    pub fn tools(&self, tools: &[Value]) -> u64 {
        Measure::Tokens(self).tools(tools)
    }

    /// Prompt tokens of a request body.
    pub fn request(&self, op: Op, body: &Map<String, Value>) -> Count {
        Count {
            tokens: Measure::Tokens(self).request(op, body),
            exact: self.is_exact(),
        }
    }
}

/// At least as many tokens as any tiktoken encoding counts for this request body, without
/// encoding it: byte-level BPE gives every token at least one byte of the text, so a text's
/// UTF-8 length bounds its tokens, and the framing, tool and image rules are the counter's own
/// (with the larger of the two families' constants). A walk over the body, no BPE work: when
/// this already fits a window, the exact count cannot change the verdict.
pub fn tiktoken_bound(op: Op, body: &Map<String, Value>) -> u64 {
    Measure::Bytes.request(op, body)
}

/// What a text costs while walking a request: tokens as a counter counts them, or UTF-8 bytes
/// (the bound on any byte-level BPE's count).
enum Measure<'a> {
    Tokens(&'a Counter),
    Bytes,
}

impl Measure<'_> {
    fn text(&self, text: &str) -> u64 {
        match self {
            Measure::Tokens(c) => c.text(text),
            Measure::Bytes => text.len() as u64,
        }
    }

    /// The cost of the parts joined with `:` (how the cookbook counts a tool's fields).
    fn joined(&self, parts: &[&str]) -> u64 {
        match self {
            Measure::Tokens(c) => c.text(&parts.join(":")),
            Measure::Bytes => parts.iter().map(|p| p.len() as u64 + 1).sum(),
        }
    }

    /// Tokens of one chat message, framing included (but not the reply priming).
    fn message(&self, m: &Value) -> u64 {
        let mut n = TOKENS_PER_MESSAGE;
        let Some(obj) = m.as_object() else {
            return n;
        };
        for (k, v) in obj {
            match (k.as_str(), v) {
                ("content", Value::Array(parts)) => {
                    for p in parts {
                        n += self.part(p);
                    }
                }
                ("tool_calls", Value::Array(calls)) => {
                    for c in calls {
                        for key in ["name", "arguments"] {
                            if let Some(s) = c
                                .pointer(&format!("/function/{key}"))
                                .and_then(Value::as_str)
                            {
                                n += self.text(s);
                            }
                        }
                    }
                }
                (_, Value::String(s)) => {
                    n += self.text(s);
                    if k == "name" {
                        n += TOKENS_PER_NAME;
                    }
                }
                _ => {}
            }
        }
        n
    }

    fn part(&self, p: &Value) -> u64 {
        match p.get("type").and_then(Value::as_str) {
            Some("text" | "input_text" | "output_text") => {
                self.text(p.get("text").and_then(Value::as_str).unwrap_or(""))
            }
            Some("refusal") => self.text(p.get("refusal").and_then(Value::as_str).unwrap_or("")),
            Some("image_url") => image_tokens(p),
            // The Responses API's image part: its URL is a string, its detail beside it.
            Some("input_image") => image_tokens(&serde_json::json!({"image_url": {
                "url": p.get("image_url").and_then(Value::as_str).unwrap_or(""),
                "detail": p.get("detail").and_then(Value::as_str).unwrap_or("auto"),
            }})),
            _ => 0,
        }
    }

    /// Tool definitions, by the rule in OpenAI's cookbook (`num_tokens_for_tools`).
    fn tools(&self, tools: &[Value]) -> u64 {
        if tools.is_empty() {
            return 0;
        }
        // gpt-4o/4o-mini constants for the o200k family; gpt-4/3.5 for cl100k.
        let (func_init, prop_init, prop_key, enum_init, enum_item, func_end): (
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
        ) = match self {
            // The bound takes the larger constants of the two families.
            Measure::Tokens(Counter::Tiktoken(Family::Cl100k)) | Measure::Bytes => {
                (10, 3, 3, -3, 3, 12)
            }
            _ => (7, 3, 3, -3, 3, 12),
        };
        let mut n: i64 = 0;
        for t in tools {
            let f = t.get("function").unwrap_or(t);
            n += func_init;
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            let desc = f.get("description").and_then(Value::as_str).unwrap_or("");
            let desc = desc.strip_suffix('.').unwrap_or(desc);
            n += self.joined(&[name, desc]) as i64;
            if let Some(props) = f
                .pointer("/parameters/properties")
                .and_then(Value::as_object)
                && !props.is_empty()
            {
                n += prop_init;
                for (key, p) in props {
                    n += prop_key;
                    if let Some(items) = p.get("enum").and_then(Value::as_array) {
                        n += enum_init;
                        for item in items {
                            n += enum_item;
                            n += self.text(item.as_str().unwrap_or(&item.to_string())) as i64;
                        }
                    }
                    let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                    let d = p.get("description").and_then(Value::as_str).unwrap_or("");
                    let d = d.strip_suffix('.').unwrap_or(d);
                    n += self.joined(&[key, ty, d]) as i64;
                }
            }
        }
        n += func_end;
        n.max(0) as u64
    }

    /// Prompt tokens of a request body.
    fn request(&self, op: Op, body: &Map<String, Value>) -> u64 {
        match op {
            Op::Chat => {
                let msgs = body.get("messages").and_then(Value::as_array);
                let mut n: u64 = msgs
                    .map(|m| m.iter().map(|m| self.message(m)).sum())
                    .unwrap_or(0);
                n += REPLY_PRIMING;
                if let Some(tools) = body.get("tools").and_then(Value::as_array) {
                    n += self.tools(tools);
                }
                n
            }
            Op::Responses => {
                // As its chat translation counts: `instructions` a message, `input` a user
                // message or items (each item counted as a message: its strings and parts), the
                // reply's priming and the tools (flat function definitions).
                let mut n = REPLY_PRIMING;
                if let Some(Value::String(s)) = body.get("instructions") {
                    n += TOKENS_PER_MESSAGE + self.text(s);
                }
                match body.get("input") {
                    Some(Value::String(s)) => n += TOKENS_PER_MESSAGE + self.text(s),
                    Some(Value::Array(items)) => {
                        n += items.iter().map(|m| self.message(m)).sum::<u64>();
                    }
                    _ => {}
                }
                if let Some(tools) = body.get("tools").and_then(Value::as_array) {
                    n += self.tools(tools);
                }
                n
            }
            Op::Completions | Op::Embeddings => {
                let key = if op == Op::Completions {
                    "prompt"
                } else {
                    "input"
                };
                match body.get(key) {
                    Some(Value::String(s)) => self.text(s),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| match v {
                            Value::String(s) => self.text(s),
                            // Token-id arrays are already tokens.
                            Value::Array(ids) => ids.len() as u64,
                            Value::Number(_) => 1,
                            _ => 0,
                        })
                        .sum(),
                    _ => 0,
                }
            }
        }
    }
}

pub fn estimate(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(CHARS_PER_TOKEN)
}

/// Image tokens by OpenAI's documented rule: `detail: low` is 85; otherwise the image is fitted
/// into 2048×2048, its shortest side scaled to 768, and each 512-pixel tile costs 170 plus 85.
/// Dimensions are read from PNG data URLs; other images count as 1024×1024 (765 tokens).
pub fn image_tokens(part: &Value) -> u64 {
    let detail = part
        .pointer("/image_url/detail")
        .and_then(Value::as_str)
        .unwrap_or("auto");
    if detail == "low" {
        return 85;
    }
    let url = part
        .pointer("/image_url/url")
        .and_then(Value::as_str)
        .unwrap_or("");
    let (w, h) = png_size(url).unwrap_or((1024, 1024));
    tiles_tokens(w, h)
}

pub fn tiles_tokens(w: u64, h: u64) -> u64 {
    let (mut w, mut h) = (w.max(1) as f64, h.max(1) as f64);
    if w > 2048.0 || h > 2048.0 {
        let s = 2048.0 / w.max(h);
        w *= s;
        h *= s;
    }
    let s = 768.0 / w.min(h);
    if s < 1.0 {
        w *= s;
        h *= s;
    }
    let tiles = (w / 512.0).ceil() as u64 * (h / 512.0).ceil() as u64;
    170 * tiles + 85
}

fn png_size(url: &str) -> Option<(u64, u64)> {
    let b64 = url.strip_prefix("data:image/png;base64,")?;
    // The IHDR chunk sits in the first 33 bytes: 44 base64 characters cover them.
    let head = base64::engine::general_purpose::STANDARD
        .decode(b64.get(..44)?)
        .ok()?;
    if head.get(..8)? != b"\x89PNG\r\n\x1a\n" {
        return None;
    }
    let w = u32::from_be_bytes(head.get(16..20)?.try_into().ok()?);
    let h = u32::from_be_bytes(head.get(20..24)?.try_into().ok()?);
    Some((w as u64, h as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn families() {
        assert_eq!(family_for_model("gpt-4o-mini"), Some(Family::O200k));
        assert_eq!(family_for_model("o3-mini"), Some(Family::O200k));
        assert_eq!(family_for_model("openai/gpt-4.1"), Some(Family::O200k));
        assert_eq!(family_for_model("gpt-4-turbo"), Some(Family::Cl100k));
        assert_eq!(family_for_model("gpt-3.5-turbo"), Some(Family::Cl100k));
        assert_eq!(family_for_model("qwen2.5:7b"), None);
    }

    #[test]
    fn cookbook_example_counts() {
        // OpenAI cookbook "How to count tokens with tiktoken": for this conversation the cookbook
        // prints 124 prompt tokens for gpt-4o / gpt-4o-mini (o200k_base) and 129 for gpt-4 /
        // gpt-3.5-turbo (cl100k_base), both from `num_tokens_from_messages` and from the API's
        // `usage.prompt_tokens`.
        let messages = json!([
            {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
            {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
            {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
            {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
            {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
            {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."},
        ]);
        let mut body = Map::new();
        body.insert("messages".into(), messages);
        assert_eq!(
            Counter::Tiktoken(Family::O200k)
                .request(Op::Chat, &body)
                .tokens,
            124
        );
        assert_eq!(
            Counter::Tiktoken(Family::Cl100k)
                .request(Op::Chat, &body)
                .tokens,
            129
        );
    }

    #[test]
    fn image_rule() {
        assert_eq!(tiles_tokens(1024, 1024), 765);
        assert_eq!(tiles_tokens(2048, 4096), 1105);
        assert_eq!(
            image_tokens(&json!({"type": "image_url", "image_url": {"url": "x", "detail": "low"}})),
            85
        );
        // A 1x1 PNG: one tile after scaling up is not done (only down), so 170 + 85.
        let png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";
        assert_eq!(png_size(png), Some((1, 1)));
        assert_eq!(
            image_tokens(&json!({"type": "image_url", "image_url": {"url": png}})),
            255
        );
    }

    /// Chat bodies with arbitrary text (any Unicode, whitespace runs, digits), names, parts,
    /// tool calls and tool definitions.
    fn chat_bodies() -> impl Strategy<Value = Map<String, Value>> {
        let text = prop_oneof![
            any::<String>(),
            "[ \\n\\ta-z0-9'.,!?éß日本語🙂]{0,80}",
            "( {1,5}|\\n|x{1,20}|1234567890){0,30}",
        ];
        let part = prop_oneof![
            text.clone()
                .prop_map(|t| json!({"type": "text", "text": t})),
            Just(
                json!({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}})
            ),
            Just(
                json!({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}})
            ),
        ];
        let message = prop_oneof![
            (text.clone(), proptest::option::of(text.clone())).prop_map(|(c, name)| {
                let mut m = json!({"role": "user", "content": c});
                if let Some(n) = name {
                    m["name"] = json!(n);
                }
                m
            }),
            proptest::collection::vec(part, 0..4)
                .prop_map(|p| json!({"role": "user", "content": p})),
            (text.clone(), text.clone()).prop_map(|(n, a)| json!({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}]})),
        ];
        let tool = (text.clone(), text.clone(), text.clone(), proptest::collection::vec(text, 0..3))
            .prop_map(|(name, desc, pdesc, items)| json!({"type": "function", "function": {
                "name": name, "description": desc,
                "parameters": {"type": "object", "properties": {"p": {"type": "string", "description": pdesc, "enum": items}}}}}));
        (
            proptest::collection::vec(message, 0..6),
            proptest::collection::vec(tool, 0..3),
        )
            .prop_map(|(messages, tools)| {
                let mut body = Map::new();
                body.insert("messages".into(), Value::Array(messages));
                if !tools.is_empty() {
                    body.insert("tools".into(), Value::Array(tools));
                }
                body
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// The byte bound is never below either family's exact count: a prompt it admits cannot
        /// be one the exact count would have refused.
        #[test]
        fn the_byte_bound_is_never_below_the_count(body in chat_bodies(), prompt in any::<String>()) {
            let bound = tiktoken_bound(Op::Chat, &body);
            for f in [Family::O200k, Family::Cl100k] {
                let exact = Counter::Tiktoken(f).request(Op::Chat, &body).tokens;
                prop_assert!(exact <= bound, "{f:?}: exact {exact} > bound {bound}");
            }
            let mut completion = Map::new();
            completion.insert("prompt".into(), json!([prompt, [1, 2, 3], 7]));
            let bound = tiktoken_bound(Op::Completions, &completion);
            for f in [Family::O200k, Family::Cl100k] {
                let exact = Counter::Tiktoken(f).request(Op::Completions, &completion).tokens;
                prop_assert!(exact <= bound, "{f:?}: exact {exact} > bound {bound}");
            }
        }
    }

    #[test]
    fn the_byte_bound_counts_bytes_and_the_framing() {
        // 11 bytes of text, 3 for the message, 3 to prime the reply; the exact count is 9.
        let body = json!({"messages": [{"role": "user", "content": "Hello there"}]});
        let body = body.as_object().unwrap();
        // "user" is counted too (a string field): 4 bytes.
        assert_eq!(tiktoken_bound(Op::Chat, body), 11 + 4 + 3 + 3);
        assert_eq!(
            Counter::Tiktoken(Family::O200k)
                .request(Op::Chat, body)
                .tokens,
            9
        );
        // Multi-byte text: bytes, not characters.
        let body = json!({"prompt": "日本語"});
        assert_eq!(
            tiktoken_bound(Op::Completions, body.as_object().unwrap()),
            9
        );
    }

    #[test]
    fn estimate_is_marked() {
        let c = Counter::Estimate;
        assert!(
            !c.request(
                Op::Completions,
                json!({"prompt": "abcdefgh"}).as_object().unwrap()
            )
            .exact
        );
        assert_eq!(c.text("abcdefgh"), 2);
    }
}
