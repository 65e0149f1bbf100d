//! Reading the file `collsched demo --record-out FILE.json` writes (its format is the flag's
//! documentation in `src/cli/demo.rs`). Included with `#[path]` by `tests/cli_demo.rs` and
//! `tests/mpi.rs`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use collsched::buckets::Sharding;
use collsched::demo::model::Mlp;
use collsched::demo::{DemoConfig, RunRecord, StepRecord};
use serde_json::Value;

/// What a record file holds.
pub struct Record {
    /// The demo's settings.
    pub config: DemoConfig,
    /// `--strategy`.
    pub strategy: Sharding,
    /// `--backend` (`local`, `shm`, `mpi`, `cuda`).
    pub backend: String,
    /// The sharded run's losses and final parameters.
    pub run: RunRecord,
}

/// A path for a record file in the temporary directory, unique to this process and `name`.
pub fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("collsched-record-{}-{name}.json", std::process::id()))
}

/// An f32 written as the f64 of that f32: rounding to f32 gives it back bit for bit, whatever
/// the last bits of the JSON reader's f64.
fn f32_of(v: &Value, what: &str) -> f32 {
    v.as_f64().unwrap_or_else(|| panic!("{what}: expected a number, found {v}")) as f32
}

fn usize_of(v: &Value, what: &str) -> usize {
    v.as_u64().unwrap_or_else(|| panic!("{what}: expected a whole number, found {v}")) as usize
}

/// Reads and removes the record file at `path`.
///
/// # Panics
/// When the file is missing or not a record of format version 1.
pub fn take(path: &Path) -> Record {
    let record = read(path);
    let _ = std::fs::remove_file(path);
    record
}

/// Reads the record file at `path`.
///
/// # Panics
/// When the file is missing or not a record of format version 1.
pub fn read(path: &Path) -> Record {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(json["format"], "collsched-demo-record", "{}", path.display());
    assert_eq!(json["version"], 1, "{}", path.display());
    let c = &json["config"];
    let list = |v: &Value, what: &str| -> Vec<Value> {
        v.as_array().unwrap_or_else(|| panic!("{what}: expected a list, found {v}")).clone()
    };
    let freeze = (!c["freeze"].is_null()).then(|| {
        let f = list(&c["freeze"], "config.freeze");
        assert_eq!(f.len(), 3, "config.freeze: {f:?}");
        (usize_of(&f[0], "freeze"), usize_of(&f[1], "freeze"), usize_of(&f[2], "freeze"))
    });
    let config = DemoConfig {
        model: Mlp {
            dims: list(&c["dims"], "config.dims").iter().map(|d| usize_of(d, "config.dims")).collect(),
        },
        world: usize_of(&c["world"], "config.world"),
        steps: usize_of(&c["steps"], "config.steps"),
        micro_batches: usize_of(&c["micro_batches"], "config.micro_batches"),
        batch: usize_of(&c["batch"], "config.batch"),
        lr: f32_of(&c["lr"], "config.lr"),
        seed: c["seed"].as_u64().unwrap_or_else(|| panic!("config.seed: {}", c["seed"])),
        freeze,
        eval_every: usize_of(&c["eval_every"], "config.eval_every"),
    };
    let strategy: Sharding = c["strategy"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("config.strategy: {}", c["strategy"]));
    let backend =
        c["backend"].as_str().unwrap_or_else(|| panic!("config.backend: {}", c["backend"])).to_owned();
    let steps = list(&json["steps"], "steps")
        .iter()
        .enumerate()
        .map(|(s, v)| StepRecord {
            loss: f32_of(&v["loss"], &format!("steps[{s}].loss")),
            eval_loss: (!v["eval_loss"].is_null())
                .then(|| f32_of(&v["eval_loss"], &format!("steps[{s}].eval_loss"))),
        })
        .collect();
    let params = list(&json["params"], "params")
        .iter()
        .enumerate()
        .map(|(k, p)| {
            list(&p["values"], &format!("params[{k}].values"))
                .iter()
                .map(|v| f32_of(v, &format!("params[{k}]")))
                .collect()
        })
        .collect();
    Record { config, strategy, backend, run: RunRecord { steps, params } }
}
