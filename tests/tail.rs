//! Beating the tail, against the real binary: hedged requests (the loser's connection really
//! closed), the hedge budget, routing away before a 429 the upstream's headers announced, and
//! slow start after a recovery. Each test shows the upstream was called (or not) before judging
//! what the gateway made of it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn ep(name: &str, m: &MockUp, extra: &str) -> String {
    format!(
        "  {name}: {{ type: openai, base_url: \"{}\"{extra} }}\n",
        m.base()
    )
}

fn rows(gw: &Gw, sql: &str) -> Vec<String> {
    audit_rows(gw, sql)
        .into_iter()
        .map(|r| {
            r.iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(":")
        })
        .collect()
}

/// An upstream that answers probes (`GET`) but never answers a `POST`: it reports when the
/// gateway sent one, and when the gateway closed that connection.
struct Silent {
    addr: std::net::SocketAddr,
    posted: tokio::sync::mpsc::UnboundedReceiver<Instant>,
    closed: tokio::sync::mpsc::UnboundedReceiver<Instant>,
}

async fn silent_upstream() -> Silent {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (ptx, posted) = tokio::sync::mpsc::unbounded_channel();
    let (ctx, closed) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let (ptx, ctx) = (ptx.clone(), ctx.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut seen = Vec::new();
                loop {
                    let n = match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                if seen.starts_with(b"GET") {
                    let body =
                        r#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"x"}]}"#;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(resp.as_bytes()).await;
                    return;
                }
                let _ = ptx.send(Instant::now());
                // Hold the request: read until the gateway closes the connection.
                loop {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => {
                            let _ = ctx.send(Instant::now());
                            return;
                        }
                        Ok(_) => {}
                    }
                }
            });
        }
    });
    Silent {
        addr,
        posted,
        closed,
    }
}

#[tokio::test]
async fn a_hedge_wins_over_a_silent_upstream_whose_connection_is_then_closed() {
    let mut slow = silent_upstream().await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n  slow: {{ type: openai, base_url: \"http://{}/v1\" }}\n{}routes:\n  chat:\n    chain: [slow, fast]\n    hedge: {{ after: 150ms, max_extra: 100% }}\n",
        slow.addr,
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let t0 = Instant::now();
    let r = gw
        .chat_id(
            "hedge-1",
            json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let served_after = t0.elapsed();
    let answered_at = Instant::now();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "fast");
    assert_eq!(header(&r, "x-autohedge-hedged"), "true");
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    let body: Value = r.json().await.unwrap();
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("fast")
    );
    // The first attempt really went out, and the hedge only after the delay.
    let posted = tokio::time::timeout(Duration::from_secs(10), slow.posted.recv())
        .await
        .expect("the slow upstream got the request")
        .unwrap();
    // The first attempt went out before the answer came, and the answer only after the hedge
    // delay: the hedge waited.
    assert!(
        posted < answered_at,
        "the first attempt was sent before the answer"
    );
    assert!(
        served_after >= Duration::from_millis(150),
        "{served_after:?}"
    );
    assert_eq!(fast.requests().await, 1);
    // The loser's connection is closed by the gateway (the silent upstream never answers, and
    // the gateway still runs), so a metered API would stop generating.
    tokio::time::timeout(Duration::from_secs(10), slow.closed.recv())
        .await
        .expect("the gateway closed the losing connection")
        .unwrap();
    let st = gw.status().await;
    assert_eq!(st["hedging"]["route:chat"]["sent"], 1, "{}", st["hedging"]);
    assert_eq!(st["hedging"]["route:chat"]["won"], 1);
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'hedge-1' ORDER BY seq"
        ),
        vec!["slow:hedge_cancelled", "fast:ok"]
    );
    assert_eq!(
        rows(
            &gw,
            "SELECT hedges, hedge_won FROM requests WHERE request_id = 'hedge-1'"
        ),
        vec!["1:1"]
    );
}

#[tokio::test]
async fn a_stream_is_hedged_before_its_first_chunk_and_served_once() {
    let slow = MockUp::openai("name: slow\nrules: [{when: {stream: true}, delay: 3s}]").await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  chat:\n    chain: [slow, fast]\n    hedge: {{ after: 100ms, max_extra: 100% }}\n",
        ep("slow", &slow, ""),
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let r = gw
        .chat_id(
            "hedge-stream",
            json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-hedged"), "true");
    let events = sse_events(r).await;
    assert_eq!(
        events.iter().filter(|e| e.trim() == "[DONE]").count(),
        1,
        "one stream, one end"
    );
    assert!(stream_text(&events).contains("fast"), "{events:?}");
    assert!(!stream_text(&events).contains("slow"));
    assert_eq!((slow.requests().await, fast.requests().await), (1, 1));
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'hedge-stream' ORDER BY seq"
        ),
        vec!["slow:hedge_cancelled", "fast:ok"]
    );
}

#[tokio::test]
async fn the_budget_bounds_hedges_and_tools_hedge_only_when_allowed() {
    let slow = MockUp::openai("name: slow\nrules: [{delay: 200ms}]").await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  tenth:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 10% }}\n  notools:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 100% }}\n  tools:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 100%, tools: true }}\n",
        ep("slow", &slow, ""),
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let mut hedged = Vec::new();
    for i in 0..20 {
        let r = gw.chat("tenth", "x").await;
        assert_eq!(r.status(), 200);
        if header(&r, "x-autohedge-hedged") == "true" {
            hedged.push(i + 1);
        }
    }
    // Every request was slow enough to hedge: the budget alone decided. It starts empty and
    // each request pays a tenth of a hedge.
    assert_eq!(hedged, vec![10, 20]);
    assert_eq!(
        slow.requests().await,
        20,
        "every request tried the slow one first"
    );
    let tool =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    for (route, expect) in [("notools", ""), ("tools", "true")] {
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": route, "messages": [{"role": "user", "content": "x"}], "tools": tool}),
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-autohedge-hedged"), expect, "{route}");
    }
    let st = gw.status().await;
    assert_eq!(st["hedging"]["route:tenth"]["requests"], 20);
    assert_eq!(st["hedging"]["route:tenth"]["sent"], 2);
    assert!(
        st["hedging"].get("route:notools").is_none(),
        "{}",
        st["hedging"]
    );
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT sum(hedges), sum(hedge_won) FROM requests WHERE requested_model = 'tenth'"
        ),
        vec!["2:2"]
    );
}

#[tokio::test]
async fn an_exhausted_budget_in_the_headers_routes_away_before_the_429() {
    // The first answer says no request is left for 20 s (OpenAI's headers on a 200).
    let announce = r#"{times: 1, headers: {x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "20s", x-ratelimit-limit-requests: ""}}"#;
    let a = MockUp::openai(&format!("name: a\nrules: [{announce}]")).await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  chat: [a, b]\n  only_a: [a]\n",
        ep("a", &a, ""),
        ep("b", &b, "")
    );
    let mut gw = Gw::start(&cfg);
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(a.requests().await, 1);
    let r = gw
        .chat_id(
            "predicted",
            json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(
        header(&r, "x-autohedge-attempts"),
        "1",
        "no call spent on a 429"
    );
    assert_eq!(a.requests().await, 1, "a was not called");
    let st = gw.status().await;
    let rl = &st["endpoints"]["a"]["ratelimit"][0];
    assert_eq!(rl["key"], "no key", "{rl}");
    assert!(rl["blocked_for_ms"].as_u64().unwrap() > 10_000, "{rl}");
    // A prediction alone never makes a 503: with nothing else left, `a` is tried anyway.
    let r = gw
        .chat_id(
            "last-resort",
            json!({"model": "only_a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(a.requests().await, 2);
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'predicted' ORDER BY seq"
        ),
        vec!["a:skipped_ratelimit_predicted", "b:ok"]
    );
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'last-resort' ORDER BY seq"
        ),
        vec!["a:skipped_ratelimit_predicted", "a:ok"]
    );
}

/// With `max_wait` set and only predicted-short endpoints left, the request waits for the
/// predicted refill (here 1.5 s) and then calls the endpoint once, instead of trying it at once
/// into a likely 429. The wait is checked from below only.
#[tokio::test]
async fn max_wait_waits_for_a_predicted_refill() {
    let announce = r#"{times: 1, headers: {x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "1500ms", x-ratelimit-limit-requests: ""}}"#;
    let a = MockUp::openai(&format!("name: a\nrules: [{announce}]")).await;
    let cfg = format!(
        "models:\n{}routes:\n  only_a: [a]\nrouting_policy: {{ max_wait: 5s }}\n",
        ep("a", &a, "")
    );
    let mut gw = Gw::start(&cfg);
    assert_eq!(gw.chat("only_a", "x").await.status(), 200);
    assert_eq!(a.requests().await, 1);
    let t0 = Instant::now();
    let r = gw
        .chat_id(
            "refill",
            json!({"model": "only_a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    let took = t0.elapsed();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(a.requests().await, 2, "one call, after the wait");
    assert!(
        took >= Duration::from_millis(1200),
        "answered after {took:?}: it did not wait for the refill"
    );
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'refill' ORDER BY seq"
        ),
        vec!["a:skipped_ratelimit_predicted", "a:ok"]
    );
}

#[tokio::test]
async fn a_key_with_no_budget_left_is_passed_over_for_the_next() {
    let a = MockUp::openai(
        r#"rules: [{when: {key: sk-first-1111}, times: 1, headers: {x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "20s", x-ratelimit-limit-requests: ""}}]"#,
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n{}",
        ep("a", &a, ", api_keys: [sk-first-1111, sk-second-2222]")
    ));
    for _ in 0..5 {
        let r = gw.chat("a", "x").await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    }
    // Round-robin would alternate; the first key said it had nothing left.
    assert_eq!(
        a.stats().await["key_tails"],
        json!(["1111", "2222", "2222", "2222", "2222"])
    );
    let st = gw.status().await;
    let rl = &st["endpoints"]["a"]["ratelimit"];
    assert!(
        rl.as_array()
            .unwrap()
            .iter()
            .any(|k| k["key"] == "#1" && k["blocked_for_ms"].as_u64().unwrap() > 0),
        "{rl}"
    );
    assert!(
        !st.to_string().contains("sk-first"),
        "no key value in /status"
    );
    gw.stop();
}

#[tokio::test]
async fn a_token_budget_too_small_for_max_tokens_skips_only_the_large_request() {
    let a = MockUp::openai(
        r#"rules: [{times: 1, headers: {x-ratelimit-remaining-tokens: "100", x-ratelimit-reset-tokens: "20s", x-ratelimit-limit-tokens: ""}}]"#,
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&format!(
        "models:\n{}{}routes:\n  chat: [a, b]\n",
        ep("a", &a, ""),
        ep("b", &b, "")
    ));
    assert_eq!(
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint"),
        "a"
    );
    let ask = |max_tokens: u64| json!({"model": "chat", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]});
    let r = gw.post("/v1/chat/completions", ask(500)).await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "b",
        "500 > 100 tokens left"
    );
    let r = gw.post("/v1/chat/completions", ask(5)).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a", "a few tokens fit");
    assert_eq!((a.requests().await, b.requests().await), (2, 1));
    gw.stop();
}

#[tokio::test]
async fn after_a_cooldown_the_endpoint_takes_a_rising_share_not_everything() {
    let script = r#"rules: [{status: 429, times: 1, headers: {retry-after: "1"}}]"#;
    let run = |slow_start: &'static str| async move {
        let a = MockUp::openai(script).await;
        let b = MockUp::openai("name: b").await;
        // The share's draws from a seeded sequence: the count below is the same every run.
        let mut gw = Gw::start_with_env(
            &format!(
                "models:\n{}{}routes:\n  chat: [a, b]\nrouting_policy: {{ slow_start: {slow_start} }}\n",
                ep("a", &a, ""),
                ep("b", &b, "")
            ),
            &[("AUTOHEDGE_TEST_SEED", "20261203")],
        );
        let r = gw.chat("chat", "x").await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "a answered 429");
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let mut to_a = 0;
        for _ in 0..60 {
            let r = gw.chat("chat", "x").await;
            assert_eq!(r.status(), 200);
            if header(&r, "x-autohedge-endpoint") == "a" {
                to_a += 1;
            }
        }
        let share = gw.status().await["endpoints"]["a"]["slow_start_share"].clone();
        gw.stop();
        (to_a, share)
    };
    let (to_a, share) = run("60s").await;
    // In the first seconds of a 60 s window a takes about 10 %: far from all 60.
    assert!((1..30).contains(&to_a), "slow start: a took {to_a} of 60");
    assert!(share.as_f64().is_some_and(|s| s < 0.5), "{share}");
    let (to_a, share) = run("0").await;
    assert_eq!(to_a, 60, "without slow start a takes everything at once");
    assert!(share.is_null());
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

#[tokio::test]
async fn an_endpoints_own_hedge_applies_to_requests_that_start_there() {
    let slow = MockUp::openai("name: slow\nrules: [{delay: 2s}]").await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n{}{}routing_policy: {{ fallback_chain: [slow, fast] }}\n",
        ep("slow", &slow, ", hedge: { after: 100ms, max_extra: 100% }"),
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let r = gw.chat("slow", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "fast");
    assert_eq!(header(&r, "x-autohedge-hedged"), "true");
    assert_eq!((slow.requests().await, fast.requests().await), (1, 1));
    // A request that starts at `fast` is not hedged by `slow`'s setting.
    let r = gw.chat("fast", "x").await;
    assert_eq!(header(&r, "x-autohedge-hedged"), "");
    let st = gw.status().await;
    assert_eq!(
        st["hedging"]["endpoint:slow"]["won"], 1,
        "{}",
        st["hedging"]
    );
    gw.stop();
}

#[tokio::test]
async fn a_hedge_that_fails_leaves_the_first_attempt_to_finish() {
    let slow = MockUp::openai("name: slow\nrules: [{delay: 600ms}]").await;
    let bad = MockUp::openai("rules: [{status: 500}]").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  chat:\n    chain: [slow, bad]\n    hedge: {{ after: 100ms, max_extra: 100% }}\n",
        ep("slow", &slow, ""),
        ep("bad", &bad, "")
    );
    let mut gw = Gw::start(&cfg);
    let r = gw
        .chat_id(
            "hedge-failed",
            json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "slow");
    assert_eq!(
        header(&r, "x-autohedge-hedged"),
        "",
        "the hedge did not win"
    );
    assert_eq!((slow.requests().await, bad.requests().await), (1, 1));
    gw.stop();
    assert_eq!(
        rows(
            &gw,
            "SELECT endpoint, class FROM attempts WHERE request_id = 'hedge-failed' ORDER BY seq"
        ),
        vec!["bad:server_error", "slow:ok"]
    );
    assert_eq!(
        rows(
            &gw,
            "SELECT hedges, hedge_won FROM requests WHERE request_id = 'hedge-failed'"
        ),
        vec!["1:0"]
    );
}

/// `after: pNN` trusts a percentile only once the endpoint has `hedge::MIN_SAMPLES` (20)
/// latencies: before that no hedge is sent, however slow the request and however full the
/// budget. Every 4th request to `slow` takes 1 s and the budget pays a whole hedge a request, so
/// without the minimum the 4th request would already be hedged.
#[tokio::test]
async fn a_percentile_delay_waits_for_its_sample_minimum() {
    let slow = MockUp::openai(
        "name: slow\nrules: [{when: {path: /v1/chat/completions, every: 4}, delay: 1s}]",
    )
    .await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  p50:\n    chain: [slow, fast]\n    hedge: {{ after: p50, max_extra: 100%, min_after: 150ms }}\n",
        ep("slow", &slow, ""),
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let mut hedged = Vec::new();
    for i in 1..=24 {
        let r = gw.chat("p50", "x").await;
        assert_eq!(r.status(), 200);
        if header(&r, "x-autohedge-hedged") == "true" {
            hedged.push(i);
        }
        if i == 20 {
            assert_eq!(
                fast.requests().await,
                0,
                "no hedge before 20 samples, though requests 4 to 20 were slow"
            );
        }
    }
    // The 24th (slow) request is the first with 20 samples behind it: hedged at the p50 (fast,
    // so min_after), and served by the hedge.
    assert_eq!(hedged, vec![24], "only the slow request after 20 samples");
    assert_eq!(fast.requests().await, 1);
    assert_eq!(slow.requests().await, 24, "every request tried slow first");
    gw.stop();
}
