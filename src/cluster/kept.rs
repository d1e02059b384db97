//! The last resort's answers (`last_resort:`) shared with the other replicas: each model's shelf
//! bounded in the store as in each replica (`max_bytes` in all, `max_bytes_per_key` a client
//! key's, its own oldest first, each for `ttl`; `turn.lua`). Stored off the request path; read
//! only where every attempt of a request failed, within `cluster.timeout`. A store away means no
//! shared last resort, never a request's error.

use super::Cluster;
use super::turns::Shelf;
use crate::config::LastResortSpec;

impl Cluster {
    fn kept_shelf(&self, model: &str) -> Shelf {
        Shelf {
            by_time: self.key(&["lr", model, "all"]),
            key_prefix: self.key(&["lr", model, "k", ""]),
            sizes: self.key(&["lr", model, "size"]),
            bytes: self.key(&["lr", model, "bytes"]),
            value_prefix: self.key(&["lr", model, "v", ""]),
        }
    }

    /// Keeps `value` (a kept answer, [`crate::executor::last_resort::Kept::encode`]) of
    /// `owner`'s for `model` under `id`, within `spec`.
    pub async fn put_kept(
        &self,
        model: &str,
        id: &str,
        owner: &str,
        value: Vec<u8>,
        spec: LastResortSpec,
    ) {
        if !self.is_up() {
            return;
        }
        let ms = spec.ttl.as_millis().clamp(1, u64::MAX as u128) as u64;
        let shelf = self.kept_shelf(model);
        let inv = self.bounded_call(
            &shelf,
            (id, owner),
            &value,
            ms,
            (spec.max_bytes, spec.max_bytes_per_key),
            "put",
        );
        if self.call::<i64>(&inv).await.is_err() {
            tracing::debug!("a last-resort answer was not shared (store away or slow)");
        }
    }

    /// The value kept for `model` under `id` by any replica, by `deadline`; `None` when there
    /// is none, it is larger than `max_bytes`, or the store did not answer in time.
    pub async fn get_kept(
        &self,
        model: &str,
        id: &str,
        max_bytes: u64,
        deadline: tokio::time::Instant,
    ) -> Option<Vec<u8>> {
        if !self.is_up() {
            return None;
        }
        let mut conn = self.conn.clone();
        let key = format!("{}{id}", self.kept_shelf(model).value_prefix);
        let got = tokio::time::timeout_at(
            deadline,
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<Vec<u8>>>(&mut conn),
        )
        .await
        .ok()?
        .ok()??;
        (got.len() as u64 <= max_bytes).then_some(got)
    }
}
