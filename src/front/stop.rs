//! `AppState::hard_stop` (the end of `shutdown_grace`) reaching the requests still running,
//! waited for once a connection rather than once a request.
//!
//! Each request must end with a 503 when the hard stop comes. Waiting for a `CancellationToken`
//! from every request put a waiter on the token's list and took the token's lock on each of the
//! request's polls and again at its end: 0.7k instructions a request. An HTTP/1 connection polls
//! its requests inside its own task, so [`Watched`] waits for the stop once for the connection
//! (with a waker of its own, so the connection's later polls take no lock) and, while it polls
//! the connection, tells the requests whether the stop came ([`until_stopped`] reads a
//! thread-local cell).
//! When the stop comes the connection task is woken, polls its request, and the request sees the
//! flag. Requests polled anywhere else (HTTP/2 streams run in tasks of their own; the library
//! embedded) wait for the token themselves, as before.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// What the connection being polled on this thread knows of the stop: nothing (no watched
/// connection is being polled), not yet, or it came. Set by [`Watched`] around each poll of its
/// connection and put back after it, panics included: a plain cell, as a task-local's scope
/// costs more than the waiter it replaces.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Seen {
    Unwatched,
    Running,
    Stopped,
}

thread_local! {
    static SEEN: std::cell::Cell<Seen> = const { std::cell::Cell::new(Seen::Unwatched) };
}

/// Puts back what [`SEEN`] held before a connection's poll.
struct Restore(Seen);

impl Drop for Restore {
    fn drop(&mut self) {
        SEEN.set(self.0);
    }
}

/// Set once the stop came; wakes the connection's task.
#[derive(Default)]
struct Flag {
    stopped: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.stopped.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// A connection's future (HTTP/1: its requests are polled within it), with the stop waited for
/// once and its flag visible to the requests it polls.
pub struct Watched<F> {
    conn: Pin<Box<F>>,
    flag: Arc<Flag>,
    /// The token's waiter, polled with `flag` as its waker: on the first poll and once the flag
    /// is set, never on the connection's other polls. `None` once the stop came.
    wait: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    registered: bool,
}

impl<F: Future> Watched<F> {
    pub fn new(stop: &CancellationToken, conn: F) -> Self {
        Watched {
            conn: Box::pin(conn),
            flag: Arc::default(),
            wait: Some(Box::pin(stop.clone().cancelled_owned())),
            registered: false,
        }
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.flag.task.register(cx.waker());
        if let Some(wait) = &mut this.wait
            && (!this.registered || this.flag.stopped.load(Ordering::Acquire))
        {
            this.registered = true;
            let waker = Waker::from(this.flag.clone());
            if wait
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready()
            {
                this.flag.stopped.store(true, Ordering::Release);
                this.wait = None;
            }
        }
        let seen = if this.flag.stopped.load(Ordering::Acquire) {
            Seen::Stopped
        } else {
            Seen::Running
        };
        let _restore = Restore(SEEN.replace(seen));
        this.conn.as_mut().poll(cx)
    }
}

/// `run`'s output, or `None` when the hard stop came first. Under a [`Watched`] connection it
/// reads the connection's flag; anywhere else it waits for `stop` itself.
pub async fn until_stopped<F: Future>(stop: &CancellationToken, run: F) -> Option<F::Output> {
    let mut run = std::pin::pin!(run);
    let mut own: Option<Pin<Box<WaitForCancellationFutureOwned>>> = None;
    std::future::poll_fn(|cx| {
        let seen = SEEN.get();
        if seen == Seen::Stopped {
            return Poll::Ready(None);
        }
        if let Poll::Ready(out) = run.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        if seen == Seen::Unwatched {
            let wait = own.get_or_insert_with(|| Box::pin(stop.clone().cancelled_owned()));
            if wait.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    /// A request that never finishes, polled inside a watched "connection" (as hyper's HTTP/1
    /// dispatcher polls its in-flight request): the stop ends it, and only through the
    /// connection's flag — the request registered no waiter of its own.
    #[tokio::test]
    async fn a_watched_connection_ends_its_request_at_the_stop() {
        let stop = CancellationToken::new();
        let polls = Arc::new(AtomicUsize::new(0));
        let p = polls.clone();
        let s = stop.clone();
        let conn = async move {
            let counted = std::future::poll_fn(|_| {
                p.fetch_add(1, Ordering::Relaxed);
                Poll::<()>::Pending
            });
            until_stopped(&s, counted).await
        };
        let task = tokio::spawn(Watched::new(&stop, conn));
        for _ in 0..100 {
            if polls.load(Ordering::Relaxed) > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "polled once, then waiting"
        );
        assert!(!task.is_finished());
        stop.cancel();
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the stop reached the request")
            .unwrap();
        assert_eq!(out, None);
    }

    /// Outside a watched connection (an HTTP/2 stream's own task) the request waits for the
    /// token itself.
    #[tokio::test]
    async fn an_unwatched_request_waits_for_the_stop_itself() {
        let stop = CancellationToken::new();
        let s = stop.clone();
        let task =
            tokio::spawn(async move { until_stopped(&s, std::future::pending::<()>()).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!task.is_finished());
        stop.cancel();
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the stop reached the request")
            .unwrap();
        assert_eq!(out, None);
    }

    /// What finishes first is returned, watched or not; a stop that came before the first poll
    /// wins at once.
    #[tokio::test]
    async fn a_finished_request_returns_its_output_and_an_early_stop_wins() {
        let stop = CancellationToken::new();
        assert_eq!(until_stopped(&stop, async { 7 }).await, Some(7));
        let s = stop.clone();
        let watched = Watched::new(&stop, async move { until_stopped(&s, async { 8 }).await });
        assert_eq!(watched.await, Some(8));
        stop.cancel();
        let s = stop.clone();
        let watched = Watched::new(&stop, async move {
            until_stopped(&s, std::future::pending::<()>()).await
        });
        assert_eq!(watched.await, None);
        assert_eq!(
            until_stopped(&stop, std::future::pending::<()>()).await,
            None
        );
    }
}
