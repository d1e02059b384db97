//! A plain client request read in one pass over its bytes, without building a `Value` tree:
//! the fields the request path needs when nothing changes the body on its way to an
//! OpenAI-type upstream (which then gets the client's bytes with `model` patched).
//!
//! [`read`] is an exact fast path or nothing: it answers only for bodies that a parse into
//! `serde_json::Value` followed by [`super::inspect`] would accept, with the same model, stream
//! flag and needs, and declines (`None`) everything else — every invalid body, so the `Value`
//! path gives the client its usual error, and every body it is not sure of: a top-level key
//! given twice or escaped or more than [`MAX_KEYS`] of them (as [`super::patch`] declines
//! them), a message key given twice or escaped, an object anywhere inside the messages, prompt
//! or input (a content part, which may need vision; a tool call), a `model` with escapes,
//! nesting deeper than 64 inside a value, a lone surrogate escape anywhere, or a number so large
//! that serde_json would refuse it as out of range. The differential property test below holds
//! it to the `Value` path; a mutation of each of those rules fails it.

use std::ops::Range;

use super::answer::{Bad, Scanner};
use crate::op::Op;

/// The most top-level keys read; more are declined (and so are for the model patch).
pub const MAX_KEYS: usize = 48;

/// What [`read`] found in a plain request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plain {
    pub model: String,
    /// `stream: true` (never for embeddings, as [`super::inspect`] has it).
    pub stream: bool,
    /// A non-empty `tools` or `functions` array in a chat request: it needs tool support.
    pub tools: bool,
    /// The body has a `tools` key (whatever its value).
    pub tools_key: bool,
    /// `max_tokens` and `max_completion_tokens`: `None` when absent, else the value as
    /// `Value::as_u64` reads it.
    pub max_tokens: Option<Option<u64>>,
    pub max_completion_tokens: Option<Option<u64>>,
    /// Where the top-level `model` value (its quotes included) is in the bytes.
    pub model_span: Range<usize>,
    /// The characters of `messages`, `prompt` and `input`, as [`super::prompt_chars`] counts
    /// them in the map.
    pub prompt_chars: usize,
    /// How many messages a chat request holds (0 for the other operations).
    pub messages: usize,
}

/// Reads `body` as a plain request for `op`; `None` declines it to the `Value` path.
pub fn read(op: Op, body: &str) -> Option<Plain> {
    if op == Op::Responses {
        // Read as a map: its input is items, and translation and pinning walk them anyway.
        return None;
    }
    let body = body.as_bytes();
    let mut s = Scanner {
        b: body,
        i: 0,
        escaped: false,
    };
    let plain = top(&mut s, op)?;
    s.ws();
    (s.i == body.len()).then_some(plain)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Model,
    Stream,
    Messages,
    Tools,
    Functions,
    MaxTokens,
    MaxCompletionTokens,
    Prompt,
    Input,
    Other,
}

fn key_of(name: &[u8]) -> Key {
    match name {
        b"model" => Key::Model,
        b"stream" => Key::Stream,
        b"messages" => Key::Messages,
        b"tools" => Key::Tools,
        b"functions" => Key::Functions,
        b"max_tokens" => Key::MaxTokens,
        b"max_completion_tokens" => Key::MaxCompletionTokens,
        b"prompt" => Key::Prompt,
        b"input" => Key::Input,
        _ => Key::Other,
    }
}

fn top(s: &mut Scanner<'_>, op: Op) -> Option<Plain> {
    let b = s.b;
    s.ws();
    if s.peek() != Some(b'{') || s.open_empty(b'}') {
        return None;
    }
    let mut keys = Keys::<MAX_KEYS>::new();
    let mut model = None;
    let mut stream = false;
    let mut messages = false;
    let mut tools = false;
    let mut tools_key = false;
    let mut prompt = false;
    let mut input = false;
    let mut max_tokens = None;
    let mut max_completion_tokens = None;
    let mut chars = 0;
    let mut message_count = 0;
    loop {
        let name = keys.next(s)?;
        let at = s.i;
        match key_of(name) {
            Key::Model => {
                s.eat(b'"', Bad::Value).ok()?;
                let end = s.string().ok()?;
                let m = std::str::from_utf8(&b[at + 1..end]).ok()?;
                if s.escaped || m.is_empty() {
                    return None;
                }
                model = Some((m.to_string(), at..s.i));
            }
            Key::Stream => {
                stream = match s.peek()? {
                    b't' => s.literal(b"true").map(|()| true).ok()?,
                    b'f' => s.literal(b"false").map(|()| false).ok()?,
                    b'n' => s.literal(b"null").map(|()| false).ok()?,
                    _ => return None,
                };
            }
            Key::Messages if op == Op::Chat => {
                let (c, n) = messages_of(s)?;
                chars += c;
                message_count = n;
                messages = true;
            }
            Key::Messages => chars += counted(s)?,
            Key::Tools | Key::Functions => {
                tools_key |= key_of(name) == Key::Tools;
                let non_empty_array = s.peek() == Some(b'[') && !is_empty_array(s);
                skip(s)?;
                tools |= non_empty_array && op == Op::Chat;
            }
            Key::MaxTokens | Key::MaxCompletionTokens => {
                skip(s)?;
                let v = Some(as_u64(&b[at..s.i]));
                if key_of(name) == Key::MaxTokens {
                    max_tokens = v;
                } else {
                    max_completion_tokens = v;
                }
            }
            Key::Prompt => {
                prompt = s.peek() != Some(b'n');
                chars += counted(s)?;
            }
            Key::Input => {
                input = match s.peek()? {
                    b'"' => true,
                    b'[' => !is_empty_array(s),
                    _ => false,
                };
                chars += counted(s)?;
            }
            _ => skip(s)?,
        }
        if !s.more_members().ok()? {
            break;
        }
    }
    let (model, model_span) = model?;
    let complete = match op {
        Op::Chat => messages,
        Op::Completions => prompt,
        Op::Embeddings => input,
        Op::Responses => false,
    };
    complete.then_some(Plain {
        model,
        stream: stream && op != Op::Embeddings,
        tools,
        tools_key,
        max_tokens,
        max_completion_tokens,
        model_span,
        prompt_chars: chars,
        messages: message_count,
    })
}

/// The keys of one object so far, for reading its next member's key: `None` (declined) when
/// the key has an escape, was given before, or is one more than `N`. [`super::patch`] reads the
/// top level with it too.
pub(super) struct Keys<'a, const N: usize> {
    seen: [&'a [u8]; N],
    n: usize,
}

impl<'a, const N: usize> Keys<'a, N> {
    pub(super) fn new() -> Self {
        Keys {
            seen: [&[]; N],
            n: 0,
        }
    }

    /// A member's key and its colon (and the whitespace after it), the cursor on its value.
    pub(super) fn next(&mut self, s: &mut Scanner<'a>) -> Option<&'a [u8]> {
        let b = s.b;
        s.eat(b'"', Bad::Key).ok()?;
        let start = s.i;
        let end = s.string().ok()?;
        let name = &b[start..end];
        if s.escaped || self.n == N || self.seen[..self.n].contains(&name) {
            return None;
        }
        self.seen[self.n] = name;
        self.n += 1;
        s.eat(b':', Bad::Colon).ok()?;
        s.ws();
        Some(name)
    }
}

/// Whether the array under the cursor is empty (`[` then only whitespace before `]`); the
/// cursor does not move.
fn is_empty_array(s: &Scanner<'_>) -> bool {
    s.b[s.i + 1..]
        .iter()
        .find(|c| !matches!(c, b' ' | b'\n' | b'\t' | b'\r'))
        == Some(&b']')
}

/// A chat request's `messages`: a non-empty array of objects, each with a string `role` and its
/// keys given once, holding no object (a content part may need vision). Returns their
/// characters as [`super::prompt_chars`] counts them, and how many there are.
fn messages_of(s: &mut Scanner<'_>) -> Option<(usize, usize)> {
    if s.peek() != Some(b'[') || s.open_empty(b']') {
        return None;
    }
    let mut chars = 0;
    let mut n = 0;
    loop {
        s.ws();
        chars += message(s)?;
        n += 1;
        s.ws();
        match s.peek()? {
            b',' => s.i += 1,
            b']' => {
                s.i += 1;
                return Some((chars, n));
            }
            _ => return None,
        }
    }
}

/// The most keys of one message read; a message with more is declined.
const MAX_MESSAGE_KEYS: usize = 16;

fn message(s: &mut Scanner<'_>) -> Option<usize> {
    if s.peek() != Some(b'{') || s.open_empty(b'}') {
        return None;
    }
    let mut keys = Keys::<MAX_MESSAGE_KEYS>::new();
    let mut role = false;
    let mut chars = 0;
    loop {
        match keys.next(s)? {
            b"role" => {
                if s.peek() != Some(b'"') {
                    return None;
                }
                chars += counted(s)?;
                role = true;
            }
            // Not counted, as in the map.
            b"image_url" => skip(s)?,
            _ => chars += counted(s)?,
        }
        if !s.more_members().ok()? {
            return role.then_some(chars);
        }
    }
}

/// How deep [`skip`] follows a value's nesting before it declines.
const MAX_DEPTH: u32 = 64;

/// Skips one value of any kind, declining what a `Value` parse would not take (see the module
/// comment). Iterative: one bit a level in a word.
fn skip(s: &mut Scanner<'_>) -> Option<()> {
    // Bit k set: level k is an object; clear: an array.
    let mut stack: u64 = 0;
    let mut depth: u32 = 0;
    loop {
        s.ws();
        match s.peek()? {
            b'"' => {
                s.i += 1;
                string(s)?;
            }
            open @ (b'{' | b'[') => {
                let close = if open == b'{' { b'}' } else { b']' };
                if !s.open_empty(close) {
                    if depth == MAX_DEPTH {
                        return None;
                    }
                    stack = (stack & !(1 << depth)) | (u64::from(open == b'{') << depth);
                    depth += 1;
                    if open == b'{' {
                        key(s)?;
                    }
                    continue;
                }
            }
            b'-' | b'0'..=b'9' => number(s)?,
            b'n' => s.literal(b"null").ok()?,
            b't' => s.literal(b"true").ok()?,
            b'f' => s.literal(b"false").ok()?,
            _ => return None,
        }
        // After a value: close what it ends, or go on to the next element.
        loop {
            if depth == 0 {
                return Some(());
            }
            let in_object = stack & (1 << (depth - 1)) != 0;
            s.ws();
            match (s.peek()?, in_object) {
                (b',', true) => {
                    s.i += 1;
                    key(s)?;
                    break;
                }
                (b',', false) => {
                    s.i += 1;
                    break;
                }
                (b'}', true) | (b']', false) => {
                    s.i += 1;
                    depth -= 1;
                }
                _ => return None,
            }
        }
    }
}

/// Skips a value that [`super::prompt_chars`] counts, returning its characters: the bytes of
/// its strings (unescaped) and [`super::TOKEN_ID_CHARS`] a number, in arrays nested up to
/// [`MAX_DEPTH`]. An object inside is declined (its keys would have to be compared for repeats
/// and for `image_url`).
fn counted(s: &mut Scanner<'_>) -> Option<usize> {
    let mut chars = 0;
    let mut depth: u32 = 0;
    loop {
        s.ws();
        match s.peek()? {
            b'"' => {
                s.i += 1;
                let start = s.i;
                string(s)?;
                let raw = &s.b[start..s.i - 1];
                chars += if s.escaped {
                    unescaped_len(raw)
                } else {
                    raw.len()
                };
            }
            b'[' => {
                if !s.open_empty(b']') {
                    if depth == MAX_DEPTH {
                        return None;
                    }
                    depth += 1;
                    continue;
                }
            }
            b'-' | b'0'..=b'9' => {
                number(s)?;
                chars += super::TOKEN_ID_CHARS;
            }
            b'n' => s.literal(b"null").ok()?,
            b't' => s.literal(b"true").ok()?,
            b'f' => s.literal(b"false").ok()?,
            _ => return None,
        }
        loop {
            if depth == 0 {
                return Some(chars);
            }
            s.ws();
            match s.peek()? {
                b',' => {
                    s.i += 1;
                    break;
                }
                b']' => {
                    s.i += 1;
                    depth -= 1;
                }
                _ => return None,
            }
        }
    }
}

/// The length in bytes of a string's text once its escapes (checked, surrogates paired) are
/// decoded.
fn unescaped_len(raw: &[u8]) -> usize {
    let mut len = 0;
    let mut i = 0;
    while let Some(k) = memchr::memchr(b'\\', &raw[i..]) {
        len += k;
        let at = i + k;
        if raw.get(at + 1) != Some(&b'u') {
            len += 1;
            i = at + 2;
            continue;
        }
        let hex = std::str::from_utf8(raw.get(at + 2..at + 6).unwrap_or_default())
            .ok()
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .unwrap_or(0);
        (len, i) = match hex {
            0..0x80 => (len + 1, at + 6),
            0x80..0x800 => (len + 2, at + 6),
            0xD800..0xDC00 => (len + 4, at + 12),
            _ => (len + 3, at + 6),
        };
        if i > raw.len() {
            return len;
        }
    }
    len + raw.len() - i
}

/// A key inside a skipped object, and its colon.
fn key(s: &mut Scanner<'_>) -> Option<()> {
    s.eat(b'"', Bad::Key).ok()?;
    string(s)?;
    s.eat(b':', Bad::Colon).ok()
}

/// The rest of a string whose opening quote was read; declines a lone surrogate escape.
fn string(s: &mut Scanner<'_>) -> Option<()> {
    let start = s.i;
    let end = s.string().ok()?;
    (!s.escaped || surrogates_paired(&s.b[start..end])).then_some(())
}

/// Every `\uD800`–`\uDBFF` escape is followed by a `\uDC00`–`\uDFFF` one, and no low one
/// stands alone (serde_json refuses a string otherwise). The escapes' grammar was checked.
fn surrogates_paired(raw: &[u8]) -> bool {
    let hex = |at: usize| -> Option<u32> {
        let h = std::str::from_utf8(raw.get(at..at + 4)?).ok()?;
        u32::from_str_radix(h, 16).ok()
    };
    let mut i = 0;
    while let Some(k) = memchr::memchr(b'\\', &raw[i..]) {
        let at = i + k;
        if raw.get(at + 1) != Some(&b'u') {
            i = at + 2;
            continue;
        }
        let Some(hi) = hex(at + 2) else {
            return false;
        };
        match hi {
            0xD800..0xDC00 => {
                if raw.get(at + 6..at + 8) != Some(b"\\u") {
                    return false;
                }
                if !hex(at + 8).is_some_and(|lo| (0xDC00..0xE000).contains(&lo)) {
                    return false;
                }
                i = at + 12;
            }
            0xDC00..0xE000 => return false,
            _ => i = at + 6,
        }
        if i > raw.len() {
            return false;
        }
    }
    true
}

/// A number, declined when it might not fit an `f64` (serde_json refuses those as out of
/// range): kept only while its integer digits plus its exponent are at most 300 (below 10^300).
fn number(s: &mut Scanner<'_>) -> Option<()> {
    let start = s.i;
    s.number().ok()?;
    let token = &s.b[start..s.i];
    let digits = token.strip_prefix(b"-").unwrap_or(token);
    let int_digits = digits.iter().take_while(|c| c.is_ascii_digit()).count() as u64;
    let exp = match digits.iter().position(|c| matches!(c, b'e' | b'E')) {
        None => 0,
        Some(e) => {
            let rest = &digits[e + 1..];
            let positive = rest.first() != Some(&b'-');
            let exp_digits = rest.strip_prefix(b"-").or(rest.strip_prefix(b"+"));
            let value = exp_digits.unwrap_or(rest).iter().fold(0u64, |n, d| {
                n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
            });
            if positive { value } else { 0 }
        }
    };
    (int_digits.saturating_add(exp) <= 300).then_some(())
}

/// A number token as `Value::as_u64` reads it: an integer of digits alone that fits in 64 bits.
fn as_u64(token: &[u8]) -> Option<u64> {
    if token.is_empty() || !token.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(token).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Capability;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use serde_json::Value;

    /// What the `Value` path makes of `body`, in [`Plain`]'s terms (with the needs beside it):
    /// `None` when it refuses the body.
    fn reference(op: Op, body: &[u8]) -> Option<(Plain, std::collections::BTreeSet<Capability>)> {
        let text = std::str::from_utf8(body).ok()?;
        let v: Value = serde_json::from_str(text).ok()?;
        let map = v.as_object()?.clone();
        let inbound = super::super::inspect(op, v).ok()?;
        let u64_of = |k: &str| map.get(k).map(Value::as_u64);
        let plain = Plain {
            model: inbound.model.clone(),
            stream: inbound.stream,
            tools: inbound.needs.contains(&Capability::Tools),
            tools_key: map.contains_key("tools"),
            max_tokens: u64_of("max_tokens"),
            max_completion_tokens: u64_of("max_completion_tokens"),
            model_span: super::super::patch::model_span(body)?,
            prompt_chars: super::super::prompt_chars(&map),
            messages: match (op, map.get("messages")) {
                (Op::Chat, Some(Value::Array(m))) => m.len(),
                _ => 0,
            },
        };
        Some((plain, inbound.needs))
    }

    /// When [`read`] answers, it is the `Value` path's answer.
    fn agrees(op: Op, body: &[u8]) -> Result<bool, TestCaseError> {
        // What the front door lets through: UTF-8 (`read_request` checks it first).
        let Ok(text) = std::str::from_utf8(body) else {
            return Ok(false);
        };
        let Some(got) = read(op, text) else {
            return Ok(false);
        };
        let want = reference(op, body);
        prop_assert!(
            want.is_some(),
            "read {:?} ({op:?}) that the Value path refuses or cannot patch",
            String::from_utf8_lossy(body)
        );
        let (want, needs) = want.unwrap();
        prop_assert_eq!(&got, &want, "for {:?}", String::from_utf8_lossy(body));
        let mut expected = std::collections::BTreeSet::from([Capability::of(op)]);
        if got.tools {
            expected.insert(Capability::Tools);
        }
        prop_assert_eq!(expected, needs);
        Ok(true)
    }

    fn ops() -> impl Strategy<Value = Op> {
        prop_oneof![Just(Op::Chat), Just(Op::Completions), Just(Op::Embeddings)]
    }

    fn one_of(items: &'static [&'static str]) -> impl Strategy<Value = String> {
        proptest::sample::select(items).prop_map(str::to_string)
    }

    /// JSON text, sometimes hostile: escapes, lone surrogates, deep nesting, huge numbers.
    fn value_text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            one_of(&[
                "null",
                "true",
                "false",
                "0",
                "-0",
                "7",
                "12.5",
                "1e2",
                "-3",
                "18446744073709551615",
                "18446744073709551616",
                "1e400",
                "1e299",
                "-1e-400",
                "0.5E+3",
            ]),
            one_of(&[
                r#""""#,
                r#""user""#,
                r#""a\nb""#,
                r#""\ud83d\ude00""#,
                r#""\ud800""#,
                r#""\udc00x""#,
                r#""\ud800\u0041""#,
                r#""\u00e9""#,
                r#""\"""#,
                r#""\\""#,
            ]),
            "[a-z]{0,3}".prop_map(|s| format!("\"{s}\"")),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((one_of(&["a", "b", "type", "role", "a"]), inner), 0..4)
                    .prop_map(|kv| {
                        let m: Vec<String> = kv
                            .into_iter()
                            .map(|(k, v)| format!("\"{k}\":{v}"))
                            .collect();
                        format!("{{{}}}", m.join(","))
                    }),
            ]
        })
    }

    /// A message: mostly `role` and string `content`, sometimes anything.
    fn message_text() -> impl Strategy<Value = String> {
        let role = prop_oneof![
            8 => one_of(&[r#""role":"user""#, r#""role":"system""#, r#""role":"a\nb""#]),
            1 => value_text().prop_map(|v| format!("\"role\":{v}")),
        ];
        let content = prop_oneof![
            6 => one_of(&[
                r#""content":"Hello there""#,
                r#""content":"line\none \u00e9\ud83d\ude00""#,
                r#""content":null"#,
            ]),
            2 => value_text().prop_map(|v| format!("\"content\":{v}")),
            1 => one_of(&[
                r#""content":[{"type":"image_url","image_url":{"url":"x"}}]"#,
                r#""content":[{"type":"text","text":"x"}]"#,
            ]),
        ];
        let extra = prop_oneof![
            one_of(&[
                r#""name":"n""#,
                r#""image_url":"not counted""#,
                r#""r\u006fle":"user""#,
                r#""role":"again""#,
                r#""tool_calls":[{"id":"1"}]"#,
            ]),
            value_text().prop_map(|v| format!("\"x\":{v}")),
        ];
        let message = (
            proptest::option::weighted(0.95, role),
            proptest::option::weighted(0.9, content),
            proptest::option::weighted(0.2, extra),
        )
            .prop_flat_map(|(r, c, e)| {
                Just([r, c, e].into_iter().flatten().collect::<Vec<_>>()).prop_shuffle()
            })
            .prop_map(|m| format!("{{{}}}", m.join(",")));
        prop_oneof![12 => message, 1 => value_text()]
    }

    /// Request-shaped bodies: `model`, `messages`, `prompt` and `input` (so that one body can
    /// be plain for every operation), each sometimes missing or of another kind, in any order,
    /// with other members — the keys the reader knows among them, so some come twice.
    fn body_text() -> impl Strategy<Value = String> {
        let model = prop_oneof![
            8 => one_of(&[r#""gpt""#, r#""a b""#, r#""é""#]),
            1 => one_of(&[r#""""#, r#""g\u0070t""#, "3", "null"]),
        ]
        .prop_map(|v| format!("\"model\":{v}"));
        let messages = prop_oneof![
            8 => prop::collection::vec(message_text(), 1..4)
                .prop_map(|m| format!("[{}]", m.join(","))),
            1 => value_text(),
        ]
        .prop_map(|v| format!("\"messages\":{v}"));
        let prompt = prop_oneof![
            4 => one_of(&[r#""Say hi""#, r#"["a","b\n"]"#, "[1,2]", r#"[[1],["x"]]"#]),
            1 => value_text(),
        ]
        .prop_map(|v| format!("\"prompt\":{v}"));
        let input = prop_oneof![
            4 => one_of(&[r#""embed me""#, r#"["a","b"]"#, "[[1,2]]", "[]"]),
            1 => value_text(),
        ]
        .prop_map(|v| format!("\"input\":{v}"));
        let extra = prop_oneof![
            3 => prop_oneof![one_of(&["true", "false", "null"]), value_text()]
                .prop_map(|v| format!("\"stream\":{v}")),
            3 => (
                one_of(&["tools", "functions"]),
                prop_oneof![one_of(&[r#"[{"type":"function"}]"#, "[]", "null"]), value_text()],
            )
                .prop_map(|(k, v)| format!("\"{k}\":{v}")),
            3 => (one_of(&["max_tokens", "max_completion_tokens"]), value_text())
                .prop_map(|(k, v)| format!("\"{k}\":{v}")),
            3 => (one_of(&["temperature", "user", "x\\\"y", "mod\\u0065l"]), value_text())
                .prop_map(|(k, v)| format!("\"{k}\":{v}")),
            1 => one_of(&[r#""model":"twice""#, r#""messages":[{"role":"user"}]"#]),
        ];
        (
            proptest::option::weighted(0.95, model),
            proptest::option::weighted(0.9, messages),
            proptest::option::weighted(0.9, prompt),
            proptest::option::weighted(0.9, input),
            prop::collection::vec(extra, 0..4),
        )
            .prop_flat_map(|(m, msgs, p, i, extra)| {
                let mut all: Vec<String> = [m, msgs, p, i].into_iter().flatten().collect();
                all.extend(extra);
                Just(all).prop_shuffle()
            })
            .prop_map(|m| format!("{{{}}}", m.join(", ")))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn read_is_the_value_paths_answer_when_it_answers(op in ops(), body in body_text()) {
            agrees(op, body.as_bytes())?;
        }

        #[test]
        fn read_never_answers_for_a_cut_or_changed_body(
            op in ops(),
            body in body_text(),
            cut in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let b = body.as_bytes();
            let at = cut.index(b.len() + 1);
            agrees(op, &b[..at])?;
            let mut changed = b.to_vec();
            if at < changed.len() {
                changed[at] = byte;
                agrees(op, &changed)?;
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// The bound a plain request gives without a parse is never below either tiktoken
        /// family's exact count of the same body (the context guard admits on it uncounted).
        #[test]
        fn the_plain_bound_is_never_below_the_count(
            (op, body) in prop_oneof![
                (ops(), body_text()),
                // Long, arbitrary text as the client's JSON encoder writes it.
                (prop::collection::vec((any::<String>(), "[ a-z0-9\\n]{0,400}"), 1..4), any::<bool>())
                    .prop_map(|(texts, chat)| if chat {
                        let messages: Vec<_> = texts
                            .iter()
                            .map(|(a, b)| serde_json::json!({"role": "user", "content": format!("{a}{b}"), "name": a}))
                            .collect();
                        (Op::Chat, serde_json::json!({"model": "m", "messages": messages}).to_string())
                    } else {
                        let prompt: Vec<_> = texts.iter().map(|(a, b)| format!("{a}{b}")).collect();
                        (Op::Completions, serde_json::json!({"model": "m", "prompt": prompt}).to_string())
                    }),
            ]
        ) {
            let Ok(inbound) = super::super::read_request(op, bytes::Bytes::from(body.clone())) else {
                return Ok(());
            };
            let Some(bound) = inbound.plain_token_bound() else {
                prop_assert!(!body.contains(r#""model":"m""#), "a plain body was declined: {body}");
                return Ok(());
            };
            for f in [crate::tokens::Family::O200k, crate::tokens::Family::Cl100k] {
                let exact = crate::tokens::Counter::Tiktoken(f).request(op, inbound.body()).tokens;
                prop_assert!(exact <= bound, "{f:?} {op:?}: exact {exact} > bound {bound}: {body}");
            }
        }
    }

    /// The generator reaches the reader's answers, not only its declines.
    #[test]
    fn the_generator_reaches_plain_requests() {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = (ops(), body_text());
        let (mut answered, mut tools, mut streams) = (0, 0, 0);
        for _ in 0..4000 {
            let (op, body) = strategy.new_tree(&mut runner).unwrap().current();
            if let Some(p) = read(op, &body) {
                answered += 1;
                tools += usize::from(p.tools);
                streams += usize::from(p.stream);
            }
        }
        assert!(answered > 100, "{answered} answered of 4000");
        assert!(tools > 5 && streams > 5, "tools {tools}, streams {streams}");
    }

    #[test]
    fn reads_a_plain_chat_request() {
        let body = r#"{"model": "gpt-4o", "messages": [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "Hi \ud83d\ude00", "name": "x"}], "max_tokens": 64, "stream": true, "tools": [{"type": "function"}], "temperature": 0.2}"#;
        let p = read(Op::Chat, body).unwrap();
        let body = body.as_bytes();
        assert_eq!(p.model, "gpt-4o");
        assert!(p.stream && p.tools && p.tools_key);
        assert_eq!(
            (p.max_tokens, p.max_completion_tokens),
            (Some(Some(64)), None)
        );
        assert_eq!(&body[p.model_span.clone()], br#""gpt-4o""#);
        let e = read(
            Op::Embeddings,
            r#"{"model":"e","input":["a"],"stream":true}"#,
        )
        .unwrap();
        assert!(!e.stream, "embeddings never stream");
        let c = read(
            Op::Completions,
            r#"{"model":"c","prompt":"x","max_tokens":"5"}"#,
        )
        .unwrap();
        assert_eq!(c.max_tokens, Some(None));
    }

    #[test]
    fn declines_what_it_is_not_sure_of() {
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"x":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        for body in [
            // Invalid for the Value path: it answers with its own error.
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"","messages":[{"role":"user","content":"x"}]}"#,
            r#"{"model":"m","messages":[]}"#,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":1,"content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user"}],"stream":"yes"}"#,
            r#"{"model":"m","messages":[{"role":"user"}],"x":"\ud800"}"#,
            r#"{"model":"m","messages":[{"role":"user"}],"x":1e400}"#,
            r#"{"model":"m","messages":[{"role":"user"}]} x"#,
            // Valid, but not for the fast path.
            r#"{"model":"m","model":"n","messages":[{"role":"user"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","role":"system"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
            r#"{"model":"\u006d","messages":[{"role":"user"}]}"#,
            r#"{"mod\u0065l":"m","messages":[{"role":"user"}]}"#,
            deep.as_str(),
        ] {
            assert_eq!(read(Op::Chat, body), None, "{body}");
        }
        assert!(
            serde_json::from_str::<Value>(&deep).is_err(),
            "deeper than serde_json goes"
        );
        let many: Vec<String> = (0..MAX_KEYS).map(|i| format!("\"k{i}\":1")).collect();
        let body = format!(r#"{{"model":"m","prompt":"p",{}}}"#, many.join(","));
        assert_eq!(read(Op::Completions, &body), None);
        assert!(read(Op::Completions, r#"{"model":"m","prompt":"p"}"#).is_some());
        assert!(read(Op::Completions, r#"{"model":"m","prompt":null}"#).is_none());
        assert!(read(Op::Embeddings, r#"{"model":"m","input":[]}"#).is_none());
        // Near the edges of what an f64 holds.
        assert!(read(Op::Completions, r#"{"model":"m","prompt":"p","t":1e299}"#).is_some());
    }
}
