//! Token counting speed: a ~100k-token chat request counted with o200k_base (what the gateway
//! does on the blocking pool before routing a long request). Goal: under 20 ms.
//!
//! Run: `cargo bench --bench tokens`.

use std::time::Instant;

use autohedge::tokens::{Counter, Family};
use autohedge::wire::Op;
use serde_json::{Map, Value, json};

fn main() {
    // Without `--bench` (`cargo test --benches`, as CI does): a smoke run on a ~10k-token
    // request, checked against tiktoken-rs's own count, timed and judged by no one.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let goal = if smoke { 10_000 } else { 100_000 };
    let para = "The gateway counts every prompt before it routes, so that no request is sent to an endpoint whose context window cannot hold it. Ein bisschen Deutsch, 一点中文, some code: `let x = vec![1, 2, 3];` and an emoji 🚀. ";
    let mut messages = vec![json!({"role": "system", "content": "You are a careful reviewer."})];
    let counter = Counter::Tiktoken(Family::O200k);
    let mut body = Map::new();
    let mut i = 0;
    loop {
        messages.push(json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": para.repeat(20)}));
        i += 1;
        if i % 20 == 0 {
            body.insert("messages".into(), Value::Array(messages.clone()));
            if counter.request(Op::Chat, &body).tokens >= goal {
                break;
            }
        }
    }
    body.insert("messages".into(), Value::Array(messages));
    let tokens = counter.request(Op::Chat, &body).tokens;
    // Counted, not estimated: the contents' tokens are at most the whole's, and most of it.
    let text: String = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    let reference = tiktoken_rs::o200k_base()
        .unwrap()
        .encode_ordinary(&text)
        .len() as u64;
    assert!(
        tokens >= reference && tokens < reference + reference / 10,
        "counted {tokens} tokens of a text tiktoken-rs counts {reference}"
    );
    let mut times = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        std::hint::black_box(counter.request(Op::Chat, std::hint::black_box(&body)));
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "count {tokens} tokens ({} messages, o200k_base): median {:.1} ms, min {:.1} ms, max {:.1} ms ({})",
        body["messages"].as_array().map(Vec::len).unwrap_or(0),
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        if smoke {
            "smoke run: not judged"
        } else {
            "goal < 20 ms"
        }
    );
}
