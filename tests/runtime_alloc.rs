//! A steady-state training step through the coordinator allocates nothing on the engine's
//! thread: counted with a counting global allocator (its own test binary).
//!
//! The backend here is a one-rank loopback that allocates nothing itself (collectives of a
//! group of one run synchronously at launch), so the count measures the driver, the
//! coordinator and the scheduler. (The same step on the local backend is checked by
//! `local_runtime_alloc.rs`.)

use std::sync::Arc;

use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::ModelState;
use collsched::schedule::{GradReduce, Plan, PolicyKind, SchedulerConfig};

#[path = "support/counting.rs"]
mod counting;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

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
        counting::reset();
        counting::count_this_thread(true);
        let stats = step(&mut c);
        counting::count_this_thread(false);
        let n = counting::allocs();
        assert!(
            stats.schedule.prefetch_hits > 0,
            "{sharding}, {reduce:?}: the measured step had no prefetch hits: {stats:?}"
        );
        assert!(stats.collectives() > 0);
        assert_eq!(n, 0, "{sharding}, reduce in {reduce:?}: a steady-state step made {n} heap allocations");
        assert!(sum > 0.0);
    }
}
