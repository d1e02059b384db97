//! The log writer: every line the gateway logs is appended to one bounded buffer in memory, and
//! a thread of its own writes that buffer to stderr in one `write(2)` per gather interval.
//!
//! Why not `tracing-appender`'s non-blocking writer: it hands each line through a channel to a
//! worker that wakes (a futex, often a `sched_yield` spin) for each line and writes after each
//! drain. Under load that was a context switch every second request and a quarter of the
//! gateway's system time. Here a logging thread takes an uncontended mutex and copies its line;
//! the writer wakes only when it was idle (the first line after a quiet spell) and then gathers
//! for [`GATHER`] before it writes, so under load no log line costs a wake-up. A warning or an
//! error cuts the gather short: what an operator (or a test) waits for goes out at once.
//!
//! Bounded and lossy like before: past `limit` lines (`AUTOHEDGE_LOG_BUFFER_LINES`) or
//! [`MAX_BYTES`] queued, a line is dropped and counted (`autohedge_log_dropped_total`), so a
//! blocked stderr (a full pipe nobody reads) never stalls a request. Info lines reach stderr at
//! most [`GATHER`] late; [`Guard`] writes what is queued when the process ends.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How long the writer gathers lines after it wakes for the first of them: a burst of any size
/// costs one write, and info lines appear at most this late. Warnings and errors do not wait.
pub const GATHER: Duration = Duration::from_millis(10);

/// Bytes queued at most, whatever the line count (one line may be long).
pub const MAX_BYTES: usize = 32 * 1024 * 1024;

/// How long [`Guard`] waits at exit for the queue to reach stderr (a blocked stderr must not
/// hold the process).
const EXIT_WAIT: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Queue {
    buf: Vec<u8>,
    lines: usize,
    /// The writer is waiting for a first line: the next line wakes it.
    idle: bool,
    /// The writer is gathering: a warning or an error wakes it.
    gathering: bool,
    /// A warning or an error is queued: write without gathering.
    urgent: bool,
    closed: bool,
    /// The writer has written everything and stopped.
    done: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    /// The writer waits on this (idle, or gathering).
    wake: Condvar,
    /// The guard waits on this for the writer to finish.
    finished: Condvar,
    dropped: AtomicU64,
    limit: usize,
    gather: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A thread that panicked while holding the lock left a consistent queue (appends are
        // single calls): keep logging.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The writing half, cheap to clone; one `write` call is one line (as `tracing-subscriber`'s
/// formatter writes each event in one `write_all`).
#[derive(Clone)]
pub struct LogWriter {
    shared: Arc<Shared>,
}

/// Stops the writer thread when dropped, after writing what is queued (waiting at most a
/// second).
pub struct Guard {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LogWriter {
    /// Starts the writer thread over `sink` with a queue of at most `limit` lines.
    pub fn start<W: io::Write + Send + 'static>(
        sink: W,
        limit: usize,
        thread_name: &str,
    ) -> io::Result<(LogWriter, Guard)> {
        Self::start_gathering(sink, limit, thread_name, GATHER)
    }

    /// The same with another gather interval.
    pub fn start_gathering<W: io::Write + Send + 'static>(
        sink: W,
        limit: usize,
        thread_name: &str,
        gather: Duration,
    ) -> io::Result<(LogWriter, Guard)> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            finished: Condvar::new(),
            dropped: AtomicU64::new(0),
            limit: limit.max(1),
            gather,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || run(&s, sink))?;
        Ok((
            LogWriter {
                shared: shared.clone(),
            },
            Guard {
                shared,
                thread: Some(thread),
            },
        ))
    }

    /// Queues one line, or drops and counts it when the queue is full. Never blocks on the sink.
    pub fn line(&self, line: &[u8]) {
        self.queue(line, false);
    }

    /// `urgent`: a warning or an error, written without waiting for the gather.
    fn queue(&self, line: &[u8], urgent: bool) {
        let mut q = self.shared.lock();
        if q.lines >= self.shared.limit || q.buf.len().saturating_add(line.len()) > MAX_BYTES {
            drop(q);
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.buf.extend_from_slice(line);
        q.lines += 1;
        let mut wake = std::mem::take(&mut q.idle);
        if urgent {
            q.urgent = true;
            wake |= q.gathering;
        }
        drop(q);
        if wake {
            self.shared.wake.notify_one();
        }
    }

    /// Lines dropped so far because the queue was full.
    pub fn dropped_lines(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

fn run<W: io::Write>(shared: &Shared, mut sink: W) {
    let mut out = Vec::new();
    loop {
        let mut q = shared.lock();
        while q.buf.is_empty() && !q.closed {
            q.idle = true;
            q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        if q.buf.is_empty() {
            q.done = true;
            drop(q);
            shared.finished.notify_all();
            return;
        }
        // Gather: whatever else is logged meanwhile goes out in the same write, and while this
        // thread gathers rather than waits idle, no logging thread has to wake it.
        let until = std::time::Instant::now() + shared.gather;
        while !q.urgent && !q.closed {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            q.gathering = true;
            q = match shared.wake.wait_timeout(q, left) {
                Ok((q, _)) => q,
                Err(e) => e.into_inner().0,
            };
            q.gathering = false;
        }
        q.urgent = false;
        std::mem::swap(&mut q.buf, &mut out);
        q.lines = 0;
        drop(q);
        // A failing sink (closed stderr) loses these lines, as any write to it would.
        let _ = sink.write_all(&out).and_then(|()| sink.flush());
        out.clear();
        // After a burst, give the memory back rather than keep the largest buffer ever seen.
        if out.capacity() > 1024 * 1024 {
            out = Vec::new();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.closed = true;
        self.shared.wake.notify_all();
        let deadline = std::time::Instant::now() + EXIT_WAIT;
        while !q.done {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                // The sink is blocked: leave the thread behind rather than hang the exit.
                return;
            }
            q = match self.shared.finished.wait_timeout(q, left) {
                Ok((q, _)) => q,
                Err(e) => e.into_inner().0,
            };
        }
        drop(q);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.line(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What `tracing-subscriber` asks for each event: a borrowed handle, no clone of the `Arc`,
/// and whether the event is a warning or an error.
pub struct LineRef<'a>(&'a LogWriter, bool);

impl io::Write for LineRef<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.queue(buf, self.1);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LineRef<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineRef(self, false)
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        LineRef(self, *meta.level() <= tracing::Level::WARN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that records what reached it, optionally blocking every write until released.
    #[derive(Clone, Default)]
    struct Sink {
        got: Arc<Mutex<Vec<u8>>>,
        writes: Arc<AtomicU64>,
        gate: Option<Arc<(Mutex<bool>, Condvar)>>,
    }

    impl io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if let Some(g) = &self.gate {
                let mut open = g.0.lock().unwrap();
                while !*open {
                    open = g.1.wait(open).unwrap();
                }
            }
            self.writes.fetch_add(1, Ordering::Relaxed);
            self.got.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Waits (generously: it must happen) until the writer has `taken` what was queued (the
    /// queue is empty again), or has written everything and stopped (`!taken`: after the guard
    /// closed it; the guard itself gives up after `EXIT_WAIT`, which a stalled thread can pass).
    fn until(w: &LogWriter, taken: bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let q = w.shared.lock();
            if if taken { q.buf.is_empty() } else { q.done } {
                return;
            }
            drop(q);
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never {}",
                if taken { "took the queue" } else { "finished" }
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_burst_of_lines_goes_out_in_order_and_in_few_writes() {
        let sink = Sink::default();
        // A gather longer than the test: only the guard's close ends it, so how long the loop
        // below takes (a preempted thread) cannot decide how many writes there are.
        let (w, guard) =
            LogWriter::start_gathering(sink.clone(), 10_000, "t-log", Duration::from_secs(3600))
                .unwrap();
        for i in 0..1000 {
            w.line(format!("line {i}\n").as_bytes());
        }
        drop(guard);
        until(&w, false);
        let got = String::from_utf8(sink.got.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len(), 1000);
        assert!(
            lines
                .iter()
                .enumerate()
                .all(|(i, l)| *l == format!("line {i}"))
        );
        // Queued within one gather interval: one write, not one per line.
        let writes = sink.writes.load(Ordering::Relaxed);
        assert_eq!(writes, 1, "{writes} writes for one burst of 1000 lines");
        assert_eq!(w.dropped_lines(), 0);
    }

    fn wait_for(sink: &Sink, what: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !String::from_utf8_lossy(&sink.got.lock().unwrap()).contains(what) {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    #[test]
    fn a_warning_cuts_the_gather_short() {
        use std::io::Write as _;
        use tracing_subscriber::fmt::MakeWriter as _;
        let sink = Sink::default();
        // A gather far longer than the test may wait: only the warning can get lines out.
        let (w, _guard) =
            LogWriter::start_gathering(sink.clone(), 100, "t-log", Duration::from_secs(3600))
                .unwrap();
        let (info, warn) = (meta(tracing::Level::INFO), meta(tracing::Level::WARN));
        w.make_writer_for(&info).write_all(b"info line\n").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !String::from_utf8_lossy(&sink.got.lock().unwrap()).contains("info line"),
            "the info line waits for the gather"
        );
        w.make_writer_for(&warn).write_all(b"warn line\n").unwrap();
        assert!(
            wait_for(&sink, "warn line"),
            "the warning was not written at once"
        );
        assert!(
            wait_for(&sink, "info line"),
            "and took the info line with it"
        );
    }

    fn meta(level: tracing::Level) -> tracing::Metadata<'static> {
        tracing::Metadata::new(
            "event",
            "test",
            level,
            None,
            None,
            None,
            tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&CALLSITE)),
            tracing::metadata::Kind::EVENT,
        )
    }

    struct Callsite;
    impl tracing::callsite::Callsite for Callsite {
        fn set_interest(&self, _: tracing::subscriber::Interest) {}
        fn metadata(&self) -> &tracing::Metadata<'_> {
            unimplemented!()
        }
    }
    static CALLSITE: Callsite = Callsite;

    #[test]
    fn a_line_logged_when_idle_reaches_the_sink_without_an_exit() {
        let sink = Sink::default();
        let (w, _guard) = LogWriter::start(sink.clone(), 16, "t-log").unwrap();
        for round in 0..3 {
            w.line(format!("r{round}\n").as_bytes());
            assert!(
                wait_for(&sink, &format!("r{round}")),
                "line {round} never written"
            );
            // Quiet long enough for the writer to go idle again.
            std::thread::sleep(GATHER * 3);
        }
    }

    #[test]
    fn a_blocked_sink_drops_and_counts_past_the_limit_without_blocking_the_caller() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let sink = Sink {
            gate: Some(gate.clone()),
            ..Sink::default()
        };
        let (w, guard) = LogWriter::start(sink.clone(), 100, "t-log").unwrap();
        w.line(b"first\n");
        // The writer takes `first` (the queue is empty again) and blocks in the sink; the
        // queue then holds 100 more.
        until(&w, true);
        // The sink stays blocked, so a caller that blocked on it would never return: the
        // bound only turns that hang into a failure (generous, for a busy machine).
        let (done, finished) = std::sync::mpsc::channel();
        let caller = w.clone();
        std::thread::spawn(move || {
            for i in 0..1000 {
                caller.line(format!("l{i}\n").as_bytes());
            }
            let _ = done.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the caller blocked"
        );
        assert_eq!(w.dropped_lines(), 900);
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        drop(guard);
        until(&w, false);
        let got = String::from_utf8(sink.got.lock().unwrap().clone()).unwrap();
        assert_eq!(got.lines().count(), 101, "first and the 100 queued");
        assert!(got.contains("l99\n") && !got.contains("l100\n"));
    }

    #[test]
    fn the_guard_does_not_hang_the_exit_on_a_sink_that_never_returns() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let sink = Sink {
            gate: Some(gate),
            ..Sink::default()
        };
        let (w, guard) = LogWriter::start(sink, 10, "t-log").unwrap();
        w.line(b"stuck\n");
        // The writer took `stuck` and is blocked in the sink for good.
        until(&w, true);
        let t = std::time::Instant::now();
        drop(guard);
        // The time is the promise (the exit is bounded by EXIT_WAIT, not a hang that lasts
        // forever); generous past EXIT_WAIT for a late wake-up on a busy machine.
        assert!(t.elapsed() < EXIT_WAIT + Duration::from_secs(10));
    }
}
