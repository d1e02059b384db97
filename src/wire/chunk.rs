//! What a committed stream reads from each chunk it passes on — whether it carries content,
//! how many bytes of text, its `usage` — without building a `serde_json::Value` tree: a typed
//! parse that borrows the strings and skips every field it does not name. A `Value` per chunk
//! (a map and a string for every key, freed again) was the largest cost of a streamed chunk.
//!
//! [`read`] answers only for the plain case; anything else — not an object, a field of another
//! type than a chunk has, a field given twice, an `error` that is not `null`, an `object` that is
//! or may be `"error"` — gives `None`, and the caller reads the chunk as a `Value` as before, so
//! the two always agree (a differential property test below holds them to each other).

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, Visitor};

#[cfg(test)]
use super::ChunkKind;
use super::Usage;

/// A plain chunk, read.
#[derive(Debug, PartialEq, Eq)]
pub struct Plain {
    /// It carries content or a finish reason ([`super::ChunkKind::Content`]), else it is a
    /// preamble.
    pub content: bool,
    /// Bytes of its choices' `delta.content` and legacy `text`.
    pub text_bytes: usize,
    /// Its `usage`, when it has one (counts that are not non-negative integers read as 0).
    pub usage: Option<Usage>,
    /// The last choice's finish reason that is not `null`, by [`super::trace::finish_name`]
    /// (a value that is not a string: `other`).
    pub finish: Option<&'static str>,
}

/// A finish reason of any JSON type: a string by its name, anything else `other`.
struct Finish(&'static str);

impl<'de> Deserialize<'de> for Finish {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Any;
        impl<'de> Visitor<'de> for Any {
            type Value = Finish;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a finish reason")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Finish, E> {
                Ok(Finish(super::trace::finish_name(v.as_bytes())))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Finish, E> {
                Ok(Finish("other"))
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Finish, E> {
                Ok(Finish("other"))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Finish, E> {
                Ok(Finish("other"))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Finish, E> {
                Ok(Finish("other"))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Finish, E> {
                Ok(Finish("other"))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Finish, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Finish("other"))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> Result<Finish, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Finish("other"))
            }
        }
        d.deserialize_any(Any)
    }
}

/// `T` read from a JSON object only. A derived struct also reads from an array (its fields in
/// order), where the `Value` path would find no field at all.
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Fields<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Fields(PhantomData)).map(Obj)
    }
}

#[derive(Deserialize)]
struct Chunk<'a> {
    /// Present and not `null`: an in-band error, for the `Value` path to read.
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(default, borrow)]
    object: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    choices: Option<Vec<Obj<Choice<'a>>>>,
    #[serde(default)]
    usage: Option<Obj<Counts>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    finish_reason: Option<Finish>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Obj<Delta<'a>>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    refusal: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    function_call: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Counts {
    #[serde(default)]
    prompt_tokens: Option<serde_json::Number>,
    #[serde(default)]
    completion_tokens: Option<serde_json::Number>,
}

/// The chunk's content, text and usage, or `None` when it is not a plain chunk (see the module):
/// read in one pass by [`super::scan`], or, where that declines, by serde.
pub fn read(data: &str) -> Option<Plain> {
    super::scan::read(data).or_else(|| typed(data))
}

/// [`read`] for the next chunk of a stream, against the stream's last (see [`super::scan::Skim`]).
pub fn read_next(skim: &mut super::scan::Skim, data: &str) -> Option<Plain> {
    skim.read(data).or_else(|| typed(data))
}

/// [`read`] through serde's derive: the reference [`super::scan`] is held to.
fn typed(data: &str) -> Option<Plain> {
    let Obj(c): Obj<Chunk<'_>> = serde_json::from_str(data).ok()?;
    if c.error.is_some() || c.object.as_deref() == Some("error") {
        return None;
    }
    let nonempty = |s: &Option<Cow<'_, str>>| s.as_deref().is_some_and(|t| !t.is_empty());
    let choices: Vec<Choice<'_>> = c
        .choices
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.0)
        .collect();
    let content = choices.iter().any(|ch| {
        ch.finish_reason.is_some()
            || nonempty(&ch.text)
            || ch.delta.as_ref().map(|d| &d.0).is_some_and(|d| {
                nonempty(&d.content)
                    || nonempty(&d.refusal)
                    || nonempty(&d.reasoning_content)
                    || nonempty(&d.reasoning)
                    || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                    || d.function_call.is_some()
            })
    });
    let len = |s: &Option<Cow<'_, str>>| s.as_deref().map_or(0, str::len);
    let text_bytes = choices
        .iter()
        .map(|ch| len(&ch.text) + ch.delta.as_ref().map_or(0, |d| len(&d.0.content)))
        .sum();
    let count = |n: &Option<serde_json::Number>| n.as_ref().and_then(|n| n.as_u64()).unwrap_or(0);
    let finish = choices
        .iter()
        .rev()
        .find_map(|ch| ch.finish_reason.as_ref().map(|f| f.0));
    Some(Plain {
        content,
        text_bytes,
        finish,
        usage: c.usage.map(|Obj(u)| Usage {
            prompt: count(&u.prompt_tokens),
            completion: count(&u.completion_tokens),
        }),
    })
}

/// What the `Value` path reads from the same chunk (the reference [`read`] is held to).
#[cfg(test)]
fn by_value(data: &str) -> Option<(ChunkKind, usize, Option<Usage>)> {
    let v: serde_json::Value = serde_json::from_str(data).ok()?;
    let kind = super::classify_chunk(&v);
    let text = v
        .get("choices")
        .and_then(serde_json::Value::as_array)
        .map_or(0, |cs| {
            let len = |x: Option<&serde_json::Value>| {
                x.and_then(serde_json::Value::as_str).map_or(0, str::len)
            };
            cs.iter()
                .map(|c| len(c.get("delta").and_then(|d| d.get("content"))) + len(c.get("text")))
                .sum()
        });
    Some((kind, text, super::usage_of(&v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Chunks as servers send them take the typed path, and read as the `Value` path reads them.
    #[test]
    fn real_chunks_take_the_typed_path() {
        let chunks = [
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#,
            r#"{"id":"c1","object":"text_completion","choices":[{"text":"caf\u00e9","index":0,"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}],"error":null}"#,
        ];
        let want = [
            (false, 0, None),
            (true, 5, None),
            (true, 0, None),
            (
                false,
                0,
                Some(Usage {
                    prompt: 12,
                    completion: 3,
                }),
            ),
            (true, 5, None),
            (true, 0, None),
        ];
        for (c, (content, text_bytes, usage)) in chunks.iter().zip(want) {
            let got = read(c).unwrap_or_else(|| panic!("typed path declined {c}"));
            let finish = c.contains("\"stop\"").then_some("stop");
            assert_eq!(
                got,
                Plain {
                    content,
                    text_bytes,
                    usage,
                    finish,
                },
                "{c}"
            );
            let (kind, text, u) = by_value(c).unwrap();
            assert_eq!(kind == ChunkKind::Content, content, "{c}");
            assert_eq!((text, u), (text_bytes, usage), "{c}");
        }
    }

    /// Chunks the typed path must leave to the `Value` path.
    #[test]
    fn errors_and_odd_shapes_are_declined() {
        for c in [
            r#"{"error":{"message":"overloaded"}}"#,
            r#"{"error":"overloaded"}"#,
            r#"{"object":"error","message":"m"}"#,
            r#"{"object":"\u0065rror","message":"m"}"#,
            r#"{"choices":[{"delta":{"content":"a"}}],"choices":[]}"#,
            r#"{"choices":{"0":{}}}"#,
            r#"{"choices":[{"delta":"text"}]}"#,
            r#"{"usage":7}"#,
            r#"[1,2]"#,
            r#"[null,null,[{"text":"a"}]]"#,
            r#"{"choices":[[null,"a"]]}"#,
            r#"{"choices":[{"delta":[null,"a"]}]}"#,
            r#"{"usage":[5,6]}"#,
            r#"not json"#,
        ] {
            assert_eq!(read(c), None, "{c}");
        }
    }

    fn one_of(choices: &'static [&'static str]) -> BoxedStrategy<String> {
        proptest::sample::select(choices)
            .prop_map(str::to_string)
            .boxed()
    }

    /// `"key":value` zero, one or two times (a key given twice).
    fn field(k: &'static str, v: BoxedStrategy<String>) -> BoxedStrategy<Vec<String>> {
        prop_oneof![
            20 => Just(Vec::new()),
            60 => v.clone().prop_map(move |v| vec![format!("\"{k}\":{v}")]),
            1 => (v.clone(), v).prop_map(move |(a, b)| vec![format!("\"{k}\":{a}"), format!("\"{k}\":{b}")]),
        ]
        .boxed()
    }

    /// An object of these fields, or now and then an array or a scalar in its place.
    fn object(fields: Vec<BoxedStrategy<Vec<String>>>) -> BoxedStrategy<String> {
        let obj = fields.prop_map(|parts| format!("{{{}}}", parts.concat().join(",")));
        prop_oneof![
            60 => obj,
            1 => one_of(&["null", "\"x\"", "[null,\"a\"]", "[]", "{}", "[null,null,[{\"text\":\"a\"}]]"]),
        ]
        .boxed()
    }

    /// Chunks shaped as servers send them, every field sometimes of another type, missing or
    /// given twice.
    fn chunk_shaped() -> BoxedStrategy<String> {
        let text = || {
            prop_oneof![
                40 => one_of(&["\"\"", "\"hi\"", "\"caf\\u00e9\"", "null"]),
                1 => one_of(&["3", "[]"]),
            ]
            .boxed()
        };
        let delta = object(vec![
            field("role", text()),
            field("content", text()),
            field("refusal", text()),
            field("reasoning", text()),
            field("reasoning_content", text()),
            field(
                "tool_calls",
                one_of(&["[]", "[{}]", "[{},{}]", "null", "null", "{}"]),
            ),
            field("function_call", one_of(&["null", "{}", "\"f\"", "0"])),
        ]);
        let choice = object(vec![
            field("index", one_of(&["0", "1"])),
            field(
                "finish_reason",
                one_of(&[
                    "null",
                    "\"stop\"",
                    "0",
                    "\"length\"",
                    "\"st\\u006fp\"",
                    "{}",
                    "[1]",
                    "\"odd\"",
                ]),
            ),
            field("text", text()),
            field("delta", delta),
        ]);
        let choices = prop_oneof![
            40 => proptest::collection::vec(choice, 0..3).prop_map(|c| format!("[{}]", c.join(","))),
            1 => one_of(&["null", "{}", "\"x\""]),
        ]
        .boxed();
        let num = || {
            prop_oneof![
                40 => one_of(&["0", "12", "-1", "1.5", "1e2", "18446744073709551616", "null"]),
                1 => one_of(&["\"5\""]),
            ]
            .boxed()
        };
        let usage = object(vec![
            field("prompt_tokens", num()),
            field("completion_tokens", num()),
            field("total_tokens", num()),
        ]);
        object(vec![
            field("id", one_of(&["\"c1\""])),
            field(
                "object",
                one_of(&[
                    "\"chat.completion.chunk\"",
                    "\"chat.completion.chunk\"",
                    "\"chat.completion.chunk\"",
                    "\"error\"",
                    "\"\\u0065rror\"",
                    "null",
                ]),
            ),
            field("choices", choices),
            field("usage", usage),
            field(
                "error",
                one_of(&[
                    "null",
                    "null",
                    "null",
                    "null",
                    "{\"message\":\"m\"}",
                    "\"e\"",
                ]),
            ),
        ])
    }

    /// JSON built from the keys a chunk has, each with a value of any type, nested as chunks
    /// are, sometimes with a key given twice.
    fn chunkish() -> impl Strategy<Value = String> {
        let scalar = one_of(&[
            "null",
            "true",
            "0",
            "3",
            "-2",
            "1.5",
            "18446744073709551616",
            "\"\"",
            "\"hi\"",
            "\"error\"",
            "\"\\u00e9\\n\"",
            "[]",
            "{}",
        ]);
        let keys = proptest::sample::select(
            &[
                "error",
                "object",
                "choices",
                "usage",
                "delta",
                "content",
                "text",
                "finish_reason",
                "tool_calls",
                "function_call",
                "refusal",
                "reasoning",
                "reasoning_content",
                "prompt_tokens",
                "completion_tokens",
                "id",
            ][..],
        );
        scalar.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                proptest::collection::vec((keys.clone(), inner), 0..6).prop_map(|kv| {
                    let body: Vec<String> = kv
                        .into_iter()
                        .map(|(k, v)| format!("\"{k}\":{v}"))
                        .collect();
                    format!("{{{}}}", body.join(","))
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        /// Whenever the typed path answers, it answers what the `Value` path does.
        #[test]
        fn agrees_with_the_value_path(data in prop_oneof![3 => chunk_shaped(), 1 => chunkish().boxed()]) {
            if let Some(p) = read(&data) {
                let (kind, text, usage) = by_value(&data).expect("typed accepted invalid JSON");
                prop_assert!(!matches!(kind, ChunkKind::Error(_)), "{}", data);
                prop_assert_eq!(kind == ChunkKind::Content, p.content, "{}", data);
                prop_assert_eq!(text, p.text_bytes, "{}", data);
                prop_assert_eq!(usage, p.usage, "{}", data);
            }
        }

        /// Arbitrary text never panics.
        #[test]
        fn arbitrary_text_never_panics(s in ".{0,200}") {
            let _ = read(&s);
        }

        /// Whenever the one-pass reader answers, serde's derive answers the same.
        #[test]
        fn the_scan_agrees_with_serde(data in prop_oneof![3 => chunk_shaped(), 1 => chunkish().boxed(), 1 => escapes()]) {
            if let Some(p) = super::super::scan::read(&data) {
                prop_assert_eq!(Some(p), typed(&data), "{}", data);
            }
        }

        /// A stream's chunks read against the last one read in full answer what each read
        /// alone does: chunks of one shape whose generated strings (valid, escaped, broken)
        /// and sometimes other bytes differ from chunk to chunk.
        #[test]
        fn skimming_agrees_with_reading_each_chunk(chunks in same_shape()) {
            let mut skim = super::super::scan::Skim::default();
            for data in &chunks {
                prop_assert_eq!(skim.read(data), super::super::scan::read(data), "{}", data);
            }
            let mut skim = super::super::scan::Skim::default();
            for data in &chunks {
                prop_assert_eq!(read_next(&mut skim, data), read(data), "{}", data);
            }
        }

        /// Arbitrary text after a learned shape never panics the skim.
        #[test]
        fn skimming_arbitrary_text_never_panics(s in "[{}\\[\\]\",:a-z0-9 \\\\]{0,200}") {
            let mut skim = super::super::scan::Skim::default();
            let shape = r#"{"choices":[{"delta":{"content":"a"},"finish_reason":null}],"obfuscation":"x"}"#;
            prop_assert!(skim.read(shape).is_some());
            let _ = skim.read(&s);
            let _ = skim.read(&format!(r#"{{"choices":[{{"delta":{{"content":"{s}"}},"finish_reason":null}}],"obfuscation":"x"}}"#));
        }

        /// Arbitrary bytes near a chunk's shape never panic the scan.
        #[test]
        fn the_scan_never_panics(s in "[{}\\[\\]\",:a-z0-9.eE+\\\\ -]{0,120}") {
            let _ = super::super::scan::read(&s);
        }
    }

    /// Chunks of a few shapes (content, reasoning, a tool call, OpenAI's `obfuscation`, legacy
    /// `text`, a finish, usage) with their strings drawn from valid, escaped and broken JSON
    /// strings, and now and then another byte changed: what a [`super::super::scan::Skim`]
    /// sees in a stream.
    fn same_shape() -> BoxedStrategy<Vec<String>> {
        let s = prop_oneof![
            4 => "[a-z é中😀]{0,12}".prop_map(|t| format!("\"{t}\"")),
            1 => one_of(&[
                "\"\"",
                "\"\\ud83d\\ude00\"",
                "\"\\ud83d\"",
                "\"a\\u0000\"",
                "\"\\x\"",
                "\"\\/\\b\\f\\n\\r\\t\\\"\\\\\"",
                "\"tab\there\"",
                "\"a\\\"",
                "\"open",
                "null",
                "1",
            ]),
        ];
        let finish = one_of(&["null", "null", "null", "\"stop\"", "\"length\"", "1"]);
        let chunk = (s.clone(), s.clone(), s, finish, 0..12usize);
        (0..6usize, proptest::collection::vec(chunk, 1..8))
            .prop_map(|(shape, chunks)| {
                chunks
                    .into_iter()
                    .map(|(a, b, c, f, odd)| shaped(shape, &a, &b, &c, &f, odd))
                    .collect()
            })
            .boxed()
    }

    /// One chunk of `shape` (see [`same_shape`]) with its strings and finish reason; `odd`
    /// below 3 changes a byte outside them.
    fn shaped(shape: usize, a: &str, b: &str, c: &str, f: &str, odd: usize) -> String {
        let mut out = match shape {
            0 => format!(
                "{{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{a}}},\"finish_reason\":{f}}}],\"usage\":null,\"obfuscation\":{b}}}"
            ),
            1 => format!(
                "{{\"choices\":[{{\"delta\":{{\"reasoning_content\":{a},\"content\":{b}}},\"finish_reason\":{f}}}]}}"
            ),
            2 => format!(
                "{{\"choices\":[{{\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":{a}}}}}]}},\"finish_reason\":{f}}}],\"obfuscation\":{c}}}"
            ),
            3 => {
                format!("{{\"choices\":[{{\"text\":{a},\"finish_reason\":{f}}},{{\"text\":{b}}}]}}")
            }
            4 => format!(
                "{{\"choices\":[{{\"delta\":{{\"refusal\":{a}}}}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":4}},\"obfuscation\":{c}}}"
            ),
            _ => format!(
                " {{ \"choices\" : [ {{ \"delta\" : {{ \"content\" : {a} }} }} ] , \"obfuscation\" : {b} }} "
            ),
        };
        // Now and then a byte outside the strings changed too.
        if odd < 3 {
            let at = out.len() * (odd + 1) / 4;
            if out.is_char_boundary(at) && out.is_char_boundary(at + 1) {
                out.replace_range(at..at + 1, ["1", "\"", " "][odd]);
            }
        }
        out
    }

    /// Chunks whose strings and numbers take every odd form JSON allows, or nearly: escapes,
    /// surrogate pairs and lone halves, control characters, exponents, long integers, spaces.
    fn escapes() -> BoxedStrategy<String> {
        let s = one_of(&[
            "\"\\ud83d\\ude00\"",
            "\"\\ud83d\"",
            "\"\\ude00x\"",
            "\"\\ud83d\\u0041\"",
            "\"a\\u0000\"",
            "\"\\x\"",
            "\"\\/\\b\\f\\n\\r\\t\\\"\\\\\"",
            "\"\\u00E9\\u4e2d\"",
            "\"tab\there\"",
            "\"é中😀\"",
            "\"\"",
            "1e5",
            "-0",
            "01",
            "1.",
            "-",
            "123456789012345678901234567890",
            "18446744073709551615",
            " null ",
            "true",
            "[1,]",
            "{\"a\":1,}",
        ]);
        let key = one_of(&[
            "content",
            "text",
            "con\\u0074ent",
            "prompt_tokens",
            "finish_reason",
        ]);
        (key, s.clone(), s, 0..4usize)
            .prop_map(|(k, a, b, shape)| match shape {
                0 => format!("{{\"choices\":[{{\"delta\":{{\"{k}\":{a}}},\"text\":{b}}}]}}"),
                1 => format!("{{\"usage\":{{\"{k}\":{a},\"completion_tokens\":{b}}}}}"),
                2 => format!(" {{ \"choices\" : [ {{ \"{k}\" : {a} }} ] , \"x\" : {b} }} "),
                _ => format!("{{\"object\":{a},\"choices\":[{{\"{k}\":{b}}}]}}"),
            })
            .boxed()
    }

    /// How long each reader takes a chunk (release build: `cargo test --release --lib
    /// scan_speed -- --ignored --nocapture`); prints, asserts nothing.
    #[test]
    #[ignore]
    fn scan_speed() {
        let c = r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench","system_fingerprint":"fp_bench","choices":[{"index":0,"delta":{"content":" word17"},"logprobs":null,"finish_reason":null}]}"#;
        let n = 2_000_000;
        for (name, f) in [
            (
                "scan",
                super::super::scan::read as fn(&str) -> Option<Plain>,
            ),
            ("serde", typed),
            ("scan", super::super::scan::read),
            ("serde", typed),
        ] {
            let t = std::time::Instant::now();
            let mut bytes = 0;
            for _ in 0..n {
                bytes += f(std::hint::black_box(c)).map_or(0, |p| p.text_bytes);
            }
            println!(
                "{name}: {:.1} ns a chunk ({bytes})",
                t.elapsed().as_nanos() as f64 / n as f64
            );
        }
        // Against the stream's shape (two chunks alternating, so every read compares).
        let d = c.replace("word17", "word18");
        let mut skim = super::super::scan::Skim::default();
        let t = std::time::Instant::now();
        let mut bytes = 0;
        for i in 0..n {
            let data = if i % 2 == 0 { c } else { &d[..] };
            bytes += read_next(&mut skim, std::hint::black_box(data)).map_or(0, |p| p.text_bytes);
        }
        println!(
            "skim: {:.1} ns a chunk ({bytes})",
            t.elapsed().as_nanos() as f64 / n as f64
        );
    }

    /// The chunks servers send are read in one pass, not only declined to serde.
    #[test]
    fn real_chunks_take_the_one_pass_path() {
        for c in [
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hello \"there\"\n\u00e9\ud83d\ude00"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
            r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\": 1.5}"}}]},"logprobs":{"content":[{"token":"x","logprob":-0.25}]}}],"error":null}"#,
        ] {
            let fast = super::super::scan::read(c).unwrap_or_else(|| panic!("declined {c}"));
            assert_eq!(Some(fast), typed(c), "{c}");
        }
        let p = super::super::scan::read(
            r#"{"choices":[{"delta":{"content":"\"\u00e9\ud83d\ude00"}}]}"#,
        )
        .unwrap();
        assert_eq!(p.text_bytes, 1 + 2 + 4);
    }

    /// Real servers' streams: from the second content chunk on, a chunk is read against the
    /// last (only its strings), and answers what reading it alone does.
    #[test]
    fn real_streams_are_skimmed() {
        let streams: [&[&str]; 3] = [
            // OpenAI, with `obfuscation` changing in every chunk.
            &[
                r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"Xy"}"#,
                r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"abc"}"#,
                r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":" \"wor\u00e9ld\"\n"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"Q"}"#,
                r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","service_tier":"default","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"Qxyzzy"}"#,
            ],
            // vLLM.
            &[
                r#"{"id":"chatcmpl-2","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-2","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"To"},"logprobs":null,"finish_reason":null}]}"#,
                r#"{"id":"chatcmpl-2","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":" be"},"logprobs":null,"finish_reason":null}]}"#,
            ],
            // A tool call's arguments, piece by piece.
            &[
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":""}}]},"finish_reason":null}]}"#,
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"ci"}}]},"finish_reason":null}]}"#,
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ty\": 1}"}}]},"finish_reason":null}]}"#,
            ],
        ];
        for stream in streams {
            let mut skim = super::super::scan::Skim::default();
            for (i, c) in stream.iter().enumerate() {
                if i >= 2 {
                    assert!(skim.like(c.as_bytes()).is_some(), "not skimmed: {c}");
                }
                let got = skim.read(c);
                assert!(got.is_some(), "declined {c}");
                assert_eq!(got, typed(c), "{c}");
            }
        }
        // Nested past the scan's depth, an `obfuscation` string is declined as the scan
        // declines it, not learned as a hole.
        let deep = format!(
            "{}{{\"obfuscation\":\"x\"}}{}",
            "{\"a\":".repeat(64),
            "}".repeat(64)
        );
        let mut skim = super::super::scan::Skim::default();
        assert_eq!(super::super::scan::read(&deep), None);
        assert_eq!(skim.read(&deep), None);
        // Another byte outside the strings: read in full, and the new shape kept.
        let mut skim = super::super::scan::Skim::default();
        let a = r#"{"choices":[{"delta":{"content":"a"},"finish_reason":null}]}"#;
        let b = r#"{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}"#;
        skim.read(a);
        assert!(skim.like(b.as_bytes()).is_none());
        assert_eq!(skim.read(b).and_then(|p| p.finish), Some("stop"));
        assert!(skim.like(b.as_bytes()).is_some());
    }

    /// The streams of one shape the agreement above is tested on are mostly read against
    /// their shape, not only in full.
    #[test]
    fn same_shape_streams_are_mostly_skimmed() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut skimmed, mut text) = (0, 0);
        for _ in 0..300 {
            let chunks = same_shape().new_tree(&mut runner).unwrap().current();
            let mut skim = super::super::scan::Skim::default();
            for c in &chunks {
                if let Some(p) = skim.like(c.as_bytes()) {
                    skimmed += 1;
                    text += usize::from(p.text_bytes > 0);
                }
                skim.read(c);
            }
        }
        assert!(
            skimmed >= 150 && text >= 80,
            "{skimmed} skimmed, {text} with text"
        );
    }

    /// The generator reaches the typed path's answers, content and preambles both, so the
    /// agreement above is tested on them and not only on what the typed path declines.
    #[test]
    fn shaped_chunks_are_mostly_read() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut read_n, mut content, mut preamble) = (0, 0, 0);
        for _ in 0..400 {
            let data = chunk_shaped().new_tree(&mut runner).unwrap().current();
            if let Some(p) = read(&data) {
                read_n += 1;
                if p.content {
                    content += 1;
                } else {
                    preamble += 1;
                }
            }
        }
        assert!(read_n >= 100, "only {read_n} of 400 read");
        assert!(
            content >= 20 && preamble >= 20,
            "{content} content, {preamble} preambles"
        );
    }
}
