//! The flight recorder end to end: ranks of a local world that disagree on a collective, or
//! one that never launches what its peers did, write their records on the failure
//! (`FlightConfig::dir`), and `collsched flight DIR` says what went wrong in its first line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use collsched::backend::flight::verdict::{analyze, Finding};
use collsched::backend::flight::FlightConfig;
use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::ElemType;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("collsched-flight-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn world(n: usize, dir: &Path, timeout: Duration) -> LocalWorld {
    let flight = FlightConfig { entries: 64, dir: Some(dir.to_path_buf()) };
    LocalWorld::with_config(n, LocalConfig { timeout, flight, ..LocalConfig::default() }).expect("world")
}

/// An all-gather (tag 1) of 8 f32 a member on `stream`; its outcome.
fn gather(rank: &LocalRank, tag: u64) -> Result<(), String> {
    let n = rank.world_size();
    let desc = CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 8).with_tag(tag);
    let c = Collective {
        desc,
        input: Some(rank.alloc(32).expect("alloc")),
        output: rank.alloc(32 * n).expect("alloc"),
    };
    let f = rank.launch(Stream::AllGather, &[], c).map_err(|e| e.error.to_string())?;
    f.wait(Duration::from_secs(30)).map(drop).map_err(|e| e.into_error().to_string())
}

fn cli_verdict(dir: &Path) -> String {
    let out =
        Command::new(env!("CARGO_BIN_EXE_collsched")).arg("flight").arg(dir).output().expect("run collsched");
    assert!(out.status.success(), "collsched flight failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(text.contains("rank 0 (pid"), "no per-rank summary: {text}");
    text.lines().next().expect("a verdict line").to_string()
}

/// `collsched flight DIR --quiet --trace-out DIR/trace.json`, read back.
fn cli_trace(dir: &Path) -> serde_json::Value {
    let file = dir.join("trace.json");
    let run = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .arg("flight")
        .arg(dir)
        .arg("--quiet")
        .arg("--trace-out")
        .arg(&file)
        .output()
        .expect("run collsched flight");
    assert!(run.status.success(), "collsched flight failed: {}", String::from_utf8_lossy(&run.stderr));
    serde_json::from_str(&std::fs::read_to_string(&file).expect("trace written")).expect("JSON")
}

#[test]
fn a_collective_the_ranks_disagree_on_is_named_with_what_each_launched() {
    let dir = scratch("mismatch");
    let w = world(3, &dir, Duration::from_secs(20));
    let out = w
        .run(|rank| {
            gather(&rank, 1)?;
            if rank.rank() == 1 {
                // Rank 1 reduce-scatters where the others all-gather.
                let desc = CollDesc::reduce_scatter(RankGroup::world(3), ElemType::F32, 8).with_tag(2);
                let c = Collective {
                    desc,
                    input: Some(rank.alloc(96).expect("alloc")),
                    output: rank.alloc(32).expect("alloc"),
                };
                let f = rank.launch(Stream::AllGather, &[], c).map_err(|e| e.error.to_string())?;
                return f.wait(Duration::from_secs(30)).map(drop).map_err(|e| e.into_error().to_string());
            }
            gather(&rank, 2)
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        let e = o.expect("no panic").expect_err("a mismatched collective failed");
        assert!(e.contains("mismatched"), "rank {r}: {e}");
    }
    let dumps = collsched::cli::flight::read_dir(&dir).expect("three records");
    assert_eq!(dumps.len(), 3);
    let v = analyze(&dumps);
    match &v.finding {
        Finding::Disagree { seq, group, stream, launched } => {
            assert_eq!((*seq, group.as_slice(), stream.as_str()), (1, &[0, 1, 2][..], "all_gather"), "{v}");
            let ops: Vec<(usize, bool)> =
                launched.iter().map(|(r, w)| (*r, w.starts_with("reduce_scatter"))).collect();
            assert_eq!(ops, [(0, false), (1, true), (2, false)], "{v}");
        }
        other => panic!("expected a disagreement, got {other:?}"),
    }
    let line = cli_verdict(&dir);
    assert!(
        line.starts_with("ranks disagree at collective #1 of group [0, 1, 2] on stream all_gather"),
        "{line}"
    );
    assert!(line.contains("rank 1 reduce_scatter(tag 2, 8 x f32, sum)"), "{line}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_never_launches_a_collective_is_named() {
    let dir = scratch("missing");
    let w = world(3, &dir, Duration::from_millis(500));
    let out = w
        .run(|rank| {
            gather(&rank, 1)?;
            gather(&rank, 2)?;
            if rank.rank() == 2 {
                // Rank 2 stops after two (its peers launch a third and wait for it in vain) and
                // writes its record on request, as an engine would on a timeout of its own.
                rank.flight_record("stopped early").write_to(&dir).map_err(|e| e.to_string())?;
                return Ok(());
            }
            gather(&rank, 3)
        })
        .expect("ranks");
    let out: Vec<_> = out.into_iter().map(|o| o.expect("no panic")).collect();
    assert!(out[2].is_ok(), "{:?}", out[2]);
    for r in [0, 1] {
        let e = out[r].as_ref().expect_err("waited for a rank that never came");
        assert!(e.contains("[2]"), "rank {r}: {e}");
    }
    let dumps = collsched::cli::flight::read_dir(&dir).expect("three records");
    let v = analyze(&dumps);
    match &v.finding {
        Finding::NeverLaunched { seq, missing, launched_by, what, .. } => {
            assert_eq!(*seq, 2, "{v}");
            assert_eq!(missing.as_slice(), &[(2, Some(1))], "{v}");
            assert_eq!(launched_by.as_slice(), &[0, 1], "{v}");
            assert!(what.starts_with("all_gather(tag 3, 8 x f32)"), "{v}");
        }
        other => panic!("expected a collective never launched, got {other:?}"),
    }
    let line = cli_verdict(&dir);
    assert!(
        line.starts_with("ranks [2] never launched collective #2 of group [0, 1, 2] on stream all_gather"),
        "{line}"
    );
    assert!(line.contains("rank 2 last launched #1"), "{line}");
    // Without rank 2's record (a rank killed before it could write one): named as such.
    std::fs::remove_file(dir.join("rank-2.json")).expect("remove");
    let line = cli_verdict(&dir);
    assert!(line.ends_with("no record from ranks [2] (dead before writing one, or never started)"), "{line}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_without_records_is_an_error_naming_it() {
    let dir = scratch("empty");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("rank-0.json"), "{ not json").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_collsched")).arg("flight").arg(&dir).output().expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank-0.json: not a collsched flight record"), "{err}");
    std::fs::remove_file(dir.join("rank-0.json")).expect("remove");
    let out = Command::new(env!("CARGO_BIN_EXE_collsched")).arg("flight").arg(&dir).output().expect("run");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no flight records"), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_real_runs_collectives_become_a_chrome_trace_on_the_simulators_tracks() {
    let dir = scratch("trace");
    let w = world(2, &dir, Duration::from_secs(30));
    let out = w
        .run(|rank| {
            for tag in 1..=3 {
                gather(&rank, tag)?;
            }
            rank.flight_record("requested").write_to(&dir).map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        o.expect("no panic").unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let trace = cli_trace(&dir);
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let spans: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    // Three all-gathers a rank, each on the simulator's all-gather track of its rank.
    assert_eq!(spans.len(), 6, "{spans:?}");
    for rank in 0..2u64 {
        let mine: Vec<_> = spans.iter().filter(|e| e["pid"] == rank).collect();
        assert_eq!(mine.len(), 3, "rank {rank}: {mine:?}");
        let mut last_end = -1.0;
        for (k, e) in mine.iter().enumerate() {
            assert_eq!(e["tid"], 1, "{e}");
            assert_eq!(e["name"], format!("all_gather bucket {}", k + 1), "{e}");
            assert_eq!(e["args"]["seq"], k as u64, "{e}");
            let (ts, dur) = (e["ts"].as_f64().expect("ts"), e["dur"].as_f64().expect("dur"));
            assert!(ts.is_finite() && dur.is_finite() && ts >= 0.0 && dur >= 0.0, "{e}");
            // One stream runs its collectives in order.
            assert!(ts >= last_end, "rank {rank}: collective {k} starts at {ts} before {last_end}");
            last_end = ts + dur;
        }
        let named =
            events.iter().any(|e| e["ph"] == "M" && e["pid"] == rank && e["args"]["name"] == "all-gather");
        assert!(named, "rank {rank}: no all-gather track name");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `collsched demo --flight-out DIR`: every rank's record of a successful run, which `collsched
/// flight` reads back (no finding) and draws, one all-gather track and one reduce-scatter
/// track a rank, each with what the demo printed it launched at the least, and a compute track
/// with each layer's forward and backward once a micro-batch, a layer's backward after its
/// forward, forwards in layer order and backwards in reverse.
#[test]
fn the_demo_writes_every_ranks_flight_record_on_request() {
    let dir = scratch("demo");
    let (steps, micro, layers) = (2usize, 2usize, 6usize);
    let run = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args([
            "demo",
            "--ranks",
            "3",
            "--steps",
            "2",
            "--micro-batches",
            "2",
            "--eval-every",
            "0",
            "--no-freeze",
        ])
        .arg("--flight-out")
        .arg(&dir)
        .output()
        .expect("run collsched demo");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for r in 0..3 {
        assert!(dir.join(format!("rank-{r}.json")).is_file(), "rank {r}'s record");
    }
    assert!(cli_verdict(&dir).contains("no disagreement"), "{}", cli_verdict(&dir));
    let trace = cli_trace(&dir);
    let spans: Vec<_> =
        trace["traceEvents"].as_array().expect("events").iter().filter(|e| e["ph"] == "X").collect();
    // The demo's table: per step "ag" and "rs" columns of rank 0 (all ranks issue the same).
    let text = String::from_utf8_lossy(&run.stdout);
    let (mut ag, mut rs) = (0u64, 0u64);
    for row in text.lines().filter(|l| l.split_whitespace().count() == 15) {
        let c: Vec<&str> = row.split_whitespace().collect();
        if let (Ok(a), Ok(s)) = (c[6].parse::<u64>(), c[7].parse::<u64>()) {
            ag += a;
            rs += s;
        }
    }
    assert!(ag > 0 && rs > 0, "no collectives in the demo's table:\n{text}");
    for rank in 0..3u64 {
        let on = |tid: u64| spans.iter().filter(|e| e["pid"] == rank && e["tid"] == tid).count() as u64;
        assert!(
            on(1) >= ag && on(2) >= rs,
            "rank {rank}: {} all-gathers, {} reduce-scatters; the table: {ag}, {rs}",
            on(1),
            on(2)
        );
        // The compute track (where collectives of other streams, the plan's agreement, are
        // drawn too): per micro-batch "forward 0" .. "forward 5", then "backward 5" ..
        // "backward 0", each span after the one before it.
        let compute: Vec<_> = spans
            .iter()
            .filter(|e| {
                e["pid"] == rank && e["tid"] == 0 && (e["cat"] == "forward" || e["cat"] == "backward")
            })
            .collect();
        let mut want = Vec::new();
        for _ in 0..steps * micro {
            want.extend((0..layers).map(|l| format!("forward {l}")));
            want.extend((0..layers).rev().map(|l| format!("backward {l}")));
        }
        let names: Vec<&str> = compute.iter().map(|e| e["name"].as_str().expect("a name")).collect();
        assert_eq!(names, want, "rank {rank}'s compute track");
        for e in &compute {
            let cat = e["cat"].as_str().expect("a category");
            assert!(e["name"].as_str().is_some_and(|n| n.starts_with(cat)), "{e}");
            assert!(e["dur"].as_f64().is_some_and(|d| d.is_finite() && d >= 0.0), "{e}");
        }
        let ends = compute.windows(2).all(|w| {
            let end = w[0]["ts"].as_f64().unwrap() + w[0]["dur"].as_f64().unwrap();
            w[1]["ts"].as_f64().unwrap() >= end - 1e-3
        });
        assert!(ends, "rank {rank}: a compute span begins before the one before it ends");
        // On the collectives' clock: the first forward after the first gather began, the last
        // backward before the last collective ended.
        let rank_spans = || spans.iter().filter(|e| e["pid"] == rank && e["tid"] != 0);
        let first = rank_spans().map(|e| e["ts"].as_f64().unwrap()).fold(f64::INFINITY, f64::min);
        let last =
            rank_spans().map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()).fold(0.0, f64::max);
        let c0 = compute[0]["ts"].as_f64().unwrap();
        let c1 = compute[compute.len() - 1]["ts"].as_f64().unwrap();
        assert!(
            first <= c0 && c1 <= last,
            "rank {rank}: compute {c0}..{c1} us, collectives {first}..{last} us"
        );
        for (i, e) in compute.iter().enumerate() {
            assert_eq!(e["args"]["step"], i / (micro * 2 * layers) + 1, "{e}");
        }
        // Every collective is the rank's training engine's (one number; the ranks are threads
        // of one process here, each engine numbered in it), each with the engine's step: a
        // micro-batch ends one (1-based: passes 1 to 4 here, then the final gathers of the full
        // values, 5); reductions in the synchronized ones alone (2 and 4); a step's collectives
        // all end before the next step's begin.
        let collectives: Vec<_> = rank_spans().collect();
        let engine = &collectives[0]["args"]["engine"];
        assert!(engine.as_u64().is_some_and(|n| n >= 1), "{}", collectives[0]);
        for e in &collectives {
            assert_eq!(&e["args"]["engine"], engine, "{e}");
        }
        let in_step = |s: usize| collectives.iter().filter(move |e| e["args"]["step"] == s);
        let passes = steps * micro + 1;
        for s in 1..=passes {
            let reduced = in_step(s).filter(|e| e["tid"] == 2).count();
            assert!(in_step(s).count() > reduced, "rank {rank}: no gather in step {s}");
            assert_eq!(
                reduced > 0,
                s < passes && s % micro == 0,
                "rank {rank} step {s}: {reduced} reductions"
            );
        }
        assert_eq!((1..=passes).map(|s| in_step(s).count()).sum::<usize>(), collectives.len(), "rank {rank}");
        for s in 1..passes {
            let end = in_step(s)
                .map(|e| e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap())
                .fold(0.0, f64::max);
            let next = in_step(s + 1).map(|e| e["ts"].as_f64().unwrap()).fold(f64::INFINITY, f64::min);
            assert!(
                end <= next + 1e-3,
                "rank {rank}: step {s} ends at {end} us, step {} begins at {next}",
                s + 1
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
