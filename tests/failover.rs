//! Errors and failover (docs/errors.md), against the real binary and loopback upstreams that
//! misbehave the ways real ones do: connect errors, 5xx, timeouts, malformed or endless 2xx, 429
//! cooldowns and hostile hints, 410, 401/403 key rotation, missing models, client 4xx, 499, a
//! panic, no descriptor left, and a 30 s chaos soak. Each test first shows the thing happened (the
//! upstream was called, the row was written) before showing what must not happen.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// `POST /v1/chat/completions` for `model` written on `s` (a connection the gateway has already
/// accepted), and its answer: status and body.
fn raw_chat(mut s: std::net::TcpStream, model: &str) -> (u16, String) {
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]}}"#);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    let status = got
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {got:?}"));
    let body = got
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn cooldown_ms(st: &Value, name: &str) -> u64 {
    st["endpoints"][name]["cooldown_remaining_ms"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test]
async fn connect_error_and_5xx_fail_over() {
    let dead = dead_addr();
    let a = MockUp::openai("rules: [{status: 502}]").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"
models:
  dead: {{ type: openai, base_url: "http://{dead}/v1", timeouts: {{ connect: 500ms }} }}
  a: {{ type: openai, base_url: "{}" }}
  b: {{ type: openai, base_url: "{}" }}
routing_policy: {{ fallback_chain: [dead, a, b] }}
"#,
        a.base(),
        b.base()
    );
    let gw = Gw::start(&cfg);
    for stream in [false, true] {
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "dead", "stream": stream, "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
        assert_eq!(header(&r, "x-autohedge-attempts"), "3");
        if stream {
            let ev = sse_events(r).await;
            assert_eq!(stream_text(&ev), "Hello from b!");
            assert_eq!(ev.last().unwrap(), "[DONE]");
        }
    }
    let st = gw.status().await;
    assert!(
        st["endpoints"]["dead"]["last_error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("connect_error")
    );
    assert_eq!(st["endpoints"]["a"]["totals"]["failures"], 2);
}

/// An upstream that accepts the TCP connection and then never answers the TLS handshake is a
/// connect error after `timeouts.connect` (the whole connection, handshake included, is under
/// it), and the request fails over to the next endpoint at once — not after `first_token`.
#[tokio::test]
async fn a_stalled_tls_handshake_is_a_connect_error_within_the_connect_timeout() {
    // Never read, never written: the ClientHello gets no answer.
    let stall = RawUp::mute();
    let stall_addr = stall.addr;
    let good = MockUp::openai("reply: served by good\n").await;
    let gw = Gw::start(&format!(
        "models:\n  stalled: {{ type: openai, base_url: \"https://{stall_addr}/v1\", model: m, timeouts: {{ connect: 300ms, first_token: 30s, total: 60s }} }}\n  good: {{ type: openai, base_url: \"{}\", model: m }}\nroutes:\n  chat: [stalled, good]\nhealth: {{ probe_interval: 1h }}\n",
        good.base()
    ));
    let r = gw.chat("chat", "hello").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "good");
    // The stalled server was really connected to (the handshake started) …
    assert!(stall.accepted() >= 1);
    // … and the attempt ended as a connect error, at the connect timeout (300 ms), well
    // before first_token (30 s): by the gateway's own measure of the attempt.
    let mut gw = gw;
    gw.stop();
    let rows = audit_rows(
        &gw,
        "SELECT class, latency_ms FROM attempts WHERE endpoint = 'stalled'",
    );
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0][0], serde_json::json!("connect_error"), "{rows:?}");
    let took = rows[0][1].as_f64().unwrap();
    assert!((300.0..30_000.0).contains(&took), "{rows:?}");
    assert_no_panic(&gw);
}

/// A keep-alive connection the server closes just as the gateway reuses it (uvicorn's
/// `timeout_keep_alive` racing the pool) is sent again on a fresh connection: the client is
/// served by that endpoint, not failed over, and nothing counts against it.
#[tokio::test]
async fn a_pooled_connection_closed_unanswered_is_sent_again_not_failed_over() {
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let up = {
        let (requests, dropped) = (requests.clone(), dropped.clone());
        // Each connection answers its first request, then reads the second and closes without
        // a word.
        RawUp::start(move |req| {
            if req.method != "POST" {
                // Probes: no such route.
                return Answer::Write(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
                );
            }
            requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if req.nth >= 1 {
                dropped.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Answer::Close;
            }
            let body = json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            .to_string();
            Answer::full("200 OK", "application/json", &body)
        })
    };
    let addr = up.addr;
    let backup = MockUp::openai("name: backup").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{addr}/v1\", model: m }}\n  backup: {{ type: openai, base_url: \"{}\", model: m }}\nrouting_policy: {{ fallback_chain: [a, backup] }}\n",
        backup.base()
    ));
    // At least four requests, and on until a pooled connection was reused and closed (a
    // connection not yet back in the pool when the next request goes is a fresh one, which
    // proves nothing either way), each served by `a` in one attempt.
    let mut served = 0;
    while served < 4 || (dropped.load(std::sync::atomic::Ordering::SeqCst) == 0 && served < 20) {
        let r = gw.chat("a", &format!("q{served}")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-autohedge-endpoint"), "a", "request {served}");
        assert_eq!(header(&r, "x-autohedge-attempts"), "1");
        served += 1;
        // Let the connection go back to the pool.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server did close reused connections unanswered, and each was sent again.
    let closed = dropped.load(std::sync::atomic::Ordering::SeqCst);
    assert!(closed >= 1, "no pooled connection was reused and closed");
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::SeqCst),
        served + closed
    );
    assert_eq!(backup.requests().await, 0);
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["a"]["totals"]["failures"], 0,
        "{}",
        st["endpoints"]["a"]
    );
}

#[tokio::test]
async fn retries_same_endpoint_when_configured() {
    let a = MockUp::openai("rules: [{status: 503, times: 1}]").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"
models:
  a: {{ type: openai, base_url: "{}", retries: 1, retry_backoff: 10ms }}
  b: {{ type: openai, base_url: "{}" }}
"#,
        a.base(),
        b.base()
    );
    let gw = Gw::start(&cfg);
    let r = gw.chat("a", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(a.requests().await, 2);
    assert_eq!(b.requests().await, 0);
}

#[tokio::test]
async fn a_slow_non_stream_answer_times_out_and_fails_over() {
    let a = MockUp::openai("rules: [{delay: 3s}]").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", timeouts: {{ total: 300ms }} }}\n  b: {{ type: openai, base_url: \"{}\" }}\n",
        a.base(),
        b.base()
    ));
    let r = gw.chat("a", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1, "a was called and timed out");
    let st = gw.status().await;
    assert!(
        st["endpoints"]["a"]["last_error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("timeout"),
        "{}",
        st["endpoints"]["a"]
    );
}

#[tokio::test]
async fn request_timeout_bounds_a_chain_of_slow_endpoints() {
    let slow = || MockUp::openai("rules: [{delay: 3s}]");
    let (a, b, c) = (slow().await, slow().await, slow().await);
    let mut gw = Gw::start(&chain_cfg(
        &[("a", &a), ("b", &b), ("c", &c)],
        "  request_timeout: 1s",
    ));
    let r = gw
        .chat_id(
            "too-slow",
            json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "request_timeout");
    let attempts = v["error"]["attempts"].as_array().unwrap();
    assert_eq!(attempts[0]["endpoint"], "a", "{attempts:?}");
    assert_eq!(attempts[0]["class"], "timeout");
    assert_eq!(a.requests().await, 1, "a was called");
    assert_eq!(
        b.requests().await + c.requests().await,
        0,
        "the deadline passed during a"
    );
    gw.stop();
    let got = audit_rows(
        &gw,
        "SELECT status, error_class FROM requests WHERE request_id = 'too-slow'",
    );
    assert_eq!(got, vec![vec![json!(504), json!("request_timeout")]]);
}

#[tokio::test]
async fn a_malformed_2xx_body_fails_over() {
    let a = MockUp::openai("rules: [{status: 200, body: \"<html>gateway says hi</html>\"}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&format!("models:\n{}{}", ep("a", &a, ""), ep("b", &b, "")));
    let r = gw
        .chat_id(
            "malformed",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1);
    gw.stop();
    assert_eq!(
        db_rows(
            &gw,
            "SELECT class FROM attempts WHERE request_id = 'malformed' ORDER BY seq"
        ),
        vec!["malformed_response", "ok"]
    );
}

/// Answers a strict reader would still serve: they reach the client from the first endpoint,
/// while a truncated one fails over. Each answer is a raw body the mock sends as-is.
#[tokio::test]
async fn odd_but_servable_2xx_bodies_are_served_and_a_truncated_one_fails_over() {
    let served = [
        // Some compatible servers put `"error": null` in every success; no usage either, so the
        // gateway reads the whole answer.
        r#"{"id":"c1","object":"chat.completion","error":null,"choices":[{"index":0,"message":{"role":"assistant","content":"from a"},"finish_reason":"stop"}]}"#,
        // A key given twice (the last counts, as in any JSON parser's tree), `usage` of a shape
        // no count can be read from, `object` not a string.
        r#"{"object":7,"usage":{"prompt_tokens":-1},"usage":null,"choices":[{"index":0,"message":{"role":"assistant","content":"from a"},"finish_reason":"stop"}]}"#,
    ];
    let truncated = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"from "#;
    let b = MockUp::openai("name: b").await;
    for (i, body) in served.iter().chain([&truncated]).enumerate() {
        let script =
            serde_json::to_string(&json!({"rules": [{"status": 200, "body": body}]})).unwrap();
        let a = MockUp::openai(&script).await;
        let mut gw = Gw::start(&format!("models:\n{}{}", ep("a", &a, ""), ep("b", &b, "")));
        let id = format!("odd-{i}");
        let r = gw
            .chat_id(
                &id,
                json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200, "{body}");
        assert_eq!(a.requests().await, 1, "{body}");
        let endpoint = header(&r, "x-autohedge-endpoint");
        let text = r.text().await.unwrap();
        gw.stop();
        let classes = db_rows(
            &gw,
            &format!("SELECT class FROM attempts WHERE request_id = '{id}' ORDER BY seq"),
        );
        if i < served.len() {
            assert_eq!(endpoint, "a", "{body}");
            assert_eq!(text, *body, "served as the upstream sent it");
            assert_eq!(classes, vec!["ok"], "{body}");
        } else {
            assert_eq!(endpoint, "b", "{body}");
            assert!(text.contains("Hello from b!"), "{text}");
            assert_eq!(classes, vec!["malformed_response", "ok"], "{body}");
        }
    }
}

/// An upstream whose 200 answer never ends is read no further than `server.max_response_bytes`:
/// the attempt is `malformed_response`, the connection dropped, and the request fails over.
/// Before, the gateway held every byte it was sent until `timeouts.total` (here 256 MiB, then a
/// timeout): one such upstream could exhaust its memory.
#[tokio::test]
async fn an_answer_that_never_ends_is_cut_at_max_response_bytes_and_fails_over() {
    const CAP: u64 = 256 << 20;
    let a = Endless::start(CAP, false, None);
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&endless_then(&a, &b, "{ total: 20s }"));
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "failed over");
    assert_cut_past(&a, 1 << 20);
    let row = first_attempt(&gw, "a").await;
    assert!(
        row.starts_with("malformed_response ") && row.contains("larger than 1048576 bytes"),
        "{row}"
    );
    assert_no_panic(&gw);
}

#[tokio::test]
async fn rate_limit_cools_down_and_is_never_retried() {
    let a = MockUp::openai(
        "rules: [{status: 429, times: 1, headers: {retry-after: \"30\"}, error: \"Rate limit reached for gpt-4o-mini\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"
models:
  a: {{ type: openai, base_url: "{}", retries: 3 }}
  b: {{ type: openai, base_url: "{}" }}
"#,
        a.base(),
        b.base()
    );
    let gw = Gw::start(&cfg);
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(
        a.requests().await,
        1,
        "a 429 is never retried on the same endpoint"
    );
    let r = gw.chat("a", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    assert_eq!(a.requests().await, 1, "a cooling endpoint is skipped");
    let st = gw.status().await;
    let ea = &st["endpoints"]["a"];
    assert_eq!(ea["state"], "cooldown");
    let left = ea["cooldown_remaining_ms"].as_u64().unwrap();
    // Live, the bounds (the clock runs on); the exact cooldown set is in its event below.
    assert!(left > 0 && left <= 30_000, "Retry-After honoured: {left}");
    assert_eq!(ea["totals"]["failures"], 0, "a 429 is not a health failure");
    let mut gw = gw;
    gw.stop();
    let ev = db_rows(
        &gw,
        "SELECT endpoint || ':' || event || ':' || substr(reason, instr(reason, 'cooling down for')) FROM endpoint_events WHERE event = 'cooldown'",
    );
    assert_eq!(
        ev,
        vec!["a:cooldown:cooling down for 30000ms"],
        "Retry-After honoured"
    );
}

/// A 429 with no hint cools down for the endpoint's `cooldown`, else `default_cooldown`; one with
/// OpenAI's `x-ratelimit-reset-*` for the exhausted budget cools down that long.
#[tokio::test]
async fn rate_limit_cooldown_sources() {
    // "" removes the mock's standard retry-after and x-ratelimit-reset-* headers.
    let no_hint = r#"rules: [{status: 429, times: 1, headers: {retry-after: "", x-ratelimit-reset-requests: "", x-ratelimit-reset-tokens: ""}}]"#;
    let own = MockUp::openai(no_hint).await;
    let dflt = MockUp::openai(no_hint).await;
    let reset = MockUp::openai(
        r#"rules: [{status: 429, times: 1, headers: {retry-after: "", x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "1m30s", x-ratelimit-remaining-tokens: "5000", x-ratelimit-reset-tokens: "9m"}}]"#,
    )
    .await;
    let ok = MockUp::openai("name: ok").await;
    let cfg = format!(
        "models:\n{}{}{}{}routing_policy: {{ default_cooldown: 3s }}\n",
        ep("own", &own, ", cooldown: 7s"),
        ep("dflt", &dflt, ""),
        ep("reset", &reset, ""),
        ep("ok", &ok, "")
    );
    let gw = Gw::start(&cfg);
    for name in ["own", "dflt", "reset"] {
        let r = gw.chat(name, "x").await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "ok", "{name}");
    }
    assert_eq!(
        (
            own.requests().await,
            dflt.requests().await,
            reset.requests().await
        ),
        (1, 1, 1),
        "each answered one 429"
    );
    let st = gw.status().await;
    let (o, d, r) = (
        cooldown_ms(&st, "own"),
        cooldown_ms(&st, "dflt"),
        cooldown_ms(&st, "reset"),
    );
    // Live, the upper bounds (the clock runs on, and a busy machine may have let a few
    // seconds' cooldown end already); the exact values are in the events below.
    assert!(o <= 7_000, "endpoint cooldown: {o}");
    assert!(d <= 3_000, "default_cooldown: {d}");
    assert!(
        r > 3_000 && r <= 90_000,
        "the exhausted budget's reset (requests, not tokens): {r}"
    );
    let mut gw = gw;
    gw.stop();
    let ev = db_rows(
        &gw,
        "SELECT endpoint || ':' || event || ':' || substr(reason, instr(reason, 'cooling down for')) FROM endpoint_events ORDER BY endpoint",
    );
    assert_eq!(
        ev,
        vec![
            "dflt:cooldown:cooling down for 3000ms",
            "own:cooldown:cooling down for 7000ms",
            "reset:cooldown:cooling down for 90000ms"
        ]
    );
}

#[tokio::test]
async fn hostile_rate_limit_headers_fail_over_and_are_clamped() {
    let huge_reset = format!("{}s", "9".repeat(400));
    let a = MockUp::openai(&format!(
        r#"rules:
  - {{ status: 429, times: 1, headers: {{ retry-after: "1e20" }} }}
  - {{ status: 429, times: 1, headers: {{ retry-after: "31536000" }} }}
  - {{ status: 429, times: 1, headers: {{ retry-after: "NaN", x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "{huge_reset}" }} }}
  - {{ status: 429, times: 1, headers: {{ retry-after: "soon", x-ratelimit-reset-requests: "", x-ratelimit-reset-tokens: "" }} }}
"#
    ))
    .await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&chain_cfg(
        &[("a", &a), ("b", &b)],
        // Slow start off: this test asserts `a` is called as soon as each cooldown ends.
        "  max_cooldown: 3s\n  default_cooldown: 1s\n  slow_start: 0",
    ));
    // 1e20 seconds: the request fails over (no reset connection) and a's cooldown is clamped.
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1, "a was called and answered 429");
    let left = gw.status().await["endpoints"]["a"]["cooldown_remaining_ms"]
        .as_u64()
        .unwrap();
    // Live, only the bound (the clock runs on); the exact 3000 ms is in its `cooldown` event,
    // checked below.
    assert!(left <= 3_000, "clamped to max_cooldown: {left}");

    // The other hostile values, one per request once a's cooldown is over.
    let mut expected_calls = 1;
    for (what, hi) in [
        ("a year", 3_000u64),
        ("a 400-digit reset", 3_000),
        ("a malformed value falls back to default_cooldown", 1_000),
    ] {
        // Generous: the cooldown (3 s at most) must end, and the wait ends when it does.
        let ok = eventually(Duration::from_secs(20), || async {
            gw.status().await["endpoints"]["a"]["state"] == "healthy"
        })
        .await;
        assert!(ok, "{what}: a's cooldown ends");
        let r = gw.chat("chat", "x").await;
        expected_calls += 1;
        assert_eq!(r.status(), 200, "{what}");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "{what}");
        assert_eq!(a.requests().await, expected_calls, "{what}: a was called");
        let ea = &gw.status().await["endpoints"]["a"];
        let left = ea["cooldown_remaining_ms"].as_u64().unwrap();
        // Live, only the bound can be checked (the clock runs on); the exact cooldown each 429
        // set is in its `cooldown` event, checked below.
        assert!(left <= hi, "{what}: {left} {ea}");
    }
    let mut gw = gw;
    gw.stop();
    let n: i64 = one(
        &rusqlite::Connection::open(gw.db()).unwrap(),
        "SELECT COUNT(*) FROM requests WHERE status = 200",
    );
    assert_eq!(n, 4, "every request has its row");
    let cooldowns: Vec<String> = audit_rows(&gw,
        "SELECT reason FROM endpoint_events WHERE endpoint = 'a' AND event = 'cooldown' ORDER BY id",
    )
    .into_iter()
    .map(|r| {
        let reason = r[0].as_str().unwrap().to_string();
        reason.rsplit("cooling down for ").next().unwrap().to_string()
    })
    .collect();
    assert_eq!(
        cooldowns,
        vec!["3000ms", "3000ms", "3000ms", "1000ms"],
        "1e20 s, a year and a 400-digit reset clamped to max_cooldown; a malformed value gets default_cooldown"
    );
    assert_no_panic(&gw);
}

#[tokio::test]
async fn retry_after_http_date_is_honoured_end_to_end() {
    let base = Instant::now();
    let when = httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(90));
    let a = MockUp::openai(&format!(
        "rules: [{{status: 429, times: 1, headers: {{retry-after: \"{when}\"}}}}]"
    ))
    .await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&chain_cfg(&[("a", &a), ("b", &b)], ""));
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1);
    let left = gw.status().await["endpoints"]["a"]["cooldown_remaining_ms"]
        .as_u64()
        .unwrap();
    // The date is 90 s from `base` (less up to 1 s: it has whole seconds), so what is left is
    // 90 s less the time since, measured here (a default cooldown would be a minute off). No
    // bound on how long the start-up and the request took.
    let since = base.elapsed().as_millis() as u64;
    assert!(
        left <= 90_000 && left + since + 1_000 >= 90_000,
        "{left} ms left {since} ms after the date was set"
    );
}

#[tokio::test]
async fn max_wait_waits_for_a_cooling_endpoint() {
    // A minute's cooldown for the `max_wait: 0` part: the second request meets it cooling
    // however late it comes (`max_wait: 0` never waits, so the minute costs nothing).
    let a =
        MockUp::openai("rules: [{status: 429, times: 1, headers: {retry-after: \"60\"}}]").await;
    let cfg = |wait: &str| {
        format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nrouting_policy: {{ max_wait: {wait} }}\n",
            a.base()
        )
    };
    let gw = Gw::start(&cfg("0"));
    assert_eq!(gw.chat("a", "x").await.status(), 503);
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 503, "max_wait 0: fail at once");
    assert_eq!(header(&r, "x-autohedge-attempts"), "0", "no call, no wait");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["attempts"][0]["class"], "skipped_cooldown");
    assert_eq!(a.requests().await, 1, "only the first request's 429");
    drop(gw);

    // The wait covers an endpoint that answered 429 earlier in the same request too.
    a.set_script("rules: [{status: 429, times: 1, headers: {retry-after-ms: \"700\"}}]")
        .await;
    let gw = Gw::start(&cfg("5s"));
    let t = Instant::now();
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200, "waited for the cooldown to end");
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(
        a.requests().await,
        2,
        "the 429, then the call after the wait"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn gone_retires_across_restarts_until_cleared() {
    let a = MockUp::openai(
        "rules: [{status: 410, error: \"The model gpt-4-0314 has been deprecated\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = two(&a, &b, "");
    let tmp = tempfile::tempdir().unwrap();
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "retired");
    gw.stop();

    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    assert_eq!(
        gw.status().await["endpoints"]["a"]["state"],
        "retired",
        "retirement survives a restart"
    );
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1);

    a.set_script("name: a").await;
    let out = std::process::Command::new(BIN)
        .args(["endpoint", "clear", "a", "--url"])
        .arg(gw.url(""))
        .arg("--data-dir")
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("retirement lifted") && text.contains("cleared in the running gateway"),
        "{text}"
    );
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "healthy");
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    gw.stop();

    // A config change to the endpoint lifts a retirement too.
    a.set_script("rules: [{status: 410}]").await;
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    gw.chat("chat", "x").await;
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "retired");
    gw.stop();
    let changed = cfg.replace("model: upstream-a", "model: upstream-a2");
    let mut gw = Gw::start_in(tmp.path(), &changed, &[]);
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "healthy");
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let events: Vec<String> = conn
        .prepare("SELECT event FROM endpoint_events WHERE endpoint = 'a' ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // Lifting a retirement by a config change across a restart is an event too.
    assert_eq!(events, vec!["retired", "cleared", "retired", "unretired"]);
}

#[tokio::test]
async fn rejected_key_rotates_then_marks_auth_failed() {
    // The revoked key is refused on inference calls only: the rotation under test is the request
    // path's (a probe's rejection of the same key is tested in routing.rs).
    let a = MockUp::openai(
        "rules: [{when: {key: sk-revoked-1111}, status: 401, error: \"Incorrect API key provided: sk-revo****1111.\", error_code: invalid_api_key}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"
models:
  a:
    type: openai
    base_url: "{}"
    api_keys: [env:AH_TEST_KEY_OLD, env:AH_TEST_KEY_NEW]
  single:
    type: openai
    base_url: "{}"
    api_key: env:AH_TEST_KEY_OLD
  b: {{ type: openai, base_url: "{}" }}
routing_policy: {{ fallback_chain: [a, single, b] }}
"#,
        a.base(),
        a.base(),
        b.base()
    );
    let gw = Gw::start_with_env(
        &cfg,
        &[
            ("AH_TEST_KEY_OLD", "sk-revoked-1111"),
            ("AH_TEST_KEY_NEW", "sk-good-key-2222"),
        ],
    );
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "a",
        "served by a with its second key"
    );
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(a.stats().await["key_tails"], json!(["1111", "2222"]));
    // Next request goes straight to the good key.
    gw.chat("a", "x").await;
    assert_eq!(
        a.stats().await["key_tails"],
        json!(["1111", "2222", "2222"])
    );

    let r = gw.chat("single", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["single"]["state"], "auth_failed");
    assert_eq!(st["endpoints"]["a"]["state"], "healthy");
    assert_eq!(
        st["endpoints"]["a"]["keys"],
        json!({"configured": 2, "usable": 1})
    );
}

#[tokio::test]
async fn a_403_rotates_to_the_next_key() {
    let a = MockUp::openai("name: a\nrules: [{when: {key: sk-forbidden-1111}, status: 403, error: \"Project does not have access\"}]").await;
    let mut gw = Gw::start(&format!(
        "models:\n{}",
        ep("a", &a, ", api_keys: [sk-forbidden-1111, sk-allowed-2222]")
    ));
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(a.stats().await["key_tails"], json!(["1111", "2222"]));
    assert_eq!(gw.status().await["endpoints"]["a"]["keys"]["usable"], 1);
    let r = gw.chat("a", "x").await;
    assert_eq!(
        header(&r, "x-autohedge-attempts"),
        "1",
        "the 403 key is out"
    );
    gw.stop();
    assert_eq!(
        db_rows(
            &gw,
            "SELECT event FROM endpoint_events WHERE endpoint = 'a' ORDER BY id"
        ),
        vec!["key_rejected"]
    );
}

#[tokio::test]
async fn a_missing_model_404_fails_over_on_openai_and_vllm() {
    let o = MockUp::openai(
        "rules: [{status: 404, error: \"The model `gpt-9` does not exist or you do not have access to it.\", error_code: model_not_found}]",
    )
    .await;
    let v = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        "rules: [{status: 404, error: \"The model `qwen` does not exist.\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n{}  v: {{ type: vllm, base_url: \"{}\" }}\n{}routing_policy: {{ fallback_chain: [o, v, b] }}\n",
        ep("o", &o, ""),
        v.base(),
        ep("b", &b, "")
    ));
    let r = gw.chat("o", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!((o.requests().await, v.requests().await), (1, 1));
    let st = gw.status().await;
    for name in ["o", "v"] {
        let e = &st["endpoints"][name];
        assert!(
            e["last_error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("model_missing"),
            "{e}"
        );
        assert_eq!(e["totals"]["failures"], 1, "counts against {name}");
    }
}

#[tokio::test]
async fn ollama_failures_map_to_the_right_action() {
    let b = MockUp::openai("name: b").await;
    // Before the first content: fail over invisibly.
    for script in [
        "rules: [{stream_error_after: 0}]",
        "rules: [{cut_after: 0}]",
        "rules: [{status: 500, error: \"model requires more system memory (9.5 GiB) than is available\"}]",
        "rules: [{status: 404, error: \"model 'qwen2.5:7b' not found, try pulling it first\"}]",
    ] {
        let o = MockUp::start(autohedge::demo::mock::Flavor::Ollama, script).await;
        let gw = Gw::start(&ollama_cfg(&o, &b));
        let r = gw
            .post("/v1/chat/completions", json!({"model": "local", "stream": true, "messages": [{"role": "user", "content": "x"}]}))
            .await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "{script}");
        assert_eq!(
            stream_text(&sse_events(r).await),
            "Hello from b!",
            "{script}"
        );
    }
    // After it: the stream ends with an error event.
    let o = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "reply: \"one two three\"\nrules: [{cut_after: 2}]",
    )
    .await;
    let gw = Gw::start(&ollama_cfg(&o, &b));
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "stream": true, "messages": [{"role": "user", "content": "x"}]}))
        .await;
    let ev = sse_events(r).await;
    assert_eq!(stream_text(&ev), "one two ");
    let last: Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["code"], "stream_truncated",
        "no done:true is a failure, not an answer"
    );
    // A client error comes back in OpenAI's shape.
    o.set_script(
        "rules: [{status: 400, error: \"invalid format: expected \\\"json\\\" or a JSON schema\"}]",
    )
    .await;
    let r = gw.chat("local", "x").await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid format")
    );
    // Context overflow fails over: local's window is unknown, so any next endpoint may try.
    o.set_script("context_window: 10").await;
    let r = gw.chat("local", &"long text ".repeat(50)).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    // A remote image URL cannot go to Ollama: skipped, not held against it.
    let before = gw.status().await["endpoints"]["local"]["totals"]["failures"].clone();
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}))
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from b!");
    assert_eq!(
        gw.status().await["endpoints"]["local"]["totals"]["failures"],
        before
    );
}

#[tokio::test]
async fn client_errors_come_back_unchanged_without_failover() {
    let a = MockUp::openai(
        "rules: [{status: 400, when: {model: upstream-a}, error: \"Invalid value for 'temperature': must be <= 2\", error_code: invalid_value}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&two(&a, &b, ""));
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"error": {"message": "Invalid value for 'temperature': must be <= 2", "type": "invalid_request_error", "param": null, "code": "invalid_value"}})
    );
    assert_eq!(b.requests().await, 0);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["totals"]["failures"], 0);
    assert_eq!(st["endpoints"]["a"]["state"], "healthy");
}

/// A loopback upstream whose every POST gets a 400 declaring a body of [`BigError::TOTAL`] bytes
/// of `x`, written until a write fails; GETs get a one-model list (probes pass). `posts` counts
/// the POSTs, `written` is how much of the body the gateway let it write, `released` says a write
/// failed (the gateway hung up on the answer).
struct BigError {
    addr: std::net::SocketAddr,
    posts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
    up: RawUp,
}

impl BigError {
    /// 160 MiB: far past 64 KiB plus whatever the sockets' buffers hold.
    const TOTAL: u64 = 160 << 20;

    fn start() -> BigError {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let posts = Arc::new(AtomicU64::new(0));
        let released = Arc::new(AtomicBool::new(false));
        let (p, r) = (posts.clone(), released.clone());
        let up = RawUp::with_release(
            move |req| {
                if req.method == "GET" {
                    return Answer::models_list();
                }
                p.fetch_add(1, Ordering::SeqCst);
                // All of it written (the gateway read it all, or the buffers took it): the
                // connection's next request.
                Answer::Stream {
                    head: format!(
                        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        BigError::TOTAL
                    )
                    .into_bytes(),
                    piece: vec![b'x'; 0x10000],
                    credit: 0x10000,
                    cap: BigError::TOTAL,
                    then: Then::Next,
                }
            },
            move |_| r.store(true, Ordering::SeqCst),
        );
        BigError {
            addr: up.addr,
            posts,
            released,
            up,
        }
    }
}

/// An upstream's error body is read up to 64 KiB: a 400 of 160 MiB reaches the client cut at
/// that, and the gateway reads no more of it — it hangs up, and the upstream's writes fail once
/// the sockets' buffers are full, far short of the 160 MiB.
#[tokio::test]
async fn an_error_body_is_read_up_to_64_kib() {
    use std::sync::atomic::Ordering;
    let a = BigError::start();
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{}/v1\" }}\n",
        a.addr
    ));
    let r = gw.chat("a", "hi").await;
    assert_eq!(r.status(), 400);
    assert_eq!(
        a.posts.load(Ordering::SeqCst),
        1,
        "the upstream answered its 400"
    );
    let body = r.bytes().await.unwrap();
    assert!(
        body.len() > 60 * 1024,
        "the body was passed on: {} bytes",
        body.len()
    );
    assert!(body.len() <= 64 * 1024, "{} bytes passed on", body.len());
    // The gateway stopped reading and let go of the connection: a write failed.
    let released = eventually(Duration::from_secs(10), || async {
        a.released.load(Ordering::SeqCst)
    })
    .await;
    let written = a.up.written();
    assert!(
        released,
        "the gateway still holds the answer ({written} bytes written)"
    );
    assert!(
        written < 64 << 20,
        "{written} of {} bytes were read",
        BigError::TOTAL
    );
}

#[tokio::test]
async fn bad_input_gets_openai_shaped_errors() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!("server: {{ max_body_bytes: 2000 }}\n{}", two(&a, &b, ""));
    let gw = Gw::start(&cfg);
    let c = reqwest::Client::new();
    let url = gw.url("/v1/chat/completions");
    let cases: Vec<(reqwest::RequestBuilder, u16, &str)> = vec![
        (c.post(&url).header("content-type", "application/json").body("{not json"), 400, "invalid_json"),
        (c.post(&url).json(&json!({"messages": [{"role": "user", "content": "x"}]})), 400, ""),
        (c.post(&url).json(&json!({"model": 7, "messages": [{"role": "user", "content": "x"}]})), 400, "invalid_type"),
        (c.post(&url).json(&json!({"model": "chat", "messages": []})), 400, "empty_array"),
        (c.post(&url).json(&json!({"model": "chat"})), 400, "missing_required_parameter"),
        (c.post(&url).json(&json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(3000)}]})), 413, "payload_too_large"),
        (c.post(&url).header("content-type", "text/plain").body("{}"), 415, "unsupported_media_type"),
        (c.post(&url).header("content-type", "application/json").body(vec![b'{', 0xff, 0xfe, b'}']), 400, "invalid_utf8"),
        (c.post(&url).json(&json!({"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]})), 404, "model_not_found"),
        (c.post(&url).json(&json!([1, 2])), 400, ""),
        (c.get(&url), 405, "method_not_allowed"),
        (c.get(gw.url("/v1/nope")), 404, "unknown_url"),
    ];
    for (i, (req, status, code)) in cases.into_iter().enumerate() {
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "case {i}");
        let v: Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("case {i}: body not JSON: {e}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "case {i}: {v}"
        );
        assert!(v["error"]["type"].is_string(), "case {i}: {v}");
        if !code.is_empty() {
            assert_eq!(v["error"]["code"], code, "case {i}: {v}");
        }
    }
    assert_eq!(a.requests().await + b.requests().await, 0);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["totals"]["requests"], 0);
    // Still serving.
    assert_eq!(gw.chat("chat", "x").await.status(), 200);
}

#[tokio::test]
async fn upstream_addresses_stay_out_of_client_error_bodies() {
    let dead = dead_addr();
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{dead}/v1\", timeouts: {{ connect: 500ms }} }}\n"
    ));
    let r = gw
        .chat_id(
            "dead-addr",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 503);
    let body = r.text().await.unwrap();
    assert!(body.contains("connect_error"), "{body}");
    assert!(!body.contains(&dead.port().to_string()), "{body}");
    gw.stop();
    // The operator's audit row keeps where it failed.
    let got = audit_rows(
        &gw,
        "SELECT error FROM attempts WHERE request_id = 'dead-addr'",
    );
    assert!(
        got[0][0].as_str().unwrap().contains(&dead.to_string()),
        "{got:?}"
    );
}

#[tokio::test]
async fn all_failed_is_503_with_attempts() {
    let a = MockUp::openai("rules: [{status: 500}]").await;
    let b = MockUp::openai("rules: [{status: 503}]").await;
    let gw = Gw::start(&two(&a, &b, ""));
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "all_upstreams_failed");
    let att = v["error"]["attempts"].as_array().unwrap();
    assert_eq!(att.len(), 2);
    assert_eq!(att[0]["endpoint"], "a");
    assert_eq!(att[0]["status"], 500);
    assert_eq!(att[0]["class"], "server_error");
    assert!(att[0]["latency_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(att[1]["endpoint"], "b");
    assert_eq!(att[1]["status"], 503);
}

/// Which outcomes count against the endpoint's success rate (README's table, last column).
#[tokio::test]
async fn which_failures_count_against_the_endpoint() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    // Slow start off: after the 429's cooldown `a` must be called at once again.
    let gw = Gw::start(&format!(
        "models:\n{}{}routing_policy: {{ slow_start: 0 }}\n",
        ep("a", &a, ", cooldown: 1ms"),
        ep("b", &b, "")
    ));
    let failures = || async {
        gw.status().await["endpoints"]["a"]["totals"]["failures"]
            .as_u64()
            .unwrap()
    };
    for (script, counts, what) in [
        ("rules: [{status: 429, times: 1}]", false, "429"),
        (
            "rules: [{status: 400, times: 1, error: \"temperature must be <= 2\"}]",
            false,
            "client 4xx",
        ),
        (
            "rules: [{status: 400, times: 1, error: \"This model's maximum context length is 10 tokens.\", error_code: context_length_exceeded}]",
            false,
            "context length",
        ),
        ("rules: [{status: 500, times: 1}]", true, "5xx"),
        // Closed unanswered twice: the first is sent again on a fresh connection (a server
        // closing a pooled connection as it is reused), the second is the endpoint's failure.
        ("rules: [{reset: true, times: 2}]", true, "connection reset"),
        (
            "rules: [{status: 200, times: 1, body: \"nope\"}]",
            true,
            "malformed 2xx",
        ),
    ] {
        a.set_script(script).await;
        // Past the 1 ms cooldown of the previous 429, if any.
        let ok = eventually(Duration::from_secs(5), || async {
            gw.status().await["endpoints"]["a"]["cooldown_remaining_ms"] == 0
        })
        .await;
        assert!(ok);
        let before = failures().await;
        let _ = gw.chat("a", "x").await;
        let calls = if what == "connection reset" { 2 } else { 1 };
        assert_eq!(a.requests().await, calls, "{what}: a was called");
        let after = failures().await;
        assert_eq!(after - before, u64::from(counts), "{what}");
    }
}

#[tokio::test]
async fn client_leaving_before_the_first_byte_is_recorded_as_499() {
    // An upstream that holds the request far longer than the test: the client leaves first.
    let a = MockUp::openai("name: a\nrules: [{delay: 60s}]").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let send = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "leaves-early")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}))
        .send();
    let client = tokio::spawn(send);
    // In this order: the upstream holds the request, then the client leaves (its connection
    // dropped with the request).
    let ok = eventually(Duration::from_secs(30), || async {
        a.requests().await == 1
    })
    .await;
    assert!(ok, "the upstream was called");
    client.abort();
    assert!(
        client.await.is_err_and(|e| e.is_cancelled()),
        "the client gave up before an answer"
    );
    // The row is written when the gateway notices the client left: nothing is in flight then.
    let ok = eventually(Duration::from_secs(30), || async {
        gw.status().await["in_flight"] == 0
    })
    .await;
    assert!(ok, "the gateway noticed the client left");
    gw.stop();
    let got = audit_rows(
        &gw,
        "SELECT status, error_class FROM requests WHERE request_id = 'leaves-early'",
    );
    assert_eq!(got, vec![vec![json!(499), json!("client_closed")]]);
    let att = audit_rows(
        &gw,
        "SELECT endpoint, class FROM attempts WHERE request_id = 'leaves-early'",
    );
    assert_eq!(att, vec![vec![json!("a"), json!("client_closed")]]);
}

#[tokio::test]
async fn a_panic_becomes_a_500_with_its_row() {
    let a = MockUp::openai("name: a").await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  __autohedge_test_panic__: [a]\n",
        a.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &[("AUTOHEDGE_TEST_HOOKS", "1")]);
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "will-panic")
        .json(&json!({"model": "__autohedge_test_panic__", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .expect("an answer, not a reset connection");
    assert_eq!(r.status(), 500);
    assert_eq!(header(&r, "x-request-id"), "will-panic");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "internal_error");
    // The gateway keeps serving.
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    gw.stop();
    let got = audit_rows(
        &gw,
        "SELECT status, error_class FROM requests WHERE request_id = 'will-panic'",
    );
    assert_eq!(got, vec![vec![json!(500), json!("internal_panic")]]);
    // Without the test-hooks switch the same model name is an ordinary route.
    let gw = Gw::start(&cfg);
    let r = gw.chat("__autohedge_test_panic__", "x").await;
    assert_eq!(r.status(), 200);
}

/// A gateway with no descriptor left for an upstream connection (the clients' connections hold
/// them all) answers 503, but blames no endpoint: its attempts are `gateway_out_of_files`, not
/// `connect_error`, so nothing is ejected, and a probe failing the same way is set aside. Once
/// the descriptors are back, the first request is served by the chain's first endpoint. Before,
/// each such attempt counted as a connect error: two requests ejected both endpoints (for 60 s
/// here), and a probe round marked them unhealthy.
#[tokio::test]
async fn a_gateway_out_of_file_descriptors_blames_no_endpoint() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    const LIMIT: usize = 128;
    let mut gw = Gw::start_after_shell(
        &chain_cfg(
            &[("a", &a), ("b", &b)],
            "server: { header_timeout: 60s }\nhealth: { probe_interval: 300ms, flip_after: 1, eject_after: 2, eject_base: 60s }",
        ),
        &format!("ulimit -n {LIMIT}"),
    );
    let pid = gw.pid();
    assert!(
        eventually(Duration::from_secs(5), || async {
            let st = gw.status().await;
            st["endpoints"]["a"]["state"] == "healthy" && st["endpoints"]["b"]["state"] == "healthy"
        })
        .await,
        "{}",
        gw.status().await["endpoints"]
    );
    // Connections the requests will be written on, accepted while descriptors are left.
    let requests: Vec<_> = (0..4)
        .map(|_| std::net::TcpStream::connect(gw.addr).unwrap())
        .collect();
    // Then idle ones (sending nothing; `header_timeout` is 60 s) past the limit: every
    // descriptor is taken, and the rest wait in the accept queue, so one that comes free goes
    // to the next of them at once (the accept loop retries every 50 ms).
    let exhausted_at = std::time::Instant::now();
    let held: Vec<_> = (0..LIMIT + 50)
        .map(|_| std::net::TcpStream::connect(gw.addr).unwrap())
        .collect();
    // The status checks' connections close once this runtime gets to run their tasks; the
    // descriptors they free go to queued connections too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        eventually(Duration::from_secs(5), || async { open_fds(pid) >= LIMIT }).await,
        "{} of {LIMIT} open",
        open_fds(pid)
    );
    for (i, s) in requests.into_iter().enumerate() {
        // The previous request's connection, closed, has gone to a queued one: every
        // descriptor is taken again, and stays so (the accept loop retries every 50 ms, so a
        // descriptor freed by that close is taken back well within the 300 ms it must hold).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut full_since: Option<std::time::Instant> = None;
        loop {
            if open_fds(pid) >= LIMIT {
                let since = *full_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= Duration::from_millis(300) {
                    break;
                }
            } else {
                full_since = None;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "request {i}: {} of {LIMIT} open",
                open_fds(pid)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (status, body) = tokio::task::spawn_blocking(move || raw_chat(s, "chat"))
            .await
            .unwrap();
        assert_eq!(status, 503, "request {i}: {body}");
        assert!(
            body.contains("gateway_out_of_files") && !body.contains("connect_error"),
            "request {i}: {body}"
        );
    }
    assert_eq!(a.requests().await, 0, "no request reached an upstream");
    assert_eq!(b.requests().await, 0);
    // The accept loop failed every 50 ms meanwhile (more than a second of it), and said so —
    // once per 10 s of it (the throttle's period), not twenty times a second.
    let accept_warnings = gw.log().matches("accept failed").count();
    let periods = exhausted_at.elapsed().as_secs() / 10 + 1;
    assert!(
        (1..=periods as usize + 1).contains(&accept_warnings),
        "{accept_warnings} accept warnings in {:?}:\n{}",
        exhausted_at.elapsed(),
        gw.log()
    );

    // The probes' own connections are closed after each answer from now on: the next round
    // needs new sockets, and finds no descriptor either.
    let log_before = gw.log().len();
    let close = "rules: [{when: {path: /v1/models}, headers: {connection: close}}]";
    a.set_script(&format!("name: a\n{close}")).await;
    b.set_script(&format!("name: b\n{close}")).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.log()[log_before..].contains("its failures are set aside")
        })
        .await,
        "no probe round ran out of descriptors:\n{}",
        &gw.log()[log_before..]
    );

    // The descriptors come back: nothing was ejected, and the first request is served by the
    // chain's first endpoint.
    drop(held);
    assert!(
        eventually(Duration::from_secs(5), || async {
            open_fds(pid) < LIMIT / 2
        })
        .await,
        "{} of {LIMIT} still open",
        open_fds(pid)
    );
    let st = gw.status().await;
    for ep in ["a", "b"] {
        let e = &st["endpoints"][ep];
        assert_eq!(
            e["state"], "healthy",
            "{ep}: {e} (not ejected, not unhealthy)"
        );
    }
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(a.requests().await, 1);
    // Counted for an operator's alert: the requests' eight attempts and the probes'.
    let metrics = gw.metrics().await;
    let n: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("autohedge_out_of_files_total "))
        .unwrap_or_else(|| panic!("no autohedge_out_of_files_total in:\n{metrics}"))
        .parse()
        .unwrap();
    assert!(n >= 9.0, "{n}");
    let sql = "SELECT count(*) FROM attempts WHERE class = 'gateway_out_of_files'";
    assert!(
        eventually(Duration::from_secs(5), || async {
            audit_rows(&gw, sql)[0][0].as_i64() >= Some(8)
        })
        .await,
        "the audit trail has {:?}",
        audit_rows(&gw, sql)
    );
    // No state change blamed either endpoint meanwhile (a probe verdict that came and went
    // between two looks at `/status` is still a row here).
    gw.stop();
    let blamed = audit_rows(
        &gw,
        "SELECT endpoint || ' ' || event FROM endpoint_events WHERE event LIKE 'health:%->unhealthy' OR event LIKE 'health:%->ejected'",
    );
    assert!(blamed.is_empty(), "{blamed:?}");
    assert_no_panic(&gw);
}

/// A bounded chaos soak (30 s): endpoints that 5xx, 429 with odd `Retry-After`s, reset, stall
/// and hold connections, with one healthy endpoint last in the chain, while clients stream and
/// some disconnect early. No panic, one row per request, no client error, flat RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak() {
    let flaky =
        MockUp::openai("rules: [{status: 500, when: {every: 2}}, {status: 502, when: {every: 3}}]")
            .await;
    let limited = MockUp::openai(
        r#"rules:
  - { status: 429, when: { every: 5 }, headers: { retry-after: "1e20" } }
  - { status: 429, when: { every: 4 }, headers: { retry-after: "NaN" } }
  - { status: 429, when: { every: 3 }, headers: { retry-after: "Fri, 31 Dec 9999 23:59:59 GMT" } }
  - { status: 429, when: { every: 2 }, headers: { retry-after-ms: "-5" } }
  - { status: 429, headers: { retry-after: "0.05", x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "99999999999999999999999999999999999999h" } }
"#,
    )
    .await;
    let resets = MockUp::openai(
        "rules: [{reset: true, when: {every: 2}}, {when: {stream: true}, reset_after: 0}]",
    )
    .await;
    let stalls =
        MockUp::openai("rules: [{when: {stream: true}, stall_after: 0}, {delay: 3s}]").await;
    let holds = MockUp::openai("name: holds\nrules: [{when: {stream: true}, hold_after_done: true}, {status: 503, when: {every: 2}}]").await;
    let healthy = MockUp::openai("name: healthy").await;
    let mut cfg = String::from("models:\n");
    for (n, m) in [
        ("flaky", &flaky),
        ("limited", &limited),
        ("resets", &resets),
        ("stalls", &stalls),
        ("holds", &holds),
        ("healthy", &healthy),
    ] {
        // The short timeouts are for the misbehaving endpoints, which the soak exercises. The
        // last resort gets generous ones of its own (within `request_timeout`): an answer of
        // its that a busy machine made slow is not a client error the soak is about.
        let timeouts = if n == "healthy" {
            "{ connect: 5s, first_token: 10s, total: 15s }"
        } else {
            "{ connect: 500ms, first_token: 300ms, total: 1s }"
        };
        cfg.push_str(&format!(
            "  {n}: {{ type: openai, base_url: \"{}\", timeouts: {timeouts} }}\n",
            m.base()
        ));
    }
    cfg.push_str("routing_policy:\n  fallback_chain: [flaky, limited, resets, stalls, holds, healthy]\n  max_cooldown: 500ms\n  request_timeout: 20s\nhealth: { probe_interval: 200ms, eject_base: 500ms, eject_max: 1s }\n");
    let mut gw = Gw::start(&cfg);
    let pid = gw.pid();
    let rss = move || rss_kb(pid);
    let url = gw.url("/v1/chat/completions");
    let soak = Duration::from_secs(30);
    let start = std::time::Instant::now();
    let mut workers = Vec::new();
    for w in 0..4u64 {
        let url = url.clone();
        workers.push(tokio::spawn(async move {
            let patient = reqwest::Client::new();
            let impatient = reqwest::Client::builder().timeout(Duration::from_millis(40)).build().unwrap();
            let (mut ids, mut errors) = (Vec::new(), Vec::new());
            let mut i = 0u64;
            // The soak's time, and at least 30 requests a worker however slow the machine.
            while start.elapsed() < soak || i < 30 {
                i += 1;
                let id = format!("chaos-{w}-{i}");
                let stream = i.is_multiple_of(2);
                let leaves = i.is_multiple_of(7);
                let body = json!({"model": "flaky", "stream": stream, "messages": [{"role": "user", "content": "chaos"}]});
                let client = if leaves { &impatient } else { &patient };
                let r = client.post(&url).header("x-request-id", &id).json(&body).send().await;
                ids.push((id.clone(), leaves));
                match r {
                    Ok(r) if r.status() == 200 => {
                        let text = r.text().await.unwrap_or_default();
                        if !leaves && stream && (!text.contains("[DONE]") || text.contains("\"error\"")) {
                            errors.push(format!("{id}: broken stream {text}"));
                        }
                    }
                    Ok(r) if !leaves => errors.push(format!("{id}: {} {}", r.status(), r.text().await.unwrap_or_default())),
                    Ok(_) => {}
                    Err(e) if !leaves => errors.push(format!("{id}: {e}")),
                    Err(_) => {}
                }
            }
            (ids, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    let rss_warm = rss();
    let (mut ids, mut errors) = (Vec::new(), Vec::new());
    for w in workers {
        let (i, e) = w.await.unwrap();
        ids.extend(i);
        errors.extend(e);
    }
    let rss_end = rss();
    assert!(ids.len() > 100, "traffic flowed: {}", ids.len());
    assert!(
        errors.is_empty(),
        "{} client errors while `healthy` served:\n{}",
        errors.len(),
        errors.join("\n")
    );
    assert!(rss_warm > 0, "could not read the gateway's RSS");
    assert!(
        rss_end < rss_warm + 20_000,
        "RSS grew from {rss_warm} kB to {rss_end} kB"
    );
    for m in [&flaky, &limited, &resets, &stalls, &holds] {
        assert!(
            m.stats().await["by_path"]["/v1/chat/completions"]
                .as_u64()
                .unwrap_or(0)
                > 0,
            "every misbehaving endpoint was called"
        );
    }
    gw.stop();
    assert_no_panic(&gw);
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(
        &conn,
        "SELECT COUNT(*) FROM requests WHERE request_id LIKE 'chaos-%'",
    );
    let rows: std::collections::HashSet<String> = conn
        .prepare("SELECT DISTINCT request_id FROM requests WHERE request_id LIKE 'chaos-%'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(n as usize, rows.len(), "no request has two rows");
    // Every patient request has its row. One whose client left after 40 ms has one or none:
    // a starved client may leave before the gateway has read its request head.
    let sent: std::collections::HashSet<&str> = ids.iter().map(|(id, _)| id.as_str()).collect();
    let missing: Vec<&str> = ids
        .iter()
        .filter(|(id, leaves)| !leaves && !rows.contains(id))
        .map(|(id, _)| id.as_str())
        .collect();
    assert!(
        missing.is_empty(),
        "one row per request: none for {missing:?}"
    );
    let unknown: Vec<&String> = rows.iter().filter(|r| !sent.contains(r.as_str())).collect();
    assert!(unknown.is_empty(), "rows for no request sent: {unknown:?}");
    eprintln!(
        "chaos soak: {} requests, RSS {rss_warm} kB after warm-up, {rss_end} kB at the end",
        ids.len()
    );
}
