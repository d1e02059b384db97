//! Token counting speed: a ~100k-token chat request counted with o200k_base (what the gateway
//! does on the blocking pool before routing a long request). Goal: under 20 ms.
//!
//! Run: `cargo bench --bench tokens`.

use std::time::Instant;

use autohedge::tokens::{Counter, Family};
use autohedge::wire::Op;
use serde_json::{Map, Value, json};

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
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
            if counter.request(Op::Chat, &body).tokens >= 100_000 {
                break;
            }
        }
    }
    body.insert("messages".into(), Value::Array(messages));
    let tokens = counter.request(Op::Chat, &body).tokens;
    let mut times = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        std::hint::black_box(counter.request(Op::Chat, std::hint::black_box(&body)));
        times.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "count {tokens} tokens ({} messages, o200k_base): median {:.1} ms, min {:.1} ms, max {:.1} ms (goal < 20 ms)",
        body["messages"].as_array().map(Vec::len).unwrap_or(0),
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );
}
