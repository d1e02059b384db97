//! The process's allocator: mimalloc, called the way `std`'s system allocator calls malloc.
//!
//! The `mimalloc` crate's `GlobalAlloc` passes every request to `mi_malloc_aligned`, whatever its
//! alignment. In mimalloc 3 that call is quick only for a block of at most 1 KiB whose size is
//! at least its alignment and whose free block happens to be aligned; anything larger (a boxed
//! request future, a `Run`, hyper's read buffers, a growing `Vec`) takes the generic path, which
//! over-allocates by the alignment, marks the page as holding interior pointers and so slows
//! every later free on that page too. That was 5,000 instructions a request of the gateway's
//! 100,000 (`benches/instructions.sh`). Every mimalloc block is aligned to a machine word, so a
//! layout that asks for no more than that is plain `mi_malloc`; a stricter one (tokio's task
//! cells ask for 128 bytes) keeps the aligned call.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment every mimalloc block has (blocks are whole machine words, the smallest one
/// word).
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc as the global allocator: `#[global_allocator] static A: Allocator = Allocator;`.
pub struct Allocator;

// SAFETY: each method hands mimalloc a layout it was asked for and returns what mimalloc
// returned. A block from `mi_malloc`/`mi_zalloc`/`mi_realloc` is aligned to a word, which is
// all the layouts sent there ask for; the others go to the `_aligned` calls, which align to the
// layout's alignment. `mi_free` frees blocks from every one of them; `mi_realloc_aligned` keeps
// the alignment it is given.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_malloc(layout.size()) as *mut u8
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see the impl.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_zalloc(layout.size()) as *mut u8
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from one of the calls above (the `GlobalAlloc` contract).
        unsafe { mi::mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: see the impl; the alignment is the block's own (the `GlobalAlloc` contract).
        unsafe {
            if layout.align() <= WORD {
                mi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8
            } else {
                mi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

/// At most once a second on each runtime worker, when it goes idle (tokio's `on_thread_park`):
/// the worker's freed blocks and pages collected. mimalloc returns a thread's freed pages only
/// while that thread allocates, so memory a burst left (10,000 connections' buffers, freed when
/// they parked or closed) stayed resident while the workers had nothing to do: 60 s after
/// 10,000 connections closed the gateway still held 123 MiB against 25 idle (now about 40), and
/// parked connections held 8.7 KB each instead of 4 (`benches/connections.rs`).
///
/// The forced collect (pages handed back to the system at once, which the next allocations
/// fault in again) runs only on a worker whose last sleep lasted a second or more — one with
/// little to do; a busy worker, which parks for moments between requests, only collects what
/// is free (`mi_collect(false)`), so no request waits behind a purge under load.
pub fn on_worker_park() {
    use std::cell::Cell;
    use std::time::{Duration, Instant};
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    let now = Instant::now();
    PARKED_AT.set(Some(now));
    if LAST
        .get()
        .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
    {
        return;
    }
    LAST.set(Some(now));
    let idle = SLEPT.get() >= Duration::from_secs(1);
    // SAFETY: `mi_collect` takes no pointers; it only walks mimalloc's own free lists.
    unsafe { mi::mi_collect(idle) }
    if !idle {
        BUSY_COLLECTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

thread_local! {
    /// When this worker last went to sleep, and how long its last sleep lasted.
    static PARKED_AT: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
    static SLEPT: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// When a runtime worker wakes (tokio's `on_thread_unpark`): how long it slept.
pub fn on_worker_unpark() {
    if let Some(at) = PARKED_AT.get() {
        SLEPT.set(at.elapsed());
    }
}

/// Collects workers made while busy (`on_worker_park` after a short sleep), for the purger.
static BUSY_COLLECTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Starts the thread that lets a quiet process hand back what its last burst freed. A worker
/// hands its free pages to the system only in a forced collect, which it makes when it parks
/// after a sleep of a second or more; so after a burst (10,000 connections parked or closed, and
/// nothing else to do) the pages stayed resident until something woke the workers — a probe, a
/// timer, the next request — whenever that came. This thread, a second after the workers were
/// last busy, wakes each of them with an empty task: each wakes from its sleep, parks again and
/// makes that collect. It costs a wake a second while nothing is happening and two empty tasks
/// after a burst.
pub fn start_purger(rt: tokio::runtime::Handle) {
    use std::sync::atomic::Ordering;
    let spawned = std::thread::Builder::new()
        .name("autohedge-purge".into())
        .spawn(move || {
            let workers = rt.metrics().num_workers();
            let mut quiet = Quiet::new(BUSY_COLLECTS.load(Ordering::Relaxed));
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
                if quiet.tick(BUSY_COLLECTS.load(Ordering::Relaxed)) {
                    for _ in 0..workers {
                        drop(rt.spawn(async {}));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the allocator's purge thread: a quiet gateway hands freed memory back only when its workers next wake");
    }
}

/// The purger's policy, a tick a second: wake the workers on the first two quiet ticks after a
/// busy one (a worker's collect may follow the burst's end by up to a second), then not again
/// until they have been busy.
#[derive(Debug)]
struct Quiet {
    /// The busy collects counted at the last tick.
    seen: u64,
    /// Wakes left to send.
    due: u8,
}

impl Quiet {
    fn new(count: u64) -> Quiet {
        Quiet {
            seen: count,
            due: 0,
        }
    }

    /// Whether to wake the workers now, the busy collects counting `count`.
    fn tick(&mut self, count: u64) -> bool {
        if count != self.seen {
            // Still busy: wait for a quiet second.
            self.seen = count;
            self.due = 2;
            return false;
        }
        if self.due == 0 {
            return false;
        }
        self.due -= 1;
        true
    }
}

/// mimalloc's `mi_option_purge_delay` (its `mimalloc.h`; `libmimalloc-sys` names no constant for
/// it): how long freed memory stays resident before it is returned to the system (1,000 ms by
/// default in mimalloc 3).
const PURGE_DELAY: mi::mi_option_t = 15;

/// Runs `f`, a one-off burst of scratch memory (building a token encoder), with mimalloc
/// returning freed memory to the system at once instead of a second later, so what the burst
/// frees as it goes is not still resident when it peaks: building the o200k encoder peaked
/// 6.8 MB lower this way (13.8 against 20.6 MB over the process before it, the same 57 ms).
///
/// The delay is one setting for the whole process: while `f` runs, the other threads' frees are
/// purged at once too (more `madvise` calls for those milliseconds, nothing else). Nested and
/// concurrent calls share one restore: the last to finish puts back the delay the first found.
pub fn purging_at_once<T>(f: impl FnOnce() -> T) -> T {
    /// Calls running, and the delay to restore when the last ends.
    static RUNNING: std::sync::Mutex<(usize, std::ffi::c_long)> = std::sync::Mutex::new((0, 0));
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
            running.0 -= 1;
            if running.0 == 0 {
                // SAFETY: sets one of mimalloc's options; takes no pointers.
                unsafe { mi::mi_option_set(PURGE_DELAY, running.1) }
            }
        }
    }
    {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if running.0 == 0 {
            // SAFETY: reads and sets one of mimalloc's options; takes no pointers.
            unsafe {
                running.1 = mi::mi_option_get(PURGE_DELAY);
                mi::mi_option_set(PURGE_DELAY, 0);
            }
        }
        running.0 += 1;
    }
    let _restore = Restore;
    f()
}

/// The purge delay mimalloc uses now (for the tests).
pub fn purge_delay() -> std::ffi::c_long {
    // SAFETY: reads one of mimalloc's options; takes no pointers.
    unsafe { mi::mi_option_get(PURGE_DELAY) }
}

/// Returns the allocator's free pages to the system, after a one-off burst of scratch memory
/// (building a token encoder).
pub fn release_free_memory() {
    // SAFETY: `mi_collect` takes no pointers; it only walks mimalloc's own free lists.
    unsafe { mi::mi_collect(true) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wakes come on the two quiet ticks after a busy one, never while busy, never when
    /// nothing has happened, and again after the next busy spell.
    #[test]
    fn the_purger_wakes_the_workers_twice_after_a_burst_and_then_rests() {
        let mut q = Quiet::new(7);
        let ticks = |q: &mut Quiet, counts: &[u64]| -> Vec<bool> {
            counts.iter().map(|&c| q.tick(c)).collect()
        };
        // Nothing happened since the start: no wake.
        assert_eq!(ticks(&mut q, &[7, 7, 7]), [false; 3]);
        // Busy for three ticks, then quiet: two wakes, then rest.
        assert_eq!(
            ticks(&mut q, &[8, 12, 15, 15, 15, 15, 15]),
            [false, false, false, true, true, false, false]
        );
        // Busy again in the middle of the wakes: wait for quiet again.
        assert_eq!(
            ticks(&mut q, &[16, 16, 17, 17, 17, 17]),
            [false, true, false, true, true, false]
        );
    }

    /// Every alignment from a byte to a page, sizes around mimalloc's size classes (a word,
    /// the 1 KiB small-block limit, beyond it), allocated, zeroed, grown and shrunk: every block
    /// is aligned as asked, zeroed where asked, keeps its bytes across a realloc, and frees.
    #[test]
    fn blocks_are_aligned_zeroed_and_kept_as_asked() {
        let a = Allocator;
        let sizes = [1, 7, 8, 9, 24, 40, 100, 1000, 1024, 1025, 3000, 70_000];
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for &size in &sizes {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: non-zero sizes; each block is freed once with its layout.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    std::ptr::write_bytes(p, 0xAB, size);
                    let grown = size * 3 + 5;
                    let q = a.realloc(p, layout, grown);
                    assert_eq!(
                        q as usize % align,
                        0,
                        "realloc {size}->{grown} align {align}"
                    );
                    assert!((0..size).all(|i| *q.add(i) == 0xAB));
                    let shrunk = size.div_ceil(2);
                    let r = a.realloc(q, Layout::from_size_align(grown, align).unwrap(), shrunk);
                    assert_eq!(r as usize % align, 0);
                    assert!((0..shrunk).all(|i| *r.add(i) == 0xAB));
                    a.dealloc(r, Layout::from_size_align(shrunk, align).unwrap());

                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0);
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
