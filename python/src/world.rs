//! [`World`]: this process's rank of a job on the `shm` backend (and the job's hub), of an
//! MPI job on the `mpi` backend (a build with the `mpi` feature), or of a job with one GPU per
//! process on the `cuda` backend (NCCL; a build with the `cuda` feature).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use collsched::backend::flight::ComputeSpan;
use collsched::backend::local::LocalRank;
use collsched::backend::ondevice::OnDevice;
use collsched::backend::shm::{join, ShmConfig};
use collsched::backend::{Backend, Exchange};
use collsched::bootstrap::LaunchEnv;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors;

/// This process's rank of a job on the `shm` backend (one process per rank, one machine).
///
/// `World()` reads the launcher's environment (torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
/// or Open MPI's); `World(rank, world, job)` takes them from the caller (an engine that already
/// knows them from `torch.distributed`, with a job key it agreed on through its store).
/// Collective: every rank of the job makes its `World`, and they meet. `World.mpi()` joins the
/// MPI job this process was started in instead (`mpirun`; a build with the `mpi` feature).
#[pyclass(module = "collsched._native")]
pub struct World {
    /// Dropped before `hub`: the rank's streams finish before the job closes (for MPI, before
    /// MPI_Finalize).
    pub(crate) backend: Rank,
    /// The job's small exchanges: the bootstrap hub (`shm`) or the MPI job (`mpi`). Behind a
    /// lock so that the world is usable from any thread (autograd calls the package's hooks
    /// from its device threads on CUDA); the exchanges are collective and rare.
    hub: Mutex<Box<dyn Exchange>>,
}

/// Whether this build has the `mpi` backend.
pub(crate) const HAS_MPI: bool = cfg!(feature = "mpi");
/// Whether this build has the `cuda` backend.
pub(crate) const HAS_CUDA: bool = cfg!(feature = "cuda");

/// This process's rank: of a host backend (`shm`, `mpi`: one type, the local backend behind
/// another meeting place), of the shm backend seen as a device (`emulated`), or of the CUDA
/// backend.
pub(crate) enum Rank {
    Host(Arc<LocalRank>),
    Emulated(Arc<OnDevice<LocalRank>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<collsched::backend::cuda::CudaBackend>),
}

impl World {
    /// The job's exchange. Exchanges are collective, one at a time: a second thread's call
    /// while one runs is refused (waiting for the lock while holding the interpreter could
    /// deadlock with an exchange that calls into Python). A poisoned lock only means a panic
    /// elsewhere; the hub is intact.
    fn exchange(&self) -> PyResult<MutexGuard<'_, Box<dyn Exchange>>> {
        match self.hub.try_lock() {
            Ok(g) => Ok(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => Err(errors::other(
                "World: an exchange of this rank is running on another thread; exchanges are collective, \
                 make them from one thread at a time",
            )),
        }
    }
}

impl Rank {
    /// The rank and world size.
    pub(crate) fn rank_world(&self) -> (usize, usize) {
        match self {
            Rank::Host(b) => (b.rank(), b.world_size()),
            Rank::Emulated(b) => (b.rank(), b.world_size()),
            #[cfg(feature = "cuda")]
            Rank::Cuda(b) => (b.rank(), b.world_size()),
        }
    }

    /// The host backend, for what runs on host memory only (`op` names it in the error).
    pub(crate) fn host(&self, op: &str) -> PyResult<&Arc<LocalRank>> {
        let _ = op; // named in the error of the other kinds
        match self {
            Rank::Host(b) => Ok(b),
            Rank::Emulated(_) => Err(errors::other(format!(
                "{op}: this world is the emulated device, which it does not run on; make a World() (shm) for it"
            ))),
            #[cfg(feature = "cuda")]
            Rank::Cuda(_) => Err(errors::other(format!(
                "{op}: this world is on the cuda backend, which it does not run on; make a World() (shm) for it"
            ))),
        }
    }
}

/// The job's small exchanges through a Python callable (`exchange(bytes) -> list[bytes]`,
/// every rank's bytes in rank order; collective): an engine's own, e.g. torch.distributed's
/// store, which reaches every machine of the job.
#[cfg(feature = "cuda")]
struct PyExchange(Py<PyAny>);

#[cfg(feature = "cuda")]
impl Exchange for PyExchange {
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, collsched::backend::BackendError> {
        Python::attach(|py| {
            let out = self.0.bind(py).call1((PyBytes::new(py, mine),))?;
            out.extract::<Vec<Vec<u8>>>()
        })
        .map_err(|e| collsched::backend::BackendError::Unsupported {
            what: format!("the job's exchange (a Python callable) failed: {e}"),
        })
    }
}

/// The launcher's environment, or the caller's rank, world and job key (all or none).
fn launch_env(rank: Option<usize>, world: Option<usize>, job: Option<String>) -> PyResult<LaunchEnv> {
    match (rank, world, job) {
        (None, None, None) => LaunchEnv::from_env().map_err(errors::other),
        (Some(rank), Some(world), Some(job)) => {
            let vars: HashMap<&str, String> = [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("LOCAL_WORLD_SIZE", world.to_string()),
                ("COLLSCHED_RUN_ID", job),
            ]
            .into_iter()
            .collect();
            LaunchEnv::from_lookup(|k| vars.get(k).cloned()).map_err(errors::other)
        }
        _ => Err(errors::other(
            "World: give rank, world and job together, or none of them (read from the launcher's environment)",
        )),
    }
}

#[pymethods]
impl World {
    /// `timeout_secs`: how long a member waits for the others (a process group's timeout),
    /// where `COLLSCHED_TIMEOUT_SECS` does not say (it wins when set); else its 300 s.
    #[new]
    #[pyo3(signature = (rank=None, world=None, job=None, timeout_secs=None))]
    fn new(
        rank: Option<usize>,
        world: Option<usize>,
        job: Option<String>,
        timeout_secs: Option<f64>,
    ) -> PyResult<World> {
        let env = launch_env(rank, world, job)?;
        let mut config = ShmConfig::from_env().map_err(errors::other)?;
        if let Some(secs) = timeout_secs {
            let given =
                std::time::Duration::try_from_secs_f64(secs).ok().filter(|d| !d.is_zero()).ok_or_else(
                    || errors::other(format!("World: timeout_secs {secs}: give a positive number")),
                )?;
            if std::env::var_os("COLLSCHED_TIMEOUT_SECS").is_none() {
                config.local.timeout = given;
            }
        }
        let (backend, hub) = join(&env, &config).map_err(errors::backend)?;
        Ok(World { backend: Rank::Host(Arc::new(backend)), hub: Mutex::new(Box::new(hub)) })
    }

    /// This process's rank of a job on the `shm` backend seen as a device backend (collective;
    /// rank, world and job as for `World(...)`): shards, gathered parameters and reduced
    /// gradients live in memory the bindings never read as host memory (its regions refuse
    /// the buffer protocol, as CUDA's do, and export DLPack tensors of the host), and
    /// gradients are given in the reduction dtype and packed on the compute stream, as on
    /// CUDA. What `collsched.torch` does on a GPU then runs on the CPU, for its tests.
    #[staticmethod]
    #[pyo3(signature = (rank=None, world=None, job=None))]
    fn emulated(rank: Option<usize>, world: Option<usize>, job: Option<String>) -> PyResult<World> {
        let env = launch_env(rank, world, job)?;
        let config = ShmConfig::from_env().map_err(errors::other)?;
        let (backend, hub) = join(&env, &config).map_err(errors::backend)?;
        Ok(World { backend: Rank::Emulated(Arc::new(OnDevice(backend))), hub: Mutex::new(Box::new(hub)) })
    }

    /// This process's rank of a job with one GPU per process (collective): CUDA device
    /// `device`, NCCL on the library's own streams, and `stream` (a `CUstream` handle:
    /// `torch.cuda.current_stream().cuda_stream`) as the compute stream, which must outlive
    /// the world. The ranks meet through the job's hub on this machine (rank, world and job
    /// as for `World(...)`), or through `exchange` when given (a callable taking this rank's
    /// bytes and returning every rank's, in rank order, collectively: the job may then span
    /// machines; give `rank` and `world` with it, no job key), where rank 0's NCCL unique id
    /// goes to the others. `groups`: the rank groups besides the world that plans will use
    /// (hybrid sharding's shard and replica groups; NCCL makes their communicators now, on
    /// every rank alike). `timeout_secs`: how long host waits last (the backend's timeout).
    #[staticmethod]
    #[pyo3(signature = (device, stream, rank=None, world=None, job=None, groups=Vec::new(), timeout_secs=300.0, exchange=None))]
    #[allow(clippy::too_many_arguments)]
    fn cuda(
        device: usize,
        stream: usize,
        rank: Option<usize>,
        world: Option<usize>,
        job: Option<String>,
        groups: Vec<Vec<usize>>,
        timeout_secs: f64,
        exchange: Option<Py<PyAny>>,
    ) -> PyResult<World> {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, stream, rank, world, job, groups, timeout_secs, exchange);
            Err(errors::other(
                "World.cuda(): this collsched package was built without the cuda backend; rebuild it with \
                 MATURIN_PEP517_ARGS='--features cuda' pip install ./python",
            ))
        }
        #[cfg(feature = "cuda")]
        {
            use collsched::backend::cuda::{CudaBackend, CudaConfig, RawStream, UniqueId};
            use collsched::backend::RankGroup;
            use collsched::bootstrap::{Hub, HubConfig};
            let timeout = std::time::Duration::try_from_secs_f64(timeout_secs)
                .map_err(|e| errors::other(format!("World.cuda: timeout_secs {timeout_secs}: {e}")))?;
            let (env, mut hub): (LaunchEnv, Box<dyn Exchange>) = match (exchange, rank, world, &job) {
                (Some(f), Some(rank), Some(world), None) => {
                    (launch_env(Some(rank), Some(world), Some(String::new()))?, Box::new(PyExchange(f)))
                }
                (Some(_), ..) => return Err(errors::other(
                    "World.cuda: with an exchange, give rank and world (and no job key: the exchange is the \
                         job's)",
                )),
                (None, ..) => {
                    let env = launch_env(rank, world, job)?;
                    let config = HubConfig::from_env().map_err(errors::other)?;
                    let hub = Hub::connect(&env, &config).map_err(errors::other)?;
                    (env, Box::new(hub))
                }
            };
            // Every rank checks its device and rank 0 makes NCCL's id before any of them
            // enters NCCL's initialization, which would wait for a rank that failed: a
            // failure anywhere is every rank's error, naming where it happened.
            let device_ok = match collsched::backend::cuda::device_count() {
                Ok(n) if device < n => Ok(()),
                Ok(n) => Err(format!("device {device} does not exist ({n} CUDA devices)")),
                Err(e) => Err(e.to_string()),
            };
            let id = match (&device_ok, env.rank) {
                (Ok(()), 0) => UniqueId::generate().map_err(|e| format!("making NCCL's unique id: {e}")),
                _ => Ok(UniqueId([0; UniqueId::BYTES])),
            };
            let mine = match (&device_ok, &id) {
                (Ok(()), Ok(id)) => id.0.to_vec(),
                (Err(e), _) | (_, Err(e)) => e.clone().into_bytes(),
            };
            let all = hub.all_gather_bytes(&mine).map_err(errors::backend)?;
            let failed: Vec<String> = all
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() != UniqueId::BYTES)
                .map(|(r, b)| format!("rank {r}: {}", String::from_utf8_lossy(b)))
                .collect();
            if !failed.is_empty() {
                return Err(errors::other(format!("World.cuda: {}", failed.join("; "))));
            }
            let id = UniqueId::from_bytes(&all[0]).map_err(errors::other)?;
            let mut config = CudaConfig::new(env.rank, env.world, device);
            config.timeout = timeout;
            for g in groups {
                config.groups.push(RankGroup::new(g).map_err(errors::other)?);
            }
            // SAFETY: the caller passes a live stream of `device`'s primary context (torch's
            // current stream; 0 is the legacy default stream, which always is) that outlives
            // the world (the Python package keeps it until the process ends).
            let backend = unsafe { CudaBackend::with_compute_stream(config, &id, stream as RawStream) }
                .map_err(errors::other)?;
            Ok(World { backend: Rank::Cuda(Arc::new(backend)), hub: Mutex::new(hub) })
        }
    }

    /// This process's rank of the MPI job it was started in (`mpirun`; collective: every rank
    /// calls it). MPI is initialized at MPI_THREAD_MULTIPLE unless it already is.
    #[staticmethod]
    fn mpi() -> PyResult<World> {
        #[cfg(feature = "mpi")]
        {
            use collsched::backend::mpi::{join, MpiConfig};
            let config = MpiConfig::from_env().map_err(errors::other)?;
            let (backend, job) = join(&config).map_err(errors::backend)?;
            Ok(World { backend: Rank::Host(Arc::new(backend)), hub: Mutex::new(Box::new(job)) })
        }
        #[cfg(not(feature = "mpi"))]
        Err(errors::other(
            "World.mpi(): this collsched package was built without the mpi backend; rebuild it with \
             MATURIN_PEP517_ARGS='--features mpi' pip install ./python (needs libopenmpi-dev and libclang-dev)",
        ))
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.backend.rank_world().0
    }

    /// Ranks in the job.
    #[getter]
    fn world(&self) -> usize {
        self.backend.rank_world().1
    }

    /// The backend: "host" (`shm`, `mpi`), "emulated" ([`World::emulated`]) or "cuda".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.backend {
            Rank::Host(_) => "host",
            Rank::Emulated(_) => "emulated",
            #[cfg(feature = "cuda")]
            Rank::Cuda(_) => "cuda",
        }
    }

    /// Every rank's `data`, by rank (collective; small exchanges: error reports, agreement).
    fn all_gather<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let all = self.exchange()?.all_gather_bytes(data).map_err(errors::backend)?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// This rank's flight record (its last collectives: sequence number, op, bucket, group,
    /// bytes, dtype, stream, state, times) as JSON text, taken because of `reason`, with
    /// `compute` (`(name, step, start_ns, end_ns)`, oldest first) on its compute track; with
    /// `dir`, also written there as `rank-R.json` for `collsched flight DIR`. Not collective.
    #[pyo3(signature = (reason="requested", dir=None, compute=Vec::new()))]
    fn flight_record(
        &self,
        reason: &str,
        dir: Option<std::path::PathBuf>,
        compute: Vec<(String, u64, u64, u64)>,
    ) -> PyResult<String> {
        let mut dump = match &self.backend {
            Rank::Emulated(b) => b.0.flight_record(reason),
            other => other.host("flight_record")?.flight_record(reason),
        };
        let spans = compute.into_iter().map(|(name, step, start_ns, end_ns)| ComputeSpan {
            name,
            step,
            start_ns,
            end_ns,
        });
        dump.set_compute(spans.collect());
        if let Some(dir) = dir {
            dump.write_to(&dir).map_err(errors::other)?;
        }
        serde_json::to_string(&dump).map_err(errors::other)
    }

    /// What this rank's device memory pool holds (`cuda`): a dict of `reserved_bytes` (every
    /// block got from the driver), `in_use_bytes`, `deferred_bytes` (given back, their work not
    /// yet seen complete), `free_bytes` (cached for reuse) and `fresh_allocations`; `None` on a
    /// host or emulated world (their buffers are host memory). Not collective.
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match &self.backend {
            #[cfg(feature = "cuda")]
            Rank::Cuda(b) => {
                let s = b.pool().stats();
                let d = PyDict::new(py);
                d.set_item("reserved_bytes", s.reserved_bytes)?;
                d.set_item("in_use_bytes", s.in_use_bytes)?;
                d.set_item("deferred_bytes", s.deferred_bytes)?;
                d.set_item("free_bytes", s.free_bytes)?;
                d.set_item("fresh_allocations", s.fresh_allocations)?;
                Ok(Some(d))
            }
            _ => {
                let _ = py;
                Ok(None)
            }
        }
    }

    /// Returns this rank's cached free device blocks to the driver once its streams are quiet
    /// (`cuda`; as `torch.cuda.empty_cache()` does torch's); the bytes returned, 0 on a host or
    /// emulated world. Not collective.
    fn empty_cache(&self, py: Python<'_>) -> PyResult<usize> {
        match &self.backend {
            #[cfg(feature = "cuda")]
            Rank::Cuda(b) => {
                let b = Arc::clone(b);
                // The wait for the streams runs without the interpreter's lock: autograd's
                // threads may need it to finish the work waited for.
                py.detach(move || b.pool().empty_cache()).map_err(|e| errors::other(e.to_string()))
            }
            _ => {
                let _ = py;
                Ok(0)
            }
        }
    }

    /// Waits until every rank called it (collective).
    fn barrier(&mut self) -> PyResult<()> {
        self.exchange()?.all_gather_bytes(&[]).map(drop).map_err(errors::backend)
    }
}

/// The entries a flight record keeps: `COLLSCHED_FLIGHT_ENTRIES` as the library reads it (a
/// malformed value keeps the default and says so in the log), for `collsched.torch`'s compute
/// spans.
#[pyfunction]
pub fn flight_entries() -> usize {
    collsched::backend::flight::FlightConfig::from_env().entries
}
