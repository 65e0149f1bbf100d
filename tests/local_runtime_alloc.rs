//! A steady-state training step through the coordinator on the local backend (a
//! [`LocalWorld`] of 2 ranks, each rank's coordinator on its own thread) allocates nothing on
//! the coordinator threads: counted with a counting global allocator (its own test binary).
//!
//! What is counted: allocations made by the ranks' coordinator threads (a thread-local flag)
//! during one steady-state step after warm-up steps; the stream threads are covered by
//! `local_alloc.rs`.

use std::sync::Arc;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::ModelState;
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};

#[path = "support/counting.rs"]
mod counting;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

#[test]
fn a_steady_state_step_on_the_local_backend_allocates_nothing() {
    let n = 2;
    let sizes = [37usize, 5, 41, 7, 29, 3, 64, 9];
    let specs =
        sizes.iter().enumerate().map(|(k, &s)| ParamSpec::new(format!("p{k}"), [s], DType::F32)).collect();
    let set = ParamSet::new(specs).unwrap();
    let plan = Plan::new(
        LayoutBuilder::new(&set, Sharding::Flat, n as u32).bucket_bytes(200).align(16).build().unwrap(),
    );
    let world = LocalWorld::with_config(n, LocalConfig::default()).unwrap();
    let results = world
        .run(|rank| {
            let init: Vec<Vec<f32>> = sizes.iter().map(|&s| vec![1.0; s]).collect();
            let state = ModelState::from_f32(Arc::new(rank), &plan, &init).unwrap();
            let config = SchedulerConfig { policy: PolicyKind::TraceReplay, ..SchedulerConfig::default() };
            let mut c = state.coordinator(config).unwrap();
            let modules: Vec<[ParamId; 2]> = (0..4).map(|m| [ParamId(2 * m), ParamId(2 * m + 1)]).collect();
            let grads: Vec<Vec<f32>> = sizes.iter().map(|&s| vec![0.25; s]).collect();
            let step = |c: &mut collsched::Coordinator<collsched::backend::local::LocalRank>| {
                for m in &modules {
                    c.fetch(m).unwrap();
                    c.release(m).unwrap();
                }
                for m in modules.iter().rev() {
                    c.fetch(m).unwrap();
                    for &p in m {
                        c.grad_ready_f32(p, &grads[p.index()]).unwrap();
                    }
                    c.release(m).unwrap();
                }
                let stats = c.end_step().unwrap();
                c.update_shards_f32(|_, _, w, g| w.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.1 * g))
                    .unwrap();
                stats
            };
            for _ in 0..5 {
                step(&mut c);
            }
            let before = counting::allocs();
            counting::count_this_thread(true);
            let stats = step(&mut c);
            counting::count_this_thread(false);
            assert!(stats.collectives() > 0);
            counting::allocs() - before
        })
        .unwrap();
    let total: u64 = results.into_iter().map(|r| r.unwrap()).sum();
    let first = counting::first_backtrace().unwrap_or_default();
    assert_eq!(total, 0, "a steady-state step made {total} heap allocations; the first at:\n{first}");
}
