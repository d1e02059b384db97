//! Payload hygiene: some APIs reject message text with U+2028/U+2029 (JSON-valid, but JavaScript
//! line terminators that break naive parsers) or raw control characters. Optional per endpoint
//! (`payload_hygiene: strip | escape`), off by default because it changes what the model sees.

use std::borrow::Cow;

use serde_json::{Map, Value};

use crate::config::Hygiene;

fn offending(c: char) -> bool {
    matches!(c, '\u{2028}' | '\u{2029}') || (c.is_control() && c != '\n' && c != '\t')
}

/// Cleans one string; returns how many characters changed.
pub fn clean(text: &str, mode: Hygiene) -> (Cow<'_, str>, u64) {
    if mode == Hygiene::Off || !text.chars().any(offending) {
        return (Cow::Borrowed(text), 0);
    }
    let mut out = String::with_capacity(text.len());
    let mut n = 0;
    for c in text.chars() {
        if offending(c) {
            n += 1;
            if mode == Hygiene::Escape {
                out.push_str(&format!("\\u{:04X}", c as u32));
            }
        } else {
            out.push(c);
        }
    }
    (Cow::Owned(out), n)
}

fn clean_value(v: &mut Value, mode: Hygiene) -> u64 {
    match v {
        Value::String(s) => {
            let (c, n) = clean(s, mode);
            if n > 0 {
                *s = c.into_owned();
            }
            n
        }
        Value::Array(a) => a.iter_mut().map(|v| clean_value(v, mode)).sum(),
        Value::Object(o) => o
            .iter_mut()
            .filter(|(k, _)| matches!(k.as_str(), "content" | "text"))
            .map(|(_, v)| clean_value(v, mode))
            .sum(),
        _ => 0,
    }
}

/// The body with message text (and prompts/inputs) cleaned, and how many characters changed.
pub fn apply(body: &Map<String, Value>, mode: Hygiene) -> (Cow<'_, Map<String, Value>>, u64) {
    if mode == Hygiene::Off {
        return (Cow::Borrowed(body), 0);
    }
    let mut b = body.clone();
    let mut n = 0;
    if let Some(Value::Array(msgs)) = b.get_mut("messages") {
        for m in msgs {
            if let Some(c) = m.get_mut("content") {
                n += clean_value(c, mode);
            }
        }
    }
    for key in ["prompt", "input"] {
        if let Some(v) = b.get_mut(key) {
            n += clean_value_any(v, mode);
        }
    }
    if n == 0 {
        return (Cow::Borrowed(body), 0);
    }
    (Cow::Owned(b), n)
}

fn clean_value_any(v: &mut Value, mode: Hygiene) -> u64 {
    match v {
        Value::String(_) => clean_value(v, mode),
        Value::Array(a) => a.iter_mut().map(|v| clean_value_any(v, mode)).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strips_and_escapes() {
        let (c, n) = clean("a\u{2028}b\u{0007}c\nd\te\u{2029}", Hygiene::Strip);
        assert_eq!(c, "abc\nd\te");
        assert_eq!(n, 3);
        let (c, n) = clean("a\u{2028}b", Hygiene::Escape);
        assert_eq!(c, "a\\u2028b");
        assert_eq!(n, 1);
        let (c, n) = clean("clean text", Hygiene::Strip);
        assert!(matches!(c, Cow::Borrowed(_)));
        assert_eq!(n, 0);
    }

    #[test]
    fn cleans_message_text_only() {
        let body = json!({"model": "m\u{2028}", "messages": [{"role": "user", "content": "hi\u{2028}"}, {"role": "user", "content": [{"type": "text", "text": "x\u{0000}y"}]}]});
        let (b, n) = apply(body.as_object().unwrap(), Hygiene::Strip);
        assert_eq!(n, 2);
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(b["messages"][1]["content"][0]["text"], "xy");
        assert_eq!(b["model"], "m\u{2028}", "only message text is touched");
    }
}
