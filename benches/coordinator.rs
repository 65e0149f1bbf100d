//! Host cost of the coordinator (driver + scheduler) per step, on a one-rank loopback backend
//! whose collectives cost a memcpy, so what is measured is scheduling and bookkeeping:
//! - `fetch_release/1000`: a forward pass over a 1,000-parameter model (100 buckets of 10
//!   parameters of 16 f32, fetched and released module by module, trace-replay prefetch
//!   hits); throughput is per parameter (target: under 1 µs per parameter);
//! - `step/1000`: a whole training step of that model (forward, backward with `grad_ready`
//!   per parameter, `end_step` with 100 reductions, SGD through the optimizer hook).
//!
//! Run: `cargo bench --bench coordinator`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::{Coordinator, ModelState};
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[path = "../tests/support/loopback.rs"]
mod loopback;
use loopback::Loopback;

const PARAMS: usize = 1000;
const PER_MODULE: usize = 10;
const NUMEL: usize = 16;

fn setup() -> (Coordinator<Loopback>, Vec<Vec<ParamId>>, Vec<f32>) {
    let specs = (0..PARAMS).map(|k| ParamSpec::new(format!("p{k}"), [NUMEL], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 1)
        .bucket_bytes(PER_MODULE * NUMEL * 4)
        .align(16)
        .build()
        .expect("layout");
    let plan = Plan::new(layout);
    let modules: Vec<Vec<ParamId>> =
        plan.layout().gather_buckets().iter().map(|b| b.params().to_vec()).collect();
    let init = vec![vec![1.0f32; NUMEL]; PARAMS];
    let state = ModelState::from_f32(Arc::new(Loopback::new()), &plan, &init).expect("state");
    let config = SchedulerConfig { policy: PolicyKind::TraceReplay, ..SchedulerConfig::default() };
    (state.coordinator(config).expect("coordinator"), modules, vec![0.5; NUMEL])
}

fn forward(c: &mut Coordinator<Loopback>, modules: &[Vec<ParamId>]) -> f32 {
    let mut s = 0f32;
    for m in modules {
        let v = c.fetch(m).expect("fetch");
        s += v.f32(m[0]).expect("view")[0];
        drop(v);
        c.release(m).expect("release");
    }
    s
}

fn train_step(c: &mut Coordinator<Loopback>, modules: &[Vec<ParamId>], grad: &[f32]) -> f32 {
    let s = forward(c, modules);
    for m in modules.iter().rev() {
        c.fetch(m).expect("fetch");
        for &p in m {
            c.grad_ready_f32(p, grad).expect("grad");
        }
        c.release(m).expect("release");
    }
    c.end_step().expect("end_step");
    c.update_shards_f32(|_, _, w, g| w.iter_mut().zip(g).for_each(|(w, g)| *w -= 1e-3 * g)).expect("sgd");
    s
}

fn bench(cr: &mut Criterion) {
    let (mut c, modules, grad) = setup();
    for _ in 0..3 {
        train_step(&mut c, &modules, &grad);
    }
    let mut g = cr.benchmark_group("fetch_release");
    g.throughput(Throughput::Elements(PARAMS as u64));
    g.bench_function("1000", |b| {
        b.iter(|| {
            let s = forward(&mut c, &modules);
            c.end_step().expect("end_step");
            black_box(s)
        })
    });
    g.finish();
    let mut g = cr.benchmark_group("step");
    g.bench_function("1000", |b| b.iter(|| black_box(train_step(&mut c, &modules, &grad))));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
