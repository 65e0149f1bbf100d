//! Whether the GPU tests, and the tests of the missing driver, run here: shared by the GPU
//! tests (`tests/gpu_backend.rs`, `tests/gpu_demo.rs`, `tests/gpu_fences.rs`,
//! `tests/runtime_reduce_device.rs`, `tests/runtime_device.rs`) and the no-driver ones
//! (`tests/gpu_no_driver.rs`, `tests/cli_demo.rs`), included with `#[path]`.
//!
//! Both kinds can only check something on some machines, so both are `#[ignore]`d with the
//! reason and run when selected on purpose (nextest and libtest report them as skipped
//! otherwise, never as passed):
//! - GPU tests: `COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only` on a
//!   machine with a GPU (`gpu/run.sh` runs the packed binaries with `--ignored`);
//! - no-driver tests (their names hold `without_a_driver`): `cargo nextest run --all-features
//!   --run-ignored only -E 'test(/without_a_driver/)'` on a machine without a CUDA driver.
//!
//! Selected where they cannot check anything, they fail saying so.
#![allow(dead_code)]

use collsched::backend::cuda::device_count;
use collsched_kernels::cuda::loader;

/// Number of GPUs a GPU test uses (the device count, at most `max`).
///
/// # Panics
/// Without `COLLSCHED_GPU=1`, a driver or a device: the test fails, naming what is missing.
pub fn gpus(test: &str, max: usize) -> usize {
    assert!(
        std::env::var("COLLSCHED_GPU").as_deref() == Ok("1"),
        "{test}: a GPU test run without COLLSCHED_GPU=1; set it on a machine with a GPU"
    );
    match device_count() {
        Ok(0) => panic!("{test}: COLLSCHED_GPU=1 but the driver sees no CUDA device"),
        Ok(n) => n.min(max),
        Err(e) => panic!("{test}: COLLSCHED_GPU=1 but {e}"),
    }
}

/// Checks that this machine has no CUDA driver, which a no-driver test needs.
///
/// # Panics
/// Where the driver loads: the test was selected on a machine where it cannot check the
/// error, and fails naming the driver it found.
pub fn no_driver(test: &str) {
    if let Ok(driver) = loader::driver() {
        panic!(
            "{test}: checks the error without a CUDA driver, but this machine has one ({}); \
             run the no-driver tests on a machine without a driver",
            driver.opened_as
        );
    }
}
