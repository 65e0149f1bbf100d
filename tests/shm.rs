//! The shm backend with real processes (one per rank): the backend-generic collective suite at
//! 1, 2, 3 and 5 processes, and the faults of a multi-process job: a mismatched collective, a
//! rank killed before or during a collective, a rank that leaves early. Nothing may be left in
//! `/dev/shm`.

use std::time::{Duration, Instant};

use collsched::backend::local::LocalRank;
use collsched::backend::shm::{join, ShmConfig};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::bootstrap::LaunchEnv;
use collsched::kernels::ElemType;

#[path = "support/collectives.rs"]
mod collectives;
#[path = "support/faults.rs"]
mod faults;
use faults::{all_reduce, kill_self};
#[path = "support/procs.rs"]
mod procs;
use procs::{finish, job, start};

fn run_child() -> Result<String, String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let config = ShmConfig::from_env().map_err(|e| e.to_string())?;
    let mode = std::env::var("COLLSCHED_TEST_MODE").unwrap_or_default();
    let (rank, _hub) = join(&env, &config).map_err(|e| e.to_string())?;
    let me = env.rank;
    match mode.as_str() {
        "suite" => collectives::suite(&rank),
        "mismatch" => faults::mismatch(&rank),
        "failed-dep" => faults::failed_dependency(&rank),
        "kill-depart" => {
            // The victim is the root of in-place broadcasts: it copies nothing, so it spends
            // its time in the departure barrier, waiting for its peers to copy from it.
            let n = rank.world_size();
            let root = n - 1;
            if me == root {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    kill_self();
                });
            }
            let count = 32 << 20;
            for _ in 0..1000 {
                let output = rank.alloc(count * 4).map_err(|e| e.to_string())?;
                let desc = CollDesc::broadcast(RankGroup::world(n), ElemType::F32, count, root);
                let f = rank
                    .launch(Stream::AllGather, &[], Collective { desc, input: None, output })
                    .map_err(|e| e.error.to_string())?;
                let mut done = f.wait(Duration::from_secs(120)).map_err(|e| e.into_error().to_string())?;
                if let Some(c) = done.pop() {
                    rank.free(c.output, None);
                }
            }
            Ok("no failure seen".into())
        }
        "kill-before" | "kill-mid" | "leave" => {
            let victim = me == rank.world_size() - 1;
            if victim && mode == "kill-before" {
                kill_self();
            }
            if victim && mode == "leave" {
                drop(rank);
                return Ok("left".into());
            }
            if victim {
                // Killed while its peers are inside a large all-reduce with it.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    kill_self();
                });
            }
            for _ in 0..1000 {
                all_reduce(&rank, 16 << 20).map_err(|e| e.to_string())?;
            }
            Ok("no failure seen".into())
        }
        "borrowed" => borrowed_outputs(&rank).map(|()| "borrowed".into()),
        other => Err(format!("unknown mode {other}")),
    }
}

/// `count` f32 values of rank `r`: `r * 1000 + i`.
fn values(r: usize, count: usize) -> Vec<u8> {
    (0..count).flat_map(|i| ((r * 1000 + i) as f32).to_le_bytes()).collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Collectives whose outputs are this process's own heap memory (`LocalBuffer::borrowed`),
/// written by their owner alone: all-gather, reduce-scatter (large enough that peers would
/// otherwise take pieces of it), a broadcast's receivers; an all-reduce into such memory is
/// refused, naming the output.
fn borrowed_outputs(rank: &LocalRank) -> Result<(), String> {
    use collsched::backend::local::LocalBuffer;
    let n = rank.world_size();
    let me = rank.rank();
    let group = RankGroup::world(n);
    let wait = |c: Collective<collsched::backend::local::LocalBuffer>| -> Result<(), String> {
        let f = rank.launch(Stream::AllGather, &[], c).map_err(|e| e.error.to_string())?;
        f.wait(Duration::from_secs(60)).map_err(|e| e.into_error().to_string())?;
        Ok(())
    };
    let pooled = |bytes: &[u8]| -> Result<LocalBuffer, String> {
        let mut b = rank.alloc(bytes.len()).map_err(|e| e.to_string())?;
        rank.write_from_host(&mut b, 0, bytes).map_err(|e| e.to_string())?;
        Ok(b)
    };
    let borrow = |v: &mut Vec<u8>| {
        let ptr = std::ptr::NonNull::new(v.as_mut_ptr()).expect("a Vec's pointer");
        // SAFETY: every Vec given here outlives its collective, which is waited for before the
        // Vec is read or dropped, and nothing else touches it meanwhile.
        unsafe { LocalBuffer::borrowed(ptr, v.len()) }
    };

    let count = 257;
    let mut gathered = vec![0u8; n * count * 4];
    let desc = CollDesc::all_gather(group.clone(), ElemType::F32, count);
    wait(Collective { desc, input: Some(pooled(&values(me, count))?), output: borrow(&mut gathered) })?;
    let want: Vec<u8> = (0..n).flat_map(|r| values(r, count)).collect();
    if gathered != want {
        return Err(format!("all_gather into heap memory: {:?}...", &floats(&gathered)[..4]));
    }

    // 4 MiB per member: many reduction pieces, none of which a peer may take.
    let count = 1 << 20;
    let input: Vec<u8> = (0..n).flat_map(|_| values(me, count)).collect();
    let mut reduced = vec![0u8; count * 4];
    let desc = CollDesc::reduce_scatter(group.clone(), ElemType::F32, count);
    wait(Collective { desc, input: Some(pooled(&input)?), output: borrow(&mut reduced) })?;
    let sum_r = (0..n).sum::<usize>() as f32;
    let got = floats(&reduced);
    if got.len() != count {
        return Err(format!("reduce_scatter gave {} elements for {count}", got.len()));
    }
    if let Some((i, v)) =
        got.iter().enumerate().find(|&(i, v)| *v != sum_r * 1000.0 + n as f32 * i as f32 || v.is_nan())
    {
        return Err(format!("reduce_scatter into heap memory: element {i} is {v}"));
    }

    // The same with this member's own chunk read from heap memory; the pooled input's bytes
    // there are NaN (read, they would show).
    let mut staged = input.clone();
    staged[me * count * 4..(me + 1) * count * 4].copy_from_slice(&f32::NAN.to_le_bytes().repeat(count));
    let own_values = input[me * count * 4..(me + 1) * count * 4].to_vec();
    let ptr = std::ptr::NonNull::new(own_values.as_ptr().cast_mut()).expect("a Vec's pointer");
    // SAFETY: `own_values` outlives both collectives, each waited for, and is not written.
    let own = unsafe { collsched::backend::OwnChunk::new(ptr, own_values.len()) };
    let mut reduced = vec![0u8; count * 4];
    let desc = CollDesc::reduce_scatter(group.clone(), ElemType::F32, count).with_own_chunk(own);
    wait(Collective { desc: desc.clone(), input: Some(pooled(&staged)?), output: borrow(&mut reduced) })?;
    let got = floats(&reduced);
    if let Some((i, v)) =
        got.iter().enumerate().find(|&(i, v)| *v != sum_r * 1000.0 + n as f32 * i as f32 || v.is_nan())
    {
        return Err(format!("reduce_scatter with its own chunk apart: element {i} is {v}"));
    }
    // Into a pooled output too: reduced by this member alone (a peer's process cannot reach
    // the chunk).
    let output = rank.alloc(count * 4).map_err(|e| e.to_string())?;
    let f = rank
        .launch(Stream::AllGather, &[], Collective { desc, input: Some(pooled(&staged)?), output })
        .map_err(|e| e.error.to_string())?;
    let mut done = f.wait(Duration::from_secs(60)).map_err(|e| e.into_error().to_string())?;
    let c = done.pop().ok_or("no collective back")?;
    let mut pooled_out = vec![0u8; count * 4];
    rank.read_to_host(&c.output, 0, &mut pooled_out).map_err(|e| e.to_string())?;
    if pooled_out != reduced {
        return Err("reduce_scatter with its own chunk apart into a pooled output: another result".into());
    }

    let count = 4099;
    let root = n - 1;
    let desc = CollDesc::broadcast(group.clone(), ElemType::F32, count, root);
    let mut received = vec![0u8; count * 4];
    let output = if me == root { pooled(&values(root, count))? } else { borrow(&mut received) };
    wait(Collective { desc, input: None, output })?;
    if me != root && received != values(root, count) {
        return Err("broadcast into heap memory: wrong data".into());
    }

    let mut mine = vec![0u8; 64 * 4];
    let desc = CollDesc::all_reduce(group, ElemType::F32, 64);
    match wait(Collective { desc, input: Some(pooled(&values(me, 64))?), output: borrow(&mut mine) }) {
        Ok(()) => Err("an all-reduce into memory peers cannot read ran".into()),
        Err(e) if e.contains("not from this rank's shared-memory pool") => Ok(()),
        Err(e) => Err(format!("an all-reduce into heap memory failed with another error: {e}")),
    }
}

#[test]
#[ignore = "a rank of the shm tests' jobs, started by them as a child process"]
fn child() {
    match run_child() {
        Ok(s) => println!("\nRESULT ok {s}"),
        Err(e) => println!("\nRESULT err {e}"),
    }
}

/// Names in `/dev/shm` that look like ours.
fn leftovers() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("collsched"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_collective_at_1_2_3_and_5_processes() {
    for world in [1, 2, 3, 5] {
        let all: Vec<usize> = (0..world).collect();
        let out = finish(start(&job(&format!("suite{world}")), world, &all, 60.0, |_| "suite"));
        assert_eq!(out.len(), world);
        for (r, line) in out {
            let line = line.unwrap_or_else(|| panic!("world {world}: rank {r} reported nothing"));
            assert_eq!(line, "ok suite", "world {world}: rank {r}");
        }
    }
    assert_eq!(leftovers(), Vec::<String>::new());
}

#[test]
fn outputs_in_heap_memory_are_written_by_their_owner_alone() {
    for world in [2, 3] {
        let all: Vec<usize> = (0..world).collect();
        let out = finish(start(&job(&format!("borrowed{world}")), world, &all, 60.0, |_| "borrowed"));
        assert_eq!(out.len(), world);
        for (r, line) in out {
            let line = line.unwrap_or_else(|| panic!("world {world}: rank {r} reported nothing"));
            assert_eq!(line, "ok borrowed", "world {world}: rank {r}");
        }
    }
    assert_eq!(leftovers(), Vec::<String>::new());
}

#[test]
fn a_mismatched_collective_fails_on_every_rank_at_once() {
    let t = Instant::now();
    let out = finish(start(&job("mismatch"), 3, &[0, 1, 2], 60.0, |_| "mismatch"));
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
    for (r, line) in out {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert!(
            line.contains("mismatched collectives") && line.contains("reduce_scatter"),
            "rank {r}: {line}"
        );
    }
}

/// Every rank but the last must fail naming the last, within `within` (the timeout is 120 s).
fn check_victim_named(mode: &'static str, within: Duration) {
    let t = Instant::now();
    let out = finish(start(&job(mode), 3, &[0, 1, 2], 120.0, move |_| mode));
    assert!(t.elapsed() < within, "{mode}: took {:?}", t.elapsed());
    for (r, line) in out {
        if r == 2 {
            continue;
        }
        let line = line.unwrap_or_else(|| panic!("{mode}: rank {r} reported nothing"));
        assert!(line.starts_with("err") && line.contains("[2]"), "{mode}: rank {r}: {line}");
    }
    assert_eq!(leftovers(), Vec::<String>::new());
}

#[test]
fn a_rank_killed_before_a_collective_is_named_within_seconds() {
    check_victim_named("kill-before", Duration::from_secs(10));
}

#[test]
fn a_rank_killed_in_the_middle_of_a_large_collective_is_named_within_seconds() {
    check_victim_named("kill-mid", Duration::from_secs(15));
}

#[test]
fn a_rank_killed_in_the_departure_barrier_is_named_within_seconds() {
    check_victim_named("kill-depart", Duration::from_secs(15));
}

#[test]
fn a_failed_dependency_fails_every_rank_at_once() {
    let t = Instant::now();
    let out = finish(start(&job("faileddep"), 3, &[0, 1, 2], 120.0, |_| "failed-dep"));
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    for (r, line) in out {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        if r == 2 {
            assert!(line.starts_with("err") && line.contains("injected host failure"), "rank {r}: {line}");
        } else {
            assert!(line.starts_with("err") && line.contains("[2]"), "rank {r}: {line}");
        }
    }
}

#[test]
fn a_rank_that_leaves_early_is_named_within_seconds() {
    check_victim_named("leave", Duration::from_secs(10));
}

#[test]
fn two_jobs_at_once_keep_to_themselves() {
    let a = start(&job("twin-a"), 2, &[0, 1], 60.0, |_| "suite");
    let b = start(&job("twin-b"), 3, &[0, 1, 2], 60.0, |_| "suite");
    for (r, line) in finish(a).into_iter().chain(finish(b)) {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert_eq!(line, "ok suite", "rank {r}");
    }
}

#[test]
fn a_rank_that_never_starts_is_named_after_the_bootstrap_timeout() {
    let t = Instant::now();
    let out = finish(start(&job("never"), 3, &[0, 1], 2.0, |_| "suite"));
    assert!(t.elapsed() < Duration::from_secs(20), "took {:?}", t.elapsed());
    for (r, line) in out {
        let line = line.unwrap_or_else(|| panic!("rank {r} reported nothing"));
        assert!(line.starts_with("err") && line.contains("[2]"), "rank {r}: {line}");
    }
}

/// `COLLSCHED_SPIN_US` sets how long the waits spin (the local backend's default otherwise), and
/// a malformed one is refused naming it.
#[test]
fn the_spin_is_the_default_or_as_told() {
    let with = |spin: Option<&str>| {
        let spin = spin.map(str::to_string);
        ShmConfig::from_lookup(move |k| if k == "COLLSCHED_SPIN_US" { spin.clone() } else { None })
    };
    let default = collsched::backend::local::LocalConfig::default().spin;
    assert_eq!(with(None).expect("config").local.spin, default);
    assert_eq!(with(Some("200")).expect("config").local.spin, Duration::from_micros(200));
    assert_eq!(with(Some("0")).expect("config").local.spin, Duration::ZERO);
    for bad in ["-1", "soon", "NaN", "2e6"] {
        let e = with(Some(bad)).expect_err("malformed").to_string();
        assert!(e.contains("COLLSCHED_SPIN_US") && e.contains(bad), "{e}");
    }
}
