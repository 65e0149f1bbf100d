//! The simulator (`collsched sim`): the real [`Scheduler`](crate::schedule::Scheduler) of every
//! rank driven by a workload on a virtual clock, collectives priced by
//! [`CostModel`](crate::topo::CostModel).
//!
//! - [`workload`]: what a training step computes and fetches (transformer presets, JSON traces);
//! - [`config`]: the knobs ([`SimConfig`], [`Policy`]) and errors;
//! - `step`: the engine calls of a step;
//! - `program`: a workload compiled into a plan, the engine calls of a step and their prices;
//! - `colls`: each stream's collectives, their start and end, shared link or not;
//! - [`engine`]: the event loop that runs every rank's scheduler ([`simulate`]);
//! - [`report`]: what a run reports ([`SimReport`], per-step [`SimStepStats`], timelines);
//! - [`timeline`]: Chrome trace JSON and SVG pictures of a report;
//! - `zero3`: the `zero3-2021` policy's step (DeepSpeed ZeRO-3 before batching) and its costs.

pub mod against;
mod colls;
pub mod config;
pub mod engine;
mod program;
pub mod report;
mod step;
pub mod timeline;
pub mod workload;
mod zero3;

pub use config::{peak_tflops, Policy, SimConfig, SimError};
pub use engine::{simulate, Simulation};
pub use report::{Lane, SimReport, SimStepStats, Span, SpanKind, Timeline};
