//! collsched: coalesced all-gather and reduce-scatter plans for sharded data-parallel training
//! (ZeRO-3 / FSDP style), and the runtime that runs them on dedicated streams with prefetch
//! queues and in-flight parameter tracking.
//!
//! The pipeline is `ParamSpec -> Layout -> Plan -> Scheduler -> Action -> Backend`; see
//! `ARCHITECTURE.md` at the repository root.

#![warn(missing_docs)]

pub use collsched_buckets as buckets;
pub use collsched_kernels as kernels;
pub use collsched_schedule as schedule;
pub use collsched_topo as topo;

pub mod backend;
pub mod bench;
pub mod bootstrap;
pub mod calibrate;
pub mod checkpoint;
pub mod cli;
pub mod demo;
pub mod progress;
pub mod runtime;
pub mod sim;
pub mod units;

pub use runtime::{Coordinator, ModelState, RuntimeError, StepStats};
