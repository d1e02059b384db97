//! `autohedge report` on a large trail: 1,000,000 requests (and their ~1.15M attempts, events)
//! spread over 24 h in a real SQLite file written with the gateway's own schema, then the report
//! built from it as the CLI does (read-only connection, Markdown and HTML). Goal: under 5 s.
//!
//! Run: `cargo bench --bench report` (`REPORT_ROWS=N` for another size).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::params;

/// One synthetic request: the endpoint that served, status, error class, and its attempts
/// (endpoint, class, status).
type Shape = (
    Option<&'static str>,
    i64,
    Option<&'static str>,
    Vec<(&'static str, &'static str, Option<i64>)>,
);

fn main() {
    // Without `--bench` (`cargo test --benches`, as CI does): a smoke run on a small trail, its
    // checks (every row read, the last hour read from its mark) kept, its time judged by no one.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let rows: u64 = std::env::var("REPORT_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke { 20_000 } else { 1_000_000 });
    let dir = tempfile::tempdir().expect("temp dir");
    let db = autohedge::store::db_path(dir.path());
    let now = SystemTime::now();
    let day_ms = 86_400_000i64;
    let now_ms = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let t = Instant::now();
    {
        let mut conn = autohedge::store::open_connection(&db).expect("open");
        let tx = conn.transaction().expect("tx");
        {
            let mut req = tx
                .prepare("INSERT INTO requests (request_id, ts_ms, operation, requested_model, endpoint, status, error_class, stream, latency_ms, ttft_ms, tokens_in, tokens_out, attempts) VALUES (?1, ?2, 'chat', 'chat', ?3, ?4, ?5, 0, ?6, NULL, 20, 30, ?7)")
                .expect("prepare");
            let mut att = tx
                .prepare("INSERT INTO attempt_rows (request_row, request_id, seq, ts_ms, endpoint, class, status, error, latency_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)")
                .expect("prepare");
            let mut ev = tx
                .prepare("INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES (?1, ?2, ?3, ?4)")
                .expect("prepare");
            let mut rng = fastrand::Rng::with_seed(7);
            for i in 0..rows {
                let ts = now_ms - day_ms + (i as i64 * day_ms / rows as i64);
                let id = format!("{:032x}", rng.u128(..));
                // 8 % of requests fail over from primary (429 or 5xx or a timeout), 0.2 % fail on
                // every endpoint.
                let roll = rng.u32(..1000);
                let (endpoint, status, class, attempts): Shape = match roll {
                    0..=1 => (
                        None,
                        503,
                        Some("all_failed"),
                        vec![
                            ("primary", "server_error", Some(500)),
                            ("backup", "connect_error", None),
                        ],
                    ),
                    2..=41 => (
                        Some("backup"),
                        200,
                        None,
                        vec![
                            ("primary", "rate_limited", Some(429)),
                            ("backup", "ok", Some(200)),
                        ],
                    ),
                    42..=71 => (
                        Some("backup"),
                        200,
                        None,
                        vec![
                            ("primary", "server_error", Some(502)),
                            ("backup", "ok", Some(200)),
                        ],
                    ),
                    72..=81 => (
                        Some("local"),
                        200,
                        None,
                        vec![
                            ("primary", "first_token_timeout", None),
                            ("backup", "skipped_cooldown", None),
                            ("local", "ok", Some(200)),
                        ],
                    ),
                    82..=90 => (
                        None,
                        400,
                        Some("client_error"),
                        vec![("primary", "client_error", Some(400))],
                    ),
                    _ => (
                        Some("primary"),
                        200,
                        None,
                        vec![("primary", "ok", Some(200))],
                    ),
                };
                let latency =
                    200.0 + rng.f64() * 800.0 + if attempts.len() > 1 { 1500.0 } else { 0.0 };
                let calls = attempts
                    .iter()
                    .filter(|a| !a.1.starts_with("skipped_"))
                    .count() as i64;
                req.execute(params![id, ts, endpoint, status, class, latency, calls])
                    .expect("insert");
                let row = tx.last_insert_rowid();
                for (seq, (ep, class, st)) in attempts.iter().enumerate() {
                    att.execute(params![
                        row,
                        id,
                        seq as i64 + 1,
                        ts,
                        ep,
                        class,
                        st,
                        Option::<&str>::None,
                        latency / attempts.len() as f64
                    ])
                    .expect("insert");
                }
                if i % 5000 == 0 {
                    ev.execute(params![
                        ts,
                        "primary",
                        "cooldown",
                        "429 rate_limit_exceeded; cooling down for 1000ms"
                    ])
                    .expect("insert");
                }
            }
            ev.execute(params![
                now_ms - 1000,
                "legacy",
                "retired",
                "410 Gone: the model was removed"
            ])
            .expect("insert");
            ev.execute(params![
                now_ms - 900,
                "primary",
                "key_rejected",
                "401 invalid_api_key (key #2)"
            ])
            .expect("insert");
        }
        tx.commit().expect("commit");
        // The marks the gateway's writer keeps as it writes (a trail upgraded from before them
        // gets them the same way: this is the upgrade's work on a trail of this size).
        let t = Instant::now();
        conn.execute_batch(
            "INSERT INTO request_marks (before_ms, first_id)
                SELECT min(before_ms), min(id) FROM (
                    SELECT id, max(ts_ms) OVER (ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) + 1
                        AS before_ms
                    FROM requests)
                WHERE before_ms IS NOT NULL
                GROUP BY before_ms / 1000",
        )
        .expect("marks");
        let marks: i64 = conn
            .query_row("SELECT COUNT(*) FROM request_marks", [], |r| r.get(0))
            .expect("count");
        eprintln!(
            "marks: {marks} in {:.2} s (what an upgrade to them does on this trail)",
            t.elapsed().as_secs_f64()
        );
    }
    let attempts: i64 = rusqlite::Connection::open(&db)
        .and_then(|c| c.query_row("SELECT COUNT(*) FROM attempts", [], |r| r.get(0)))
        .unwrap_or(0);
    eprintln!(
        "trail written: {rows} requests, {attempts} attempts in {:.1} s ({} MB)",
        t.elapsed().as_secs_f64(),
        std::fs::metadata(&db)
            .map(|m| m.len() / 1_000_000)
            .unwrap_or(0)
    );

    let mut times = Vec::new();
    let mut sizes = (0, 0);
    for _ in 0..3 {
        let t = Instant::now();
        let since = now - Duration::from_secs(86_400 + 60);
        let r = autohedge::ops::report::build(&[dir.path().to_path_buf()], since).expect("report");
        let md = autohedge::ops::report::markdown(&r);
        let html = autohedge::ops::report::html(&r);
        times.push(t.elapsed().as_secs_f64());
        assert_eq!(r.requests, rows, "every row read");
        sizes = (md.len(), html.len());
        std::hint::black_box((md, html));
    }
    times.sort_by(f64::total_cmp);
    // The last hour: read from its mark on, not from the first row.
    let t = Instant::now();
    let since = now - Duration::from_secs(3_600);
    let r = autohedge::ops::report::build(&[dir.path().to_path_buf()], since).expect("report");
    let hour = t.elapsed().as_secs_f64();
    assert!(
        r.requests > 0 && r.requests < rows / 20,
        "an hour's requests: {}",
        r.requests
    );
    println!(
        "report over the last hour ({} requests): {hour:.2} s",
        r.requests
    );
    println!(
        "report over {rows} requests / {attempts} attempts (24 h): median {:.2} s, best {:.2} s of 3 (goal < 5 s); markdown {} B, html {} B",
        times[1], times[0], sizes.0, sizes.1
    );
}
