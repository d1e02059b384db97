//! Small pure types for per-endpoint statistics: a time-bucketed rolling window of outcomes, an
//! EWMA of latency, and a bounded sample of recent latencies for percentiles. Time is always passed
//! in, so tests drive them with `tokio::time::pause()`.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::routing::blame::{Tally, Witness};

/// The window is split into this many buckets. Twelve keeps the error of "what fell out of the
/// window" under 1/12 of its length while costing a dozen counters per endpoint.
const BUCKETS: u32 = 12;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub ok: u64,
    pub failed: u64,
    /// The largest prompt + completion (tokens) of a request served in full: what the endpoint
    /// has shown it holds, the floor under any context window learned from an error.
    pub served_max: u64,
    /// Who saw the answers and the failures: one client key's alone demote nothing, and hide
    /// nothing ([`Counts::routing_rate`]).
    pub tally: Tally,
}

impl Counts {
    pub fn total(&self) -> u64 {
        self.ok + self.failed
    }
    /// Success rate, or `None` when there are fewer than `min_samples` outcomes: a ratio over
    /// two requests says nothing, and demoting on it would make routing flap.
    pub fn rate(&self, min_samples: u32) -> Option<f64> {
        let total = self.total();
        if total == 0 || total < u64::from(min_samples) {
            None
        } else {
            Some(self.ok as f64 / total as f64)
        }
    }

    /// The success rate routing demotes on ([`Tally::failure_rate`]): failures only one client
    /// key saw (its content may be their cause) are left out, so one key cannot push an
    /// endpoint behind its fallbacks for everyone, and one key's answers weigh no more than the
    /// others', so one key cannot keep an endpoint failing the others ahead of its fallbacks.
    /// `/status` shows [`Counts::rate`], every outcome.
    pub fn routing_rate(&self, min_samples: u32) -> Option<f64> {
        self.tally
            .failure_rate(f64::from(min_samples))
            .map(|failed| 1.0 - failed)
    }
}

#[derive(Clone, Debug)]
pub struct RollingWindow {
    window: Duration,
    width: Duration,
    buckets: VecDeque<Bucket>,
}

/// A bucket's times kept as the instants its tests compare with (`now >= closes`), not as a
/// start that each test subtracts from `now`: every request records into the window twice.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    start: Instant,
    /// `start + width`: from then on outcomes go to a new bucket.
    closes: Instant,
    /// `start + window`: from then on the bucket is out of the window.
    expires: Instant,
    counts: Counts,
}

/// `t + d`; never panics (windows are capped at load, so the fallbacks are not reached).
fn plus(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(t)
}

impl RollingWindow {
    pub fn new(window: Duration) -> Self {
        let window = window.max(Duration::from_millis(BUCKETS as u64));
        RollingWindow {
            window,
            width: window / BUCKETS,
            buckets: VecDeque::with_capacity(BUCKETS as usize + 1),
        }
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    /// Changes the window length (a reload changed `routing_policy.window`), keeping what fits.
    pub fn resize(&mut self, window: Duration, now: Instant) {
        if window != self.window {
            let old = std::mem::take(&mut self.buckets);
            *self = RollingWindow::new(window);
            self.buckets = old;
            for b in &mut self.buckets {
                b.closes = plus(b.start, self.width);
                b.expires = plus(b.start, self.window);
            }
            self.prune(now);
        }
    }

    fn prune(&mut self, now: Instant) {
        while let Some(b) = self.buckets.front() {
            if now >= b.expires {
                self.buckets.pop_front();
            } else {
                break;
            }
        }
    }

    /// The bucket `now` falls in, opened if needed.
    fn current(&mut self, now: Instant) -> &mut Counts {
        self.prune(now);
        let fresh = match self.buckets.back() {
            Some(b) => now >= b.closes,
            None => true,
        };
        if fresh {
            self.buckets.push_back(Bucket {
                start: now,
                closes: plus(now, self.width),
                expires: plus(now, self.window),
                counts: Counts::default(),
            });
        }
        let last = self.buckets.len() - 1;
        &mut self.buckets[last].counts
    }

    /// An outcome as `who` saw it: served, or `failed`.
    pub fn record(&mut self, now: Instant, who: Witness, failed: bool) {
        let c = self.current(now);
        if failed {
            c.failed += 1;
        } else {
            c.ok += 1;
        }
        c.tally.add(who, failed);
    }

    /// A request of `tokens` (prompt + completion) was served in full.
    pub fn served(&mut self, now: Instant, tokens: u64) {
        let c = self.current(now);
        c.served_max = c.served_max.max(tokens);
    }

    pub fn counts(&self, now: Instant) -> Counts {
        let mut sum = Counts::default();
        for Bucket {
            expires, counts: c, ..
        } in &self.buckets
        {
            if now < *expires {
                sum.ok += c.ok;
                sum.failed += c.failed;
                sum.served_max = sum.served_max.max(c.served_max);
                sum.tally.merge(&c.tally);
            }
        }
        sum
    }
}

/// Exponentially weighted moving average. `alpha` 0.2 weighs roughly the last ten samples.
#[derive(Clone, Copy, Debug)]
pub struct Ewma {
    alpha: f64,
    value: Option<f64>,
}

impl Ewma {
    pub fn new(alpha: f64) -> Self {
        Ewma { alpha, value: None }
    }
    pub fn seeded(alpha: f64, value: Option<f64>) -> Self {
        Ewma { alpha, value }
    }
    pub fn observe(&mut self, x: f64) {
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + self.alpha * (x - v),
        });
    }
    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

/// The last `cap` latency samples, for percentiles in `/status`.
#[derive(Clone, Debug)]
pub struct LatencySample {
    cap: usize,
    samples: VecDeque<f64>,
}

impl LatencySample {
    pub fn new(cap: usize) -> Self {
        LatencySample {
            cap: cap.max(1),
            samples: VecDeque::with_capacity(cap.max(1)),
        }
    }
    pub fn push(&mut self, ms: f64) {
        if self.samples.len() == self.cap {
            self.samples.pop_front();
        }
        self.samples.push_back(ms);
    }
    /// The samples in ascending order.
    pub fn sorted(&self) -> Vec<f64> {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        sorted
    }

    /// Percentiles (0..=100) by nearest rank; `None` with no samples.
    pub fn percentiles(&self, ps: &[f64]) -> Vec<Option<f64>> {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        ps.iter().map(|p| percentile_sorted(&sorted, *p)).collect()
    }
}

/// Nearest-rank percentile of an ascending slice.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn window_forgets_old_outcomes() {
        let mut w = RollingWindow::new(Duration::from_secs(60));
        let t0 = Instant::now();
        for _ in 0..5 {
            w.record(t0, Witness::Sure, true);
        }
        tokio::time::advance(Duration::from_secs(30)).await;
        for _ in 0..5 {
            w.record(Instant::now(), Witness::Sure, false);
        }
        let c = w.counts(Instant::now());
        assert_eq!((c.ok, c.failed), (5, 5));
        tokio::time::advance(Duration::from_secs(31)).await;
        let c = w.counts(Instant::now());
        assert_eq!((c.ok, c.failed), (5, 0));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(w.counts(Instant::now()).total(), 0);
    }

    /// A reload that shortens the window forgets what fell out of the new one, by the new
    /// length, and what is still inside stays counted.
    #[tokio::test(start_paused = true)]
    async fn a_resized_window_keeps_what_fits_and_forgets_by_its_new_length() {
        let mut w = RollingWindow::new(Duration::from_secs(60));
        for _ in 0..5 {
            w.record(Instant::now(), Witness::Sure, true);
        }
        tokio::time::advance(Duration::from_secs(30)).await;
        w.record(Instant::now(), Witness::Sure, false);
        w.resize(Duration::from_secs(40), Instant::now());
        let c = w.counts(Instant::now());
        assert_eq!((c.ok, c.failed), (1, 5), "30 s old: inside 40 s");
        tokio::time::advance(Duration::from_secs(11)).await;
        let c = w.counts(Instant::now());
        assert_eq!(
            (c.ok, c.failed),
            (1, 0),
            "41 s old: out of 40 s (it had 60)"
        );
        // Buckets are as wide as the new window makes them: 40 s / 12.
        w.record(Instant::now(), Witness::Sure, false);
        tokio::time::advance(Duration::from_millis(3_400)).await;
        w.record(Instant::now(), Witness::Sure, true);
        tokio::time::advance(Duration::from_millis(36_700)).await;
        let c = w.counts(Instant::now());
        assert_eq!(
            (c.ok, c.failed),
            (0, 1),
            "the 3.4 s later outcome is in a bucket of its own"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_largest_served_request_is_kept_for_the_window() {
        let mut w = RollingWindow::new(Duration::from_secs(60));
        w.served(Instant::now(), 900);
        tokio::time::advance(Duration::from_secs(30)).await;
        w.served(Instant::now(), 300);
        assert_eq!(w.counts(Instant::now()).served_max, 900);
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(w.counts(Instant::now()).served_max, 300);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(w.counts(Instant::now()).served_max, 0);
    }

    #[test]
    fn rate_needs_min_samples() {
        let c = Counts {
            ok: 1,
            failed: 1,
            served_max: 0,
            tally: Tally::default(),
        };
        assert_eq!(c.rate(10), None);
        assert_eq!(c.rate(2), Some(0.5));
    }

    /// Failures one client key alone saw demote nothing: routing reads them out, `/status`'s
    /// rate keeps them; other keys' failures bring back as many of them as they number.
    #[tokio::test(start_paused = true)]
    async fn one_keys_failures_demote_nothing() {
        let mut w = RollingWindow::new(Duration::from_secs(60));
        let now = Instant::now();
        for _ in 0..8 {
            w.record(now, Witness::Key(1), true);
        }
        w.record(now, Witness::Key(2), false);
        w.record(now, Witness::Key(2), false);
        let c = w.counts(now);
        assert_eq!(c.rate(2), Some(0.2));
        assert_eq!(c.routing_rate(2), Some(1.0));
        assert_eq!(
            c.routing_rate(5),
            None,
            "key 1's eight weigh as key 2's two: four are too few to judge"
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        let now = Instant::now();
        w.record(now, Witness::Key(2), true);
        let c = w.counts(now);
        assert_eq!(
            c.routing_rate(2),
            Some(1.0 - 2.0 / 6.0),
            "key 2's one failure lets one of key 1's count, not all: two of six"
        );
        for k in 3..10 {
            w.record(now, Witness::Key(k), true);
        }
        let c = w.counts(now);
        assert!(c.rate(2).unwrap() < 0.2, "/status: {:?}", c.rate(2));
        assert_eq!(
            c.routing_rate(2),
            Some(0.0),
            "eight keys failed every request, one key had answers: with it left out, nothing \
             is served"
        );
    }

    /// Key 1's easy requests, a thousand answers in the window, beside keys 2 and 3 failing
    /// half of theirs: routing reads the endpoint as the other keys meet it (before answers had
    /// witnesses, 0.99), `/status`'s rate as everyone does.
    #[tokio::test(start_paused = true)]
    async fn one_keys_answers_keep_no_endpoint_failing_the_others_ahead() {
        let mut w = RollingWindow::new(Duration::from_secs(60));
        let now = Instant::now();
        for i in 0..10 {
            for k in [2, 3] {
                w.record(now, Witness::Key(k), i % 2 == 0);
            }
        }
        let others = w.counts(now).routing_rate(10).expect("judged");
        assert!((others - 0.5).abs() < 1e-9, "{others}");
        for _ in 0..1000 {
            w.record(now, Witness::Key(1), false);
        }
        let c = w.counts(now);
        assert!(c.rate(10).unwrap() > 0.99, "everyone's: {:?}", c.rate(10));
        assert_eq!(c.routing_rate(10), Some(others));
    }

    #[test]
    fn ewma_and_percentiles() {
        let mut e = Ewma::new(0.5);
        e.observe(10.0);
        e.observe(20.0);
        assert_eq!(e.get(), Some(15.0));
        let mut s = LatencySample::new(100);
        for i in 1..=100 {
            s.push(i as f64);
        }
        assert_eq!(
            s.percentiles(&[50.0, 95.0, 99.0]),
            vec![Some(50.0), Some(95.0), Some(99.0)]
        );
        assert_eq!(percentile_sorted(&[], 50.0), None);
    }
}
