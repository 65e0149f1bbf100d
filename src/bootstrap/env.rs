//! [`LaunchEnv`]: who this process is in its job, from the variables a launcher sets.

use std::fmt;

/// A launcher variable that is missing or malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("launch environment: {var}={value:?}: {what}")]
pub struct EnvError {
    /// The variable.
    pub var: &'static str,
    /// Its value (empty when unset).
    pub value: String,
    /// What is wrong and what to do.
    pub what: String,
}

/// Which launcher's variables described the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun (and anything else that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, ...).
    OpenMpi,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "mpirun (Open MPI)",
        })
    }
}

/// This process's place in a multi-process job, as its launcher describes it.
///
/// torchrun's variables are read first (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, optional
/// `LOCAL_WORLD_SIZE`), then Open MPI's (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
/// `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`).
///
/// The **job key** tells two jobs on one machine apart (their bootstrap sockets and shared
/// memory must never meet): `COLLSCHED_RUN_ID` when set, else what the launcher gives every
/// process of one job and no other (torchrun: `TORCHELASTIC_RUN_ID`, the restart count,
/// `MASTER_ADDR` and `MASTER_PORT`; Open MPI: `PMIX_NAMESPACE` or `OMPI_MCA_ess_base_jobid`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's global rank.
    pub rank: usize,
    /// Processes in the job.
    pub world: usize,
    /// This process's rank on its machine (the CUDA device it uses).
    pub local_rank: usize,
    /// Processes on this machine, if the launcher says.
    pub local_world: Option<usize>,
    /// Which launcher's variables were read.
    pub launcher: Launcher,
    /// The job key (see the type's docs).
    pub job: String,
}

impl LaunchEnv {
    /// Reads the process environment.
    ///
    /// # Errors
    /// [`EnvError`] naming the missing or malformed variable.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `lookup` (for tests and embedders with their own source).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let num = |var: &'static str, required: bool| -> Result<Option<usize>, EnvError> {
            match lookup(var) {
                None if required => Err(EnvError {
                    var,
                    value: String::new(),
                    what: "not set; launch with torchrun or mpirun (or set RANK, WORLD_SIZE and LOCAL_RANK)"
                        .into(),
                }),
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| EnvError {
                    var,
                    value: v,
                    what: "expected a non-negative integer".into(),
                }),
            }
        };
        let (launcher, names) = if lookup("RANK").is_some() || lookup("OMPI_COMM_WORLD_RANK").is_none() {
            (Launcher::Torchrun, ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
        } else {
            (
                Launcher::OpenMpi,
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            )
        };
        let rank = num(names[0], true)?.unwrap_or(0);
        let world = num(names[1], true)?.unwrap_or(0);
        let local_rank = num(names[2], true)?.unwrap_or(0);
        let local_world = num(names[3], false)?;
        if world == 0 {
            return Err(EnvError {
                var: names[1],
                value: world.to_string(),
                what: "a job needs at least one process".into(),
            });
        }
        if rank >= world {
            return Err(EnvError {
                var: names[0],
                value: rank.to_string(),
                what: format!("must be below {}={world}", names[1]),
            });
        }
        if let Some(lw) = local_world {
            if local_rank >= lw {
                return Err(EnvError {
                    var: names[2],
                    value: local_rank.to_string(),
                    what: format!("must be below {}={lw}", names[3]),
                });
            }
        }
        Ok(LaunchEnv { rank, world, local_rank, local_world, launcher, job: job_key(&lookup) })
    }

    /// A one-process job (rank 0 of 1), for callers that run without a launcher.
    pub fn single(job: impl Into<String>) -> Self {
        LaunchEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            local_world: Some(1),
            launcher: Launcher::Torchrun,
            job: job.into(),
        }
    }
}

/// The job key (see [`LaunchEnv`]); empty when nothing identifies the job.
fn job_key(lookup: &impl Fn(&str) -> Option<String>) -> String {
    if let Some(id) = lookup("COLLSCHED_RUN_ID").filter(|s| !s.is_empty()) {
        return id;
    }
    let parts: Vec<String> = [
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PMIX_NAMESPACE",
        "OMPI_MCA_ess_base_jobid",
    ]
    .iter()
    .filter_map(|k| lookup(k).filter(|v| !v.is_empty()).map(|v| format!("{k}={v}")))
    .collect();
    parts.join(";")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_and_open_mpi_variables_are_read() {
        let t = LaunchEnv::from_lookup(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .expect("torchrun env");
        assert_eq!((t.rank, t.world, t.local_rank, t.local_world), (3, 4, 1, Some(2)));
        assert_eq!(t.launcher, Launcher::Torchrun);
        assert!(t.job.contains("MASTER_PORT=29500"), "{}", t.job);
        let m = LaunchEnv::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("PMIX_NAMESPACE", "prterun-host-123@1"),
        ]))
        .expect("mpirun env");
        assert_eq!((m.rank, m.world, m.local_rank, m.local_world), (2, 3, 2, None));
        assert_eq!(m.launcher, Launcher::OpenMpi);
        let r = LaunchEnv::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]))
            .expect("env");
        assert_eq!(r.job, "");
        let id = LaunchEnv::from_lookup(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("COLLSCHED_RUN_ID", "abc"),
            ("MASTER_PORT", "1"),
        ]))
        .expect("env");
        assert_eq!(id.job, "abc");
    }

    #[test]
    fn bad_variables_are_named() {
        let e = LaunchEnv::from_lookup(env(&[])).unwrap_err();
        assert_eq!(e.var, "RANK");
        let e = LaunchEnv::from_lookup(env(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]))
            .unwrap_err();
        assert_eq!((e.var, e.value.as_str()), ("RANK", "x"));
        let e = LaunchEnv::from_lookup(env(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]))
            .unwrap_err();
        assert!(e.to_string().contains("must be below WORLD_SIZE=2"), "{e}");
        let e = LaunchEnv::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "0")]))
            .unwrap_err();
        assert_eq!(e.var, "WORLD_SIZE");
        let e = LaunchEnv::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap_err();
        assert_eq!(e.var, "OMPI_COMM_WORLD_LOCAL_RANK");
    }
}
