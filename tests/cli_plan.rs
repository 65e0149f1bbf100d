//! `collsched plan` as scripts see it: the built binary, its JSON, its table, its errors.
//!
//! The golden file `tests/data/params/small.hybrid2.plan.json` is the plan JSON of
//! `tests/data/params/small.json` at `--world 4 --strategy hybrid:2 --bucket-mb 0.0005
//! --align 16`. The format is a contract: if a change to it is intended, regenerate with
//! `COLLSCHED_BLESS=1 cargo test --test cli_plan golden`, review the diff, and run the test
//! again without `COLLSCHED_BLESS` (a blessing run writes the file and fails: a file compared
//! with itself proves nothing).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_collsched");

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/params").join(name)
}

fn plan(args: &[&str]) -> Output {
    Command::new(BIN).arg("plan").args(args).output().expect("run collsched")
}

fn json_of(args: &[&str]) -> Value {
    let out = plan(&[args, &["--json"]].concat());
    assert!(out.status.success(), "collsched plan {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim_end().lines().count(), 1, "one JSON object on one line");
    serde_json::from_str(&text).expect("valid JSON")
}

fn small() -> String {
    data("small.json").display().to_string()
}

#[test]
fn golden_small_plan() {
    let args = [
        "--params",
        &small(),
        "--world",
        "4",
        "--strategy",
        "hybrid:2",
        "--bucket-mb",
        "0.0005",
        "--align",
        "16",
    ];
    let got = json_of(&args);
    let golden = data("small.hybrid2.plan.json");
    if std::env::var_os("COLLSCHED_BLESS").is_some() {
        std::fs::write(&golden, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
        panic!(
            "COLLSCHED_BLESS: golden rewritten: {}; review its diff, then rerun without COLLSCHED_BLESS",
            golden.display()
        );
    }
    let want: Value = serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    assert_eq!(got, want, "plan JSON differs from {}; see this file's docs to regenerate", golden.display());
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

/// Checks a plan JSON against the contract, from the JSON alone.
fn check_contract(v: &Value, world: u64, group: u64, align: u64) {
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    for k in ["world", "strategy", "fingerprint", "params", "buckets", "ops"] {
        assert!(keys.contains(&k), "missing `{k}`");
    }
    assert_eq!(u(&v["world"]), world);
    let fp = v["fingerprint"].as_str().unwrap();
    assert!(fp.len() == 16 && fp.chars().all(|c| c.is_ascii_hexdigit()), "{fp}");
    let mut numel = HashMap::new();
    let mut trainable = HashMap::new();
    let mut size = HashMap::new();
    for p in v["params"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_string();
        numel.insert(name.clone(), u(&p["numel"]));
        trainable.insert(name.clone(), p["trainable"].as_bool().unwrap());
        let bytes = match p["dtype"].as_str().unwrap() {
            "f64" => 8,
            "f32" => 4,
            "f16" | "bf16" => 2,
            "u8" | "i8" => 1,
            d => panic!("dtype {d}"),
        };
        size.insert(name, bytes);
    }
    let mut gathered_once = HashMap::<String, u64>::new();
    let mut kinds = HashMap::new();
    for b in v["buckets"].as_array().unwrap() {
        let id = u(&b["id"]);
        let kind = b["kind"].as_str().unwrap();
        kinds.insert(id, kind.to_string());
        let shard_numel = u(&b["shard_numel"]);
        let names: Vec<&str> = b["params"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let elem = size[names[0]];
        assert_eq!(shard_numel * elem % align, 0, "bucket {id}: shard bytes aligned");
        if kind == "grad" {
            assert!(names.iter().all(|n| trainable[*n]), "bucket {id}: frozen parameter in a grad bucket");
        }
        let shards = b["shards"].as_array().unwrap();
        assert_eq!(shards.len() as u64, world, "bucket {id}: one shard per rank");
        // Per shard group: every element of every parameter exactly once.
        for g in 0..world / group {
            let mut runs: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
            for r in g * group..(g + 1) * group {
                let shard = &shards[r as usize];
                assert_eq!(u(&shard["rank"]), r);
                let mut end = 0;
                for s in shard["segments"].as_array().unwrap() {
                    let (off, n, at) = (u(&s["param_offset"]), u(&s["numel"]), u(&s["shard_offset"]));
                    assert!(at >= end && at + n <= shard_numel, "bucket {id} rank {r}: segment out of place");
                    assert_eq!(at * elem % align, 0, "bucket {id} rank {r}: unaligned segment");
                    end = at + n;
                    runs.entry(s["param"].as_str().unwrap()).or_default().push((off, n));
                }
            }
            assert_eq!(runs.len(), names.len(), "bucket {id} group {g}: parameters covered");
            for (name, mut rs) in runs {
                rs.sort_unstable();
                let mut at = 0;
                for (off, n) in rs {
                    assert_eq!(off, at, "bucket {id}: `{name}` has a gap or overlap");
                    at += n;
                }
                assert_eq!(at, numel[name], "bucket {id}: `{name}` not fully covered");
                if kind == "gather" {
                    *gathered_once.entry(name.to_string()).or_default() += 1;
                }
            }
        }
    }
    for (name, n) in &gathered_once {
        assert_eq!(*n, world / group, "`{name}` in one gather bucket, once per group");
    }
    assert_eq!(gathered_once.len(), numel.len(), "every parameter gathered");
    for op in v["ops"].as_array().unwrap() {
        let kind = op["kind"].as_str().unwrap();
        let bucket = u(&op["bucket"]);
        let ranks: Vec<u64> = op["group"].as_array().unwrap().iter().map(u).collect();
        assert!(ranks.iter().all(|&r| r < world) && !ranks.is_empty());
        assert!(u(&op["bytes_per_rank"]) > 0);
        match kind {
            "all_gather" | "broadcast" => assert_eq!(kinds[&bucket], "gather"),
            "reduce_scatter" | "all_reduce" => assert_eq!(kinds[&bucket], "grad"),
            k => panic!("op kind {k}"),
        }
    }
}

#[test]
fn json_follows_the_contract_for_every_strategy() {
    for (strategy, world, group) in [
        ("even", 4, 4),
        ("flat", 3, 3),
        ("greedy", 5, 5),
        ("hybrid:2", 6, 2),
        ("hybrid:1", 2, 1),
        ("even", 1, 1),
    ] {
        for align in ["16", "256"] {
            let w = world.to_string();
            let args = [
                "--params",
                &small(),
                "--world",
                &w,
                "--strategy",
                strategy,
                "--bucket-mb",
                "0.0005",
                "--align",
                align,
            ];
            let v = json_of(&args);
            assert_eq!(v["strategy"], strategy);
            check_contract(&v, world, group, align.parse().unwrap());
        }
    }
}

#[test]
fn fingerprint_matches_the_library_and_is_stable() {
    let args = ["--params", &small(), "--world", "8", "--strategy", "flat"];
    let a = json_of(&args);
    let b = json_of(&args);
    assert_eq!(a["fingerprint"], b["fingerprint"], "same inputs, same fingerprint across processes");
    let text = std::fs::read_to_string(data("small.json")).unwrap();
    let set = collsched::buckets::ParamSet::from_json(&text).unwrap();
    let layout =
        collsched::buckets::LayoutBuilder::new(&set, collsched::buckets::Sharding::Flat, 8).build().unwrap();
    let fp = collsched::schedule::Plan::new(layout).fingerprint().to_string();
    assert_eq!(a["fingerprint"], fp.as_str());
    let other = json_of(&["--params", &small(), "--world", "8", "--strategy", "even"]);
    assert_ne!(a["fingerprint"], other["fingerprint"]);
}

#[test]
fn hybrid_ops_are_listed_once_per_group() {
    let v = json_of(&["--params", &small(), "--world", "6", "--strategy", "hybrid:2"]);
    let grad = v["buckets"].as_array().unwrap().iter().find(|b| b["kind"] == "grad").unwrap();
    let id = &grad["id"];
    let groups = |kind: &str| -> Vec<Vec<u64>> {
        v["ops"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["kind"] == kind && &o["bucket"] == id)
            .map(|o| o["group"].as_array().unwrap().iter().map(u).collect())
            .collect()
    };
    let blocks: Vec<Vec<u64>> = (0..3).map(|g| vec![2 * g, 2 * g + 1]).collect();
    let strided: Vec<Vec<u64>> = (0..2).map(|i| vec![i, i + 2, i + 4]).collect();
    assert_eq!(groups("reduce_scatter"), blocks);
    assert_eq!(groups("all_reduce"), strided);
}

#[test]
fn table_summarizes() {
    let out = plan(&["--params", &small(), "--world", "4", "--bucket-mb", "0.0005"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let fp = json_of(&["--params", &small(), "--world", "4", "--bucket-mb", "0.0005"])["fingerprint"].clone();
    assert!(text.contains(&format!("fingerprint {}", fp.as_str().unwrap())), "{text}");
    assert!(text.contains("padding overhead"), "{text}");
    assert!(text.contains("all_gather") && text.contains("reduce_scatter"), "{text}");
}

/// Writes a parameter file into the test's scratch directory.
fn scratch(name: &str, text: &str) -> String {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli_plan-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// Runs a bad invocation: non-zero exit, one line on stderr mentioning every `needle`.
fn rejects(args: &[&str], needles: &[&str]) {
    let out = plan(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line, got {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` not in {err}");
    }
}

#[test]
fn bad_parameter_files() {
    let zero = scratch("zero.json", r#"{"params": [{"name": "mlp.w", "shape": [8, 0], "dtype": "f32"}]}"#);
    rejects(&["--params", &zero, "--world", "2"], &["mlp.w", "zero"]);
    let dup = scratch(
        "dup.json",
        r#"{"params": [{"name": "w", "shape": [8], "dtype": "f32"}, {"name": "w", "shape": [8], "dtype": "f32"}]}"#,
    );
    rejects(&["--params", &dup, "--world", "2"], &["duplicate", "`w`"]);
    let dtype = scratch("dtype.json", r#"{"params": [{"name": "emb", "shape": [8], "dtype": "fp4"}]}"#);
    rejects(&["--params", &dtype, "--world", "2"], &["emb", "fp4"]);
    let broken = scratch("broken.json", "{\"params\": [\n  {\"name\": \"a\",, }\n]}");
    rejects(&["--params", &broken, "--world", "2"], &["line 2", "column"]);
    rejects(&["--params", "/nonexistent/params.json", "--world", "2"], &["/nonexistent/params.json"]);
}

#[test]
fn bad_flags() {
    let s = small();
    rejects(&["--params", &s, "--world", "0"], &["world size is 0"]);
    rejects(
        &["--params", &s, "--world", "8", "--strategy", "hybrid:3"],
        &["hybrid group size 3", "world size 8"],
    );
    rejects(&["--params", &s, "--world", "8", "--bucket-mb", "0"], &["bucket size is 0"]);
    rejects(&["--params", &s, "--world", "8", "--bucket-mb=-1"], &["--bucket-mb"]);
    rejects(&["--params", &s, "--world", "8", "--align", "48"], &["alignment 48", "power of two"]);
    // small.json holds f64 and f32 parameters: 4 bytes is not a multiple of 8.
    rejects(&["--params", &s, "--world", "8", "--align", "4"], &["alignment 4", "f64", "head.scale"]);
}

#[test]
fn bucket_by_module_splits_at_layers() {
    // small.json at a 64 MiB cap: by size every parameter of a dtype shares one bucket; by
    // module (`embed`, `h.0`, `head`) each dtype's bucket holds one module.
    let s = small();
    let by_size = json_of(&["--params", &s, "--world", "4"]);
    assert!(by_size.get("bucket_by").is_none(), "size (the default) prints no bucket_by");
    let explicit = json_of(&["--params", &s, "--world", "4", "--bucket-by", "size"]);
    assert_eq!(by_size, explicit, "--bucket-by size is the default");
    let by_module = json_of(&["--params", &s, "--world", "4", "--bucket-by", "module"]);
    assert_eq!(by_module["bucket_by"], "module");
    check_contract(&by_module, 4, 4, 256);
    let modules = |v: &Value| -> Vec<Vec<String>> {
        v["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["kind"] == "gather")
            .map(|b| {
                let mut m: Vec<String> = b["params"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p.as_str().unwrap().split('.').take(2).collect::<Vec<_>>().join("."))
                    .map(|m| if m.starts_with("h.") { m } else { m.split('.').next().unwrap().to_string() })
                    .collect();
                m.dedup();
                m
            })
            .collect()
    };
    assert!(modules(&by_size).iter().any(|m| m.len() > 1), "by size some bucket spans modules");
    assert!(modules(&by_module).iter().all(|m| m.len() == 1), "{:?}", modules(&by_module));
    assert!(by_module["buckets"].as_array().unwrap().len() > by_size["buckets"].as_array().unwrap().len());
    assert_ne!(by_module["fingerprint"], by_size["fingerprint"]);
    // The same fingerprint as the library with the same knob.
    let text = std::fs::read_to_string(data("small.json")).unwrap();
    let set = collsched::buckets::ParamSet::from_json(&text).unwrap();
    let layout = collsched::buckets::LayoutBuilder::new(&set, collsched::buckets::Sharding::EvenSplit, 4)
        .boundary(collsched::buckets::Boundary::LAYER)
        .build()
        .unwrap();
    assert_eq!(
        by_module["fingerprint"],
        collsched::schedule::Plan::new(layout).fingerprint().to_string().as_str()
    );
    // Depth and packing parse; the table names the boundary.
    let packed = json_of(&["--params", &s, "--world", "4", "--bucket-by", "module:1+pack"]);
    assert_eq!(packed["bucket_by"], "module:1+pack");
    let out = plan(&["--params", &s, "--world", "4", "--bucket-by", "module:2"]);
    assert!(String::from_utf8(out.stdout).unwrap().contains("bucket boundaries module:2"));
    // A parameter file's "module" field regroups parameters.
    let file = scratch(
        "modules.json",
        r#"{"params": [{"name": "a.w", "shape": [64], "dtype": "f32", "module": "m0"},
                       {"name": "b.w", "shape": [64], "dtype": "f32", "module": "m0"},
                       {"name": "c.w", "shape": [64], "dtype": "f32"}]}"#,
    );
    let v = json_of(&["--params", &file, "--world", "2", "--bucket-by", "module"]);
    let sizes: Vec<usize> = v["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["kind"] == "gather")
        .map(|b| b["params"].as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, [2, 1]);
}

#[test]
fn bad_bucket_boundaries() {
    let s = small();
    for bad in ["modules", "module:0", "module:x", "size+pack"] {
        let out = plan(&["--params", &s, "--world", "2", "--bucket-by", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(bad) && !err.contains("panicked"), "{bad}: {err}");
    }
    let empty = scratch(
        "empty-module.json",
        r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "module": ""}]}"#,
    );
    rejects(&["--params", &empty, "--world", "2"], &["`w`", "empty module"]);
}

/// A reader that stops early (`collsched plan --json | head -c 10`) ends the command quietly:
/// no panic message, killed by SIGPIPE as coreutils are, never exit status 101.
#[test]
fn a_closed_output_pipe_ends_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["plan", "--params", "tests/data/params/small.json", "--world", "4096", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run collsched");
    let mut first = [0u8; 10];
    child.stdout.take().expect("stdout").read_exact(&mut first).expect("ten bytes");
    // Closing our end of the pipe: the next write fails.
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.status.success() || out.status.signal() == Some(13), "{:?}: {stderr}", out.status);
}

/// A positive bucket size below one byte says so (it was reported as "give a positive size").
#[test]
fn a_bucket_below_one_byte_is_named_as_such() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["plan", "--params", "tests/data/params/small.json", "--world", "8", "--bucket-mb", "1e-9"])
        .output()
        .expect("run collsched");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("below one byte"), "{err}");
}

/// A plan JSON of a terabyte is refused, naming --world and the limit, before anything is
/// written (it was written, 9 GB and more).
#[test]
fn a_plan_json_beyond_the_limit_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["plan", "--params", "tests/data/params/small.json", "--world", "4294967295", "--json"])
        .output()
        .expect("run collsched");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{err}");
    assert!(err.contains("--world 4294967295 --json") && err.contains("limit"), "{err}");
}
