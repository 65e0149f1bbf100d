//! `collsched calibrate` and `collsched sim --cost`: a calibration on the local backend prints
//! its table and writes a profile the simulator reads; bad flags and files give one clear line.
//! Nothing here asserts on a timing.

use std::path::PathBuf;
use std::process::{Command, Output};

use collsched::topo::CostProfile;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_collsched")).args(args).output().expect("the binary runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("collsched-cli-calibrate-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn failure(args: &[&str]) -> String {
    let out = run(args);
    assert!(!out.status.success(), "{args:?} should fail");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: ") && !err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn calibrates_the_local_backend_into_a_profile_the_simulator_reads() {
    let dir = scratch("local");
    let profile = dir.join("p.json");
    let p = profile.to_str().unwrap();
    let out = run(&[
        "calibrate",
        "--backend",
        "local",
        "--ranks",
        "2",
        "-b",
        "4K",
        "-e",
        "1M",
        "-f",
        "4",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--launch-iters",
        "10",
        "--demo-steps",
        "3",
        "--out",
        p,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Every kind measured at every size, each with its fit or the reason it has none.
    assert!(stdout.contains("measured_us") && stdout.contains("residual"), "{stdout}");
    for kind in ["all_gather", "reduce_scatter", "all_reduce"] {
        assert_eq!(
            stdout.lines().filter(|l| l.trim_start().starts_with(kind)).count(),
            5,
            "{kind}: {stdout}"
        );
        assert!(
            stdout.contains(&format!("# {kind}: fixed")) || stdout.contains(&format!("{kind} on 2 ranks")),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("# launch:") && stdout.contains("# sharing:") && stdout.contains("# host:"),
        "{stdout}"
    );
    if !out.status.success() {
        // A machine too noisy for any fit says so (timings decide it, so it is not a failure here).
        assert!(stderr.contains("no collective kind could be fitted"), "{stderr}");
        return;
    }
    let prof = CostProfile::from_json(&std::fs::read_to_string(&profile).unwrap()).unwrap();
    assert_eq!((prof.backend.as_str(), prof.ranks), ("local", 2));
    assert!(prof.host_per_collective_s.is_some(), "{stdout}");
    // The simulator reads it, with or without a topology.
    let demo = dir.join("w.json");
    let d = run(&[
        "demo",
        "--ranks",
        "2",
        "--steps",
        "2",
        "--micro-batches",
        "1",
        "--eval-every",
        "0",
        "--workload-out",
        demo.to_str().unwrap(),
    ]);
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    if prof.covers(collsched::topo::CollectiveKind::AllGather)
        && prof.covers(collsched::topo::CollectiveKind::ReduceScatter)
    {
        let s = run(&[
            "sim",
            "--workload",
            demo.to_str().unwrap(),
            "--world",
            "2",
            "--cost",
            p,
            "--tflops",
            "0.001",
            "--bucket-by",
            "size",
            "--bucket-mb",
            "0.004",
        ]);
        let text = String::from_utf8_lossy(&s.stdout);
        assert!(s.status.success(), "{}", String::from_utf8_lossy(&s.stderr));
        assert!(text.contains("priced by a cost profile of `local` measured on 2 ranks"), "{text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_flags_give_one_line() {
    let e = failure(&["calibrate", "--ranks", "1"]);
    assert!(e.contains("--ranks 1") && e.contains("at least 2"), "{e}");
    let e = failure(&["calibrate", "--ranks", "2", "-f", "1"]);
    assert!(e.contains("-f/--stepfactor"), "{e}");
    let e = failure(&["calibrate", "--ranks", "2", "--demo-bucket-kb", "0"]);
    assert!(e.contains("--demo-bucket-kb"), "{e}");
    // No GPU here (or no `cuda` feature): refused, naming the backend.
    let e = failure(&["calibrate", "--backend", "cuda", "--ranks", "2"]);
    assert!(e.contains("calibrate --backend cuda"), "{e}");
}

#[test]
fn sim_cost_rejects_a_bad_profile_and_needs_a_topology_without_one() {
    let dir = scratch("sim");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"format": "collsched-topology", "version": 1}"#).unwrap();
    let e = failure(&["sim", "--workload", "gpt2-1.5b", "--world", "2", "--cost", bad.to_str().unwrap()]);
    assert!(e.contains("--cost") && e.contains("bad.json"), "{e}");
    let e = failure(&[
        "sim",
        "--workload",
        "gpt2-1.5b",
        "--world",
        "2",
        "--cost",
        dir.join("none.json").to_str().unwrap(),
    ]);
    assert!(e.contains("calibrate --out"), "{e}");
    // A profile without reduce-scatter cannot price a training step.
    let mut p = CostProfile::new("local", 2);
    p.collectives.push(collsched::topo::calibration::CollectiveFit {
        kind: collsched::topo::CollectiveKind::AllGather,
        ranks: 2,
        fit: collsched::topo::calibration::LinearFit { fixed_s: 1e-5, per_byte_s: 1e-10, points: Vec::new() },
    });
    let only_ag = dir.join("ag.json");
    std::fs::write(&only_ag, p.to_json()).unwrap();
    let e = failure(&["sim", "--workload", "gpt2-1.5b", "--world", "2", "--cost", only_ag.to_str().unwrap()]);
    assert!(e.contains("reduce_scatter"), "{e}");
    let out = run(&["sim", "--workload", "gpt2-1.5b", "--world", "2"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--topo"));
    std::fs::remove_dir_all(&dir).ok();
}
