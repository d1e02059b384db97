//! Admission: one request asked of the store, and the group commit that sends the admissions of
//! one key that queue while its call is out together in the next call (the flusher).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::lease::{GivenBack, LEASE_STORE_LIFE};
use super::settle::Settle;
use super::{
    Ask, BACKGROUND_TIMEOUT, Batch, Cluster, MAX_BATCH_WAITING, SETTLED_FOR, SPEND_TTL, Verdict,
};

/// A reservation of a replica that died before settling is let go after this.
const HOLD: Duration = Duration::from_secs(3600);

/// One admission asked of the store.
#[derive(Debug, Clone, Copy)]
pub struct Admit<'a> {
    pub client: &'a str,
    pub rpm: Option<u32>,
    pub tpm: Option<u64>,
    /// Taken from `tpm` at once.
    pub tokens: u64,
    pub budget: Option<f64>,
    /// Held against `budget` until the request settles.
    pub reserve: f64,
    /// The reservation's name (the request's id).
    pub request: &'a str,
    /// `YYYY-MM`.
    pub month: &'a str,
    /// Tokens more for a request already admitted (a continued conversation's history): no
    /// request counted, no lease taken, spent or ended, batched apart from admissions.
    pub more: bool,
}

/// What waits for a key's next call: admissions, and settles of the key that ride along.
#[derive(Default)]
pub(super) struct Group {
    waiting: Vec<Waiting>,
    pub(super) settles: Vec<Settle>,
}

/// One admission waiting for its call.
struct Waiting {
    ask: Ask,
    tx: tokio::sync::oneshot::Sender<Result<Verdict, ()>>,
}

/// An admission's part: the call for its quiet key, or a place in the key's next call.
enum Turn {
    Call(Ask),
    Wait(tokio::sync::oneshot::Receiver<Result<Verdict, ()>>),
}

/// The first asker's call for a key: when it ends (or is dropped), those who queued meanwhile
/// are handed to a flusher.
struct Lead<'a> {
    cluster: &'a Arc<Cluster>,
    key: Option<Batch>,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.cluster.hand_over(key);
        }
    }
}

/// What the admission script answered: a verdict a request, and the lease granted (requests,
/// tokens), if any.
type LeasedVerdicts = Result<(Vec<Result<Verdict, ()>>, Option<(u64, u64)>), String>;

impl Cluster {
    /// Asks the store to admit one request, within `cluster.timeout`. `Err` (the store away or
    /// slow) means: admit on local state.
    ///
    /// Requests for one key (with the same limits and month) that ask while a call for that key
    /// is on its way go together in the next call (group commit): the script takes them in
    /// order, each as if alone, so the counts stay exact; under load a call carries many.
    pub async fn admit(self: &Arc<Self>, a: &Admit<'_>) -> Result<Verdict, ()> {
        if !self.is_up() {
            self.fallbacks.fetch_add(1, Ordering::Relaxed);
            return Err(());
        }
        let budget = a.budget.filter(|b| b.is_finite()).map(f64::to_bits);
        if budget.is_none()
            && !a.more
            && let Some(usd) = self.admit_on_lease(
                a.client,
                a.rpm.unwrap_or(0),
                a.tpm.unwrap_or(0),
                a.month,
                a.tokens,
            )
        {
            return Ok(Verdict::Admitted { usd });
        }
        let key = Batch {
            client: a.client.to_string(),
            rpm: a.rpm.unwrap_or(0),
            tpm: a.tpm.unwrap_or(0),
            budget,
            month: a.month.to_string(),
            more: a.more,
        };
        let ask = Ask {
            tokens: a.tokens,
            reserve: if a.reserve.is_finite() {
                a.reserve.max(0.0)
            } else {
                0.0
            },
            request: a.request.to_string(),
        };
        let started = std::time::Instant::now();
        // The first to ask for a key calls at once, for itself alone (no hop through another
        // task when the key is quiet); those who ask while that call is out wait together for
        // the next, which a flusher makes for them.
        let turn = {
            let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
            match batches.get_mut(&key) {
                Some(g) if g.waiting.len() < MAX_BATCH_WAITING => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    g.waiting.push(Waiting { ask, tx });
                    Turn::Wait(rx)
                }
                Some(_) => {
                    drop(batches);
                    self.fallbacks.fetch_add(1, Ordering::Relaxed);
                    self.slow_answers.fetch_add(1, Ordering::Relaxed);
                    self.wake.notify_one();
                    return Err(());
                }
                None => {
                    batches.insert(key.clone(), Group::default());
                    Turn::Call(ask)
                }
            }
        };
        let answer = match turn {
            Turn::Call(ask) => {
                // Whoever queues meanwhile goes in the next call, or the key is quiet again —
                // also when this request is dropped mid-call (its client gone).
                let lead = Lead {
                    cluster: self,
                    key: Some(key.clone()),
                };
                let answer = tokio::time::timeout(
                    self.settings.timeout,
                    self.admit_batch(&key, &[&ask], &[]),
                )
                .await;
                drop(lead);
                match answer {
                    Ok(Ok(mut v)) => Ok(Ok(v.pop().unwrap_or(Err(())))),
                    Ok(Err(e)) => {
                        self.down(&e);
                        Ok(Ok(Err(())))
                    }
                    Err(elapsed) => Err(elapsed),
                }
            }
            Turn::Wait(rx) => tokio::time::timeout(self.settings.timeout, rx).await,
        };
        let verdict = match answer {
            Ok(Ok(Ok(v))) => v,
            Ok(Ok(Err(()))) | Ok(Err(_)) => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                return Err(());
            }
            Err(_) => {
                // Slow is not down: this request is admitted alone (its place in the batch is
                // given up if the call has not left yet), and the keeper asks the store at once
                // (with its own, longer timeout) whether it is away.
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                self.slow_answers.fetch_add(1, Ordering::Relaxed);
                self.note_error(&format!(
                    "no answer within cluster.timeout ({} ms)",
                    self.settings.timeout.as_millis()
                ));
                self.wake.notify_one();
                return Err(());
            }
        };
        let waited = started.elapsed().as_micros() as u64;
        self.longest_wait_us.fetch_max(waited, Ordering::Relaxed);
        Ok(verdict)
    }

    /// After a call for `key`: the admissions that queued meanwhile get a flusher, or the key is
    /// quiet again (the next to ask calls at once).
    fn hand_over(self: &Arc<Self>, key: Batch) {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = batches.get_mut(&key) {
            g.waiting.retain(|w| !w.tx.is_closed());
            if g.waiting.is_empty() {
                // Settles that waited for admissions that did not come go the settler's way.
                let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                drop(batches);
                self.to_settler(settles);
            } else if let Ok(rt) = tokio::runtime::Handle::try_current() {
                drop(batches);
                rt.spawn(self.clone().flush(key));
            } else {
                // No runtime (shutting down): the waiting give up at their timeout.
                let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                drop(batches);
                self.to_settler(settles);
            }
        }
    }

    /// Sends the admissions waiting for `key`, call after call, until none is left.
    async fn flush(self: Arc<Self>, key: Batch) {
        loop {
            let (batch, settles) = {
                let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
                let Some(g) = batches.get_mut(&key) else {
                    return;
                };
                // A request that stopped waiting (past `cluster.timeout`) was admitted on its
                // own: it takes nothing from the store.
                g.waiting.retain(|w| !w.tx.is_closed());
                if g.waiting.is_empty() {
                    let settles = batches.remove(&key).map(|g| g.settles).unwrap_or_default();
                    drop(batches);
                    self.to_settler(settles);
                    return;
                }
                (
                    std::mem::take(&mut g.waiting),
                    std::mem::take(&mut g.settles),
                )
            };
            // Those the lease the last call brought can hold take nothing from the store.
            let batch: Vec<Waiting> = batch
                .into_iter()
                .filter_map(|w| match self.lease_for(&key, w.ask.tokens) {
                    Some(usd) => {
                        let _ = w.tx.send(Ok(Verdict::Admitted { usd }));
                        None
                    }
                    None => Some(w),
                })
                .collect();
            if batch.is_empty() {
                if !settles.is_empty() {
                    self.to_settler(settles);
                }
                continue;
            }
            let asks: Vec<&Ask> = batch.iter().map(|w| &w.ask).collect();
            let verdicts = self.admit_batch(&key, &asks, &settles).await;
            match verdicts {
                Ok(vs) => {
                    self.unsettled(&settles, -1.0);
                    self.settles_carried
                        .fetch_add(settles.len() as u64, Ordering::Relaxed);
                    for (w, v) in batch.into_iter().zip(vs) {
                        let _ = w.tx.send(v);
                    }
                }
                Err(e) => {
                    self.down(&e);
                    // Not known to be applied (the call may have run): the settler sends them
                    // again when the store is back, each under its own name, so the store
                    // applies each once.
                    self.to_settler(settles.into_iter().map(|mut s| {
                        s.sent = true;
                        s
                    }));
                    for w in batch {
                        let _ = w.tx.send(Err(()));
                    }
                }
            }
        }
    }

    /// The admission script itself: verdicts in order, and the lease granted if one was asked
    /// (`ask`: requests, tokens, and the fewest of each worth a lease; the lease's name) and
    /// given. `back`: a lease that ends, and what is left of it.
    pub(super) async fn invoke_admit(
        &self,
        key: &Batch,
        batch: &[&Ask],
        settles: &[Settle],
        ask: Option<([u64; 4], &str)>,
        back: Option<GivenBack>,
    ) -> LeasedVerdicts {
        let client = key.client.as_str();
        let ([lr, lt, minr, mint], lease_id) = ask.unwrap_or(([0; 4], ""));
        let (back_id, (backr, backt)) = back.unwrap_or_default();
        let limits = format!("{}:{}", key.rpm, key.tpm);
        let mut inv = self.admit.prepare_invoke();
        inv.key(self.key(&["rpm", client, &key.rpm.to_string()]))
            .key(self.key(&["tpm", client, &key.tpm.to_string()]))
            .key(self.key(&["spend", client, &key.month]))
            .key(self.key(&["resv", client]))
            .key(self.key(&["resvamt", client]))
            .key(self.key(&["resvtot", client]))
            .key(self.key(&["lease", client, &limits]))
            .key(self.key(&["leaseamt", client, &limits]))
            .key(self.key(&["settled", client]))
            .arg(key.rpm)
            .arg(key.tpm)
            .arg(key.budget.map(f64::from_bits).unwrap_or(-1.0))
            .arg(HOLD.as_millis() as u64)
            .arg(settles.len())
            .arg(SPEND_TTL.as_secs())
            .arg(lr)
            .arg(lt)
            .arg(self.replicas())
            .arg(minr)
            .arg(mint)
            .arg(lease_id)
            .arg(LEASE_STORE_LIFE.as_millis() as u64)
            .arg(back_id)
            .arg(backr)
            .arg(backt)
            .arg(SETTLED_FOR.as_millis() as u64);
        for s in settles {
            inv.arg(s.request.as_deref().unwrap_or(""))
                .arg(if s.usd.is_finite() {
                    s.usd.max(0.0)
                } else {
                    0.0
                })
                .arg(s.completion_tokens)
                .arg(&s.id);
        }
        for w in batch {
            inv.arg(w.tokens).arg(w.reserve).arg(&w.request);
        }
        let mut conn = self.conn.clone();
        let answer = tokio::time::timeout(
            BACKGROUND_TIMEOUT,
            inv.invoke_async::<Vec<redis::Value>>(&mut conn),
        )
        .await
        .map_err(|_| format!("no answer within {} ms", BACKGROUND_TIMEOUT.as_millis()))?
        .map_err(|e| e.to_string())?;
        self.admission_calls.fetch_add(1, Ordering::Relaxed);
        self.store_admissions
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if answer.len() != batch.len() * 5 + 3 {
            return Err(format!(
                "the admission script answered {} values for {} requests",
                answer.len(),
                batch.len()
            ));
        }
        let (answer, lease) = answer.split_at(batch.len() * 5);
        let (granted, requests, tokens): (u64, u64, u64) =
            redis::from_redis_value(redis::Value::Array(lease.to_vec()))
                .map_err(|e| e.to_string())?;
        // Never more than was asked, whatever the store says.
        let lease = (ask.is_some() && granted == 1).then_some((requests.min(lr), tokens.min(lt)));
        let verdicts = answer
            .chunks(5)
            .map(|c| {
                let (v, usd, retry, reset, remaining): (String, String, u64, u64, String) =
                    redis::from_redis_value(redis::Value::Array(c.to_vec()))
                        .map_err(|e| e.to_string())?;
                let usd = usd
                    .parse::<f64>()
                    .ok()
                    .filter(|u| u.is_finite())
                    .unwrap_or(0.0);
                let remaining = remaining.parse::<f64>().unwrap_or(0.0).max(0.0) as u64;
                let limited = |kind| Verdict::Limited {
                    kind,
                    remaining,
                    retry_after: Duration::from_millis(retry),
                    reset: Duration::from_millis(reset),
                };
                Ok(Ok(match v.as_str() {
                    "ok" => Verdict::Admitted { usd },
                    "budget" => Verdict::Budget { usd },
                    "requests" => limited("requests"),
                    "tokens" => limited("tokens"),
                    other => {
                        return Err(format!(
                            "unexpected answer from the admission script: {other:.40}"
                        ));
                    }
                }))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok((verdicts, lease))
    }
}
