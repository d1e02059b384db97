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
