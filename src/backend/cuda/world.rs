//! One process driving several GPUs, one thread per GPU (what `collsched bench --backend cuda`
//! and single-node tests use). Multi-process jobs build one [`CudaBackend`] per process instead
//! ([`CudaBackend::from_launch_env`]).

use std::time::Duration;

use super::{device_count, nccl, CudaBackend, CudaConfig, CudaError, UniqueId, DEFAULT_TIMEOUT};
use crate::backend::RankGroup;

/// `ranks` GPUs of this process (device `r` for rank `r`), joined by one NCCL world.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaWorld {
    ranks: usize,
    groups: Vec<RankGroup>,
    timeout: Duration,
}

impl CudaWorld {
    /// Checks that the driver, NCCL and `ranks` devices are there (before any thread waits in
    /// NCCL's bootstrap for a rank that cannot come).
    ///
    /// # Errors
    /// `no CUDA driver found: ...`, `no NCCL found: ...`, [`CudaError::NoSuchDevice`] when there
    /// are fewer devices than ranks, [`CudaError::Invalid`] for zero ranks.
    pub fn new(ranks: usize) -> Result<Self, CudaError> {
        if ranks == 0 {
            return Err(CudaError::Invalid {
                op: "CudaWorld::new".into(),
                what: "a world needs at least one rank".into(),
            });
        }
        let count = device_count()?;
        if count < ranks {
            return Err(CudaError::NoSuchDevice { ordinal: ranks - 1, count });
        }
        nccl::version()?;
        Ok(CudaWorld { ranks, groups: Vec::new(), timeout: DEFAULT_TIMEOUT })
    }

    /// Declares the extra rank groups collectives will use (see [`CudaConfig::groups`]).
    #[must_use]
    pub fn with_groups(mut self, groups: Vec<RankGroup>) -> Self {
        self.groups = groups;
        self
    }

    /// Sets the backends' timeout.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.ranks
    }

    /// Runs `f` on every rank, each on its own thread with its own [`CudaBackend`], and returns
    /// the ranks' results in rank order (`Err` for a rank whose thread panicked).
    ///
    /// # Errors
    /// The first rank's failure to build its backend (then no `f` ran on that rank).
    pub fn run<T, F>(&self, f: F) -> Result<Vec<std::thread::Result<T>>, CudaError>
    where
        T: Send,
        F: Fn(CudaBackend) -> T + Sync,
    {
        let id = UniqueId::generate()?;
        let f = &f;
        let results: Vec<std::thread::Result<Result<T, CudaError>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.ranks)
                .map(|rank| {
                    let config = CudaConfig {
                        rank,
                        world: self.ranks,
                        device: rank,
                        groups: self.groups.clone(),
                        timeout: self.timeout,
                    };
                    s.spawn(move || CudaBackend::new(config, &id).map(f))
                })
                .collect();
            handles.into_iter().map(|h| h.join()).collect()
        });
        let mut out = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(Ok(v)) => out.push(Ok(v)),
                Ok(Err(e)) => return Err(e),
                Err(panic) => out.push(Err(panic)),
            }
        }
        Ok(out)
    }
}
