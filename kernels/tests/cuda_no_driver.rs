//! Loading the kernels on a machine without a CUDA driver is an error that says so, not a panic.
#![cfg(feature = "cuda")]

use collsched_kernels::cuda::{loader, CudaKernelError, KernelModule};

#[test]
#[ignore = "checks the error without a CUDA driver: --run-ignored only -E 'test(/without_a_driver/)' on a machine without one (ci/test.sh)"]
fn loading_kernels_without_a_driver_is_a_clear_error() {
    if let Ok(driver) = loader::driver() {
        panic!(
            "loading_kernels_without_a_driver_is_a_clear_error: this machine has a CUDA driver ({}); \
             run the no-driver tests where there is none",
            driver.opened_as
        );
    }
    let r = std::panic::catch_unwind(|| KernelModule::load(80).map(|_| ()));
    let e = r.expect("KernelModule::load panicked without a driver").unwrap_err();
    assert!(matches!(e, CudaKernelError::Load(_)), "{e:?}");
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");
}
