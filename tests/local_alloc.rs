//! Steady-state launches, group launches, records and waits of the local backend allocate
//! nothing: counted with a counting global allocator (its own test binary).
//!
//! What is counted: every heap allocation (and reallocation) made by **any thread of the
//! process** while the measured window is open: the rank threads that launch, record and wait,
//! and the stream threads that run the collectives. The window opens after a warm-up (which
//! fills the event and work pools, the queues and the rendezvous slots) and closes after every
//! rank waited for its last collective; barriers separate it from the test's own setup.

use std::sync::Barrier;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::ElemType;

#[path = "support/counting.rs"]
mod counting;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

const WAIT: Duration = Duration::from_secs(30);
/// Elements per shard (odd, so that all-reduce chunks differ in size).
const COUNT: usize = 257;
const WARMUP: usize = 20;
const STEPS: usize = 50;

/// A collective with freshly allocated buffers: `input_bytes` of input (none if 0) filled
/// with `fill`, and `output_bytes` of output.
fn coll(
    rank: &LocalRank,
    desc: CollDesc,
    input_bytes: usize,
    output_bytes: usize,
    fill: f32,
) -> Collective<collsched::backend::local::LocalBuffer> {
    let input = (input_bytes > 0).then(|| {
        let mut b = rank.alloc(input_bytes).expect("alloc input");
        let bytes: Vec<u8> = (0..input_bytes / 4).flat_map(|_| fill.to_le_bytes()).collect();
        rank.write_from_host(&mut b, 0, &bytes).expect("fill input");
        b
    });
    let output = rank.alloc(output_bytes).expect("alloc output");
    Collective { desc, input, output }
}

/// One rank's steady state: per step, an all-gather on its stream, a record there and a
/// cross-stream wait, a reduce-scatter and an all-reduce after it, and a group launch of an
/// all-gather with a reduce-scatter; every launch waited for, its buffers reused.
fn run_rank(rank: LocalRank, n: usize, window: &Barrier) -> (u64, Vec<f32>) {
    let group = RankGroup::new((0..n).collect::<Vec<_>>()).expect("group");
    let me = rank.rank() as f32 + 1.0;
    let s = COUNT * 4;
    let ag = CollDesc::all_gather(group.clone(), ElemType::F32, COUNT);
    let rs = CollDesc::reduce_scatter(group.clone(), ElemType::F32, COUNT);
    let ar = CollDesc::all_reduce(group.clone(), ElemType::F32, COUNT);
    let mut ag_ops = vec![coll(&rank, ag.clone(), s, n * s, me)];
    let mut rs_ops = vec![coll(&rank, rs.clone(), n * s, s, me)];
    let mut ar_ops = vec![coll(&rank, ar, s, s, me)];
    let mut grouped = vec![coll(&rank, ag, s, n * s, me), coll(&rank, rs, n * s, s, me)];
    let mut step = || {
        let ag = rank.launch_group(Stream::AllGather, &[], std::mem::take(&mut ag_ops)).expect("launch ag");
        let after_ag = rank.record(Stream::AllGather).expect("record");
        rank.wait_event(Stream::ReduceScatter, &after_ag).expect("wait_event");
        let rs = rank
            .launch_group(Stream::ReduceScatter, std::slice::from_ref(&after_ag), std::mem::take(&mut rs_ops))
            .expect("launch rs");
        let ar =
            rank.launch_group(Stream::ReduceScatter, &[], std::mem::take(&mut ar_ops)).expect("launch ar");
        drop(after_ag);
        ag_ops = ag.wait(WAIT).map_err(|e| e.into_error()).expect("all-gather");
        rs_ops = rs.wait(WAIT).map_err(|e| e.into_error()).expect("reduce-scatter");
        ar_ops = ar.wait(WAIT).map_err(|e| e.into_error()).expect("all-reduce");
        let g = rank.launch_group(Stream::Compute, &[], std::mem::take(&mut grouped)).expect("launch group");
        grouped = g.wait(WAIT).map_err(|e| e.into_error()).expect("group");
    };
    for _ in 0..WARMUP {
        step();
    }
    window.wait();
    if rank.rank() == 0 {
        counting::count_all(true);
    }
    window.wait();
    for _ in 0..STEPS {
        step();
    }
    window.wait();
    if rank.rank() == 0 {
        counting::count_all(false);
    }
    window.wait();
    let fresh = rank.fresh_allocations();
    // The all-reduce's result, to check that the collectives really ran.
    let mut out = vec![0u8; s];
    rank.read_to_host(&ar_ops[0].output, 0, &mut out).expect("read");
    (fresh, out.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

#[test]
fn steady_state_launches_records_and_waits_allocate_nothing() {
    for n in [2usize, 3] {
        let world = LocalWorld::with_config(n, LocalConfig { timeout: WAIT, ..LocalConfig::default() })
            .expect("world");
        let window = Barrier::new(n);
        counting::reset();
        let results = world.run(|rank| run_rank(rank, n, &window)).expect("run");
        let allocs = counting::allocs();
        // Sum over ranks of (rank + 1), computed the plain way.
        let want: f32 = (1..=n).map(|r| r as f32).sum();
        for (r, res) in results.into_iter().enumerate() {
            let (fresh, sums) = res.expect("rank did not panic");
            assert!(fresh > 0, "rank {r}: the pool allocated its buffers at setup");
            assert!(sums.iter().all(|&x| x == want), "rank {r}: all-reduce gave {sums:?}, want {want}");
        }
        assert_eq!(
            allocs,
            0,
            "{n} ranks: {allocs} heap allocations in {STEPS} steady-state steps (launches, a group \
             launch, a record, a cross-stream wait and host waits per step); the first at:\n{}",
            counting::first_backtrace().unwrap_or_default()
        );
    }
}
