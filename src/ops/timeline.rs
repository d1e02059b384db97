//! The last minutes at a glance, for the charts on `/docs`: a ring of ten-second buckets (15
//! minutes) of requests, errors by class, failovers, hedges, and per endpoint the latency and
//! time to first token of what it served, as histograms read for their p50 and p95. Fed from the
//! one place every request ends; its size is bounded (buckets × endpoints of the config × a
//! fixed histogram; error classes are a closed set, and past [`MAX_CLASSES`] fold into `other`).
//! Time is passed in (unix seconds), so tests drive it.

use std::collections::{BTreeMap, VecDeque};

use serde_json::{Value, json};

/// Seconds a bucket covers.
pub const BUCKET_SECONDS: u64 = 10;
/// Buckets kept: 15 minutes.
pub const BUCKETS: usize = 90;
/// Error classes a bucket names apart; the rest count as `other`.
const MAX_CLASSES: usize = 16;
/// Endpoints a bucket names apart; the rest are not charted (a config has far fewer).
const MAX_ENDPOINTS: usize = 64;

/// Histogram bounds grow by this factor from [`FIRST_MS`]: a value read back is within 25 % of
/// the truth, plenty for a chart.
const FACTOR: f64 = 1.25;
const FIRST_MS: f64 = 0.5;
const BINS: usize = 64;

/// Latencies in log-spaced bins (0.5 ms to about 10 minutes; past it, the last bin).
#[derive(Clone, Debug)]
struct Hist {
    bins: [u32; BINS],
    n: u32,
}

impl Default for Hist {
    fn default() -> Hist {
        Hist {
            bins: [0; BINS],
            n: 0,
        }
    }
}

impl Hist {
    fn add(&mut self, ms: f64) {
        if !ms.is_finite() || ms < 0.0 {
            return;
        }
        let i = if ms <= FIRST_MS {
            0
        } else {
            ((ms / FIRST_MS).ln() / FACTOR.ln()).ceil() as usize
        };
        self.bins[i.min(BINS - 1)] = self.bins[i.min(BINS - 1)].saturating_add(1);
        self.n = self.n.saturating_add(1);
    }

    /// The upper bound of the bin that holds the `q` quantile.
    fn quantile(&self, q: f64) -> Option<f64> {
        if self.n == 0 {
            return None;
        }
        let want = ((q * f64::from(self.n)).ceil() as u32).max(1);
        let mut seen = 0u32;
        for (i, c) in self.bins.iter().enumerate() {
            seen = seen.saturating_add(*c);
            if seen >= want {
                return Some(FIRST_MS * FACTOR.powi(i as i32));
            }
        }
        None
    }
}

#[derive(Clone, Debug, Default)]
struct Served {
    n: u32,
    latency: Hist,
    ttft: Hist,
}

#[derive(Clone, Debug, Default)]
struct Bucket {
    /// Its first second (unix), a multiple of [`BUCKET_SECONDS`].
    start: u64,
    requests: u32,
    errors: BTreeMap<&'static str, u32>,
    failovers: u32,
    hedges: u32,
    endpoints: BTreeMap<String, Served>,
}

/// What one finished request adds.
pub struct Sample<'a> {
    /// The error class of a request that was not served (`None` when it was).
    pub error: Option<&'a str>,
    /// Moves from a failed endpoint to the next.
    pub failovers: u32,
    pub hedges: u32,
    /// The endpoint that served it, with its latency and time to first token (ms).
    pub served: Option<(&'a str, f64, Option<f64>)>,
}

#[derive(Debug, Default)]
pub struct Timeline {
    buckets: VecDeque<Bucket>,
}

/// The closed set of names an error class is charted under: a known class keeps its name, any
/// other is `other` (no client-chosen string becomes a series).
fn class_name(class: &str) -> &'static str {
    crate::routing::outcome::Outcome::ALL
        .iter()
        .map(|o| o.as_str())
        .chain(crate::error::GATEWAY_CLASSES.iter().copied())
        .chain(["last_resort"])
        .find(|c| *c == class)
        .unwrap_or("other")
}

impl Timeline {
    /// Adds a request that ended at `now` (unix seconds). A clock that stepped back adds to the
    /// newest bucket.
    pub fn add(&mut self, now: u64, s: &Sample<'_>) {
        let start = now - now % BUCKET_SECONDS;
        let fresh = self.buckets.back().is_none_or(|b| start > b.start);
        if fresh {
            self.buckets.push_back(Bucket {
                start,
                ..Bucket::default()
            });
            while self.buckets.len() > BUCKETS {
                self.buckets.pop_front();
            }
        }
        let Some(b) = self.buckets.back_mut() else {
            return;
        };
        b.requests = b.requests.saturating_add(1);
        b.failovers = b.failovers.saturating_add(s.failovers);
        b.hedges = b.hedges.saturating_add(s.hedges);
        if let Some(class) = s.error {
            let mut name = class_name(class);
            if !b.errors.contains_key(name) && b.errors.len() >= MAX_CLASSES {
                name = "other";
            }
            let n = b.errors.entry(name).or_default();
            *n = n.saturating_add(1);
        }
        if let Some((ep, latency, ttft)) = s.served {
            if !b.endpoints.contains_key(ep) && b.endpoints.len() >= MAX_ENDPOINTS {
                return;
            }
            let e = b.endpoints.entry(ep.to_string()).or_default();
            e.n = e.n.saturating_add(1);
            e.latency.add(latency);
            if let Some(t) = ttft {
                e.ttft.add(t);
            }
        }
    }

    /// The buckets of the last 15 minutes before `now`, oldest first (`/status.timeline`).
    pub fn json(&self, now: u64) -> Value {
        let oldest = now.saturating_sub(BUCKET_SECONDS * BUCKETS as u64);
        let round = |v: Option<f64>| v.map(|x| (x * 10.0).round() / 10.0);
        let buckets: Vec<Value> = self
            .buckets
            .iter()
            .filter(|b| b.start >= oldest)
            .map(|b| {
                let endpoints: serde_json::Map<String, Value> = b
                    .endpoints
                    .iter()
                    .map(|(name, e)| {
                        (
                            name.clone(),
                            json!({
                                "served": e.n,
                                "p50_ms": round(e.latency.quantile(0.5)),
                                "p95_ms": round(e.latency.quantile(0.95)),
                                "ttft_p50_ms": round(e.ttft.quantile(0.5)),
                                "ttft_p95_ms": round(e.ttft.quantile(0.95)),
                            }),
                        )
                    })
                    .collect();
                json!({
                    "start_unix_ms": b.start * 1000,
                    "requests": b.requests,
                    "errors": b.errors,
                    "failovers": b.failovers,
                    "hedges": b.hedges,
                    "endpoints": endpoints,
                })
            })
            .collect();
        json!({
            "bucket_seconds": BUCKET_SECONDS,
            "now_unix_ms": now * 1000,
            "buckets": buckets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ep: &str, ms: f64) -> Sample<'_> {
        Sample {
            error: None,
            failovers: 0,
            hedges: 0,
            served: Some((ep, ms, Some(ms / 2.0))),
        }
    }

    #[test]
    fn requests_fall_in_ten_second_buckets_and_old_ones_leave() {
        let mut t = Timeline::default();
        t.add(1_000_003, &ok("a", 10.0));
        t.add(1_000_009, &ok("a", 30.0));
        t.add(
            1_000_010,
            &Sample {
                error: Some("server_error"),
                failovers: 1,
                hedges: 1,
                served: None,
            },
        );
        let j = t.json(1_000_011);
        let b = j["buckets"].as_array().unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b[0]["start_unix_ms"], 1_000_000_000u64);
        assert_eq!(b[0]["requests"], 2);
        assert_eq!(b[0]["endpoints"]["a"]["served"], 2);
        assert_eq!(b[1]["errors"]["server_error"], 1);
        assert_eq!(
            (b[1]["failovers"].clone(), b[1]["hedges"].clone()),
            (1.into(), 1.into())
        );
        // 15 minutes later both are gone from what is shown; the ring never grows past 90.
        assert_eq!(
            t.json(1_000_011 + 900)["buckets"].as_array().unwrap().len(),
            0
        );
        for i in 0..200 {
            t.add(2_000_000 + i * 10, &ok("a", 1.0));
        }
        assert_eq!(t.buckets.len(), BUCKETS);
    }

    #[test]
    fn percentiles_are_within_a_quarter_and_classes_are_closed() {
        let mut t = Timeline::default();
        for i in 1..=100 {
            t.add(50, &ok("a", f64::from(i)));
        }
        let j = t.json(55);
        let p50 = j["buckets"][0]["endpoints"]["a"]["p50_ms"]
            .as_f64()
            .unwrap();
        let p95 = j["buckets"][0]["endpoints"]["a"]["p95_ms"]
            .as_f64()
            .unwrap();
        assert!((50.0..=62.5).contains(&p50), "{p50}");
        assert!((95.0..=118.75).contains(&p95), "{p95}");
        let mut t = Timeline::default();
        for class in ["no-such-class\u{0}", "server_error", "<script>"] {
            t.add(
                7,
                &Sample {
                    error: Some(class),
                    failovers: 0,
                    hedges: 0,
                    served: None,
                },
            );
        }
        let errors = t.json(8)["buckets"][0]["errors"].clone();
        assert_eq!(errors, json!({"other": 2, "server_error": 1}));
        // Odd values change nothing and panic nothing.
        t.add(u64::MAX, &ok("a", f64::NAN));
        t.add(0, &ok("a", -1.0));
        t.add(9, &ok("a", 1e300));
    }
}
