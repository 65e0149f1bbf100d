//! Steady-state collectives of the shm backend allocate nothing, in any thread of a rank's
//! process: counted with a counting global allocator in each rank (its own test binary).

use std::time::Duration;

use collsched::backend::local::{LocalBuffer, LocalRank};
use collsched::backend::shm::{join, ShmConfig};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::bootstrap::LaunchEnv;
use collsched::kernels::ElemType;

#[path = "support/counting.rs"]
mod counting;
#[path = "support/procs.rs"]
mod procs;
use procs::{finish, job, start};

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

/// One round: an all-gather, a reduce-scatter and an all-reduce, the buffers back to the pool.
fn round(rank: &LocalRank, world: &RankGroup, ops: &mut Vec<Collective<LocalBuffer>>) -> Result<(), String> {
    let n = rank.world_size();
    let count = 1021;
    let e = |e: collsched::backend::BackendError| e.to_string();
    for (stream, desc, input, output) in [
        (Stream::AllGather, CollDesc::all_gather(world.clone(), ElemType::F32, count), count, n * count),
        (
            Stream::ReduceScatter,
            CollDesc::reduce_scatter(world.clone(), ElemType::BF16, count),
            n * count,
            count,
        ),
        (Stream::ReduceScatter, CollDesc::all_reduce(world.clone(), ElemType::F32, count), count, count),
    ] {
        let es = desc.elem.size();
        ops.push(Collective {
            desc,
            input: Some(rank.alloc(input * es).map_err(e)?),
            output: rank.alloc(output * es).map_err(e)?,
        });
        let f = rank.launch_group(stream, &[], std::mem::take(ops)).map_err(|l| l.error.to_string())?;
        *ops = f.wait(Duration::from_secs(60)).map_err(|w| w.into_error().to_string())?;
        for c in ops.drain(..) {
            if let Some(i) = c.input {
                rank.free(i, None);
            }
            rank.free(c.output, None);
        }
    }
    Ok(())
}

fn run_child() -> Result<String, String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let (rank, mut hub) =
        join(&env, &ShmConfig::from_env().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let mut ops = Vec::with_capacity(4);
    // Made once: a group is an `Arc` (a clone allocates nothing, a new one does).
    let world = RankGroup::world(env.world);
    for _ in 0..20 {
        round(&rank, &world, &mut ops)?;
    }
    hub.barrier().map_err(|e| e.to_string())?;
    counting::reset();
    counting::count_all(true);
    let r = (0..50).try_for_each(|_| round(&rank, &world, &mut ops));
    counting::count_all(false);
    r?;
    let allocs = counting::allocs();
    if allocs == 0 {
        Ok("0 allocations".into())
    } else {
        Err(format!("{allocs} allocations; the first at {}", counting::first_backtrace().unwrap_or_default()))
    }
}

#[test]
#[ignore = "a rank of the shm allocation test's job, started by it as a child process"]
fn child() {
    match run_child() {
        Ok(s) => println!("\nRESULT ok {s}"),
        Err(e) => println!("\nRESULT err {e}"),
    }
}

#[test]
fn steady_state_collectives_allocate_nothing_in_any_rank() {
    for world in [2, 3] {
        let all: Vec<usize> = (0..world).collect();
        for (r, line) in finish(start(&job(&format!("alloc{world}")), world, &all, 60.0, |_| "alloc")) {
            let line = line.unwrap_or_else(|| panic!("world {world}: rank {r} reported nothing"));
            assert_eq!(line, "ok 0 allocations", "world {world}: rank {r}");
        }
    }
}
