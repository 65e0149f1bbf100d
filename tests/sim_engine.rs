//! The simulator: exact compute time without communication, no exposed communication on an
//! infinitely fast network, prefetch never worse than no prefetch, determinism with jitter,
//! collective counts that match the plan.

use collsched::buckets::{Boundary, DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
use collsched::sim::workload::{Architecture, Layer, ParamRecord, Workload};
use collsched::sim::{simulate, Policy, SimConfig, SimReport};
use collsched::topo::{preset, CostModel, Link, LinkClass};

#[path = "support/workloads.rs"]
mod workloads;
use workloads::small_config;

/// A small transformer of the given architecture.
fn small(arch: Architecture, layers: u32, hidden: u64, checkpointing: bool) -> Workload {
    small_config(&format!("small-{arch:?}-{layers}x{hidden}"), arch, layers, hidden, checkpointing)
        .workload()
        .unwrap()
}

fn workloads() -> Vec<Workload> {
    vec![
        small(Architecture::Gpt2, 3, 256, true),
        small(Architecture::Llama, 4, 512, false),
        small(Architecture::Roberta, 2, 384, true),
    ]
}

fn config(topo: &str, world: u32, policy: Policy) -> SimConfig {
    let mut c = SimConfig::for_topology(&preset(topo).unwrap(), world).unwrap();
    c.policy = policy;
    // Small buckets so the small models have several.
    c.bucket_bytes = 256 << 10;
    c
}

fn run(w: &Workload, c: &SimConfig) -> SimReport {
    simulate(w, c).unwrap_or_else(|e| panic!("{} on {} ranks, {}: {e}", w.name, c.world, c.policy))
}

#[test]
fn one_rank_takes_exactly_its_compute_time() {
    for (k, mut w) in workloads().into_iter().enumerate() {
        // The step's compute outside the layers counts too, and the engine's hooks' host time
        // (none in the first workload).
        w.loss_flops = 1.5e9 * k as f64;
        w.update_flops = 2.5e9 * k as f64;
        w.hook_s = 3.3e-6 * k as f64;
        for policy in Policy::LIBRARY {
            let mut c = config("dgx-h100", 1, policy);
            c.host_overhead_s = Some(0.0);
            let r = run(&w, &c);
            // Reference: every compute op of a step, rounded to ns like the simulator's clock.
            let ns = |f: f64| (f / (c.tflops * 1e12) * 1e9).round() as u64;
            let per_step: u64 = w
                .layers
                .iter()
                .map(|l| ns(l.forward_flops) + ns(l.recompute_flops) + ns(l.backward_flops))
                .sum::<u64>()
                + ns(w.loss_flops)
                + ns(w.update_flops);
            // A quarter of a layer's hook time at each of its two fetches and two releases.
            let hooks = 4 * w.layers.len() as u64 * (w.hook_s * 1e9 / 4.0).round() as u64;
            for s in &r.steps {
                assert_eq!(s.step_ns, per_step + hooks, "{} {policy}", w.name);
                assert_eq!(s.compute_ns, per_step as f64);
                assert_eq!(s.host_ns, hooks as f64);
                assert_eq!(s.exposed_ns, 0.0);
                assert_eq!(s.comm_ns, [0, 0], "a group of one rank moves nothing");
            }
            let exact = (w.executed_flops() / (c.tflops * 1e12) + w.hook_s * w.layers.len() as f64) * 1e3;
            assert!(
                (r.step_ms() - exact).abs() < 1e-5 * w.layers.len() as f64 * 3.0,
                "{} vs {exact}",
                r.step_ms()
            );
        }
    }
}

#[test]
fn infinite_bandwidth_and_zero_latency_expose_nothing() {
    let inf = |class| Link { class, bandwidth_gbs: f64::INFINITY, latency_us: 0.0 };
    let cost = CostModel::new(inf(LinkClass::NvLink), inf(LinkClass::InfiniBand))
        .with_launch_overhead(0.0)
        .with_group_call_overhead(0.0);
    for w in workloads() {
        for policy in Policy::LIBRARY {
            for (world, rpn) in [(2, 2), (16, 8)] {
                let mut c = SimConfig::new(world, rpn, cost, 100.0);
                c.policy = policy;
                c.bucket_bytes = 256 << 10;
                let r = run(&w, &c);
                for s in &r.steps {
                    assert_eq!(s.exposed_ns, 0.0, "{} {policy} world {world}", w.name);
                    assert_eq!(s.comm_ns, [0, 0]);
                    assert_eq!(s.step_ns as f64, s.compute_ns + s.host_ns);
                }
            }
        }
    }
}

#[test]
fn prefetch_never_exposes_more_than_no_prefetch() {
    for w in workloads() {
        for (topo, world) in [("dgx-h100", 8), ("p4d", 16), ("pcie-8gpu", 4)] {
            for (prefetch_bytes, max_inflight) in [(256 << 20, 4), (512 << 10, 2), (1 << 30, 16)] {
                let mut base = config(topo, world, Policy::Coalesced);
                base.prefetch_bytes = prefetch_bytes;
                base.max_inflight = max_inflight;
                let none = run(&w, &base);
                let trace = run(&w, &SimConfig { policy: Policy::Trace, ..base.clone() });
                let what =
                    format!("{} on {world} x {topo}, budget {prefetch_bytes} / {max_inflight}", w.name);
                assert!(none.exposed_comm_ms() > 0.0, "{what}: the case must expose something");
                assert!(
                    trace.exposed_comm_ms() <= none.exposed_comm_ms(),
                    "{what}: trace {} > none {}",
                    trace.exposed_comm_ms(),
                    none.exposed_comm_ms()
                );
                assert!(trace.step_ms() <= none.step_ms(), "{what}");
                // The first step records the trace and is the no-prefetch step.
                assert_eq!(trace.steps[0].exposed_ns, none.steps[0].exposed_ns, "{what}");
            }
        }
    }
}

#[test]
fn deterministic_for_a_seed_with_jitter() {
    let w = small(Architecture::Gpt2, 3, 256, true);
    let mut c = config("p4d", 16, Policy::Trace);
    c.jitter = 0.2;
    c.seed = 7;
    c.timeline = true;
    let a = run(&w, &c);
    let b = run(&w, &c);
    assert_eq!(a, b);
    let other = run(&w, &SimConfig { seed: 8, ..c.clone() });
    assert_ne!(a.steps, other.steps, "another seed gives other times");
    let calm = run(&w, &SimConfig { jitter: 0.0, ..c.clone() });
    assert!(a.steps.iter().zip(&calm.steps).all(|(j, q)| j.step_ns >= q.step_ns), "jitter only slows down");
    // Without jitter every rank computes the same: the mean equals each rank's sum.
    let tl = calm.timeline.as_ref().unwrap();
    let busy: Vec<u64> = tl
        .compute
        .iter()
        .map(|s| s.iter().filter(|s| s.kind != collsched::sim::SpanKind::Wait).map(|s| s.dur_ns).sum())
        .collect();
    assert!(busy.windows(2).all(|p| p[0] == p[1]));
}

/// Gathers a step issues when every layer releases before the next fetch: per layer (forward
/// then backward), one per distinct bucket of its parameters.
fn expected_gathers(w: &Workload, bucket_of: &dyn Fn(&str) -> u32) -> u64 {
    let mut n = 0;
    for name in w.forward_order.iter().chain(&w.backward_order) {
        let layer = w.layer(name).unwrap();
        let mut seen: Vec<u32> = layer.params.iter().map(|p| bucket_of(p)).collect();
        seen.sort_unstable();
        seen.dedup();
        n += seen.len() as u64;
    }
    n
}

#[test]
fn collective_counts_match_the_plan() {
    let mut w = small(Architecture::Gpt2, 3, 256, true);
    // Freeze two parameters: they take no gradient bucket.
    for p in w.params.iter_mut().filter(|p| p.name.starts_with("block.1.attn.qkv")) {
        p.trainable = false;
    }
    let trainable = w.params.iter().filter(|p| p.trainable).count() as u64;
    let mut by_boundary = Vec::new();
    // 256 KiB: most weights have a bucket of their own; 2 MiB: a block (1.6 MB) fits.
    let runs = [256 << 10, 2 << 20]
        .into_iter()
        .flat_map(|cap| Policy::LIBRARY.into_iter().map(move |p| (cap, p)))
        .flat_map(|(cap, p)| [(cap, p, Boundary::Size), (cap, p, Boundary::LAYER)]);
    for (cap, policy, boundary) in runs {
        let mut c = config("dgx-h100", 8, policy);
        c.bucket_bytes = cap;
        c.boundary = boundary;
        let r = run(&w, &c);
        // The reference layout: parameters in forward order, the simulator's bucket cap (naive:
        // one parameter per bucket).
        let specs: Vec<ParamSpec> = w
            .params
            .iter()
            .map(|p| {
                let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
                ParamSpec::new(p.name.clone(), shape, DType::BF16).trainable(p.trainable)
            })
            .collect();
        let set = ParamSet::new(specs).unwrap();
        let mut order = Vec::new();
        for name in &w.forward_order {
            for p in &w.layer(name).unwrap().params {
                let id = set.id(p).unwrap();
                if !order.contains(&id) {
                    order.push(id);
                }
            }
        }
        let (cap, boundary) =
            if policy == Policy::Naive { (1, Boundary::Size) } else { (c.bucket_bytes, boundary) };
        let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 8)
            .bucket_bytes(cap)
            .boundary(boundary)
            .order(order)
            .build()
            .unwrap();
        assert_eq!(r.boundary, boundary);
        let bucket_of = |name: &str| {
            let id = set.id(name).unwrap();
            layout.gather_buckets().iter().position(|b| b.params().contains(&id)).unwrap() as u32
        };
        let gathers = expected_gathers(&w, &bucket_of);
        let grads = layout.grad_buckets().len() as u64;
        if policy == Policy::Naive {
            assert_eq!(grads, trainable, "naive: one reduce-scatter per gradient");
            let per_layer: u64 = w
                .forward_order
                .iter()
                .chain(&w.backward_order)
                .map(|n| w.layer(n).unwrap().params.len() as u64)
                .sum();
            assert_eq!(gathers, per_layer, "naive: one all-gather per parameter fetch");
        }
        assert_eq!(r.gather_buckets, layout.gather_buckets().len());
        // The reference counts a release-before-next-fetch order. With blocks that straddle
        // buckets (size bucketing at 2 MiB), prefetching a bucket that the current layer still
        // holds changes how often it is gathered, so only the other cases are exact. (The
        // tied embedding's bucket ends both `embed` and `head`; `explicit`'s rules fire once
        // per step, so "after `embed`, prefetch block 0" does not fire again at `head`.)
        let exact = cap == 256 << 10 || boundary != Boundary::Size;
        for (k, s) in r.steps.iter().enumerate() {
            if exact {
                assert_eq!(s.all_gathers, gathers, "{policy} {boundary} step {k}");
            }
            assert_eq!(s.reduce_scatters, grads, "{policy} {boundary} step {k}");
        }
        if boundary != Boundary::Size {
            // No bucket holds parameters of two layers (the tied embedding is listed by two
            // layers but sits in one bucket of its first layer).
            for b in layout.gather_buckets() {
                let first = |p: &str| {
                    w.forward_order.iter().find(|l| w.layer(l).unwrap().params.iter().any(|q| q == p))
                };
                let layers: Vec<_> = b.params().iter().map(|&p| first(set.name(p))).collect();
                assert!(
                    layers.windows(2).all(|x| x[0] == x[1]),
                    "{policy}: bucket {} spans {layers:?}",
                    b.id()
                );
            }
        }
        by_boundary.push((cap, policy, r.steps.last().unwrap().all_gathers));
    }
    // Module boundaries never need more all-gathers than size bucketing (one per bucket per
    // layer, and no bucket is shared by two layers); with blocks that fit the cap, fewer.
    for pair in by_boundary.chunks(2) {
        let [(cap, p, size), (_, _, module)] = pair else { unreachable!() };
        assert!(module <= size, "{p} at {cap} B: {module} > {size}");
        if *p != Policy::Naive && *cap == 2 << 20 {
            assert!(module < size, "{p}: {module} == {size}");
        }
    }
}

#[test]
fn peak_memory_holds_the_largest_layer_and_naive_pays_host_time() {
    let w = small(Architecture::Llama, 4, 512, false);
    let c = config("dgx-h100", 8, Policy::Coalesced);
    let r = run(&w, &c);
    let largest = w
        .layers
        .iter()
        .map(|l| {
            l.params.iter().map(|p| w.params.iter().find(|q| &q.name == p).unwrap().numel() * 2).sum::<u64>()
        })
        .max()
        .unwrap();
    assert!(r.peak_gathered_bytes >= largest, "{} < {largest}", r.peak_gathered_bytes);
    let nc = config("dgx-h100", 8, Policy::Naive);
    let naive = run(&w, &nc);
    let launches = naive.reported()[0].all_gathers + naive.reported()[0].reduce_scatters;
    let host = nc.host_overhead();
    assert_eq!(host, collsched::sim::config::NAIVE_HOST_OVERHEAD_S);
    assert!(
        (naive.host_ms() - launches as f64 * host * 1e3).abs() < 1e-6,
        "{} vs {launches}",
        naive.host_ms()
    );
    assert!(naive.step_ms() > r.step_ms());
}

#[test]
fn a_hand_written_trace_runs() {
    // Two layers sharing nothing, one frozen parameter, backward not the reverse of forward.
    let rec = |name: &str, n: u64, trainable| ParamRecord {
        name: name.into(),
        shape: vec![n],
        dtype: "f32".into(),
        trainable,
        module: None,
    };
    let layer = |name: &str, params: &[&str], f: f64| Layer {
        name: name.into(),
        params: params.iter().map(|s| s.to_string()).collect(),
        forward_flops: f,
        backward_flops: 2.0 * f,
        recompute_flops: 0.0,
        keep: false,
    };
    let w = Workload::in_layer_order(
        "hand",
        vec![rec("a", 1 << 20, true), rec("b", 1 << 18, false), rec("c", 1 << 20, true)],
        vec![layer("l0", &["a", "b"], 1e12), layer("l1", &["c"], 2e12)],
    );
    assert_eq!(
        (w.forward_order.clone(), w.backward_order.clone()),
        (vec!["l0".into(), "l1".into()], vec!["l1".into(), "l0".into()])
    );
    let c = config("p4d", 8, Policy::Trace);
    let r = run(&w, &c);
    assert_eq!(r.reported()[0].reduce_scatters, 2, "one per gradient bucket, the frozen `b` in none");
    assert!(r.step_ms() * 1e-3 >= w.executed_flops() / (c.tflops * 1e12) * (1.0 - 1e-9));
}

#[test]
fn the_timeline_adds_up_to_the_summary() {
    let mut w = small(Architecture::Roberta, 2, 384, true);
    w.loss_flops = 1e9;
    w.update_flops = 4e9;
    let mut c = config("p4d", 16, Policy::Explicit);
    c.timeline = true;
    c.jitter = 0.1;
    c.seed = 3;
    c.steps = 2;
    let r = run(&w, &c);
    let tl = r.timeline.as_ref().unwrap();
    use collsched::sim::SpanKind;
    for (s, stats) in r.steps.iter().enumerate() {
        let mean = |kinds: &[SpanKind]| {
            let total: u64 = tl
                .compute
                .iter()
                .flat_map(|spans| spans.iter())
                .filter(|x| x.step as usize == s && kinds.contains(&x.kind))
                .map(|x| x.dur_ns)
                .sum();
            total as f64 / f64::from(r.world)
        };
        assert!((mean(&[SpanKind::Wait]) - stats.exposed_ns).abs() < 1e-6, "step {s}");
        let compute = mean(&[
            SpanKind::Forward,
            SpanKind::Recompute,
            SpanKind::Backward,
            SpanKind::Loss,
            SpanKind::Update,
        ]);
        assert!((compute - stats.compute_ns).abs() < 1e-6, "step {s}");
        for (lane, list) in tl.collectives.iter().enumerate() {
            let busy: u64 = list.iter().filter(|x| x.step as usize == s).map(|x| x.dur_ns).sum();
            assert_eq!(busy, stats.comm_ns[lane], "step {s} lane {lane}");
        }
        // Collectives of one stream never overlap.
        for list in &tl.collectives {
            assert!(list.windows(2).all(|p| p[0].start_ns + p[0].dur_ns <= p[1].start_ns));
        }
        // Each rank's compute lane is a sequence of disjoint spans.
        for spans in &tl.compute {
            assert!(spans.windows(2).all(|p| p[0].start_ns + p[0].dur_ns <= p[1].start_ns));
        }
    }
}

/// The loss runs between a step's last forward and its first backward; the update after the
/// step's last reduce-scatter ended, before the next step's first forward; each once a step
/// on each rank, for its FLOPs at the compute rate.
#[test]
fn the_loss_and_the_update_run_between_the_passes_and_after_the_reductions() {
    use collsched::sim::SpanKind;
    let mut w = small(Architecture::Gpt2, 3, 256, false);
    w.loss_flops = 2e9;
    w.update_flops = 6e9;
    for policy in [Policy::Trace, Policy::Zero3_2021] {
        let mut c = config("p4d", 8, policy);
        c.timeline = true;
        c.steps = 3;
        let r = run(&w, &c);
        let tl = r.timeline.as_ref().unwrap();
        let ns = |f: f64| (f / (c.tflops * 1e12) * 1e9).round() as u64;
        let reductions_end = |step: u32| {
            tl.collectives[1].iter().filter(|x| x.step == step).map(|x| x.start_ns + x.dur_ns).max()
        };
        for spans in &tl.compute {
            for step in 0..c.steps {
                let of = |kind: SpanKind| spans.iter().filter(move |x| x.step == step && x.kind == kind);
                let (loss, update): (Vec<_>, Vec<_>) =
                    (of(SpanKind::Loss).collect(), of(SpanKind::Update).collect());
                assert_eq!((loss.len(), update.len()), (1, 1), "{policy} step {step}");
                assert_eq!((loss[0].dur_ns, update[0].dur_ns), (ns(w.loss_flops), ns(w.update_flops)));
                let last_forward = of(SpanKind::Forward).map(|x| x.start_ns + x.dur_ns).max().unwrap();
                let first_backward = of(SpanKind::Backward).map(|x| x.start_ns).min().unwrap();
                assert!(
                    last_forward <= loss[0].start_ns && loss[0].start_ns + loss[0].dur_ns <= first_backward
                );
                let reduced = reductions_end(step).expect("a reduce-scatter a step");
                assert!(
                    reduced <= update[0].start_ns,
                    "{policy} step {step}: {reduced} > {}",
                    update[0].start_ns
                );
                let next = spans
                    .iter()
                    .filter(|x| x.step == step + 1 && x.kind == SpanKind::Forward)
                    .map(|x| x.start_ns)
                    .min();
                assert!(
                    next.is_none_or(|n| update[0].start_ns + update[0].dur_ns <= n),
                    "{policy} step {step}"
                );
            }
        }
    }
}

/// A rank that blocks on a collective resumes the wait overhead after its end: every wait
/// span of a run without prefetch is at least that long, the step's exposed time at least that
/// much per wait, and every step longer than without it.
#[test]
fn a_blocking_wait_costs_the_wait_overhead() {
    use collsched::sim::SpanKind;
    let w = small(Architecture::Llama, 4, 512, false);
    let mut c = config("p4d", 8, Policy::Coalesced);
    c.timeline = true;
    let base = run(&w, &c);
    c.wait_overhead_s = Some(25e-6);
    let slow = run(&w, &c);
    let waits = |r: &SimReport, step: u32| {
        r.timeline.as_ref().unwrap().compute[0]
            .iter()
            .filter(|x| x.step == step && x.kind == SpanKind::Wait)
            .count()
    };
    for (k, (a, b)) in base.steps.iter().zip(&slow.steps).enumerate() {
        let n = waits(&slow, k as u32);
        assert!(n > 0 && waits(&base, k as u32) > 0, "step {k}: fetches block without prefetch");
        assert!(b.step_ns > a.step_ns, "step {k}: {} vs {}", b.step_ns, a.step_ns);
        assert!(b.exposed_ns >= n as f64 * 25_000.0, "step {k}: {} exposed over {n} waits", b.exposed_ns);
    }
    let tl = slow.timeline.as_ref().unwrap();
    assert!(tl.compute.iter().flatten().filter(|x| x.kind == SpanKind::Wait).all(|x| x.dur_ns >= 25_000));
    c.wait_overhead_s = Some(f64::NAN);
    let Err(e) = simulate(&w, &c) else { panic!("a NaN wait overhead was accepted") };
    assert!(e.to_string().contains("wait-overhead-us"), "{e}");
}

/// A hook time the virtual clock cannot hold is refused by name, as the other knobs are; a
/// NaN or negative step term is refused as a workload file's would be.
#[test]
fn a_hook_time_beyond_the_clock_is_refused_by_name() {
    let mut w = small(Architecture::Gpt2, 3, 256, false);
    w.hook_s = 1e12;
    let Err(e) = simulate(&w, &config("p4d", 8, Policy::Trace)) else { panic!("hook_s 1e12 s was accepted") };
    let e = e.to_string();
    assert!(e.contains("hook_s") && e.contains("beyond the simulator's clock"), "{e}");
    // A workload built in code is checked as a file is: a NaN or negative outside term is refused.
    for (loss, update) in [(f64::NAN, 0.0), (0.0, -1.0)] {
        let mut w = small(Architecture::Gpt2, 3, 256, false);
        (w.loss_flops, w.update_flops) = (loss, update);
        let Err(e) = simulate(&w, &config("p4d", 8, Policy::Trace)) else {
            panic!("{loss} {update} accepted")
        };
        let e = e.to_string();
        assert!(e.contains("give a finite number >= 0") && e.contains("_flops"), "{e}");
    }
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// On a static trace, trace-replay prefetch never exposes more communication than no
        /// prefetch, whatever the model, machine, bucket cap and budgets.
        #[test]
        fn prefetch_never_hurts(
            arch in prop_oneof![Just(Architecture::Gpt2), Just(Architecture::Llama), Just(Architecture::Roberta)],
            layers in 1u32..5,
            hidden in prop_oneof![Just(128u64), Just(256), Just(384)],
            checkpointing in any::<bool>(),
            topo in prop_oneof![Just("dgx-h100"), Just("p4d"), Just("pcie-8gpu")],
            world in prop_oneof![Just(2u32), Just(4), Just(8), Just(16)],
            bucket_kib in 16usize..2048,
            prefetch_kib in 16usize..8192,
            max_inflight in 1usize..9,
            live_kib in prop_oneof![Just(1usize << 22), 256usize..8192],
        ) {
            let w = small(arch, layers, hidden, checkpointing);
            let mut base = config(topo, world, Policy::Coalesced);
            base.bucket_bytes = bucket_kib << 10;
            base.prefetch_bytes = prefetch_kib << 10;
            base.max_inflight = max_inflight;
            base.max_live_bytes = live_kib << 10;
            let none = run(&w, &base);
            let trace = run(&w, &SimConfig { policy: Policy::Trace, ..base.clone() });
            prop_assert!(trace.exposed_comm_ms() <= none.exposed_comm_ms(), "trace {} > none {}", trace.exposed_comm_ms(), none.exposed_comm_ms());
            prop_assert_eq!(trace.collectives(), none.collectives());
        }
    }
}

/// `bucket_order`: `forward` numbers the buckets in the order the forward first needs them,
/// `params` in the order the parameters are listed (an engine's own layout, ids included).
#[test]
fn bucket_order_params_numbers_buckets_as_listed() {
    use collsched::sim::workload::BucketOrder;
    use collsched::sim::SpanKind;
    let rec = |name: &str| ParamRecord {
        name: name.into(),
        shape: vec![1 << 16],
        dtype: "f32".into(),
        trainable: true,
        module: None,
    };
    let layer = |name: &str, param: &str| Layer {
        name: name.into(),
        params: vec![param.into()],
        forward_flops: 1e9,
        backward_flops: 2e9,
        recompute_flops: 0.0,
        keep: false,
    };
    // Listed c, a, b; the forward runs a, b, c (one module, so one bucket, each).
    let mut w = Workload::in_layer_order(
        "listed",
        vec![rec("c.w"), rec("a.w"), rec("b.w")],
        vec![layer("a", "a.w"), layer("b", "b.w"), layer("c", "c.w")],
    );
    let mut c = config("p4d", 2, Policy::Coalesced);
    c.timeline = true;
    let gathers = |r: &SimReport| -> Vec<u32> {
        let tl = r.timeline.as_ref().unwrap();
        let mut first: Vec<&collsched::sim::Span> =
            tl.collectives[0].iter().filter(|x| x.step == 0 && x.kind == SpanKind::AllGather).collect();
        first.sort_by_key(|x| x.start_ns);
        first.iter().map(|x| x.index).collect()
    };
    let forward = gathers(&run(&w, &c));
    assert_eq!(&forward[..3], &[0, 1, 2], "forward order: {forward:?}");
    w.bucket_order = BucketOrder::Params;
    let listed = gathers(&run(&w, &c));
    assert_eq!(&listed[..3], &[1, 2, 0], "listed order: {listed:?}");
    assert_eq!(forward.len(), listed.len());
    // The file keeps it; the default is left out.
    assert!(
        w.to_json().contains("\"bucket_order\":\"params\"")
            || w.to_json().contains("\"bucket_order\": \"params\"")
    );
    assert_eq!(Workload::from_json(&w.to_json()).unwrap(), w);
    w.bucket_order = BucketOrder::Forward;
    assert!(!w.to_json().contains("bucket_order"), "the default is left out");
}

/// `shared_link`: the two streams' transfers never use the link at once. On links without
/// latency or launch costs a collective's whole price is transfer, so the time some
/// collective runs (the union of the spans) is at least the sum of the prices (a run without
/// sharing, where each collective lasts its price, gives them); in that run the streams do
/// overlap (the union is shorter than the sum), so the check can fail. No collective runs
/// shorter than its price.
#[test]
fn a_shared_link_carries_one_transfer_at_a_time() {
    let w = small(Architecture::Llama, 4, 512, false);
    let mut c = config("p4d", 8, Policy::Trace);
    c.timeline = true;
    c.cost = c.cost.with_launch_overhead(0.0).with_group_call_overhead(0.0);
    c.cost.intra.latency_us = 0.0;
    c.cost.inter.latency_us = 0.0;
    let own = run(&w, &c);
    c.shared_link = true;
    let shared = run(&w, &c);
    // Each collective by (stream, step, bucket, occurrence): its (start, end).
    let spans = |r: &SimReport| -> std::collections::BTreeMap<(usize, u32, u32, u32), (u64, u64)> {
        let mut out = std::collections::BTreeMap::new();
        for (lane, spans) in r.timeline.as_ref().unwrap().collectives.iter().enumerate() {
            for s in spans {
                let mut k = 0;
                while out.contains_key(&(lane, s.step, s.index, k)) {
                    k += 1;
                }
                out.insert((lane, s.step, s.index, k), (s.start_ns, s.start_ns + s.dur_ns));
            }
        }
        out
    };
    let union = |spans: &std::collections::BTreeMap<(usize, u32, u32, u32), (u64, u64)>| -> u64 {
        let mut v: Vec<(u64, u64)> = spans.values().copied().collect();
        v.sort_unstable();
        let (mut total, mut end) = (0, 0);
        for (a, b) in v {
            total += b.saturating_sub(a.max(end));
            end = end.max(b);
        }
        total
    };
    let (a, b) = (spans(&own), spans(&shared));
    assert!(a.len() > 10, "{} collectives", a.len());
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same collectives in both runs"
    );
    let prices: u64 = a.values().map(|(s, e)| e - s).sum();
    assert!(union(&a) < prices, "the streams never overlap without sharing: the test shows nothing");
    assert!(union(&b) >= prices, "two transfers at once: {} ns of collectives in {} ns", prices, union(&b));
    for (k, (s, e)) in &b {
        let (s0, e0) = a[k];
        assert!(e - s >= e0 - s0, "{k:?}: {} ns shared, priced {} ns", e - s, e0 - s0);
    }
    assert!(shared.steps.iter().zip(&own.steps).any(|(x, y)| x.step_ns > y.step_ns), "sharing cost nothing");
}

/// With a shared link and `compute_overlap` 0 a compute op is stretched by the time some
/// collective runs during it, not counting a collective's wait for the link. On links without
/// latency or launch costs the link moves one transfer at a time, so no op more than doubles;
/// the two streams' spans (one of them waiting) do cover some op together, where counting each
/// stream's span whole would stretch it up to threefold, so the check can fail.
#[test]
fn a_wait_for_a_shared_link_does_not_stretch_compute() {
    use collsched::sim::{Span, SpanKind};
    use std::collections::HashMap;
    let w = small(Architecture::Llama, 4, 512, false);
    let mut c = config("p4d", 8, Policy::Trace);
    c.timeline = true;
    c.shared_link = true;
    c.cost = c.cost.with_launch_overhead(0.0).with_group_call_overhead(0.0);
    c.cost.intra.latency_us = 0.0;
    c.cost.inter.latency_us = 0.0;
    let free = run(&w, &c);
    c.compute_overlap = Some(0.0);
    let slowed = run(&w, &c);
    let computes = |r: &SimReport| -> Vec<Span> {
        let tl = r.timeline.as_ref().unwrap();
        tl.compute[0]
            .iter()
            .filter(|s| {
                matches!(s.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Loss | SpanKind::Update)
            })
            .cloned()
            .collect()
    };
    // Each op by (step, kind, layer, occurrence): its unstretched duration.
    let key = |seen: &mut HashMap<(u32, SpanKind, u32), u32>, s: &Span| {
        let k = seen.entry((s.step, s.kind, s.index)).or_insert(0);
        *k += 1;
        (s.step, s.kind, s.index, *k)
    };
    let mut seen = HashMap::new();
    let base: HashMap<_, u64> = computes(&free).iter().map(|s| (key(&mut seen, s), s.dur_ns)).collect();
    let mut seen = HashMap::new();
    let ops = computes(&slowed);
    assert_eq!(ops.len(), base.len(), "the same compute ops in both runs");
    let lanes = &slowed.timeline.as_ref().unwrap().collectives;
    let (mut stretched, mut covered_by_both) = (0, 0);
    for s in &ops {
        let b = *base.get(&key(&mut seen, s)).unwrap_or_else(|| panic!("{s:?} not in the free run"));
        assert!(b > 0 && s.dur_ns >= b, "{s:?} shorter than its {b} ns");
        assert!(s.dur_ns <= 2 * b, "{s:?} stretched past twice its {b} ns: a wait for the link counted");
        stretched += usize::from(s.dur_ns > b);
        let (from, to) = (s.start_ns, s.start_ns + b);
        let during = |lane: &Vec<Span>| -> Vec<(u64, u64)> {
            lane.iter()
                .map(|x| (x.start_ns.max(from), (x.start_ns + x.dur_ns).min(to)))
                .filter(|(a, z)| a < z)
                .collect()
        };
        let (ag, rs) = (during(&lanes[0]), during(&lanes[1]));
        covered_by_both += usize::from(ag.iter().any(|x| rs.iter().any(|y| x.0.max(y.0) < x.1.min(y.1))));
    }
    assert!(stretched > 0, "no compute op was stretched: the test shows nothing");
    assert!(covered_by_both > 0, "no op ran under both streams' spans: the test shows nothing");
}
