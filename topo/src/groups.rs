//! Rank groups: which ranks take part in a collective together.
//!
//! Ranks are numbered node-major: rank `r` is on node `r / ranks_per_node`, local index
//! `r % ranks_per_node`.
//! - **intra-node** groups: the ranks of one node (one group per node);
//! - **inter-node** groups: the ranks with the same local index on every node (one group per
//!   local index) — the rails of a rail-optimised network;
//! - **hybrid shard** groups of size `g` (HSDP / ZeRO++ hpZ): consecutive blocks of `g` ranks
//!   shard the parameters, and the ranks at the same position of every block form a replicate
//!   group that all-reduces gradients.

use crate::TopoError;

/// The shape of the whole world: `nodes` nodes of `ranks_per_node` ranks each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorldShape {
    /// Nodes (>= 1).
    pub nodes: usize,
    /// Ranks per node (>= 1).
    pub ranks_per_node: usize,
}

/// The shape of one group, what the cost model needs to price a collective on it: how many
/// ranks, spread over how many nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupShape {
    /// Ranks in the group (>= 1).
    pub ranks: usize,
    /// Nodes the group spans (1..=ranks).
    pub nodes: usize,
}

impl GroupShape {
    /// A group of `ranks` ranks spread evenly over `nodes` nodes.
    ///
    /// # Errors
    /// [`TopoError::Groups`] when `ranks` is 0, `nodes` is 0 or `nodes > ranks`.
    pub fn new(ranks: usize, nodes: usize) -> Result<Self, TopoError> {
        if ranks == 0 || nodes == 0 || nodes > ranks {
            return Err(TopoError::Groups {
                message: format!(
                    "a group of {ranks} ranks over {nodes} nodes is impossible; need 1 <= nodes <= ranks"
                ),
            });
        }
        Ok(GroupShape { ranks, nodes })
    }

    /// Ranks of the group on its busiest node: `ceil(ranks / nodes)`.
    pub fn ranks_per_node(&self) -> usize {
        self.ranks.div_ceil(self.nodes.max(1))
    }
}

impl From<&GroupShape> for GroupShape {
    fn from(g: &GroupShape) -> Self {
        *g
    }
}

impl From<WorldShape> for GroupShape {
    /// The group of the whole world.
    fn from(w: WorldShape) -> Self {
        w.world_group()
    }
}

impl From<&WorldShape> for GroupShape {
    /// The group of the whole world.
    fn from(w: &WorldShape) -> Self {
        w.world_group()
    }
}

/// Hybrid sharding: shard groups and the replicate groups across them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridGroups {
    /// Consecutive blocks of `g` ranks: each shards the parameters among its members.
    pub shard: Vec<Vec<usize>>,
    /// Position `i` of every shard group: these all-reduce (replicate) gradients.
    pub replicate: Vec<Vec<usize>>,
}

impl WorldShape {
    /// A world of `nodes` x `ranks_per_node` ranks.
    ///
    /// # Errors
    /// [`TopoError::Groups`] when either is 0.
    pub fn new(nodes: usize, ranks_per_node: usize) -> Result<Self, TopoError> {
        if nodes == 0 || ranks_per_node == 0 {
            return Err(TopoError::Groups {
                message: format!(
                    "a world of {nodes} nodes x {ranks_per_node} ranks per node is empty; both must be >= 1"
                ),
            });
        }
        Ok(WorldShape { nodes, ranks_per_node })
    }

    /// All ranks.
    pub fn world_size(&self) -> usize {
        self.nodes * self.ranks_per_node
    }

    /// The node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node.max(1)
    }

    /// The shape of the group of all ranks.
    pub fn world_group(&self) -> GroupShape {
        GroupShape { ranks: self.world_size().max(1), nodes: self.nodes.max(1) }
    }

    /// One group per node: the ranks of that node.
    pub fn intra_node_groups(&self) -> Vec<Vec<usize>> {
        (0..self.nodes).map(|n| (n * self.ranks_per_node..(n + 1) * self.ranks_per_node).collect()).collect()
    }

    /// One group per local index: that index on every node.
    pub fn inter_node_groups(&self) -> Vec<Vec<usize>> {
        (0..self.ranks_per_node)
            .map(|l| (0..self.nodes).map(|n| n * self.ranks_per_node + l).collect())
            .collect()
    }

    /// Hybrid shard groups of size `g` and their replicate groups.
    ///
    /// # Errors
    /// [`TopoError::Groups`] when `g` is 0 or does not divide the world size.
    ///
    /// # Examples
    /// ```
    /// let w = collsched_topo::WorldShape::new(2, 4)?;
    /// let h = w.hybrid_shard_groups(4)?;
    /// assert_eq!(h.shard, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    /// assert_eq!(h.replicate[1], vec![1, 5]);
    /// # Ok::<(), collsched_topo::TopoError>(())
    /// ```
    pub fn hybrid_shard_groups(&self, g: usize) -> Result<HybridGroups, TopoError> {
        let n = self.world_size();
        if g == 0 || !n.is_multiple_of(g) {
            return Err(TopoError::Groups {
                message: format!(
                    "hybrid shard group size {g} does not divide the world of {n} ranks; pick a divisor of {n} (e.g. {})",
                    self.ranks_per_node
                ),
            });
        }
        let shard = (0..n / g).map(|b| (b * g..(b + 1) * g).collect()).collect();
        let replicate = (0..g).map(|i| (0..n / g).map(|b| b * g + i).collect()).collect();
        Ok(HybridGroups { shard, replicate })
    }

    /// The shape of an arbitrary group of ranks of this world.
    ///
    /// # Errors
    /// [`TopoError::Groups`] when the list is empty, repeats a rank, or names a rank past the
    /// world.
    pub fn shape_of(&self, ranks: &[usize]) -> Result<GroupShape, TopoError> {
        let n = self.world_size();
        let mut seen = vec![false; n];
        let mut nodes = std::collections::BTreeSet::new();
        for &r in ranks {
            if r >= n {
                return Err(TopoError::Groups {
                    message: format!("rank {r} is past the world of {n} ranks"),
                });
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(TopoError::Groups {
                    message: format!("rank {r} appears twice in the group {ranks:?}"),
                });
            }
            nodes.insert(self.node_of(r));
        }
        GroupShape::new(ranks.len(), nodes.len())
    }
}
