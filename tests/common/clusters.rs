//! The client keys the `cluster:` tests start their replicas with, and the wait until
//! the replicas share one store.

use std::time::Duration;

use super::{Gw, eventually};

pub const TEAM: &str = "sk-team-0123456789";

pub const TOKENS: &str = "sk-tokens-0123456789";

pub const WIDE: &str = "sk-wide-0123456789";

/// Waits until every gateway says the store is `up` and sees `n` replicas.
pub async fn until_clustered(gws: &[&Gw], n: u64) {
    for gw in gws {
        let ok = eventually(Duration::from_secs(15), || async {
            let st = gw.status().await;
            st["cluster"]["state"] == "up" && st["cluster"]["replicas"] == n
        })
        .await;
        assert!(ok, "not clustered: {}", gw.status().await["cluster"]);
    }
}
