//! The `zero3-2021` policy (DeepSpeed ZeRO-3 before batching): one all-gather per gathered
//! parameter at every fetch (a recomputed layer fetched again), none launched ahead, every
//! collective run alone, the host-device syncs of the 2021 code counted one by one, one
//! reduce-scatter per gradient, and a step longer than the library's.

use collsched::sim::workload::{Architecture, Workload};
use collsched::sim::{simulate, Policy, SimConfig, SimReport, Span, SpanKind};
use collsched::topo::constants::{ZERO3_2021_PERSISTENCE_THRESHOLD, ZERO3_2021_REDUCE_BUCKET_ELEMENTS};
use collsched::topo::preset;

#[path = "support/workloads.rs"]
mod workloads;
use workloads::small_config;

/// A small RoBERTa: its weights are above the persistence threshold, its biases and norms
/// (and the position table) below it.
fn roberta(layers: u32, checkpointing: bool) -> Workload {
    small_config(&format!("roberta-{layers}x384"), Architecture::Roberta, layers, 384, checkpointing)
        .workload()
        .unwrap()
}

fn run(w: &Workload, policy: Policy, timeline: bool) -> SimReport {
    let mut c = SimConfig::for_topology(&preset("p4d").unwrap(), 16).unwrap();
    c.policy = policy;
    c.timeline = timeline;
    simulate(w, &c).unwrap_or_else(|e| panic!("{} {policy}: {e}", w.name))
}

fn numel(w: &Workload, name: &str) -> u64 {
    w.params.iter().find(|p| p.name == name).unwrap().numel()
}

/// The gathered (non-persistent) parameters of a layer.
fn gathered<'a>(w: &'a Workload, layer: &str) -> Vec<&'a String> {
    let l = w.layer(layer).unwrap();
    l.params.iter().filter(|p| numel(w, p) >= ZERO3_2021_PERSISTENCE_THRESHOLD).collect()
}

/// Layer fetches of a step: forward once, backward once, and once more for the recompute.
fn fetches(w: &Workload) -> Vec<&str> {
    let mut f: Vec<&str> = w.forward_order.iter().map(String::as_str).collect();
    for name in &w.backward_order {
        if w.layer(name).unwrap().recompute_flops > 0.0 {
            f.push(name);
        }
        f.push(name);
    }
    f
}

fn overlaps(a: &Span, b: &Span) -> bool {
    a.start_ns < b.start_ns + b.dur_ns && b.start_ns < a.start_ns + a.dur_ns
}

#[test]
fn one_all_gather_per_gathered_parameter_and_fetch_and_one_reduce_scatter_per_gradient() {
    for checkpointing in [true, false] {
        let w = roberta(3, checkpointing);
        // Some parameters are persistent, some gathered: the count below tells them apart.
        let persistent = w.params.iter().filter(|p| p.numel() < ZERO3_2021_PERSISTENCE_THRESHOLD).count();
        assert!(persistent > 0 && persistent < w.params.len());
        let expected: u64 = fetches(&w).iter().map(|l| gathered(&w, l).len() as u64).sum();
        let trainable = w.params.iter().filter(|p| p.trainable).count() as u64;
        let r = run(&w, Policy::Zero3_2021, false);
        assert_eq!(r.gather_buckets, w.params.len(), "one bucket per parameter");
        for (k, s) in r.steps.iter().enumerate() {
            assert_eq!(s.all_gathers, expected, "checkpointing {checkpointing}, step {k}");
            assert_eq!(s.reduce_scatters, trainable, "step {k}");
            assert_eq!((s.prefetch_launches, s.prefetch_hits), (0, 0), "step {k}");
        }
    }
}

#[test]
fn no_all_gather_runs_ahead_or_beside_anything() {
    let w = roberta(3, true);
    let r = run(&w, Policy::Zero3_2021, true);
    let tl = r.timeline.as_ref().unwrap();
    let [gathers, reduces] = &tl.collectives;
    assert!(!gathers.is_empty() && !reduces.is_empty());
    assert!(gathers.iter().all(|g| !g.prefetch), "an all-gather was launched ahead");
    // Each launch waited for every collective before it: no two collectives run at once.
    let mut all: Vec<&Span> = gathers.iter().chain(reduces).filter(|s| s.dur_ns > 0).collect();
    all.sort_by_key(|s| s.start_ns);
    for pair in all.windows(2) {
        assert!(!overlaps(pair[0], pair[1]), "{:?} and {:?} overlap", pair[0], pair[1]);
    }
    // An all-gather is launched by its layer's fetch, after the compute before it, and the
    // compute after it waits for it: none runs beside any rank's compute.
    let beside = |r: &SimReport| {
        let tl = r.timeline.as_ref().unwrap();
        let mut n = 0;
        for spans in &tl.compute {
            let compute = spans
                .iter()
                .filter(|s| matches!(s.kind, SpanKind::Forward | SpanKind::Recompute | SpanKind::Backward));
            for c in compute {
                n += tl.collectives[0].iter().filter(|g| g.dur_ns > 0 && overlaps(g, c)).count();
            }
        }
        n
    };
    assert_eq!(beside(&r), 0, "an all-gather ran beside compute");
    // The same check on trace replay, whose prefetches do run beside compute.
    assert!(beside(&run(&w, Policy::Trace, true)) > 0);
}

#[test]
fn the_syncs_of_the_2021_code_are_counted_one_by_one() {
    let w = roberta(2, true);
    let total: u64 = w.params.iter().map(|p| p.numel()).sum();
    assert!(total < ZERO3_2021_REDUCE_BUCKET_ELEMENTS, "no bucket flush before the epilogue");
    let r = run(&w, Policy::Zero3_2021, false);
    let f = fetches(&w);
    let gathers: u64 = f.iter().map(|l| gathered(&w, l).len() as u64).sum();
    // Before each all-gather (B2); two in the drain of each fetch that gathers (B7); one
    // `.item()` per parameter of each fetched layer (B6); one per released parameter (B9);
    // three in the epilogue (its flush and stream sync, B13); two per parameter in the
    // optimizer step (B16).
    let drains: u64 = f.iter().filter(|l| !gathered(&w, l).is_empty()).count() as u64 * 2;
    let norms: u64 = f.iter().map(|l| w.layer(l).unwrap().params.len() as u64).sum();
    let releases = gathers;
    let optimizer = 2 * w.params.iter().filter(|p| p.trainable).count() as u64;
    let expected = gathers + drains + norms + releases + 3 + optimizer;
    for (k, s) in r.steps.iter().enumerate() {
        assert_eq!(s.host_syncs, expected, "step {k}");
    }
    assert!(r.host_ms() > 0.0);
    for p in Policy::LIBRARY {
        let lib = run(&w, p, false);
        assert!(lib.steps.iter().all(|s| s.host_syncs == 0), "{p} makes no host syncs");
    }
}

#[test]
fn a_step_takes_longer_than_the_librarys() {
    for w in [roberta(3, true), roberta(2, false)] {
        let z = run(&w, Policy::Zero3_2021, false);
        for p in [Policy::Trace, Policy::Coalesced] {
            let lib = run(&w, p, false);
            assert!(
                z.step_ms() > lib.step_ms(),
                "{}: zero3-2021 {} ms, {p} {} ms",
                w.name,
                z.step_ms(),
                lib.step_ms()
            );
            assert_eq!(z.compute_ms(), lib.compute_ms(), "{}: same compute", w.name);
            assert!(z.exposed_comm_ms() > lib.exposed_comm_ms(), "{} {p}", w.name);
        }
    }
}

#[test]
fn the_policy_has_its_name() {
    assert_eq!("zero3-2021".parse::<Policy>().unwrap(), Policy::Zero3_2021);
    assert_eq!(Policy::Zero3_2021.to_string(), "zero3-2021");
    assert!(Policy::ALL.contains(&Policy::Zero3_2021) && !Policy::LIBRARY.contains(&Policy::Zero3_2021));
    let e = "zero3".parse::<Policy>().unwrap_err().to_string();
    assert!(e.contains("zero3-2021"), "{e}");
}
