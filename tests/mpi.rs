//! The mpi backend under Open MPI's `mpirun` (one process per rank; `ci/setup.sh` installs
//! `openmpi-bin` and `libopenmpi-dev`): the backend-generic collective suite at 1, 2, 3 and 4
//! processes, a mismatched collective, a failed dependency, a rank that never launches, and a
//! killed rank. Each job runs this test binary's ignored `child` test as its ranks.
#![cfg(feature = "mpi")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use collsched::backend::local::LocalRank;
use collsched::backend::mpi::{join, MpiConfig};
use collsched::backend::Backend;
use collsched::buckets::Sharding;
use collsched::demo::DemoConfig;

#[path = "support/collectives.rs"]
mod collectives;
#[path = "support/faults.rs"]
mod faults;
#[path = "support/record.rs"]
mod record;
#[path = "support/reference.rs"]
mod reference;
use faults::{all_reduce, kill_self};

fn run_child(rank: &LocalRank, me: usize, mode: &str) -> Result<String, String> {
    let n = rank.world_size();
    match mode {
        "suite" => collectives::suite(rank),
        "mismatch" => faults::mismatch(rank),
        "failed-dep" => faults::failed_dependency(rank),
        "absent" => {
            // The last rank launches nothing and stays up past its peers' timeout.
            if me == n - 1 {
                std::thread::sleep(Duration::from_secs(6));
                return Ok("absent".into());
            }
            all_reduce(rank, 1024).map(|()| "ran".into()).map_err(|e| e.to_string())
        }
        "kill" => {
            if me == n - 1 {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    kill_self();
                });
            }
            for _ in 0..10_000 {
                all_reduce(rank, 1 << 20).map_err(|e| e.to_string())?;
            }
            Ok("no failure seen".into())
        }
        other => Err(format!("unknown mode {other}")),
    }
}

#[test]
#[ignore = "a rank of the mpi tests' jobs, started by them under mpirun"]
fn child() {
    let mode = std::env::var("COLLSCHED_TEST_MODE").unwrap_or_default();
    let config = MpiConfig::from_env().expect("config");
    let (rank, job) = match join(&config) {
        Ok(j) => j,
        Err(e) => {
            println!("\nRESULT {} err join: {e}", std::env::var("OMPI_COMM_WORLD_RANK").unwrap_or_default());
            return;
        }
    };
    let me = job.rank();
    let result = if mode == "absent-exchange" {
        // The last rank never takes part in the control exchange and stays up past its peers'
        // timeout.
        if me == job.world() - 1 {
            std::thread::sleep(Duration::from_secs(6));
            Ok("absent".into())
        } else {
            job.all_gather_bytes(b"rows").map(|all| format!("{} parts", all.len())).map_err(|e| e.to_string())
        }
    } else {
        run_child(&rank, me, &mode)
    };
    let line = match result {
        Ok(s) => format!("ok {s}"),
        Err(e) => format!("err {e}"),
    };
    println!("\nRESULT {me} {line}");
    drop(rank);
    if mode.starts_with("absent") && me == job.world() - 1 {
        // Its peers left without finalizing MPI (their job broke): MPI_Finalize here would wait
        // for them for ever under mpirun's recovery (without it, mpirun ends this process).
        std::mem::forget(job);
        return;
    }
    drop(job);
}

/// Runs `np` ranks in `mode` under mpirun; returns each rank's result line (by rank) and the
/// whole output.
fn mpirun(np: usize, mode: &str, timeout_s: u32) -> (Vec<Option<String>>, Output) {
    mpirun_with(np, mode, timeout_s, &[])
}

/// [`mpirun`] for a job in which a rank dies or stays away: Open MPI's recovery on, so that
/// mpirun lets the survivors finish instead of ending them when the first process exits
/// abnormally (which races with their report: the survivors name the dead rank within
/// milliseconds, mpirun's abort takes about as long).
fn mpirun_surviving(np: usize, mode: &str, timeout_s: u32) -> (Vec<Option<String>>, Output) {
    mpirun_with(np, mode, timeout_s, &["--mca", "orte_enable_recovery", "1"])
}

fn mpirun_with(np: usize, mode: &str, timeout_s: u32, extra: &[&str]) -> (Vec<Option<String>>, Output) {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()])
        .args(extra)
        .args(["-x", "COLLSCHED_TEST_MODE", "-x", "COLLSCHED_TIMEOUT_SECS"])
        .arg(exe)
        .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("COLLSCHED_TEST_MODE", mode)
        .env("COLLSCHED_TIMEOUT_SECS", timeout_s.to_string())
        .output()
        .expect("mpirun (apt install openmpi-bin libopenmpi-dev, or run ci/setup.sh)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = vec![None; np];
    for l in text.lines() {
        if let Some((_, rest)) = l.split_once("RESULT ") {
            if let Some((r, res)) = rest.split_once(' ') {
                if let Ok(r) = r.parse::<usize>() {
                    if r < np {
                        lines[r] = Some(res.to_string());
                    }
                }
            }
        }
    }
    (lines, out)
}

fn show(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn every_collective_at_1_2_3_and_4_processes() {
    for np in [1, 2, 3, 4] {
        let (lines, out) = mpirun(np, "suite", 60);
        for (r, l) in lines.iter().enumerate() {
            assert_eq!(l.as_deref(), Some("ok suite"), "np {np}, rank {r}:\n{}", show(&out));
        }
        assert!(out.status.success(), "np {np}:\n{}", show(&out));
    }
}

/// Waits spin only when every process on the machine has a core for its waiting and its
/// working thread; `COLLSCHED_SPIN_US` sets the spin, and a malformed one is refused naming it.
#[test]
fn waits_spin_only_with_cores_to_spare_or_as_told() {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let with = |vars: &'static [(&'static str, &'static str)]| {
        MpiConfig::from_lookup(move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    };
    let crowded = with(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "100000")]).expect("config");
    assert_eq!(crowded.local.spin, Duration::ZERO);
    let alone = with(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "1")]).expect("config");
    let default = collsched::backend::local::LocalConfig::default().spin;
    assert_eq!(alone.local.spin, if cores >= 2 { default } else { Duration::ZERO });
    let told =
        with(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "100000"), ("COLLSCHED_SPIN_US", "7.5")]).expect("config");
    assert_eq!(told.local.spin, Duration::from_nanos(7500));
    for bad in [
        &[("COLLSCHED_SPIN_US", "-1")][..],
        &[("COLLSCHED_SPIN_US", "soon")],
        &[("COLLSCHED_SPIN_US", "NaN")],
    ] {
        let e = with(bad).expect_err("malformed").to_string();
        assert!(e.contains("COLLSCHED_SPIN_US"), "{e}");
    }
}

#[test]
fn a_mismatched_collective_fails_on_every_rank_naming_both() {
    let t = Instant::now();
    let (lines, out) = mpirun(3, "mismatch", 60);
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    for (r, l) in lines.iter().enumerate() {
        let l = l.as_deref().unwrap_or_else(|| panic!("rank {r} reported nothing:\n{}", show(&out)));
        assert!(
            l.starts_with("err") && l.contains("mismatched collectives") && l.contains("reduce_scatter"),
            "rank {r}: {l}"
        );
    }
}

#[test]
fn a_failed_dependency_fails_every_rank_naming_it() {
    let (lines, out) = mpirun(3, "failed-dep", 60);
    for (r, l) in lines.iter().enumerate() {
        let l = l.as_deref().unwrap_or_else(|| panic!("rank {r} reported nothing:\n{}", show(&out)));
        assert!(l.starts_with("err"), "rank {r}: {l}");
        if r == 2 {
            assert!(l.contains("injected host failure"), "rank {r}: {l}");
        } else {
            assert!(l.contains("[2]") && l.contains("will never arrive"), "rank {r}: {l}");
        }
    }
}

#[test]
fn a_rank_that_never_launches_is_named_after_the_timeout() {
    let (lines, out) = mpirun_surviving(3, "absent", 2);
    // The peers end without finalizing MPI (their requests to rank 2 are pending); rank 2 ends
    // after them.
    for (r, l) in lines.iter().enumerate() {
        let l = l.as_deref().unwrap_or_else(|| panic!("rank {r} reported nothing:\n{}", show(&out)));
        if r == 2 {
            assert_eq!(l, "ok absent", "rank {r}");
        } else {
            // Rank 2 is named as absent, or, when the other peer gave up first and exited
            // before this rank's own timeout, as not having launched it.
            assert!(
                l.starts_with("err")
                    && (l.contains("ranks [2] did not arrive")
                        || l.contains(
                            "will never arrive: their processes exited, and ranks [2] had not launched it"
                        )),
                "rank {r}: {l}"
            );
        }
    }
}

/// A control exchange (a bench's rows, a checkpoint's index) that one rank never reaches ends on
/// the others at the timeout, naming the call and what to do, instead of waiting for ever.
#[test]
fn a_control_exchange_a_rank_never_reaches_ends_at_the_timeout() {
    let (lines, out) = mpirun_surviving(3, "absent-exchange", 2);
    for (r, l) in lines.iter().enumerate() {
        let l = l.as_deref().unwrap_or_else(|| panic!("rank {r} reported nothing:\n{}", show(&out)));
        if r == 2 {
            assert_eq!(l, "ok absent", "rank {r}");
        } else {
            assert!(l.starts_with("err") && l.contains("MPI_Iallgather"), "rank {r}: {l}");
            assert!(
                l.contains("did not complete within 2s") && l.contains("COLLSCHED_TIMEOUT_SECS"),
                "rank {r}: {l}"
            );
        }
    }
}

#[test]
fn a_killed_rank_is_named_by_its_peers_on_this_machine_within_seconds() {
    let t = Instant::now();
    let (lines, out) = mpirun_surviving(3, "kill", 120);
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
    assert_eq!(lines[2], None, "the killed rank reports nothing:\n{}", show(&out));
    for (r, l) in lines.iter().take(2).enumerate() {
        let l = l.as_deref().unwrap_or_else(|| panic!("rank {r} reported nothing:\n{}", show(&out)));
        // Rank 2, or the other survivor with it when that one already reported and left.
        let both = format!("ranks [{}, 2] will never arrive", 1 - r);
        assert!(
            l.starts_with("err")
                && (l.contains("ranks [2] will never arrive") || l.contains(&both))
                && l.contains("all_reduce"),
            "rank {r}: {l}"
        );
    }
}

fn collsched_under_mpirun(np: usize, args: &[&str]) -> Output {
    Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
            env!("CARGO_BIN_EXE_collsched"),
        ])
        .args(args)
        .output()
        .expect("mpirun (apt install openmpi-bin libopenmpi-dev, or run ci/setup.sh)")
}

/// `mpirun -np 3 collsched bench --backend mpi --check`: every collective, no wrong element.
#[test]
fn bench_under_mpirun_checks_every_collective() {
    for op in ["all_gather", "reduce_scatter", "all_reduce"] {
        let args = ["bench", "--backend", "mpi", "--op", op, "-b", "1K", "-e", "256K", "-f", "8"];
        let out =
            collsched_under_mpirun(3, &[&args[..], &["--iters", "3", "--warmup", "1", "--check"]].concat());
        let text = show(&out);
        assert!(out.status.success(), "{op}:\n{text}");
        assert!(
            text.contains("(mpi backend)") && text.contains("# out of bounds values : 0 OK"),
            "{op}:\n{text}"
        );
        let rows: Vec<&str> =
            text.lines().filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit())).collect();
        assert_eq!(rows.len(), 3, "{op}: about 1K, 8K and 64K:\n{text}");
        // Every process on this machine: MPI's own collective and the shm backend, same sizes,
        // same run: three columns each after the table's nine (time, busbw, ratio), all finite,
        // times and ratios > 0 (a busbw of a tiny size prints as 0.00).
        assert!(
            text.contains("x_ref") && text.contains("shm_time") && text.contains("x_shm"),
            "{op}:\n{text}"
        );
        for row in rows {
            let cells: Vec<f64> =
                row.split_whitespace().skip(9).map(|c| c.parse().unwrap_or(f64::NAN)).collect();
            assert_eq!(cells.len(), 6, "{op}: {row}");
            assert!(cells.iter().all(|c| c.is_finite() && *c >= 0.0), "{op}: {row}");
            assert!([0, 2, 3, 5].iter().all(|&i| cells[i] > 0.0), "{op}: {row}");
        }
    }
    // `--no-shm-compare`: Open MPI's columns only.
    let args = ["bench", "--backend", "mpi", "--op", "all_gather", "-b", "8K", "-e", "8K", "--iters", "2"];
    let out = collsched_under_mpirun(2, &[&args[..], &["--warmup", "1", "--no-shm-compare"]].concat());
    let text = show(&out);
    assert!(out.status.success() && text.contains("x_ref") && !text.contains("shm_"), "{text}");
}

/// `mpirun -np N collsched demo --backend mpi`: at 1 to 4 processes and every strategy, exact
/// parity with the demo's own reference, and rank 0's record (`--record-out`) bit for bit the
/// reference computed here (`tests/support/reference.rs`, no code shared with the library):
/// MPI only carries the bytes, the library's kernels sum in the plan's order, as the
/// reference does.
#[test]
fn demo_under_mpirun_keeps_parity_with_every_strategy() {
    for (np, strategy) in
        [(1, "even"), (2, "flat"), (3, "greedy"), (4, "even"), (3, "flat"), (4, "greedy"), (4, "hybrid:2")]
    {
        let path = record::temp_path(&format!("mpi-{np}-{}", strategy.replace(':', "-")));
        let path_arg = path.to_str().expect("utf-8 path");
        let args =
            ["demo", "--backend", "mpi", "--steps", "2", "--strategy", strategy, "--record-out", path_arg];
        let out = collsched_under_mpirun(np, &args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "np {np} {strategy}:\n{}", show(&out));
        let last = text.trim_end().lines().last().unwrap_or_default();
        assert_eq!(last, "parity: max |loss difference| = 0e0 over 2 steps", "np {np} {strategy}");
        assert_eq!(text.matches("collsched demo:").count(), 1, "only rank 0 reports:\n{text}");
        let got = record::take(&path);
        let sharding: Sharding = strategy.parse().expect("a strategy");
        let cfg = DemoConfig::standard(np, 2, 1);
        assert_eq!(got.config, cfg, "np {np} {strategy}: the settings the record names");
        let want = reference::reference(&cfg, sharding);
        reference::assert_matches(&got.run, &want, 0.0, &format!("np {np} {strategy}"));
    }
}
