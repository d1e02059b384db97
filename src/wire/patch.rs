//! The body an OpenAI-type endpoint gets, as the client's own bytes with the top-level `model`
//! value replaced, instead of the parsed body serialised again: a scan of the bytes and two
//! copies where serialising walked the whole tree and escaped every string (for a long prompt,
//! most of the work of forwarding it). What the upstream reads is what the gateway validated:
//! the patch is made only when the bytes are one object whose keys are each written once and
//! without escapes (a key given twice is read as its last occurrence by serde_json but by some
//! servers as its first, so `stream` or `max_tokens` could mean one thing to the gateway and
//! another upstream). Anything else, and every body the gateway changes (hygiene, truncation, a
//! `max_tokens` cap, a continuation), is serialised from the parsed map as before.
//!
//! The client's spelling survives the patch: key order, whitespace, and numbers as written
//! (`1e2`, integers past 64 bits), which a round trip through `serde_json::Value` rewrote.

use std::ops::Range;

use super::answer::{Bad, Scanner};

/// `body` with its top-level `model` value replaced by `model` (as a JSON string); `None` when
/// the bytes do not qualify (see the module's header), and the caller serialises instead.
pub fn model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    at(body, model_span(body)?, model)
}

/// Where the top-level `model` value lies in `body`, when the bytes qualify for the patch
/// ([`super::request::read`] finds the same span in its one pass over a plain request).
pub fn model_span(body: &[u8]) -> Option<Range<usize>> {
    top_value(body, b"model")
}

/// `body` with the value at `span` — the top-level `model` value, found by [`model_span`] —
/// replaced by `model`.
pub fn at(body: &[u8], span: Range<usize>, model: &str) -> Option<Vec<u8>> {
    if span.start > span.end || span.end > body.len() {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() - span.len() + model.len() + 2);
    out.extend_from_slice(&body[..span.start]);
    serde_json::to_writer(&mut out, model).ok()?;
    out.extend_from_slice(&body[span.end..]);
    Some(out)
}

/// Where the value of the top-level member `key` lies in `body`: `None` unless `body` is one
/// JSON object that has the member, with no key written twice or with an escape.
fn top_value(body: &[u8], key: &[u8]) -> Option<Range<usize>> {
    let mut s = Scanner {
        b: body,
        i: 0,
        escaped: false,
    };
    members(&mut s, key).ok().flatten()
}

/// Top-level keys compared for repeats (`request::MAX_KEYS`, 48: OpenAI's chat API has about
/// thirty parameters); a body with more falls back to serialising.
use super::request::{Keys, MAX_KEYS};

fn members(s: &mut Scanner<'_>, want: &[u8]) -> Result<Option<Range<usize>>, Bad> {
    let b = s.b;
    s.ws();
    if s.peek() != Some(b'{') || s.open_empty(b'}') {
        return Ok(None);
    }
    let mut keys = Keys::<MAX_KEYS>::new();
    let mut found = None;
    loop {
        let Some(name) = keys.next(s) else {
            return Ok(None);
        };
        let at = s.i;
        if s.peek() == Some(b'"') {
            s.i += 1;
            s.string()?;
        } else {
            s.value()?;
        }
        if name == want {
            found = Some(at..s.i);
        }
        if !s.more_members()? {
            break;
        }
    }
    s.ws();
    Ok(found.filter(|_| s.i == b.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    fn patched(body: &str, m: &str) -> Option<String> {
        model(body.as_bytes(), m).map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn replaces_the_model_and_keeps_the_clients_spelling() {
        assert_eq!(
            patched(
                r#"{ "messages": [{"role":"user","content":"hi \"there\""}], "model" : "a", "temperature": 1e-1, "seed": 123456789012345678901234567890 }"#,
                "gpt-4o-mini"
            )
            .unwrap(),
            r#"{ "messages": [{"role":"user","content":"hi \"there\""}], "model" : "gpt-4o-mini", "temperature": 1e-1, "seed": 123456789012345678901234567890 }"#
        );
        // The upstream's model name is written as JSON, whatever it holds.
        assert_eq!(
            patched(r#"{"model":"a"}"#, "we\"ird\\name\n").unwrap(),
            r#"{"model":"we\"ird\\name\n"}"#
        );
        // A `"model"` inside a nested object or a string is not the top-level member.
        assert_eq!(
            patched(
                r#"{"x":{"model":"inner"},"y":"\"model\":\"s\"","model":"a"}"#,
                "b"
            )
            .unwrap(),
            r#"{"x":{"model":"inner"},"y":"\"model\":\"s\"","model":"b"}"#
        );
    }

    #[test]
    fn declines_what_it_cannot_patch_faithfully() {
        for body in [
            // A key twice: serde_json reads the last, some servers the first.
            r#"{"model":"a","stream":false,"stream":true}"#,
            r#"{"model":"a","model":"b"}"#,
            // A key with an escape (it may spell `model`).
            r#"{"mod\u0065l":"a"}"#,
            r#"{"model":"a","x\"y":1}"#,
            // No top-level model, not an object, not one value.
            r#"{"x":{"model":"a"}}"#,
            r#"{}"#,
            r#"["model"]"#,
            r#"{"model":"a"} {}"#,
            r#"{"model":"a""#,
            "",
        ] {
            assert_eq!(patched(body, "m"), None, "{body}");
        }
    }

    fn values() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            "[a-z\"\\\\\u{0}-\u{1f}\u{e9}\u{1f600}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{0,6}|model", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Bodies written as a client might: any member order, whitespace anywhere it may go,
    /// sometimes a key twice.
    fn bodies() -> impl Strategy<Value = (String, Map<String, Value>)> {
        (
            prop::collection::vec(("[a-z]{1,6}|model|stream", values()), 0..6),
            any::<bool>(),
            values(),
            prop::collection::vec(prop::sample::select(vec!["", " ", "\n", "\t ", "\r\n"]), 4),
        )
            .prop_map(|(mut members, with_model, model, ws)| {
                if with_model {
                    members.push(("model".into(), model));
                }
                let text = members
                    .iter()
                    .map(|(k, v)| {
                        format!(
                            "{}{}{}:{}{}",
                            ws[0],
                            serde_json::to_string(k).unwrap(),
                            ws[1],
                            ws[2],
                            serde_json::to_string_pretty(v).unwrap()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                let body = format!("{}{{{text}{}}}{}", ws[3], ws[0], ws[1]);
                let parsed = members.into_iter().collect::<Map<_, _>>();
                (body, parsed)
            })
    }

    proptest! {
        /// What the upstream parses from the patch is the client's body with `model` replaced;
        /// the patch is declined exactly for a repeated key or a missing `model`.
        #[test]
        fn the_patch_parses_to_the_rewritten_body((body, generated) in bodies(), m in "[a-z\"\\\\\u{0}-\u{1f}]{0,6}") {
            // The generated map, as serde_json reads the text back (floats need not round-trip).
            let Value::Object(parsed) = serde_json::from_str::<Value>(&body).unwrap() else {
                unreachable!()
            };
            prop_assert_eq!(parsed.keys().collect::<Vec<_>>(), generated.keys().collect::<Vec<_>>());
            let keys_once = {
                let mut s = Scanner { b: body.as_bytes(), i: 0, escaped: false };
                let mut names = Vec::new();
                s.ws();
                if !s.open_empty(b'}') {
                    loop {
                        s.eat(b'"', Bad::Key).unwrap();
                        let start = s.i;
                        let end = s.string().unwrap();
                        names.push(body[start..end].to_string());
                        s.eat(b':', Bad::Colon).unwrap();
                        s.value().unwrap();
                        if !s.more_members().unwrap() { break; }
                    }
                }
                let n = names.len();
                names.sort();
                names.dedup();
                names.len() == n
            };
            match patched(&body, &m) {
                Some(out) => {
                    prop_assert!(keys_once && parsed.contains_key("model"));
                    let mut want = parsed.clone();
                    want.insert("model".into(), Value::String(m.clone()));
                    prop_assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), Value::Object(want));
                }
                None => prop_assert!(!keys_once || !parsed.contains_key("model")),
            }
        }

        /// Arbitrary bytes: a patch or a refusal, never a panic; a patch only of valid JSON.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            if let Some(out) = model(&bytes, "m") {
                prop_assert!(serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok());
                prop_assert!(serde_json::from_slice::<serde::de::IgnoredAny>(&out).is_ok());
            }
        }
    }
}
