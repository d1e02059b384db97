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
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// The timer a connection hands hyper (`http1::Builder::timer`); one per connection.
#[derive(Clone, Default)]
pub struct ConnTimer {
    shared: Arc<Mutex<Slot>>,
    /// How long a wait for a head may last before the connection is asked to park
    /// ([`ConnTimer::take_park`]); `None`: never.
    park_after: Option<Duration>,
}

#[derive(Default)]
struct Slot {
    sleep: Option<Pin<Box<Sleep>>>,
    /// Set when a wait for a head has lasted `park_after`: that wait's deadline.
    park: Option<Instant>,
    /// The latest the first head may finish: a connection served again for a head it had
    /// begun (`front::idle`) keeps the deadline that head began under. Taken by the first sleep.
    first: Option<Instant>,
}

impl ConnTimer {
    pub fn new() -> ConnTimer {
        ConnTimer::default()
    }

    /// A timer that asks for the connection to be parked once a wait for a head has lasted
    /// `park_after`, and ends no head later than `first_deadline`.
    pub fn parking(park_after: Duration, first_deadline: Option<Instant>) -> ConnTimer {
        ConnTimer {
            shared: Arc::new(Mutex::new(Slot {
                first: first_deadline,
                ..Slot::default()
            })),
            park_after: Some(park_after),
        }
    }

    /// The deadline of a wait for a head that has lasted `park_after`, once (then `None` until
    /// another does).
    pub fn take_park(&self) -> Option<Instant> {
        lock(&self.shared).park.take()
    }
}

fn lock(m: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    // The slot holds a timer and an instant: nothing a panic could leave half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One of hyper's sleeps: done at `deadline`, on the connection's shared timer.
struct ConnSleep {
    shared: Arc<Mutex<Slot>>,
    deadline: Instant,
    /// When this wait asks to be parked; `None` once it has (or never).
    park_at: Option<Instant>,
}

impl ConnSleep {
    /// What the connection's timer must fire for next: the park point while it is ahead.
    fn target(&self) -> Instant {
        match self.park_at {
            Some(p) if p < self.deadline => p,
            _ => self.deadline,
        }
    }
}

impl Future for ConnSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let shared = this.shared.clone();
        let mut slot = lock(&shared);
        let target = this.target();
        let sleep = slot
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(target)));
        // Armed for a later time (an earlier sleep's that was reset later, or a clock that
        // went back): brought forward to this one.
        if sleep.deadline() > target {
            sleep.as_mut().reset(target);
        }
        loop {
            let Some(sleep) = slot.sleep.as_mut() else {
                return Poll::Pending;
            };
            match sleep.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // Fired at or after this deadline: due.
                Poll::Ready(()) if sleep.deadline() >= this.deadline => return Poll::Ready(()),
                Poll::Ready(()) => {
                    // Fired at this wait's park point: the connection is asked to park.
                    if this.park_at.is_some_and(|p| sleep.deadline() >= p) {
                        this.park_at = None;
                        slot.park = Some(this.deadline);
                    }
                    // Fired for an earlier time (the park point, an earlier request's
                    // deadline): armed again for what this wait waits for next.
                    let next = this.target();
                    if let Some(sleep) = slot.sleep.as_mut() {
                        sleep.as_mut().reset(next);
                    }
                }
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
        let mut deadline: Instant = deadline.into();
        if let Some(first) = lock(&self.shared).first.take() {
            deadline = deadline.min(first);
        }
        Box::pin(ConnSleep {
            shared: self.shared.clone(),
            deadline,
            park_at: self.park_after.map(|p| Instant::now() + p),
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
        assert!(
            lock(&t.shared).sleep.is_some(),
            "the connection's timer is made"
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        // The head came in: hyper drops its sleep; the next request's runs 10 s from now.
        drop(first);
        let mut second = t.sleep_until((Instant::now() + Duration::from_secs(10)).into_std());
        assert!(!ready(&mut second));
        // The timer fires at the first deadline (10 s): not the second's, which waits on.
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!ready(&mut second), "not due at 11 s");
        let armed = lock(&t.shared).sleep.as_ref().unwrap().deadline();
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

    #[tokio::test(start_paused = true)]
    async fn a_wait_asks_to_park_at_its_park_point_and_still_ends_at_its_deadline() {
        let t = ConnTimer::parking(Duration::from_secs(1), None);
        let start = Instant::now();
        let mut wait = t.sleep(Duration::from_secs(10));
        assert!(!ready(&mut wait));
        assert_eq!(t.take_park(), None);
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert!(!ready(&mut wait), "a park point is not the deadline");
        assert_eq!(t.take_park(), Some(start + Duration::from_secs(10)));
        assert_eq!(t.take_park(), None, "asked once");
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(ready(&mut wait), "due at 10 s");
        // A wait that ends before its park point never asks.
        drop(wait);
        let mut short = t.sleep(Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(ready(&mut short));
        assert_eq!(t.take_park(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_served_again_keeps_the_deadline_it_began_under() {
        let start = Instant::now();
        let t = ConnTimer::parking(Duration::from_secs(1), Some(start + Duration::from_secs(3)));
        // The first head ends by the deadline it began under, not 10 s from now.
        let mut first = t.sleep(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(3_100)).await;
        assert!(ready(&mut first));
        drop(first);
        // Later heads get their whole timeout.
        let mut second = t.sleep(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!ready(&mut second));
    }
}
