//! The SQLite trail's schema: the migrations, and opening a connection that applies them.

use std::path::Path;
use std::time::Duration;

use rusqlite::Connection;

/// Migrations, applied in order; `PRAGMA user_version` holds how many have run.
pub(super) const MIGRATIONS: &[&str] = &[
    // 1: the audit trail and endpoint state.
    r#"
    CREATE TABLE requests (
        id INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        ts_ms INTEGER NOT NULL,
        operation TEXT NOT NULL,
        requested_model TEXT,
        endpoint TEXT,
        status INTEGER NOT NULL,
        error_class TEXT,
        stream INTEGER NOT NULL DEFAULT 0,
        latency_ms REAL NOT NULL,
        ttft_ms REAL,
        tokens_in INTEGER,
        tokens_out INTEGER,
        tokens_estimated INTEGER NOT NULL DEFAULT 0,
        cost_usd REAL,
        attempts INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX requests_ts ON requests(ts_ms);
    -- No index on request_id: UUIDs arrive in random order and an index on them costs a random
    -- B-tree insert per request; looking one request up is an operator's rare scan.
    CREATE TABLE attempts (
        id INTEGER PRIMARY KEY,
        request_row INTEGER NOT NULL REFERENCES requests(id),
        request_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        ts_ms INTEGER NOT NULL,
        endpoint TEXT NOT NULL,
        class TEXT NOT NULL,
        status INTEGER,
        error TEXT,
        latency_ms REAL NOT NULL
    );
    CREATE INDEX attempts_request_row ON attempts(request_row, seq);
    CREATE INDEX attempts_ts ON attempts(ts_ms);
    CREATE TABLE endpoint_events (
        id INTEGER PRIMARY KEY,
        ts_ms INTEGER NOT NULL,
        endpoint TEXT NOT NULL,
        event TEXT NOT NULL,
        reason TEXT NOT NULL
    );
    CREATE INDEX endpoint_events_endpoint ON endpoint_events(endpoint, ts_ms);
    CREATE TABLE endpoint_state (
        endpoint TEXT PRIMARY KEY,
        requests INTEGER NOT NULL DEFAULT 0,
        successes INTEGER NOT NULL DEFAULT 0,
        failures INTEGER NOT NULL DEFAULT 0,
        ewma_latency_ms REAL,
        retired_reason TEXT,
        retired_fingerprint TEXT,
        updated_ms INTEGER NOT NULL
    );
    "#,
    // 2: context-window guard: counted prompt tokens, truncation and payload hygiene per request;
    // context limits learned from upstream errors.
    r#"
    ALTER TABLE requests ADD COLUMN prompt_tokens_counted INTEGER;
    ALTER TABLE requests ADD COLUMN truncated_messages INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN truncated_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN sanitized_chars INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE endpoint_state ADD COLUMN learned_context_window INTEGER;
    "#,
    // 3: attempts tried although health said to skip them (healthy panic, last resort).
    r#"
    ALTER TABLE attempts ADD COLUMN panic_mode INTEGER NOT NULL DEFAULT 0;
    "#,
    // 4: hedged requests (copies sent, whether one won) and continued streams (the endpoint
    // whose stream broke before another carried it on).
    r#"
    ALTER TABLE requests ADD COLUMN hedges INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN hedge_won INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN continued_from TEXT;
    ALTER TABLE requests ADD COLUMN client_key TEXT;
    CREATE TABLE client_spend (
        client TEXT NOT NULL,
        month TEXT NOT NULL,
        usd REAL NOT NULL DEFAULT 0,
        requests INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (client, month)
    );
    "#,
    // 5: attempts lose their time index: an attempt's time is its request's, so readers find a
    // window's attempts from its first request row (`request_row >= …`, the request-row index)
    // and pruning deletes a request's attempts with it. One B-tree insert fewer per attempt on
    // the audit thread.
    r#"
    DROP INDEX IF EXISTS attempts_ts;
    "#,
    // 6: a learned context window keeps the request that taught it and the definition of the
    // endpoint it was learned under. Windows learned before could have been taught by a client's
    // own text (a quoted validation error): they are forgotten and learned again from upstreams.
    r#"
    ALTER TABLE endpoint_state ADD COLUMN learned_window_request TEXT;
    ALTER TABLE endpoint_state ADD COLUMN learned_window_fingerprint TEXT;
    UPDATE endpoint_state SET learned_context_window = NULL;
    ALTER TABLE attempts ADD COLUMN own_key INTEGER NOT NULL DEFAULT 0;
    "#,
    // 7: the standbys remediation scaled up, so a restarted gateway scales them back down.
    r#"
    CREATE TABLE standby_state (
        standby TEXT PRIMARY KEY,
        primary_endpoint TEXT NOT NULL,
        up INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL
    );
    "#,
    // 8: endpoint events are read by time (the report) and swept by time (retention), never by
    // endpoint: the (endpoint, ts_ms) index helped neither, and both scanned the table.
    r#"
    DROP INDEX IF EXISTS endpoint_events_endpoint;
    CREATE INDEX endpoint_events_ts ON endpoint_events(ts_ms);
    "#,
    // 9: `/v1/responses`: the gateway's id for the response a request made, and the one it
    // continued (`previous_response_id`: that row's `endpoint` is where the conversation was
    // pinned).
    r#"
    ALTER TABLE requests ADD COLUMN response_id TEXT;
    ALTER TABLE requests ADD COLUMN previous_response_id TEXT;
    "#,
    // 10: most requests make one plain attempt (no error text, not in panic, at the endpoint
    // that served): it is kept in its request's row (`attempt_class`, `attempt_status`,
    // `attempt_latency_ms`) instead of a row of its own, which took 8.7k of the writer's 20.3k
    // instructions a request (a row and an index entry). The other attempts are rows of
    // `attempt_rows`; `attempts` is a view of both, with the columns the table had, so readers
    // and operators' queries see every attempt as before.
    r#"
    ALTER TABLE attempts RENAME TO attempt_rows;
    ALTER TABLE requests ADD COLUMN attempt_class TEXT;
    ALTER TABLE requests ADD COLUMN attempt_status INTEGER;
    ALTER TABLE requests ADD COLUMN attempt_latency_ms REAL;
    CREATE VIEW attempts AS
        SELECT id, request_row, request_id, seq, ts_ms, endpoint, class, status, error,
               latency_ms, panic_mode, own_key
        FROM attempt_rows
        UNION ALL
        SELECT NULL, id, request_id, 1, ts_ms, endpoint, attempt_class, attempt_status, NULL,
               attempt_latency_ms, 0, 0
        FROM requests WHERE attempt_class IS NOT NULL;
    "#,
    // 11: the time index of `requests` (2.3k of the writer's instructions a request) gives way
    // to marks: `(before_ms, first_id)` says every request row numbered below `first_id`
    // started before `before_ms`. A reader of a window takes the first id of the latest mark
    // at or before the window's start and reads the rowids from there, filtering `ts_ms`;
    // the sweep deletes below the latest mark at or before its cutoff. The writer adds a mark
    // at most once a second of request time ([`MarkState`]). Marks for an existing trail: the
    // running maximum of `ts_ms` in id order, one a second.
    r#"
    CREATE TABLE request_marks (
        before_ms INTEGER PRIMARY KEY,
        first_id INTEGER NOT NULL
    );
    INSERT INTO request_marks (before_ms, first_id)
        SELECT min(before_ms), min(id) FROM (
            SELECT id, max(ts_ms) OVER (ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) + 1
                AS before_ms
            FROM requests)
        WHERE before_ms IS NOT NULL
        GROUP BY before_ms / 1000;
    DROP INDEX IF EXISTS requests_ts;
    "#,
    // 12: the batches PostgreSQL's writer committed, by the token it gave each, so a batch sent
    // again after a call that timed out (and may have committed) is written once. SQLite's
    // writer does not use it (its commits are not in doubt): the table keeps the schemas alike.
    r#"
    CREATE TABLE audit_batches (
        token TEXT PRIMARY KEY,
        ts_ms INTEGER NOT NULL
    );
    "#,
    // 13: the address an attempt went to, when its endpoint has several (`base_urls`,
    // discovered tasks). Such an attempt is always a row of `attempt_rows` (the request's own
    // row has no column for it); the view shows it.
    r#"
    ALTER TABLE attempt_rows ADD COLUMN address TEXT;
    DROP VIEW attempts;
    CREATE VIEW attempts AS
        SELECT id, request_row, request_id, seq, ts_ms, endpoint, class, status, error,
               latency_ms, panic_mode, own_key, address
        FROM attempt_rows
        UNION ALL
        SELECT NULL, id, request_id, 1, ts_ms, endpoint, attempt_class, attempt_status, NULL,
               attempt_latency_ms, 0, 0, NULL
        FROM requests WHERE attempt_class IS NOT NULL;
    "#,
    // 14: the request's trace id (W3C), when it was traced (`telemetry.otlp`, or a client's
    // `traceparent`): the access line carries it too, so one finds the other.
    r#"
    ALTER TABLE requests ADD COLUMN trace_id TEXT;
    "#,
    // 15: replay (`audit.capture_bodies`, `autohedge replay`): the request a row replayed, and
    // the bodies kept beside a row (redacted, cut at `audit.max_body_bytes`; `*_cut` says so),
    // found by request id (only rows with bodies are indexed: the capture is opt-in). And the
    // kept answer that served a row: `last_resort` or `cache` (`last_resort:`, `cache:`).
    r#"
    ALTER TABLE requests ADD COLUMN replay_of TEXT;
    ALTER TABLE requests ADD COLUMN served_from TEXT;
    CREATE TABLE request_bodies (
        request_row INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        request_body TEXT NOT NULL,
        request_cut INTEGER NOT NULL DEFAULT 0,
        response_body TEXT,
        response_cut INTEGER NOT NULL DEFAULT 0,
        own_key INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX request_bodies_request_id ON request_bodies(request_id);
    "#,
];

/// The WAL file is truncated to this after checkpoints: a burst cannot leave it gigabytes large.
pub(super) const JOURNAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

/// How long opening retries while another process holds the database (SQLite does not call the
/// busy handler for every statement of the setup, e.g. switching the journal mode).
const OPEN_BUSY_FOR: Duration = Duration::from_secs(10);

pub fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let deadline = std::time::Instant::now() + OPEN_BUSY_FOR;
    loop {
        match try_open(path) {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if matches!(
                    e.code,
                    rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
                ) && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10 + fastrand::u64(..20)));
            }
            other => return other,
        }
    }
}

fn try_open(path: &Path) -> rusqlite::Result<Connection> {
    let mut conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    // Only takes effect on a new, empty database (before its first table): lets pruning hand
    // pages back with `incremental_vacuum` instead of a blocking full VACUUM.
    conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "journal_size_limit", JOURNAL_SIZE_LIMIT)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // The writer appends: every B-tree it touches (the tables' rowids, the time and request
    // indexes) grows at its right edge, so the hot set is a few pages per tree — tens of pages
    // of the 512 that 2 MiB holds, with room for a pruning pass. More only raised the gateway's
    // peak RSS (32 MiB, then 8 MiB: 4.5 MB more at saturation than this).
    conn.pragma_update(None, "cache_size", -2048)?;
    migrate(&mut conn)?;
    Ok(conn)
}

/// Runs the pending migrations inside one IMMEDIATE transaction: the version is read under the
/// write lock, so two processes opening one data dir at once cannot both apply a migration (the
/// second waits on the busy timeout, then finds nothing to do).
fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let version: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version.max(0) as usize >= MIGRATIONS.len() {
        return Ok(());
    }
    for sql in MIGRATIONS.iter().skip(version.max(0) as usize) {
        tx.execute_batch(sql)?;
    }
    tx.pragma_update(None, "user_version", MIGRATIONS.len() as i64)?;
    tx.commit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::db_path;

    #[test]
    fn two_processes_opening_one_data_dir_at_once() {
        for _ in 0..10 {
            let dir = tempfile::tempdir().unwrap();
            let path = db_path(dir.path());
            let barrier = std::sync::Barrier::new(4);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| {
                        barrier.wait();
                        open_connection(&path).expect("every opener succeeds")
                    });
                }
            });
            let conn = Connection::open(&path).unwrap();
            let v: i64 = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
            assert_eq!(v as usize, MIGRATIONS.len());
        }
    }
}
