//! The simulated backend: every rank's real [`Scheduler`] driven by a workload on a virtual clock,
//! collectives priced by [`CostModel`](collsched_topo::CostModel), compute by FLOPs over an
//! achieved throughput.
//!
//! # Model
//! - **Clock**: integer nanoseconds (deterministic; no float accumulation across events).
//! - **Ranks**: each has its own [`Scheduler`] and [`InflightRegistry`], fed by the engine
//!   program of the workload: per step, forward over the layers (`Fetch` -> compute ->
//!   `Release`), the loss, then backward in reverse (`Fetch` -> recompute under checkpointing ->
//!   backward compute -> `GradReady` for each trainable parameter whose last use this is ->
//!   `Release`), then `EndStep` and the update (the workload's `loss_flops` and `update_flops`).
//! - **The engine is synchronous with its compute stream**: each engine call happens when the
//!   rank's compute stream reached it (no CPU run-ahead), so every engine event recorded after
//!   a compute op is complete when the next call is made. Overlap therefore comes from the
//!   scheduler's prefetch only, which is what the simulator studies.
//! - **Streams**: the compute stream is the rank's clock; the all-gather and reduce-scatter streams
//!   are FIFO timelines. A collective starts when every rank launched it (at its host time, after
//!   its fences) and the previous collective of that stream ended, and lasts
//!   [`CostModel::time`](collsched_topo::CostModel::time) (or
//!   [`CostModel::group_call_time`](collsched_topo::CostModel::group_call_time) when a launch holds
//!   several plan ops); a group of one rank moves nothing and costs 0. All ranks issue the same
//!   collectives in the same order (the scheduler's determinism rule), which the simulator checks.
//!   With [`SimConfig::shared_link`] the two streams share one link: a collective's transfer
//!   (its price less a launch of 0 bytes) runs where the other stream's already priced
//!   transfers leave the link free, so it lasts longer than its price.
//! - **Actions**: `Launch` queues the collective (and allocates a gathered buffer);
//!   `Wait` on compute stalls the rank until the fence, and [`SimConfig::wait_overhead_s`] past
//!   it when the rank did block (the stall is *exposed communication*);
//!   `Free` releases the buffer's memory once its fences completed; `AllocGrad`, `CopyGradIn`
//!   and `AccumulateGrad` cost nothing (copy kernels are not priced). `OpDone` is fed back before
//!   each engine call for every collective that ended by then.
//! - **Compute**: FLOPs / [`SimConfig::tflops`] (achieved, per rank), times `1 + jitter * u`
//!   with `u` in `[0, 1)` drawn from a hash of (`seed`, rank, step, program position): a
//!   deterministic straggler model.
//! - **Shared cores** (CPU backends; a calibrated profile's `compute_slowdown` and
//!   `compute_overlap`): compute takes `compute_slowdown` times longer, and a compute op is
//!   stretched by `1 - compute_overlap` of the time the resolved collectives of both streams
//!   run during it (collectives some rank has not launched yet are not counted; on a shared
//!   link, neither is a collective's wait for the link). The defaults
//!   (1 and 1) leave compute alone.
//! - **Host overhead**: [`SimConfig::host_overhead_s`] is added to the rank's compute timeline
//!   for every collective it launches (per-parameter Python hooks for [`Policy::Naive`]); a
//!   workload's `hook_s` adds the engine's hooks' host time (`Host`, a `hook` span) at each
//!   fetch and release of a layer.
//! - **The step outside the layers**: a workload's `loss_flops` run after the forward, its
//!   `update_flops` after the step's end (its reductions waited for), at the compute rate.
//! - **[`Policy::Zero3_2021`]** (the `zero3` module): the program also holds host work of the
//!   engine's hooks (`Host`, a `hook` span) and device drains (`Drain`: the rank waits for
//!   every collective it launched, the wait counted as exposed); each all-gather launch first
//!   drains too; launches are priced per role, and each position's host-device syncs are
//!   counted ([`SimStepStats::host_syncs`]).
//!
//! All ranks run in lock-step in one thread: each rank advances until it must wait for a
//! collective some rank has not launched yet, then the next rank runs. Every rank is simulated
//! (no representative-rank shortcut): a 64-rank step of `roberta-50b` takes well under 2
//! seconds (`cargo bench --bench sim`).

use collsched_buckets::BucketKind;
use collsched_schedule::{
    Action, EngineEvent, Fence, Fences, InflightRegistry, PolicyKind, Role, ScheduleError, Scheduler,
    SchedulerConfig, Stream, WaitOn,
};

use super::colls::{Coll, Colls};
use super::config::{Policy, SimConfig, SimError, COMPUTE_QUEUE};
use super::program::{jitter_factor, price, Program};
use super::report::{Lane, SimReport, SimStepStats, Span, SpanKind, Timeline};
use super::step::Call;
use super::workload::Workload;

#[derive(Default, Clone, Copy)]
struct Acc {
    compute: u64,
    exposed: u64,
    host: u64,
    syncs: u64,
    start: u64,
    end: u64,
}

struct SimRank {
    sched: Scheduler,
    reg: InflightRegistry,
    acts: Vec<Action>,
    act_pos: usize,
    in_actions: bool,
    pc: usize,
    step: u32,
    clock: u64,
    seq: u64,
    finished: bool,
    issued: [usize; 2],
    fed: [usize; 2],
    not_before: [u64; 2],
    acc: Acc,
    per_step: Vec<Acc>,
    counters: Vec<collsched_schedule::StepCounters>,
    mem: Vec<(u64, i64)>,
    pending_free: Vec<(u64, usize, Fences)>,
    /// Bytes of each live gathered buffer, by buffer serial (0: none).
    gbuf: Vec<usize>,
    spans: Vec<Span>,
    events: u64,
}

enum Flow {
    Done,
    Blocked,
}

/// A simulation of one workload on one configuration.
pub struct Simulation {
    shared: Program,
    ranks: Vec<SimRank>,
    colls: Colls,
    config: SimConfig,
    workload: String,
    layer_names: Vec<String>,
    model_flops: f64,
}

impl std::fmt::Debug for Simulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation").field("workload", &self.workload).field("config", &self.config).finish()
    }
}

/// Runs `workload` under `config`: see the module docs.
///
/// # Errors
/// [`SimError`]: a bad knob, a workload whose parameters cannot be laid out, a scheduler error
/// (naming rank and step), ranks diverging.
///
/// # Examples
/// ```
/// use collsched::sim::{simulate, SimConfig};
/// use collsched::sim::workload::TransformerConfig;
/// let mut c = TransformerConfig::preset("gpt2-1.5b")?;
/// c.layers = 2;
/// let w = c.workload()?;
/// let topo = collsched::topo::preset("dgx-h100")?;
/// let report = simulate(&w, &SimConfig::for_topology(&topo, 8)?)?;
/// assert!(report.step_ms() >= report.compute_ms());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn simulate(workload: &Workload, config: &SimConfig) -> Result<SimReport, SimError> {
    Simulation::new(workload, config)?.run()
}

impl Simulation {
    /// Builds the layout, plan, program and one scheduler per rank.
    ///
    /// # Errors
    /// As [`simulate`].
    pub fn new(workload: &Workload, config: &SimConfig) -> Result<Simulation, SimError> {
        config.validate()?;
        let (program, input) = Program::compile(workload, config)?;
        // Every rank has its own scheduler and registry: refuse a world whose ranks cannot fit in
        // memory before allocating them (about 0.5 KiB per bucket and 0.1 KiB per parameter and
        // program call per rank, measured on the presets, doubled).
        let per_rank = 512 * input.gather.len() * 2 + 128 * (input.params.len() + program.program.len());
        let need = per_rank.saturating_mul(config.world as usize);
        if let Some(available) = crate::units::memory_available().filter(|&a| need > a) {
            return Err(SimError::Config {
                knob: "world",
                message: format!(
                    "{} ranks would need about {need} bytes ({per_rank} per rank: each has its own scheduler), more \
                     than the {available} bytes available; simulate fewer ranks",
                    config.world
                ),
            });
        }
        let sched_config = SchedulerConfig {
            policy: match config.policy {
                Policy::Trace => PolicyKind::TraceReplay,
                _ => PolicyKind::None,
            },
            prefetch_bytes: config.prefetch_bytes,
            max_inflight: config.max_inflight,
            max_live_bytes: config.max_live_bytes,
            ..SchedulerConfig::default()
        };
        let mut ranks = Vec::with_capacity(config.world as usize);
        for r in 0..config.world {
            let mut reg = InflightRegistry::new(&input);
            let sched = Scheduler::new(&input, r, sched_config.clone(), &mut reg)
                .map_err(|source| SimError::Schedule { rank: r, step: 0, source })?;
            ranks.push(SimRank {
                sched,
                reg,
                acts: Vec::with_capacity(256),
                act_pos: 0,
                in_actions: false,
                pc: 0,
                step: 0,
                clock: 0,
                seq: 0,
                finished: false,
                issued: [0; 2],
                fed: [0; 2],
                not_before: [0; 2],
                acc: Acc::default(),
                per_step: Vec::with_capacity(config.steps as usize),
                counters: Vec::with_capacity(config.steps as usize),
                mem: Vec::new(),
                pending_free: Vec::new(),
                gbuf: Vec::new(),
                spans: Vec::new(),
                events: 0,
            });
        }
        Ok(Simulation {
            shared: program,
            ranks,
            colls: Colls { shared: config.shared_link, ..Colls::default() },
            config: config.clone(),
            workload: workload.name.clone(),
            layer_names: workload.layers.iter().map(|l| l.name.clone()).collect(),
            model_flops: workload.model_flops(),
        })
    }

    /// Runs every step on every rank and reports.
    ///
    /// # Errors
    /// As [`simulate`].
    pub fn run(mut self) -> Result<SimReport, SimError> {
        // A line on stderr every COLLSCHED_PROGRESS_SECS of wall time (a large world runs for
        // minutes), by the slowest rank's steps.
        let steps = self.shared.steps as u64;
        let mut progress = crate::progress::Progress::new(format!("sim ({} ranks)", self.ranks.len()), steps);
        loop {
            let done = self.ranks.iter().map(|r| r.step as u64).min().unwrap_or(steps);
            progress.tick(done.min(steps));
            let mut progressed = false;
            let mut all_done = true;
            for r in 0..self.ranks.len() {
                progressed |= advance(&mut self.shared, &mut self.colls, &mut self.ranks[r])?;
                all_done &= self.ranks[r].finished;
            }
            if all_done {
                break;
            }
            if !progressed {
                let (rank, st) =
                    self.ranks.iter().enumerate().find(|(_, s)| !s.finished).unwrap_or((0, &self.ranks[0]));
                let waiting = match st.acts.get(st.act_pos) {
                    Some(a) => format!("{a:?}"),
                    None => "nothing".into(),
                };
                return Err(SimError::Stalled { rank: rank as u32, step: st.step, waiting });
            }
        }
        Ok(self.report())
    }

    fn report(mut self) -> SimReport {
        let steps_n = self.shared.steps as usize;
        let world = self.ranks.len().max(1) as f64;
        let mut steps = vec![SimStepStats::default(); steps_n];
        let mut prev_end = 0u64;
        for (s, st) in steps.iter_mut().enumerate() {
            let end = self.ranks.iter().map(|r| r.per_step[s].end).max().unwrap_or(0);
            st.step_ns = end.saturating_sub(prev_end);
            prev_end = end;
            st.compute_ns = self.ranks.iter().map(|r| r.per_step[s].compute as f64).sum::<f64>() / world;
            st.exposed_ns = self.ranks.iter().map(|r| r.per_step[s].exposed as f64).sum::<f64>() / world;
            st.host_ns = self.ranks.iter().map(|r| r.per_step[s].host as f64).sum::<f64>() / world;
            st.host_syncs = self.ranks[0].per_step[s].syncs;
            if let Some(c) = self.ranks[0].counters.get(s) {
                st.prefetch_launches = c.prefetch_launches;
                st.prefetch_hits = c.prefetch_hits;
                st.live_overruns = c.live_overruns;
            }
        }
        for c in &self.colls.all {
            let st = &mut steps[(c.step as usize).min(steps_n - 1)];
            match c.id.role {
                Role::Gather => {
                    st.comm_ns[0] += c.end - c.start;
                    st.all_gathers += 1;
                }
                Role::Reduce => {
                    st.comm_ns[1] += c.end - c.start;
                    st.reduce_scatters += 1;
                }
            }
        }
        // Memory: frees take effect when their fences completed.
        let mut peak = 0i64;
        for r in &mut self.ranks {
            let mut mem = std::mem::take(&mut r.mem);
            for (issue, bytes, after) in &r.pending_free {
                let t = after.iter().fold(*issue, |t, f| match f {
                    Fence::Op(id) => self.colls.get(*id).map_or(t, |c| t.max(c.end)),
                    Fence::Engine(_) => t,
                });
                mem.push((t, -(*bytes as i64)));
            }
            mem.sort_unstable();
            let mut live = 0i64;
            for (_, d) in mem {
                live += d;
                peak = peak.max(live);
            }
        }
        let layout = self.shared.plan.layout();
        let timeline = self.shared.timeline.then(|| {
            let mut bucket_bytes =
                vec![0; layout.buckets().iter().map(|b| b.id().0 as usize + 1).max().unwrap_or(0)];
            for b in layout.buckets() {
                bucket_bytes[b.id().0 as usize] = match b.kind() {
                    BucketKind::Gather => b.gathered_bytes(),
                    BucketKind::Grad => b.shard_bytes(),
                } as u64;
            }
            let mut colls: [Vec<Span>; 2] = [Vec::new(), Vec::new()];
            for c in &self.colls.all {
                let (lane, kind) = match c.id.role {
                    Role::Gather => (0, SpanKind::AllGather),
                    Role::Reduce => (1, SpanKind::ReduceScatter),
                };
                colls[lane].push(Span {
                    start_ns: c.start,
                    dur_ns: c.end - c.start,
                    kind,
                    index: c.id.bucket.0,
                    step: c.step,
                    prefetch: c.prefetch,
                });
            }
            Timeline {
                compute: self.ranks.iter_mut().map(|r| std::mem::take(&mut r.spans)).collect(),
                collectives: colls,
                steps: self
                    .ranks
                    .iter()
                    .map(|r| r.per_step.iter().map(|a| (a.start, a.end)).collect())
                    .collect(),
                layer_names: self.layer_names.clone(),
                bucket_bytes,
            }
        });
        SimReport {
            workload: self.workload,
            world: self.config.world,
            policy: self.config.policy,
            boundary: layout.boundary(),
            steps,
            reported_from: usize::from(steps_n > 1),
            peak_gathered_bytes: peak.max(0) as u64,
            model_flops: self.model_flops,
            gather_buckets: layout.gather_buckets().len(),
            grad_buckets: layout.grad_buckets().len(),
            scheduler_events: self.ranks.iter().map(|r| r.events).sum(),
            timeline,
        }
    }
}

fn sched_err(st: &SimRank) -> impl Fn(ScheduleError) -> SimError + '_ {
    move |source| SimError::Schedule { rank: st.sched.rank(), step: st.step, source }
}

/// Feeds `OpDone` for every collective that ended by the rank's clock.
fn feed_done(colls: &Colls, st: &mut SimRank) -> Result<(), SimError> {
    for s in 0..2 {
        while st.fed[s] < colls.resolved[s] {
            let c = &colls.all[colls.lane[s][st.fed[s]] as usize];
            if c.end > st.clock {
                break;
            }
            st.sched.op_done(&mut st.reg, c.id).map_err(|source| SimError::Schedule {
                rank: st.sched.rank(),
                step: st.step,
                source,
            })?;
            st.events += 1;
            st.fed[s] += 1;
        }
    }
    Ok(())
}

/// Runs a rank until it blocks or finishes; returns whether it advanced.
fn advance(sh: &mut Program, colls: &mut Colls, st: &mut SimRank) -> Result<bool, SimError> {
    let mut progressed = false;
    loop {
        if st.finished {
            return Ok(progressed);
        }
        if st.in_actions {
            let from = st.act_pos;
            let flow = exec(sh, colls, st)?;
            progressed |= st.act_pos > from;
            match flow {
                Flow::Blocked => return Ok(progressed),
                Flow::Done => {
                    progressed = true;
                    st.in_actions = false;
                    st.acts.clear();
                    st.act_pos = 0;
                    continue;
                }
            }
        }
        if st.pc == sh.program.len() {
            // The step's last call (its end, or the update after it) is done.
            end_step(sh, st);
            continue;
        }
        let before = progressed;
        progressed = true;
        feed_done(colls, st)?;
        let pc = st.pc;
        st.pc += 1;
        st.acc.syncs += u64::from(sh.syncs[pc]);
        let after = Some(EngineEvent { queue: COMPUTE_QUEUE, seq: st.seq });
        match sh.program[pc] {
            Call::Phase { backward } => {
                if let Some(rules) = &sh.rules {
                    st.sched.set_policy(Box::new(rules[usize::from(backward)].clone()));
                }
            }
            Call::Fetch(l) => {
                st.sched
                    .fetch(&mut st.reg, &sh.layer_params[l as usize], &mut st.acts)
                    .map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::Compute(l, kind) => {
                let mut ns =
                    (sh.compute_ns[pc] * jitter_factor(sh, st.sched.rank(), st.step, pc)).round() as u64;
                if sh.contention > 0.0 {
                    let busy = colls.busy_between(st.clock, st.clock + ns);
                    ns += (sh.contention * busy as f64).round() as u64;
                }
                if sh.timeline && ns > 0 {
                    st.spans.push(Span {
                        start_ns: st.clock,
                        dur_ns: ns,
                        kind,
                        index: l,
                        step: st.step,
                        prefetch: false,
                    });
                }
                st.clock += ns;
                st.acc.compute += ns;
                st.seq += 1;
            }
            Call::Release(l) => {
                st.sched
                    .release(&mut st.reg, &sh.layer_params[l as usize], after, &mut st.acts)
                    .map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::Grad(p) => {
                st.sched.grad_ready(&mut st.reg, p, after, &mut st.acts).map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::EndStep => {
                st.sched.end_step(&mut st.reg, &mut st.acts).map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::Drain => {
                let Some(end) = launched_end(colls, st) else {
                    // Some rank has not launched a collective this rank waits for: come back.
                    st.pc = pc;
                    st.acc.syncs -= u64::from(sh.syncs[pc]);
                    return Ok(before);
                };
                wait_until(sh, st.clock(), end, u32::MAX);
                host(sh, st.clock(), sh.compute_ns[pc].round() as u64, SpanKind::Hook, u32::MAX);
            }
            Call::Host(l) => host(sh, st.clock(), sh.compute_ns[pc].round() as u64, SpanKind::Hook, l),
        }
    }
}

/// When every collective `st` launched has ended, or `None` while one is unresolved.
fn launched_end(colls: &Colls, st: &SimRank) -> Option<u64> {
    let mut end = 0;
    for s in 0..2 {
        if let Some(k) = st.issued[s].checked_sub(1) {
            let c = &colls.all[colls.lane[s][k] as usize];
            if !c.resolved {
                return None;
            }
            end = end.max(c.end);
        }
    }
    Some(end)
}

/// A rank's clock, accounts and spans, borrowed apart from its pending actions.
struct Clock<'a> {
    clock: &'a mut u64,
    acc: &'a mut Acc,
    spans: &'a mut Vec<Span>,
    step: u32,
}

impl SimRank {
    fn clock(&mut self) -> Clock<'_> {
        Clock { clock: &mut self.clock, acc: &mut self.acc, spans: &mut self.spans, step: self.step }
    }
}

/// Stalls the rank until `end` (exposed communication), a wait span on `index`.
fn wait_until(sh: &Program, c: Clock<'_>, end: u64, index: u32) {
    if end > *c.clock {
        // A rank that blocked resumes its wait overhead after the collective's end.
        let stall = end - *c.clock + sh.wait_ns;
        if sh.timeline {
            let kind = SpanKind::Wait;
            c.spans.push(Span {
                start_ns: *c.clock,
                dur_ns: stall,
                kind,
                index,
                step: c.step,
                prefetch: false,
            });
        }
        c.acc.exposed += stall;
        *c.clock += stall;
    }
}

/// Adds `ns` of host time to the rank's timeline, a span of `kind` on `index`.
fn host(sh: &Program, c: Clock<'_>, ns: u64, kind: SpanKind, index: u32) {
    if ns > 0 {
        if sh.timeline {
            c.spans.push(Span { start_ns: *c.clock, dur_ns: ns, kind, index, step: c.step, prefetch: false });
        }
        *c.clock += ns;
        c.acc.host += ns;
    }
}

fn end_step(sh: &Program, st: &mut SimRank) {
    st.acc.end = st.clock;
    st.per_step.push(st.acc);
    st.counters.push(st.sched.last_step().counters.clone());
    st.acc = Acc { start: st.clock, ..Acc::default() };
    st.step += 1;
    st.pc = 0;
    if st.step >= sh.steps {
        st.finished = true;
    }
}

fn lane_of(stream: Stream) -> Option<usize> {
    match stream {
        Stream::AllGather => Some(0),
        Stream::ReduceScatter => Some(1),
        Stream::Compute => None,
    }
}

/// Executes the rank's pending actions from `act_pos`.
fn exec(sh: &mut Program, colls: &mut Colls, st: &mut SimRank) -> Result<Flow, SimError> {
    while st.act_pos < st.acts.len() {
        match &st.acts[st.act_pos] {
            Action::Launch(l) => {
                let mut ready = st.clock;
                for f in &l.after {
                    if let Fence::Op(id) = f {
                        match colls.get(*id) {
                            Some(c) if c.resolved => ready = ready.max(c.end),
                            _ => return Ok(Flow::Blocked),
                        }
                    }
                }
                let gather = l.id.role == Role::Gather;
                if gather && sh.sync_before_gather {
                    // `torch.cuda.synchronize()` before the launch: every collective launched so
                    // far must end first.
                    let Some(end) = launched_end(colls, st) else { return Ok(Flow::Blocked) };
                    let c =
                        Clock { clock: &mut st.clock, acc: &mut st.acc, spans: &mut st.spans, step: st.step };
                    wait_until(sh, c, end, l.id.bucket.0);
                    st.acc.syncs += 1;
                    ready = ready.max(st.clock);
                }
                let host_ns = sh.host_ns[usize::from(!gather)];
                if host_ns > 0 {
                    let c =
                        Clock { clock: &mut st.clock, acc: &mut st.acc, spans: &mut st.spans, step: st.step };
                    host(sh, c, host_ns, SpanKind::Host, l.id.bucket.0);
                    ready = ready.max(st.clock);
                }
                let Some(s) = lane_of(l.stream) else {
                    return Err(SimError::Config {
                        knob: "policy",
                        message: format!("{} was launched on the compute stream", l.id),
                    });
                };
                ready = ready.max(st.not_before[s]);
                let k = st.issued[s];
                st.issued[s] += 1;
                let idx = if let Some(&i) = colls.lane[s].get(k) {
                    let expected = colls.all[i as usize].id;
                    if expected != l.id {
                        return Err(SimError::Diverged {
                            rank: st.sched.rank(),
                            stream: Lane::ALL[s + 1].name(),
                            index: k,
                            expected,
                            got: l.id,
                        });
                    }
                    i as usize
                } else {
                    let [dur, fixed] = price(sh, l.id.bucket, &l.ops);
                    let i = colls.all.len();
                    colls.all.push(Coll {
                        id: l.id,
                        dur,
                        fixed,
                        issued: 0,
                        ready: 0,
                        start: 0,
                        end: 0,
                        resolved: false,
                        prefetch: l.prefetch,
                        step: st.step,
                    });
                    colls.lane[s].push(i as u32);
                    let serial = l.id.serial as usize;
                    if colls.by_serial.len() <= serial {
                        colls.by_serial.resize(serial + 1, u32::MAX);
                    }
                    colls.by_serial[serial] = i as u32;
                    i
                };
                let c = &mut colls.all[idx];
                c.issued += 1;
                c.ready = c.ready.max(ready);
                if c.issued == sh.world {
                    colls.try_resolve(s, sh.world);
                }
                if l.id.role == Role::Gather {
                    let k = l.buffer.serial as usize;
                    if st.gbuf.len() <= k {
                        st.gbuf.resize(k + 1, 0);
                    }
                    st.gbuf[k] = l.bytes;
                    st.mem.push((st.clock, l.bytes as i64));
                }
            }
            Action::Wait { fence, on } => {
                if let Fence::Op(id) = fence {
                    let end = match colls.get(*id) {
                        Some(c) if c.resolved => c.end,
                        _ => return Ok(Flow::Blocked),
                    };
                    match on {
                        WaitOn::Stream(Stream::Compute) | WaitOn::Host => {
                            // Field by field: the action list stays borrowed.
                            let c = Clock {
                                clock: &mut st.clock,
                                acc: &mut st.acc,
                                spans: &mut st.spans,
                                step: st.step,
                            };
                            wait_until(sh, c, end, id.bucket.0);
                        }
                        WaitOn::Stream(other) => {
                            if let Some(s) = lane_of(*other) {
                                st.not_before[s] = st.not_before[s].max(end);
                            }
                        }
                    }
                }
            }
            Action::Free { buffer, after } => {
                if let Some(bytes) = st.gbuf.get_mut(buffer.serial as usize).map(std::mem::take) {
                    if bytes > 0 {
                        // The memory is reusable once every fence completed: now if they are
                        // known, else when the report is made (all collectives resolved by then).
                        let mut t = Some(st.clock);
                        for f in after {
                            if let (Some(tt), Fence::Op(id)) = (t, f) {
                                t = colls.get(*id).filter(|c| c.resolved).map(|c| tt.max(c.end));
                            }
                        }
                        match t {
                            Some(t) => st.mem.push((t, -(bytes as i64))),
                            None => st.pending_free.push((st.clock, bytes, after.clone())),
                        }
                    }
                }
            }
            Action::AllocGrad { .. } | Action::CopyGradIn { .. } | Action::AccumulateGrad { .. } => {}
        }
        st.act_pos += 1;
    }
    Ok(Flow::Done)
}
