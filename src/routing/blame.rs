//! Whose failure it was: a server is judged bad by failures its clients could not have caused
//! alone. A refused connection or a failed probe is the server's own; a 5xx, a lost connection or
//! a silent first token may come from what one client asked (a prompt that crashes the model, a
//! prompt too long to start in time), so such failures eject an address or an endpoint for
//! everyone only once a second client key saw them too. One key's requests can never take a
//! server away from the other keys (it still fails over, its own requests retried elsewhere).

/// Who saw a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Witness {
    /// The server's own beyond doubt: a refused connection, a probe, or a request of a gateway
    /// with no second client key to tell it from (no keys, or one).
    Sure,
    /// A request of one client key (a hash of its name): its content may have caused it.
    Key(u64),
}

impl Witness {
    /// The witness of a failed request: `client` is its key's name; `tenants` how many client
    /// keys the gateway has (`auth.keys`); `sure` whether the failure could not come from what
    /// was asked (a refused connection). A request without a key, or a gateway of one key, has
    /// nobody else to protect: its failures are sure.
    pub fn of(client: Option<&str>, tenants: usize, sure: bool) -> Witness {
        match client {
            Some(name) if tenants > 1 && !sure => Witness::Key(fnv(name)),
            _ => Witness::Sure,
        }
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Keys a tally names apart; beyond them the least seen share a slot (an overcount of the
/// commonest key's failures, never an undercount: the tally errs toward ejecting nothing).
/// Merged tallies (a window's buckets) may credit an evicted key's failures to another key's
/// slot: the others' count can then be over by about a seventh, never the commonest key's
/// failures counted in full.
const TRACKED: usize = 8;

/// Who saw a set of failures, and how many of them count: every sure one, every failure of the
/// keys other than the commonest, and the commonest key's at most as many as all the others'
/// together ([`Witnesses::counted`]). So one key's flood makes nothing of itself, and a single
/// failure of another key (or one refused connection) lets through one of the flood's, not all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Witnesses {
    /// Keys and their failures (`0`: an empty slot), kept by the Space-Saving rule: a new key
    /// when all are taken replaces the least counted and inherits its count.
    keys: [(u64, u32); TRACKED],
    sure: u32,
}

impl Witnesses {
    pub fn add(&mut self, w: Witness) {
        self.add_n(w, 1);
    }

    fn add_n(&mut self, w: Witness, n: u32) {
        if n == 0 {
            return;
        }
        let k = match w {
            Witness::Sure => {
                self.sure = self.sure.saturating_add(n);
                return;
            }
            Witness::Key(k) => k,
        };
        if let Some(slot) = self.keys.iter_mut().find(|(key, c)| *c > 0 && *key == k) {
            slot.1 = slot.1.saturating_add(n);
            return;
        }
        // An empty slot, or else the least counted (it is overtaken: counted as this key's).
        if let Some(slot) = self.keys.iter_mut().min_by_key(|(_, c)| *c) {
            *slot = (k, slot.1.saturating_add(n));
        }
    }

    /// Both sets of witnesses together.
    pub fn merge(&mut self, other: Witnesses) {
        for (k, n) in other.keys {
            self.add_n(Witness::Key(k), n);
        }
        self.add_n(Witness::Sure, other.sure);
    }

    /// Every failure, whoever saw it.
    pub fn total(&self) -> u64 {
        u64::from(self.sure) + self.keys.iter().map(|(_, c)| u64::from(*c)).sum::<u64>()
    }

    /// The failures that count against the server: the commonest key's count at most as much
    /// as everyone else's together (sure failures included).
    pub fn counted(&self) -> u64 {
        let total = self.total();
        let top = self
            .keys
            .iter()
            .map(|(_, c)| u64::from(*c))
            .max()
            .unwrap_or(0);
        let others = total - top;
        total.min(others.saturating_mul(2))
    }

    /// Whether any of the failures count.
    pub fn convincing(&self) -> bool {
        self.counted() > 0
    }
}

/// A server's last [`WINDOW`] outcomes with their witnesses, and its current run of failures:
/// the failure rate and the failures in a row an ejection reads, counting only what
/// [`Witnesses::counted`] lets through.
#[derive(Clone, Debug)]
pub struct Record {
    /// Ring of outcomes: `None` served, `Some(w)` failed as `w` saw.
    ring: [Option<Witness>; WINDOW],
    next: usize,
    seen: usize,
    /// The current run of failures and its witnesses.
    run: Witnesses,
}

/// Outcomes the failure rate reads.
pub const WINDOW: usize = 20;

impl Default for Record {
    fn default() -> Record {
        Record {
            ring: [None; WINDOW],
            next: 0,
            seen: 0,
            run: Witnesses::default(),
        }
    }
}

impl Record {
    fn push(&mut self, o: Option<Witness>) {
        self.ring[self.next] = o;
        self.next = (self.next + 1) % WINDOW;
        self.seen = (self.seen + 1).min(WINDOW);
    }

    fn window(&self) -> Witnesses {
        let mut w = Witnesses::default();
        for o in self.ring.iter().take(self.seen).flatten() {
            w.add(*o);
        }
        w
    }

    /// A request served: the run of failures ends.
    pub fn served(&mut self) {
        self.push(None);
        self.run = Witnesses::default();
    }

    /// A failure as `w` saw it. Whether it added to what counts against the server (in the
    /// run or the window): a failure that did not may steer nothing.
    pub fn failed(&mut self, w: Witness) -> bool {
        let (run, window) = (self.run.counted(), self.window().counted());
        self.push(Some(w));
        self.run.add(w);
        self.run.counted() > run || self.window().counted() > window
    }

    /// A probe failed: a sure failure in the run, not an outcome of the window (which is the
    /// requests').
    pub fn probe_failed(&mut self) {
        self.run.add(Witness::Sure);
    }

    /// Forget everything (an ejection, or a comeback: judged on what it does next).
    pub fn clear(&mut self) {
        *self = Record::default();
    }

    /// Failures in a row that count ([`Witnesses::counted`]).
    pub fn run(&self) -> u32 {
        u32::try_from(self.run.counted()).unwrap_or(u32::MAX)
    }

    /// Failures in a row, whoever saw them (what `/status` shows).
    pub fn run_seen(&self) -> u32 {
        u32::try_from(self.run.total()).unwrap_or(u32::MAX)
    }

    /// The share of the last outcomes whose failures count, once `min` are known and some do.
    pub fn rate(&self, min: usize) -> Option<f64> {
        if self.seen < min.max(1) {
            return None;
        }
        let counted = self.window().counted();
        (counted > 0).then(|| counted as f64 / self.seen as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Witness = Witness::Key(1);
    const B: Witness = Witness::Key(2);

    #[test]
    fn one_key_alone_convinces_nobody() {
        let mut r = Record::default();
        for _ in 0..50 {
            r.failed(A);
        }
        assert_eq!(r.run_seen(), 50, "the failures happened");
        assert_eq!(r.run(), 0);
        assert_eq!(r.rate(10), None);
        assert!(r.failed(B), "another key's failure counts");
        assert_eq!(
            r.run(),
            2,
            "a second key's failure lets through one of the first key's, not all fifty"
        );
        assert_eq!(r.rate(10), Some(0.1), "two of the window's twenty count");
        assert!(!r.failed(A), "the flood adds nothing more");
        assert_eq!(r.run(), 2);
        for _ in 0..3 {
            r.failed(B);
            r.failed(Witness::Sure);
        }
        assert_eq!(
            r.run(),
            14,
            "others' seven failures let seven of the first key's count"
        );
    }

    #[test]
    fn a_server_failing_every_key_counts_every_failure() {
        let mut r = Record::default();
        for i in 0..6 {
            r.failed(if i % 2 == 0 { A } else { B });
        }
        assert_eq!(r.run(), 6);
        let mut w = Witnesses::default();
        for k in 0..40u64 {
            w.add(Witness::Key(k % 20));
        }
        assert_eq!(w.total(), 40);
        assert_eq!(
            w.counted(),
            40,
            "many keys, none dominant: every failure counts"
        );
    }

    #[test]
    fn keys_beyond_the_tracked_never_hide_the_commonest() {
        let mut w = Witnesses::default();
        for k in 100..(100 + TRACKED as u64 * 3) {
            w.add(Witness::Key(k));
        }
        for _ in 0..1000 {
            w.add(A);
        }
        let others = TRACKED as u64 * 3;
        assert_eq!(w.total(), 1000 + others);
        assert!(
            w.counted() <= 2 * others,
            "the flood counts at most as much as the others: {}",
            w.counted()
        );
        let mut merged = Witnesses::default();
        merged.merge(w);
        merged.merge(w);
        assert_eq!(merged.total(), 2 * w.total());
        assert!(merged.counted() <= 4 * others);
    }

    #[test]
    fn a_sure_failure_convinces_alone_and_an_answer_ends_the_run() {
        let mut r = Record::default();
        r.failed(Witness::Sure);
        assert_eq!(r.run(), 1);
        r.served();
        assert_eq!(r.run(), 0);
        r.failed(A);
        assert_eq!(r.run(), 0, "a new run, one key's");
        assert_eq!(
            r.rate(1),
            Some(2.0 / 3.0),
            "the window still holds the sure failure"
        );
    }

    #[test]
    fn the_rate_reads_only_the_window() {
        let mut r = Record::default();
        r.failed(A);
        r.failed(B);
        for _ in 0..(WINDOW - 2) {
            r.served();
        }
        assert_eq!(r.rate(10), Some(0.1));
        r.served();
        r.served();
        assert_eq!(r.rate(10), None, "both failures left the window");
        let mut short = Record::default();
        short.failed(Witness::Sure);
        assert_eq!(short.rate(10), None, "too few outcomes yet");
    }

    #[test]
    fn witnesses_by_name_and_class() {
        let k = Witness::of(Some("team-a"), 2, false);
        assert_eq!(k, Witness::of(Some("team-a"), 5, false));
        assert_ne!(k, Witness::of(Some("team-b"), 2, false));
        assert_eq!(Witness::of(Some("team-a"), 2, true), Witness::Sure);
        assert_eq!(Witness::of(None, 2, false), Witness::Sure);
        assert_eq!(Witness::of(Some("only"), 1, false), Witness::Sure);
    }
}
