//! Readers of the audit trail (SQLite).

use std::time::Duration;

use super::{Gw, audit_rows, eventually};
use serde_json::Value;

/// `class error` of the first attempt on `endpoint` in the audit trail, once it is written.
pub async fn first_attempt(gw: &Gw, endpoint: &str) -> String {
    let sql = format!("SELECT class || ' ' || error FROM attempts WHERE endpoint = '{endpoint}'");
    assert!(
        eventually(Duration::from_secs(5), || async {
            !audit_rows(gw, &sql).is_empty()
        })
        .await,
        "no attempt on {endpoint} in the audit trail"
    );
    audit_rows(gw, &sql)[0][0].as_str().unwrap().to_string()
}

/// The first column of each row, as text.
pub fn db_rows(gw: &Gw, sql: &str) -> Vec<String> {
    audit_rows(gw, sql)
        .into_iter()
        .map(|r| r[0].as_str().unwrap_or_default().to_string())
        .collect()
}

pub fn rows(gw: &Gw, sql: &str) -> Vec<String> {
    audit_rows(gw, sql)
        .into_iter()
        .map(|r| {
            r.iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(":")
        })
        .collect()
}
