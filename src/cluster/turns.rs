//! Kept conversations: `/v1/responses` turns stored for the other replicas (`turn.lua`), so any
//! replica can continue a conversation another one answered.

use std::time::Duration;

use super::Cluster;

impl Cluster {
    /// Stores one `/v1/responses` turn (its JSON, from `routing::conversations`) for `ttl`, so
    /// another replica can continue the conversation. Off the request path (a task of its own);
    /// a store away loses the share, never the request.
    /// Keeps a turn for the other replicas (`turn.lua`), bounded in the store as in each
    /// replica: `bounds.max_bytes` in all, `max_bytes_per_key` for `client`'s turns (its own
    /// oldest go first), each for `bounds.ttl`.
    pub async fn put_turn(
        &self,
        id: &str,
        client: Option<&str>,
        json: String,
        bounds: crate::routing::conversations::Bounds,
    ) {
        if !self.is_up() {
            return;
        }
        let ms = bounds.ttl.as_millis().clamp(1, u64::MAX as u128) as u64;
        let inv = self.turn_call(id, client, &json, ms, bounds, "put");
        if self.call::<i64>(&inv).await.is_err() {
            tracing::debug!("a /v1/responses turn was not shared (store away or slow)");
        }
    }

    /// The turn another replica stored under `id`, within `cluster.timeout` (`deadline`);
    /// `None` when there is none, it is larger than `max_bytes`, or the store did not answer.
    pub async fn get_turn(
        &self,
        id: &str,
        max_bytes: u64,
        deadline: tokio::time::Instant,
    ) -> Option<String> {
        if !self.is_up() {
            return None;
        }
        let mut conn = self.conn.clone();
        let got = tokio::time::timeout_at(
            deadline,
            redis::cmd("GET")
                .arg(self.key(&["resp", id]))
                .query_async::<Option<String>>(&mut conn),
        )
        .await
        .ok()?
        .ok()??;
        (got.len() as u64 <= max_bytes).then_some(got)
    }

    /// `turn.lua` for `id` of `client`'s: `put` keeps `json` for `ms`, within `bounds`;
    /// `delete` forgets it.
    fn turn_call(
        &self,
        id: &str,
        client: Option<&str>,
        json: &str,
        ms: u64,
        bounds: crate::routing::conversations::Bounds,
        mode: &str,
    ) -> redis::ScriptInvocation<'_> {
        let who = client.unwrap_or("");
        let mut inv = self.turn.prepare_invoke();
        inv.key(self.key(&["turns"]))
            .key(self.key(&["turns", "k", who]))
            .key(self.key(&["turnsize"]))
            .key(self.key(&["turnbytes"]))
            .arg(id)
            .arg(json)
            .arg(ms)
            .arg(bounds.max_bytes)
            .arg(bounds.max_bytes_per_key)
            .arg(who)
            .arg(self.key(&["resp", ""]))
            .arg(self.key(&["turns", "k", ""]))
            .arg(mode);
        inv
    }

    /// Forgets a shared turn (`DELETE /v1/responses/{id}`), its bytes with it.
    pub async fn delete_turn(&self, id: &str, client: Option<&str>) {
        let none = crate::config::HistoryBounds {
            ttl: Duration::from_millis(1),
            max_bytes: 0,
            max_bytes_per_key: 0,
        };
        let inv = self.turn_call(id, client, "", 1, none, "delete");
        let _ = self.call::<i64>(&inv).await;
    }
}
