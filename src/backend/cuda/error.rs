//! The CUDA backend's error type.

use collsched_kernels::cuda::{CudaKernelError, DriverCallError, LoadError};
use collsched_kernels::KernelError;

use super::nccl::NcclError;
use super::park::Parked;
use super::rendezvous::RendezvousError;

/// Why the CUDA backend failed. Every variant says what was being done.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CudaError {
    /// A library (driver, NVRTC, NCCL) could not be loaded: `no CUDA driver found: ...`.
    #[error(transparent)]
    Load(Box<LoadError>),
    /// A CUDA driver call failed.
    #[error("{context}: {source}")]
    Driver {
        /// What the backend was doing (`rank 3: allocating 64 MiB`, ...).
        context: String,
        /// The driver's error.
        source: Box<DriverCallError>,
    },
    /// The kernels could not be compiled or loaded.
    #[error(transparent)]
    Kernels(Box<CudaKernelError>),
    /// A kernel's input was refused (same checks as the CPU kernels).
    #[error("{context}: {source}")]
    KernelInput {
        /// What the backend was doing.
        context: String,
        /// The refusal.
        source: Box<KernelError>,
    },
    /// An NCCL call failed.
    #[error(transparent)]
    Nccl(Box<NcclError>),
    /// The NCCL unique id could not be agreed on.
    #[error(transparent)]
    Bootstrap(Box<RendezvousError>),
    /// No such device.
    #[error("no CUDA device {ordinal}: the driver sees {count} device(s); choose an ordinal below {count} (CUDA_VISIBLE_DEVICES may hide some)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A request this backend refuses.
    #[error("{op}: {what}")]
    Invalid {
        /// The operation.
        op: String,
        /// What is wrong and what to do.
        what: String,
    },
    /// Errors that happened in `Drop`s since the last call, reported now.
    #[error(transparent)]
    Parked(#[from] Parked),
}

impl CudaError {
    /// A driver error with what the backend was doing.
    pub fn driver(context: impl Into<String>, source: DriverCallError) -> Self {
        CudaError::Driver { context: context.into(), source: Box::new(source) }
    }
}

impl From<LoadError> for CudaError {
    fn from(e: LoadError) -> Self {
        CudaError::Load(Box::new(e))
    }
}

impl From<CudaKernelError> for CudaError {
    fn from(e: CudaKernelError) -> Self {
        match e {
            CudaKernelError::Load(l) => CudaError::Load(Box::new(l)),
            e => CudaError::Kernels(Box::new(e)),
        }
    }
}

impl From<NcclError> for CudaError {
    fn from(e: NcclError) -> Self {
        match e {
            NcclError::Load(l) => CudaError::Load(l),
            e => CudaError::Nccl(Box::new(e)),
        }
    }
}

impl From<RendezvousError> for CudaError {
    fn from(e: RendezvousError) -> Self {
        CudaError::Bootstrap(Box::new(e))
    }
}
