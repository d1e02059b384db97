//! README's rules, one test each, against the real binary: every rule the README states that no
//! other test covered. Each test shows the upstream was really called (or really skipped) before
//! asserting what the gateway made of it.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

fn ep(name: &str, m: &MockUp, extra: &str) -> String {
    format!(
        "  {name}: {{ type: openai, base_url: \"{}\"{extra} }}\n",
        m.base()
    )
}

/// The first column of each row, as text.
fn db_rows(gw: &Gw, sql: &str) -> Vec<String> {
    audit_rows(gw, sql)
        .into_iter()
        .map(|r| r[0].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Asserts an endpoint's `health_reason` in a `/status` document says `needle`.
fn assert_reason(st: &Value, name: &str, needle: &str) {
    let e = &st["endpoints"][name];
    let reason = e["health_reason"].as_str().unwrap_or("");
    assert!(reason.contains(needle), "{name}: {e}");
}

fn cooldown_ms(st: &Value, name: &str) -> u64 {
    st["endpoints"][name]["cooldown_remaining_ms"]
        .as_u64()
        .unwrap_or(0)
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
    // Live, the bounds (the clock runs on); the exact values are in the events below.
    assert!(o > 0 && o <= 7_000, "endpoint cooldown: {o}");
    assert!(d > 0 && d <= 3_000, "default_cooldown: {d}");
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

#[tokio::test]
async fn a_committed_stream_past_timeouts_total_ends_with_stream_timeout() {
    let a = MockUp::openai(
        "name: slow\nreply: \"one two three four five six seven eight\"\nchunk_delay: 300ms",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n{}",
        ep("a", &a, ", timeouts: { first_token: 2s, total: 1s }")
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

/// Every `skipped_*` attempt name, in one request's audit row.
#[tokio::test]
async fn every_skip_reason_is_recorded_by_name() {
    let r = MockUp::openai("rules: [{status: 410, times: 1}]").await;
    let k = MockUp::openai("name: k").await;
    let cd =
        MockUp::openai("rules: [{status: 429, times: 1, headers: {retry-after: \"600\"}}]").await;
    let nv = MockUp::openai("name: nv").await;
    let u = MockUp::openai("name: u\nrules: [{when: {path: /v1/models}, status: 500}]").await;
    let ok = MockUp::openai("name: ok").await;
    let cfg = format!(
        "models:\n{}{}{}{}{}{}routing_policy: {{ fallback_chain: [r, k, cd, nv, u, ok] }}\nhealth: {{ probe_interval: 100ms, flip_after: 1 }}\n",
        ep("r", &r, ""),
        ep("k", &k, ", api_key: env:AH_SURELY_UNSET_KEY"),
        ep("cd", &cd, ""),
        ep("nv", &nv, ", capabilities: [chat]"),
        ep("u", &u, ""),
        ep("ok", &ok, "")
    );
    let mut gw = Gw::start(&cfg);
    // r answers 410 (retired), cd 429 (cooling), nv serves.
    let first = gw.chat("r", "x").await;
    assert_eq!(header(&first, "x-autohedge-endpoint"), "nv");
    assert_eq!((r.requests().await, cd.requests().await), (1, 1));
    let ok_now = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["u"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok_now);
    // An image part: nv lacks `vision`.
    let resp = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "skips")
        .json(&json!({"model": "r", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="}}
        ]}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&resp, "x-autohedge-endpoint"), "ok");
    assert_eq!(header(&resp, "x-autohedge-attempts"), "1");
    gw.stop();
    assert_eq!(
        db_rows(
            &gw,
            "SELECT endpoint || ':' || class FROM attempts WHERE request_id = 'skips' ORDER BY seq"
        ),
        vec![
            "r:skipped_retired",
            "k:skipped_auth_failed",
            "cd:skipped_cooldown",
            "nv:skipped_capability",
            "u:skipped_unhealthy",
            "ok:ok"
        ]
    );
}

#[tokio::test]
async fn endpoint_clear_lifts_auth_failed_and_a_cooldown_in_a_running_gateway() {
    // Inference calls with this key get 401 (probes pass): auth_failed comes from traffic only.
    let a = MockUp::openai("name: a\nrules: [{when: {key: sk-revoked-0000}, status: 401}]").await;
    let c =
        MockUp::openai("rules: [{status: 429, times: 1, headers: {retry-after: \"600\"}}]").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n{}{}{}",
        ep("a", &a, ", api_key: sk-revoked-0000"),
        ep("c", &c, ""),
        ep("b", &b, "")
    ));
    let _ = gw.chat("a", "x").await;
    let _ = gw.chat("c", "x").await;
    assert_eq!((a.requests().await, c.requests().await), (1, 1));
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["state"], "auth_failed");
    assert_eq!(st["endpoints"]["c"]["state"], "cooldown");
    for name in ["a", "c"] {
        let out = std::process::Command::new(BIN)
            .args(["endpoint", "clear", name, "--url", &gw.url("")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["state"], "healthy");
    assert_eq!(st["endpoints"]["c"]["state"], "healthy");
    a.set_script("name: a").await;
    let r = gw.chat("a", "x").await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "a",
        "the key is tried again"
    );
    assert_eq!(
        header(&gw.chat("c", "x").await, "x-autohedge-endpoint"),
        "c"
    );
}

#[tokio::test]
async fn openai_probe_403_429_and_an_empty_model_list() {
    let forbidden = MockUp::openai("rules: [{when: {path: /v1/models}, status: 403}]").await;
    let limited = MockUp::openai("rules: [{when: {path: /v1/models}, status: 429}]").await;
    let empty = MockUp::openai("rules: [{when: {path: /v1/models}, status: 200, body: '{\"object\":\"list\",\"data\":[]}'}]").await;
    let gw = Gw::start(&format!(
        "models:\n{}{}{}health: {{ probe_interval: 100ms, flip_after: 1 }}\n",
        ep("forbidden", &forbidden, ""),
        ep("limited", &limited, ""),
        ep("empty", &empty, "")
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        let st = gw.status().await;
        st["endpoints"]["forbidden"]["state"] == "unhealthy"
            && st["endpoints"]["limited"]["state"] == "degraded"
            && st["endpoints"]["empty"]["state"] == "degraded"
    })
    .await;
    let st = gw.status().await;
    assert!(ok, "{}", st["endpoints"]);
    assert_reason(&st, "forbidden", "403");
    assert_reason(&st, "limited", "429");
    assert_reason(&st, "empty", "no models");
    for m in [&forbidden, &limited, &empty] {
        assert!(m.stats().await["by_path"]["/v1/models"].as_u64().unwrap() >= 1);
    }
}

#[tokio::test]
async fn vllm_queue_and_kv_cache_degrade_the_endpoint() {
    let metrics = |waiting: f64, kv: f64| {
        format!(
            "rules: [{{when: {{path: /metrics}}, status: 200, body: \"vllm:num_requests_running{{engine=\\\"0\\\",model_name=\\\"m\\\"}} 2\\nvllm:num_requests_waiting{{engine=\\\"0\\\",model_name=\\\"m\\\"}} {waiting}\\nvllm:kv_cache_usage_perc{{engine=\\\"0\\\",model_name=\\\"m\\\"}} {kv}\\n\"}}]"
        )
    };
    let queue = MockUp::start(autohedge::demo::mock::Flavor::Vllm, &metrics(20.0, 0.1)).await;
    let kv = MockUp::start(autohedge::demo::mock::Flavor::Vllm, &metrics(0.0, 0.97)).await;
    let calm = MockUp::start(autohedge::demo::mock::Flavor::Vllm, &metrics(3.0, 0.5)).await;
    let gw = Gw::start(&format!(
        "models:\n  queue: {{ type: vllm, base_url: \"{}\" }}\n  kv: {{ type: vllm, base_url: \"{}\" }}\n  calm: {{ type: vllm, base_url: \"{}\" }}\nhealth: {{ probe_interval: 100ms, flip_after: 1, vllm_max_waiting: 16, vllm_max_kv_cache: 0.95 }}\n",
        queue.base(),
        kv.base(),
        calm.base()
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        let st = gw.status().await;
        st["endpoints"]["queue"]["state"] == "degraded"
            && st["endpoints"]["kv"]["state"] == "degraded"
            && st["endpoints"]["calm"]["probe"]["ok"] == true
    })
    .await;
    let st = gw.status().await;
    assert!(ok, "{}", st["endpoints"]);
    assert_eq!(st["endpoints"]["calm"]["state"], "healthy");
    assert_reason(&st, "queue", "20 requests waiting");
    assert_reason(&st, "kv", "KV cache 97%");
    assert_eq!(
        st["endpoints"]["queue"]["probe"]["detail"]["load"]["num_requests_waiting"],
        20.0
    );
}

#[tokio::test]
async fn a_probe_older_than_cache_ttl_is_stale() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "models:\n{}routing_policy: {{ cache_ttl: 300ms }}\nhealth: {{ probe_interval: 1h }}\n",
        ep("a", &a, "")
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["probe"]["stale"] == false
    })
    .await;
    assert!(ok, "a fresh probe result first");
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["probe"]["stale"] == true
    })
    .await;
    let p = gw.status().await["endpoints"]["a"]["probe"].clone();
    assert!(ok, "{p}");
    assert!(p["age_ms"].as_u64().unwrap() > 300, "{p}");
}

#[tokio::test]
async fn a_semantic_probe_answered_without_content_is_unhealthy() {
    let s = MockUp::openai(
        "rules: [{when: {path: /v1/chat/completions}, status: 200, body: '{\"id\":\"x\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\"},\"finish_reason\":\"stop\"}]}'}]",
    )
    .await;
    let gw = Gw::start(&format!(
        "models:\n{}health: {{ probe_interval: 100ms, flip_after: 1 }}\n",
        ep("s", &s, ", semantic_probe: true")
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["s"]["state"] == "unhealthy"
    })
    .await;
    let e = gw.status().await["endpoints"]["s"].clone();
    assert!(ok, "{e}");
    assert!(
        e["health_reason"]
            .as_str()
            .unwrap()
            .contains("no choices[0].message.content"),
        "{e}"
    );
    assert!(
        s.requests().await >= 1,
        "the semantic probe made a completion call"
    );
}

#[tokio::test]
async fn a_full_audit_queue_drops_and_counts() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ audit_queue: 1 }}\nmodels:\n{}",
        ep("a", &a, "")
    ));
    let url = gw.url("/v1/chat/completions");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            for _ in 0..10 {
                let r = c
                    .post(&url)
                    .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "a full queue never fails a request");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(a.requests().await, 200);
    let ok = eventually(Duration::from_secs(5), || async {
        let au = &gw.status().await["audit"];
        au["written"].as_u64().unwrap() + au["dropped"].as_u64().unwrap() >= 200
    })
    .await;
    let au = gw.status().await["audit"].clone();
    assert!(ok, "{au}");
    assert!(
        au["dropped"].as_u64().unwrap() > 0,
        "a queue of one overflows: {au}"
    );
    assert!(
        gw.log().contains("record dropped"),
        "and says so in the log"
    );
}

#[tokio::test]
async fn cost_and_endpoint_state_snapshots_are_recorded() {
    let a = MockUp::openai("name: a").await;
    let mut gw = Gw::start(&format!(
        "models:\n{}",
        ep(
            "a",
            &a,
            ", cost: { input_per_mtok: 2.5, output_per_mtok: 10 }"
        )
    ));
    let r = gw
        .chat_id(
            "priced",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    let v: Value = r.json().await.unwrap();
    let (pin, pout) = (
        v["usage"]["prompt_tokens"].as_f64().unwrap(),
        v["usage"]["completion_tokens"].as_f64().unwrap(),
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let cost: f64 = one(
        &conn,
        "SELECT cost_usd FROM requests WHERE request_id = 'priced'",
    );
    let want = (pin * 2.5 + pout * 10.0) / 1e6;
    assert!((cost - want).abs() < 1e-12, "{cost} vs {want}");
    // The shutdown snapshot of endpoint state.
    let (reqs, succ): (i64, i64) = conn
        .query_row(
            "SELECT requests, successes FROM endpoint_state WHERE endpoint = 'a'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((reqs, succ), (1, 1));
}

#[tokio::test]
async fn retention_prunes_at_start_and_zero_keeps_everything() {
    let a = MockUp::openai("name: a").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = |keep: &str| {
        format!(
            "server: {{ audit_retention: {keep} }}\nmodels:\n{}",
            ep("a", &a, "")
        )
    };
    let mut gw = Gw::start_in(dir.path(), &cfg("0"), &[]);
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    gw.stop();
    let count = |gw: &Gw| -> i64 {
        one(
            &rusqlite::Connection::open(gw.db()).unwrap(),
            "SELECT COUNT(*) FROM requests",
        )
    };
    assert_eq!(count(&gw), 1);
    // Rows older than the retention go at the next start (and hourly).
    std::thread::sleep(Duration::from_millis(1100));
    let mut gw = Gw::start_in(dir.path(), &cfg("0"), &[]);
    gw.stop();
    assert_eq!(count(&gw), 1, "audit_retention: 0 keeps everything");
    let mut gw = Gw::start_in(dir.path(), &cfg("1s"), &[]);
    let ok = eventually(Duration::from_secs(5), || async {
        gw.log().contains("audit rows past retention deleted")
    })
    .await;
    assert!(ok, "the start-up prune ran");
    gw.stop();
    assert_eq!(count(&gw), 0);
}

fn count_tokens(gw: &Gw, model: &str, body: &Value) -> u64 {
    use std::io::Write;
    let mut child = std::process::Command::new(BIN)
        .args(["count-tokens", "--json", "--model", model, "--config"])
        .arg(&gw.config_path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tokens"].as_u64().unwrap()
}

/// `context_skip` before any call, `max_completion_tokens` counted like `max_tokens`, and
/// `context_fill` deciding where the line is.
#[tokio::test]
async fn context_skip_honours_max_completion_tokens_and_context_fill() {
    let small = MockUp::openai("name: small").await;
    let big = MockUp::openai("name: big").await;
    let cfg = |fill: &str| {
        format!(
            "models:\n  small: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 400 }}\n  big: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\nrouting_policy: {{ fallback_chain: [small, big], context_fill: {fill} }}\n",
            small.base(),
            big.base()
        )
    };
    let mut gw = Gw::start(&cfg("0.95"));
    let messages = json!([{"role": "user", "content": "word ".repeat(200)}]);
    let prompt = count_tokens(&gw, "small", &json!({ "messages": messages }));
    assert!(prompt < 380, "{prompt}");
    // prompt + completion = 390: over 95% of 400 (380), within 100%.
    let completion = 390 - prompt;
    for (id, field) in [("mt", "max_tokens"), ("mct", "max_completion_tokens")] {
        let r = gw
            .chat_id(
                id,
                json!({"model": "small", "messages": messages, field: completion}),
            )
            .await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "big", "{field}");
    }
    assert_eq!(small.requests().await, 0, "skipped before any call");
    gw.stop();
    for id in ["mt", "mct"] {
        let got = db_rows(
            &gw,
            &format!(
                "SELECT endpoint || ':' || class || ':' || COALESCE(error, '') FROM attempts WHERE request_id = '{id}' ORDER BY seq"
            ),
        );
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].starts_with("small:context_skip:"), "{got:?}");
        assert!(
            got[0].contains(&format!("needs {prompt} prompt + {completion} completion")),
            "{got:?}"
        );
        assert!(got[0].contains("= 380"), "{got:?}");
        assert_eq!(got[1], "big:ok:");
    }
    drop(gw);
    let gw = Gw::start(&cfg("1.0"));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "small", "messages": messages, "max_tokens": completion}),
        )
        .await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "small",
        "390 fits 100% of 400"
    );
}

/// The guard counts a prompt only when its byte bound (tokens <= UTF-8 bytes, plus framing)
/// does not already fit the window: a short prompt is served uncounted, and a prompt whose bytes
/// exceed the window but whose tokens fit is counted exactly and served by that endpoint, not
/// skipped or refused.
#[tokio::test]
async fn only_a_prompt_near_its_window_is_counted_and_the_bound_never_refuses() {
    let small = MockUp::openai("name: small").await;
    let big = MockUp::openai("name: big").await;
    let gw = Gw::start(&format!(
        "models:\n  small: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 400 }}\n  big: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\nrouting_policy: {{ fallback_chain: [small, big] }}\n",
        small.base(),
        big.base()
    ));
    let short = json!([{"role": "user", "content": "Hello there"}]);
    // 1,000 bytes: over the 380 tokens small allows, though its tokens are far fewer.
    let near = json!([{"role": "user", "content": "word ".repeat(200)}]);
    let exact = count_tokens(&gw, "small", &json!({ "messages": near }));
    assert!(exact < 300, "{exact}");
    let r = gw
        .chat_id("short", json!({"model": "small", "messages": short}))
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "small");
    let r = gw
        .chat_id(
            "near",
            json!({"model": "small", "messages": near, "max_tokens": 380 - exact}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "small",
        "the exact count fits, so the endpoint is not skipped"
    );
    let r = gw
        .chat_id(
            "over",
            json!({"model": "small", "messages": near, "max_tokens": 381 - exact}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big", "one token over");
    assert_eq!(small.requests().await, 2);
    let mut gw = gw;
    gw.stop();
    let counted = db_rows(
        &gw,
        "SELECT request_id || ':' || COALESCE(prompt_tokens_counted, 'none') FROM requests ORDER BY request_id",
    );
    assert_eq!(
        counted,
        [
            format!("near:{exact}"),
            format!("over:{exact}"),
            "short:none".to_string()
        ]
    );
}

#[tokio::test]
async fn the_encoding_override_picks_the_tokenizer() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "models:\n  plain: {{ type: openai, base_url: \"{0}\", model: my-finetune }}\n  tuned: {{ type: openai, base_url: \"{0}\", model: my-finetune, encoding: cl100k_base }}\n",
        a.base()
    ));
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["tuned"]["tokenizer"],
        "tiktoken cl100k_base"
    );
    assert!(
        st["endpoints"]["plain"]["tokenizer"]
            .as_str()
            .unwrap()
            .starts_with("estimate"),
        "an unknown model id is estimated: {}",
        st["endpoints"]["plain"]
    );
    let body =
        json!({"messages": [{"role": "user", "content": "Tokenizers differ: ünïcödé, 東京, 🇫🇷."}]});
    assert_ne!(
        count_tokens(&gw, "plain", &body),
        count_tokens(&gw, "tuned", &body)
    );
}

/// `backend_tokenize: llamacpp`: the backend's count (plus the chat framing llama.cpp's
/// `/tokenize` does not apply), cached per body, and the local count when the backend fails.
#[tokio::test]
async fn backend_tokenize_llamacpp_counts_caches_and_falls_back() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {path: /tokenize}, status: 200, body: '{\"tokens\":[1,2,3,4,5,6,7]}'}]",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", model: my-llama, context_window: 100000, backend_tokenize: llamacpp }}\n",
        a.base()
    ));
    let send = |id: &'static str, text: &'static str| {
        let url = gw.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .header("x-request-id", id)
                .json(&json!({"model": "a", "messages": [{"role": "user", "content": text}]}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(send("b1", "count me please").await, 200);
    assert_eq!(send("b2", "count me please").await, 200);
    let tokenize_calls = |v: &Value| v["by_path"]["/tokenize"].as_u64().unwrap_or(0);
    assert_eq!(
        tokenize_calls(&a.stats().await),
        1,
        "the second count came from the cache"
    );
    a.set_script("name: a\nrules: [{when: {path: /tokenize}, status: 500}]")
        .await;
    assert_eq!(
        send("b3", "a different body now").await,
        200,
        "served with the local count"
    );
    assert_eq!(tokenize_calls(&a.stats().await), 1, "the backend was asked");
    gw.stop();
    let counted = db_rows(
        &gw,
        "SELECT request_id || ':' || prompt_tokens_counted FROM requests ORDER BY request_id",
    );
    // 7 tokens of text + 3 per message + 3 to prime the reply.
    assert_eq!(counted[0], "b1:13");
    assert_eq!(counted[1], "b2:13");
    assert!(
        counted[2].starts_with("b3:") && counted[2] != "b3:13",
        "{counted:?}"
    );
}

/// `on_context_overflow` set on an endpoint, and in `routing_policy`, applies to requests naming
/// that endpoint (routes have their own, tested in gateway.rs).
#[tokio::test]
async fn on_context_overflow_on_an_endpoint_and_in_the_policy() {
    let a = MockUp::openai("name: a").await;
    let long: Vec<Value> = (0..30)
        .flat_map(|i| {
            [
                json!({"role": "user", "content": format!("question {i}: {}", "lorem ipsum ".repeat(10))}),
                json!({"role": "assistant", "content": format!("answer {i}: {}", "dolor sit ".repeat(10))}),
            ]
        })
        .chain([json!({"role": "user", "content": "the last question"})])
        .collect();
    let cases = [
        (
            "endpoint",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400, on_context_overflow: truncate }\nrouting_policy: { on_context_overflow: reject }\n",
            200,
        ),
        (
            "policy",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400 }\nrouting_policy: { on_context_overflow: truncate }\n",
            200,
        ),
        (
            "default",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400 }\n",
            400,
        ),
    ];
    for (what, models, want) in cases {
        let gw = Gw::start(&format!("models:\n{}", models.replace("BASE", &a.base())));
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "a", "messages": long}),
            )
            .await;
        assert_eq!(r.status().as_u16(), want, "{what}");
        if want == 200 {
            assert!(!header(&r, "x-autohedge-truncated").is_empty(), "{what}");
        }
    }
}

#[tokio::test]
async fn a_stated_context_limit_is_learned_and_recorded() {
    let a = MockUp::openai(
        "rules: [{status: 400, times: 1, error: \"This model's maximum context length is 300 tokens. However, your messages resulted in 900 tokens.\", error_code: context_length_exceeded}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n  b: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\n",
        a.base(),
        b.base()
    ));
    let r = gw
        .chat_id(
            "teacher-1",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["learned_context_window"], 300);
    assert_eq!(
        st["endpoints"]["a"]["learned_context_window_request"],
        "teacher-1"
    );
    gw.stop();
    let ev = db_rows(
        &gw,
        "SELECT event || ': ' || reason FROM endpoint_events WHERE endpoint = 'a'",
    );
    assert_eq!(
        ev,
        vec![
            "context_window_learned: upstream stated a context limit of 300 tokens (request teacher-1)"
        ]
    );
}

#[tokio::test]
async fn endpoint_clear_through_the_database_when_no_gateway_runs() {
    let a = MockUp::openai("rules: [{status: 410, times: 1}]").await;
    let b = MockUp::openai("name: b").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!("models:\n{}{}", ep("a", &a, ""), ep("b", &b, ""));
    let mut gw = Gw::start_in(dir.path(), &cfg, &[]);
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "b"
    );
    assert_eq!(a.requests().await, 1, "a answered 410");
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "retired");
    gw.stop();
    // No gateway runs (the URL points at a port nothing listens on): the database is changed.
    let nobody = dead_addr();
    let out = std::process::Command::new(BIN)
        .args([
            "endpoint",
            "clear",
            "a",
            "--url",
            &format!("http://{nobody}"),
            "--data-dir",
        ])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "healthy");
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "a"
    );
}

/// An OpenAI-style upstream on 127.0.0.1 that keeps every request body's bytes as they came.
async fn recording_upstream() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    use axum::routing::post;
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = got.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(body.to_vec());
                axum::Json(json!({
                    "id": "c1", "object": "chat.completion", "created": 1, "model": "up",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/v1"), got)
}

/// The upstream gets the client's own bytes with only `model` replaced (key order, spacing and
/// numbers as the client wrote them); a body with a key given twice, or one the endpoint's
/// `max_tokens` cap changes, is sent as the gateway read it instead, so the upstream cannot read
/// a different request from the one the gateway checked.
#[tokio::test]
async fn the_upstream_gets_the_clients_bytes_unless_they_could_be_read_two_ways() {
    let (base, got) = recording_upstream().await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{base}\", model: up-model, max_tokens: 100 }}\n"
    ));
    let send = |body: &'static str| {
        let url = gw.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    let plain = r#"{"messages": [{"role": "user", "content": "hi \"there\""}],  "model" : "a", "temperature": 1e-1, "seed": 123456789012345678901234567890}"#;
    let twice = r#"{"model": "a", "max_tokens": 5, "max_tokens": 7, "messages": [{"role": "user", "content": "x"}]}"#;
    let capped =
        r#"{"model": "a", "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]}"#;
    for body in [plain, twice, capped] {
        let r = send(body).await;
        assert_eq!(r.status(), 200, "{body}");
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 3, "each request reached the upstream");
    assert_eq!(
        String::from_utf8(got[0].clone()).unwrap(),
        plain.replace(r#""model" : "a""#, r#""model" : "up-model""#)
    );
    // A key given twice goes once, with the value the gateway read (the last).
    let sent = String::from_utf8(got[1].clone()).unwrap();
    assert_eq!(sent.matches("max_tokens").count(), 1, "{sent}");
    let sent: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(sent["max_tokens"], 7);
    assert_eq!(sent["model"], "up-model");
    // Over the cap: the cap goes, not the client's bytes.
    let sent: Value = serde_json::from_slice(&got[2]).unwrap();
    assert_eq!(sent["max_tokens"], 100);
    assert_eq!(sent["model"], "up-model");
}

/// `/docs` is served with a Content-Security-Policy that allows nothing but the page itself and
/// its calls to the gateway (its data comes from `/status`, set as text).
#[tokio::test]
async fn the_live_page_is_served_with_a_self_only_content_security_policy() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!("models:\n{}", ep("a", &a, "")));
    let r = reqwest::get(gw.url("/docs")).await.unwrap();
    assert_eq!(r.status(), 200);
    let csp = header(&r, "content-security-policy");
    // Nothing by default; the page may talk only to the gateway itself; no other origin, no
    // eval, no wildcard.
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(csp.contains("connect-src 'self'"), "{csp}");
    assert!(
        !csp.contains("unsafe-eval") && !csp.contains('*') && !csp.contains("http"),
        "{csp}"
    );
    let page = r.text().await.unwrap();
    assert!(page.contains("/status"), "the page reads /status");
    assert!(
        !page.contains("innerHTML"),
        "values are set as text, never parsed as HTML"
    );
}

/// An upstream's error body is read up to 64 KiB: a 400 of a megabyte reaches the client cut at
/// that, and the gateway reads no more of it.
#[tokio::test]
async fn an_error_body_is_read_up_to_64_kib() {
    let big = "x".repeat(1024 * 1024);
    let a = MockUp::openai(&format!("rules: [{{status: 400, body: \"{big}\"}}]")).await;
    let gw = Gw::start(&format!("models:\n{}", ep("a", &a, "")));
    let r = gw.chat("a", "hi").await;
    assert_eq!(r.status(), 400);
    assert_eq!(a.requests().await, 1, "the upstream answered its 400");
    let body = r.bytes().await.unwrap();
    assert!(
        body.len() > 60 * 1024,
        "the body was passed on: {} bytes",
        body.len()
    );
    assert!(body.len() <= 64 * 1024, "{} bytes passed on", body.len());
}

/// A request with `tools` skips an endpoint without the `tools` capability (recorded as
/// `skipped_capability`) and is served by the next.
#[tokio::test]
async fn a_request_with_tools_skips_an_endpoint_without_the_tools_capability() {
    let nt = MockUp::openai("name: nt").await;
    let ok = MockUp::openai("name: ok").await;
    let mut gw = Gw::start(&format!(
        "models:\n{}{}routes:\n  chat: [nt, ok]\n",
        ep("nt", &nt, ", capabilities: [chat]"),
        ep("ok", &ok, "")
    ));
    let r = gw
        .chat_id(
            "tools-1",
            json!({"model": "chat", "messages": [{"role": "user", "content": "weather?"}],
                   "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "ok");
    assert_eq!(ok.requests().await, 1);
    assert_eq!(nt.requests().await, 0, "never called");
    // Without tools, nt serves.
    assert_eq!(
        header(&gw.chat("chat", "hi").await, "x-autohedge-endpoint"),
        "nt"
    );
    gw.stop();
    assert_eq!(
        db_rows(
            &gw,
            "SELECT endpoint || ':' || class FROM attempts WHERE request_id = 'tools-1' ORDER BY seq"
        ),
        vec!["nt:skipped_capability", "ok:ok"]
    );
}

/// An OpenAI-type server that answers `GET /models` with 405 has no probe: its state comes
/// from live traffic, and it is not unhealthy.
#[tokio::test]
async fn a_405_for_the_model_list_means_no_probe_not_unhealthy() {
    let a = MockUp::openai("name: a\nrules: [{when: {path: /v1/models}, status: 405}]").await;
    let gw = Gw::start(&format!(
        "models:\n{}health: {{ probe_interval: 100ms, flip_after: 1 }}\n",
        ep("a", &a, "")
    ));
    let probed = eventually(Duration::from_secs(10), || async {
        a.stats().await["by_path"]["/v1/models"]
            .as_u64()
            .unwrap_or(0)
            >= 2
    })
    .await;
    assert!(probed, "the probe asked /v1/models");
    let st = gw.status().await;
    let e = &st["endpoints"]["a"];
    assert_eq!(e["state"], "healthy", "{e}");
    assert!(e["probe"]["detail"].to_string().contains("no probe"), "{e}");
    assert_eq!(gw.chat("a", "hi").await.status(), 200);
}

/// The endpoints' state is snapshotted to SQLite every 10 s while the gateway runs, not only at
/// shutdown: a gateway killed without one (SIGKILL, the node lost) keeps its last 10 s.
#[tokio::test]
async fn endpoint_state_is_snapshotted_every_10_s_while_running() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!("models:\n{}", ep("a", &a, "")));
    for _ in 0..3 {
        assert_eq!(gw.chat("a", "x").await.status(), 200);
    }
    let requests = || {
        rusqlite::Connection::open(gw.db())
            .ok()
            .and_then(|c| {
                c.query_row(
                    "SELECT requests FROM endpoint_state WHERE endpoint = 'a'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
                .ok()
            })
            .unwrap_or(0)
    };
    // Within the first snapshot period (and some slack), with the gateway still running.
    let snapped = eventually(Duration::from_secs(25), || async { requests() == 3 }).await;
    assert!(snapped, "no snapshot of the 3 requests: {}", requests());
    assert!(gw.pid() > 0 && gw.status().await["endpoints"]["a"]["totals"].is_object());
}
