//! Token counting, the way each backend counts: tiktoken (o200k_base for the gpt-4o/4.1/o-series
//! family, cl100k_base for gpt-4/3.5 and the embeddings models) with OpenAI's documented chat
//! overhead, tool-definition and image rules; a Hugging Face `tokenizer.json` for local models;
//! otherwise a documented estimate, marked as such. Tokenizers are loaded once and shared.
//!
//! The tiktoken encodings are counted by the `tiktoken` crate (a hand-written pre-tokenizer for
//! ASCII and CJK, a counting path that allocates nothing, its vocabularies compressed in the
//! binary: 5–40x faster than tiktoken-rs here and half its memory). Its general path, a regex
//! for the rest of Unicode, is as exact but can be 40x slower than tiktoken-rs on text full of
//! varied scripts and symbols (its lazy DFA thrashes): a text of many such characters is counted
//! by tiktoken-rs instead ([`Family`] counting), built the first time one arrives. Both give
//! Python tiktoken's counts (`tests/tokens`, and a property test between the two).

pub mod hf;
pub mod pool;
pub mod truncate;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use base64::Engine;
use serde_json::{Map, Value};
use tiktoken_rs::CoreBPE;

/// The most characters outside the fast pre-tokenizer's ranges (ASCII, Latin-1 and Extended-A,
/// CJK, fullwidth) a text may hold to be counted by the `tiktoken` crate: past it tiktoken-rs
/// counts it (see the module's note). A bound on their number, not their share: 7,000 varied
/// symbols in a row cost the fast crate 90 ms wherever they sit in a long prompt, 256 of them at
/// most a few milliseconds. Prose in a Latin script stays under it; text in another script, or
/// a crafted mix of symbols, goes over.
const SLOW_CHARS_MAX: usize = 256;
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
        tok: Arc<hf::HfTokenizer>,
    },
    Estimate,
}

impl Counter {
    /// Builds what this counter needs now (an encoder takes about 60 ms to build and holds
    /// about 13 MB: o200k). Built lazily: only a prompt whose [`tiktoken_bound`] does not already fit its
    /// window needs the exact count, so a gateway whose prompts are small next to their windows
    /// never holds the tables.
    pub fn warm(&self) {
        if let Counter::Tiktoken(f) = self {
            let _ = fast(*f);
        }
    }

    /// [`warm`](Self::warm) on the blocking pool, awaited: the first request that needs an
    /// encoder starts its one build, and those that come while it runs wait for that build
    /// without holding a thread each (a blocking thread each, blocked on the build, would let a
    /// burst of first requests start up to the blocking pool's 512 threads).
    pub async fn built(&self) {
        if let Counter::Tiktoken(f) = self {
            static BUILDS: [tokio::sync::OnceCell<()>; 2] = [
                tokio::sync::OnceCell::const_new(),
                tokio::sync::OnceCell::const_new(),
            ];
            let f = *f;
            built_once(&BUILDS[f as usize], move || {
                let _ = fast(f);
            })
            .await;
        }
    }

    /// Whether counting now would not stall on building an encoder.
    pub fn ready(&self) -> bool {
        match self {
            Counter::Tiktoken(f) => FAST[*f as usize].get().is_some(),
            _ => true,
        }
    }

    /// Whether [`tiktoken_bound`] bounds this counter's count (byte-level BPE).
    pub fn bounded_by_bytes(&self) -> bool {
        matches!(self, Counter::Tiktoken(_))
    }
}

/// Encoders built so far, by family (`Family as usize`): the `tiktoken` crate's, and
/// tiktoken-rs's for texts its general path is slow on.
static FAST: [std::sync::OnceLock<Option<&'static tiktoken::CoreBpe>>; 2] =
    [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
static BUILT: [std::sync::OnceLock<&'static CoreBPE>; 2] =
    [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
/// Whether tiktoken-rs's encoder of a family is being built (on a thread of its own).
static BUILDING: [std::sync::atomic::AtomicBool; 2] = [
    std::sync::atomic::AtomicBool::new(false),
    std::sync::atomic::AtomicBool::new(false),
];

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

/// Awaits `cell`'s one build: the first caller runs `build` on the blocking pool, and every
/// caller waits for it in `cell`'s queue, not on a thread. A caller dropped while its build runs
/// hands the wait to the next (the build itself goes on: `build` must be safe to run again, as
/// a `OnceLock`'s initialiser is); a build that panicked leaves `cell` empty, so the next caller
/// builds again on the blocking pool rather than on its async worker.
async fn built_once(cell: &tokio::sync::OnceCell<()>, build: impl FnOnce() + Send + 'static) {
    let _ = cell
        .get_or_try_init(|| async move { tokio::task::spawn_blocking(build).await })
        .await;
}

/// The `tiktoken` crate's encoder (`None` only if its vocabulary were missing from the build:
/// tiktoken-rs counts then).
fn fast(f: Family) -> Option<&'static tiktoken::CoreBpe> {
    *FAST[f as usize].get_or_init(|| {
        let name = match f {
            Family::O200k => "o200k_base",
            Family::Cl100k => "cl100k_base",
        };
        // Compiled in (the crate's `vocab-*` features). Our copy of the crate builds it without
        // a map of every token (vendor/tiktoken/PATCHES.md); what scratch it frees as it goes
        // (the decompressor's window) is returned at once, and the rest after.
        let e = crate::alloc::purging_at_once(|| tiktoken::get_encoding(name));
        crate::alloc::release_free_memory();
        e
    })
}

fn build_general(f: Family) -> &'static CoreBPE {
    BUILT[f as usize].get_or_init(|| match f {
        Family::O200k => tiktoken_rs::o200k_base_singleton(),
        Family::Cl100k => tiktoken_rs::cl100k_base_singleton(),
    })
}

/// tiktoken-rs's encoder, when built: the first text that needs it starts the build on a
/// thread of its own and is counted by the `tiktoken` crate meanwhile (exact, only slower),
/// so no small request waits on it; on a counting thread (a long prompt, where the crate's slow
/// path would cost most) the count waits for the build instead.
fn general(f: Family) -> Option<&'static CoreBPE> {
    use std::sync::atomic::Ordering;
    if let Some(b) = BUILT[f as usize].get() {
        return Some(b);
    }
    if pool::on_counting_thread() {
        return Some(build_general(f));
    }
    if !BUILDING[f as usize].swap(true, Ordering::AcqRel) {
        let spawned = std::thread::Builder::new()
            .name("autohedge-tiktoken".into())
            .spawn(move || {
                build_general(f);
            });
        if spawned.is_err() {
            BUILDING[f as usize].store(false, Ordering::Release);
        }
    }
    None
}

/// Whether `text` has more than [`SLOW_CHARS_MAX`] characters outside the fast pre-tokenizer's
/// ranges (ASCII, Han, kana, Hangul syllables, fullwidth forms, CJK and common typographic
/// punctuation) and Latin-1/Latin Extended-A.
#[cfg(test)]
fn mostly_slow(text: &str) -> bool {
    slow_chars(text, SLOW_CHARS_MAX) > SLOW_CHARS_MAX
}

/// How many of `text`'s characters are outside the fast ranges (`SLOW_CHARS_MAX`), counted no
/// further than one past `most`.
fn slow_chars(text: &str, most: usize) -> usize {
    if text.is_ascii() {
        return 0;
    }
    let mut slow = 0usize;
    for c in text.chars() {
        let c = c as u32;
        // Latin-1 and Latin Extended-A too: few characters, so the regex's states for them
        // stay few (French or German prose counts at the fast path's speed).
        let quick = c < 0x180
            || matches!(c, 0x3000..=0x30FF | 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xAC00..=0xD7A3 | 0xFF00..=0xFFEF | 0x2014 | 0x2018..=0x201D | 0x2025..=0x2026);
        slow += usize::from(!quick);
        if slow > most {
            break;
        }
    }
    slow
}

/// Runs `f` as one request's counting: the bound on characters outside the fast ranges
/// (`SLOW_CHARS_MAX`) is shared by every text `f` counts on this thread ([`Counter::request`],
/// and truncation's per-message counts), and the thread's scope is restored after, a panic
/// included.
pub fn scope<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0;
            SLOW_SEEN.with(|s| s.set(outer));
        }
    }
    let _restore = Restore(SLOW_SEEN.with(|s| s.replace(Some(0))));
    f()
}

/// Texts tiktoken-rs counted (the tests watch it).
static GENERAL_COUNTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// Characters outside the fast ranges seen so far in the request being counted on this
    /// thread ([`Counter::request`]; `None` outside one): the bound is the request's, so a
    /// request of many texts just under it each is counted by tiktoken-rs too.
    static SLOW_SEEN: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Tokens of `text` in family `f`, without special tokens (tiktoken's `encode_ordinary`).
fn count_bpe(f: Family, text: &str) -> u64 {
    let before = SLOW_SEEN.with(std::cell::Cell::get);
    let prior = before.unwrap_or(0);
    let seen = prior.saturating_add(slow_chars(text, SLOW_CHARS_MAX.saturating_sub(prior)));
    if before.is_some() {
        SLOW_SEEN.with(|s| s.set(Some(seen)));
    }
    if seen > SLOW_CHARS_MAX
        && let Some(b) = general(f)
    {
        GENERAL_COUNTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return b.encode_ordinary(text).len() as u64;
    }
    match fast(f) {
        Some(e) => e.count(text) as u64,
        None => build_general(f).encode_ordinary(text).len() as u64,
    }
}

/// Whether tiktoken-rs's encoder of `f` is built (the benches wait for it).
pub fn general_ready(f: Family) -> bool {
    BUILT[f as usize].get().is_some()
}

/// tiktoken-rs's count of `text` (the reference the tests compare with).
pub fn reference_count(f: Family, text: &str) -> u64 {
    let b = match f {
        Family::O200k => tiktoken_rs::o200k_base_singleton(),
        Family::Cl100k => tiktoken_rs::cl100k_base_singleton(),
    };
    b.encode_ordinary(text).len() as u64
}

/// The `tiktoken` crate's count of `text`, whatever its characters (for the tests and benches).
pub fn fast_count(f: Family, text: &str) -> u64 {
    fast(f).map_or_else(|| reference_count(f, text), |e| e.count(text) as u64)
}

/// Loaded tokenizer files, shared across endpoints and reloads; reloaded when the file changes.
/// A loaded tokenizer and the file time it was loaded at.
type Loaded = (Option<std::time::SystemTime>, Arc<hf::HfTokenizer>);

static HF: LazyLock<Mutex<HashMap<PathBuf, Loaded>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Loads (or reuses) a `tokenizer.json`. No network: a path only.
pub fn load_hf(path: &Path) -> Result<Arc<hf::HfTokenizer>, String> {
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut cache = HF.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((t, tok)) = cache.get(path)
        && *t == mtime
    {
        return Ok(tok.clone());
    }
    let tok = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| format!("cannot load tokenizer {}: {e}", path.display()))?;
    let tok = Arc::new(hf::HfTokenizer::new(tok));
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
            Counter::Tiktoken(f) => count_bpe(*f, text),
            Counter::Hf { tok, .. } => tok.count(text).unwrap_or_else(|_| estimate(text)),
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
        let tokens = scope(|| Measure::Tokens(self).request(op, body));
        Count {
            tokens,
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

    /// Text of the kinds that stress a pre-tokenizer: English words and contractions in any
    /// case, whitespace runs (spaces, tabs, CR/LF), digits, punctuation, CJK, emoji with joiners,
    /// combining marks, special-token look-alikes and any character at all.
    fn stressing_text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[A-Za-z]{1,12}",
            "(?i)(don't|I'M|they'll|we've|it's|you'RE|he'd)",
            "[ \t\r\n]{1,6}",
            "[0-9]{1,9}",
            "[!-/:-@\\[-`{-~]{1,4}",
            "[一-鿿ぁ-ゖァ-ヺ가-힣]{1,8}",
            "(🚀|👩‍👩‍👧‍👦|🇫🇷|é|e\u{301}|ß|Ω|Ж|ت|अ)",
            "(<\\|endoftext\\|>|<\\|im_start\\|>|<\\|fim_prefix\\|>)",
            any::<char>().prop_map(String::from),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        /// The fast counter gives tiktoken-rs's count, for both families, on any text.
        #[test]
        fn the_fast_counter_counts_as_tiktoken_rs(text in stressing_text()) {
            for f in [Family::O200k, Family::Cl100k] {
                prop_assert_eq!(fast_count(f, &text), reference_count(f, &text), "{:?} {:?}", f, text);
            }
        }
    }

    /// `alloc::purging_at_once` (here, beside the encoders' builds it runs): freed memory goes
    /// back at once while a burst runs (nested too), and the delay is put back after it, even
    /// when the burst panics.
    #[test]
    fn the_purge_delay_is_zero_during_a_burst_and_restored_after() {
        use crate::alloc::{purge_delay, purging_at_once};
        // The one other caller builds the encoders: have them built (waiting for a build another
        // test started) so that no burst of theirs overlaps this test's.
        for f in [Family::O200k, Family::Cl100k] {
            Counter::Tiktoken(f).warm();
        }
        let before = purge_delay();
        assert_ne!(before, 0, "mimalloc delays purging by default");
        let inner = purging_at_once(|| {
            assert_eq!(purge_delay(), 0);
            purging_at_once(purge_delay)
        });
        assert_eq!(inner, 0, "nested: still at once");
        assert_eq!(purge_delay(), before);
        let panicked = std::panic::catch_unwind(|| purging_at_once(|| panic!("a failed build")));
        assert!(panicked.is_err());
        assert_eq!(purge_delay(), before, "restored after a panic");
    }

    /// Requests that need an encoder while it is built wait for the one build, on no thread
    /// of their own: one blocking task runs however many wait, none goes on before the build
    /// ends, and a build that panicked is run again by the next caller.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_during_a_build_wait_for_it_without_a_thread_each() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        static CELL: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        // Blocking tasks started (a thread each), and builds finished.
        static ENTERED: AtomicUsize = AtomicUsize::new(0);
        static DONE: AtomicBool = AtomicBool::new(false);
        let build = || {
            ENTERED.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(200));
            DONE.store(true, Ordering::SeqCst);
        };
        let callers: Vec<_> = (0..100)
            .map(|_| {
                tokio::spawn(async move {
                    built_once(&CELL, build).await;
                    DONE.load(Ordering::SeqCst)
                })
            })
            .collect();
        for c in callers {
            assert!(c.await.unwrap(), "a caller went on before the build ended");
        }
        assert_eq!(
            ENTERED.load(Ordering::SeqCst),
            1,
            "one blocking task, not one a caller"
        );

        // A build that panics leaves the cell empty: the next caller builds again.
        static RETRY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        static TRIES: AtomicUsize = AtomicUsize::new(0);
        built_once(&RETRY, || {
            TRIES.fetch_add(1, Ordering::SeqCst);
            panic!("a failed build");
        })
        .await;
        assert!(RETRY.get().is_none(), "a panicked build is not a build");
        built_once(&RETRY, || {
            TRIES.fetch_add(1, Ordering::SeqCst);
        })
        .await;
        assert_eq!(TRIES.load(Ordering::SeqCst), 2);
        assert!(RETRY.get().is_some());
    }

    /// The fast crate's vocabulary (our copy builds it without a map: vendor/tiktoken) holds
    /// every token tiktoken-rs's does: each rank decodes to the same bytes, and each token's
    /// text encodes to the same ids (its own rank, where the pre-tokenizer keeps it whole), so
    /// the lookups find every token of every length class (1, 2, 3–8 bytes, longer).
    #[test]
    fn every_token_is_held_as_tiktoken_rs_holds_it() {
        for (f, regular) in [(Family::O200k, 199_998u32), (Family::Cl100k, 100_256)] {
            let ours = fast(f).expect("compiled in");
            let reference = match f {
                Family::O200k => tiktoken_rs::o200k_base_singleton(),
                Family::Cl100k => tiktoken_rs::cl100k_base_singleton(),
            };
            let (mut whole, mut long) = (0u32, 0u32);
            for rank in 0..regular {
                let bytes = reference.decode_bytes(&[rank]).expect("a regular rank");
                assert_eq!(ours.decode(&[rank]), bytes, "{f:?} rank {rank}");
                let Ok(text) = std::str::from_utf8(&bytes) else {
                    continue;
                };
                let ids = ours.encode(text);
                assert_eq!(ids, reference.encode_ordinary(text), "{f:?} {text:?}");
                if ids == [rank] {
                    whole += 1;
                    long += u32::from(bytes.len() > 8);
                }
            }
            assert!(
                whole > regular / 2,
                "{f:?}: only {whole} tokens found whole"
            );
            assert!(long > 1_000, "{f:?}: only {long} long tokens found whole");
        }
    }

    /// Text with many characters outside the fast pre-tokenizer goes to tiktoken-rs once it is
    /// built (and is counted the same either way); prose with accents stays on the fast path.
    #[test]
    fn varied_scripts_go_to_the_general_counter() {
        assert!(!mostly_slow("plain ASCII"));
        assert!(!mostly_slow("中文字符測試日本語のテキスト한국어"));
        assert!(!mostly_slow(
            "Le café est très bon, mais la crème brûlée est meilleure encore aujourd'hui."
        ));
        assert!(
            !mostly_slow("Привет, как дела? Всё хорошо."),
            "a few: the fast crate"
        );
        assert!(mostly_slow(&"Привет, как дела? Всё хорошо. ".repeat(20)));
        let mixed: String = (0x2000u32..0x2400).filter_map(char::from_u32).collect();
        assert!(mostly_slow(&mixed));
        // Built on a thread of its own: the first call finds it missing, later ones use it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while general(Family::Cl100k).is_none() {
            assert!(std::time::Instant::now() < deadline, "never built");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // A request's texts share the bound: many texts each under it still go over together.
        let few = "Привет, как дела? Всё хорошо.";
        let body: Map<String, Value> = serde_json::from_value(json!({
            "messages": (0..40).map(|_| json!({"role": "user", "content": few})).collect::<Vec<_>>()
        }))
        .unwrap();
        assert!(!mostly_slow(few));
        let used = GENERAL_COUNTS.load(std::sync::atomic::Ordering::Relaxed);
        let _ = Counter::Tiktoken(Family::Cl100k).request(Op::Chat, &body);
        assert!(GENERAL_COUNTS.load(std::sync::atomic::Ordering::Relaxed) > used);
        // Truncation's per-message counts share the bound the same way.
        let used = GENERAL_COUNTS.load(std::sync::atomic::Ordering::Relaxed);
        let messages = body["messages"].as_array().unwrap();
        let counter = Counter::Tiktoken(Family::Cl100k);
        scope(|| messages.iter().map(|m| counter.message(m)).sum::<u64>());
        assert!(GENERAL_COUNTS.load(std::sync::atomic::Ordering::Relaxed) > used);
        // A panic inside a scope restores the thread's (no scope) all the same.
        let _ = std::panic::catch_unwind(|| scope(|| panic!("a bad count")));
        assert_eq!(SLOW_SEEN.with(std::cell::Cell::get), None);
        assert_eq!(
            SLOW_SEEN.with(std::cell::Cell::get),
            None,
            "the request's scope ends"
        );
        let russian = "Привет, как дела? ".repeat(40);
        for t in [mixed.as_str(), russian.as_str()] {
            assert_eq!(
                Counter::Tiktoken(Family::Cl100k).text(t),
                reference_count(Family::Cl100k, t)
            );
            assert_eq!(
                fast_count(Family::Cl100k, t),
                reference_count(Family::Cl100k, t)
            );
        }
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
