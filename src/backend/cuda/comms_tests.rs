//! The communicator table's failure handling on fake communicators: asynchronous errors,
//! aborts, and what later launches and watches see.

use std::sync::atomic::AtomicUsize;

use collsched_kernels::ElemType;

use super::super::nccl::{result_name, NcclCallError};
use super::*;

/// A fake communicator: its asynchronous status is set by the test; aborts are counted.
struct FakeComm {
    status: Arc<Mutex<Option<i32>>>,
    aborts: Arc<AtomicUsize>,
}

impl Comm for FakeComm {
    fn async_error(&self, site: CallSite) -> Result<(), NcclError> {
        match *lock(&self.status) {
            None => Ok(()),
            Some(code) => Err(NcclError::Call(Box::new(NcclCallError {
                site,
                api: "a previous collective (ncclCommGetAsyncError)",
                code,
                code_name: result_name(code),
                message: "remote process exited or there was a network error".into(),
                last_error: "NET/IB : Got completion from peer with error 12".into(),
            }))),
        }
    }

    fn abort(self) -> Result<(), NcclError> {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

struct Fixture {
    table: Arc<CommTable<FakeComm>>,
    status: HashMap<(RankGroup, Stream), Arc<Mutex<Option<i32>>>>,
    aborts: HashMap<(RankGroup, Stream), Arc<AtomicUsize>>,
    pair: RankGroup,
    world: RankGroup,
}

const PATIENCE: Duration = Duration::from_secs(300);

/// Rank 0 of 4, with the world and the pair {0, 1}, on every stream.
fn fixture() -> Fixture {
    let world = RankGroup::world(4);
    let pair = RankGroup::new(vec![0, 1]).unwrap();
    let (mut comms, mut status, mut aborts) = (HashMap::new(), HashMap::new(), HashMap::new());
    for g in [&world, &pair] {
        for s in Stream::ALL {
            let st = Arc::new(Mutex::new(None));
            let ab = Arc::new(AtomicUsize::new(0));
            comms.insert((g.clone(), s), FakeComm { status: Arc::clone(&st), aborts: Arc::clone(&ab) });
            status.insert((g.clone(), s), st);
            aborts.insert((g.clone(), s), ab);
        }
    }
    Fixture { table: Arc::new(CommTable::new(0, comms, ErrorPark::new())), status, aborts, pair, world }
}

impl Fixture {
    fn fail(&self, g: &RankGroup, s: Stream, code: i32) {
        *lock(&self.status[&(g.clone(), s)]) = Some(code);
    }
    fn aborts(&self, g: &RankGroup, s: Stream) -> usize {
        self.aborts[&(g.clone(), s)].load(Ordering::SeqCst)
    }
    fn launch(&self, g: &RankGroup, s: Stream, tag: u64) -> Result<CollRef, BackendError> {
        let desc = CollDesc::all_gather(g.clone(), ElemType::F32, 16).with_tag(tag);
        self.table.launch(&desc, s).map(|l| l.op.clone())
    }
}

#[test]
fn an_async_error_ends_a_watched_wait_naming_the_collective_and_aborts_its_group_and_stream() {
    let f = fixture();
    let first = f.launch(&f.pair, Stream::AllGather, 3).unwrap();
    assert_eq!(first.seq, Some(0));
    let op = f.launch(&f.pair, Stream::AllGather, 4).unwrap();
    assert_eq!(op.seq, Some(1), "collectives are numbered per (group, stream)");
    f.launch(&f.pair, Stream::ReduceScatter, 4).unwrap();
    f.launch(&f.world, Stream::AllGather, 5).unwrap();
    let watch = Watch::new(&f.table, Scope::collective(op.clone()), PATIENCE);
    assert_eq!(watch.check(), Ok(()), "no failure yet");

    f.fail(&f.pair, Stream::AllGather, 6); // ncclRemoteError
    let e = watch.check().unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, BackendError::Device { rank: 0, .. }), "{e:?}");
    for part in [
        "rank 0",
        "all_gather",
        "tag 4",
        "stream all_gather",
        "sequence number 1",
        "ncclRemoteError",
        "NET/IB",
    ] {
        assert!(s.contains(part), "the error should name {part:?}: {s}");
    }
    assert_eq!(f.aborts(&f.pair, Stream::AllGather), 1, "the failed (group, stream) was not aborted");
    for (g, st) in [(&f.pair, Stream::ReduceScatter), (&f.world, Stream::AllGather)] {
        assert_eq!(f.aborts(g, st), 0, "({g}, {st}) was aborted for another's failure");
    }

    // Later collectives on it fail with Aborted, carrying the first failure; others still run.
    match f.launch(&f.pair, Stream::AllGather, 6) {
        Err(BackendError::Aborted { rank: 0, op: Some(later), cause }) => {
            assert_eq!(later.desc.tag, 6);
            assert_eq!(*cause, e, "the cause must be the first failure");
        }
        other => panic!("a launch after the abort: {other:?}"),
    }
    assert!(matches!(watch.check(), Err(BackendError::Aborted { .. })));
    assert!(matches!(watch.aborted(), Some(BackendError::Aborted { .. })));
    assert_eq!(f.launch(&f.pair, Stream::ReduceScatter, 6).unwrap().seq, Some(1));
    assert_eq!(f.launch(&f.world, Stream::AllGather, 6).unwrap().seq, Some(1));
    assert!(f.table.any_aborted());
}

#[test]
fn a_wait_that_gave_up_after_the_timeout_aborts_a_poll_or_short_wait_does_not() {
    let f = fixture();
    let op = f.launch(&f.world, Stream::ReduceScatter, 9).unwrap();
    let watch = Watch::new(&f.table, Scope::collective(op), PATIENCE);
    for short in [Duration::ZERO, Duration::from_millis(20), PATIENCE - Duration::from_millis(1)] {
        assert!(!watch.abort_after_timeout(short), "a wait of {short:?} aborted");
    }
    assert_eq!(f.aborts(&f.world, Stream::ReduceScatter), 0);
    assert!(f.launch(&f.world, Stream::ReduceScatter, 10).is_ok());

    assert!(watch.abort_after_timeout(PATIENCE));
    assert_eq!(f.aborts(&f.world, Stream::ReduceScatter), 1);
    match f.launch(&f.world, Stream::ReduceScatter, 11) {
        Err(BackendError::Aborted { cause, .. }) => {
            let s = cause.to_string();
            assert!(s.contains("not complete after 300s") && s.contains("all_gather(tag 9"), "{s}");
        }
        other => panic!("{other:?}"),
    }
    // A second timeout aborts nothing more and keeps the first cause.
    watch.abort_after_timeout(PATIENCE * 2);
    assert_eq!(f.aborts(&f.world, Stream::ReduceScatter), 1, "a communicator was aborted twice");
}

#[test]
fn a_stream_wide_watch_checks_and_aborts_only_communicators_that_launched() {
    let f = fixture();
    let watch = Watch::new(&f.table, Scope::streams(&[Stream::AllGather]), PATIENCE);
    f.fail(&f.pair, Stream::AllGather, 6);
    assert_eq!(watch.check(), Ok(()), "a communicator that never launched has nothing of ours to fail");
    assert!(!watch.abort_after_timeout(PATIENCE), "nothing launched on the stream, nothing to abort");
    assert_eq!(f.aborts(&f.pair, Stream::AllGather) + f.aborts(&f.world, Stream::AllGather), 0);

    f.launch(&f.world, Stream::AllGather, 1).unwrap();
    assert_eq!(watch.check(), Ok(()), "the world's communicator has no error");
    f.launch(&f.pair, Stream::AllGather, 1).unwrap();
    let e = watch.check().unwrap_err();
    assert!(e.to_string().contains("work on stream all_gather"), "{e}");
    assert_eq!(f.aborts(&f.pair, Stream::AllGather), 1);
    assert_eq!(f.aborts(&f.world, Stream::AllGather), 0, "only the failed group's communicator is aborted");
}

#[test]
fn a_communicator_busy_with_a_launch_is_checked_later_not_waited_for() {
    let f = fixture();
    let op = f.launch(&f.pair, Stream::AllGather, 1).unwrap();
    let watch = Watch::new(&f.table, Scope::collective(op), PATIENCE);
    f.fail(&f.pair, Stream::AllGather, 6);
    let desc = CollDesc::all_gather(f.pair.clone(), ElemType::F32, 16).with_tag(2);
    let launching = f.table.launch(&desc, Stream::AllGather).unwrap();
    assert!(launching.comm().is_some());
    // Holding the communicator (as a launch does from ncclGroupStart to ncclGroupEnd) on this
    // very thread: a check that locked it would deadlock here.
    assert_eq!(watch.check(), Ok(()));
    drop(launching);
    assert!(watch.check().is_err());
}

#[test]
fn teardown_aborts_every_communicator_once() {
    let f = fixture();
    let cause = BackendError::Shutdown { rank: 0, what: "teardown could not drain the streams".into() };
    f.table.abort_all(cause.clone());
    f.table.abort_all(cause);
    for g in [&f.world, &f.pair] {
        for s in Stream::ALL {
            assert_eq!(f.aborts(g, s), 1, "({g}, {s})");
        }
    }
}

#[test]
fn a_watch_outliving_its_table_does_nothing() {
    let f = fixture();
    let op = f.launch(&f.pair, Stream::AllGather, 1).unwrap();
    let watch = Watch::new(&f.table, Scope::collective(op), PATIENCE);
    f.fail(&f.pair, Stream::AllGather, 6);
    let aborts = Arc::clone(&f.aborts[&(f.pair.clone(), Stream::AllGather)]);
    drop(f);
    assert_eq!(watch.check(), Ok(()));
    assert_eq!(watch.aborted(), None);
    assert!(!watch.abort_after_timeout(PATIENCE));
    assert_eq!(aborts.load(Ordering::SeqCst), 0);
}
