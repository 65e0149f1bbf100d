//! Gradient reduction in a dtype other than the parameters' (bf16 or f16 parameters reduced in
//! f32, f32 parameters reduced in bf16 or f16), against an unsharded reference computed here
//! that does the same casts and sums in the reduce-scatter's order; a parameter without a
//! gradient reduced as zeros; refused dtype pairs; and
//! hybrid sharding's cross-group all-reduce chained behind the in-group reduce-scatter in
//! stream order (launched before the reduce-scatter completed; a failure of the first stage
//! reported on every rank).

use std::sync::mpsc;
use std::sync::Arc;

use collsched::backend::local::LocalRank;
use collsched::backend::{Backend, BackendError, Stream};
use collsched::buckets::{DType, ParamId, Sharding};
use collsched::kernels::ElemType;
use collsched::runtime::{Coordinator, ModelState, RuntimeError};
use collsched::schedule::{GradReduce, SchedulerConfig};

#[path = "support/reduce.rs"]
mod reduce;
use reduce::*;

fn all_cases(dtype: DType, reduce: DType) {
    for world in 1..=5 {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            // Alternate the divide factors: the defaults (mean), a pre-divide, both given.
            let (pre, post) = [(None, None), (Some(2.0), None), (Some(4.0), Some(0.75))][(world + k) % 3];
            check(&Case { dtype, reduce, world, sharding, pre, post, missing: false });
        }
    }
}

#[test]
fn bf16_params_reduced_in_f32_match_the_reference() {
    all_cases(DType::BF16, DType::F32);
}

#[test]
fn f16_params_reduced_in_f32_match_the_reference() {
    all_cases(DType::F16, DType::F32);
}

#[test]
fn f32_params_reduced_in_bf16_match_their_reference() {
    all_cases(DType::F32, DType::BF16);
}

#[test]
fn f32_params_reduced_in_f16_match_their_reference() {
    for world in [2, 4] {
        for sharding in [Sharding::EvenSplit, Sharding::Hybrid(2)] {
            check(&Case {
                dtype: DType::F32,
                reduce: DType::F16,
                world,
                sharding,
                pre: Some(2.0),
                post: None,
                missing: false,
            });
        }
    }
}

/// A gradient that never comes is reduced as zeros, though the bucket's gradient buffer comes
/// from the pool with an earlier step's gradients in it.
#[test]
fn a_parameter_without_a_gradient_is_reduced_as_zeros_in_a_reused_buffer() {
    for (dtype, reduce) in [(DType::F32, DType::F32), (DType::BF16, DType::F32)] {
        for world in 1..=4 {
            for sharding in strategies(world) {
                check(&Case { dtype, reduce, world, sharding, pre: None, post: None, missing: true });
            }
        }
    }
}

#[test]
fn the_optimizer_gets_the_gradient_in_the_reduction_dtype_and_update_shards_f32_widens_it() {
    let case = Case {
        dtype: DType::F32,
        reduce: DType::BF16,
        world: 2,
        sharding: Sharding::EvenSplit,
        pre: None,
        post: None,
        missing: false,
    };
    let plan = case.plan();
    let init = case.init();
    let (grads, _) = reference(&case);
    let out = world(2)
        .run(|rank| -> Result<Vec<Run>, RuntimeError> {
            let state = ModelState::from_f32(Arc::new(rank), &plan, &init)?;
            let mut c = state.coordinator(case.config())?;
            for micro in 0..MICRO - 1 {
                let mut g = c.no_sync()?;
                backward(&mut g, &case, 0, micro)?;
                g.end_step()?;
            }
            backward(&mut c, &case, 0, MICRO - 1)?;
            c.end_step()?;
            let mut seen = Vec::new();
            c.update_shards_f32(|p, off, _, g| seen.push((p.index(), off, g.to_vec())))?;
            // Consumed: a second call visits nothing.
            assert_eq!(c.update_shards(|_| {})?, 0);
            Ok(seen)
        })
        .expect("ranks");
    let mut runs = 0;
    for (r, seen) in out.into_iter().enumerate() {
        for (p, off, g) in seen.expect("rank thread").expect("rank") {
            assert_eq!(bits(&g), bits(&grads[0][p][off..off + g.len()]), "rank {r}, p{p} at {off}");
            runs += 1;
        }
    }
    assert!(runs >= SIZES.len(), "every parameter has at least one run, got {runs}");
}

#[test]
fn refused_dtype_pairs_name_the_bucket_and_both_dtypes() {
    for (dtype, reduce, words) in [
        (DType::BF16, DType::F16, "range"),
        (DType::F16, DType::BF16, "precision"),
        (DType::F32, DType::F64, "f32, f16 or bf16"),
        (DType::BF16, DType::I8, "f32, f16 or bf16"),
    ] {
        let case = Case {
            dtype,
            reduce,
            world: 2,
            sharding: Sharding::EvenSplit,
            pre: None,
            post: None,
            missing: false,
        };
        let plan = case.plan();
        let gather = plan.layout().gather_buckets()[1].id();
        // Only one gather bucket's override is bad: the error names its gradient bucket.
        let config = SchedulerConfig {
            reduce_per_bucket: vec![(gather, GradReduce { dtype: Some(reduce), ..GradReduce::default() })],
            ..SchedulerConfig::default()
        };
        let bytes: Vec<Vec<u8>> = case.init().iter().map(|v| encode(elem(dtype), v)).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let out = world(2)
            .run(|rank| {
                let state = ModelState::new(Arc::new(rank), &plan, &refs).expect("state");
                state.coordinator(config.clone()).map(|_| ())
            })
            .expect("ranks");
        for (r, res) in out.into_iter().enumerate() {
            let e = res.expect("rank thread").expect_err("a refused pair");
            let msg = e.to_string();
            match e {
                RuntimeError::ReduceDtype { rank, gather_bucket, dtype: d, reduce: rd, .. } => {
                    assert_eq!((rank, gather_bucket, d, rd), (r, Some(gather), dtype, reduce), "{msg}");
                }
                other => panic!("{dtype}/{reduce}: expected ReduceDtype, got {other}"),
            }
            for w in
                ["gradient bucket", &format!("gather bucket {gather}"), dtype.name(), reduce.name(), words]
            {
                assert!(msg.contains(w), "{dtype}/{reduce}: message lacks {w:?}: {msg}");
            }
        }
    }
}

/// Blocks rank's reduce-scatter stream until the test says go (`true`) or fail (`false`).
fn gate(rank: &LocalRank) -> mpsc::Sender<bool> {
    let (tx, rx) = mpsc::channel::<bool>();
    rank.enqueue_host(Stream::ReduceScatter, move || match rx.recv() {
        Ok(false) => {
            Err(BackendError::Unsupported { what: "injected failure before the reduce-scatter".into() })
        }
        _ => Ok(()),
    })
    .expect("gate");
    tx
}

fn hybrid_case() -> Case {
    Case {
        dtype: DType::BF16,
        reduce: DType::F32,
        world: 4,
        sharding: Sharding::Hybrid(2),
        pre: None,
        post: None,
        missing: false,
    }
}

/// All gradients of one step (no fetches) with the reduce-scatter stream gated: every
/// reduction, both stages, is launched while no reduce-scatter can have run.
fn gated_step(c: &mut Coordinator<LocalRank>, case: &Case) -> Result<usize, RuntimeError> {
    let p = elem(case.dtype);
    for k in (0..SIZES.len()).rev() {
        let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, c.model().rank(), k, i)).collect();
        c.grad_ready(ParamId(k as u32), &encode(p, &g))?;
    }
    c.poll()?;
    Ok(c.reductions_in_flight())
}

#[test]
fn hybrid_all_reduce_is_launched_before_the_reduce_scatter_completed() {
    let case = Case { pre: Some(2.0), ..hybrid_case() };
    let plan = case.plan();
    let n_grad = plan.layout().grad_buckets().len();
    assert!(n_grad >= 3, "want several gradient buckets, got {n_grad}");
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(4)
        .run(|rank| -> Result<(u64, usize, Vec<Run>), RuntimeError> {
            let state = ModelState::new(Arc::new(rank), &plan, &refs)?;
            let mut c = state.coordinator(SchedulerConfig { ..case.config() })?;
            let go = gate(state.backend());
            let in_flight = gated_step(&mut c, &case)?;
            // Both stages of every bucket were issued while the stream was held.
            let launched = c.driver_counters().collectives;
            go.send(true).expect("gate");
            c.end_step()?;
            let mut seen = Vec::new();
            c.update_shards(sgd_hook(&mut seen))?;
            Ok((launched, in_flight, seen))
        })
        .expect("ranks");
    // The reference of this single micro-batch step, by the rule of `reference`.
    let groups = case.groups();
    let post = (4.0 / 2.0) as f32;
    let mut runs = 0;
    for (r, res) in out.into_iter().enumerate() {
        let (launched, in_flight, seen) =
            res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(in_flight, n_grad, "rank {r}: a reduction finished while its stream was gated");
        assert_eq!(
            launched,
            2 * n_grad as u64,
            "rank {r}: all-reduces not launched before the reduce-scatters ran"
        );
        runs += seen.len();
        for (p, off, g) in seen {
            let want: Vec<f32> = (off..off + g.len())
                .map(|i| {
                    let stage = |group: &[usize]| {
                        let mut s = 0f32;
                        for &q in group {
                            s += round(ElemType::BF16, grad_value(0, 0, q, p, i)) / 2.0;
                        }
                        s
                    };
                    let mut s = 0f32;
                    for grp in &groups {
                        s += stage(grp);
                    }
                    s / post
                })
                .collect();
            assert_eq!(bits(&g), bits(&want), "rank {r}: p{p} at {off}");
        }
    }
    // (With 64-byte buckets of bf16 and the layout's alignment, some ranks own only padding.)
    assert!(runs >= 2 * SIZES.len(), "every parameter reached an optimizer in both groups: {runs} runs");
}

#[test]
fn a_backward_s_fetch_finishes_the_reductions_that_completed() {
    // Their buffers go back before the step's end: a backward holds the inputs of the
    // reductions still running, not every bucket's.
    let case = Case::f32_even(2);
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<(usize, usize, usize), RuntimeError> {
            let state = ModelState::new(Arc::new(rank), &plan, &refs)?;
            let mut c = state.coordinator(case.config())?;
            let be = Arc::clone(state.backend());
            for k in (1..SIZES.len()).rev() {
                let id = ParamId(k as u32);
                c.fetch(&[id])?;
                let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, be.rank(), k, i)).collect();
                c.grad_ready(id, &encode(ElemType::F32, &g))?;
                c.release(&[id])?;
            }
            let launched = c.reductions_in_flight();
            // Everything queued on the reduce-scatter stream so far has run once this is seen.
            let (tx, rx) = mpsc::channel();
            be.enqueue_host(Stream::ReduceScatter, move || {
                tx.send(()).expect("test thread");
                Ok(())
            })
            .map_err(backend)?;
            rx.recv().expect("stream");
            c.fetch(&[ParamId(0)])?;
            let after_fetch = c.reductions_in_flight();
            let g: Vec<f32> = (0..SIZES[0]).map(|i| grad_value(0, 0, be.rank(), 0, i)).collect();
            c.grad_ready(ParamId(0), &encode(ElemType::F32, &g))?;
            c.release(&[ParamId(0)])?;
            c.end_step()?;
            let mut seen = Vec::new();
            let runs = c.update_shards(sgd_hook(&mut seen))?;
            Ok((launched, after_fetch, runs))
        })
        .expect("ranks");
    let mut runs = 0;
    for (r, res) in out.into_iter().enumerate() {
        let (launched, after_fetch, n) =
            res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(launched >= 1, "rank {r}: no bucket without p0 was reduced during the backward");
        assert_eq!(
            after_fetch, 0,
            "rank {r}: {after_fetch} completed reductions left unfinished by the fetch"
        );
        runs += n;
    }
    assert!(runs >= SIZES.len(), "every parameter's gradient reached an optimizer: {runs} runs");
}

#[test]
fn a_failed_first_stage_is_reported_on_every_rank_naming_the_op_and_bucket() {
    let case = hybrid_case();
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(4)
        .run(|rank| {
            let state = ModelState::new(Arc::new(rank), &plan, &refs).expect("state");
            let mut c = state.coordinator(case.config()).expect("coordinator");
            let go = gate(state.backend());
            gated_step(&mut c, &case).expect("launches");
            // Rank 0's reduce-scatter stream fails before its first reduce-scatter.
            go.send(state.rank() != 0).expect("gate");
            c.end_step().map(|_| ())
        })
        .expect("ranks");
    for (r, res) in out.into_iter().enumerate() {
        let e = res.expect("rank thread").expect_err("every rank reports the failure");
        let msg = e.to_string();
        match e {
            RuntimeError::Backend { rank, op, bucket, source } => {
                assert_eq!(rank, r);
                assert!(bucket.is_some(), "{msg}");
                // Ranks 0 and 1 share the failed reduce-scatter; ranks 2 and 3 completed
                // theirs and fail in the all-reduce with the failed peers.
                let want = if r < 2 { "reduce_scatter" } else { "all_reduce" };
                assert_eq!(op, want, "rank {r}: {msg}");
                assert!(
                    !matches!(source, BackendError::PeerTimeout { .. } | BackendError::EventTimeout { .. }),
                    "rank {r}: a timeout instead of the failure: {msg}"
                );
                assert!(msg.contains("bucket"), "{msg}");
            }
            other => panic!("rank {r}: expected a backend error, got {other}"),
        }
    }
}
