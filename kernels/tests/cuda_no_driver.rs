//! Loading the kernels on a machine without a CUDA driver is an error that says so, not a panic.
#![cfg(feature = "cuda")]

use collsched_kernels::cuda::{loader, CudaKernelError, KernelModule};

#[test]
fn loading_kernels_without_a_driver_is_a_clear_error() {
    if loader::driver().is_ok() {
        println!(
            "loading_kernels_without_a_driver_is_a_clear_error: skipped: this machine has a CUDA driver"
        );
        return;
    }
    let r = std::panic::catch_unwind(|| KernelModule::load(80).map(|_| ()));
    let e = r.expect("KernelModule::load panicked without a driver").unwrap_err();
    assert!(matches!(e, CudaKernelError::Load(_)), "{e:?}");
    assert!(e.to_string().starts_with("no CUDA driver found"), "{e}");
}
