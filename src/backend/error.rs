//! What a backend reports when something fails.

use std::time::Duration;

use collsched_kernels::KernelError;

use super::{CollRef, Collective, InvalidGroup, Stream};

/// What a backend reports. Cloneable: one failure reaches every rank and event that depends on it.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum BackendError {
    /// A rank group that is not one.
    #[error(transparent)]
    InvalidGroup(#[from] InvalidGroup),
    /// A collective refused at launch (buffer sizes, membership, in-place rules); nothing ran.
    #[error("rank {rank}: {op}: {what}")]
    InvalidCollective {
        /// The launching rank.
        rank: usize,
        /// The collective.
        op: Box<CollRef>,
        /// What is wrong and what to do.
        what: String,
    },
    /// Some members did not arrive at a collective within the timeout.
    #[error(
        "rank {rank}: {op}: ranks {missing:?} did not arrive within {waited:?}; every rank of the group \
         must launch the same collectives in the same order on each stream (raise the timeout knob if \
         they are merely slow)"
    )]
    PeerTimeout {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<CollRef>,
        /// Members that had not posted.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// Some members left (panicked, dropped their handle, or failed) before arriving.
    #[error("rank {rank}: {op}: ranks {missing:?} will never arrive: {reason}")]
    PeerFailed {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<CollRef>,
        /// Members that had not posted.
        missing: Vec<usize>,
        /// Why they will not (panicked, handle dropped, an earlier error).
        reason: String,
    },
    /// Members posted different collectives at the same sequence number; nothing was executed.
    #[error("rank {rank}: {op}: mismatched collectives: {detail}; every rank must issue the same plan")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The collective this rank posted.
        op: Box<CollRef>,
        /// Who posted what.
        detail: String,
    },
    /// Not executed because an earlier failure on the same (group, stream) or stream poisoned it.
    #[error("rank {rank}: {}not run because of an earlier failure: {cause}", op_prefix(op.as_deref()))]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The collective (or `None` for non-collective stream work).
        op: Option<Box<CollRef>>,
        /// The first failure.
        cause: Box<BackendError>,
    },
    /// Another member failed while writing part of this rank's output (the local backend
    /// shares a reduction's work between the members' threads), so that output is incomplete.
    #[error("rank {rank}: {op}: rank {peer} failed while computing part of this rank's output, which is incomplete: {cause}")]
    PeerKernel {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<CollRef>,
        /// The member that failed.
        peer: usize,
        /// Its error.
        cause: Box<BackendError>,
    },
    /// A kernel (reduction, copy) refused its arguments.
    #[error("rank {rank}: {op}: {source}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// The collective.
        op: Box<CollRef>,
        /// The kernel's error.
        source: KernelError,
    },
    /// A host wait on an event ran out of time; the event is still pending.
    #[error("event not complete after waiting {waited:?}")]
    EventTimeout {
        /// How long the caller waited.
        waited: Duration,
    },
    /// A stream waited on an event longer than the backend's timeout.
    #[error("rank {rank}: stream {stream} waited {waited:?} for an event that never completed")]
    StreamWaitTimeout {
        /// The rank.
        rank: usize,
        /// The waiting stream.
        stream: Stream,
        /// How long it waited.
        waited: Duration,
    },
    /// Host buffer access out of range.
    #[error("rank {rank}: {what}")]
    OutOfRange {
        /// The rank.
        rank: usize,
        /// Which access, and the sizes involved.
        what: String,
    },
    /// Memory could not be allocated.
    #[error("rank {rank}: cannot allocate {bytes} bytes: {what}")]
    OutOfMemory {
        /// The rank.
        rank: usize,
        /// Bytes requested.
        bytes: usize,
        /// Detail from the allocator.
        what: String,
    },
    /// The backend (or this rank of it) was shut down.
    #[error("rank {rank}: backend is shut down: {what}")]
    Shutdown {
        /// The rank.
        rank: usize,
        /// Detail.
        what: String,
    },
    /// A device or library call failed (CUDA, NCCL): which API, and what it said.
    #[error("rank {rank}: {api} failed: {detail}")]
    Device {
        /// The rank.
        rank: usize,
        /// The failing API (`cuStreamWaitEvent`, `ncclGroupEnd`, ...).
        api: &'static str,
        /// The library's error code and message.
        detail: String,
    },
    /// The processes of a multi-process backend could not meet.
    #[error(transparent)]
    Bootstrap(#[from] crate::bootstrap::BootstrapError),
    /// A launch this backend refuses before anything runs (an empty group launch, ...).
    #[error("rank {rank}: {what}")]
    InvalidLaunch {
        /// The rank.
        rank: usize,
        /// What is wrong and what to do.
        what: String,
    },
    /// A broken invariant of the backend itself, or a kernel or host function that panicked: a
    /// bug in collsched (report it with the message), not in the caller's input.
    #[error("internal error (a bug in collsched; please report it): {what}")]
    Internal {
        /// What broke, with the rank and op where known.
        what: String,
    },
    /// Not supported by this backend or build.
    #[error("{what}")]
    Unsupported {
        /// What, and what to use instead.
        what: String,
    },
}

impl BackendError {
    /// The variant's name (`"PeerTimeout"`, `"Kernel"`, ...), for records and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::InvalidGroup(_) => "InvalidGroup",
            BackendError::InvalidCollective { .. } => "InvalidCollective",
            BackendError::PeerTimeout { .. } => "PeerTimeout",
            BackendError::PeerFailed { .. } => "PeerFailed",
            BackendError::Mismatch { .. } => "Mismatch",
            BackendError::Aborted { .. } => "Aborted",
            BackendError::PeerKernel { .. } => "PeerKernel",
            BackendError::Kernel { .. } => "Kernel",
            BackendError::EventTimeout { .. } => "EventTimeout",
            BackendError::StreamWaitTimeout { .. } => "StreamWaitTimeout",
            BackendError::OutOfRange { .. } => "OutOfRange",
            BackendError::OutOfMemory { .. } => "OutOfMemory",
            BackendError::Shutdown { .. } => "Shutdown",
            BackendError::Device { .. } => "Device",
            BackendError::Bootstrap(_) => "Bootstrap",
            BackendError::InvalidLaunch { .. } => "InvalidLaunch",
            BackendError::Internal { .. } => "Internal",
            BackendError::Unsupported { .. } => "Unsupported",
        }
    }

    /// Whether this rank failed because of another's failure or absence (a peer that died,
    /// was late, failed in a shared kernel, or an earlier failure on the channel), rather than
    /// on its own.
    pub fn is_peers(&self) -> bool {
        matches!(
            self,
            BackendError::PeerTimeout { .. }
                | BackendError::PeerFailed { .. }
                | BackendError::PeerKernel { .. }
                | BackendError::Aborted { .. }
        )
    }
}

fn op_prefix(op: Option<&CollRef>) -> String {
    op.map_or(String::new(), |op| format!("{op}: "))
}

/// A launch that was refused: the error, and the collectives with their buffers, untouched.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct LaunchError<Buf> {
    /// Why.
    pub error: BackendError,
    /// The collectives given to the launch, with their buffers.
    pub ops: Vec<Collective<Buf>>,
}
