//! A counting global allocator for the allocation tests (`tests/local_alloc.rs`,
//! `tests/runtime_alloc.rs`, `tests/local_runtime_alloc.rs`), included with `#[path]`; each test
//! binary installs it with `#[global_allocator] static GLOBAL: counting::Counting = counting::Counting;`.
//!
//! It counts allocations and reallocations (frees are not counted) made either by **any
//! thread** while [`count_all`] is on, or by **the calling thread** while [`count_this_thread`]
//! is on, and keeps the backtrace of the first one it counted ([`first_backtrace`]) to say
//! where a regression allocates.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// The allocator: the system's, counting.
pub struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static ALL_THREADS: AtomicBool = AtomicBool::new(false);
static FIRST: Mutex<Option<String>> = Mutex::new(None);
thread_local! {
    static THIS_THREAD: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread records a backtrace (which allocates): not counted.
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

/// Counts every thread's allocations while `on`.
pub fn count_all(on: bool) {
    ALL_THREADS.store(on, Ordering::SeqCst);
}

/// Counts the calling thread's allocations while `on`.
pub fn count_this_thread(on: bool) {
    THIS_THREAD.with(|c| c.set(on));
}

/// Allocations counted so far.
pub fn allocs() -> u64 {
    ALLOCS.load(Ordering::SeqCst)
}

/// Sets the count to zero and forgets the first backtrace.
pub fn reset() {
    ALLOCS.store(0, Ordering::SeqCst);
    if let Ok(mut f) = FIRST.lock() {
        *f = None;
    }
}

/// Where the first counted allocation came from, if one was counted.
pub fn first_backtrace() -> Option<String> {
    FIRST.lock().ok().and_then(|f| f.clone())
}

fn note() {
    let counted = ALL_THREADS.load(Ordering::Relaxed) || THIS_THREAD.with(Cell::get);
    if !counted || RECORDING.with(Cell::get) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    RECORDING.with(|r| r.set(true));
    if let Ok(mut f) = FIRST.try_lock() {
        if f.is_none() {
            *f = Some(std::backtrace::Backtrace::force_capture().to_string());
        }
    }
    RECORDING.with(|r| r.set(false));
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
