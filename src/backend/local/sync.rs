//! The synchronisation the local backend's protocols are made of, in one place, so that loom can
//! model-check them: built with `RUSTFLAGS="--cfg loom"`, the atomics, mutexes and condition
//! variables of events (`event.rs`), stream queues (`stream.rs`), meeting slots
//! (`rendezvous.rs`) and the pool's deferred frees (`buffer.rs`) are loom's, and the loom tests
//! (`loom_tests.rs`, `ci/loom.sh`) explore their interleavings. Otherwise they are the standard
//! library's, unchanged.
//!
//! `Arc` stays the standard library's in both builds: it is a container here (of channels, slot
//! data and events), and loom's cannot hold a `dyn` value. Clocks stay real: under loom a timed
//! wait is an untimed one, so a lost wake-up shows up as a deadlock loom reports.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

/// Whether waits may spin before they sleep. Under loom a spin loop on an atomic is a branch
/// per iteration and exhausts the model; waits go straight to the condition variable there.
pub(crate) const SPIN: bool = !cfg!(loom);
