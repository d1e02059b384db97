//! Payload hygiene: some APIs reject message text with U+2028/U+2029 (JSON-valid, but JavaScript
//! line terminators that break naive parsers) or raw control characters. Optional per endpoint
//! (`payload_hygiene: strip | escape`), off by default.
//!
//! `escape` never changes the text the model reads: the offending characters are written as JSON
//! `\uXXXX` escapes on the wire ([`escape_wire`]), which decode to the identical string. `strip`
//! removes them (and so does change the text). Tab, LF and CR are ordinary text.

use std::borrow::Cow;

use serde_json::{Map, Value};

use crate::config::Hygiene;

fn offending(c: char) -> bool {
    matches!(c, '\u{2028}' | '\u{2029}') || (c.is_control() && !matches!(c, '\n' | '\t' | '\r'))
}

/// Cleans one string; returns how many offending characters it holds. `Strip` removes them;
/// `Escape` leaves the text as it is (the escaping happens on the wire, see [`escape_wire`]).
pub fn clean(text: &str, mode: Hygiene) -> (Cow<'_, str>, u64) {
    if mode == Hygiene::Off || !text.chars().any(offending) {
        return (Cow::Borrowed(text), 0);
    }
    let n = text.chars().filter(|c| offending(*c)).count() as u64;
    if mode == Hygiene::Escape {
        return (Cow::Borrowed(text), n);
    }
    (
        Cow::Owned(text.chars().filter(|c| !offending(*c)).collect()),
        n,
    )
}

/// Characters JSON allows raw in a string that some parsers choke on: written as `\uXXXX`.
/// (serde_json already escapes U+0000..U+001F.)
fn wire_offending(c: char) -> bool {
    matches!(c, '\u{2028}' | '\u{2029}' | '\u{7f}' | '\u{80}'..='\u{9f}')
}

/// Rewrites a serialized JSON document so U+2028, U+2029, DEL and C1 controls appear as `\uXXXX`
/// escapes. Outside strings JSON cannot hold them, so the document decodes to the same value.
pub fn escape_wire(json: Vec<u8>) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(&json) else {
        return json;
    };
    if !text.chars().any(wire_offending) {
        return json;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if wire_offending(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    out.into_bytes()
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
        assert_eq!(c, "a\u{2028}b", "escape leaves the text itself alone");
        assert_eq!(n, 1);
        let (_, n) = clean("tab\tcr\rlf\n", Hygiene::Strip);
        assert_eq!(n, 0, "tab, CR and LF are not offending");
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

    #[test]
    fn escape_on_the_wire_decodes_to_the_same_text() {
        let body = json!({"messages": [{"role": "user", "content": "a\u{2028}b\u{2029}c\u{7f}d\u{85}e\u{7}f\tg\r\n"}]});
        let wire = escape_wire(serde_json::to_vec(&body).unwrap());
        let text = String::from_utf8(wire.clone()).unwrap();
        assert!(
            text.contains("\\u2028") && text.contains("\\u2029") && text.contains("\\u0085"),
            "{text}"
        );
        assert!(!text.contains('\u{2028}') && !text.contains('\u{2029}'));
        let back: Value = serde_json::from_slice(&wire).unwrap();
        assert_eq!(back, body, "the decoded document is identical");
    }

    proptest::proptest! {
        #[test]
        fn escape_wire_round_trips(s in "\\PC*|[\u{2028}\u{2029}\u{7f}-\u{9f}a\"\\\\]{0,40}") {
            let body = json!({"content": s, "k\u{2028}": [1, "x\u{2029}"]});
            let wire = escape_wire(serde_json::to_vec(&body).unwrap());
            let back: Value = serde_json::from_slice(&wire).unwrap();
            proptest::prop_assert_eq!(back, body);
        }
    }
}
