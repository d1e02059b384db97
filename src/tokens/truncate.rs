//! Semantic truncation: when no endpoint's window holds a conversation, trim it the way a careful
//! engineer would. System messages stay whole; the latest `keep_turns` user turns stay whole;
//! older messages go first where they are least related to the latest user message (BM25); an
//! assistant `tool_calls` message and its `tool` results go together or not at all; messages are
//! dropped whole, so a fenced code block is never split.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::Counter;

#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// User turns (a user message and the answers after it) kept whole at the end.
    pub keep_turns: usize,
    /// Insert one short system note saying earlier context was omitted.
    pub note: bool,
}

#[derive(Debug, PartialEq)]
pub struct Truncated {
    pub messages: Vec<Value>,
    pub dropped_messages: usize,
    pub dropped_tokens: u64,
    pub tokens: u64,
}

#[derive(Debug, PartialEq)]
pub struct CannotFit {
    /// Tokens left after dropping everything that may be dropped.
    pub minimum: u64,
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn text_of(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// Lowercased alphanumeric terms (identifiers keep their underscores).
fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|t| !t.is_empty())
        .map(|t| t.to_lowercase())
        .collect()
}

/// BM25 scores of `docs` against `query` (k1 = 1.2, b = 0.75, the usual defaults).
pub fn bm25(query: &str, docs: &[String]) -> Vec<f64> {
    const K1: f64 = 1.2;
    const B: f64 = 0.75;
    let docs_terms: Vec<Vec<String>> = docs.iter().map(|d| terms(d)).collect();
    let n = docs_terms.len() as f64;
    let avg = (docs_terms.iter().map(Vec::len).sum::<usize>() as f64 / n.max(1.0)).max(1.0);
    let mut df: HashMap<&str, f64> = HashMap::new();
    for d in &docs_terms {
        let mut seen: Vec<&str> = d.iter().map(String::as_str).collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            *df.entry(t).or_default() += 1.0;
        }
    }
    let mut q = terms(query);
    q.sort_unstable();
    q.dedup();
    docs_terms
        .iter()
        .map(|d| {
            let len = d.len() as f64;
            q.iter()
                .map(|t| {
                    let f = d.iter().filter(|x| *x == t).count() as f64;
                    if f == 0.0 {
                        return 0.0;
                    }
                    let dfi = df.get(t.as_str()).copied().unwrap_or(0.0);
                    let idf = ((n - dfi + 0.5) / (dfi + 0.5) + 1.0).ln();
                    idf * f * (K1 + 1.0) / (f + K1 * (1.0 - B + B * len / avg))
                })
                .sum()
        })
        .collect()
}

/// Messages grouped into units that are kept or dropped together.
fn units(messages: &[Value]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let start = i;
        let has_calls = role(&messages[i]) == "assistant"
            && messages[i]
                .get("tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|c| !c.is_empty());
        i += 1;
        if has_calls {
            while i < messages.len() && role(&messages[i]) == "tool" {
                i += 1;
            }
        }
        out.push(start..i);
    }
    out
}

pub fn omission_note(dropped: usize) -> Value {
    json!({"role": "system", "content": format!("[Note: {dropped} earlier message(s) of this conversation were omitted to fit the model's context window.]")})
}

/// Trims `messages` until their count (with `fixed` tokens of tools and reply priming) fits
/// `budget`.
pub fn truncate(
    messages: &[Value],
    budget: u64,
    fixed: u64,
    counter: &Counter,
    opts: Options,
) -> Result<Truncated, CannotFit> {
    let per_msg: Vec<u64> = messages.iter().map(|m| counter.message(m)).collect();
    let total: u64 = fixed + per_msg.iter().sum::<u64>();
    if total <= budget {
        return Ok(Truncated {
            messages: messages.to_vec(),
            dropped_messages: 0,
            dropped_tokens: 0,
            tokens: total,
        });
    }
    let units = units(messages);
    let is_system =
        |u: &std::ops::Range<usize>| matches!(role(&messages[u.start]), "system" | "developer");
    // The protected tail starts at the keep_turns-th last user unit.
    let user_units: Vec<usize> = units
        .iter()
        .enumerate()
        .filter(|(_, u)| role(&messages[u.start]) == "user")
        .map(|(i, _)| i)
        .collect();
    let protect_from = if user_units.is_empty() {
        units.len().saturating_sub(opts.keep_turns.max(1))
    } else {
        user_units[user_units.len().saturating_sub(opts.keep_turns.max(1))]
    };
    let droppable: Vec<usize> = (0..protect_from)
        .filter(|i| !is_system(&units[*i]))
        .collect();
    let query = user_units
        .last()
        .map(|i| text_of(&messages[units[*i].start]))
        .unwrap_or_default();
    let docs: Vec<String> = droppable
        .iter()
        .map(|i| {
            units[*i]
                .clone()
                .map(|j| text_of(&messages[j]))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let scores = bm25(&query, &docs);
    // Least related first; among equals, the oldest first.
    let mut order: Vec<usize> = (0..droppable.len()).collect();
    order.sort_by(|a, b| scores[*a].total_cmp(&scores[*b]).then(a.cmp(b)));

    let unit_tokens = |u: usize| -> u64 { units[u].clone().map(|j| per_msg[j]).sum() };
    let mut dropped_units = vec![false; units.len()];
    let mut current = total;
    let mut dropped_msgs = 0usize;
    let note_cost = |n: usize| {
        if opts.note {
            counter.message(&omission_note(n))
        } else {
            0
        }
    };
    for k in order {
        if dropped_msgs > 0 && current + note_cost(dropped_msgs) <= budget {
            break;
        }
        let u = droppable[k];
        dropped_units[u] = true;
        current -= unit_tokens(u);
        dropped_msgs += units[u].len();
    }
    let with_note = current
        + if dropped_msgs > 0 {
            note_cost(dropped_msgs)
        } else {
            0
        };
    if with_note > budget {
        return Err(CannotFit { minimum: with_note });
    }
    let mut out = Vec::with_capacity(messages.len() - dropped_msgs + 1);
    let mut note_placed = !opts.note || dropped_msgs == 0;
    for (i, u) in units.iter().enumerate() {
        if !note_placed && !is_system(u) {
            out.push(omission_note(dropped_msgs));
            note_placed = true;
        }
        if !dropped_units[i] {
            out.extend(messages[u.clone()].iter().cloned());
        }
    }
    if !note_placed {
        out.push(omission_note(dropped_msgs));
    }
    Ok(Truncated {
        messages: out,
        dropped_messages: dropped_msgs,
        dropped_tokens: total - current,
        tokens: with_note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Family;

    fn convo() -> Vec<Value> {
        let mut m = vec![json!({"role": "system", "content": "You are a senior Rust reviewer."})];
        for i in 0..6 {
            m.push(json!({"role": "user", "content": format!("Question {i} about gardening tomatoes and watering schedules {}", "lorem ipsum ".repeat(20))}));
            m.push(json!({"role": "assistant", "content": format!("Answer {i} about plants {}", "dolor sit amet ".repeat(20))}));
        }
        // An old but relevant exchange with a code block.
        m.insert(3, json!({"role": "user", "content": "Here is my tokio channel code:\n```rust\nlet (tx, rx) = tokio::sync::mpsc::channel(16);\n```"}));
        m.insert(4, json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run_clippy", "arguments": "{}"}}]}));
        m.insert(5, json!({"role": "tool", "tool_call_id": "c1", "content": "clippy: no warnings for tokio channel"}));
        m.push(json!({"role": "user", "content": "Why does my tokio channel block when the buffer is full?"}));
        m
    }

    #[test]
    fn keeps_system_latest_turns_and_relevant_history() {
        let c = Counter::Tiktoken(Family::O200k);
        let msgs = convo();
        let full: u64 = msgs.iter().map(|m| c.message(m)).sum::<u64>() + 3;
        let budget = full / 2;
        let t = truncate(
            &msgs,
            budget,
            3,
            &c,
            Options {
                keep_turns: 2,
                note: true,
            },
        )
        .unwrap();
        assert!(t.tokens <= budget, "{} > {budget}", t.tokens);
        assert!(t.dropped_messages > 0);
        assert_eq!(
            t.messages[0], msgs[0],
            "system message kept whole and first"
        );
        assert!(
            t.messages[1]["content"]
                .as_str()
                .unwrap()
                .contains("omitted")
        );
        // The latest two user turns are intact at the end.
        let n = msgs.len();
        assert_eq!(t.messages.last(), msgs.last());
        assert_eq!(t.messages[t.messages.len() - 2], msgs[n - 2]);
        assert_eq!(t.messages[t.messages.len() - 3], msgs[n - 3]);
        // The relevant tokio exchange outranks the gardening chatter.
        assert!(
            t.messages
                .iter()
                .any(|m| text_of(m).contains("tokio::sync::mpsc"))
        );
        // Tool call and its result stay together.
        let has_call = t.messages.iter().any(|m| m.get("tool_calls").is_some());
        let has_result = t.messages.iter().any(|m| role(m) == "tool");
        assert_eq!(has_call, has_result);
        // Code fences are balanced in every kept message.
        for m in &t.messages {
            assert_eq!(text_of(m).matches("```").count() % 2, 0);
        }
        assert_eq!(
            t.dropped_tokens + t.tokens,
            full + c.message(&omission_note(t.dropped_messages))
        );
    }

    #[test]
    fn refuses_when_even_the_protected_part_is_too_big() {
        let c = Counter::Estimate;
        let msgs = vec![
            json!({"role": "system", "content": "x".repeat(400)}),
            json!({"role": "user", "content": "y".repeat(400)}),
        ];
        let e = truncate(
            &msgs,
            50,
            3,
            &c,
            Options {
                keep_turns: 2,
                note: false,
            },
        )
        .unwrap_err();
        assert!(e.minimum > 50);
    }

    #[test]
    fn bm25_prefers_matching_documents() {
        let s = bm25(
            "tokio channel",
            &[
                "gardening tips".into(),
                "a tokio channel example".into(),
                "tokio".into(),
            ],
        );
        assert!(s[1] > s[2] && s[2] > s[0]);
        assert_eq!(s[0], 0.0);
    }
}
