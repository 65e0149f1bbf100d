//! Multi-process runs of a subcommand (`--backend shm`): under a launcher (torchrun, mpirun)
//! this process is one rank; alone, it starts the ranks as processes of itself, like
//! `torchrun --standalone`, forwards their output, and fails if any rank fails.

use std::process::{Command, ExitCode, ExitStatus};

use super::CliError;
use crate::bootstrap::LaunchEnv;

/// What this process is in a multi-process run.
#[derive(Debug)]
pub enum LaunchRole {
    /// One rank of a job a launcher (or this command) started.
    Rank(LaunchEnv),
    /// No launcher: start this many ranks.
    Standalone(usize),
}

/// Whether a launcher's variables are set.
pub fn launched() -> bool {
    std::env::var_os("RANK").is_some() || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
}

/// The role of this process: a rank when a launcher's variables are set (then `ranks`, if
/// given, must equal the job's world size), else the starter of `ranks` processes.
///
/// # Errors
/// A malformed launcher variable; `--ranks` missing or 0 without a launcher, or unequal to the
/// launcher's world size.
pub fn role(ranks: Option<usize>) -> Result<LaunchRole, CliError> {
    if launched() {
        let env = LaunchEnv::from_env()?;
        if let Some(n) = ranks.filter(|&n| n != env.world) {
            return Err(format!(
                "--ranks {n} differs from the launcher's world size {} ({}); drop --ranks under a launcher",
                env.world, env.launcher
            )
            .into());
        }
        return Ok(LaunchRole::Rank(env));
    }
    match ranks {
        Some(n) if n > 0 => Ok(LaunchRole::Standalone(n)),
        _ => Err("give --ranks N (at least 1), or start the ranks with torchrun or mpirun".into()),
    }
}

fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// Starts `n` ranks as processes of this program with the same arguments and torchrun's
/// variables (and a fresh `COLLSCHED_RUN_ID`), lets them write to this process's output, and
/// waits for all of them.
///
/// # Errors
/// A rank that could not be started.
pub fn standalone(n: usize) -> Result<ExitCode, CliError> {
    let exe = std::env::current_exe()?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let run_id = format!("standalone-{}-{nanos}", std::process::id());
    let mut children = Vec::with_capacity(n);
    for r in 0..n {
        let child = Command::new(&exe)
            .args(&args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("COLLSCHED_RUN_ID", &run_id)
            .env_remove("OMPI_COMM_WORLD_RANK")
            .spawn();
        match child {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {r}: {e}").into());
            }
        }
    }
    let mut failed = Vec::new();
    for (r, mut c) in children {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r} {}", describe(s))),
            Err(e) => failed.push(format!("rank {r}: cannot wait for it: {e}")),
        }
    }
    if failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("error: {}", failed.join("; "));
        Ok(ExitCode::FAILURE)
    }
}
