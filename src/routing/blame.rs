//! Whose failure it was: a server is judged bad by failures its clients could not have caused
//! alone. A refused connection or a failed probe is the server's own; a 5xx, a lost connection or
//! a silent first token may come from what one client asked (a prompt that crashes the model, a
//! prompt too long to start in time), so such failures eject an address or an endpoint for
//! everyone only once a second client key saw them too. One key's requests can never take a
//! server away from the other keys (it still fails over, its own requests retried elsewhere),
//! and one key's answers can never keep a server failing the others: a rate weighs each key's
//! outcomes at most as much as the others' together and is judged with any one key left out
//! ([`Tally`]).

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

/// Slots a rate's witnesses are told apart by: a key's slot is fixed by its name's hash, the
/// same in every bucket and on every replica, so no key's outcomes are ever credited to another
/// slot by eviction or a merge. Two keys in one slot (one chance in 16 for a pair) are one
/// witness: their failures corroborate nothing of each other's (the rule errs toward ejecting
/// nothing), and neither can be left out without the other.
pub const SLOTS: usize = 16;

/// The slot of a key's hash (its top bits, after a multiplicative mix).
fn slot(k: u64) -> usize {
    (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize
}

/// Answers and failures by who saw them: what a failure *rate* reads. Each client key's
/// outcomes weigh at most as much as everyone else's together, the commonest failing key's
/// failures count at most as much as the others' failures ([`Witnesses::counted`]'s rule), and
/// the rate is the worst that holds with any one key left out: one key's answers (its own easy
/// prompts, however many) never bring the rate below what the other keys' outcomes say
/// together, and its failures (however many) convict no server that answers the others. What
/// one key can still do is what any second witness does: corroborate another key's failures
/// (the rule asks for two), or be one more key with answers among several.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// (answers, failures) by slot ([`SLOTS`]).
    keys: [(u32, u32); SLOTS],
    sure: (u32, u32),
    /// A key's outcome was added: without one (no client keys, or one) the slots are all
    /// empty, and a merge or a rate reads the sure witness alone.
    keyed: bool,
}

impl Tally {
    /// One outcome of `w`'s: an answer or a failure.
    pub fn add(&mut self, w: Witness, failed: bool) {
        let (ok, bad) = if failed { (0, 1) } else { (1, 0) };
        self.add_n(w, ok, bad);
    }

    fn add_n(&mut self, w: Witness, ok: u32, bad: u32) {
        let s = match w {
            Witness::Sure => &mut self.sure,
            Witness::Key(k) => {
                self.keyed = true;
                &mut self.keys[slot(k)]
            }
        };
        s.0 = s.0.saturating_add(ok);
        s.1 = s.1.saturating_add(bad);
    }

    /// Both tallies together.
    pub fn merge(&mut self, other: &Tally) {
        if other.keyed {
            self.keyed = true;
            for (s, o) in self.keys.iter_mut().zip(other.keys) {
                s.0 = s.0.saturating_add(o.0);
                s.1 = s.1.saturating_add(o.1);
            }
        }
        self.sure.0 = self.sure.0.saturating_add(other.sure.0);
        self.sure.1 = self.sure.1.saturating_add(other.sure.1);
    }

    /// Every outcome, whoever saw it.
    pub fn total(&self) -> u64 {
        let s = u64::from(self.sure.0) + u64::from(self.sure.1);
        s + self
            .keys
            .iter()
            .map(|(ok, bad)| u64::from(*ok) + u64::from(*bad))
            .sum::<u64>()
    }

    /// The failure rate that counts, once the outcomes it reads weigh `min`: the highest of the
    /// rate of everyone's outcomes and the rates with one key left out (see [`Tally`]). `None`
    /// while no such set of outcomes weighs `min`.
    pub fn failure_rate(&self, min: f64) -> Option<f64> {
        let min = min.max(1.0);
        if !self.keyed {
            // The sure witness alone (the common case of a gateway without client keys): its
            // own rate, what `judge` reads of it (read on every request's ranking).
            let n = f64::from(self.sure.0) + f64::from(self.sure.1);
            return (n >= min).then(|| f64::from(self.sure.1) / n);
        }
        let all = judge(&self.keys, self.sure, None);
        if self.sure.1 == 0 && self.keys.iter().all(|(_, bad)| *bad == 0) {
            // Nothing failed (the common case): no set of outcomes reads otherwise.
            return (all.1 >= min).then_some(0.0);
        }
        let without = (0..SLOTS)
            .filter(|i| self.keys[*i].0 > 0 || self.keys[*i].1 > 0)
            .map(|i| judge(&self.keys, self.sure, Some(i)));
        std::iter::once(all)
            .chain(without)
            .filter(|(_, weight)| *weight >= min)
            .map(|(counted, weight)| counted / weight)
            .max_by(f64::total_cmp)
    }
}

/// The failures that count and the outcomes they are out of, for the keys (but `left_out`)
/// and the sure witness: the key seen most weighs at most as much as the rest together (its
/// answers and failures scaled alike), then the commonest failing key's failures count at most
/// as much as the other failures.
fn judge(keys: &[(u32, u32); SLOTS], sure: (u32, u32), left_out: Option<usize>) -> (f64, f64) {
    let kept = || {
        keys.iter()
            .enumerate()
            .filter(move |(i, _)| Some(*i) != left_out)
            .map(|(_, (ok, bad))| (f64::from(*ok), f64::from(*bad)))
    };
    let n_sure = f64::from(sure.0) + f64::from(sure.1);
    let n_keys: f64 = kept().map(|(ok, bad)| ok + bad).sum();
    let top = kept().map(|(ok, bad)| ok + bad).fold(0.0, f64::max);
    let rest = n_sure + n_keys - top;
    let scale = if top > rest && top > 0.0 {
        rest / top
    } else {
        1.0
    };
    // The top key's share scaled (the first key seen that many times, as `top` was found).
    let mut scaled = false;
    let mut weight = n_sure;
    let mut failed = f64::from(sure.1);
    let mut commonest = 0.0f64;
    for (ok, bad) in kept() {
        let s = if !scaled && ok + bad == top {
            scaled = true;
            scale
        } else {
            1.0
        };
        weight += (ok + bad) * s;
        failed += bad * s;
        commonest = commonest.max(bad * s);
    }
    let others = failed - commonest;
    (failed.min(2.0 * others), weight)
}

/// A server's last outcomes, [`WINDOW`] of each witness slot's ([`SLOTS`]: a client key's,
/// by its name's hash) and of the sure witness's, and its current run of failures: the failure
/// rate ([`Tally::failure_rate`]) and the failures in a row ([`Witnesses::counted`]) an ejection
/// reads. Each slot keeps its own window, so one key's flood of requests pushes no other key's
/// outcomes out (but those of a key sharing its slot).
#[derive(Clone, Debug, Default)]
pub struct Record {
    lanes: [Lane; SLOTS],
    sure: Lane,
    /// The current run of failures and its witnesses.
    run: Witnesses,
}

/// One witness's last [`WINDOW`] outcomes, newest in the lowest bit (`1`: failed).
#[derive(Clone, Copy, Debug, Default)]
struct Lane {
    bits: u32,
    len: u8,
}

impl Lane {
    fn push(&mut self, failed: bool) {
        self.bits = (self.bits << 1) | u32::from(failed);
        self.len = (self.len + 1).min(WINDOW as u8);
    }

    /// (answers, failures) in the window.
    fn counts(&self) -> (u32, u32) {
        let mask = (1u32 << self.len) - 1;
        let bad = (self.bits & mask).count_ones();
        (u32::from(self.len) - bad, bad)
    }
}

/// Outcomes of each witness the failure rate reads.
pub const WINDOW: usize = 20;

/// The outcomes (as [`Tally::failure_rate`] weighs them) a rate is judged on at the least.
pub const RATE_MIN: usize = 10;
const _: () = assert!(WINDOW < 32);

impl Record {
    fn push(&mut self, w: Witness, failed: bool) {
        match w {
            Witness::Sure => self.sure.push(failed),
            Witness::Key(k) => self.lanes[slot(k)].push(failed),
        }
    }

    /// The window's outcomes by witness.
    fn tally(&self) -> Tally {
        let mut t = Tally::default();
        for (s, l) in t.keys.iter_mut().zip(&self.lanes) {
            *s = l.counts();
            t.keyed |= l.len > 0;
        }
        t.sure = self.sure.counts();
        t
    }

    /// A request of `w`'s served: the run of failures ends.
    pub fn served(&mut self, w: Witness) {
        self.push(w, false);
        self.run = Witnesses::default();
    }

    /// A failure as `w` saw it. Whether failures count against the server now (the run's,
    /// or the window's rate once [`RATE_MIN`] outcomes are judged): while none does — one
    /// key's alone — it may steer nothing.
    pub fn failed(&mut self, w: Witness) -> bool {
        let run = self.run.counted();
        self.push(w, true);
        self.run.add(w);
        self.run.counted() > run || self.rate(RATE_MIN).is_some()
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

    /// The failure rate that counts ([`Tally::failure_rate`]) once the outcomes it reads weigh
    /// `min`, when some failures count.
    pub fn rate(&self, min: usize) -> Option<f64> {
        self.tally().failure_rate(min as f64).filter(|r| *r > 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Witness = Witness::Key(1);
    const B: Witness = Witness::Key(2);
    const C: Witness = Witness::Key(3);
    /// What ejects an address (`balance::RATE_EJECT`).
    const RATE_EJECT: f64 = 0.25;

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
        assert_eq!(
            r.rate(10),
            None,
            "B's one outcome and A's weighed as much: two, too few to judge"
        );
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

    /// Key A's easy requests, however many, answered at an address that fails a third of key
    /// B's and key C's: the rate reads B's and C's outcomes as they are (before each key had a
    /// window of its own, A's answers filled the shared one and read 0.1).
    #[test]
    fn a_busy_keys_answers_hide_no_failures_of_the_others() {
        let mut r = Record::default();
        for i in 0..WINDOW {
            for k in [B, C] {
                if i % 3 == 0 {
                    r.failed(k);
                } else {
                    r.served(k);
                }
            }
        }
        let others = r.rate(10).expect("B and C judged");
        assert!((others - 14.0 / 40.0).abs() < 1e-9, "{others}");
        for _ in 0..500 {
            r.served(A);
        }
        assert_eq!(
            r.rate(10),
            Some(others),
            "A's 500 answers change nothing the others' outcomes say"
        );
        // As before each key had its own window: one ring of the last 20 outcomes, A's 19.
        let mut shared = Tally::default();
        shared.add(B, true);
        for _ in 0..19 {
            shared.add(A, false);
        }
        let hidden = shared.failure_rate(10.0).unwrap_or(0.0);
        assert!(hidden < RATE_EJECT, "{hidden}");
        let mut r = Record::default();
        for _ in 0..WINDOW {
            r.served(A);
        }
        for _ in 0..3 {
            r.failed(B);
            r.failed(C);
        }
        for _ in 0..2 {
            r.served(B);
            r.served(C);
        }
        let rate = r.rate(10).expect("judged");
        assert!(
            rate >= RATE_EJECT,
            "B and C fail 3 of 5, A's twenty answers aside: {rate}"
        );
    }

    /// Key A's failures, however many, at an address answering keys B and C: nothing counts;
    /// one failure of B's lets one of A's count, not all.
    #[test]
    fn a_busy_keys_failures_convict_no_server_answering_the_others() {
        let mut r = Record::default();
        for _ in 0..WINDOW {
            r.served(B);
            r.served(C);
        }
        for _ in 0..500 {
            r.failed(A);
        }
        assert_eq!(r.rate(10), None, "A's failures alone count for nothing");
        assert!(r.failed(B));
        let rate = r.rate(10).expect("B's failure counts");
        assert!(rate < 0.1, "B's one and one of A's, of sixty: {rate}");
    }

    /// Each key keeps its own window: a flood of another key's outcomes pushes none out.
    #[test]
    fn each_key_keeps_its_own_window() {
        let slots: std::collections::BTreeSet<usize> =
            [1u64, 2, 3].iter().map(|k| slot(*k)).collect();
        assert_eq!(slots.len(), 3, "A, B and C have slots of their own");
        let mut r = Record::default();
        r.failed(B);
        r.failed(C);
        for _ in 0..100 {
            r.served(A);
        }
        assert_eq!(
            r.tally().total(),
            2 + WINDOW as u64,
            "A's window holds its last 20"
        );
    }

    /// Keys A and B fail every request, key C's answers come between: the run never grows (an
    /// answer ends it), the rate does, and every failure says so (the ejection reads it).
    #[test]
    fn failures_keep_counting_while_the_rate_stays_high() {
        let mut r = Record::default();
        let mut said = Vec::new();
        for _ in 0..12 {
            said.push(r.failed(A));
            r.served(C);
            said.push(r.failed(B));
            r.served(C);
        }
        assert_eq!(r.run(), 0, "C's answers end every run");
        assert!(said[12..].iter().all(|s| *s), "{said:?}");
        let rate = r.rate(10).expect("judged");
        assert!(rate >= RATE_EJECT, "A and B fail all theirs: {rate}");
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
        r.served(Witness::Sure);
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
        for _ in 0..(WINDOW - 1) {
            r.served(A);
            r.served(B);
        }
        assert_eq!(r.rate(10), Some(0.05), "one of each key's twenty");
        r.served(A);
        r.served(B);
        assert_eq!(r.rate(10), None, "both failures left the window");
        let mut short = Record::default();
        short.failed(Witness::Sure);
        assert_eq!(short.rate(10), None, "too few outcomes yet");
    }

    #[test]
    fn a_tally_merges_and_many_even_keys_count_every_outcome() {
        let mut t = Tally::default();
        for k in 0..6u64 {
            for i in 0..10 {
                t.add(Witness::Key(k), i < 3);
            }
        }
        let mut merged = Tally::default();
        merged.merge(&t);
        merged.merge(&t);
        assert_eq!(merged.total(), 120);
        for x in [t, merged] {
            let r = x.failure_rate(10.0).expect("judged");
            assert!((r - 0.3).abs() < 1e-9, "{r}");
        }
        let mut sure = Tally::default();
        for i in 0..20 {
            sure.add(Witness::Sure, i % 4 == 0);
        }
        let (counted, weight) = judge(&sure.keys, sure.sure, None);
        assert_eq!(
            sure.failure_rate(10.0),
            Some(counted / weight),
            "the sure witness alone"
        );
        assert_eq!(sure.failure_rate(10.0), Some(0.25));
        let mut alone = Tally::default();
        for _ in 0..50 {
            alone.add(A, true);
        }
        assert_eq!(
            alone.failure_rate(1.0),
            None,
            "one key alone weighs nothing"
        );
    }

    fn tally_of(keys: &[(u32, u32)], sure: (u32, u32)) -> Tally {
        let mut t = Tally::default();
        for (k, (ok, bad)) in keys.iter().enumerate() {
            t.add_n(Witness::Key(k as u64 + 1), *ok, *bad);
        }
        t.add_n(Witness::Sure, sure.0, sure.1);
        t
    }

    proptest::proptest! {
        /// Whatever the outcomes: a rate in [0, 1] or none; and one more key's outcomes,
        /// answers or failures however many, never bring the rate below what the others'
        /// outcomes say together.
        #[test]
        fn one_more_key_never_lowers_the_others_rate(
            keys in proptest::collection::vec((0u32..40, 0u32..40), 1..8),
            sure in (0u32..10, 0u32..10),
            extra in (0u32..100_000, 0u32..100_000),
            min in 1u32..30,
        ) {
            let others = tally_of(&keys, sure);
            let mut with = others;
            // A key of a slot of its own (one sharing a slot is one witness with that key).
            let used: Vec<usize> = (1..=keys.len() as u64).map(slot).collect();
            let extra_key = (1_000u64..).find(|k| !used.contains(&slot(*k))).unwrap_or(1_000);
            with.add_n(Witness::Key(extra_key), extra.0, extra.1);
            for t in [others, with] {
                if let Some(r) = t.failure_rate(f64::from(min)) {
                    proptest::prop_assert!((0.0..=1.0).contains(&r), "{r}");
                }
            }
            let (counted, weight) = judge(&others.keys, others.sure, None);
            if weight >= f64::from(min) {
                let floor = counted / weight;
                let r = with.failure_rate(f64::from(min));
                proptest::prop_assert!(
                    r.is_some_and(|r| r >= floor - 1e-9),
                    "others say {floor}, with one more key {r:?}"
                );
            }
        }
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
