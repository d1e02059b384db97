//! A future that wakes its own task while it is being polled is polled again at once, rather
//! than sent through the scheduler.
//!
//! tokio treats a task woken while it runs as one that yielded: once its poll returns, the task
//! goes to the back of its worker's queue and another worker is unparked to steal it (a futex
//! wake, a context switch, that worker's search and its park again), and the task is polled
//! again — by either. hyper's HTTP/1 connection wakes itself that way on every request with a
//! body that its service reads: the body's channel holds one chunk, its sender (the connection,
//! reading the socket) waits for room with the connection's own waker, and the service reading
//! the chunk inside the same poll makes that room — and wakes the connection. On the serial
//! bench that was one futex wake, two parks and about 2k instructions a request, and the two
//! workers took turns on every request (`docs/benchmarks.md`).
//!
//! [`Rewake`] gives the future a waker of its own. A wake from inside the future's poll on the
//! same thread (through `POLLING`, a thread-local naming the `Rewake` being polled) is only
//! noted, and the future is polled again when its poll returns pending; any other wake (another
//! task, another thread, the I/O driver, a timer) goes to the task's waker as it would have. A
//! future that keeps waking itself is polled at most [`AGAIN`] more times in one poll: then the
//! task is woken and yields as before, so it cannot hold its worker.
//!
//! Imports nothing of the crate (below `front` and `h1pool`).

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls repeated within one poll of the task for wakes the future gave itself.
pub const AGAIN: u32 = 4;

thread_local! {
    /// The [`Rewake`] whose future this thread is polling (null when none).
    static POLLING: Cell<*const Inner> = const { Cell::new(std::ptr::null()) };
}

struct Inner {
    task: AtomicWaker,
    /// Woken by its own poll: set and read by the polling thread only.
    again: AtomicBool,
}

impl Wake for Inner {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if std::ptr::eq(POLLING.get(), Arc::as_ptr(self)) {
            self.again.store(true, Ordering::Relaxed);
        } else {
            self.task.wake();
        }
    }
}

/// Puts back what [`POLLING`] held before a poll, panics included.
struct Restore(*const Inner);

impl Drop for Restore {
    fn drop(&mut self) {
        POLLING.set(self.0);
    }
}

/// The waker one future is polled with, for as long as it lives (so wakers the future stored
/// compare equal to the next poll's: `Waker::will_wake`).
pub struct Rewake {
    inner: Arc<Inner>,
    waker: Waker,
}

impl Default for Rewake {
    fn default() -> Self {
        let inner = Arc::new(Inner {
            task: AtomicWaker::new(),
            again: AtomicBool::new(false),
        });
        let waker = Waker::from(inner.clone());
        Rewake { inner, waker }
    }
}

impl Rewake {
    /// `poll` (the future's poll) with this waker, again while it returns pending having woken
    /// itself ([`AGAIN`] times at most); `cx` is the task's.
    pub fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut poll: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.inner.task.register(cx.waker());
        let mut own = Context::from_waker(&self.waker);
        for _ in 0..=AGAIN {
            let polled = {
                let _restore = Restore(POLLING.replace(Arc::as_ptr(&self.inner)));
                poll(&mut own)
            };
            if polled.is_ready() || !self.inner.again.swap(false, Ordering::Relaxed) {
                return polled;
            }
        }
        // Still waking itself: through the scheduler, as a yield.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::AtomicUsize;

    /// `fut` polled through a [`Rewake`], as `front::stop::Watched` polls its connection.
    struct SelfWake<F> {
        fut: Pin<Box<F>>,
        rewake: Rewake,
    }

    impl<F> SelfWake<F> {
        fn new(fut: F) -> Self {
            SelfWake {
                fut: Box::pin(fut),
                rewake: Rewake::default(),
            }
        }
    }

    impl<F: Future> Future for SelfWake<F> {
        type Output = F::Output;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let this = self.get_mut();
            let fut = &mut this.fut;
            this.rewake.poll(cx, |cx| fut.as_mut().poll(cx))
        }
    }

    /// A waker counting its wakes.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn counting() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    /// A future that wakes itself in its first `n` polls and is ready after them.
    fn waking_itself(n: usize, polls: Arc<AtomicUsize>) -> impl Future<Output = ()> {
        std::future::poll_fn(move |cx| {
            if polls.fetch_add(1, Ordering::Relaxed) < n {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
    }

    #[test]
    fn a_wake_from_its_own_poll_is_a_poll_again_not_a_wake_of_the_task() {
        let (task, waker) = counting();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut f = Box::pin(SelfWake::new(waking_itself(2, polls.clone())));
        let r = f.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(r.is_ready(), "polled again within the task's one poll");
        assert_eq!(polls.load(Ordering::Relaxed), 3);
        assert_eq!(task.0.load(Ordering::Relaxed), 0, "the task was not woken");
    }

    #[test]
    fn a_future_that_keeps_waking_itself_yields_to_the_scheduler() {
        let (task, waker) = counting();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut f = Box::pin(SelfWake::new(waking_itself(usize::MAX, polls.clone())));
        let r = f.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(r.is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), 1 + AGAIN as usize);
        assert_eq!(
            task.0.load(Ordering::Relaxed),
            1,
            "woken once, to be polled again"
        );
    }

    #[test]
    fn a_wake_after_the_poll_or_from_another_thread_reaches_the_task() {
        let (task, waker) = counting();
        let stored: Arc<std::sync::Mutex<Option<Waker>>> = Arc::default();
        let s = stored.clone();
        let mut f = Box::pin(SelfWake::new(std::future::poll_fn(move |cx| {
            *s.lock().unwrap() = Some(cx.waker().clone());
            Poll::<()>::Pending
        })));
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        assert_eq!(task.0.load(Ordering::Relaxed), 0);
        // After the poll, on this thread (as another task or the I/O driver would).
        stored.lock().unwrap().as_ref().unwrap().wake_by_ref();
        assert_eq!(task.0.load(Ordering::Relaxed), 1);
        // Polled again (the waker registered again), then woken from another thread.
        assert!(
            f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        let w = stored.lock().unwrap().clone().unwrap();
        std::thread::spawn(move || w.wake()).join().unwrap();
        assert_eq!(task.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_wake_of_an_outer_future_from_an_inner_ones_poll_reaches_the_task() {
        // The outer future stores its waker; the inner one, polled inside it, wakes it.
        let (task, waker) = counting();
        let outer_waker: Arc<std::sync::Mutex<Option<Waker>>> = Arc::default();
        let (o, i) = (outer_waker.clone(), outer_waker.clone());
        let mut inner = Box::pin(SelfWake::new(std::future::poll_fn(move |_| {
            if let Some(w) = i.lock().unwrap().take() {
                w.wake();
            }
            Poll::<()>::Pending
        })));
        let mut outer = Box::pin(SelfWake::new(std::future::poll_fn(move |cx| {
            *o.lock().unwrap() = Some(cx.waker().clone());
            inner.as_mut().poll(cx)
        })));
        assert!(
            outer
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
        );
        assert_eq!(
            task.0.load(Ordering::Relaxed),
            1,
            "not lost: the outer future is polled again through the task"
        );
    }
}
