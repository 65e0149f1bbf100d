//! loom model checks of the local backend's synchronisation (`sync.rs` swaps in loom's
//! primitives): every interleaving of the threads below, with loom's default preemption bound.
//! Run by `ci/loom.sh` (`RUSTFLAGS="--cfg loom" cargo test --lib --release loom_`).
//!
//! A lost wake-up shows up as a deadlock loom reports (timed waits are untimed under loom), a
//! wrong result or a missing error as a failed assertion in some interleaving.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use collsched_kernels::ElemType;
use loom::thread;
use smallvec::smallvec;

use super::buffer::Pool;
use super::event::{EventPool, LocalEvent};
use super::moves::{OpPost, Post, RawPtr};
use super::rendezvous::{Arrival, Caller, Channel, Departures};
use super::stream::{Queue, Work};
use super::sync::AtomicBool;
use super::LocalConfig;
use crate::backend::{BackendError, BackendEvent, CollDesc, CollRef, RankGroup, Stream};

/// Long enough never to pass (and timed waits are untimed under loom anyway).
const WAIT: Duration = Duration::from_secs(3600);

fn config() -> LocalConfig {
    // `piece_bytes` 0: one element a piece, so that two members share a reduction's pieces.
    LocalConfig { timeout: WAIT, spin: Duration::ZERO, piece_bytes: 0, ..LocalConfig::default() }
}

/// A completion on one thread wakes a waiter on another, whichever comes first.
#[test]
fn loom_event_completion_wakes_its_waiter() {
    loom::model(|| {
        let event = LocalEvent::new(Duration::ZERO);
        let waiter = {
            let e = event.clone();
            thread::spawn(move || e.wait(WAIT))
        };
        event.complete(Ok(()));
        assert!(waiter.join().expect("waiter").is_ok());
        assert!(event.query().expect("done"));
    });
}

/// A failure reaches the waiter with its error, published before the state.
#[test]
fn loom_event_failure_reaches_its_waiter() {
    loom::model(|| {
        let event = LocalEvent::new(Duration::ZERO);
        let completer = {
            let e = event.clone();
            thread::spawn(move || e.complete(Err(BackendError::Internal { what: "injected".into() })))
        };
        match event.wait(WAIT) {
            Err(BackendError::Internal { what }) => assert_eq!(what, "injected"),
            other => panic!("expected the injected failure, got {other:?}"),
        }
        completer.join().expect("completer");
    });
}

/// The event pool resets an event only when nobody else holds it: a waiter still holding a
/// completed event never sees it pending again (it would sleep for ever), and what `get` hands
/// out is pending.
#[test]
fn loom_event_pool_never_resets_a_held_event() {
    loom::model(|| {
        let pool = EventPool::new(Duration::ZERO);
        let first = pool.get();
        let waiter = {
            let e = first.clone();
            thread::spawn(move || {
                let r = e.wait(WAIT);
                let still_done = e.query();
                (r, still_done)
            })
        };
        first.complete(Ok(()));
        drop(first);
        let second = pool.get();
        assert!(!second.query().expect("a fresh event"), "get handed out a completed event");
        let (r, still_done) = waiter.join().expect("waiter");
        assert!(r.is_ok());
        assert!(still_done.expect("done"), "the waiter's event was reset under it");
    });
}

/// A stream queue delivers every item in order and ends after `close`, whether the stream
/// thread is asleep or not when items come.
#[test]
fn loom_queue_delivers_in_order_then_ends() {
    loom::model(|| {
        let queue = Arc::new(Queue::new());
        let events = [LocalEvent::new(Duration::ZERO), LocalEvent::new(Duration::ZERO)];
        let producer = {
            let q = Arc::clone(&queue);
            let events = events.clone();
            thread::spawn(move || {
                for e in events {
                    assert!(q.send(Work::Record(e)).is_ok());
                }
                q.close();
            })
        };
        let mut seen = 0;
        while let Some(work) = queue.recv() {
            match work {
                Work::Record(e) => {
                    // In order: every earlier event was completed already.
                    assert!(events[..seen].iter().all(|x| x.query().unwrap_or(false)));
                    assert!(!e.query().expect("pending"));
                    e.complete(Ok(()));
                    seen += 1;
                }
                _ => panic!("only records were sent"),
            }
        }
        producer.join().expect("producer");
        assert_eq!(seen, 2);
    });
}

/// One member of a two-member channel: an all-reduce (sum) of two f32 elements, or an
/// all-gather of one when `gather`, or a failed arrival when `fail`.
struct Member {
    rank: usize,
    input: Vec<f32>,
    output: Vec<f32>,
    gather: bool,
    fail: bool,
}

impl Member {
    fn new(rank: usize) -> Self {
        let base = rank as f32 * 10.0;
        Member { rank, input: vec![base + 1.0, base + 2.0], output: vec![0.0; 2], gather: false, fail: false }
    }

    fn desc(&self, n: usize) -> CollDesc {
        if self.gather {
            CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 1)
        } else {
            CollDesc::all_reduce(RankGroup::world(n), ElemType::F32, 2)
        }
    }

    /// Takes part in collective 0 of `channel`.
    fn run(&mut self, channel: &Channel, n: usize) -> Result<(), BackendError> {
        let desc = self.desc(n);
        let op = CollRef { desc: desc.clone(), stream: Stream::ReduceScatter, seq: Some(0) };
        let arrival = if self.fail {
            Arrival::Failed(BackendError::Internal { what: format!("rank {} failed before", self.rank) })
        } else {
            let post: Post = smallvec![OpPost {
                desc,
                src: RawPtr(self.input.as_mut_ptr().cast()),
                dst: RawPtr(self.output.as_mut_ptr().cast()),
                private: false,
            }];
            Arrival::Ops(post)
        };
        let config = config();
        let caller = Caller { rank: self.rank, config: &config, spin: false };
        channel.run(&caller, 0, arrival, &op)
    }
}

fn channel(n: usize) -> (Arc<Channel>, Arc<Departures>) {
    let departures = Arc::new(Departures::new(n));
    (Arc::new(Channel::new(RankGroup::world(n), Stream::ReduceScatter, Arc::clone(&departures))), departures)
}

/// Runs `members` on one channel, member 0 on the model's main thread; returns each member's
/// result and output.
fn meet(members: Vec<Member>) -> Vec<(Result<(), BackendError>, Vec<f32>)> {
    let n = members.len();
    let (chan, _) = channel(n);
    let mut members = members.into_iter();
    let mut first = members.next().expect("a member");
    let peers: Vec<_> = members
        .map(|mut m| {
            let c = Arc::clone(&chan);
            thread::spawn(move || {
                let r = m.run(&c, n);
                (r, m.output)
            })
        })
        .collect();
    let r = first.run(&chan, n);
    let mut out = vec![(r, first.output)];
    out.extend(peers.into_iter().map(|p| p.join().expect("member thread")));
    out
}

/// Two members of an all-reduce meet, share its pieces and the middle barrier, and both leave
/// with the sum, in every interleaving.
#[test]
fn loom_rendezvous_all_reduce_meets_and_sums() {
    loom::model(|| {
        for (r, out) in meet(vec![Member::new(0), Member::new(1)]) {
            assert!(r.is_ok(), "{r:?}");
            assert_eq!(out, vec![12.0, 14.0]);
        }
    });
}

/// Members posting different collectives both fail with the mismatch, and nothing was written.
#[test]
fn loom_rendezvous_mismatch_fails_every_member() {
    loom::model(|| {
        let mut other = Member::new(1);
        other.gather = true;
        for (i, (r, out)) in meet(vec![Member::new(0), other]).into_iter().enumerate() {
            match r {
                Err(BackendError::Mismatch { rank, detail, .. }) => {
                    assert_eq!(rank, i);
                    assert!(detail.contains("rank 0") && detail.contains("rank 1"), "{detail}");
                }
                other => panic!("member {i}: expected a mismatch, got {other:?}"),
            }
            assert_eq!(out, vec![0.0, 0.0], "member {i}: an aborted collective wrote its output");
        }
    });
}

/// A member that arrives failed (its stream failed earlier) aborts the slot: the other member,
/// arriving before or after it, fails naming it, and nothing was written.
#[test]
fn loom_rendezvous_failed_arrival_aborts_the_other_member() {
    loom::model(|| {
        let mut failed = Member::new(1);
        failed.fail = true;
        let out = meet(vec![Member::new(0), failed]);
        match &out[0].0 {
            Err(BackendError::PeerFailed { missing, .. }) => assert_eq!(missing, &vec![1]),
            Err(BackendError::Aborted { cause, .. }) => {
                assert!(cause.to_string().contains("rank 1 failed before"), "{cause}")
            }
            other => panic!("member 0: expected the failure of rank 1, got {other:?}"),
        }
        assert_eq!(out[0].1, vec![0.0, 0.0]);
        assert!(matches!(out[1].0, Err(BackendError::Aborted { .. })), "{:?}", out[1].0);
    });
}

/// Three members, one of them failed: however the arrivals interleave (the failed one last, so
/// that the others already wait; or first, before the last arriver could freeze the posts),
/// every member fails and none moves data.
#[test]
fn loom_rendezvous_abort_among_three_arrivals() {
    loom::model(|| {
        let mut failed = Member::new(2);
        failed.fail = true;
        let out = meet(vec![Member::new(0), Member::new(1), failed]);
        for (i, (r, data)) in out.iter().enumerate() {
            assert!(r.is_err(), "member {i} succeeded beside a failed member");
            assert_eq!(data, &vec![0.0, 0.0], "member {i} moved data in an aborted slot");
        }
    });
}

/// A member whose peer's stream leaves for good (its handle dropped) stops waiting: the
/// departure and the wake-up race its arrival, and it fails naming the peer, never sleeps on.
#[test]
fn loom_rendezvous_departed_peer_wakes_the_waiter() {
    loom::model(|| {
        let (chan, departures) = channel(2);
        let leaver = {
            let c = Arc::clone(&chan);
            thread::spawn(move || {
                departures.set_departed(1, Stream::ReduceScatter);
                c.poke();
            })
        };
        let r = Member::new(0).run(&chan, 2);
        leaver.join().expect("leaver");
        match r {
            Err(BackendError::PeerFailed { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("expected rank 1 named as gone, got {other:?}"),
        }
    });
}

/// A deferred free: a buffer freed after an event comes back from the pool only once the event
/// completed, so a peer still reading it (before it completes the event) never sees it reused.
#[test]
fn loom_pool_reuses_a_deferred_free_only_after_its_event() {
    loom::model(|| {
        let pool = Pool::new(0, WAIT, None);
        let buffer = pool.alloc(64, 0).expect("alloc");
        let freed = buffer.as_ptr();
        let event = LocalEvent::new(Duration::ZERO);
        let reading = Arc::new(AtomicBool::new(true));
        pool.free(buffer, Some(&event), false);
        let peer = {
            let (e, reading) = (event.clone(), Arc::clone(&reading));
            thread::spawn(move || {
                reading.store(false, Ordering::Release);
                e.complete(Ok(()));
            })
        };
        let again = pool.alloc(64, 0).expect("alloc");
        if again.as_ptr() == freed {
            assert!(!reading.load(Ordering::Acquire), "reused while a peer still read it");
        }
        peer.join().expect("peer");
        // A fresh buffer exactly when the freed one was not yet free.
        assert_eq!(pool.allocations(), if again.as_ptr() == freed { 1 } else { 2 });
    });
}
