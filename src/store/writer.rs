//! The SQLite writer: the audit thread that takes records off the queue and commits them in
//! batches, and the marks it keeps for the readers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OptionalExtension, params};

use super::raw::{self, Val};
use super::{
    ATTEMPT_COLUMNS, AttemptRow, BATCH, GATHER, REQUEST_COLUMNS, Record, RequestRow, ms, prune,
};

pub(super) fn writer(
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

/// The SQLite writer's `requests` columns: [`REQUEST_COLUMNS`] and the request's one attempt
/// when it is kept in the row ([`inline_attempt`]; PostgreSQL writes every attempt as a row).
const SQLITE_REQUEST_COLUMNS: [&str; 32] = {
    let mut c = [""; 32];
    let mut i = 0;
    while i < REQUEST_COLUMNS.len() {
        c[i] = REQUEST_COLUMNS[i];
        i += 1;
    }
    c[29] = "attempt_class";
    c[30] = "attempt_status";
    c[31] = "attempt_latency_ms";
    c
};

/// The `requests` columns of a plain row ([`plain_request`]), as indices into
/// [`SQLITE_REQUEST_COLUMNS`]: the rest hold their defaults (`NULL` or 0) and are left to them
/// instead of bound — eleven values fewer a request.
const REQUEST_PLAIN: [usize; 18] = [
    0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 13, 14, 15, 23, 29, 30, 31,
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
        && row.trace.is_none()
        && row.replay_of.is_none()
        && row.served_from.is_none()
}

fn plain_attempt(a: &AttemptRow) -> bool {
    a.error.is_none() && !a.panic_mode && !a.own_key && a.address.is_none()
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
        Val::text(row.trace.as_ref().map(|t| t.id.as_str())),
        Val::text(row.replay_of.as_deref()),
        Val::text(row.served_from),
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
        Val::text(a.address.as_deref()),
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
        // Kept bodies (`audit.capture_bodies`): rare, one statement each.
        for (id, row) in &requests {
            if let Some(b) = &row.bodies {
                self.conn
                    .prepare_cached(super::sql::INSERT_BODIES)?
                    .execute(params![
                        id,
                        row.request_id,
                        b.request,
                        b.request_cut,
                        b.response,
                        b.response_cut,
                        b.own_key
                    ])?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::routing::outcome::Outcome;
    use crate::store::schema::MIGRATIONS;
    use crate::store::{db_path, open_connection, sql};

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
                    address: None,
                    trace: None,
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
                    address: None,
                    trace: None,
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
            address: None,
            trace: None,
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
                address: None,
                trace: None,
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
}
