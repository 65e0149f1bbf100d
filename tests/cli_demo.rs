//! `collsched demo` end to end: small settings, the last line parsed.

use std::process::Command;

fn demo(args: &[&str]) -> (bool, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_collsched")).arg("demo").args(args).output().expect("run collsched");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn parse_last_line(stdout: &str) -> (f64, usize) {
    let last = stdout.lines().last().expect("some output");
    let rest =
        last.strip_prefix("parity: max |loss difference| = ").unwrap_or_else(|| panic!("last line: {last}"));
    let (x, steps) = rest.split_once(" over ").expect("` over `");
    let steps = steps.strip_suffix(" steps").expect("` steps`");
    (x.parse().expect("a number"), steps.parse().expect("a step count"))
}

#[test]
fn demo_prints_parity_as_its_last_line() {
    let (ok, stdout) = demo(&["--ranks", "2", "--steps", "3", "--strategy", "flat", "--seed", "5"]);
    assert!(ok, "demo failed:\n{stdout}");
    let (x, steps) = parse_last_line(&stdout);
    assert_eq!((x, steps), (0.0, 3), "{stdout}");
    assert!(stdout.contains("ref loss"), "{stdout}");
}

#[test]
fn demo_hybrid_and_no_prefetch() {
    let (ok, stdout) = demo(&["--ranks", "4", "--steps", "2", "--strategy", "hybrid:2", "--policy", "none"]);
    assert!(ok, "demo failed:\n{stdout}");
    let (x, steps) = parse_last_line(&stdout);
    assert!(x <= 1e-4 && steps == 2, "{stdout}");
}

#[test]
fn demo_rejects_bad_settings() {
    let (ok, _) = demo(&["--ranks", "4", "--strategy", "hybrid:3"]);
    assert!(!ok, "hybrid:3 on 4 ranks must fail");
    let (ok, _) = demo(&["--ranks", "0"]);
    assert!(!ok, "0 ranks must fail");
    for (flag, value) in [("--ranks", "100000"), ("--steps", "18446744073709551615")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
            .args(["demo", flag, value])
            .output()
            .expect("run collsched");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(flag) && err.contains("limit"),
            "{flag} {value}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The demo's own workload, as `--workload-out` writes it, simulated by `collsched sim`: the
/// simulator builds the same buckets and launches the same collectives per step as the demo
/// run with one micro-batch and no evaluation, and the demo splits its step time into parts
/// that add up to no more than the whole.
#[test]
fn demo_workload_simulates_the_same_collectives() {
    let dir = std::env::temp_dir().join(format!("collsched-demo-workload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("demo.json");
    let file_arg = file.to_str().expect("utf-8 path");
    let (ok, stdout) = demo(&[
        "--ranks",
        "2",
        "--steps",
        "4",
        "--micro-batches",
        "1",
        "--eval-every",
        "0",
        "--no-freeze",
        "--workload-out",
        file_arg,
    ]);
    assert!(ok, "demo failed:\n{stdout}");
    assert_eq!(parse_last_line(&stdout), (0.0, 4), "{stdout}");
    // "N gather buckets, M gradient buckets; ..." and the per-step "coll" column.
    let buckets = stdout.lines().find(|l| l.contains(" gather buckets, ")).expect("bucket line");
    let words: Vec<&str> = buckets.split_whitespace().collect();
    let (gather, grad): (u64, u64) = (words[0].parse().expect("count"), words[3].parse().expect("count"));
    let header = stdout.lines().find(|l| l.trim_start().starts_with("step ")).expect("table header");
    // Three headers before `coll` are two words each ("ref loss", "ref eval", "sh. eval").
    let col = header.split_whitespace().position(|w| w == "coll").expect("coll column") - 3;
    let last_step = stdout.lines().find(|l| l.trim_start().starts_with("3 ")).expect("step 3's row");
    let coll: u64 = last_step.split_whitespace().nth(col).expect("coll value").parse().expect("count");
    let line = stdout.lines().find(|l| l.starts_with("step time: ")).expect("step time line");
    let ms = |key: &str| -> f64 {
        let at = line.find(key).unwrap_or_else(|| panic!("no `{key}` in {line}"));
        line[at + key.len()..].split_whitespace().next().expect("a number").parse().expect("a number")
    };
    let (step, compute, waits, host) = (ms("step time: "), ms("compute "), ms("waits "), ms("host "));
    assert!(step > 0.0 && compute > 0.0 && waits >= 0.0 && host >= 0.0, "{line}");
    assert_eq!(ms("evaluation "), 0.0, "no evaluation asked for: {line}");
    assert!(compute + waits <= step * 1.0001, "{line}");
    let out = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["sim", "--workload", file_arg, "--world", "2", "--topo", "cpu-2socket", "--tflops", "0.003"])
        .args(["--bucket-by", "size", "--bucket-mb", "0.00390625", "--steps", "3", "--json"])
        .output()
        .expect("run collsched sim");
    let sim = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "sim failed: {sim}{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(&sim).expect("sim --json");
    assert_eq!(json["gather_buckets"].as_u64(), Some(gather), "{sim}");
    assert_eq!(json["grad_buckets"].as_u64(), Some(grad), "{sim}");
    assert_eq!(json["collectives"].as_f64(), Some(coll as f64), "{sim}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_rejects_zero_micro_batches() {
    for value in ["0", "100000"] {
        let out = Command::new(env!("CARGO_BIN_EXE_collsched"))
            .args(["demo", "--ranks", "2", "--micro-batches", value])
            .output()
            .expect("run collsched");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--micro-batches"), "{value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `--backend cuda` on a machine without a GPU (or a build without the `cuda` feature) is one
/// clear error line and a failing exit status, never a panic. With `COLLSCHED_GPU=1` on a GPU
/// machine the cuda run is the parity run itself (tests/gpu_demo.rs), so this checks only
/// the no-GPU path.
#[test]
fn demo_cuda_backend_without_gpu_is_a_clear_error() {
    if std::env::var_os("COLLSCHED_GPU").is_some_and(|v| v == "1") {
        eprintln!("skipped: COLLSCHED_GPU=1 (a GPU may be present; tests/gpu_demo.rs covers it)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["demo", "--backend", "cuda", "--ranks", "2", "--steps", "1"])
        .output()
        .expect("run collsched");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "demo --backend cuda must fail here:\n{stderr}");
    assert!(!stderr.contains("panicked"), "a panic instead of an error:\n{stderr}");
    let expected =
        if cfg!(feature = "cuda") { "no CUDA driver found" } else { "built without the `cuda` feature" };
    assert!(stderr.contains(expected), "expected `{expected}` in:\n{stderr}");
}

/// `--backend shm`: one process per rank (started by the demo itself), the same parity as the
/// local backend: bit for bit for even, flat and greedy, within the hybrid tolerance for hybrid.
#[test]
fn demo_shm_backend_reaches_local_parity_for_every_strategy() {
    for (strategy, ranks, tolerance) in
        [("even", "3", 0.0), ("flat", "2", 0.0), ("greedy", "3", 0.0), ("hybrid:2", "4", 1e-4)]
    {
        let (ok, stdout) = demo(&[
            "--backend",
            "shm",
            "--ranks",
            ranks,
            "--steps",
            "3",
            "--strategy",
            strategy,
            "--seed",
            "3",
        ]);
        assert!(ok, "{strategy}: demo failed:\n{stdout}");
        let (x, steps) = parse_last_line(&stdout);
        assert!(x <= tolerance && steps == 3, "{strategy}: {stdout}");
    }
}
