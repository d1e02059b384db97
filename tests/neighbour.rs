//! The hostile neighbour: what one client key, one upstream's answer or one store hiccup does
//! must not change what another key gets — its statuses, answers, spend, limits and audit rows.
//! Each case shows the hostile thing happened (the bytes reached the store, the pause was
//! served) before showing the victim's service, bill and records unchanged. Real parts: the
//! real binary, loopback upstreams, Redis 7 and PostgreSQL 15 of our own (tests/common).

mod common;

use std::time::Duration;

use common::pg_server::Pg;
use common::*;
use serde_json::json;

const KEY_A: &str = "sk-hostile-0123456789";
const KEY_B: &str = "sk-victim-0123456789";

fn keys_env<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut env = vec![("KEY_A", KEY_A), ("KEY_B", KEY_B)];
    env.extend_from_slice(extra);
    env
}

async fn chat_as(gw: &Gw, key: &str, id: impl AsRef<str>, model: &str) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .header("x-request-id", id.as_ref())
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

async fn pg_count(c: &tokio_postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

/// #45 item 3: key A's `"model": "x\u0000y"`, an upstream error text with a NUL and a model
/// name of 10,000 characters, sent among key B's 40 concurrent requests, cost B no row: every
/// one of B's requests has its row, and A's are there too, with the NUL replaced and the name
/// cut to 256 characters. (Before: PostgreSQL refused the batch holding the NUL whole.)
#[tokio::test]
async fn a_nul_from_one_key_costs_no_other_key_its_audit_rows() {
    let pg = Pg::start();
    let url = pg.database("nul").await;
    let up = MockUp::openai(
        "name: a\nrules: [{when: {model: poison-model}, status: 500, error: \"bad\\0thing\"}]",
    )
    .await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{0}", model: gpt-4o-mini }}
  poisoned: {{ type: openai, base_url: "{0}", model: poison-model }}
routing_policy: {{ fallback_chain: [a] }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[("AUTOHEDGE_PG_URL", &url)]));
    gw.ready().await;
    let long = "m".repeat(10_000);
    let hostile = async {
        let (s1, _) = chat_as(&gw, KEY_A, "a-nul", "x\u{0}y").await;
        let (s2, _) = chat_as(&gw, KEY_A, "a-upstream-nul", "poisoned").await;
        let (s3, _) = chat_as(&gw, KEY_A, "a-long", &long).await;
        (s1, s2, s3)
    };
    let victim =
        futures_util::future::join_all((0..40).map(|i| chat_as(&gw, KEY_B, format!("b-{i}"), "a")));
    let ((s1, s2, s3), answers) = tokio::join!(hostile, victim);
    assert_eq!((s1, s3), (404, 404), "unknown models refused");
    assert_eq!(s2, 200, "the poisoned endpoint failed over to `a`");
    assert!(answers.iter().all(|(s, _)| *s == 200));
    let written = eventually(Duration::from_secs(10), || async {
        gw.status().await["audit"]["written"].as_u64().unwrap_or(0) >= 43
    })
    .await;
    let audit = gw.status().await["audit"].clone();
    assert!(written, "{audit}");
    assert_eq!(
        (&audit["dropped"], &audit["set_aside"]),
        (&json!(0), &json!(0)),
        "{audit}"
    );
    gw.stop();
    let c = pg.client("nul").await;
    // The hostile bytes reached the trail (made safe) ...
    let nul: Vec<String> = c
        .query(
            "SELECT requested_model FROM requests WHERE request_id = 'a-nul'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(nul, vec!["x\u{FFFD}y".to_string()]);
    let error: String = c
        .query_one(
            "SELECT a.error FROM attempts a WHERE a.request_id = 'a-upstream-nul' AND a.endpoint = 'poisoned'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("bad\u{FFFD}thing"), "{error}");
    let cut: String = c
        .query_one(
            "SELECT requested_model FROM requests WHERE request_id = 'a-long'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(cut.chars().count(), 256);
    // ... and every one of the victim's requests has its row.
    assert_eq!(
        pg_count(
            &c,
            "SELECT COUNT(*) FROM requests WHERE client_key = 'victim' AND status = 200"
        )
        .await,
        40
    );
}

/// #45 item 3: a record PostgreSQL refuses whatever its text (here a trigger of the store's
/// own refuses one request id) costs no other record: the batch it was in is written record
/// by record, the victim's 40 rows land, and the one refused is set aside — counted in
/// `/status.audit.set_aside` and logged with its request id. (Before: the batch was dropped.)
#[tokio::test]
async fn a_record_the_store_refuses_is_set_aside_alone() {
    let pg = Pg::start();
    let url = pg.database("refuse").await;
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[("AUTOHEDGE_PG_URL", &url)]));
    gw.ready().await;
    let c = pg.client("refuse").await;
    c.batch_execute(
        "CREATE FUNCTION refuse_poison() RETURNS trigger AS $$
         BEGIN
           IF NEW.request_id = 'a-poison' THEN RAISE EXCEPTION 'no poison here'; END IF;
           RETURN NEW;
         END $$ LANGUAGE plpgsql;
         CREATE TRIGGER refuse_poison BEFORE INSERT ON requests
           FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
    )
    .await
    .unwrap();
    let hostile = chat_as(&gw, KEY_A, "a-poison", "a");
    let victim =
        futures_util::future::join_all((0..40).map(|i| chat_as(&gw, KEY_B, format!("b-{i}"), "a")));
    let ((s, _), answers) = tokio::join!(hostile, victim);
    assert_eq!(s, 200);
    assert!(answers.iter().all(|(s, _)| *s == 200));
    let set_aside = eventually(Duration::from_secs(10), || async {
        gw.status().await["audit"]["set_aside"] == 1
    })
    .await;
    assert!(set_aside, "{}", gw.status().await["audit"]);
    gw.stop();
    assert!(
        gw.log().contains("set aside") && gw.log().contains("a-poison"),
        "{}",
        gw.log()
    );
    assert_eq!(
        pg_count(
            &c,
            "SELECT COUNT(*) FROM requests WHERE request_id = 'a-poison'"
        )
        .await,
        0
    );
    assert_eq!(
        pg_count(
            &c,
            "SELECT COUNT(*) FROM requests WHERE client_key = 'victim' AND status = 200"
        )
        .await,
        40
    );
}

// ── A store that pauses: Redis (`cluster:`) ─────────────────────────────────────────────────

use common::redis_server::Redis;

/// One gateway on `redis`, key B (`victim`) with a budget, every token at $0.001.
fn budget_gateway(up: &MockUp, redis: &Redis, prefix: &str, budget: f64) -> Gw {
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, cost: {{ input_per_mtok: 1000, output_per_mtok: 1000 }} }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B, budget_usd: {budget} }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "{prefix}", timeout: 20ms }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let url = redis.url();
    Gw::start_with_env(&cfg, &keys_env(&[("AUTOHEDGE_REDIS_URL", &url)]))
}

async fn until_store_up(gw: &Gw) {
    let up = eventually(Duration::from_secs(15), || async {
        gw.status().await["cluster"]["state"] == "up"
    })
    .await;
    assert!(up, "{}", gw.status().await["cluster"]);
}

/// A priced request of the victim's: `max_tokens` 95, so it reserves about $0.10.
async fn priced(gw: &Gw, id: String) -> u16 {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(KEY_B)
        .header("x-request-id", id)
        .json(&json!({"model": "a", "max_tokens": 95, "messages": [{"role": "user", "content": "Hello"}]}))
        .send()
        .await
        .unwrap();
    r.status().as_u16()
}

/// The victim's spend and reservations in the store, and the sum of its rows' costs.
async fn store_and_rows(gw: &Gw, redis: &Redis, prefix: &str) -> (f64, f64, f64) {
    let num = |v: Option<String>| v.and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let spend = num(redis.value(&format!("HGET {prefix}spend:victim:{} usd", month_now())));
    let reserved = num(redis.value(&format!("GET {prefix}resvtot:victim")));
    let rows = audit_rows(
        gw,
        "SELECT COALESCE(SUM(cost_usd), 0) FROM requests WHERE client_key = 'victim'",
    );
    (spend, reserved, rows[0][0].as_f64().unwrap_or(0.0))
}

/// #45 item 2: a 400 ms Redis pause locks no budgeted key out. Requests during the pause are
/// admitted locally after `cluster.timeout`; the admission scripts already written run when
/// Redis resumes and reserve for requests that ended meanwhile — their settles let those
/// reservations go by name, so the key's next requests are admitted as its real spend allows.
/// (Before: the late reservations held the whole $1 budget for an hour; every later request
/// got 429 `insufficient_quota` with $0.02 spent.)
#[tokio::test]
async fn a_short_store_pause_locks_no_budgeted_key_out() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    let mut gw = budget_gateway(&up, &redis, "pause:", 1.0);
    gw.ready().await;
    until_store_up(&gw).await;
    assert_eq!(priced(&gw, "b-first".into()).await, 200);
    assert_eq!(redis.cmd("CLIENT PAUSE 400").as_deref(), Some("+OK"));
    // Three requests, at once after the pause began (not as many as fit in a time box).
    for i in 0..3 {
        assert_eq!(priced(&gw, format!("b-pause-{i}")).await, 200);
    }
    // The pause was met, as the gateway counts it: requests admitted on their own after the
    // store's silence.
    let st = gw.status().await["cluster"].clone();
    assert!(st["slow_answers"].as_u64().unwrap() >= 1, "{st}");
    // Once the store answers, the reservations go and the key is served as its spend allows.
    let free = eventually(Duration::from_secs(10), || async {
        store_and_rows(&gw, &redis, "pause:").await.1.abs() < 1e-9
    })
    .await;
    assert!(
        free,
        "reservations left: {:?}",
        store_and_rows(&gw, &redis, "pause:").await
    );
    for i in 0..5 {
        assert_eq!(priced(&gw, format!("b-after-{i}")).await, 200, "after {i}");
    }
    gw.stop();
    let (spend, reserved, rows) = store_and_rows(&gw, &redis, "pause:").await;
    assert!(rows > 0.0 && rows < 1.0, "{rows}");
    assert!(reserved.abs() < 1e-9, "{reserved}");
    assert!(
        (spend - rows).abs() < 1e-9,
        "store {spend} against rows {rows}"
    );
}

/// #45 item 5: a Redis pause longer than a settle call's timeout charges nothing twice. The
/// settles of requests that ended during a 3 s pause time out and run when Redis resumes;
/// the settler sends them again, and the store applies each name once: the spend is exactly
/// the sum of the rows' costs. (Before: a $1 request charged $3 after two.)
#[tokio::test]
async fn a_slow_store_charges_nothing_twice() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    let mut gw = budget_gateway(&up, &redis, "twice:", 1000.0);
    gw.ready().await;
    until_store_up(&gw).await;
    assert_eq!(priced(&gw, "b-first".into()).await, 200);
    // Three times the store calls' 1 s timeout: a call the gateway starts within the first 2 s
    // of the pause (its heartbeat is once a second) times out while the store is still paused.
    assert_eq!(redis.cmd("CLIENT PAUSE 3000").as_deref(), Some("+OK"));
    for i in 0..5 {
        assert_eq!(priced(&gw, format!("b-pause-{i}")).await, 200);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The pause was met: the store counted away for a while.
    let outage = eventually(Duration::from_secs(15), || async {
        gw.status().await["cluster"]["outages"]
            .as_u64()
            .unwrap_or(0)
            >= 1
    })
    .await;
    assert!(outage, "{}", gw.status().await["cluster"]);
    until_store_up(&gw).await;
    for i in 0..3 {
        assert_eq!(priced(&gw, format!("b-after-{i}")).await, 200);
    }
    let settled = eventually(Duration::from_secs(10), || async {
        let st = gw.status().await["cluster"].clone();
        st["settles_queued"] == 0 && store_and_rows(&gw, &redis, "twice:").await.1.abs() < 1e-9
    })
    .await;
    assert!(settled, "{}", gw.status().await["cluster"]);
    gw.stop();
    let (spend, _, rows) = store_and_rows(&gw, &redis, "twice:").await;
    assert!(rows > 0.0, "{rows}");
    assert!(
        (spend - rows).abs() < 1e-9,
        "store {spend} against rows {rows}"
    );
}

/// #45 item 6: three replicas saw each other; Redis dies and each restarts while it is away.
/// Each still splits `rpm: 60` by three (the count it kept in its data dir): 200 requests over
/// the three pass at most the key's 60 (and a refill's worth of slack), not 180. A fourth
/// replica that never saw the store splits by `cluster.replicas`.
#[tokio::test]
async fn a_replica_restarted_while_the_store_is_away_remembers_the_fleet() {
    let mut redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    let cfg = |url: &str| {
        format!(
            r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: victim, key: env:KEY_B, rpm: 60 }}
cluster: {{ redis: "{url}", key_prefix: "fleet:", timeout: 50ms }}
health: {{ probe_interval: 1h }}
"#,
            up.base()
        )
    };
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let env = keys_env(&[]);
    let mut gws: Vec<Gw> = dirs
        .iter()
        .map(|d| Gw::start_in(d.path(), &cfg(&redis.url()), &env))
        .collect();
    for g in &gws {
        let seen = eventually(Duration::from_secs(15), || async {
            let st = g.status().await;
            st["cluster"]["state"] == "up" && st["cluster"]["replicas"] == 3
        })
        .await;
        assert!(seen, "{}", g.status().await["cluster"]);
    }
    redis.kill();
    for g in gws.iter_mut() {
        g.stop();
    }
    let gws: Vec<Gw> = dirs
        .iter()
        .map(|d| Gw::start_in(d.path(), &cfg(&redis.url()), &env))
        .collect();
    for g in &gws {
        g.ready().await;
        let st = g.status().await["cluster"].clone();
        assert_ne!(st["state"], "up", "{st}");
        assert_eq!(st["replicas"], 3, "{st}");
    }
    let client = reqwest::Client::new();
    let mut passed = 0;
    let started = std::time::Instant::now();
    for i in 0..200 {
        let r = client
            .post(gws[i % 3].url("/v1/chat/completions"))
            .bearer_auth(KEY_B)
            .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            200 => passed += 1,
            429 => {}
            s => panic!("{s}"),
        }
    }
    // Each share is a third of a minute's 60 and refills a third of a request a second: the
    // three together never pass more than 60 and one a second since they started.
    let refilled = started.elapsed().as_secs_f64().ceil() as usize + 1;
    assert!(
        passed >= 60 && passed <= 60 + refilled,
        "{passed} of 200 passed rpm: 60 ({refilled} refilled)"
    );
    // One that never saw the store: `cluster.replicas`.
    let fresh = tempfile::tempdir().unwrap();
    let told = cfg(&redis.url()).replace("timeout: 50ms", "timeout: 50ms, replicas: 4");
    let g = Gw::start_in(fresh.path(), &told, &env);
    g.ready().await;
    assert_eq!(g.status().await["cluster"]["replicas"], 4);
}

// ── Shared facts a client's request can provoke: the Responses API ──────────────────────────

/// The victim's Responses call with a tool only a native `/responses` serves (translation to
/// chat refuses it with 400 `unsupported_parameter`).
async fn native_only(gw: &Gw, id: &str) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/responses"))
        .bearer_auth(KEY_B)
        .header("x-request-id", id)
        .json(&json!({"model": "a", "input": "news today?", "tools": [{"type": "web_search"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

/// #45 item 1: a client's own 404 never makes an endpoint chat-only for everyone. Key A's
/// `conversation: conv_x` gets the upstream's 404 naming it (the client's business, returned to
/// it); A's next call gets a 404 that names nothing (a hostile or confused upstream answer) and
/// goes on translated, alone. The gateway's own probe (no client content) finds the route, so
/// the endpoint stays native: key B's `web_search` call is served by the upstream. An endpoint
/// that has no `/responses` for anyone (its probe answers 404 too) is marked chat-only, and its
/// calls are translated. (Before: A's first 404 marked the endpoint chat-only, and B got 400.)
#[tokio::test]
async fn a_clients_own_404_never_makes_an_endpoint_chat_only() {
    let up = MockUp::openai(
        "name: a\nrules:\n  - {when: {path: /v1/responses}, times: 1, status: 404, error: \"Conversation with id 'conv_x' not found.\"}\n  - {when: {path: /v1/responses}, times: 1, status: 404, error: \"Not found.\"}\n",
    )
    .await;
    let chatty = MockUp::openai(
        "name: c\nrules: [{when: {path: /v1/responses}, status: 404, error: \"Not found.\"}]",
    )
    .await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  c: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
health: {{ probe_interval: 1h }}
"#,
        up.base(),
        chatty.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let client = reqwest::Client::new();
    let ask = |body: serde_json::Value| {
        client
            .post(gw.url("/v1/responses"))
            .bearer_auth(KEY_A)
            .json(&body)
            .send()
    };
    // A's conversation is unknown upstream: A gets that 404, as the upstream said it.
    let r = ask(json!({"model": "a", "conversation": "conv_x", "input": "hi"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("conv_x"),
        "{body}"
    );
    // A 404 naming nothing A sent: A's call goes on, translated, on the same endpoint.
    let r = ask(json!({"model": "a", "input": "hi"})).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    // Both 404s reached the upstream, and the gateway's probe (a body with no model) after.
    let probed = eventually(Duration::from_secs(10), || async {
        let st = up.stats().await;
        st["by_path"]["/v1/responses"].as_u64().unwrap_or(0) >= 3
    })
    .await;
    assert!(probed, "{}", up.stats().await);
    // The endpoint still speaks Responses natively to everyone else.
    let (status, body) = native_only(&gw, "b-native").await;
    assert_eq!(status, 200, "{body}");
    let st = gw.status().await;
    assert_ne!(
        st["endpoints"]["a"]["responses"]["mode"], "translated",
        "{}",
        st["endpoints"]["a"]
    );
    // An endpoint with no `/responses` at all: its probe says so, and it is marked.
    let r = client
        .post(gw.url("/v1/responses"))
        .bearer_auth(KEY_B)
        .json(&json!({"model": "c", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let marked = eventually(Duration::from_secs(10), || async {
        gw.status().await["endpoints"]["c"]["responses"]["mode"] == "translated"
    })
    .await;
    assert!(marked, "{}", gw.status().await["endpoints"]["c"]);
    gw.stop();
}

/// #45 items 3 and 10: every call of a key counts. Key A at `rpm: 5` floods `GET
/// /v1/responses/{id}` of its own response, `DELETE`s, `/v1/models`, unknown models and
/// bodies the gateway cannot read: each call takes from A's `rpm` (past it, 429 with no
/// upstream call) and has its audit row naming its `operation`; key B, beside it, is served
/// every time. (Before: 30 GETs at `rpm: 5` were all answered, 30 upstream calls with the
/// endpoint's shared key, and none had a row; refusals took nothing from `rpm`.)
#[tokio::test]
async fn every_call_of_a_key_counts_against_its_limits() {
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A, rpm: 5 }}
    - {{ name: victim, key: env:KEY_B, rpm: 600 }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let client = reqwest::Client::new();
    // A's one response (natively stored upstream): the first of its five.
    let r = client
        .post(gw.url("/v1/responses"))
        .bearer_auth(KEY_A)
        .json(&json!({"model": "a", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rid = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let gets_before = up.stats().await["requests"].as_u64().unwrap();
    let mut statuses = Vec::new();
    for i in 0..30 {
        let r = client
            .get(gw.url(&format!("/v1/responses/{rid}")))
            .bearer_auth(KEY_A)
            .header("x-request-id", format!("a-get-{i}"))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
        // B beside it, every time.
        let (s, _) = chat_as(&gw, KEY_B, format!("b-{i}"), "a").await;
        assert_eq!(s, 200);
    }
    let served = statuses.iter().filter(|s| **s == 200).count();
    assert!(served >= 1, "A's own response was read: {statuses:?}");
    assert!(served <= 5, "{served} of 30 GETs at rpm: 5: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    // What was refused asked nothing upstream (B's 30 chats and A's reads only).
    let upstream_calls = up.stats().await["requests"].as_u64().unwrap() - gets_before;
    assert!(upstream_calls <= 30 + served as u64, "{upstream_calls}");
    // The other calls A can make count too, and are refused past the limit.
    let r = client
        .get(gw.url("/v1/models"))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let (s, body) = chat_as(&gw, KEY_A, "a-unknown", "no-such-model").await;
    assert_eq!(s, 429, "{body}");
    let r = client
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(KEY_A)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let r = client
        .get(gw.url("/v1/models"))
        .bearer_auth(KEY_B)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.stop();
    // Every call has its row, named.
    let rows = audit_rows(
        &gw,
        "SELECT operation, status, COUNT(*) FROM requests WHERE client_key = 'hostile' GROUP BY operation, status ORDER BY operation, status",
    );
    let count = |op: &str, status: i64| {
        rows.iter()
            .find(|r| r[0] == op && r[1] == status)
            .map_or(0, |r| r[2].as_i64().unwrap())
    };
    assert_eq!(
        count("responses_get", 200) + count("responses_get", 429),
        30,
        "{rows:?}"
    );
    assert_eq!(count("models", 429), 1, "{rows:?}");
    assert_eq!(count("chat", 429), 2, "{rows:?}");
    let b_rows = audit_rows(
        &gw,
        "SELECT COUNT(*) FROM requests WHERE client_key = 'victim' AND status = 200",
    );
    assert_eq!(b_rows[0][0], 31);
}

/// Before a key's limits, unknown models count: at `rpm: 5` the sixth call naming a model the
/// gateway does not have gets 429, not another 404 (a key cannot probe names past its limit).
#[tokio::test]
async fn refused_calls_count_against_rpm() {
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A, rpm: 5, models: [a] }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let mut got = Vec::new();
    for (i, model) in ["x", "y", "z", "gpt-4o", "b", "w", "v"].iter().enumerate() {
        let (s, _) = chat_as(&gw, KEY_A, format!("a-{i}"), model).await;
        got.push(s);
    }
    // Not allowed (403) or not found (404) for five, then the limit.
    assert!(got[..5].iter().all(|s| *s == 403 || *s == 404), "{got:?}");
    assert_eq!(&got[5..], &[429, 429], "{got:?}");
    assert_eq!(up.requests().await, 0);
}

/// #45 item 4: `tpm` counts the billed prompt, not only the messages. At `tpm: 1000`, 20 KB in
/// a function tool's description, a `response_format` schema or a Responses `text.format` is
/// refused as the same text in a message is (about 5,000 tokens, more than a minute's), and
/// never reaches the upstream; a short request of the same key passes. (Before: all five
/// requests with the 20 KB tool passed.)
#[tokio::test]
async fn tpm_counts_tools_and_schemas_as_the_upstream_bills_them() {
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A, tpm: 1000 }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let text = "word ".repeat(4_000);
    let msg = json!([{"role": "user", "content": "hi"}]);
    let client = reqwest::Client::new();
    let send = |path: &'static str, body: serde_json::Value| {
        client
            .post(gw.url(path))
            .bearer_auth(KEY_A)
            .json(&body)
            .send()
    };
    let tool = json!({"model": "a", "max_tokens": 5, "messages": msg, "tools": [{"type": "function", "function": {"name": "f", "description": text, "parameters": {"type": "object"}}}]});
    let format = json!({"model": "a", "max_tokens": 5, "messages": msg, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "description": text}}}});
    let text_format = json!({"model": "a", "max_output_tokens": 5, "input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object", "description": text}}}});
    let in_message =
        json!({"model": "a", "max_tokens": 5, "messages": [{"role": "user", "content": text}]});
    for (path, body) in [
        ("/v1/chat/completions", in_message),
        ("/v1/chat/completions", tool.clone()),
        ("/v1/chat/completions", tool),
        ("/v1/chat/completions", format),
        ("/v1/responses", text_format),
    ] {
        let r = send(path, body).await.unwrap();
        let status = r.status().as_u16();
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(status, 429, "{err}");
        assert!(
            err["error"]["message"].as_str().unwrap().contains("token"),
            "{err}"
        );
    }
    assert_eq!(up.requests().await, 0, "none reached the upstream");
    let r = send(
        "/v1/chat/completions",
        json!({"model": "a", "max_tokens": 5, "messages": msg}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
}

/// Key `key`'s Responses turn on `gw`: its status, id and body.
async fn respond(
    gw: &Gw,
    key: &str,
    input: String,
    prev: Option<String>,
) -> (u16, String, serde_json::Value) {
    let mut body = json!({"model": "a", "input": input});
    if let Some(p) = prev {
        body["previous_response_id"] = json!(p);
    }
    let r = reqwest::Client::new()
        .post(gw.url("/v1/responses"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: serde_json::Value = r.json().await.unwrap();
    (status, v["id"].as_str().unwrap_or_default().to_string(), v)
}

/// A's two-turn conversation, then `turns` turns of `size` bytes from B (each continuing the
/// last); the id of A's last turn.
async fn conversation_then_flood(gw: &Gw, turns: usize, size: usize) -> String {
    let (s, a1, _) = respond(gw, KEY_A, "Hello".into(), None).await;
    assert_eq!(s, 200);
    let (s, a2, v) = respond(gw, KEY_A, "And then?".into(), Some(a1)).await;
    assert_eq!(s, 200, "{v}");
    let mut prev: Option<String> = None;
    for _ in 0..turns {
        let (s, id, v) = respond(gw, KEY_B, "b".repeat(size), prev.take()).await;
        assert!(s == 200 || s == 404, "{v}");
        prev = (s == 200).then_some(id);
    }
    a2
}

/// #45 item 8: each key's kept conversations are its own. Key B keeps twenty turns of 100 KB
/// (`history_max_bytes: 1MiB`, a key's share a quarter of it): only B's own oldest turns go,
/// and key A's conversation continues. (Before: one LRU for all keys; A's next turn got 404
/// `previous_response_not_found`.)
#[tokio::test]
async fn one_keys_history_never_evicts_anothers() {
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: victim, key: env:KEY_A }}
    - {{ name: hostile, key: env:KEY_B }}
responses: {{ history: keep, history_max_bytes: 1048576 }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let a2 = conversation_then_flood(&gw, 20, 100_000).await;
    let (s, _, v) = respond(&gw, KEY_A, "Still there?".into(), Some(a2)).await;
    assert_eq!(s, 200, "{v}");
}

/// #45 item 7: Redis holds the kept turns within the same bounds. Key B sends forty turns of
/// 200 KB (8 MB) with `history_max_bytes: 2MiB`: Redis's memory grows by less than 4 MB, and
/// key A's turns are still there. (Before: every turn was stored; 60 turns of 200 KB grew it
/// by 13.8 MB.)
#[tokio::test]
async fn redis_keeps_turns_within_the_history_bounds() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: victim, key: env:KEY_A }}
    - {{ name: hostile, key: env:KEY_B }}
responses: {{ history: keep, history_max_bytes: 2097152 }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "hist:", timeout: 1s }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let url = redis.url();
    let gw = Gw::start_with_env(&cfg, &keys_env(&[("AUTOHEDGE_REDIS_URL", &url)]));
    gw.ready().await;
    until_store_up(&gw).await;
    let used = || {
        redis
            .answer("INFO memory")
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("used_memory:").map(|v| v.trim().to_string()))
            })
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
    };
    let before = used();
    let a2 = conversation_then_flood(&gw, 40, 200_000).await;
    // B's turns reached the store (its last one is there) ...
    let shared = eventually(Duration::from_secs(5), || async {
        redis.cmd("DBSIZE").is_some_and(|n| n != ":0")
            && redis.cmd(&format!("EXISTS hist:resp:{a2}")).as_deref() == Some(":1")
    })
    .await;
    assert!(shared, "A's turn in the shared store");
    // ... and the store holds no more than the bound.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = used().saturating_sub(before);
    assert!(grown < 4 << 20, "Redis grew by {grown} bytes");
    // A deleted turn takes its bytes with it.
    let a_bytes = || {
        redis
            .value("HGET hist:turnbytes k:victim")
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(0)
    };
    let held = a_bytes();
    assert!(held > 0);
    let r = reqwest::Client::new()
        .delete(gw.url(&format!("/v1/responses/{a2}")))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(a_bytes() < held, "{} of {held}", a_bytes());
    assert_eq!(
        redis.cmd(&format!("EXISTS hist:resp:{a2}")).as_deref(),
        Some(":0")
    );
}

/// #45 item 9: a translated stream is bounded. A chat-only upstream streams 120 MB of deltas
/// to a `/v1/responses` stream, the config as shipped: the translator keeps at most
/// `server.max_response_bytes`, and never more than 16 MiB, the stream ends with
/// `response.failed` (`response_too_large`), the upstream is read no further, the attempt's
/// row says why, and the gateway's peak memory grows by less than 100 MB. (Before: its memory
/// grew by 1.5 GB.)
#[tokio::test]
async fn a_translated_stream_is_bounded_whatever_the_upstream_sends() {
    let word = format!("{} ", "w".repeat(1 << 20));
    let reply = word.repeat(120);
    let script = serde_json::to_string(&json!({
        "name": "chatonly",
        "reply": reply,
        "rules": [{"when": {"path": "/v1/responses"}, "status": 404, "error": "Not found."}],
    }))
    .unwrap();
    drop(reply);
    let up = MockUp::openai(&script).await;
    drop(script);
    let cfg = format!(
        // The mock makes 120 MB of answer before its first byte: on a busy machine that can
        // take longer than a first-token timeout, which is not what this test is about.
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, timeouts: {{ first_token: 120s, total: 300s }} }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    let idle = peak_kb(gw.pid());
    let r = reqwest::Client::new()
        .post(gw.url("/v1/responses"))
        .header("x-request-id", "too-large")
        .json(&json!({"model": "a", "input": "talk", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(r).await;
    let last = events.last().cloned().unwrap_or_default();
    assert!(last.contains("response.failed"), "{last:.300}");
    assert!(last.contains("response_too_large"), "{last:.300}");
    assert!(
        events
            .iter()
            .filter(|e| e.contains("output_text.delta"))
            .count()
            <= 17,
        "{} deltas",
        events.len()
    );
    let grown_mb = peak_kb(gw.pid()).saturating_sub(idle) / 1024;
    assert!(grown_mb < 100, "peak memory grew by {grown_mb} MB");
    gw.stop();
    let rows = audit_rows(
        &gw,
        "SELECT a.error FROM attempts a WHERE a.request_id = 'too-large'",
    );
    assert!(
        rows.iter().any(|r| r[0]
            .as_str()
            .is_some_and(|e| e.contains("max_response_bytes"))),
        "{rows:?}"
    );
}

// ── The victim alone, and beside a hostile key and a store that stumbles ────────────────────

/// What the victim got from one run of its workload: each call's label, status and answer
/// text; its spend as the gateway and the store hold it; its rows in the trail.
#[derive(Debug, PartialEq)]
struct Service {
    answers: Vec<(String, u16, String)>,
    spend_store: String,
    rows: Vec<(String, i64, i64)>,
    /// The rows' costs, summed (the bill as the trail has it).
    spend_rows: f64,
}

/// The victim's workload, `rounds` times: a plain chat, a stream, a Responses conversation of
/// two turns (kept by the gateway), a priced request with `max_tokens`.
async fn victim_workload(gw: &Gw, rounds: usize) -> Vec<(String, u16, String)> {
    let client = reqwest::Client::new();
    let mut out = Vec::new();
    let started = tokio::time::Instant::now();
    for round in 0..rounds {
        // A round every 400 ms: the runs alone and beside the neighbour span the same time (and
        // the stores' faults, on their own schedule, fall within it).
        tokio::time::sleep_until(started + Duration::from_millis(400) * round as u32).await;
        let post = |path: &str, body: serde_json::Value, tag: String| {
            client
                .post(gw.url(path))
                .bearer_auth(KEY_B)
                .header("x-request-id", tag)
                .json(&body)
                .send()
        };
        let r = post(
            "/v1/chat/completions",
            json!({"model": "a", "messages": [{"role": "user", "content": "plain"}]}),
            format!("b-plain-{round}"),
        )
        .await
        .unwrap();
        let s = r.status().as_u16();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        out.push(("plain".to_string(), s, text));
        let r = post(
            "/v1/chat/completions",
            json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "stream"}]}),
            format!("b-stream-{round}"),
        )
        .await
        .unwrap();
        let s = r.status().as_u16();
        out.push(("stream".to_string(), s, stream_text(&sse_events(r).await)));
        let r = post(
            "/v1/responses",
            json!({"model": "a", "input": "first turn"}),
            format!("b-resp1-{round}"),
        )
        .await
        .unwrap();
        let s = r.status().as_u16();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        let first = v["id"].as_str().unwrap_or("").to_string();
        out.push((
            "turn1".to_string(),
            s,
            v["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        ));
        let r = post(
            "/v1/responses",
            json!({"model": "a", "input": "second turn", "previous_response_id": first}),
            format!("b-resp2-{round}"),
        )
        .await
        .unwrap();
        let s = r.status().as_u16();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        out.push((
            "turn2".to_string(),
            s,
            v["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        ));
        let r = post(
            "/v1/chat/completions",
            json!({"model": "a", "max_tokens": 20, "messages": [{"role": "user", "content": "priced"}]}),
            format!("b-priced-{round}"),
        )
        .await
        .unwrap();
        let s = r.status().as_u16();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string();
        out.push(("priced".to_string(), s, text));
    }
    out
}

/// Key A's hostile traffic until `stop`: crafted ids and conversations, NULs, 20 KB tools,
/// large turns, unknown models, GET floods.
async fn hostile_workload(gw: &Gw, stop: &std::sync::atomic::AtomicBool) -> usize {
    let client = reqwest::Client::new();
    let big = "t".repeat(20_000);
    let mut sent = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let bodies = [
            (
                "/v1/chat/completions",
                json!({"model": "x\u{0}y", "messages": [{"role": "user", "content": "n"}]}),
            ),
            (
                "/v1/chat/completions",
                json!({"model": "a", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "description": big}}]}),
            ),
            (
                "/v1/responses",
                json!({"model": "a", "conversation": "conv_x", "input": "hi"}),
            ),
            (
                "/v1/responses",
                json!({"model": "a", "input": "hi", "previous_response_id": "resp_not_mine"}),
            ),
            ("/v1/responses", json!({"model": "a", "input": big})),
            (
                "/v1/chat/completions",
                json!({"model": "no-such-model", "messages": [{"role": "user", "content": "?"}]}),
            ),
        ];
        for (path, body) in bodies {
            let _ = client
                .post(gw.url(path))
                .bearer_auth(KEY_A)
                .json(&body)
                .send()
                .await;
            sent += 1;
        }
        for _ in 0..5 {
            let _ = client
                .get(gw.url("/v1/responses/resp_0123456789"))
                .bearer_auth(KEY_A)
                .send()
                .await;
            sent += 1;
        }
    }
    sent
}

/// Rounds of the victim's workload a run: 8 s of it, at a round every 400 ms.
const ROUNDS: usize = 20;

/// One fresh stack (its own database and key prefix) on `redis` and `pg`; the victim's service
/// from a run of its workload, alone or beside key A and the stores' faults.
async fn one_run(redis: &mut Redis, pg: &Pg, name: &str, hostile: bool) -> Service {
    let up = MockUp::openai(
        "name: a\nrules:\n  - {when: {path: /v1/responses, conversation: conv_x}, status: 404, error: \"Conversation with id 'conv_x' not found.\"}\n",
    )
    .await;
    let db = pg.database(name).await;
    let prefix = format!("{name}:");
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, cost: {{ input_per_mtok: 1000, output_per_mtok: 1000 }} }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A, rpm: 20, tpm: 2000 }}
    - {{ name: victim, key: env:KEY_B, rpm: 600, tpm: 600000, budget_usd: 100 }}
responses: {{ history: keep, history_max_bytes: 1MiB }}
audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "{prefix}", timeout: 50ms }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let url = redis.url();
    let mut gw = Gw::start_with_env(
        &cfg,
        &keys_env(&[("AUTOHEDGE_REDIS_URL", &url), ("AUTOHEDGE_PG_URL", &db)]),
    );
    gw.ready().await;
    until_store_up(&gw).await;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let answers = if hostile {
        let faults = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(redis.cmd("CLIENT PAUSE 400").as_deref(), Some("+OK"));
            tokio::time::sleep(Duration::from_millis(600)).await;
            pg.ctl_stop();
            tokio::time::sleep(Duration::from_secs(3)).await;
            pg.ctl_start();
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(redis.cmd("CLIENT PAUSE 1500").as_deref(), Some("+OK"));
            tokio::time::sleep(Duration::from_millis(2000)).await;
            // Redis restarted, empty, on its port.
            let port = redis.port;
            redis.kill();
            *redis = Redis::start_on(port);
        };
        let victim = async {
            let a = victim_workload(&gw, ROUNDS).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            a
        };
        let (answers, sent, ()) = tokio::join!(victim, hostile_workload(&gw, &stop), faults);
        assert!(sent > 20, "the hostile key was busy: {sent} calls");
        // The faults were met: the store paused, went away (the restart), the trail was away.
        let st = gw.status().await;
        assert!(
            st["cluster"]["slow_answers"].as_u64().unwrap() >= 1
                && st["cluster"]["outages"].as_u64().unwrap() >= 1,
            "{}",
            st["cluster"]
        );
        answers
    } else {
        victim_workload(&gw, ROUNDS).await
    };
    // Everything written: the spool drained, the settles applied.
    let drained = eventually(Duration::from_secs(30), || async {
        let st = gw.status().await;
        st["audit"]["spooled"].as_u64().unwrap_or(0) == 0
            && st["audit"]["state"] == "ok"
            && st["cluster"]["settles_queued"] == 0
            && redis
                .value(&format!("GET {prefix}resvtot:victim"))
                .and_then(|v| v.parse::<f64>().ok())
                .is_none_or(|v| v.abs() < 1e-9)
    })
    .await;
    assert!(drained, "{}", gw.status().await);
    gw.stop();
    let spend_store = redis
        .value(&format!("HGET {prefix}spend:victim:{} usd", month_now()))
        .unwrap_or_default();
    let c = pg.client(name).await;
    let rows = c
        .query(
            "SELECT operation, status, COUNT(*) FROM requests WHERE client_key = 'victim' GROUP BY operation, status ORDER BY operation, status",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let spend_rows: f64 = c
        .query_one(
            "SELECT COALESCE(SUM(cost_usd), 0) FROM requests WHERE client_key = 'victim'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    Service {
        answers,
        spend_store,
        rows,
        spend_rows,
    }
}

/// The rule, whole: the victim's statuses, answers, spend (in the store) and audit rows are
/// the same alone and beside a hostile key A (NULs, 20 KB tools, crafted conversations, large
/// turns, unknown models, GET floods) while Redis pauses for 400 ms, PostgreSQL is stopped for
/// 3 s, Redis pauses for 1.5 s and is restarted empty. Each part of A's traffic is a case above that failed on the code before #45.
#[tokio::test]
async fn the_victims_service_bill_and_records_are_the_same_beside_a_hostile_neighbour() {
    let mut redis = Redis::start();
    let pg = Pg::start();
    let alone = one_run(&mut redis, &pg, "alone", false).await;
    assert!(
        alone
            .answers
            .iter()
            .all(|(_, s, t)| *s == 200 && !t.is_empty()),
        "{alone:?}"
    );
    assert!(!alone.spend_store.is_empty());
    let beside = one_run(&mut redis, &pg, "beside", true).await;
    assert_eq!(alone.answers, beside.answers);
    assert_eq!(alone.rows, beside.rows);
    let (a, b): (f64, f64) = (
        alone.spend_store.parse().unwrap(),
        beside.spend_store.parse().unwrap(),
    );
    assert!(
        (alone.spend_rows - beside.spend_rows).abs() < 1e-9,
        "{alone:?} {beside:?}"
    );
    assert!(
        (a - alone.spend_rows).abs() < 1e-9,
        "store {a}, rows {}",
        alone.spend_rows
    );
    assert!((a - b).abs() < 1e-9, "spend alone {a}, beside {b}");
}

/// #45 item 4: a continued conversation counts what the upstream reads again. At `tpm: 3000`
/// a first turn of 8 KB (about 2,000 tokens) passes; a short call after it passes too; the
/// same short call continuing the first turn is refused: the upstream would read the 8 KB
/// again. (Before: only the new input was counted.)
#[tokio::test]
async fn a_continued_conversation_counts_what_the_upstream_reads_again() {
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A, tpm: 3000 }}
responses: {{ history: keep }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let (s, first, v) = respond(&gw, KEY_A, "word ".repeat(1600), None).await;
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = respond(&gw, KEY_A, "short".into(), None).await;
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = respond(&gw, KEY_A, "short".into(), Some(first)).await;
    assert_eq!(s, 429, "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
}

/// A 429 about one request's size cools no endpoint for the others. Key A's request gets
/// OpenAI's "Request too large … on tokens per min" from endpoint `a` and goes on to `b`; key
/// B's next request is still served by `a`. (Before: A's 429 cooled `a` for every key.)
/// Route `chat: [a, b]` over two mocks, the hostile and the victim keys, and `extra`.
fn chat_of_two(a: &MockUp, b: &MockUp, extra: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  b: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
routes:
  chat: [a, b]
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
{extra}"#,
        a.base(),
        b.base()
    )
}

#[tokio::test]
async fn a_429_about_one_requests_size_cools_no_endpoint() {
    let a = MockUp::openai(
        "name: a\nrules: [{times: 1, status: 429, headers: {retry-after: \"30\"}, error: \"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 50000. The input or output tokens must be reduced in order to run successfully.\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = chat_of_two(&a, &b, "health: { probe_interval: 1h }\n");
    let gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(KEY_A)
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "big"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1, "A's request met a's 429");
    let st = gw.status().await;
    assert!(
        st["endpoints"]["a"]["cooldown_remaining_ms"]
            .as_u64()
            .unwrap_or(0)
            == 0,
        "{}",
        st["endpoints"]["a"]
    );
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(KEY_B)
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
}

/// A chat as `key` with `messages`, for the poison tests.
async fn say(gw: &Gw, key: &str, model: &str, messages: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": messages}))
        .send()
        .await
        .unwrap()
}

fn chat_calls_of(stats: &serde_json::Value) -> u64 {
    stats["by_path"]["/v1/chat/completions"]
        .as_u64()
        .unwrap_or(0)
}

/// Key A aims prompts every replica fails on (a 500 for any body holding `POISON`) at the
/// replica that keeps key B's conversation — the same leading messages, so the same replica.
/// A's failures are A's: no replica is ejected, B's conversation stays where it is and every
/// turn of B's is served there. Only when a second key (B itself) meets the same failures is the
/// replica judged bad and ejected (the rule still ejects — it only asks for two witnesses).
#[tokio::test]
async fn one_keys_poison_prompts_eject_no_replica_and_move_no_conversation() {
    let poison =
        "name: {}\nrules: [{when: {contains: POISON}, status: 500, error: \"engine crashed\"}]";
    let r = [
        MockUp::openai(&poison.replace("{}", "r0")).await,
        MockUp::openai(&poison.replace("{}", "r1")).await,
        MockUp::openai(&poison.replace("{}", "r2")).await,
    ];
    let cfg = format!(
        r#"models:
  m: {{ type: openai, base_urls: ["{}", "{}", "{}"] }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
health: {{ probe_interval: 1h, eject_after: 2, eject_base: 1h, eject_max: 1h }}
"#,
        r[0].base(),
        r[1].base(),
        r[2].base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let mut convo = json!([
        {"role": "system", "content": "You are the victim's agent."},
        {"role": "user", "content": "Plan the victim's trip."}
    ]);
    let calls = || async {
        let mut out = Vec::new();
        for m in &r {
            out.push(chat_calls_of(&m.stats().await));
        }
        out
    };
    // B's conversation finds its replica.
    let before = calls().await;
    assert_eq!(say(&gw, KEY_B, "m", &convo).await.status(), 200);
    let after = calls().await;
    let home = (0..3).find(|i| after[*i] > before[*i]).unwrap();
    // A: the same leading messages, then poison — aimed at B's replica, 12 times.
    let mut aimed = convo.clone();
    aimed.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Sure."}),
        json!({"role": "user", "content": "POISON"}),
    ]);
    let before = calls().await;
    for _ in 0..12 {
        let s = say(&gw, KEY_A, "m", &aimed).await.status().as_u16();
        assert!(s >= 500, "every replica fails the poison: {s}");
    }
    let after = calls().await;
    assert!(
        after[home] - before[home] >= 12,
        "the poison reached B's replica each time: {before:?} → {after:?}"
    );
    // Nothing ejected, nothing moved: B's turns all served at its replica.
    let st = gw.status().await;
    for a in st["endpoints"]["m"]["addresses"].as_array().unwrap() {
        assert_eq!(a["state"], "active", "{a}");
    }
    assert_eq!(
        st["endpoints"]["m"]["state"], "healthy",
        "{}",
        st["endpoints"]["m"]
    );
    for turn in 0..4 {
        convo.as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": "Sure."}),
            json!({"role": "user", "content": format!("And then {turn}?")}),
        ]);
        let before = calls().await;
        assert_eq!(say(&gw, KEY_B, "m", &convo).await.status(), 200);
        let after = calls().await;
        assert_eq!(
            after[home] - before[home],
            1,
            "turn {turn} served at B's replica {home}: {before:?} → {after:?}"
        );
    }
    // A's failure, then a second key meeting the same: now the replica is judged bad.
    say(&gw, KEY_A, "m", &aimed).await;
    let mut b_poison = convo.clone();
    b_poison
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "POISON again"}));
    say(&gw, KEY_B, "m", &b_poison).await;
    let st = gw.status().await;
    let ejected = st["endpoints"]["m"]["addresses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["state"] == "ejected")
        .count();
    assert!(
        ejected >= 1,
        "two keys' failures eject: {}",
        st["endpoints"]["m"]
    );
    gw.stop();
}

/// Key A's poison prompts fail at the route's first endpoint (and are served by its second):
/// the first endpoint is neither ejected nor demoted for key B, whose requests all stay there.
/// When B meets the failure too, the endpoint is ejected as ever.
#[tokio::test]
async fn one_keys_poison_prompts_neither_eject_nor_demote_an_endpoint() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {contains: POISON}, status: 500, error: \"engine crashed\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = chat_of_two(
        &a,
        &b,
        "health: { probe_interval: 1h, eject_after: 2, eject_base: 1h, eject_max: 1h }\nrouting_policy: { min_samples: 5 }\n",
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let poison = json!([{"role": "user", "content": "POISON"}]);
    for _ in 0..10 {
        let r = say(&gw, KEY_A, "chat", &poison).await;
        assert_eq!(r.status(), 200, "A's request failed over");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    }
    assert!(chat_calls_of(&a.stats().await) >= 10, "each met a's 500");
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["a"]["state"], "healthy",
        "{}",
        st["endpoints"]["a"]
    );
    assert_eq!(
        st["endpoints"]["a"]["success_rate"], 0.0,
        "/status shows a's failures: {}",
        st["endpoints"]["a"]
    );
    for i in 0..6 {
        let r = say(
            &gw,
            KEY_B,
            "chat",
            &json!([{"role": "user", "content": format!("hi {i}")}]),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            header(&r, "x-autohedge-endpoint"),
            "a",
            "B's request {i} stays first"
        );
    }
    // A's poison then B's: two keys' failures in a row eject the endpoint.
    say(&gw, KEY_A, "chat", &poison).await;
    say(&gw, KEY_B, "chat", &poison).await;
    let r = say(
        &gw,
        KEY_B,
        "chat",
        &json!([{"role": "user", "content": "after"}]),
    )
    .await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "b",
        "a ejected: {}",
        gw.status().await["endpoints"]["a"]
    );
    gw.stop();
}

/// Key A floods poison prompts at the route's first endpoint; then key B meets one failure of
/// its own there. A's twenty failures weigh no more than B's one (two count: under
/// `eject_after: 5`), so the endpoint stays in; once B has met three, six count and it is
/// ejected as ever.
#[tokio::test]
async fn one_keys_flood_weighs_no_more_than_the_other_keys_failures() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {contains: POISON}, status: 500, error: \"engine crashed\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = chat_of_two(
        &a,
        &b,
        "health: { probe_interval: 1h, eject_after: 5, eject_base: 1h, eject_max: 1h }\n",
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let poison = json!([{"role": "user", "content": "POISON"}]);
    for _ in 0..20 {
        let r = say(&gw, KEY_A, "chat", &poison).await;
        assert_eq!(r.status(), 200, "A's request failed over");
    }
    let r = say(&gw, KEY_B, "chat", &poison).await;
    assert_eq!(r.status(), 200, "B's request failed over");
    assert!(chat_calls_of(&a.stats().await) >= 21, "each met a's 500");
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["a"]["state"], "healthy",
        "21 failures in a row, 20 of one key: {}",
        st["endpoints"]["a"]
    );
    for _ in 0..2 {
        say(&gw, KEY_B, "chat", &poison).await;
    }
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["a"]["state"], "ejected",
        "three of B's failures let three of A's count: {}",
        st["endpoints"]["a"]
    );
    gw.stop();
}

/// Key A's easy requests, answered at the route's first endpoint, outnumber eight to one the
/// requests of keys B and C, which that endpoint fails (and the second serves). Everyone's
/// success rate there stays above `success_threshold` (what `/status` shows); routing reads B's
/// and C's outcomes as they are and puts the endpoint behind its fallback, so their requests stop
/// meeting its failures first. One key's answers, however many, hide nothing from the others.
#[tokio::test]
async fn one_keys_answers_keep_no_endpoint_failing_the_others_ahead() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {contains: HARD}, status: 500, error: \"engine crashed\"}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    // A third key, beside the hostile (here: busy) and the victim keys.
    let cfg = chat_of_two(
        &a,
        &b,
        "    - { name: third, key: env:KEY_C }\nhealth: { probe_interval: 1h, eject_after: 1000 }\nrouting_policy: { min_samples: 5 }\n",
    );
    const KEY_C: &str = "sk-third-0123456789";
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[("KEY_C", KEY_C)]));
    gw.ready().await;
    let easy = json!([{"role": "user", "content": "hello"}]);
    let hard = json!([{"role": "user", "content": "HARD question"}]);
    let busy = |n: usize| {
        let (gw, easy) = (&gw, &easy);
        async move {
            for _ in 0..n {
                let r = say(gw, KEY_A, "chat", easy).await;
                assert_eq!(r.status(), 200);
                assert_eq!(header(&r, "x-autohedge-endpoint"), "a", "A's served at a");
            }
        }
    };
    busy(16).await;
    // Three failures of two other keys (too few to judge before the third), A's answers
    // between them.
    for (i, key) in [KEY_B, KEY_C, KEY_B].into_iter().enumerate() {
        let before = chat_calls_of(&a.stats().await);
        let r = say(&gw, key, "chat", &hard).await;
        assert_eq!(r.status(), 200, "failed over");
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
        assert_eq!(
            chat_calls_of(&a.stats().await),
            before + 1,
            "the request met a's failure first"
        );
        if i < 2 {
            busy(8).await;
        }
    }
    let st = gw.status().await;
    let everyone = st["endpoints"]["a"]["success_rate"].as_f64().unwrap();
    assert!(
        everyone > 0.85,
        "A's answers keep everyone's rate above the threshold: {}",
        st["endpoints"]["a"]
    );
    assert_eq!(
        st["endpoints"]["a"]["state"], "degraded",
        "routing's rate, the others' outcomes: {}",
        st["endpoints"]["a"]
    );
    // B's and C's next requests go to b first: a is not called.
    for key in [KEY_B, KEY_C] {
        let before = chat_calls_of(&a.stats().await);
        let r = say(&gw, key, "chat", &hard).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
        assert_eq!(
            chat_calls_of(&a.stats().await),
            before,
            "a is behind its fallback for the others: {}",
            gw.status().await["endpoints"]["a"]
        );
    }
    gw.stop();
}

/// Key A sends long prompts in varied scripts, many at once, each counted on the counting
/// threads (the gateway's shared CPU for long counts); key B's short requests, counted on the
/// request path, are all answered while A's are still being counted — the counting of one key's
/// long prompts never holds another key's small requests.
#[tokio::test]
async fn one_keys_long_counts_hold_no_other_keys_short_requests() {
    let up = MockUp::openai("name: up").await;
    // Text in varied scripts (counted by tiktoken-rs on the counting threads), its bytes over
    // the window (so it is counted, not bounded) and its tokens under it (so it is served).
    let varied: String = (0..80_000u32)
        .map(|i| char::from_u32(0x400 + (i * 7919) % 0x2C00).unwrap_or('x'))
        .collect();
    let tokens = autohedge::tokens::reference_count(autohedge::tokens::Family::O200k, &varied);
    let window = (varied.len() as u64 + tokens) / 2;
    assert!(
        tokens + 100 < window && window < varied.len() as u64,
        "{tokens} {window}"
    );
    let cfg = format!(
        r#"models:
  m: {{ type: openai, base_url: "{}", model: gpt-4o-mini, context_window: {window} }}
auth:
  keys:
    - {{ name: hostile, key: env:KEY_A }}
    - {{ name: victim, key: env:KEY_B }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start_with_env(&cfg, &keys_env(&[]));
    gw.ready().await;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut hostile = Vec::new();
    for i in 0..4 {
        let (url, body, done) = (
            gw.url("/v1/chat/completions"),
            json!({"model": "m", "messages": [{"role": "user", "content": format!("{i}{varied}")}]}),
            done.clone(),
        );
        hostile.push(tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(url)
                .bearer_auth(KEY_A)
                .json(&body)
                .send()
                .await
                .unwrap();
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            r.status().as_u16()
        }));
    }
    // B's short requests, while A's counts run.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for i in 0..10 {
        let (s, _) = chat_as(&gw, KEY_B, format!("victim-{i}"), "m").await;
        assert_eq!(s, 200);
    }
    let finished_before_b = done.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("B's 10 requests answered with {finished_before_b} of A's 4 long prompts done");
    let statuses: Vec<u16> = futures_util::future::join_all(hostile)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        statuses.iter().all(|s| *s == 200),
        "A's long prompts were counted and served: {statuses:?}"
    );
    assert!(
        finished_before_b < 4,
        "B's requests were answered while A's counts still ran ({finished_before_b} of 4 done)"
    );
    gw.stop();
    let counted = audit_rows(
        &gw,
        "SELECT COUNT(*) FROM requests WHERE client_key = 'hostile' AND prompt_tokens_counted > 50000",
    );
    assert_eq!(
        counted,
        vec![vec![json!(4)]],
        "A's prompts were counted exactly"
    );
}
