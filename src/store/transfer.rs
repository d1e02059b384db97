//! `autohedge audit export` and `audit import`: the trail as JSON lines, so an operator can move
//! a SQLite trail into PostgreSQL (or back). One line a record: `{"kind": "request", …}` with
//! every column of the request and its `attempts`, `{"kind": "event", …}` for an endpoint
//! event, `{"kind": "spend", …}` for a client key's month. Import writes them through the
//! configured store's own writer, so they land as the gateway's own rows would.

use std::io::{BufRead, Write};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension};
use serde_json::{Value, json};

use super::{AttemptRow, EndpointEvent, Record, RequestRow};
use crate::op::Op;
use crate::routing::outcome::Outcome;

/// Writes the trail of `conn` from `since` on as JSON lines; returns how many lines.
pub fn export(conn: &Connection, since: SystemTime, out: &mut dyn Write) -> anyhow::Result<u64> {
    let from = super::ms(since);
    let mut n = 0u64;
    let mut attempts: std::collections::HashMap<i64, Vec<Value>> = Default::default();
    // Requests and their attempts are read from the window's first row on (the rowid and the
    // attempts' request-row index), filtered by time.
    let first_row: i64 = conn.query_row(super::sql::FIRST_ROW_SINCE, [from], |r| r.get(0))?;
    {
        let mut st = conn.prepare(
            "SELECT request_row, seq, endpoint, class, status, error, latency_ms, panic_mode, own_key, address FROM attempts WHERE request_row >= ?1 ORDER BY request_row, seq",
        )?;
        let rows = st.query_map([first_row], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                json!({
                    "seq": r.get::<_, i64>(1)?,
                    "endpoint": r.get::<_, String>(2)?,
                    "class": r.get::<_, String>(3)?,
                    "status": r.get::<_, Option<i64>>(4)?,
                    "error": r.get::<_, Option<String>>(5)?,
                    "latency_ms": r.get::<_, f64>(6)?,
                    "panic_mode": r.get::<_, i64>(7)? != 0,
                    "own_key": r.get::<_, i64>(8)? != 0,
                    "address": r.get::<_, Option<String>>(9)?,
                }),
            ))
        })?;
        for r in rows {
            let (row, a) = r?;
            attempts.entry(row).or_default().push(a);
        }
    }
    // A row's kept bodies, read as its line is written (never all of them at once).
    let mut bodies = conn.prepare(
        "SELECT request_body, request_cut, response_body, response_cut, own_key FROM request_bodies WHERE request_row = ?1",
    )?;
    let cols = super::REQUEST_COLUMNS;
    let mut st = conn.prepare(&format!(
        "SELECT {} FROM requests WHERE id >= ?2 AND ts_ms >= ?1 ORDER BY id",
        cols.join(", ")
    ))?;
    let mut rows = st.query([from, first_row])?;
    while let Some(r) = rows.next()? {
        let mut o = serde_json::Map::new();
        o.insert("kind".into(), json!("request"));
        let mut id = 0i64;
        for (i, c) in cols.iter().enumerate() {
            let v: rusqlite::types::Value = r.get(i)?;
            let v = match v {
                rusqlite::types::Value::Null => Value::Null,
                rusqlite::types::Value::Integer(n) => json!(n),
                rusqlite::types::Value::Real(f) => json!(f),
                rusqlite::types::Value::Text(t) => json!(t),
                rusqlite::types::Value::Blob(_) => Value::Null,
            };
            if *c == "id" {
                id = v.as_i64().unwrap_or(0);
                continue;
            }
            o.insert((*c).into(), v);
        }
        o.insert(
            "attempts".into(),
            Value::Array(attempts.remove(&id).unwrap_or_default()),
        );
        let kept = bodies
            .query_row([id], |r| {
                Ok(json!({
                    "request": r.get::<_, String>(0)?,
                    "request_cut": r.get::<_, i64>(1)? != 0,
                    "response": r.get::<_, Option<String>>(2)?,
                    "response_cut": r.get::<_, i64>(3)? != 0,
                    "own_key": r.get::<_, i64>(4)? != 0,
                }))
            })
            .optional()?;
        if let Some(b) = kept {
            o.insert("bodies".into(), b);
        }
        writeln!(out, "{}", Value::Object(o))?;
        n += 1;
    }
    let mut st = conn.prepare(
        "SELECT ts_ms, endpoint, event, reason FROM endpoint_events WHERE ts_ms >= ?1 ORDER BY id",
    )?;
    let mut rows = st.query([from])?;
    while let Some(r) = rows.next()? {
        writeln!(
            out,
            "{}",
            json!({"kind": "event", "ts_ms": r.get::<_, i64>(0)?, "endpoint": r.get::<_, String>(1)?, "event": r.get::<_, String>(2)?, "reason": r.get::<_, String>(3)?})
        )?;
        n += 1;
    }
    let mut st = conn.prepare(super::sql::SPEND)?;
    let mut rows = st.query([])?;
    while let Some(r) = rows.next()? {
        writeln!(
            out,
            "{}",
            json!({"kind": "spend", "client": r.get::<_, String>(0)?, "month": r.get::<_, String>(1)?, "usd": r.get::<_, f64>(2)?})
        )?;
        n += 1;
    }
    Ok(n)
}

fn ts(v: &Value) -> Option<SystemTime> {
    UNIX_EPOCH.checked_add(Duration::from_millis(u64::try_from(v.as_i64()?).ok()?))
}

fn opt_str(v: &Value, k: &str) -> Option<String> {
    v.get(k).and_then(Value::as_str).map(str::to_string)
}

fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// One exported line as the record it was; `Err` names what is wrong with it.
pub fn record(line: &str) -> Result<Record, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    match v.get("kind").and_then(Value::as_str) {
        Some("request") => {
            let operation = Op::ALL
                .into_iter()
                .map(Op::name)
                .chain(crate::op::SIDE_CALLS)
                .find(|n| v.get("operation").and_then(Value::as_str) == Some(n))
                .ok_or("an unknown `operation`")?;
            let at = ts(v.get("ts_ms").unwrap_or(&Value::Null)).ok_or("no `ts_ms`")?;
            let request_id = opt_str(&v, "request_id").ok_or("no `request_id`")?;
            let mut attempts = Vec::new();
            for a in v
                .get("attempts")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                attempts.push(AttemptRow {
                    seq: u32::try_from(num(a, "seq")).unwrap_or(u32::MAX),
                    endpoint: opt_str(a, "endpoint").ok_or("an attempt with no `endpoint`")?,
                    class: a
                        .get("class")
                        .and_then(Value::as_str)
                        .and_then(|c| c.parse::<Outcome>().ok())
                        .ok_or("an attempt with an unknown `class`")?,
                    status: a
                        .get("status")
                        .and_then(Value::as_u64)
                        .and_then(|s| u16::try_from(s).ok()),
                    error: opt_str(a, "error"),
                    latency_ms: a.get("latency_ms").and_then(Value::as_f64).unwrap_or(0.0),
                    panic_mode: a
                        .get("panic_mode")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                    own_key: a.get("own_key").and_then(Value::as_bool).unwrap_or(false),
                    address: opt_str(a, "address"),
                    trace: None,
                });
            }
            let flag = |k: &str| v.get(k).and_then(Value::as_i64).unwrap_or(0) != 0;
            let opt_u = |k: &str| v.get(k).and_then(Value::as_u64);
            Ok(Record::Request(Box::new(RequestRow {
                requested_model: opt_str(&v, "requested_model"),
                endpoint: opt_str(&v, "endpoint"),
                status: u16::try_from(num(&v, "status")).unwrap_or(0),
                error_class: opt_str(&v, "error_class"),
                stream: flag("stream"),
                latency_ms: v.get("latency_ms").and_then(Value::as_f64).unwrap_or(0.0),
                ttft_ms: v.get("ttft_ms").and_then(Value::as_f64),
                tokens_in: opt_u("tokens_in"),
                tokens_out: opt_u("tokens_out"),
                tokens_estimated: flag("tokens_estimated"),
                cost_usd: v.get("cost_usd").and_then(Value::as_f64),
                attempts,
                prompt_tokens_counted: opt_u("prompt_tokens_counted"),
                truncated_messages: num(&v, "truncated_messages"),
                truncated_tokens: num(&v, "truncated_tokens"),
                sanitized_chars: num(&v, "sanitized_chars"),
                hedges: u32::try_from(num(&v, "hedges")).unwrap_or(u32::MAX),
                hedge_won: flag("hedge_won"),
                continued_from: opt_str(&v, "continued_from"),
                client_key: opt_str(&v, "client_key"),
                response_id: opt_str(&v, "response_id"),
                previous_response_id: opt_str(&v, "previous_response_id"),
                trace: opt_str(&v, "trace_id").and_then(|t| crate::wire::trace::Trace::known(&t)),
                replay_of: opt_str(&v, "replay_of"),
                served_from: match v.get("served_from").and_then(Value::as_str) {
                    Some("cache") => Some("cache"),
                    Some("last_resort") => Some("last_resort"),
                    _ => None,
                },
                bodies: match v.get("bodies") {
                    None | Some(Value::Null) => None,
                    Some(b) => Some(Box::new(super::bodies::Bodies {
                        own_key: b.get("own_key").and_then(Value::as_bool).unwrap_or(false),
                        ..super::bodies::Bodies::stored(
                            opt_str(b, "request").ok_or("`bodies` with no `request`")?,
                            b.get("request_cut")
                                .and_then(Value::as_bool)
                                .unwrap_or(false),
                            opt_str(b, "response"),
                            b.get("response_cut")
                                .and_then(Value::as_bool)
                                .unwrap_or(false),
                        )
                    })),
                },
                ..RequestRow::new(request_id, at, operation)
            })))
        }
        Some("event") => Ok(Record::Event(EndpointEvent {
            ts: ts(v.get("ts_ms").unwrap_or(&Value::Null)).ok_or("no `ts_ms`")?,
            endpoint: opt_str(&v, "endpoint").ok_or("no `endpoint`")?,
            event: opt_str(&v, "event").ok_or("no `event`")?,
            reason: opt_str(&v, "reason").unwrap_or_default(),
        })),
        Some("spend") => {
            let usd = v
                .get("usd")
                .and_then(Value::as_f64)
                .filter(|u| u.is_finite() && *u >= 0.0)
                .ok_or("no `usd`")?;
            Ok(Record::Spend(vec![(
                opt_str(&v, "client").ok_or("no `client`")?,
                opt_str(&v, "month").ok_or("no `month`")?,
                usd,
            )]))
        }
        _ => Err("an unknown `kind` (request, event or spend)".into()),
    }
}

/// A record as the exported lines [`record`] reads back (what the PostgreSQL writer's spool
/// holds while the store is away): one line a request, event or key's month, each ending in
/// `\n`. `false` for a record the format has no line for (endpoint state, prunes, flushes).
pub fn lines(r: &Record, out: &mut String) -> bool {
    use std::fmt::Write as _;
    let flag = |b: bool| i64::from(b);
    match r {
        Record::Request(row) => {
            let attempts: Vec<Value> = row
                .attempts
                .iter()
                .map(|a| {
                    json!({
                        "seq": a.seq,
                        "endpoint": a.endpoint,
                        "class": a.class.as_str(),
                        "status": a.status,
                        "error": a.error,
                        "latency_ms": a.latency_ms,
                        "panic_mode": a.panic_mode,
                        "own_key": a.own_key,
                        "address": a.address,
                    })
                })
                .collect();
            let mut v = json!({
                "kind": "request",
                "request_id": row.request_id,
                "ts_ms": super::ms(row.ts),
                "operation": row.operation,
                "requested_model": row.requested_model,
                "endpoint": row.endpoint,
                "status": row.status,
                "error_class": row.error_class,
                "stream": flag(row.stream),
                "latency_ms": row.latency_ms,
                "ttft_ms": row.ttft_ms,
                "tokens_in": row.tokens_in,
                "tokens_out": row.tokens_out,
                "tokens_estimated": flag(row.tokens_estimated),
                "cost_usd": row.cost_usd,
                "prompt_tokens_counted": row.prompt_tokens_counted,
                "truncated_messages": row.truncated_messages,
                "truncated_tokens": row.truncated_tokens,
                "sanitized_chars": row.sanitized_chars,
                "hedges": row.hedges,
                "hedge_won": flag(row.hedge_won),
                "continued_from": row.continued_from,
                "client_key": row.client_key,
                "response_id": row.response_id,
                "previous_response_id": row.previous_response_id,
                "trace_id": row.trace.as_ref().map(|t| t.id.as_str()),
                "replay_of": row.replay_of,
                "served_from": row.served_from,
                "attempts": attempts,
            });
            if let Some(b) = &row.bodies {
                v["bodies"] = json!({
                    "request": b.request,
                    "request_cut": b.request_cut,
                    "response": b.response,
                    "response_cut": b.response_cut,
                    "own_key": b.own_key,
                });
            }
            let _ = writeln!(out, "{v}");
            true
        }
        Record::Event(ev) => {
            let v = json!({"kind": "event", "ts_ms": super::ms(ev.ts), "endpoint": ev.endpoint, "event": ev.event, "reason": ev.reason});
            let _ = writeln!(out, "{v}");
            true
        }
        Record::Spend(rows) => {
            for (client, month, usd) in rows {
                let v = json!({"kind": "spend", "client": client, "month": month, "usd": usd});
                let _ = writeln!(out, "{v}");
            }
            true
        }
        _ => false,
    }
}

/// Reads exported lines and hands each record to `send`; returns (records, lines refused with
/// their line number and why — at most the first ten kept).
pub fn import(
    input: &mut dyn BufRead,
    mut send: impl FnMut(Record),
) -> anyhow::Result<(u64, u64, Vec<String>)> {
    let (mut ok, mut bad, mut why) = (0u64, 0u64, Vec::new());
    for (i, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match record(&line) {
            Ok(r) => {
                send(r);
                ok += 1;
            }
            Err(e) => {
                bad += 1;
                if why.len() < 10 {
                    why.push(format!("line {}: {e}", i + 1));
                }
            }
        }
    }
    Ok((ok, bad, why))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_its_line() {
        use crate::routing::outcome::Outcome;
        let mut row = RequestRow::new(
            "req-1".into(),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            "chat",
        );
        row.requested_model = Some("m \u{fffd} \"quoted\"".into());
        row.endpoint = Some("a".into());
        row.status = 200;
        row.stream = true;
        row.latency_ms = 12.5;
        row.ttft_ms = Some(3.25);
        row.tokens_in = Some(10);
        row.tokens_out = Some(u64::MAX);
        row.cost_usd = Some(0.001);
        row.hedges = 2;
        row.hedge_won = true;
        row.client_key = Some("team".into());
        row.replay_of = Some("req-0".into());
        row.served_from = Some("cache");
        row.bodies = Some(Box::new(crate::store::bodies::Bodies::stored(
            "{\"model\":\"m\"}".into(),
            true,
            Some("data: x\n\n".into()),
            false,
        )));
        row.attempts.push(AttemptRow {
            seq: 1,
            endpoint: "a".into(),
            class: Outcome::Server,
            status: Some(503),
            error: Some("down\nhard".into()),
            latency_ms: 1.5,
            panic_mode: true,
            own_key: false,
            address: None,
            trace: None,
        });
        for r in [
            Record::Request(Box::new(row)),
            Record::Event(EndpointEvent {
                ts: UNIX_EPOCH + Duration::from_millis(5),
                endpoint: "a".into(),
                event: "ejected".into(),
                reason: "x".into(),
            }),
            Record::Spend(vec![("team".into(), "2026-12".into(), 1.5)]),
        ] {
            let mut text = String::new();
            assert!(lines(&r, &mut text));
            assert_eq!(text.matches('\n').count(), 1, "{text}");
            let back = record(text.trim_end()).unwrap();
            assert_eq!(format!("{r:?}"), format!("{back:?}"));
            if let (Record::Request(r), Record::Request(back)) = (&r, &back) {
                let (r, back) = (r.bodies.as_ref().unwrap(), back.bodies.as_ref().unwrap());
                assert_eq!((&r.request, &r.response), (&back.request, &back.response));
            }
        }
        assert!(!lines(&Record::Prune(UNIX_EPOCH), &mut String::new()));
    }

    #[test]
    fn hostile_lines_are_refused_by_name_never_a_panic() {
        for (line, why) in [
            ("{", "not JSON"),
            ("{}", "an unknown `kind`"),
            (
                r#"{"kind":"request","operation":"x"}"#,
                "an unknown `operation`",
            ),
            (
                r#"{"kind":"request","operation":"chat","ts_ms":-5}"#,
                "no `ts_ms`",
            ),
            (
                r#"{"kind":"request","operation":"chat","ts_ms":5}"#,
                "no `request_id`",
            ),
            (
                r#"{"kind":"request","operation":"chat","ts_ms":5,"request_id":"r","attempts":[{"endpoint":"a","class":"nope"}]}"#,
                "an attempt with an unknown `class`",
            ),
            (
                r#"{"kind":"spend","client":"a","month":"2026-12","usd":-1}"#,
                "no `usd`",
            ),
        ] {
            let err = match record(line) {
                Err(e) => e,
                Ok(_) => panic!("{line} was taken"),
            };
            assert!(err.starts_with(why), "{line}: {err}");
        }
        assert!(
            record(r#"{"kind":"request","operation":"responses","ts_ms":5,"request_id":"r","status":99999999}"#).is_ok(),
            "out-of-range numbers are clamped, not refused"
        );
    }
}
