//! Settles: a request's end queued off the request path and applied by the settler, each under
//! a name the store applies once (a settle sent again charges nothing twice).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Batch, MAX_BATCH_WAITING};
use super::{Cluster, SETTLED_FOR, SPEND_TTL};

/// A request's end, to be applied to the store.
#[derive(Debug, Clone)]
pub struct Settle {
    pub client: String,
    pub month: String,
    /// The reservation to let go (`None`: the request held none in the store). A request
    /// admitted on its own while the store was slow still names the reservation it asked for:
    /// the store's late run of that admission is rolled back by it.
    pub request: Option<String>,
    /// The settle's own name (unique: the gateway makes it, never the client): the store
    /// applies a settle of a name once, so one sent again after a call that timed out (and ran)
    /// charges nothing twice.
    pub id: String,
    /// Sent once already in a call whose answer was lost: kept apart (never merged into a new
    /// name) so the store can tell it was applied.
    pub sent: bool,
    pub usd: f64,
    pub completion_tokens: u64,
    pub tpm: u64,
    /// The key's `rpm` (0: none) and budget: with `tpm` and the month, the admissions a settle
    /// can ride along with.
    pub rpm: u32,
    pub budget: Option<f64>,
}

impl Settle {
    fn batch(&self) -> Batch {
        Batch {
            client: self.client.clone(),
            rpm: self.rpm,
            tpm: self.tpm,
            budget: self.budget.filter(|b| b.is_finite()).map(f64::to_bits),
            month: self.month.clone(),
            more: false,
        }
    }
}

impl Cluster {
    /// Queues a request's end for the store (never waits). Completion tokens of a key holding a
    /// lease are charged to the lease first (its tokens are the fleet's, taken from the bucket).
    pub fn settle(&self, mut s: Settle) {
        if s.completion_tokens > 0 && s.tpm > 0 && s.budget.is_none() {
            self.charge_lease(&mut s);
        }
        if s.request.is_none() && s.usd <= 0.0 && s.completion_tokens == 0 {
            return;
        }
        self.unsettled(std::slice::from_ref(&s), 1.0);
        // While a call for the key is out, the settle goes in the key's next call (the same
        // keys, one call instead of two under load).
        let s = {
            let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
            // No call out (the quiet case): no key to build.
            if batches.is_empty() {
                drop(batches);
                self.queue_settle(s);
                return;
            }
            match batches.get_mut(&s.batch()) {
                Some(g) if g.settles.len() < MAX_BATCH_WAITING => {
                    g.settles.push(s);
                    return;
                }
                _ => s,
            }
        };
        self.to_settler(std::iter::once(s));
    }

    /// Counts `settles`' costs as not yet in the store (`sign` 1) or as applied (-1).
    pub(super) fn unsettled(&self, settles: &[Settle], sign: f64) {
        let mut map = self.unsettled_usd.lock().unwrap_or_else(|e| e.into_inner());
        for s in settles {
            if !(s.usd.is_finite() && s.usd > 0.0) {
                continue;
            }
            let k = (s.client.clone(), s.month.clone());
            let v = map.entry(k.clone()).or_insert(0.0);
            *v += sign * s.usd;
            if *v <= 1e-12 {
                map.remove(&k);
            }
        }
    }

    /// Queues settles for the settler (never waits; a full queue drops and counts).
    pub(super) fn to_settler(&self, settles: impl IntoIterator<Item = Settle>) {
        for s in settles {
            self.queue_settle(s);
        }
    }

    fn queue_settle(&self, s: Settle) {
        if let Err(e) = self.settles.try_send(s) {
            // Lost: the next seeding carries its cost instead.
            let (tokio::sync::mpsc::error::TrySendError::Full(s)
            | tokio::sync::mpsc::error::TrySendError::Closed(s)) = e;
            self.unsettled(std::slice::from_ref(&s), -1.0);
            let n = self.settles_dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n == 1 || n.is_multiple_of(1000) {
                tracing::warn!(
                    dropped_total = n,
                    "cluster settle queue full: a request's cost was not sent to the shared store"
                );
            }
        }
    }

    /// Applies `settles` in one call.
    async fn apply(&self, settles: &[Settle]) -> Result<(), String> {
        let mut inv = self.settle.prepare_invoke();
        inv.arg(SPEND_TTL.as_secs())
            .arg(SETTLED_FOR.as_millis() as u64);
        for s in settles {
            inv.key(self.key(&["spend", &s.client, &s.month]))
                .key(self.key(&["resv", &s.client]))
                .key(self.key(&["resvamt", &s.client]))
                .key(self.key(&["resvtot", &s.client]))
                .key(self.key(&["tpm", &s.client, &s.tpm.to_string()]))
                .key(self.key(&["settled", &s.client]))
                .arg(&s.id)
                .arg(s.request.as_deref().unwrap_or(""))
                .arg(if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                })
                .arg(s.completion_tokens)
                .arg(s.tpm);
        }
        self.call::<i64>(&inv).await.map(|_| ())
    }
}

/// Applies settles in order; while the store is away they wait (in the queue) for it.
/// Settles sent in one call at most.
const SETTLE_BATCH: usize = 128;
/// How long the settler lets settles gather after the first of a batch arrives.
const SETTLE_LINGER: Duration = Duration::from_millis(2);

/// Settles that hold no reservation, merged per key, month and `tpm` (their costs and tokens
/// add up): one entry each in the call instead of one a request. Those with a reservation stay
/// as they are.
fn merge_settles(batch: &[Settle]) -> Vec<Settle> {
    let mut out: Vec<Settle> = Vec::with_capacity(batch.len());
    let mut at: std::collections::HashMap<(&str, &str, u64), usize> = Default::default();
    for s in batch {
        // A settle that may have been applied keeps its own name (a merged one takes a new).
        if s.request.is_some() || s.sent {
            out.push(s.clone());
            continue;
        }
        match at.get(&(s.client.as_str(), s.month.as_str(), s.tpm)) {
            Some(&i) => {
                let m = &mut out[i];
                if !m.id.starts_with("m:") {
                    m.id = format!("m:{}", uuid::Uuid::new_v4());
                }
                m.usd += if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                };
                m.completion_tokens = m.completion_tokens.saturating_add(s.completion_tokens);
            }
            None => {
                at.insert((s.client.as_str(), s.month.as_str(), s.tpm), out.len());
                let mut s = s.clone();
                s.usd = if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                };
                out.push(s);
            }
        }
    }
    out
}

pub(super) async fn settler(cluster: Arc<Cluster>, cancel: CancellationToken) {
    let Some(mut rx) = cluster
        .settles_rx
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    else {
        return;
    };
    let mut pending: VecDeque<Settle> = VecDeque::new();
    // A call that failed is sent again as it was (the same merged settles under the same
    // names): it may have run, and the store tells a name it applied.
    let mut unanswered: Option<(Vec<Settle>, usize)> = None;
    loop {
        if pending.is_empty() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                s = rx.recv() => match s {
                    Some(s) => pending.push_back(s),
                    None => return,
                },
            }
            // A moment for more to gather: under load one call carries many (a settle is off
            // the request path; this delays a reservation's release by as much at most).
            if rx.len() + 1 < SETTLE_BATCH {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(SETTLE_LINGER) => {}
                }
            }
        }
        while let Ok(s) = rx.try_recv() {
            pending.push_back(s);
        }
        if pending.is_empty() {
            continue;
        }
        if !cluster.is_up() {
            if !cluster.until_back(&cancel).await {
                return;
            }
            continue;
        }
        // What queued while the last call ran goes in the next: one call, in order.
        let (batch, n) = unanswered.take().unwrap_or_else(|| {
            let n = pending.len().min(SETTLE_BATCH);
            (merge_settles(&pending.make_contiguous()[..n]), n)
        });
        match cluster.apply(&batch).await {
            Ok(()) => {
                let done: Vec<Settle> = pending.drain(..n).collect();
                cluster.unsettled(&done, -1.0);
            }
            Err(e) => {
                cluster.down(&e);
                unanswered = Some((batch, n));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settles_without_a_reservation_merge_per_key_and_month() {
        let s = |client: &str, month: &str, request: Option<&str>, usd: f64, tokens: u64| Settle {
            client: client.into(),
            month: month.into(),
            request: request.map(str::to_string),
            id: uuid::Uuid::new_v4().to_string(),
            sent: false,
            usd,
            completion_tokens: tokens,
            tpm: 600,
            rpm: 0,
            budget: None,
        };
        let merged = merge_settles(&[
            s("a", "2026-12", None, 0.5, 10),
            s("b", "2026-12", None, 1.0, 1),
            s("a", "2026-12", Some("r1"), 0.25, 0),
            s("a", "2026-12", None, f64::NAN, 5),
            s("a", "2027-01", None, 2.0, 7),
            s("a", "2026-12", None, 0.5, 10),
        ]);
        let got: Vec<_> = merged
            .iter()
            .map(|m| {
                (
                    m.client.as_str(),
                    m.month.as_str(),
                    m.request.as_deref(),
                    m.usd,
                    m.completion_tokens,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", "2026-12", None, 1.0, 25),
                ("b", "2026-12", None, 1.0, 1),
                ("a", "2026-12", Some("r1"), 0.25, 0),
                ("a", "2027-01", None, 2.0, 7),
            ]
        );
    }
}
