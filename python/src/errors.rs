//! Python exceptions for the library's errors: every message is the library's own (rank,
//! parameter, bucket, op, and what to do).

use collsched::backend::BackendError;
use collsched::schedule::ScheduleError;
use collsched::RuntimeError;
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::PyErr;

create_exception!(
    collsched,
    CollschedError,
    PyRuntimeError,
    "An error of collsched; the message names the rank, parameter, bucket and op."
);
create_exception!(
    collsched,
    PeerError,
    CollschedError,
    "Another rank failed, died or did not answer in time; the message names it."
);
create_exception!(
    collsched,
    MismatchError,
    CollschedError,
    "Ranks disagree: different plans, or different collectives at the same point."
);

/// A runtime error as the matching exception.
pub fn runtime(e: RuntimeError) -> PyErr {
    let msg = e.to_string();
    match &e {
        RuntimeError::Backend { source, .. } => backend_class(source, msg),
        RuntimeError::Schedule(ScheduleError::PlanMismatch { .. }) => MismatchError::new_err(msg),
        _ => CollschedError::new_err(msg),
    }
}

/// A checkpoint error as the matching exception (a runtime error inside as its own class).
pub fn checkpoint(e: collsched::checkpoint::CheckpointError) -> PyErr {
    match e {
        collsched::checkpoint::CheckpointError::Runtime(r) => runtime(r),
        e @ collsched::checkpoint::CheckpointError::Peers { .. } => PeerError::new_err(e.to_string()),
        other => CollschedError::new_err(other.to_string()),
    }
}

/// A backend error as the matching exception.
pub fn backend(e: BackendError) -> PyErr {
    let msg = e.to_string();
    backend_class(&e, msg)
}

fn backend_class(e: &BackendError, msg: String) -> PyErr {
    match e {
        BackendError::PeerTimeout { .. }
        | BackendError::PeerFailed { .. }
        | BackendError::Aborted { .. }
        | BackendError::PeerKernel { .. }
        | BackendError::Bootstrap(_) => PeerError::new_err(msg),
        BackendError::Mismatch { .. } => MismatchError::new_err(msg),
        _ => CollschedError::new_err(msg),
    }
}

/// Any other error of ours, as the base class.
pub fn other(e: impl std::fmt::Display) -> PyErr {
    CollschedError::new_err(e.to_string())
}
