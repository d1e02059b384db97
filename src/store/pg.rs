//! PostgreSQL as the audit store (`audit: { store: postgres, url: … }`), beside the embedded
//! SQLite: the same tables, columns and meaning, and the same versioned migrations (version N here
//! is version N there, each run in one transaction under an advisory lock, so replicas starting
//! at once do not race), written the same way — one writer on its own thread behind the same
//! bounded queue ([`super::StoreHandle`]), batches of rows in one transaction, multi-row
//! `INSERT`s, request ids from the table's sequence.
//!
//! A store that is down or slow never holds a request: the writer drops (and counts) what it
//! cannot write, says why (`/health` `degraded`, `/status.audit.state`, the `audit` alert on
//! drops), and reconnects with backoff. The readers (`stats`, `report`, `audit export`) copy the
//! window they read into a SQLite file and run the SQLite readers on it ([`snapshot`]): one
//! query layer for the analytics, so both stores give the same figures by construction.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::time::{Duration, Instant, SystemTime};

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls};

use super::{
    ATTEMPT_COLUMNS, BATCH, GATHER, Opened, PersistedStats, REQUEST_COLUMNS, Record, RequestRow,
    Store, StoreHandle, ms,
};
use crate::config::PgSettings;

/// The migrations, version for version the SQLite ones (`super::MIGRATIONS`), in PostgreSQL's
/// dialect: the same tables and columns (integers as `BIGINT`, reals as `DOUBLE PRECISION`).
const MIGRATIONS: &[&str] = &[
    // 1: the audit trail and endpoint state.
    r#"
    CREATE TABLE requests (
        id BIGSERIAL PRIMARY KEY,
        request_id TEXT NOT NULL,
        ts_ms BIGINT NOT NULL,
        operation TEXT NOT NULL,
        requested_model TEXT,
        endpoint TEXT,
        status BIGINT NOT NULL,
        error_class TEXT,
        stream BIGINT NOT NULL DEFAULT 0,
        latency_ms DOUBLE PRECISION NOT NULL,
        ttft_ms DOUBLE PRECISION,
        tokens_in BIGINT,
        tokens_out BIGINT,
        tokens_estimated BIGINT NOT NULL DEFAULT 0,
        cost_usd DOUBLE PRECISION,
        attempts BIGINT NOT NULL DEFAULT 0
    );
    CREATE INDEX requests_ts ON requests(ts_ms);
    CREATE TABLE attempts (
        id BIGSERIAL PRIMARY KEY,
        request_row BIGINT NOT NULL REFERENCES requests(id),
        request_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        ts_ms BIGINT NOT NULL,
        endpoint TEXT NOT NULL,
        class TEXT NOT NULL,
        status BIGINT,
        error TEXT,
        latency_ms DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX attempts_request_row ON attempts(request_row, seq);
    CREATE INDEX attempts_ts ON attempts(ts_ms);
    CREATE TABLE endpoint_events (
        id BIGSERIAL PRIMARY KEY,
        ts_ms BIGINT NOT NULL,
        endpoint TEXT NOT NULL,
        event TEXT NOT NULL,
        reason TEXT NOT NULL
    );
    CREATE INDEX endpoint_events_endpoint ON endpoint_events(endpoint, ts_ms);
    CREATE TABLE endpoint_state (
        endpoint TEXT PRIMARY KEY,
        requests BIGINT NOT NULL DEFAULT 0,
        successes BIGINT NOT NULL DEFAULT 0,
        failures BIGINT NOT NULL DEFAULT 0,
        ewma_latency_ms DOUBLE PRECISION,
        retired_reason TEXT,
        retired_fingerprint TEXT,
        updated_ms BIGINT NOT NULL
    );
    "#,
    // 2: the context-window guard's columns; learned windows.
    r#"
    ALTER TABLE requests ADD COLUMN prompt_tokens_counted BIGINT;
    ALTER TABLE requests ADD COLUMN truncated_messages BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN truncated_tokens BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN sanitized_chars BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE endpoint_state ADD COLUMN learned_context_window BIGINT;
    "#,
    // 3: attempts tried although health said to skip them.
    r#"
    ALTER TABLE attempts ADD COLUMN panic_mode BIGINT NOT NULL DEFAULT 0;
    "#,
    // 4: hedges, continuations, client keys and their spend.
    r#"
    ALTER TABLE requests ADD COLUMN hedges BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN hedge_won BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE requests ADD COLUMN continued_from TEXT;
    ALTER TABLE requests ADD COLUMN client_key TEXT;
    CREATE TABLE client_spend (
        client TEXT NOT NULL,
        month TEXT NOT NULL,
        usd DOUBLE PRECISION NOT NULL DEFAULT 0,
        requests BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (client, month)
    );
    "#,
    // 5: attempts lose their time index (read from their request's row).
    r#"
    DROP INDEX IF EXISTS attempts_ts;
    "#,
    // 6: a learned window's request and fingerprint; attempts with the request's own key.
    r#"
    ALTER TABLE endpoint_state ADD COLUMN learned_window_request TEXT;
    ALTER TABLE endpoint_state ADD COLUMN learned_window_fingerprint TEXT;
    UPDATE endpoint_state SET learned_context_window = NULL;
    ALTER TABLE attempts ADD COLUMN own_key BIGINT NOT NULL DEFAULT 0;
    "#,
    // 7: standbys remediation scaled up.
    r#"
    CREATE TABLE standby_state (
        standby TEXT PRIMARY KEY,
        primary_endpoint TEXT NOT NULL,
        up BIGINT NOT NULL,
        updated_ms BIGINT NOT NULL
    );
    "#,
    // 8: endpoint events indexed by time only.
    r#"
    DROP INDEX IF EXISTS endpoint_events_endpoint;
    CREATE INDEX endpoint_events_ts ON endpoint_events(ts_ms);
    "#,
    // 9: `/v1/responses` ids.
    r#"
    ALTER TABLE requests ADD COLUMN response_id TEXT;
    ALTER TABLE requests ADD COLUMN previous_response_id TEXT;
    "#,
    // 10: SQLite keeps a request's one plain attempt in its row (its writer's cost); the same
    // columns here keep the tables alike, but this writer leaves them empty and keeps every
    // attempt a row of `attempts`, as before.
    r#"
    ALTER TABLE requests ADD COLUMN attempt_class TEXT;
    ALTER TABLE requests ADD COLUMN attempt_status BIGINT;
    ALTER TABLE requests ADD COLUMN attempt_latency_ms DOUBLE PRECISION;
    "#,
    // 11: SQLite's writer replaced its time index on `requests` by marks (its writer's cost);
    // the table here keeps the schemas alike, empty: PostgreSQL keeps `requests_ts`, and its
    // readers use it.
    r#"
    CREATE TABLE request_marks (
        before_ms BIGINT PRIMARY KEY,
        first_id BIGINT NOT NULL
    );
    "#,
    // 12: the batches this writer committed, by the token it gave each: a batch sent again
    // after a call that timed out (and may have committed) is written once.
    r#"
    CREATE TABLE audit_batches (
        token TEXT PRIMARY KEY,
        ts_ms BIGINT NOT NULL
    );
    CREATE INDEX audit_batches_ts ON audit_batches(ts_ms);
    "#,
    // 13: the address an attempt went to (an endpoint of several).
    r#"
    ALTER TABLE attempts ADD COLUMN address TEXT;
    "#,
    // 14: the request's trace id (W3C), when it was traced: one finds the other.
    r#"
    ALTER TABLE requests ADD COLUMN trace_id TEXT;
    "#,
    // 15: replay: the request a row replayed, and the bodies kept beside a row; the kept answer
    // (last resort, cache) that served a row.
    r#"
    ALTER TABLE requests ADD COLUMN replay_of TEXT;
    ALTER TABLE requests ADD COLUMN served_from TEXT;
    CREATE TABLE request_bodies (
        request_row BIGINT PRIMARY KEY,
        request_id TEXT NOT NULL,
        request_body TEXT NOT NULL,
        request_cut BIGINT NOT NULL DEFAULT 0,
        response_body TEXT,
        response_cut BIGINT NOT NULL DEFAULT 0,
        own_key BIGINT NOT NULL DEFAULT 0
    );
    CREATE INDEX request_bodies_request_id ON request_bodies(request_id);
    "#,
];

/// The advisory lock every replica's migration takes (any constant; "autohedge" in ASCII).
const MIGRATION_LOCK: i64 = 0x6175_746f_6865_6467;

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a batch may take to write before the store counts as slow (its records dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Reconnection backoff: from this, doubling, to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Rows one multi-row `INSERT` carries (26 columns: far below PostgreSQL's 65,535 parameters).
const ROWS_PER_INSERT: usize = 256;

/// Connects (within [`CONNECT_TIMEOUT`]) and drives the connection on `rt`.
async fn connect(url: &str) -> Result<Client, String> {
    let (client, conn) = tokio::time::timeout(CONNECT_TIMEOUT, tokio_postgres::connect(url, NoTls))
        .await
        .map_err(|_| "no answer within 3s".to_string())?
        .map_err(|e| error_text(&e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "audit store connection ended");
        }
    });
    Ok(client)
}

/// `replay`: the kept requests of id `request_id` in PostgreSQL, newest first, on a connection
/// of its own, within `within`.
pub async fn find_kept(
    settings: &PgSettings,
    request_id: &str,
    key: Option<&str>,
    within: Duration,
) -> Result<Vec<super::bodies::Source>, String> {
    tokio::time::timeout(within, async {
        let client = connect(settings.url.expose()).await?;
        super::bodies::find_pg(&client, request_id, key)
            .await
            .map_err(|e| error_text(&e))
    })
    .await
    .map_err(|_| format!("no answer within {within:?}"))?
}

/// An error without anything of the URL (tokio-postgres never prints the password; the text
/// is bounded).
fn error_text(e: &tokio_postgres::Error) -> String {
    let mut s = e.to_string();
    if let Some(db) = e.as_db_error() {
        s = format!("{}: {}", db.code().code(), db.message());
    }
    s.chars().take(300).collect()
}

/// Applies the pending migrations in one transaction, under [`MIGRATION_LOCK`]: replicas that
/// start together wait for the first, then find nothing to do. `up_to` stops early (tests make
/// a database at an older version with it).
pub async fn migrate(client: &mut Client, up_to: Option<usize>) -> Result<usize, String> {
    let target = up_to.unwrap_or(MIGRATIONS.len()).min(MIGRATIONS.len());
    let e = |e: tokio_postgres::Error| error_text(&e);
    let tx = client.transaction().await.map_err(e)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(e)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS autohedge_schema (version BIGINT NOT NULL)")
        .await
        .map_err(e)?;
    let version: i64 = match tx
        .query_opt("SELECT version FROM autohedge_schema", &[])
        .await
        .map_err(e)?
    {
        Some(row) => row.get(0),
        None => {
            tx.execute("INSERT INTO autohedge_schema (version) VALUES (0)", &[])
                .await
                .map_err(e)?;
            0
        }
    };
    let from = version.max(0) as usize;
    for sql in MIGRATIONS.iter().take(target).skip(from) {
        tx.batch_execute(sql).await.map_err(e)?;
    }
    if target > from {
        tx.execute(
            "UPDATE autohedge_schema SET version = $1",
            &[&(target as i64)],
        )
        .await
        .map_err(e)?;
    }
    tx.commit().await.map_err(e)?;
    Ok(target.max(from))
}

/// What the gateway reads at start: endpoint state, this month's spend, standbys left up.
struct Persisted {
    stats: Vec<PersistedStats>,
    spend: Vec<(String, String, f64)>,
    standbys_up: Vec<String>,
}

async fn read_persisted(client: &Client) -> Result<Persisted, String> {
    let e = |e: tokio_postgres::Error| error_text(&e);
    let stats = client
        .query(
            "SELECT endpoint, requests, successes, failures, ewma_latency_ms, retired_reason, retired_fingerprint, learned_context_window, learned_window_request, learned_window_fingerprint FROM endpoint_state",
            &[],
        )
        .await
        .map_err(e)?
        .iter()
        .map(|r| PersistedStats {
            endpoint: r.get(0),
            requests: r.get::<_, i64>(1).max(0) as u64,
            successes: r.get::<_, i64>(2).max(0) as u64,
            failures: r.get::<_, i64>(3).max(0) as u64,
            ewma_latency_ms: r.get(4),
            retired_reason: r.get(5),
            retired_fingerprint: r.get(6),
            learned_context_window: r.get::<_, Option<i64>>(7).map(|v| v.max(0) as u64),
            learned_window_request: r.get(8),
            learned_window_fingerprint: r.get(9),
        })
        .collect();
    let spend = client
        .query(super::sql::SPEND, &[])
        .await
        .map_err(e)?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let standbys_up = client
        .query("SELECT standby FROM standby_state WHERE up = 1", &[])
        .await
        .map_err(e)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(Persisted {
        stats,
        spend,
        standbys_up,
    })
}

/// Connects, migrates and reads what the gateway needs at start.
async fn start(url: &str) -> Result<(Client, Persisted), String> {
    let mut client = connect(url).await?;
    migrate(&mut client, None).await?;
    let persisted = read_persisted(&client).await?;
    Ok((client, persisted))
}

/// Opens the PostgreSQL trail and starts its writer. A store that cannot be reached does not
/// stop the gateway: it starts with the trail down (and nothing read), and the writer keeps
/// trying to reach it.
///
/// `spool_dir` (the data dir) holds the spool, `audit-spool.jsonl`: records that wait there
/// while the store is away, written in order, each once, when it is back (also after a
/// restart). `None` (`audit import`): nothing is spooled.
pub fn open(settings: &PgSettings, capacity: usize, spool_dir: Option<&Path>) -> Opened {
    let (tx, rx) = sync_channel(capacity);
    let dropped = Arc::new(AtomicU64::new(0));
    let written = Arc::new(AtomicU64::new(0));
    let down: Arc<std::sync::Mutex<Option<String>>> = Default::default();
    let held: Arc<super::Held> = Default::default();
    let handle = StoreHandle {
        tx: Some(tx),
        dropped: dropped.clone(),
        written: written.clone(),
        off_reason: None,
        down: down.clone(),
        held: held.clone(),
    };
    let spool = spool_dir.map(|d| Spool::open(d, settings.spool_max_bytes, held.clone()));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let url = settings.url.expose().to_string();
    let display = settings.display.clone();
    let thread = std::thread::Builder::new()
        .name("autohedge-audit".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("cannot start the audit writer: {e}")));
                    return;
                }
            };
            let first = rt.block_on(start(&url));
            let (client, persisted) = match first {
                Ok((c, p)) => (Some(c), Ok(p)),
                Err(e) => (None, Err(e)),
            };
            let _ = ready_tx.send(persisted);
            let w = Writer {
                rt,
                url,
                display,
                client,
                dropped,
                written,
                down,
                backoff: BACKOFF_MIN,
                next_try: Instant::now(),
                spool,
                state: VecDeque::new(),
                held,
                tokens_swept: Instant::now(),
            };
            w.run(rx);
        });
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            return Opened {
                store: Store {
                    handle: StoreHandle::off(format!("cannot start the audit writer: {e}")),
                    thread: None,
                },
                persisted: Vec::new(),
                spend: Vec::new(),
                standbys_up: Vec::new(),
            };
        }
    };
    let persisted = match ready_rx.recv_timeout(CONNECT_TIMEOUT * 4) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::error!(store = %settings.display, error = %e, "audit store (PostgreSQL) unreachable at start: serving with the trail down until it is back");
            set_down(&handle.down, Some(format!("postgres unreachable: {e}")));
            Persisted {
                stats: Vec::new(),
                spend: Vec::new(),
                standbys_up: Vec::new(),
            }
        }
        Err(_) => {
            set_down(
                &handle.down,
                Some("postgres: no answer at start".to_string()),
            );
            Persisted {
                stats: Vec::new(),
                spend: Vec::new(),
                standbys_up: Vec::new(),
            }
        }
    };
    Opened {
        store: Store { handle, thread },
        persisted: persisted.stats,
        spend: persisted.spend,
        standbys_up: persisted.standbys_up,
    }
}

fn set_down(down: &std::sync::Mutex<Option<String>>, why: Option<String>) {
    *down.lock().unwrap_or_else(|e| e.into_inner()) = why;
}

struct Writer {
    rt: tokio::runtime::Runtime,
    url: String,
    display: String,
    client: Option<Client>,
    dropped: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    down: Arc<std::sync::Mutex<Option<String>>>,
    backoff: Duration,
    next_try: Instant,
    /// Trail records (requests, events, spend) waiting for the store, in order.
    spool: Option<Spool>,
    /// Endpoint state records (retirements, learned windows, standbys, stats) waiting for the
    /// store: kept in memory, the newest [`STATE_HELD`].
    state: VecDeque<Record>,
    held: Arc<super::Held>,
    /// When batch tokens older than [`TOKENS_KEPT`] were last deleted.
    tokens_swept: Instant,
}

/// How long a batch's token is kept: far longer than a batch waits to be sent again, whatever
/// `audit_retention` says (tokens are deleted on their own, hourly).
const TOKENS_KEPT: Duration = Duration::from_secs(86_400);

/// Batches [`Writer::catch_up`] writes before the writer reads its queue again.
const CATCH_UP_BATCHES: usize = 8;

/// Endpoint state records held in memory while the store is away (each replaces what it
/// says; the oldest go first).
const STATE_HELD: usize = 10_000;

/// Why a batch was not written.
enum WriteError {
    /// The store refused what it was sent (a value, a constraint): the connection is fine,
    /// and the same records sent again would be refused again.
    Refused(String),
    /// The store is away or did not answer: nothing is known to be written.
    Away(String),
}

impl Writer {
    fn run(mut self, rx: Receiver<Record>) {
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            // Wakes every second while idle, so a store that is down is tried again (and
            // `/health` turns back to ok, the spool drains) without waiting for traffic.
            // While the spool drains, the queue is looked at between its batches.
            let behind = self.spool.as_ref().is_some_and(|s| !s.is_empty());
            let wait = if behind && self.client.is_some() {
                Duration::from_millis(5)
            } else {
                Duration::from_secs(1)
            };
            match rx.recv_timeout(wait) {
                Ok(first) => batch.push(first),
                Err(RecvTimeoutError::Timeout) => {
                    if self.client.is_none() {
                        self.reconnect();
                    }
                    self.catch_up();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Shutting down: what the spool holds stays on disk for the next start.
                    self.catch_up();
                    return;
                }
            }
            let deadline = Instant::now() + GATHER;
            loop {
                while batch.len() < BATCH {
                    match rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                let flush = batch.iter().any(|r| matches!(r, Record::Flush(_)));
                if flush || batch.len() >= BATCH || Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            self.write(&mut batch);
        }
    }

    /// Tries to (re)connect, no sooner than the backoff allows.
    fn reconnect(&mut self) {
        if Instant::now() < self.next_try {
            return;
        }
        let url = self.url.clone();
        match self.rt.block_on(async {
            let mut c = connect(&url).await?;
            migrate(&mut c, None).await?;
            Ok::<_, String>(c)
        }) {
            Ok(c) => {
                self.client = Some(c);
                self.backoff = BACKOFF_MIN;
                if self.down.lock().is_ok_and(|d| d.is_some()) {
                    tracing::info!(store = %self.display, "audit store (PostgreSQL) reachable again: writing resumes");
                }
                set_down(&self.down, None);
            }
            Err(e) => {
                set_down(&self.down, Some(format!("postgres unreachable: {e}")));
                self.next_try = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
            }
        }
    }

    /// The connection, made again (with backoff) when it is gone.
    fn connected(&mut self) -> bool {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = None;
            self.reconnect();
        }
        self.client.is_some()
    }

    /// Sends `records` in one transaction under `token` (the same token for the same records
    /// whenever they are sent again).
    fn send(&mut self, records: &[Record], token: &str) -> Result<(), WriteError> {
        let Some(client) = self.client.as_mut() else {
            return Err(WriteError::Away(
                self.down
                    .lock()
                    .ok()
                    .and_then(|d| d.clone())
                    .unwrap_or_else(|| "postgres unreachable".into()),
            ));
        };
        let result = self.rt.block_on(async {
            let prunes = tokio::time::timeout(WRITE_TIMEOUT, write_records(client, records, token))
                .await
                .unwrap_or_else(|_| Err(WriteError::Away("no answer within 10s".into())))?;
            for before in prunes {
                if let Err(e) = prune(client, before).await {
                    tracing::warn!(error = %e, "audit retention (PostgreSQL) failed; tried again at the next sweep");
                }
            }
            Ok(())
        });
        if result.is_ok() && self.tokens_swept.elapsed() >= Duration::from_secs(3600) {
            self.tokens_swept = Instant::now();
            let before = ms(SystemTime::now()
                .checked_sub(TOKENS_KEPT)
                .unwrap_or(SystemTime::UNIX_EPOCH));
            if let Some(client) = self.client.as_mut() {
                let swept = self.rt.block_on(async {
                    tokio::time::timeout(
                        WRITE_TIMEOUT,
                        client.execute("DELETE FROM audit_batches WHERE ts_ms < $1", &[&before]),
                    )
                    .await
                });
                if !matches!(swept, Ok(Ok(_))) {
                    tracing::debug!("old audit batch tokens not deleted; tried again in an hour");
                }
            }
        }
        if let Err(WriteError::Away(e)) = &result {
            // A failed connection is made again (with backoff) for the next batch; one that
            // did not answer in time is not trusted with the next.
            self.client = None;
            set_down(&self.down, Some(format!("postgres unreachable: {e}")));
        }
        result
    }

    fn write(&mut self, batch: &mut Vec<Record>) {
        let mut flushes = Vec::new();
        let mut records = Vec::with_capacity(batch.len());
        for mut r in batch.drain(..) {
            match r {
                Record::Flush(f) => flushes.push(f),
                _ => {
                    r.make_safe();
                    records.push(r);
                }
            }
        }
        // What waits already goes first: the trail is written in order.
        let behind = self.spool.as_ref().is_some_and(|s| !s.is_empty()) || !self.state.is_empty();
        let token = new_token();
        if behind || !self.connected() {
            self.hold(records, &token);
            self.catch_up();
        } else {
            match self.send(&records, &token) {
                Ok(()) => self.counted_written(&records),
                Err(WriteError::Refused(e)) => self.one_by_one(records, &e),
                // Perhaps committed: it waits under the same token, which the store knows
                // if it was.
                Err(WriteError::Away(_)) => self.hold(records, &token),
            }
        }
        for f in flushes {
            let _ = f.send(());
        }
    }

    fn counted_written(&self, records: &[Record]) {
        let n = records
            .iter()
            .filter(|r| !matches!(r, Record::Prune(_)))
            .count() as u64;
        self.written.fetch_add(n, Ordering::Relaxed);
    }

    /// A batch the store refused: each record again in a transaction of its own, so one bad
    /// record costs no other; a record refused alone is set aside (logged with its request id,
    /// counted).
    fn one_by_one(&mut self, records: Vec<Record>, why: &str) {
        tracing::warn!(store = %self.display, error = %why, records = records.len(), "audit batch refused by PostgreSQL: writing its records one by one");
        let mut rest = records.into_iter();
        while let Some(r) = rest.next() {
            let token = new_token();
            match self.send(std::slice::from_ref(&r), &token) {
                Ok(()) => self.counted_written(std::slice::from_ref(&r)),
                Err(WriteError::Refused(e)) => {
                    let total = self.held.set_aside.fetch_add(1, Ordering::Relaxed) + 1;
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(store = %self.display, request_id = r.request_id().unwrap_or(""), error = %e, set_aside_total = total, "audit record refused by PostgreSQL: set aside");
                }
                Err(WriteError::Away(_)) => {
                    // The store went away meanwhile: this record (under its token: it may
                    // have been written) and the rest wait.
                    self.hold(vec![r], &token);
                    self.hold(rest.collect(), &new_token());
                    return;
                }
            }
        }
    }

    /// Records that cannot be written now: the trail's to the spool (in order), endpoint state
    /// in memory; without a spool (or past its limit) they are dropped and counted.
    fn hold(&mut self, records: Vec<Record>, token: &str) {
        let mut lost = 0u64;
        let mut marked = false;
        for mut r in records {
            // Past half the spool, rows go on without their kept bodies: a body never costs a
            // row (or a key's spend) its place.
            if let (Record::Request(row), Some(spool)) = (&mut r, &self.spool)
                && row.bodies.is_some()
                && spool.past_half()
            {
                row.bodies = None;
                metrics::counter!("autohedge_audit_bodies_dropped_total").increment(1);
            }
            match r {
                Record::Prune(_) | Record::Flush(_) => {}
                Record::Request(_) | Record::Event(_) | Record::Spend(_) => match &mut self.spool {
                    Some(spool) => {
                        // The batch's line goes before its first record (a batch with none has
                        // none).
                        if !marked {
                            marked = spool.mark(token);
                        }
                        if !marked || !spool.push(&r) {
                            lost += 1;
                        }
                    }
                    None => lost += 1,
                },
                state => {
                    if self.state.len() >= STATE_HELD {
                        self.state.pop_front();
                        lost += 1;
                    }
                    self.state.push_back(state);
                }
            }
        }
        if let Some(spool) = &mut self.spool {
            spool.sync();
        }
        if lost > 0 {
            let total = self.dropped.fetch_add(lost, Ordering::Relaxed) + lost;
            tracing::warn!(store = %self.display, dropped = lost, dropped_total = total, "audit store (PostgreSQL) away and its spool full (audit.spool_max_bytes): records dropped");
        }
    }

    /// Writes what waits (the spool, then endpoint state), in order, while the store takes it.
    fn catch_up(&mut self) {
        // A few batches a call: the writer goes back to its queue in between (what came
        // meanwhile joins the spool's end, in order), so a long drain drops nothing new.
        for _ in 0..CATCH_UP_BATCHES {
            let waiting = self.spool.as_ref().is_some_and(|s| !s.is_empty());
            if !waiting && self.state.is_empty() {
                return;
            }
            if !self.connected() {
                return;
            }
            if waiting {
                let Some(spool) = self.spool.as_mut() else {
                    return;
                };
                let (token, records, bad) = match spool.peek(BATCH) {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::error!(store = %self.display, error = %e, "the audit spool cannot be read: its records are set aside");
                        spool.discard();
                        continue;
                    }
                };
                if bad > 0 {
                    self.held.set_aside.fetch_add(bad, Ordering::Relaxed);
                    tracing::error!(store = %self.display, lines = bad, "audit spool lines that do not read as records: set aside");
                }
                match self.send(&records, &token) {
                    Ok(()) => self.counted_written(&records),
                    Err(WriteError::Refused(e)) => {
                        // Written or set aside one by one; what a new outage leaves goes back
                        // to the spool's end (after what is left of this batch's lines).
                        self.spool_consumed();
                        self.one_by_one(records, &e);
                        continue;
                    }
                    Err(WriteError::Away(_)) => return,
                }
                self.spool_consumed();
            } else {
                let records: Vec<Record> = self.state.drain(..).collect();
                match self.send(&records, &new_token()) {
                    Ok(()) => self.counted_written(&records),
                    Err(WriteError::Refused(e)) => self.one_by_one(records, &e),
                    Err(WriteError::Away(_)) => {
                        for r in records.into_iter().rev() {
                            self.state.push_front(r);
                        }
                        return;
                    }
                }
            }
        }
    }

    /// The lines the last [`Spool::peek`] gave are written: the spool moves past them.
    fn spool_consumed(&mut self) {
        if let Some(spool) = self.spool.as_mut()
            && let Err(e) = spool.consume()
        {
            tracing::error!(store = %self.display, error = %e, "the audit spool's progress cannot be saved");
        }
    }
}

/// The token a spool line names, when it is a batch line.
fn batch_token(line: &str) -> Option<String> {
    if !line.starts_with("{\"batch\"") {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(line.trim_end()).ok()?;
    v.get("batch")?.as_str().map(str::to_string)
}

/// A batch's token: unique among every replica's (a v4 UUID).
fn new_token() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The spool: trail records waiting for PostgreSQL, as the lines `audit export` writes
/// (`audit-spool.jsonl` in the data dir), appended while the store is away and read from the
/// front when it is back. How far it was written is kept beside it (`audit-spool.done`, the
/// byte offset, replaced atomically after each written batch), so a restart resumes where the
/// last run stopped instead of writing a line twice. Each group of records held together is
/// preceded by a line naming its batch token (`{"batch": "…"}`): read back as the same batch
/// under the same token, it is written once even if its first sending had committed. Empty,
/// both files are removed.
struct Spool {
    path: std::path::PathBuf,
    done_path: std::path::PathBuf,
    max_bytes: u64,
    /// The file's length, and how far its lines are written.
    len: u64,
    done: u64,
    /// Where the last `peek` stopped (its lines end there), and how many lines it read.
    peeked_to: u64,
    peeked_lines: u64,
    file: Option<std::fs::File>,
    held: Arc<super::Held>,
    /// A line being made (reused).
    line: String,
    /// This opening's own name, for the tokens of records read without a batch line.
    id: String,
}

impl Spool {
    fn open(dir: &Path, max_bytes: u64, held: Arc<super::Held>) -> Spool {
        // The data dir of a gateway whose trail is in PostgreSQL may not exist yet.
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "the audit spool's directory cannot be made: records are dropped while PostgreSQL is away");
        }
        let path = dir.join("audit-spool.jsonl");
        let done_path = dir.join("audit-spool.done");
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let done = std::fs::read_to_string(&done_path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0)
            .min(len);
        let s = Spool {
            path,
            done_path,
            max_bytes,
            len,
            done,
            peeked_to: done,
            peeked_lines: 0,
            file: None,
            held,
            line: String::new(),
            id: new_token(),
        };
        if s.len > 0 {
            // Records a run before this one left: counted as waiting (lines, not parsed).
            // Read as it streams by, a line at a time (the file may be a GiB).
            let lines = (|| -> std::io::Result<u64> {
                use std::io::{BufRead, Seek, SeekFrom};
                let mut f = std::io::BufReader::new(std::fs::File::open(&s.path)?);
                f.seek(SeekFrom::Start(s.done))?;
                let (mut n, mut line) = (0u64, Vec::new());
                loop {
                    line.clear();
                    if f.read_until(b'\n', &mut line)? == 0 {
                        return Ok(n);
                    }
                    if line != b"\n" && !line.starts_with(b"{\"batch\"") {
                        n += 1;
                    }
                }
            })()
            .unwrap_or(0);
            s.held.spooled_records.store(lines, Ordering::Relaxed);
            tracing::info!(spool = %s.path.display(), records = lines, "audit spool from an earlier run: written once PostgreSQL answers");
        }
        s.publish();
        s
    }

    fn is_empty(&self) -> bool {
        self.done >= self.len
    }

    fn publish(&self) {
        self.held
            .spooled_bytes
            .store(self.len.saturating_sub(self.done), Ordering::Relaxed);
    }

    /// Starts a batch: the records pushed next are read back together under `token`. `false`
    /// when it cannot be written (the limit, the disk): the batch's records are not kept.
    fn mark(&mut self, token: &str) -> bool {
        self.line = format!("{}\n", serde_json::json!({ "batch": token }));
        self.append()
    }

    /// Appends `self.line` within the limit; `false` (nothing appended) when it would pass it
    /// or cannot be written (a partial write is cut back off: the file stays whole lines).
    /// More than half of `max_bytes` waits in it.
    fn past_half(&self) -> bool {
        self.len.saturating_sub(self.done) > self.max_bytes / 2
    }

    fn append(&mut self) -> bool {
        use std::io::Write;
        let n = self.line.len() as u64;
        if self.len.saturating_sub(self.done) + n > self.max_bytes {
            return false;
        }
        // The file holds what was written too until the spool empties: with a store that
        // comes and goes it never may, so past the limit on disk the written front is cut off
        // (once it is a quarter of the limit: a copy of the rest, now and then).
        if self.len + n > self.max_bytes
            && self.done >= self.max_bytes / 4
            && self.compact().is_err()
        {
            return false;
        }
        if self.file.is_none() {
            self.file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .ok();
        }
        let Some(f) = self.file.as_mut() else {
            return false;
        };
        if f.write_all(self.line.as_bytes()).is_err() {
            let _ = f.set_len(self.len);
            return false;
        }
        self.len += n;
        self.publish();
        true
    }

    /// The file again without its written front: what is left copied to a new file that
    /// replaces it, the done mark at its start.
    fn compact(&mut self) -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom};
        self.file = None;
        let tmp = self.path.with_extension("jsonl.tmp");
        {
            let mut from = std::fs::File::open(&self.path)?;
            from.seek(SeekFrom::Start(self.done))?;
            let mut to = std::fs::File::create(&tmp)?;
            std::io::copy(&mut from, &mut to)?;
            to.sync_data()?;
        }
        // The mark first (0), then the new file: a crash between them leaves the old file
        // read from its start, its written batches sent again and written once (their tokens);
        // the other order could leave the old mark over the new file, skipping unwritten lines.
        // Each step on the disk before the next (a power loss keeps the order too).
        let mark = self.done_path.with_extension("done.tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&mark)?;
            f.write_all(b"0")?;
            f.sync_all()?;
        }
        let dir = |p: &std::path::Path| {
            p.parent()
                .and_then(|d| std::fs::File::open(d).ok())
                .map(|d| d.sync_all())
        };
        std::fs::rename(&mark, &self.done_path)?;
        dir(&self.done_path);
        std::fs::rename(&tmp, &self.path)?;
        dir(&self.path);
        self.len -= self.done;
        self.peeked_to = self.peeked_to.saturating_sub(self.done);
        self.done = 0;
        self.publish();
        Ok(())
    }

    /// Appends `r` (its lines); `false` when it would pass the limit (nothing appended).
    fn push(&mut self, r: &Record) -> bool {
        self.line.clear();
        if !super::transfer::lines(r, &mut self.line) {
            return true;
        }
        if !self.append() {
            return false;
        }
        let lines = self.line.matches('\n').count() as u64;
        self.held
            .spooled_records
            .fetch_add(lines, Ordering::Relaxed);
        true
    }

    /// What was appended reaches the disk (once a batch).
    fn sync(&mut self) {
        if let Some(f) = &self.file {
            let _ = f.sync_data();
        }
    }

    /// The next batch from the front: its token, its records (a batch is read whole, as it was
    /// held; records before any batch line, at most `most`), and how many lines did not read
    /// as one. Records without a batch line get a token of this spool's and their place.
    fn peek(&mut self, most: usize) -> std::io::Result<(String, Vec<Record>, u64)> {
        use std::io::{BufRead, Seek, SeekFrom};
        let mut f = std::io::BufReader::new(std::fs::File::open(&self.path)?);
        f.seek(SeekFrom::Start(self.done))?;
        let (mut records, mut bad, mut at) = (Vec::new(), 0u64, self.done);
        let mut token: Option<String> = None;
        let mut cut = false;
        let mut line = String::new();
        while token.is_some() || records.len() < most {
            line.clear();
            let n = f.read_line(&mut line)? as u64;
            if n == 0 {
                break;
            }
            if !line.ends_with('\n') {
                cut = true;
                break;
            }
            if let Some(t) = batch_token(&line) {
                if !records.is_empty() || bad > 0 {
                    // The next batch begins: this one ends before its line.
                    break;
                }
                // (A batch with no record before it is passed over.)
                token = Some(t);
                at += n;
                continue;
            }
            at += n;
            match super::transfer::record(line.trim_end()) {
                Ok(r) => records.push(r),
                Err(_) => bad += 1,
            }
        }
        let token = token.unwrap_or_else(|| format!("spool:{}:{}", self.id, self.done));
        if cut && records.is_empty() && bad == 0 {
            // A line without its end (a write cut short): nothing after it can be trusted.
            at = self.len;
            bad += 1;
        }
        self.peeked_to = at;
        self.peeked_lines = records.len() as u64 + bad;
        Ok((token, records, bad))
    }

    /// The last peek's lines are written: saved, and the files removed once all are.
    fn consume(&mut self) -> std::io::Result<()> {
        let taken = self.peeked_lines;
        self.done = self.peeked_to;
        let left = self
            .held
            .spooled_records
            .load(Ordering::Relaxed)
            .saturating_sub(taken);
        self.held.spooled_records.store(left, Ordering::Relaxed);
        if self.done >= self.len {
            self.discard();
            return Ok(());
        }
        let tmp = self.done_path.with_extension("done.tmp");
        std::fs::write(&tmp, self.done.to_string())?;
        std::fs::rename(&tmp, &self.done_path)?;
        self.publish();
        Ok(())
    }

    /// Everything written (or unreadable): both files go.
    fn discard(&mut self) {
        self.file = None;
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(&self.done_path);
        self.len = 0;
        self.done = 0;
        self.peeked_to = 0;
        self.peeked_lines = 0;
        self.held.spooled_records.store(0, Ordering::Relaxed);
        self.publish();
    }
}

type Param = Box<dyn ToSql + Sync + Send>;

/// One batch of records in one transaction under `token` (written once, whatever the number of
/// times it is sent); the prunes it asked for come back, to be run after
/// it (in batches of their own: a slow prune never makes written records count as unwritten).
async fn write_records(
    client: &mut Client,
    records: &[Record],
    token: &str,
) -> Result<Vec<SystemTime>, WriteError> {
    let e = write_error;
    let now = ms(SystemTime::now());
    let mut prunes = Vec::new();
    let tx = client.transaction().await.map_err(e)?;
    // The batch's token first: a batch this store committed already (its last call timed out
    // after the commit) is not written again.
    let fresh = tx
        .execute(
            "INSERT INTO audit_batches (token, ts_ms) VALUES ($1, $2) ON CONFLICT (token) DO NOTHING",
            &[&token, &now],
        )
        .await
        .map_err(e)?;
    if fresh == 0 {
        tx.rollback().await.map_err(e)?;
        return Ok(Vec::new());
    }
    let mut requests: Vec<&RequestRow> = Vec::new();
    for r in records {
        match r {
            Record::Request(row) => requests.push(row),
            Record::Event(ev) => {
                tx.execute(
                    "INSERT INTO endpoint_events (ts_ms, endpoint, event, reason) VALUES ($1, $2, $3, $4)",
                    &[&ms(ev.ts), &ev.endpoint, &ev.event, &ev.reason],
                )
                .await
                .map_err(e)?;
            }
            Record::Retired {
                endpoint,
                reason,
                fingerprint,
            } => {
                tx.execute(
                    "INSERT INTO endpoint_state (endpoint, retired_reason, retired_fingerprint, updated_ms) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (endpoint) DO UPDATE SET retired_reason = excluded.retired_reason, retired_fingerprint = excluded.retired_fingerprint, updated_ms = excluded.updated_ms",
                    &[&endpoint, &reason, &fingerprint, &now],
                )
                .await
                .map_err(e)?;
            }
            Record::Stats(rows) => {
                for s in rows {
                    tx.execute(
                        "INSERT INTO endpoint_state (endpoint, requests, successes, failures, ewma_latency_ms, updated_ms) VALUES ($1, $2, $3, $4, $5, $6)
                         ON CONFLICT (endpoint) DO UPDATE SET requests = excluded.requests, successes = excluded.successes, failures = excluded.failures, ewma_latency_ms = excluded.ewma_latency_ms, updated_ms = excluded.updated_ms",
                        &[&s.endpoint, &(s.requests as i64), &(s.successes as i64), &(s.failures as i64), &s.ewma_latency_ms, &now],
                    )
                    .await
                    .map_err(e)?;
                }
            }
            Record::LearnedWindow { endpoint, learned } => {
                let (tokens, request, fingerprint) = match learned {
                    Some((t, r, f)) => (Some(*t as i64), Some(r), Some(f)),
                    None => (None, None, None),
                };
                tx.execute(
                    "INSERT INTO endpoint_state (endpoint, learned_context_window, learned_window_request, learned_window_fingerprint, updated_ms) VALUES ($1, $2, $3, $4, $5)
                     ON CONFLICT (endpoint) DO UPDATE SET learned_context_window = excluded.learned_context_window, learned_window_request = excluded.learned_window_request, learned_window_fingerprint = excluded.learned_window_fingerprint, updated_ms = excluded.updated_ms",
                    &[&endpoint, &tokens, &request, &fingerprint, &now],
                )
                .await
                .map_err(e)?;
            }
            Record::Spend(rows) => {
                for (client, month, usd) in rows {
                    if usd.is_finite() && *usd >= 0.0 {
                        // Absolute and never lowered: several replicas each write their own view
                        // (with `cluster:`, the fleet's), and the largest stands.
                        tx.execute(
                            "INSERT INTO client_spend (client, month, usd, requests) VALUES ($1, $2, $3, 0)
                             ON CONFLICT (client, month) DO UPDATE SET usd = GREATEST(client_spend.usd, excluded.usd)",
                            &[&client, &month, &usd],
                        )
                        .await
                        .map_err(e)?;
                    }
                }
            }
            Record::Standby {
                standby,
                primary,
                up,
            } => {
                tx.execute(
                    "INSERT INTO standby_state (standby, primary_endpoint, up, updated_ms) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (standby) DO UPDATE SET primary_endpoint = excluded.primary_endpoint, up = excluded.up, updated_ms = excluded.updated_ms",
                    &[&standby, &primary, &i64::from(*up), &now],
                )
                .await
                .map_err(e)?;
            }
            Record::Prune(before) => prunes.push(*before),
            Record::Flush(_) => {}
        }
    }
    if !requests.is_empty() {
        insert_requests(&tx, &requests).await?;
    }
    tx.commit().await.map_err(e)?;
    Ok(prunes)
}

/// A failed statement: refused by the store (its answer names the record's fault), or the
/// store away (no answer, the connection gone, the server shutting down or starting).
fn write_error(e: tokio_postgres::Error) -> WriteError {
    let text = error_text(&e);
    match e.as_db_error() {
        // Only what is about the records themselves: class 22 (a value: data exception), 23 (a
        // constraint), P0 (a trigger of the store's own raised). Anything else (a connection,
        // a shutdown, read-only after a failover, a lock timeout, a missing table or grant, an
        // I/O or internal error) says the store cannot take writes now: the records wait.
        Some(db)
            if ["22", "23", "P0"]
                .iter()
                .any(|c| db.code().code().starts_with(c)) =>
        {
            WriteError::Refused(text)
        }
        _ => WriteError::Away(text),
    }
}

/// The batch's requests and their attempts: ids from the sequence, then multi-row `INSERT`s.
async fn insert_requests(
    tx: &tokio_postgres::Transaction<'_>,
    requests: &[&RequestRow],
) -> Result<(), WriteError> {
    let e = write_error;
    let ids: Vec<i64> = tx
        .query(
            "SELECT nextval('requests_id_seq') FROM generate_series(1, $1::bigint)",
            &[&(requests.len() as i64)],
        )
        .await
        .map_err(e)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if ids.len() != requests.len() {
        return Err(WriteError::Away(
            "the id sequence gave fewer ids than asked".into(),
        ));
    }
    for row in requests {
        if let Some(client) = &row.client_key {
            tx.execute(
                "INSERT INTO client_spend (client, month, usd, requests) VALUES ($1, $2, 0, 1)
                 ON CONFLICT (client, month) DO UPDATE SET requests = client_spend.requests + 1",
                &[client, &crate::clients::month_of(row.ts)],
            )
            .await
            .map_err(e)?;
        }
    }
    let rows: Vec<Vec<Param>> = ids
        .iter()
        .zip(requests)
        .map(|(id, r)| request_params(*id, r))
        .collect();
    insert_rows(tx, "requests", &REQUEST_COLUMNS, rows).await?;
    let attempts: Vec<Vec<Param>> = ids
        .iter()
        .zip(requests)
        .flat_map(|(id, r)| {
            r.attempts.iter().map(move |a| -> Vec<Param> {
                vec![
                    Box::new(*id),
                    Box::new(r.request_id.clone()),
                    Box::new(i64::from(a.seq)),
                    Box::new(ms(r.ts)),
                    Box::new(a.endpoint.clone()),
                    Box::new(a.class.as_str()),
                    Box::new(a.status.map(i64::from)),
                    Box::new(a.error.clone()),
                    Box::new(a.latency_ms),
                    Box::new(i64::from(a.panic_mode)),
                    Box::new(i64::from(a.own_key)),
                    Box::new(a.address.clone()),
                ]
            })
        })
        .collect();
    insert_rows(tx, "attempts", &ATTEMPT_COLUMNS, attempts).await?;
    // Kept bodies (`audit.capture_bodies`): rare, one statement each. A batch sent again
    // (its token) is skipped whole before this, so no body is written twice.
    for (id, r) in ids.iter().zip(requests) {
        if let Some(b) = &r.bodies {
            tx.execute(
                "INSERT INTO request_bodies (request_row, request_id, request_body, request_cut, response_body, response_cut, own_key) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &[
                    id,
                    &r.request_id,
                    &b.request,
                    &i64::from(b.request_cut),
                    &b.response,
                    &i64::from(b.response_cut),
                    &i64::from(b.own_key),
                ],
            )
            .await
            .map_err(e)?;
        }
    }
    Ok(())
}

/// A request's values in [`REQUEST_COLUMNS`] order, with its id first.
fn request_params(id: i64, row: &RequestRow) -> Vec<Param> {
    let u = |v: u64| v.min(i64::MAX as u64) as i64;
    vec![
        Box::new(id),
        Box::new(row.request_id.clone()),
        Box::new(ms(row.ts)),
        Box::new(row.operation),
        Box::new(row.requested_model.clone()),
        Box::new(row.endpoint.clone()),
        Box::new(i64::from(row.status)),
        Box::new(row.error_class.clone()),
        Box::new(i64::from(row.stream)),
        Box::new(row.latency_ms),
        Box::new(row.ttft_ms),
        Box::new(row.tokens_in.map(u)),
        Box::new(row.tokens_out.map(u)),
        Box::new(i64::from(row.tokens_estimated)),
        Box::new(row.cost_usd),
        Box::new(row.attempts.iter().filter(|a| !a.class.is_skip()).count() as i64),
        Box::new(row.prompt_tokens_counted.map(u)),
        Box::new(u(row.truncated_messages)),
        Box::new(u(row.truncated_tokens)),
        Box::new(u(row.sanitized_chars)),
        Box::new(i64::from(row.hedges)),
        Box::new(i64::from(row.hedge_won)),
        Box::new(row.continued_from.clone()),
        Box::new(row.client_key.clone()),
        Box::new(row.response_id.clone()),
        Box::new(row.previous_response_id.clone()),
        Box::new(row.trace.as_ref().map(|t| t.id.clone())),
        Box::new(row.replay_of.clone()),
        Box::new(row.served_from),
    ]
}

/// Multi-row `INSERT`s of `rows` (each its values in `columns` order, the SQLite writer's),
/// [`ROWS_PER_INSERT`] at a time.
async fn insert_rows(
    tx: &tokio_postgres::Transaction<'_>,
    table: &str,
    cols: &[&str],
    rows: Vec<Vec<Param>>,
) -> Result<(), WriteError> {
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut sql = format!("INSERT INTO {table} ({}) VALUES ", cols.join(", "));
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(chunk.len() * cols.len());
        for (i, row) in chunk.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push('(');
            for (j, v) in row.iter().enumerate() {
                if j > 0 {
                    sql.push_str(", ");
                }
                params.push(v.as_ref() as &(dyn ToSql + Sync));
                sql.push_str(&format!("${}", params.len()));
            }
            sql.push(')');
        }
        tx.execute(sql.as_str(), &params)
            .await
            .map_err(write_error)?;
    }
    Ok(())
}

/// Deletes rows older than `before`, a batch (its own transaction) at a time, as the SQLite
/// sweep does.
async fn prune(client: &mut Client, before: SystemTime) -> Result<(), String> {
    let e = |e: tokio_postgres::Error| error_text(&e);
    let t = ms(before);
    let limit = super::PRUNE_BATCH as i64;
    loop {
        // The ids are picked once, so a request's attempts and bodies go with it even when
        // another replica commits older rows meanwhile.
        let n = client
            .execute(
                "WITH gone AS (SELECT id FROM requests WHERE ts_ms < $1 ORDER BY id LIMIT $2),
                      a AS (DELETE FROM attempts WHERE request_row IN (SELECT id FROM gone)),
                      b AS (DELETE FROM request_bodies WHERE request_row IN (SELECT id FROM gone))
                 DELETE FROM requests WHERE id IN (SELECT id FROM gone)",
                &[&t, &limit],
            )
            .await
            .map_err(e)?;
        if (n as usize) < super::PRUNE_BATCH {
            break;
        }
    }
    loop {
        let n = client
            .execute(
                "DELETE FROM endpoint_events WHERE id IN (SELECT id FROM endpoint_events WHERE ts_ms < $1 LIMIT $2)",
                &[&t, &limit],
            )
            .await
            .map_err(e)?;
        if (n as usize) < super::PRUNE_BATCH {
            break;
        }
    }
    // A batch's token is needed only while it may be sent again (seconds to the spool's
    // drain): kept as long as the rows.
    client
        .execute("DELETE FROM audit_batches WHERE ts_ms < $1", &[&t])
        .await
        .map_err(e)?;
    Ok(())
}

/// A column's type, for copying rows between the stores.
#[derive(Clone, Copy)]
enum Ty {
    Int,
    Real,
    Text,
}

/// The tables a snapshot copies, with every column of the current schema.
fn tables() -> Vec<(&'static str, Vec<(&'static str, Ty)>)> {
    use Ty::*;
    let requests: Vec<(&'static str, Ty)> = REQUEST_COLUMNS
        .iter()
        .map(|c| {
            let ty = match *c {
                "request_id"
                | "operation"
                | "requested_model"
                | "endpoint"
                | "error_class"
                | "continued_from"
                | "client_key"
                | "response_id"
                | "previous_response_id"
                | "trace_id"
                | "replay_of"
                | "served_from" => Text,
                "latency_ms" | "ttft_ms" | "cost_usd" => Real,
                _ => Int,
            };
            (*c, ty)
        })
        .collect();
    let mut attempts = vec![("id", Int)];
    attempts.extend(ATTEMPT_COLUMNS.iter().map(|c| {
        let ty = match *c {
            "request_id" | "endpoint" | "class" | "error" | "address" => Text,
            "latency_ms" => Real,
            _ => Int,
        };
        (*c, ty)
    }));
    vec![
        ("requests", requests),
        ("attempts", attempts),
        (
            "request_bodies",
            vec![
                ("request_row", Int),
                ("request_id", Text),
                ("request_body", Text),
                ("request_cut", Int),
                ("response_body", Text),
                ("response_cut", Int),
                ("own_key", Int),
            ],
        ),
        (
            "endpoint_events",
            vec![
                ("id", Int),
                ("ts_ms", Int),
                ("endpoint", Text),
                ("event", Text),
                ("reason", Text),
            ],
        ),
        (
            "endpoint_state",
            vec![
                ("endpoint", Text),
                ("requests", Int),
                ("successes", Int),
                ("failures", Int),
                ("ewma_latency_ms", Real),
                ("retired_reason", Text),
                ("retired_fingerprint", Text),
                ("updated_ms", Int),
                ("learned_context_window", Int),
                ("learned_window_request", Text),
                ("learned_window_fingerprint", Text),
            ],
        ),
        (
            "client_spend",
            vec![
                ("client", Text),
                ("month", Text),
                ("usd", Real),
                ("requests", Int),
            ],
        ),
        (
            "standby_state",
            vec![
                ("standby", Text),
                ("primary_endpoint", Text),
                ("up", Int),
                ("updated_ms", Int),
            ],
        ),
    ]
}

/// Copies the trail from `since` on (requests, their attempts, endpoint events; all endpoint
/// state, spend and standbys) into a new SQLite database in `dir`, for the readers.
/// `bodies`: the kept bodies too (`audit export`; the readers of figures need none).
pub fn snapshot(
    settings: &PgSettings,
    since: SystemTime,
    dir: &Path,
    bodies: bool,
) -> anyhow::Result<()> {
    own_runtime(|rt| snapshot_on(rt, settings, since, dir, bodies))
}

/// Runs `f` with a runtime of its own on a thread of its own: the CLI's callers may already be
/// inside a runtime, where another cannot block.
fn own_runtime<T: Send>(
    f: impl FnOnce(&tokio::runtime::Runtime) -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            f(&rt)
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the PostgreSQL reader failed")))
    })
}

fn snapshot_on(
    rt: &tokio::runtime::Runtime,
    settings: &PgSettings,
    since: SystemTime,
    dir: &Path,
    bodies: bool,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut sqlite = super::open_connection(&super::db_path(dir))?;
    rt.block_on(async {
        let client = connect(settings.url.expose())
            .await
            .map_err(|e| anyhow::anyhow!("PostgreSQL ({}): {e}", settings.display))?;
        let from = ms(since);
        let first: Option<i64> = client
            .query_one("SELECT MIN(id) FROM requests WHERE ts_ms >= $1", &[&from])
            .await
            .map_err(|e| anyhow::anyhow!("{}", error_text(&e)))?
            .get(0);
        let tx = sqlite.transaction()?;
        for (table, cols) in tables() {
            if table == "request_bodies" && !bodies {
                continue;
            }
            let names: Vec<&str> = cols.iter().map(|(n, _)| *n).collect();
            let (filter, params): (&str, Vec<&(dyn ToSql + Sync)>) = match table {
                "requests" | "endpoint_events" => ("WHERE ts_ms >= $1", vec![&from]),
                "attempts" | "request_bodies" => match &first {
                    Some(f) => ("WHERE request_row >= $1", vec![f]),
                    None => ("WHERE false", vec![]),
                },
                _ => ("", vec![]),
            };
            let sql = format!("SELECT {} FROM {table} {filter}", names.join(", "));
            let rows = client
                .query(sql.as_str(), &params)
                .await
                .map_err(|e| anyhow::anyhow!("{}", error_text(&e)))?;
            // SQLite's attempts made as rows are in `attempt_rows` (`attempts` is a view).
            let into = if table == "attempts" {
                "attempt_rows"
            } else {
                table
            };
            let insert = format!(
                "INSERT OR REPLACE INTO {into} ({}) VALUES ({})",
                names.join(", "),
                vec!["?"; names.len()].join(", ")
            );
            let mut stmt = tx.prepare(&insert)?;
            for row in rows {
                // A column of another type than this build writes (a database altered by hand,
                // or by another version) is an error naming it, not a panic.
                let values: Vec<rusqlite::types::Value> = cols
                    .iter()
                    .enumerate()
                    .map(|(i, (name, ty))| {
                        use rusqlite::types::Value as V;
                        let v = match ty {
                            Ty::Int => row
                                .try_get::<_, Option<i64>>(i)
                                .map(|v| v.map_or(V::Null, V::Integer)),
                            Ty::Real => row
                                .try_get::<_, Option<f64>>(i)
                                .map(|v| v.map_or(V::Null, V::Real)),
                            Ty::Text => row
                                .try_get::<_, Option<String>>(i)
                                .map(|v| v.map_or(V::Null, V::Text)),
                        };
                        v.map_err(|e| anyhow::anyhow!("{table}.{name}: {}", error_text(&e)))
                    })
                    .collect::<anyhow::Result<_>>()?;
                stmt.execute(rusqlite::params_from_iter(values))?;
            }
        }
        tx.commit()?;
        Ok::<_, anyhow::Error>(())
    })
}

/// The schema version of the database at `url` (tests).
pub fn version(url: &str) -> anyhow::Result<i64> {
    own_runtime(|rt| {
        rt.block_on(async {
            let c = connect(url).await.map_err(|e| anyhow::anyhow!(e))?;
            let v: i64 = c
                .query_one("SELECT version FROM autohedge_schema", &[])
                .await
                .map_err(|e| anyhow::anyhow!("{}", error_text(&e)))?
                .get(0);
            Ok(v)
        })
    })
}

/// Migrates the database at `url` up to `version` only (tests make an older schema with it).
pub fn migrate_to(url: &str, version: usize) -> anyhow::Result<usize> {
    own_runtime(|rt| {
        rt.block_on(async {
            let mut c = connect(url).await.map_err(|e| anyhow::anyhow!(e))?;
            migrate(&mut c, Some(version))
                .await
                .map_err(|e| anyhow::anyhow!(e))
        })
    })
}

/// How many migrations there are (both stores have as many).
pub const VERSIONS: usize = MIGRATIONS.len();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EndpointEvent;

    #[test]
    fn both_stores_have_the_same_versions() {
        assert_eq!(super::MIGRATIONS.len(), super::super::MIGRATIONS.len());
    }

    fn event(i: u32) -> Record {
        Record::Event(EndpointEvent {
            ts: SystemTime::UNIX_EPOCH + Duration::from_millis(u64::from(i)),
            endpoint: format!("e{i}"),
            event: "x".into(),
            reason: String::new(),
        })
    }

    fn names(records: &[Record]) -> Vec<String> {
        records
            .iter()
            .map(|r| match r {
                Record::Event(e) => e.endpoint.clone(),
                _ => "?".into(),
            })
            .collect()
    }

    /// The spool gives its records back in order, each once, across a restart (its progress
    /// is kept beside it), refuses what would pass its limit, and is gone once written.
    #[test]
    fn the_spool_gives_back_each_record_once_in_order_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let held: Arc<crate::store::Held> = Default::default();
        let mut spool = Spool::open(dir.path(), 1 << 20, held.clone());
        assert!(spool.is_empty());
        for i in 0..5 {
            assert!(spool.push(&event(i)));
        }
        spool.sync();
        assert_eq!(held.spooled_records.load(Ordering::Relaxed), 5);
        let (_, got, bad) = spool.peek(2).unwrap();
        assert_eq!((names(&got), bad), (vec!["e0".into(), "e1".into()], 0));
        spool.consume().unwrap();
        // Peeked but not consumed (the write failed): given again.
        let (_, got, _) = spool.peek(2).unwrap();
        assert_eq!(names(&got), vec!["e2", "e3"]);
        drop(spool);
        // A restart: from where the last run stopped.
        let held: Arc<crate::store::Held> = Default::default();
        let mut spool = Spool::open(dir.path(), 1 << 20, held.clone());
        assert_eq!(held.spooled_records.load(Ordering::Relaxed), 3);
        let (_, got, _) = spool.peek(10).unwrap();
        assert_eq!(names(&got), vec!["e2", "e3", "e4"]);
        spool.consume().unwrap();
        assert!(spool.is_empty());
        assert!(!dir.path().join("audit-spool.jsonl").exists());
        assert_eq!(held.spooled_bytes.load(Ordering::Relaxed), 0);
        // Its limit: a record that would pass it is refused, nothing written.
        let mut small = Spool::open(dir.path(), 100, held);
        assert!(small.push(&event(1)));
        assert!(!small.push(&event(2)));
        let (_, got, _) = small.peek(10).unwrap();
        assert_eq!(names(&got), vec!["e1"]);
    }

    /// A store that comes and goes drains the spool's front while records keep coming: the
    /// file on disk stays within the limit (its written front cut off), nothing is refused that
    /// the unwritten part has room for, and every record comes back once, in order, also after
    /// a restart.
    #[test]
    fn a_flapping_store_keeps_the_spool_within_its_limit_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("audit-spool.jsonl");
        let held: Arc<crate::store::Held> = Default::default();
        // What one batch of one record takes, measured on a spool of its own.
        let one = {
            let d = tempfile::tempdir().unwrap();
            let mut s = Spool::open(d.path(), 1 << 20, Default::default());
            assert!(s.mark("t000") && s.push(&event(100)));
            s.len
        };
        // Room for three rounds' records unwritten: the store lets one round lag.
        let limit = one * 24 + one / 2;
        let mut spool = Spool::open(dir.path(), limit, held.clone());
        let (mut pushed, mut back) = (0u32, Vec::new());
        let mut largest = 0;
        for round in 0..40 {
            // Records while the store is away.
            for _ in 0..8 {
                assert!(spool.mark(&format!("t{pushed:03}")));
                assert!(spool.push(&event(pushed)), "refused with room left");
                pushed += 1;
            }
            largest = largest.max(std::fs::metadata(&file).unwrap().len());
            // The store answers for a moment: the round before's batches are written.
            if round > 0 {
                for _ in 0..8 {
                    let (_, got, _) = spool.peek(100).unwrap();
                    back.extend(names(&got));
                    spool.consume().unwrap();
                }
            }
            if round == 20 {
                // A restart: from where the last run stopped.
                drop(spool);
                spool = Spool::open(dir.path(), limit, held.clone());
            }
        }
        while !spool.is_empty() {
            let (_, got, _) = spool.peek(100).unwrap();
            back.extend(names(&got));
            spool.consume().unwrap();
        }
        // The churn happened (far more went through than the limit holds)...
        assert_eq!(pushed, 320);
        assert!(pushed as u64 * one > limit * 10);
        // ...every record came back once, in order...
        let want: Vec<String> = (0..pushed).map(|i| format!("e{i}")).collect();
        assert_eq!(back, want);
        // ...and the file never held more than the limit.
        assert!(
            largest <= limit,
            "{largest} bytes on disk for a {limit}-byte spool"
        );
    }

    /// A batch line with no record after it (written, then nothing could follow) is passed
    /// over: the batches after it are read, not thrown away.
    #[test]
    fn an_empty_batch_costs_the_spool_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let held: Arc<crate::store::Held> = Default::default();
        let mut spool = Spool::open(dir.path(), 1 << 20, held.clone());
        assert!(spool.mark("t0"));
        assert!(spool.mark("t1"));
        assert!(spool.push(&event(1)));
        assert!(spool.mark("t2"));
        assert!(spool.push(&event(2)));
        let (t, got, bad) = spool.peek(100).unwrap();
        assert_eq!((t.as_str(), names(&got), bad), ("t1", vec!["e1".into()], 0));
        spool.consume().unwrap();
        let (t, got, _) = spool.peek(100).unwrap();
        assert_eq!((t.as_str(), names(&got)), ("t2", vec!["e2".into()]));
        // A batch is read whole, however many records it holds.
        spool.consume().unwrap();
        assert!(spool.mark("big"));
        for i in 0..5 {
            assert!(spool.push(&event(i)));
        }
        let (t, got, _) = spool.peek(2).unwrap();
        assert_eq!((t.as_str(), got.len()), ("big", 5));
    }

    /// Records held together come back together under the token they were held with (the
    /// same on every reading), one batch at a time.
    #[test]
    fn the_spool_gives_back_each_batch_under_its_token() {
        let dir = tempfile::tempdir().unwrap();
        let held: Arc<crate::store::Held> = Default::default();
        let mut spool = Spool::open(dir.path(), 1 << 20, held.clone());
        assert!(spool.mark("t1"));
        assert!(spool.push(&event(1)) && spool.push(&event(2)));
        assert!(spool.mark("t2"));
        assert!(spool.push(&event(3)));
        assert_eq!(held.spooled_records.load(Ordering::Relaxed), 3);
        let (t, got, _) = spool.peek(100).unwrap();
        assert_eq!(
            (t.as_str(), names(&got)),
            ("t1", vec!["e1".into(), "e2".into()])
        );
        // Not written (the store went away): the same batch, the same token.
        let (t, got, _) = spool.peek(100).unwrap();
        assert_eq!((t.as_str(), got.len()), ("t1", 2));
        spool.consume().unwrap();
        drop(spool);
        let held: Arc<crate::store::Held> = Default::default();
        let mut spool = Spool::open(dir.path(), 1 << 20, held.clone());
        assert_eq!(held.spooled_records.load(Ordering::Relaxed), 1);
        let (t, got, _) = spool.peek(100).unwrap();
        assert_eq!((t.as_str(), names(&got)), ("t2", vec!["e3".into()]));
        spool.consume().unwrap();
        assert!(spool.is_empty());
    }
}
