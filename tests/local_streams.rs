//! Streams and events of the local backend (the single-rank tests also on an shm rank, which
//! shares the stream machinery): in-order execution, cross-stream and cross-rank
//! events, launches after events, host waits, the pool.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalEvent, LocalWorld};
use collsched::backend::{
    Backend, BackendError, BackendEvent, CollDesc, Collective, RankGroup, Stream, WaitError,
};
use collsched::kernels::ElemType;

const WAIT: Duration = Duration::from_secs(20);

/// Rank 0 of a one-rank world of `backend` (`local`, or `shm`: this process alone), and what
/// must outlive it.
fn one_rank(backend: &str) -> (collsched::backend::local::LocalRank, Box<dyn std::any::Any>) {
    match backend {
        "shm" => {
            let env = collsched::bootstrap::LaunchEnv::single(format!("streams-{}", std::process::id()));
            let config = collsched::backend::shm::ShmConfig {
                arena_bytes: 64 << 20,
                local: LocalConfig { timeout: WAIT, ..LocalConfig::default() },
                ..Default::default()
            };
            let (rank, hub) = collsched::backend::shm::join(&env, &config).expect("shm rank");
            (rank, Box::new(hub))
        }
        _ => {
            let w = world(1);
            (w.rank(0).expect("rank"), Box::new(w))
        }
    }
}

fn world(n: usize) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout: WAIT, ..LocalConfig::default() }).expect("world")
}

#[test]
fn work_on_one_stream_runs_in_launch_order() {
    for backend in ["local", "shm"] {
        let (rank, _keep) = one_rank(backend);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut events = Vec::new();
        for i in 0..200 {
            let log = Arc::clone(&log);
            events.push(rank.enqueue_host(Stream::Compute, move || {
                log.lock().expect("log").push(i);
                Ok(())
            }));
        }
        let last = rank.record(Stream::Compute).expect("record");
        last.wait(WAIT).expect("done");
        for e in events {
            assert!(e.expect("enqueued").query().expect("no failure"));
        }
        assert_eq!(*log.lock().expect("log"), (0..200).collect::<Vec<_>>());
    }
}

#[test]
fn a_stream_waits_for_an_event_of_another_stream() {
    for backend in ["local", "shm"] {
        let (rank, _keep) = one_rank(backend);
        let (open_tx, open_rx) = mpsc::channel::<()>();
        let value = Arc::new(Mutex::new(0));
        // Compute stream: blocked until the test opens the gate, then writes 42.
        let v = Arc::clone(&value);
        rank.enqueue_host(Stream::Compute, move || {
            open_rx.recv().map_err(|_| BackendError::Unsupported { what: "gate dropped".into() })?;
            *v.lock().expect("value") = 42;
            Ok(())
        })
        .expect("enqueue");
        let produced = rank.record(Stream::Compute).expect("record");
        // All-gather stream: waits for that event, then reads the value.
        rank.wait_event(Stream::AllGather, &produced).expect("wait_event");
        let seen = Arc::new(Mutex::new(None));
        let s = Arc::clone(&seen);
        let v = Arc::clone(&value);
        let consumed = rank
            .enqueue_host(Stream::AllGather, move || {
                *s.lock().expect("seen") = Some(*v.lock().expect("value"));
                Ok(())
            })
            .expect("enqueue");
        // Other streams are not held up by the compute stream.
        rank.synchronize(Stream::ReduceScatter, WAIT).expect("independent stream");
        assert!(!consumed.query().expect("pending"), "ran before the event it waits for");
        assert!(matches!(consumed.wait(Duration::from_millis(1)), Err(BackendError::EventTimeout { .. })));
        open_tx.send(()).expect("open");
        consumed.wait(WAIT).expect("done");
        assert_eq!(*seen.lock().expect("seen"), Some(42));
    }
}

#[test]
fn a_launch_waits_for_its_after_events_and_events_cross_ranks() {
    // Rank 1 produces its all-gather input on its compute stream, behind a gate, and launches the
    // all-gather after that event; rank 0's all-gather must wait too (through the collective), and
    // rank 0's reduce-scatter stream waits on rank 1's event directly.
    let w = world(2);
    let (ev_tx, ev_rx) = mpsc::channel::<LocalEvent>();
    let ev_rx = Mutex::new(ev_rx);
    let (gate_tx, gate_rx) = mpsc::channel::<()>();
    let gate_rx = Mutex::new(Some(gate_rx));
    let out = w
        .run(|rank| -> Result<Vec<u8>, BackendError> {
            let me = rank.rank();
            let count = 257;
            let mut input = rank.alloc(count * 4)?;
            let output = rank.alloc(2 * count * 4)?;
            let mut after = Vec::new();
            if me == 1 {
                // Fill the input on the compute stream once the gate opens.
                let gate = gate_rx.lock().expect("gate").take().expect("one gate");
                let fill_at = input.as_bytes_mut().as_mut_ptr() as usize;
                let filled = rank.enqueue_host(Stream::Compute, move || {
                    gate.recv().map_err(|_| BackendError::Unsupported { what: "gate dropped".into() })?;
                    // SAFETY: the buffer outlives this closure (the launch below waits for this
                    // event before reading it, and the test waits for the launch), and nothing else
                    // touches it meanwhile.
                    unsafe { std::ptr::write_bytes(fill_at as *mut u8, 9, count * 4) };
                    Ok(())
                })?;
                ev_tx.send(filled.clone()).expect("send event");
                after.push(filled);
            } else {
                input.as_bytes_mut().fill(1);
                // Rank 0's reduce-scatter stream waits on rank 1's event.
                let remote = ev_rx.lock().expect("rx").recv().expect("event");
                rank.wait_event(Stream::ReduceScatter, &remote)?;
            }
            let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, count);
            let f = rank
                .launch(Stream::AllGather, &after, Collective { desc, input: Some(input), output })
                .map_err(|e| e.error)?;
            if me == 0 {
                let rs_done = rank.record(Stream::ReduceScatter)?;
                assert!(!f.is_done()?, "the all-gather finished before rank 1's input was produced");
                assert!(!rs_done.query()?, "rank 0's stream passed rank 1's pending event");
                gate_tx.send(()).expect("open gate");
                rs_done.wait(WAIT)?;
            }
            let done = f.wait(WAIT).map_err(|e| e.into_error())?;
            Ok(done[0].output.as_bytes().to_vec())
        })
        .expect("ranks");
    let want = [vec![1u8; 257 * 4], vec![9u8; 257 * 4]].concat();
    for o in out {
        assert_eq!(o.expect("no panic").expect("ok"), want);
    }
}

#[test]
fn a_failed_dependency_fails_the_launch_on_every_rank_quickly() {
    let w = world(2);
    let out = w
        .run(|rank| {
            let mut after = Vec::new();
            if rank.rank() == 1 {
                let failing = rank
                    .enqueue_host(Stream::Compute, || {
                        Err(BackendError::Unsupported { what: "copy-in broke".into() })
                    })
                    .expect("enqueue");
                after.push(failing);
            }
            let input = rank.alloc(8).expect("alloc");
            let output = rank.alloc(16).expect("alloc");
            let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 2);
            let f = rank
                .launch(Stream::AllGather, &after, Collective { desc, input: Some(input), output })
                .expect("launch");
            match f.wait(WAIT) {
                Err(WaitError::Failed { error, .. }) => error,
                other => panic!("expected a failure, got {:?}", other.map(|v| v.len())),
            }
        })
        .expect("ranks");
    let e0 = out[0].as_ref().expect("no panic");
    assert!(matches!(e0, BackendError::PeerFailed { missing, .. } if missing == &vec![1]), "{e0}");
    assert!(e0.to_string().contains("copy-in broke"), "{e0}");
    let e1 = out[1].as_ref().expect("no panic");
    assert!(matches!(e1, BackendError::Aborted { .. }), "{e1}");
}

#[test]
fn wait_with_timeout_gives_the_flight_back() {
    let w = world(2);
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let out = w
        .run(|rank| {
            if rank.rank() == 1 {
                go_rx.lock().expect("rx").recv().expect("go");
            }
            let input = rank.alloc(4).expect("alloc");
            let output = rank.alloc(8).expect("alloc");
            let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 1);
            let f = rank
                .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
                .expect("launch");
            let f = if rank.rank() == 0 {
                match f.wait(Duration::from_millis(5)) {
                    Err(WaitError::TimedOut { in_flight, waited }) => {
                        assert!(waited >= Duration::from_millis(5));
                        go_tx.send(()).expect("go");
                        in_flight
                    }
                    other => panic!("expected TimedOut, got {:?}", other.map(|v| v.len())),
                }
            } else {
                f
            };
            f.wait(WAIT).expect("completes").len()
        })
        .expect("ranks");
    assert!(out.into_iter().all(|o| o.ok() == Some(1)));
}

#[test]
fn steady_state_steps_allocate_nothing() {
    let w = world(2);
    let out = w
        .run(|rank| {
            let mut fresh_after_first = 0;
            for step in 0..5 {
                for count in [17usize, 4099] {
                    let input = rank.alloc(count * 2).expect("alloc");
                    let output = rank.alloc(2 * count * 2).expect("alloc");
                    let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::BF16, count);
                    let f = rank
                        .launch(Stream::AllGather, &[], Collective { desc, input: Some(input), output })
                        .expect("launch");
                    let done = f.event().clone();
                    // The scheduler's deferred free: give everything back after the event.
                    drop(f);
                    let c = rank.alloc(16).expect("alloc"); // unrelated scratch, freed at once
                    rank.free(c, Some(&done));
                    done.wait(WAIT).expect("done");
                }
                if step == 0 {
                    fresh_after_first = rank.fresh_allocations();
                }
            }
            (fresh_after_first, rank.fresh_allocations())
        })
        .expect("ranks");
    for o in out {
        let (first, last) = o.expect("no panic");
        assert!(first > 0);
        assert_eq!(first, last, "steps after the first allocated fresh buffers");
    }
}

#[test]
fn deferred_free_holds_the_buffer_until_its_event() {
    for backend in ["local", "shm"] {
        let (rank, _keep) = one_rank(backend);
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let gate = rank
            .enqueue_host(Stream::Compute, move || {
                go_rx.recv().map_err(|_| BackendError::Unsupported { what: "gate".into() })
            })
            .expect("enqueue");
        let b = rank.alloc(1000).expect("alloc");
        let addr = b.as_bytes().as_ptr();
        rank.free(b, Some(&gate));
        let c = rank.alloc(1000).expect("alloc");
        assert_ne!(c.as_bytes().as_ptr(), addr, "reused a buffer whose event is pending");
        go_tx.send(()).expect("go");
        gate.wait(WAIT).expect("done");
        let d = rank.alloc(1000).expect("alloc");
        assert_eq!(d.as_bytes().as_ptr(), addr, "the buffer came back to the pool after its event");
        drop(c);
    }
}
