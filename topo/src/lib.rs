//! Machine topology, rank groups and the collective cost model: *where* things move.
//!
//! - [`Topology`]: a cluster of identical nodes (CPUs, NUMA nodes, GPUs with PCI placement,
//!   NICs) and two link levels (inside a node, between nodes), each with a bandwidth and a
//!   latency. Get one from a built-in machine ([`preset`]), hwloc XML ([`from_hwloc_xml`],
//!   [`load_hwloc_xml_file`]), an hwloc synthetic description ([`from_synthetic`]), the
//!   project's own JSON ([`Topology::from_json`], written by [`Topology::to_json`]), or the live
//!   machine (`discover`, feature `hwloc`).
//! - Rank groups ([`WorldShape`]): intra-node, inter-node (one per local index), hybrid shard
//!   groups of size `g`.
//! - [`CostModel`]: seconds a collective takes on a [`GroupShape`], for ring, tree and
//!   hierarchical algorithms, plus launch and group-call overheads.
//! - [`CostProfile`] ([`calibration`]): per-collective costs measured on a machine
//!   (`collsched calibrate`), from a checked least-squares fit ([`calibration::fit_linear`]).
//!
//! Units: bandwidth in GB/s (10^9 B/s), latency in microseconds, memory in bytes, times in
//! seconds. Every constant is in [`constants`], with its source.
//!
//! ```
//! use collsched_topo::{preset, CollectiveKind, CostModel};
//! let topo = preset("p4d")?.with_nodes(2)?;
//! let cost = CostModel::for_topology(&topo);
//! let world = topo.world();
//! let node = collsched_topo::GroupShape::new(world.ranks_per_node, 1)?;
//! // A gather inside one node is faster than the same gather across both nodes.
//! let bytes = 256 << 20;
//! assert!(cost.time(CollectiveKind::AllGather, bytes, &node) < cost.time(CollectiveKind::AllGather, bytes, &world.world_group()));
//! # Ok::<(), collsched_topo::TopoError>(())
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod calibration;
pub mod constants;
mod cost;
#[cfg(feature = "hwloc")]
mod discover;
mod error;
mod fixtures;
mod groups;
mod model;
mod synthetic;
mod xml;

pub use calibration::{CalibrationError, CostProfile};
pub use cost::{Algorithm, CollectiveKind, CostModel, Estimate};
#[cfg(feature = "hwloc")]
pub use discover::discover;
pub use error::TopoError;
pub use fixtures::{preset, PRESETS};
pub use groups::{GroupShape, HybridGroups, WorldShape};
pub use model::{
    Gpu, Link, LinkClass, Machine, Nic, NumaNode, PciAddress, RankLocation, Topology, JSON_FORMAT,
    JSON_VERSION, PCI_VENDOR_AMAZON, PCI_VENDOR_NVIDIA,
};
pub use synthetic::{from_synthetic, MAX_SYNTHETIC_PUS};
pub use xml::{from_hwloc_xml, load_hwloc_xml_file};

/// Resolves what a user names a machine by: a built-in preset name ([`PRESETS`]), a path to an
/// hwloc XML file (ending in `.xml`), or a path to the project's JSON (anything else).
///
/// # Errors
/// [`TopoError::UnknownPreset`] when `spec` is neither a preset nor an existing file; otherwise
/// the loader's error.
///
/// # Examples
/// ```
/// assert_eq!(collsched_topo::resolve("p4d")?.ranks_per_node(), 8);
/// # Ok::<(), collsched_topo::TopoError>(())
/// ```
pub fn resolve(spec: &str) -> Result<Topology, TopoError> {
    if PRESETS.contains(&spec) {
        return preset(spec);
    }
    let path = std::path::Path::new(spec);
    if !path.exists() {
        return preset(spec);
    }
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("xml")) {
        load_hwloc_xml_file(path)
    } else {
        Topology::load_json_file(path)
    }
}
