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

/// The witnesses of a run of failures: convincing once one is sure or two keys differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Witnesses {
    first: Option<u64>,
    convincing: bool,
}

impl Witnesses {
    pub fn add(&mut self, w: Witness) {
        match w {
            Witness::Sure => self.convincing = true,
            Witness::Key(k) => match self.first {
                None => self.first = Some(k),
                Some(f) if f != k => self.convincing = true,
                Some(_) => {}
            },
        }
    }

    /// Both runs' witnesses together.
    pub fn merge(&mut self, other: Witnesses) {
        if other.convincing {
            self.convincing = true;
        }
        if let Some(k) = other.first {
            self.add(Witness::Key(k));
        }
    }

    /// Whether the failures are the server's: a sure one, or two keys'.
    pub fn convincing(&self) -> bool {
        self.convincing
    }
}

/// A server's last [`WINDOW`] outcomes with their witnesses, and its current run of failures:
/// the failure rate and the failures in a row an ejection reads, counting only what more than
/// one client key (or a sure witness) saw.
#[derive(Clone, Debug)]
pub struct Record {
    /// Ring of outcomes: `None` served, `Some(w)` failed as `w` saw.
    ring: [Option<Witness>; WINDOW],
    next: usize,
    seen: usize,
    /// The current run of failures and its witnesses.
    run: u32,
    run_witnesses: Witnesses,
}

/// Outcomes the failure rate reads.
pub const WINDOW: usize = 20;

impl Default for Record {
    fn default() -> Record {
        Record {
            ring: [None; WINDOW],
            next: 0,
            seen: 0,
            run: 0,
            run_witnesses: Witnesses::default(),
        }
    }
}

impl Record {
    fn push(&mut self, o: Option<Witness>) {
        self.ring[self.next] = o;
        self.next = (self.next + 1) % WINDOW;
        self.seen = (self.seen + 1).min(WINDOW);
    }

    /// A request served: the run of failures ends.
    pub fn served(&mut self) {
        self.push(None);
        self.run = 0;
        self.run_witnesses = Witnesses::default();
    }

    /// A failure as `w` saw it.
    pub fn failed(&mut self, w: Witness) {
        self.push(Some(w));
        self.run = self.run.saturating_add(1);
        self.run_witnesses.add(w);
    }

    /// A probe failed: a sure failure in the run, not an outcome of the window (which is the
    /// requests').
    pub fn probe_failed(&mut self) {
        self.run = self.run.saturating_add(1);
        self.run_witnesses.add(Witness::Sure);
    }

    /// Forget everything (an ejection, or a comeback: judged on what it does next).
    pub fn clear(&mut self) {
        *self = Record::default();
    }

    /// Failures in a row, counted only when convincing (else 0).
    pub fn run(&self) -> u32 {
        if self.run_witnesses.convincing() {
            self.run
        } else {
            0
        }
    }

    /// Failures in a row, whoever saw them (what `/status` shows).
    pub fn run_seen(&self) -> u32 {
        self.run
    }

    /// The share of the last outcomes that failed, once `min` are known and when the failures
    /// among them are convincing.
    pub fn rate(&self, min: usize) -> Option<f64> {
        if self.seen < min.max(1) {
            return None;
        }
        let mut w = Witnesses::default();
        let mut failed = 0usize;
        for o in self.ring.iter().take(self.seen).flatten() {
            failed += 1;
            w.add(*o);
        }
        (failed > 0 && w.convincing()).then(|| failed as f64 / self.seen as f64)
    }

    /// Whether the server's recent failures (in the window) are convincing: one key's failures
    /// alone change nothing another key gets.
    pub fn convincing(&self) -> bool {
        let mut w = Witnesses::default();
        for o in self.ring.iter().take(self.seen).flatten() {
            w.add(*o);
        }
        w.convincing()
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
        assert!(!r.convincing());
        r.failed(B);
        assert_eq!(
            r.run(),
            51,
            "a second key's failure makes the run the server's"
        );
        assert_eq!(r.rate(10), Some(1.0));
        assert!(r.convincing());
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
        assert!(r.convincing(), "the window still holds the sure failure");
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
