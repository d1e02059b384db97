//! `audit.store: postgres` against a real PostgreSQL 15 (Debian's `postgresql` package): a
//! cluster of our own made with `initdb` in a temporary directory (as the `postgres` user when
//! the tests run as root), on a free loopback port, `fsync` off. Several gateway processes write
//! one trail; `stats` and `report` read it as they read SQLite; the store stopped mid-run never
//! stops serving; a budget outlives every replica.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::pg_server::Pg;
use common::*;
use serde_json::{Value, json};

fn pg_config(upstream: &MockUp, extra: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, cost: {{ input_per_mtok: 1000, output_per_mtok: 1000 }} }}
audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}
health: {{ probe_interval: 1h }}
{extra}"#,
        upstream.base()
    )
}

fn start(cfg: &str, url: &str, env: &[(&str, &str)]) -> Gw {
    let mut all = vec![("AUTOHEDGE_PG_URL", url)];
    all.extend_from_slice(env);
    Gw::start_with_env(cfg, &all)
}

async fn count(c: &tokio_postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

/// Migrations from an empty database, from the version before the last, and by three replicas
/// starting at once (the advisory lock: all start, the schema is applied once).
#[tokio::test]
async fn migrations_from_empty_from_the_previous_version_and_at_once() {
    let pg = Pg::start();
    let up = MockUp::openai("name: a").await;
    let cfg = pg_config(&up, "");
    let versions = autohedge::store::pg::VERSIONS as i64;
    // Empty.
    let empty = pg.database("empty").await;
    let mut gw = start(&cfg, &empty, &[]);
    gw.ready().await;
    assert_eq!(autohedge::store::pg::version(&empty).unwrap(), versions);
    // The version before: the last migration's table appears, and rows are written after it.
    let older = pg.database("older").await;
    assert_eq!(
        autohedge::store::pg::migrate_to(&older, versions as usize - 1).unwrap(),
        versions as usize - 1
    );
    let c = pg.client("older").await;
    const HAS_COLUMN: &str =
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 'audit_batches'";
    assert_eq!(count(&c, HAS_COLUMN).await, 0);
    let mut old_gw = start(&cfg, &older, &[]);
    old_gw.ready().await;
    assert_eq!(autohedge::store::pg::version(&older).unwrap(), versions);
    assert_eq!(count(&c, HAS_COLUMN).await, 1);
    let r = old_gw
        .post("/v1/responses", json!({"model": "a", "input": "hi"}))
        .await;
    assert_eq!(r.status(), 200);
    old_gw.stop();
    let ids: i64 = count(
        &c,
        "SELECT COUNT(*) FROM requests WHERE response_id LIKE 'resp_%'",
    )
    .await;
    assert_eq!(ids, 1, "a row written after the upgrade");
    // Three at once on an empty database.
    let together = pg.database("together").await;
    let mut gws: Vec<Gw> = (0..3).map(|_| start(&cfg, &together, &[])).collect();
    for g in &gws {
        g.ready().await;
        assert_eq!(g.status().await["audit"]["state"], "ok", "{}", g.log());
    }
    assert_eq!(autohedge::store::pg::version(&together).unwrap(), versions);
    for g in gws.iter_mut() {
        g.stop();
    }
    gw.stop();
}

/// Three gateway processes writing one database under load: one row per request, with the ids
/// the clients got, and each request's attempts under its own row.
#[tokio::test]
async fn three_gateways_write_one_row_per_request() {
    let pg = Pg::start();
    let url = pg.database("fleet").await;
    let up = MockUp::openai("name: a\nrules: [{when: {every: 5}, status: 503}]").await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}" }}
  b: {{ type: openai, base_url: "{}" }}
routes:
  r: [a, b]
audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}
health: {{ probe_interval: 1h }}
"#,
        up.base(),
        b.base()
    );
    let mut gws: Vec<Gw> = (0..3).map(|_| start(&cfg, &url, &[])).collect();
    for g in &gws {
        g.ready().await;
    }
    let client = reqwest::Client::new();
    let mut sent = Vec::new();
    let sends = (0..300).map(|i| {
        let id = format!("fleet-{i:03}");
        sent.push(id.clone());
        let req = client
            .post(gws[i % 3].url("/v1/chat/completions"))
            .header("x-request-id", id)
            .json(&json!({"model": "r", "stream": i % 2 == 0, "messages": [{"role": "user", "content": "x"}]}));
        async move {
            let r = req.send().await.unwrap();
            let s = r.status().as_u16();
            let id = header(&r, "x-request-id");
            let _ = r.text().await;
            (s, id)
        }
    });
    let got = futures_util::future::join_all(sends).await;
    assert!(got.iter().all(|(s, _)| *s == 200), "{got:?}");
    let mut answered: Vec<String> = got.into_iter().map(|(_, id)| id).collect();
    answered.sort();
    sent.sort();
    assert_eq!(answered, sent);
    for g in gws.iter_mut() {
        g.stop();
    }
    let c = pg.client("fleet").await;
    let mut rows: Vec<String> = c
        .query("SELECT request_id FROM requests ORDER BY request_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    rows.sort();
    assert_eq!(
        rows, sent,
        "exactly one row per request, with the client's id"
    );
    let failovers = count(
        &c,
        "SELECT COUNT(*) FROM attempts WHERE class = 'server_error'",
    )
    .await;
    assert!(failovers >= 50, "{failovers}");
    let orphans = count(
        &c,
        "SELECT COUNT(*) FROM attempts a JOIN requests r ON r.id = a.request_row WHERE a.request_id <> r.request_id",
    )
    .await;
    assert_eq!(orphans, 0, "every attempt under its own request's row");
}

fn cli(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_autohedge"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The same traffic read from SQLite and from PostgreSQL gives the same `stats` (per endpoint
/// and per key, as JSON, field by field) and the same `report`: a SQLite trail exported and
/// imported into PostgreSQL, as an operator moving over does.
#[tokio::test]
async fn stats_and_report_read_the_same_from_either_store() {
    let pg = Pg::start();
    let url = pg.database("moved").await;
    let a = MockUp::openai(
        "name: a\nrules: [{when: {every: 3}, status: 503}, {when: {every: 7}, status: 429}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", cost: {{ input_per_mtok: 1000, output_per_mtok: 1000 }} }}
  b: {{ type: openai, base_url: "{}" }}
routes:
  r: [a, b]
auth:
  keys:
    - {{ name: team, key: env:TEAM_KEY }}
    - {{ name: other, key: env:OTHER_KEY }}
health: {{ probe_interval: 1h }}
"#,
        a.base(),
        b.base()
    );
    let env = [
        ("TEAM_KEY", "sk-team-000001"),
        ("OTHER_KEY", "sk-other-00002"),
    ];
    let mut gw = Gw::start_with_env(&cfg, &env);
    gw.ready().await;
    let c = reqwest::Client::new();
    for i in 0..60 {
        let key = if i % 3 == 0 { env[1].1 } else { env[0].1 };
        let model = if i % 10 == 9 { "missing" } else { "r" };
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(&json!({"model": model, "stream": i % 4 == 0, "messages": [{"role": "user", "content": "hello there"}]}))
            .send()
            .await
            .unwrap();
        let _ = r.text().await;
    }
    gw.stop();
    let data = gw.data_dir();
    let data = data.to_str().unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    let file = file.path().to_str().unwrap();
    let (ok, _, err) = cli(
        &[
            "audit",
            "export",
            "--since",
            "1h",
            "--data-dir",
            data,
            "--out",
            file,
        ],
        &[],
    );
    assert!(ok, "{err}");
    let pg_cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        pg_cfg.path(),
        format!("{cfg}audit: {{ store: postgres, url: env:AUTOHEDGE_PG_URL }}\n"),
    )
    .unwrap();
    let pg_cfg = pg_cfg.path().to_str().unwrap();
    let mut pg_env = env.to_vec();
    pg_env.push(("AUTOHEDGE_PG_URL", &url));
    let (ok, _, err) = cli(&["audit", "import", file, "--config", pg_cfg], &pg_env);
    assert!(ok, "{err}");
    assert!(err.contains("0 refused, 0 not written"), "{err}");
    let pgc = pg.client("moved").await;
    assert_eq!(count(&pgc, "SELECT COUNT(*) FROM requests").await, 60);
    for args in [
        vec!["stats", "--since", "1h", "--json"],
        vec!["stats", "--since", "1h", "--json", "--by-key"],
        vec!["report", "--since", "1h"],
    ] {
        let mut from_sqlite = args.clone();
        from_sqlite.extend(["--data-dir", data]);
        let mut from_pg = args.clone();
        from_pg.extend(["--config", pg_cfg]);
        let (ok1, a, e1) = cli(&from_sqlite, &env);
        let (ok2, b, e2) = cli(&from_pg, &pg_env);
        assert!(ok1 && ok2, "{args:?}: {e1} {e2}");
        if args[0] == "stats" {
            let (a, b): (Value, Value) = (
                serde_json::from_str(&a).unwrap(),
                serde_json::from_str(&b).unwrap(),
            );
            assert!(a.as_array().is_some_and(|x| !x.is_empty()), "{a}");
            assert_eq!(a, b, "{args:?}");
        } else {
            // The report names where it read from; the rest is the same, line for line.
            let strip = |t: &str| -> Vec<String> {
                t.lines()
                    .filter(|l| !l.contains("autohedge.db") && !l.contains("Generated"))
                    .map(str::to_string)
                    .collect()
            };
            assert!(a.contains("failover") || a.contains("Failover"), "{a}");
            assert_eq!(strip(&a), strip(&b));
        }
    }
}

/// PostgreSQL stopped in the middle of a run: every request is still served, `/health` says
/// `degraded`, its records wait in the spool (none dropped), and once it is back the spool is
/// written, once and in order, before what came after.
#[tokio::test]
async fn the_store_stopped_mid_run_never_stops_serving_nor_loses_a_row() {
    let pg = Pg::start();
    let url = pg.database("flaky").await;
    let up = MockUp::openai("name: a").await;
    let mut gw = start(&pg_config(&up, ""), &url, &[]);
    gw.ready().await;
    let c = pg.client("flaky").await;
    let send = |n: usize, tag: &'static str| {
        let gw = &gw;
        async move {
            for i in 0..n {
                let r = gw
                    .chat_id(
                        &format!("{tag}-{i}"),
                        json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
                    )
                    .await;
                assert_eq!(r.status(), 200, "{tag}-{i}");
            }
        }
    };
    send(10, "before").await;
    let ok = eventually(Duration::from_secs(5), || async {
        pg.client("flaky")
            .await
            .query_one("SELECT COUNT(*) FROM requests", &[])
            .await
            .map(|r| r.get::<_, i64>(0))
            .unwrap_or(0)
            == 10
    })
    .await;
    assert!(ok, "written while up");
    drop(c);
    pg.ctl_stop();
    let t0 = Instant::now();
    send(20, "during").await;
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let ok = eventually(Duration::from_secs(10), || async {
        let h: Value = reqwest::get(gw.url("/health"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        h["status"] == "degraded"
    })
    .await;
    assert!(ok, "health degraded while the store is away");
    let status = gw.status().await;
    assert!(
        status["audit"]["state"]
            .as_str()
            .unwrap()
            .contains("postgres unreachable"),
        "{}",
        status["audit"]
    );
    // Nothing is lost while the store is away: the records wait in the spool.
    let spooled = eventually(Duration::from_secs(10), || async {
        gw.status().await["audit"]["spooled"].as_u64().unwrap_or(0) >= 20
    })
    .await;
    let status = gw.status().await;
    assert!(spooled, "20 requests spooled: {}", status["audit"]);
    assert_eq!(status["audit"]["dropped"], 0, "{}", status["audit"]);
    assert!(gw.data_dir().join("audit-spool.jsonl").exists());
    assert!(
        !status["audit"]["state"]
            .as_str()
            .unwrap()
            .contains("postgres://postgres@"),
        "no URL"
    );
    pg.ctl_start();
    let ok = eventually(Duration::from_secs(20), || async {
        let h: Value = reqwest::get(gw.url("/health"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        h["status"] == "ok"
    })
    .await;
    assert!(ok, "health back to ok: {}", gw.status().await["audit"]);
    send(10, "after").await;
    gw.stop();
    let c = pg.client("flaky").await;
    let after = count(
        &c,
        "SELECT COUNT(*) FROM requests WHERE request_id LIKE 'after-%'",
    )
    .await;
    assert_eq!(after, 10, "writing resumed");
    // The spool was written once, in order, and removed.
    let during = count(
        &c,
        "SELECT COUNT(*) FROM requests WHERE request_id LIKE 'during-%'",
    )
    .await;
    assert_eq!(during, 20, "every request of the outage has its row, once");
    let first_after: i64 = count(
        &c,
        "SELECT MIN(id) FROM requests WHERE request_id LIKE 'after-%'",
    )
    .await;
    let last_during: i64 = count(
        &c,
        "SELECT MAX(id) FROM requests WHERE request_id LIKE 'during-%'",
    )
    .await;
    assert!(last_during < first_after, "in order");
    assert!(!gw.data_dir().join("audit-spool.jsonl").exists());
    let before = count(
        &c,
        "SELECT COUNT(*) FROM requests WHERE request_id LIKE 'before-%'",
    )
    .await;
    assert_eq!(before, 10);
}

/// A client key's monthly budget outlives a restart of every replica: the spend is read back
/// from PostgreSQL at start, and the key is refused there, not given a fresh month.
#[tokio::test]
async fn a_budget_survives_a_restart_of_every_replica() {
    let pg = Pg::start();
    let url = pg.database("budget").await;
    let up = MockUp::openai("name: a").await;
    let cfg = pg_config(
        &up,
        "auth:\n  keys:\n    - { name: team, key: env:TEAM_KEY, budget_usd: 0.05 }\n",
    );
    let env = [("TEAM_KEY", "sk-team-budget-01")];
    let spend = |gws: &[Gw]| {
        let c = reqwest::Client::new();
        let urls: Vec<String> = gws.iter().map(|g| g.url("/v1/chat/completions")).collect();
        async move {
            let mut statuses = Vec::new();
            for i in 0..40 {
                let r = c
                    .post(&urls[i % urls.len()])
                    .bearer_auth("sk-team-budget-01")
                    .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hello there friend"}]}))
                    .send()
                    .await
                    .unwrap();
                statuses.push(r.status().as_u16());
            }
            statuses
        }
    };
    let mut gws: Vec<Gw> = (0..2).map(|_| start(&cfg, &url, &env)).collect();
    for g in &gws {
        g.ready().await;
    }
    let first = spend(&gws).await;
    assert!(first.contains(&200), "{first:?}");
    assert!(first.contains(&429), "the budget was spent: {first:?}");
    for g in gws.iter_mut() {
        g.stop();
    }
    let c = pg.client("budget").await;
    let usd: f64 = c
        .query_one("SELECT usd FROM client_spend WHERE client = 'team'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(usd >= 0.05 * 0.5, "{usd}");
    // Every replica restarted: the month's spend comes back from the store.
    let mut gws: Vec<Gw> = (0..2).map(|_| start(&cfg, &url, &env)).collect();
    for g in &gws {
        g.ready().await;
    }
    let again = spend(&gws).await;
    let served_again = again.iter().filter(|s| **s == 200).count();
    let served_first = first.iter().filter(|s| **s == 200).count();
    assert!(
        served_again < served_first,
        "a fresh budget after the restart: {again:?} vs {first:?}"
    );
    for g in gws.iter_mut() {
        g.stop();
    }
}

/// The retention sweep runs against PostgreSQL too: rows older than `server.audit_retention`
/// go (at start, then hourly), with their attempts and old events; newer ones stay.
#[tokio::test]
async fn the_retention_sweep_deletes_old_rows_in_postgres() {
    let pg = Pg::start();
    let url = pg.database("sweep").await;
    autohedge::store::pg::migrate_to(&url, autohedge::store::pg::VERSIONS).unwrap();
    let c = pg.client("sweep").await;
    let old = 1_000_000i64; // 1970: far past any retention
    c.batch_execute(&format!(
        "INSERT INTO requests (request_id, ts_ms, operation, status, latency_ms) VALUES ('old', {old}, 'chat', 200, 1.0);
         INSERT INTO attempts (request_row, request_id, seq, ts_ms, endpoint, class, latency_ms) SELECT id, 'old', 1, {old}, 'a', 'ok', 1.0 FROM requests;
         INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES ({old}, 'a', 'cooldown', 'old');"
    ))
    .await
    .unwrap();
    let up = MockUp::openai("name: a").await;
    let mut gw = start(
        &pg_config(&up, "server: { audit_retention: 1d }"),
        &url,
        &[],
    );
    gw.ready().await;
    let r = gw
        .chat_id(
            "new",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let ok = eventually(Duration::from_secs(10), || async {
        count(
            &pg.client("sweep").await,
            "SELECT COUNT(*) FROM requests WHERE request_id = 'old'",
        )
        .await
            == 0
    })
    .await;
    gw.stop();
    assert!(ok, "the old row was swept");
    let c = pg.client("sweep").await;
    assert_eq!(
        count(&c, "SELECT COUNT(*) FROM attempts WHERE request_id = 'old'").await,
        0
    );
    assert_eq!(
        count(
            &c,
            "SELECT COUNT(*) FROM endpoint_events WHERE reason = 'old'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&c, "SELECT COUNT(*) FROM requests WHERE request_id = 'new'").await,
        1
    );
}

/// A write that timed out may still have committed: the batch sent again (from the spool,
/// under the token it was first sent with) is written once. A deferred trigger of the store's
/// own holds one commit for 11 s, past the writer's 10 s: the writer counts the store away and
/// holds the batch; the commit lands meanwhile; every request of the batch has one row, not two.
#[tokio::test]
async fn a_batch_whose_commit_answer_was_lost_is_written_once() {
    let pg = Pg::start();
    let url = pg.database("doubt").await;
    let up = MockUp::openai("name: a").await;
    let mut gw = start(&pg_config(&up, ""), &url, &[]);
    gw.ready().await;
    let c = pg.client("doubt").await;
    c.batch_execute(
        "CREATE TABLE slept (once INT);
         CREATE FUNCTION slow_commit() RETURNS trigger AS $$
         BEGIN
           IF NEW.request_id = 'doubt-0' AND NOT EXISTS (SELECT 1 FROM slept) THEN
             INSERT INTO slept VALUES (1);
             PERFORM pg_sleep(11);
           END IF;
           RETURN NULL;
         END $$ LANGUAGE plpgsql;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON requests
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .await
    .unwrap();
    for i in 0..5 {
        let r = gw
            .chat_id(
                &format!("doubt-{i}"),
                json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    // The writer gave up on the commit's answer ...
    let doubted = eventually(Duration::from_secs(20), || async {
        gw.status().await["audit"]["state"]
            .as_str()
            .is_some_and(|s| s.contains("no answer within 10s"))
    })
    .await;
    assert!(doubted, "{}", gw.status().await["audit"]);
    // ... and once the store answers again, what it held is written (or known written).
    let settled = eventually(Duration::from_secs(30), || async {
        let a = gw.status().await["audit"].clone();
        a["state"] == "ok" && a["spooled"] == 0
    })
    .await;
    assert!(settled, "{}", gw.status().await["audit"]);
    gw.stop();
    let rows: Vec<(String, i64)> = c
        .query(
            "SELECT request_id, COUNT(*) FROM requests WHERE request_id LIKE 'doubt-%' GROUP BY request_id ORDER BY request_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let want: Vec<(String, i64)> = (0..5).map(|i| (format!("doubt-{i}"), 1)).collect();
    assert_eq!(rows, want);
}
