//! Failure paths of the local backend: a panicking rank, a rank that never arrives, mismatched
//! collectives, poisoned channels, parked errors. Each ends in errors on every rank, never a hang.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use collsched::backend::local::{LocalBuffer, LocalConfig, LocalRank, LocalWorld};
use collsched::backend::CollectiveKind;
use collsched::backend::{Backend, BackendError, CollDesc, Collective, InFlight, RankGroup, Stream};
use collsched::kernels::ElemType;

/// Long enough never to fire in a test that relies on departure detection; those tests check the
/// error is `PeerFailed`, not `PeerTimeout`.
const LONG: Duration = Duration::from_secs(20);
const SHORT: Duration = Duration::from_millis(150);

fn world(n: usize, timeout: Duration) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout, ..LocalConfig::default() }).expect("world")
}

fn all_gather(
    rank: &LocalRank,
    tag: u64,
    count: usize,
    ty: ElemType,
) -> Result<InFlight<LocalRank>, BackendError> {
    let n = rank.world_size();
    let mut input = rank.alloc(count * ty.size())?;
    input.as_bytes_mut().fill(rank.rank() as u8 + 1);
    let output = rank.alloc(n * count * ty.size())?;
    let desc = CollDesc::all_gather(RankGroup::world(n), ty, count).with_tag(tag);
    rank.launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output }).map_err(|e| e.error)
}

fn wait_err(f: InFlight<LocalRank>) -> (BackendError, Vec<Collective<LocalBuffer>>) {
    match f.wait(LONG) {
        Ok(_) => panic!("collective succeeded, expected a failure"),
        Err(collsched::backend::WaitError::Failed { error, ops }) => (error, ops),
        Err(e) => panic!("unexpected: {e}"),
    }
}

#[test]
fn panicking_rank_fails_the_others_at_once() {
    let w = world(3, LONG);
    let out = w
        .run(|rank| {
            if rank.rank() == 1 {
                panic!("rank 1 falls over before its first all-gather");
            }
            let f = all_gather(&rank, 3, 17, ElemType::F32).expect("launch");
            wait_err(f).0
        })
        .expect("ranks");
    assert!(out[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        let e = out[r].as_ref().expect("no panic");
        match e {
            BackendError::PeerFailed { rank, op, missing, reason } => {
                assert_eq!(*rank, r);
                assert_eq!(missing, &vec![1]);
                assert_eq!(op.desc.kind, CollectiveKind::AllGather);
                assert_eq!(op.desc.tag, 3);
                assert_eq!(op.seq, Some(0));
                assert!(reason.contains("panicked"), "{reason}");
                let msg = e.to_string();
                assert!(
                    msg.contains("all_gather") && msg.contains("[0, 1, 2]") && msg.contains("[1]"),
                    "{msg}"
                );
            }
            other => panic!("rank {r}: expected PeerFailed, got {other}"),
        }
    }
}

#[test]
fn rank_that_never_arrives_times_out_on_all_others() {
    let w = world(3, SHORT);
    let gate = Barrier::new(3);
    let out = w
        .run(|rank| {
            if rank.rank() == 2 {
                // Alive, but never launches: the others must time out.
                gate.wait();
                return None;
            }
            let f = all_gather(&rank, 5, 257, ElemType::BF16).expect("launch");
            let e = wait_err(f).0;
            gate.wait();
            Some(e)
        })
        .expect("ranks");
    let mut longest = Duration::ZERO;
    for r in [0, 1] {
        match out[r].as_ref().expect("no panic").as_ref().expect("an error") {
            BackendError::PeerTimeout { rank, op, missing, waited } => {
                assert_eq!(*rank, r);
                assert_eq!(missing, &vec![2]);
                assert_eq!(op.desc.tag, 5);
                assert_eq!(op.seq, Some(0));
                longest = longest.max(*waited);
            }
            other => panic!("rank {r}: expected PeerTimeout, got {other}"),
        }
    }
    // The rank that timed out waited the whole timeout; the other learnt it from that one.
    assert!(longest >= SHORT, "{longest:?}");
}

#[test]
fn mismatched_collectives_are_reported_on_all_ranks_and_not_executed() {
    // rank 0: all_gather of bucket 3; rank 1: reduce_scatter of bucket 2; same stream and group.
    let w = world(2, LONG);
    let out = w
        .run(|rank| {
            let count = 16;
            let mut input = rank.alloc(2 * count * 4).expect("alloc");
            input.as_bytes_mut().fill(7);
            let mut output = rank.alloc(2 * count * 4).expect("alloc");
            output.as_bytes_mut().fill(0xAB);
            let group = RankGroup::world(2);
            let desc = if rank.rank() == 0 {
                CollDesc::all_gather(group, ElemType::F32, count).with_tag(3)
            } else {
                CollDesc::reduce_scatter(group, ElemType::F32, count / 2).with_tag(2)
            };
            let f = rank
                .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
                .expect("launch");
            let (e, ops) = wait_err(f);
            assert!(
                ops[0].output.as_bytes().iter().all(|&b| b == 0xAB),
                "rank {}: output was written",
                rank.rank()
            );
            e
        })
        .expect("ranks");
    for (r, e) in out.iter().enumerate() {
        match e.as_ref().expect("no panic") {
            BackendError::Mismatch { rank, detail, op } => {
                assert_eq!(*rank, r);
                assert_eq!(op.seq, Some(0));
                assert!(
                    detail.contains("all_gather(tag 3") && detail.contains("reduce_scatter(tag 2"),
                    "{detail}"
                );
            }
            other => panic!("rank {r}: expected Mismatch, got {other}"),
        }
    }
}

#[test]
fn size_and_type_mismatches_are_detected() {
    for (count1, ty1) in [(18, ElemType::F32), (17, ElemType::F16)] {
        let w = world(3, LONG);
        let out = w
            .run(|rank| {
                let (count, ty) = if rank.rank() == 1 { (count1, ty1) } else { (17, ElemType::F32) };
                wait_err(all_gather(&rank, 1, count, ty).expect("launch")).0
            })
            .expect("ranks");
        for (r, e) in out.iter().enumerate() {
            assert!(
                matches!(e.as_ref().expect("no panic"), BackendError::Mismatch { .. }),
                "rank {r} ({count1} x {ty1:?}): {:?}",
                e
            );
        }
    }
}

#[test]
fn a_poisoned_channel_fails_later_collectives_at_once() {
    let w = world(2, LONG);
    let out = w
        .run(|rank| {
            let first = all_gather(&rank, 1, 8, if rank.rank() == 0 { ElemType::F32 } else { ElemType::F16 });
            let e1 = wait_err(first.expect("launch")).0;
            let second = all_gather(&rank, 2, 8, ElemType::F32).expect("launch");
            let e2 = wait_err(second).0;
            (e1, e2)
        })
        .expect("ranks");
    for o in out {
        let (e1, e2) = o.expect("no panic");
        assert!(matches!(e1, BackendError::Mismatch { .. }), "{e1}");
        match e2 {
            BackendError::Aborted { cause, .. } => assert!(matches!(*cause, BackendError::Mismatch { .. })),
            other => panic!("expected Aborted, got {other}"),
        }
    }
}

#[test]
fn late_arrival_after_a_timeout_gets_an_error_not_a_hang() {
    let w = world(2, SHORT);
    let first_failed = Arc::new(Barrier::new(2));
    let out = w
        .run(|rank| {
            if rank.rank() == 1 {
                first_failed.wait(); // arrive only after rank 0 timed out
            }
            let f = all_gather(&rank, 9, 4, ElemType::F32).expect("launch");
            let e = wait_err(f).0;
            if rank.rank() == 0 {
                first_failed.wait();
            }
            e
        })
        .expect("ranks");
    assert!(matches!(out[0].as_ref().expect("ok"), BackendError::PeerTimeout { .. }), "{:?}", out[0]);
    assert!(matches!(out[1].as_ref().expect("ok"), BackendError::PeerTimeout { .. }), "{:?}", out[1]);
}

#[test]
fn dropped_failed_flight_parks_its_error_for_the_next_call() {
    let w = world(2, LONG);
    let out = w
        .run(|rank| {
            if rank.rank() == 1 {
                return Ok(());
            }
            let f = all_gather(&rank, 4, 8, ElemType::F32).expect("launch");
            // Wait for the failure without taking the buffers, then drop the flight.
            let ev = f.event().clone();
            let failure = collsched::backend::BackendEvent::wait(&ev, LONG).expect_err("peer left");
            drop(f);
            match rank.alloc(64) {
                Err(e) => {
                    assert_eq!(e, failure);
                    rank.alloc(64).map(|_| ())
                }
                Ok(_) => panic!("the parked failure was not reported"),
            }
        })
        .expect("ranks");
    for o in out {
        o.expect("no panic").expect("after reporting once, alloc works again");
    }
}

#[test]
fn bad_launches_give_their_buffers_back() {
    let w = world(2, LONG);
    w.run(|rank| {
        let input = rank.alloc(16).expect("alloc");
        let output = rank.alloc(16).expect("alloc"); // needs 2 * 8 * 4 = 64
        let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 8);
        let err = rank
            .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
            .expect_err("too small");
        assert!(matches!(err.error, BackendError::InvalidCollective { .. }), "{}", err.error);
        assert!(err.error.to_string().contains("output buffer has 16 bytes but needs 64"), "{}", err.error);
        assert_eq!(err.ops.len(), 1);
        assert_eq!(err.ops[0].output.as_bytes().len(), 16);

        let output = rank.alloc(8).expect("alloc");
        let desc = CollDesc::reduce_scatter(RankGroup::world(2), ElemType::F32, 2);
        let err = rank
            .launch(Stream::ReduceScatter, &[], Collective { desc, input: None, output })
            .expect_err("in place");
        assert!(err.error.to_string().contains("needs an input"), "{}", err.error);

        let output = rank.alloc(8).expect("alloc");
        let desc = CollDesc::all_reduce(RankGroup::new(vec![5, 6]).expect("group"), ElemType::F32, 2);
        let err = rank
            .launch(Stream::ReduceScatter, &[], Collective { desc, input: None, output })
            .expect_err("not in world");
        assert!(err.error.to_string().contains("not in this world"), "{}", err.error);

        assert!(RankGroup::new(vec![1, 1]).is_err());
        assert!(RankGroup::new(Vec::new()).is_err());
    })
    .expect("ranks")
    .into_iter()
    .for_each(|o| o.expect("no panic"));
}

#[test]
fn a_rank_that_panics_after_launching_still_completes_what_it_launched() {
    let w = world(2, LONG);
    let out = w
        .run(|rank| {
            let first = all_gather(&rank, 1, 4099, ElemType::F32).expect("launch");
            if rank.rank() == 1 {
                // Unwinding drops the in-flight value (its buffers are deferred to the pool, not
                // freed under the peer) and then the handle (its stream finishes the queue).
                panic!("rank 1 dies with a collective in flight");
            }
            let done = first.wait(LONG).map_err(|e| e.into_error());
            let second = all_gather(&rank, 2, 17, ElemType::F32).expect("launch");
            (done.map(|ops| ops[0].output.as_bytes().to_vec()), wait_err(second).0)
        })
        .expect("ranks");
    assert!(out[1].is_err());
    let (first, second) = out.into_iter().next().expect("rank 0").expect("no panic");
    let bytes = first.expect("the collective rank 1 launched before dying completes");
    assert!(bytes[..4099 * 4].iter().all(|&b| b == 1) && bytes[4099 * 4..].iter().all(|&b| b == 2));
    match second {
        BackendError::PeerFailed { missing, op, reason, .. } => {
            assert_eq!(missing, vec![1]);
            assert_eq!(op.seq, Some(1));
            assert!(reason.contains("panicked"), "{reason}");
        }
        other => panic!("expected PeerFailed, got {other}"),
    }
}

#[test]
fn a_rank_that_drops_its_handle_is_reported_as_gone() {
    let w = world(2, LONG);
    let out = w
        .run(|rank| {
            if rank.rank() == 1 {
                return None; // the handle drops here, without a panic
            }
            Some(wait_err(all_gather(&rank, 0, 1, ElemType::BF16).expect("launch")).0)
        })
        .expect("ranks");
    match out[0].as_ref().expect("no panic").as_ref().expect("rank 0 reports") {
        BackendError::PeerFailed { missing, reason, .. } => {
            assert_eq!(missing, &vec![1]);
            assert!(reason.contains("dropped"), "{reason}");
        }
        other => panic!("expected PeerFailed, got {other}"),
    }
}
