//! A steady-state training step through the coordinator allocates nothing on the engine's
//! thread: counted with a counting global allocator (its own test binary).
//!
//! The backend here is a one-rank loopback that allocates nothing itself (collectives of a
//! group of one run synchronously at launch), so the count measures the driver, the
//! coordinator and the scheduler. (The same step on the local backend is checked by
//! `local_runtime_alloc.rs`.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::ModelState;
use collsched::schedule::{GradReduce, Plan, PolicyKind, SchedulerConfig};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[path = "support/loopback.rs"]
mod loopback;
use loopback::Loopback;

#[test]
fn a_steady_state_step_allocates_nothing() {
    // Also with a reduction in bf16 of the f32 parameters and a no_sync micro-batch before the
    // sync one: the casts at copy-in, the mixed accumulation and the widening for
    // `update_shards_f32` reuse their buffers too.
    let cases = [
        (Sharding::EvenSplit, None),
        (Sharding::Flat, None),
        (Sharding::Greedy, None),
        (Sharding::EvenSplit, Some(DType::BF16)),
        (Sharding::Flat, Some(DType::BF16)),
    ];
    for (sharding, reduce) in cases {
        let sizes = [37usize, 5, 41, 7, 29, 3, 64, 9];
        let specs = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32))
            .collect();
        let set = ParamSet::new(specs).unwrap();
        let plan =
            Plan::new(LayoutBuilder::new(&set, sharding, 1).bucket_bytes(200).align(16).build().unwrap());
        let init: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1.0; n]).collect();
        let state = ModelState::from_f32(Arc::new(Loopback::new()), &plan, &init).unwrap();
        let config = SchedulerConfig {
            policy: PolicyKind::TraceReplay,
            reduce: GradReduce { dtype: reduce, ..GradReduce::default() },
            ..SchedulerConfig::default()
        };
        let mut c = state.coordinator(config).unwrap();
        let modules: Vec<[ParamId; 2]> = (0..4).map(|m| [ParamId(2 * m), ParamId(2 * m + 1)]).collect();
        let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.25; n]).collect();
        let mut sum = 0f32;
        let mut pass = |c: &mut collsched::Coordinator<Loopback>| {
            for m in &modules {
                let v = c.fetch(m).unwrap();
                sum += v.f32(m[0]).unwrap()[0];
                drop(v);
                c.release(m).unwrap();
            }
            for m in modules.iter().rev() {
                c.fetch(m).unwrap();
                for &p in m {
                    c.grad_ready_f32(p, &grads[p.index()]).unwrap();
                }
                // The event-carrying form allocates nothing either.
                c.release_after(m, &loopback::Done).unwrap();
            }
        };
        let mut step = |c: &mut collsched::Coordinator<Loopback>| {
            if reduce.is_some() {
                let mut g = c.no_sync().unwrap();
                pass(&mut g);
                g.end_step().unwrap();
            }
            pass(c);
            let stats = c.end_step().unwrap();
            c.update_shards_f32(|_, _, w, g| w.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.1 * g)).unwrap();
            stats
        };
        for _ in 0..3 {
            step(&mut c);
        }
        ALLOCS.store(0, Ordering::SeqCst);
        COUNTING.with(|x| x.set(true));
        let stats = step(&mut c);
        COUNTING.with(|x| x.set(false));
        let n = ALLOCS.load(Ordering::SeqCst);
        assert!(
            stats.schedule.prefetch_hits > 0,
            "{sharding}, {reduce:?}: the measured step had no prefetch hits: {stats:?}"
        );
        assert!(stats.collectives() > 0);
        assert_eq!(n, 0, "{sharding}, reduce in {reduce:?}: a steady-state step made {n} heap allocations");
        assert!(sum > 0.0);
    }
}
