//! The simulator's speed: one training step of `roberta-50b` on 64 ranks (8 DGX H100 nodes),
//! every rank's real scheduler included, and scheduler events per second.
//!
//! Run: `cargo bench --bench sim`. Targets: a 64-rank `roberta-50b` step in under
//! 2 seconds, at least a million scheduler events per second (criterion prints the events per
//! second as `thrpt`).

use std::hint::black_box;
use std::time::Duration;

use collsched::sim::workload::TransformerConfig;
use collsched::sim::{simulate, Policy, SimConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn bench(c: &mut Criterion) {
    let w = TransformerConfig::preset("roberta-50b").unwrap().workload().unwrap();
    let topo = collsched::topo::preset("dgx-h100").unwrap();
    let mut g = c.benchmark_group("sim/roberta-50b/64-ranks");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    for (policy, steps) in [(Policy::Trace, 1), (Policy::Trace, 3), (Policy::Coalesced, 1)] {
        let mut cfg = SimConfig::for_topology(&topo, 64).unwrap();
        cfg.policy = policy;
        cfg.steps = steps;
        let events = simulate(&w, &cfg).unwrap().scheduler_events;
        g.throughput(Throughput::Elements(events));
        g.bench_function(format!("{policy}/{steps}-step"), |b| {
            b.iter(|| simulate(black_box(&w), &cfg).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
