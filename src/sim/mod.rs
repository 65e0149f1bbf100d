//! The simulator (`collsched sim`): the real [`Scheduler`](crate::schedule::Scheduler) of every
//! rank driven by a workload on a virtual clock, collectives priced by
//! [`CostModel`](crate::topo::CostModel).
//!
//! - [`workload`]: what a training step computes and fetches (transformer presets, JSON traces);
//! - [`engine`]: the simulated backend and its action executor ([`engine::simulate`]);
//! - [`timeline`]: Chrome trace JSON and SVG pictures of a run.

pub mod engine;
pub mod timeline;
pub mod workload;

pub use engine::{simulate, Policy, SimConfig, SimError, SimReport, Simulation};
