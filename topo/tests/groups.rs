//! Rank groups partition the world the way their docs say.

use collsched_topo::{preset, GroupShape, TopoError, WorldShape};
use proptest::prelude::*;

fn is_partition(groups: &[Vec<usize>], n: usize) -> bool {
    let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
    all.sort_unstable();
    all == (0..n).collect::<Vec<_>>()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn groups_partition_the_world(nodes in 1usize..6, per in 1usize..9, g_pick in 0usize..8) {
        let w = WorldShape::new(nodes, per).unwrap();
        let n = w.world_size();
        let intra = w.intra_node_groups();
        prop_assert_eq!(intra.len(), nodes);
        prop_assert!(is_partition(&intra, n));
        for grp in &intra {
            prop_assert!(grp.iter().all(|&r| w.node_of(r) == w.node_of(grp[0])));
            prop_assert_eq!(w.shape_of(grp).unwrap(), GroupShape { ranks: per, nodes: 1 });
        }
        let inter = w.inter_node_groups();
        prop_assert_eq!(inter.len(), per);
        prop_assert!(is_partition(&inter, n));
        for grp in &inter {
            let mut seen: Vec<usize> = grp.iter().map(|&r| w.node_of(r)).collect();
            seen.dedup();
            prop_assert_eq!(seen.len(), nodes, "one rank per node");
            prop_assert!(grp.iter().all(|&r| r % per == grp[0] % per), "same local index");
        }
        let divisors: Vec<usize> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
        let g = divisors[g_pick % divisors.len()];
        let h = w.hybrid_shard_groups(g).unwrap();
        prop_assert!(is_partition(&h.shard, n));
        prop_assert!(is_partition(&h.replicate, n));
        prop_assert!(h.shard.iter().all(|s| s.len() == g));
        prop_assert!(h.replicate.iter().all(|r| r.len() == n / g));
        // Sharding within a node and replicating across nodes (HSDP's usual choice) gives the
        // intra-node groups as shard groups and the inter-node groups as replicate groups.
        let hsdp = w.hybrid_shard_groups(per).unwrap();
        prop_assert_eq!(&hsdp.shard, &intra);
        prop_assert_eq!(&hsdp.replicate, &inter);
        // Each replicate group meets each shard group exactly once.
        for r in &h.replicate {
            for s in &h.shard {
                prop_assert_eq!(r.iter().filter(|x| s.contains(x)).count(), 1);
            }
        }
    }
}

#[test]
fn bad_group_requests_are_clear_errors() {
    let w = preset("dgx-h100").unwrap().with_nodes(2).unwrap().world();
    assert_eq!(w.world_size(), 16);
    match w.hybrid_shard_groups(5) {
        Err(TopoError::Groups { message }) => {
            assert!(message.contains("5") && message.contains("16"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(w.hybrid_shard_groups(0).is_err());
    assert!(
        matches!(w.shape_of(&[0, 16]), Err(TopoError::Groups { message }) if message.contains("rank 16"))
    );
    assert!(matches!(w.shape_of(&[3, 3]), Err(TopoError::Groups { message }) if message.contains("twice")));
    assert!(GroupShape::new(2, 3).is_err());
    assert!(WorldShape::new(0, 8).is_err());
    // Groups across nodes count their nodes.
    assert_eq!(w.shape_of(&[0, 1, 8, 9]).unwrap(), GroupShape { ranks: 4, nodes: 2 });
}

#[test]
fn ranks_are_node_major() {
    let t = preset("p4d").unwrap().with_nodes(3).unwrap();
    for r in 0..t.world_size() {
        let loc = t.locate(r).unwrap();
        assert_eq!(loc.node * t.ranks_per_node() + loc.local, r);
    }
    assert!(t.locate(t.world_size()).is_none());
}
