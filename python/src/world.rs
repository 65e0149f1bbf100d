//! [`World`]: this process's rank of a job on the `shm` backend (and the job's hub), or of an
//! MPI job on the `mpi` backend (a build with the `mpi` feature).

use std::collections::HashMap;
use std::sync::Arc;

use collsched::backend::local::LocalRank;
use collsched::backend::shm::{join, ShmConfig};
use collsched::backend::{Backend, Exchange};
use collsched::bootstrap::LaunchEnv;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

/// This process's rank of a job on the `shm` backend (one process per rank, one machine).
///
/// `World()` reads the launcher's environment (torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
/// or Open MPI's); `World(rank, world, job)` takes them from the caller (an engine that already
/// knows them from `torch.distributed`, with a job key it agreed on through its store).
/// Collective: every rank of the job makes its `World`, and they meet. `World.mpi()` joins the
/// MPI job this process was started in instead (`mpirun`; a build with the `mpi` feature).
#[pyclass(module = "collsched._native", unsendable)]
pub struct World {
    /// Dropped before `hub`: the rank's streams finish before the job closes (for MPI, before
    /// MPI_Finalize).
    pub(crate) backend: Arc<LocalRank>,
    /// The job's small exchanges: the bootstrap hub (`shm`) or the MPI job (`mpi`).
    hub: Box<dyn Exchange>,
}

/// Whether this build has the `mpi` backend.
pub(crate) const HAS_MPI: bool = cfg!(feature = "mpi");

#[pymethods]
impl World {
    #[new]
    #[pyo3(signature = (rank=None, world=None, job=None))]
    fn new(rank: Option<usize>, world: Option<usize>, job: Option<String>) -> PyResult<World> {
        let env =
            match (rank, world, job) {
                (None, None, None) => LaunchEnv::from_env().map_err(errors::other)?,
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
                    LaunchEnv::from_lookup(|k| vars.get(k).cloned()).map_err(errors::other)?
                }
                _ => return Err(errors::other(
                    "World: give rank, world and job together, or none of them (read from the launcher's \
                     environment)",
                )),
            };
        let config = ShmConfig::from_env().map_err(errors::other)?;
        let (backend, hub) = join(&env, &config).map_err(errors::backend)?;
        Ok(World { backend: Arc::new(backend), hub: Box::new(hub) })
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
            Ok(World { backend: Arc::new(backend), hub: Box::new(job) })
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
        self.backend.rank()
    }

    /// Ranks in the job.
    #[getter]
    fn world(&self) -> usize {
        self.backend.world_size()
    }

    /// Every rank's `data`, by rank (collective; small exchanges: error reports, agreement).
    fn all_gather<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let all = self.hub.all_gather_bytes(data).map_err(errors::backend)?;
        Ok(all.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// This rank's flight record (its last collectives: sequence number, op, bucket, group,
    /// bytes, dtype, stream, state, times) as JSON text, taken because of `reason`; with
    /// `dir`, also written there as `rank-R.json` for `collsched flight DIR`. Not collective.
    #[pyo3(signature = (reason="requested", dir=None))]
    fn flight_record(&self, reason: &str, dir: Option<std::path::PathBuf>) -> PyResult<String> {
        let dump = self.backend.flight_record(reason);
        if let Some(dir) = dir {
            dump.write_to(&dir).map_err(errors::other)?;
        }
        serde_json::to_string(&dump).map_err(errors::other)
    }

    /// Waits until every rank called it (collective).
    fn barrier(&mut self) -> PyResult<()> {
        self.hub.all_gather_bytes(&[]).map(drop).map_err(errors::backend)
    }
}
