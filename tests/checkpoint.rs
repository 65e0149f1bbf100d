//! Checkpoints: saved at one layout, loaded into others; refused when they do not fit, are
//! incomplete or damaged; a save some rank never enters fails on the others, naming it.
//! Expected values are computed here from the parameters' definitions, not read back through
//! the library.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::Backend;
use collsched::buckets::{Boundary, DType, ParamId, Sharding};
use collsched::checkpoint::{self, CheckpointError};
use collsched::schedule::{plan_from_json, Plan, SchedulerConfig};
use collsched::ModelState;

const PARAMS: &str = r#"{"params": [
    {"name": "emb", "shape": [37, 24], "dtype": "f32"},
    {"name": "w1", "shape": [24, 13], "dtype": "bf16"},
    {"name": "b1", "shape": [13], "dtype": "f32"},
    {"name": "w2", "shape": [13, 7], "dtype": "f32", "trainable": false},
    {"name": "b2", "shape": [7], "dtype": "f16"}
]}"#;

fn plan(json: &str, strategy: &str, world: u32, bucket: usize) -> Plan {
    let s: Sharding = strategy.parse().expect("strategy");
    plan_from_json(json, s, world, bucket, 256, Boundary::Size).expect("plan")
}

/// Element `i` of parameter `k`, version `v`: distinct, exact in bf16 and f16.
fn value(k: usize, i: usize, v: u32) -> f32 {
    (((k * 131 + i * 7) % 97) as f32 - 48.0) / 4.0 + v as f32
}

fn encode(dtype: DType, xs: impl Iterator<Item = f32>) -> Vec<u8> {
    match dtype {
        DType::F32 => xs.flat_map(f32::to_le_bytes).collect(),
        DType::BF16 => xs.flat_map(|x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        DType::F16 => xs.flat_map(|x| half::f16::from_f32(x).to_le_bytes()).collect(),
        other => panic!("no test values for {other}"),
    }
}

/// Every parameter's full value, version `v`, by id.
fn full(plan: &Plan, v: u32) -> Vec<Vec<u8>> {
    let set = plan.layout().params();
    set.ids()
        .map(|p| encode(set.specs()[p.index()].dtype, (0..set.numel(p)).map(|i| value(p.index(), i, v))))
        .collect()
}

/// Runs `f` on every rank of a model state built with `plan` and values `v`.
fn on_ranks<T: Send>(
    plan: &Plan,
    v: u32,
    timeout: Duration,
    f: impl Fn(&ModelState<LocalRank>) -> T + Sync,
) -> Vec<T> {
    on_ranks_of(plan, v, timeout, |rank| rank, f)
}

/// [`on_ranks`] over the backend `wrap` makes of each local rank.
fn on_ranks_of<B: Backend, T: Send>(
    plan: &Plan,
    v: u32,
    timeout: Duration,
    wrap: impl Fn(LocalRank) -> B + Sync,
    f: impl Fn(&ModelState<B>) -> T + Sync,
) -> Vec<T> {
    let world = plan.layout().world() as usize;
    let config = LocalConfig { timeout, ..LocalConfig::default() };
    let w = LocalWorld::with_config(world, config).expect("world");
    let init = full(plan, v);
    w.run(|rank| {
        let bufs: Vec<&[u8]> = init.iter().map(Vec::as_slice).collect();
        let state = ModelState::new(Arc::new(wrap(rank)), plan, &bufs).expect("model state");
        f(&state)
    })
    .expect("run")
    .into_iter()
    .map(|r| r.expect("rank thread"))
    .collect()
}

/// Every parameter's full value as the model state now gathers it (copied to the host).
fn gathered<B: Backend>(state: &ModelState<B>) -> Vec<Vec<u8>> {
    let mut c = state.coordinator(SchedulerConfig::default()).expect("coordinator");
    let n = state.plan().layout().params().len() as u32;
    let ids: Vec<ParamId> = (0..n).map(ParamId).collect();
    let out = {
        let v = c.fetch(&ids).expect("fetch");
        ids.iter()
            .map(|&p| {
                let mut host = vec![0; v.buffer(p).expect("view").1.len()];
                v.copy_to_host(p, &mut host).expect("view");
                host
            })
            .collect()
    };
    c.release(&ids).expect("release");
    c.end_step().expect("end step");
    out
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("collsched-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Saves version 1 of the model at 4 ranks, even, small buckets.
fn save_v1(dir: &Path) -> checkpoint::Index {
    let saved = plan(PARAMS, "even", 4, 1024);
    let out = on_ranks(&saved, 1, Duration::from_secs(60), |s| checkpoint::save(s, dir, 7));
    let mut indexes: Vec<_> = out.into_iter().map(|r| r.expect("save")).collect();
    let first = indexes.remove(0);
    assert!(indexes.iter().all(|i| *i == first), "ranks returned different indexes");
    first
}

#[test]
fn saved_at_4_even_loads_at_2_greedy_3_flat_4_hybrid_and_other_buckets() {
    let root = tmp("layouts");
    let ckpt = root.join("step7");
    let index = save_v1(&ckpt);
    assert_eq!((index.world, index.strategy.as_str(), index.step), (4, "even", 7));
    assert!(ckpt.join("index.json").is_file() && !root.join("step7.partial").exists());
    for (strategy, world, bucket) in
        [("greedy", 2, 4096), ("flat", 3, 1 << 20), ("hybrid:2", 4, 2048), ("even", 1, 512)]
    {
        let p = plan(PARAMS, strategy, world, bucket);
        let want = full(&p, 1);
        let got = on_ranks(&p, 0, Duration::from_secs(60), |s| {
            let before = gathered(s);
            let index = checkpoint::load(s, &ckpt).expect("load");
            (before, index.step, gathered(s))
        });
        for (r, (before, step, after)) in got.into_iter().enumerate() {
            assert_eq!(step, 7);
            assert_eq!(before, full(&p, 0), "{strategy} rank {r}: the model did not start from version 0");
            assert_eq!(after.len(), want.len());
            for (k, (a, w)) in after.iter().zip(&want).enumerate() {
                assert_eq!(a, w, "{strategy} at {world} ranks, rank {r}: parameter {k} differs after load");
            }
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_second_save_replaces_the_first_and_leaves_nothing_beside_it() {
    let root = tmp("replace");
    let ckpt = root.join("latest");
    save_v1(&ckpt);
    let p = plan(PARAMS, "flat", 2, 4096);
    let out = on_ranks(&p, 2, Duration::from_secs(60), |s| checkpoint::save(s, &ckpt, 8).map(|i| i.step));
    assert!(out.iter().all(|r| matches!(r, Ok(8))));
    assert_eq!(names_in(&root), ["latest"]);
    let index = checkpoint::read_index(&ckpt).expect("index");
    assert_eq!((index.world, index.step), (2, 8));
    let back = on_ranks(&p, 0, Duration::from_secs(60), |s| {
        checkpoint::load(s, &ckpt).expect("load");
        gathered(s)
    });
    assert!(back.iter().all(|g| *g == full(&p, 2)));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_model_that_does_not_fit_is_refused_naming_every_difference_and_nothing_changes() {
    let root = tmp("mismatch");
    let ckpt = root.join("c");
    save_v1(&ckpt);
    let other = PARAMS.replace(r#""name": "b1", "shape": [13]"#, r#""name": "b1", "shape": [14]"#).replace(
        r#"{"name": "b2", "shape": [7], "dtype": "f16"}"#,
        r#"{"name": "bias2", "shape": [7], "dtype": "f16"}"#,
    );
    let p = plan(&other, "even", 2, 4096);
    let got =
        on_ranks(&p, 0, Duration::from_secs(60), |s| (checkpoint::load(s, &ckpt).map(|_| ()), gathered(s)));
    for (r, (res, after)) in got.into_iter().enumerate() {
        let msg = match res {
            Err(e @ CheckpointError::Mismatch { .. }) => e.to_string(),
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        };
        for word in
            ["b1", "[14]", "bias2 is not in the checkpoint", "b2 is not in the model", "nothing was loaded"]
        {
            assert!(msg.contains(word), "rank {r}: {msg:?} lacks {word:?}");
        }
        assert_eq!(after, full(&p, 0), "rank {r}: shards changed although the load was refused");
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn incomplete_and_damaged_checkpoints_are_refused_naming_the_file() {
    let root = tmp("damaged");
    let ckpt = root.join("c");
    save_v1(&ckpt);
    let p = plan(PARAMS, "greedy", 2, 4096);
    // A file cut short: every rank refuses (the one reading it names it, the other names it).
    let victim = ckpt.join("rank-1.safetensors");
    let bytes = std::fs::read(&victim).expect("read");
    std::fs::write(&victim, &bytes[..bytes.len() - 10]).expect("truncate");
    let got =
        on_ranks(&p, 0, Duration::from_secs(60), |s| (checkpoint::load(s, &ckpt).map(|_| ()), gathered(s)));
    let mut named = false;
    for (r, (res, after)) in got.into_iter().enumerate() {
        let msg = res.expect_err("a truncated checkpoint loaded").to_string();
        named |= msg.contains("rank-1.safetensors") && msg.contains("truncated");
        assert!(msg.contains("rank-1.safetensors") || msg.contains("failed"), "rank {r}: {msg}");
        assert_eq!(after, full(&p, 0), "rank {r}: shards changed although the load failed");
    }
    assert!(named, "no rank named the truncated file");
    let inspected = checkpoint::inspect(&ckpt).expect_err("inspect passed a truncated file").to_string();
    assert!(inspected.contains("rank-1.safetensors"), "{inspected}");
    // No index: a save that did not finish.
    std::fs::remove_file(ckpt.join("index.json")).expect("rm index");
    let e = checkpoint::read_index(&ckpt).expect_err("an incomplete checkpoint was read");
    assert!(
        matches!(e, CheckpointError::Incomplete { .. }) && e.to_string().contains("did not finish"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_save_that_only_rank_0_enters_fails_naming_the_others_and_writes_no_index() {
    let root = tmp("alone");
    let ckpt = root.join("c");
    let p = plan(PARAMS, "even", 3, 4096);
    let got = on_ranks(&p, 0, Duration::from_millis(1500), |s| {
        if s.rank() == 0 {
            Some(checkpoint::save(s, &ckpt, 1).map(|_| ()))
        } else {
            // Alive, busy elsewhere (AllenNLP's hang: its own barrier), past the timeout.
            std::thread::sleep(Duration::from_millis(3000));
            None
        }
    });
    let msg = got[0].as_ref().expect("rank 0 result").as_ref().expect_err("rank 0 saved alone").to_string();
    assert!(msg.contains("checkpoint agreement") && msg.contains("[1, 2]"), "{msg}");
    assert!(!ckpt.exists(), "a checkpoint appeared although the save failed");
    assert!(!root.join("c.partial").exists(), "a failed save left its partial directory");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn inspect_reports_the_index_and_the_cli_prints_it() {
    let root = tmp("inspect");
    let ckpt = root.join("c");
    let index = save_v1(&ckpt);
    let (got, sizes) = checkpoint::inspect(&ckpt).expect("inspect");
    assert_eq!(got, index);
    let want: u64 = full(&plan(PARAMS, "even", 1, 4096), 0).iter().map(|b| b.len() as u64).sum();
    assert_eq!(sizes.iter().sum::<u64>(), want, "every element once");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["ckpt", "inspect"])
        .arg(&ckpt)
        .output()
        .expect("run collsched");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    for word in ["world 4", "even", "step 7", "emb", "[37, 24]", "rank-0.safetensors"] {
        assert!(text.contains(word), "{text:?} lacks {word:?}");
    }
    std::fs::remove_file(ckpt.join("index.json")).expect("rm index");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collsched"))
        .args(["ckpt", "inspect"])
        .arg(&ckpt)
        .output()
        .expect("run collsched");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("index.json"));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn per_parameter_states_and_metadata_follow_the_elements_into_another_layout() {
    let root = tmp("states");
    let ckpt = root.join("c");
    let saved = plan(PARAMS, "even", 4, 1024);
    let set = saved.layout().params().clone();
    // State "m": element i of parameter k is value(k, i, 5) in f32, on every rank.
    on_ranks(&saved, 1, Duration::from_secs(60), |s| {
        let extras: Vec<checkpoint::ExtraState> = set
            .ids()
            .map(|p| {
                let (from, len) = s.read_shard(p, |at, b| (at, b.len())).expect("shard");
                let n = len / set.specs()[p.index()].dtype.size();
                let data = encode(DType::F32, (from..from + n).map(|i| value(p.index(), i, 5)));
                checkpoint::ExtraState { name: "m".into(), param: p, dtype: DType::F32, data }
            })
            .collect();
        let meta = serde_json::json!({"lr": 0.5});
        checkpoint::save_with(s, &ckpt, 3, &extras, meta).expect("save")
    });
    let index = checkpoint::read_index(&ckpt).expect("index");
    assert_eq!(index.meta["lr"], 0.5);
    assert_eq!(index.extras.len(), set.len());
    let p = plan(PARAMS, "greedy", 2, 4096);
    let got = on_ranks(&p, 0, Duration::from_secs(60), |s| {
        let wanted: Vec<(ParamId, String)> = s
            .plan()
            .layout()
            .params()
            .ids()
            .flat_map(|q| [(q, "m".to_string()), (q, "none".to_string())])
            .collect();
        let (_, states) = checkpoint::load_with(s, &ckpt, &wanted).expect("load");
        let runs: Vec<(usize, usize)> = s
            .plan()
            .layout()
            .params()
            .ids()
            .map(|q| {
                s.read_shard(q, |at, b| {
                    (at, b.len() / s.plan().layout().params().specs()[q.index()].dtype.size())
                })
                .expect("run")
            })
            .collect();
        (states, runs)
    });
    for (r, (states, runs)) in got.into_iter().enumerate() {
        assert_eq!(states.len(), 2 * runs.len());
        for (k, &(from, n)) in runs.iter().enumerate() {
            let m = &states[2 * k];
            if n == 0 {
                continue;
            }
            let (dtype, bytes) =
                m.as_ref().unwrap_or_else(|| panic!("rank {r}: state m of parameter {k} missing"));
            assert_eq!(*dtype, DType::F32);
            assert_eq!(
                *bytes,
                encode(DType::F32, (from..from + n).map(|i| value(k, i, 5))),
                "rank {r} parameter {k}"
            );
            assert!(states[2 * k + 1].is_none(), "rank {r}: a state never saved was found");
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn save_full_writes_one_safetensors_file_of_the_full_parameters() {
    let root = tmp("full");
    let file = root.join("model.safetensors");
    let p = plan(PARAMS, "flat", 3, 1024);
    let out = on_ranks(&p, 4, Duration::from_secs(60), |s| checkpoint::save_full(s, &file));
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    let bytes = std::fs::read(&file).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let set = p.layout().params();
    let want = full(&p, 4);
    assert_eq!(st.len(), set.len());
    for q in set.ids() {
        let spec = &set.specs()[q.index()];
        let t = st.tensor(&spec.name).expect("tensor");
        assert_eq!(t.shape(), spec.shape.to_vec().as_slice(), "{}", spec.name);
        assert_eq!(t.data(), want[q.index()].as_slice(), "{}", spec.name);
    }
    assert!(!root.join("model.safetensors.tmp").exists());
    std::fs::remove_dir_all(&root).ok();
}

#[path = "support/device.rs"]
mod device;

#[test]
fn shards_on_a_device_backend_are_saved_and_loaded_through_the_host() {
    let root = tmp("device");
    let ckpt = root.join("step3");
    let saved = plan(PARAMS, "even", 3, 1024);
    let wrap = device::OnDevice;
    let out = on_ranks_of(&saved, 2, Duration::from_secs(60), wrap, |s| checkpoint::save(s, &ckpt, 3));
    assert!(out.into_iter().all(|r| r.is_ok()), "save from a device backend failed");
    let p = plan(PARAMS, "flat", 2, 2048);
    let got = on_ranks_of(&p, 0, Duration::from_secs(60), wrap, |s| {
        let region = s.shard_region(ParamId(0)).expect("shard region");
        assert_eq!(region.device, Some(0), "a device backend's shard is not on its device");
        checkpoint::load(s, &ckpt).expect("load into a device backend");
        gathered(s)
    });
    let want = full(&p, 2);
    for (r, after) in got.into_iter().enumerate() {
        assert_eq!(after.len(), want.len(), "rank {r}: parameter count");
        for (k, (a, w)) in after.iter().zip(&want).enumerate() {
            assert_eq!(a, w, "rank {r}: parameter {k} differs after a save and load on a device backend");
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into())
        .collect();
    names.sort();
    names
}

#[test]
fn a_save_onto_a_directory_of_other_files_is_refused_and_leaves_it_as_it_was() {
    let root = tmp("not-a-checkpoint");
    let outputs = root.join("outputs");
    std::fs::create_dir_all(&outputs).expect("mkdir");
    std::fs::write(outputs.join("train.log"), b"step 1\n").expect("log");
    let p = plan(PARAMS, "even", 2, 4096);
    let got = on_ranks(&p, 1, Duration::from_secs(60), |s| checkpoint::save(s, &outputs, 1).map(|_| ()));
    for (r, res) in got.into_iter().enumerate() {
        let msg = res.expect_err("a save replaced a directory of other files").to_string();
        assert!(msg.contains("not a checkpoint") || msg.contains("[0]"), "rank {r}: {msg}");
    }
    assert_eq!(names_in(&root), ["outputs"], "the save left something beside it");
    assert_eq!(names_in(&outputs), ["train.log"]);
    assert_eq!(std::fs::read(outputs.join("train.log")).expect("log"), b"step 1\n");
    // A plain file is refused too; an empty directory is taken.
    let file = root.join("a-file");
    std::fs::write(&file, b"x").expect("file");
    let got = on_ranks(&p, 1, Duration::from_secs(60), |s| checkpoint::save(s, &file, 1).map(|_| ()));
    assert!(got.iter().all(Result::is_err), "a save replaced a plain file");
    assert_eq!(std::fs::read(&file).expect("file"), b"x");
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let got = on_ranks(&p, 1, Duration::from_secs(60), |s| checkpoint::save(s, &empty, 3).map(|i| i.step));
    assert!(got.iter().all(|r| matches!(r, Ok(3))), "{got:?}");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_commit_interrupted_between_its_renames_is_read_by_loads_and_finished_by_the_next_save() {
    let root = tmp("interrupted");
    let ckpt = root.join("c");
    save_v1(&ckpt);
    // As a commit that stopped after moving the previous checkpoint aside: the whole new one
    // is at c.partial, the previous at c.previous, nothing at c.
    std::fs::rename(&ckpt, root.join("c.partial")).expect("rename");
    std::fs::create_dir_all(root.join("c.previous")).expect("previous");
    std::fs::write(root.join("c.previous/index.json"), b"{}").expect("previous index");
    let p = plan(PARAMS, "flat", 3, 2048);
    let got = on_ranks(&p, 0, Duration::from_secs(60), |s| {
        checkpoint::load(s, &ckpt).expect("load");
        gathered(s)
    });
    assert!(got.iter().all(|g| *g == full(&p, 1)), "the whole commit did not load version 1");
    // Readers rename nothing (another job's save may be committing); inspect reads it too.
    assert_eq!(names_in(&root), ["c.partial", "c.previous"]);
    assert_eq!(checkpoint::inspect(&ckpt).expect("inspect").0.step, 7);
    // The next save finishes that commit, then replaces it.
    let out = on_ranks(&p, 2, Duration::from_secs(60), |s| checkpoint::save(s, &ckpt, 9).map(|i| i.step));
    assert!(out.iter().all(|r| matches!(r, Ok(9))), "{out:?}");
    assert_eq!(names_in(&root), ["c"]);
    assert_eq!(checkpoint::read_index(&ckpt).expect("index").step, 9);
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn states_given_twice_or_in_two_dtypes_are_refused_and_nothing_is_left_on_disk() {
    let root = tmp("bad-states");
    let ckpt = root.join("c");
    let p = plan(PARAMS, "even", 2, 4096);
    let emb = ParamId(0);
    let state_of = |s: &ModelState<LocalRank>, dtype: DType| {
        let (_, len) = s.read_shard(emb, |at, b| (at, b.len())).expect("shard");
        let n = len / 4;
        checkpoint::ExtraState { name: "m".into(), param: emb, dtype, data: vec![0; n * dtype.size()] }
    };
    let twice = on_ranks(&p, 1, Duration::from_secs(60), |s| {
        let m = state_of(s, DType::F32);
        checkpoint::save_with(s, &ckpt, 1, &[m.clone(), m], serde_json::Value::Null).map(|_| ())
    });
    let msg = twice[0].as_ref().expect_err("a state given twice was saved").to_string();
    assert!(msg.contains("given twice") && msg.contains("emb"), "{msg}");
    assert!(twice.iter().all(Result::is_err));
    // f32 on rank 0, bf16 on rank 1: every rank refuses, naming both.
    let split = on_ranks(&p, 1, Duration::from_secs(60), |s| {
        let m = state_of(s, if s.rank() == 0 { DType::F32 } else { DType::BF16 });
        checkpoint::save_with(s, &ckpt, 1, &[m], serde_json::Value::Null).map(|_| ())
    });
    for (r, res) in split.into_iter().enumerate() {
        let msg = res.expect_err("a state in two dtypes was saved").to_string();
        assert!(msg.contains("f32 on rank 0") && msg.contains("bf16 on rank 1"), "rank {r}: {msg}");
    }
    assert!(names_in(&root).is_empty(), "a refused save left {:?}", names_in(&root));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_load_while_one_rank_holds_a_bucket_gathered_fails_on_every_rank_and_changes_nothing() {
    let root = tmp("gathered");
    let ckpt = root.join("c");
    save_v1(&ckpt);
    let p = plan(PARAMS, "even", 2, 4096);
    let got = on_ranks(&p, 0, Duration::from_secs(60), |s| {
        // Both gather a bucket (a collective); rank 0 releases it, rank 1 still holds it.
        let mut c = s.coordinator(SchedulerConfig::default()).expect("coordinator");
        c.fetch(&[ParamId(2)]).map(drop).expect("fetch");
        if s.rank() == 0 {
            c.release(&[ParamId(2)]).expect("release");
        }
        let res = checkpoint::load(s, &ckpt).map(|_| ());
        if s.rank() == 1 {
            c.release(&[ParamId(2)]).expect("release");
        }
        c.end_step().expect("end step");
        drop(c);
        (res, gathered(s))
    });
    for (r, (res, after)) in got.into_iter().enumerate() {
        let msg = res.expect_err("a load with a bucket gathered went through").to_string();
        assert!(msg.contains("gathered") || msg.contains("[1]"), "rank {r}: {msg}");
        assert_eq!(after, full(&p, 0), "rank {r}: shards changed although the load failed");
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Rewrites the safetensors header of `path` with `edit` (the data stays as it was).
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).expect("json");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).expect("write");
}

#[test]
fn offsets_past_the_end_and_a_tensor_of_another_dtype_are_damage_not_a_panic() {
    let root = tmp("offsets");
    let ckpt = root.join("c");
    save_v1(&ckpt);
    let victim = ckpt.join("rank-0.safetensors");
    let original = std::fs::read(&victim).expect("read");
    // An end offset that wraps the file's base around: refused as damage on open.
    edit_header(&victim, |h| {
        let (_, e) = h.iter_mut().find(|(k, _)| *k != "__metadata__").expect("a tensor");
        e["data_offsets"] = serde_json::json!([0u64, u64::MAX - 4]);
    });
    let e = checkpoint::inspect(&ckpt).expect_err("wrapped offsets passed").to_string();
    assert!(e.contains("rank-0.safetensors") && e.contains("beyond"), "{e}");
    // The same bytes said to be i32 instead of f32: inspect refuses it as a load would.
    std::fs::write(&victim, &original).expect("restore");
    edit_header(&victim, |h| {
        let (_, e) = h.iter_mut().find(|(_, v)| v["dtype"] == "F32").expect("an f32 tensor");
        e["dtype"] = serde_json::json!("I32");
    });
    let e = checkpoint::inspect(&ckpt).expect_err("a tensor of another dtype passed").to_string();
    assert!(e.contains("rank-0.safetensors") && e.contains("I32"), "{e}");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_data_file_of_another_save_is_refused_even_of_the_same_layout() {
    let root = tmp("mixed");
    let (a, b) = (root.join("a"), root.join("b"));
    let first = save_v1(&a);
    let second = save_v1(&b);
    assert!(!first.save.is_empty() && first.save != second.save, "{} {}", first.save, second.save);
    // Same layout, same tensor names and sizes: only the save's id tells the files apart.
    std::fs::copy(b.join("rank-1.safetensors"), a.join("rank-1.safetensors")).expect("copy");
    let p = plan(PARAMS, "even", 2, 4096);
    let got =
        on_ranks(&p, 0, Duration::from_secs(60), |s| (checkpoint::load(s, &a).map(|_| ()), gathered(s)));
    let mut named = false;
    for (r, (res, after)) in got.into_iter().enumerate() {
        let msg = res.expect_err("a file of another save loaded").to_string();
        named |= msg.contains("rank-1.safetensors") && msg.contains("written by save");
        assert_eq!(after, full(&p, 0), "rank {r}: shards changed although the load was refused");
    }
    assert!(named, "no rank named the file of the other save");
    let e = checkpoint::inspect(&a).expect_err("inspect passed a file of another save").to_string();
    assert!(e.contains("rank-1.safetensors") && e.contains(&second.save), "{e}");
    std::fs::remove_dir_all(&root).ok();
}
