//! Every query the readers (`stats`, `report`, budgets at start) and the retention sweep run,
//! in one place, so that a test can show each one's plan uses an index (`EXPLAIN QUERY PLAN`).

/// The first request row a window starting at `?1` (ms) can hold: the `first_id` of the latest
/// mark at or before it (rows below it all started earlier), or 0 when there is none. A scalar
/// subquery, evaluated once, so a query can read `id >= first_row!()` as a rowid range.
macro_rules! first_row {
    () => {
        "(SELECT coalesce((SELECT first_id FROM request_marks WHERE before_ms <= ?1 ORDER BY before_ms DESC LIMIT 1), 0))"
    };
}

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
/// `report`: the first and last time of a window's requests (what its charts cover).
pub const REQUESTS_SPAN: &str = concat!(
    "SELECT MIN(ts_ms), MAX(ts_ms) FROM requests WHERE id >= ",
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
pub const PRUNE_BODIES: &str = concat!(
    "DELETE FROM request_bodies WHERE request_row IN (SELECT id FROM requests WHERE id < ",
    first_row!(),
    " LIMIT ?2)"
);
/// The writer: a request's kept bodies (`audit.capture_bodies`).
pub const INSERT_BODIES: &str = "INSERT OR REPLACE INTO request_bodies (request_row, request_id, request_body, request_cut, response_body, response_cut, own_key) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
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
pub const ALL: [(&str, &str); 15] = [
    ("FIRST_ROW_SINCE", FIRST_ROW_SINCE),
    ("ATTEMPTS_FROM_ROW", ATTEMPTS_FROM_ROW),
    ("REQUESTS_BETWEEN", REQUESTS_BETWEEN),
    ("REQUESTS_SPAN", REQUESTS_SPAN),
    ("EVENTS_BETWEEN", EVENTS_BETWEEN),
    ("BY_KEY_SINCE", BY_KEY_SINCE),
    ("CALLS_SINCE", CALLS_SINCE),
    ("FALLBACKS_SERVED_SINCE", FALLBACKS_SERVED_SINCE),
    ("FALLBACKS_FROM_SINCE", FALLBACKS_FROM_SINCE),
    ("SPEND", SPEND),
    ("PRUNE_ATTEMPTS", PRUNE_ATTEMPTS),
    ("PRUNE_BODIES", PRUNE_BODIES),
    ("PRUNE_REQUESTS", PRUNE_REQUESTS),
    ("PRUNE_EVENTS", PRUNE_EVENTS),
    ("PRUNE_MARKS", PRUNE_MARKS),
];

#[cfg(test)]
mod tests {
    use crate::store::{Store, db_path, open_connection, sql};

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
}
