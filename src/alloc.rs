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

/// Returns the allocator's free pages to the system, after a one-off burst of scratch memory
/// (building a token encoder).
pub fn release_free_memory() {
    // SAFETY: `mi_collect` takes no pointers; it only walks mimalloc's own free lists.
    unsafe { mi::mi_collect(true) }
}

#[cfg(test)]
mod tests {
    use super::*;

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
