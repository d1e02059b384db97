//! Leases: a share of a key's buckets taken from the store ahead of its requests and spent here
//! without a call, and what is left of it given back.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Cluster;
use super::settle::Settle;
use super::{Ask, Batch, Verdict};

/// How long a lease may be spent; what is left after goes back to the store.
const LEASE_FOR: Duration = Duration::from_millis(250);
/// The requests a lease asks for: twice what the last one spent, within these.
const LEASE_FIRST: u64 = 16;
const LEASE_MOST: u64 = 1024;
/// The fewest requests a lease is worth (fewer: the key is too near its limits or too small to
/// lease, and each request asks the store).
const LEASE_FEWEST: u64 = 8;
/// How long the store counts a lease as outstanding when its replica does not give it back:
/// longer than the replica spends it, whatever the call took or the clocks drift.
pub(super) const LEASE_STORE_LIFE: Duration = Duration::from_millis(1250);

/// A share of a key's buckets taken from the store ahead of its requests, spent here without a
/// call. Taken only while the key is far from its limits (`admit.lua` says how far), so the fleet
/// never admits more than the buckets hold; what is not spent within [`LEASE_FOR`] goes back.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    /// The key, limits and month it was taken for.
    key: Batch,
    /// Its name in the store (this replica's id and a count).
    id: String,
    /// Requests left (keys with `rpm`).
    requests: u64,
    /// Tokens left (keys with `tpm`).
    tokens: u64,
    until: std::time::Instant,
    /// Requests admitted on it.
    used: u64,
    /// The key's spend as the store last said (keys with a lease have no budget).
    usd: f64,
}

impl Lease {
    /// Whether it was taken for these limits and month.
    fn is_for(&self, rpm: u32, tpm: u64, month: &str) -> bool {
        self.key.rpm == rpm && self.key.tpm == tpm && self.key.month == month
    }

    /// Spends one request of `tokens` on the lease, if it holds them and has not run out.
    fn take(&mut self, tokens: u64, now: std::time::Instant) -> bool {
        let (rpm, tpm) = (self.key.rpm, self.key.tpm);
        if now >= self.until || (rpm > 0 && self.requests == 0) || (tpm > 0 && tokens > self.tokens)
        {
            return false;
        }
        if rpm > 0 {
            self.requests -= 1;
        }
        if tpm > 0 {
            self.tokens -= tokens;
        }
        self.used += 1;
        true
    }

    /// What goes back to the store: the requests and tokens left.
    fn left(&self) -> (u64, u64) {
        (
            if self.key.rpm > 0 { self.requests } else { 0 },
            if self.key.tpm > 0 { self.tokens } else { 0 },
        )
    }
}

/// A lease that ends: its name, and the requests and tokens left of it.
pub(super) type GivenBack = (String, (u64, u64));

impl Cluster {
    /// [`Cluster::admit_on_lease`] for a queued admission of `key`.
    pub(super) fn lease_for(&self, key: &Batch, tokens: u64) -> Option<f64> {
        if key.budget.is_some() || key.more {
            return None;
        }
        self.admit_on_lease(&key.client, key.rpm, key.tpm, &key.month, tokens)
    }

    /// Admits one request of a key without a budget on its lease, if it has one for these
    /// limits and month that holds it: the key's spend as last seen.
    pub(super) fn admit_on_lease(
        &self,
        client: &str,
        rpm: u32,
        tpm: u64,
        month: &str,
        tokens: u64,
    ) -> Option<f64> {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        if leases.is_empty() {
            return None;
        }
        let lease = leases.get_mut(client)?;
        if !lease.is_for(rpm, tpm, month) || !lease.take(tokens, std::time::Instant::now()) {
            return None;
        }
        let usd = lease.usd;
        drop(leases);
        self.lease_admissions.fetch_add(1, Ordering::Relaxed);
        Some(usd)
    }

    /// One call of the admission script for `batch`; a verdict for each, in order. A key
    /// without a budget gives back what is left of its lease and asks for a new one, sized by
    /// what the last one spent.
    pub(super) async fn admit_batch(
        &self,
        key: &Batch,
        batch: &[&Ask],
        settles: &[Settle],
    ) -> Result<Vec<Result<Verdict, ()>>, String> {
        let leasing =
            !key.more && key.budget.is_none() && (key.rpm > 0 || key.tpm > 0) && !batch.is_empty();
        let (ask, back) = if leasing {
            let old = self
                .leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key.client);
            // One for other limits or another month (a reload, a new month) ends by itself.
            let old = match old {
                Some(l) if !l.is_for(key.rpm, key.tpm, &key.month) => {
                    self.ended.lock().unwrap_or_else(|e| e.into_inner()).push(l);
                    None
                }
                old => old,
            };
            let n = old.as_ref().map_or(LEASE_FIRST, |l| {
                l.used.saturating_mul(2).clamp(LEASE_FIRST, LEASE_MOST)
            });
            let per = batch.iter().map(|w| w.tokens).max().unwrap_or(0).max(1);
            let back = old.map(|l| {
                let left = l.left();
                if left != (0, 0) {
                    self.leases_returned.fetch_add(1, Ordering::Relaxed);
                }
                (l.id, left)
            });
            (
                Some([
                    n,
                    n.saturating_mul(per),
                    LEASE_FEWEST,
                    LEASE_FEWEST.saturating_mul(per),
                ]),
                back,
            )
        } else {
            (None, None)
        };
        let id = ask.map(|_| {
            format!(
                "{}:{}",
                self.replica,
                self.lease_count.fetch_add(1, Ordering::Relaxed)
            )
        });
        // The lease's time counts from before the call: it ends here before it ends in the
        // store, whatever the call took.
        let asked_at = std::time::Instant::now();
        let (verdicts, lease) = self
            .invoke_admit(key, batch, settles, ask.zip(id.as_deref()), back)
            .await?;
        if let (Some((requests, tokens)), Some(id)) = (lease, id) {
            let usd = verdicts
                .iter()
                .rev()
                .find_map(|v| match v {
                    Ok(Verdict::Admitted { usd } | Verdict::Budget { usd }) => Some(*usd),
                    _ => None,
                })
                .unwrap_or(0.0);
            self.leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(
                    key.client.clone(),
                    Lease {
                        key: key.clone(),
                        id,
                        requests,
                        tokens,
                        until: asked_at + LEASE_FOR,
                        used: 0,
                        usd,
                    },
                );
            self.leases_granted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(verdicts)
    }

    /// Gives back what is left of leases that ran out of time (or all, `all`), one call a key.
    pub(super) async fn give_back(&self, all: bool) -> Result<(), String> {
        let now = std::time::Instant::now();
        let mut expired: Vec<Lease> =
            std::mem::take(&mut *self.ended.lock().unwrap_or_else(|e| e.into_inner()));
        {
            let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            let names: Vec<String> = leases
                .iter()
                .filter(|(_, l)| all || l.until <= now)
                .map(|(k, _)| k.clone())
                .collect();
            expired.extend(names.into_iter().filter_map(|k| leases.remove(&k)));
        }
        // Spent whole, a lease that ran out of time ends in the store by its expiry.
        for l in expired {
            let left = l.left();
            if left == (0, 0) {
                continue;
            }
            self.invoke_admit(&l.key, &[], &[], None, Some((l.id, left)))
                .await?;
            self.leases_returned.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Takes `s`'s completion tokens from its key's lease, as many as it holds.
    pub(super) fn charge_lease(&self, s: &mut Settle) {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        if leases.is_empty() {
            return;
        }
        let Some(lease) = leases.get_mut(&s.client) else {
            return;
        };
        if !lease.is_for(s.rpm, s.tpm, &s.month) || std::time::Instant::now() >= lease.until {
            return;
        }
        let t = lease.tokens.min(s.completion_tokens);
        lease.tokens -= t;
        s.completion_tokens -= t;
    }
}

/// Gives back what leases left when their time ran out, so a key whose traffic stopped does not
/// keep units from the rest of the fleet.
pub(super) async fn lease_keeper(cluster: Arc<Cluster>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(LEASE_FOR);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if cluster.is_up()
            && let Err(e) = cluster.give_back(false).await
        {
            cluster.down(&e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::test_util::settings;

    fn key(rpm: u32, tpm: u64, budget: Option<f64>) -> Batch {
        Batch {
            client: "k".into(),
            rpm,
            tpm,
            budget: budget.map(f64::to_bits),
            month: "2026-12".into(),
            more: false,
        }
    }

    #[test]
    fn a_lease_admits_what_it_holds_and_no_more() {
        let now = std::time::Instant::now();
        let lease = |key: Batch, requests: u64, tokens: u64, until| Lease {
            key,
            id: "r:0".into(),
            requests,
            tokens,
            until,
            used: 0,
            usd: 0.0,
        };
        let mut l = lease(key(100, 1000, None), 3, 250, now + LEASE_FOR);
        assert!(l.is_for(100, 1000, "2026-12"));
        assert!(!l.is_for(100, 1000, "2027-01") && !l.is_for(60, 1000, "2026-12"));
        assert!(l.take(100, now));
        assert!(l.take(100, now));
        // 50 tokens left: a request of 60 is not held (it asks the store), one of 50 is.
        assert!(!l.take(60, now));
        assert!(l.take(50, now));
        // No request left.
        assert!(!l.take(0, now));
        assert_eq!((l.used, l.left()), (3, (0, 0)));
        // Out of time, whatever it holds.
        let mut l = lease(key(100, 0, None), 5, 0, now);
        assert!(!l.take(0, now));
        assert_eq!(l.left(), (5, 0));
        // A key without `rpm` counts tokens only (and gives back no requests).
        let mut l = lease(key(0, 1000, None), 0, 10, now + LEASE_FOR);
        assert!(l.take(10, now));
        assert!(!l.take(1, now));
        assert_eq!(l.left(), (0, 0));
    }

    /// A leased key's completion tokens are charged to its lease first; what the lease cannot
    /// hold goes to the store (the settle queue), and a key without a lease sends them all.
    #[tokio::test]
    async fn completion_tokens_are_charged_to_the_lease_first() {
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        let c = Cluster::new(settings("redis://127.0.0.1:1/0"), alerts, None).unwrap();
        let k = key(600, 6000, None);
        c.leases.lock().unwrap().insert(
            k.client.clone(),
            Lease {
                key: k.clone(),
                id: "r:0".into(),
                requests: 10,
                tokens: 20,
                // An hour, not LEASE_FOR: this test is about the order of charging, and a
                // stall past 250 ms would expire the lease (expiry is pinned, with explicit
                // instants, by `a_lease_admits_what_it_holds_and_no_more`).
                until: std::time::Instant::now() + Duration::from_secs(3600),
                used: 0,
                usd: 0.0,
            },
        );
        let settle = |tokens: u64, client: &str| Settle {
            client: client.into(),
            month: k.month.clone(),
            request: None,
            id: uuid::Uuid::new_v4().to_string(),
            sent: false,
            usd: 0.0,
            completion_tokens: tokens,
            tpm: 6000,
            rpm: 600,
            budget: None,
        };
        c.settle(settle(15, "k"));
        c.settle(settle(15, "k"));
        c.settle(settle(7, "other"));
        assert_eq!(c.leases.lock().unwrap()["k"].tokens, 0);
        let mut rx = c.settles_rx.lock().unwrap().take().unwrap();
        let queued: Vec<(String, u64)> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|s| (s.client, s.completion_tokens))
            .collect();
        assert_eq!(queued, vec![("k".into(), 10), ("other".into(), 7)]);
    }
}
