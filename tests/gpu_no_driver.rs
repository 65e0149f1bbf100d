//! Choosing the CUDA backend on a machine without a CUDA driver is a clear error, not a panic:
//! building a backend, bootstrapping one from a launcher's variables, the bench, and the demo's
//! sharded run (the local world still runs the same configuration).
//!
//! These tests can only check something where no driver loads, so they are ignored unless
//! selected on purpose: `cargo nextest run --all-features --run-ignored only -E
//! 'test(/without_a_driver/)'` on a machine without a driver (see `tests/support/gpu.rs`).
//! Selected on a machine with a driver, they fail saying so.
#![cfg(feature = "cuda")]

use std::process::Command;

use collsched::backend::cuda::{device_count, CudaBackend, CudaConfig, CudaError, UniqueId};
use collsched::buckets::Sharding;
use collsched::demo::sharded::sharded_run_cuda;
use collsched::demo::DemoError;
use collsched::schedule::PolicyKind;

#[path = "support/demo.rs"]
mod demo;
#[path = "support/gpu.rs"]
mod gpu;
use demo::{opts, small};
#[path = "support/reference.rs"]
mod reference;

#[test]
#[ignore = "checks the error without a CUDA driver: --run-ignored only -E 'test(/without_a_driver/)' on a machine without one"]
fn cuda_backend_without_a_driver_is_a_clear_error() {
    gpu::no_driver("cuda_backend_without_a_driver_is_a_clear_error");
    let result = std::panic::catch_unwind(|| {
        CudaBackend::new(CudaConfig::new(0, 1, 0), &UniqueId([0; UniqueId::BYTES]))
    });
    let err = result.expect("building the CUDA backend without a driver panicked").unwrap_err();
    assert!(matches!(err, CudaError::Load(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("no CUDA driver found: tried libcuda.so.1"), "{msg}");
    assert!(msg.contains("local backend"), "the error should say what to do instead: {msg}");

    let e = device_count().unwrap_err();
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");

    // One process driving several GPUs fails the same way, before any thread waits.
    let e = collsched::backend::cuda::CudaWorld::new(2).unwrap_err();
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");

    // Through the Backend trait's error type, too.
    let be = err.into_backend(0);
    assert!(be.to_string().contains("no CUDA driver found"), "{be}");
}

/// Makes this test binary the child of
/// [`launch_env_bootstrap_without_a_driver_fails_before_waiting`]: `none` (no launcher
/// variables) or `torchrun` (rank 0 of 2).
const LAUNCH_CHILD: &str = "COLLSCHED_TEST_LAUNCH_CHILD";

/// The variables a launcher sets that `CudaBackend::from_launch_env` reads.
const LAUNCH_VARS: [&str; 10] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "COLLSCHED_RENDEZVOUS_FILE",
    "COLLSCHED_CUDA_TIMEOUT_SECS",
];

/// `CudaBackend::from_launch_env` in a child process whose launcher variables the test sets
/// (whatever this process's own are): without any, the error names `RANK`; as rank 0 of a job
/// of 2 whose other rank never comes, the missing driver is reported, not a wait for the peer
/// (a wait would end in the bootstrap's timeout, 2 s here, with another error).
#[test]
#[ignore = "checks the error without a CUDA driver: --run-ignored only -E 'test(/without_a_driver/)' on a machine without one"]
fn launch_env_bootstrap_without_a_driver_fails_before_waiting() {
    const NAME: &str = "launch_env_bootstrap_without_a_driver_fails_before_waiting";
    if let Ok(mode) = std::env::var(LAUNCH_CHILD) {
        let e = CudaBackend::from_launch_env(Vec::new()).expect_err("from_launch_env without a driver");
        let msg = e.to_string();
        match mode.as_str() {
            "none" => assert!(msg.contains("RANK") && msg.contains("not set"), "{msg}"),
            "torchrun" => assert!(msg.contains("no CUDA driver found"), "{msg}"),
            other => panic!("{LAUNCH_CHILD}={other}: expected none or torchrun"),
        }
        println!("\nchild {mode}: {msg}");
        return;
    }
    gpu::no_driver(NAME);
    let run_id = format!("gpu-no-driver-{}", std::process::id());
    let torchrun = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "0"),
        ("COLLSCHED_RUN_ID", run_id.as_str()),
        ("COLLSCHED_BOOTSTRAP_TIMEOUT_SECS", "2"),
    ];
    for (mode, vars) in [("none", &[][..]), ("torchrun", &torchrun[..])] {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"));
        child
            .args([NAME, "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
            .env(LAUNCH_CHILD, mode);
        for var in LAUNCH_VARS {
            child.env_remove(var);
        }
        let out = child.envs(vars.iter().copied()).output().expect("run this test binary as the child");
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{mode}:\n{text}");
        assert!(
            text.contains(&format!("child {mode}: ")),
            "{mode}: the child did not run the check:\n{text}"
        );
    }
}

#[test]
#[ignore = "checks the error without a CUDA driver: --run-ignored only -E 'test(/without_a_driver/)' on a machine without one"]
fn cuda_bench_without_a_driver_is_a_clear_error() {
    gpu::no_driver("cuda_bench_without_a_driver_is_a_clear_error");
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: collsched::cli::bench::BenchArgs,
    }
    let cli = Cli::try_parse_from([
        "bench",
        "--op",
        "all_gather",
        "--ranks",
        "2",
        "-b",
        "1K",
        "-e",
        "4K",
        "-f",
        "2",
        "--backend",
        "cuda",
    ])
    .expect("flags");
    let e = collsched::cli::bench::run(cli.args).unwrap_err();
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");
}

#[test]
#[ignore = "checks the error without a CUDA driver: --run-ignored only -E 'test(/without_a_driver/)' on a machine without one"]
fn sharded_run_cuda_without_a_driver_is_a_clear_error() {
    gpu::no_driver("sharded_run_cuda_without_a_driver_is_a_clear_error");
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
    // The local world runs the same configuration, bit for bit what the reference computes.
    let cfg = small(2);
    let run = collsched::demo::sharded_run(&cfg, &opts(Sharding::Flat, PolicyKind::TraceReplay))
        .expect("local run");
    reference::assert_matches(
        &run.record,
        &reference::reference(&cfg, Sharding::Flat),
        0.0,
        "flat on 2 ranks",
    );
}
