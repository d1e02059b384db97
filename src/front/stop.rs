//! The two shutdown signals reaching an HTTP/1 connection and the requests it is running, each
//! waited for once a connection rather than once a request or once a poll.
//!
//! Each request must end with a 503 when the hard stop (`AppState::hard_stop`, the end of
//! `shutdown_grace`) comes, and each connection must finish its request in flight and close
//! when the graceful drain begins. Waiting for a `CancellationToken` from every request put a
//! waiter on the token's list and took the token's lock on each of the request's polls and at
//! its end, and hyper-util's drain watcher took its channel's lock on every poll of the
//! connection: about 1k instructions a request. An HTTP/1 connection polls its requests inside
//! its own task, so [`Watched`] waits for both signals once for the connection, with a waker of
//! its own (so the connection's other polls take no lock), drains the connection when the drain
//! begins, and while it polls the connection tells its requests whether the stop came
//! ([`until_stopped`] reads a thread-local cell). When the stop comes the connection's task is
//! woken, polls its request, and the request sees it. Requests polled anywhere else (HTTP/2
//! streams run in tasks of their own; the library embedded) wait for the token themselves.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use hyper_util::server::graceful::GracefulConnection;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::front::selfwake::Rewake;

/// A connection that can be asked to finish what it is doing and close (hyper's, through
/// hyper-util's `GracefulConnection`).
pub trait Drains: Future {
    fn drain(self: Pin<&mut Self>);
}

impl<T: GracefulConnection> Drains for T {
    fn drain(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

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

/// The waker [`Watched`] gives its two waiters: notes that one of them may be ready and wakes
/// the connection's task.
#[derive(Default)]
struct Flag {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

type Waiter = Pin<Box<WaitForCancellationFutureOwned>>;

/// An HTTP/1 connection (its requests are polled within it) under the two shutdown signals,
/// each waited for once a connection: `drain` (the graceful drain: the connection finishes the
/// request in flight and closes, as hyper-util's `GracefulShutdown` watcher did) and `stop` (the
/// hard stop, which its requests see through [`until_stopped`]). Their waiters are polled with
/// a waker of their own, on the first poll and after it woke, never on the connection's other
/// polls: a `CancellationToken`'s waiter takes the token's lock on every poll, and so did the
/// watcher's channel.
pub struct Watched<F> {
    conn: Pin<Box<F>>,
    flag: Arc<Flag>,
    /// `None` once fired.
    stop: Option<Waiter>,
    drain: Option<Waiter>,
    stopped: bool,
    polled: bool,
    /// The connection's polls, again at once when it woke itself (`selfwake`).
    rewake: Rewake,
}

impl<F: Drains> Watched<F> {
    pub fn new(stop: &CancellationToken, drain: &CancellationToken, conn: F) -> Self {
        Watched {
            conn: Box::pin(conn),
            flag: Arc::default(),
            stop: Some(Box::pin(stop.clone().cancelled_owned())),
            drain: Some(Box::pin(drain.clone().cancelled_owned())),
            stopped: false,
            polled: false,
            rewake: Rewake::default(),
        }
    }
}

impl<F: Drains> Future for Watched<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.flag.task.register(cx.waker());
        if !this.polled || this.flag.woken.swap(false, Ordering::AcqRel) {
            this.polled = true;
            let waker = Waker::from(this.flag.clone());
            let mut wcx = Context::from_waker(&waker);
            if let Some(w) = &mut this.drain
                && w.as_mut().poll(&mut wcx).is_ready()
            {
                this.drain = None;
                this.conn.as_mut().drain();
            }
            if let Some(w) = &mut this.stop
                && w.as_mut().poll(&mut wcx).is_ready()
            {
                this.stop = None;
                this.stopped = true;
            }
        }
        let seen = if this.stopped {
            Seen::Stopped
        } else {
            Seen::Running
        };
        let _restore = Restore(SEEN.replace(seen));
        let conn = &mut this.conn;
        this.rewake.poll(cx, |cx| conn.as_mut().poll(cx))
    }
}

/// `run`'s output, or `None` when the hard stop came first. Under a [`Watched`] connection it
/// reads the connection's flag; anywhere else it waits for `stop` itself.
pub async fn until_stopped<F: Future>(stop: &CancellationToken, run: F) -> Option<F::Output> {
    let mut run = std::pin::pin!(run);
    let mut own: Option<Waiter> = None;
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

    /// A connection for the tests: `inner`, counting the drains asked of it.
    struct Conn<F> {
        inner: Pin<Box<F>>,
        drains: Arc<AtomicUsize>,
    }

    impl<F: Future> Future for Conn<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            self.inner.as_mut().poll(cx)
        }
    }

    impl<F: Future> Drains for Conn<F> {
        fn drain(self: Pin<&mut Self>) {
            self.drains.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn conn<F: Future>(f: F) -> (Conn<F>, Arc<AtomicUsize>) {
        let drains = Arc::new(AtomicUsize::new(0));
        let c = Conn {
            inner: Box::pin(f),
            drains: drains.clone(),
        };
        (c, drains)
    }

    /// Cancels `stop` and waits for `task`, a request, to end as cut.
    async fn cut_by<T: std::fmt::Debug + PartialEq>(
        stop: &CancellationToken,
        task: tokio::task::JoinHandle<Option<T>>,
    ) {
        stop.cancel();
        let out = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the stop reached the request")
            .unwrap();
        assert_eq!(out, None);
    }

    async fn until(what: impl Fn() -> bool) {
        for _ in 0..2000 {
            if what() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("not within 10 s");
    }

    /// A request that never finishes, polled inside a watched connection (as hyper's HTTP/1
    /// dispatcher polls its in-flight request): the drain is passed to the connection once,
    /// and the hard stop ends the request — through the connection's flag: the request waits
    /// on no token of its own.
    #[tokio::test]
    async fn a_watched_connection_drains_once_and_ends_its_request_at_the_stop() {
        let (stop, drain) = (CancellationToken::new(), CancellationToken::new());
        let polls = Arc::new(AtomicUsize::new(0));
        let p = polls.clone();
        let s = stop.clone();
        let (c, drains) = conn(async move {
            let counted = std::future::poll_fn(|_| {
                p.fetch_add(1, Ordering::Relaxed);
                Poll::<()>::Pending
            });
            until_stopped(&s, counted).await
        });
        let task = tokio::spawn(Watched::new(&stop, &drain, c));
        until(|| polls.load(Ordering::Relaxed) > 0).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            polls.load(Ordering::Relaxed),
            1,
            "polled once, then waiting"
        );
        drain.cancel();
        until(|| drains.load(Ordering::Relaxed) == 1).await;
        assert!(
            !task.is_finished(),
            "a drained connection finishes its request"
        );
        cut_by(&stop, task).await;
        assert_eq!(drains.load(Ordering::Relaxed), 1, "drained once");
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
        cut_by(&stop, task).await;
    }

    /// What finishes first is returned, watched or not; signals that came before the first
    /// poll act at once.
    #[tokio::test]
    async fn a_finished_request_returns_its_output_and_early_signals_act_at_once() {
        let (stop, drain) = (CancellationToken::new(), CancellationToken::new());
        assert_eq!(until_stopped(&stop, async { 7 }).await, Some(7));
        let s = stop.clone();
        let (c, _) = conn(async move { until_stopped(&s, async { 8 }).await });
        assert_eq!(Watched::new(&stop, &drain, c).await, Some(8));
        stop.cancel();
        drain.cancel();
        let s = stop.clone();
        let (c, drains) =
            conn(async move { until_stopped(&s, std::future::pending::<()>()).await });
        assert_eq!(Watched::new(&stop, &drain, c).await, None);
        assert_eq!(drains.load(Ordering::Relaxed), 1);
        assert_eq!(
            until_stopped(&stop, std::future::pending::<()>()).await,
            None
        );
    }

    /// The cell is put back after each poll: a future polled after a watched connection's
    /// poll on the same thread is unwatched again.
    #[tokio::test]
    async fn the_cell_is_put_back_after_the_connection_poll() {
        let (stop, drain) = (CancellationToken::new(), CancellationToken::new());
        stop.cancel();
        let (c, _) = conn(async { SEEN.get() });
        assert_eq!(Watched::new(&stop, &drain, c).await, Seen::Stopped);
        assert_eq!(SEEN.get(), Seen::Unwatched);
    }

    /// hyper's HTTP/1 connection wakes its own task when its service reads the request's body
    /// within the connection's poll (the body channel's sender waits for room with the
    /// connection's waker): tokio would queue the task again and wake another worker. A watched
    /// connection is polled again at once instead, and its task is not woken.
    #[tokio::test]
    async fn a_watched_connection_reading_a_body_does_not_wake_its_own_task() {
        use futures_util::FutureExt;
        use http_body_util::BodyExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }

        /// A keep-alive connection that has been sent one POST with a body, the service
        /// answering with the body's length; polled once, with a waker counting its wakes.
        /// Returns the wakes and what the client read.
        async fn one_poll(watched: bool) -> (usize, String) {
            let (mut client, server) = tokio::io::duplex(64 * 1024);
            let svc = hyper::service::service_fn(
                |req: hyper::Request<hyper::body::Incoming>| async move {
                    let body = req.into_body().collect().await?.to_bytes();
                    Ok::<_, hyper::Error>(hyper::Response::new(http_body_util::Full::new(
                        bytes::Bytes::from(body.len().to_string()),
                    )))
                },
            );
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(server), svc);
            client
                .write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
                .await
                .unwrap();
            let count = Arc::new(Count(AtomicUsize::new(0)));
            let waker = Waker::from(count.clone());
            let mut cx = Context::from_waker(&waker);
            let (stop, drain) = (CancellationToken::new(), CancellationToken::new());
            let polled = if watched {
                Box::pin(Watched::new(&stop, &drain, conn))
                    .as_mut()
                    .poll(&mut cx)
            } else {
                Box::pin(conn).as_mut().poll(&mut cx)
            };
            assert!(polled.is_pending(), "a keep-alive connection stays open");
            let mut buf = vec![0; 4096];
            let n = client
                .read(&mut buf)
                .now_or_never()
                .expect("answered within the one poll")
                .unwrap();
            (
                count.0.load(Ordering::Relaxed),
                String::from_utf8_lossy(&buf[..n]).into_owned(),
            )
        }

        let (wakes, answer) = one_poll(false).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            wakes >= 1,
            "hyper's connection wakes its own task as it reads a body (else this test shows nothing)"
        );
        let (wakes, answer) = one_poll(true).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n\r\n5"),
            "{answer}"
        );
        assert_eq!(
            wakes, 0,
            "the watched connection's task was woken by itself"
        );
    }
}
