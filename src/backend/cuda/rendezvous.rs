//! How the ranks of a multi-process job agree on the NCCL unique id.
//!
//! Three ways, all ending in the same [`UniqueId`]:
//! - **from the engine**: it already exchanged the 128 bytes (torch.distributed's store, MPI):
//!   [`UniqueId::from_bytes`];
//! - **file rendezvous** on a filesystem every rank sees ([`FileRendezvous`]): rank 0 creates
//!   the id and writes it atomically (a temporary file renamed into place), the others poll
//!   for it until a timeout;
//! - **a launcher's environment** (the shared [`LaunchEnv`] of `crate::bootstrap`: torchrun's
//!   or Open MPI's variables) and `COLLSCHED_RENDEZVOUS_FILE` for the file rendezvous
//!   ([`FileRendezvous::from_launch`]).
//!
//! The file holds a small text header (format version, world size, run id) and the id in hex,
//! so a reader refuses a file of another job or world size instead of hanging in NCCL's
//! bootstrap. Use a path unique to the job (the run id helps: a stale file of an earlier run
//! with another run id is refused and waited past until rank 0 replaces it).
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_RENDEZVOUS_FILE` | unset | path of the file rendezvous (with [`LaunchEnv`]) |
//! | `COLLSCHED_RENDEZVOUS_TIMEOUT_SECS` | 300 | how long ranks other than 0 wait for the file |
//! | `COLLSCHED_RUN_ID` | `TORCHELASTIC_RUN_ID`, else empty | the job's id, written into and checked in the file (with `/restart-N` appended from `TORCHELASTIC_RESTART_COUNT`) |

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::nccl::{hex, NcclError, UniqueId};
use crate::bootstrap::{EnvError, LaunchEnv};

/// Default of `COLLSCHED_RENDEZVOUS_TIMEOUT_SECS`.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
/// How often a waiting rank looks at the file.
pub const RENDEZVOUS_POLL: Duration = Duration::from_millis(20);
const MAGIC: &str = "collsched-nccl-unique-id v1";

/// Why the ranks could not agree on a unique id.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RendezvousError {
    /// A launcher variable or knob is missing or malformed.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// Writing or reading the rendezvous file failed.
    #[error("rank {rank}: rendezvous file {path}: {what}")]
    File {
        /// The calling rank.
        rank: usize,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        what: String,
    },
    /// Rank 0 did not write the file in time.
    #[error("rank {rank}: waited {waited:?} for rank 0 to write the rendezvous file {path}{}; start rank 0, check that every rank sees the same path, or raise COLLSCHED_RENDEZVOUS_TIMEOUT_SECS", last_seen_suffix(.last_seen))]
    Timeout {
        /// The calling rank.
        rank: usize,
        /// The file.
        path: PathBuf,
        /// How long it waited.
        waited: Duration,
        /// Why the last file seen (if any) was refused.
        last_seen: Option<String>,
    },
    /// Generating the id failed on rank 0.
    #[error("rank 0: creating the NCCL unique id: {0}")]
    Nccl(#[from] NcclError),
}

fn last_seen_suffix(s: &Option<String>) -> String {
    s.as_ref().map(|s| format!(" (a file was there but was refused: {s})")).unwrap_or_default()
}

/// A file rendezvous for one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRendezvous {
    /// The file every rank sees.
    pub path: PathBuf,
    /// Ranks in the job.
    pub world: usize,
    /// The job's id (written and checked; empty means "any").
    pub run_id: String,
    /// How long ranks other than 0 wait.
    pub timeout: Duration,
}

impl FileRendezvous {
    /// A rendezvous at `path` for `world` ranks, with the run id and timeout from the
    /// environment (`COLLSCHED_RUN_ID` / `TORCHELASTIC_RUN_ID`, `COLLSCHED_RENDEZVOUS_TIMEOUT_SECS`).
    ///
    /// # Errors
    /// [`RendezvousError::Env`] for a malformed timeout.
    pub fn new(path: impl Into<PathBuf>, world: usize) -> Result<Self, RendezvousError> {
        let env = |k: &str| std::env::var(k).ok();
        Ok(FileRendezvous { path: path.into(), world, run_id: run_id(&env), timeout: timeout(&env)? })
    }

    fn contents(&self, id: &UniqueId) -> String {
        format!("{MAGIC}\nworld {}\nrun {}\nid {}\n", self.world, self.run_id, hex(&id.0))
    }

    fn parse(&self, text: &str) -> Result<UniqueId, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err("not a collsched rendezvous file (or a partial one)".into());
        }
        let field = |line: Option<&str>, key: &str| -> Result<String, String> {
            line.and_then(|l| l.strip_prefix(key))
                .and_then(|l| l.strip_prefix(' '))
                .map(str::to_string)
                .ok_or_else(|| format!("no `{key}` line"))
        };
        let world = field(lines.next(), "world")?;
        if world != self.world.to_string() {
            return Err(format!("written for a world of {world} ranks, this job has {}", self.world));
        }
        let run = field(lines.next(), "run")?;
        if !self.run_id.is_empty() && run != self.run_id {
            return Err(format!("written by run {run:?}, this is run {:?}", self.run_id));
        }
        let id = field(lines.next(), "id")?;
        let bytes: Option<Vec<u8>> = (0..id.len())
            .step_by(2)
            .map(|i| id.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect();
        let bytes = bytes.ok_or("the id is not hex")?;
        UniqueId::from_bytes(&bytes).map_err(|e| e.to_string())
    }

    /// Rank 0: creates the id with `generate` and publishes it; other ranks: wait for it.
    /// Every rank returns the same id.
    ///
    /// # Errors
    /// [`RendezvousError`] if the file cannot be written or read, or rank 0 is late.
    pub fn exchange(
        &self,
        rank: usize,
        generate: impl FnOnce() -> Result<UniqueId, NcclError>,
    ) -> Result<UniqueId, RendezvousError> {
        if rank == 0 {
            let id = generate()?;
            self.publish(&id)?;
            Ok(id)
        } else {
            self.wait(rank)
        }
    }

    /// Writes the file atomically: a temporary file in the same directory, renamed into place.
    ///
    /// # Errors
    /// [`RendezvousError::File`] on an I/O error.
    pub fn publish(&self, id: &UniqueId) -> Result<(), RendezvousError> {
        let err = |what: String| RendezvousError::File { rank: 0, path: self.path.clone(), what };
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| err(format!("creating its directory: {e}")))?;
        let name = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, self.contents(id))
            .map_err(|e| err(format!("writing {}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            err(format!("renaming {} into place: {e}", tmp.display()))
        })
    }

    /// Polls for the file until it holds an id for this job, or the timeout.
    ///
    /// # Errors
    /// [`RendezvousError::Timeout`].
    pub fn wait(&self, rank: usize) -> Result<UniqueId, RendezvousError> {
        let start = Instant::now();
        let mut last_seen = None;
        loop {
            match std::fs::read_to_string(&self.path) {
                Ok(text) => match self.parse(&text) {
                    Ok(id) => return Ok(id),
                    Err(why) => last_seen = Some(why),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(RendezvousError::File {
                        rank,
                        path: self.path.clone(),
                        what: format!("reading: {e}"),
                    })
                }
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(RendezvousError::Timeout { rank, path: self.path.clone(), waited, last_seen });
            }
            std::thread::sleep(RENDEZVOUS_POLL.min(self.timeout - waited));
        }
    }
}

fn run_id(env: &dyn Fn(&str) -> Option<String>) -> String {
    let id = env("COLLSCHED_RUN_ID").or_else(|| env("TORCHELASTIC_RUN_ID")).unwrap_or_default();
    // torchrun keeps the run id across restarts of a job; the restart count tells them apart,
    // so a file left by the previous attempt is refused instead of read.
    match env("TORCHELASTIC_RESTART_COUNT") {
        Some(n) if !id.is_empty() => format!("{id}/restart-{n}"),
        _ => id,
    }
}

fn timeout(env: &dyn Fn(&str) -> Option<String>) -> Result<Duration, RendezvousError> {
    match env("COLLSCHED_RENDEZVOUS_TIMEOUT_SECS") {
        None => Ok(DEFAULT_RENDEZVOUS_TIMEOUT),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or(RendezvousError::Env(EnvError {
                var: "COLLSCHED_RENDEZVOUS_TIMEOUT_SECS",
                value: v,
                what: "expected a number of seconds, e.g. 300".into(),
            })),
    }
}

impl FileRendezvous {
    /// The file rendezvous a launch names (`COLLSCHED_RENDEZVOUS_FILE`), with the run id and
    /// timeout read through `lookup`.
    ///
    /// # Errors
    /// [`RendezvousError::Env`] when `COLLSCHED_RENDEZVOUS_FILE` is unset or the timeout is bad.
    pub fn from_launch(
        launch: &LaunchEnv,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<FileRendezvous, RendezvousError> {
        let path = lookup("COLLSCHED_RENDEZVOUS_FILE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .ok_or(RendezvousError::Env(EnvError {
            var: "COLLSCHED_RENDEZVOUS_FILE",
            value: String::new(),
            what: "not set; point it at a path on a filesystem every rank sees, or pass the unique id bytes \
                       from the engine"
                .into(),
        }))?;
        Ok(FileRendezvous { path, world: launch.world, run_id: run_id(&lookup), timeout: timeout(&lookup)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id file's path in a scratch directory, and a guard that removes the directory.
    fn tmp(name: &str) -> (PathBuf, Scratch) {
        let d = std::env::temp_dir().join(format!("collsched-rdv-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        (d.join("nccl.id"), Scratch(d))
    }

    /// Removes its directory when the test ends.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn some_id(seed: u8) -> UniqueId {
        let mut b = [0u8; UniqueId::BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        UniqueId(b)
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let (path, _scratch) = tmp("agree");
        let world = 5;
        let want = some_id(7);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let r = FileRendezvous {
                    path: path.clone(),
                    world,
                    run_id: "job-1".into(),
                    timeout: Duration::from_secs(20),
                };
                std::thread::spawn(move || r.exchange(rank, || Ok(want)))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), want);
        }
    }

    #[test]
    fn a_file_of_another_world_or_run_is_refused_and_times_out() {
        let (path, _scratch) = tmp("stale");
        let old =
            FileRendezvous { path: path.clone(), world: 4, run_id: "old".into(), timeout: Duration::ZERO };
        old.publish(&some_id(1)).unwrap();
        let other_world = FileRendezvous { world: 8, ..old.clone() };
        let e = other_world.wait(3).unwrap_err();
        assert!(
            matches!(&e, RendezvousError::Timeout { rank: 3, last_seen: Some(s), .. } if s.contains("world of 4")),
            "{e}"
        );
        let other_run = FileRendezvous { run_id: "new".into(), ..old.clone() };
        let e = other_run.wait(1).unwrap_err();
        assert!(e.to_string().contains("run \"old\""), "{e}");
        assert_eq!(old.wait(2).unwrap(), some_id(1));
    }

    #[test]
    fn missing_rank_zero_times_out_with_advice() {
        let (path, _scratch) = tmp("late");
        let r = FileRendezvous { path, world: 2, run_id: String::new(), timeout: Duration::from_millis(1) };
        let e = r.wait(1).unwrap_err();
        assert!(e.to_string().contains("COLLSCHED_RENDEZVOUS_TIMEOUT_SECS"), "{e}");
    }

    #[test]
    fn the_file_rendezvous_reads_its_knobs_from_the_launch() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let ok = LaunchEnv::from_lookup(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("COLLSCHED_RENDEZVOUS_FILE", "/shared/id"),
        ]))
        .unwrap();
        assert_eq!((ok.rank, ok.world, ok.local_rank, ok.local_world), (3, 8, 1, Some(2)));
        let r = FileRendezvous::from_launch(
            &ok,
            vars(&[
                ("COLLSCHED_RENDEZVOUS_FILE", "/shared/id"),
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("COLLSCHED_RENDEZVOUS_TIMEOUT_SECS", "2.5"),
            ]),
        )
        .unwrap();
        assert_eq!((r.world, r.run_id.as_str(), r.timeout), (8, "abc", Duration::from_millis(2500)));
        let r = FileRendezvous::from_launch(
            &ok,
            vars(&[
                ("COLLSCHED_RENDEZVOUS_FILE", "/shared/id"),
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("TORCHELASTIC_RESTART_COUNT", "2"),
            ]),
        )
        .unwrap();
        assert_eq!(r.run_id, "abc/restart-2", "a restarted job must not read the previous attempt's file");

        let unset = FileRendezvous::from_launch(&ok, vars(&[])).unwrap_err();
        assert!(matches!(&unset, RendezvousError::Env(e) if e.var == "COLLSCHED_RENDEZVOUS_FILE"), "{unset}");
        let bad_timeout = FileRendezvous::from_launch(
            &ok,
            vars(&[("COLLSCHED_RENDEZVOUS_FILE", "/x"), ("COLLSCHED_RENDEZVOUS_TIMEOUT_SECS", "soon")]),
        )
        .unwrap_err();
        assert!(
            matches!(&bad_timeout, RendezvousError::Env(e) if e.var == "COLLSCHED_RENDEZVOUS_TIMEOUT_SECS")
        );
    }

    #[test]
    fn engine_bytes_must_be_128() {
        assert!(UniqueId::from_bytes(&[0u8; 127]).unwrap_err().to_string().contains("127 were given"));
        assert_eq!(UniqueId::from_bytes(&some_id(3).0).unwrap(), some_id(3));
    }
}
