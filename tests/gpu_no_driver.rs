//! Choosing the CUDA backend on a machine without a CUDA driver is a clear error, not a panic.
//!
//! Where a driver exists this test has nothing to check and says so.
#![cfg(feature = "cuda")]

use collsched::backend::cuda::{device_count, CudaBackend, CudaConfig, CudaError, UniqueId};
use collsched_kernels::cuda::loader;

#[test]
fn cuda_backend_without_a_driver_is_a_clear_error() {
    if loader::driver().is_ok() {
        println!("cuda_backend_without_a_driver_is_a_clear_error: skipped: this machine has a CUDA driver");
        return;
    }
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

#[test]
fn launch_env_bootstrap_without_a_driver_fails_before_waiting() {
    if loader::driver().is_ok() {
        println!("launch_env_bootstrap_without_a_driver_fails_before_waiting: skipped: this machine has a CUDA driver");
        return;
    }
    // No torchrun variables here: the first error is about them, and it names the variable.
    if std::env::var_os("RANK").is_none() {
        let e = CudaBackend::from_launch_env(Vec::new()).unwrap_err();
        assert!(e.to_string().contains("RANK"), "{e}");
    }
}

#[test]
fn cuda_bench_without_a_driver_is_a_clear_error() {
    if loader::driver().is_ok() {
        println!("cuda_bench_without_a_driver_is_a_clear_error: skipped: this machine has a CUDA driver");
        return;
    }
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
