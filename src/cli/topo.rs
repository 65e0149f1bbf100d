//! `collsched topo`: prints the machine as the library sees it.
//!
//! `collsched topo [--xml FILE | --synthetic DESC | --preset NAME] [--nodes N] [--json]`: the
//! summary (nodes, NUMA nodes, GPUs with PCI ids and NUMA node, NICs, link levels, rank groups,
//! and the cost model's time, algorithm and bus bandwidth for a 1 GiB collective on one node and
//! on the world) or the topology JSON. Without a source it discovers this machine (feature
//! `hwloc`) or says how to give one.

use std::path::PathBuf;
use std::process::ExitCode;

use collsched_topo::Topology;

use super::CliError;

/// Flags of `collsched topo`.
///
/// Exactly one source at most: `--xml`, `--synthetic` or `--preset`; with none, the live machine
/// is discovered through hwloc (builds with feature `hwloc`).
#[derive(Debug, clap::Args)]
pub struct TopoArgs {
    /// Load an hwloc XML export (`lstopo --of xml`).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["synthetic", "preset"])]
    pub xml: Option<PathBuf>,
    /// Build from an hwloc synthetic description, e.g. "pack:2 numa:1 core:8 pu:2".
    #[arg(long, value_name = "DESC", conflicts_with = "preset")]
    pub synthetic: Option<String>,
    /// A built-in machine: dgx-h100, p4d, pcie-8gpu, cpu-2socket.
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
    /// Number of identical nodes.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nodes: u32,
    /// Print the project's topology JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// Runs `collsched topo`.
///
/// # Errors
/// Any failure to get or check the topology, as one line for the user.
pub fn run(args: TopoArgs) -> Result<ExitCode, CliError> {
    let topo = source(&args)?.with_nodes(args.nodes)?;
    if args.json {
        println!("{}", topo.to_json());
    } else {
        println!("{topo}");
        print_costs(&topo);
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes of the example collectives the summary prices.
const SUMMARY_BYTES: u64 = 1 << 30;

/// What the cost model says about a 1 GiB collective on one node and on the whole world.
fn print_costs(topo: &Topology) {
    use collsched_topo::{CollectiveKind, CostModel, GroupShape};
    let cost = CostModel::for_topology(topo);
    let world = topo.world().world_group();
    let node = GroupShape { ranks: topo.ranks_per_node(), nodes: 1 };
    println!("  cost model, {} MiB (time, algorithm, bus bandwidth):", SUMMARY_BYTES >> 20);
    for op in CollectiveKind::ALL {
        let mut line = format!("    {:<15}", op.name());
        let groups: &[(&str, GroupShape)] =
            if topo.nodes > 1 { &[("node", node), ("world", world)] } else { &[("node", node)] };
        for (label, g) in groups {
            let e = cost.estimate(op, SUMMARY_BYTES, *g);
            let busbw = CostModel::bus_bandwidth_gbs(op, SUMMARY_BYTES, g.ranks, e.seconds);
            line.push_str(&format!(
                " {label} ({} ranks): {:>9.3} ms {:<12} {:>7.1} GB/s",
                g.ranks,
                e.seconds * 1e3,
                e.algorithm.name(),
                busbw
            ));
        }
        println!("{line}");
    }
}

fn source(args: &TopoArgs) -> Result<Topology, CliError> {
    if let Some(path) = &args.xml {
        return Ok(collsched_topo::load_hwloc_xml_file(path)?);
    }
    if let Some(desc) = &args.synthetic {
        return Ok(collsched_topo::from_synthetic(desc)?);
    }
    if let Some(name) = &args.preset {
        return Ok(collsched_topo::preset(name)?);
    }
    discover()
}

#[cfg(feature = "hwloc")]
fn discover() -> Result<Topology, CliError> {
    Ok(collsched_topo::discover()?)
}

#[cfg(not(feature = "hwloc"))]
fn discover() -> Result<Topology, CliError> {
    Err("no machine given: pass --xml FILE, --synthetic DESC or --preset NAME \
         (discovering this machine needs a build with feature `hwloc`)"
        .into())
}
