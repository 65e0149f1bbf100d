//! The local backend: `n` ranks as threads of one process.
//!
//! Each rank has one thread per [`Stream`] (started on first use) that runs the rank's work on
//! that stream in order. Events ([`LocalEvent`]) are completion fences any thread of any rank can
//! wait on. Collectives work directly on the members' buffers (shared memory, no staging copy):
//! an all-gather pulls each peer's shard straight into the output, a reduce-scatter reads each
//! member's contribution once and writes the reduced shard, an all-reduce is a reduce-scatter of
//! chunks into the outputs followed by an all-gather of the chunks, a broadcast copies from the
//! root. The rendezvous protocol that makes this safe is described in `rendezvous.rs`.
//!
//! [`Backend::launch_then`] (a collective chained behind an in-flight one, reading its output)
//! is the trait's stream-ordered implementation: the chained work item is queued right behind
//! the first on the same stream thread, fenced on the first's event (already complete when the
//! thread reaches it), and the first's other buffers wait in the pool's deferred frees for
//! that event. A buffer's memory does not move with the [`LocalBuffer`] value, which is what
//! lets the chained collective take the first one's output while it is still being written.
//!
//! # Failures
//! A member that panics, drops its handle, fails, or simply does not arrive makes every other
//! member of that collective fail with an error naming the op, the group, the missing ranks and
//! the sequence number: at once when the missing rank's stream has left for good (its handle was
//! dropped, for instance while unwinding from a panic), otherwise after [`LocalConfig::timeout`].
//! Members that post different collectives at the same sequence number all get
//! [`BackendError::Mismatch`], and nothing is executed.
//!
//! # Knobs
//! [`LocalConfig`]: `timeout` (default [`DEFAULT_TIMEOUT`], 300 s), `spin` (default
//! [`DEFAULT_SPIN`], 50 µs) and `piece_bytes` (default [`DEFAULT_PIECE_BYTES`], 1 MiB).
//!
//! # Shared reductions
//! A reduce-scatter's (or all-reduce's) reduction into one member's output is not that member's
//! job alone: it is cut into pieces of `piece_bytes` of output, and every member's stream thread,
//! once done with its own pieces, takes the pieces nobody has taken yet. The slowest member no
//! longer sets the pace (on two cores under load, one rank's thread is often descheduled for a
//! while), and nothing changes when the members keep pace. If a member fails (its kernel panics)
//! it may have left any member's output incomplete, so every other member of that collective
//! gets [`BackendError::PeerKernel`] naming it.

mod buffer;
mod event;
pub(crate) mod meeting;
pub(crate) mod moves;
pub(crate) mod rendezvous;
mod stream;
mod sync;

#[cfg(all(test, loom))]
mod loom_tests;

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use smallvec::SmallVec;

pub use buffer::{LocalBuffer, BUFFER_ALIGN};
pub use event::LocalEvent;

pub(crate) use self::buffer::HostMemory;
use self::buffer::Pool;
use self::event::EventPool;
use self::meeting::Meeting;
use self::moves::{OpPost, Post, RawPtr};
use self::rendezvous::Channels;
use self::stream::{HostFn, Queue, Work};
use crate::backend::flight::{FlightConfig, FlightDump, FlightRecorder};
use crate::backend::CollectiveKind;
use crate::backend::{
    Backend, BackendBuffer, BackendError, CollRef, Collective, InFlight, InvalidGroup, LaunchError, OnDrop,
    RankGroup, Stream,
};

/// Default of [`LocalConfig::timeout`]: 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Entries each per-rank and per-channel reuse pool (events, stream work queues, deferred
/// frees, rendezvous slots) holds from the start, so that a rank running a few collectives
/// further ahead than it did during warm-up (a loaded machine) still allocates nothing.
const PREFILL: usize = 32;
/// Default of [`LocalConfig::spin`]: 50 µs.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Default of [`LocalConfig::piece_bytes`]: 1 MiB.
pub const DEFAULT_PIECE_BYTES: usize = 1 << 20;

/// Knobs of a [`LocalWorld`].
#[derive(Clone, Debug, PartialEq)]
pub struct LocalConfig {
    /// How long a member of a collective waits for the others to arrive, and a stream waits for
    /// an event, before failing. Default [`DEFAULT_TIMEOUT`] (300 s); tests use a short one.
    pub timeout: Duration,
    /// How long a waiter spins before it sleeps, when the group has no more ranks than the
    /// machine has cores (otherwise it sleeps at once). Spinning buys small messages their few
    /// microseconds. Default [`DEFAULT_SPIN`] (50 µs).
    pub spin: Duration,
    /// Output bytes of one piece of a shared reduction (module docs, "Shared reductions"):
    /// large enough that handing out a piece (one atomic addition) costs nothing next to
    /// reducing it, small enough that the members finish within one piece's time of each other.
    /// Default [`DEFAULT_PIECE_BYTES`] (1 MiB); 0 counts as one element.
    pub piece_bytes: usize,
    /// The flight recorder's knobs (entries kept per rank, where failures write the record).
    /// Default [`FlightConfig::from_env`].
    pub flight: FlightConfig,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            timeout: DEFAULT_TIMEOUT,
            spin: DEFAULT_SPIN,
            piece_bytes: DEFAULT_PIECE_BYTES,
            flight: FlightConfig::from_env(),
        }
    }
}

/// What every rank and stream thread of a world shares.
pub(crate) struct WorldShared {
    n: usize,
    config: LocalConfig,
    cores: usize,
    meeting: Box<dyn Meeting>,
    claimed: Vec<AtomicBool>,
}

/// A world of `n` ranks living as threads of this process.
///
/// # Examples
/// ```
/// use collsched::backend::local::{LocalConfig, LocalWorld};
/// use collsched::backend::Backend;
///
/// let world = LocalWorld::with_config(3, LocalConfig::default())?;
/// let sizes = world.run(|rank| rank.world_size())?;
/// assert!(sizes.into_iter().all(|s| s.ok() == Some(3)));
/// # Ok::<(), collsched::backend::BackendError>(())
/// ```
pub struct LocalWorld {
    shared: Arc<WorldShared>,
}

impl LocalWorld {
    /// A world of `n` ranks with the default [`LocalConfig`].
    ///
    /// # Errors
    /// [`BackendError::InvalidGroup`] if `n == 0`.
    pub fn new(n: usize) -> Result<Self, BackendError> {
        Self::with_config(n, LocalConfig::default())
    }

    /// A world of `n` ranks.
    ///
    /// # Errors
    /// [`BackendError::InvalidGroup`] if `n == 0`.
    pub fn with_config(n: usize, config: LocalConfig) -> Result<Self, BackendError> {
        Self::with_meeting(n, config, Box::new(Channels::new(n)))
    }

    /// A world of `n` ranks whose collectives meet in `meeting` (in this process, or across
    /// processes for the `shm` backend).
    pub(crate) fn with_meeting(
        n: usize,
        config: LocalConfig,
        meeting: Box<dyn Meeting>,
    ) -> Result<Self, BackendError> {
        if n == 0 {
            return Err(BackendError::InvalidGroup(InvalidGroup {
                ranks: Vec::new(),
                what: "a local world needs at least one rank (LocalWorld::new(0))".into(),
            }));
        }
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        Ok(LocalWorld {
            shared: Arc::new(WorldShared {
                n,
                config,
                cores,
                meeting,
                claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            }),
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.n
    }

    /// The knobs.
    pub fn config(&self) -> &LocalConfig {
        &self.shared.config
    }

    /// The handle of rank `r`, to be used from that rank's thread. Each rank can be taken once;
    /// dropping the handle lets its streams finish their work and then leave the world (peers
    /// still waiting for it get [`BackendError::PeerFailed`]).
    ///
    /// # Errors
    /// [`BackendError::InvalidGroup`] if `r` is out of range or was already taken.
    pub fn rank(&self, r: usize) -> Result<LocalRank, BackendError> {
        self.rank_in(r, None)
    }

    /// [`LocalWorld::rank`] with buffers from `memory` (another process's view of them too).
    pub(crate) fn rank_in(
        &self,
        r: usize,
        memory: Option<Arc<dyn HostMemory>>,
    ) -> Result<LocalRank, BackendError> {
        let Some(flag) = self.shared.claimed.get(r) else {
            return Err(BackendError::InvalidGroup(InvalidGroup {
                ranks: vec![r],
                what: format!("rank {r} does not exist in a local world of {} ranks", self.shared.n),
            }));
        };
        if flag.swap(true, Ordering::SeqCst) {
            return Err(BackendError::InvalidGroup(InvalidGroup {
                ranks: vec![r],
                what: format!("rank {r} of this local world was already taken; each rank has one handle"),
            }));
        }
        let pool = Arc::new(Pool::new(r, self.shared.config.timeout, memory));
        let drop_pool = Arc::clone(&pool);
        let on_drop: OnDrop<LocalRank> =
            Arc::new(move |ops: Vec<Collective<LocalBuffer>>, event: &LocalEvent| {
                let mut park = true;
                for op in ops {
                    for buf in op.input.into_iter().chain(std::iter::once(op.output)) {
                        drop_pool.free(buf, Some(event), park);
                        park = false;
                    }
                }
            });
        Ok(LocalRank {
            rank: r,
            shared: Arc::clone(&self.shared),
            streams: Default::default(),
            pool,
            events: EventPool::new(self.shared.config.spin),
            on_drop,
            flight: Arc::new(FlightRecorder::new(r, self.shared.n, self.shared.config.flight.clone())),
        })
    }

    /// Runs `f` on every rank, each on a thread of its own, and returns each rank's outcome in
    /// rank order (`Err` holds the panic of a rank that panicked).
    ///
    /// # Errors
    /// [`BackendError::InvalidGroup`] if some rank was already taken with [`LocalWorld::rank`].
    pub fn run<T, F>(&self, f: F) -> Result<Vec<std::thread::Result<T>>, BackendError>
    where
        T: Send,
        F: Fn(LocalRank) -> T + Sync,
    {
        let ranks = (0..self.shared.n).map(|r| self.rank(r)).collect::<Result<Vec<_>, _>>()?;
        let f = &f;
        Ok(std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|rank| {
                    std::thread::Builder::new()
                        .name(format!("collsched-rank{}", rank.rank))
                        .spawn_scoped(s, move || f(rank))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join(),
                    Err(e) => {
                        Err(Box::new(format!("cannot start rank thread: {e}"))
                            as Box<dyn std::any::Any + Send>)
                    }
                })
                .collect()
        }))
    }
}

/// One rank of a [`LocalWorld`]: the [`Backend`] the engine of that rank uses.
pub struct LocalRank {
    rank: usize,
    shared: Arc<WorldShared>,
    streams: [OnceLock<Arc<Queue>>; 3],
    pool: Arc<Pool>,
    events: EventPool,
    on_drop: OnDrop<LocalRank>,
    flight: Arc<FlightRecorder>,
}

impl std::fmt::Debug for LocalRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRank").field("rank", &self.rank).field("world", &self.shared.n).finish()
    }
}

impl Drop for LocalRank {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.meeting.panicked(self.rank);
        }
        for s in Stream::ALL {
            match self.streams[s.index()].get() {
                // Each stream thread finishes its queue, then leaves.
                Some(q) => q.close(),
                None => {
                    self.shared.meeting.departed(self.rank, s);
                }
            }
        }
    }
}

impl LocalRank {
    fn queue(&self, stream: Stream) -> &Queue {
        self.streams[stream.index()].get_or_init(|| {
            stream::spawn(self.rank, stream, Arc::clone(&self.shared), Arc::clone(&self.flight))
        })
    }

    fn send(&self, stream: Stream, work: Work) -> Result<(), BackendError> {
        self.queue(stream).send(work).map_err(|_| BackendError::Shutdown {
            rank: self.rank,
            what: format!("the {stream} stream thread is gone"),
        })
    }

    fn new_event(&self) -> LocalEvent {
        self.events.get()
    }

    /// Runs `f` on `stream` in order with the stream's other work; the event completes with its
    /// result. (How a driver runs copy-in / copy-out on a stream locally.)
    ///
    /// # Errors
    /// [`BackendError::Shutdown`]; a parked failure.
    pub fn enqueue_host<F>(&self, stream: Stream, f: F) -> Result<LocalEvent, BackendError>
    where
        F: FnOnce() -> Result<(), BackendError> + Send + 'static,
    {
        self.pool.take_parked()?;
        let event = self.new_event();
        let f: HostFn = Box::new(f);
        self.send(stream, Work::Host { f, event: event.clone() })?;
        Ok(event)
    }

    /// Whether this rank's peers can read `len` bytes at `ptr` in place: any memory of the
    /// process on the local backend (ranks are its threads), only memory from the rank's pool
    /// (its shared arena) on the `shm` backend. Inputs of collectives must be such memory
    /// (see [`LocalBuffer::borrowed`]).
    pub fn peers_can_read(&self, ptr: *const u8, len: usize) -> bool {
        self.pool.peers_can_read(ptr, len)
    }

    /// Whether a reduce-scatter may read this member's own chunk apart
    /// ([`CollDesc::own_chunk`](crate::backend::CollDesc::own_chunk)): the data moves through
    /// this library's own code (not MPI's).
    pub fn takes_own_chunk(&self) -> bool {
        self.shared.meeting.gathers_unpacked()
    }

    /// This rank's flight record as it is now (its last collectives and where each got to),
    /// taken because of `reason`; [`FlightDump::write_to`] writes it where `collsched flight`
    /// reads it.
    pub fn flight_record(&self, reason: &str) -> FlightDump {
        self.flight.dump(reason)
    }

    /// Writes this rank's flight record where `COLLSCHED_FLIGHT_RECORDER` (the config's
    /// [`FlightConfig::dir`]) says, if it says, as a failure does: for an engine's own timeout.
    /// Returns the file written.
    pub fn write_flight_record(&self, reason: &str) -> Option<std::path::PathBuf> {
        self.flight.write_if_configured(reason)
    }

    /// How many buffers this rank's pool allocated fresh (not reused) so far.
    pub fn fresh_allocations(&self) -> u64 {
        self.pool.allocations()
    }

    fn op_id(&self, stream: Stream, c: &Collective<LocalBuffer>) -> Box<CollRef> {
        Box::new(CollRef { desc: c.desc.clone(), stream, seq: None })
    }

    /// Checks a group launch and builds this rank's post.
    fn validate(
        &self,
        stream: Stream,
        ops: &mut [Collective<LocalBuffer>],
    ) -> Result<(RankGroup, Post), BackendError> {
        let rank = self.rank;
        let Some(first) = ops.first() else {
            return Err(BackendError::InvalidLaunch {
                rank,
                what: format!("launch_group on stream {stream} got no collectives; pass at least one"),
            });
        };
        let group = first.desc.group.clone();
        let mut post: Post = SmallVec::with_capacity(ops.len());
        for c in ops.iter_mut() {
            let bad =
                |what: String| BackendError::InvalidCollective { rank, op: self.op_id(stream, c), what };
            let d = &c.desc;
            if d.group != group {
                return Err(bad(format!(
                    "a group launch mixes rank groups {} and {}; launch them separately",
                    group, d.group
                )));
            }
            if let Some(&r) = d.group.ranks().iter().find(|&&r| r >= self.shared.n) {
                return Err(bad(format!(
                    "rank {r} of the group is not in this world of {} ranks",
                    self.shared.n
                )));
            }
            if d.group.position(rank).is_none() {
                return Err(bad(format!("rank {rank} is not a member of group {}", d.group)));
            }
            let es = d.elem.size();
            let need = |count: usize, what: &str, have: usize| -> Result<(), BackendError> {
                let bytes = count.checked_mul(es).ok_or_else(|| bad(format!("{what} size overflows")))?;
                if have < bytes {
                    return Err(bad(format!(
                        "the {what} buffer has {have} bytes but needs {bytes} ({count} x {}); allocate it \
                         with the collective's size",
                        d.elem.name()
                    )));
                }
                Ok(())
            };
            need(d.output_count(), "output", c.output.len())?;
            match (d.kind, &c.input) {
                (CollectiveKind::ReduceScatter | CollectiveKind::AllReduce, None) => {
                    return Err(bad(format!(
                        "{} needs an input buffer distinct from the output (in place is not supported)",
                        d.kind.name()
                    )))
                }
                (CollectiveKind::Broadcast, input) => {
                    let root = d.root;
                    if d.group.position(root).is_none() {
                        return Err(bad(format!("root {root} is not a member of group {}", d.group)));
                    }
                    if root != rank && input.is_some() {
                        return Err(bad(format!(
                            "rank {rank} is not the root ({root}): only the root gives an input; pass None"
                        )));
                    }
                }
                _ => {}
            }
            if let Some(input) = &c.input {
                need(d.input_count(), "input", input.len())?;
            }
            if let Some(what) = d.own_facts_refused(c.input.is_some(), self.shared.meeting.gathers_unpacked())
            {
                return Err(bad(what));
            }
            let src = c.input.as_ref().map_or(std::ptr::null_mut(), |b| b.as_ptr().cast_mut());
            let dst = c.output.as_mut_ptr();
            // One address space: every member can reach every buffer, borrowed or not.
            post.push(OpPost { desc: c.desc.clone(), src: RawPtr(src), dst: RawPtr(dst), private: false });
        }
        Ok((group, post))
    }
}

impl Backend for LocalRank {
    type Buffer = LocalBuffer;
    type Event = LocalEvent;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn flight_dump(&self, reason: &str) -> Option<FlightDump> {
        Some(self.flight.dump(reason))
    }

    fn timeout(&self) -> Duration {
        self.shared.config.timeout
    }

    fn alloc(&self, bytes: usize) -> Result<LocalBuffer, BackendError> {
        self.pool.take_parked()?;
        self.pool.alloc(bytes, 0)
    }

    fn alloc_preferring(&self, bytes: usize, key: usize) -> Result<LocalBuffer, BackendError> {
        self.pool.take_parked()?;
        self.pool.alloc(bytes, key)
    }

    fn free(&self, buffer: LocalBuffer, after: Option<&LocalEvent>) {
        self.pool.free(buffer, after, false);
    }

    fn write_from_host(
        &self,
        buffer: &mut LocalBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        let len = buffer.len();
        let dst = offset
            .checked_add(src.len())
            .filter(|&end| end <= len)
            .map(|end| &mut buffer.as_bytes_mut()[offset..end])
            .ok_or_else(|| BackendError::OutOfRange {
                rank: self.rank,
                what: format!("write of {} bytes at offset {offset} into a buffer of {len} bytes", src.len()),
            })?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn read_to_host(&self, buffer: &LocalBuffer, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        let len = buffer.len();
        let src = offset
            .checked_add(dst.len())
            .filter(|&end| end <= len)
            .map(|end| &buffer.as_bytes()[offset..end])
            .ok_or_else(|| BackendError::OutOfRange {
                rank: self.rank,
                what: format!("read of {} bytes at offset {offset} from a buffer of {len} bytes", dst.len()),
            })?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn host_bytes<'a>(&self, buffer: &'a LocalBuffer) -> Option<&'a [u8]> {
        Some(buffer.as_bytes())
    }

    fn host_bytes_mut<'a>(&self, buffer: &'a mut LocalBuffer) -> Option<&'a mut [u8]> {
        Some(buffer.as_bytes_mut())
    }

    fn gathers_unpacked(&self) -> bool {
        self.shared.meeting.gathers_unpacked()
    }

    /// Copies on the calling thread with the kernels' `copy_out` (both buffers are this
    /// rank's host memory, owned by the caller: no stream thread touches them).
    fn unpack(
        &self,
        _stream: Stream,
        dst: &mut LocalBuffer,
        packed: &LocalBuffer,
        segments: &[collsched_kernels::CopySegment],
        elem_size: usize,
    ) -> Result<Option<LocalEvent>, BackendError> {
        collsched_kernels::copy_out(&mut [dst.as_bytes_mut()], packed.as_bytes(), segments, elem_size)
            .map_err(|e| BackendError::OutOfRange {
                rank: self.rank,
                what: format!("unpack: {e}; nothing was copied"),
            })?;
        Ok(None)
    }

    fn record(&self, stream: Stream) -> Result<LocalEvent, BackendError> {
        self.pool.take_parked()?;
        let event = self.new_event();
        self.send(stream, Work::Record(event.clone()))?;
        Ok(event)
    }

    fn wait_event(&self, stream: Stream, event: &LocalEvent) -> Result<(), BackendError> {
        self.pool.take_parked()?;
        self.send(stream, Work::Wait(event.clone()))
    }

    fn launch_group(
        &self,
        stream: Stream,
        after: &[LocalEvent],
        mut ops: Vec<Collective<LocalBuffer>>,
    ) -> Result<InFlight<Self>, LaunchError<LocalBuffer>> {
        if let Err(error) = self.pool.take_parked() {
            return Err(LaunchError { error, ops });
        }
        let (group, post) = match self.validate(stream, &mut ops) {
            Ok(v) => v,
            Err(error) => return Err(LaunchError { error, ops }),
        };
        tracing::debug!(target: "collsched::coll", rank = self.rank, %stream, first = %ops[0].desc, ops = ops.len(), "launch");
        let event = self.new_event();
        let bytes = ops.iter().map(|c| c.desc.output_count() * c.desc.elem.size()).sum();
        let flight = self.flight.launched(stream, &ops[0].desc, ops.len(), bytes);
        let work = Work::Coll {
            group,
            first: ops[0].desc.clone(),
            post,
            after: after.iter().cloned().collect(),
            event: event.clone(),
            flight,
        };
        if let Err(error) = self.send(stream, work) {
            self.flight.ended(flight, &Err(error.clone()));
            return Err(LaunchError { error, ops });
        }
        Ok(InFlight::new(ops, event, Arc::clone(&self.on_drop)))
    }
}
