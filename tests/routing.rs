//! Routing, against the real binary: which endpoint serves a request, and when. Chain order,
//! demotion, capability skips and every `skipped_*` name, the healthy panic and the last resort;
//! health (OpenAI, vLLM, Ollama, custom and semantic probes, stale and absent probes, passive
//! ejection, warming); beating the tail (hedges and their budget, routing away before a 429 the
//! headers announced, slow start). Each test shows the upstream was called (or not) first.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// Asserts an endpoint's `health_reason` in a `/status` document says `needle`.
fn assert_reason(st: &Value, name: &str, needle: &str) {
    let e = &st["endpoints"][name];
    let reason = e["health_reason"].as_str().unwrap_or("");
    assert!(reason.contains(needle), "{name}: {e}");
}

/// An upstream that answers probes (`GET`) but never answers a `POST`: it reports when the
/// gateway sent one, and when the gateway closed that connection.
struct Silent {
    addr: std::net::SocketAddr,
    posted: tokio::sync::mpsc::UnboundedReceiver<Instant>,
    closed: tokio::sync::mpsc::UnboundedReceiver<Instant>,
}

async fn silent_upstream() -> Silent {
    let (ptx, posted) = tokio::sync::mpsc::unbounded_channel();
    let (ctx, closed) = tokio::sync::mpsc::unbounded_channel();
    let up = RawUp::with_release(
        move |req| {
            if req.method == "GET" {
                let body =
                    r#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"x"}]}"#;
                return Answer::WriteClose(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .into_bytes(),
                );
            }
            let _ = ptx.send(Instant::now());
            // Hold the request: read until the gateway closes the connection.
            Answer::Hold
        },
        move |at| {
            let _ = ctx.send(at);
        },
    );
    Silent {
        addr: up.addr,
        posted,
        closed,
    }
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
async fn healthy_panic_tries_unhealthy_endpoints_instead_of_503() {
    // Both endpoints fail their probe (GET /models 500) but serve chat.
    let a = MockUp::openai("name: a\nrules: [{when: {path: /v1/models}, status: 500}]").await;
    let b = MockUp::openai("name: b\nrules: [{when: {path: /v1/models}, status: 500}]").await;
    let gw = Gw::start(&chain_cfg(
        &[("a", &a), ("b", &b)],
        "health: { probe_interval: 100ms, flip_after: 1 }",
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        let st = gw.status().await;
        st["endpoints"]["a"]["state"] == "unhealthy" && st["endpoints"]["b"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]);
    let st = gw.status().await;
    assert_eq!(st["chains"]["in_panic"], json!(["fallback_chain", "chat"]));
    let r = gw.chat("chat", "x").await;
    assert_eq!(
        r.status(),
        200,
        "health alone never turns a request into a 503"
    );
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a", "chain order");
    assert_eq!(a.requests().await, 1);

    // When they really fail, the 503 shows the attempts were made in panic mode.
    a.set_script("rules: [{when: {path: /v1/models}, status: 500}, {status: 500}]")
        .await;
    b.set_script("rules: [{when: {path: /v1/models}, status: 500}, {status: 502}]")
        .await;
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    let attempts = v["error"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    for at in attempts {
        assert_eq!(at["panic_mode"], true, "{at}");
        assert_ne!(at["class"], "skipped_unhealthy");
    }
    assert_eq!((a.requests().await, b.requests().await), (1, 1));
    let mut gw = gw;
    gw.stop();
    let n: i64 = one(
        &rusqlite::Connection::open(gw.db()).unwrap(),
        "SELECT COUNT(*) FROM attempts WHERE panic_mode = 1",
    );
    assert_eq!(n, 3, "panic_mode is in the audit trail");
}

#[tokio::test]
async fn unhealthy_endpoint_is_the_last_resort_when_healthy_ones_fail() {
    // a is unhealthy by probe but serves; b and c are healthy by probe but fail chat.
    let a = MockUp::openai("name: a\nrules: [{when: {path: /v1/models}, status: 500}]").await;
    let b = MockUp::openai("rules: [{when: {path: /v1/chat/completions}, status: 500}]").await;
    let c = MockUp::openai("rules: [{when: {path: /v1/chat/completions}, status: 503}]").await;
    let gw = Gw::start(&chain_cfg(
        &[("a", &a), ("b", &b), ("c", &c)],
        "health: { probe_interval: 100ms, flip_after: 1, eject_after: 100 }",
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok);
    assert_eq!(
        gw.status().await["chains"]["in_panic"],
        json!([]),
        "2 of 3 healthy is no panic"
    );
    let r = gw.chat("chat", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(header(&r, "x-autohedge-attempts"), "3");
    assert_eq!(
        (a.requests().await, b.requests().await, c.requests().await),
        (1, 1, 1),
        "the healthy ones first, then the last resort"
    );
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
# itself has a test of its own in this file).
routing_policy: {{ fallback_chain: [a, b, c], panic_threshold: 0.3, slow_start: 0 }}
# An ejection window (10 s) far longer than the status read and the request that must see it,
# on any machine, busy or not: eject_base is the time promised, and the recovery below waits
# for it (the ejection ends when it ends, and the wait with it).
health: {{ probe_interval: 100ms, flip_after: 2, eject_after: 3, eject_base: 10s, eject_max: 20s }}
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
    // Generous past eject_base: the recovery must come, and the loop ends as soon as it does.
    let deadline = Instant::now() + Duration::from_secs(40);
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

#[tokio::test]
async fn probes_use_the_live_key_and_send_the_endpoints_headers() {
    // Key A is revoked; B works. The mock also demands the endpoint's header on every request.
    let a = MockUp::openai("name: a\nkeys: [sk-good-BBBB]\nrequire_headers: {x-org: acme}").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        r#"models:
  a:
    type: openai
    base_url: "{}"
    api_keys: [sk-revoked-AAAA, sk-good-BBBB]
    headers: {{ x-org: acme }}
health: {{ probe_interval: 100ms, flip_after: 1 }}
"#,
        a.base()
    );
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    // Several probe rounds: the revoked key is rejected once, then probes use B.
    let ok = eventually(Duration::from_secs(5), || async {
        a.stats().await["by_path"]["/v1/models"]
            .as_u64()
            .unwrap_or(0)
            >= 4
    })
    .await;
    assert!(ok, "probes ran: {}", a.stats().await);
    let ea = gw.status().await["endpoints"]["a"].clone();
    assert_eq!(ea["state"], "healthy", "{ea}");
    assert_eq!(ea["keys"]["usable"], 1, "the probe rejected key A: {ea}");
    assert_eq!(ea["probe"]["detail"]["status"], 200, "{ea}");
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(a.stats().await["key_tails"], json!(["BBBB"]));
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
        "models:\n{}routing_policy: {{ cache_ttl: 1s }}\nhealth: {{ probe_interval: 1h }}\n",
        ep("a", &a, "")
    ));
    // The only probe runs at start (`probe_interval: 1h`). Each look at it is judged by the gateway's own numbers, not
    // by when the look came: `stale` says whether `age_ms` (read just before it) is past
    // `cache_ttl` (50 ms of margin for the two reads of the clock). Fresh, then stale.
    let (fresh, looks) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let stale = eventually(Duration::from_secs(30), || async {
        let p = gw.status().await["endpoints"]["a"]["probe"].clone();
        if p.is_null() {
            return false; // no probe result yet
        }
        let age = p["age_ms"].as_u64().unwrap();
        let stale = p["stale"].as_bool().unwrap();
        looks.set(looks.get() + 1);
        if stale {
            assert!(age + 50 > 1_000, "stale at {age} ms: {p}");
        } else {
            assert!(age <= 1_000, "not stale at {age} ms: {p}");
            fresh.set(fresh.get() + 1);
        }
        stale
    })
    .await;
    let p = gw.status().await["endpoints"]["a"]["probe"].clone();
    assert!(stale, "{p}");
    assert!(p["age_ms"].as_u64().unwrap() > 1_000, "{p}");
    eprintln!(
        "{} of {} looks saw the probe fresh",
        fresh.get(),
        looks.get()
    );
}

#[tokio::test]
async fn no_models_route_means_no_probe_not_unhealthy() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {path: /v1/models}, status: 404, error: \"Not Found\"}]",
    )
    .await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 100ms, flip_after: 1 }}\n",
        a.base()
    ));
    let ok = eventually(Duration::from_secs(5), || async {
        a.stats().await["by_path"]["/v1/models"]
            .as_u64()
            .unwrap_or(0)
            >= 3
    })
    .await;
    assert!(ok, "the probe was tried");
    let ea = gw.status().await["endpoints"]["a"].clone();
    assert_eq!(ea["state"], "healthy", "{ea}");
    assert!(
        ea["probe"]["detail"]["note"]
            .as_str()
            .unwrap()
            .contains("no probe"),
        "{ea}"
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200);
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
# 1 of 3 healthy is no panic here (1/3 >= 0.3): unhealthy endpoints are skipped.
routing_policy: {{ fallback_chain: [a, s, b], panic_threshold: 0.3, slow_start: 0 }}
health: {{ probe_interval: 100ms, flip_after: 1, warmup: 300ms }}
"#,
        a.base(),
        s.base(),
        b.base()
    ));
    // uptime 12s: warming.
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "warming"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["a"]);
    // Warming serves a share rising over the warmup (behind the healthy ones for the rest).
    let share = gw.status().await["endpoints"]["a"]["slow_start_share"].as_f64();
    assert!(
        share.is_some_and(|s| (0.1..1.0).contains(&s)),
        "warming: a share of its traffic, {share:?}"
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200);
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

/// A probe answer that never ends is read no further than 8 MiB: the probe fails (the endpoint
/// is unhealthy, and says why) instead of holding what arrives for the whole probe timeout.
#[tokio::test]
async fn a_probe_answer_that_never_ends_fails_the_probe_at_8_mib() {
    const CAP: u64 = 256 << 20;
    let p = Endless::start(CAP, true, None);
    let gw = Gw::start(&format!(
        "models:\n  p: {{ type: openai, base_url: \"http://{}/v1\" }}\nhealth: {{ probe_interval: 60s, probe_timeout: 10s, flip_after: 1 }}\n",
        p.addr
    ));
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.status().await["endpoints"]["p"]["state"] == "unhealthy"
        })
        .await,
        "{}",
        gw.status().await["endpoints"]["p"]
    );
    let st = gw.status().await;
    let reason = st["endpoints"]["p"]["health_reason"].as_str().unwrap_or("");
    assert!(reason.contains("larger than 8388608 bytes"), "{reason}");
    assert_cut_past(&p, 8 << 20);
    assert_no_panic(&gw);
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
    // 500 ms: the hedge timer (50 ms) has 450 ms to fire before `slow` answers, on any machine.
    // Whether a hedge was sent is read from the trail, not from whether it won.
    let slow = MockUp::openai("name: slow\nrules: [{delay: 500ms}]").await;
    let fast = MockUp::openai("name: fast").await;
    let cfg = format!(
        "models:\n{}{}routes:\n  tenth:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 10% }}\n  notools:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 100% }}\n  tools:\n    chain: [slow, fast]\n    hedge: {{ after: 50ms, max_extra: 100%, tools: true }}\n",
        ep("slow", &slow, ""),
        ep("fast", &fast, "")
    );
    let mut gw = Gw::start(&cfg);
    let mut won = Vec::new();
    for i in 0..20 {
        let r = gw.chat("tenth", "x").await;
        assert_eq!(r.status(), 200);
        if header(&r, "x-autohedge-hedged") == "true" {
            won.push(i + 1);
        }
    }
    // Only a hedge sent can win (the header says it won; the trail below says which were sent).
    assert!(won.iter().all(|i| [10, 20].contains(i)), "{won:?}");
    assert_eq!(
        slow.requests().await,
        20,
        "every request tried the slow one first"
    );
    let tool =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    for route in ["notools", "tools"] {
        let r = gw
            .chat_id(
                &format!("with-tools-{route}"),
                json!({"model": route, "messages": [{"role": "user", "content": "x"}], "tools": tool}),
            )
            .await;
        assert_eq!(r.status(), 200);
        if route == "notools" {
            assert_eq!(header(&r, "x-autohedge-hedged"), "", "{route}");
        }
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
    // Every request was slow enough to hedge: the budget alone decided. It starts empty and
    // each request pays a tenth of a hedge: the 10th and the 20th sent one.
    let sent: Vec<usize> = rows(
        &gw,
        "SELECT hedges FROM requests WHERE requested_model = 'tenth' ORDER BY id",
    )
    .iter()
    .enumerate()
    .filter(|(_, h)| *h != "0")
    .map(|(i, h)| {
        assert_eq!(h, "1", "request {}", i + 1);
        i + 1
    })
    .collect();
    assert_eq!(sent, vec![10, 20]);
    let won_rows: Vec<String> = rows(
        &gw,
        "SELECT sum(hedges), sum(hedge_won) FROM requests WHERE requested_model = 'tenth'",
    );
    assert_eq!(won_rows, vec![format!("2:{}", won.len())]);
    // Tools hedge only where the route allows it.
    assert_eq!(
        rows(
            &gw,
            "SELECT request_id, hedges FROM requests WHERE request_id LIKE 'with-tools-%' ORDER BY request_id"
        ),
        vec!["with-tools-notools:0", "with-tools-tools:1"]
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
    // 2 s: the hedge (sent at 100 ms) is answered with its 500 long before `slow` answers,
    // however busy the machine.
    let slow = MockUp::openai("name: slow\nrules: [{delay: 2s}]").await;
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
    assert_eq!(slow.requests().await, 24, "every request tried slow first");
    let to_fast = fast.requests().await;
    gw.stop();
    // From the trail, each request's hedges and how long its attempt at `slow` took.
    let trail = audit_rows(
        &gw,
        "SELECT r.hedges, a.latency_ms FROM requests r JOIN attempts a ON a.request_row = r.id AND a.endpoint = 'slow' WHERE r.requested_model = 'p50' ORDER BY r.id",
    );
    assert_eq!(trail.len(), 24, "{trail:?}");
    let hedges: Vec<u64> = trail.iter().map(|r| r[0].as_u64().unwrap()).collect();
    // None before 20 samples, whatever the latency.
    assert!(hedges[..20].iter().all(|h| *h == 0), "{trail:?}");
    // The 24th (slow) request is the first slow one with 20 samples behind it: hedged at the
    // p50 (fast, so min_after).
    assert_eq!(hedges[23], 1, "{trail:?}");
    // The 21st to 23rd answer at once: hedged only if `slow` took past min_after (a busy
    // machine), never before it.
    for (i, r) in trail.iter().enumerate().take(23).skip(20) {
        assert!(
            r[0] == 0 || r[1].as_f64().unwrap() >= 150.0,
            "request {} hedged before min_after: {r:?}",
            i + 1
        );
    }
    // Each hedge was one call to `fast`, and only a request that sent one says it was hedged.
    assert_eq!(to_fast, hedges.iter().sum::<u64>(), "{trail:?}");
    assert!(
        hedged.iter().all(|i| hedges[i - 1] == 1),
        "{hedged:?} {trail:?}"
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
/// predicted refill (here 3 s) and then calls the endpoint once, instead of trying it at once
/// into a likely 429. The wait is checked from below only.
#[tokio::test]
async fn max_wait_waits_for_a_predicted_refill() {
    // 3 s: the second request comes well inside it (it must, to meet the prediction), and
    // `max_wait` (5 s) covers it.
    let announce = r#"{times: 1, headers: {x-ratelimit-remaining-requests: "0", x-ratelimit-reset-requests: "3s", x-ratelimit-limit-requests: ""}}"#;
    let a = MockUp::openai(&format!("name: a\nrules: [{announce}]")).await;
    let cfg = format!(
        "models:\n{}routes:\n  only_a: [a]\nrouting_policy: {{ max_wait: 5s }}\n",
        ep("a", &a, "")
    );
    let mut gw = Gw::start(&cfg);
    // Before the first request: the refill it announces is at least 3 s from here, however
    // long anything below takes (a lower bound only).
    let t0 = Instant::now();
    assert_eq!(gw.chat("only_a", "x").await.status(), 200);
    assert_eq!(a.requests().await, 1);
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
        took >= Duration::from_secs(3),
        "answered {took:?} after the first request: it did not wait for the refill"
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

/// A loopback health-check server whose first request is held unanswered until released (`up.open_gate()`), so a
/// probe round that includes it stays open for as long as the test likes; later requests are
/// answered at once, `200 {"status":"ok"}`. `seen` counts the requests.
struct GatedHealth {
    addr: std::net::SocketAddr,
    seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    up: RawUp,
}

impl GatedHealth {
    async fn start() -> GatedHealth {
        use std::sync::atomic::Ordering;
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        let up = RawUp::start(move |_| {
            let body = r#"{"status":"ok"}"#;
            let ok = Answer::WriteClose(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes(),
            );
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                Answer::Gated(Box::new(ok))
            } else {
                ok
            }
        });
        GatedHealth {
            addr: up.addr,
            seen,
            up,
        }
    }

    fn seen(&self) -> usize {
        self.seen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Ejected endpoints are probed sooner than `health.probe_interval`: with the interval at an
/// hour and `eject_base` at a second, an endpoint ejected by live traffic gets its next probe —
/// the half-open probe that restores it — within the run, not an hour later.
///
/// How the ejection is made to count: the prober shortens its wait (to `eject_base`) when an
/// endpoint is ejected at the end of a probe round (src/discovery/probe.rs). So the first round
/// is held open (the other endpoint's health check, `GatedHealth`, answers only when released)
/// while `bad` is ejected, then released. `bad`'s own probe in that round fails (a 500, once), so
/// whichever way that stale result lands — still ejected, or half-open and ejected again — `bad`
/// is ejected when the round ends; its later probes succeed.
///
/// docs/routing.md ("Health", passive outlier detection): "When the time is over the endpoint is
/// `half_open`: real traffic still skips it, and the next probe decides — success restores it
/// and resets the backoff, failure ejects it again for twice as long. Recovery never comes from
/// a flood of real requests; ejected endpoints are probed sooner."
///
/// Fails if: the prober always sleeps `health.probe_interval` between rounds (the
/// `is_ejected` → `probe_interval.min(eject_base)` choice in `discovery::probe::run` removed):
/// `bad` then gets no second probe for an hour and stays ejected/half-open for the whole wait.
///
/// The one time bound is the promise itself: the next probe of `bad` within 60 s, against the
/// hour `health.probe_interval` says — sixty times `eject_base`, a sixtieth of the interval.
#[tokio::test]
async fn an_ejected_endpoint_is_probed_sooner_than_the_probe_interval() {
    use std::time::Duration;

    let probes = |v: &serde_json::Value| v["by_path"]["/v1/models"].as_u64().unwrap_or(0);
    // `bad`: every request fails (500); its first probe fails too, later probes pass.
    let bad = MockUp::openai(
        "name: bad\nrules:\n  - { when: { path: /v1/models }, status: 500, times: 1 }\n  - { status: 500 }\n",
    )
    .await;
    let good = MockUp::openai("name: good").await;
    let gate = GatedHealth::start().await;
    let cfg = format!(
        r#"models:
  bad: {{ type: openai, base_url: "{}" }}
  good: {{ type: openai, base_url: "{}", health_check: {{ url: "http://{}/health", timeout: 600s }} }}
routing_policy: {{ fallback_chain: [bad, good], slow_start: 0 }}
health: {{ probe_interval: 1h, probe_timeout: 1s, eject_after: 1, eject_base: 1s, eject_max: 5s }}
"#,
        bad.base(),
        good.base(),
        gate.addr
    );
    let mut gw = Gw::start(&cfg);
    // Ready at `probe_timeout` at the latest, while the first round waits on the gate.
    gw.ready().await;
    let first_round = eventually(Duration::from_secs(10), || async {
        probes(&bad.stats().await) == 1 && gate.seen() == 1
    })
    .await;
    assert!(
        first_round,
        "the first round probed bad once and waits on the gate: bad {}, gate {}",
        probes(&bad.stats().await),
        gate.seen()
    );

    // Live traffic ejects `bad`: its 500 fails the request over to `good`.
    let r = gw.chat("bad", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "good");
    assert_eq!(bad.requests().await, 1, "bad was really called");
    // Ejected (or, should this machine be slow, past its second of ejection and half-open:
    // ejected still, waiting for a probe to decide).
    let st = gw.status().await;
    assert!(
        matches!(
            st["endpoints"]["bad"]["state"].as_str(),
            Some("ejected" | "half_open")
        ),
        "{}",
        st["endpoints"]["bad"]
    );
    // Still one probe of `bad`: the round that began at start has not ended.
    assert_eq!(probes(&bad.stats().await), 1);
    assert_eq!(gate.seen(), 1);

    // The round ends with `bad` ejected: the next one comes after `eject_base`, not the hour.
    gate.up.open_gate();
    let recovered = eventually(Duration::from_secs(60), || async {
        probes(&bad.stats().await) >= 2
            && gw.status().await["endpoints"]["bad"]["state"] == "healthy"
    })
    .await;
    let st = gw.status().await;
    assert!(
        recovered,
        "bad was not probed again (probes {}), state {}",
        probes(&bad.stats().await),
        st["endpoints"]["bad"]
    );
    assert!(
        st["endpoints"]["bad"]["health_reason"]
            .as_str()
            .is_some_and(|r| r.contains("half-open probe succeeded")),
        "restored by its probe, not by traffic: {}",
        st["endpoints"]["bad"]
    );
    assert_eq!(
        bad.requests().await,
        1,
        "no live request reached bad meanwhile"
    );

    // The gateway's own record, in order: ejected by traffic, then restored by a probe.
    gw.stop();
    let events: Vec<String> = audit_rows(
        &gw,
        "SELECT event FROM endpoint_events WHERE endpoint = 'bad' AND event LIKE 'health:%' ORDER BY id",
    )
    .into_iter()
    .map(|r| r[0].as_str().unwrap_or("").to_string())
    .collect();
    assert_eq!(
        events.first().map(String::as_str),
        Some("health:healthy->ejected"),
        "{events:?}"
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("health:half_open->healthy"),
        "{events:?}"
    );
}

/// A spare that is still warming (its health check reports a young uptime) serves: alone behind
/// a dead primary it carries every request; beside a healthy backup it takes a share (slow
/// start) and the backup the rest. Warming never keeps the only spare out of an outage.
#[tokio::test]
async fn a_warming_spare_carries_an_outage_and_shares_beside_a_backup() {
    let dead = dead_addr();
    let spare = MockUp::openai(
        r#"name: spare
rules:
  - { when: { path: /health }, status: 200, body: '{"status":"healthy","uptime_seconds":3}' }
"#,
    )
    .await;
    let backup = MockUp::openai("name: backup").await;
    let gw = Gw::start(&format!(
        r#"
models:
  primary: {{ type: openai, base_url: "http://{}/v1" }}
  spare: {{ type: vllm, base_url: "{}", health_check: {{ url: /health }} }}
  backup: {{ type: openai, base_url: "{}" }}
routes:
  outage: [primary, spare]
  mixed: [primary, spare, backup]
health: {{ probe_interval: 100ms, flip_after: 1, warmup: 1h }}
routing_policy: {{ panic_threshold: 0 }}
"#,
        dead,
        spare.base(),
        backup.base()
    ));
    let ok = eventually(Duration::from_secs(10), || async {
        let st = gw.status().await;
        st["endpoints"]["spare"]["state"] == "warming"
            && st["endpoints"]["primary"]["state"] == "unhealthy"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]);
    for i in 0..20 {
        let r = gw.chat("outage", &format!("o{i}")).await;
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "spare");
    }
    let mut by_spare = 0;
    for i in 0..100 {
        let r = gw.chat("mixed", &format!("m{i}")).await;
        assert_eq!(r.status(), 200, "request {i}");
        if header(&r, "x-autohedge-endpoint") == "spare" {
            by_spare += 1;
        }
    }
    assert!(
        (1..=40).contains(&by_spare),
        "the warming spare takes a share (a tenth at first), the backup the rest: {by_spare} of 100"
    );
}
