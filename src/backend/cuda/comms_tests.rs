//! The communicator table's failure handling on fake communicators: asynchronous errors,
//! aborts (off the caller's thread, every communicator of the rank for a peer's failure), and
//! what later launches and watches see.

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;

use collsched_kernels::ElemType;

use super::super::nccl::{result_name, NcclCallError};
use super::*;

/// How long a test waits for an abort's thread before failing (a bound against a hang, not a
/// timing: the fakes end at once, or when the test opens their gate).
const BOUND: Duration = Duration::from_secs(60);

/// Holds fake aborts until the test opens it.
#[derive(Default)]
struct AbortGate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl AbortGate {
    fn open(&self) {
        *lock(&self.open) = true;
        self.opened.notify_all();
    }

    /// Waits until opened (at most [`BOUND`]).
    fn pass(&self) {
        let g = lock(&self.open);
        let _ = self.opened.wait_timeout_while(g, BOUND, |open| !*open);
    }
}

/// Where a fake abort ran.
struct Started {
    thread: std::thread::ThreadId,
    name: Option<String>,
}

/// A fake communicator: its asynchronous status is set by the test; aborts are counted once
/// they end. With a gate, an abort first says where it runs, then blocks until the gate opens
/// (as `ncclCommAbort` blocks in `cudaFreeHost` while another communicator's kernels spin).
struct FakeComm {
    status: Arc<Mutex<Option<i32>>>,
    aborts: Arc<AtomicUsize>,
    gate: Option<(Arc<AbortGate>, mpsc::Sender<Started>)>,
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
        if let Some((gate, started)) = &self.gate {
            let me = std::thread::current();
            let _ = started.send(Started { thread: me.id(), name: me.name().map(str::to_owned) });
            gate.pass();
        }
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

/// Rank 0 of 4, with the world and the pair {0, 1}, on every stream; aborts end at once.
fn fixture() -> Fixture {
    fixture_with(None)
}

/// As [`fixture`], with aborts that block on `gate` after reporting where they run.
fn fixture_with(gate: Option<(Arc<AbortGate>, mpsc::Sender<Started>)>) -> Fixture {
    let world = RankGroup::world(4);
    let pair = RankGroup::new(vec![0, 1]).unwrap();
    let (mut comms, mut status, mut aborts) = (HashMap::new(), HashMap::new(), HashMap::new());
    for g in [&world, &pair] {
        for s in Stream::ALL {
            let st = Arc::new(Mutex::new(None));
            let ab = Arc::new(AtomicUsize::new(0));
            let fake = FakeComm { status: Arc::clone(&st), aborts: Arc::clone(&ab), gate: gate.clone() };
            comms.insert((g.clone(), s), fake);
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
    /// Aborts that ended on (g, s), once every abort started so far ended.
    fn aborts(&self, g: &RankGroup, s: Stream) -> usize {
        assert!(self.table.wait_aborts(BOUND), "an abort's thread did not end");
        self.aborts[&(g.clone(), s)].load(Ordering::SeqCst)
    }
    fn every(&self) -> Vec<(RankGroup, Stream)> {
        [&self.world, &self.pair].into_iter().flat_map(|g| Stream::ALL.map(|s| (g.clone(), s))).collect()
    }
    fn launch(&self, g: &RankGroup, s: Stream, tag: u64) -> Result<CollRef, BackendError> {
        let desc = CollDesc::all_gather(g.clone(), ElemType::F32, 16).with_tag(tag);
        self.table.launch(&desc, s).map(|l| l.op.clone())
    }
}

#[test]
fn an_async_error_ends_a_watched_wait_naming_the_collective_and_aborts_every_communicator_of_the_rank() {
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
    // A peer's failure: every communicator of the rank is aborted, once.
    for (g, st) in f.every() {
        assert_eq!(f.aborts(&g, st), 1, "({g}, {st}) was not aborted for a peer's failure");
    }

    // Later collectives on any (group, stream) fail with Aborted, carrying the first failure.
    for (g, st) in f.every() {
        match f.launch(&g, st, 6) {
            Err(BackendError::Aborted { rank: 0, op: Some(later), cause }) => {
                assert_eq!(later.desc.tag, 6);
                assert_eq!(*cause, e, "the cause must be the first failure");
            }
            other => panic!("a launch on ({g}, {st}) after the abort: {other:?}"),
        }
    }
    assert!(matches!(watch.check(), Err(BackendError::Aborted { .. })));
    assert!(matches!(watch.aborted(), Some(BackendError::Aborted { .. })));
    assert!(f.table.any_aborted());
    assert_eq!(f.table.aborts_pending(), 0);
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
    for (g, st) in f.every() {
        assert_eq!(
            f.aborts(&g, st),
            1,
            "({g}, {st}): a peer missing for the timeout aborts every communicator"
        );
    }
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
fn a_stream_wide_watch_checks_only_communicators_that_launched() {
    let f = fixture();
    let watch = Watch::new(&f.table, Scope::streams(&[Stream::AllGather]), PATIENCE);
    f.fail(&f.pair, Stream::AllGather, 6);
    assert_eq!(watch.check(), Ok(()), "a communicator that never launched has nothing of ours to fail");
    assert!(!watch.abort_after_timeout(PATIENCE), "nothing launched on the stream, nothing to abort");
    assert!(!f.table.any_aborted());

    f.launch(&f.world, Stream::AllGather, 1).unwrap();
    assert_eq!(watch.check(), Ok(()), "the world's communicator has no error");
    f.launch(&f.pair, Stream::AllGather, 1).unwrap();
    let e = watch.check().unwrap_err();
    assert!(e.to_string().contains("work on stream all_gather"), "{e}");
    for (g, st) in f.every() {
        assert_eq!(f.aborts(&g, st), 1, "({g}, {st})");
    }
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
    assert_eq!(f.aborts(&f.pair, Stream::AllGather), 1);
}

#[test]
fn an_abort_waiting_for_a_launch_takes_the_communicator_once_the_launch_let_go() {
    let f = fixture();
    let desc = CollDesc::all_gather(f.pair.clone(), ElemType::F32, 16).with_tag(1);
    let launching = f.table.launch(&desc, Stream::AllGather).unwrap();
    let cause = BackendError::Shutdown { rank: 0, what: "test".into() };
    // Returns at once although this very thread holds the communicator.
    f.table.abort_all(cause);
    assert!(launching.comm().is_some(), "the launch's communicator was taken from under it");
    drop(launching);
    assert_eq!(f.aborts(&f.pair, Stream::AllGather), 1);
    assert!(matches!(f.launch(&f.pair, Stream::AllGather, 2), Err(BackendError::Aborted { .. })));
}

#[test]
fn aborts_run_off_the_caller_s_thread_and_one_failure_starts_every_abort_of_the_rank() {
    // Every fake abort blocks until the gate opens, as ncclCommAbort does while kernels of
    // another communicator spin: a caller that ran one itself would never return.
    let gate = Arc::new(AbortGate::default());
    let (tx, started) = mpsc::channel();
    let f = fixture_with(Some((Arc::clone(&gate), tx)));
    let total = f.every().len();
    let op = f.launch(&f.pair, Stream::AllGather, 3).unwrap();
    let watch = Watch::new(&f.table, Scope::collective(op), PATIENCE);
    f.fail(&f.pair, Stream::AllGather, 6);

    let e = watch.check().unwrap_err();
    assert!(matches!(e, BackendError::Device { .. }), "{e:?}");
    // The caller is back while every abort is still blocked (none has ended)...
    let ended: usize = f.aborts.values().map(|a| a.load(Ordering::SeqCst)).sum();
    assert_eq!(ended, 0, "an abort ended before the gate opened: it did not block, or ran here");
    // ...and every abort of the rank started, each on a thread of its own, none waiting for
    // another (all of them are blocked at once).
    let me = std::thread::current().id();
    let mut threads = std::collections::HashSet::new();
    for k in 0..total {
        let s = started.recv_timeout(BOUND).unwrap_or_else(|_| {
            panic!("only {k} of {total} aborts started: an abort waits for another before it starts")
        });
        assert_ne!(s.thread, me, "an abort ran on the caller's thread");
        let name = s.name.unwrap_or_default();
        assert!(name.starts_with("collsched-abort"), "an abort's thread is named {name:?}");
        threads.insert(s.thread);
    }
    assert_eq!(threads.len(), total, "the aborts share threads");
    assert_eq!(f.table.aborts_pending(), total);
    assert!(aborts_running() >= total, "the process-wide count misses blocked aborts");
    // Launches fail at once meanwhile, and a second failure starts nothing more.
    for (g, st) in f.every() {
        assert!(matches!(f.launch(&g, st, 4), Err(BackendError::Aborted { .. })), "({g}, {st})");
    }
    assert!(matches!(watch.check(), Err(BackendError::Aborted { .. })));
    assert!(!f.table.wait_aborts(Duration::ZERO), "blocked aborts counted as ended");

    gate.open();
    for (g, st) in f.every() {
        assert_eq!(f.aborts(&g, st), 1, "({g}, {st})");
    }
    assert_eq!(f.table.aborts_pending(), 0);
    assert!(wait_for_aborts(BOUND), "the process-wide count kept an ended abort");
    assert!(started.try_recv().is_err(), "a communicator was aborted twice");
}

#[test]
fn a_failed_abort_is_parked() {
    struct Refuses;
    impl Comm for Refuses {
        fn async_error(&self, _: CallSite) -> Result<(), NcclError> {
            Ok(())
        }
        fn abort(self) -> Result<(), NcclError> {
            Err(NcclError::InvalidArgument { site: CallSite::op("comm_abort"), what: "refused".into() })
        }
    }
    let park = ErrorPark::new();
    let comms = HashMap::from([((RankGroup::world(2), Stream::AllGather), Refuses)]);
    let table = CommTable::new(1, comms, park.clone());
    table.abort_all(BackendError::Shutdown { rank: 1, what: "test".into() });
    assert!(table.wait_aborts(BOUND));
    let parked = park.take();
    assert_eq!(parked.len(), 1, "{parked:?}");
    for part in ["rank 1", "stream all_gather", "refused"] {
        assert!(parked[0].contains(part), "the parked error should name {part:?}: {}", parked[0]);
    }
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
