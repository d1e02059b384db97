//! Routing away before the 429: what an upstream's `x-ratelimit-*` headers say about the budget
//! left for one endpoint and key, and whether a request would fit in it. Pure and clock-injected.
//!
//! OpenAI sends `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on every response, not
//! only on 429s. `reset` is the time until the budget is full again, and the buckets refill
//! continuously (`remaining 9999 of 10000, reset 6ms`): so a budget is modelled as a bucket that
//! was at `remaining` when observed and refills linearly to `limit` by `reset`. Without a limit
//! the bucket is taken to stay at `remaining` until the reset. Our own calls since the
//! observation are debited locally, so concurrent requests do not all spend the last unit.

use std::time::Duration;

use tokio::time::Instant;

/// One budget (requests or tokens) as last observed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    pub limit: Option<u64>,
    pub remaining: u64,
    pub observed: Instant,
    /// When the budget is full again (`observed + x-ratelimit-reset-*`, clamped).
    pub reset_at: Instant,
}

impl Budget {
    /// The units predicted available at `now`.
    pub fn available(&self, now: Instant) -> f64 {
        if now >= self.reset_at {
            return f64::INFINITY;
        }
        let r = self.remaining as f64;
        match self.limit {
            Some(l) if l > self.remaining => {
                let span = (self.reset_at - self.observed).as_secs_f64();
                if span <= 0.0 {
                    return l as f64;
                }
                let elapsed = now.saturating_duration_since(self.observed).as_secs_f64();
                (r + (l as f64 - r) * elapsed / span).min(l as f64)
            }
            _ => r,
        }
    }

    /// How long until `need` units are predicted to be there; `None` when they are now.
    pub fn wait_for(&self, need: u64, now: Instant) -> Option<Duration> {
        if now >= self.reset_at || self.available(now) >= need as f64 {
            return None;
        }
        let until_reset = self.reset_at - now;
        match self.limit {
            Some(l) if l > self.remaining && need <= l => {
                let span = self.reset_at - self.observed;
                let share = (need - self.remaining.min(need)) as f64 / (l - self.remaining) as f64;
                let at = self.observed + span.mul_f64(share.clamp(0.0, 1.0));
                Some(at.saturating_duration_since(now).min(until_reset))
            }
            _ => Some(until_reset),
        }
    }

    /// Our own call spent `n` units.
    pub fn debit(&mut self, n: u64) {
        self.remaining = self.remaining.saturating_sub(n);
    }
}

/// What one response's headers said (each part absent when its headers were missing or
/// malformed). Built by `upstream::classify::ratelimit_headers`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Observed {
    pub requests: Option<(Option<u64>, u64, Duration)>,
    pub tokens: Option<(Option<u64>, u64, Duration)>,
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }
}

/// Which budget stands in the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Short {
    Requests,
    Tokens,
}

impl Short {
    pub fn as_str(self) -> &'static str {
        match self {
            Short::Requests => "requests",
            Short::Tokens => "tokens",
        }
    }
}

/// Both budgets of one endpoint and key.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    pub requests: Option<Budget>,
    pub tokens: Option<Budget>,
}

impl Limits {
    /// Takes in a response's headers; a budget the response did not mention keeps its old value.
    pub fn observe(&mut self, o: &Observed, now: Instant) {
        let budget = |(limit, remaining, reset): (Option<u64>, u64, Duration)| Budget {
            limit,
            remaining,
            observed: now,
            reset_at: now + reset,
        };
        if let Some(r) = o.requests {
            self.requests = Some(budget(r));
        }
        if let Some(t) = o.tokens {
            self.tokens = Some(budget(t));
        }
    }

    /// Takes in another replica's observation made at `at` (earlier than `now`), for each budget
    /// only when it is newer than the one held: the upstream's count then includes every
    /// replica's calls up to it.
    pub fn observe_shared(&mut self, o: &Observed, at: Instant, now: Instant) {
        let newer = |b: &Option<Budget>| b.is_none_or(|b| b.observed < at);
        let budget = |(limit, remaining, reset): (Option<u64>, u64, Duration)| Budget {
            limit,
            remaining,
            observed: at,
            reset_at: (at + reset).max(at),
        };
        if let Some(r) = o.requests
            && newer(&self.requests)
            && at + r.2 > now
        {
            self.requests = Some(budget(r));
        }
        if let Some(t) = o.tokens
            && newer(&self.tokens)
            && at + t.2 > now
        {
            self.tokens = Some(budget(t));
        }
    }

    /// Whether another replica should hear of this observation: a budget at half its limit or
    /// less (or with no limit stated). Far from its limits an endpoint needs no prediction, and
    /// the fleet hears nothing on the common path.
    pub fn worth_sharing(o: &Observed) -> bool {
        let low = |b: Option<(Option<u64>, u64, Duration)>| {
            b.is_some_and(|(limit, remaining, _)| {
                limit.is_none_or(|l| remaining.saturating_mul(2) <= l)
            })
        };
        low(o.requests) || low(o.tokens)
    }

    /// Whether a request needing `tokens` (prompt + completion; `None`: not counted) would be
    /// refused now, and for how long: the longer of the two budgets' waits.
    pub fn wait_for(&self, tokens: Option<u64>, now: Instant) -> Option<(Duration, Short)> {
        let r = self
            .requests
            .and_then(|b| b.wait_for(1, now))
            .map(|d| (d, Short::Requests));
        let t = match (self.tokens, tokens) {
            (Some(b), Some(n)) => b.wait_for(n, now).map(|d| (d, Short::Tokens)),
            _ => None,
        };
        match (r, t) {
            (Some(a), Some(b)) => Some(if b.0 > a.0 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// Whether the token budget might not cover `upper_bound` tokens: when it surely does, the
    /// request need not be counted exactly.
    pub fn tokens_tight(&self, upper_bound: u64, now: Instant) -> bool {
        self.tokens
            .is_some_and(|b| b.available(now) < upper_bound as f64)
    }

    /// Our own call: one request and (if counted) its tokens.
    pub fn debit(&mut self, tokens: Option<u64>) {
        if let Some(b) = self.requests.as_mut() {
            b.debit(1);
        }
        if let (Some(b), Some(n)) = (self.tokens.as_mut(), tokens) {
            b.debit(n);
        }
    }

    /// Nothing left to predict: every budget is past its reset.
    pub fn expired(&self, now: Instant) -> bool {
        self.requests.is_none_or(|b| now >= b.reset_at)
            && self.tokens.is_none_or(|b| now >= b.reset_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn budget(limit: Option<u64>, remaining: u64, reset: Duration, t0: Instant) -> Budget {
        Budget {
            limit,
            remaining,
            observed: t0,
            reset_at: t0 + reset,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_request_budget_blocks_until_one_request_has_refilled() {
        let t0 = Instant::now();
        // OpenAI's own figures: 10,000 a minute, none left, full again in 60 s → one request
        // every 6 ms.
        let b = budget(Some(10_000), 0, Duration::from_secs(60), t0);
        assert_eq!(b.wait_for(1, t0), Some(6 * MS));
        tokio::time::advance(6 * MS).await;
        assert_eq!(b.wait_for(1, Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_limit_the_reset_is_the_wait() {
        let t0 = Instant::now();
        let b = budget(None, 0, 300 * MS, t0);
        assert_eq!(b.wait_for(1, t0), Some(300 * MS));
        tokio::time::advance(299 * MS).await;
        assert_eq!(b.wait_for(1, Instant::now()), Some(MS));
        tokio::time::advance(MS).await;
        assert_eq!(
            b.wait_for(1, Instant::now()),
            None,
            "past the reset nothing is predicted"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_budget_below_the_need_blocks_and_one_above_does_not() {
        let t0 = Instant::now();
        let mut l = Limits::default();
        l.observe(
            &Observed {
                requests: Some((Some(100), 50, Duration::from_secs(1))),
                tokens: Some((Some(10_000), 1_000, Duration::from_secs(9))),
            },
            t0,
        );
        assert_eq!(l.wait_for(Some(900), t0), None);
        assert_eq!(
            l.wait_for(None, t0),
            None,
            "uncounted: only requests are judged"
        );
        // 2,000 needed, 1,000 there, 9,000 refill in 9 s: 1,000 more take 1 s.
        let (d, short) = l.wait_for(Some(2_000), t0).unwrap();
        assert_eq!(short, Short::Tokens);
        assert_eq!(d, Duration::from_secs(1));
        assert!(l.tokens_tight(2_000, t0) && !l.tokens_tight(1_000, t0));
    }

    #[tokio::test(start_paused = true)]
    async fn more_than_the_whole_budget_waits_for_the_reset_only() {
        let t0 = Instant::now();
        let b = budget(Some(1_000), 10, Duration::from_secs(2), t0);
        assert_eq!(b.wait_for(5_000, t0), Some(Duration::from_secs(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn own_calls_are_debited_so_concurrent_requests_do_not_all_spend_the_last_unit() {
        let t0 = Instant::now();
        let mut l = Limits::default();
        l.observe(
            &Observed {
                requests: Some((None, 2, Duration::from_secs(1))),
                tokens: None,
            },
            t0,
        );
        assert!(l.wait_for(None, t0).is_none());
        l.debit(None);
        assert!(l.wait_for(None, t0).is_none());
        l.debit(None);
        assert_eq!(
            l.wait_for(None, t0),
            Some((Duration::from_secs(1), Short::Requests))
        );
        l.debit(None);
        assert_eq!(l.requests.unwrap().remaining, 0, "saturates, never wraps");
        assert!(!l.expired(t0));
        assert!(l.expired(t0 + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_response_replaces_only_what_it_mentions() {
        let t0 = Instant::now();
        let mut l = Limits::default();
        l.observe(
            &Observed {
                requests: Some((None, 0, Duration::from_secs(1))),
                tokens: Some((None, 5, Duration::from_secs(1))),
            },
            t0,
        );
        l.observe(
            &Observed {
                requests: Some((None, 7, Duration::from_secs(1))),
                tokens: None,
            },
            t0,
        );
        assert_eq!(l.requests.unwrap().remaining, 7);
        assert_eq!(l.tokens.unwrap().remaining, 5);
    }
}
