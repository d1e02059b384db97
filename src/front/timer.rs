//! hyper's HTTP/1 header-read timeout (`server.header_timeout`) on one tokio timer a
//! connection.
//!
//! hyper asks its timer for a new sleep each time it starts reading a request's head and drops
//! it once the head is in: with hyper-util's `TokioTimer` that is a tokio timer made, put in the
//! timer wheel (the connection waits for its next request) and taken out again, on every request
//! of a keep-alive connection — about 0.9k instructions a request (`docs/benchmarks.md`).
//! [`ConnTimer`] gives each connection one tokio timer, made when the connection first waits
//! for a head, and lets it run: a sleep hyper drops leaves it armed for that request's deadline,
//! and the next sleep, whose deadline is later, moves it only when it fires early (at most once
//! a `header_timeout` while requests keep coming). A timer that fires for a deadline nobody
//! waits for any more wakes the connection's task once, for nothing.
//!
//! Used for the HTTP/1 server only, where hyper polls its sleeps from the connection's task one
//! at a time (the header read is the one thing it times). HTTP/2 keeps `TokioTimer`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

/// The timer a connection hands hyper (`http1::Builder::timer`); one per connection.
#[derive(Clone, Default)]
pub struct ConnTimer {
    armed: Arc<Mutex<Option<Pin<Box<Sleep>>>>>,
}

impl ConnTimer {
    pub fn new() -> ConnTimer {
        ConnTimer::default()
    }
}

fn lock(m: &Mutex<Option<Pin<Box<Sleep>>>>) -> MutexGuard<'_, Option<Pin<Box<Sleep>>>> {
    // The slot holds a timer and nothing that a panic could leave half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One of hyper's sleeps: done at `deadline`, on the connection's shared timer.
struct ConnSleep {
    armed: Arc<Mutex<Option<Pin<Box<Sleep>>>>>,
    deadline: Instant,
}

impl Future for ConnSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.deadline;
        let mut slot = lock(&self.armed);
        let sleep = slot.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        // Armed for a later deadline (an earlier sleep's that was reset later, or a clock
        // that went back): brought forward to this one.
        if sleep.deadline() > deadline {
            sleep.as_mut().reset(deadline);
        }
        loop {
            match sleep.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // Fired at or after this deadline: due.
                Poll::Ready(()) if sleep.deadline() >= deadline => return Poll::Ready(()),
                // Fired for an earlier request's deadline: armed again for this one.
                Poll::Ready(()) => sleep.as_mut().reset(deadline),
            }
        }
    }
}

impl hyper::rt::Sleep for ConnSleep {}

impl hyper::rt::Timer for ConnTimer {
    fn sleep(&self, duration: std::time::Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until((Instant::now() + duration).into_std())
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(ConnSleep {
            armed: self.armed.clone(),
            deadline: deadline.into(),
        })
    }

    fn now(&self) -> std::time::Instant {
        // tokio's clock, as `TokioTimer`'s (a paused test clock moves it).
        Instant::now().into_std()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;
    use std::time::Duration;

    fn ready(s: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> bool {
        let waker = futures_util::task::noop_waker();
        s.as_mut().poll(&mut Context::from_waker(&waker)).is_ready()
    }

    #[tokio::test(start_paused = true)]
    async fn each_sleep_ends_at_its_own_deadline_on_one_timer() {
        let t = ConnTimer::new();
        let start = Instant::now();
        let mut first = t.sleep_until((start + Duration::from_secs(10)).into_std());
        assert!(!ready(&mut first));
        assert!(lock(&t.armed).is_some(), "the connection's timer is made");
        tokio::time::sleep(Duration::from_secs(4)).await;
        // The head came in: hyper drops its sleep; the next request's runs 10 s from now.
        drop(first);
        let mut second = t.sleep_until((Instant::now() + Duration::from_secs(10)).into_std());
        assert!(!ready(&mut second));
        // The timer fires at the first deadline (10 s): not the second's, which waits on.
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!ready(&mut second), "not due at 11 s");
        let armed = lock(&t.armed).as_ref().unwrap().deadline();
        assert_eq!(
            armed,
            start + Duration::from_secs(14),
            "armed again for 14 s"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!ready(&mut second), "not due at 13 s");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(ready(&mut second), "due at 14 s");
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_deadline_brings_the_timer_forward() {
        let t = ConnTimer::new();
        let start = Instant::now();
        let mut late = t.sleep_until((start + Duration::from_secs(30)).into_std());
        assert!(!ready(&mut late));
        drop(late);
        let mut soon = t.sleep(Duration::from_secs(2));
        assert!(!ready(&mut soon));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!ready(&mut soon));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            ready(&mut soon),
            "due at 2 s, not at the 30 s the timer was armed for"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_sleep_wakes_its_task() {
        let t = ConnTimer::new();
        let start = Instant::now();
        // Awaited as hyper's connection task would: the timer's wake-up must reach it.
        t.sleep(Duration::from_secs(3)).await;
        assert!(Instant::now() >= start + Duration::from_secs(3));
        let before = Instant::now();
        t.sleep(Duration::from_secs(5)).await;
        assert!(Instant::now() >= before + Duration::from_secs(5));
    }
}
