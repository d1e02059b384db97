//! The request's deadline (`routing_policy.request_timeout`) without a timer of its own while an
//! attempt's timer covers it.
//!
//! Every wait of an attempt runs under a timer whose deadline is capped by the request's
//! (`Attempt::full`, `Attempt::stream`). While the request waits on such a timer, that timer
//! wakes it no later than the request's deadline, so a second timer for the request would be
//! put in tokio's timer wheel and taken out again for nothing — on every request (about 0.7k
//! instructions, `docs/benchmarks.md`). [`within`] registers the request's own timer only when
//! the request waits on something no such timer covers (a `max_wait`, a retry's backoff, a
//! prompt count, a hedge's delay): it asks, after each poll of the request that did not finish,
//! whether a [`Covering`] timer was pending in that poll.
//!
//! The question is answered through a thread-local flag, which is exact because a poll runs on
//! one thread from start to end: [`Within`] clears it before polling the request and reads it
//! after; a [`Covering`] timer polled inside sets it when it is pending and its deadline is not
//! after the request's.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

thread_local! {
    /// Set by a pending [`Covering`] timer during the current [`Within`] poll.
    static COVERED: Cell<bool> = const { Cell::new(false) };
}

/// `fut`, unless `deadline` passes first (`Err(Elapsed)`), as [`tokio::time::timeout_at`].
pub fn within<F: Future>(deadline: Instant, fut: F) -> Within<F> {
    Within {
        fut,
        deadline,
        timer: None,
    }
}

/// The request's deadline passed.
#[derive(Debug, PartialEq, Eq)]
pub struct Elapsed;

pin_project_lite::pin_project! {
    /// See [`within`].
    pub struct Within<F> {
        #[pin]
        fut: F,
        deadline: Instant,
        // Made the first time the request waits on something no attempt's timer covers.
        timer: Option<Pin<Box<Sleep>>>,
    }
}

impl<F: Future> Future for Within<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let outer = COVERED.replace(false);
        let polled = this.fut.poll(cx);
        let covered = COVERED.replace(outer);
        if let Poll::Ready(v) = polled {
            return Poll::Ready(Ok(v));
        }
        if covered {
            // A timer no later than the deadline wakes this request: the deadline is checked
            // then, by the next poll.
            return Poll::Pending;
        }
        let deadline = *this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// An attempt's timer, which covers the request's deadline while it is pending (its own
/// deadline is capped by the request's).
pub struct Covering<'a> {
    pub timer: Pin<&'a mut Sleep>,
    /// The request's deadline.
    pub request: Instant,
}

impl Future for Covering<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let request = self.request;
        let polled = self.timer.as_mut().poll(cx);
        if polled.is_pending() && self.timer.deadline() <= request {
            COVERED.set(true);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `f` once with a waker that does nothing.
    fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        let waker = futures_util::task::noop_waker();
        Pin::new(f).poll(&mut Context::from_waker(&waker))
    }

    #[tokio::test(start_paused = true)]
    async fn an_uncovered_wait_times_out_at_the_deadline() {
        let deadline = Instant::now() + Duration::from_secs(5);
        let r = within(deadline, tokio::time::sleep(Duration::from_secs(60))).await;
        assert_eq!(r, Err(Elapsed));
        assert_eq!(Instant::now(), deadline);
        let r = within(deadline + Duration::from_secs(1), async { 7 }).await;
        assert_eq!(r, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_covered_wait_makes_no_timer_and_the_cover_ending_ends_it() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(5);
        // An attempt under a timer at the request's deadline, then (its timer fired) a wait
        // that never ends, as the executor's after the deadline.
        let attempt = async move {
            let timer = tokio::time::sleep_until(deadline);
            tokio::pin!(timer);
            let never = std::future::pending::<()>();
            tokio::select! {
                biased;
                () = never => unreachable!(),
                () = Covering { timer: timer.as_mut(), request: deadline } => {}
            }
            std::future::pending::<()>().await;
        };
        let mut w = Box::pin(within(deadline, attempt));
        assert!(poll_once(&mut w).is_pending());
        assert!(w.timer.is_none(), "covered: no timer of the request's own");
        assert_eq!(w.await, Err(Elapsed));
        assert_eq!(Instant::now(), deadline, "ended at the deadline, not later");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timer_past_the_deadline_covers_nothing() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(5);
        let late = start + Duration::from_secs(60);
        let attempt = async move {
            let timer = tokio::time::sleep_until(late);
            tokio::pin!(timer);
            Covering {
                timer: timer.as_mut(),
                request: deadline,
            }
            .await;
        };
        let mut w = Box::pin(within(deadline, attempt));
        assert!(poll_once(&mut w).is_pending());
        assert!(w.timer.is_some(), "the request's own timer is made");
        assert_eq!(w.await, Err(Elapsed));
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn covered_then_uncovered_waits_still_time_out() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(10);
        // A covered attempt that fails after 2 s, then a backoff of a minute: the request's
        // timer is made for the backoff and ends it at 10 s.
        let run = async move {
            let timer = tokio::time::sleep_until(start + Duration::from_secs(2));
            tokio::pin!(timer);
            Covering {
                timer: timer.as_mut(),
                request: deadline,
            }
            .await;
            tokio::time::sleep(Duration::from_secs(60)).await;
        };
        assert_eq!(within(deadline, run).await, Err(Elapsed));
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flag_set_outside_does_not_leak_in_or_out() {
        // A `Within` polled inside another's poll keeps the outer's answer.
        COVERED.set(true);
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut w = Box::pin(within(deadline, std::future::pending::<()>()));
        assert!(poll_once(&mut w).is_pending());
        assert!(
            w.timer.is_some(),
            "a flag set before the poll does not count"
        );
        assert!(COVERED.get(), "and is given back after it");
        COVERED.set(false);
    }
}
