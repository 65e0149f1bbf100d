//! Faults every multi-process backend's tests inject from inside a rank (shared by the shm and
//! mpi tests; each mode returns what the rank saw, for the parent test to judge).
#![allow(dead_code)]

use std::time::Duration;

use collsched::backend::local::LocalRank;
use collsched::backend::{Backend, BackendError, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::ElemType;

/// One all-reduce of `count` f32 over the world on this rank.
pub fn all_reduce(rank: &LocalRank, count: usize) -> Result<(), BackendError> {
    let n = rank.world_size();
    let input = rank.alloc(count * 4)?;
    let output = rank.alloc(count * 4)?;
    let desc = CollDesc::all_reduce(RankGroup::world(n), ElemType::F32, count);
    let f = rank
        .launch(Stream::ReduceScatter, &[], Collective { desc, input: Some(input), output })
        .map_err(|e| e.error)?;
    f.wait(Duration::from_secs(120)).map_err(|e| e.into_error())?;
    Ok(())
}

/// Rank 1 launches a reduce-scatter where every other rank launches an all-gather, at the same
/// place of the same stream: `Err` with the error this rank saw, `Ok` if the collective ran.
pub fn mismatch(rank: &LocalRank) -> Result<String, String> {
    let (me, n) = (rank.rank(), rank.world_size());
    let count = 64;
    let desc = if me == 1 {
        CollDesc::reduce_scatter(RankGroup::world(n), ElemType::F32, count)
    } else {
        CollDesc::all_gather(RankGroup::world(n), ElemType::F32, count)
    };
    let input = rank.alloc(if me == 1 { n * count * 4 } else { count * 4 }).map_err(|e| e.to_string())?;
    let output = rank.alloc(n * count * 4).map_err(|e| e.to_string())?;
    let f = rank
        .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
        .map_err(|e| e.error.to_string())?;
    match f.wait(Duration::from_secs(60)) {
        Ok(_) => Ok("a mismatched collective ran".into()),
        Err(e) => Err(e.into_error().to_string()),
    }
}

/// The last rank launches its all-gather behind a host task that fails: every rank should fail,
/// at once. `Err` with the error this rank saw, `Ok` if the collective ran.
pub fn failed_dependency(rank: &LocalRank) -> Result<String, String> {
    let (me, n) = (rank.rank(), rank.world_size());
    let mut after = Vec::new();
    if me == n - 1 {
        after.push(
            rank.enqueue_host(Stream::Compute, || {
                Err(BackendError::InvalidLaunch { rank: 0, what: "injected host failure".into() })
            })
            .map_err(|e| e.to_string())?,
        );
    }
    let input = rank.alloc(64 * 4).map_err(|e| e.to_string())?;
    let output = rank.alloc(n * 64 * 4).map_err(|e| e.to_string())?;
    let desc = CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 64);
    let f = rank
        .launch(Stream::AllGather, &after, Collective { desc, input: Some(input), output })
        .map_err(|e| e.error.to_string())?;
    match f.wait(Duration::from_secs(60)) {
        Ok(_) => Ok("the collective ran".into()),
        Err(e) => Err(e.into_error().to_string()),
    }
}

/// This process, killed by SIGKILL (no unwinding, no cleanup: a crashed rank).
pub fn kill_self() {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
}
