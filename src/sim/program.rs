//! The simulator's program: a workload compiled into a plan, the engine calls of one step and
//! their compute times, and the prices of the plan's collectives.

use collsched_buckets::{Boundary, BucketId, DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched_schedule::{Explicit, Plan, ScheduleInput};
use collsched_topo::{CollectiveKind, CostModel, GroupShape};

use super::config::{Policy, SimConfig, SimError};
use super::report::SpanKind;
use super::step::{Call, StepProgram};
use super::workload::{BucketOrder, Workload};
use super::zero3;

/// What every rank runs: the plan, the engine program of one step with its compute times, the
/// explicit prefetch rules, the collectives' prices and the run's settings.
pub(crate) struct Program {
    pub(crate) plan: Plan,
    pub(crate) layer_params: Vec<Vec<ParamId>>,
    pub(crate) program: Vec<Call>,
    /// Per program position: compute ns before jitter (host ns of `Host` and `Drain`).
    pub(crate) compute_ns: Vec<f64>,
    /// Per program position: host-device synchronizations it makes.
    pub(crate) syncs: Vec<u32>,
    /// Explicit rules for forward and backward.
    pub(crate) rules: Option<[Explicit; 2]>,
    /// Launch price cache by bucket id: its duration and the part of it a launch of 0 bytes
    /// would take (`[u64::MAX, _]`: not priced yet).
    pub(crate) price: Vec<[u64; 2]>,
    pub(crate) cost: CostModel,
    /// A measured profile pricing collectives instead of `cost`.
    pub(crate) profile: Option<collsched_topo::CostProfile>,
    /// Host ns per launch, by role: `[all-gather, reduce-scatter]`.
    pub(crate) host_ns: [u64; 2],
    /// Ns a rank loses each time it blocks on a collective, past the collective's end.
    pub(crate) wait_ns: u64,
    /// Each all-gather launch first waits for every collective the rank launched (a device
    /// synchronize, counted as one sync): [`Policy::Zero3_2021`].
    pub(crate) sync_before_gather: bool,
    /// [`Policy::Zero3_2021`]: collectives' streams also run its copies.
    pub(crate) zero3: bool,
    /// The share of collective time overlapping a compute op that is added to it
    /// (`1 - compute_overlap`).
    pub(crate) contention: f64,
    pub(crate) rpn: u32,
    pub(crate) world: u32,
    pub(crate) jitter: f64,
    pub(crate) seed: u64,
    pub(crate) steps: u32,
    pub(crate) timeline: bool,
}

impl Program {
    /// Compiles `workload` under `config`: its parameters into a layout and plan (bucketed in
    /// forward execution order), the program of one step and its compute durations, and the
    /// explicit prefetch rules of [`Policy::Explicit`]. Returns the scheduler input too.
    pub(crate) fn compile(
        workload: &Workload,
        config: &SimConfig,
    ) -> Result<(Program, ScheduleInput), SimError> {
        config.validate()?;
        let params_err = |message: String| SimError::Params { workload: workload.name.clone(), message };
        // A workload built in code is checked as a file is (FLOPs, names, orders).
        workload.validate().map_err(|e| match e {
            super::workload::WorkloadError::Invalid { message, .. } => params_err(message),
            other => params_err(other.to_string()),
        })?;
        let mut specs = Vec::with_capacity(workload.params.len());
        for p in &workload.params {
            let dtype: DType =
                p.dtype.parse().map_err(|e| params_err(format!("parameter `{}`: {e}", p.name)))?;
            let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
            let spec = ParamSpec::new(p.name.clone(), shape, dtype).trainable(p.trainable);
            specs.push(match &p.module {
                Some(m) => spec.module(m.clone()),
                None => spec,
            });
        }
        let set = ParamSet::new(specs).map_err(|e| params_err(e.to_string()))?;
        let id = |name: &str| set.id(name).ok_or_else(|| params_err(format!("unknown parameter `{name}`")));
        let mut layer_params = Vec::with_capacity(workload.layers.len());
        for l in &workload.layers {
            let mut ids: Vec<ParamId> = Vec::with_capacity(l.params.len());
            for n in &l.params {
                let p = id(n)?;
                if !ids.contains(&p) {
                    ids.push(p);
                }
            }
            layer_params.push(ids);
        }
        let layer_index =
            |name: &String| workload.layers.iter().position(|l| &l.name == name).unwrap_or(0) as u32;
        let fwd: Vec<u32> = workload.forward_order.iter().map(layer_index).collect();
        let bwd: Vec<u32> = workload.backward_order.iter().map(layer_index).collect();
        // Bucket in forward execution order (or, below, in the parameters' listed order).
        let mut order = Vec::with_capacity(set.len());
        let mut seen = vec![false; set.len()];
        for &l in &fwd {
            for &p in &layer_params[l as usize] {
                if !std::mem::replace(&mut seen[p.index()], true) {
                    order.push(p);
                }
            }
        }
        let (bucket_bytes, boundary) = match config.policy {
            Policy::Naive | Policy::Zero3_2021 => (1, Boundary::Size),
            _ => (config.bucket_bytes, config.boundary),
        };
        let mut builder = LayoutBuilder::new(&set, Sharding::EvenSplit, config.world)
            .bucket_bytes(bucket_bytes)
            .boundary(boundary);
        if workload.bucket_order == BucketOrder::Forward {
            builder = builder.order(order);
        }
        let layout = builder.build()?;
        let plan = Plan::new(layout);

        // The program of one step and its compute durations.
        let ns_per_flop = 1e9 / (config.tflops * 1e12) * config.compute_slowdown();
        // Gradients are ready after the last layer (in backward order) that uses the parameter.
        let mut last_use = vec![u32::MAX; set.len()];
        for (k, &l) in bwd.iter().enumerate() {
            for &p in &layer_params[l as usize] {
                last_use[p.index()] = k as u32;
            }
        }
        let zero3 = config.policy == Policy::Zero3_2021;
        let steps = if zero3 {
            // Persistent parameters are never fetched in a step; gradients come from the full
            // lists.
            let fetch: Vec<Vec<ParamId>> = layer_params
                .iter()
                .map(|ps| ps.iter().copied().filter(|&p| zero3::fetched(&set, p)).collect())
                .collect();
            let steps = zero3::step_program(
                workload,
                &set,
                (&layer_params, &fetch),
                (&fwd, &bwd),
                &last_use,
                ns_per_flop,
                config.world,
            );
            layer_params = fetch;
            steps
        } else {
            library_step(workload, &set, &layer_params, (&fwd, &bwd), &last_use, ns_per_flop)
        };
        let StepProgram { program, ns: compute_ns, syncs } = steps;

        let input = ScheduleInput::from_plan(&plan);
        let rules = (config.policy == Policy::Explicit).then(|| {
            let bucket_of = |p: ParamId| input.gather[gather_pos(&input, p)].id;
            let layer_buckets = |l: u32| {
                let mut v: Vec<BucketId> = Vec::new();
                for &p in &layer_params[l as usize] {
                    let b = bucket_of(p);
                    if !v.contains(&b) {
                        v.push(b);
                    }
                }
                v
            };
            let make = |order: &[u32]| {
                let mut e = Explicit::default();
                // A tied embedding's bucket ends two layers of each pass.
                e.once_per_step(true);
                for w in order.windows(2) {
                    if let Some(&last) = layer_buckets(w[0]).last() {
                        e.after(last, &layer_buckets(w[1]));
                    }
                }
                e
            };
            [make(&fwd), make(&bwd)]
        });
        let n_buckets = plan.layout().buckets().len();
        let mut program = Program {
            plan,
            layer_params,
            program,
            compute_ns,
            syncs,
            rules,
            price: vec![[u64::MAX, 0]; n_buckets],
            cost: config.cost,
            profile: config.profile.clone(),
            host_ns: match (zero3, config.host_overhead_s) {
                (true, None) => [zero3::gather_host_ns(), zero3::reduce_host_ns()],
                _ => [(config.host_overhead() * 1e9).round() as u64; 2],
            },
            wait_ns: (config.wait_overhead() * 1e9).round() as u64,
            sync_before_gather: zero3,
            zero3,
            contention: 1.0 - config.compute_overlap(),
            rpn: config.ranks_per_node.max(1),
            world: config.world,
            jitter: config.jitter,
            seed: config.seed,
            steps: config.steps,
            timeline: config.timeline,
        };
        program.check_clock(workload, config)?;
        Ok((program, input))
    }

    /// Refuses a run whose virtual clock could pass [`MAX_CLOCK_NS`] (it is integer
    /// nanoseconds): a compute op, a collective or the host overhead too long, or their sum
    /// over the run. Names the knob to change instead of printing saturated times.
    fn check_clock(&mut self, workload: &Workload, config: &SimConfig) -> Result<(), SimError> {
        let too_long = |knob: &'static str, what: String| SimError::Config {
            knob,
            message: format!("{what}, beyond the simulator's clock ({MAX_CLOCK_NS:e} ns); check the value"),
        };
        let mut step = 0f64;
        for (c, &ns) in self.program.iter().zip(&self.compute_ns) {
            if !(ns.is_finite() && ns <= MAX_CLOCK_NS) {
                let layer = match c {
                    Call::Compute(l, kind) => match workload.layers.get(*l as usize) {
                        Some(layer) => layer.name.as_str(),
                        None => {
                            return Err(too_long(
                                "tflops",
                                format!(
                                    "the step's {} computes for {ns:e} ns at {} TFLOPS",
                                    kind.name(),
                                    config.tflops
                                ),
                            ))
                        }
                    },
                    _ if !self.zero3 => {
                        return Err(too_long(
                            "workload",
                            format!("a hook takes {ns:e} ns (the workload's hook_s)"),
                        ))
                    }
                    _ => "?",
                };
                return Err(too_long(
                    "tflops",
                    format!(
                        "layer `{layer}` computes for {ns:e} ns at {} TFLOPS (its FLOPs over --tflops)",
                        config.tflops
                    ),
                ));
            }
            step += ns;
        }
        let calls = self.program.len() as f64;
        let host_ns = self.host_ns[0].max(self.host_ns[1]);
        step += host_ns as f64 * calls;
        if host_ns as f64 > MAX_CLOCK_NS / calls.max(1.0) {
            return Err(too_long("host-overhead-us", format!("{host_ns} ns per launch")));
        }
        for b in 0..self.plan.layout().buckets().len() {
            let bucket = BucketId(b as u32);
            let ops = self.plan.ops_of(bucket).to_vec();
            if let Some(p) = &self.profile {
                for &o in &ops {
                    if let Some(op) = self.plan.op(o) {
                        if op.groups().group_size() > 1 {
                            p.time(op.kind(), 1, op.groups().group_size() as usize).map_err(|e| {
                                SimError::Config { knob: "cost", message: format!("bucket {bucket}: {e}") }
                            })?;
                        }
                    }
                }
            }
            let secs = self.price_secs(&ops);
            if !(secs.is_finite() && secs * 1e9 <= MAX_CLOCK_NS) {
                return Err(too_long(
                    "topo",
                    format!("one collective of bucket {bucket} takes {secs:e} s on this topology (its link bandwidths and latencies)"),
                ));
            }
            // A bucket is launched at most twice a step (its gather, its reduction).
            step += 2.0 * secs * 1e9;
        }
        if step * f64::from(config.steps) > MAX_CLOCK_NS {
            return Err(too_long("steps", format!("{} steps of up to {step:e} ns each", config.steps)));
        }
        Ok(())
    }
}

/// The program of one step of the library's engine: forward over the layers (`Fetch` ->
/// compute -> `Release`, which a kept layer moves to its backward's fetch), the loss, then backward (`Fetch` -> recompute -> backward -> `Grad`
/// for each trainable parameter whose last use this is -> `Release`), then `EndStep` and the
/// update; the workload's engine hooks' host time after each `Fetch` and `Release`.
fn library_step(
    workload: &Workload,
    set: &ParamSet,
    layer_params: &[Vec<ParamId>],
    (fwd, bwd): (&[u32], &[u32]),
    last_use: &[u32],
    ns_per_flop: f64,
) -> StepProgram {
    let mut s = StepProgram::default();
    // The engine's hooks: a quarter of a layer's at each of its fetches and releases.
    let hook = workload.hook_s * 1e9 / 4.0;
    s.push(Call::Phase { backward: false }, 0.0, 0);
    for &l in fwd {
        let layer = &workload.layers[l as usize];
        s.push(Call::Fetch(l), 0.0, 0);
        s.hook(l, hook);
        s.push(Call::Compute(l, SpanKind::Forward), layer.forward_flops * ns_per_flop, 0);
        if !layer.keep {
            s.push(Call::Release(l), 0.0, 0);
        }
        s.hook(l, hook);
    }
    s.outside(SpanKind::Loss, workload.loss_flops, ns_per_flop);
    s.push(Call::Phase { backward: true }, 0.0, 0);
    for (k, &l) in bwd.iter().enumerate() {
        let layer = &workload.layers[l as usize];
        s.push(Call::Fetch(l), 0.0, 0);
        if layer.keep {
            // Gathered since its forward: this fetch gathers nothing; the forward's hold goes.
            s.push(Call::Release(l), 0.0, 0);
        }
        s.hook(l, hook);
        if layer.recompute_flops > 0.0 {
            s.push(Call::Compute(l, SpanKind::Recompute), layer.recompute_flops * ns_per_flop, 0);
        }
        s.push(Call::Compute(l, SpanKind::Backward), layer.backward_flops * ns_per_flop, 0);
        for &p in &layer_params[l as usize] {
            if last_use[p.index()] == k as u32 && set.is_trainable(p) {
                s.push(Call::Grad(p), 0.0, 0);
            }
        }
        s.push(Call::Release(l), 0.0, 0);
        s.hook(l, hook);
    }
    s.push(Call::EndStep, 0.0, 0);
    s.outside(SpanKind::Update, workload.update_flops, ns_per_flop);
    s
}

/// The longest virtual time a simulation may reach: 10^18 ns (about 31 years), far below
/// `u64::MAX`, so the clock's integer sums never saturate.
pub(crate) const MAX_CLOCK_NS: f64 = 1e18;

fn gather_pos(input: &ScheduleInput, p: ParamId) -> usize {
    input.gather.iter().position(|b| b.params.contains(&p)).unwrap_or(0)
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}
pub(crate) fn jitter_factor(sh: &Program, rank: u32, step: u32, pc: usize) -> f64 {
    if sh.jitter == 0.0 {
        return 1.0;
    }
    let h = mix(mix(mix(mix(sh.seed) ^ u64::from(rank)) ^ u64::from(step)) ^ pc as u64);
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    1.0 + sh.jitter * u
}

/// Nanoseconds of one launch of `bucket` running plan `ops`, and of those the part that does
/// not grow with its bytes (the same launch priced at 0 bytes: latency, launch and copies);
/// cached per bucket.
pub(crate) fn price(sh: &mut Program, bucket: BucketId, ops: &[collsched_schedule::OpId]) -> [u64; 2] {
    if let Some(&p) = sh.price.get(bucket.index()) {
        if p[0] != u64::MAX {
            return p;
        }
    }
    // `check_clock` bounded every price at compile time: the conversions do not saturate.
    let ns = (sh.price_secs(ops) * 1e9).round().max(0.0) as u64;
    let fixed = ((sh.priced(ops, false) * 1e9).round().max(0.0) as u64).min(ns);
    if let Some(p) = sh.price.get_mut(bucket.index()) {
        *p = [ns, fixed];
    }
    [ns, fixed]
}

impl Program {
    /// Seconds of one launch running plan `ops` (one group call when several).
    fn price_secs(&self, ops: &[collsched_schedule::OpId]) -> f64 {
        self.priced(ops, true)
    }

    /// [`Program::price_secs`], with the collectives' bytes (`sized`) or with 0 bytes each (the
    /// copies of [`Policy::Zero3_2021`] at their own size either way).
    fn priced(&self, ops: &[collsched_schedule::OpId], sized: bool) -> f64 {
        let mut calls: Vec<(CollectiveKind, u64, GroupShape)> = Vec::with_capacity(ops.len());
        for &o in ops {
            let Some(op) = self.plan.op(o) else { continue };
            let g = op.groups();
            let n = g.group_size();
            if n <= 1 {
                continue;
            }
            let mut nodes: Vec<u32> = g.ranks_of(0).map(|r| r / self.rpn).collect();
            nodes.dedup();
            let per = op.bytes_per_rank() as u64;
            // The cost model's size: the whole buffer of all-gather and reduce-scatter.
            let kind = op.kind();
            let bytes = match kind {
                CollectiveKind::AllGather | CollectiveKind::ReduceScatter => per * u64::from(n),
                CollectiveKind::AllReduce | CollectiveKind::Broadcast => per,
            };
            calls.push((kind, bytes, GroupShape { ranks: n as usize, nodes: nodes.len().max(1) }));
        }
        let extra: f64 = if self.zero3 {
            // The stream of a 2021 list-form collective also runs its copies.
            calls
                .iter()
                .map(|&(kind, bytes, g)| match kind {
                    CollectiveKind::AllGather => zero3::gather_device_s(bytes as f64, g.ranks as u32),
                    _ => zero3::reduce_device_s(bytes as f64),
                })
                .sum()
        } else {
            0.0
        };
        if !sized {
            for c in &mut calls {
                c.1 = 0;
            }
        }
        if let Some(p) = &self.profile {
            // `check_clock` refused a plan with a kind the profile lacks: NaN never reaches the clock.
            return extra
                + calls.iter().map(|(k, b, g)| p.time(*k, *b, g.ranks).unwrap_or(f64::NAN)).sum::<f64>();
        }
        extra
            + match calls.len() {
                0 => 0.0,
                1 => self.cost.time(calls[0].0, calls[0].1, calls[0].2),
                _ => self.cost.group_call_time(&calls),
            }
    }
}
