//! The audit trail and persisted endpoint state, in SQLite (WAL). One writer owns the connection
//! on its own OS thread behind a bounded queue: the request path only ever does a non-blocking
//! `try_send`, and a full queue or a failing disk drops records with a counter and a warning
//! instead of stalling or failing requests. Reads for the CLI open their own connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};

pub mod pg;
mod raw;
pub mod transfer;

use raw::Val;

/// Migrations, applied in order; `PRAGMA user_version` holds how many have run.
const MIGRATIONS: &[&str] = &[
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
];

/// The first request row a window starting at `?1` (ms) can hold: the `first_id` of the latest
/// mark at or before it (rows below it all started earlier), or 0 when there is none. A scalar
/// subquery, evaluated once, so a query can read `id >= first_row!()` as a rowid range.
macro_rules! first_row {
    () => {
        "(SELECT coalesce((SELECT first_id FROM request_marks WHERE before_ms <= ?1 ORDER BY before_ms DESC LIMIT 1), 0))"
    };
}

/// Every query the readers (`stats`, `report`, budgets at start) and the retention sweep run,
/// in one place, so that a test can show each one's plan uses an index (`EXPLAIN QUERY PLAN`).
pub mod sql {
    /// The first request row of a window starting at `?1`: attempts have no time index of their
    /// own and are found from it (their request-row index), requests by their rowid.
    pub const FIRST_ROW_SINCE: &str = concat!("SELECT ", first_row!());
    /// `report`: a window's attempts, in the index's order.
    pub const ATTEMPTS_FROM_ROW: &str = "SELECT request_row, request_id, ts_ms, endpoint, class FROM attempts WHERE request_row >= ?1 ORDER BY request_row, seq";
    /// `report`: a window's requests.
    pub const REQUESTS_BETWEEN: &str = concat!(
        "SELECT id, ts_ms, endpoint, status, error_class, latency_ms FROM requests WHERE id >= ",
        first_row!(),
        " AND ts_ms >= ?1 AND ts_ms <= ?2"
    );
    /// `report`: a window's endpoint events.
    pub const EVENTS_BETWEEN: &str = "SELECT endpoint, event, reason FROM endpoint_events WHERE ts_ms >= ?1 AND ts_ms <= ?2 ORDER BY ts_ms";
    /// `stats --by-key`.
    pub const BY_KEY_SINCE: &str = concat!(
        "SELECT client_key, COUNT(*), SUM(status BETWEEN 200 AND 299), SUM(status NOT BETWEEN 200 AND 299),
                COALESCE(SUM(tokens_in), 0), COALESCE(SUM(tokens_out), 0), COALESCE(SUM(cost_usd), 0)
         FROM requests WHERE id >= ",
        first_row!(),
        " AND client_key IS NOT NULL AND ts_ms >= ?1
         GROUP BY client_key ORDER BY client_key"
    );
    /// `stats`: real attempts (not skips) per endpoint.
    pub const CALLS_SINCE: &str = "SELECT endpoint, class, latency_ms FROM attempts WHERE request_row >= ?2 AND ts_ms >= ?1 AND class NOT LIKE 'skipped_%' AND class <> 'context_skip'";
    /// `stats`: requests an endpoint served after another had failed.
    pub const FALLBACKS_SERVED_SINCE: &str = concat!(
        "SELECT endpoint, COUNT(*) FROM requests WHERE id >= ",
        first_row!(),
        " AND ts_ms >= ?1 AND endpoint IS NOT NULL AND attempts > 1 AND status < 400 GROUP BY endpoint"
    );
    /// `stats`: failed attempts followed by another endpoint's attempt in the same request.
    /// Only requests with more than one attempt can have one: their attempts are all rows of
    /// `attempt_rows` (a request's row holds its attempt only when it made one).
    pub const FALLBACKS_FROM_SINCE: &str = "SELECT a.endpoint, COUNT(*) FROM attempt_rows a WHERE a.request_row >= ?2 AND a.ts_ms >= ?1 AND a.class <> 'ok' AND a.class NOT LIKE 'skipped_%'
         AND EXISTS (SELECT 1 FROM attempt_rows b WHERE b.request_row = a.request_row AND b.seq > a.seq AND b.endpoint <> a.endpoint AND b.class NOT LIKE 'skipped_%')
         GROUP BY a.endpoint";
    /// Budgets at start: every key's spend (the whole table, by design: one row a key and month).
    pub const SPEND: &str = "SELECT client, month, usd FROM client_spend";
    /// Retention: a batch of old requests' attempts, then the requests (the same `LIMIT` over
    /// the rowids picks the same rows in both), then old events; `?2` is the batch size. Old
    /// requests are those below the latest mark at or before the cutoff `?1`: every one of them
    /// started before it. A row that started before the cutoff but was written after that mark
    /// (a long stream, or a row written within the mark's second) goes with a later sweep.
    pub const PRUNE_ATTEMPTS: &str = concat!(
        "DELETE FROM attempt_rows WHERE request_row IN (SELECT id FROM requests WHERE id < ",
        first_row!(),
        " LIMIT ?2)"
    );
    pub const PRUNE_REQUESTS: &str = concat!(
        "DELETE FROM requests WHERE id IN (SELECT id FROM requests WHERE id < ",
        first_row!(),
        " LIMIT ?2)"
    );
    pub const PRUNE_EVENTS: &str = "DELETE FROM endpoint_events WHERE id IN (SELECT id FROM endpoint_events WHERE ts_ms < ?1 LIMIT ?2)";
    /// Retention: marks older than the latest one at or before the cutoff `?1` (that one still
    /// bounds what is left).
    pub const PRUNE_MARKS: &str = "DELETE FROM request_marks WHERE before_ms < (SELECT max(before_ms) FROM request_marks WHERE before_ms <= ?1)";

    /// Every query above, named, for the plan test.
    pub const ALL: [(&str, &str); 13] = [
        ("FIRST_ROW_SINCE", FIRST_ROW_SINCE),
        ("ATTEMPTS_FROM_ROW", ATTEMPTS_FROM_ROW),
        ("REQUESTS_BETWEEN", REQUESTS_BETWEEN),
        ("EVENTS_BETWEEN", EVENTS_BETWEEN),
        ("BY_KEY_SINCE", BY_KEY_SINCE),
        ("CALLS_SINCE", CALLS_SINCE),
        ("FALLBACKS_SERVED_SINCE", FALLBACKS_SERVED_SINCE),
        ("FALLBACKS_FROM_SINCE", FALLBACKS_FROM_SINCE),
        ("SPEND", SPEND),
        ("PRUNE_ATTEMPTS", PRUNE_ATTEMPTS),
        ("PRUNE_REQUESTS", PRUNE_REQUESTS),
        ("PRUNE_EVENTS", PRUNE_EVENTS),
        ("PRUNE_MARKS", PRUNE_MARKS),
    ];
}

/// Rows deleted per transaction when pruning past retention: each delete is a few milliseconds,
/// so records queued meanwhile wait that long at most, never the whole prune.
pub(crate) const PRUNE_BATCH: usize = 2000;

/// Pages returned to the file system after a prune (`PRAGMA incremental_vacuum`), per pass.
const VACUUM_PAGES: usize = 4096;

/// The WAL file is truncated to this after checkpoints: a burst cannot leave it gigabytes large.
const JOURNAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

/// How many records the writer commits in one transaction at most. Batching turns a burst of
/// small inserts into one commit.
const BATCH: usize = 1024;

/// How long the writer gathers records before committing. Records are at most this much later
/// on disk; a clean shutdown flushes at once. At 10 ms a lightly loaded gateway committed a row
/// or two at a time: 50 ms took 5-6k instructions off each row's write and about 10k off the
/// request path (senders wake the sleeping writer less often; `benches/instructions.sh`).
const GATHER: Duration = Duration::from_millis(50);

pub fn db_path(data_dir: &Path) -> PathBuf {
    data_dir.join("autohedge.db")
}

/// The audit trails of `data_dirs` (one a replica: `autohedge stats` and `report` merge them),
/// each opened read-only, with the path it was read from. A data dir named twice (by another
/// spelling too) is read once; one with no trail is an error naming it.
pub fn open_trails(data_dirs: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, Connection)>> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for dir in data_dirs {
        let path = db_path(dir);
        if !path.exists() {
            anyhow::bail!(
                "no audit database at {} (has the gateway run with --data-dir {}?)",
                path.display(),
                dir.display()
            );
        }
        if !seen.insert(std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone())) {
            continue;
        }
        let conn = Connection::open_with_flags(
            &path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
        conn.busy_timeout(Duration::from_secs(5))?;
        out.push((path, conn));
    }
    Ok(out)
}

pub(crate) fn ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[derive(Debug, Clone)]
pub struct AttemptRow {
    pub seq: u32,
    pub endpoint: String,
    pub class: crate::routing::outcome::Outcome,
    pub status: Option<u16>,
    /// Already redacted: never contains a key.
    pub error: Option<String>,
    pub latency_ms: f64,
    /// Tried although health said to skip it (healthy panic, last resort).
    pub panic_mode: bool,
    /// Made with the request's own key (`x-encrypted-key`).
    pub own_key: bool,
}

#[derive(Debug, Clone)]
pub struct RequestRow {
    pub request_id: String,
    pub ts: SystemTime,
    pub operation: &'static str,
    pub requested_model: Option<String>,
    pub endpoint: Option<String>,
    pub status: u16,
    pub error_class: Option<String>,
    pub stream: bool,
    pub latency_ms: f64,
    pub ttft_ms: Option<f64>,
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    pub tokens_estimated: bool,
    pub cost_usd: Option<f64>,
    pub attempts: Vec<AttemptRow>,
    /// Prompt tokens as the gateway counted them (before any truncation).
    pub prompt_tokens_counted: Option<u64>,
    pub truncated_messages: u64,
    pub truncated_tokens: u64,
    pub sanitized_chars: u64,
    /// Hedged copies sent for this request.
    pub hedges: u32,
    /// A hedged copy (not the first attempt) served it.
    pub hedge_won: bool,
    /// The endpoint whose committed stream broke before `endpoint` continued it.
    pub continued_from: Option<String>,
    /// The client key's name (`auth.keys[].name`; never the key).
    pub client_key: Option<String>,
    /// `/v1/responses`: the gateway's id for the response.
    pub response_id: Option<String>,
    /// `/v1/responses`: the response this request continued (the gateway's id).
    pub previous_response_id: Option<String>,
}

impl RequestRow {
    /// A row with nothing recorded yet but who asked, when and for what; callers fill in the
    /// rest (`RequestRow { status, ..RequestRow::new(..) }`).
    pub fn new(request_id: String, ts: SystemTime, operation: &'static str) -> RequestRow {
        RequestRow {
            request_id,
            ts,
            operation,
            requested_model: None,
            endpoint: None,
            status: 0,
            error_class: None,
            stream: false,
            latency_ms: 0.0,
            ttft_ms: None,
            tokens_in: None,
            tokens_out: None,
            tokens_estimated: false,
            cost_usd: None,
            attempts: Vec::new(),
            prompt_tokens_counted: None,
            truncated_messages: 0,
            truncated_tokens: 0,
            sanitized_chars: 0,
            hedges: 0,
            hedge_won: false,
            continued_from: None,
            client_key: None,
            response_id: None,
            previous_response_id: None,
        }
    }
}

/// The most characters of `requested_model` a row keeps: the name is the client's, and a
/// client may send a megabyte of it.
pub const MAX_REQUESTED_MODEL_CHARS: usize = 256;

/// Makes `s` safe for every store: a NUL (which PostgreSQL refuses in `TEXT`, failing the
/// whole batch it is in, and which SQLite's string functions stop at) becomes U+FFFD, as
/// invalid UTF-8 already did where the text was read (`String` holds none). Returns whether
/// anything changed.
pub fn safe_text(s: &mut String) -> bool {
    if !s.as_bytes().contains(&0) {
        return false;
    }
    *s = s.replace('\0', "\u{FFFD}");
    true
}

fn safe_opt(s: &mut Option<String>) {
    if let Some(s) = s {
        safe_text(s);
    }
}

impl RequestRow {
    /// Every text of the row (and of its attempts) made safe ([`safe_text`]), and
    /// `requested_model` cut to [`MAX_REQUESTED_MODEL_CHARS`]: one client's bytes never cost
    /// another's rows. Both writers call it, so both stores hold the same text.
    pub fn make_safe(&mut self) {
        safe_text(&mut self.request_id);
        if let Some(m) = &mut self.requested_model {
            safe_text(m);
            if let Some((cut, _)) = m.char_indices().nth(MAX_REQUESTED_MODEL_CHARS) {
                m.truncate(cut);
            }
        }
        for s in [
            &mut self.endpoint,
            &mut self.error_class,
            &mut self.continued_from,
            &mut self.client_key,
            &mut self.response_id,
            &mut self.previous_response_id,
        ] {
            safe_opt(s);
        }
        for a in &mut self.attempts {
            safe_text(&mut a.endpoint);
            safe_opt(&mut a.error);
        }
    }
}

impl Record {
    /// The record's text made safe for every store (see [`RequestRow::make_safe`]).
    pub fn make_safe(&mut self) {
        match self {
            Record::Request(row) => row.make_safe(),
            Record::Event(ev) => {
                safe_text(&mut ev.endpoint);
                safe_text(&mut ev.event);
                safe_text(&mut ev.reason);
            }
            Record::Retired {
                endpoint,
                reason,
                fingerprint,
            } => {
                safe_text(endpoint);
                safe_opt(reason);
                safe_opt(fingerprint);
            }
            Record::Stats(rows) => {
                for r in rows {
                    safe_text(&mut r.endpoint);
                }
            }
            Record::LearnedWindow { endpoint, learned } => {
                safe_text(endpoint);
                if let Some((_, request, fingerprint)) = learned {
                    safe_text(request);
                    safe_text(fingerprint);
                }
            }
            Record::Spend(rows) => {
                for (client, month, _) in rows {
                    safe_text(client);
                    safe_text(month);
                }
            }
            Record::Standby {
                standby, primary, ..
            } => {
                safe_text(standby);
                safe_text(primary);
            }
            Record::Prune(_) | Record::Flush(_) => {}
        }
    }

    /// The request id a record carries, for logs about it.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            Record::Request(row) => Some(&row.request_id),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EndpointEvent {
    pub ts: SystemTime,
    pub endpoint: String,
    pub event: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default)]
pub struct PersistedStats {
    pub endpoint: String,
    pub requests: u64,
    pub successes: u64,
    pub failures: u64,
    pub ewma_latency_ms: Option<f64>,
    pub retired_reason: Option<String>,
    pub retired_fingerprint: Option<String>,
    pub learned_context_window: Option<u64>,
    pub learned_window_request: Option<String>,
    pub learned_window_fingerprint: Option<String>,
}

#[derive(Debug)]
pub enum Record {
    Request(Box<RequestRow>),
    Event(EndpointEvent),
    /// Sets (`Some`) or clears (`None`) an endpoint's persisted retirement.
    Retired {
        endpoint: String,
        reason: Option<String>,
        fingerprint: Option<String>,
    },
    Stats(Vec<PersistedStats>),
    /// A context limit learned from an upstream's context-length error: the tokens, the request
    /// that taught it and the endpoint's fingerprint; `None` forgets it.
    LearnedWindow {
        endpoint: String,
        learned: Option<(u64, String, String)>,
    },
    /// Client keys' spend as it stands: (key name, month, US dollars in all).
    Spend(Vec<(String, String, f64)>),
    /// Remediation scaled this standby (service) up or back down, for its primary endpoint.
    Standby {
        standby: String,
        primary: String,
        up: bool,
    },
    /// Deletes audit rows (requests, attempts, events) older than this.
    Prune(SystemTime),
    /// Replies once everything queued before it is committed.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The request path's side of the store: cheap to clone, never blocks.
#[derive(Clone)]
pub struct StoreHandle {
    /// `None`: the database could not be opened; the trail is off (see `off_reason`).
    tx: Option<SyncSender<Record>>,
    dropped: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    off_reason: Option<Arc<str>>,
    /// Why a store that comes and goes (PostgreSQL) is away now; `None` while it writes.
    down: Arc<std::sync::Mutex<Option<String>>>,
    /// What waits in the spool, and what the store refused (PostgreSQL's writer).
    pub(crate) held: Arc<Held>,
}

/// The PostgreSQL writer's counts of what it holds back: records waiting in its spool while
/// the store is away, and records the store refused one by one (set aside).
#[derive(Debug, Default)]
pub struct Held {
    pub spooled_records: AtomicU64,
    pub spooled_bytes: AtomicU64,
    pub set_aside: AtomicU64,
}

impl StoreHandle {
    /// A handle whose trail is off: records are counted as dropped. The gateway serves on.
    pub fn off(reason: String) -> StoreHandle {
        StoreHandle {
            tx: None,
            dropped: Arc::new(AtomicU64::new(0)),
            written: Arc::new(AtomicU64::new(0)),
            off_reason: Some(reason.into()),
            down: Default::default(),
            held: Default::default(),
        }
    }

    /// Why the audit trail is off, when it is: the database could not be opened, or the store
    /// (PostgreSQL) is away now and records are dropped until it is back.
    pub fn off_reason(&self) -> Option<String> {
        if let Some(r) = &self.off_reason {
            return Some(r.to_string());
        }
        self.down.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Queues a record. A full queue drops it and counts the drop.
    pub fn send(&self, r: Record) {
        let Some(tx) = &self.tx else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match tx.try_send(r) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                // Warn on the first drop and then every thousandth: a storm of warnings would
                // itself become the stall we are avoiding.
                if n == 1 || n.is_multiple_of(1000) {
                    tracing::warn!(
                        dropped_total = n,
                        "audit queue full or closed: record dropped"
                    );
                }
            }
        }
    }

    pub fn send_flag(&self, endpoint: &str, reason: Option<&str>, fingerprint: Option<&str>) {
        self.send(Record::Retired {
            endpoint: endpoint.to_string(),
            reason: reason.map(str::to_string),
            fingerprint: fingerprint.map(str::to_string),
        });
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// What the writer holds back (`/status.audit`): records waiting in the spool and their
    /// bytes, and records the store refused one by one.
    pub fn held(&self) -> (u64, u64, u64) {
        (
            self.held.spooled_records.load(Ordering::Relaxed),
            self.held.spooled_bytes.load(Ordering::Relaxed),
            self.held.set_aside.load(Ordering::Relaxed),
        )
    }

    /// Queues `r`, waiting (blocking) for room instead of dropping it: for the last records of a
    /// clean shutdown (the stats and spend snapshots), which a full queue must not lose.
    pub fn send_waiting(&self, r: Record) {
        match &self.tx {
            Some(tx) if tx.send(r).is_ok() => {}
            _ => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Waits (blocking) until everything queued so far is on disk, or `timeout`.
    pub fn flush_blocking(&self, timeout: Duration) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        let Some(sender) = &self.tx else {
            return true;
        };
        if sender.send(Record::Flush(tx)).is_err() {
            return false;
        }
        rx.recv_timeout(timeout).is_ok()
    }
}

/// The writer thread. Dropping every `StoreHandle` and calling [`Store::close`] drains the queue.
pub struct Store {
    handle: StoreHandle,
    thread: Option<JoinHandle<()>>,
}

pub struct Opened {
    pub store: Store,
    pub persisted: Vec<PersistedStats>,
    /// Client keys' spend: (name, month, US dollars).
    pub spend: Vec<(String, String, f64)>,
    /// Standby services remediation left scaled up.
    pub standbys_up: Vec<String>,
}

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

impl Store {
    /// Opens (creating) `<data_dir>/autohedge.db`, reads persisted endpoint state, and starts the
    /// writer thread.
    pub fn open(data_dir: &Path, capacity: usize) -> anyhow::Result<Opened> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| anyhow::anyhow!("cannot create data dir {}: {e}", data_dir.display()))?;
        let path = db_path(data_dir);
        let conn = open_connection(&path)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        let persisted = read_persisted(&conn)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let spend = read_spend(&conn)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let standbys_up = read_standbys_up(&conn)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let (tx, rx) = sync_channel(capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let written = Arc::new(AtomicU64::new(0));
        let handle = StoreHandle {
            tx: Some(tx),
            dropped: dropped.clone(),
            written: written.clone(),
            off_reason: None,
            down: Default::default(),
            held: Default::default(),
        };
        let thread = std::thread::Builder::new()
            .name("autohedge-audit".into())
            .spawn(move || writer(conn, rx, dropped, written))
            .map_err(|e| anyhow::anyhow!("cannot start audit writer: {e}"))?;
        Ok(Opened {
            store: Store {
                handle,
                thread: Some(thread),
            },
            persisted,
            spend,
            standbys_up,
        })
    }

    /// Like [`Store::open`], but a database that cannot be opened (corrupt, read-only volume,
    /// wrong owner) does not stop the gateway: it serves with the audit trail off, and says why
    /// in `/status` and `/health`.
    pub fn open_or_off(data_dir: &Path, capacity: usize) -> Opened {
        match Store::open(data_dir, capacity) {
            Ok(o) => o,
            Err(e) => {
                let reason = format!("{e:#}");
                tracing::error!(error = %reason, "audit trail is OFF: the database cannot be opened; serving without it");
                Opened {
                    store: Store {
                        handle: StoreHandle::off(reason),
                        thread: None,
                    },
                    persisted: Vec::new(),
                    spend: Vec::new(),
                    standbys_up: Vec::new(),
                }
            }
        }
    }

    pub fn handle(&self) -> StoreHandle {
        self.handle.clone()
    }

    /// Drains the queue: returns once every record queued before the call is committed. The
    /// writer thread itself lives on until the last handle (held by in-flight streams, say) is
    /// dropped, so a record queued later still lands.
    pub fn close(mut self) {
        if !self.handle.flush_blocking(Duration::from_secs(30)) {
            tracing::warn!("audit writer did not drain within 30s");
        }
        drop(self.thread.take());
    }
}

fn writer(
    conn: Connection,
    rx: Receiver<Record>,
    dropped: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
) {
    let mut statements: Option<Statements<'_>> = None;
    let mut batch = Vec::with_capacity(BATCH);
    while let Ok(first) = rx.recv() {
        batch.push(first);
        // Gather for a moment before committing: one transaction (and one wake-up of this
        // thread) per GATHER instead of per record. While this thread sleeps rather than
        // waiting in `recv`, senders never pay for a futex wake.
        let deadline = std::time::Instant::now() + GATHER;
        loop {
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let flush_asked = batch.iter().any(|r| matches!(r, Record::Flush(_)));
            if flush_asked || batch.len() >= BATCH || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut flushes = Vec::new();
        let n = batch
            .iter()
            .filter(|r| !matches!(r, Record::Flush(_) | Record::Prune(_)))
            .count() as u64;
        // Prepared on the first batch, and again after a batch that failed to prepare them.
        let written_now = match &mut statements {
            Some(s) => s.write_batch(&mut batch, &mut flushes),
            None => Statements::prepare(&conn)
                .and_then(|s| statements.insert(s).write_batch(&mut batch, &mut flushes)),
        };
        match written_now {
            Ok(()) => {
                written.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                let total = dropped.fetch_add(n, Ordering::Relaxed) + n;
                tracing::warn!(error = %e, dropped = n, dropped_total = total, "audit write failed; records dropped");
            }
        }
        batch.clear();
        for f in flushes {
            let _ = f.send(());
        }
    }
}

/// The `requests` columns the writer fills, `id` first: ids are given explicitly so that a
/// batch's attempts can name their request row without reading it back row by row.
const REQUEST_COLUMNS: [&str; 26] = [
    "id",
    "request_id",
    "ts_ms",
    "operation",
    "requested_model",
    "endpoint",
    "status",
    "error_class",
    "stream",
    "latency_ms",
    "ttft_ms",
    "tokens_in",
    "tokens_out",
    "tokens_estimated",
    "cost_usd",
    "attempts",
    "prompt_tokens_counted",
    "truncated_messages",
    "truncated_tokens",
    "sanitized_chars",
    "hedges",
    "hedge_won",
    "continued_from",
    "client_key",
    "response_id",
    "previous_response_id",
];

const ATTEMPT_COLUMNS: [&str; 11] = [
    "request_row",
    "request_id",
    "seq",
    "ts_ms",
    "endpoint",
    "class",
    "status",
    "error",
    "latency_ms",
    "panic_mode",
    "own_key",
];

/// The SQLite writer's `requests` columns: [`REQUEST_COLUMNS`] and the request's one attempt
/// when it is kept in the row ([`inline_attempt`]; PostgreSQL writes every attempt as a row).
const SQLITE_REQUEST_COLUMNS: [&str; 29] = {
    let mut c = [""; 29];
    let mut i = 0;
    while i < REQUEST_COLUMNS.len() {
        c[i] = REQUEST_COLUMNS[i];
        i += 1;
    }
    c[26] = "attempt_class";
    c[27] = "attempt_status";
    c[28] = "attempt_latency_ms";
    c
};

/// The `requests` columns of a plain row ([`plain_request`]), as indices into
/// [`SQLITE_REQUEST_COLUMNS`]: the rest hold their defaults (`NULL` or 0) and are left to them
/// instead of bound — eleven values fewer a request.
const REQUEST_PLAIN: [usize; 18] = [
    0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 14, 15, 23, 26, 27, 28,
];

/// The `attempts` columns of a plain attempt (no error text, not tried in panic), as indices
/// into [`ATTEMPT_COLUMNS`].
const ATTEMPT_PLAIN: [usize; 8] = [0, 1, 2, 3, 4, 5, 6, 8];

/// Every column of a table of `N`: the full INSERT's shape.
const fn every<const N: usize>() -> [usize; N] {
    let mut all = [0; N];
    let mut i = 0;
    while i < N {
        all[i] = i;
        i += 1;
    }
    all
}

/// A request whose columns outside [`REQUEST_PLAIN`] all hold their defaults: served
/// (or failed) without an error class, a time to first token, a count, a truncation, hygiene, a
/// hedge or a continuation — the common row.
fn plain_request(row: &RequestRow) -> bool {
    row.error_class.is_none()
        && row.ttft_ms.is_none()
        && row.prompt_tokens_counted.is_none()
        && row.truncated_messages == 0
        && row.truncated_tokens == 0
        && row.sanitized_chars == 0
        && row.hedges == 0
        && !row.hedge_won
        && row.continued_from.is_none()
        && row.response_id.is_none()
        && row.previous_response_id.is_none()
}

fn plain_attempt(a: &AttemptRow) -> bool {
    a.error.is_none() && !a.panic_mode && !a.own_key
}

/// The request's attempt when it is kept in its own row: its only one, plain, numbered 1 (as
/// attempts are), and made at the endpoint the row names (so `attempts` rebuilds it whole from
/// the row).
fn inline_attempt(row: &RequestRow) -> Option<&AttemptRow> {
    match row.attempts.as_slice() {
        [a] if plain_attempt(a)
            && a.seq == 1
            && !a.class.is_skip()
            && row.endpoint.as_deref() == Some(a.endpoint.as_str()) =>
        {
            Some(a)
        }
        _ => None,
    }
}

/// Rows one INSERT carries, largest first: a batch of 100 rows is three statements of 32, then
/// 4 of 1. Each statement executed starts and halts a VDBE program (a fifth of the writer's
/// instructions a row when every row was its own statement); 32 rows of 24 columns stay far
/// below SQLite's limit on bound parameters (32,766).
const ROWS_PER_INSERT: [usize; 3] = [32, 8, 1];

/// `INSERT INTO table (columns) VALUES (?, …), …` for `rows` rows.
fn insert_sql(table: &str, columns: &[&str], rows: usize) -> String {
    let one = format!("({})", vec!["?"; columns.len()].join(", "));
    format!(
        "INSERT INTO {table} ({}) VALUES {}",
        columns.join(", "),
        vec![one; rows].join(", ")
    )
}

/// Inserts `rows` with as few statements as [`ROWS_PER_INSERT`] allows (`inserts[i]` carries
/// `ROWS_PER_INSERT[i]` rows); `push` appends one row's values in the statement's column order.
fn insert_rows<'a, T>(
    inserts: &mut [raw::Insert<'_>; ROWS_PER_INSERT.len()],
    mut rows: &'a [T],
    mut push: impl FnMut(&'a T, &mut Vec<Val<'a>>),
) -> rusqlite::Result<()> {
    let mut values = Vec::new();
    for (n, insert) in ROWS_PER_INSERT.into_iter().zip(inserts.iter_mut()) {
        while rows.len() >= n {
            values.clear();
            for row in &rows[..n] {
                push(row, &mut values);
            }
            insert.execute(&values)?;
            rows = &rows[n..];
        }
    }
    Ok(())
}

/// A request's values in [`SQLITE_REQUEST_COLUMNS`] order.
fn request_values(id: i64, row: &RequestRow) -> [Val<'_>; SQLITE_REQUEST_COLUMNS.len()] {
    let one = inline_attempt(row);
    let int = |v: u64| Val::Int(v.min(i64::MAX as u64) as i64);
    [
        Val::Int(id),
        Val::Text(&row.request_id),
        Val::Int(ms(row.ts)),
        Val::Text(row.operation),
        Val::text(row.requested_model.as_deref()),
        Val::text(row.endpoint.as_deref()),
        Val::Int(i64::from(row.status)),
        Val::text(row.error_class.as_deref()),
        Val::Int(i64::from(row.stream)),
        Val::Real(row.latency_ms),
        Val::real(row.ttft_ms),
        row.tokens_in.map_or(Val::Null, int),
        row.tokens_out.map_or(Val::Null, int),
        Val::Int(i64::from(row.tokens_estimated)),
        Val::real(row.cost_usd),
        Val::Int(row.attempts.iter().filter(|a| !a.class.is_skip()).count() as i64),
        row.prompt_tokens_counted.map_or(Val::Null, int),
        int(row.truncated_messages),
        int(row.truncated_tokens),
        int(row.sanitized_chars),
        Val::Int(i64::from(row.hedges)),
        Val::Int(i64::from(row.hedge_won)),
        Val::text(row.continued_from.as_deref()),
        Val::text(row.client_key.as_deref()),
        Val::text(row.response_id.as_deref()),
        Val::text(row.previous_response_id.as_deref()),
        Val::text(one.map(|a| a.class.as_str())),
        Val::int(one.and_then(|a| a.status).map(i64::from)),
        Val::real(one.map(|a| a.latency_ms)),
    ]
}

/// An attempt's values in [`ATTEMPT_COLUMNS`] order.
fn attempt_values<'a>(
    request_row: i64,
    row: &'a RequestRow,
    a: &'a AttemptRow,
) -> [Val<'a>; ATTEMPT_COLUMNS.len()] {
    [
        Val::Int(request_row),
        Val::Text(&row.request_id),
        Val::Int(i64::from(a.seq)),
        Val::Int(ms(row.ts)),
        Val::Text(&a.endpoint),
        Val::Text(a.class.as_str()),
        Val::int(a.status.map(i64::from)),
        Val::text(a.error.as_deref()),
        Val::Real(a.latency_ms),
        Val::Int(i64::from(a.panic_mode)),
        Val::Int(i64::from(a.own_key)),
    ]
}

/// The writer's statements, all prepared once for its connection's life: preparing `BEGIN` and
/// `COMMIT` (rusqlite prepares them for every transaction) and building each INSERT's text every
/// transaction cost more than a small batch's rows (when the gateway is not busy and a
/// transaction holds a row or two). The multi-row INSERTs are [`raw::Insert`]s: persistent, so
/// kept out of the connection's lookaside memory, and holding no row's text between calls.
struct Statements<'c> {
    conn: &'c Connection,
    begin: rusqlite::Statement<'c>,
    commit: rusqlite::Statement<'c>,
    next_id: rusqlite::Statement<'c>,
    spend: rusqlite::Statement<'c>,
    spend_total: rusqlite::Statement<'c>,
    event: rusqlite::Statement<'c>,
    /// The multi-row INSERTs, prepared once: `requests[i]` inserts `ROWS_PER_INSERT[i]` rows.
    requests: [raw::Insert<'c>; ROWS_PER_INSERT.len()],
    attempts: [raw::Insert<'c>; ROWS_PER_INSERT.len()],
    /// The same for plain rows ([`plain_request`], [`plain_attempt`]).
    requests_plain: [raw::Insert<'c>; ROWS_PER_INSERT.len()],
    attempts_plain: [raw::Insert<'c>; ROWS_PER_INSERT.len()],
    /// Plain rows get their shorter INSERTs; false only in the test that holds the two shapes
    /// to the same rows.
    plain_shapes: bool,
    mark: rusqlite::Statement<'c>,
    last_mark: rusqlite::Statement<'c>,
    max_ts_from: rusqlite::Statement<'c>,
    /// Where the marks stand as of the last committed batch.
    marks: MarkState,
}

/// Request time between two marks at least (migration 11): a window's reader reads about this
/// much of the rows before its start, and the sweep keeps rows this much past the cutoff.
const MARK_EVERY_MS: i64 = 1000;

/// The writer's side of the marks (migration 11): a pure type, so the rule is unit-tested.
/// A mark `(before_ms, first_id)` is true when every request row numbered below `first_id`
/// started before `before_ms`; the writer keeps the latest start among the rows below the next
/// id and writes a mark before a row once that is a second or more past the last mark.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct MarkState {
    /// `before_ms` of the latest mark.
    last: Option<i64>,
    /// The latest `ts_ms` of the rows below `next_id` (of those written since the latest mark at
    /// least: older rows started before it).
    max_ts: Option<i64>,
    /// The id the next row gets if nobody else writes; `None` before the trail was read. Another
    /// id under the write lock means another process wrote rows, whose times are read then.
    next_id: Option<i64>,
}

impl MarkState {
    /// Row `id`, started at `ts`, is about to be written: the mark to write before it, if one
    /// is due.
    fn before_row(&mut self, id: i64, ts: i64) -> Option<(i64, i64)> {
        let due = match (self.max_ts, self.last) {
            (Some(m), None) => Some(m.saturating_add(1)),
            (Some(m), Some(last))
                if m.saturating_add(1) > last
                    && m.saturating_add(1) >= last.saturating_add(MARK_EVERY_MS) =>
            {
                Some(m.saturating_add(1))
            }
            _ => None,
        };
        if let Some(before) = due {
            self.last = Some(before);
        }
        self.max_ts = Some(self.max_ts.map_or(ts, |m| m.max(ts)));
        self.next_id = Some(id + 1);
        due.map(|before| (before, id))
    }

    /// A mark covering every row written so far (below the next id), if one is due at all: the
    /// sweep writes it before it deletes, so a trail that went quiet loses its last rows to
    /// retention too, not only once a later request is written.
    fn closing(&mut self) -> Option<(i64, i64)> {
        let (m, next) = (self.max_ts?, self.next_id?);
        let before = m.saturating_add(1);
        if self.last.is_some_and(|last| before <= last) {
            return None;
        }
        self.last = Some(before);
        Some((before, next))
    }

    /// Takes in rows written by someone else from `from` on (the latest start among them) and
    /// the latest mark as it stands in the trail.
    fn others_wrote(&mut self, max_ts: Option<i64>, last: Option<i64>) {
        self.max_ts = match (self.max_ts, max_ts) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.last = match (self.last, last) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

impl<'c> Statements<'c> {
    fn prepare(conn: &'c Connection) -> rusqlite::Result<Self> {
        let inserts = |table: &str,
                       columns: &[&str]|
         -> rusqlite::Result<[raw::Insert<'c>; ROWS_PER_INSERT.len()]> {
            let [a, b, c] = ROWS_PER_INSERT;
            let one = |n| raw::Insert::prepare(conn, &insert_sql(table, columns, n));
            Ok([one(a)?, one(b)?, one(c)?])
        };
        Ok(Statements {
            conn,
            // IMMEDIATE: the write lock from the start, so the ids read under it are still free
            // when the rows go in, even with a second gateway writing to the same data dir.
            begin: conn.prepare("BEGIN IMMEDIATE")?,
            commit: conn.prepare("COMMIT")?,
            // Never below the latest mark's first id, even if every row after it were deleted.
            next_id: conn.prepare(
                "SELECT max(coalesce((SELECT max(id) FROM requests), 0) + 1,
                            coalesce((SELECT first_id FROM request_marks ORDER BY before_ms DESC LIMIT 1), 0))",
            )?,
            spend: conn.prepare(
                "INSERT INTO client_spend (client, month, usd, requests) VALUES (?1, ?2, 0, 1)
                 ON CONFLICT (client, month) DO UPDATE SET requests = requests + 1",
            )?,
            // A key's month as it stands in memory: absolute, so a record that was dropped is
            // made good by the next, and never lowered (a row read at start is the floor).
            spend_total: conn.prepare(
                "INSERT INTO client_spend (client, month, usd, requests) VALUES (?1, ?2, ?3, 0)
                 ON CONFLICT (client, month) DO UPDATE SET usd = max(usd, excluded.usd)",
            )?,
            event: conn.prepare(
                "INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES (?1, ?2, ?3, ?4)",
            )?,
            requests: inserts("requests", &SQLITE_REQUEST_COLUMNS)?,
            attempts: inserts("attempt_rows", &ATTEMPT_COLUMNS)?,
            requests_plain: inserts(
                "requests",
                &REQUEST_PLAIN.map(|c| SQLITE_REQUEST_COLUMNS[c]),
            )?,
            attempts_plain: inserts("attempt_rows", &ATTEMPT_PLAIN.map(|c| ATTEMPT_COLUMNS[c]))?,
            plain_shapes: true,
            // OR IGNORE: a mark is a bound readers use, never needed for a row to be found; a
            // clash with one another process wrote loses nothing.
            mark: conn.prepare(
                "INSERT OR IGNORE INTO request_marks (before_ms, first_id) VALUES (?1, ?2)",
            )?,
            last_mark: conn.prepare(
                "SELECT before_ms, first_id FROM request_marks ORDER BY before_ms DESC LIMIT 1",
            )?,
            max_ts_from: conn.prepare("SELECT max(ts_ms) FROM requests WHERE id >= ?1")?,
            marks: MarkState::default(),
        })
    }

    /// Writes `batch` in one transaction (rolled back whole if any of it fails), then runs the
    /// prunes it asked for. Flush requests are collected into `flushes`, to be answered once
    /// the transaction is over.
    fn write_batch(
        &mut self,
        batch: &mut Vec<Record>,
        flushes: &mut Vec<std::sync::mpsc::Sender<()>>,
    ) -> rusqlite::Result<()> {
        let mut prunes = Vec::new();
        self.begin.raw_execute()?;
        let mut marks = self.marks;
        let written = self
            .write_records(batch, flushes, &mut prunes, &mut marks)
            .and_then(|()| self.commit.raw_execute());
        if let Err(e) = written {
            // A failed COMMIT (SQLITE_BUSY, say) leaves the transaction open.
            if !self.conn.is_autocommit() {
                let _ = self.conn.execute_batch("ROLLBACK");
            }
            return Err(e);
        }
        self.marks = marks;
        for before in prunes {
            prune(self.conn, before)?;
        }
        Ok(())
    }

    fn write_records(
        &mut self,
        batch: &mut Vec<Record>,
        flushes: &mut Vec<std::sync::mpsc::Sender<()>>,
        prunes: &mut Vec<SystemTime>,
        marks: &mut MarkState,
    ) -> rusqlite::Result<()> {
        let conn = self.conn;
        let mut next_id: i64 = self.next_id.query_row([], |r| r.get(0))?;
        if marks.next_id != Some(next_id) {
            // The trail's first batch here, or another process wrote since: the rows this
            // writer has not seen start at the id it expected next (or, at first, at the latest
            // mark; every row below it started before the mark).
            let last: Option<(i64, i64)> = self
                .last_mark
                .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            let from = marks
                .next_id
                .unwrap_or_else(|| last.map_or(0, |(_, first)| first));
            let max_ts: Option<i64> = self.max_ts_from.query_row([from], |r| r.get(0))?;
            marks.others_wrote(max_ts, last.map(|(before, _)| before));
            marks.next_id = Some(next_id);
        }
        let mut requests: Vec<(i64, Box<RequestRow>)> = Vec::new();
        for mut r in batch.drain(..) {
            r.make_safe();
            match r {
                Record::Request(row) => {
                    // The row counts the request; its cost reaches `usd` through
                    // `Record::Spend` (so a dropped row loses no spend).
                    if let Some(client) = &row.client_key {
                        self.spend
                            .execute(params![client, crate::clients::month_of(row.ts)])?;
                    }
                    if let Some((before, first)) = marks.before_row(next_id, ms(row.ts)) {
                        self.mark.execute(params![before, first])?;
                    }
                    requests.push((next_id, row));
                    next_id += 1;
                }
                Record::Event(ev) => {
                    self.event
                        .execute(params![ms(ev.ts), ev.endpoint, ev.event, ev.reason])?;
                }
                Record::Retired {
                    endpoint,
                    reason,
                    fingerprint,
                } => {
                    conn.execute(
                        "INSERT INTO endpoint_state (endpoint, retired_reason, retired_fingerprint, updated_ms) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT(endpoint) DO UPDATE SET retired_reason = excluded.retired_reason, retired_fingerprint = excluded.retired_fingerprint, updated_ms = excluded.updated_ms",
                        params![endpoint, reason, fingerprint, ms(SystemTime::now())],
                    )?;
                }
                Record::Stats(rows) => {
                    for s in rows {
                        conn.execute(
                            "INSERT INTO endpoint_state (endpoint, requests, successes, failures, ewma_latency_ms, updated_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                             ON CONFLICT(endpoint) DO UPDATE SET requests = excluded.requests, successes = excluded.successes, failures = excluded.failures, ewma_latency_ms = excluded.ewma_latency_ms, updated_ms = excluded.updated_ms",
                            params![s.endpoint, s.requests as i64, s.successes as i64, s.failures as i64, s.ewma_latency_ms, ms(SystemTime::now())],
                        )?;
                    }
                }
                Record::LearnedWindow { endpoint, learned } => {
                    let (tokens, request, fingerprint) = match learned {
                        Some((t, r, f)) => (Some(t as i64), Some(r), Some(f)),
                        None => (None, None, None),
                    };
                    conn.execute(
                        "INSERT INTO endpoint_state (endpoint, learned_context_window, learned_window_request, learned_window_fingerprint, updated_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                         ON CONFLICT(endpoint) DO UPDATE SET learned_context_window = excluded.learned_context_window, learned_window_request = excluded.learned_window_request, learned_window_fingerprint = excluded.learned_window_fingerprint, updated_ms = excluded.updated_ms",
                        params![endpoint, tokens, request, fingerprint, ms(SystemTime::now())],
                    )?;
                }
                Record::Spend(rows) => {
                    for (client, month, usd) in rows {
                        if usd.is_finite() && usd >= 0.0 {
                            self.spend_total.execute(params![client, month, usd])?;
                        }
                    }
                }
                Record::Standby {
                    standby,
                    primary,
                    up,
                } => {
                    conn.execute(
                        "INSERT INTO standby_state (standby, primary_endpoint, up, updated_ms) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT(standby) DO UPDATE SET primary_endpoint = excluded.primary_endpoint, up = excluded.up, updated_ms = excluded.updated_ms",
                        params![standby, primary, up, ms(SystemTime::now())],
                    )?;
                }
                Record::Prune(before) => prunes.push(before),
                Record::Flush(f) => flushes.push(f),
            }
        }
        if !prunes.is_empty()
            && let Some((before, first)) = marks.closing()
        {
            self.mark.execute(params![before, first])?;
        }
        // Plain rows and the rest in statements of their own (ids are explicit, so the order
        // they go in does not matter).
        let plain = self.plain_shapes;
        let (plain_requests, other_requests): (Vec<(i64, &RequestRow)>, Vec<_>) = requests
            .iter()
            .map(|(id, row)| (*id, &**row))
            .partition(|(_, row)| plain && plain_request(row));
        // A request's one plain attempt is in its row already.
        let (plain_attempts, other_attempts): (Vec<(i64, &RequestRow, &AttemptRow)>, Vec<_>) =
            requests
                .iter()
                .filter(|(_, row)| inline_attempt(row).is_none())
                .flat_map(|(id, row)| row.attempts.iter().map(move |a| (*id, &**row, a)))
                .partition(|(_, _, a)| plain && plain_attempt(a));
        let all_requests = every::<{ SQLITE_REQUEST_COLUMNS.len() }>();
        let all_attempts = every::<{ ATTEMPT_COLUMNS.len() }>();
        for (inserts, shape, rows) in [
            (
                &mut self.requests_plain,
                &REQUEST_PLAIN[..],
                &plain_requests,
            ),
            (&mut self.requests, &all_requests[..], &other_requests),
        ] {
            insert_rows(inserts, rows, |&(id, row), values| {
                let all = request_values(id, row);
                values.extend(shape.iter().map(|&c| all[c]));
            })?;
        }
        for (inserts, shape, rows) in [
            (
                &mut self.attempts_plain,
                &ATTEMPT_PLAIN[..],
                &plain_attempts,
            ),
            (&mut self.attempts, &all_attempts[..], &other_attempts),
        ] {
            insert_rows(inserts, rows, |&(id, row, a), values| {
                let all = attempt_values(id, row, a);
                values.extend(shape.iter().map(|&c| all[c]));
            })?;
        }
        Ok(())
    }
}

/// Deletes audit rows older than `before` in short transactions of `PRUNE_BATCH` rows, then
/// hands freed pages back to the file system. Returns the rows deleted.
pub fn prune(conn: &Connection, before: SystemTime) -> rusqlite::Result<usize> {
    let t = ms(before);
    let mut total = 0;
    // Requests with their attempts, a batch at a time in one transaction each: the same
    // `LIMIT` over the time index picks the same rows in both statements.
    let limit = PRUNE_BATCH as i64;
    loop {
        let tx = conn.unchecked_transaction()?;
        total += tx.execute(sql::PRUNE_ATTEMPTS, params![t, limit])?;
        let n = tx.execute(sql::PRUNE_REQUESTS, params![t, limit])?;
        tx.commit()?;
        total += n;
        if n < PRUNE_BATCH {
            break;
        }
    }
    loop {
        let n = conn.execute(sql::PRUNE_EVENTS, params![t, limit])?;
        total += n;
        if n < PRUNE_BATCH {
            break;
        }
    }
    conn.execute(sql::PRUNE_MARKS, [t])?;
    if total > 0 {
        tracing::info!(rows = total, "audit rows past retention deleted");
        // A no-op on databases created before auto_vacuum was set.
        conn.execute_batch(&format!("PRAGMA incremental_vacuum({VACUUM_PAGES})"))?;
    }
    Ok(total)
}

/// One client key's line of `autohedge stats --by-key`.
#[derive(Debug, Clone, Default)]
pub struct KeyReport {
    pub key: String,
    pub requests: u64,
    pub served: u64,
    /// Turned away at the front door or by the upstreams (any non-2xx).
    pub refused: u64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: f64,
}

/// Requests, tokens and spend per client key name since `from`, summed over `trails` (one a
/// replica), by key.
pub fn report_by_key(trails: &[Connection], from: SystemTime) -> rusqlite::Result<Vec<KeyReport>> {
    let mut out: std::collections::BTreeMap<String, KeyReport> = Default::default();
    for conn in trails {
        let mut stmt = conn.prepare(sql::BY_KEY_SINCE)?;
        let mut rows = stmt.query([ms(from)])?;
        while let Some(r) = rows.next()? {
            let key: String = r.get(0)?;
            let e = out.entry(key.clone()).or_insert_with(|| KeyReport {
                key,
                ..Default::default()
            });
            e.requests += r.get::<_, i64>(1)?.max(0) as u64;
            e.served += r.get::<_, Option<i64>>(2)?.unwrap_or(0).max(0) as u64;
            e.refused += r.get::<_, Option<i64>>(3)?.unwrap_or(0).max(0) as u64;
            e.tokens_in += r.get::<_, i64>(4)?.max(0) as u64;
            e.tokens_out += r.get::<_, i64>(5)?.max(0) as u64;
            e.cost_usd += r.get::<_, f64>(6)?;
        }
    }
    Ok(out.into_values().collect())
}

fn read_standbys_up(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare("SELECT standby FROM standby_state WHERE up = 1")?;
    let rows = stmt.query_map([], |r| r.get(0))?;
    rows.collect()
}

fn read_spend(conn: &Connection) -> rusqlite::Result<Vec<(String, String, f64)>> {
    let mut stmt = conn.prepare(sql::SPEND)?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

fn read_persisted(conn: &Connection) -> rusqlite::Result<Vec<PersistedStats>> {
    let mut stmt = conn.prepare(
        "SELECT endpoint, requests, successes, failures, ewma_latency_ms, retired_reason, retired_fingerprint, learned_context_window, learned_window_request, learned_window_fingerprint FROM endpoint_state",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(PersistedStats {
            endpoint: r.get(0)?,
            requests: r.get::<_, i64>(1)? as u64,
            successes: r.get::<_, i64>(2)? as u64,
            failures: r.get::<_, i64>(3)? as u64,
            ewma_latency_ms: r.get(4)?,
            retired_reason: r.get(5)?,
            retired_fingerprint: r.get(6)?,
            learned_context_window: r.get::<_, Option<i64>>(7)?.map(|v| v as u64),
            learned_window_request: r.get(8)?,
            learned_window_fingerprint: r.get(9)?,
        })
    })?;
    rows.collect()
}

/// `autohedge endpoint clear NAME`, offline half: lifts the persisted retirement and records it.
/// Returns whether the endpoint had been retired.
pub fn clear_endpoint(data_dir: &Path, name: &str) -> rusqlite::Result<bool> {
    let conn = open_connection(&db_path(data_dir))?;
    let was: Option<Option<String>> = conn
        .query_row(
            "SELECT retired_reason FROM endpoint_state WHERE endpoint = ?1",
            [name],
            |r| r.get(0),
        )
        .optional()?;
    conn.execute(
        "UPDATE endpoint_state SET retired_reason = NULL, retired_fingerprint = NULL, learned_context_window = NULL, learned_window_request = NULL, learned_window_fingerprint = NULL, updated_ms = ?2 WHERE endpoint = ?1",
        params![name, ms(SystemTime::now())],
    )?;
    conn.execute(
        "INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES (?1, ?2, 'cleared', 'cleared by operator (autohedge endpoint clear)')",
        params![ms(SystemTime::now()), name],
    )?;
    Ok(matches!(was, Some(Some(_))))
}

/// One endpoint's figures for `autohedge stats`.
#[derive(Debug, Default)]
pub struct EndpointReport {
    pub endpoint: String,
    pub requests: u64,
    pub ok: u64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub errors: Vec<(String, u64)>,
    /// Requests this endpoint served after at least one earlier endpoint failed.
    pub fallbacks_served: u64,
    /// Attempts on this endpoint that failed and passed the request on.
    pub fallbacks_from: u64,
}

/// Aggregates the audit trails since `since` (a wall-clock time): each replica's read on its
/// own (its row ids are its own), the counts summed and the percentiles taken over all their
/// latencies together.
pub fn report(trails: &[Connection], since: SystemTime) -> rusqlite::Result<Vec<EndpointReport>> {
    let since = ms(since);
    let mut out: std::collections::BTreeMap<String, EndpointReport> = Default::default();
    let mut lat: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut errors: std::collections::BTreeMap<(String, String), u64> = Default::default();
    for conn in trails {
        report_one(conn, since, &mut out, &mut lat, &mut errors)?;
    }
    for ((ep, class), n) in errors {
        if let Some(e) = out.get_mut(&ep) {
            e.errors.push((class, n));
        }
    }
    for (ep, mut v) in lat {
        v.sort_by(f64::total_cmp);
        if let Some(e) = out.get_mut(&ep) {
            e.p50_ms = crate::routing::stats::percentile_sorted(&v, 50.0);
            e.p95_ms = crate::routing::stats::percentile_sorted(&v, 95.0);
        }
    }
    Ok(out.into_values().collect())
}

/// One trail's part of [`report`].
fn report_one(
    conn: &Connection,
    since: i64,
    out: &mut std::collections::BTreeMap<String, EndpointReport>,
    lat: &mut std::collections::BTreeMap<String, Vec<f64>>,
    errors: &mut std::collections::BTreeMap<(String, String), u64>,
) -> rusqlite::Result<()> {
    // A window's attempts are found from its first request row (attempts carry their
    // request's time and have no time index of their own).
    let first_row: i64 = conn.query_row(sql::FIRST_ROW_SINCE, [since], |r| r.get(0))?;
    // Real attempts (not skips) per endpoint: counts, successes, latencies.
    let mut stmt = conn.prepare(sql::CALLS_SINCE)?;
    let mut rows = stmt.query(params![since, first_row])?;
    while let Some(r) = rows.next()? {
        let ep: String = r.get(0)?;
        let class: String = r.get(1)?;
        let latency: f64 = r.get(2)?;
        let e = out.entry(ep.clone()).or_insert_with(|| EndpointReport {
            endpoint: ep.clone(),
            ..Default::default()
        });
        e.requests += 1;
        if class == "ok" {
            e.ok += 1;
            lat.entry(ep).or_default().push(latency);
        } else {
            *errors.entry((ep, class)).or_default() += 1;
        }
    }
    let mut stmt = conn.prepare(sql::FALLBACKS_SERVED_SINCE)?;
    let mut rows = stmt.query([since])?;
    while let Some(r) = rows.next()? {
        let ep: String = r.get(0)?;
        let n: i64 = r.get(1)?;
        if let Some(e) = out.get_mut(&ep) {
            e.fallbacks_served += n.max(0) as u64;
        }
    }
    // Failed attempts followed by another attempt of the same request.
    let mut stmt = conn.prepare(sql::FALLBACKS_FROM_SINCE)?;
    let mut rows = stmt.query(params![since, first_row])?;
    while let Some(r) = rows.next()? {
        let ep: String = r.get(0)?;
        let n: i64 = r.get(1)?;
        if let Some(e) = out.get_mut(&ep) {
            e.fallbacks_from += n.max(0) as u64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::outcome::Outcome;

    fn row(id: &str, endpoint: &str, class: &str) -> RequestRow {
        RequestRow {
            requested_model: Some("m".into()),
            endpoint: Some(endpoint.into()),
            status: 200,
            latency_ms: 5.0,
            tokens_in: Some(3),
            tokens_out: Some(4),
            attempts: vec![
                AttemptRow {
                    panic_mode: false,
                    own_key: false,
                    seq: 1,
                    endpoint: "a".into(),
                    class: class.parse().expect("a known outcome"),
                    status: Some(503),
                    error: None,
                    latency_ms: 1.0,
                },
                AttemptRow {
                    panic_mode: false,
                    own_key: false,
                    seq: 2,
                    endpoint: endpoint.into(),
                    class: crate::routing::outcome::Outcome::Ok,
                    status: Some(200),
                    error: None,
                    latency_ms: 4.0,
                },
            ],
            ..RequestRow::new(id.into(), SystemTime::now(), "chat")
        }
    }

    /// Every reader's and the retention sweep's query searches an index (or the rowid): none
    /// scans `requests`, `attempts` or `endpoint_events`, whose size grows with traffic. The
    /// budgets' read of `client_spend` is the one whole-table read, by design (a row per key
    /// and month, all of them wanted).
    #[test]
    fn every_reader_query_uses_an_index() {
        let dir = tempfile::tempdir().unwrap();
        drop(Store::open(dir.path(), 10).unwrap());
        let conn = open_connection(&db_path(dir.path())).unwrap();
        for (name, query) in sql::ALL {
            let mut stmt = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {query}"))
                .unwrap();
            for i in 1..=stmt.parameter_count() {
                stmt.raw_bind_parameter(i, 0i64).unwrap();
            }
            let mut plan: Vec<String> = Vec::new();
            let mut rows = stmt.raw_query();
            while let Some(r) = rows.next().unwrap() {
                plan.push(r.get(3).unwrap());
            }
            // The `attempts` view is read as a co-routine over its two arms: its own reads are
            // the arms' (each checked here); scanning the co-routine's output reads no table.
            let coroutines: Vec<String> = plan
                .iter()
                .filter_map(|d| d.strip_prefix("CO-ROUTINE "))
                .map(|v| format!("SCAN {v}"))
                .collect();
            let reads: Vec<&String> = plan
                .iter()
                .filter(|d| d.starts_with("SCAN") || d.starts_with("SEARCH"))
                .filter(|d| !coroutines.contains(d))
                // A scalar subquery's one computed row (the first row of a window).
                .filter(|d| d.as_str() != "SCAN CONSTANT ROW")
                .collect();
            assert!(!reads.is_empty(), "{name}: no table read in {plan:?}");
            for d in reads {
                let indexed = d.starts_with("SEARCH")
                    && (d.contains("USING INDEX")
                        || d.contains("USING COVERING INDEX")
                        || d.contains("USING INTEGER PRIMARY KEY"));
                assert!(
                    indexed || (name == "SPEND" && d == "SCAN client_spend"),
                    "{name}: `{d}` does not use an index (plan: {plan:?})"
                );
            }
        }
    }

    #[test]
    fn writes_drains_and_reports() {
        let dir = tempfile::tempdir().unwrap();
        let opened = Store::open(dir.path(), 100).unwrap();
        let h = opened.store.handle();
        for i in 0..10 {
            h.send(Record::Request(Box::new(row(
                &format!("r{i}"),
                "b",
                "server_error",
            ))));
        }
        h.send_flag("a", Some("gone"), Some("fp"));
        drop(h);
        opened.store.close();
        let rep = report(&trails(&[dir.path()]), UNIX_EPOCH).unwrap();
        let a = rep.iter().find(|r| r.endpoint == "a").unwrap();
        let b = rep.iter().find(|r| r.endpoint == "b").unwrap();
        assert_eq!(a.requests, 10);
        assert_eq!(a.errors, vec![("server_error".to_string(), 10)]);
        assert_eq!(a.fallbacks_from, 10);
        assert_eq!(b.ok, 10);
        assert_eq!(b.fallbacks_served, 10);
        assert_eq!(b.p50_ms, Some(4.0));
        // Retirement persisted and cleared.
        let reopened = Store::open(dir.path(), 10).unwrap();
        assert_eq!(
            reopened.persisted[0].retired_reason.as_deref(),
            Some("gone")
        );
        reopened.store.close();
        assert!(clear_endpoint(dir.path(), "a").unwrap());
        let again = Store::open(dir.path(), 10).unwrap();
        assert_eq!(again.persisted[0].retired_reason, None);
        again.store.close();
    }

    fn trails(dirs: &[&Path]) -> Vec<Connection> {
        let dirs: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
        open_trails(&dirs)
            .unwrap()
            .into_iter()
            .map(|(_, c)| c)
            .collect()
    }

    /// Writes `rows` into a new trail in `dir`.
    fn write_trail(dir: &Path, rows: &[RequestRow]) {
        let opened = Store::open(dir, 100).unwrap();
        let h = opened.store.handle();
        for r in rows {
            h.send(Record::Request(Box::new(r.clone())));
        }
        drop(h);
        opened.store.close();
    }

    /// Two replicas' trails read together give what one trail holding all their rows gives:
    /// counts summed, percentiles over every latency, and each trail's request rows its own
    /// (both trails number their rows from 1: replica B's direct answers are not taken for
    /// replica A's failovers).
    #[test]
    fn several_trails_merge_as_one() {
        // Replica A: five requests failed over from `a` to `b` (b answered in 1..5 ms).
        let failed_over: Vec<RequestRow> = (1..=5)
            .map(|i| {
                let mut r = row(&format!("a{i}"), "b", "server_error");
                r.attempts[1].latency_ms = i as f64;
                r.latency_ms = i as f64 + 1.0;
                r.client_key = Some("team-a".into());
                r.cost_usd = Some(0.25);
                r
            })
            .collect();
        // Replica B: five served by `b` at once, in 10..50 ms.
        let direct: Vec<RequestRow> = (1..=5)
            .map(|i| {
                let mut r = row(&format!("b{i}"), "b", "ok");
                r.attempts.remove(0);
                r.attempts[0].seq = 1;
                r.attempts[0].latency_ms = 10.0 * i as f64;
                r.latency_ms = 10.0 * i as f64;
                r.client_key = Some(if i % 2 == 0 { "team-a" } else { "team-b" }.into());
                r.cost_usd = Some(0.5);
                r
            })
            .collect();
        let (da, db, dall) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        write_trail(da.path(), &failed_over);
        write_trail(db.path(), &direct);
        let all: Vec<RequestRow> = failed_over.iter().chain(&direct).cloned().collect();
        write_trail(dall.path(), &all);
        let merged = trails(&[da.path(), db.path()]);
        let one = trails(&[dall.path()]);

        let show = |r: Vec<EndpointReport>| format!("{r:?}");
        let m = report(&merged, UNIX_EPOCH).unwrap();
        let b = m.iter().find(|r| r.endpoint == "b").unwrap();
        assert_eq!((b.requests, b.ok, b.fallbacks_served), (10, 10, 5));
        assert_eq!(
            b.p50_ms,
            Some(5.0),
            "the median of 1..5 and 10..50 together"
        );
        assert_eq!(show(m), show(report(&one, UNIX_EPOCH).unwrap()));
        assert_ne!(
            show(report(&merged[..1], UNIX_EPOCH).unwrap()),
            show(report(&one, UNIX_EPOCH).unwrap()),
            "one trail alone is not the fleet's"
        );

        let keys = |t: &[Connection]| format!("{:?}", report_by_key(t, UNIX_EPOCH).unwrap());
        let by_key = report_by_key(&merged, UNIX_EPOCH).unwrap();
        assert_eq!(by_key.len(), 2);
        assert_eq!((by_key[0].key.as_str(), by_key[0].requests), ("team-a", 7));
        assert!((by_key[0].cost_usd - 2.25).abs() < 1e-9);
        assert_eq!(keys(&merged), keys(&one));

        // The failure report: same figures, same failovers (5 landed on `b`, not 10).
        let (since, until) = (UNIX_EPOCH, SystemTime::now() + Duration::from_secs(1));
        let r = crate::ops::report::from_conns(&merged, since, until).unwrap();
        assert_eq!((r.requests, r.failed_attempts), (10, 5));
        assert_eq!(r.endpoints["b"].landed, 5);
        assert_eq!(
            crate::ops::report::markdown(&r),
            crate::ops::report::markdown(
                &crate::ops::report::from_conns(&one, since, until).unwrap()
            )
        );
    }

    #[test]
    fn prune_deletes_rows_past_retention() {
        let dir = tempfile::tempdir().unwrap();
        let opened = Store::open(dir.path(), 100).unwrap();
        let h = opened.store.handle();
        let mut old = row("old", "b", "server_error");
        old.ts = SystemTime::now() - Duration::from_secs(3600);
        h.send(Record::Request(Box::new(old)));
        h.send(Record::Request(Box::new(row("new", "b", "server_error"))));
        h.send(Record::Prune(SystemTime::now() - Duration::from_secs(60)));
        drop(h);
        opened.store.close();
        let conn = Connection::open(db_path(dir.path())).unwrap();
        let ids: Vec<String> = conn
            .prepare("SELECT request_id FROM requests")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(ids, vec!["new"]);
        let n: i64 = conn
            .query_row("SELECT COUNT(*) FROM attempts", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 2, "only the new request's attempts remain");
    }

    #[test]
    fn prune_works_in_batches_and_vacuums() {
        let dir = tempfile::tempdir().unwrap();
        let path = db_path(dir.path());
        let mut conn = open_connection(&path).unwrap();
        let auto_vacuum: i64 = conn
            .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
            .unwrap();
        assert_eq!(auto_vacuum, 2, "new databases use incremental auto-vacuum");
        let limit: i64 = conn
            .query_row("PRAGMA journal_size_limit", [], |r| r.get(0))
            .unwrap();
        assert_eq!(limit, JOURNAL_SIZE_LIMIT);
        let old = SystemTime::now() - Duration::from_secs(3600);
        let n = PRUNE_BATCH * 2 + 17;
        let tx = conn.transaction().unwrap();
        for i in 0..n {
            tx.execute(
                "INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES (?1, 'a', 'x', ?2)",
                params![ms(old), "r".repeat(200) + &i.to_string()],
            )
            .unwrap();
        }
        tx.execute(
            "INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES (?1, 'a', 'keep', '')",
            [ms(SystemTime::now())],
        )
        .unwrap();
        tx.commit().unwrap();
        let pages =
            |c: &Connection| -> i64 { c.query_row("PRAGMA page_count", [], |r| r.get(0)).unwrap() };
        let before = pages(&conn);
        let deleted = prune(&conn, SystemTime::now() - Duration::from_secs(60)).unwrap();
        assert_eq!(deleted, n, "every old row, over several batches");
        let left: Vec<String> = conn
            .prepare("SELECT event FROM endpoint_events")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(left, vec!["keep"]);
        assert!(
            pages(&conn) < before,
            "freed pages went back: {} -> {}",
            before,
            pages(&conn)
        );
    }

    /// A request row with `n` attempts, its fields derived from `i` so each row is checkable.
    fn numbered(i: usize, n: usize) -> RequestRow {
        RequestRow {
            endpoint: Some(format!("e{}", i % 3)),
            status: 200 + (i % 7) as u16,
            latency_ms: i as f64,
            ttft_ms: i.is_multiple_of(2).then_some(0.5),
            hedges: (i % 4) as u32,
            client_key: i.is_multiple_of(5).then(|| "team".to_string()),
            cost_usd: Some(0.25),
            attempts: (0..n)
                .map(|k| AttemptRow {
                    panic_mode: k % 2 == 1,
                    own_key: false,
                    seq: k as u32 + 1,
                    endpoint: format!("e{k}"),
                    class: crate::routing::outcome::Outcome::Ok,
                    status: Some(200),
                    error: (k == 0).then(|| format!("err {i}")),
                    latency_ms: k as f64,
                })
                .collect(),
            ..RequestRow::new(
                format!("r{i}"),
                UNIX_EPOCH + Duration::from_secs(i as u64),
                "chat",
            )
        }
    }

    /// A row of every kind — each default-valued column once set, the rest at their defaults —
    /// with attempts plain and not.
    fn varied(i: usize) -> RequestRow {
        let mut r = RequestRow {
            requested_model: (!i.is_multiple_of(5)).then(|| "m".to_string()),
            endpoint: (!i.is_multiple_of(6)).then(|| format!("e{}", i % 3)),
            status: [200, 429, 503][i % 3],
            stream: i.is_multiple_of(4),
            latency_ms: i as f64 / 3.0,
            tokens_in: i.is_multiple_of(2).then_some(i as u64),
            tokens_out: i.is_multiple_of(3).then_some(7),
            tokens_estimated: i.is_multiple_of(7),
            cost_usd: (!i.is_multiple_of(2)).then_some(0.125),
            client_key: i.is_multiple_of(3).then(|| "team".to_string()),
            attempts: (0..i % 4)
                .map(|k| AttemptRow {
                    panic_mode: (i + k).is_multiple_of(5),
                    own_key: false,
                    seq: k as u32 + 1,
                    endpoint: format!("e{k}"),
                    class: [Outcome::Ok, Outcome::Timeout, Outcome::SkippedCooldown][k % 3],
                    status: (k != 1).then_some(200),
                    error: (i + k).is_multiple_of(3).then(|| format!("err {i}")),
                    latency_ms: k as f64,
                })
                .collect(),
            ..RequestRow::new(
                format!("r{i}"),
                UNIX_EPOCH + Duration::from_secs(i as u64),
                "chat",
            )
        };
        match i % 12 {
            1 => r.error_class = Some("all_failed".into()),
            2 => r.ttft_ms = Some(1.5),
            3 => r.prompt_tokens_counted = Some(40),
            4 => r.truncated_messages = 2,
            5 => r.truncated_tokens = 300,
            6 => r.sanitized_chars = 4,
            7 => r.hedges = 1,
            8 => r.hedge_won = true,
            9 => r.continued_from = Some("e2".into()),
            10 => {
                r.response_id = Some("resp_b".into());
                r.previous_response_id = Some("resp_a".into());
            }
            _ => {}
        }
        r
    }

    /// The plain rows' shorter INSERTs (their default-valued columns left out) write exactly
    /// what the full INSERTs write, column for column, and take the common rows.
    #[test]
    fn plain_rows_are_written_as_the_full_insert_writes_them() {
        let rows = |plain_shapes: bool| {
            let dir = tempfile::tempdir().unwrap();
            let conn = open_connection(&db_path(dir.path())).unwrap();
            let mut st = Statements::prepare(&conn).unwrap();
            st.plain_shapes = plain_shapes;
            let mut batch: Vec<Record> = (0..120)
                .map(|i| Record::Request(Box::new(varied(i))))
                .collect();
            st.write_batch(&mut batch, &mut Vec::new()).unwrap();
            let dump = |sql: &str| -> Vec<String> {
                let mut q = conn.prepare(sql).unwrap();
                let n = q.column_count();
                q.query_map([], |r| {
                    Ok((0..n)
                        .map(|k| format!("{:?}", r.get_ref(k).unwrap()))
                        .collect::<Vec<_>>()
                        .join("|"))
                })
                .unwrap()
                .map(Result::unwrap)
                .collect()
            };
            drop(st);
            (
                dump("SELECT * FROM requests ORDER BY id"),
                dump(&format!(
                    "SELECT {} FROM attempts ORDER BY request_row, seq",
                    ATTEMPT_COLUMNS.join(", ")
                )),
            )
        };
        let (plain, full) = (rows(true), rows(false));
        assert_eq!(plain.0.len(), 120);
        assert!(plain.1.len() > 100, "{} attempts", plain.1.len());
        assert_eq!(plain.0, full.0, "requests");
        assert_eq!(plain.1, full.1, "attempts");
        let (p, a) = (
            (0..120).filter(|i| plain_request(&varied(*i))).count(),
            (0..120)
                .flat_map(|i| varied(i).attempts)
                .filter(plain_attempt)
                .count(),
        );
        assert!((20..120).contains(&p), "{p} plain requests");
        assert!(a > 30 && a < plain.1.len(), "{a} plain attempts");
    }

    /// A request's one plain attempt is kept in its row, not in `attempt_rows`, and the
    /// `attempts` view gives it back with every column the row would have had; the attempts of
    /// requests with several, or with an error, in panic, or at another endpoint than the row's
    /// are rows as before. Readers (`stats`, `report`, export) see the same attempts.
    #[test]
    fn one_plain_attempt_lives_in_its_request_row_and_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open_connection(&db_path(dir.path())).unwrap();
        let mut st = Statements::prepare(&conn).unwrap();
        let attempt = |seq: u32, endpoint: &str, class: Outcome, error: Option<&str>| AttemptRow {
            seq,
            endpoint: endpoint.into(),
            class,
            status: Some(if class == Outcome::Ok { 200 } else { 503 }),
            error: error.map(str::to_string),
            latency_ms: 2.5 + f64::from(seq),
            panic_mode: false,
            own_key: false,
        };
        let row = |i: u64, endpoint: Option<&str>, attempts: Vec<AttemptRow>| RequestRow {
            endpoint: endpoint.map(str::to_string),
            status: 200,
            latency_ms: 3.0,
            attempts,
            ..RequestRow::new(format!("r{i}"), UNIX_EPOCH + Duration::from_secs(i), "chat")
        };
        let mut panicked = attempt(1, "a", Outcome::Ok, None);
        panicked.panic_mode = true;
        let rows = vec![
            // Inline: one plain attempt at the endpoint that served.
            row(1, Some("a"), vec![attempt(1, "a", Outcome::Ok, None)]),
            // Rows: two attempts; an error text; in panic; another endpoint; none at all.
            row(
                2,
                Some("b"),
                vec![
                    attempt(1, "a", Outcome::Server, None),
                    attempt(2, "b", Outcome::Ok, None),
                ],
            ),
            row(3, Some("a"), vec![attempt(1, "a", Outcome::Ok, Some("x"))]),
            row(4, Some("a"), vec![panicked]),
            row(5, None, vec![attempt(1, "a", Outcome::Server, None)]),
            row(6, Some("a"), vec![]),
            row(7, Some("c"), vec![attempt(1, "c", Outcome::Ok, None)]),
        ];
        let expected: Vec<String> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                r.attempts.iter().map(move |a| {
                    format!(
                        "{}|{}|{}|{}|{}|{:?}|{:?}|{}|{}|{}",
                        i + 1,
                        r.request_id,
                        a.seq,
                        a.endpoint,
                        a.class.as_str(),
                        a.status,
                        a.error,
                        a.latency_ms,
                        a.panic_mode as i64,
                        a.own_key as i64
                    )
                })
            })
            .collect();
        let mut batch: Vec<Record> = rows
            .into_iter()
            .map(|r| Record::Request(Box::new(r)))
            .collect();
        st.write_batch(&mut batch, &mut Vec::new()).unwrap();
        drop(st);
        let got: Vec<String> = conn
            .prepare("SELECT request_row, request_id, seq, endpoint, class, status, error, latency_ms, panic_mode, own_key FROM attempts ORDER BY request_row, seq")
            .unwrap()
            .query_map([], |r| {
                Ok(format!(
                    "{}|{}|{}|{}|{}|{:?}|{:?}|{}|{}|{}",
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, Option<u16>>(5)?,
                    r.get::<_, Option<String>>(6)?,
                    r.get::<_, f64>(7)?,
                    r.get::<_, i64>(8)?,
                    r.get::<_, i64>(9)?
                ))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, expected);
        let stored: Vec<i64> = conn
            .prepare("SELECT DISTINCT request_row FROM attempt_rows ORDER BY request_row")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(stored, vec![2, 3, 4, 5], "inline: requests 1 and 7");
    }

    /// A trail at `path` as the first `version` migrations left it.
    fn trail_at(path: &Path, version: usize) -> Connection {
        let conn = Connection::open(path).unwrap();
        for m in &MIGRATIONS[..version] {
            conn.execute_batch(m).unwrap();
        }
        conn.pragma_update(None, "user_version", version as i64)
            .unwrap();
        conn
    }

    /// A trail from before the attempts view (version 9) keeps every attempt readable through
    /// `attempts` after the upgrade, and new rows join them there.
    #[test]
    fn attempts_written_before_the_view_read_back_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = db_path(dir.path());
        {
            let conn = trail_at(&path, 9);
            conn.execute_batch(
                "INSERT INTO requests (id, request_id, ts_ms, operation, endpoint, status, latency_ms, attempts)
                     VALUES (1, 'old', 1000, 'chat', 'a', 200, 2.0, 1);
                 INSERT INTO attempts (request_row, request_id, seq, ts_ms, endpoint, class, status, latency_ms)
                     VALUES (1, 'old', 1, 1000, 'a', 'ok', 200, 1.5);",
            )
            .unwrap();
        }
        let conn = open_connection(&path).unwrap();
        let mut st = Statements::prepare(&conn).unwrap();
        let new = RequestRow {
            endpoint: Some("a".into()),
            status: 200,
            latency_ms: 3.0,
            attempts: vec![AttemptRow {
                seq: 1,
                endpoint: "a".into(),
                class: Outcome::Ok,
                status: Some(200),
                error: None,
                latency_ms: 2.5,
                panic_mode: false,
                own_key: false,
            }],
            ..RequestRow::new("new".into(), UNIX_EPOCH + Duration::from_secs(2), "chat")
        };
        st.write_batch(&mut vec![Record::Request(Box::new(new))], &mut Vec::new())
            .unwrap();
        drop(st);
        let got: Vec<(i64, String, f64)> = conn
            .prepare(
                "SELECT request_row, request_id, latency_ms FROM attempts ORDER BY request_row",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, vec![(1, "old".into(), 1.5), (2, "new".into(), 2.5)]);
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version as usize, MIGRATIONS.len());
    }

    #[test]
    fn a_mark_comes_once_a_second_of_request_time_and_bounds_every_row_below_it() {
        let mut m = MarkState::default();
        assert_eq!(m.before_row(1, 5_000), None, "nothing below the first row");
        assert_eq!(m.before_row(2, 5_400), Some((5_001, 2)), "the first mark");
        assert_eq!(m.before_row(3, 5_900), None, "within the second");
        // A request that started long before (a stream) moves nothing.
        assert_eq!(m.before_row(4, 1_000), None);
        assert_eq!(
            m.before_row(5, 6_200),
            None,
            "5,901 is not a second past 5,001"
        );
        assert_eq!(m.before_row(6, 6_300), Some((6_201, 6)));
        assert_eq!(m.before_row(7, 6_400), None);
        assert_eq!(m.next_id, Some(8));
        // Another process's rows count once read.
        m.others_wrote(Some(9_000), Some(8_000));
        assert_eq!(m.last, Some(8_000));
        assert_eq!(m.before_row(9, 9_100), Some((9_001, 9)));
        // The sweep's mark covers every row written, and is not written twice.
        assert_eq!(m.closing(), Some((9_101, 10)));
        assert_eq!(m.closing(), None);
        assert_eq!(MarkState::default().closing(), None, "nothing written");
        // Hostile clocks: no overflow.
        let mut m = MarkState::default();
        m.before_row(1, i64::MAX);
        assert_eq!(m.before_row(2, 0), Some((i64::MAX, 2)));
        assert_eq!(m.before_row(3, 0), None);
    }

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn count_with(conn: &Connection, sql: &str, arg: i64) -> i64 {
        conn.query_row(sql, [arg], |r| r.get(0)).unwrap()
    }

    /// Whether every mark in the trail is true: no row below its first id started at or after
    /// its time.
    fn marks_hold(conn: &Connection) {
        let broken: Vec<(i64, i64)> = conn
            .prepare(
                "SELECT m.before_ms, m.first_id FROM request_marks m
                 WHERE EXISTS (SELECT 1 FROM requests r WHERE r.id < m.first_id AND r.ts_ms >= m.before_ms)",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert!(
            broken.is_empty(),
            "marks with an older row at or after them: {broken:?}"
        );
    }

    /// The requests a window from `since` holds, read as the readers read them (from the
    /// marks), and as they are (every row).
    fn window_both_ways(conn: &Connection, since: i64) -> (Vec<i64>, Vec<i64>) {
        let read = |q: &str| -> Vec<i64> {
            conn.prepare(q)
                .unwrap()
                .query_map([since, i64::MAX], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let mut marked = read(sql::REQUESTS_BETWEEN);
        marked.sort_unstable();
        let all = read("SELECT id FROM requests WHERE ts_ms >= ?1 AND ts_ms <= ?2 ORDER BY id");
        (marked, all)
    }

    /// Two connections to one new trail (as two processes writing one data dir), and the
    /// directory that holds it.
    fn two_connections() -> (tempfile::TempDir, Connection, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = db_path(dir.path());
        let conn = open_connection(&path).unwrap();
        let other = open_connection(&path).unwrap();
        (dir, conn, other)
    }

    /// Rows written by two writers in batches, starting out of order (long requests written
    /// late, clocks a little apart): every mark stays true, a window read from the marks holds
    /// exactly the rows that started in it, and the sweep deletes only rows that started
    /// before its cutoff — rows that started long before it but were written after its mark
    /// go with a later sweep.
    #[test]
    fn marks_stay_true_and_windows_read_from_them_are_exact() {
        let (_dir, conn, other) = two_connections();
        let (mut mine, mut theirs) = (
            Statements::prepare(&conn).unwrap(),
            Statements::prepare(&other).unwrap(),
        );
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut draw = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let start = 1_700_000_000_000i64;
        let mut clock = start;
        let mut written = 0;
        for batch_no in 0..120 {
            let size = 1 + draw(40) as usize;
            let theirs_now = batch_no % 7 == 3;
            let mut batch: Vec<Record> = (0..size)
                .map(|i| {
                    clock += draw(120) as i64;
                    // One in ten started up to a minute before (a stream written at its end);
                    // the other process's clock runs 5 s ahead.
                    let ts = if draw(10) == 0 {
                        clock - draw(60_000) as i64
                    } else {
                        clock
                    } + if theirs_now { 5_000 } else { 0 };
                    let mut row = numbered(written + i, i % 3);
                    row.ts = UNIX_EPOCH + Duration::from_millis(ts as u64);
                    Record::Request(Box::new(row))
                })
                .collect();
            written += size;
            let w = if theirs_now { &mut theirs } else { &mut mine };
            w.write_batch(&mut batch, &mut Vec::new()).unwrap();
        }
        let marks: i64 = count(&conn, "SELECT count(*) FROM request_marks");
        let span_s = (clock - start) / 1000;
        // At most one a second of request time; fewer while the other clock's lead is caught
        // up.
        assert!(
            marks >= span_s / 4 && marks <= span_s + 7,
            "about a mark a second of request time: {marks} over {span_s} s"
        );
        marks_hold(&conn);
        for _ in 0..200 {
            let since = start - 60_000 + draw((clock - start + 120_000) as u64) as i64;
            let (marked, all) = window_both_ways(&conn, since);
            assert_eq!(marked, all, "window from {since}");
        }
        // The sweep: nothing that started at or after the cutoff, all that started before the
        // latest mark at or before it.
        let cutoff = start + (clock - start) / 2;
        let (_, kept_before) = window_both_ways(&conn, cutoff);
        let bound: i64 = conn
            .query_row(sql::FIRST_ROW_SINCE, [cutoff], |r| r.get(0))
            .unwrap();
        assert!(bound > 1, "a mark at or before the cutoff");
        assert!(prune(&conn, UNIX_EPOCH + Duration::from_millis(cutoff as u64)).unwrap() > 0);
        let (_, kept_after) = window_both_ways(&conn, cutoff);
        assert_eq!(
            kept_after, kept_before,
            "every row that started after the cutoff"
        );
        let below: i64 = count_with(&conn, "SELECT count(*) FROM requests WHERE id < ?1", bound);
        assert_eq!(below, 0, "every row below the cutoff's mark is gone");
        let orphans: i64 = count(
            &conn,
            "SELECT count(*) FROM attempt_rows WHERE request_row NOT IN (SELECT id FROM requests)",
        );
        assert_eq!(orphans, 0, "attempts went with their requests");
        let older_marks: i64 = count_with(
            &conn,
            "SELECT count(*) FROM request_marks WHERE first_id < ?1",
            bound,
        );
        assert_eq!(
            older_marks, 0,
            "marks before the cutoff's went with the rows"
        );
        marks_hold(&conn);
        // Windows still read exactly after the sweep, and new rows keep ids above every mark.
        let mut batch = vec![Record::Request(Box::new(numbered(written, 1)))];
        mine.write_batch(&mut batch, &mut Vec::new()).unwrap();
        marks_hold(&conn);
        for since in [cutoff, cutoff + 1, clock - 1000, clock] {
            let (marked, all) = window_both_ways(&conn, since);
            assert_eq!(marked, all, "window from {since} after the sweep");
        }
        // The writer's sweep marks every row it has written first: a trail that went quiet
        // loses its last rows to retention too (here every row started before the cutoff).
        let after_all = UNIX_EPOCH + Duration::from_millis((clock + 70_000) as u64);
        theirs
            .write_batch(&mut vec![Record::Prune(after_all)], &mut Vec::new())
            .unwrap();
        let left: i64 = count(&conn, "SELECT count(*) FROM requests");
        assert_eq!(left, 0, "every row, the last ones too");
        marks_hold(&conn);
    }

    /// A trail written before the marks (version 10) gets marks from its rows at the upgrade:
    /// true ones, about a second apart, and windows read from them hold what they should.
    #[test]
    fn a_trail_from_before_the_marks_gets_true_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = db_path(dir.path());
        {
            let conn = trail_at(&path, 10);
            let mut st = conn
                .prepare(
                    "INSERT INTO requests (id, request_id, ts_ms, operation, status, latency_ms)
                     VALUES (?1, 'r', ?2, 'chat', 200, 1.0)",
                )
                .unwrap();
            for i in 0..5_000i64 {
                // 10 a second; every 50th started 30 s before it was written.
                let ts = 1_000_000 + i * 100 - if i % 50 == 49 { 30_000 } else { 0 };
                st.execute([i + 1, ts]).unwrap();
            }
        }
        let conn = open_connection(&path).unwrap();
        let marks: i64 = count(&conn, "SELECT count(*) FROM request_marks");
        assert!((490..=501).contains(&marks), "a mark a second: {marks}");
        let index: i64 = count(
            &conn,
            "SELECT count(*) FROM sqlite_master WHERE name = 'requests_ts'",
        );
        assert_eq!(index, 0, "the time index is gone");
        marks_hold(&conn);
        for since in [
            0, 999_999, 1_000_000, 1_012_345, 1_250_050, 1_499_900, 1_600_000,
        ] {
            let (marked, all) = window_both_ways(&conn, since);
            assert_eq!(marked, all, "window from {since}");
        }
        // The writer carries on from them.
        let mut st = Statements::prepare(&conn).unwrap();
        let mut row = numbered(0, 1);
        row.ts = UNIX_EPOCH + Duration::from_millis(1_600_000);
        st.write_batch(&mut vec![Record::Request(Box::new(row))], &mut Vec::new())
            .unwrap();
        let id: i64 = conn
            .query_row("SELECT max(id) FROM requests", [], |r| r.get(0))
            .unwrap();
        assert_eq!(id, 5_001);
        marks_hold(&conn);
    }

    /// Every row of batches of every size the multi-row INSERTs split (32 + 8 + 1 rows, and
    /// the counts between), with 0 to 3 attempts each, lands once with its own values, and each
    /// attempt points at its own request — also when a second connection writes to the same
    /// database between two batches.
    #[test]
    fn multi_row_inserts_keep_every_row_and_its_attempts() {
        let (_dir, conn, other) = two_connections();
        let (mut mine, mut theirs) = (
            Statements::prepare(&conn).unwrap(),
            Statements::prepare(&other).unwrap(),
        );
        let mut next = 0;
        let mut expected_attempts = 0;
        for size in [1, 7, 8, 9, 31, 32, 33, 41, 73, 100] {
            let mut batch: Vec<Record> = (next..next + size)
                .map(|i| {
                    expected_attempts += i % 4;
                    Record::Request(Box::new(numbered(i, i % 4)))
                })
                .collect();
            next += size;
            mine.write_batch(&mut batch, &mut Vec::new()).unwrap();
            // The other writer takes the next ids in between.
            let mut one = vec![Record::Request(Box::new(numbered(next, 1)))];
            expected_attempts += 1;
            next += 1;
            theirs.write_batch(&mut one, &mut Vec::new()).unwrap();
        }
        let rows: i64 = conn
            .query_row("SELECT count(*) FROM requests", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows as usize, next);
        type Row = (
            String,
            i64,
            String,
            i64,
            f64,
            Option<f64>,
            i64,
            Option<String>,
        );
        let mut q = conn
            .prepare("SELECT request_id, ts_ms, endpoint, status, latency_ms, ttft_ms, hedges, client_key FROM requests ORDER BY id")
            .unwrap();
        let got: Vec<Row> = q
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got.len(), next);
        for (i, got) in got.into_iter().enumerate() {
            let w = numbered(i, 0);
            let want: Row = (
                w.request_id,
                i as i64 * 1000,
                w.endpoint.unwrap(),
                i64::from(w.status),
                w.latency_ms,
                w.ttft_ms,
                i64::from(w.hedges),
                w.client_key,
            );
            assert_eq!(
                got, want,
                "row {i}: in order, none lost or doubled, its own values"
            );
        }
        // Each attempt under its own request, in order, with its own values.
        let bad: i64 = conn
            .query_row(
                "SELECT count(*) FROM attempts a JOIN requests r ON r.id = a.request_row
                 WHERE a.request_id != r.request_id OR a.ts_ms != r.ts_ms",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(bad, 0);
        let attempts: i64 = conn
            .query_row("SELECT count(*) FROM attempts", [], |r| r.get(0))
            .unwrap();
        assert_eq!(attempts as usize, expected_attempts);
        let mismatched: i64 = conn
            .query_row(
                "SELECT count(*) FROM requests r WHERE r.attempts !=
                 (SELECT count(*) FROM attempts a WHERE a.request_row = r.id)",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(
            mismatched, 0,
            "every request's attempt count matches its attempt rows"
        );
        let (seq, endpoint, error, panic): (i64, String, Option<String>, bool) = conn
            .query_row(
                "SELECT seq, endpoint, error, panic_mode FROM attempts WHERE request_id = 'r42' AND seq = 2",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(
            (seq, endpoint.as_str(), error, panic),
            (2, "e1", None, true)
        );
        let first_error: Option<String> = conn
            .query_row(
                "SELECT error FROM attempts WHERE request_id = 'r42' AND seq = 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(first_error.as_deref(), Some("err 42"));
        // Client spend still counted per request row.
        let spent: i64 = conn
            .query_row(
                "SELECT requests FROM client_spend WHERE client = 'team'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(
            spent as usize,
            (0..next).filter(|i| i.is_multiple_of(5)).count()
        );
    }

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

    #[test]
    fn audit_text_is_safe_for_every_store() {
        let mut row = RequestRow::new("r\0id".into(), SystemTime::now(), "chat");
        // Multi-byte characters around the cut: it falls between characters, never in one.
        row.requested_model = Some(format!("x\0y{}", "é".repeat(400)));
        row.client_key = Some("k\0".into());
        row.attempts.push(AttemptRow {
            seq: 1,
            endpoint: "e\0".into(),
            class: crate::routing::outcome::Outcome::Server,
            status: Some(500),
            error: Some("bad\0thing".into()),
            latency_ms: 1.0,
            panic_mode: false,
            own_key: false,
        });
        let mut r = Record::Request(Box::new(row));
        r.make_safe();
        let text = format!("{r:?}");
        assert!(!text.contains("\\0"), "{text}");
        let Record::Request(row) = r else {
            unreachable!()
        };
        let model = row.requested_model.unwrap();
        assert!(model.starts_with("x\u{FFFD}y"));
        assert_eq!(model.chars().count(), MAX_REQUESTED_MODEL_CHARS);
        assert_eq!(row.request_id, "r\u{FFFD}id");
        assert_eq!(row.attempts[0].error.as_deref(), Some("bad\u{FFFD}thing"));
        // Clean text is left as it is.
        let mut clean = String::from("plain");
        assert!(!safe_text(&mut clean));
    }

    #[test]
    fn full_queue_drops_and_counts() {
        let (tx, _rx) = sync_channel(1);
        let h = StoreHandle {
            tx: Some(tx),
            dropped: Arc::new(AtomicU64::new(0)),
            written: Arc::new(AtomicU64::new(0)),
            off_reason: None,
            down: Default::default(),
            held: Default::default(),
        };
        h.send(Record::Event(EndpointEvent {
            ts: SystemTime::now(),
            endpoint: "a".into(),
            event: "x".into(),
            reason: "y".into(),
        }));
        h.send(Record::Event(EndpointEvent {
            ts: SystemTime::now(),
            endpoint: "a".into(),
            event: "x".into(),
            reason: "y".into(),
        }));
        assert_eq!(h.dropped(), 1);
    }
}
