//! `collsched sim`: the flags, the `--json` keys, the Chrome trace (valid JSON, one pid per
//! rank), the SVG, the sweep table, and clear errors for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

use collsched::sim::workload::Architecture;

#[path = "support/workloads.rs"]
mod workloads;
use workloads::small_config;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_collsched")).arg("sim").args(args).output().expect("the binary runs")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `collsched sim --workload W --world 4 --topo dgx-h100 EXTRA..`, which must succeed.
fn on_4_dgx(workload: &str, extra: &[&str]) -> String {
    let mut args = vec!["--workload", workload, "--world", "4", "--topo", "dgx-h100"];
    args.extend_from_slice(extra);
    ok_stdout(&args)
}

fn err_line(args: &[&str]) -> String {
    let out = run(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

/// A scratch directory for this test, removed when the test ends (passed or failed).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(test: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("collsched-cli-sim-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A small workload file (a generator config), so the tests run in milliseconds.
fn small_workload(dir: &std::path::Path) -> String {
    let cfg = small_config("tiny", Architecture::Gpt2, 3, 256, true);
    let text = serde_json::json!({"format": "collsched-workload", "version": 1, "transformer": cfg});
    let path = dir.join("tiny.json");
    std::fs::write(&path, text.to_string()).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn json_has_the_contract_keys() {
    let dir = scratch("json");
    let w = small_workload(&dir);
    let text = ok_stdout(&[
        "--workload",
        &w,
        "--world",
        "8",
        "--topo",
        "dgx-h100",
        "--policy",
        "trace",
        "--bucket-mb",
        "0.25",
        "--prefetch-mb",
        "1",
        "--max-inflight",
        "2",
        "--steps",
        "3",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    for key in
        ["step_ms", "compute_ms", "exposed_comm_ms", "tflops_per_gpu", "peak_gathered_bytes", "collectives"]
    {
        assert!(v[key].is_number(), "`{key}` missing or not a number: {v}");
    }
    let comm = v["comm_ms"].as_object().expect("comm_ms is an object");
    assert!(comm.contains_key("all_gather") && comm.contains_key("reduce_scatter"), "{v}");
    let step = v["step_ms"].as_f64().unwrap();
    let parts = v["compute_ms"].as_f64().unwrap() + v["exposed_comm_ms"].as_f64().unwrap();
    assert!((step - parts).abs() < 1e-6 * step.max(1.0), "step = compute + exposed without jitter: {v}");
    assert_eq!(v["steps_reported"], 2, "step 1 is left out");
    assert_eq!(v["policy"], "trace");
    assert_eq!(v["world"], 8);
}

#[test]
fn every_policy_runs_and_naive_issues_more_collectives() {
    let dir = scratch("policies");
    let w = small_workload(&dir);
    let mut collectives = Vec::new();
    for p in ["naive", "coalesced", "trace", "explicit", "zero3-2021"] {
        let text = ok_stdout(&["--workload", &w, "--world", "4", "--topo", "p4d", "--policy", p, "--json"]);
        let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        collectives.push(v["collectives"].as_f64().unwrap());
        let human = ok_stdout(&["--workload", &w, "--world", "4", "--topo", "p4d", "--policy", p]);
        for line in [
            "step time",
            "compute",
            "exposed comm",
            "comm all_gather",
            "comm reduce_scatter",
            "TFLOPS per GPU",
            "peak gathered",
            "collectives",
        ] {
            assert!(human.contains(line), "{p}: `{line}` missing:\n{human}");
        }
    }
    assert!(collectives[0] > collectives[1], "naive {} vs coalesced {}", collectives[0], collectives[1]);
}

#[test]
fn trace_out_is_chrome_json_with_one_pid_per_rank() {
    let dir = scratch("trace");
    let w = small_workload(&dir);
    let trace = dir.join("t.json");
    let svg = dir.join("t.svg");
    ok_stdout(&[
        "--workload",
        &w,
        "--world",
        "6",
        "--topo",
        "dgx-h100",
        "--steps",
        "2",
        "--trace-out",
        trace.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--svg-rank",
        "5",
    ]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let mut pids: Vec<u64> = events.iter().map(|e| e["pid"].as_u64().unwrap()).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids, (0..6).collect::<Vec<u64>>());
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(!complete.is_empty());
    for e in &complete {
        assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        assert!(e["tid"].as_u64().unwrap() < 3, "one thread per stream: {e}");
    }
    for tid in 0..3 {
        assert!(complete.iter().any(|e| e["tid"] == tid), "no events on thread {tid}");
    }
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
    for lane in ["compute", "all_gather", "reduce_scatter"] {
        assert!(picture.contains(&format!(">{lane}</text>")), "lane {lane} missing");
    }
    assert!(picture.matches("<rect").count() > 10);
}

#[test]
fn sweep_prints_the_grid() {
    let dir = scratch("sweep");
    let w = small_workload(&dir);
    let text = on_4_dgx(&w, &["--sweep", "policy=coalesced,trace,explicit", "--sweep", "world=2,8"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 3 * 2, "{text}");
    assert!(lines[0].contains("policy") && lines[0].contains("world") && lines[0].contains("step_ms"));
    assert!(lines[1].contains("coalesced") && lines[6].contains("explicit"));
    let json = on_4_dgx(&w, &["--sweep", "bucket-mb=0.1,1", "--json"]);
    let rows: Vec<serde_json::Value> = json.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    assert!(rows[0]["gather_buckets"].as_u64() > rows[1]["gather_buckets"].as_u64());
    assert_eq!(rows[1]["sweep"]["bucket-mb"], "1");
}

#[test]
fn bucket_by_module_is_the_default_and_cuts_all_gathers() {
    let dir = scratch("bucket-by");
    let w = small_workload(&dir);
    let json = on_4_dgx(&w, &["--bucket-mb", "2", "--sweep", "bucket-by=size,module", "--json"]);
    let rows: Vec<serde_json::Value> = json.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0]["bucket_by"].as_str(), rows[1]["bucket_by"].as_str()),
        (Some("size"), Some("module"))
    );
    // No bucket is shared by two blocks: fewer all-gathers per step.
    assert!(rows[1]["all_gathers"].as_u64() < rows[0]["all_gathers"].as_u64(), "{rows:?}");
    let default = on_4_dgx(&w, &["--bucket-mb", "2", "--json"]);
    let default: serde_json::Value = serde_json::from_str(&default).unwrap();
    assert_eq!(default["bucket_by"], "module");
    assert_eq!(default["all_gathers"], rows[1]["all_gathers"]);
    let table = on_4_dgx(&w, &["--bucket-by", "module:2+pack"]);
    assert!(table.contains("bucket by module:2+pack"), "{table}");
    let bad = err_line(&["--workload", &w, "--world", "4", "--topo", "dgx-h100", "--bucket-by", "layers"]);
    assert!(bad.contains("layers"), "{bad}");
    let bad =
        err_line(&["--workload", &w, "--world", "4", "--topo", "dgx-h100", "--sweep", "bucket-by=module:0"]);
    assert!(bad.contains("module:0"), "{bad}");
}

#[test]
fn bad_input_is_one_clear_error() {
    let dir = scratch("errors");
    let w = small_workload(&dir);
    let base = ["--workload", w.as_str(), "--world", "4", "--topo", "dgx-h100"];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        err_line(&a)
    };
    assert!(with(&["--policy", "eager"]).contains("eager"));
    assert!(with(&["--sweep", "colour=red"]).contains("colour"));
    assert!(with(&["--sweep", "world=two"]).contains("two"));
    assert!(with(&["--bucket-mb=-1"]).contains("--bucket-mb -1"));
    assert!(with(&["--steps", "0"]).contains("steps"));
    assert!(with(&["--tflops", "0"]).contains("tflops"));
    assert!(err_line(&["--workload", "gpt9", "--world", "4", "--topo", "dgx-h100"]).contains("gpt9"));
    assert!(err_line(&["--workload", &w, "--world", "4", "--topo", "nope"]).contains("nope"));
    assert!(err_line(&["--workload", &w, "--world", "0", "--topo", "dgx-h100"]).contains("world"));
}

/// Knobs that would run the virtual clock past its range are refused, naming the knob, instead
/// of printing saturated times with exit status 0.
#[test]
fn knobs_beyond_the_clock_are_refused_by_name() {
    let base = ["sim", "--workload", "gpt2-1.5b", "--world", "8", "--topo", "dgx-h100"];
    for (extra, knob) in [
        (["--tflops", "1e-9"], "`tflops`"),
        (["--host-overhead-us", "1e15"], "`host-overhead-us`"),
        (["--steps", "4294967295"], "`steps`"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
            .args(base)
            .args(extra)
            .output()
            .expect("run collsched");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(err.contains(knob) && err.contains("beyond the simulator's clock"), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A trace missing one field names the field.
#[test]
fn a_trace_missing_a_field_names_it() {
    let dir = scratch("missing_field");
    let path = dir.join("trace.json");
    std::fs::write(
        &path,
        r#"{"format": "collsched-workload", "version": 1, "name": "x", "params": [], "forward_order": [], "backward_order": []}"#,
    )
    .expect("write");
    let line = err_line(&["--workload", path.to_str().expect("utf-8"), "--world", "2", "--topo", "dgx-h100"]);
    assert!(line.contains("missing field `layers`"), "{line}");
}

/// A world beyond the simulator's limit is refused at once, naming it (it allocated until abort).
#[test]
fn a_world_beyond_the_limit_is_refused() {
    let line = err_line(&["--workload", "gpt2-1.5b", "--world", "4294967295", "--topo", "dgx-h100"]);
    assert!(line.contains("`world`") && line.contains("limit of 1048576"), "{line}");
}

/// `--against REAL.json`: a "real" trace made of the simulation's own collectives, one of them
/// ten times longer, one rank's reduce-scatters cut short by one, a collective the
/// simulation lacks (a plan agreement) put first on its all-gathers and its first gather run
/// twice in its step, and another engine's gathers beside: counts, pairs by bucket and step
/// (by order where the names carry none: rank 0's, renamed), the other engine's left out, busy
/// times, the collective that differs most, and the real events drawn beside the simulated ones.
#[test]
fn against_compares_each_track_and_overlays_the_real_run() {
    let dir = scratch("against");
    let w = small_workload(&dir);
    let sim_trace = dir.join("sim.json");
    let base = ["--workload", &w, "--world", "2", "--topo", "dgx-h100", "--steps", "2"];
    ok_stdout(&[&base[..], &["--trace-out", sim_trace.to_str().unwrap()]].concat());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sim_trace).unwrap()).unwrap();
    let mut real: Vec<serde_json::Value> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && (e["tid"] == 1 || e["tid"] == 2))
        .cloned()
        .collect();
    let count = |real: &[serde_json::Value], rank: u64, tid: u64| {
        real.iter().filter(|e| e["pid"] == rank && e["tid"] == tid).count()
    };
    let n_ag = count(&real, 0, 1);
    let n_rs = count(&real, 0, 2);
    assert!(n_ag >= 3 && n_rs >= 2 && count(&real, 1, 1) == n_ag, "{n_ag} {n_rs}");
    // Rank 1's third all-gather takes ten times as long; rank 1 loses its last reduce-scatter.
    let third = real.iter().position(|e| e["pid"] == 1 && e["tid"] == 1).unwrap() + 2;
    let slow = real[third]["dur"].as_f64().unwrap();
    assert!(slow > 0.0, "{}", real[third]);
    real[third]["dur"] = serde_json::json!(slow * 10.0);
    let bytes = real[third]["args"]["bytes"].as_u64().unwrap_or_else(|| panic!("no bytes: {}", real[third]));
    assert!(bytes > 0, "{}", real[third]);
    real[third]["args"]["bytes"] = serde_json::json!(2 * bytes);
    let last_rs = real.iter().rposition(|e| e["pid"] == 1 && e["tid"] == 2).unwrap();
    let lost = real.remove(last_rs)["dur"].as_f64().unwrap();
    let first = real.iter().position(|e| e["pid"] == 1 && e["tid"] == 1).unwrap();
    let mut extra = real[first].clone();
    extra["name"] = serde_json::json!("all_gather bucket 15814254");
    extra["dur"] = serde_json::json!(1.0e6);
    extra["ts"] = serde_json::json!(0.0);
    real.insert(first, extra);
    // The first reduce-scatter again right after it, in its step: paired with nothing (by
    // occurrence it would take the next step's reduction of its bucket, and differ most).
    let first_rs = real.iter().position(|e| e["pid"] == 1 && e["tid"] == 2).unwrap();
    let mut again = real[first_rs].clone();
    again["ts"] = serde_json::json!(real[first_rs]["ts"].as_f64().unwrap() + 0.001);
    again["dur"] = serde_json::json!(5.0e5);
    real.insert(first_rs + 1, again);
    // Rank 1's reductions in steps 2 and 4 (two micro-batches a step, the first under no_sync):
    // the k-th step with reductions is the simulation's k-th.
    for e in real.iter_mut().filter(|e| e["pid"] == 1 && e["tid"] == 2) {
        let step = e["args"]["step"].as_u64().unwrap_or_else(|| panic!("no step: {e}"));
        e["args"]["step"] = serde_json::json!(2 * step);
    }
    // Rank 1's collectives are engine 7's; engine 3 (an evaluation) gathered the same buckets
    // at the same times, a thousand times as long: left out.
    for e in real.iter_mut().filter(|e| e["pid"] == 1) {
        e["args"]["engine"] = serde_json::json!(7);
    }
    let other: Vec<serde_json::Value> = real
        .iter()
        .filter(|e| e["pid"] == 1 && e["tid"] == 1 && e["args"]["bytes"].is_u64())
        .map(|e| {
            let mut o = e.clone();
            o["args"]["engine"] = serde_json::json!(3);
            o["dur"] = serde_json::json!(e["dur"].as_f64().unwrap() * 1000.0);
            o
        })
        .collect();
    assert_eq!(other.len(), n_ag + 1, "{other:?}");
    real.extend(other);
    for e in real.iter_mut().filter(|e| e["pid"] == 0) {
        e["name"] = serde_json::json!("a collective");
    }
    let real_path = dir.join("real.json");
    std::fs::write(&real_path, serde_json::json!({"traceEvents": real}).to_string()).unwrap();
    let both = dir.join("both.json");
    let out = ok_stdout(
        &[&base[..], &["--against", real_path.to_str().unwrap(), "--trace-out", both.to_str().unwrap()]]
            .concat(),
    );
    let rows = against_rows(&out);
    assert_eq!(rows.len(), 4, "{out}");
    assert!(out.contains("have no match on the other side"), "{out}");
    assert!(!out.contains("the counts differ on some track"), "{out}");
    let cell = |r: usize, c: usize| -> f64 { rows[r][c].parse().unwrap_or_else(|_| panic!("{out}")) };
    // Rank 0 is the simulation itself, its names without buckets: paired by order, the same
    // counts and busy time, ratio 1.
    for (r, n) in [(0, n_ag), (1, n_rs)] {
        assert_eq!((cell(r, 2) as usize, cell(r, 3) as usize, cell(r, 4) as usize), (n, n, n), "{out}");
        assert_eq!(rows[r][5], "order", "{out}");
        assert!((cell(r, 7) - cell(r, 8)).abs() <= 0.1 + 1e-3 * cell(r, 7), "{out}");
        // The same buckets on both sides: every pair of the same size.
        assert_eq!(rows[r][6], "0", "{out}");
    }
    // Rank 1 by bucket: the agreement left unpaired (its second long), the slowed gather named
    // at its place on the real track (one after the agreement); one reduce-scatter missing.
    assert_eq!(
        (cell(2, 2) as usize, cell(2, 3) as usize, cell(2, 4) as usize),
        (n_ag, n_ag + 1, n_ag),
        "{out}"
    );
    assert_eq!((rows[2][5], rows[3][5]), ("step", "step"), "{out}");
    assert!((cell(2, 8) - cell(2, 7) - 9.0 * slow - 1.0e6).abs() <= 0.2 + 1e-3 * cell(2, 8), "{out}");
    assert!(rows[2][10..].join(" ").starts_with(&format!("#3 {}", v_name(&v, 1, 1, 2))), "{out}");
    let left = format!(
        "compared: the collectives of engine 7 (on each rank the one with the most); {} real",
        n_ag + 1
    );
    assert!(out.contains(&left), "{out}");
    // The slowed gather says twice its bucket's bytes: one pair of another size, said.
    assert_eq!((rows[2][6], rows[3][6]), ("1", "0"), "{out}");
    assert!(out.contains("some pairs differ in size (`resized`)"), "{out}");
    // One reduce-scatter missing, one run twice: every pair of the same duration.
    assert_eq!(
        (cell(3, 2) as usize, cell(3, 3) as usize, cell(3, 4) as usize),
        (n_rs, n_rs, n_rs - 1),
        "{out}"
    );
    assert!((cell(3, 8) - cell(3, 7) - 5.0e5 + lost).abs() <= 0.2 + 1e-3 * cell(3, 8), "{out}");
    let worst = &rows[3][10..];
    assert!(worst.len() >= 4 && worst[worst.len() - 3] == format!("{},", worst[worst.len() - 1]), "{out}");
    // The overlay: the simulator's events, and every real one as "real rank R".
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&both).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let real_x = events.iter().filter(|e| e["ph"] == "X" && e["cat"] == "real").count();
    assert_eq!(real_x, 3 * n_ag + 2 * n_rs + 2, "{t}");
    assert!(events.iter().any(|e| e["pid"] == 1001 && e["args"]["name"] == "real rank 1"), "{t}");
    // A rank no machine has: refused by name, not looped over.
    std::fs::write(
        dir.join("huge.json"),
        r#"{"traceEvents": [{"ph": "X", "pid": 4294967296, "tid": 1, "ts": 0, "dur": 1}]}"#,
    )
    .unwrap();
    let e = err_line(&[&base[..], &["--against", dir.join("huge.json").to_str().unwrap()]].concat());
    assert!(e.contains("4294967296") && e.contains("above"), "{e}");
    // --against with --json or a sweep, or a file that is no trace: one clear line each.
    let e = err_line(&[&base[..], &["--against", real_path.to_str().unwrap(), "--json"]].concat());
    assert!(e.contains("--against") && e.contains("--json"), "{e}");
    std::fs::write(dir.join("bad.json"), "{\"events\": []}").unwrap();
    let e = err_line(&[&base[..], &["--against", dir.join("bad.json").to_str().unwrap()]].concat());
    assert!(e.contains("traceEvents") && e.contains("flight"), "{e}");
}

/// The rows of `--against`'s table in `out`, split into cells.
fn against_rows(out: &str) -> Vec<Vec<&str>> {
    out.lines()
        .skip_while(|l| !l.starts_with("against "))
        .skip(2)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|c| c.first().is_some_and(|x| x.parse::<u64>().is_ok()))
        .collect()
}

/// The name of the `k`-th event of rank `pid` on thread `tid` in the simulator's trace `v`.
fn v_name(v: &serde_json::Value, pid: u64, tid: u64, k: usize) -> String {
    let e = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == tid);
    e.clone().nth(k).unwrap()["name"].as_str().unwrap().to_owned()
}

/// `--against` a real trace with compute (the simulator's own layer arithmetic, as a flight
/// record's compute track is drawn): a compute row per rank, the same spans paired by order,
/// busy times equal; the collective rows count none real; the overlay draws the compute on
/// the real ranks' compute thread. Without compute in the real trace there is no compute row.
#[test]
fn against_compares_the_compute_track_where_the_real_run_has_one() {
    let dir = scratch("against-compute");
    let w = small_workload(&dir);
    let sim_trace = dir.join("sim.json");
    let base = ["--workload", &w, "--world", "2", "--topo", "dgx-h100", "--steps", "2"];
    ok_stdout(&[&base[..], &["--trace-out", sim_trace.to_str().unwrap()]].concat());
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sim_trace).unwrap()).unwrap();
    let real: Vec<serde_json::Value> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["ph"] == "X"
                && e["tid"] == 0
                && ["forward", "backward", "recompute"].iter().any(|c| e["cat"] == *c)
        })
        .cloned()
        .collect();
    // Each real span's name marked with its step, to tell which step the SVG draws.
    let real: Vec<serde_json::Value> = real
        .into_iter()
        .map(|mut e| {
            e["name"] =
                serde_json::json!(format!("{} (step {})", e["name"].as_str().unwrap(), e["args"]["step"]));
            e
        })
        .collect();
    let per_rank = |r: u64| real.iter().filter(|e| e["pid"] == r).count();
    let n = per_rank(0);
    assert!(n >= 4 && per_rank(1) == n, "{} {}", n, per_rank(1));
    let busy: f64 = real.iter().filter(|e| e["pid"] == 0).map(|e| e["dur"].as_f64().unwrap()).sum();
    let real_path = dir.join("real.json");
    std::fs::write(&real_path, serde_json::json!({"traceEvents": real}).to_string()).unwrap();
    let both = dir.join("both.json");
    let svg = dir.join("both.svg");
    let out = ok_stdout(
        &[
            &base[..],
            &["--against", real_path.to_str().unwrap(), "--trace-out", both.to_str().unwrap()],
            &["--svg", svg.to_str().unwrap(), "--svg-rank", "1"],
        ]
        .concat(),
    );
    let rows = against_rows(&out);
    assert_eq!(rows.len(), 6, "{out}");
    // The SVG: rank 1's last simulated step, and below it the real one (the same spans: the
    // real trace is the simulation's), each compute span once in each.
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.contains("below, the real run's step 2"), "{picture}");
    let lanes =
        ["compute", "all_gather", "reduce_scatter", "real compute", "real all_gather", "real reduce_scatter"];
    for lane in lanes {
        assert!(picture.contains(&format!(">{lane}</text>")), "no lane {lane}: {picture}");
    }
    let last: Vec<&serde_json::Value> =
        real.iter().filter(|e| e["pid"] == 1 && e["args"]["step"] == 2).collect();
    assert_eq!(last.len(), n / 2, "{n}");
    for e in &last {
        let title = format!("<title>{}</title>", e["name"].as_str().unwrap());
        assert_eq!(picture.matches(&title).count(), 1, "{title} in {picture}");
    }
    assert_eq!(picture.matches("(step 2)</title>").count(), n / 2, "{picture}");
    assert!(!picture.contains("(step 1)"), "{picture}");
    for rank in 0..2usize {
        let r = &rows[3 * rank..3 * rank + 3];
        assert_eq!((r[0][1], r[1][1], r[2][1]), ("all-gather", "reduce-scatter", "compute"), "{out}");
        assert_eq!((r[0][3], r[1][3]), ("0", "0"), "{out}");
        let cell = |c: usize| -> f64 { r[2][c].parse().unwrap_or_else(|_| panic!("{out}")) };
        assert_eq!((cell(2) as usize, cell(3) as usize, cell(4) as usize), (n, n, n), "{out}");
        assert_eq!(r[2][5], "order", "{out}");
        assert!((cell(7) - cell(8)).abs() <= 0.1 + 1e-3 * cell(7), "{out}");
        assert!((cell(8) - busy).abs() <= 0.1 + 1e-3 * busy, "{out}");
    }
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&both).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let drawn = events.iter().filter(|e| e["ph"] == "X" && e["cat"] == "real" && e["tid"] == 0).count();
    assert_eq!(drawn, 2 * n, "{t}");
    assert!(
        events.iter().any(|e| e["pid"] == 1000 && e["tid"] == 0 && e["args"]["name"] == "compute"),
        "{t}"
    );
}
