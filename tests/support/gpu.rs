//! Whether the GPU tests run here: shared by `tests/gpu_backend.rs` and `tests/gpu_demo.rs`.

use collsched::backend::cuda::device_count;

/// Number of GPUs a GPU test uses (the device count, at most `max`). GPU tests are ignored by
/// default (they show as skipped); run on purpose (`--run-ignored`), they need
/// `COLLSCHED_GPU=1` and a device, and fail without them.
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
