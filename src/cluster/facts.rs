//! Shared endpoint facts: what one replica learns about an endpoint (a cooldown, a retired key)
//! stored and published for the others, and what they learn applied here.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{BACKGROUND_TIMEOUT, Cluster, FIRST_BACKOFF, MAX_BACKOFF, scrub};
use crate::routing::observed::Fact;

/// An endpoint's shared facts outlive their last change by this.
const FACTS_TTL: Duration = Duration::from_secs(30 * 86_400);
/// The largest fact message read from the store; larger ones are ignored.
const MAX_FACT_BYTES: usize = 64 * 1024;
/// Facts waiting to be shared; more are dropped (the other replicas learn them themselves).
pub const FACT_QUEUE: usize = 4096;

/// Where a fact is stored among its endpoint's, and whether it is a clear.
fn fact_field(f: &Fact) -> String {
    match f {
        Fact::Cooldown { .. } => "cooldown".into(),
        Fact::Retired { .. } => "retired".into(),
        Fact::KeyRejected { key, .. } => format!("key:{key}"),
        Fact::Window { .. } => "window".into(),
        Fact::Cleared { .. } => String::new(),
        // Published only: stale within seconds.
        Fact::RateLimit { .. } => "-".into(),
    }
}

/// A fact message: who learned it, and what.
#[derive(serde::Serialize, serde::Deserialize)]
struct Message {
    origin: String,
    fact: Fact,
}

impl Cluster {
    async fn publish(&self, fact: &Fact) -> Result<(), String> {
        self.share_fact(fact, true).await
    }

    /// Stores `fact`, and publishes it when `publish` (the running replicas apply it at once).
    pub(super) async fn share_fact(&self, fact: &Fact, publish: bool) -> Result<(), String> {
        let body = serde_json::to_string(fact).map_err(|e| e.to_string())?;
        let msg = serde_json::to_string(&Message {
            origin: self.replica.clone(),
            fact: fact.clone(),
        })
        .map_err(|e| e.to_string())?;
        let mut inv = self.share.prepare_invoke();
        inv.key(self.key(&["facts", fact.endpoint()]))
            .arg(fact_field(fact))
            .arg(body)
            .arg(msg)
            .arg(if publish {
                self.key(&["facts"])
            } else {
                String::new()
            })
            .arg(FACTS_TTL.as_secs());
        self.call::<i64>(&inv).await.map(|_| ())
    }

    /// `autohedge endpoint clear` with no gateway answering: drops what the fleet stored about
    /// `endpoint` and tells the replicas that run (one that starts later finds nothing to apply).
    pub async fn clear_endpoint(&self, endpoint: &str) -> Result<(), String> {
        self.publish(&Fact::Cleared {
            endpoint: endpoint.to_string(),
        })
        .await
        .map_err(|e| scrub(&self.settings, &e))
    }

    /// Every stored fact about `endpoints` (a replica that starts or reconnects catches up).
    async fn stored_facts(&self, endpoints: &[String]) -> Result<Vec<Fact>, String> {
        let mut out = Vec::new();
        for e in endpoints {
            let mut conn = self.conn.clone();
            let got = tokio::time::timeout(
                BACKGROUND_TIMEOUT,
                redis::cmd("HGETALL")
                    .arg(self.key(&["facts", e]))
                    .query_async::<Vec<(String, String)>>(&mut conn),
            )
            .await
            .map_err(|_| "no answer reading shared facts".to_string())?
            .map_err(|e| e.to_string())?;
            for (_, v) in got {
                if v.len() <= MAX_FACT_BYTES
                    && let Ok(f) = serde_json::from_str::<Fact>(&v)
                    && f.endpoint() == e
                {
                    out.push(f);
                }
            }
        }
        Ok(out)
    }
}

/// Shares what this replica learns, in order; while the store is away facts wait in the queue.
pub(super) async fn sharer(
    cluster: Arc<Cluster>,
    mut rx: mpsc::Receiver<Fact>,
    cancel: CancellationToken,
) {
    loop {
        let fact = tokio::select! {
            _ = cancel.cancelled() => return,
            f = rx.recv() => match f {
                Some(f) => f,
                None => return,
            },
        };
        loop {
            if !cluster.is_up() {
                if !cluster.until_back(&cancel).await {
                    return;
                }
                continue;
            }
            match cluster.publish(&fact).await {
                Ok(()) => {
                    cluster.facts_shared.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) => cluster.down(&e),
            }
        }
    }
}

/// Applies what the other replicas learn: subscribes to the facts channel, then reads every
/// stored fact (what was learned before this replica started or while it was cut off), then
/// applies each message as it comes. Starts over, with backoff, when the subscription breaks.
pub(super) async fn listener(
    cluster: Arc<Cluster>,
    endpoints: Arc<dyn Fn() -> Vec<String> + Send + Sync>,
    apply: Arc<dyn Fn(Fact) + Send + Sync>,
    cancel: CancellationToken,
) {
    use futures_util::StreamExt;
    let mut backoff = FIRST_BACKOFF;
    loop {
        if cancel.is_cancelled() {
            return;
        }
        let subscribed = async {
            let mut ps =
                tokio::time::timeout(BACKGROUND_TIMEOUT, cluster.client.get_async_pubsub())
                    .await
                    .map_err(|_| "no answer subscribing".to_string())?
                    .map_err(|e| e.to_string())?;
            tokio::time::timeout(BACKGROUND_TIMEOUT, ps.subscribe(cluster.key(&["facts"])))
                .await
                .map_err(|_| "no answer subscribing".to_string())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(ps)
        }
        .await;
        let ps = match subscribed {
            Ok(ps) => ps,
            Err(e) => {
                cluster.note_error(&e);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        // Subscribed first, then read: a fact published in between is seen twice, never missed
        // (applying one twice changes nothing).
        match cluster.stored_facts(&endpoints()).await {
            Ok(facts) => {
                for f in facts {
                    cluster.facts_applied.fetch_add(1, Ordering::Relaxed);
                    apply(f);
                }
            }
            Err(e) => {
                cluster.note_error(&e);
                continue;
            }
        }
        backoff = FIRST_BACKOFF;
        let mut messages = ps.into_on_message();
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => return,
                m = messages.next() => m,
            };
            let Some(msg) = msg else {
                break;
            };
            let payload: Vec<u8> = msg.get_payload_bytes().to_vec();
            if payload.len() > MAX_FACT_BYTES {
                continue;
            }
            let Ok(m) = serde_json::from_slice::<Message>(&payload) else {
                continue;
            };
            if m.origin == cluster.replica {
                continue;
            }
            cluster.facts_applied.fetch_add(1, Ordering::Relaxed);
            apply(m.fact);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}
