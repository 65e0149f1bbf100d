//! The cost model: monotone in size and world, equal to the closed forms on a two-link toy
//! machine, and close to published nccl-tests bus bandwidths on the fixture machines.

use collsched_topo::constants as c;
use collsched_topo::{
    preset, Algorithm, CollectiveKind, CostModel, GroupShape, Link, LinkClass, Topology, PRESETS,
};

const OPS: [CollectiveKind; 4] = CollectiveKind::ALL;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-30)
}

#[test]
fn time_is_monotone_in_size() {
    for name in PRESETS {
        for nodes in [1usize, 2, 4] {
            let t = preset(name).unwrap().with_nodes(nodes as u32).unwrap();
            let cost = CostModel::for_topology(&t);
            let g = t.world().world_group();
            for op in OPS {
                let mut prev = 0.0;
                let mut prev_alg = [0.0f64; 3];
                for shift in 0..36 {
                    let bytes = 1u64 << shift;
                    let now = cost.time(op, bytes, g);
                    assert!(now >= prev, "{name} x{nodes} {op}: {bytes} B takes {now} < {prev}");
                    prev = now;
                    for (i, alg) in Algorithm::ALL.into_iter().enumerate() {
                        if let Some(a) = cost.algorithm_time(op, bytes, g, alg) {
                            assert!(a >= prev_alg[i], "{name} {op} {alg}");
                            prev_alg[i] = a;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn time_is_monotone_in_world() {
    let bytes = 64 << 20;
    for name in PRESETS {
        let t = preset(name).unwrap();
        let cost = CostModel::for_topology(&t);
        let per = t.ranks_per_node();
        // Growing inside one node, then node by node (full nodes).
        let mut shapes: Vec<GroupShape> = (1..=per).map(|r| GroupShape::new(r, 1).unwrap()).collect();
        shapes.extend((2..=16).map(|m| GroupShape::new(m * per, m).unwrap()));
        for op in OPS {
            let times: Vec<f64> = shapes.iter().map(|g| cost.time(op, bytes, g)).collect();
            for (w, pair) in times.windows(2).enumerate() {
                assert!(
                    pair[1] >= pair[0],
                    "{name} {op}: {:?} -> {:?}: {} < {}",
                    shapes[w],
                    shapes[w + 1],
                    pair[1],
                    pair[0]
                );
            }
        }
    }
}

/// The two-link toy machine: 100 GB/s, 1 us inside a node; 10 GB/s, 10 us between nodes.
fn toy() -> CostModel {
    CostModel::new(
        Link { class: LinkClass::NvLink, bandwidth_gbs: 100.0, latency_us: 1.0 },
        Link { class: LinkClass::InfiniBand, bandwidth_gbs: 10.0, latency_us: 10.0 },
    )
    .with_launch_overhead(5e-6)
    .with_group_call_overhead(3e-6)
}

#[test]
fn closed_forms_on_a_two_link_toy_machine() {
    use Algorithm::*;
    use CollectiveKind::*;
    let cost = toy();
    let s = 1e6; // bytes
    let (bi, ai, be, ae) = (100e9, 1e-6, 10e9, 10e-6);
    // 4 ranks on 2 nodes, 2 per node: flat algorithms run at the network's speed and latency.
    let g = GroupShape::new(4, 2).unwrap();
    let want = [
        (AllGather, Ring, Some(3.0 * ae + 0.75 * s / be)),
        (ReduceScatter, Ring, Some(3.0 * ae + 0.75 * s / be)),
        (AllReduce, Ring, Some(6.0 * ae + 1.5 * s / be)),
        (Broadcast, Ring, Some(3.0 * ae + s / be)),
        (AllGather, Tree, None),
        (ReduceScatter, Tree, None),
        // ceil(log2 2) = 1 hop between nodes, ceil(log2 2) = 1 inside.
        (AllReduce, Tree, Some(2.0 * (ae + ai) + 2.0 * s / be)),
        (Broadcast, Tree, Some(ae + ai + s / be)),
        (AllGather, Hierarchical, Some(ai + 0.5 * s / bi + ae + 0.5 * s / be)),
        (ReduceScatter, Hierarchical, Some(ai + 0.5 * s / bi + ae + 0.5 * s / be)),
        (AllReduce, Hierarchical, Some(2.0 * (ai + 0.5 * s / bi) + 2.0 * (ae + 0.5 * s / be))),
        (Broadcast, Hierarchical, Some(ae + s / be + ai + 0.5 * s / bi)),
    ];
    for (op, alg, expect) in want {
        let got = cost.algorithm_time(op, s as u64, g, alg);
        match (got, expect) {
            (Some(a), Some(b)) => assert!(close(a, b), "{op} {alg}: {a} != {b}"),
            (None, None) => {}
            _ => panic!("{op} {alg}: {got:?} vs {expect:?}"),
        }
    }
    // The estimate is the fastest applicable algorithm plus one launch and one group call.
    for op in OPS {
        let best = Algorithm::ALL
            .into_iter()
            .filter_map(|a| cost.algorithm_time(op, s as u64, g, a).map(|t| (a, t)))
            .min_by(|x, y| x.1.total_cmp(&y.1))
            .unwrap();
        let e = cost.estimate(op, s as u64, g);
        assert_eq!(e.algorithm, best.0, "{op}");
        assert!(close(e.seconds, best.1 + 5e-6 + 3e-6), "{op}");
        assert!(close(cost.time(op, s as u64, g), e.seconds));
    }
    // One node: the intra link alone.
    let node = GroupShape::new(2, 1).unwrap();
    assert!(close(cost.algorithm_time(AllGather, s as u64, node, Ring).unwrap(), ai + 0.5 * s / bi));
    // One rank moves nothing.
    let one = GroupShape::new(1, 1).unwrap();
    for op in OPS {
        assert_eq!(cost.algorithm_time(op, s as u64, one, Ring), Some(0.0));
    }
    // A group call pays one group overhead and one launch per collective.
    let ops = [(AllGather, 1_000_000u64, g), (ReduceScatter, 2_000_000u64, g)];
    let wire: f64 = ops.iter().map(|(k, b, gr)| cost.estimate(*k, *b, gr).seconds - 8e-6).sum();
    assert!(close(cost.group_call_time(&ops), 3e-6 + 2.0 * 5e-6 + wire));
    assert_eq!(cost.group_call_time(&[]), 0.0);
    // Coalescing two collectives into one group call saves one group overhead.
    let apart = cost.time(AllGather, 1_000_000, g) + cost.time(ReduceScatter, 2_000_000, g);
    assert!(close(apart - cost.group_call_time(&ops), 3e-6));
}

/// A published nccl-tests bus bandwidth and where it comes from.
struct Published {
    machine: Topology,
    op: CollectiveKind,
    bytes: u64,
    busbw_gbs: f64,
    source: &'static str,
}

#[test]
fn published_bus_bandwidths() {
    // An 8 x A100 + 4 x HDR 200 Gb/s cluster (nccl-tests #119) is the p4d with InfiniBand.
    let mut hdr = preset("p4d").unwrap().with_nodes(3).unwrap();
    hdr.inter_node = Link {
        class: LinkClass::InfiniBand,
        bandwidth_gbs: 4.0 * c::IB_HDR_NIC_GBS,
        latency_us: c::IB_LATENCY_US,
    };
    let table = [
        Published {
            machine: preset("dgx-h100").unwrap(),
            op: CollectiveKind::AllGather,
            bytes: 8 << 30,
            busbw_gbs: 370.0,
            source: "nccl-tests #212: effective NVLink busbw ~370 GB/s for non-allreduce ops on 8 H100",
        },
        Published {
            machine: preset("dgx-h100").unwrap().with_nodes(2).unwrap(),
            op: CollectiveKind::AllReduce,
            bytes: 8 << 30,
            busbw_gbs: 8.0 * 47.0,
            source: "nccl-tests #290: 46-48 GB/s per NDR NIC, 8 NICs per node, ring over 2 nodes",
        },
        Published {
            machine: preset("p4d").unwrap(),
            op: CollectiveKind::AllReduce,
            bytes: 1 << 30,
            busbw_gbs: 230.77,
            source: "nccl #527: 1 p4dn node, 1 GiB all_reduce busbw 230.77 GB/s",
        },
        Published {
            machine: preset("p4d").unwrap().with_nodes(2).unwrap(),
            op: CollectiveKind::AllReduce,
            bytes: 1 << 30,
            busbw_gbs: 57.17,
            source: "nccl #527: 2 p4dn nodes, 1 GiB all_reduce busbw 57.17 GB/s",
        },
        Published {
            machine: hdr,
            op: CollectiveKind::AllReduce,
            bytes: 128 << 20,
            busbw_gbs: 96.0,
            source: "nccl-tests #119: 3 nodes of 8 A100 + 4 HDR, peak busbw about 96 GB/s",
        },
    ];
    const TOLERANCE: f64 = 0.15;
    for p in table {
        let cost = CostModel::for_topology(&p.machine);
        let g = p.machine.world().world_group();
        let t = cost.time(p.op, p.bytes, g);
        let model = CostModel::bus_bandwidth_gbs(p.op, p.bytes, g.ranks, t);
        let rel = (model - p.busbw_gbs) / p.busbw_gbs;
        assert!(
            rel.abs() <= TOLERANCE,
            "{}: model busbw {model:.1} GB/s vs published {:.1} ({:+.0}%)",
            p.source,
            p.busbw_gbs,
            rel * 100.0
        );
    }
}

#[test]
fn names_parse_back() {
    for op in OPS {
        assert_eq!(op.name().parse::<CollectiveKind>(), Ok(op));
    }
    assert!("all-gather".parse::<CollectiveKind>().unwrap_err().contains("all_gather"));
}

mod random_links {
    use super::*;
    use proptest::prelude::*;

    fn link(class: LinkClass) -> impl Strategy<Value = Link> {
        (0.1f64..1000.0, 0.0f64..50.0).prop_map(move |(bandwidth_gbs, latency_us)| Link {
            class,
            bandwidth_gbs,
            latency_us,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// On any two-level machine, every collective takes longer with more bytes, more ranks
        /// per node, or more nodes.
        #[test]
        fn monotone_for_any_links(intra in link(LinkClass::NvLink), inter in link(LinkClass::InfiniBand),
                                  per in 1usize..9, nodes in 1usize..9, shift in 0u32..34) {
            let cost = CostModel::new(intra, inter);
            let bytes = 1u64 << shift;
            let g = GroupShape::new(per * nodes, nodes).unwrap();
            for op in OPS {
                let t = cost.time(op, bytes, g);
                prop_assert!(t.is_finite() && t > 0.0);
                prop_assert!(cost.time(op, bytes * 2, g) >= t, "{} bytes", op);
                prop_assert!(cost.time(op, bytes, GroupShape::new((per + 1) * nodes, nodes).unwrap()) >= t, "{} ranks", op);
                prop_assert!(cost.time(op, bytes, GroupShape::new(per * (nodes + 1), nodes + 1).unwrap()) >= t, "{} nodes", op);
            }
        }
    }
}
