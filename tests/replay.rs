//! Replay (`audit.capture_bodies`, `POST /admin/replay/{id}`, `autohedge replay`): a request the
//! trail kept is sent again through the running gateway as the client key that sent it — to
//! another endpoint when asked, with `replay_of` in its row — and never with wider rights than
//! that key has now; no secret is in a kept body.

mod common;

use std::time::Duration;

use common::pg_server::Pg;
use common::trail::rows;
use common::*;
use serde_json::{Value, json};

const KEY_A: &str = "sk-team-a-0123456789";
const KEY_B: &str = "sk-team-b-0123456789";
const UPSTREAM_KEY: &str = "upstream-secret-aaaa-0000";

fn config(a: &MockUp, b: &MockUp, keys: &str, extra: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, api_key: "{UPSTREAM_KEY}" }}
  b: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
routes:
  chat: [a, b]
auth:
  keys:
{keys}
health: {{ probe_interval: 1h, eject_after: 1000 }}
audit: {{ capture_bodies: failed, max_body_bytes: 4KiB }}
{extra}"#,
        a.base(),
        b.base()
    )
}

const BOTH_KEYS: &str = "    - { name: team-a, key: env:KEY_A, models: [chat] }\n    - { name: team-b, key: env:KEY_B }";

async fn send(gw: &Gw, key: &str, id: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .unwrap()
}

async fn replay(gw: &Gw, id: &str, ask: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(gw.url(&format!("/admin/replay/{id}")))
        .json(&ask)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Waits until the trail holds a body for `id` (the writer commits every 50 ms).
async fn kept(gw: &Gw, id: &str) -> Vec<Vec<Value>> {
    let sql = format!(
        "SELECT request_body, request_cut, response_body, response_cut FROM request_bodies WHERE request_id = '{id}'"
    );
    eventually(Duration::from_secs(10), || async {
        !audit_rows(gw, &sql).is_empty()
    })
    .await;
    audit_rows(gw, &sql)
}

/// Rewrites the config and waits until the gateway reloaded it.
async fn reload(gw: &Gw, cfg: &str) {
    let before = gw.status().await["config"]["reloads"].as_u64().unwrap_or(0);
    std::fs::write(&gw.config_path, cfg).unwrap();
    gw.hup();
    let ok = eventually(Duration::from_secs(10), || async {
        gw.status().await["config"]["reloads"].as_u64().unwrap_or(0) > before
    })
    .await;
    assert!(ok, "reload not seen: {}", gw.log());
}

fn spend_requests(gw: &Gw, key: &str) -> i64 {
    let r = audit_rows(
        gw,
        &format!("SELECT COALESCE(SUM(requests), 0) FROM client_spend WHERE client = '{key}'"),
    );
    r[0][0].as_i64().unwrap()
}

/// A request that failed over (a answered 500, b served) keeps its body and answer, with no
/// secret in either; replayed to `a` once it is back, it runs as team-a (team-a's count grows,
/// team-b's does not), reaches a, and its row says `replay_of`; the answer holds the old and
/// the new response. A stream is kept and replayed the same way.
#[tokio::test]
async fn a_failed_over_request_is_replayed_to_another_endpoint_as_its_key() {
    let a = MockUp::openai(
        "name: a\nreply: \"Now from a.\"\nrules: [{status: 500, error: \"engine crashed\"}]",
    )
    .await;
    let b = MockUp::openai("name: b\nreply: \"Served by b.\"").await;
    let gw = Gw::start_with_env(
        &config(&a, &b, BOTH_KEYS, ""),
        &[("KEY_A", KEY_A), ("KEY_B", KEY_B)],
    );
    gw.ready().await;
    let body = json!({
        "model": "chat",
        "temperature": 0.2,
        "metadata": {"team": "red", "api_key": "sk-hidden-in-metadata-000000"},
        "messages": [{"role": "user", "content": format!("What is replay? (my key is {KEY_A}, theirs {UPSTREAM_KEY})")}]
    });
    let r = send(&gw, KEY_A, "orig-1", &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = send(&gw, KEY_A, "orig-stream", &sbody).await;
    assert_eq!(r.status(), 200);
    let streamed = r.text().await.unwrap();
    assert!(streamed.contains("[DONE]"));

    // Kept: the request as sent, redacted; the answer b gave.
    let k = kept(&gw, "orig-1").await;
    assert_eq!(k.len(), 1);
    let (req, resp) = (k[0][0].as_str().unwrap(), k[0][2].as_str().unwrap());
    assert!(req.contains("What is replay?"), "{req}");
    assert!(req.contains("\"team\":\"red\""), "{req}");
    assert!(resp.contains("Served by b."), "{resp}");
    assert_eq!((k[0][1].as_i64(), k[0][3].as_i64()), (Some(0), Some(0)));
    let ks = kept(&gw, "orig-stream").await;
    let sresp = ks[0][2].as_str().unwrap();
    assert!(sresp.contains("data: [DONE]"), "{sresp}");
    let everything = gw.db_text() + &gw.log();
    for secret in [KEY_A, UPSTREAM_KEY, "sk-hidden-in-metadata"] {
        assert!(!everything.contains(secret), "{secret} stored or logged");
    }

    // a is back; team-a's and team-b's counts before.
    a.set_script("name: a\nreply: \"Now from a.\"").await;
    let (a_before, b_before) = (a.requests().await, b.requests().await);
    let (team_a, team_b) = (spend_requests(&gw, "team-a"), spend_requests(&gw, "team-b"));
    let (status, out) = replay(&gw, "orig-1", json!({"to": "a"})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["status"], 200, "{out}");
    assert_eq!(out["endpoint"], "a", "{out}");
    assert_eq!(out["replay_of"], "orig-1");
    assert_eq!(out["client_key"], "team-a");
    assert_eq!(out["original"]["endpoint"], "b");
    assert_eq!(
        out["original"]["response"]["choices"][0]["message"]["content"],
        "Served by b."
    );
    assert_eq!(
        out["response"]["choices"][0]["message"]["content"],
        "Now from a."
    );
    assert_eq!(a.requests().await, a_before + 1, "the replay reached a");
    assert_eq!(b.requests().await, b_before, "and only a");
    let new_id = out["request_id"].as_str().unwrap().to_string();
    let ok = eventually(Duration::from_secs(10), || async {
        !rows(&gw, &format!("SELECT client_key, replay_of, endpoint, status FROM requests WHERE request_id = '{new_id}'")).is_empty()
    })
    .await;
    assert!(ok);
    assert_eq!(
        rows(
            &gw,
            &format!(
                "SELECT client_key, replay_of, endpoint, status FROM requests WHERE request_id = '{new_id}'"
            )
        ),
        vec!["team-a:orig-1:a:200"]
    );
    assert_eq!(
        spend_requests(&gw, "team-a"),
        team_a + 1,
        "team-a's request"
    );
    assert_eq!(
        spend_requests(&gw, "team-b"),
        team_b,
        "team-b's count unchanged"
    );

    // The stream: replayed as a stream.
    let (status, out) = replay(&gw, "orig-stream", json!({"to": "a"})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["original"]["stream"], true);
    let text = out["response"].as_str().unwrap();
    assert!(
        text.contains("data: [DONE]") && text.contains("from"),
        "{text}"
    );
    assert!(
        out["original"]["response"]
            .as_str()
            .unwrap()
            .contains("Served"),
        "{out}"
    );

    // The CLI prints both answers side by side.
    // (Off the test's runtime: the mock upstreams answer on it.)
    let url = gw.url("");
    let cli = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_autohedge"))
            .args(["replay", "orig-1", "--diff", "--url", &url])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&cli.stdout);
    assert!(
        cli.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&cli.stderr)
    );
    assert!(stdout.contains("replayed orig-1 as"), "{stdout}");
    let diffed = stdout
        .lines()
        .find(|l| l.contains("Served by b.") && l.contains("Now from a."))
        .unwrap_or_else(|| panic!("no side-by-side line: {stdout}\n{}", gw.log()));
    assert!(diffed.contains(" | "), "{diffed}");
}

/// The key decides, as it is now: a key whose models no longer cover the request's model, a key
/// gone from auth.keys, an endpoint the key does not cover — refused, nothing sent upstream. A
/// body kept cut, an unknown id, another key's request named by an id two keys used, and a
/// request made without `application/json` are refused too.
#[tokio::test]
async fn a_narrowed_or_gone_key_is_refused_and_nothing_is_sent() {
    let a = MockUp::openai("name: a\nrules: [{status: 500, error: \"engine crashed\"}]").await;
    let b = MockUp::openai("name: b").await;
    let keys = "    - { name: team-a, key: env:KEY_A }\n    - { name: team-b, key: env:KEY_B }";
    let env = [("KEY_A", KEY_A), ("KEY_B", KEY_B)];
    let gw = Gw::start_with_env(&config(&a, &b, keys, ""), &env);
    gw.ready().await;
    let ask = json!({"model": "chat", "messages": [{"role": "user", "content": "hello"}]});
    assert_eq!(send(&gw, KEY_A, "r-a", &ask).await.status(), 200);
    // team-b uses the same id for a request of its own.
    assert_eq!(send(&gw, KEY_B, "r-a", &ask).await.status(), 200);
    let long =
        json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(5000)}]});
    assert_eq!(send(&gw, KEY_A, "r-long", &long).await.status(), 200);
    kept(&gw, "r-long").await;
    let k = kept(&gw, "r-a").await;
    assert_eq!(k.len(), 2, "both keys' requests kept");

    // An id two keys used: the key must be named; named, it replays that key's.
    let (status, out) = replay(&gw, "r-a", json!({})).await;
    assert_eq!(status, 409, "{out}");
    assert_eq!(out["error"]["code"], "not_replayable");
    let (status, out) = replay(&gw, "r-a", json!({"key": "team-b"})).await;
    assert_eq!(
        (status, &out["client_key"]),
        (200, &json!("team-b")),
        "{out}"
    );
    // Cut, unknown, not JSON.
    let (status, out) = replay(&gw, "r-long", json!({})).await;
    assert_eq!(status, 409, "{out}");
    assert!(
        out["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_body_bytes")
    );
    let (status, out) = replay(&gw, "no-such-request", json!({})).await;
    assert_eq!(
        (status, &out["error"]["code"]),
        (404, &json!("replay_not_found"))
    );
    let r = reqwest::Client::new()
        .post(gw.url("/admin/replay/r-a"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);

    // Narrowed: team-a may use endpoint b only (a model name that does not cover `chat`).
    let narrowed = "    - { name: team-a, key: env:KEY_A, models: [b] }\n    - { name: team-b, key: env:KEY_B }";
    let upstream = a.requests().await + b.requests().await;
    reload(&gw, &config(&a, &b, narrowed, "")).await;
    let (status, out) = replay(&gw, "r-a", json!({"key": "team-a"})).await;
    assert_eq!(status, 403, "the narrowed key is refused: {out}");
    assert!(
        out["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no longer covers model `chat`"),
        "{out}"
    );
    // team-b has no allow-list: an endpoint that exists is its to use; one that does not, no.
    let (status, _) = replay(&gw, "r-a", json!({"key": "team-b", "to": "nowhere"})).await;
    assert_eq!(status, 400);
    // Gone.
    let gone = "    - { name: team-b, key: env:KEY_B }";
    reload(&gw, &config(&a, &b, gone, "")).await;
    let (status, out) = replay(&gw, "r-a", json!({"key": "team-a"})).await;
    assert_eq!(status, 403, "the gone key is refused: {out}");
    assert!(
        out["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no longer one of auth.keys"),
        "{out}"
    );
    assert_eq!(
        a.requests().await + b.requests().await,
        upstream,
        "no refused replay reached an upstream"
    );
}

/// With `audit.store: postgres`, bodies are written to PostgreSQL and read back from it: the
/// replay of a failed request, and its row's `replay_of`, are there.
#[tokio::test]
async fn a_request_kept_in_postgres_is_replayed() {
    let pg = Pg::start();
    let url = pg.database("replay").await;
    let a = MockUp::openai("name: a\nrules: [{status: 500, error: \"engine crashed\"}]").await;
    let b = MockUp::openai("name: b").await;
    let keys = "    - { name: team-a, key: env:KEY_A }";
    let cfg = config(&a, &b, keys, "").replace(
        "audit: { capture_bodies: failed, max_body_bytes: 4KiB }",
        "audit: { store: postgres, url: env:AUTOHEDGE_PG_URL, capture_bodies: failed }",
    );
    let gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A), ("AUTOHEDGE_PG_URL", &url)]);
    gw.ready().await;
    let ask =
        json!({"model": "chat", "messages": [{"role": "user", "content": "kept in postgres"}]});
    assert_eq!(send(&gw, KEY_A, "pg-1", &ask).await.status(), 200);
    let c = pg.client("replay").await;
    let ok = eventually(Duration::from_secs(10), || async {
        c.query_one(
            "SELECT count(*) FROM request_bodies WHERE request_id = 'pg-1'",
            &[],
        )
        .await
        .map(|r| r.get::<_, i64>(0) == 1)
        .unwrap_or(false)
    })
    .await;
    assert!(ok, "{}", gw.log());
    let body: String = c
        .query_one(
            "SELECT request_body FROM request_bodies WHERE request_id = 'pg-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        body.contains("kept in postgres") && !body.contains(KEY_A),
        "{body}"
    );
    let (status, out) = replay(&gw, "pg-1", json!({"to": "b"})).await;
    assert_eq!((status, &out["status"]), (200, &json!(200)), "{out}");
    let new_id = out["request_id"].as_str().unwrap().to_string();
    let ok = eventually(Duration::from_secs(10), || async {
        c.query_one(
            "SELECT count(*) FROM requests WHERE request_id = $1 AND replay_of = 'pg-1' AND client_key = 'team-a'",
            &[&new_id],
        )
        .await
        .map(|r| r.get::<_, i64>(0) == 1)
        .unwrap_or(false)
    })
    .await;
    assert!(ok, "the replay's row says replay_of in PostgreSQL");
}

/// Kept bodies wait for the writer within a bound (64 × `audit.max_body_bytes`), one key at most
/// half of it: with the writer held up (the test holds the database's write lock), team-a's
/// flood reaches its half and loses its later bodies (counted), while team-b's request, sent
/// after the flood, keeps its body — and every row of both keys is written once the writer goes
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_keys_flood_of_bodies_keeps_none_of_another_keys_out() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let keys = "    - { name: team-a, key: env:KEY_A }\n    - { name: team-b, key: env:KEY_B }";
    let cfg = config(&a, &b, keys, "").replace(
        "audit: { capture_bodies: failed, max_body_bytes: 4KiB }",
        "audit: { capture_bodies: all, max_body_bytes: 1KiB }",
    );
    let gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A), ("KEY_B", KEY_B)]);
    gw.ready().await;
    let big = |who: &str| json!({"model": "chat", "messages": [{"role": "user", "content": format!("{who} {}", "y".repeat(2000))}]});
    assert_eq!(send(&gw, KEY_B, "warm", &big("warm")).await.status(), 200);
    kept(&gw, "warm").await;

    // The writer is held: what is sent now waits in memory.
    let lock = rusqlite::Connection::open(gw.db()).unwrap();
    lock.execute_batch("BEGIN IMMEDIATE").unwrap();
    let flood: Vec<_> = (0..100)
        .map(|i| {
            let (url, body) = (gw.url("/v1/chat/completions"), big("team-a"));
            tokio::spawn(async move {
                reqwest::Client::new()
                    .post(url)
                    .bearer_auth(KEY_A)
                    .header("x-request-id", format!("flood-{i}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    for f in flood {
        assert_eq!(f.await.unwrap(), 200);
    }
    let dropped = gw.metric("autohedge_audit_bodies_dropped_total").await;
    assert!(
        dropped >= 1.0,
        "team-a's flood reached its share: {dropped}"
    );
    // team-b, after the flood, while the writer is still held.
    assert_eq!(
        send(&gw, KEY_B, "team-b-1", &big("team-b")).await.status(),
        200
    );
    assert_eq!(
        gw.metric("autohedge_audit_bodies_dropped_total").await,
        dropped,
        "team-b's body was not refused"
    );
    lock.execute_batch("ROLLBACK").unwrap();
    drop(lock);

    let k = kept(&gw, "team-b-1").await;
    assert_eq!(k.len(), 1, "team-b's body kept");
    assert!(k[0][0].as_str().unwrap().contains("team-b"));
    let ok = eventually(Duration::from_secs(10), || async {
        rows(
            &gw,
            "SELECT count(*) FROM requests WHERE request_id LIKE 'flood-%'",
        ) == vec!["100"]
    })
    .await;
    assert!(ok, "every row of the flood written");
    let with_bodies: i64 = audit_rows(
        &gw,
        "SELECT count(*) FROM request_bodies WHERE request_id LIKE 'flood-%'",
    )[0][0]
        .as_i64()
        .unwrap();
    assert!(
        with_bodies < 100 && with_bodies as f64 + dropped == 100.0,
        "{with_bodies} kept, {dropped} dropped"
    );
}

/// A `/v1/responses` continuation keeps the body its client sent — the gateway's own
/// `previous_response_id` and its new input, not the upstream's id (native) nor the whole
/// conversation joined to it (translated to chat) — and replays as the continuation it was.
#[tokio::test]
async fn a_responses_continuation_keeps_and_replays_what_its_client_sent() {
    let native = MockUp::openai("name: native\nreply: \"Hi Ada.\"").await;
    let chat = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "name: chat\nreply: \"Hi again.\"\nmodels: [qwen]",
    )
    .await;
    let gw = Gw::start(&format!(
        r#"models:
  native: {{ type: openai, base_url: "{}" }}
  chat: {{ type: ollama, base_url: "http://{}", model: qwen }}
health: {{ probe_interval: 1h }}
audit: {{ capture_bodies: all }}
"#,
        native.base(),
        chat.addr
    ));
    gw.ready().await;
    for model in ["native", "chat"] {
        let r = gw
            .post(
                "/v1/responses",
                json!({"model": model, "input": "My name is Ada."}),
            )
            .await;
        assert_eq!(r.status(), 200);
        let id = r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let r = gw
            .post(
                "/v1/responses",
                json!({"model": model, "input": "Who am I?", "previous_response_id": id}),
            )
            .await;
        assert_eq!(r.status(), 200, "{model}");
        let second = header(&r, "x-request-id");
        let k = kept(&gw, &second).await;
        let body: Value = serde_json::from_str(k[0][0].as_str().unwrap()).unwrap();
        assert_eq!(
            body,
            json!({"model": model, "input": "Who am I?", "previous_response_id": id}),
            "{model}: the client's own body"
        );
        let (status, out) = replay(&gw, &second, json!({})).await;
        assert_eq!(
            (status, &out["status"]),
            (200, &json!(200)),
            "{model}: {out}"
        );
        assert_eq!(
            out["response"]["previous_response_id"],
            id.as_str(),
            "{model}: {out}"
        );
    }
}
