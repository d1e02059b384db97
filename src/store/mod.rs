//! The audit trail and persisted endpoint state, in SQLite (WAL). One writer owns the connection
//! on its own OS thread behind a bounded queue: the request path only ever does a non-blocking
//! `try_send`, and a full queue or a failing disk drops records with a counter and a warning
//! instead of stalling or failing requests. Reads for the CLI open their own connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub mod bodies;
pub mod pg;
mod raw;
mod read;
mod retention;
mod schema;
pub mod sql;
pub mod transfer;
mod writer;

pub use read::{EndpointReport, KeyReport, clear_endpoint, open_trails, report, report_by_key};
use read::{read_persisted, read_spend, read_standbys_up};
pub(crate) use retention::PRUNE_BATCH;
pub use retention::prune;
pub use schema::open_connection;
use writer::writer;

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
    /// The address it went to, when its endpoint has several (`base_urls`, discovered tasks).
    pub address: Option<String>,
    /// Its span, when the request is traced (not stored: the trail keeps the trace id).
    pub trace: Option<crate::wire::trace::AttemptTrace>,
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
    /// Its trace (W3C trace context and what its spans carry), when it has one: continued from
    /// the client's `traceparent`, or started by the gateway with `telemetry.otlp`.
    pub trace: Option<Box<crate::wire::trace::Trace>>,
    /// `autohedge replay`: the request this one replayed (its request id).
    pub replay_of: Option<String>,
    /// A kept answer served it: `last_resort` (every attempt failed) or `cache`.
    pub served_from: Option<&'static str>,
    /// Its bodies, when `audit.capture_bodies` keeps them ([`bodies`]).
    pub bodies: Option<Box<bodies::Bodies>>,
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
            trace: None,
            replay_of: None,
            served_from: None,
            bodies: None,
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
            &mut self.replay_of,
        ] {
            safe_opt(s);
        }
        if let Some(b) = &mut self.bodies {
            safe_text(&mut b.request);
            safe_opt(&mut b.response);
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

/// The `requests` columns the writer fills, `id` first: ids are given explicitly so that a
/// batch's attempts can name their request row without reading it back row by row.
const REQUEST_COLUMNS: [&str; 29] = [
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
    "trace_id",
    "replay_of",
    "served_from",
];

const ATTEMPT_COLUMNS: [&str; 12] = [
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
    "address",
];

#[cfg(test)]
use schema::MIGRATIONS;

/// Helpers the tests of several files share.
#[cfg(test)]
mod test_util {
    use rusqlite::Connection;

    use super::*;

    pub(super) fn row(id: &str, endpoint: &str, class: &str) -> RequestRow {
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
                    address: None,
                    trace: None,
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
                    address: None,
                    trace: None,
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

    pub(super) fn trails(dirs: &[&Path]) -> Vec<Connection> {
        let dirs: Vec<PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
        open_trails(&dirs)
            .unwrap()
            .into_iter()
            .map(|(_, c)| c)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use super::test_util::{row, trails};
    use super::*;

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
            address: None,
            trace: None,
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
