//! Integration tests: the real binary against real loopback upstreams, one test per routing rule.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use common::*;
use serde_json::{Value, json};

fn two(a: &MockUp, b: &MockUp, extra_policy: &str) -> String {
    format!(
        r#"
models:
  a:
    type: openai
    base_url: {}
    model: upstream-a
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
  b:
    type: openai
    base_url: {}
    model: upstream-b
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
routing_policy:
  fallback_chain: [a, b]
{extra_policy}
routes:
  chat: [a, b]
"#,
        a.base(),
        b.base()
    )
}

#[tokio::test]
async fn non_stream_passes_through_with_headers() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&two(&a, &b, ""));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "my-req-1")
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "foo_unknown": {"x": 1}, "temperature": 0.2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-request-id"), "my-req-1");
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from a!");
    let last = &a.stats().await["last_body"];
    assert_eq!(
        last["foo_unknown"],
        json!({"x": 1}),
        "unknown fields pass through"
    );
    assert_eq!(
        last["model"], "upstream-a",
        "model rewritten to the endpoint's id"
    );
    assert_eq!(b.requests().await, 0);

    // Naming an endpoint starts there; a fresh request id is generated when none is given.
    let r = gw.chat("b", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(header(&r, "x-request-id").len(), 36);

    // Completions and embeddings go through too.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "chat", "prompt": "Say hi"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap()["object"],
        "text_completion"
    );
    let r = gw
        .post(
            "/v1/embeddings",
            json!({"model": "chat", "input": ["a", "b"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);

    // /v1/models lists routes and endpoints.
    let v: Value = reqwest::get(gw.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["chat", "a", "b"]);
    let h: Value = reqwest::get(gw.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
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
    assert!(
        left > 25_000 && left <= 30_000,
        "Retry-After honoured: {left}"
    );
    assert_eq!(ea["totals"]["failures"], 0, "a 429 is not a health failure");
}

#[tokio::test]
async fn max_wait_waits_for_a_cooling_endpoint() {
    let a = MockUp::openai("rules: [{status: 429, times: 1, headers: {retry-after-ms: \"700\"}}]")
        .await;
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
    // path's (a probe's rejection of the same key is tested in hardening.rs).
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
async fn context_length_fails_over_only_to_larger_windows() {
    let small = MockUp::openai("context_window: 80").await;
    let same = MockUp::openai("name: same").await;
    let big = MockUp::openai("name: big").await;
    let vague = MockUp::openai("rules: [{status: 400, error: \"input length exceeds the context length\", error_code: context_length_exceeded}]").await;
    let cfg = format!(
        r#"
models:
  vague: {{ type: openai, base_url: "{}" }}
  small: {{ type: openai, base_url: "{}" }}
  same: {{ type: openai, base_url: "{}", context_window: 80 }}
  big: {{ type: openai, base_url: "{}", context_window: 100000 }}
routing_policy: {{ fallback_chain: [small, same, big] }}
routes:
  short: [small, same]
  vague_only: [vague]
"#,
        vague.base(),
        small.base(),
        same.base(),
        big.base()
    );
    let gw = Gw::start(&cfg);
    let long = "lorem ipsum ".repeat(100);
    let r = gw.chat("small", &long).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(
        same.requests().await,
        0,
        "an endpoint with no larger window is skipped"
    );
    // small's refusal stated its limit: it is learned, kept, and used from the next request.
    assert_eq!(
        gw.status().await["endpoints"]["small"]["learned_context_window"],
        80
    );
    let r = gw.chat("small", &long).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    assert_eq!(
        small.requests().await,
        1,
        "skipped before the call this time"
    );
    // A short prompt still goes to small.
    let r = gw.chat("small", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "small");
    // Context errors do not count against the endpoint.
    assert_eq!(
        gw.status().await["endpoints"]["small"]["totals"]["failures"],
        0
    );
    // Nothing fits: a 400 that says the counted tokens and the largest window.
    let r = gw.chat("short", &long).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("largest context window in its chain is 80 tokens"),
        "{msg}"
    );
    // A refusal that states no limit, with nothing else to try: the upstream's own 400.
    let r = gw.chat("vague_only", &long).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "vague");
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "input length exceeds the context length"
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

#[tokio::test]
async fn stream_failures_before_first_chunk_fail_over_invisibly() {
    let b = MockUp::openai("name: b").await;
    for script in [
        "rules: [{status: 503}]",
        "rules: [{stream_error_after: 0}]",
        "rules: [{stall_after: 0}]",
        "rules: [{reset: true}]",
        "rules: [{cut_after: 0}]",
        "rules: [{body: 'not json at all', status: 200}]",
    ] {
        let a = MockUp::openai(script).await;
        let gw = Gw::start(&two(&a, &b, ""));
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200, "{script}");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b", "{script}");
        let ev = sse_events(r).await;
        assert_eq!(stream_text(&ev), "Hello from b!", "{script}");
        let roles = ev.iter().filter(|e| e.contains("\"role\"")).count();
        assert_eq!(
            roles, 1,
            "nothing from the failed upstream reached the client: {script}"
        );
        assert_eq!(ev.last().unwrap(), "[DONE]");
    }
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
async fn low_success_rate_demotes_behind_healthy() {
    let a = MockUp::openai("rules: [{status: 503, times: 4}]").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&two(
        &a,
        &b,
        "  success_threshold: 0.85\n  min_samples: 4\n  window: 60s",
    ));
    for _ in 0..4 {
        let r = gw.chat("chat", "x").await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    }
    // a is healthy again, but its window says 0/4: it goes behind b.
    let r = gw.chat("chat", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    assert_eq!(a.requests().await, 4);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["state"], "degraded");
    assert_eq!(st["endpoints"]["a"]["success_rate"], 0.0);
    // A demoted endpoint is still tried when the healthy one fails.
    b.set_script("rules: [{status: 500}]").await;
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
}

#[tokio::test]
async fn missing_capability_is_skipped() {
    let a = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "name: a").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: vllm, base_url: \"{}\" }}\n  b: {{ type: openai, base_url: \"{}\" }}\n",
        a.base(),
        b.base()
    ));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 0);
    // Plain text still goes to the vLLM endpoint.
    let r = gw.chat("a", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
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
async fn api_keys_never_leak() {
    // Its tail (what the mock reports, and what must not appear) has letters no request id,
    // timestamp or latency can hold: with "3210" this test failed once by such a chance.
    const SECRET: &str = "sk-proj-SUPERSECRETVALUE98765QzXw";
    let a = MockUp::openai("keys: [sk-some-other-key-000000000]").await;
    let b = MockUp::openai("rules: [{status: 500}]").await;
    let tmp = tempfile::tempdir().unwrap();
    let key_file = tmp.path().join("key.txt");
    std::fs::write(&key_file, format!("{SECRET}\n")).unwrap();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"file:{}\" }}\n  b: {{ type: openai, base_url: \"{}\", api_key: env:AH_LEAK_KEY }}\n",
        a.base(),
        key_file.display(),
        b.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[("AH_LEAK_KEY", SECRET)]);
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 503);
    let body = r.text().await.unwrap();
    // First: both keys were loaded and sent — the file key to a (by the probe or the request,
    // which a rejected), the env key to b (which answered 500).
    let ok = eventually(Duration::from_secs(5), || async {
        a.stats().await["key_tails_all"]
            .as_array()
            .is_some_and(|t| t.contains(&json!("QzXw")))
    })
    .await;
    assert!(ok, "the file: key reached a: {}", a.stats().await);
    assert_eq!(
        b.stats().await["key_tails"],
        json!(["QzXw"]),
        "the env: key reached b"
    );
    let status = gw.status().await.to_string();
    let check = std::process::Command::new(BIN)
        .env("AH_LEAK_KEY", SECRET)
        .args(["check-config"])
        .arg(&gw.config_path)
        .output()
        .unwrap();
    let check_out = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check_out.contains("env:AH_LEAK_KEY"), "{check_out}");
    gw.stop();
    let db = gw.db_text();
    let log = gw.log();
    // The whole key and its distinctive middle never appear anywhere.
    for (what, text) in [
        ("503 body", &body),
        ("/status", &status),
        ("check-config", &check_out),
        ("sqlite", &db),
        ("log", &log),
    ] {
        assert!(!text.contains(SECRET), "{what} contains the key");
        assert!(
            !text.contains("SUPERSECRET"),
            "{what} contains part of the key"
        );
        assert!(!text.contains("QzXw"), "{what} contains the key's tail");
    }
    assert!(body.contains("auth_failed"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_one_audit_row_after_sigterm() {
    // a fails every third request; b is slow (500 ms before a full answer, 50 ms between stream
    // chunks), so SIGTERM lands while streams and slow requests are in flight.
    let a = MockUp::openai("rules: [{status: 503, when: {every: 3}}]").await;
    let b = MockUp::openai(
        "name: b\nchunk_delay: 50ms\nrules: [{when: {stream: false}, delay: 500ms}]",
    )
    .await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    let c = reqwest::Client::new();
    let mut ids = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..60 {
        let id = format!("bulk-{i}");
        ids.push(id.clone());
        let req = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-request-id", id)
            .json(&json!({"model": if i % 7 == 0 { "nope" } else { "chat" }, "stream": i % 2 == 0, "messages": [{"role": "user", "content": "x"}]}));
        tasks.push(tokio::spawn(async move {
            let r = req.send().await.expect("answered, not reset");
            let status = r.status().as_u16();
            let body = r.text().await.expect("the whole body");
            (status, body)
        }));
    }
    // Most requests have reached an upstream and are still running.
    let ok = eventually(Duration::from_secs(10), || async {
        a.requests().await + b.requests().await >= 30
    })
    .await;
    assert!(ok, "requests in flight");
    let in_flight = gw.status().await["in_flight"].as_u64().unwrap_or(0);
    assert!(in_flight > 0, "SIGTERM must land with requests in flight");
    gw.stop();
    // The drain let every one of them finish.
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert!(status == 200 || status == 404, "{status} {body}");
        if body.starts_with("data:") {
            assert!(body.contains("[DONE]"), "stream finished: {body}");
        }
    }
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let mut got: Vec<String> = conn
        .prepare("SELECT request_id FROM requests")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    got.sort();
    ids.sort();
    assert_eq!(got, ids, "exactly one row per request id");
    let failovers: i64 = one(
        &conn,
        "SELECT COUNT(*) FROM attempts WHERE class = 'server_error'",
    );
    assert!(failovers >= 10, "{failovers}");
    let version: i64 = one(&conn, "PRAGMA user_version");
    assert_eq!(version, 12);
}

#[tokio::test]
async fn live_reload_swaps_the_order_and_rejects_invalid_files() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let cfg = two(&a, &b, "");
    let gw = Gw::start(&cfg);
    assert_eq!(
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint"),
        "a"
    );
    // Edit the way an editor does: write a new file and rename it over the old one.
    let swapped = cfg.replace("chat: [a, b]", "chat: [b, a]");
    let tmp = gw.dir.join("config.yaml.tmp");
    std::fs::write(&tmp, &swapped).unwrap();
    std::fs::rename(&tmp, &gw.config_path).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint") == "b"
    })
    .await;
    assert!(ok, "new order served");
    // State survives the reload.
    assert!(
        gw.status().await["endpoints"]["a"]["totals"]["successes"]
            .as_u64()
            .unwrap()
            >= 1
    );

    // An invalid file is rejected with the bad key's path; the old table stays live.
    std::fs::write(
        &gw.config_path,
        swapped.replace("model: upstream-b", "model: upstream-b\n    bogus_key: 1"),
    )
    .unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["config"]["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("models.b") && e.contains("bogus_key"))
    })
    .await;
    assert!(ok, "{}", gw.status().await["config"]);
    assert_eq!(
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint"),
        "b"
    );
    assert!(gw.log().contains("bogus_key"));

    // A valid file is picked up again by the watcher. (What only SIGHUP reloads — a `file:` key
    // kept outside the watched directory — is tested in tests/hardening.rs,
    // `replacing_a_rejected_keys_value_clears_it_on_reload`.)
    std::fs::write(&gw.config_path, &cfg).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint") == "a"
    })
    .await;
    assert!(ok);
}

#[tokio::test]
async fn stats_and_check_config_commands() {
    let a = MockUp::openai("rules: [{status: 503, when: {every: 2}}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    for _ in 0..6 {
        gw.chat("chat", "x").await;
    }
    gw.stop();
    let out = std::process::Command::new(BIN)
        .args(["stats", "--since", "1h", "--json", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let a_row = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["endpoint"] == "a")
        .unwrap();
    assert_eq!(a_row["requests"], 6);
    assert_eq!(a_row["success_rate"], 0.5);
    assert_eq!(a_row["errors"]["server_error"], 3);
    assert_eq!(a_row["fallbacks_from"], 3);
    let b_row = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["endpoint"] == "b")
        .unwrap();
    assert_eq!(b_row["fallbacks_served"], 3);
    let out = std::process::Command::new(BIN)
        .args(["stats", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("server_error=3"), "{text}");

    // check-config: resolved chains and key sources; unset env keys named.
    let cfg = gw.dir.join("check.yaml");
    std::fs::write(
        &cfg,
        "models:\n  x: { type: openai, api_key: env:AH_SURELY_UNSET_KEY }\n  y: { type: ollama, host: \"http://127.0.0.1:11434\", model: \"qwen2.5:7b\", timeout: 3 }\nrouting_policy: { fallback_chain: [x, y], cache_ttl: 5m }\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("fallback_chain: x -> y"), "{text}");
    assert!(
        text.contains("AH_SURELY_UNSET_KEY") && text.contains("not set"),
        "{text}"
    );
    std::fs::write(&cfg, "models:\n  x: { type: openai, colour: blue }\n").unwrap();
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("models.x") && text.contains("colour"),
        "{text}"
    );
}

#[tokio::test]
async fn mock_upstream_binary_runs_a_script_file() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("s.yaml");
    std::fs::write(&script, "name: cli\nrules:\n  - when: { every: 2 }\n    status: 429\n    headers: { retry-after: \"7\" }\n").unwrap();
    let mut child = std::process::Command::new(BIN)
        .args([
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--flavor",
            "openai",
            "--script",
        ])
        .arg(&script)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    let c = reqwest::Client::new();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let r1 = c
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r1.status(), 200);
    let r2 = c
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r2.status(), 429);
    assert_eq!(header(&r2, "retry-after"), "7");
    assert_eq!(header(&r2, "x-ratelimit-remaining-requests"), "0");
    let v: Value = r2.json().await.unwrap();
    assert_eq!(v["error"]["type"], "requests");
    let _ = child.kill();
    let _ = child.wait();
}

fn ollama_cfg(o: &MockUp, b: &MockUp) -> String {
    format!(
        r#"
models:
  local:
    type: ollama
    host: "http://{}"
    model: "qwen2.5:7b"
    max_tokens: 256
    capabilities: [chat, completions, embeddings, tools, vision]
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
  b: {{ type: openai, base_url: "{}", model: upstream-b }}
routing_policy: {{ fallback_chain: [local, b] }}
"#,
        o.addr,
        b.base()
    )
}

#[tokio::test]
async fn ollama_answers_look_like_openai() {
    let o = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "reply: \"Hi there friend\"",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&ollama_cfg(&o, &b));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "ollama-1")
        .json(&json!({"model": "local", "max_tokens": 1000, "temperature": 0.1, "stop": "END", "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "local");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "local");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["content"], "Hi there friend");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let sent = &o.stats().await["last_body"];
    assert_eq!(sent["model"], "qwen2.5:7b");
    assert_eq!(
        sent["options"]["num_predict"], 256,
        "capped at the endpoint's max_tokens"
    );
    assert_eq!(sent["options"]["stop"], json!(["END"]));
    assert_eq!(sent["stream"], false);
    assert_eq!(o.stats().await["by_path"]["/api/chat"], 1);

    // Streamed: role first, content chunks, finish, usage, [DONE].
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "ollama-2")
        .json(&json!({"model": "local", "stream": true, "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    let ev = sse_events(r).await;
    assert_eq!(stream_text(&ev), "Hi there friend");
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    let ids: std::collections::HashSet<String> = ev[..ev.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one stable id per stream");
    let fin: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert_eq!(ev.last().unwrap(), "[DONE]");

    // Legacy completions and embeddings.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "local", "prompt": "Say hi"}),
        )
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hi there friend");
    assert_eq!(o.stats().await["by_path"]["/api/generate"], 1);
    let r = gw
        .post(
            "/v1/embeddings",
            json!({"model": "local", "input": ["a", "b"], "encoding_format": "base64"}),
        )
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert!(v["data"][0]["embedding"].is_string(), "base64 honoured");
    assert_eq!(v["usage"]["prompt_tokens"], 2);

    // Tool calls, plain and streamed.
    o.set_script("rules: [{tool_call: get_weather}]").await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "tools": tools, "messages": [{"role": "user", "content": "weather?"}]}))
        .await;
    let v: Value = r.json().await.unwrap();
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        o.stats().await["last_body"]["tools"],
        tools,
        "tools forwarded"
    );
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "stream": true, "tools": tools, "messages": [{"role": "user", "content": "weather?"}]}))
        .await;
    let ev = sse_events(r).await;
    let chunk: Value = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| v.pointer("/choices/0/delta/tool_calls").is_some())
        .unwrap();
    assert_eq!(chunk["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
    assert_eq!(
        chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let fin: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "tool_calls");

    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let (tout, est): (i64, bool) = conn
        .query_row(
            "SELECT tokens_out, tokens_estimated FROM requests WHERE request_id = 'ollama-2'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        (tout, est),
        (3, false),
        "Ollama's own counts recorded for a stream without include_usage"
    );
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
async fn probes_report_backend_self_description_in_status() {
    let o = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "models: [\"qwen2.5:7b\", \"llama3:latest\"]\nloaded: [\"qwen2.5:7b\"]",
    )
    .await;
    let v = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "name: v").await;
    let gw = Gw::start(&format!(
        "models:\n  local: {{ type: ollama, host: \"http://{}\", model: \"qwen2.5:7b\" }}\n  llama: {{ type: ollama, host: \"http://{}\", model: llama3 }}\n  missing: {{ type: ollama, host: \"http://{}\", model: \"phi4\" }}\n  v: {{ type: vllm, base_url: \"{}\" }}\nhealth: {{ probe_interval: 100ms, probe_timeout: 1s }}\n",
        o.addr,
        o.addr,
        o.addr,
        v.base()
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        let st = gw.status().await;
        !st["endpoints"]["v"]["probe"].is_null() && !st["endpoints"]["missing"]["probe"].is_null()
    })
    .await;
    assert!(ok);
    let st = gw.status().await;
    let e = &st["endpoints"];
    assert_eq!(e["local"]["probe"]["detail"]["model_present"], true);
    assert_eq!(e["local"]["probe"]["detail"]["model_loaded"], true);
    assert_eq!(
        e["llama"]["probe"]["detail"]["model_present"], true,
        "bare name matches :latest"
    );
    assert_eq!(e["llama"]["probe"]["detail"]["model_loaded"], false);
    assert_eq!(e["missing"]["probe"]["detail"]["model_present"], false);
    assert_eq!(e["missing"]["probe"]["ok"], false);
    assert_eq!(e["v"]["probe"]["ok"], true);
    assert_eq!(e["v"]["probe"]["detail"]["load"]["kv_cache_usage"], 0.1);
    assert_eq!(
        e["v"]["probe"]["detail"]["load"]["num_requests_waiting"],
        0.0
    );
    assert_eq!(v.requests().await, 0, "probes never bill a token");
}

fn long_conversation() -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": "You are a senior Rust reviewer. Answer briefly."}),
    ];
    for i in 0..8 {
        m.push(json!({"role": "user", "content": format!("Old question {i} about gardening: when should I water tomatoes and how much mulch is right for the beds in a dry summer?")}));
        m.push(json!({"role": "assistant", "content": format!("Old answer {i}: water deeply twice a week in the morning, keep five centimetres of mulch, and check the soil by hand before watering again.")}));
    }
    m.insert(5, json!({"role": "user", "content": "Here is my tokio channel code:\n```rust\nlet (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(16);\ntx.send(1).await?;\n```\nWhy is it slow?"}));
    m.insert(6, json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "run_clippy", "arguments": "{\"path\": \"src/main.rs\"}"}}]}));
    m.insert(7, json!({"role": "tool", "tool_call_id": "call_1", "content": "clippy: tokio channel capacity 16 is fine"}));
    m.push(json!({"role": "user", "content": "Now a different thing: my tokio mpsc channel blocks when the buffer is full. Why?"}));
    m
}

#[tokio::test]
async fn context_guard_skips_rejects_and_truncates() {
    let a = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"
models:
  small: {{ type: openai, base_url: "{}", model: gpt-4o-mini, context_window: 400 }}
routing_policy:
  fallback_chain: [small]
  truncation: {{ keep_turns: 2, omission_note: true }}
routes:
  strict: [small]
  trimming: {{ chain: [small], on_context_overflow: truncate }}
"#,
        a.base()
    );
    let mut gw = Gw::start(&cfg);
    let convo = long_conversation();
    // Counted with o200k_base before any call: too big for 95% of 400, so nothing is sent.
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "strict", "messages": convo}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("400 tokens"),
        "{v}"
    );
    assert_eq!(a.requests().await, 0);

    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "trunc-1")
        .json(&json!({"model": "trimming", "max_tokens": 50, "messages": convo}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let trunc = header(&r, "x-autohedge-truncated");
    let (msgs, toks) = trunc
        .split_once('/')
        .expect("x-autohedge-truncated: messages/tokens");
    let (msgs, toks): (usize, u64) = (msgs.parse().unwrap(), toks.parse().unwrap());
    assert!(msgs > 0 && toks > 0, "{trunc}");
    let sent = a.stats().await["last_body"]["messages"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        sent.len() + msgs,
        convo.len() + 1,
        "dropped messages plus one note"
    );
    assert_eq!(sent[0], convo[0], "system message whole and first");
    assert!(sent[1]["content"].as_str().unwrap().contains("omitted"));
    // The latest two user turns are intact at the end.
    assert_eq!(&sent[sent.len() - 3..], &convo[convo.len() - 3..]);
    // A tool call never travels without its result, nor a result without its call.
    let calls = sent
        .iter()
        .filter(|m| m.get("tool_calls").is_some())
        .count();
    let results = sent.iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(calls, results);
    // The tokio exchange is the most related to the last question: it survives the trim.
    assert!(sent.iter().any(|m| {
        m["content"]
            .as_str()
            .is_some_and(|c| c.contains("mpsc::channel::<u32>"))
    }));
    for m in &sent {
        if let Some(c) = m["content"].as_str() {
            assert_eq!(c.matches("```").count() % 2, 0, "a code fence was split");
        }
    }
    // What was sent fits: count it the way the gateway does.
    let out = std::process::Command::new(BIN)
        .args(["count-tokens", "--json", "--model", "small", "--config"])
        .arg(&gw.config_path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(json!({"messages": sent}).to_string().as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    let counted: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(counted["tokens"].as_u64().unwrap() + 50 <= 380, "{counted}");
    assert_eq!(counted["method"], "tiktoken o200k_base");
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let (tm, tt, counted): (i64, i64, i64) = conn
        .query_row("SELECT truncated_messages, truncated_tokens, prompt_tokens_counted FROM requests WHERE request_id = 'trunc-1'", [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap();
    assert_eq!((tm as usize, tt as u64), (msgs, toks));
    assert!(counted > 380);
}

#[tokio::test]
async fn payload_hygiene_and_learned_limits_persist() {
    let a = MockUp::openai("name: a").await;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", payload_hygiene: strip }}\n",
        a.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "hyg-1")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "line\u{2028}sep\u{0007}bell\nnewline\ttab"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        a.stats().await["last_body"]["messages"][0]["content"],
        "linesepbell\nnewline\ttab"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(
        &conn,
        "SELECT sanitized_chars FROM requests WHERE request_id = 'hyg-1'",
    );
    assert_eq!(n, 2);

    // A limit learned from an upstream error survives a restart.
    a.set_script("context_window: 80").await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\n",
        a.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    let r = gw.chat("a", &"word ".repeat(100)).await;
    assert_eq!(r.status(), 400, "nothing larger to try");
    // The bound fit the configured window, so nothing was counted before the upstream refused:
    // the refusal counts it, to say what the prompt needs.
    let msg = r.json::<Value>().await.unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("needs 108 prompt tokens"), "{msg}");
    assert_eq!(
        gw.status().await["endpoints"]["a"]["learned_context_window"],
        80
    );
    gw.stop();
    let gw = Gw::start_in(tmp.path(), &cfg, &[]);
    assert_eq!(
        gw.status().await["endpoints"]["a"]["learned_context_window"],
        80
    );
    let before = a.requests().await;
    let r = gw.chat("a", &"word ".repeat(100)).await;
    assert_eq!(r.status(), 400);
    assert_eq!(
        a.requests().await,
        before,
        "skipped before calling, from the learned limit"
    );
}

#[tokio::test]
async fn backend_tokenize_counts_and_teaches_the_window() {
    let v = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "context_window: 80").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n  v: {{ type: vllm, base_url: \"{}\", backend_tokenize: vllm, tokenize_timeout: 500ms }}\n  b: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\n",
        v.base(),
        b.base()
    ));
    let r = gw.chat("v", &"several words here ".repeat(40)).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(
        v.requests().await,
        0,
        "vLLM's own count said it would not fit"
    );
    assert_eq!(v.stats().await["by_path"]["/tokenize"], 1);
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["v"]["learned_context_window"], 80,
        "max_model_len learned"
    );
    // Short prompts still go to v.
    let r = gw.chat("v", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "v");
}

#[tokio::test]
async fn probes_and_passive_ejection_drive_health() {
    // a's /v1/models answers 401: its key is revoked; after two probes it is unhealthy and skipped.
    let a = MockUp::openai("rules: [{when: {path: /v1/models}, status: 401}]").await;
    let b = MockUp::openai("name: b").await;
    let c = MockUp::openai("name: c").await;
    let gw = Gw::start(&format!(
        r#"
models:
  a: {{ type: openai, base_url: "{}" }}
  b: {{ type: openai, base_url: "{}" }}
  c: {{ type: openai, base_url: "{}" }}
# One of three healthy is not a panic here (1/3 >= 0.3): the ejection is honoured.
# Slow start off: this test asserts the recovered endpoint takes traffic at once (slow start
# itself is tested in tail.rs).
routing_policy: {{ fallback_chain: [a, b, c], panic_threshold: 0.3, slow_start: 0 }}
# An ejection window (3 s) far longer than the two requests that must see it, on any machine.
health: {{ probe_interval: 100ms, flip_after: 2, eject_after: 3, eject_base: 3s, eject_max: 6s }}
"#,
        a.base(),
        b.base(),
        c.base()
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["a"]);
    assert!(
        gw.status().await["endpoints"]["a"]["health_reason"]
            .as_str()
            .unwrap()
            .contains("401")
    );
    let r = gw.chat("a", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(
        a.requests().await,
        0,
        "an unhealthy endpoint gets no real traffic"
    );

    // b starts failing real traffic: three in a row eject it (its probes still pass).
    b.set_script("rules: [{status: 500}]").await;
    for _ in 0..3 {
        let r = gw.chat("b", "x").await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "c");
    }
    let st = gw.status().await;
    assert!(
        matches!(
            st["endpoints"]["b"]["state"].as_str(),
            Some("ejected" | "half_open")
        ),
        "{}",
        st["endpoints"]["b"]
    );
    let before = b.requests().await;
    let r = gw.chat("b", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "c");
    assert_eq!(b.requests().await, before, "ejected: skipped");
    // b recovers; after the ejection a half-open probe (not real traffic) restores it.
    b.set_script("name: b").await; // (resets the mock's counters)
    // Client traffic for b goes on while it recovers: served by c, never by b.
    let (mut sent_meanwhile, mut served_by_b) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    while gw.status().await["endpoints"]["b"]["state"] != "healthy" {
        assert!(
            Instant::now() < deadline,
            "{}",
            gw.status().await["endpoints"]["b"]
        );
        let r = gw.chat("b", "x").await;
        sent_meanwhile += 1;
        // A probe may restore b between the status read and this request: then (and only
        // then) it serves.
        if header(&r, "x-autohedge-endpoint") == "b" {
            served_by_b += 1;
            assert_eq!(gw.status().await["endpoints"]["b"]["state"], "healthy");
            break;
        }
        assert_eq!(header(&r, "x-autohedge-endpoint"), "c");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        sent_meanwhile > 0,
        "client requests were sent during the recovery"
    );
    let probes = b.stats().await["by_path"]["/v1/models"]
        .as_u64()
        .unwrap_or(0);
    assert!(probes >= 1, "a probe (GET /v1/models) reached b");
    assert_eq!(
        b.requests().await,
        served_by_b,
        "recovery came from a probe, not real traffic: b got no request before it was healthy"
    );
    assert_eq!(
        header(&gw.chat("b", "x").await, "x-autohedge-endpoint"),
        "b"
    );
    // Every transition is an endpoint_events row.
    let mut gw = gw;
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let evs: Vec<String> = conn
        .prepare("SELECT endpoint || ' ' || event FROM endpoint_events WHERE event LIKE 'health:%' ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(
        evs.contains(&"a health:healthy->unhealthy".to_string()),
        "{evs:?}"
    );
    assert!(
        evs.contains(&"b health:healthy->ejected".to_string()),
        "{evs:?}"
    );
    assert!(
        evs.contains(&"b health:half_open->healthy".to_string()),
        "{evs:?}"
    );
}

#[tokio::test]
async fn unreachable_docker_daemon_is_reported_and_routing_goes_on() {
    let a = MockUp::openai("name: a").await;
    let mut gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\" }}\ndocker: {{ enabled: true, interval: 200ms, timeout: 1s }}\n",
            a.base()
        ),
        &[("DOCKER_HOST", "tcp://127.0.0.1:1")],
    );
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["docker"]["status"] == "docker_daemon_unreachable"
    })
    .await;
    assert!(ok, "{}", gw.status().await["docker"]);
    assert_eq!(gw.chat("a", "x").await.status(), 200, "routing carries on");
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(
        &conn,
        "SELECT COUNT(*) FROM endpoint_events WHERE event = 'docker_daemon_unreachable'",
    );
    assert_eq!(n, 1, "recorded once per transition");
}

#[tokio::test]
async fn custom_health_check_warming_purge_hook_and_semantic_probe() {
    // Warming until the test has seen it (no transient state to catch in time).
    let a = MockUp::openai(
        r#"rules:
  - { when: { path: /custom-health }, status: 200, body: '{"status":"healthy","uptime_seconds":12}' }
"#,
    )
    .await;
    let growing = r#"rules:
  - { when: { path: /custom-health }, times: 1, status: 200, body: '{"status":"healthy","kv_cache_size_mb":100,"uptime_seconds":999}' }
  - { when: { path: /custom-health }, times: 1, status: 200, body: '{"status":"healthy","kv_cache_size_mb":150,"uptime_seconds":999}' }
  - { when: { path: /custom-health }, status: 200, body: '{"status":"healthy","kv_cache_size_mb":200,"uptime_seconds":999}' }
  - { when: { path: /purge }, status: 200, body: '{}' }
"#;
    let s = MockUp::openai("rules: [{status: 500}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&format!(
        r#"
models:
  a:
    type: vllm
    base_url: "{}"
    health_check: {{ url: /custom-health, expect: {{ status: healthy }}, kv_growth_probes: 3, purge: {{ url: /purge, method: POST }} }}
  s: {{ type: openai, base_url: "{}", semantic_probe: true }}
  b: {{ type: openai, base_url: "{}" }}
# 1 of 3 healthy is no panic here (1/3 >= 0.3): warming and unhealthy endpoints are skipped.
routing_policy: {{ fallback_chain: [a, s, b], panic_threshold: 0.3, slow_start: 0 }}
health: {{ probe_interval: 100ms, flip_after: 1, warmup: 300ms }}
"#,
        a.base(),
        s.base(),
        b.base()
    ));
    // uptime 12s: warming, skipped.
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "warming"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["a"]);
    let r = gw.chat("a", "x").await;
    assert_ne!(header(&r, "x-autohedge-endpoint"), "a", "warming: skipped");
    a.set_script(growing).await;
    // The semantic probe's completion fails although GET /models works: unhealthy.
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["s"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["s"]);
    // Then healthy, and the KV cache grows across three probes: the purge hook is called once.
    let ok = eventually(Duration::from_secs(5), || async {
        a.stats().await["by_path"]["/purge"] == 1
    })
    .await;
    assert!(ok, "{}", a.stats().await);
    // Three more probes that keep seeing it grow.
    let probes = |v: &Value| v["by_path"]["/custom-health"].as_u64().unwrap_or(0);
    let seen = probes(&a.stats().await);
    let ok = eventually(Duration::from_secs(5), || async {
        probes(&a.stats().await) >= seen + 3
    })
    .await;
    assert!(ok, "{}", a.stats().await);
    assert_eq!(
        a.stats().await["by_path"]["/purge"],
        1,
        "only once while it keeps growing"
    );
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "a"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let reason: String = one(
        &conn,
        "SELECT reason FROM endpoint_events WHERE event = 'kv_cache_purge'",
    );
    assert!(reason.contains("result: ok"), "{reason}");
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
async fn keeps_serving_past_the_shutdown_grace() {
    // Regression: the drain bound once wrapped the whole server, which stopped accepting after
    // `shutdown_grace` of uptime.
    let a = MockUp::openai("name: a").await;
    let mut gw = Gw::start(&format!(
        "server: {{ shutdown_grace: 1s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        gw.chat("a", "x").await.status(),
        200,
        "still serving after shutdown_grace"
    );
    // (`stop` fails the test if SIGTERM does not end the process.)
    gw.stop();
}

/// A bounded soak: a minute-scale run past every periodic timer of the first minute (the 10 s
/// stats snapshot, the 30 s default shutdown grace) with steady loopback traffic: every request
/// must succeed, memory must stay flat, and the audit trail must hold every request.
#[tokio::test]
async fn soak_forty_seconds_of_steady_traffic() {
    let a = MockUp::openai("rules: [{status: 503, when: {every: 10}}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    let pid = gw.pid();
    let rss = move || rss_kb(pid);
    let c = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    let (mut sent, mut rss_after_warmup) = (0u64, 0u64);
    while Instant::now() < deadline {
        let stream = sent % 3 == 0;
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "soak"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            200,
            "request {sent} failed at {:?}",
            Instant::now()
        );
        let _ = r.bytes().await.unwrap();
        sent += 1;
        if sent == 300 {
            rss_after_warmup = rss();
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let rss_end = rss();
    // The count depends on the machine's speed; what matters is that traffic ran past the
    // warm-up sample and every request succeeded and was recorded.
    assert!(sent > 300, "{sent}");
    assert!(rss_after_warmup > 0, "could not read the gateway's RSS");
    assert!(
        rss_end < rss_after_warmup + 20_000,
        "RSS grew from {rss_after_warmup} kB to {rss_end} kB"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(&conn, "SELECT COUNT(*) FROM requests");
    assert_eq!(n as u64, sent);
}

#[tokio::test]
async fn a_closed_stdout_does_not_panic_the_cli() {
    // `autohedge check-config | head -1`: the reader goes away after one line.
    let mut child = std::process::Command::new(BIN)
        .args(["check-config", "config/example.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?} {err}", out.status);
}

/// A drain that drops nothing: on SIGTERM a gateway answers `/health` 503 `draining` at once,
/// keeps serving for `server.drain_delay` with `Connection: close` on every answer, then stops
/// accepting and finishes what is in flight. Two gateways behind a balancer that follows
/// `/health` (every 100 ms, as a load balancer or Swarm's mesh does) and a client that retries a
/// refused connection twice (the OpenAI SDK's default), each gateway restarted in turn under
/// load: not one request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_restarted_in_turn_under_load_drop_nothing() {
    use std::sync::{Arc, Mutex};
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        "server: {{ drain_delay: 2s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 1h }}\n",
        up.base()
    );
    let mut gws = [Gw::start(&cfg), Gw::start(&cfg)];
    for g in &gws {
        g.ready().await;
    }
    // The balancer's view: each member's address and whether its last /health was 200.
    let members: Arc<Mutex<Vec<(SocketAddr, bool)>>> =
        Arc::new(Mutex::new(gws.iter().map(|g| (g.addr, true)).collect()));
    let stop = CancellationToken::new();
    let checker = {
        let (members, stop) = (members.clone(), stop.clone());
        tokio::spawn(async move {
            let c = reqwest::Client::new();
            while !stop.is_cancelled() {
                let list: Vec<SocketAddr> = members.lock().unwrap().iter().map(|m| m.0).collect();
                for addr in list {
                    let ok = c
                        .get(format!("http://{addr}/health"))
                        .timeout(Duration::from_millis(500))
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    for m in members.lock().unwrap().iter_mut() {
                        if m.0 == addr {
                            m.1 = ok;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for w in 0..4usize {
        let (members, stop, sent, failed) =
            (members.clone(), stop.clone(), sent.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let mut turn = w;
            while !stop.is_cancelled() {
                let mut last = String::new();
                let mut ok = false;
                for _attempt in 0..3 {
                    turn += 1;
                    let addr = {
                        let m = members.lock().unwrap();
                        let healthy: Vec<SocketAddr> =
                            m.iter().filter(|m| m.1).map(|m| m.0).collect();
                        let pool = if healthy.is_empty() {
                            m.iter().map(|m| m.0).collect()
                        } else {
                            healthy
                        };
                        pool[turn % pool.len()]
                    };
                    match c
                        .post(format!("http://{addr}/v1/chat/completions"))
                        .json(
                            &json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
                        )
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 200 => {
                            ok = r.text().await.is_ok();
                            if ok {
                                break;
                            }
                        }
                        // The SDK retries 408, 409, 429 and 5xx too: the count says which.
                        Ok(r) => last = format!("{}", r.status()),
                        Err(e) => {
                            last = format!("{e}");
                            // Only a connection that was never made is retried here; the SDK
                            // retries any connection error after a short backoff.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !ok {
                    failed.lock().unwrap().push(last);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, gw) in gws.iter_mut().enumerate() {
        let before = sent.load(std::sync::atomic::Ordering::Relaxed);
        gw.term();
        // Draining: /health says so as soon as the signal is handled (the signal arrives on
        // its own time: polled), and a request is still served, with `Connection: close`.
        let draining = eventually(Duration::from_secs(5), || async {
            match reqwest::get(gw.url("/health")).await {
                Ok(h) if h.status() == 503 => h
                    .json::<Value>()
                    .await
                    .is_ok_and(|v| v["status"] == "draining"),
                _ => false,
            }
        })
        .await;
        assert!(draining, "gateway {i}: /health never said draining");
        let r = gw.chat("a", "still serving").await;
        assert_eq!(r.status(), 200, "served while draining");
        assert_eq!(header(&r, "connection"), "close");
        let exited = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(20)));
        assert!(exited, "gateway {i} stopped cleanly");
        let old = gw.addr;
        *gw = Gw::start(&cfg);
        gw.ready().await;
        for m in members.lock().unwrap().iter_mut() {
            if m.0 == old {
                *m = (gw.addr, true);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            sent.load(std::sync::atomic::Ordering::Relaxed) > before + 20,
            "traffic went on while gateway {i} restarted"
        );
    }
    stop.cancel();
    for w in workers {
        w.await.unwrap();
    }
    checker.await.unwrap();
    let failed = failed.lock().unwrap().clone();
    let total = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(total > 100, "{total} requests sent");
    assert!(
        failed.is_empty(),
        "{} of {total} failed: {failed:?}",
        failed.len()
    );
}
