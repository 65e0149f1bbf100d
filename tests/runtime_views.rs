//! Views of gathered parameters and engine events, on the local backend.
//!
//! - Views point into the gathered buffer where a parameter is one contiguous run of it, and
//!   into one unpacked buffer otherwise; nothing stays allocated between steps.
//! - A bucket released with an engine event that has not completed is neither reused nor
//!   overwritten by later gathers until the event completes (the engine's "kernel" here is a
//!   host closure queued on the rank's compute stream behind a gate, which reads the released
//!   parameter only when the gate opens, as a CUDA kernel queued before the release would).
//! - `grad_ready_after` waits for its event before it takes the gradient.
//! - A bucket gathered again lands at the address it had (what a framework made of it stays
//!   right).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{Backend, BackendBuffer, BackendEvent, Stream};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::runtime::{ModelState, RuntimeError};
use collsched::schedule::{Plan, PolicyKind, SchedulerConfig};

fn values(sizes: &[usize]) -> Vec<Vec<f32>> {
    sizes.iter().enumerate().map(|(k, &n)| (0..n).map(|i| (k * 1000 + i) as f32 * 0.5).collect()).collect()
}

fn set_of(sizes: &[usize]) -> ParamSet {
    ParamSet::new(
        sizes.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect(),
    )
    .unwrap()
}

fn no_prefetch() -> SchedulerConfig {
    SchedulerConfig { policy: PolicyKind::None, ..SchedulerConfig::default() }
}

/// The bytes a gathered bucket holds on the local backend, whose all-gather places the pieces
/// of split parameters: their unpacked buffer alone, or the gathered buffer.
fn held(b: &collsched::buckets::Bucket) -> usize {
    match b.unpacked_numel() {
        0 => b.gathered_bytes(),
        n => n * 4,
    }
}

#[test]
fn views_point_into_the_gathered_buffer_or_one_unpacked_buffer() {
    let sizes = [370usize, 50, 410, 70, 290, 30, 640, 90];
    let set = set_of(&sizes);
    let init = values(&sizes);
    let world = 4;
    for sharding in [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(2)] {
        let plan = Plan::new(
            LayoutBuilder::new(&set, sharding, world).bucket_bytes(2048).align(16).build().unwrap(),
        );
        let results = LocalWorld::new(world as usize)
            .unwrap()
            .run(|rank| -> Result<(), RuntimeError> {
                let state = ModelState::from_f32(Arc::new(rank), &plan, &init)?;
                let mut c = state.coordinator(no_prefetch())?;
                let mut unpacked_seen = 0;
                for b in plan.layout().gather_buckets() {
                    let params = b.params();
                    let v = c.fetch(params)?;
                    let mut gathered_at = None;
                    let mut unpacked_at = None;
                    for (i, &p) in params.iter().enumerate() {
                        assert_eq!(v.f32(p)?, &init[p.index()][..], "{sharding}: values of {p}");
                        let (buf, range) = v.buffer(p)?;
                        let base = state.backend().host_bytes(buf).unwrap().as_ptr() as usize;
                        match b.contiguous_offset(i) {
                            Some(at) => {
                                // Straight into the gathered buffer, at the parameter's run.
                                assert_eq!(range.start, at * 4, "{sharding}: {p}");
                                assert_eq!(
                                    *gathered_at.get_or_insert(base),
                                    base,
                                    "{sharding}: one gathered buffer"
                                );
                                assert_eq!(buf.len(), b.gathered_bytes());
                            }
                            None => {
                                assert_eq!(
                                    *unpacked_at.get_or_insert(base),
                                    base,
                                    "{sharding}: one unpacked buffer"
                                );
                                assert_eq!(buf.len(), b.unpacked_numel() * 4);
                                unpacked_seen += 1;
                            }
                        }
                    }
                    drop(v);
                    // What the bucket holds is counted while gathered: the unpacked buffer
                    // alone where the all-gather places the pieces (the local backend does),
                    // else the gathered buffer...
                    assert_eq!(state.live_bytes(), held(b), "{sharding}: bucket {}", b.id());
                    c.release(params)?;
                    // ...and gone when released.
                    assert_eq!(state.live_bytes(), 0);
                }
                let stats = c.end_step()?;
                let most = plan.layout().gather_buckets().iter().map(|b| held(b) as u64).max().unwrap();
                assert_eq!(stats.peak_gathered_bytes(), most, "{sharding}");
                // Only EvenSplit and Hybrid split parameters over shards.
                let splits = matches!(sharding, Sharding::EvenSplit | Sharding::Hybrid(_));
                assert_eq!(unpacked_seen > 0, splits, "{sharding}");
                Ok(())
            })
            .unwrap();
        for r in results {
            r.expect("rank thread").unwrap();
        }
    }
}

/// Queues a host closure on `stream` of `rank` that waits for the returned gate, then copies
/// `len` bytes at `addr` and sends them; returns the gate, the receiver of the copy, and an
/// event recorded after the closure.
fn reader(
    rank: &LocalRank,
    stream: Stream,
    addr: usize,
    len: usize,
) -> (mpsc::Sender<()>, mpsc::Receiver<Vec<u8>>, <LocalRank as Backend>::Event) {
    let (gate, wait) = mpsc::channel::<()>();
    let (send, got) = mpsc::channel::<Vec<u8>>();
    rank.enqueue_host(stream, move || {
        let _ = wait.recv();
        // SAFETY: `addr..addr + len` is the parameter's range of a gathered buffer of this
        // rank's pool. Pool memory is never returned to the system while the rank exists (a
        // freed buffer goes to the pool's free list or its deferred list), so the bytes are
        // allocated and initialized; the test checks that nothing overwrote them.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        let _ = send.send(bytes);
        Ok(())
    })
    .unwrap();
    let event = rank.record(stream).unwrap();
    (gate, got, event)
}

/// Same-size buckets, one parameter each, one rank: a freed gathered buffer is the next
/// gather's (exact size classes), so an early free would be overwritten at once.
fn one_rank_model() -> (ParamSet, Plan, Vec<Vec<f32>>) {
    let sizes = [64usize, 64, 64];
    let set = set_of(&sizes);
    let plan = Plan::new(LayoutBuilder::new(&set, Sharding::Flat, 1).bucket_bytes(256).build().unwrap());
    (set, plan, values(&sizes))
}

fn addr_of(c: &mut collsched::Coordinator<LocalRank>, p: ParamId) -> (usize, usize, Vec<u8>) {
    let v = c.fetch(&[p]).unwrap();
    let b = v.bytes(p).unwrap();
    (b.as_ptr() as usize, b.len(), b.to_vec())
}

#[test]
fn a_bucket_gathered_again_lands_where_it_was() {
    let (_, plan, init) = one_rank_model();
    let (p0, p1) = (ParamId(0), ParamId(1));
    let world = LocalWorld::new(1).unwrap();
    let state = ModelState::from_f32(Arc::new(world.rank(0).unwrap()), &plan, &init).unwrap();
    let mut c = state.coordinator(no_prefetch()).unwrap();
    let mut first = None;
    for step in 0..4 {
        // Both held, then released first to last: the pool's last freed buffer is p1's, which
        // a plain pop would hand to p0 at the next step.
        let (a0, _, v0) = addr_of(&mut c, p0);
        let (a1, _, v1) = addr_of(&mut c, p1);
        assert_eq!(v0, bytemuck::cast_slice::<f32, u8>(&init[0]), "step {step}: values of p0");
        assert_eq!(v1, bytemuck::cast_slice::<f32, u8>(&init[1]), "step {step}: values of p1");
        assert_ne!(a0, a1, "step {step}: two held buckets share a buffer");
        match first {
            None => first = Some((a0, a1)),
            Some(f) => assert_eq!((a0, a1), f, "step {step}: a bucket was gathered somewhere else"),
        }
        c.release(&[p0]).unwrap();
        c.release(&[p1]).unwrap();
        c.end_step().unwrap();
    }
}

#[test]
fn a_buffer_released_after_a_pending_event_is_not_reused_before_it_completes() {
    let (_, plan, init) = one_rank_model();
    let (p0, p1, p2) = (ParamId(0), ParamId(1), ParamId(2));
    let world = LocalWorld::new(1).unwrap();
    let rank = world.rank(0).unwrap();
    let state = ModelState::from_f32(Arc::new(rank), &plan, &init).unwrap();
    let be = Arc::clone(state.backend());
    let mut c = state.coordinator(no_prefetch()).unwrap();
    // Warm the pool: steady state allocates nothing, so any fresh allocation below is a
    // buffer that could not be reused.
    for p in [p0, p1, p2] {
        c.fetch(&[p]).unwrap();
        c.release(&[p]).unwrap();
    }
    let (addr, len, want) = addr_of(&mut c, p0);
    let (gate, got, event) = reader(&be, Stream::Compute, addr, len);
    c.release_after(&[p0], &event).unwrap();
    let before = be.fresh_allocations();
    for _ in 0..3 {
        for p in [p1, p2] {
            let v = c.fetch(&[p]).unwrap();
            let b = v.bytes(p).unwrap();
            assert_ne!(
                b.as_ptr() as usize,
                addr,
                "a later gather got the buffer released after a pending event"
            );
            drop(v);
            c.release(&[p]).unwrap();
        }
    }
    assert!(!event.query().unwrap(), "the engine's event completed early");
    assert!(be.fresh_allocations() > before, "the later gathers must have needed a buffer of their own");
    gate.send(()).unwrap();
    assert_eq!(
        got.recv().unwrap(),
        want,
        "the released parameter was overwritten before the event completed"
    );
    event.wait(Duration::from_secs(60)).unwrap();
    // Once it completed, the buffer is reused: no fresh allocation any more.
    let after = be.fresh_allocations();
    for _ in 0..3 {
        for p in [p0, p1, p2] {
            c.fetch(&[p]).unwrap();
            c.release(&[p]).unwrap();
        }
    }
    c.end_step().unwrap();
    assert_eq!(
        be.fresh_allocations(),
        after,
        "plain releases and completed events give buffers back at once"
    );
}

#[test]
fn two_coordinators_release_after_their_own_events_and_the_buffer_waits_for_both() {
    let (_, plan, init) = one_rank_model();
    let (p0, p1, p2) = (ParamId(0), ParamId(1), ParamId(2));
    let world = LocalWorld::new(1).unwrap();
    let state = ModelState::from_f32(Arc::new(world.rank(0).unwrap()), &plan, &init).unwrap();
    let be = Arc::clone(state.backend());
    let mut train = state.coordinator(no_prefetch()).unwrap();
    let mut eval = state.coordinator(no_prefetch()).unwrap();
    let (addr, len, want) = addr_of(&mut train, p0);
    eval.fetch(&[p0]).unwrap();
    // Two engines, two queues: neither event implies the other.
    let (gate1, got1, ev1) = reader(&be, Stream::Compute, addr, len);
    let (gate2, got2, ev2) = reader(&be, Stream::ReduceScatter, addr, len);
    train.release_after(&[p0], &ev1).unwrap();
    eval.release_after(&[p0], &ev2).unwrap();
    assert_eq!(state.live_bytes(), 0, "the scheduler freed the bucket (deferred)");
    let churn = |c: &mut collsched::Coordinator<LocalRank>| {
        for _ in 0..3 {
            for p in [p1, p2] {
                let v = c.fetch(&[p]).unwrap();
                assert_ne!(
                    v.bytes(p).unwrap().as_ptr() as usize,
                    addr,
                    "reused before both events completed"
                );
                drop(v);
                c.release(&[p]).unwrap();
            }
        }
    };
    churn(&mut train);
    gate1.send(()).unwrap();
    assert_eq!(got1.recv().unwrap(), want);
    ev1.wait(Duration::from_secs(60)).unwrap();
    // One of the two completed: still not free.
    churn(&mut train);
    gate2.send(()).unwrap();
    assert_eq!(got2.recv().unwrap(), want);
    ev2.wait(Duration::from_secs(60)).unwrap();
    train.end_step().unwrap();
    eval.end_step().unwrap();
}

#[test]
fn grad_ready_after_waits_for_its_event_and_changes_nothing_when_it_does_not_complete() {
    let sizes = [24usize];
    let set = set_of(&sizes);
    let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 1).build().unwrap());
    let init = values(&sizes);
    let config = LocalConfig { timeout: Duration::from_millis(200), ..LocalConfig::default() };
    let world = LocalWorld::with_config(1, config).unwrap();
    let state = ModelState::from_f32(Arc::new(world.rank(0).unwrap()), &plan, &init).unwrap();
    let be = Arc::clone(state.backend());
    let mut c = state.coordinator(no_prefetch()).unwrap();
    let p = ParamId(0);
    let grad: Vec<f32> = (0..24).map(|i| i as f32 - 7.0).collect();
    c.fetch(&[p]).unwrap();
    c.release(&[p]).unwrap();
    let (gate, wait) = mpsc::channel::<()>();
    be.enqueue_host(Stream::Compute, move || {
        let _ = wait.recv();
        Ok(())
    })
    .unwrap();
    let event = be.record(Stream::Compute).unwrap();
    let err = c.grad_ready_after(p, bytemuck::cast_slice(&grad), &event).unwrap_err();
    assert!(matches!(err, RuntimeError::Backend { .. }), "{err}");
    assert!(err.to_string().contains("nothing was changed"), "{err}");
    gate.send(()).unwrap();
    // Nothing changed: the same gradient is taken now (not a "second gradient" error).
    c.grad_ready_after(p, bytemuck::cast_slice(&grad), &event).unwrap();
    c.end_step().unwrap();
    let mut seen = Vec::new();
    c.update_shards_f32(|_, _, _, g| seen.extend_from_slice(g)).unwrap();
    assert_eq!(seen, grad);
}

#[path = "support/loopback.rs"]
#[allow(dead_code)]
mod loopback;

#[path = "support/device.rs"]
mod device;

#[test]
fn on_a_device_backend_bytes_is_a_clear_error_and_buffer_and_host_copies_work() {
    let (set, plan, init) = one_rank_model();
    let state =
        ModelState::from_f32(Arc::new(device::OnDevice(loopback::Loopback::new())), &plan, &init).unwrap();
    let mut c = state.coordinator(no_prefetch()).unwrap();
    let p = ParamId(1);
    let v = c.fetch(&[p]).unwrap();
    let err = v.bytes(p).unwrap_err();
    assert!(matches!(err, RuntimeError::Unsupported { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("Views::buffer") && msg.contains(set.name(p)), "{msg}");
    let (buf, range) = v.buffer(p).unwrap();
    assert_eq!(&buf.0[range], bytemuck::cast_slice::<f32, u8>(&init[1]));
    assert_eq!(&*v.read_f32(p).unwrap(), &init[1][..]);
    drop(v);
    c.release(&[p]).unwrap();
    c.end_step().unwrap();
}

#[test]
fn a_zeroed_model_gathers_zeros_of_every_size_on_every_rank_and_checks_its_world() {
    // Odd sizes, split over 3 ranks with padding; no rank is given any value.
    let sizes = [17usize, 257, 5, 4099];
    let set = set_of(&sizes);
    let plan =
        Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 3).bucket_bytes(4096).build().unwrap());
    let world = LocalWorld::new(3).unwrap();
    let got: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let rank = world.rank(r).unwrap();
                let plan = &plan;
                s.spawn(move || {
                    let state = ModelState::zeroed(Arc::new(rank), plan).unwrap();
                    let mut c = state.coordinator(no_prefetch()).unwrap();
                    let ids: Vec<ParamId> = (0..sizes.len() as u32).map(ParamId).collect();
                    let out = {
                        let v = c.fetch(&ids).unwrap();
                        ids.iter().map(|&p| v.bytes(p).unwrap().to_vec()).collect::<Vec<_>>()
                    };
                    c.release(&ids).unwrap();
                    c.end_step().unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got.len(), 3);
    for (r, params) in got.iter().enumerate() {
        assert_eq!(params.len(), sizes.len(), "rank {r}");
        for (k, bytes) in params.iter().enumerate() {
            assert_eq!(bytes.len(), sizes[k] * 4, "rank {r} p{k}: length");
            assert!(bytes.iter().all(|&b| b == 0), "rank {r} p{k}: not all zeros");
        }
    }
    // A plan for another world size is refused, as ModelState::new refuses it.
    let one = LocalWorld::new(1).unwrap();
    match ModelState::zeroed(Arc::new(one.rank(0).unwrap()), &plan) {
        Err(RuntimeError::Plan { what, .. }) => assert!(what.contains("world of 3 ranks"), "{what}"),
        Err(e) => panic!("expected a plan error, got {e}"),
        Ok(_) => panic!("a 3-rank plan was taken by a 1-rank world"),
    }
}
