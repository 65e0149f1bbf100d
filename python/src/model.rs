//! [`Model`] (one rank's share of a sharded model) and [`Engine`] (a coordinator on it): the
//! runtime's engine API for the Python package's `collsched.torch`, on the world's backend (a
//! host backend, or CUDA: shards, gathered parameters and reduced gradients then live on the
//! device, and gradients are given there).

use std::sync::Arc;

use collsched::backend::local::LocalRank;
use collsched::backend::ondevice::OnDevice;
use collsched::backend::Backend;
use collsched::backend::Stream;
use collsched::buckets::{BucketId, DType, ParamId};
use collsched::kernels::ElemType;
use collsched::runtime::StepStats;
use collsched::schedule::{Explicit, GradReduce, PolicyKind, SchedulerConfig};
use collsched::{checkpoint, Coordinator, ModelState, RuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::errors;
#[cfg(feature = "cuda")]
use crate::region::tensor_span;
use crate::region::{host_tensor_bytes, Region};
use crate::world::{Rank, World};

#[cfg(feature = "cuda")]
use collsched::backend::cuda::CudaBackend;

/// A runtime value on the world's backend: `St` (the model state) or `Co` (a coordinator).
macro_rules! each {
    ($enum:ident, $v:expr, $x:ident => $e:expr) => {
        match $v {
            $enum::Host($x) => $e,
            $enum::Emulated($x) => $e,
            #[cfg(feature = "cuda")]
            $enum::Cuda($x) => $e,
        }
    };
}

/// `checkpoint_dir(path)`: the directory that holds the checkpoint at `path` as loads read it
/// (`path`, or `PATH.partial` while a commit is stopped between its renames).
#[pyfunction]
pub fn checkpoint_dir(path: std::path::PathBuf) -> std::path::PathBuf {
    checkpoint::resolve(&path)
}

/// The model state on the world's backend.
enum St {
    Host(ModelState<LocalRank>),
    Emulated(ModelState<OnDevice<LocalRank>>),
    #[cfg(feature = "cuda")]
    Cuda(ModelState<CudaBackend>),
}

/// A coordinator on the world's backend.
enum Co {
    Host(Coordinator<LocalRank>),
    Emulated(Coordinator<OnDevice<LocalRank>>),
    #[cfg(feature = "cuda")]
    Cuda(Coordinator<CudaBackend>),
}

/// Where bytes `range` of `buffer` are: `(address, device)`, a device address with the
/// device's ordinal, or a host address and `None`.
fn located<B: Backend>(
    be: &B,
    buffer: &B::Buffer,
    range: &std::ops::Range<usize>,
) -> Option<(usize, Option<usize>)> {
    match be.device_address(buffer) {
        Some(base) => Some((base as usize + range.start, be.device())),
        None => be.host_bytes(buffer).and_then(|b| b.get(range.clone())).map(|b| (b.as_ptr() as usize, None)),
    }
}

/// [`Engine::fetch`] on any backend: a region per parameter, `None` where `known` says the
/// caller already views its address.
fn fetch_regions<B: Backend>(
    coord: &mut Coordinator<B>,
    owner: &Py<PyAny>,
    py: Python<'_>,
    ids: &[ParamId],
    known: Option<&[usize]>,
    emulated: bool,
) -> PyResult<Vec<Option<Region>>> {
    let be = Arc::clone(coord.model().backend());
    let views = coord.fetch(ids).map_err(errors::runtime)?;
    let mut out = Vec::with_capacity(ids.len());
    for (i, &p) in ids.iter().enumerate() {
        let (buffer, range) = views.buffer(p).map_err(errors::runtime)?;
        let len = range.len();
        let (addr, device) = located(&*be, buffer, &range)
            .ok_or_else(|| errors::other(format!("fetch: parameter id {p}: its buffer has no address")))?;
        let same = known.is_some_and(|k| k[i] == addr && len > 0);
        out.push((!same).then(|| Region::on(owner.clone_ref(py), addr as *const u8, len, device, emulated)));
    }
    Ok(out)
}

/// The emulated device's compute stream is the host thread (torch computes on the CPU there,
/// in program order): before Python reads what the stream was to wait for (gathered
/// parameters, reduced gradients), the host waits for it, as a CUDA compute stream would.
fn host_is_compute<B: Backend>(c: &Coordinator<B>, op: &'static str) -> PyResult<()> {
    let be = c.model().backend();
    be.synchronize(Stream::Compute, be.timeout())
        .map_err(|source| RuntimeError::Backend { rank: c.model().rank(), op, bucket: None, source })
        .map_err(errors::runtime)
}

/// [`Engine::release`] on a device backend: the buckets are freed once the compute stream
/// passed the work queued on it so far (which reads them).
fn release_after_compute<B: Backend>(c: &mut Coordinator<B>, params: &[ParamId]) -> Result<(), RuntimeError> {
    let done = c.model().backend().record(Stream::Compute).map_err(|source| RuntimeError::Backend {
        rank: c.model().rank(),
        op: "release (recording the compute stream's event)",
        bucket: None,
        source,
    })?;
    c.release_after(params, &done)
}

/// [`Engine::take_grads`] on a device backend: a region per reduced gradient shard, in the
/// backend's memory.
fn device_grads<B: Backend>(
    c: &mut Coordinator<B>,
    owner: &Py<PyAny>,
    py: Python<'_>,
    emulated: bool,
    out: &mut Vec<GradShard>,
) -> PyResult<()> {
    let mut regions = Vec::new();
    let r = c.take_grad_shards(|g| regions.push(g));
    for g in regions {
        let region = Region::on(owner.clone_ref(py), g.ptr, g.numel * g.elem.size(), g.device, emulated);
        out.push((g.param.0, g.param_offset, Py::new(py, region)?.into_any(), dtype_name(g.elem)));
    }
    r.map(drop).map_err(errors::runtime)
}

/// One rank's share of one model: its shards (the optimizer's memory), its gradient shards and
/// its in-flight registry, built from the plan of `params` (a parameter file's text) and the
/// full initial value of every parameter (`init`: `(address, bytes)` of a contiguous CPU
/// tensor per parameter, read during the call; `None`: zero-filled shards, for values written
/// into them afterwards). Collective: every rank builds its model at
/// the same point with the same plan.
#[pyclass(module = "collsched._native")]
pub struct Model {
    state: St,
    plan_json: String,
}

#[pymethods]
impl Model {
    #[new]
    #[pyo3(signature = (world, params, init, strategy="even", bucket_mb=64.0, align=collsched::buckets::DEFAULT_ALIGN, bucket_by="size"))]
    fn new(
        world: &World,
        params: &str,
        init: Option<Vec<Bound<'_, PyAny>>>,
        strategy: &str,
        bucket_mb: f64,
        align: usize,
        bucket_by: &str,
    ) -> PyResult<Model> {
        let ranks = u32::try_from(world.backend.rank_world().1).map_err(errors::other)?;
        let plan = crate::plan::build(params, ranks, strategy, bucket_mb, align, bucket_by)?;
        let Some(init) = init else {
            // No values (a model built on the meta device): zero-filled shards, written later.
            let state = match &world.backend {
                Rank::Host(b) => St::Host(ModelState::zeroed(Arc::clone(b), &plan).map_err(errors::runtime)?),
                Rank::Emulated(b) => {
                    St::Emulated(ModelState::zeroed(Arc::clone(b), &plan).map_err(errors::runtime)?)
                }
                #[cfg(feature = "cuda")]
                Rank::Cuda(b) => St::Cuda(ModelState::zeroed(Arc::clone(b), &plan).map_err(errors::runtime)?),
            };
            let plan_json = crate::plan::json(&plan)?;
            return Ok(Model { state, plan_json });
        };
        let names = plan.layout().params().specs().iter().map(|p| p.name.as_str());
        if init.len() != plan.layout().params().len() {
            return Err(errors::other(format!(
                "Model: {} initial values for {} parameters; give one tensor per parameter, in the \
                 parameter file's order",
                init.len(),
                plan.layout().params().len()
            )));
        }
        let full = init
            .iter()
            .zip(names)
            .map(|(t, name)| {
                // SAFETY: `host_tensor_bytes`' contract: `init` holds the tensors for the whole
                // call, and the bytes are copied into the shards before it returns.
                unsafe { host_tensor_bytes(t, &format!("Model: parameter {name}'s initial value")) }
            })
            .collect::<PyResult<Vec<&[u8]>>>()?;
        let state = match &world.backend {
            Rank::Host(b) => St::Host(ModelState::new(Arc::clone(b), &plan, &full).map_err(errors::runtime)?),
            Rank::Emulated(b) => {
                St::Emulated(ModelState::new(Arc::clone(b), &plan, &full).map_err(errors::runtime)?)
            }
            #[cfg(feature = "cuda")]
            Rank::Cuda(b) => St::Cuda(ModelState::new(Arc::clone(b), &plan, &full).map_err(errors::runtime)?),
        };
        let plan_json = crate::plan::json(&plan)?;
        Ok(Model { state, plan_json })
    }

    /// The plan, as `collsched plan --json` prints it.
    #[getter]
    fn plan(&self) -> &str {
        &self.plan_json
    }

    /// `(gather bucket id, bytes)`: the memory each gather bucket takes while gathered, as the
    /// prefetch and live-bytes budgets count it.
    #[getter]
    fn gather_memory(&self) -> Vec<(u32, usize)> {
        each!(St, &self.state, s => s.gather_memory().map(|(id, bytes)| (id.0, bytes)).collect())
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        each!(St, &self.state, s => s.rank())
    }

    /// The plan's fingerprint (16 hex digits).
    #[getter]
    fn fingerprint(&self) -> String {
        each!(St, &self.state, s => s.plan().fingerprint().to_string())
    }

    /// This rank's shard of parameter `id`: `(region, param_offset, numel)`, the elements
    /// `param_offset..param_offset + numel` of the flattened parameter, in memory the model
    /// owns for its whole life (`region` is `None` when this rank holds none of them; on the
    /// device for a CUDA world). The optimizer updates it in place (on the compute stream, for
    /// a device); the next gather reads it.
    fn shard(slf: Bound<'_, Self>, id: u32) -> PyResult<(Option<Region>, usize, usize)> {
        let r = each!(St, &slf.borrow().state, s => s.shard_region(ParamId(id))).map_err(errors::runtime)?;
        let owner = slf.clone().into_any().unbind();
        let emulated = matches!(slf.borrow().state, St::Emulated(_));
        let region =
            (r.numel > 0).then(|| Region::on(owner, r.ptr, r.numel * r.elem.size(), r.device, emulated));
        Ok((region, r.param_offset, r.numel))
    }

    /// Saves the shards to the checkpoint directory `path` (collective; between steps), with
    /// per-parameter states `extras` (`(name, param id, dtype, address, bytes)`: this rank's
    /// elements of a contiguous CPU tensor held during the call) and `meta` (JSON text, kept
    /// in the index). Returns the index as JSON text.
    #[pyo3(signature = (path, step, extras, meta))]
    fn save(
        &self,
        path: std::path::PathBuf,
        step: u64,
        extras: Vec<(String, u32, String, Bound<'_, PyAny>)>,
        meta: &str,
    ) -> PyResult<String> {
        let meta: serde_json::Value = serde_json::from_str(meta).map_err(errors::other)?;
        let mut states = Vec::with_capacity(extras.len());
        for (name, id, dtype, tensor) in extras {
            let dtype: DType = dtype.parse().map_err(|e| errors::other(format!("state {name}: {e}")))?;
            // SAFETY: `host_tensor_bytes`' contract: `extras` holds the tensor for the call;
            // the bytes are copied here.
            let data =
                unsafe { host_tensor_bytes(&tensor, &format!("save: state {name} of parameter id {id}")) }?
                    .to_vec();
            states.push(checkpoint::ExtraState { name, param: ParamId(id), dtype, data });
        }
        let index = each!(St, &self.state, s => checkpoint::save_with(s, &path, step, &states, meta))
            .map_err(errors::checkpoint)?;
        serde_json::to_string(&index).map_err(errors::other)
    }

    /// Loads the checkpoint at `path` into the shards (collective; between steps), whatever
    /// layout saved it, and reads the states `wanted` (`(param id, name)`) of this rank's
    /// elements: `(index JSON, [(dtype, bytes) or None])`.
    fn load<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
        wanted: Vec<(u32, String)>,
    ) -> PyResult<LoadedStates<'py>> {
        let wanted: Vec<(ParamId, String)> = wanted.into_iter().map(|(p, n)| (ParamId(p), n)).collect();
        let (index, states) = each!(St, &self.state, s => checkpoint::load_with(s, &path, &wanted))
            .map_err(errors::checkpoint)?;
        let states =
            states.into_iter().map(|s| s.map(|(d, b)| (d.name(), PyByteArray::new(py, &b)))).collect();
        Ok((serde_json::to_string(&index).map_err(errors::other)?, states))
    }

    /// Writes every parameter's full value to one safetensors file at `path`, gathering a
    /// bucket at a time (collective; between steps; rank 0 writes).
    fn save_full(&self, path: std::path::PathBuf) -> PyResult<()> {
        each!(St, &self.state, s => checkpoint::save_full(s, &path)).map_err(errors::checkpoint)
    }

    /// A coordinator on this model (collective: exchanges the plan fingerprint).
    ///
    /// `policy`: "trace" (record the first step's fetch order, prefetch along it) or "none";
    /// `prefetch_bytes`, `max_inflight`, `max_live_bytes`: the scheduler's budgets (`None`:
    /// its defaults); `reduce_dtype`: "f32", "bf16", "f16" or `None` (the parameter's);
    /// `divide`: `(gather bucket id, factor)` pairs, the gradients of those buckets reduced to
    /// their sum over the ranks divided by `factor` instead of their mean (FSDP2's
    /// `set_gradient_divide_factor`).
    #[pyo3(signature = (policy="trace", prefetch_bytes=None, max_inflight=None, max_live_bytes=None, reduce_dtype=None, divide=Vec::new()))]
    fn engine(
        slf: Bound<'_, Self>,
        policy: &str,
        prefetch_bytes: Option<usize>,
        max_inflight: Option<usize>,
        max_live_bytes: Option<usize>,
        reduce_dtype: Option<&str>,
        divide: Vec<(u32, f64)>,
    ) -> PyResult<Engine> {
        let policy = match policy {
            "trace" => PolicyKind::TraceReplay,
            "none" => PolicyKind::None,
            other => {
                return Err(errors::other(format!(
                    "prefetch {other:?}: expected \"trace\" (replay the first step's fetch order) or \"none\""
                )))
            }
        };
        // f16 reductions divide partly before the sum, as FSDP2's do (NCCL sums f16 in f16).
        let mut config = SchedulerConfig { policy, split_f16_divide: true, ..SchedulerConfig::default() };
        if let Some(b) = prefetch_bytes {
            config.prefetch_bytes = b;
        }
        if let Some(n) = max_inflight {
            config.max_inflight = n;
        }
        if let Some(b) = max_live_bytes {
            config.max_live_bytes = b;
        }
        if let Some(d) = reduce_dtype {
            let dtype: DType = d.parse().map_err(|e| errors::other(format!("reduce_dtype {d:?}: {e}")))?;
            config.reduce = GradReduce { dtype: Some(dtype), ..GradReduce::default() };
        }
        // The scheduler checks the factors and the bucket ids, naming a bad one; it splits a
        // factor of an f16 reduction as the mean's.
        config.reduce_per_bucket = divide
            .into_iter()
            .map(|(b, f)| (BucketId(b), GradReduce { post_divide: Some(f), ..GradReduce::default() }))
            .collect();
        let coord = match &slf.borrow().state {
            St::Host(s) => Co::Host(s.coordinator(config).map_err(errors::runtime)?),
            St::Emulated(s) => Co::Emulated(s.coordinator(config).map_err(errors::runtime)?),
            #[cfg(feature = "cuda")]
            St::Cuda(s) => Co::Cuda(s.coordinator(config).map_err(errors::runtime)?),
        };
        Ok(Engine { coord, model: slf.into_any().unbind() })
    }
}

/// A coordinator on a [`Model`]: fetch, release, gradients, no_sync, steps. Several engines on
/// one model (training and evaluation) share its gathered buffers.
#[pyclass(module = "collsched._native")]
pub struct Engine {
    coord: Co,
    /// The model (owner of every region handed out).
    model: Py<PyAny>,
}

/// A loaded checkpoint: its index (JSON) and the states asked for (dtype, bytes).
type LoadedStates<'py> = (String, Vec<Option<(&'static str, Bound<'py, PyByteArray>)>>);

/// A reduced gradient shard: parameter id, first element, its bytes (a bytearray) or where
/// it is (a device region), reduction dtype.
type GradShard = (u32, usize, Py<PyAny>, &'static str);

fn ids(v: &[u32]) -> Vec<ParamId> {
    v.iter().map(|&i| ParamId(i)).collect()
}

fn dtype_name(e: ElemType) -> &'static str {
    match e {
        ElemType::F32 => "f32",
        ElemType::F16 => "f16",
        ElemType::BF16 => "bf16",
    }
}

#[pymethods]
impl Engine {
    /// Gathers `params` (whole buckets, prefetching ahead) and returns a region per parameter
    /// with its full value, valid until the parameter is released.
    ///
    /// With `known` (an address per parameter, 0 for none), a parameter whose full value is at
    /// the address given gets `None` instead of a new region: the caller's view of that
    /// address is still the parameter (buffers come back from the pool at the same address,
    /// step after step), and making a new view is the cost this saves.
    #[pyo3(signature = (params, known=None))]
    fn fetch(
        &mut self,
        py: Python<'_>,
        params: Vec<u32>,
        known: Option<Vec<usize>>,
    ) -> PyResult<Vec<Option<Region>>> {
        let ids = ids(&params);
        if known.as_ref().is_some_and(|k| k.len() != ids.len()) {
            return Err(errors::other("fetch: give one known address per parameter"));
        }
        let known = known.as_deref();
        let emulated = matches!(self.coord, Co::Emulated(_));
        let regions =
            each!(Co, &mut self.coord, c => fetch_regions(c, &self.model, py, &ids, known, emulated))?;
        if let Co::Emulated(c) = &self.coord {
            host_is_compute(c, "fetch")?;
        }
        Ok(regions)
    }

    /// The backward pass of this step begins (a policy with backward rules switches to them).
    fn begin_backward(&mut self) {
        each!(Co, &mut self.coord, c => c.begin_backward());
    }

    /// Replaces the prefetch policy by explicit rules: `forward` and `backward` are
    /// `(bucket, [buckets])` pairs, "after this gather bucket is fetched, prefetch those"; each
    /// rule fires once per pass of a step.
    fn set_explicit(&mut self, forward: Vec<(u32, Vec<u32>)>, backward: Vec<(u32, Vec<u32>)>) {
        let mut e = Explicit::default();
        e.once_per_step(true);
        let ids = |v: &[u32]| v.iter().map(|&b| BucketId(b)).collect::<Vec<_>>();
        for (b, then) in &forward {
            e.after(BucketId(*b), &ids(then));
        }
        for (b, then) in &backward {
            e.after_in_backward(BucketId(*b), &ids(then));
        }
        each!(Co, &mut self.coord, c => c.set_policy(Box::new(e)));
    }

    /// The engine is done with `params` (their buckets are freed once nobody holds them; on
    /// CUDA once the compute stream passed the work queued on it so far, which reads them).
    fn release(&mut self, params: Vec<u32>) -> PyResult<()> {
        match &mut self.coord {
            Co::Host(c) => c.release(&ids(&params)),
            Co::Emulated(c) => release_after_compute(c, &ids(&params)),
            #[cfg(feature = "cuda")]
            Co::Cuda(c) => release_after_compute(c, &ids(&params)),
        }
        .map_err(errors::runtime)
    }

    /// The full gradient of parameter `id`, `grad` (a contiguous tensor). On a host backend a
    /// CPU tensor of the parameter's dtype, copied in before return; on CUDA a tensor of the
    /// reduction dtype on the rank's device, written on the compute stream, packed in on that
    /// stream (the caller may drop it after the call: torch reuses its memory in that stream's
    /// order). Not under no_sync on CUDA (the caller accumulates). A tensor on another device
    /// than the backend's is refused, never read.
    fn grad_ready(&mut self, id: u32, grad: Bound<'_, PyAny>) -> PyResult<()> {
        let what = format!("grad_ready: parameter id {id}'s gradient");
        match &mut self.coord {
            Co::Host(c) => {
                // SAFETY: `host_tensor_bytes`' contract: `grad` is held for the call, and
                // grad_ready copies the bytes before returning.
                let bytes = unsafe { host_tensor_bytes(&grad, &what) }?;
                c.grad_ready(ParamId(id), bytes).map_err(errors::runtime)
            }
            // A device gradient: as one of a unit's (one pack, the same checks).
            _ => self.grad_ready_many(vec![(id, grad)]),
        }
    }

    /// [`Engine::grad_ready`] for each `(id, grad)` of `grads`, in order (one call for a
    /// unit's gradients); the first failure stops there and is raised.
    ///
    /// Device gradients (`cuda`, `emulated`) go over in one call to the library, which packs
    /// each gradient bucket's of them with one launch; a gradient it cannot take as a buffer
    /// (on another device, not contiguous) is refused before any of the call's is taken.
    fn grad_ready_many(&mut self, grads: Vec<(u32, Bound<'_, PyAny>)>) -> PyResult<()> {
        match &mut self.coord {
            Co::Host(_) => {
                for (id, grad) in grads {
                    self.grad_ready(id, grad)?;
                }
                Ok(())
            }
            Co::Emulated(c) => {
                // As `grad_ready`: each gradient into a buffer of the backend's, freed after
                // the packs the compute stream holds once the call returns.
                let be = Arc::clone(c.model().backend());
                let rank = c.model().rank();
                let backend_err = |source| RuntimeError::Backend {
                    rank,
                    op: "grad_ready (staging an emulated device gradient)",
                    bucket: None,
                    source,
                };
                let mut buffers = Vec::with_capacity(grads.len());
                let mut staged = Ok(());
                for (id, grad) in &grads {
                    let what = format!("grad_ready: parameter id {id}'s gradient");
                    // SAFETY: `host_tensor_bytes`' contract: `grad` is held for the call, and
                    // the bytes are copied into the buffer before the next line.
                    let bytes = match unsafe { host_tensor_bytes(grad, &what) } {
                        Ok(bytes) => bytes,
                        Err(e) => {
                            staged = Err(e);
                            break;
                        }
                    };
                    let made = be
                        .alloc(bytes.len())
                        .and_then(|mut b| be.write_from_host(&mut b, 0, bytes).map(|()| b));
                    match made {
                        Ok(b) => buffers.push((ParamId(*id), b)),
                        Err(e) => {
                            staged = Err(errors::runtime(backend_err(e)));
                            break;
                        }
                    }
                }
                let lent: Vec<(ParamId, &_)> = buffers.iter().map(|(id, b)| (*id, b)).collect();
                // Nothing is taken unless every gradient was staged; the staged buffers go
                // back to the backend below either way.
                let r = staged.and_then(|()| c.grad_ready_many_on_device(&lent).map_err(errors::runtime));
                drop(lent);
                match be.record(Stream::Compute) {
                    Ok(after) => buffers.into_iter().for_each(|(_, b)| be.free(b, Some(&after))),
                    Err(e) => {
                        // Never given back: the packs may still read them.
                        std::mem::forget(buffers);
                        return Err(errors::runtime(backend_err(e)));
                    }
                }
                r
            }
            #[cfg(feature = "cuda")]
            Co::Cuda(c) => {
                let device = collsched::backend::Backend::device(&**c.model().backend());
                let mut buffers = Vec::with_capacity(grads.len());
                for (id, grad) in &grads {
                    let what = format!("grad_ready: parameter id {id}'s gradient");
                    let span = tensor_span(grad, &what)?;
                    if span.device != device {
                        return Err(errors::other(format!(
                            "{what}: on {}, where this rank's device is cuda:{}; move it there first",
                            span.device.map_or_else(|| "cpu".to_string(), |d| format!("cuda:{d}")),
                            device.unwrap_or(0)
                        )));
                    }
                    // SAFETY: as in `grad_ready`: `span.len` contiguous bytes on the rank's
                    // device (checked above), alive during the call (`grads` holds them); the
                    // packs that read them are queued on the compute stream before it returns.
                    let buffer =
                        unsafe { collsched::backend::cuda::CudaBuffer::from_raw(span.addr as u64, span.len) };
                    buffers.push((ParamId(*id), buffer));
                }
                let lent: Vec<(ParamId, &_)> = buffers.iter().map(|(id, b)| (*id, b)).collect();
                c.grad_ready_many_on_device(&lent).map_err(errors::runtime)
            }
        }
    }

    /// no_sync on (`True`: gradients accumulate locally) or off, from the next gradient on.
    fn set_no_sync(&mut self, on: bool) -> PyResult<()> {
        each!(Co, &mut self.coord, c => c.set_no_sync(on)).map_err(errors::runtime)
    }

    /// Ends the step (reductions finished, prefetches drained); returns its counters.
    fn end_step<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = each!(Co, &mut self.coord, c => c.end_step()).map_err(errors::runtime)?;
        stats_dict(py, &stats)
    }

    /// The last ended step's counters.
    fn last_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        each!(Co, &self.coord, c => stats_dict(py, c.last_stats()))
    }

    /// Applies a new trainability mask (one flag per parameter) now, between steps;
    /// collective when it changed (the new plan's fingerprint is exchanged). Returns whether
    /// it changed.
    fn refresh_trainable(&mut self, mask: Vec<bool>) -> PyResult<bool> {
        each!(Co, &mut self.coord, c => c.refresh_trainable(&mask)).map_err(errors::runtime)
    }

    /// The reduced gradient shards of the last synchronized step, consumed:
    /// `[(id, param_offset, data, dtype)]` per trainable parameter with elements on this
    /// rank, `dtype` the reduction's ("f32", "bf16", "f16"); `data` is a bytearray (host
    /// backends), or on CUDA a device region valid until the next call on this engine and
    /// invalid after `release_grads` (copy it out on the compute stream before).
    fn take_grads(&mut self, py: Python<'_>) -> PyResult<Vec<GradShard>> {
        let mut out = Vec::new();
        match &mut self.coord {
            Co::Host(c) => c
                .update_shards(|u| {
                    let data = PyByteArray::new(py, u.grad).into_any().unbind();
                    out.push((u.param.0, u.param_offset, data, dtype_name(u.grad_elem)))
                })
                .map(drop)
                .map_err(errors::runtime),
            Co::Emulated(c) => device_grads(c, &self.model, py, true, &mut out)
                .and_then(|()| host_is_compute(c, "take_grads")),
            #[cfg(feature = "cuda")]
            Co::Cuda(c) => device_grads(c, &self.model, py, false, &mut out),
        }?;
        Ok(out)
    }

    /// Gives the device memory of the gradients `take_grads` handed out back to the library's
    /// pool once the compute stream passed what is queued on it now (copy them out first);
    /// without it, it goes back at their bucket's next reduction. Host backends: nothing to do.
    fn release_grads(&mut self) -> PyResult<()> {
        each!(Co, &mut self.coord, c => c.release_grad_shards()).map_err(errors::runtime)
    }

    /// Gradient reductions launched and not yet finished.
    #[getter]
    fn reductions_in_flight(&self) -> usize {
        each!(Co, &self.coord, c => c.reductions_in_flight())
    }

    /// Gathered bytes live on this rank (every engine of the model).
    #[getter]
    fn live_bytes(&self) -> usize {
        each!(Co, &self.coord, c => c.model().live_bytes())
    }
}

fn stats_dict<'py>(py: Python<'py>, s: &StepStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let c = &s.schedule;
    d.set_item("step", s.step)?;
    d.set_item("all_gathers", c.all_gathers)?;
    d.set_item("reduce_scatters", c.reduce_scatters)?;
    d.set_item("ops_issued", c.ops_issued)?;
    d.set_item("gathered_bytes", c.gathered_bytes)?;
    d.set_item("reduced_bytes", c.reduced_bytes)?;
    d.set_item("prefetch_launches", c.prefetch_launches)?;
    d.set_item("prefetch_hits", c.prefetch_hits)?;
    d.set_item("prefetch_misses", c.prefetch_misses)?;
    d.set_item("already_gathered", c.already_gathered)?;
    d.set_item("waits", c.waits)?;
    d.set_item("evictions", c.evictions)?;
    d.set_item("discarded_prefetches", c.discarded_prefetches)?;
    d.set_item("live_overruns", c.live_overruns)?;
    d.set_item("peak_gathered_bytes", c.peak_gathered_bytes)?;
    d.set_item("drained_params", c.drained_params)?;
    d.set_item("zero_filled_params", c.zero_filled_params)?;
    d.set_item("accumulated_grads", c.accumulated_grads)?;
    d.set_item("collectives", s.driver.collectives)?;
    d.set_item("bytes_moved", s.driver.bytes_moved)?;
    d.set_item("wait_ms", s.driver.wait_time.as_secs_f64() * 1e3)?;
    d.set_item("blocked_waits", s.driver.blocked_waits)?;
    Ok(d)
}
