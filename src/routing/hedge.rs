//! Hedged requests ("The Tail at Scale", Dean and Barroso, CACM 2013): when the first attempt has
//! not answered after a delay, a copy goes to the next candidate and the first success wins. This
//! module is the policy, pure: when to hedge ([`Spec::delay`]) and how many hedges the budget
//! allows ([`Budget`]); the executor races the attempts.

use std::time::Duration;

/// When the hedge starts: a fixed delay, or a percentile of the endpoint's recent time to first
/// byte (non-stream: the response; stream: the first content chunk).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum After {
    Fixed(Duration),
    /// 90, 95 or 99.
    Percentile(f64),
}

/// `hedge:` of a route or an endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spec {
    pub after: After,
    /// Hedged copies at most this share of the requests (0.05 for `5%`).
    pub max_extra: f64,
    /// Never hedge sooner than this.
    pub min_after: Duration,
    /// Requests with `tools` hedge only with this set (a tool call may have side effects).
    pub tools: bool,
}

/// Percentiles known before a `Percentile` delay is trusted: fewer samples say little.
pub const MIN_SAMPLES: usize = 20;

impl Spec {
    /// The delay for this request; `None` when no hedge should be sent (a percentile with too
    /// few samples to know it). `percentile(p)` reads the endpoint's recent latencies.
    pub fn delay(&self, percentile: impl FnOnce(f64) -> Option<Duration>) -> Option<Duration> {
        let d = match self.after {
            After::Fixed(d) => d,
            After::Percentile(p) => percentile(p)?,
        };
        Some(d.max(self.min_after))
    }
}

/// A token bucket: every request adds `max_extra` of a hedge, every hedge takes one whole. It
/// starts empty, so hedges can never exceed `max_extra` of the requests seen, and holds at most
/// [`Budget::CAP`], so a quiet hour cannot be saved up for a burst of hedges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Budget {
    /// In millionths of a hedge: integers, so ten requests at 10% make exactly one hedge.
    micros: u64,
    pub requests: u64,
    pub sent: u64,
    pub won: u64,
}

const ONE: u64 = 1_000_000;

impl Budget {
    /// Whole hedges the bucket holds at most.
    pub const CAP: f64 = 10.0;
    const CAP_MICROS: u64 = 10 * ONE;

    /// A request arrived on the hedged route.
    pub fn on_request(&mut self, max_extra: f64) {
        self.requests += 1;
        let share = if max_extra.is_finite() {
            max_extra.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let add = (share * ONE as f64).round() as u64;
        self.micros = (self.micros + add).min(Self::CAP_MICROS);
    }

    /// Takes one hedge from the budget; false when it is spent.
    pub fn take(&mut self) -> bool {
        if self.micros >= ONE {
            self.micros -= ONE;
            self.sent += 1;
            true
        } else {
            false
        }
    }

    /// Gives back a hedge taken but never sent (the copy could not be built).
    pub fn refund(&mut self) {
        self.micros = (self.micros + ONE).min(Self::CAP_MICROS);
        self.sent = self.sent.saturating_sub(1);
    }

    pub fn won(&mut self) {
        self.won += 1;
    }

    /// Hedges left (fractional).
    pub fn left(&self) -> f64 {
        self.micros as f64 / ONE as f64
    }
}

/// Parses `after:`: `p90`, `p95`, `p99` (or any `pNN` / `pNN.N` in (0, 100)).
pub fn parse_percentile(s: &str) -> Option<f64> {
    let p: f64 = s.trim().strip_prefix('p')?.parse().ok()?;
    (p > 0.0 && p < 100.0).then_some(p)
}

/// Parses `max_extra:`: `5%`, or a fraction `0.05`. Must be in [0, 100%].
pub fn parse_share(s: &str) -> Option<f64> {
    let s = s.trim();
    let v = match s.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => s.parse::<f64>().ok()?,
    };
    (v.is_finite() && (0.0..=1.0).contains(&v)).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn spec(after: After) -> Spec {
        Spec {
            after,
            max_extra: 0.05,
            min_after: 50 * MS,
            tools: false,
        }
    }

    #[test]
    fn the_delay_is_the_percentile_but_never_below_min_after() {
        let s = spec(After::Percentile(95.0));
        assert_eq!(s.delay(|p| (p == 95.0).then_some(80 * MS)), Some(80 * MS));
        assert_eq!(s.delay(|_| Some(10 * MS)), Some(50 * MS));
        assert_eq!(s.delay(|_| None), None, "unknown percentile: no hedge");
        assert_eq!(spec(After::Fixed(800 * MS)).delay(|_| None), Some(800 * MS));
        assert_eq!(spec(After::Fixed(MS)).delay(|_| None), Some(50 * MS));
    }

    #[test]
    fn the_budget_never_allows_more_than_its_share() {
        let mut b = Budget::default();
        let mut hedges = 0;
        for _ in 0..10_000 {
            b.on_request(0.05);
            // Try to hedge every request: the bucket is the only limit.
            if b.take() {
                hedges += 1;
            }
        }
        assert_eq!(b.requests, 10_000);
        assert_eq!(hedges, 500, "exactly 5% of 10,000 requests");
        assert_eq!(b.sent, hedges);
    }

    #[test]
    fn ten_requests_at_ten_percent_pay_for_exactly_one_hedge() {
        let mut b = Budget::default();
        for _ in 0..9 {
            b.on_request(0.1);
            assert!(!b.take());
        }
        b.on_request(0.1);
        assert!(b.take(), "no float drift: 10 x 0.1 is one whole hedge");
        b.refund();
        assert_eq!((b.sent, b.left()), (0, 1.0));
    }

    #[test]
    fn the_budget_starts_empty_and_caps_savings() {
        let mut b = Budget::default();
        assert!(!b.take(), "no hedge before any request paid for it");
        for _ in 0..1_000_000 {
            b.on_request(0.05);
        }
        assert_eq!(b.left(), Budget::CAP);
        let burst = std::iter::from_fn(|| b.take().then_some(())).count();
        assert_eq!(burst, 10);
        // Hostile shares are clamped, never poison the bucket.
        let mut b = Budget::default();
        b.on_request(f64::NAN);
        b.on_request(-3.0);
        assert_eq!(b.left(), 0.0);
        b.on_request(7.0);
        assert_eq!(b.left(), 1.0);
    }

    #[test]
    fn parses_the_config_forms() {
        assert_eq!(parse_percentile("p95"), Some(95.0));
        assert_eq!(parse_percentile("p99.9"), Some(99.9));
        for bad in ["95", "p0", "p100", "p-1", "pNaN", "p", ""] {
            assert_eq!(parse_percentile(bad), None, "{bad}");
        }
        assert_eq!(parse_share("5%"), Some(0.05));
        assert_eq!(parse_share("0.05"), Some(0.05));
        assert_eq!(parse_share("100%"), Some(1.0));
        for bad in ["101%", "-1%", "2", "NaN", "inf", "%", "five"] {
            assert_eq!(parse_share(bad), None, "{bad}");
        }
    }
}
