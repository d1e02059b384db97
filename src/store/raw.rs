//! The audit writer's multi-row INSERTs, bound through SQLite's C API. rusqlite binds every
//! string as `SQLITE_TRANSIENT`: SQLite copies it into memory of its own (a `malloc` under its
//! mutex) and frees it when the parameter is bound again — 2.7k of the writer's 11.4k
//! instructions a row went there. Here strings are bound `SQLITE_STATIC`, borrowed for the one
//! statement: [`Insert::execute`] binds, steps, resets and clears the bindings inside one call,
//! so no pointer to a row's text outlives the borrow it was taken from.

use std::ffi::{CString, c_int};
use std::marker::PhantomData;
use std::ptr::NonNull;

use rusqlite::{Connection, ffi};

/// One bound value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Val<'a> {
    Null,
    Int(i64),
    Real(f64),
    Text(&'a str),
}

impl<'a> Val<'a> {
    pub(crate) fn text(s: Option<&'a str>) -> Val<'a> {
        s.map_or(Val::Null, Val::Text)
    }

    pub(crate) fn int(v: Option<i64>) -> Val<'a> {
        v.map_or(Val::Null, Val::Int)
    }

    pub(crate) fn real(v: Option<f64>) -> Val<'a> {
        v.map_or(Val::Null, Val::Real)
    }
}

/// A statement prepared once (`SQLITE_PREPARE_PERSISTENT`: kept out of the connection's small
/// lookaside memory, which long-lived statements would fill) and finalized on drop; it borrows
/// its connection, so it cannot outlive it.
pub(crate) struct Insert<'c> {
    stmt: NonNull<ffi::sqlite3_stmt>,
    db: *mut ffi::sqlite3,
    params: usize,
    _conn: PhantomData<&'c Connection>,
}

impl<'c> Insert<'c> {
    pub(crate) fn prepare(conn: &'c Connection, sql: &str) -> rusqlite::Result<Insert<'c>> {
        let c_sql = CString::new(sql).map_err(rusqlite::Error::NulError)?;
        // SAFETY: `conn` is open for 'c, the statement is tied to that lifetime, and the
        // handle is only used on the thread that owns `conn` (`Insert` is neither Send nor
        // Sync: it holds raw pointers).
        unsafe {
            let db = conn.handle();
            let mut stmt = std::ptr::null_mut();
            let rc = ffi::sqlite3_prepare_v3(
                db,
                c_sql.as_ptr(),
                -1,
                ffi::SQLITE_PREPARE_PERSISTENT as _,
                &mut stmt,
                std::ptr::null_mut(),
            );
            if rc != ffi::SQLITE_OK {
                if !stmt.is_null() {
                    ffi::sqlite3_finalize(stmt);
                }
                return Err(error(db, rc));
            }
            let stmt = NonNull::new(stmt).ok_or_else(|| {
                rusqlite::Error::SqliteFailure(ffi::Error::new(ffi::SQLITE_MISUSE), None)
            })?;
            let params = ffi::sqlite3_bind_parameter_count(stmt.as_ptr()).max(0) as usize;
            Ok(Insert {
                stmt,
                db,
                params,
                _conn: PhantomData,
            })
        }
    }

    /// Binds `values` as parameters 1.. (there must be exactly as many as the statement has),
    /// runs the statement to completion, and leaves it reset with no bindings: nothing of
    /// `values` is referenced once this returns, whether it succeeded or not.
    pub(crate) fn execute(&mut self, values: &[Val<'_>]) -> rusqlite::Result<()> {
        if values.len() != self.params {
            return Err(rusqlite::Error::InvalidParameterCount(
                values.len(),
                self.params,
            ));
        }
        let stmt = self.stmt.as_ptr();
        // SAFETY: `stmt` is a live statement of this connection (see `prepare`); every text
        // pointer bound here stays valid until `sqlite3_clear_bindings` below, which runs before
        // this function returns on every path, and `SQLITE_STATIC` tells SQLite not to free it.
        unsafe {
            let mut rc = ffi::SQLITE_OK;
            for (i, v) in values.iter().enumerate() {
                let at = (i + 1) as c_int;
                rc = match *v {
                    Val::Null => ffi::sqlite3_bind_null(stmt, at),
                    Val::Int(n) => ffi::sqlite3_bind_int64(stmt, at, n),
                    Val::Real(x) => ffi::sqlite3_bind_double(stmt, at, x),
                    Val::Text(s) => ffi::sqlite3_bind_text64(
                        stmt,
                        at,
                        // An empty String's pointer dangles: a static "" instead, as rusqlite.
                        if s.is_empty() { "" } else { s }.as_ptr().cast(),
                        s.len() as ffi::sqlite3_uint64,
                        ffi::SQLITE_STATIC(),
                        ffi::SQLITE_UTF8 as _,
                    ),
                };
                if rc != ffi::SQLITE_OK {
                    break;
                }
            }
            if rc == ffi::SQLITE_OK {
                rc = match ffi::sqlite3_step(stmt) {
                    ffi::SQLITE_DONE => ffi::SQLITE_OK,
                    ffi::SQLITE_ROW => ffi::SQLITE_MISUSE,
                    other => other,
                };
            }
            // The error is read before the reset, which may replace it.
            let result = if rc == ffi::SQLITE_OK {
                Ok(())
            } else {
                Err(error(self.db, rc))
            };
            ffi::sqlite3_reset(stmt);
            ffi::sqlite3_clear_bindings(stmt);
            result
        }
    }
}

impl Drop for Insert<'_> {
    fn drop(&mut self) {
        // SAFETY: finalized once, here; the connection outlives `self` ('c).
        unsafe {
            ffi::sqlite3_finalize(self.stmt.as_ptr());
        }
    }
}

/// The connection's error for `rc`, as rusqlite reports it.
fn error(db: *mut ffi::sqlite3, rc: c_int) -> rusqlite::Error {
    // SAFETY: `db` is an open connection; the message is copied before anything else runs on it.
    let message = unsafe {
        let m = ffi::sqlite3_errmsg(db);
        (!m.is_null()).then(|| std::ffi::CStr::from_ptr(m).to_string_lossy().into_owned())
    };
    rusqlite::Error::SqliteFailure(ffi::Error::new(rc), message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_every_kind_and_the_rows_keep_their_own_text() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (a, b, c, d)").unwrap();
        let mut ins =
            Insert::prepare(&conn, "INSERT INTO t VALUES (?, ?, ?, ?), (?, ?, ?, ?)").unwrap();
        for i in 0..3 {
            // Text that dies right after the call: the rows must hold their own copies.
            let s = format!("row {i} ünïcode");
            let empty = String::new();
            ins.execute(&[
                Val::Int(i),
                Val::Real(0.5),
                Val::Text(&s),
                Val::Null,
                Val::text(Some(&empty)),
                Val::int(None),
                Val::real(Some(-1.0)),
                Val::Text(&s[..3]),
            ])
            .unwrap();
            drop(s);
        }
        use rusqlite::types::Value as V;
        let got: Vec<[V; 4]> = conn
            .prepare("SELECT a, b, c, d FROM t ORDER BY rowid")
            .unwrap()
            .query_map([], |r| Ok([r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?]))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got.len(), 6);
        assert_eq!(
            got[4],
            [
                V::Integer(2),
                V::Real(0.5),
                V::Text("row 2 ünïcode".into()),
                V::Null
            ]
        );
        assert_eq!(
            got[5],
            [
                V::Text(String::new()),
                V::Null,
                V::Real(-1.0),
                V::Text("row".into())
            ]
        );
        let kind: String = conn
            .query_row("SELECT typeof(a) FROM t WHERE rowid = 2", [], |r| r.get(0))
            .unwrap();
        assert_eq!(kind, "text", "an empty string stays text, not NULL");
    }

    #[test]
    fn errors_leave_the_statement_usable() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
            .unwrap();
        let mut ins = Insert::prepare(&conn, "INSERT INTO t VALUES (?, ?)").unwrap();
        ins.execute(&[Val::Int(1), Val::Text("a")]).unwrap();
        let dup = ins.execute(&[Val::Int(1), Val::Text("b")]).unwrap_err();
        assert!(dup.to_string().contains("UNIQUE"), "{dup}");
        let null = ins.execute(&[Val::Int(2), Val::Null]).unwrap_err();
        assert!(null.to_string().contains("NOT NULL"), "{null}");
        assert!(matches!(
            ins.execute(&[Val::Int(3)]),
            Err(rusqlite::Error::InvalidParameterCount(1, 2))
        ));
        ins.execute(&[Val::Int(2), Val::Text("c")]).unwrap();
        let n: i64 = conn
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 2);
        assert!(Insert::prepare(&conn, "INSERT INTO nowhere VALUES (?)").is_err());
    }
}
