//! `collsched bench` as scripts see it: run the binary with tiny sizes and `--check`, parse the
//! nccl-tests columns.

use std::process::Command;

fn bench(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run collsched");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

struct Row {
    size: u64,
    count: u64,
    ty: String,
    redop: String,
    root: i64,
    time: f64,
    algbw: f64,
    busbw: f64,
    wrong: String,
    extra: Vec<f64>,
}

/// `bench` with its arguments written as one command line (split at whitespace).
fn bench_line(line: &str) -> (bool, String, String) {
    bench(&line.split_whitespace().collect::<Vec<_>>())
}

fn rows(stdout: &str) -> Vec<Row> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            assert!(c.len() == 9 || c.len() == 12, "unexpected row: {l}");
            Row {
                size: c[0].parse().expect("size"),
                count: c[1].parse().expect("count"),
                ty: c[2].into(),
                redop: c[3].into(),
                root: c[4].parse().expect("root"),
                time: c[5].parse().expect("time"),
                algbw: c[6].parse().expect("algbw"),
                busbw: c[7].parse().expect("busbw"),
                wrong: c[8].into(),
                extra: c[9..].iter().map(|x| x.parse().expect("sep column")).collect(),
            }
        })
        .collect()
}

/// What a table must show.
struct Expect {
    ranks: u64,
    elem: u64,
    ty: &'static str,
    redop: &'static str,
    bus: f64,
    min: u64,
    max: u64,
    factor: u64,
}

fn check_table(stdout: &str, e: Expect) {
    assert!(stdout.contains("# memcpy reference:"), "{stdout}");
    let header = stdout
        .lines()
        .find(|l| l.trim_start_matches('#').split_whitespace().next() == Some("size"))
        .expect("header");
    let names: Vec<&str> = header.trim_start_matches('#').split_whitespace().collect();
    assert_eq!(&names[..9], ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]);
    let rows = rows(stdout);
    // One row per size from min to max by factor (rounded down to whole elements per rank).
    let mut want_sizes = Vec::new();
    let mut s = e.min;
    while s <= e.max {
        want_sizes.push(s);
        s *= e.factor;
    }
    assert_eq!(rows.len(), want_sizes.len(), "{stdout}");
    for (r, want) in rows.iter().zip(want_sizes) {
        assert!(
            r.size <= want && r.size + e.ranks * e.elem * 4 > want,
            "size {} for requested {want}",
            r.size
        );
        assert_eq!(r.size, r.count * e.elem);
        assert_eq!(r.ty, e.ty);
        assert_eq!(r.redop, e.redop);
        assert_eq!(r.root, -1);
        assert_eq!(r.wrong, "0", "wrong elements: {stdout}");
        assert!(r.time > 0.0);
        // algbw = size / time, busbw = algbw x factor, both printed with 2 decimals.
        let algbw = r.size as f64 / (r.time * 1e-6) / 1e9;
        assert!((r.algbw - algbw).abs() <= 0.01 + 0.01 * algbw, "algbw {} vs {algbw}", r.algbw);
        assert!((r.busbw - r.algbw * e.bus).abs() <= 0.011, "busbw {} vs algbw {}", r.busbw, r.algbw);
    }
    assert!(stdout.contains("# out of bounds values : 0 OK"), "{stdout}");
    // The host's time in the launch calls, row by row: part of the row's iteration time.
    let line = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "# host in launch calls / iteration time (us, each the largest over ranks, per row): ",
            )
        })
        .expect("the launch line");
    let pairs: Vec<(f64, f64)> = line
        .split_whitespace()
        .map(|p| {
            let (l, t) = p.split_once('/').expect("launch/time");
            (l.parse().expect("launch"), t.parse().expect("time"))
        })
        .collect();
    assert_eq!(pairs.len(), rows.len(), "{stdout}");
    for ((launch, time), row) in pairs.iter().zip(&rows) {
        assert!(launch.is_finite() && *launch >= 0.0 && *launch <= *time, "{launch} of {time}: {stdout}");
        assert!((time - row.time).abs() < 0.006, "{time} against the row's {}", row.time);
    }
}

#[test]
fn all_gather_two_ranks_checked() {
    let (ok, out, err) =
        bench_line("--op all_gather --ranks 2 -b 1K -e 16K -f 4 --iters 3 --warmup 1 --check");
    assert!(ok, "{err}");
    check_table(
        &out,
        Expect { ranks: 2, elem: 4, ty: "f32", redop: "none", bus: 0.5, min: 1024, max: 16384, factor: 4 },
    );
}

/// `--inflight 1` times each collective alone, `--inflight 5` keeps five in flight (every set
/// of buffers checked); 0 and more than the limit are refused naming the flag.
#[test]
fn inflight_one_and_many_checked_and_bounds_refused() {
    for k in ["1", "5"] {
        let (ok, out, err) = bench_line(&format!(
            "--op all_gather --ranks 3 -b 3K -e 12K -f 4 --iters 7 --warmup 2 --check --inflight {k}"
        ));
        assert!(ok, "--inflight {k}: {err}");
        assert!(out.contains(&format!(", {k} in flight, checked")), "{out}");
        check_table(
            &out,
            Expect {
                ranks: 3,
                elem: 4,
                ty: "f32",
                redop: "none",
                bus: 2.0 / 3.0,
                min: 3072,
                max: 12288,
                factor: 4,
            },
        );
    }
    for k in ["0", "65"] {
        let (ok, _, err) =
            bench(&["--op", "all_gather", "--ranks", "2", "-b", "1K", "-e", "1K", "--inflight", k]);
        assert!(!ok && err.contains("--inflight") && !err.contains("panicked"), "--inflight {k}: {err}");
    }
}

#[test]
fn reduce_scatter_three_ranks_bf16_coalesced() {
    let (ok, out, err) = bench_line("--op reduce_scatter --ranks 3 -b 1K -e 8K -f 8 --dtype bf16 --iters 3 --warmup 1 --check --coalesce 3");
    assert!(ok, "{err}");
    check_table(
        &out,
        Expect {
            ranks: 3,
            elem: 2,
            ty: "bf16",
            redop: "sum",
            bus: 2.0 / 3.0,
            min: 1024,
            max: 8192,
            factor: 8,
        },
    );
    for r in rows(&out) {
        assert_eq!(r.extra.len(), 3, "sep_time sep_algbw sep_busbw");
        assert!(r.extra[0] > 0.0);
    }
    assert!(out.contains("sep_time"));
}

#[test]
fn all_reduce_four_ranks_f16() {
    let (ok, out, err) =
        bench_line("--op all_reduce --ranks 4 -b 256 -e 4K -f 16 --dtype f16 --iters 2 --warmup 1 --check");
    assert!(ok, "{err}");
    check_table(
        &out,
        Expect { ranks: 1, elem: 2, ty: "f16", redop: "sum", bus: 1.5, min: 256, max: 4096, factor: 16 },
    );
}

#[test]
fn bad_flags_and_cuda_without_the_feature_are_clear_errors() {
    let (ok, _, err) = bench(&["--op", "all_gather", "--ranks", "2", "-b", "1K", "-e", "4K", "-f", "1"]);
    assert!(!ok && err.contains("--stepfactor"), "{err}");
    let (ok, _, err) = bench(&["--op", "all_gather", "--ranks", "2", "-b", "lots", "-e", "4K", "-f", "2"]);
    assert!(!ok && err.contains("lots"), "{err}");
    let (ok, _, err) = bench(&["--op", "all_gather", "--ranks", "0", "-b", "1K", "-e", "4K", "-f", "2"]);
    assert!(!ok && err.contains("--ranks"), "{err}");
    let (ok, _, err) = bench_line("--op all_gather --ranks 2 -b 1K -e 1K -f 2 --backend cuda");
    assert!(!ok && err.contains("cuda"), "{err}");
}

/// `--backend shm` alone starts one process per rank; the table has the same columns and the
/// checked results are right.
#[test]
fn shm_backend_standalone_checked() {
    let args =
        ["-b", "1K", "-e", "64K", "-f", "4", "--iters", "3", "--warmup", "1", "--check", "--backend", "shm"];
    let (ok, out, err) = bench(&[&["--op", "all_gather", "--ranks", "3"], &args[..]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("(shm backend)"), "{out}");
    check_table(
        &out,
        Expect {
            ranks: 3,
            elem: 4,
            ty: "f32",
            redop: "none",
            bus: 2.0 / 3.0,
            min: 1024,
            max: 65536,
            factor: 4,
        },
    );
    let (ok, out, err) =
        bench(&[&["--op", "reduce_scatter", "--ranks", "2", "--dtype", "bf16"], &args[..]].concat());
    assert!(ok, "{err}");
    check_table(
        &out,
        Expect { ranks: 2, elem: 2, ty: "bf16", redop: "sum", bus: 0.5, min: 1024, max: 65536, factor: 4 },
    );
}

/// Sizes default to 32M and the factor to 2, as in nccl-tests: `--op` and `--ranks` suffice.
#[test]
fn sizes_and_factor_have_nccl_tests_defaults() {
    let (ok, out, err) = bench(&["--op", "all_gather", "--ranks", "2", "--iters", "2", "--warmup", "1"]);
    assert!(ok, "{err}");
    let rows = rows(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0].size, 32 << 20);
}

/// Start-up and teardown of process ranks: 100 consecutive `--backend shm --ranks 2` runs
/// succeed and leave no process of theirs (running or zombie) and nothing in `/dev/shm`.
#[test]
fn a_hundred_shm_runs_leave_nothing_behind() {
    let tag = format!("collsched-test-{}", std::process::id());
    // Orphans of our runs (ranks whose launcher did not wait for them) become this process's
    // children, so that their zombies are told apart from other tests' processes by parent.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(rc, 0, "prctl(PR_SET_CHILD_SUBREAPER)");
    for i in 0..100 {
        let out = Command::new(env!("CARGO_BIN_EXE_collsched"))
            .args(["bench", "--op", "all_reduce", "--ranks", "2", "-b", "4K", "-e", "4K", "--iters", "1"])
            .args(["--warmup", "0", "--backend", "shm"])
            .env("COLLSCHED_TEST_TAG", &tag)
            .output()
            .expect("run collsched");
        assert!(out.status.success(), "run {i}: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(ours(&tag), Vec::<String>::new(), "processes left");
    let shm: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(shm.iter().all(|n| !n.contains("collsched")), "{shm:?}");
}

/// Launched by Open MPI's `mpirun` (its `OMPI_COMM_WORLD_*` variables and job namespace), each
/// process is a rank: the checked table, and the demo's parity. `ci/setup.sh` installs
/// `openmpi-bin`.
#[test]
fn shm_ranks_launched_by_mpirun() {
    let mpirun = |args: &[&str]| {
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "3", env!("CARGO_BIN_EXE_collsched")])
            .args(args)
            .output()
            .expect("mpirun (apt install openmpi-bin, or run ci/setup.sh)")
    };
    // The local backend under a launcher still needs --ranks: a clear error, not a hang.
    let out = mpirun(&["bench", "--op", "all_reduce", "-b", "1K", "-e", "16K", "-f", "4", "--iters", "3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ranks is required"));
    let out = mpirun(&[
        "bench",
        "--op",
        "all_reduce",
        "-b",
        "1K",
        "-e",
        "16K",
        "-f",
        "4",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--check",
        "--backend",
        "shm",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    check_table(
        &stdout,
        Expect {
            ranks: 3,
            elem: 4,
            ty: "f32",
            redop: "sum",
            bus: 4.0 / 3.0,
            min: 1024,
            max: 16384,
            factor: 4,
        },
    );
    let out = mpirun(&["demo", "--backend", "shm", "--steps", "2", "--strategy", "greedy"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.trim_end().ends_with("parity: max |loss difference| = 0e0 over 2 steps"), "{stdout}");
}

/// `--check` counts only the buffer sets that ran: with one iteration and one warm-up, a
/// correct run reports 0 wrong elements.
#[test]
fn check_with_a_single_iteration_counts_only_what_ran() {
    for backend in ["local", "shm"] {
        let (ok, out, err) = bench_line(&format!(
            "--op reduce_scatter --ranks 2 -b 4K -e 4K --iters 1 --warmup 1 --check --backend {backend}"
        ));
        assert!(ok, "{backend}: {err}\n{out}");
        assert!(out.contains("# out of bounds values : 0 OK"), "{backend}: {out}");
    }
}

/// A request larger than the machine is refused before anything is allocated, naming `-e`.
#[test]
fn a_request_larger_than_the_machine_is_refused() {
    for backend in ["local", "shm"] {
        let (ok, _, err) =
            bench_line(&format!("--op all_reduce --ranks 2 -b 1024G -e 1024G --backend {backend}"));
        assert!(!ok, "{backend}: accepted");
        assert!(err.contains("-e/--maxbytes") && err.contains("available"), "{backend}: {err}");
        assert_eq!(err.lines().count(), 1, "{backend}: one error line: {err}");
    }
}

/// Processes carrying `tag` in their environment, and zombies whose parent is this process
/// (orphaned ranks, reparented here; a zombie's environment can no longer be read), by pid.
fn ours(tag: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().chars().all(|c| c.is_ascii_digit()))
        .filter(|e| {
            let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // stat: "pid (comm) state ppid ...": the fields after the command's closing paren.
            let after = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
            let mut fields = after.split_whitespace();
            let (state, ppid) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
            env.windows(tag.len()).any(|w| w == tag.as_bytes()) || (state == "Z" && ppid == me)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// `--op copy_in|copy_out` on the host's kernels: one row per size, every element right, the
/// kernel and the reference both timed, the sizes whole elements of whole pieces; and the
/// requests it cannot serve refused by name.
#[test]
fn copy_kernels_checked_against_a_host_copy() {
    for (op, ty, es) in [("copy_in", "f32", 4u64), ("copy_out", "bf16", 2)] {
        let line =
            format!("--op {op} --dtype {ty} -b 1K -e 1M -f 16 --coalesce 7 --iters 3 --warmup 1 --check");
        let (ok, out, err) = bench_line(&line);
        assert!(ok, "{line}: {err}\n{out}");
        assert!(out.contains("7 pieces") && out.contains("a host memcpy"), "{out}");
        let rows: Vec<Vec<&str>> = out
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| l.split_whitespace().collect())
            .collect();
        // 1 KiB, 16 KiB, 256 KiB: each rounded down to 7 pieces of whole 16-byte multiples.
        assert_eq!(rows.len(), 3, "{out}");
        for (c, want) in rows.iter().zip([1024u64, 16 << 10, 256 << 10]) {
            assert_eq!(c.len(), 11, "{c:?}");
            let size: u64 = c[0].parse().unwrap();
            assert_eq!(size, want / (16 * 7) * 16 * 7, "{c:?}");
            assert_eq!(c[1].parse::<u64>().unwrap(), size / es, "{c:?}");
            assert_eq!((c[2], c[3]), (ty, "7"), "{c:?}");
            for k in [4, 5, 7, 8, 9] {
                let x: f64 = c[k].parse().unwrap();
                assert!(x.is_finite() && x > 0.0, "column {k} of {c:?}");
            }
            assert_eq!(c[10], "0", "{c:?}");
        }
        assert!(out.contains("# wrong elements: 0"), "{out}");
    }
    for (line, says) in [
        ("--op copy_in --ranks 2", "give --ranks 1"),
        ("--op copy_out --backend shm", "--backend local"),
        ("--op copy_in --coalesce 0", "--coalesce"),
    ] {
        let (ok, _, err) = bench_line(line);
        assert!(!ok && err.contains(says), "{line}: {err}");
    }
}
