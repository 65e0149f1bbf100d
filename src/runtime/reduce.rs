//! The reduce side of the driver: gradient buffers, no_sync accumulators, reductions in
//! flight, reduced gradient shards.
//!
//! Two owners: [`GradStore`] lives in the model state (the reduced shards the optimizer reads
//! and the no_sync accumulators, shared by the coordinators of a rank on a model); each
//! coordinator's driver has a [`ReduceSide`] (its gradient buffers and its reductions in
//! flight). A bucket of dtype P reduced in R takes the engine's gradient (P) cast into its
//! gradient buffer (R) at copy-in; accumulators hold R; the collectives run in R.

use std::sync::Arc;

use collsched_buckets::ParamId;
use collsched_kernels::{accumulate_cast, cast_or_copy, copy_in_cast, CopySegment, ElemType, KernelError};
use collsched_schedule::{GradSource, Launch, LaunchId};

use super::bytes::Bytes;
use super::flight::{backend_err, free_ops, launch, wait_flight, DriverCounters, Waited};
use super::gather::Done;
use super::tables::{GradTable, GradTables};
use super::RuntimeError;
use crate::backend::{
    Backend, BackendError, BackendEvent, ChainError, Chained, Collective, InFlight, Origin, Stream,
};

/// Reduced gradient shards of the last synchronized step and the no_sync accumulators, of one
/// rank on one model. Gradient buckets are indexed by their position `j` in the tables of the
/// plan they were reduced with.
pub(crate) struct GradStore<B: Backend> {
    /// Reduced gradient shards, by gradient bucket of `tables`.
    shards: Vec<Bytes>,
    /// A device backend's reduced gradient shards where its engine gave gradients on the
    /// device: the reduction's output buffer itself, in place of `shards[j]`.
    on_device: Vec<Option<B::Buffer>>,
    /// Whether `shards[j]` holds the gradient of the last synchronized step.
    valid: Vec<bool>,
    /// The gradient tables (plan) `shards` belong to.
    tables: Option<Arc<GradTables>>,
    /// no_sync accumulators (full size, in the reduction dtype), by parameter.
    accumulators: Vec<Bytes>,
    /// Whether `accumulators[p]` is live.
    accumulated: Vec<bool>,
}

impl<B: Backend> GradStore<B> {
    pub(crate) fn new(params: usize) -> Self {
        GradStore {
            shards: Vec::new(),
            on_device: Vec::new(),
            valid: Vec::new(),
            tables: None,
            accumulators: vec![Bytes::default(); params],
            accumulated: vec![false; params],
        }
    }

    /// The tables of the last synchronized step's gradients, if any step reduced.
    pub(crate) fn tables(&self) -> Option<&Arc<GradTables>> {
        self.tables.as_ref()
    }

    /// The reduced shard of gradient bucket `j` in host memory, if it holds the last
    /// synchronized step's (see [`GradStore::bring_to_host`] for one on the device).
    pub(crate) fn shard(&self, j: usize) -> Option<&[u8]> {
        let on_device = self.on_device.get(j).is_some_and(Option::is_some);
        (self.valid.get(j).copied().unwrap_or(false) && !on_device).then(|| self.shards[j].as_bytes())
    }

    /// The reduced shard of gradient bucket `j` on the device, if it holds the last
    /// synchronized step's.
    pub(crate) fn device_shard(&self, j: usize) -> Option<&B::Buffer> {
        self.valid.get(j).copied().unwrap_or(false).then(|| self.on_device.get(j)?.as_ref()).flatten()
    }

    /// Copies the reduced shards held on the device into host memory (after the compute
    /// stream: the engine may have used them there) and gives their buffers back.
    pub(crate) fn bring_to_host(&mut self, be: &B) -> Result<(), BackendError> {
        if self.on_device.iter().all(Option::is_none) {
            return Ok(());
        }
        be.synchronize(Stream::Compute, be.timeout())?;
        for (j, d) in self.on_device.iter_mut().enumerate() {
            if let Some(buf) = d.take() {
                let r = be.read_to_host(&buf, 0, self.shards[j].as_bytes_mut());
                be.free(buf, None);
                r?;
            }
        }
        Ok(())
    }

    /// Whether parameter `p` has a no_sync accumulator waiting for its synchronized step.
    pub(crate) fn accumulated(&self, p: ParamId) -> bool {
        self.accumulated.get(p.index()).copied().unwrap_or(false)
    }

    /// Marks every reduced shard consumed (the optimizer used them). Shards on the device stay
    /// where they are (the engine may still be copying them out on the compute stream) until
    /// [`release_device`](Self::release_device), the bucket's next reduction or a plan change,
    /// and go back to the pool once the compute stream passed that point.
    pub(crate) fn consume(&mut self) {
        self.valid.iter_mut().for_each(|v| *v = false);
    }

    /// Gives the reduced shards held on the device back to the pool, after the compute stream;
    /// their buckets hold no reduced shard any more.
    pub(crate) fn release_device(&mut self, be: &B) {
        if self.on_device.iter().all(Option::is_none) {
            return;
        }
        let after = be.record(Stream::Compute).ok();
        for (j, slot) in self.on_device.iter_mut().enumerate() {
            let Some(buf) = slot.take() else { continue };
            // Its host shard holds no reduction of this bucket: nothing of it is served again.
            if let Some(v) = self.valid.get_mut(j) {
                *v = false;
            }
            match &after {
                Some(e) => be.free(buf, Some(e)),
                // The stream failed: nothing runs on it any more.
                None => be.free(buf, None),
            }
        }
    }

    /// The shard buffer of bucket `j` of `tables` to receive a reduction (sized; its old
    /// bytes are overwritten whole),
    /// switching to `tables` first if the plan changed.
    fn receive(&mut self, be: &B, tables: &Arc<GradTables>, j: usize) -> &mut [u8] {
        if !self.tables.as_ref().is_some_and(|g| Arc::ptr_eq(g, tables)) {
            self.tables = Some(Arc::clone(tables));
            self.valid.clear();
            self.release_device(be);
        }
        let n = tables.grad.len();
        if self.shards.len() < n {
            self.shards.resize_with(n, Bytes::default);
        }
        self.on_device.resize_with(n.max(self.on_device.len()), || None);
        if let Some(old) = self.on_device[j].take() {
            let after = be.record(Stream::Compute).ok();
            be.free(old, after.as_ref());
        }
        self.valid.resize(n, false);
        self.shards[j].resize(tables.grad[j].shard_bytes);
        self.shards[j].as_bytes_mut()
    }
}

/// The gradient a `grad_ready` call hands over: host bytes in the parameter's dtype, or a
/// buffer of the backend (an engine's device tensor) in the reduction dtype, written by work on
/// the compute stream.
pub(crate) enum Fresh<'a, B: Backend> {
    Host(&'a [u8]),
    Device(&'a B::Buffer),
    /// Gradient `.1` of the device gradients of one `grad_ready_many_on_device` call: its
    /// copy-in is put off and packed with the call's others of its bucket, in one launch,
    /// before the bucket's reduction launches or when the call ends.
    Batch(&'a [&'a B::Buffer], usize),
}

impl<B: Backend> Fresh<'_, B> {
    /// The backend buffer of a device gradient.
    pub(crate) fn device_buffer(&self) -> Option<&B::Buffer> {
        match *self {
            Fresh::Host(_) => None,
            Fresh::Device(b) => Some(b),
            Fresh::Batch(all, i) => all.get(i).copied(),
        }
    }
}

impl<B: Backend> Clone for Fresh<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Fresh<'_, B> {}

/// A reduction in flight.
struct PendingReduce<B: Backend> {
    id: LaunchId,
    /// Position of the gradient bucket in the tables.
    j: usize,
    /// Whether its gradients were packed on the device: its reduced shard stays there.
    packed: bool,
    /// Hybrid sharding: the event of the in-group reduce-scatter, which `flight` (the
    /// cross-group all-reduce chained behind it) follows; tells which stage failed.
    first: Option<B::Event>,
    flight: InFlight<B>,
}

/// One coordinator's gradient buffers (full size, in the reduction dtype) and reductions in
/// flight.
///
/// A bucket's gradient buffer is the reduce-scatter's input, a backend buffer taken from the
/// pool at `AllocGrad`: on a backend whose buffers are host memory gradients are cast straight
/// into it, and only what no gradient wrote is zeroed (the padding at `AllocGrad`, a parameter
/// whose gradient never came at launch). Elsewhere (device memory) host gradients go into a
/// host staging buffer, zeroed whole, copied into the backend buffer at launch; gradients in
/// the backend's memory are packed into it on the compute stream (where the engine made them:
/// it may reuse their memory in that stream's order), what none wrote is zeroed there at
/// launch, and the reduction follows the compute stream. One bucket takes one kind or the other.
pub(crate) struct ReduceSide<B: Backend> {
    rank: usize,
    pending: Vec<PendingReduce<B>>,
    /// Per gradient bucket: its gradient buffer between `AllocGrad` and the launch.
    inputs: Vec<Option<B::Buffer>>,
    /// Per gradient bucket: the host staging buffer, for a backend without host buffers.
    staging: Vec<Bytes>,
    /// Per parameter: whether its gradient is in its bucket's open gradient buffer.
    copied: Vec<bool>,
    /// Per gradient bucket: whether a host gradient went into its staging buffer, and whether
    /// a gradient was packed into its backend buffer on the device, since its `AllocGrad`.
    staged: Vec<bool>,
    packed: Vec<bool>,
    /// The copy-ins put off by a `grad_ready_many_on_device` call: (bucket position, the
    /// gradient's index in the call, its parameter). Empty outside such a call.
    deferred: Vec<(usize, usize, ParamId)>,
    spare: Vec<Vec<Collective<B::Buffer>>>,
}

fn kernel_err(rank: usize, param: ParamId, kernel: &str, e: KernelError) -> RuntimeError {
    RuntimeError::Param { rank, param: Some(format!("id {param}")), what: format!("{kernel}: {e}") }
}

fn device_accumulated(rank: usize, param: ParamId) -> RuntimeError {
    RuntimeError::Param {
        rank,
        param: Some(format!("id {param}")),
        what:
            "a gradient in the backend's memory cannot be accumulated by the library (no_sync): accumulate \
               it in the engine and hand the sum over in the synchronized micro-batch, or give host gradients"
                .into(),
    }
}

fn mixed(rank: usize, param: ParamId, bucket: collsched_buckets::BucketId) -> RuntimeError {
    RuntimeError::Param {
        rank,
        param: Some(format!("id {param}")),
        what: format!(
            "gradient bucket {bucket} already holds gradients of the other kind (host bytes and the backend's \
             memory): give every gradient of a step the same way"
        ),
    }
}

/// Bucket `j`'s open gradient buffer (between its `AllocGrad` and its launch).
fn open_input<'a, T>(
    inputs: &'a mut [Option<T>],
    rank: usize,
    t: &GradTable,
    j: usize,
) -> Result<&'a mut T, RuntimeError> {
    inputs.get_mut(j).and_then(Option::as_mut).ok_or_else(|| RuntimeError::Internal {
        rank,
        what: format!("gradient bucket {}: a gradient copy-in before its AllocGrad", t.id),
    })
}

fn no_fresh(rank: usize, param: ParamId) -> RuntimeError {
    RuntimeError::Internal {
        rank,
        what: format!("parameter id {param}: the scheduler asked for a fresh gradient outside grad_ready"),
    }
}

impl<B: Backend> ReduceSide<B> {
    pub(crate) fn new(rank: usize, n_grad: usize) -> Self {
        ReduceSide {
            rank,
            pending: Vec::with_capacity(n_grad.max(4)),
            inputs: Vec::new(),
            staging: Vec::new(),
            copied: Vec::new(),
            staged: Vec::new(),
            packed: Vec::new(),
            deferred: Vec::new(),
            spare: Vec::with_capacity(n_grad.max(4)),
        }
    }

    /// Why gradient bucket `j` cannot take `param`'s gradient of this kind (`on_device`) now,
    /// if it cannot: its open buffer, on a backend without host buffers, already holds
    /// gradients of the other kind; or a device gradient would have to be added to a no_sync
    /// accumulator. Asked before anything changes (`grad_ready` refuses then, naming both).
    pub(crate) fn refuses(
        &self,
        be: &B,
        store: &GradStore<B>,
        tables: &GradTables,
        param: ParamId,
        on_device: bool,
    ) -> Option<RuntimeError> {
        let j = tables.params.get(param.index())?.bucket as usize;
        let t = tables.grad.get(j)?;
        if on_device && store.accumulated(param) {
            return Some(device_accumulated(self.rank, param));
        }
        let open = self.inputs.get(j).and_then(Option::as_ref)?;
        let flag = if on_device { &self.staged } else { &self.packed };
        let other_kind = flag.get(j).copied().unwrap_or(false) && be.host_bytes(open).is_none();
        other_kind.then(|| mixed(self.rank, param, t.id))
    }

    /// Reductions in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The event of launch `id` if it is in flight here (a fence for a later launch).
    pub(crate) fn pending_event(&self, id: LaunchId) -> Option<&B::Event> {
        self.pending.iter().find(|p| p.id == id).map(|p| p.flight.event())
    }

    /// `AllocGrad`: opens bucket `j`'s gradient buffer, in the reduction dtype (the scheduler
    /// sizes it in the bucket's dtype), with zeros where no gradient goes.
    pub(crate) fn alloc_grad(&mut self, be: &B, tables: &GradTables, j: usize) -> Result<(), RuntimeError> {
        let n = tables.grad.len();
        if self.inputs.len() < n {
            self.inputs.resize_with(n, || None);
        }
        if self.copied.len() < tables.params.len() {
            self.copied.resize(tables.params.len(), false);
        }
        self.staged.resize(n.max(self.staged.len()), false);
        self.packed.resize(n.max(self.packed.len()), false);
        self.staged[j] = false;
        self.packed[j] = false;
        let t = &tables.grad[j];
        // A buffer a step opened and never launched (its backward raised): back to the pool.
        if let Some(old) = self.inputs[j].take() {
            be.free(old, None);
        }
        // Named as the collective the buffer is the input of, like every failure of the bucket.
        let op = t.stages[0].kind.name();
        let mut input = be.alloc(t.gathered_bytes).map_err(backend_err(be.rank(), op, Some(t.id)))?;
        match be.host_bytes_mut(&mut input) {
            Some(bytes) => {
                for &(lo, hi) in &t.gaps {
                    bytes[lo..hi].fill(0);
                }
            }
            None => {
                // Zeroed when the first host gradient is staged (a bucket given on the device
                // never needs it).
                if self.staging.len() < n {
                    self.staging.resize_with(n, Bytes::default);
                }
            }
        }
        self.inputs[j] = Some(input);
        for p in &t.params {
            self.copied[p.index()] = false;
        }
        Ok(())
    }

    /// Bucket `j`'s open gradient buffer as host bytes: the backend buffer itself, or the
    /// staging buffer.
    fn grad_bytes<'a>(
        be: &B,
        rank: usize,
        inputs: &'a mut [Option<B::Buffer>],
        staging: &'a mut [Bytes],
        t: &GradTable,
        j: usize,
    ) -> Result<&'a mut [u8], RuntimeError> {
        let input = open_input(inputs, rank, t, j)?;
        Ok(match be.host_bytes_mut(input) {
            Some(bytes) => bytes,
            None => staging[j].as_bytes_mut(),
        })
    }

    /// `CopyGradIn`: the fresh gradient (cast from the parameters' dtype to the reduction
    /// dtype per run), the accumulator, or both added, into bucket `j`'s gradient buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_grad_in(
        &mut self,
        be: &B,
        tables: &GradTables,
        store: &mut GradStore<B>,
        j: usize,
        param: ParamId,
        source: GradSource,
        fresh: Option<Fresh<'_, B>>,
    ) -> Result<(), RuntimeError> {
        let rank = self.rank;
        let (lo, hi) = tables.params[param.index()].copy_in;
        let segs = &tables.copy_in[lo as usize..hi as usize];
        let t = &tables.grad[j];
        let p = param.index();
        let fresh = match fresh {
            Some(Fresh::Device(grad)) if source == GradSource::Fresh => {
                let input = open_input(&mut self.inputs, rank, t, j)?;
                if self.staged[j] && be.host_bytes_mut(input).is_none() {
                    return Err(mixed(rank, param, t.id));
                }
                be.pack(Stream::Compute, input, &[grad], segs, t.elem.size()).map_err(backend_err(
                    rank,
                    "reduce_scatter copy-in",
                    Some(t.id),
                ))?;
                self.packed[j] = true;
                self.copied[p] = true;
                return Ok(());
            }
            Some(Fresh::Batch(_, i)) if source == GradSource::Fresh => {
                let input = open_input(&mut self.inputs, rank, t, j)?;
                if self.staged[j] && be.host_bytes_mut(input).is_none() {
                    return Err(mixed(rank, param, t.id));
                }
                self.deferred.push((j, i, param));
                self.packed[j] = true;
                self.copied[p] = true;
                return Ok(());
            }
            Some(Fresh::Device(_) | Fresh::Batch(..)) => return Err(device_accumulated(rank, param)),
            Some(Fresh::Host(f)) => Some(f),
            None => None,
        };
        // The fresh gradient is in the parameter's dtype, the accumulator in the reduction
        // dtype; both land in the gradient buffer in the reduction dtype.
        let (src, src_elem): (&[u8], ElemType) = match source {
            GradSource::Fresh => (fresh.ok_or_else(|| no_fresh(rank, param))?, t.param_elem),
            GradSource::FreshPlusAccumulated => {
                let f = fresh.ok_or_else(|| no_fresh(rank, param))?;
                accumulate_cast(t.elem, store.accumulators[p].as_bytes_mut(), t.param_elem, f)
                    .map_err(|e| kernel_err(rank, param, "accumulate", e))?;
                store.accumulated[p] = false;
                (store.accumulators[p].as_bytes(), t.elem)
            }
            GradSource::Accumulated => {
                store.accumulated[p] = false;
                (store.accumulators[p].as_bytes(), t.elem)
            }
        };
        let staging = be.host_bytes_mut(open_input(&mut self.inputs, rank, t, j)?).is_none();
        if staging && self.packed[j] {
            return Err(mixed(rank, param, t.id));
        }
        if staging && !self.staged[j] {
            self.staging[j].reset_zeroed(t.gathered_bytes);
        }
        let dst = Self::grad_bytes(be, rank, &mut self.inputs, &mut self.staging, t, j)?;
        copy_in_cast(dst, t.elem, src, src_elem, segs).map_err(|e| kernel_err(rank, param, "copy_in", e))?;
        self.copied[p] = true;
        self.staged[j] |= staging;
        Ok(())
    }

    /// Packs the copy-ins put off by a `grad_ready_many_on_device` call (`grads`: its
    /// gradients), those of bucket `only` or all: one pack a bucket, on the compute stream,
    /// its sources the call's gradients in the order they came. Whatever happens, the packed
    /// ones are forgotten (all of them when `only` is `None`: none outlives the call that
    /// lends its buffers).
    pub(crate) fn pack_deferred(
        &mut self,
        be: &B,
        tables: &GradTables,
        grads: &[&B::Buffer],
        only: Option<usize>,
    ) -> Result<(), RuntimeError> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let mut take = std::mem::take(&mut self.deferred);
        if let Some(j) = only {
            let (mine, rest): (Vec<_>, Vec<_>) = take.into_iter().partition(|d| d.0 == j);
            self.deferred = rest;
            take = mine;
        }
        let rank = self.rank;
        let mut buckets: Vec<usize> = take.iter().map(|d| d.0).collect();
        buckets.sort_unstable();
        buckets.dedup();
        let mut sources: Vec<&B::Buffer> = Vec::new();
        let mut segs = Vec::new();
        for j in buckets {
            sources.clear();
            segs.clear();
            for &(_, i, param) in take.iter().filter(|d| d.0 == j) {
                let grad = grads.get(i).copied().ok_or_else(|| RuntimeError::Internal {
                    rank,
                    what: format!("parameter id {param}: gradient {i} of a call of {}", grads.len()),
                })?;
                let (lo, hi) = tables.params[param.index()].copy_in;
                let k = sources.len();
                sources.push(grad);
                segs.extend(
                    tables.copy_in[lo as usize..hi as usize].iter().map(|s| CopySegment { buffer: k, ..*s }),
                );
            }
            let t = &tables.grad[j];
            let input = open_input(&mut self.inputs, rank, t, j)?;
            be.pack(Stream::Compute, input, &sources, &segs, t.elem.size()).map_err(backend_err(
                rank,
                "reduce_scatter copy-in",
                Some(t.id),
            ))?;
        }
        Ok(())
    }

    /// `AccumulateGrad`: adds the fresh gradient into the parameter's full-size accumulator, in
    /// the reduction dtype.
    pub(crate) fn accumulate_grad(
        &self,
        tables: &GradTables,
        store: &mut GradStore<B>,
        param: ParamId,
        fresh: Option<Fresh<'_, B>>,
    ) -> Result<(), RuntimeError> {
        let rank = self.rank;
        let f = match fresh {
            Some(Fresh::Host(f)) => f,
            Some(Fresh::Device(_) | Fresh::Batch(..)) => return Err(device_accumulated(rank, param)),
            None => return Err(no_fresh(rank, param)),
        };
        let p = param.index();
        let j = tables.params[p].bucket as usize;
        let t = tables.grad.get(j).ok_or_else(|| RuntimeError::Internal {
            rank,
            what: format!("parameter id {param} has no gradient bucket in the driver's tables"),
        })?;
        let acc = &mut store.accumulators[p];
        if store.accumulated[p] {
            accumulate_cast(t.elem, acc.as_bytes_mut(), t.param_elem, f)
                .map_err(|e| kernel_err(rank, param, "accumulate", e))
        } else {
            // First micro-batch: the accumulator is the gradient itself in the reduction dtype
            // (bit for bit `acc = grad` when the dtypes agree).
            let numel = f.len() / t.param_elem.size();
            acc.reset_zeroed(numel * t.elem.size());
            cast_or_copy(t.param_elem, f, t.elem, acc.as_bytes_mut())
                .map_err(|e| kernel_err(rank, param, "cast", e))?;
            store.accumulated[p] = true;
            Ok(())
        }
    }

    /// Launches bucket `j`'s reduction `l` on the reduce-scatter stream after `fences`: zeros
    /// where a gradient never came (or the staging buffer copied in), the reduce-scatter (or
    /// all-reduce) of the gradient buffer; for hybrid
    /// sharding the cross-group all-reduce is chained behind it in stream order (no host
    /// wait), its input the reduce-scatter's output. `engine` marks the collectives in the
    /// flight record, with the launch's step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &mut self,
        be: &B,
        tables: &GradTables,
        j: usize,
        l: &Launch,
        engine: u32,
        fences: &[B::Event],
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        let rank = be.rank();
        let t = &tables.grad[j];
        let err = |op| backend_err(rank, op, Some(t.id));
        let first_op = t.stages[0].kind.name();
        let mut input =
            self.inputs.get_mut(j).and_then(Option::take).ok_or_else(|| RuntimeError::Internal {
                rank,
                what: format!("gradient bucket {}: launched without an AllocGrad", t.id),
            })?;
        // A bucket no host gradient went into is made on the device (zeros where none came).
        let packed = self.packed.get(j).copied().unwrap_or(false)
            || (be.device().is_some() && !self.staged.get(j).copied().unwrap_or(false));
        match be.host_bytes_mut(&mut input) {
            Some(bytes) => {
                for p in &t.params {
                    if std::mem::take(&mut self.copied[p.index()]) {
                        continue;
                    }
                    let (lo, hi) = tables.params[p.index()].copy_in;
                    for s in &tables.copy_in[lo as usize..hi as usize] {
                        let es = t.elem.size();
                        bytes[s.packed_offset * es..(s.packed_offset + s.len) * es].fill(0);
                    }
                }
            }
            None if packed => {
                // Gradients packed on the compute stream: zero what none wrote there too, and
                // let the reduction follow that stream.
                let es = t.elem.size();
                let mut zeroed = Ok(());
                for &(lo, hi) in &t.gaps {
                    zeroed = zeroed.and_then(|()| be.zero(Stream::Compute, &mut input, lo, hi - lo));
                }
                for p in &t.params {
                    if std::mem::take(&mut self.copied[p.index()]) {
                        continue;
                    }
                    let (lo, hi) = tables.params[p.index()].copy_in;
                    for s in &tables.copy_in[lo as usize..hi as usize] {
                        let (at, len) = (s.packed_offset * es, s.len * es);
                        zeroed = zeroed.and_then(|()| be.zero(Stream::Compute, &mut input, at, len));
                    }
                }
                // The reduction's stream waits for the compute stream's writes.
                let fenced = be.record(Stream::Compute).and_then(|written| be.wait_event(l.stream, &written));
                if let Err(e) = zeroed.and(fenced) {
                    be.free(input, be.record(Stream::Compute).ok().as_ref());
                    return Err(err("reduce_scatter copy-in")(e));
                }
            }
            None => {
                if !self.staged.get(j).copied().unwrap_or(false) {
                    // Nothing was staged: the staging buffer still holds an earlier step's.
                    self.staging[j].reset_zeroed(t.gathered_bytes);
                }
                let staged = self.staging.get(j).map_or(&[][..], Bytes::as_bytes);
                if let Err(e) = be.write_from_host(&mut input, 0, staged) {
                    be.free(input, None);
                    return Err(err("reduce_scatter copy-in")(e));
                }
            }
        }
        let output = be.alloc(t.shard_bytes).map_err(err(first_op))?;
        let mut ops = self.spare.pop().unwrap_or_default();
        ops.push(Collective { desc: t.stages[0].clone(), input: Some(input), output });
        let origin = Origin { engine, step: l.step };
        let mut flight = launch(be, l.stream, fences, ops, t.id, origin, first_op)?;
        counters.collectives += 1;
        counters.bytes_moved += t.gathered_bytes as u64;
        let mut first = None;
        for desc in &t.stages[1..] {
            let op = desc.kind.name();
            let output = be.alloc(t.shard_bytes).map_err(err(op))?;
            let event = flight.event().clone();
            // Same stream, right behind the previous stage: the stream's order is the fence.
            flight = match be.launch_then(
                flight,
                l.stream,
                [Chained { desc: desc.clone().with_origin(origin), input_of: 0, output }],
            ) {
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
            counters.collectives += 1;
            counters.bytes_moved += t.shard_bytes as u64;
        }
        self.pending.push(PendingReduce { id: l.id, j, packed, first, flight });
        Ok(())
    }

    /// Finishes reduction `id` (blocking, or only if complete): the reduced shard into
    /// `store`, then `done`. Returns whether it finished (or had already).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish(
        &mut self,
        be: &B,
        tables: &Arc<GradTables>,
        store: &mut GradStore<B>,
        id: LaunchId,
        block: bool,
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<bool, RuntimeError> {
        let rank = be.rank();
        let Some(k) = self.pending.iter().position(|p| p.id == id) else { return Ok(true) };
        let p = self.pending.swap_remove(k);
        let t = &tables.grad[p.j];
        let mut ops = match wait_flight(p.flight, block, be, counters) {
            Ok(ops) => ops,
            Err(Waited::Pending(flight)) => {
                self.pending.push(PendingReduce { flight, ..p });
                let last = self.pending.len() - 1;
                self.pending.swap(k, last);
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
        free_ops(be, ops.drain(..));
        self.spare.push(ops);
        if let Some(input) = c.input {
            be.free(input, None);
        }
        let dst = store.receive(be, tables, p.j);
        if p.packed && be.host_bytes(&c.output).is_none() {
            // Gradients given on the device: the reduced shard stays there for the engine.
            store.on_device[p.j] = Some(c.output);
        } else {
            let r = be.read_to_host(&c.output, 0, dst);
            be.free(c.output, None);
            r.map_err(backend_err(rank, "reduce_scatter copy-out", Some(t.id)))?;
        }
        store.valid[p.j] = true;
        done(id)?;
        Ok(true)
    }

    /// Finishes every reduction that already completed, without blocking.
    pub(crate) fn poll(
        &mut self,
        be: &B,
        tables: &Arc<GradTables>,
        store: &mut GradStore<B>,
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<(), RuntimeError> {
        let mut i = 0;
        while i < self.pending.len() {
            let id = self.pending[i].id;
            if self.finish(be, tables, store, id, false, counters, &mut *done)? {
                continue;
            }
            i += 1;
        }
        Ok(())
    }

    /// Waits for every reduction in flight.
    pub(crate) fn drain(
        &mut self,
        be: &B,
        tables: &Arc<GradTables>,
        store: &mut GradStore<B>,
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<(), RuntimeError> {
        while let Some(p) = self.pending.first() {
            let id = p.id;
            self.finish(be, tables, store, id, true, counters, &mut *done)?;
        }
        Ok(())
    }
}
