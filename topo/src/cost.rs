//! The collective cost model: how long a collective takes on a group of ranks.
//!
//! An alpha-beta model over two link levels of a [`Topology`]: inside a node (`intra`:
//! per-rank bus bandwidth `Bi`, step latency `ai`) and between nodes (`inter`: bus bandwidth of
//! one node's adapters together `Be`, step latency `ae`). For a group of `n` ranks over `m`
//! nodes with `L = ceil(n / m)` ranks per node and a buffer of `S` bytes:
//!
//! - a **flat** algorithm (ring, tree) crosses the slowest level it touches: on one node
//!   `B = Bi, a = ai`; across nodes `B = min(Bi, Be)` (every ring channel enters and leaves each
//!   node through its adapters, so the node's adapters carry the ring's bus bandwidth) and
//!   `a = max(ai, ae)`;
//! - **ring**: all-gather and reduce-scatter `(n-1) a + (n-1)/n S/B`; all-reduce (reduce-scatter
//!   then all-gather) `2(n-1) a + 2(n-1)/n S/B`; broadcast (pipelined chain) `(n-1) a + S/B`;
//! - **tree** (all-reduce and broadcast only, as in NCCL): `h = ceil(log2 m) ae + ceil(log2 L) ai`
//!   hops of latency; all-reduce (pipelined reduce up, broadcast down) `2h + 2 S/B`; broadcast
//!   `h + S/B`;
//! - **hierarchical** (intra-node then inter-node, rail by rail): all-gather and reduce-scatter
//!   `(L-1) ai + (L-1)/L S/Bi + (m-1) ae + (m-1)/m S/Be` (the inter-node step moves `S/L` per
//!   rail, each rail getting `Be/L`); all-reduce is intra reduce-scatter, inter all-reduce,
//!   intra all-gather: `2(L-1) ai + 2(L-1)/L S/Bi + 2(m-1) ae + 2(m-1)/m S/Be`; broadcast is an
//!   inter-node broadcast of each rail's slice then an intra-node all-gather:
//!   `(m-1) ae + S/Be + (L-1) ai + (L-1)/L S/Bi`.
//!
//! `S` is the size nccl-tests prints: the whole gathered buffer for all-gather, the whole input
//! for reduce-scatter, the buffer for all-reduce and broadcast. A group of one rank moves nothing.
//! On top of the algorithm time, every collective pays `launch_overhead_s` and every group call
//! `group_call_overhead_s` (a collective issued alone is a group call of one).
//!
//! Times are in **seconds** (f64); bandwidths in the [`Link`]s are GB/s (10^9 B/s), latencies
//! microseconds.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::constants as c;
use crate::{GroupShape, Link, Topology};

/// The collectives the model prices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Every rank contributes `S/n` bytes and receives all `S`.
    AllGather,
    /// Every rank contributes `S` bytes and receives its reduced `S/n`.
    ReduceScatter,
    /// Every rank contributes and receives `S` bytes, reduced.
    AllReduce,
    /// One rank's `S` bytes reach all.
    Broadcast,
}

impl CollectiveKind {
    /// Every kind.
    pub const ALL: [CollectiveKind; 4] = [
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllReduce,
        CollectiveKind::Broadcast,
    ];

    /// The name used in plans and on the command line (`all_gather`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Broadcast => "broadcast",
        }
    }

    /// Whether the collective reduces (reduce-scatter, all-reduce).
    pub const fn reduces(self) -> bool {
        matches!(self, CollectiveKind::ReduceScatter | CollectiveKind::AllReduce)
    }

    /// nccl-tests' factor from algorithm bandwidth to bus bandwidth on `n` ranks:
    /// `(n-1)/n` for all-gather and reduce-scatter, `2(n-1)/n` for all-reduce, 1 for broadcast.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => (n - 1.0) / n,
            CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
            CollectiveKind::Broadcast => 1.0,
        }
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CollectiveKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown collective `{s}`; use all_gather, reduce_scatter, all_reduce or broadcast")
        })
    }
}

/// How a collective is executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// One ring over all ranks.
    Ring,
    /// A binary tree over nodes, then over the ranks of each node (all-reduce, broadcast).
    Tree,
    /// Intra-node step(s) and an inter-node step per rail.
    Hierarchical,
}

impl Algorithm {
    /// Every algorithm, in the order ties are broken.
    pub const ALL: [Algorithm; 3] = [Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical];

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Hierarchical => "hierarchical",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The price of one collective: the algorithm the model picks and the time, overheads included.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// The fastest applicable algorithm.
    pub algorithm: Algorithm,
    /// Seconds, launch and group-call overheads included.
    pub seconds: f64,
}

/// Prices collectives on groups of ranks of one topology. See the module docs for the formulas.
///
/// # Examples
/// ```
/// use collsched_topo::{preset, CollectiveKind, CostModel};
/// let topo = preset("dgx-h100")?.with_nodes(2)?;
/// let cost = CostModel::for_topology(&topo);
/// // A group shape, or the whole world's shape.
/// let t = cost.time(CollectiveKind::AllGather, 1 << 30, topo.world());
/// assert!(t > 0.0 && t < 1.0);
/// let e = cost.estimate(CollectiveKind::AllReduce, 1 << 30, topo.world());
/// println!("{} takes {:.3} ms", e.algorithm, e.seconds * 1e3);
/// # Ok::<(), collsched_topo::TopoError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Links inside a node (per-rank bus bandwidth).
    pub intra: Link,
    /// Links between nodes (bus bandwidth of one node's adapters together).
    pub inter: Link,
    /// Seconds every collective pays to be launched. Default
    /// [`DEFAULT_LAUNCH_OVERHEAD_S`](crate::constants::DEFAULT_LAUNCH_OVERHEAD_S).
    pub launch_overhead_s: f64,
    /// Seconds every group call pays once. Default
    /// [`DEFAULT_GROUP_CALL_OVERHEAD_S`](crate::constants::DEFAULT_GROUP_CALL_OVERHEAD_S).
    pub group_call_overhead_s: f64,
}

impl CostModel {
    /// A model over two link levels, with the default overheads.
    pub fn new(intra: Link, inter: Link) -> Self {
        CostModel {
            intra,
            inter,
            launch_overhead_s: c::DEFAULT_LAUNCH_OVERHEAD_S,
            group_call_overhead_s: c::DEFAULT_GROUP_CALL_OVERHEAD_S,
        }
    }

    /// The model of a topology's links.
    pub fn for_topology(topology: &Topology) -> Self {
        Self::new(topology.intra_node, topology.inter_node)
    }

    /// The same model with another per-collective launch overhead (seconds).
    pub fn with_launch_overhead(mut self, seconds: f64) -> Self {
        self.launch_overhead_s = seconds;
        self
    }

    /// The same model with another per-group-call overhead (seconds).
    pub fn with_group_call_overhead(mut self, seconds: f64) -> Self {
        self.group_call_overhead_s = seconds;
        self
    }

    /// Time on the wire of `op` over `bytes` on `group` with `algorithm`, overheads excluded,
    /// in seconds; `None` when the algorithm does not implement the collective (tree
    /// all-gather and reduce-scatter).
    pub fn algorithm_time(
        &self,
        op: CollectiveKind,
        bytes: u64,
        group: impl Into<GroupShape>,
        algorithm: Algorithm,
    ) -> Option<f64> {
        let group = group.into();
        use Algorithm::*;
        use CollectiveKind::*;
        let n = group.ranks.max(1);
        if algorithm == Tree && matches!(op, AllGather | ReduceScatter) {
            return None;
        }
        if n == 1 {
            return Some(0.0);
        }
        let m = group.nodes.clamp(1, n);
        let l = group.ranks_per_node();
        let s = bytes as f64;
        let (bi, ai) = (self.intra.bytes_per_second(), self.intra.latency_seconds());
        let (be, ae) = (self.inter.bytes_per_second(), self.inter.latency_seconds());
        let (b, a) = if m == 1 { (bi, ai) } else { (bi.min(be), ai.max(ae)) };
        let nf = n as f64;
        let t = match algorithm {
            Ring => match op {
                AllGather | ReduceScatter => (nf - 1.0) * a + (nf - 1.0) / nf * s / b,
                AllReduce => 2.0 * (nf - 1.0) * a + 2.0 * (nf - 1.0) / nf * s / b,
                Broadcast => (nf - 1.0) * a + s / b,
            },
            Tree => {
                let hops = ceil_log2(m) * ae + ceil_log2(l) * ai;
                match op {
                    AllReduce => 2.0 * hops + 2.0 * s / b,
                    _ => hops + s / b,
                }
            }
            Hierarchical => {
                let (lf, mf) = (l as f64, m as f64);
                let intra = (lf - 1.0) * ai + (lf - 1.0) / lf * s / bi;
                let inter = (mf - 1.0) * ae + (mf - 1.0) / mf * s / be;
                match op {
                    AllGather | ReduceScatter => intra + inter,
                    AllReduce => 2.0 * intra + 2.0 * inter,
                    Broadcast => intra + (mf - 1.0) * ae + if m > 1 { s / be } else { 0.0 },
                }
            }
        };
        Some(t)
    }

    /// The fastest algorithm for `op` over `bytes` on `group`, and its time with one launch
    /// overhead and one group-call overhead.
    pub fn estimate(&self, op: CollectiveKind, bytes: u64, group: impl Into<GroupShape>) -> Estimate {
        let (algorithm, wire) = self.best(op, bytes, group.into());
        Estimate { algorithm, seconds: self.group_call_overhead_s + self.launch_overhead_s + wire }
    }

    /// Seconds `op` over `bytes` takes on `group`, issued alone: [`CostModel::estimate`]'s time.
    pub fn time(&self, op: CollectiveKind, bytes: u64, group: impl Into<GroupShape>) -> f64 {
        self.estimate(op, bytes, group).seconds
    }

    /// Seconds of one group call holding `ops` (`(kind, bytes, group)` each), executed one
    /// after another: one group-call overhead plus, per collective, a launch overhead and its
    /// fastest algorithm's time. An empty group call costs nothing.
    pub fn group_call_time(&self, ops: &[(CollectiveKind, u64, GroupShape)]) -> f64 {
        if ops.is_empty() {
            return 0.0;
        }
        self.group_call_overhead_s
            + ops.iter().map(|(k, b, g)| self.launch_overhead_s + self.best(*k, *b, *g).1).sum::<f64>()
    }

    /// nccl-tests' bus bandwidth in GB/s of `op` over `bytes` on `ranks` ranks that took
    /// `seconds`: `bytes / seconds * bus_factor / 1e9`.
    pub fn bus_bandwidth_gbs(op: CollectiveKind, bytes: u64, ranks: usize, seconds: f64) -> f64 {
        bytes as f64 / seconds * op.bus_factor(ranks) / 1e9
    }

    fn best(&self, op: CollectiveKind, bytes: u64, group: GroupShape) -> (Algorithm, f64) {
        let mut best = (Algorithm::Ring, f64::INFINITY);
        for alg in Algorithm::ALL {
            if let Some(t) = self.algorithm_time(op, bytes, group, alg) {
                if t < best.1 {
                    best = (alg, t);
                }
            }
        }
        best
    }
}

fn ceil_log2(x: usize) -> f64 {
    if x <= 1 {
        0.0
    } else {
        f64::from(usize::BITS - (x - 1).leading_zeros())
    }
}
