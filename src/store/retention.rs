//! Retention: the sweep that deletes audit rows past their time, in short batches.

use std::time::SystemTime;

use rusqlite::{Connection, params};

use super::{ms, sql};

/// Rows deleted per transaction when pruning past retention: each delete is a few milliseconds,
/// so records queued meanwhile wait that long at most, never the whole prune.
pub(crate) const PRUNE_BATCH: usize = 2000;

/// Pages returned to the file system after a prune (`PRAGMA incremental_vacuum`), per pass.
const VACUUM_PAGES: usize = 4096;

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
        total += tx.execute(sql::PRUNE_BODIES, params![t, limit])?;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::schema::JOURNAL_SIZE_LIMIT;
    use crate::store::test_util::row;
    use crate::store::{Record, Store, db_path, open_connection};

    #[test]
    fn prune_deletes_rows_past_retention() {
        let dir = tempfile::tempdir().unwrap();
        let opened = Store::open(dir.path(), 100).unwrap();
        let h = opened.store.handle();
        let bodies = || {
            Some(Box::new(crate::store::bodies::Bodies::stored(
                "{}".into(),
                false,
                None,
                false,
            )))
        };
        let mut old = row("old", "b", "server_error");
        old.ts = SystemTime::now() - Duration::from_secs(3600);
        old.bodies = bodies();
        h.send(Record::Request(Box::new(old)));
        let mut new = row("new", "b", "server_error");
        new.bodies = bodies();
        h.send(Record::Request(Box::new(new)));
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
        let kept: String = conn
            .query_row(
                "SELECT group_concat(request_id) FROM request_bodies",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(kept, "new", "the old request's bodies went with it");
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
}
