//! [`Model`] (one rank's share of a sharded model) and [`Engine`] (a coordinator on it): the
//! runtime's engine API for the Python package's `collsched.torch`.

use collsched::backend::local::LocalRank;
use collsched::backend::Backend;
use collsched::buckets::{BucketId, DType, ParamId};
use collsched::kernels::ElemType;
use collsched::runtime::StepStats;
use collsched::schedule::{Explicit, GradReduce, PolicyKind, SchedulerConfig};
use collsched::{checkpoint, Coordinator, ModelState};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::errors;
use crate::region::{tensor_bytes, Region};
use crate::world::World;

/// One rank's share of one model: its shards (the optimizer's memory), its gradient shards and
/// its in-flight registry, built from the plan of `params` (a parameter file's text) and the
/// full initial value of every parameter (`init`: `(address, bytes)` of a contiguous CPU
/// tensor per parameter, read during the call). Collective: every rank builds its model at
/// the same point with the same plan.
#[pyclass(module = "collsched._native", unsendable)]
pub struct Model {
    state: ModelState<LocalRank>,
    plan_json: String,
}

#[pymethods]
impl Model {
    #[new]
    #[pyo3(signature = (world, params, init, strategy="even", bucket_mb=64.0, align=collsched::buckets::DEFAULT_ALIGN, bucket_by="size"))]
    fn new(
        world: &World,
        params: &str,
        init: Vec<(usize, usize)>,
        strategy: &str,
        bucket_mb: f64,
        align: usize,
        bucket_by: &str,
    ) -> PyResult<Model> {
        let ranks = u32::try_from(world.backend.world_size()).map_err(errors::other)?;
        let plan = crate::plan::build(params, ranks, strategy, bucket_mb, align, bucket_by)?;
        // SAFETY: the Python caller passes each parameter's contiguous CPU tensor, which it
        // holds for the duration of this call (`tensor_bytes`' contract); the bytes are copied
        // into the shards before the call returns.
        let full: Vec<&[u8]> = init.iter().map(|&(addr, len)| unsafe { tensor_bytes(addr, len) }).collect();
        let state = ModelState::new(world.backend.clone(), &plan, &full).map_err(errors::runtime)?;
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
        self.state.gather_memory().map(|(id, bytes)| (id.0, bytes)).collect()
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.state.rank()
    }

    /// The plan's fingerprint (16 hex digits).
    #[getter]
    fn fingerprint(&self) -> String {
        self.state.plan().fingerprint().to_string()
    }

    /// This rank's shard of parameter `id`: `(region, param_offset, numel)`, the elements
    /// `param_offset..param_offset + numel` of the flattened parameter, in memory the model
    /// owns for its whole life (`region` is `None` when this rank holds none of them). The
    /// optimizer updates it in place; the next gather reads it.
    fn shard(slf: Bound<'_, Self>, id: u32) -> PyResult<(Option<Region>, usize, usize)> {
        let r = slf.borrow().state.shard_region(ParamId(id)).map_err(errors::runtime)?;
        let region = (r.numel > 0)
            .then(|| Region::new(slf.clone().into_any().unbind(), r.ptr, r.numel * r.elem.size()));
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
        extras: Vec<(String, u32, String, usize, usize)>,
        meta: &str,
    ) -> PyResult<String> {
        let meta: serde_json::Value = serde_json::from_str(meta).map_err(errors::other)?;
        let mut states = Vec::with_capacity(extras.len());
        for (name, id, dtype, addr, len) in extras {
            let dtype: DType = dtype.parse().map_err(|e| errors::other(format!("state {name}: {e}")))?;
            // SAFETY: `tensor_bytes`' contract: the Python caller passes a contiguous CPU
            // tensor it holds for the duration of this call; the bytes are copied here.
            let data = unsafe { tensor_bytes(addr, len) }.to_vec();
            states.push(checkpoint::ExtraState { name, param: ParamId(id), dtype, data });
        }
        let index =
            checkpoint::save_with(&self.state, &path, step, &states, meta).map_err(errors::checkpoint)?;
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
        let (index, states) =
            checkpoint::load_with(&self.state, &path, &wanted).map_err(errors::checkpoint)?;
        let states =
            states.into_iter().map(|s| s.map(|(d, b)| (d.name(), PyByteArray::new(py, &b)))).collect();
        Ok((serde_json::to_string(&index).map_err(errors::other)?, states))
    }

    /// Writes every parameter's full value to one safetensors file at `path`, gathering a
    /// bucket at a time (collective; between steps; rank 0 writes).
    fn save_full(&self, path: std::path::PathBuf) -> PyResult<()> {
        checkpoint::save_full(&self.state, &path).map_err(errors::checkpoint)
    }

    /// A coordinator on this model (collective: exchanges the plan fingerprint).
    ///
    /// `policy`: "trace" (record the first step's fetch order, prefetch along it) or "none";
    /// `prefetch_bytes`, `max_inflight`, `max_live_bytes`: the scheduler's budgets (`None`:
    /// its defaults); `reduce_dtype`: "f32", "bf16", "f16" or `None` (the parameter's).
    #[pyo3(signature = (policy="trace", prefetch_bytes=None, max_inflight=None, max_live_bytes=None, reduce_dtype=None))]
    fn engine(
        slf: Bound<'_, Self>,
        policy: &str,
        prefetch_bytes: Option<usize>,
        max_inflight: Option<usize>,
        max_live_bytes: Option<usize>,
        reduce_dtype: Option<&str>,
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
        let mut config = SchedulerConfig { policy, ..SchedulerConfig::default() };
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
        let coord = slf.borrow().state.coordinator(config).map_err(errors::runtime)?;
        Ok(Engine { coord, model: slf.into_any().unbind() })
    }
}

/// A coordinator on a [`Model`]: fetch, release, gradients, no_sync, steps. Several engines on
/// one model (training and evaluation) share its gathered buffers.
#[pyclass(module = "collsched._native", unsendable)]
pub struct Engine {
    coord: Coordinator<LocalRank>,
    /// The model (owner of every region handed out).
    model: Py<PyAny>,
}

/// A loaded checkpoint: its index (JSON) and the states asked for (dtype, bytes).
type LoadedStates<'py> = (String, Vec<Option<(&'static str, Bound<'py, PyByteArray>)>>);

/// A reduced gradient shard: parameter id, first element, bytes, reduction dtype.
type GradShard<'py> = (u32, usize, Bound<'py, PyByteArray>, &'static str);

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
        let views = self.coord.fetch(&ids).map_err(errors::runtime)?;
        let mut out = Vec::with_capacity(ids.len());
        for (i, &p) in ids.iter().enumerate() {
            let b = views.bytes(p).map_err(errors::runtime)?;
            let same = known.as_ref().is_some_and(|k| k[i] == b.as_ptr() as usize && !b.is_empty());
            out.push((!same).then(|| Region::new(self.model.clone_ref(py), b.as_ptr(), b.len())));
        }
        Ok(out)
    }

    /// The backward pass of this step begins (a policy with backward rules switches to them).
    fn begin_backward(&mut self) {
        self.coord.begin_backward();
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
        self.coord.set_policy(Box::new(e));
    }

    /// The engine is done with `params` (their buckets are freed once nobody holds them).
    fn release(&mut self, params: Vec<u32>) -> PyResult<()> {
        self.coord.release(&ids(&params)).map_err(errors::runtime)
    }

    /// The full gradient of parameter `id`: `bytes` bytes at `addr` (a contiguous CPU tensor
    /// of the parameter's dtype the caller holds during the call), copied in before return.
    fn grad_ready(&mut self, id: u32, addr: usize, bytes: usize) -> PyResult<()> {
        // SAFETY: `tensor_bytes`' contract: the Python caller passes a contiguous CPU tensor
        // it holds for the duration of this call; grad_ready copies it before returning.
        let grad = unsafe { tensor_bytes(addr, bytes) };
        self.coord.grad_ready(ParamId(id), grad).map_err(errors::runtime)
    }

    /// [`Engine::grad_ready`] for each `(id, addr, bytes)` of `grads`, in order (one call for
    /// a unit's gradients); the first failure stops there and is raised.
    fn grad_ready_many(&mut self, grads: Vec<(u32, usize, usize)>) -> PyResult<()> {
        for (id, addr, bytes) in grads {
            self.grad_ready(id, addr, bytes)?;
        }
        Ok(())
    }

    /// no_sync on (`True`: gradients accumulate locally) or off, from the next gradient on.
    fn set_no_sync(&mut self, on: bool) -> PyResult<()> {
        self.coord.set_no_sync(on).map_err(errors::runtime)
    }

    /// Ends the step (reductions finished, prefetches drained); returns its counters.
    fn end_step<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.coord.end_step().map_err(errors::runtime)?;
        stats_dict(py, &stats)
    }

    /// The last ended step's counters.
    fn last_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.coord.last_stats())
    }

    /// Applies a new trainability mask (one flag per parameter) now, between steps;
    /// collective when it changed (the new plan's fingerprint is exchanged). Returns whether
    /// it changed.
    fn refresh_trainable(&mut self, mask: Vec<bool>) -> PyResult<bool> {
        self.coord.refresh_trainable(&mask).map_err(errors::runtime)
    }

    /// The reduced gradient shards of the last synchronized step, consumed:
    /// `[(id, param_offset, bytes, dtype)]` per trainable parameter with elements on this
    /// rank, `dtype` the reduction's ("f32", "bf16", "f16").
    fn take_grads<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<GradShard<'py>>> {
        let mut out = Vec::new();
        self.coord
            .update_shards(|u| {
                out.push((u.param.0, u.param_offset, PyByteArray::new(py, u.grad), dtype_name(u.grad_elem)))
            })
            .map_err(errors::runtime)?;
        Ok(out)
    }

    /// Gradient reductions launched and not yet finished.
    #[getter]
    fn reductions_in_flight(&self) -> usize {
        self.coord.reductions_in_flight()
    }

    /// Gathered bytes live on this rank (every engine of the model).
    #[getter]
    fn live_bytes(&self) -> usize {
        self.coord.model().live_bytes()
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
    Ok(d)
}
