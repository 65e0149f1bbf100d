//! Backends: where the scheduler's actions run (`local` threads, the `sim` clock, `cuda`).

#[cfg(feature = "cuda")]
pub mod cuda;
