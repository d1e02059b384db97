//! Streams (SSE), against the real binary: chunks and usage pass through; a failure before the
//! first content chunk fails over unseen, one after it ends in an error event on a clean boundary;
//! only whole events reach the client, within `limits.max_event_bytes` and `max_response_bytes`;
//! `[DONE]` and `stream_timeout` end a stream; a broken stream is continued with no gap.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// A role-only chunk: stream preamble, never content.
const ROLE: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n";

/// How a raw SSE upstream ends its stream.
#[derive(Clone, Copy)]
enum Ending {
    /// Closes the connection in the middle of an HTTP chunk (a broken stream).
    Break,
    /// Sends `data:` lines with no blank line, without end (until the gateway hangs up, or
    /// `limit` bytes).
    Endless { limit: usize },
}

/// A loopback upstream speaking OpenAI's streaming wire format byte for byte: chunked HTTP/1.1,
/// `chunks` as given, then `ending`. Returns its base URL and the bytes of the ending it wrote.
async fn raw_sse_upstream(chunks: Vec<String>, ending: Ending) -> (String, Arc<AtomicU64>) {
    let up = RawUp::start(move |_| {
        let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        for c in &chunks {
            out.extend_from_slice(format!("{:x}\r\n{c}\r\n", c.len()).as_bytes());
        }
        match ending {
            Ending::Break => {
                // A chunk announced longer than what follows, then the connection goes.
                out.extend_from_slice(
                    b"400\r\ndata: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"par",
                );
                Answer::WriteClose(out)
            }
            Ending::Endless { limit } => {
                let line = format!("data: {}\n", "z".repeat(1000));
                let chunk = format!("{:x}\r\n{}\r\n", line.len() * 64, line.repeat(64));
                Answer::Stream {
                    head: out,
                    credit: chunk.len() as u64,
                    piece: chunk.into_bytes(),
                    cap: limit as u64,
                    then: Then::Close,
                }
            }
        }
    });
    (up.base(), up.written_counter())
}

fn content_event(text: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
    )
}

/// Every event of a stream the client got, each `data:` JSON or `[DONE]`; panics on any other.
fn whole_events(raw: &str) -> Vec<Value> {
    let mut p = autohedge::wire::sse::SseParser::new();
    let events = p.push(raw.as_bytes()).unwrap();
    assert!(
        !p.has_partial(),
        "the client's stream ends mid-event: {raw:?}"
    );
    events
        .iter()
        .filter(|e| e.data.trim() != "[DONE]")
        .map(|e| {
            serde_json::from_str(&e.data)
                .unwrap_or_else(|err| panic!("not JSON ({err}): {:?} in {raw:?}", e.data))
        })
        .collect()
}

/// The text a stream's chunks carried, in order (`delta.content` of their first choice).
fn delta_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect()
}

fn error_event(message: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"error": {"message": message, "type": "server_error", "code": null}})
    )
}

#[tokio::test]
async fn stream_passes_chunks_and_usage_through() {
    let a = MockUp::openai("reply: \"alpha beta gamma\"\nchunk_delay: 5ms").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "stream-ok")
        .json(&json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    let ev = sse_events(r).await;
    assert_eq!(stream_text(&ev), "alpha beta gamma");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let (tin, tout, est, ttft): (i64, i64, bool, Option<f64>) = conn
        .query_row(
            "SELECT tokens_in, tokens_out, tokens_estimated, ttft_ms FROM requests WHERE request_id = 'stream-ok'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(tout, 3);
    assert!(tin >= 1);
    assert!(!est);
    assert!(ttft.is_some());
}

#[tokio::test]
async fn stream_failures_before_first_chunk_fail_over_invisibly() {
    let b = MockUp::openai("name: b").await;
    // Each script, and how many times `a` is called: a connection closed before any answer is
    // sent once more on a fresh one (docs/errors.md), the rest once.
    for (script, calls) in [
        ("rules: [{status: 503}]", 1),
        ("rules: [{stream_error_after: 0}]", 1),
        ("rules: [{stall_after: 0}]", 1),
        ("rules: [{reset: true}]", 2),
        ("rules: [{cut_after: 0}]", 1),
        ("rules: [{body: 'not json at all', status: 200}]", 1),
    ] {
        let a = MockUp::openai(script).await;
        let gw = Gw::start(&two(&a, &b, ""));
        let b_before = b.requests().await;
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200, "{script}");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "{script}");
        let ev = sse_events(r).await;
        // `a` got the request (and failed it), and only then `b`, once.
        assert_eq!(a.requests().await, calls, "a was tried first: {script}");
        assert_eq!(b.requests().await, b_before + 1, "{script}");
        assert_eq!(stream_text(&ev), "Hello from b!", "{script}");
        let roles = ev.iter().filter(|e| e.contains("\"role\"")).count();
        assert_eq!(
            roles, 1,
            "nothing from the failed upstream reached the client: {script}"
        );
        assert_eq!(ev.last().unwrap(), "[DONE]");
    }
}

/// A stream that sends preamble (role-only chunks) without end and never any content is held
/// no further than `server.max_response_bytes` before the first content chunk: the attempt is
/// `malformed_response` and the stream fails over before anything reached the client.
#[tokio::test]
async fn a_stream_of_endless_preamble_is_cut_at_max_response_bytes_and_fails_over() {
    const CAP: u64 = 256 << 20;
    let a = Endless::start(CAP, false, Some(ROLE));
    let b = MockUp::openai("name: b\nreply: \"from b\"").await;
    let gw = Gw::start(&endless_then(&a, &b, "{ first_token: 20s, total: 30s }"));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "failed over");
    assert_eq!(stream_text(&sse_events(r).await), "from b");
    assert_cut_past(&a, 1 << 20);
    let row = first_attempt(&gw, "a").await;
    assert!(
        row.starts_with("malformed_response ")
            && row.contains("preamble larger than 1048576 bytes"),
        "{row}"
    );
    assert_no_panic(&gw);
}

#[tokio::test]
async fn mid_stream_failure_ends_with_an_error_event() {
    let b = MockUp::openai("name: b").await;
    for (script, code) in [
        ("rules: [{reset_after: 2}]", "stream_broken"),
        ("rules: [{stall_after: 2}]", "stream_stalled"),
        ("rules: [{cut_after: 2}]", "stream_truncated"),
    ] {
        let a = MockUp::openai(&format!("reply: \"one two three four five\"\n{script}")).await;
        let gw = Gw::start(&two(&a, &b, ""));
        let r = reqwest::Client::new()
            .post(gw.url("/v1/chat/completions"))
            .header("x-request-id", "mid-1")
            .json(&json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
        let ev = sse_events(r).await;
        assert_eq!(stream_text(&ev), "one two ", "{script}");
        let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
        assert_eq!(last["error"]["code"], code, "{script}");
        assert!(!ev.contains(&"[DONE]".to_string()));
        assert_eq!(b.requests().await, 0, "no failover after the first byte");
        let mut gw = gw;
        gw.stop();
        let conn = rusqlite::Connection::open(gw.db()).unwrap();
        let class: String = one(
            &conn,
            "SELECT error_class FROM requests WHERE request_id = 'mid-1'",
        );
        assert_eq!(class, code);
    }
}

/// An upstream that breaks in the middle of an event: the client gets the whole events before
/// it, then the gateway's error event on a clean boundary; the half event never reaches it.
#[tokio::test]
async fn a_stream_broken_mid_event_reaches_the_client_as_whole_events() {
    // The event before the break comes in two pieces, its blank line in the second.
    let first = content_event("Hello ");
    let (a, b) = first.split_at(20);
    let (base, _) = raw_sse_upstream(
        vec![a.to_string(), b.to_string(), content_event("world ")],
        Ending::Break,
    )
    .await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{base}\" }}\n"
    ));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let events = whole_events(&raw);
    let text = delta_text(&events);
    assert_eq!(text, "Hello world ", "{raw}");
    assert!(
        !raw.contains(":\"par"),
        "the half event reached the client: {raw}"
    );
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "stream_broken", "{raw}");
}

/// An upstream that sends `data:` lines without the blank line that ends an event, without end:
/// the gateway holds at most `limits.max_event_bytes` of it, passes none of it on, ends the
/// client's stream with `stream_broken` and hangs up on the upstream; its memory stays flat.
/// Before the first content chunk the same upstream is failed over.
#[tokio::test]
async fn an_endless_event_is_cut_at_max_event_bytes_and_memory_stays_bounded() {
    const LIMIT: usize = 300 * 1024 * 1024;
    let (endless, wrote) = raw_sse_upstream(
        vec![content_event("Hello ")],
        Ending::Endless { limit: LIMIT },
    )
    .await;
    let (early, early_wrote) = raw_sse_upstream(vec![], Ending::Endless { limit: LIMIT }).await;
    let b = MockUp::openai("name: b\nreply: \"served by b\"").await;
    let gw = Gw::start(&format!(
        "models:\n  endless: {{ type: openai, base_url: \"{endless}\" }}\n  early: {{ type: openai, base_url: \"{early}\" }}\n  b: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  late: [endless, b]\n  first: [early, b]\nlimits: {{ max_event_bytes: 1048576 }}\n",
        b.base()
    ));
    let ask = |model: &str| json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    // Warm up every path once (code pages, pools, the allocator's first arenas), then measure
    // what a second 300 MB event costs.
    let _ = gw.chat("b", "x").await.text().await;
    for model in ["late", "first"] {
        let _ = gw
            .post("/v1/chat/completions", ask(model))
            .await
            .text()
            .await;
    }
    let rss_before = rss_kb(gw.pid());

    let r = gw.post("/v1/chat/completions", ask("late")).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "endless");
    let raw = r.text().await.unwrap();
    assert!(
        wrote.load(Ordering::SeqCst) > 1024 * 1024,
        "the upstream sent past the limit"
    );
    assert!(
        raw.len() < 1024 * 1024,
        "the client got {} bytes",
        raw.len()
    );
    assert!(
        !raw.contains("zzzz"),
        "none of the unfinished event passed on"
    );
    let events = whole_events(&raw);
    assert_eq!(events[0]["choices"][0]["delta"]["content"], "Hello ");
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "stream_broken", "{raw}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("max_event_bytes"),
        "{last}"
    );
    // The gateway hung up: the upstream could not write its 300 MB.
    let ok = eventually(Duration::from_secs(10), || async {
        let a = wrote.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        wrote.load(Ordering::SeqCst) == a
    })
    .await;
    assert!(ok);
    assert!((wrote.load(Ordering::SeqCst) as usize) < LIMIT / 4);

    // Before the first content chunk: an attempt that fails over, invisibly.
    let r = gw.post("/v1/chat/completions", ask("first")).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let raw = r.text().await.unwrap();
    assert!(raw.contains("served"), "{raw}");
    assert!(early_wrote.load(Ordering::SeqCst) > 1024 * 1024);

    let grown_mb = rss_kb(gw.pid()).saturating_sub(rss_before) / 1024;
    assert!(grown_mb < 32, "RSS grew by {grown_mb} MiB");
}

#[tokio::test]
async fn done_ends_the_stream_even_when_the_upstream_holds_the_connection() {
    let a = MockUp::openai("name: a\nrules: [{when: {stream: true}, hold_after_done: true}]").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", timeouts: {{ first_token: 3s, total: 20s }} }}\n",
        a.base()
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "held")
        .json(
            &json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(r).await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        !events.iter().any(|e| e.contains("stream_stalled")),
        "{events:?}"
    );
    assert_eq!(stream_text(&events), "Hello from a!");
    gw.stop();
    let got = audit_rows(
        &gw,
        "SELECT status, error_class FROM requests WHERE request_id = 'held'",
    );
    assert_eq!(got, vec![vec![json!(200), Value::Null]]);
}

#[tokio::test]
async fn a_committed_stream_past_timeouts_total_ends_with_stream_timeout() {
    let a = MockUp::openai(
        "name: slow\nreply: \"one two three four five six seven eight\"\nchunk_delay: 500ms",
    )
    .await;
    // The first content comes about 500 ms in, 2 s inside `total` (a busy machine's slack);
    // the eight chunks take at least 4 s, so the stream cannot end before `total` either.
    let mut gw = Gw::start(&format!(
        "models:\n{}",
        ep("a", &a, ", timeouts: { first_token: 5s, total: 2500ms }")
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "too-long")
        .json(
            &json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "committed on the first chunk");
    let events = sse_events(r).await;
    assert!(
        !stream_text(&events).is_empty(),
        "content reached the client"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "stream_timeout", "{events:?}");
    gw.stop();
    assert_eq!(
        db_rows(
            &gw,
            "SELECT error_class FROM requests WHERE request_id = 'too-long'"
        ),
        vec!["stream_timeout"]
    );
}

#[tokio::test]
async fn a_broken_stream_is_continued_on_an_endpoint_that_can_and_spliced_into_one() {
    let reply = "one two three four five six seven";
    let a = MockUp::openai(&format!(
        "reply: \"{reply}\"\nrules: [{{when: {{stream: true}}, reset_after: 3}}]"
    ))
    .await;
    // An OpenAI endpoint cannot continue an assistant message: never used for it.
    let b = MockUp::openai(&format!("reply: \"{reply}\"")).await;
    let c = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        &format!("reply: \"{reply}\""),
    )
    .await;
    let cfg = format!(
        "models:\n{}{}  c: {{ type: vllm, base_url: \"{}\" }}\nroutes:\n  chat:\n    chain: [a, b, c]\n    continue_streams: true\n  plain: [a, b, c]\n",
        ep("a", &a, ""),
        ep("b", &b, ""),
        c.base()
    );
    let mut gw = Gw::start(&cfg);
    let ask = |model: &str| json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "count"}]});
    let r = gw.chat_id("continued", ask("chat")).await;
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let mut p = autohedge::wire::sse::SseParser::new();
    let events: Vec<String> = p
        .push(raw.as_bytes())
        .unwrap()
        .into_iter()
        .map(|e| e.data)
        .collect();
    // a really broke after three words, and c was asked to continue exactly that text.
    assert_eq!(a.requests().await, 1);
    assert_eq!(b.requests().await, 0, "b cannot continue");
    assert_eq!(c.requests().await, 1);
    let sent = c.stats().await["last_body"].clone();
    assert_eq!(sent["continue_final_message"], true, "{sent}");
    assert_eq!(sent["add_generation_prompt"], false);
    let last = sent["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        last,
        json!({"role": "assistant", "content": "one two three "})
    );
    // The client saw one stream: the whole text once, one finish_reason, one id, one [DONE].
    assert_eq!(stream_text(&events), reply, "{raw}");
    let chunks: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let finishes = chunks
        .iter()
        .filter(|v| !v["choices"][0]["finish_reason"].is_null() && v["choices"][0].is_object())
        .count();
    assert_eq!(finishes, 1, "{raw}");
    let ids: std::collections::BTreeSet<String> =
        chunks.iter().map(|v| v["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one stream identity: {ids:?}");
    assert_eq!(events.iter().filter(|e| e.trim() == "[DONE]").count(), 1);
    assert!(!raw.contains("\"error\""), "no error event: {raw}");
    assert!(
        raw.contains(": autohedge: continued on c after a broke (stream_broken)"),
        "{raw}"
    );
    // Without continue_streams the same break ends the stream with an error event.
    let r = gw.post("/v1/chat/completions", ask("plain")).await;
    let raw = r.text().await.unwrap();
    assert!(raw.contains("stream_broken"), "{raw}");
    assert_eq!(c.requests().await, 1, "not continued");
    // With tools it is not continued either.
    let mut with_tools = ask("chat");
    with_tools["tools"] =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let raw = gw
        .post("/v1/chat/completions", with_tools)
        .await
        .text()
        .await
        .unwrap();
    assert!(raw.contains("stream_broken"), "{raw}");
    assert_eq!(c.requests().await, 1);
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, continued_from, status FROM requests WHERE request_id = 'continued'"
        ),
        vec!["c:a:200"]
    );
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'continued' ORDER BY seq"
        ),
        vec!["a:ok", "a:stream_broken", "c:ok"]
    );
}

/// A continuation is invisible: when one upstream read holds both content and an in-band error,
/// the client still gets that content, then the continuation (no gap); the audit row and the
/// key's bill hold both legs' tokens.
#[tokio::test]
async fn a_continued_stream_has_no_gap_and_both_legs_are_billed() {
    let both = format!("{}{}", content_event("there "), error_event("engine died"));
    let (brk, _) = raw_sse_upstream(vec![content_event("Hello "), both], Ending::Break).await;
    let cont = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        "reply: \"Hello there my old friend\"",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  brk: {{ type: vllm, base_url: \"{brk}\", cost: {{ input_per_mtok: 0, output_per_mtok: 1000000 }} }}\n  cont: {{ type: vllm, base_url: \"{}\", cost: {{ input_per_mtok: 0, output_per_mtok: 1000000 }} }}\nroutes:\n  chat:\n    chain: [brk, cont]\n    continue_streams: true\nauth:\n  keys:\n    - {{ name: team, key: sk-team-cont-000000 }}\n",
        cont.base()
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth("sk-team-cont-000000")
        .header("x-request-id", "cont-1")
        .json(
            &json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "greet"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let events = whole_events(&raw);
    let text = delta_text(&events);
    assert_eq!(cont.requests().await, 1, "cont carried the stream on");
    let sent = cont.stats().await["last_body"].clone();
    let prefix = sent["messages"].as_array().unwrap().last().unwrap()["content"].clone();
    assert_eq!(
        prefix, "Hello there ",
        "cont was asked to go on from what the client has"
    );
    assert_eq!(text, "Hello there my old friend", "{raw}");
    assert!(!raw.contains("engine died"), "{raw}");
    // The second leg's own usage, as the client saw it.
    let second = events
        .iter()
        .filter_map(|v| v["usage"]["completion_tokens"].as_u64())
        .next_back()
        .expect("usage chunk");
    let status = gw.status().await;
    let spent = status["auth"]["spend_this_month_usd"]["team"]
        .as_f64()
        .unwrap_or(0.0);
    gw.stop();
    let row = audit_rows(
        &gw,
        "SELECT tokens_out, cost_usd, continued_from FROM requests WHERE request_id = 'cont-1'",
    );
    // The first leg's "Hello there " (12 characters: 3 tokens estimated) plus the second's.
    assert_eq!(row[0][0], json!(3 + second), "{row:?}");
    assert_eq!(row[0][2], json!("brk"));
    let cost = row[0][1].as_f64().unwrap();
    assert!((cost - (3 + second) as f64).abs() < 1e-9, "{cost}");
    assert!(
        (spent - cost).abs() < 1e-9,
        "billed both legs: {spent} vs {cost}"
    );
}

/// An upstream read that turns out unreadable is dropped whole, so nothing in it counts: when
/// one read holds a content event and then an event over `limits.max_event_bytes`, the client
/// never gets that content, and the continuation is asked to go on from what the client has —
/// not from text it never got.
///
/// Fails if: `PassThrough::scan` (src/executor/stream.rs) applies what a read's events teach
/// (text, usage, finish, the continuation's watch) before the read has parsed whole: `cont` is
/// then asked to continue "Hello there " and the client's text skips "there ".
#[tokio::test]
async fn an_unreadable_read_teaches_nothing_of_its_events() {
    let both = format!("{}data: {}\n\n", content_event("there "), "x".repeat(2000));
    let (brk, _) = raw_sse_upstream(vec![content_event("Hello "), both], Ending::Break).await;
    let cont = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        "reply: \"Hello my old friend\"",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  brk: {{ type: vllm, base_url: \"{brk}\" }}\n  cont: {{ type: vllm, base_url: \"{}\" }}\nroutes:\n  chat:\n    chain: [brk, cont]\n    continue_streams: true\nlimits:\n  max_event_bytes: 1024\n",
        cont.base()
    ));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "greet"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let events = whole_events(&raw);
    let text = delta_text(&events);
    // The read was refused and the stream carried on by `cont`.
    assert_eq!(
        cont.requests().await,
        1,
        "cont carried the stream on: {raw}"
    );
    assert!(raw.contains("continued on cont after brk broke"), "{raw}");
    let sent = cont.stats().await["last_body"].clone();
    let prefix = sent["messages"].as_array().unwrap().last().unwrap()["content"].clone();
    assert_eq!(prefix, "Hello ", "cont goes on from what the client has");
    assert_eq!(text, "Hello my old friend", "{raw}");
    assert!(!raw.contains("there"), "{raw}");
    gw.stop();
}

/// One continuation per request: a committed stream that breaks on `a` is continued on `c1`;
/// when the continuation breaks too, it is not continued again — not on `c2` (able to continue,
/// healthy, next in the chain) nor on `c1` once more — and the client's stream ends with the
/// `stream_broken` error event after the text both legs sent.
///
/// docs/routing.md ("Stream continuation"): "A comment `: autohedge: continued on B after A
/// broke (class)` precedes `data: [DONE]`; the audit row has `continued_from` (its `endpoint` is
/// the one that finished) and the attempts `A ok, A stream_broken, B ok`. One continuation per
/// request; if none can continue, the stream ends with the error event as before."
///
/// Fails if: `PassThrough::continue_stream` (src/executor/stream.rs) stops refusing a second
/// splice (the `c.spliced` check, or `spliced = true`, removed): the second break is then
/// carried on — on `c1` again (its break rule holds once, so it would answer the rest) or on
/// `c2` — and the client gets the whole reply with no error event.
#[tokio::test]
async fn a_continuation_that_breaks_is_not_continued_again() {
    use serde_json::Value;

    let reply = "one two three four five six seven";
    // `a` breaks after three words; `c1` continues ("four five six seven") and breaks after two
    // (once: a second continuation sent to it would be answered whole); `c2` never breaks.
    let a = MockUp::openai(&format!(
        "reply: \"{reply}\"\nrules: [{{when: {{stream: true}}, reset_after: 3}}]"
    ))
    .await;
    let c1 = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        &format!(
            "reply: \"{reply}\"\nrules: [{{when: {{stream: true}}, reset_after: 2, times: 1}}]"
        ),
    )
    .await;
    let c2 = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        &format!("reply: \"{reply}\""),
    )
    .await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n  c1: {{ type: vllm, base_url: \"{}\" }}\n  c2: {{ type: vllm, base_url: \"{}\" }}\nroutes:\n  chat:\n    chain: [a, c1, c2]\n    continue_streams: true\nhealth: {{ probe_interval: 1h }}\n",
        a.base(),
        c1.base(),
        c2.base()
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    let r = gw
        .chat_id(
            "twice-broken",
            serde_json::json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "count"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    let raw = r.text().await.unwrap();
    let mut p = autohedge::wire::sse::SseParser::new();
    let events: Vec<String> = p
        .push(raw.as_bytes())
        .unwrap()
        .into_iter()
        .map(|e| e.data)
        .collect();

    // The first break was continued: `a` broke after three words and `c1` was asked to carry
    // exactly that text on.
    assert_eq!(a.requests().await, 1);
    assert_eq!(c1.requests().await, 1, "continued once on c1");
    let sent = c1.stats().await["last_body"].clone();
    assert_eq!(sent["continue_final_message"], true, "{sent}");
    let last = sent["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["role"], "assistant", "{sent}");
    assert_eq!(last["content"], "one two three ", "{sent}");
    // The client got both legs' words, then the continuation broke too …
    assert_eq!(stream_text(&events), "one two three four five ", "{raw}");
    // … and was not continued a second time: the stream ends with the error event.
    assert_eq!(c2.requests().await, 0, "no second continuation on c2");
    assert_eq!(c1.requests().await, 1, "no second continuation on c1");
    let last_event: Value = events
        .iter()
        .rev()
        .find_map(|e| serde_json::from_str::<Value>(e).ok())
        .unwrap_or(Value::Null);
    assert_eq!(last_event["error"]["code"], "stream_broken", "{raw}");
    assert!(!raw.contains("continued on"), "no splice note: {raw}");

    gw.stop();
    let row = audit_rows(
        &gw,
        "SELECT endpoint, continued_from, error_class FROM requests WHERE request_id = 'twice-broken'",
    );
    assert_eq!(
        row,
        vec![vec![
            Value::from("c1"),
            Value::from("a"),
            Value::from("stream_broken")
        ]],
        "the row names the continuing endpoint and the break it ended with"
    );
    let attempts: Vec<String> = audit_rows(
        &gw,
        "SELECT endpoint || ':' || class FROM attempts WHERE request_id = 'twice-broken' ORDER BY seq",
    )
    .into_iter()
    .map(|r| r[0].as_str().unwrap_or("").to_string())
    .collect();
    assert_eq!(
        attempts,
        vec!["a:ok", "a:stream_broken", "c1:ok", "c1:stream_broken"],
        "c2 never attempted"
    );
}

/// Streams that end with `[DONE]` and then their body give the upstream connection back to the
/// pool: twenty streams one after another take one or two connections of the upstream, not
/// twenty (each new connection was a third of a stream's cost); one the upstream holds open
/// after `[DONE]` is not waited on by the client.
#[tokio::test]
async fn streams_reuse_their_upstream_connection() {
    let a = MockUp::openai("name: a\nreply: \"one two three\"").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 1h }}\n",
        a.base()
    ));
    gw.ready().await;
    let before = a.stats().await["connections"].as_u64().unwrap();
    let client = reqwest::Client::new();
    for i in 0..20 {
        let r = client
            .post(gw.url("/v1/chat/completions"))
            .json(&json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": format!("x{i}")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let events = sse_events(r).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        assert_eq!(stream_text(&events), "one two three");
        // The end of the body may follow `[DONE]` by a moment: read on a task of its own.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = a.stats().await;
    assert_eq!(
        stats["by_path"]["/v1/chat/completions"], 20,
        "every stream reached it"
    );
    let opened = stats["connections"].as_u64().unwrap() - before;
    assert!(opened <= 2, "{opened} connections for 20 streams");
}
