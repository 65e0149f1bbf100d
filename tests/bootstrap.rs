//! The bootstrap with real processes: each test starts this test binary's `child` entry as
//! the ranks of a job (torchrun's variables set by hand) and reads what each rank reports.

use std::io::Write;
use std::os::fd::{AsFd, FromRawFd, IntoRawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use collsched::bootstrap::{Hub, HubConfig, LaunchEnv};

#[path = "support/procs.rs"]
mod procs;
use procs::{finish, job, start};

/// What one rank does, from `COLLSCHED_TEST_MODE`.
fn run_child() -> Result<String, String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let config = HubConfig::from_env().map_err(|e| e.to_string())?;
    let mode = std::env::var("COLLSCHED_TEST_MODE").unwrap_or_default();
    let mut hub = Hub::connect(&env, &config).map_err(|e| e.to_string())?;
    if mode == "die" {
        // SIGKILL: no destructor, no goodbye on the socket.
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
    let mine = format!("rank {} pid {}", env.rank, std::process::id());
    let all = hub.all_gather(mine.as_bytes()).map_err(|e| e.to_string())?;
    for (r, b) in all.iter().enumerate() {
        let s = String::from_utf8_lossy(b);
        if !s.starts_with(&format!("rank {r} pid ")) {
            return Err(format!("exchange slot {r} holds {s:?}"));
        }
    }
    // A memfd holding this rank's number, exchanged as a descriptor; each rank reads every one.
    let fd = rustix::fs::memfd_create("collsched-test", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| e.to_string())?;
    // SAFETY: `fd` is a fresh, owned descriptor; the File takes it over.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd.into_raw_fd()) };
    file.write_all(format!("memfd of rank {}", env.rank).as_bytes()).map_err(|e| e.to_string())?;
    let fds = hub.all_gather_fds(file.as_fd()).map_err(|e| e.to_string())?;
    if fds.len() != env.world {
        return Err(format!("{} descriptors for a world of {}", fds.len(), env.world));
    }
    for (r, fd) in fds.into_iter().enumerate() {
        // Positioned reads: every process shares each memfd's file offset.
        let f = std::fs::File::from(fd);
        let mut buf = [0u8; 64];
        let n = f.read_at(&mut buf, 0).map_err(|e| e.to_string())?;
        let s = String::from_utf8_lossy(&buf[..n]);
        if s != format!("memfd of rank {r}") {
            return Err(format!("descriptor {r} holds {s:?}"));
        }
    }
    hub.barrier().map_err(|e| e.to_string())?;
    Ok(format!("{} ranks, pids {:?}", all.len(), hub.liveness().pids()))
}

#[test]
#[ignore = "a rank of the bootstrap tests' jobs, started by them as a child process"]
fn child() {
    match run_child() {
        Ok(s) => println!("RESULT ok {s}"),
        Err(e) => println!("RESULT err {e}"),
    }
}

#[test]
fn every_rank_gets_every_ranks_bytes_and_descriptors() {
    for world in [1, 2, 3, 5] {
        let all: Vec<usize> = (0..world).collect();
        let out = finish(start(&job(&format!("ok{world}")), world, &all, 30.0, |_| "exchange"));
        assert_eq!(out.len(), world);
        let all_lines = format!("{out:?}");
        for (r, line) in out {
            let line = line.unwrap_or_else(|| panic!("world {world}: rank {r} reported nothing"));
            assert!(
                line.starts_with(&format!("ok {world} ranks")),
                "world {world}: rank {r}: {line}; all: {all_lines}"
            );
        }
    }
}

#[test]
fn a_rank_that_never_starts_is_named_by_every_other_rank() {
    let t = Instant::now();
    let out = finish(start(&job("missing"), 3, &[0, 1], 2.0, |_| "exchange"));
    for (r, line) in out {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert!(line.starts_with("err") && line.contains("[2]"), "rank {r}: {line}");
    }
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
    // Rank 0 missing: the others name it.
    let out = finish(start(&job("missing0"), 2, &[1], 1.0, |_| "exchange"));
    let line = out[0].1.clone().expect("rank 1 reported");
    assert!(line.starts_with("err") && line.contains("[0]"), "{line}");
}

#[test]
fn a_rank_killed_after_joining_is_named_at_once() {
    let t = Instant::now();
    // A long timeout: the survivors must see the death through the pidfds, not the clock.
    let out =
        finish(start(&job("killed"), 3, &[0, 1, 2], 120.0, |r| if r == 2 { "die" } else { "exchange" }));
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    for (r, line) in out {
        if r == 2 {
            assert_eq!(line, None, "the killed rank printed something");
            continue;
        }
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert!(line.starts_with("err") && line.contains("rank 2 exited"), "rank {r}: {line}");
    }
}

#[test]
fn two_jobs_at_once_do_not_meet() {
    let a = start(&job("twin-a"), 2, &[0, 1], 30.0, |_| "exchange");
    let b = start(&job("twin-b"), 2, &[0, 1], 30.0, |_| "exchange");
    for (r, line) in finish(a).into_iter().chain(finish(b)) {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert!(line.starts_with("ok 2 ranks"), "rank {r}: {line}");
    }
}

#[test]
fn a_job_without_a_key_is_refused_before_it_waits() {
    let env = LaunchEnv { job: String::new(), ..LaunchEnv::single("") };
    let env = LaunchEnv { world: 2, ..env };
    let e = Hub::connect(&env, &HubConfig::default()).unwrap_err();
    assert!(e.to_string().contains("COLLSCHED_RUN_ID"), "{e}");
}
