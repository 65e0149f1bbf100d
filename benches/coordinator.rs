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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use collsched::backend::{
    Backend, BackendBuffer, BackendError, BackendEvent, CollKind, Collective, InFlight, LaunchError, OnDrop,
    Stream,
};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::kernels::{reduce, ReduceOp};
use collsched::runtime::{Coordinator, ModelState};
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

#[derive(Debug)]
struct Buf(Vec<u8>);

impl BackendBuffer for Buf {
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Clone, Debug)]
struct Done;

impl BackendEvent for Done {
    fn query(&self) -> Result<bool, BackendError> {
        Ok(true)
    }
    fn wait(&self, _: Duration) -> Result<(), BackendError> {
        Ok(())
    }
}

/// One rank, collectives run at launch, buffers pooled by exact capacity (like the local
/// backend's size classes).
struct Loopback {
    pool: Arc<Mutex<Vec<Vec<u8>>>>,
    on_drop: OnDrop<Loopback>,
}

impl Loopback {
    fn new() -> Self {
        let pool = Arc::new(Mutex::new(Vec::with_capacity(1024)));
        let p = Arc::clone(&pool);
        let on_drop: OnDrop<Loopback> = Arc::new(move |ops: Vec<Collective<Buf>>, _: &Done| {
            let mut p = p.lock().unwrap();
            for c in ops {
                p.extend(c.input.map(|b| b.0));
                p.push(c.output.0);
            }
        });
        Loopback { pool, on_drop }
    }
}

impl Backend for Loopback {
    type Buffer = Buf;
    type Event = Done;

    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
    fn alloc(&self, bytes: usize) -> Result<Buf, BackendError> {
        let mut p = self.pool.lock().unwrap();
        let mut v = match p.iter().position(|v| v.capacity() == bytes) {
            Some(i) => p.swap_remove(i),
            None => Vec::with_capacity(bytes),
        };
        v.clear();
        v.resize(bytes, 0);
        Ok(Buf(v))
    }
    fn free(&self, buffer: Buf, _: Option<&Done>) {
        self.pool.lock().unwrap().push(buffer.0);
    }
    fn write_from_host(&self, buffer: &mut Buf, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        buffer.0[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn read_to_host(&self, buffer: &Buf, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        dst.copy_from_slice(&buffer.0[offset..offset + dst.len()]);
        Ok(())
    }
    fn record(&self, _: Stream) -> Result<Done, BackendError> {
        Ok(Done)
    }
    fn wait_event(&self, _: Stream, _: &Done) -> Result<(), BackendError> {
        Ok(())
    }
    fn launch_group(
        &self,
        _: Stream,
        _: &[Done],
        mut ops: Vec<Collective<Buf>>,
    ) -> Result<InFlight<Self>, LaunchError<Buf>> {
        for c in &mut ops {
            let d = &c.desc;
            let n = d.count * d.elem.size();
            let input = c.input.as_ref().map_or(&[][..], |b| &b.0[..n]);
            match d.kind {
                CollKind::ReduceScatter | CollKind::AllReduce => {
                    reduce(d.elem, ReduceOp::Sum, d.scaling, &mut c.output.0[..n], &[input]).unwrap();
                }
                _ => c.output.0[..n].copy_from_slice(input),
            }
        }
        Ok(InFlight::new(ops, Done, Arc::clone(&self.on_drop)))
    }
}

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
