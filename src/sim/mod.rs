//! The simulator's inputs: workloads (what a training step computes and fetches).
//!
//! The simulated backend itself (virtual clock, stream timelines priced by
//! `collsched_topo::CostModel`) builds on these.

pub mod workload;
