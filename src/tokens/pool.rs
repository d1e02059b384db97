//! A few threads of their own for counting long prompts: off the runtime's workers (a long count
//! would hold every small request queued behind it), and off tokio's blocking pool, whose threads
//! — up to 512 under a burst — would each keep the counter's per-thread piece cache (about a
//! megabyte). As many threads as cores, started the first time one is needed; a burst of long
//! prompts queues here, FIFO, and never takes more than these threads' CPU.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};

type Job = Box<dyn FnOnce() + Send>;

static POOL: OnceLock<Option<Sender<Job>>> = OnceLock::new();

fn pool() -> Option<&'static Sender<Job>> {
    POOL.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let n = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 8));
        let mut started = 0;
        for i in 0..n {
            let rx = rx.clone();
            let ok = std::thread::Builder::new()
                .name(format!("autohedge-count-{i}"))
                .spawn(move || worker(&rx))
                .is_ok();
            started += usize::from(ok);
        }
        (started > 0).then_some(tx)
    })
    .as_ref()
}

thread_local! {
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is one of the counting threads (a long count may wait here).
pub fn on_counting_thread() -> bool {
    COUNTING.with(std::cell::Cell::get)
}

fn worker(rx: &Mutex<Receiver<Job>>) {
    COUNTING.with(|c| c.set(true));
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
            rx.recv()
        };
        match job {
            // A job that panics answers nothing (its caller sees `None`); the thread goes on.
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(_) => return,
        }
    }
}

/// Runs `f` on a counting thread; `None` if it panicked or no thread could be started (then it
/// runs on tokio's blocking pool instead).
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        // Its caller gone (the client left): the count is not made for no one.
        if tx.is_closed() {
            return;
        }
        let _ = tx.send(f());
    });
    match pool() {
        Some(p) => match p.send(job) {
            Ok(()) => rx.await.ok(),
            Err(std::sync::mpsc::SendError(job)) => blocking(job, rx).await,
        },
        None => blocking(job, rx).await,
    }
}

async fn blocking<T>(job: Job, rx: tokio::sync::oneshot::Receiver<T>) -> Option<T> {
    let _ = tokio::task::spawn_blocking(job).await;
    rx.await.ok()
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn runs_off_the_runtime_and_survives_a_panic() {
        let here = std::thread::current().id();
        let there = super::run(|| std::thread::current().id()).await.unwrap();
        assert_ne!(here, there);
        let name = super::run(|| std::thread::current().name().map(str::to_string))
            .await
            .unwrap();
        assert!(name.unwrap().starts_with("autohedge-count-"));
        assert!(super::run(super::on_counting_thread).await.unwrap());
        assert!(!super::on_counting_thread());
        assert_eq!(super::run(|| -> u8 { panic!("a bad job") }).await, None);
        assert_eq!(super::run(|| 7).await, Some(7), "the pool goes on");
    }
}
