//! One bootstrap for every multi-process backend: who this process is ([`LaunchEnv`], from
//! torchrun's or Open MPI's variables) and how the processes of a job on one machine meet
//! ([`Hub`]: a Unix socket rank 0 listens on, exchanges of bytes and file descriptors, and the
//! peers' liveness through pidfds).
//!
//! ```no_run
//! use collsched::bootstrap::{Hub, HubConfig, LaunchEnv};
//! let env = LaunchEnv::from_env()?;                       // RANK, WORLD_SIZE, ... or OMPI_*
//! let mut hub = Hub::connect(&env, &HubConfig::from_env()?)?;
//! let names = hub.all_gather(format!("rank {}", env.rank).as_bytes())?;
//! assert_eq!(names.len(), env.world);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_BOOTSTRAP_TIMEOUT_SECS` | 60 ([`DEFAULT_TIMEOUT`]) | how long ranks wait for each other to join, and for each exchange |
//! | `COLLSCHED_RUN_ID` | the launcher's job variables | the job key: processes with the same key and world size meet |

mod env;
mod hub;

use std::time::Duration;

pub use env::{EnvError, LaunchEnv, Launcher};
pub use hub::{Hub, Liveness};

/// Default of `COLLSCHED_BOOTSTRAP_TIMEOUT_SECS`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Knobs of the bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubConfig {
    /// How long ranks wait for each other to join, and for each exchange.
    pub timeout: Duration,
}

impl Default for HubConfig {
    fn default() -> Self {
        HubConfig { timeout: DEFAULT_TIMEOUT }
    }
}

impl HubConfig {
    /// The defaults, with `COLLSCHED_BOOTSTRAP_TIMEOUT_SECS` applied.
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`HubConfig::from_env`], reading through `lookup`.
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let var = "COLLSCHED_BOOTSTRAP_TIMEOUT_SECS";
        let timeout = match lookup(var) {
            None => DEFAULT_TIMEOUT,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s <= 1e7 => Duration::from_secs_f64(s),
                _ => {
                    return Err(EnvError {
                        var,
                        value: v,
                        what: "expected seconds, a positive number up to 10^7".into(),
                    })
                }
            },
        };
        Ok(HubConfig { timeout })
    }
}

/// Why the processes of a job could not meet, or stopped meeting.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A launcher variable or knob is missing or malformed.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// Ranks did not join or answer in time.
    #[error("rank {rank}: ranks {missing:?} {what} within {waited:?}; check that every rank was started with the same launcher variables, or raise COLLSCHED_BOOTSTRAP_TIMEOUT_SECS")]
    Timeout {
        /// The reporting rank.
        rank: usize,
        /// The ranks waited for (empty when unknown).
        missing: Vec<usize>,
        /// How long it waited.
        waited: Duration,
        /// What they did not do.
        what: String,
    },
    /// A peer process exited.
    #[error("rank {rank}: rank {peer} exited during {during}")]
    PeerDied {
        /// The reporting rank.
        rank: usize,
        /// The rank that exited.
        peer: usize,
        /// What the ranks were doing.
        during: &'static str,
    },
    /// Rank 0 ended the job and said why.
    #[error("rank {rank}: the job's bootstrap was aborted: {reason}")]
    Aborted {
        /// The reporting rank.
        rank: usize,
        /// Rank 0's reason.
        reason: String,
    },
    /// A socket operation failed.
    #[error("rank {rank}: {what}")]
    Socket {
        /// The reporting rank.
        rank: usize,
        /// What failed, and what to do.
        what: String,
    },
    /// A process said something that does not fit this job.
    #[error("rank {rank}: bootstrap: {what}")]
    Protocol {
        /// The reporting rank.
        rank: usize,
        /// What did not fit.
        what: String,
    },
}
