//! Hedged requests: when the first attempt has not answered (non-stream: the response; stream:
//! its first content chunk) within the hedge delay, a copy goes to the next candidate and the two
//! race. The first success wins; the loser is dropped at once — its upstream connection closed,
//! so a metered API stops generating — and recorded as `hedge_cancelled`. A failure of either
//! before the other succeeds goes through the normal rules (`settle`), and the survivor carries
//! on as an ordinary attempt (with its retries). A stream commits only on success, so a committed
//! stream is never duplicated.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::attempt::{Failure, Success};
use super::{EndpointOutcome, FAILED, Finished, Run, Settled};
use crate::config::Endpoint;
use crate::error::AttemptReport;
use crate::routing::outcome::Outcome;

pub(super) type AttemptFuture = Pin<Box<dyn Future<Output = Result<Success, Failure>> + Send>>;

/// An attempt running as a future of its own.
pub(super) struct Racing {
    pub key_idx: Option<usize>,
    pub t0: Instant,
    /// The address it went to, when its endpoint has several.
    pub address: Option<Arc<str>>,
    pub fut: AttemptFuture,
    /// Its span, when the request is traced.
    pub span: Option<crate::wire::trace::SpanId>,
    /// A hedged copy.
    pub hedge: bool,
}

impl Racing {
    fn finish(&self, result: Result<Success, Failure>) -> Finished {
        Finished {
            key_idx: self.key_idx,
            t0: self.t0,
            result,
            span: self.span,
            hedge: self.hedge,
        }
    }
}

/// Which side of the race.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    First,
    Hedge,
}

impl Run {
    /// Tries `a`, hedging to the first admissible endpoint of `rest` after `delay`. Returns the
    /// endpoint the outcome belongs to (the hedge's, when it won or outlived `a`).
    pub(super) async fn try_hedged(
        &mut self,
        a: &Arc<Endpoint>,
        delay: Duration,
        rest: &[String],
    ) -> (Arc<Endpoint>, EndpointOutcome) {
        let key_a = match self.pick(a).await {
            Ok(k) => k,
            Err(outcome) => return (a.clone(), outcome),
        };
        let mut first = match self.start(a, key_a, None) {
            Ok(r) => r,
            Err(f) => {
                let done = Finished {
                    key_idx: key_a,
                    t0: Instant::now(),
                    result: Err(f),
                    span: None,
                    hedge: false,
                };
                return (a.clone(), self.try_endpoint(a, Some(Box::new(done))).await);
            }
        };
        self.current = Some((a.clone(), first.t0, first.span));
        // Time in the selects and awaits below is upstream (or the hedge delay): not the
        // gateway's own.
        let t = Instant::now();
        tokio::select! {
            biased;
            result = &mut first.fut => {
                self.waited += t.elapsed();
                self.current = None;
                let done = first.finish(result);
                return (a.clone(), self.try_endpoint(a, Some(Box::new(done))).await);
            }
            _ = tokio::time::sleep(delay) => {}
        }
        self.waited += t.elapsed();
        let candidate = match self.hedge_candidate(rest).await {
            Some(c) => Some(c),
            // No other endpoint to hedge to: another address of this one, if it has one.
            None => self.hedge_same(a, key_a, first.address.clone()),
        };
        let Some((b, mut hedge)) = candidate else {
            let t = Instant::now();
            let result = (&mut first.fut).await;
            self.waited += t.elapsed();
            self.current = None;
            let done = first.finish(result);
            return (a.clone(), self.try_endpoint(a, Some(Box::new(done))).await);
        };
        self.current_hedge = Some((b.clone(), hedge.t0, hedge.span));
        // Both run now. The first to finish decides: a success wins outright; a failure is
        // settled and the other carries on alone.
        let t = Instant::now();
        let (side, result) = tokio::select! {
            r = &mut first.fut => (Side::First, r),
            r = &mut hedge.fut => (Side::Hedge, r),
        };
        self.waited += t.elapsed();
        let (done_ep, done, other_ep, other) = match side {
            Side::First => (a.clone(), first.finish(result), b, hedge),
            Side::Hedge => (b, hedge.finish(result), a.clone(), first),
        };
        self.current = None;
        self.current_hedge = None;
        if done.result.is_ok() {
            drop(other.fut);
            self.cancelled(
                &other_ep,
                (other.t0, other.address.clone(), other.span, other.hedge),
                &done_ep,
            );
            if side == Side::Hedge {
                self.hedge_won = true;
                if let Some((key, _)) = &self.hedge {
                    self.app.hedge_budget(key, |b| b.won());
                }
            }
            return (
                done_ep.clone(),
                self.try_endpoint(&done_ep, Some(Box::new(done))).await,
            );
        }
        match self.settle(&done_ep, done) {
            Settled::Done(EndpointOutcome::ClientError(s, h, b)) => {
                // The client's own error: the other copy would get the same answer.
                drop(other.fut);
                self.cancelled(
                    &other_ep,
                    (other.t0, other.address.clone(), other.span, other.hedge),
                    &done_ep,
                );
                return (done_ep, EndpointOutcome::ClientError(s, h, b));
            }
            Settled::Done(outcome) => self.note(&done_ep, outcome),
            // No retry while the other copy runs: it is the retry.
            Settled::NextKey | Settled::Retry => self.note(&done_ep, FAILED),
        }
        let mut survivor = other;
        let slot = if side == Side::First {
            &mut self.current_hedge
        } else {
            &mut self.current
        };
        *slot = Some((other_ep.clone(), survivor.t0, survivor.span));
        let t = Instant::now();
        let result = (&mut survivor.fut).await;
        self.waited += t.elapsed();
        self.current = None;
        self.current_hedge = None;
        let done = survivor.finish(result);
        let outcome = self.try_endpoint(&other_ep, Some(Box::new(done))).await;
        (other_ep, outcome)
    }

    /// The hedge when the chain has no other endpoint to take it: the same endpoint at another
    /// of its addresses (never the one the first copy went to) — if the budget has a copy left.
    fn hedge_same(
        &mut self,
        a: &Arc<Endpoint>,
        key_idx: Option<usize>,
        first_at: Option<Arc<str>>,
    ) -> Option<(Arc<Endpoint>, Racing)> {
        let avoid = first_at?;
        // A conversation the upstream holds under its own id lives at one address only: a copy
        // elsewhere would be refused (or answered without it).
        if !self.pin_lost
            && self
                .responses
                .as_ref()
                .is_some_and(|c| c.native_pin && c.pinned.as_deref() == Some(a.name.as_str()))
        {
            return None;
        }
        let key = self.hedge.as_ref()?.0.clone();
        if self.app.registry.address_count(&a.name) < 2
            || !self.app.hedge_budget(&key, |b| b.take())
        {
            return None;
        }
        match self.start(a, key_idx, Some(avoid)) {
            Ok(mut r) => {
                self.hedges_sent += 1;
                r.hedge = true;
                Some((a.clone(), r))
            }
            Err(_) => {
                // No other usable address: nothing was sent.
                self.app.hedge_budget(&key, |b| b.refund());
                None
            }
        }
    }

    /// The hedge: the next endpoint of `rest` that passes the context checks and has a key
    /// predicted to take the request, started — if the budget has a copy left.
    async fn hedge_candidate(&mut self, rest: &[String]) -> Option<(Arc<Endpoint>, Racing)> {
        let key = self.hedge.as_ref()?.0.clone();
        if !self.app.hedge_budget(&key, |b| b.left() >= 1.0) {
            return None;
        }
        for name in rest {
            if !self.pass.tried.insert(name.clone()) {
                continue;
            }
            let Some(ep) = self.admit(name).await else {
                continue;
            };
            let key_idx = match self.pick(&ep).await {
                Ok(k) => k,
                Err(outcome) => {
                    self.note(&ep, outcome);
                    continue;
                }
            };
            let taken = self.app.hedge_budget(&key, |b| b.take());
            if !taken {
                // Spent by another request meanwhile: this endpoint stays in the pass.
                self.pass.tried.remove(name);
                return None;
            }
            match self.start(&ep, key_idx, None) {
                Ok(mut r) => {
                    self.hedges_sent += 1;
                    r.hedge = true;
                    return Some((ep, r));
                }
                Err(f) => {
                    self.app.hedge_budget(&key, |b| b.refund());
                    let done = Finished {
                        key_idx,
                        t0: Instant::now(),
                        result: Err(f),
                        span: None,
                        hedge: true,
                    };
                    match self.settle(&ep, done) {
                        Settled::Done(o) => self.note(&ep, o),
                        Settled::NextKey | Settled::Retry => self.note(&ep, FAILED),
                    }
                }
            }
        }
        None
    }

    /// Records the race's loser.
    /// `lost`: its start, address, span and whether it was the hedge.
    fn cancelled(
        &mut self,
        loser: &Endpoint,
        lost: (
            Instant,
            Option<Arc<str>>,
            Option<crate::wire::trace::SpanId>,
            bool,
        ),
        winner: &Endpoint,
    ) {
        let (t0, address, span, hedge) = lost;
        let trace = self.attempt_trace(span, t0, hedge);
        let panic_mode = self.panic_mode.contains(&loser.name);
        self.attempts.push(AttemptReport {
            endpoint: loser.name.clone(),
            status: None,
            class: Outcome::HedgeCancelled,
            latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
            error: Some(format!(
                "cancelled: `{}` answered first; the connection was closed",
                winner.name
            )),
            panic_mode,
            own_key: false,
            internal: None,
            address,
            trace,
        });
    }
}
