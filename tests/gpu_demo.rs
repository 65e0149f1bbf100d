//! The ZeRO-3 parity run of the demo on GPUs: `sharded_run_cuda` (one GPU per rank, NCCL)
//! against the unsharded `reference_run` computed in the test, for even, flat and greedy
//! sharding on 1..N GPUs (N = the device count, at most 8), with and without prefetch, with
//! no_sync accumulation, a freeze/unfreeze and evaluation passes; hybrid sharding where the
//! GPUs allow it. Plus the clear error without a CUDA driver.
//!
//! The GPU tests run only with `COLLSCHED_GPU=1` and a CUDA device (and NCCL:
//! `COLLSCHED_NCCL_LIB`); otherwise they print `skipped: ...` and pass without checking
//! anything. The no-driver test runs where there is no driver and skips where there is one.
//!
//! Why exact on 1 and 2 GPUs only: the gradient reduction goes through NCCL. With one rank
//! nothing is summed; with two, every algorithm (ring or tree) computes each element as one
//! f32 addition `a + b`, which is commutative and rounded once, so it equals the reference's
//! sum bit for bit (the pre/post divides are our kernels, `__fdiv_rn`, like the CPU's). With
//! three or more ranks NCCL's ring starts each chunk's partial sum at a different rank, so
//! `(a + b) + c` may become `a + (b + c)`: a last-bit difference per step, which training then
//! carries along. There the runs are compared within 1e-5, the tolerance
//! `tests/demo_parity.rs` uses for hybrid sharding, whose two-stage reduction reorders the
//! sums the same way (observed differences are around 1e-7).
#![cfg(feature = "cuda")]

use collsched::backend::cuda::device_count;
use collsched::buckets::Sharding;
use collsched::demo::sharded::sharded_run_cuda;
use collsched::demo::{max_differences, reference_run, DemoError};
use collsched::schedule::PolicyKind;
use collsched_kernels::cuda::loader;

/// Tolerance on losses and final parameters where NCCL may sum in another order than the
/// reference (more than two ranks): the hybrid tolerance of `tests/demo_parity.rs`.
const REORDERED_SUM_TOLERANCE: f32 = 1e-5;

/// Largest world tried.
const MAX_GPUS: usize = 8;

#[path = "support/gpu.rs"]
mod gpu;

/// Number of GPUs to use (at most MAX_GPUS), or `None` (and a printed reason) when the GPU tests must skip.
fn gpus(test: &str) -> usize {
    gpu::gpus(test, MAX_GPUS)
}

#[path = "support/demo.rs"]
mod demo;
use demo::{opts, small};

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn even_flat_greedy_match_the_reference_on_1_to_n_gpus() {
    let n = gpus("even_flat_greedy_match_the_reference_on_1_to_n_gpus");
    for world in 1..=n {
        let cfg = small(world);
        let reference = reference_run(&cfg);
        for sharding in [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy] {
            for policy in [PolicyKind::None, PolicyKind::TraceReplay] {
                let run = sharded_run_cuda(&cfg, &opts(sharding, policy))
                    .unwrap_or_else(|e| panic!("{sharding} on {world} GPUs, {policy:?}: {e}"));
                if world <= 2 {
                    assert_eq!(
                        run.record, reference,
                        "{sharding} on {world} GPUs with {policy:?}: losses or final parameters differ"
                    );
                } else {
                    let (loss, param) = max_differences(&reference, &run.record);
                    assert!(
                        loss <= REORDERED_SUM_TOLERANCE && param <= REORDERED_SUM_TOLERANCE,
                        "{sharding} on {world} GPUs with {policy:?}: loss diff {loss}, param diff {param}"
                    );
                }
                assert!(
                    run.cost.iter().all(|c| c.all_gathers > 0 && c.reduce_scatters > 0),
                    "{:?}",
                    run.cost
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn hybrid_is_within_tolerance_on_gpus() {
    let n = gpus("hybrid_is_within_tolerance_on_gpus");
    let cases: Vec<(usize, u32)> =
        [(2, 1), (4, 2), (6, 3), (8, 4), (8, 2)].into_iter().filter(|&(world, _)| world <= n).collect();
    if cases.is_empty() {
        println!(
            "hybrid_is_within_tolerance_on_gpus: skipped: hybrid sharding needs at least 2 GPUs, found {n}"
        );
        return;
    }
    for (world, g) in cases {
        let cfg = small(world);
        let reference = reference_run(&cfg);
        let run = sharded_run_cuda(&cfg, &opts(Sharding::Hybrid(g), PolicyKind::TraceReplay))
            .unwrap_or_else(|e| panic!("hybrid:{g} on {world} GPUs: {e}"));
        let (loss, param) = max_differences(&reference, &run.record);
        assert!(
            loss <= REORDERED_SUM_TOLERANCE && param <= REORDERED_SUM_TOLERANCE,
            "hybrid:{g} on {world} GPUs: loss diff {loss}, param diff {param}"
        );
    }
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn more_ranks_than_gpus_is_a_clear_error() {
    gpus("more_ranks_than_gpus_is_a_clear_error");
    let world = device_count().expect("device count") + 1;
    let e = sharded_run_cuda(&small(world), &opts(Sharding::EvenSplit, PolicyKind::None)).unwrap_err();
    assert!(matches!(e, DemoError::Cuda(_)), "{e:?}");
    assert!(e.to_string().contains("no CUDA device"), "{e}");
}

#[test]
fn sharded_run_cuda_without_a_driver_is_a_clear_error() {
    if loader::driver().is_ok() {
        println!(
            "sharded_run_cuda_without_a_driver_is_a_clear_error: skipped: this machine has a CUDA driver"
        );
        return;
    }
    for (world, sharding) in [(1, Sharding::EvenSplit), (2, Sharding::Flat), (4, Sharding::Hybrid(2))] {
        let cfg = small(world);
        let result =
            std::panic::catch_unwind(|| sharded_run_cuda(&cfg, &opts(sharding, PolicyKind::TraceReplay)));
        let err = result
            .unwrap_or_else(|_| panic!("sharded_run_cuda on {world} ranks without a driver panicked"))
            .expect_err("sharded_run_cuda succeeded without a CUDA driver");
        assert!(matches!(err, DemoError::Cuda(_)), "{world} ranks, {sharding}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("no CUDA driver found"), "{world} ranks, {sharding}: {msg}");
        assert!(msg.contains("local backend"), "the error should say what to do instead: {msg}");
    }
    // The local world still runs the same configuration.
    let cfg = small(2);
    let run = collsched::demo::sharded_run(&cfg, &opts(Sharding::Flat, PolicyKind::TraceReplay))
        .expect("local run");
    assert_eq!(run.record, reference_run(&cfg));
}
