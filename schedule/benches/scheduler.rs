//! Host cost of scheduling: a 1,000-parameter model of 100 modules of 10 parameters (one
//! bucket each), trace-replay prefetch; the engine fetches and releases a module's
//! parameters together, as FSDP-style engines do. Targets: fetch + release under 1 µs per parameter; a whole training step
//! (forward fetch/release, backward fetch/grad/release, end_step) well under 1 ms.
//! `train_step_1000_params_with_completions` also reports every launch complete right after
//! the event that launched it (as the simulator does), which puts `OpDone` on the hot path.
//!
//! Run: `cargo bench -p collsched-schedule --bench scheduler`.

use std::hint::black_box;

use collsched_schedule::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched_schedule::{
    Action, Event, InflightRegistry, LaunchId, Plan, ScheduleInput, Scheduler, SchedulerConfig,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const PARAMS: u32 = 1000;
const MODULE: u32 = 10;

fn plan() -> Plan {
    let specs = (0..PARAMS).map(|i| ParamSpec::new(format!("p{i}"), [64, 64], DType::BF16)).collect();
    let set = ParamSet::new(specs).unwrap();
    // 10 parameters of 8 KiB per bucket.
    Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 8).bucket_bytes(10 * 8192).build().unwrap())
}

fn module(m: u32, ps: &mut [ParamId]) {
    for (k, p) in ps.iter_mut().enumerate() {
        *p = ParamId(m * MODULE + k as u32);
    }
}

struct Rig {
    reg: InflightRegistry,
    s: Scheduler,
    out: Vec<Action>,
}

impl Rig {
    fn new() -> Rig {
        let plan = plan();
        let mut reg = InflightRegistry::new(&ScheduleInput::from_plan(&plan));
        let s = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut reg).unwrap();
        let mut r = Rig { reg, s, out: Vec::with_capacity(4096) };
        // Record the trace and warm every table up.
        r.step();
        r.step();
        r
    }

    fn forward(&mut self) {
        let mut ps = [ParamId(0); MODULE as usize];
        for m in 0..PARAMS / MODULE {
            module(m, &mut ps);
            self.s.handle(&mut self.reg, Event::Fetch(&ps), &mut self.out).unwrap();
            self.s.handle(&mut self.reg, Event::Release { params: &ps, after: None }, &mut self.out).unwrap();
        }
    }

    /// Feeds `OpDone` for every launch pushed since `from` (completions arriving right after
    /// their launch, as with a fast network), into `done` (reused).
    fn complete_since(&mut self, from: usize, done: &mut Vec<LaunchId>) {
        done.clear();
        done.extend(self.out[from..].iter().filter_map(|a| match a {
            Action::Launch(l) => Some(l.id),
            _ => None,
        }));
        for &id in done.iter() {
            self.s.handle(&mut self.reg, Event::OpDone(id), &mut self.out).unwrap();
        }
    }

    /// A training step whose every launch is reported complete right after the event that
    /// launched it (what the simulator does), so `OpDone` is on the hot path.
    fn step_with_completions(&mut self, done: &mut Vec<LaunchId>) {
        let mut ps = [ParamId(0); MODULE as usize];
        for backward in [false, true] {
            for k in 0..PARAMS / MODULE {
                let m = if backward { PARAMS / MODULE - 1 - k } else { k };
                module(m, &mut ps);
                let from = self.out.len();
                self.s.handle(&mut self.reg, Event::Fetch(&ps), &mut self.out).unwrap();
                self.complete_since(from, done);
                if backward {
                    for &p in &ps {
                        let from = self.out.len();
                        self.s
                            .handle(&mut self.reg, Event::GradReady { param: p, after: None }, &mut self.out)
                            .unwrap();
                        self.complete_since(from, done);
                    }
                }
                let from = self.out.len();
                self.s
                    .handle(&mut self.reg, Event::Release { params: &ps, after: None }, &mut self.out)
                    .unwrap();
                self.complete_since(from, done);
            }
        }
        self.s.handle(&mut self.reg, Event::EndStep, &mut self.out).unwrap();
        black_box(self.out.len());
        self.out.clear();
    }

    fn step(&mut self) {
        self.forward();
        let mut ps = [ParamId(0); MODULE as usize];
        for m in (0..PARAMS / MODULE).rev() {
            module(m, &mut ps);
            self.s.handle(&mut self.reg, Event::Fetch(&ps), &mut self.out).unwrap();
            for &p in &ps {
                self.s
                    .handle(&mut self.reg, Event::GradReady { param: p, after: None }, &mut self.out)
                    .unwrap();
            }
            self.s.handle(&mut self.reg, Event::Release { params: &ps, after: None }, &mut self.out).unwrap();
        }
        self.s.handle(&mut self.reg, Event::EndStep, &mut self.out).unwrap();
        black_box(self.out.len());
        self.out.clear();
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    let mut r = Rig::new();
    // Per parameter: one fetch + one release (forward pass, trace-replay prefetch hits).
    g.throughput(Throughput::Elements(u64::from(PARAMS)));
    g.bench_function("fetch_release_1000_params", |b| {
        b.iter(|| {
            r.forward();
            r.s.handle(&mut r.reg, Event::EndStep, &mut r.out).unwrap();
            black_box(r.out.len());
            r.out.clear();
        })
    });
    let mut r = Rig::new();
    g.throughput(Throughput::Elements(1));
    g.bench_function("train_step_1000_params", |b| b.iter(|| r.step()));
    let mut r = Rig::new();
    let mut done = Vec::with_capacity(256);
    g.bench_function("train_step_1000_params_with_completions", |b| {
        b.iter(|| r.step_with_completions(&mut done))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
