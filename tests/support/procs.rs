//! Jobs of real processes for tests: each rank is this test binary's ignored `child` test,
//! started with torchrun's variables set by hand; a rank reports one `RESULT ...` line.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Rank {
    rank: usize,
    child: Child,
}

/// Starts ranks `ranks` of a job of `world` processes with run id `job`.
pub fn start(
    job: &str,
    world: usize,
    ranks: &[usize],
    timeout_s: f64,
    mode_of: impl Fn(usize) -> &'static str,
) -> Vec<Rank> {
    let exe = std::env::current_exe().expect("test binary");
    ranks
        .iter()
        .map(|&r| Rank {
            rank: r,
            child: Command::new(&exe)
                .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("COLLSCHED_RUN_ID", job)
                .env("COLLSCHED_BOOTSTRAP_TIMEOUT_SECS", timeout_s.to_string())
                .env("COLLSCHED_TIMEOUT_SECS", timeout_s.to_string())
                .env("COLLSCHED_TEST_MODE", mode_of(r))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank"),
        })
        .collect()
}

/// Each rank's `RESULT` line (`None` when it printed none, e.g. killed); a rank still running
/// after 60 s is killed.
pub fn finish(ranks: Vec<Rank>) -> Vec<(usize, Option<String>)> {
    let waiters: Vec<_> = ranks
        .into_iter()
        .map(|r| {
            let pid = r.child.id();
            (r.rank, pid, std::thread::spawn(move || r.child.wait_with_output()))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    waiters
        .into_iter()
        .map(|(rank, pid, h)| {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !h.is_finished() {
                if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
            }
            let out = h.join().expect("waiter").expect("output");
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text.lines().find_map(|l| l.split_once("RESULT ")).map(|(_, r)| r.to_string());
            if line.is_none() {
                eprintln!("rank {rank} printed no result:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
            }
            (rank, line)
        })
        .collect()
}

pub fn job(name: &str) -> String {
    format!("bootstrap-test-{name}-{}", std::process::id())
}
