//! The last resort (`last_resort:`): an answer kept from a request served earlier serves the
//! very same request when every endpoint of its chain fails — never another key's, never for a
//! request that differs in anything, never an error or a broken stream.

mod common;

use std::time::Duration;

use common::clusters::until_clustered;
use common::redis_server::Redis;
use common::trail::db_rows;
use common::*;
use serde_json::{Value, json};

const KEY_A: &str = "sk-team-a-0123456789";
const KEY_B: &str = "sk-team-b-0123456789";

fn config(a: &MockUp, b: &MockUp, extra: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  b: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
routes:
  chat:
    chain: [a, b]
    last_resort: {{ ttl: 1h{extra} }}
auth:
  keys:
    - {{ name: team-a, key: env:KEY_A }}
    - {{ name: team-b, key: env:KEY_B }}
health: {{ probe_interval: 1h, eject_after: 1000 }}
"#,
        a.base(),
        b.base()
    )
}

async fn send(gw: &Gw, key: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn ask(content: &str) -> Value {
    json!({"model": "chat", "temperature": 0, "messages": [{"role": "user", "content": content}]})
}

const DOWN: &str = "rules: [{status: 503, error: \"upstream down\"}]";

/// A full answer and a stream, served once; then every endpoint fails: the same requests get
/// the kept answers (the stream as the events it was, `[DONE]` last) with
/// `x-autohedge-served-from: last_resort` and `age`, after the chain was tried; a different
/// temperature, tools, model or client key gets the 503; the audit row says `last_resort` with
/// the failures before it, and nothing is billed.
#[tokio::test]
async fn a_kept_answer_serves_only_the_same_request_of_the_same_key_when_all_fail() {
    let a = MockUp::openai("name: a\nreply: \"The kept answer.\"").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start_with_env(&config(&a, &b, ""), &[("KEY_A", KEY_A), ("KEY_B", KEY_B)]);
    gw.ready().await;
    let q = ask("What is the capital of France?");
    let first = send(&gw, KEY_A, &q).await;
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-autohedge-served-from"), "");
    let kept = first.bytes().await.unwrap();
    let mut qs = q.clone();
    qs["stream"] = json!(true);
    let first_stream = send(&gw, KEY_A, &qs).await;
    assert_eq!(first_stream.status(), 200);
    let kept_stream = first_stream.bytes().await.unwrap();
    assert!(
        String::from_utf8_lossy(&kept_stream)
            .trim_end()
            .ends_with("data: [DONE]"),
        "{}",
        String::from_utf8_lossy(&kept_stream)
    );

    a.set_script(DOWN).await;
    b.set_script(DOWN).await;
    let calls = a.requests().await + b.requests().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = send(&gw, KEY_A, &q).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-served-from"), "last_resort");
    assert_eq!(
        header(&r, "x-autohedge-attempts"),
        "2",
        "both endpoints tried first"
    );
    let age: u64 = header(&r, "age").parse().expect("an age");
    assert!(age >= 1, "{age}");
    let id = header(&r, "x-request-id");
    assert_eq!(
        r.bytes().await.unwrap(),
        kept,
        "the kept answer, byte for byte"
    );
    assert_eq!(
        a.requests().await + b.requests().await,
        calls + 2,
        "each endpoint was called and failed"
    );

    let r = send(&gw, KEY_A, &qs).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    assert_eq!(header(&r, "x-autohedge-served-from"), "last_resort");
    assert_eq!(
        r.bytes().await.unwrap(),
        kept_stream,
        "the stream's events as they were"
    );

    // Anything different: the 503.
    let mut warmer = q.clone();
    warmer["temperature"] = json!(0.5);
    let mut tools = q.clone();
    tools["tools"] =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let mut other_model = q.clone();
    other_model["model"] = json!("a");
    for (why, key, body) in [
        ("a different temperature", KEY_A, &warmer),
        ("tools", KEY_A, &tools),
        ("another model", KEY_A, &other_model),
        ("another client key", KEY_B, &q),
    ] {
        let r = send(&gw, key, body).await;
        assert_eq!(r.status(), 503, "{why}");
        assert_eq!(header(&r, "x-autohedge-served-from"), "", "{why}");
        let e: Value = r.json().await.unwrap();
        assert!(e["error"]["message"].is_string(), "{why}: {e}");
    }

    // The row: served from the last resort, after both failures, nothing billed.
    let sql = format!(
        "SELECT status || ' ' || error_class || ' ' || coalesce(endpoint, '-') || ' ' || coalesce(cost_usd, 0) || ' ' || served_from FROM requests WHERE request_id = '{id}'"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            !db_rows(&gw, &sql).is_empty()
        })
        .await,
        "the row was written"
    );
    assert_eq!(
        db_rows(&gw, &sql),
        vec!["200 last_resort - 0 last_resort".to_string()]
    );
    let sql = format!(
        "SELECT endpoint || ' ' || class FROM attempts WHERE request_id = '{id}' ORDER BY seq"
    );
    let attempts = db_rows(&gw, &sql);
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert!(
        attempts[0].starts_with("a ") && attempts[1].starts_with("b "),
        "{attempts:?}"
    );
    assert!(
        gw.metric("autohedge_last_resort_served_total").await >= 2.0,
        "counted"
    );
    gw.stop();
}

/// What is never kept: an error the client got (a 400 passed through), a stream cut before
/// `[DONE]`, a request with `n: 2` or a `seed`. When everything fails afterwards, each of them
/// gets the 503.
#[tokio::test]
async fn errors_broken_streams_and_unrepeatable_requests_are_never_kept() {
    let a = MockUp::openai(
        "name: a\nrules:\n  - {when: {contains: REFUSE}, status: 400, error: \"bad request\", error_type: invalid_request_error}\n  - {when: {contains: CUT, stream: true}, reset_after: 2}",
    )
    .await;
    let b =
        MockUp::openai("name: b\nrules: [{when: {contains: CUT, stream: true}, reset_after: 2}]")
            .await;
    let mut gw = Gw::start_with_env(&config(&a, &b, ""), &[("KEY_A", KEY_A), ("KEY_B", KEY_B)]);
    gw.ready().await;
    let refused = ask("REFUSE this");
    assert_eq!(send(&gw, KEY_A, &refused).await.status(), 400);
    let mut cut = ask("CUT this stream");
    cut["stream"] = json!(true);
    let r = send(&gw, KEY_A, &cut).await;
    assert_eq!(r.status(), 200);
    let body = String::from_utf8_lossy(&r.bytes().await.unwrap()).to_string();
    assert!(!body.contains("[DONE]"), "the stream broke: {body}");
    let mut n2 = ask("two answers");
    n2["n"] = json!(2);
    let mut seeded = ask("seeded");
    seeded["seed"] = json!(42);
    for q in [&n2, &seeded] {
        assert_eq!(send(&gw, KEY_A, q).await.status(), 200);
    }
    a.set_script(DOWN).await;
    b.set_script(DOWN).await;
    for (why, q) in [
        ("a 400", &refused),
        ("a broken stream", &cut),
        ("n: 2", &n2),
        ("a seed", &seeded),
    ] {
        let r = send(&gw, KEY_A, q).await;
        assert_eq!(r.status(), 503, "{why}");
        assert_eq!(header(&r, "x-autohedge-served-from"), "", "{why}");
    }
    gw.stop();
}

/// One key's answers never push out another's: key B keeps one answer; key A then has many
/// answers kept, far past its share (`max_bytes_per_key`); when everything fails, B's answer
/// still serves B, and A's oldest is gone while its newest serves.
#[tokio::test]
async fn one_keys_answers_never_push_out_anothers() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start_with_env(
        &config(&a, &b, ", max_bytes: 64KiB, max_bytes_per_key: 16KiB"),
        &[("KEY_A", KEY_A), ("KEY_B", KEY_B)],
    );
    gw.ready().await;
    let bq = ask("B's question");
    assert_eq!(send(&gw, KEY_B, &bq).await.status(), 200);
    let mut answer_bytes = 0;
    for i in 0..200 {
        let r = send(&gw, KEY_A, &ask(&format!("A's question {i}"))).await;
        assert_eq!(r.status(), 200);
        answer_bytes += r.bytes().await.unwrap().len();
    }
    assert!(
        answer_bytes > 4 * 16 * 1024,
        "A's answers were far over its share: {answer_bytes}"
    );
    a.set_script(DOWN).await;
    b.set_script(DOWN).await;
    let r = send(&gw, KEY_B, &bq).await;
    assert_eq!(r.status(), 200, "B's answer kept");
    assert_eq!(header(&r, "x-autohedge-served-from"), "last_resort");
    assert_eq!(
        send(&gw, KEY_A, &ask("A's question 0")).await.status(),
        503,
        "A's oldest went first"
    );
    let r = send(&gw, KEY_A, &ask("A's question 199")).await;
    assert_eq!(header(&r, "x-autohedge-served-from"), "last_resort");
    gw.stop();
}

/// With `cluster:`, an answer one replica kept serves the same request at another replica that
/// never saw it, when every endpoint fails there; still only to the key it answered.
#[tokio::test]
async fn the_shared_copy_serves_another_replica() {
    let redis = Redis::start();
    let a = MockUp::openai("name: a\nreply: \"Kept on one replica.\"").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        "{}cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: \"lr:\", timeout: 2s }}\n",
        config(&a, &b, "")
    );
    let url = redis.url();
    let env = [
        ("KEY_A", KEY_A),
        ("KEY_B", KEY_B),
        ("AUTOHEDGE_REDIS_URL", url.as_str()),
    ];
    let (mut one, mut two) = (
        Gw::start_with_env(&cfg, &env),
        Gw::start_with_env(&cfg, &env),
    );
    until_clustered(&[&one, &two], 2).await;
    let q = ask("Shared question");
    let first = send(&one, KEY_A, &q).await;
    assert_eq!(first.status(), 200);
    let kept = first.bytes().await.unwrap();
    a.set_script(DOWN).await;
    b.set_script(DOWN).await;
    // Replica one shares it off its request path: replica two is asked until it is there.
    let mut served = None;
    for _ in 0..50 {
        let r = send(&two, KEY_A, &q).await;
        if r.status() == 200 {
            assert_eq!(header(&r, "x-autohedge-served-from"), "last_resort");
            served = Some(r.bytes().await.unwrap());
            break;
        }
        assert_eq!(r.status(), 503);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served.as_ref(), Some(&kept), "the answer replica one kept");
    assert_eq!(
        send(&two, KEY_B, &q).await.status(),
        503,
        "never another key's"
    );
    one.stop();
    two.stop();
}

/// `cache:`: a `temperature: 0` request answered once is answered again from the kept answer
/// before any upstream call (`x-autohedge-served-from: cache`); a warmer one, one without a
/// temperature (unless the route says so) or another key's goes upstream; a cache without
/// `last_resort:` serves nothing when every endpoint fails.
#[tokio::test]
async fn a_cached_answer_serves_temperature_zero_before_any_call() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  b: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
routes:
  chat: {{ chain: [a, b], cache: {{ ttl: 1h }} }}
  loose: {{ chain: [a, b], cache: {{ ttl: 1h, temperature_absent: true }} }}
auth:
  keys:
    - {{ name: team-a, key: env:KEY_A }}
    - {{ name: team-b, key: env:KEY_B }}
health: {{ probe_interval: 1h }}
"#,
        a.base(),
        b.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A), ("KEY_B", KEY_B)]);
    gw.ready().await;
    let calls = || async { a.requests().await + b.requests().await };
    let q = ask("Cached question");
    let before = calls().await;
    let first = send(&gw, KEY_A, &q).await;
    assert_eq!(first.status(), 200);
    let kept = first.bytes().await.unwrap();
    assert_eq!(calls().await, before + 1, "the first goes upstream");
    let r = send(&gw, KEY_A, &q).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-served-from"), "cache");
    assert_eq!(header(&r, "x-autohedge-attempts"), "0");
    let cached_id = header(&r, "x-request-id");
    assert_eq!(r.bytes().await.unwrap(), kept);
    assert_eq!(calls().await, before + 1, "no upstream call");
    // Its row says so: 200, no endpoint, no error class, served from the cache.
    let sql = format!(
        "SELECT status || ' ' || coalesce(error_class, '-') || ' ' || coalesce(endpoint, '-') || ' ' || served_from FROM requests WHERE request_id = '{cached_id}'"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            !db_rows(&gw, &sql).is_empty()
        })
        .await,
        "the cache's row was written"
    );
    assert_eq!(db_rows(&gw, &sql), vec!["200 - - cache".to_string()]);
    let mut warmer = q.clone();
    warmer["temperature"] = json!(0.7);
    let mut unset = q.clone();
    unset.as_object_mut().unwrap().remove("temperature");
    for (why, key, body) in [
        ("a warmer request", KEY_A, &warmer),
        ("a warmer request again", KEY_A, &warmer),
        ("no temperature", KEY_A, &unset),
        ("no temperature again", KEY_A, &unset),
        ("another key", KEY_B, &q),
    ] {
        let n = calls().await;
        let r = send(&gw, key, body).await;
        assert_eq!(r.status(), 200, "{why}");
        assert_eq!(header(&r, "x-autohedge-served-from"), "", "{why}");
        assert_eq!(calls().await, n + 1, "{why}: upstream");
    }
    // `temperature_absent: true`: a request without one is served from the cache too.
    let mut loose = unset.clone();
    loose["model"] = json!("loose");
    assert_eq!(send(&gw, KEY_A, &loose).await.status(), 200);
    let n = calls().await;
    let r = send(&gw, KEY_A, &loose).await;
    assert_eq!(header(&r, "x-autohedge-served-from"), "cache");
    assert_eq!(calls().await, n);
    // A cache alone is no last resort.
    a.set_script(DOWN).await;
    b.set_script(DOWN).await;
    let r = send(&gw, KEY_A, &warmer).await;
    assert_eq!(r.status(), 503, "kept, but no last_resort: on the route");
    gw.stop();
}
