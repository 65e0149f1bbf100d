//! The simulator on a measured cost profile: collectives priced by its fits, a kind it lacks
//! refused up front, and the core-sharing terms (`compute_slowdown`, `compute_overlap`).

use collsched::sim::workload::{Architecture, Workload};
use collsched::sim::{simulate, Lane, Policy, SimConfig, SimError};
use collsched::topo::calibration::{CollectiveFit, LinearFit};
use collsched::topo::{preset, CollectiveKind, CostProfile};

#[path = "support/workloads.rs"]
mod workloads;
use workloads::small_config;

fn workload() -> Workload {
    small_config("small-gpt2", Architecture::Gpt2, 3, 256, false).workload().unwrap()
}

fn fit(kind: CollectiveKind, fixed_s: f64, per_byte_s: f64) -> CollectiveFit {
    CollectiveFit { kind, ranks: 2, fit: LinearFit { fixed_s, per_byte_s, points: Vec::new() } }
}

/// 1 ms per all-gather and 2 ms per reduce-scatter, whatever their size (1e-18 s per byte).
fn profile() -> CostProfile {
    let mut p = CostProfile::new("test", 2);
    p.collectives.push(fit(CollectiveKind::AllGather, 1e-3, 1e-18));
    p.collectives.push(fit(CollectiveKind::ReduceScatter, 2e-3, 1e-18));
    p
}

fn config(world: u32, policy: Policy, p: CostProfile) -> SimConfig {
    let mut c = SimConfig::with_topology(&preset("cpu-2socket").unwrap(), world, 1e-3).unwrap();
    c.ranks_per_node = world;
    c.policy = policy;
    c.bucket_bytes = 256 << 10;
    c.profile = Some(p);
    c
}

#[test]
fn collectives_cost_what_the_profile_says() {
    let r = simulate(&workload(), &config(2, Policy::Coalesced, profile())).unwrap();
    let last = r.reported().last().cloned().unwrap();
    let (ag, rs) = (r.comm_ms(Lane::AllGather), r.comm_ms(Lane::ReduceScatter));
    assert!(last.all_gathers > 0 && last.reduce_scatters > 0);
    assert!(
        (ag - last.all_gathers as f64 * 1.0).abs() < 1e-3,
        "{ag} ms for {} all-gathers",
        last.all_gathers
    );
    assert!(
        (rs - last.reduce_scatters as f64 * 2.0).abs() < 1e-3,
        "{rs} ms for {} reduce-scatters",
        last.reduce_scatters
    );
    // The profile's host time per collective is the default host overhead.
    let mut p = profile();
    p.host_per_collective_s = Some(1e-4);
    let c = config(2, Policy::Coalesced, p);
    assert_eq!(c.host_overhead(), 1e-4);
    let with_host = simulate(&workload(), &c).unwrap();
    assert!(with_host.host_ms() > 0.0 && with_host.step_ms() > r.step_ms());
}

#[test]
fn a_kind_the_profile_lacks_is_refused_naming_it() {
    let mut p = profile();
    p.collectives.retain(|c| c.kind == CollectiveKind::AllGather);
    let e = simulate(&workload(), &config(2, Policy::Trace, p)).unwrap_err();
    assert!(matches!(e, SimError::Config { knob: "cost", .. }), "{e}");
    assert!(e.to_string().contains("reduce_scatter") && e.to_string().contains("calibrate"), "{e}");
}

#[test]
fn compute_slowdown_multiplies_compute() {
    // One rank: no collectives, the step is its compute.
    let base = simulate(&workload(), &config(1, Policy::Trace, profile())).unwrap();
    let mut c = config(1, Policy::Trace, profile());
    c.compute_slowdown = Some(2.0);
    let slow = simulate(&workload(), &c).unwrap();
    assert!(
        (slow.compute_ms() - 2.0 * base.compute_ms()).abs() <= 1e-6 * base.compute_ms(),
        "{} vs {}",
        slow.compute_ms(),
        base.compute_ms()
    );
}

#[test]
fn collectives_that_cannot_overlap_compute_stretch_it() {
    let free = simulate(&workload(), &config(2, Policy::Trace, profile())).unwrap();
    let mut c = config(2, Policy::Trace, profile());
    c.compute_overlap = Some(0.0);
    let turns = simulate(&workload(), &c).unwrap();
    // Compute shared its cores with the prefetched collectives: longer compute, a longer step,
    // never more than compute plus every collective.
    assert!(turns.compute_ms() > free.compute_ms(), "{} vs {}", turns.compute_ms(), free.compute_ms());
    assert!(turns.step_ms() >= free.step_ms());
    let comm = free.comm_ms(Lane::AllGather) + free.comm_ms(Lane::ReduceScatter);
    assert!(turns.compute_ms() <= free.compute_ms() + comm + 1e-6);
    // Out of range: refused.
    for (slow, overlap) in [(0.5, 1.0), (1.0, 1.5), (f64::NAN, 1.0)] {
        let mut c = config(2, Policy::Trace, profile());
        c.compute_slowdown = Some(slow);
        c.compute_overlap = Some(overlap);
        assert!(matches!(simulate(&workload(), &c), Err(SimError::Config { .. })), "{slow} {overlap}");
    }
}
