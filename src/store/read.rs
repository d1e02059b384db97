//! The readers: `autohedge stats` by endpoint and by key over one trail or several, the state
//! the gateway reads back at start, and `autohedge endpoint clear`'s offline half.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OptionalExtension, params};

use super::{PersistedStats, db_path, ms, open_connection, sql};

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

pub(super) fn read_standbys_up(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare("SELECT standby FROM standby_state WHERE up = 1")?;
    let rows = stmt.query_map([], |r| r.get(0))?;
    rows.collect()
}

pub(super) fn read_spend(conn: &Connection) -> rusqlite::Result<Vec<(String, String, f64)>> {
    let mut stmt = conn.prepare(sql::SPEND)?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    rows.collect()
}

pub(super) fn read_persisted(conn: &Connection) -> rusqlite::Result<Vec<PersistedStats>> {
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
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::store::test_util::{row, trails};
    use crate::store::{Record, RequestRow, Store};

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
}
