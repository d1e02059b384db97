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
        let shelf = Shelf {
            by_time: self.key(&["turns"]),
            key_prefix: self.key(&["turns", "k", ""]),
            sizes: self.key(&["turnsize"]),
            bytes: self.key(&["turnbytes"]),
            value_prefix: self.key(&["resp", ""]),
        };
        self.bounded_call(
            &shelf,
            (id, who),
            json.as_bytes(),
            ms,
            (bounds.max_bytes, bounds.max_bytes_per_key),
            mode,
        )
    }

    /// `turn.lua` on `shelf`: `put` keeps `value` under `id` for `ms`, as `who`'s, within
    /// (`most` in all, `share` a key's); `delete` forgets it.
    pub(super) fn bounded_call(
        &self,
        shelf: &Shelf,
        (id, who): (&str, &str),
        value: &[u8],
        ms: u64,
        (most, share): (u64, u64),
        mode: &str,
    ) -> redis::ScriptInvocation<'_> {
        let mut inv = self.turn.prepare_invoke();
        inv.key(&shelf.by_time)
            .key(format!("{}{who}", shelf.key_prefix))
            .key(&shelf.sizes)
            .key(&shelf.bytes)
            .arg(id)
            .arg(value)
            .arg(ms)
            .arg(most)
            .arg(share)
            .arg(who)
            .arg(&shelf.value_prefix)
            .arg(&shelf.key_prefix)
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

/// The store's keys of one bounded shelf (`turn.lua`): values by time, each key's by time (the
/// prefix and the key's name), each value's size and owner, the bytes kept, the values' prefix.
pub(super) struct Shelf {
    pub by_time: String,
    pub key_prefix: String,
    pub sizes: String,
    pub bytes: String,
    pub value_prefix: String,
}
