//! Whether the GPU tests run here: shared by `tests/gpu_backend.rs` and `tests/gpu_demo.rs`.

use collsched::backend::cuda::device_count;

/// Number of GPUs a GPU test uses (the device count, at most `max`), or `None` after printing
/// why `test` skipped: `COLLSCHED_GPU=1` not set, no device, or no driver.
pub fn gpus(test: &str, max: usize) -> Option<usize> {
    if std::env::var("COLLSCHED_GPU").as_deref() != Ok("1") {
        println!("{test}: skipped: COLLSCHED_GPU=1 is not set (GPU tests not run)");
        return None;
    }
    match device_count() {
        Ok(0) => {
            println!("{test}: skipped: COLLSCHED_GPU=1 but the driver sees no CUDA device");
            None
        }
        Ok(n) => Some(n.min(max)),
        Err(e) => {
            println!("{test}: skipped: COLLSCHED_GPU=1 but {e}");
            None
        }
    }
}
