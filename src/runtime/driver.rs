//! The driver: runs the scheduler's actions on a [`Backend`] and feeds completions back.
//!
//! | action | what the driver does |
//! |---|---|
//! | `Launch` (gather) | copy this rank's shard into a pool buffer (copy-in), allocate the gathered buffer (and, for a bucket with parameters not contiguous in it, the unpacked buffer), launch the bucket's all-gather (or broadcast) as one group on the all-gather stream after the fences |
//! | `Launch` (reduce) | copy the bucket's host gradient buffer (in the reduction dtype) into a pool buffer, launch the reduce-scatter (or all-reduce) on the reduce-scatter stream; for hybrid sharding the all-reduce across groups is chained right behind it on the same stream (`Backend::launch_then`, no host wait) |
//! | `Wait` | host wait (with the backend's timeout) for the launch, then finish it |
//! | `Free` | gather: drop the launch if still in flight and unviewed (the backend frees its buffers when it completes), else give the gathered and unpacked buffers back to the pool after the fences: the engine events the consumers gave to `release_after` and the unpack's event (one pending event: `backend.free(buf, Some(&event))`; several: kept in a deferred list until all but one completed); gradient: nothing (the host buffer is reused) |
//! | `AllocGrad` | zero the bucket's host gradient buffer (reused across steps) |
//! | `CopyGradIn` | copy-in of the fresh gradient (cast from the parameters' dtype to the reduction dtype per run), the accumulator, or both added, into the gradient buffer |
//! | `AccumulateGrad` | add into the parameter's full-size accumulator, in the reduction dtype (the kernels' `accumulate`; through f32 when the dtypes differ) |
//!
//! Engine events (the scheduler's [`EngineEvent`]s) are named per coordinator (one engine
//! queue each, increasing sequence numbers) and mapped back to the backend events the engine
//! gave, per gather bucket (the latest per queue, as the scheduler keeps them). The fence of
//! a `CopyGradIn` / `AccumulateGrad` is complete when the action runs: `grad_ready_after`
//! waited for it before the scheduler saw the gradient.
//!
//! *Finishing* a gather keeps its gathered buffer until its `Free` (views of parameters that
//! are one contiguous run of it point straight into it) and unpacks the other parameters once,
//! with the backend's `unpack` (the kernels' `copy_out`, straight from the gathered buffer: on
//! the calling thread for host memory, on the all-gather stream for a device, with the compute
//! stream waiting for it), into the unpacked buffer allocated with the gathered one. Finishing a
//! reduction reads the reduced shard into the model state's gradient shards. Each finish
//! feeds `OpDone` to the scheduler. Launches are finished by explicit waits (`Wait` actions,
//! a fetch that needs the data, `end_step`) or, without blocking, by
//! [`Coordinator::poll`](super::Coordinator::poll).
//!
//! Steady-state steps allocate nothing here: host buffers grow once and are reused, backend
//! buffers come from the backend's pool, the per-bucket consumer lists and the deferred list
//! keep their capacity, and the `Vec`s of collectives handed to the backend come back with the
//! completed launch and are reused.

use std::time::{Duration, Instant};

use collsched_buckets::{BucketId, ParamId};
use collsched_kernels::{accumulate, cast, copy_in, CopySegment, ElemType, KernelError};
use collsched_schedule::{
    Action, EngineEvent, Fence, GradSource, Launch, LaunchId, Role, Scheduler, Stream as SchedStream,
};
use smallvec::SmallVec;

use super::state::{Bytes, RankState};
use super::tables::{GatherTables, GradTables};
use super::RuntimeError;
use crate::backend::{
    Backend, BackendEvent, ChainError, Chained, Collective, InFlight, LaunchError, Stream, WaitError,
};

fn stream_of(s: SchedStream) -> Stream {
    match s {
        SchedStream::AllGather => Stream::AllGather,
        SchedStream::ReduceScatter => Stream::ReduceScatter,
        SchedStream::Compute => Stream::Compute,
    }
}

struct PendingGather<B: Backend> {
    id: LaunchId,
    g: usize,
    flight: InFlight<B>,
    /// The unpacked buffer, allocated with the gathered one (buckets with parameters that are
    /// not contiguous in the gathered buffer).
    unpacked: Option<B::Buffer>,
}

/// A finished gather, kept until its `Free`: what `fetch` hands out views of.
pub(crate) struct Gathered<B: Backend> {
    /// The launch that gathered it.
    pub(crate) id: LaunchId,
    /// The gathered buffer (views of contiguous parameters point into it).
    pub(crate) buffer: B::Buffer,
    /// The unpacked copy of the other parameters, if the bucket has any.
    pub(crate) unpacked: Option<B::Buffer>,
    /// The unpack's event when it runs on a stream (device backends): the compute stream
    /// already waits for it; host reads wait for it first. `None`: complete.
    pub(crate) ready: Option<B::Event>,
}

/// Buffers whose free waits for more than one event (the backend's `free` takes one): kept
/// here until all but one completed.
struct Deferred<B: Backend> {
    buffers: SmallVec<[B::Buffer; 2]>,
    after: SmallVec<[B::Event; 2]>,
}

/// The gather side of the driver, shared by every coordinator of a rank on a model (it lives
/// in the model state, because gathered buckets are shared through the registry).
pub(crate) struct GatherSide<B: Backend> {
    pending: Vec<PendingGather<B>>,
    /// Per gather bucket: the finished gather, kept until its `Free`.
    pub(crate) held: Vec<Option<Gathered<B>>>,
    /// Per gather bucket: the engine's consumer events given since it was last freed (the
    /// latest per engine queue), which its `Free` names.
    consumers: Vec<Vec<(EngineEvent, B::Event)>>,
    deferred: Vec<Deferred<B>>,
    /// Engine queue id of the next coordinator (one queue per coordinator).
    next_queue: u32,
    spare: Vec<Vec<Collective<B::Buffer>>>,
    events: Vec<B::Event>,
}

impl<B: Backend> GatherSide<B> {
    pub(crate) fn new(tables: &GatherTables) -> Self {
        let n = tables.gather.len();
        GatherSide {
            pending: Vec::with_capacity(n),
            held: (0..n).map(|_| None).collect(),
            consumers: (0..n).map(|_| Vec::with_capacity(2)).collect(),
            deferred: Vec::with_capacity(n),
            next_queue: 0,
            spare: Vec::with_capacity(n),
            events: Vec::with_capacity(8),
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The finished gather of bucket `g` if it is launch `id`'s.
    pub(crate) fn gathered(&self, g: usize, id: Option<LaunchId>) -> Option<&Gathered<B>> {
        self.held.get(g)?.as_ref().filter(|h| Some(h.id) == id)
    }

    /// A new engine queue id (one per coordinator).
    pub(crate) fn new_queue(&mut self) -> u32 {
        let q = self.next_queue;
        self.next_queue += 1;
        q
    }

    /// Records that the engine's use of bucket `g` ends at `event` (named `id` for the
    /// scheduler), keeping the latest event per engine queue.
    pub(crate) fn add_consumer(&mut self, g: usize, id: EngineEvent, event: &B::Event) {
        let list = &mut self.consumers[g];
        match list.iter_mut().find(|(e, _)| e.queue == id.queue) {
            Some(slot) if slot.0.seq < id.seq => *slot = (id, event.clone()),
            Some(_) => {}
            None => list.push((id, event.clone())),
        }
    }

    /// Frees buffers of deferred frees whose events (all but one) completed.
    fn reap(&mut self, be: &B) {
        let mut i = 0;
        while i < self.deferred.len() {
            let d = &mut self.deferred[i];
            d.after.retain(|e| matches!(e.query(), Ok(false)));
            if d.after.len() > 1 {
                i += 1;
                continue;
            }
            let d = self.deferred.swap_remove(i);
            for b in d.buffers {
                be.free(b, d.after.first());
            }
        }
    }

    /// At teardown (the rank's streams synchronized): every buffer back to the pool, waiting
    /// (at most the backend's timeout) for deferred frees; a buffer whose events did not
    /// complete is leaked rather than handed back under a reader.
    pub(crate) fn shut_down(&mut self, be: &B) {
        for d in self.deferred.drain(..) {
            if d.after.iter().all(|e| e.wait(be.timeout()).is_ok()) {
                d.buffers.into_iter().for_each(|b| be.free(b, None));
            } else {
                tracing::warn!(target: "collsched::alloc", rank = be.rank(),
                    "leaking gathered buffers whose consumers' events did not complete at teardown");
                std::mem::forget(d.buffers);
            }
        }
    }
}

/// Frees `buffers` once every event of `after` completed (all at once when there is at most
/// one pending event; else through the deferred list).
fn retire<B: Backend>(
    side: &mut GatherSide<B>,
    be: &B,
    buffers: SmallVec<[B::Buffer; 2]>,
    mut after: SmallVec<[B::Event; 2]>,
) {
    after.retain(|e| matches!(e.query(), Ok(false)));
    if after.len() <= 1 {
        for b in buffers {
            be.free(b, after.first());
        }
    } else {
        side.deferred.push(Deferred { buffers, after });
    }
}

struct PendingReduce<B: Backend> {
    id: LaunchId,
    j: usize,
    /// Hybrid sharding: the event of the in-group reduce-scatter, which `flight` (the
    /// cross-group all-reduce chained behind it) follows; tells which stage failed.
    first: Option<B::Event>,
    flight: InFlight<B>,
}

/// Driver counters of the step in progress (the scheduler counts the rest).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// Collectives (group launches) issued on the backend: one per gather, one per reduction
    /// stage (two for hybrid sharding's reduce-scatter + all-reduce).
    pub collectives: u64,
    /// Bytes the collectives carried: the gathered buffer of a gather, the input of a
    /// reduction stage.
    pub bytes_moved: u64,
    /// Time the host spent blocked waiting for collectives.
    pub wait_time: Duration,
}

/// The per-coordinator part of the driver: the action list, the reductions in flight, the
/// host gradient buffers.
pub(crate) struct Driver<B: Backend> {
    pub(crate) actions: Vec<Action>,
    reduces: Vec<PendingReduce<B>>,
    /// Per gradient bucket: the full-size gradient buffer, in the reduction dtype.
    grad_staging: Vec<Bytes>,
    /// f32 scratch for mixed-dtype accumulation (grows once, reused).
    wide: [Bytes; 2],
    spare: Vec<Vec<Collective<B::Buffer>>>,
    events: Vec<B::Event>,
    pub(crate) counters: DriverCounters,
}

/// Everything a run of actions needs, borrowed for the call.
pub(crate) struct Ctx<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) tables: &'a GatherTables,
    pub(crate) grad: &'a std::sync::Arc<GradTables>,
    pub(crate) st: &'a mut RankState<B>,
    pub(crate) sched: &'a mut Scheduler,
}

fn backend_err(
    rank: usize,
    op: &'static str,
    bucket: Option<BucketId>,
) -> impl FnOnce(crate::backend::BackendError) -> RuntimeError {
    move |source| RuntimeError::Backend { rank, op, bucket, source }
}

impl<B: Backend> Driver<B> {
    pub(crate) fn new(n_grad: usize) -> Self {
        Driver {
            actions: Vec::with_capacity(256),
            reduces: Vec::with_capacity(n_grad.max(4)),
            grad_staging: Vec::new(),
            wide: [Bytes::default(), Bytes::default()],
            spare: Vec::with_capacity(n_grad.max(4)),
            events: Vec::with_capacity(8),
            counters: DriverCounters::default(),
        }
    }

    /// Runs `self.actions` in order (and clears them). `fresh` is the gradient handed to the
    /// `grad_ready` call that produced them.
    pub(crate) fn run(&mut self, cx: &mut Ctx<'_, B>, fresh: Option<&[u8]>) -> Result<(), RuntimeError> {
        let actions = std::mem::take(&mut self.actions);
        let mut result = Ok(());
        for a in &actions {
            // Run every action even after a failure would leave buffers dangling; stop at the
            // first failure instead and report it (the scheduler's state is already advanced,
            // the backend's failure is sticky and the next call reports it too).
            if let Err(e) = self.run_one(cx, a, fresh) {
                result = Err(e);
                break;
            }
        }
        self.actions = actions;
        self.actions.clear();
        result
    }

    fn run_one(&mut self, cx: &mut Ctx<'_, B>, a: &Action, fresh: Option<&[u8]>) -> Result<(), RuntimeError> {
        let rank = cx.tables.rank;
        match a {
            Action::Launch(l) if l.id.role == Role::Gather => launch_gather(cx, l, &mut self.counters),
            Action::Launch(l) => self.launch_reduce(cx, l),
            Action::Wait { fence: Fence::Op(id), .. } => match id.role {
                Role::Gather => finish_gather(cx, *id, true, &mut self.counters).map(|_| ()),
                Role::Reduce => self.finish_reduce(cx, *id, true).map(|_| ()),
            },
            // The scheduler puts engine events on frees and gradient copies (handled there),
            // never on waits.
            Action::Wait { fence: Fence::Engine(_), .. } => Ok(()),
            Action::Free { buffer, after } => match cx.tables.position(buffer.bucket) {
                Some(g) => free_gathered(cx, g, buffer.serial, after, &mut self.counters),
                None => Ok(()),
            },
            Action::AllocGrad { buffer, .. } => {
                // The scheduler sizes the buffer in the bucket's dtype; it holds the reduction
                // dtype.
                let j = self.grad_position(cx, buffer.bucket)?;
                if self.grad_staging.len() < cx.grad.grad.len() {
                    self.grad_staging.resize_with(cx.grad.grad.len(), Bytes::default);
                }
                self.grad_staging[j].reset_zeroed(cx.grad.grad[j].gathered_bytes);
                Ok(())
            }
            Action::CopyGradIn { param, buffer, source, .. } => {
                let j = self.grad_position(cx, buffer.bucket)?;
                let slot = cx.grad.params[param.index()];
                let (lo, hi) = slot.copy_in;
                let segs = &cx.grad.copy_in[lo as usize..hi as usize];
                let t = &cx.grad.grad[j];
                let st = &mut *cx.st;
                let p = param.index();
                // The fresh gradient is in the parameter's dtype, the accumulator in the
                // reduction dtype; both land in the gradient buffer in the reduction dtype.
                let (src, src_elem): (&[u8], ElemType) = match source {
                    GradSource::Fresh => (fresh.ok_or_else(|| no_fresh(rank, *param))?, t.param_elem),
                    GradSource::FreshPlusAccumulated => {
                        let f = fresh.ok_or_else(|| no_fresh(rank, *param))?;
                        let acc = st.accumulators[p].as_bytes_mut();
                        accumulate_mixed(t.elem, acc, t.param_elem, f, &mut self.wide)
                            .map_err(|e| kernel_err(rank, *param, "accumulate", e))?;
                        st.accumulated[p] = false;
                        (st.accumulators[p].as_bytes(), t.elem)
                    }
                    GradSource::Accumulated => {
                        st.accumulated[p] = false;
                        (st.accumulators[p].as_bytes(), t.elem)
                    }
                };
                copy_in_cast(self.grad_staging[j].as_bytes_mut(), t.elem, src, src_elem, segs)
                    .map_err(|e| kernel_err(rank, *param, "copy_in", e))
            }
            Action::AccumulateGrad { param, .. } => {
                let f = fresh.ok_or_else(|| no_fresh(rank, *param))?;
                let p = param.index();
                let j = cx.grad.params[p].bucket as usize;
                let t = cx.grad.grad.get(j).ok_or_else(|| RuntimeError::Plan {
                    rank,
                    what: format!("parameter id {param} has no gradient bucket in the driver's tables"),
                })?;
                let st = &mut *cx.st;
                if st.accumulated[p] {
                    accumulate_mixed(
                        t.elem,
                        st.accumulators[p].as_bytes_mut(),
                        t.param_elem,
                        f,
                        &mut self.wide,
                    )
                    .map_err(|e| kernel_err(rank, *param, "accumulate", e))
                } else {
                    // First micro-batch: the accumulator is the gradient itself in the
                    // reduction dtype (bit for bit `acc = grad` when the dtypes agree).
                    let numel = f.len() / t.param_elem.size();
                    st.accumulators[p].reset_zeroed(numel * t.elem.size());
                    cast_into(t.param_elem, f, t.elem, st.accumulators[p].as_bytes_mut())
                        .map_err(|e| kernel_err(rank, *param, "cast", e))?;
                    st.accumulated[p] = true;
                    Ok(())
                }
            }
        }
    }

    fn grad_position(&self, cx: &Ctx<'_, B>, bucket: BucketId) -> Result<usize, RuntimeError> {
        cx.grad.position(bucket).ok_or_else(|| RuntimeError::Plan {
            rank: cx.tables.rank,
            what: format!("gradient bucket {bucket} of an action is not in the driver's tables"),
        })
    }

    /// Launches a gradient bucket's reduction on the reduce-scatter stream: the gradient
    /// buffer (in the reduction dtype) into a pool buffer, the reduce-scatter (or all-reduce);
    /// for hybrid sharding the cross-group all-reduce is chained behind it in stream order
    /// (no host wait), its input the reduce-scatter's output.
    fn launch_reduce(&mut self, cx: &mut Ctx<'_, B>, l: &Launch) -> Result<(), RuntimeError> {
        let rank = cx.tables.rank;
        let j = self.grad_position(cx, l.buffer.bucket)?;
        let t = &cx.grad.grad[j];
        let be = cx.backend;
        let err = |op| backend_err(rank, op, Some(t.id));
        let first_op = t.stages[0].kind.name();
        let mut input = be.alloc(t.gathered_bytes).map_err(err(first_op))?;
        let staged = self.grad_staging.get(j).map_or(&[][..], Bytes::as_bytes);
        be.write_from_host(&mut input, 0, staged).map_err(err("reduce_scatter copy-in"))?;
        let output = be.alloc(t.shard_bytes).map_err(err(first_op))?;
        let mut ops = self.spare.pop().unwrap_or_default();
        ops.push(Collective { desc: t.stages[0].clone(), input: Some(input), output });
        self.events.clear();
        fences(&cx.st.gather, &self.reduces, &l.after, &mut self.events);
        let stream = stream_of(l.stream);
        let mut flight = launch(be, stream, &self.events, ops, rank, t.id, first_op)?;
        self.counters.collectives += 1;
        self.counters.bytes_moved += t.gathered_bytes as u64;
        let mut first = None;
        for desc in &t.stages[1..] {
            let op = desc.kind.name();
            let output = be.alloc(t.shard_bytes).map_err(err(op))?;
            let event = flight.event().clone();
            // Same stream, right behind the previous stage: the stream's order is the fence.
            flight =
                match be.launch_then(flight, stream, [Chained { desc: desc.clone(), input_of: 0, output }]) {
                    Ok(f) => f,
                    Err(refused) => {
                        let ChainError { error, first, outputs } = *refused;
                        drop(first); // its buffers go back to the pool once it completed
                        for b in outputs {
                            be.free(b, None);
                        }
                        return Err(RuntimeError::Backend { rank, op, bucket: Some(t.id), source: error });
                    }
                };
            first.get_or_insert(event);
            self.counters.collectives += 1;
            self.counters.bytes_moved += t.shard_bytes as u64;
        }
        self.reduces.push(PendingReduce { id: l.id, j, first, flight });
        Ok(())
    }

    /// Finishes reduction `id` (blocking, or only if complete): the reduced shard into the
    /// model state's gradient shards, `OpDone`. Returns whether it finished (or had already).
    pub(crate) fn finish_reduce(
        &mut self,
        cx: &mut Ctx<'_, B>,
        id: LaunchId,
        block: bool,
    ) -> Result<bool, RuntimeError> {
        let rank = cx.tables.rank;
        let Some(k) = self.reduces.iter().position(|p| p.id == id) else { return Ok(true) };
        let p = self.reduces.swap_remove(k);
        let t = &cx.grad.grad[p.j];
        let mut ops = match wait_flight(p.flight, block, cx.backend, &mut self.counters) {
            Ok(ops) => ops,
            Err(Waited::Pending(flight)) => {
                self.reduces.push(PendingReduce { flight, ..p });
                let last = self.reduces.len() - 1;
                self.reduces.swap(k, last);
                return Ok(false);
            }
            Err(Waited::Failed(source)) => {
                // Name the stage that failed: a chained all-reduce fails with its
                // reduce-scatter, whose own event then carries the first failure (or is still
                // pending when the wait timed out).
                let (op, source) = match p.first.as_ref().map(BackendEvent::query) {
                    Some(Err(first)) => (t.stages[0].kind.name(), first),
                    Some(Ok(false)) => (t.stages[0].kind.name(), source),
                    _ => (t.stages.last().map_or("reduce_scatter", |d| d.kind.name()), source),
                };
                return Err(RuntimeError::Backend { rank, op, bucket: Some(t.id), source });
            }
        };
        let Some(c) = ops.pop() else { return Ok(true) };
        for o in ops.drain(..) {
            o.input.into_iter().for_each(|b| cx.backend.free(b, None));
            cx.backend.free(o.output, None);
        }
        self.spare.push(ops);
        if let Some(input) = c.input {
            cx.backend.free(input, None);
        }
        let st = &mut *cx.st;
        let n = cx.grad.grad.len();
        let same = st.grad_tables.as_ref().is_some_and(|g| std::sync::Arc::ptr_eq(g, cx.grad));
        if !same {
            st.grad_tables = Some(std::sync::Arc::clone(cx.grad));
            st.grad_valid.clear();
        }
        if st.grad_shards.len() < n {
            st.grad_shards.resize_with(n, Bytes::default);
        }
        st.grad_valid.resize(n, false);
        st.grad_shards[p.j].reset_zeroed(t.shard_bytes);
        let r = cx.backend.read_to_host(&c.output, 0, st.grad_shards[p.j].as_bytes_mut());
        cx.backend.free(c.output, None);
        r.map_err(backend_err(rank, "reduce_scatter copy-out", Some(t.id)))?;
        st.grad_valid[p.j] = true;
        cx.sched.op_done(&mut st.registry, id)?;
        Ok(true)
    }

    /// Finishes every reduction that already completed, without blocking.
    pub(crate) fn poll_reduces(&mut self, cx: &mut Ctx<'_, B>) -> Result<(), RuntimeError> {
        let mut i = 0;
        while i < self.reduces.len() {
            let id = self.reduces[i].id;
            if self.finish_reduce(cx, id, false)? {
                continue;
            }
            i += 1;
        }
        Ok(())
    }

    /// Waits for every reduction in flight.
    pub(crate) fn drain_reduces(&mut self, cx: &mut Ctx<'_, B>) -> Result<(), RuntimeError> {
        while let Some(p) = self.reduces.first() {
            let id = p.id;
            self.finish_reduce(cx, id, true)?;
        }
        Ok(())
    }

    /// Reductions in flight.
    pub(crate) fn reduces_in_flight(&self) -> usize {
        self.reduces.len()
    }
}

/// `dst` (in `dst_elem`) = `src` (in `src_elem`), rounded to nearest even; a copy when the
/// types agree.
fn cast_into(src_elem: ElemType, src: &[u8], dst_elem: ElemType, dst: &mut [u8]) -> Result<(), KernelError> {
    if src_elem == dst_elem && src.len() == dst.len() {
        dst.copy_from_slice(src);
        return Ok(());
    }
    cast(src_elem, src, dst_elem, dst)
}

/// Copy-in with a cast: the runs `segs` of `src` (in `src_elem`) into `packed` (in
/// `packed_elem`). The kernels' `copy_in` when the types agree; else one cast per run,
/// checked like `copy_in` (nothing is written if a run overruns).
fn copy_in_cast(
    packed: &mut [u8],
    packed_elem: ElemType,
    src: &[u8],
    src_elem: ElemType,
    segs: &[CopySegment],
) -> Result<(), KernelError> {
    if packed_elem == src_elem {
        return copy_in(packed, &[src], segs, src_elem.size());
    }
    let (ps, ss) = (packed_elem.size(), src_elem.size());
    let oob = |segment: usize, s: &CopySegment, side: &str, offset: usize, available: usize| {
        KernelError::SegmentOutOfBounds {
            kernel: "copy_in",
            segment,
            side: side.to_string(),
            offset,
            len: s.len,
            available,
        }
    };
    for (i, s) in segs.iter().enumerate() {
        if s.buffer != 0 {
            return Err(KernelError::NoSuchBuffer {
                kernel: "copy_in",
                segment: i,
                buffer: s.buffer,
                count: 1,
            });
        }
        if s.buffer_offset.checked_add(s.len).is_none_or(|end| end > src.len() / ss) {
            return Err(oob(i, s, "buffer 0", s.buffer_offset, src.len() / ss));
        }
        if s.packed_offset.checked_add(s.len).is_none_or(|end| end > packed.len() / ps) {
            return Err(oob(i, s, "packed", s.packed_offset, packed.len() / ps));
        }
    }
    for s in segs {
        let from = &src[s.buffer_offset * ss..(s.buffer_offset + s.len) * ss];
        cast(src_elem, from, packed_elem, &mut packed[s.packed_offset * ps..(s.packed_offset + s.len) * ps])?;
    }
    Ok(())
}

/// no_sync accumulation in the reduction dtype: `acc` (in `acc_elem`) += `src` (in
/// `src_elem`), the sum computed in f32 and rounded to `acc_elem` (the kernels' `accumulate`
/// when the types agree). `wide` is f32 scratch.
fn accumulate_mixed(
    acc_elem: ElemType,
    acc: &mut [u8],
    src_elem: ElemType,
    src: &[u8],
    wide: &mut [Bytes; 2],
) -> Result<(), KernelError> {
    if acc_elem == src_elem {
        return accumulate(acc_elem, acc, src);
    }
    let wide_bytes = acc.len() / acc_elem.size() * 4;
    let [wa, wb] = wide;
    let src: &[u8] = if src_elem == ElemType::F32 {
        src
    } else {
        wb.reset_zeroed(wide_bytes);
        cast(src_elem, src, ElemType::F32, wb.as_bytes_mut())?;
        wb.as_bytes()
    };
    if acc_elem == ElemType::F32 {
        return accumulate(ElemType::F32, acc, src);
    }
    wa.reset_zeroed(wide_bytes);
    cast(acc_elem, acc, ElemType::F32, wa.as_bytes_mut())?;
    accumulate(ElemType::F32, wa.as_bytes_mut(), src)?;
    cast(ElemType::F32, wa.as_bytes(), acc_elem, acc)
}

fn no_fresh(rank: usize, param: ParamId) -> RuntimeError {
    RuntimeError::Param {
        rank,
        param: Some(format!("id {param}")),
        what: "the scheduler asked for a fresh gradient outside grad_ready (a driver bug)".into(),
    }
}

fn kernel_err(rank: usize, param: ParamId, kernel: &str, e: collsched_kernels::KernelError) -> RuntimeError {
    RuntimeError::Param { rank, param: Some(format!("id {param}")), what: format!("{kernel}: {e}") }
}

/// Backend events for a launch's fences (launches still in flight; finished ones need no
/// wait, engine events are complete by construction).
fn fences<B: Backend>(
    side: &GatherSide<B>,
    reduces: &[PendingReduce<B>],
    after: &[Fence],
    out: &mut Vec<B::Event>,
) {
    for f in after {
        if let Fence::Op(id) = f {
            if let Some(p) = side.pending.iter().find(|p| p.id == *id) {
                out.push(p.flight.event().clone());
            } else if let Some(p) = reduces.iter().find(|p| p.id == *id) {
                out.push(p.flight.event().clone());
            }
        }
    }
}

fn launch<B: Backend>(
    be: &B,
    stream: Stream,
    after: &[B::Event],
    ops: Vec<Collective<B::Buffer>>,
    rank: usize,
    bucket: BucketId,
    op: &'static str,
) -> Result<InFlight<B>, RuntimeError> {
    match be.launch_group(stream, after, ops) {
        Ok(f) => Ok(f),
        Err(LaunchError { error, ops }) => {
            for c in ops {
                if let Some(i) = c.input {
                    be.free(i, None);
                }
                be.free(c.output, None);
            }
            Err(RuntimeError::Backend { rank, op, bucket: Some(bucket), source: error })
        }
    }
}

enum Waited<B: Backend> {
    Pending(InFlight<B>),
    Failed(crate::backend::BackendError),
}

fn wait_flight<B: Backend>(
    flight: InFlight<B>,
    block: bool,
    be: &B,
    counters: &mut DriverCounters,
) -> Result<Vec<Collective<B::Buffer>>, Waited<B>> {
    let r = if block {
        let start = Instant::now();
        let r = if matches!(flight.is_done(), Ok(true)) {
            flight.try_finish()
        } else {
            flight.wait(be.timeout())
        };
        counters.wait_time += start.elapsed();
        r
    } else {
        match flight.is_done() {
            Ok(false) => return Err(Waited::Pending(flight)),
            _ => flight.try_finish(),
        }
    };
    match r {
        Ok(ops) => Ok(ops),
        Err(WaitError::TimedOut { in_flight, waited }) => {
            if block {
                drop(in_flight);
                Err(Waited::Failed(crate::backend::BackendError::EventTimeout { waited }))
            } else {
                Err(Waited::Pending(in_flight))
            }
        }
        Err(WaitError::Failed { error, ops }) => {
            for c in ops {
                if let Some(i) = c.input {
                    be.free(i, None);
                }
                be.free(c.output, None);
            }
            Err(Waited::Failed(error))
        }
    }
}

fn launch_gather<B: Backend>(
    cx: &mut Ctx<'_, B>,
    l: &Launch,
    counters: &mut DriverCounters,
) -> Result<(), RuntimeError> {
    let rank = cx.tables.rank;
    let g = cx.tables.position(l.buffer.bucket).ok_or_else(|| RuntimeError::Plan {
        rank,
        what: format!("gather launch names bucket {}, which is not a gather bucket", l.buffer.bucket),
    })?;
    let t = &cx.tables.gather[g];
    let be = cx.backend;
    let err = |op| backend_err(rank, op, Some(t.id));
    // Deferred frees that completed go back to the pool first, so that they can be reused.
    cx.st.gather.reap(be);
    let input = if t.sends {
        let mut b = be.alloc(t.shard_bytes).map_err(err("all_gather"))?;
        if let Err(e) = be.write_from_host(&mut b, 0, cx.st.shards[g].as_bytes()) {
            be.free(b, None);
            return Err(err("all_gather copy-in")(e));
        }
        Some(b)
    } else {
        None
    };
    // The gathered buffer and the unpacked one are taken together (the scheduler counts both).
    let buffers = be.alloc(t.gathered_bytes).and_then(|out| match t.unpacked_bytes {
        0 => Ok((out, None)),
        n => match be.alloc(n) {
            Ok(u) => Ok((out, Some(u))),
            Err(e) => {
                be.free(out, None);
                Err(e)
            }
        },
    });
    let (output, unpacked) = match buffers {
        Ok(b) => b,
        Err(e) => {
            if let Some(i) = input {
                be.free(i, None);
            }
            return Err(err("all_gather")(e));
        }
    };
    let side = &mut cx.st.gather;
    let mut ops = side.spare.pop().unwrap_or_default();
    ops.push(Collective { desc: t.desc.clone(), input, output });
    let mut events = std::mem::take(&mut side.events);
    events.clear();
    fences(side, &[], &l.after, &mut events);
    let r = launch(be, stream_of(l.stream), &events, ops, rank, t.id, "all_gather");
    side.events = events;
    let flight = match r {
        Ok(f) => f,
        Err(e) => {
            if let Some(u) = unpacked {
                be.free(u, None);
            }
            return Err(e);
        }
    };
    counters.collectives += 1;
    counters.bytes_moved += t.gathered_bytes as u64;
    side.pending.push(PendingGather { id: l.id, g, flight, unpacked });
    Ok(())
}

/// Finishes gather `id` (blocking, or only if complete): unpacks the parameters that are not
/// contiguous in the gathered buffer (straight from it, on the all-gather stream; the compute
/// stream waits for it), keeps both buffers until the bucket's `Free`, reports `OpDone`.
/// Returns whether it finished (or had already).
pub(crate) fn finish_gather<B: Backend>(
    cx: &mut Ctx<'_, B>,
    id: LaunchId,
    block: bool,
    counters: &mut DriverCounters,
) -> Result<bool, RuntimeError> {
    let rank = cx.tables.rank;
    let be = cx.backend;
    let side = &mut cx.st.gather;
    let Some(k) = side.pending.iter().position(|p| p.id == id) else { return Ok(true) };
    let p = side.pending.swap_remove(k);
    let g = p.g;
    let t = &cx.tables.gather[g];
    let mut unpacked = p.unpacked;
    let mut ops = match wait_flight(p.flight, block, be, counters) {
        Ok(ops) => ops,
        Err(Waited::Pending(flight)) => {
            side.pending.push(PendingGather { id, g, flight, unpacked });
            return Ok(false);
        }
        Err(Waited::Failed(source)) => {
            if let Some(u) = unpacked {
                be.free(u, None);
            }
            return Err(RuntimeError::Backend { rank, op: "all_gather", bucket: Some(t.id), source });
        }
    };
    let mut gathered = None;
    for c in ops.drain(..) {
        if let Some(i) = c.input {
            be.free(i, None);
        }
        match gathered {
            None => gathered = Some(c.output),
            Some(_) => be.free(c.output, None),
        }
    }
    side.spare.push(ops);
    let Some(buffer) = gathered else {
        return Err(RuntimeError::Plan {
            rank,
            what: format!("all_gather(bucket {}) returned no buffer", t.id),
        });
    };
    let unpack = |u: &mut B::Buffer| -> Result<Option<B::Event>, crate::backend::BackendError> {
        let ready = be.unpack(Stream::AllGather, u, &buffer, &t.copy_out, t.elem.size())?;
        if let Some(e) = &ready {
            // The engine reads the views on the compute stream.
            be.wait_event(Stream::Compute, e)?;
        }
        Ok(ready)
    };
    let ready = match unpacked.as_mut().map(unpack).transpose() {
        Ok(r) => r.flatten(),
        Err(source) => {
            // Nobody saw these buffers yet; the fetch reports the failure.
            be.free(buffer, None);
            if let Some(u) = unpacked {
                be.free(u, None);
            }
            return Err(RuntimeError::Backend { rank, op: "all_gather unpack", bucket: Some(t.id), source });
        }
    };
    if let Some(old) = side.held[g].replace(Gathered { id, buffer, unpacked, ready }) {
        // A gather of the bucket that was never freed (a driver bug): nothing views it.
        let ready = old.ready.clone().into_iter().collect();
        retire(side, be, old.buffers(), ready);
    }
    cx.sched.op_done(&mut cx.st.registry, id)?;
    Ok(true)
}

impl<B: Backend> Gathered<B> {
    fn buffers(self) -> SmallVec<[B::Buffer; 2]> {
        let mut v = SmallVec::new();
        v.push(self.buffer);
        v.extend(self.unpacked);
        v
    }
}

/// The scheduler's `Free` of gather bucket `g`'s launch `serial`: an unfinished gather (an
/// unused prefetch) is dropped (the backend frees its buffers when it completes); a finished
/// one's buffers go back to the pool after the consumers' engine events and the unpack.
fn free_gathered<B: Backend>(
    cx: &mut Ctx<'_, B>,
    g: usize,
    serial: u64,
    after: &[Fence],
    counters: &mut DriverCounters,
) -> Result<(), RuntimeError> {
    let be = cx.backend;
    let engine = after.iter().any(|f| matches!(f, Fence::Engine(_)));
    let side = &mut cx.st.gather;
    if let Some(k) = side.pending.iter().position(|p| p.id.serial == serial) {
        if !engine {
            // Still in flight and never viewed: dropping it defers its buffers to the pool until
            // the collective completed; the unpacked buffer was not touched yet.
            let p = side.pending.swap_remove(k);
            drop(p.flight);
            if let Some(u) = p.unpacked {
                be.free(u, None);
            }
            side.consumers[g].clear();
            return Ok(());
        }
        // Consumers' events with a gather still in flight: finish it, then free as below.
        let id = side.pending[k].id;
        finish_gather(cx, id, true, counters)?;
    }
    let side = &mut cx.st.gather;
    let Some(held) = side.held[g].take_if(|h| h.id.serial == serial) else {
        side.consumers[g].clear();
        return Ok(());
    };
    let mut events: SmallVec<[B::Event; 2]> = SmallVec::new();
    let mut missing = None;
    for f in after {
        if let Fence::Engine(e) = f {
            match side.consumers[g].iter().find(|(id, _)| id == e) {
                Some((_, ev)) => events.push(ev.clone()),
                None => missing = Some(*e),
            }
        }
    }
    side.consumers[g].clear();
    events.extend(held.ready.clone());
    if let Some(e) = missing {
        // Not safe to hand back: drop the buffers (host memory goes away, nothing else reads it).
        drop(held);
        return Err(RuntimeError::Plan {
            rank: cx.tables.rank,
            what: format!(
                "the scheduler frees gather bucket {} after engine event {e:?}, which no release_after \
                 gave (a driver bug)",
                cx.tables.gather[g].id
            ),
        });
    }
    retire(side, be, held.buffers(), events);
    Ok(())
}

/// Finishes every gather that already completed, without blocking, and returns deferred
/// frees that completed to the pool.
pub(crate) fn poll_gathers<B: Backend>(
    cx: &mut Ctx<'_, B>,
    counters: &mut DriverCounters,
) -> Result<(), RuntimeError> {
    cx.st.gather.reap(cx.backend);
    let mut i = 0;
    while i < cx.st.gather.pending.len() {
        let p = &cx.st.gather.pending[i];
        if matches!(p.flight.is_done(), Ok(false)) {
            i += 1;
            continue;
        }
        let id = p.id;
        finish_gather(cx, id, false, counters)?;
        // finish_gather swap_removed index i; look at i again.
    }
    Ok(())
}

/// Makes sure the gathers holding `params` finished (waiting for them if needed), so that
/// views of them can be handed out.
pub(crate) fn ensure_gathered<B: Backend>(
    cx: &mut Ctx<'_, B>,
    params: &[ParamId],
    counters: &mut DriverCounters,
) -> Result<(), RuntimeError> {
    for &p in params {
        let g = cx.tables.params[p.index()].gather;
        let current = cx.st.registry.gathered_by(p);
        if let Some(id) = current {
            if cx.st.gather.gathered(g, current).is_none() {
                finish_gather(cx, id, true, counters)?;
            }
        }
    }
    Ok(())
}
