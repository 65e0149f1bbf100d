//! Steady-state scheduling allocates nothing: a counting global allocator around whole
//! training steps (forward fetch/release, backward fetch/grad/release, end_step) with
//! trace-replay prefetch, after a warm-up step that records the trace.

// The scheduler crate forbids unsafe code, tests included; the counting allocator needs it,
// so this test lives in the root crate and borrows the scheduler tests' fixtures.
#[path = "../schedule/tests/common/mod.rs"]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use collsched_schedule::{Event, Scheduler, SchedulerConfig};
use common::*;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steady_state_steps_allocate_nothing() {
    let layers = 12;
    let plan = layered(layers, 4);
    let mut reg = registry(&plan);
    let mut s = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
    let mut out = Vec::with_capacity(1024);
    let mut step = |s: &mut Scheduler, out: &mut Vec<_>, skip: Option<usize>| {
        for i in (0..layers).filter(|&i| Some(i) != skip) {
            s.handle(&mut reg, Event::Fetch(&layer(i)), out).unwrap();
            s.handle(&mut reg, Event::Release { params: &layer(i), after: None }, out).unwrap();
        }
        for i in (0..layers).rev().filter(|&i| Some(i) != skip) {
            s.handle(&mut reg, Event::Fetch(&layer(i)), out).unwrap();
            for p in layer(i) {
                s.handle(&mut reg, Event::GradReady { param: p, after: None }, out).unwrap();
            }
            s.handle(&mut reg, Event::Release { params: &layer(i), after: None }, out).unwrap();
        }
        s.handle(&mut reg, Event::EndStep, out).unwrap();
        let n = out.len();
        out.clear();
        n
    };
    step(&mut s, &mut out, None);
    step(&mut s, &mut out, None);
    let before = ALLOCS.load(Ordering::Relaxed);
    let mut actions = 0;
    for k in 0..4 {
        // Also a step that skips a module (divergence, drain, zero-filled gradients).
        actions += step(&mut s, &mut out, if k == 2 { Some(5) } else { None });
    }
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    assert!(actions > 0);
    assert_eq!(allocs, 0, "{allocs} heap allocations in 4 steady-state steps");
}
