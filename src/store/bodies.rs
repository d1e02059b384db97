//! Bodies kept with their audit rows (`audit.capture_bodies`), for `autohedge replay`: the
//! client's request body and the answer it got, redacted and cut at `audit.max_body_bytes`, in
//! the `request_bodies` table beside the row (both stores), pruned with it.
//!
//! What is kept is never a secret: fields that carry credentials (`api_key`, `authorization`,
//! …) are removed wherever they are in the body, every value of a configured key is replaced,
//! and text shaped like a key (`sk-…`, `Bearer …`) is masked. No header is kept.
//!
//! Captured bodies wait for the writer in memory: [`Budget`] bounds them (all together, and
//! one client key's share when there are several), so one key's flood of large requests keeps
//! no other key's bodies out of the trail. A body past the budget is not kept (counted); its row
//! is written as ever.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use regex::Regex;
use serde_json::Value;

use super::RequestRow;
use crate::config::CaptureBodies;
use crate::routing::outcome::Outcome;

/// A request's kept bodies.
pub struct Bodies {
    /// The client's request body (redacted JSON), cut at `audit.max_body_bytes`.
    pub request: String,
    pub request_cut: bool,
    /// The answer the client got (a JSON body, or a stream's events as sent), redacted and cut.
    pub response: Option<String>,
    pub response_cut: bool,
    /// The request carried its own upstream key (`x-encrypted-key`): never replayed.
    pub own_key: bool,
    /// Its bytes' hold on the [`Budget`], let go when the row is written or dropped.
    pub(crate) charge: Option<Charge>,
}

impl Clone for Bodies {
    /// A copy holds nothing of the budget (only the row the writer gets does).
    fn clone(&self) -> Self {
        Bodies {
            request: self.request.clone(),
            request_cut: self.request_cut,
            response: self.response.clone(),
            response_cut: self.response_cut,
            own_key: self.own_key,
            charge: None,
        }
    }
}

impl std::fmt::Debug for Bodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bodies")
            .field("request_bytes", &self.request.len())
            .field("request_cut", &self.request_cut)
            .field("response_bytes", &self.response.as_ref().map(String::len))
            .field("response_cut", &self.response_cut)
            .field("own_key", &self.own_key)
            .finish()
    }
}

impl Bodies {
    /// Bodies read back from a store or an exported line (nothing held in memory for them).
    pub fn stored(
        request: String,
        request_cut: bool,
        response: Option<String>,
        response_cut: bool,
    ) -> Bodies {
        Bodies {
            request,
            request_cut,
            response,
            response_cut,
            own_key: false,
            charge: None,
        }
    }

    pub fn bytes(&self) -> usize {
        self.request.len() + self.response.as_ref().map_or(0, String::len)
    }
}

/// Whether a finished request's row keeps its bodies under `mode`: `failed` keeps a request
/// that got an error, one served from the last resort, and one where any attempt failed (a
/// failover) even if another endpoint then served it.
pub fn wanted(mode: CaptureBodies, row: &RequestRow) -> bool {
    match mode {
        CaptureBodies::None => false,
        CaptureBodies::All => true,
        CaptureBodies::Failed => {
            !(200..300).contains(&row.status)
                || row.error_class.is_some()
                || row.attempts.iter().any(|a| failed(a.class))
        }
    }
}

/// An attempt that failed: not served, not skipped, and not one of the gateway's own moves
/// (a hedge's losing copy, a request an endpoint was told not to get).
fn failed(class: Outcome) -> bool {
    !matches!(
        class,
        Outcome::Ok
            | Outcome::HedgeCancelled
            | Outcome::Unsupported
            | Outcome::ResponsesUnsupported
            | Outcome::PreviousResponseLost
    ) && !class.is_skip()
}

/// Object keys whose values are credentials, wherever they are in a body (compared
/// case-insensitively, `-` as `_`).
const SECRET_FIELDS: &[&str] = &[
    "api_key",
    "apikey",
    "x_api_key",
    "authorization",
    "proxy_authorization",
    "x_encrypted_key",
    "password",
    "passwd",
    "secret",
    "client_secret",
    "access_token",
    "refresh_token",
    "id_token",
    "private_key",
    "aws_secret_access_key",
    "cookie",
];

fn secret_field(name: &str) -> bool {
    if name.len() > 32 {
        return false;
    }
    let n = name.to_ascii_lowercase().replace('-', "_");
    SECRET_FIELDS.contains(&n.as_str())
}

/// Text shaped like a key: a provider prefix or `Bearer` and at least 16 characters of token.
/// (Shorter runs are left: `key_value` in a prompt is not a secret, and cutting it would change
/// what a replay sends.)
static KEYISH: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(sk|pk|rk|api[_-]?key|bearer)([-_ :=]+)[A-Za-z0-9*._\-]{16,}")
        .expect("key regex compiles")
});

/// `text` with every secret value (8 bytes or more) and every key-shaped run replaced.
pub fn redact_text(text: &str, secrets: &[&str]) -> String {
    let mut out = std::borrow::Cow::Borrowed(text);
    for s in secrets.iter().filter(|s| s.len() >= 8) {
        if out.contains(s) {
            out = std::borrow::Cow::Owned(out.replace(s, "[REDACTED]"));
        }
    }
    KEYISH.replace_all(&out, "$1$2[REDACTED]").into_owned()
}

fn redact_value(v: &mut Value, secrets: &[&str], depth: usize) {
    match v {
        Value::String(s) => {
            let r = redact_text(s, secrets);
            if r != *s {
                *s = r;
            }
        }
        Value::Array(items) if depth < 64 => {
            for i in items {
                redact_value(i, secrets, depth + 1);
            }
        }
        Value::Object(map) if depth < 64 => {
            // A credential's field goes, and so does a field whose very name holds a secret.
            map.retain(|k, _| !secret_field(k) && redact_text(k, secrets) == *k);
            for (_, i) in map.iter_mut() {
                redact_value(i, secrets, depth + 1);
            }
        }
        // Deeper than any real body: replaced rather than walked further.
        Value::Array(_) | Value::Object(_) => *v = Value::String("[REDACTED: too deep]".into()),
        _ => {}
    }
}

/// A body as kept: JSON with credential fields removed and secrets replaced (text otherwise,
/// redacted as text), cut at `max` bytes on a character boundary; `true` when cut.
pub fn kept_text(raw: &[u8], secrets: &[&str], max: usize) -> (String, bool) {
    // Far past the bound, the body is not parsed (it would be kept cut anyway): its first
    // `max` bytes, and enough after them that a secret across the cut is still caught, are
    // redacted as text.
    if raw.len() > max.saturating_mul(4) {
        let head = &raw[..raw.len().min(max.saturating_add(4096))];
        let (text, _) = cut(redact_text(&String::from_utf8_lossy(head), secrets), max);
        return (text, true);
    }
    let text = match serde_json::from_slice::<Value>(raw) {
        Ok(mut v) => {
            redact_value(&mut v, secrets, 0);
            v.to_string()
        }
        Err(_) => redact_text(&String::from_utf8_lossy(raw), secrets),
    };
    cut(text, max)
}

fn cut(mut text: String, max: usize) -> (String, bool) {
    if text.len() <= max {
        return (text, false);
    }
    let mut at = max;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text.truncate(at);
    (text, true)
}

/// The most captured bytes waiting for the writer, all requests together: room for 64 bodies
/// of the longest kept (`audit.max_body_bytes`), at most 64 MiB.
pub fn held_max_bytes(max_body_bytes: usize) -> u64 {
    (64 * max_body_bytes as u64).min(64 << 20)
}

/// Captured bodies waiting for the writer: at most [`held_max_bytes`] in all and, with several
/// client keys, at most half of that for one key.
#[derive(Default)]
pub struct Budget {
    inner: Arc<Mutex<Held>>,
}

#[derive(Default)]
struct Held {
    total: u64,
    by_key: HashMap<Arc<str>, u64>,
}

/// A hold of `bytes` on the budget, for `key`; let go when dropped.
pub struct Charge {
    inner: Arc<Mutex<Held>>,
    key: Option<Arc<str>>,
    bytes: u64,
}

impl Budget {
    /// A hold on `bytes` for `key` when there is room (`shared`: the gateway has more than one
    /// client key, so one key may hold half at most); `None` when there is not.
    pub fn charge(
        &self,
        key: Option<&str>,
        bytes: u64,
        shared: bool,
        limit: u64,
    ) -> Option<Charge> {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if h.total.saturating_add(bytes) > limit {
            return None;
        }
        let key: Option<Arc<str>> = key.map(Arc::from);
        if let Some(k) = &key {
            let mine = h.by_key.get(k).copied().unwrap_or(0);
            if shared && mine.saturating_add(bytes) > limit / 2 {
                return None;
            }
            *h.by_key.entry(k.clone()).or_insert(0) += bytes;
        }
        h.total += bytes;
        Some(Charge {
            inner: self.inner.clone(),
            key,
            bytes,
        })
    }

    /// Bytes held now (all keys).
    pub fn held(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).total
    }
}

impl Charge {
    /// Takes `other`'s hold into this one (both of one budget and key).
    pub fn absorb(&mut self, mut other: Charge) {
        self.bytes += std::mem::take(&mut other.bytes);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        h.total = h.total.saturating_sub(self.bytes);
        if let Some(k) = &self.key
            && let Some(n) = h.by_key.get_mut(k)
        {
            *n = n.saturating_sub(self.bytes);
            if *n == 0 {
                h.by_key.remove(k);
            }
        }
    }
}

/// Where a running gateway's trail is, for `replay` to read kept requests back.
#[derive(Debug, Clone)]
pub enum Trail {
    Sqlite(std::path::PathBuf),
    Postgres(crate::config::PgSettings),
}

/// A kept request as `replay` reads it back: its row's facts and its bodies.
#[derive(Debug, Clone)]
pub struct Source {
    pub request_id: String,
    pub ts_ms: i64,
    pub operation: String,
    pub requested_model: Option<String>,
    pub endpoint: Option<String>,
    pub status: i64,
    pub error_class: Option<String>,
    pub stream: bool,
    pub client_key: Option<String>,
    pub bodies: Bodies,
}

/// The lookup both stores run (`?1`/`$1`: the request id; `?2`/`$2`: the client key's name,
/// when the operator named one), newest first, a few at most: a client's `x-request-id` can
/// repeat another's (the key is filtered here, so another key's requests of that id hide none).
macro_rules! find_sql {
    ($id:literal, $key:literal) => {
        concat!(
            "SELECT r.request_id, r.ts_ms, r.operation, r.requested_model, r.endpoint, r.status, r.error_class, r.stream, r.client_key,
                    b.request_body, b.request_cut, b.response_body, b.response_cut, b.own_key
             FROM request_bodies b JOIN requests r ON r.id = b.request_row
             WHERE b.request_id = ",
            $id,
            " AND (",
            $key,
            " IS NULL OR r.client_key = ",
            $key,
            ") ORDER BY r.id DESC LIMIT 16"
        )
    };
}

/// The kept requests of id `request_id` in a SQLite trail, newest first.
pub fn find_sqlite(
    conn: &rusqlite::Connection,
    request_id: &str,
    key: Option<&str>,
) -> rusqlite::Result<Vec<Source>> {
    let mut st = conn.prepare(find_sql!("?1", "?2"))?;
    let rows = st.query_map(rusqlite::params![request_id, key], |r| {
        Ok(Source {
            request_id: r.get(0)?,
            ts_ms: r.get(1)?,
            operation: r.get(2)?,
            requested_model: r.get(3)?,
            endpoint: r.get(4)?,
            status: r.get(5)?,
            error_class: r.get(6)?,
            stream: r.get::<_, i64>(7)? != 0,
            client_key: r.get(8)?,
            bodies: Bodies {
                own_key: r.get::<_, i64>(13)? != 0,
                ..Bodies::stored(
                    r.get(9)?,
                    r.get::<_, i64>(10)? != 0,
                    r.get(11)?,
                    r.get::<_, i64>(12)? != 0,
                )
            },
        })
    })?;
    rows.collect()
}

/// The kept requests of id `request_id` in PostgreSQL, newest first.
pub async fn find_pg(
    client: &tokio_postgres::Client,
    request_id: &str,
    key: Option<&str>,
) -> Result<Vec<Source>, tokio_postgres::Error> {
    let rows = client
        .query(find_sql!("$1", "$2::text"), &[&request_id, &key])
        .await?;
    rows.iter()
        .map(|r| {
            Ok(Source {
                request_id: r.try_get(0)?,
                ts_ms: r.try_get(1)?,
                operation: r.try_get(2)?,
                requested_model: r.try_get(3)?,
                endpoint: r.try_get(4)?,
                status: r.try_get(5)?,
                error_class: r.try_get(6)?,
                stream: r.try_get::<_, i64>(7)? != 0,
                client_key: r.try_get(8)?,
                bodies: Bodies {
                    own_key: r.try_get::<_, i64>(13)? != 0,
                    ..Bodies::stored(
                        r.try_get(9)?,
                        r.try_get::<_, i64>(10)? != 0,
                        r.try_get(11)?,
                        r.try_get::<_, i64>(12)? != 0,
                    )
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn credential_fields_go_wherever_they_are_and_secrets_are_replaced() {
        let body = serde_json::json!({
            "model": "chat",
            "api_key": "sk-live-aaaaaaaaaaaaaaaaaaaaaaaa",
            "metadata": {"Authorization": "Bearer abc", "team": "red", "upstream-secret-123": 1},
            "messages": [
                {"role": "user", "content": "my key is sk-proj-ABCDEFGHIJKLMNOPQRSTUV and the upstream's is upstream-secret-123"},
                {"role": "user", "content": "key_value pairs stay"}
            ],
            "max_tokens": 5
        });
        let (text, cut) = kept_text(
            body.to_string().as_bytes(),
            &["upstream-secret-123"],
            1 << 20,
        );
        assert!(!cut);
        for gone in [
            "sk-live",
            "Bearer abc",
            "ABCDEFGHIJKLMNOPQRSTUV",
            "upstream-secret-123",
            "api_key",
            "Authorization",
        ] {
            assert!(!text.contains(gone), "{gone} kept in {text}");
        }
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["metadata"]["team"], "red");
        assert_eq!(v["messages"][1]["content"], "key_value pairs stay");
        assert_eq!(v["max_tokens"], 5);
        assert!(text.contains("[REDACTED]"));
    }

    #[test]
    fn failed_keeps_errors_and_failovers_not_a_hedges_losing_copy() {
        use crate::store::test_util::row;
        let served = row("r", "a", "ok");
        assert!(!wanted(CaptureBodies::Failed, &served));
        assert!(wanted(CaptureBodies::All, &served));
        assert!(!wanted(CaptureBodies::None, &row("r", "a", "server_error")));
        assert!(wanted(
            CaptureBodies::Failed,
            &row("r", "a", "server_error")
        ));
        let mut hedged = row("r", "a", "ok");
        hedged.attempts.push(crate::store::AttemptRow {
            class: Outcome::HedgeCancelled,
            ..hedged.attempts[0].clone()
        });
        assert!(
            !wanted(CaptureBodies::Failed, &hedged),
            "a hedge's loser is no failure"
        );
        let mut refused = row("r", "a", "ok");
        refused.status = 429;
        assert!(wanted(CaptureBodies::Failed, &refused));
    }

    #[test]
    fn a_long_body_is_cut_on_a_character_boundary_and_says_so() {
        let (text, cut) = kept_text("é".repeat(100).as_bytes(), &[], 51);
        assert!(cut);
        assert_eq!(text.len(), 50);
        let (text, cut) = kept_text(b"{\"a\":1}", &[], 7);
        assert_eq!((text.as_str(), cut), ("{\"a\":1}", false));
    }

    #[test]
    fn one_key_holds_half_the_budget_at_most_and_gives_it_back() {
        let b = Budget::default();
        let a1 = b.charge(Some("a"), 40, true, 100).expect("room");
        assert!(
            b.charge(Some("a"), 20, true, 100).is_none(),
            "past a's half"
        );
        let other = b.charge(Some("b"), 50, true, 100).expect("b's own half");
        assert!(b.charge(None, 20, true, 100).is_none(), "past the whole");
        drop(a1);
        assert_eq!(b.held(), 50);
        assert!(b.charge(Some("a"), 50, true, 100).is_some());
        drop(other);
        // One key alone may take it all.
        let c = Budget::default();
        assert!(c.charge(Some("a"), 100, false, 100).is_some());
    }

    proptest! {
        /// Any bytes give a kept text within the bound, and never panic.
        #[test]
        fn any_body_is_kept_within_its_bound(raw in proptest::collection::vec(any::<u8>(), 0..400), max in 1usize..300) {
            let (text, cut) = kept_text(&raw, &["secret-value-1"], max);
            prop_assert!(text.len() <= max);
            prop_assert!(!text.contains("secret-value-1"));
            if !cut { prop_assert!(text.len() <= max); }
        }
    }
}
