//! Backends: where the scheduler's actions run (`local` threads, the `sim` clock, `cuda`).
//!
//! # The contract
//! A [`Backend`] is **one rank's** handle on a world of ranks (a CUDA device with its NCCL
//! communicators, or one thread of a [`local::LocalWorld`]). The engine (or the driver that runs
//! the scheduler's actions) calls it from that rank's thread. Everything it launches is
//! asynchronous and runs on a named [`Stream`] of that rank, in launch order:
//!
//! - [`Backend::launch`] / [`Backend::launch_group`] put one collective, or several as one group
//!   (NCCL's `ncclGroupStart/End`), on a stream after a list of events, and hand back an
//!   [`InFlight`]: the buffers and the completion event in one value (STYLE 8). A launch that
//!   fails gives its buffers back inside the [`LaunchError`] (STYLE 7).
//! - [`Backend::record`] records an event on a stream; [`Backend::wait_event`] makes a stream
//!   wait for an event recorded on another stream (of this rank or, locally, of any rank).
//! - The host polls an event ([`BackendEvent::query`]) or waits for it with a timeout
//!   ([`BackendEvent::wait`]); [`InFlight::wait`] does that and returns the buffers.
//! - Buffers come from a per-rank pool ([`Backend::alloc`]); [`Backend::free`] gives one back,
//!   optionally only once an event completed (the scheduler's deferred `Free { buffer, after }`),
//!   so steady-state steps allocate nothing.
//!
//! # Matching collectives across ranks
//! Collectives are matched across ranks by **(group, stream, sequence number)**: the k-th
//! collective (or group) that rank r launches on stream s over group G meets the k-th that every
//! other member of G launches on stream s over G. The members must agree on the kind, the tag
//! (bucket), the element count, the element type, the reduction and the root; a disagreement is
//! reported on every member as [`BackendError::Mismatch`] and nothing is executed. (With NCCL
//! this is one communicator per (group, stream).) After a collective on a (group, stream) failed,
//! every later one on it fails with [`BackendError::Aborted`]: a world that lost a rank is
//! rebuilt, not patched.
//!
//! # How a driver uses it
//! The scheduler (sans-IO) emits actions; the driver maps its abstract event ids to
//! `B::Event`s:
//! ```text
//! Launch { op, stream, after } => copy-in (host or compute stream), then
//!     let f = backend.launch_group(stream, &events_of(after), collectives_of(op))?;
//!     events.insert(op.done_event, f.event().clone()); in_flight.insert(op, f);
//! Wait { event }               => events[event].wait(timeout)? (or poll with query() and
//!                                 feed OpDone back into the scheduler when it turns true)
//! Free { buffer, after }       => backend.free(buffer, Some(&events[after]))
//! completion                   => let ops = in_flight.remove(op).wait(timeout)?; copy-out;
//!                                 scheduler.handle(OpDone(op))
//! ```
//! # Examples
//! ```
//! use collsched::backend::{Backend, BackendEvent, Collective, CollDesc, RankGroup, Stream};
//! use collsched::backend::local::LocalWorld;
//! use collsched::kernels::ElemType;
//! use std::time::Duration;
//!
//! let world = LocalWorld::new(2)?;
//! let results = world.run(|rank| -> Result<Vec<u8>, collsched::backend::BackendError> {
//!     let r = rank.rank();
//!     let desc = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 3).with_tag(7);
//!     let mut input = rank.alloc(12)?;
//!     rank.write_from_host(&mut input, 0, &[r as u8; 12])?;
//!     let output = rank.alloc(24)?;
//!     let op = Collective { desc, input: Some(input), output };
//!     let flight = rank.launch(Stream::AllGather, &[], op).map_err(|e| e.error)?;
//!     let mut done = flight.wait(Duration::from_secs(10)).map_err(|e| e.into_error())?;
//!     let mut host = vec![0; 24];
//!     rank.read_to_host(&done[0].output, 0, &mut host)?;
//!     Ok(host)
//! })?;
//! for got in results {
//!     let got = got.expect("rank thread")?;
//!     assert_eq!(got, [[0u8; 12], [1u8; 12]].concat());
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use collsched_kernels::{CopySegment, ElemType, KernelError, ReduceOp, Scaling};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod local;

pub use collsched_schedule::Stream;

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CollKind {
    /// Every member's `count`-element shard, concatenated in group order into one flat output of
    /// `group.len() * count` elements (`all_gather_into_tensor`).
    AllGather,
    /// One flat input of `group.len() * count` elements per member; member at position p of the
    /// group receives the reduction of every member's chunk p (`reduce_scatter_tensor`).
    ReduceScatter,
    /// The element-wise reduction of every member's `count`-element input, on every member.
    AllReduce,
    /// The root's `count` elements, on every member. `root` is a rank (not a group position).
    Broadcast {
        /// The rank whose data is sent.
        root: usize,
    },
}

impl CollKind {
    /// Lower-case name (`all_gather`, `reduce_scatter`, `all_reduce`, `broadcast`).
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllGather => "all_gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast { .. } => "broadcast",
        }
    }

    /// Whether the collective reduces (and so reads [`CollDesc::op`] and [`CollDesc::scaling`]).
    pub const fn reduces(self) -> bool {
        matches!(self, CollKind::ReduceScatter | CollKind::AllReduce)
    }
}

impl fmt::Display for CollKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollKind::Broadcast { root } => write!(f, "broadcast(root {root})"),
            k => f.write_str(k.name()),
        }
    }
}

/// The ranks taking part in a collective: distinct, in ascending order, validated.
///
/// The position of a rank in the group is its chunk index (all-gather output, reduce-scatter
/// input). Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RankGroup(Arc<[usize]>);

impl RankGroup {
    /// A group of the given ranks.
    ///
    /// # Errors
    /// [`BackendError::InvalidGroup`] if `ranks` is empty, not strictly ascending (which also
    /// rules out duplicates).
    pub fn new(ranks: impl Into<Vec<usize>>) -> Result<Self, BackendError> {
        let ranks: Vec<usize> = ranks.into();
        if ranks.is_empty() {
            return Err(BackendError::InvalidGroup { ranks, what: "a group needs at least one rank".into() });
        }
        if let Some(w) = ranks.windows(2).find(|w| w[0] >= w[1]) {
            let what = format!(
                "ranks must be distinct and ascending, but {} comes before {}; sort and deduplicate them",
                w[0], w[1]
            );
            return Err(BackendError::InvalidGroup { ranks, what });
        }
        Ok(RankGroup(ranks.into()))
    }

    /// The group `0..n` (the whole world of `n` ranks). `n == 0` gives the group `[0]`.
    pub fn world(n: usize) -> Self {
        RankGroup((0..n.max(1)).collect())
    }

    /// The ranks, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.0
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always `false` (a group has at least one rank); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The position of `rank` in the group, if it is a member.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.0.binary_search(&rank).ok()
    }
}

impl fmt::Debug for RankGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RankGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// What a collective does, without its buffers: the part every member must agree on.
#[derive(Clone, Debug, PartialEq)]
pub struct CollDesc {
    /// Which collective.
    pub kind: CollKind,
    /// Who takes part.
    pub group: RankGroup,
    /// Element type of the buffers.
    pub elem: ElemType,
    /// Elements per member's shard for all-gather (input) and reduce-scatter (output); elements
    /// of the whole buffer for all-reduce and broadcast.
    pub count: usize,
    /// Reduction (reduce-scatter, all-reduce; ignored otherwise). Default sum.
    pub op: ReduceOp,
    /// Pre/post-divide (reduce-scatter, all-reduce; ignored otherwise). Default 1 / 1.
    pub scaling: Scaling,
    /// Caller's label, normally the bucket id; checked across ranks and named in errors.
    pub tag: u64,
}

impl CollDesc {
    fn new(kind: CollKind, group: RankGroup, elem: ElemType, count: usize) -> Self {
        CollDesc { kind, group, elem, count, op: ReduceOp::Sum, scaling: Scaling::default(), tag: 0 }
    }

    /// An all-gather of `count` elements per member.
    pub fn all_gather(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollKind::AllGather, group, elem, count)
    }

    /// A reduce-scatter to `count` elements per member (the input holds `group.len() * count`).
    pub fn reduce_scatter(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollKind::ReduceScatter, group, elem, count)
    }

    /// An all-reduce of `count` elements.
    pub fn all_reduce(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollKind::AllReduce, group, elem, count)
    }

    /// A broadcast of `count` elements from rank `root`.
    pub fn broadcast(group: RankGroup, elem: ElemType, count: usize, root: usize) -> Self {
        Self::new(CollKind::Broadcast { root }, group, elem, count)
    }

    /// Sets the tag (bucket id).
    #[must_use]
    pub fn with_tag(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// Sets the reduction and its scaling.
    #[must_use]
    pub fn with_reduce(mut self, op: ReduceOp, scaling: Scaling) -> Self {
        self.op = op;
        self.scaling = scaling;
        self
    }

    /// Elements the input must hold (if one is given).
    pub fn input_count(&self) -> usize {
        match self.kind {
            CollKind::ReduceScatter => self.count * self.group.len(),
            _ => self.count,
        }
    }

    /// Elements the output must hold.
    pub fn output_count(&self) -> usize {
        match self.kind {
            CollKind::AllGather => self.count * self.group.len(),
            _ => self.count,
        }
    }

    /// Whether `other` (another member's description) describes the same collective.
    pub fn matches(&self, other: &CollDesc) -> bool {
        let reduce_same = !self.kind.reduces()
            || (self.op == other.op
                && self.scaling.pre_divide.to_bits() == other.scaling.pre_divide.to_bits()
                && self.scaling.post_divide.to_bits() == other.scaling.post_divide.to_bits());
        self.kind == other.kind
            && self.group == other.group
            && self.elem == other.elem
            && self.count == other.count
            && self.tag == other.tag
            && reduce_same
    }
}

impl fmt::Display for CollDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(tag {}, {} x {}", self.kind, self.tag, self.count, self.elem.name())?;
        if self.kind.reduces() {
            let op = match self.op {
                ReduceOp::Sum => "sum",
                ReduceOp::Avg => "avg",
            };
            write!(f, ", {op}")?;
            if self.scaling != Scaling::default() {
                write!(f, " /{} /{}", self.scaling.pre_divide, self.scaling.post_divide)?;
            }
        }
        write!(f, ")")
    }
}

/// One collective with its buffers, as launched.
///
/// `input` is `None` for an **in-place** collective:
/// - all-gather: this member's shard already sits at its position in `output`
///   (`output[p * count..(p + 1) * count]`), as FSDP's copy-in leaves it;
/// - broadcast: on the root, `output` already holds the data; on every other member the input
///   must be `None`.
///
/// Reduce-scatter and all-reduce need an input distinct from the output. Buffers may be larger
/// than the collective needs; it uses their prefix.
#[derive(Debug)]
pub struct Collective<Buf> {
    /// What to do.
    pub desc: CollDesc,
    /// The data sent, or `None` for in place (see above).
    pub input: Option<Buf>,
    /// Where the result goes.
    pub output: Buf,
}

/// Names one collective in errors: what, on which stream, at which sequence number.
#[derive(Clone, Debug, PartialEq)]
pub struct OpId {
    /// The collective as this rank described it (the first of its group launch).
    pub desc: CollDesc,
    /// The stream it was launched on.
    pub stream: Stream,
    /// Its sequence number on (group, stream), counted from 0; `None` if it never got one
    /// (rejected at launch).
    pub seq: Option<u64>,
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} over group {} on stream {}", self.desc, self.desc.group, self.stream)?;
        if let Some(seq) = self.seq {
            write!(f, " (sequence number {seq})")?;
        }
        Ok(())
    }
}

/// What a backend reports. Cloneable: one failure reaches every rank and event that depends on it.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum BackendError {
    /// A rank group that is not one.
    #[error("rank group {ranks:?}: {what}")]
    InvalidGroup {
        /// The ranks given.
        ranks: Vec<usize>,
        /// What is wrong and what to do.
        what: String,
    },
    /// A collective refused at launch (buffer sizes, membership, in-place rules); nothing ran.
    #[error("rank {rank}: {op}: {what}")]
    InvalidCollective {
        /// The launching rank.
        rank: usize,
        /// The collective.
        op: Box<OpId>,
        /// What is wrong and what to do.
        what: String,
    },
    /// Some members did not arrive at a collective within the timeout.
    #[error(
        "rank {rank}: {op}: ranks {missing:?} did not arrive within {waited:?}; every rank of the group \
         must launch the same collectives in the same order on each stream (raise the timeout knob if \
         they are merely slow)"
    )]
    PeerTimeout {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<OpId>,
        /// Members that had not posted.
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// Some members left (panicked, dropped their handle, or failed) before arriving.
    #[error("rank {rank}: {op}: ranks {missing:?} will never arrive: {reason}")]
    PeerFailed {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<OpId>,
        /// Members that had not posted.
        missing: Vec<usize>,
        /// Why they will not (panicked, handle dropped, an earlier error).
        reason: String,
    },
    /// Members posted different collectives at the same sequence number; nothing was executed.
    #[error("rank {rank}: {op}: mismatched collectives: {detail}; every rank must issue the same plan")]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// The collective this rank posted.
        op: Box<OpId>,
        /// Who posted what.
        detail: String,
    },
    /// Not executed because an earlier failure on the same (group, stream) or stream poisoned it.
    #[error("rank {rank}: {}not run because of an earlier failure: {cause}", op_prefix(op.as_deref()))]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The collective (or `None` for non-collective stream work).
        op: Option<Box<OpId>>,
        /// The first failure.
        cause: Box<BackendError>,
    },
    /// Another member failed while writing part of this rank's output (the local backend
    /// shares a reduction's work between the members' threads), so that output is incomplete.
    #[error("rank {rank}: {op}: rank {peer} failed while computing part of this rank's output, which is incomplete: {cause}")]
    PeerKernel {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        op: Box<OpId>,
        /// The member that failed.
        peer: usize,
        /// Its error.
        cause: Box<BackendError>,
    },
    /// A kernel (reduction, copy) refused its arguments.
    #[error("rank {rank}: {op}: {source}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// The collective.
        op: Box<OpId>,
        /// The kernel's error.
        source: KernelError,
    },
    /// A host wait on an event ran out of time; the event is still pending.
    #[error("event not complete after waiting {waited:?}")]
    EventTimeout {
        /// How long the caller waited.
        waited: Duration,
    },
    /// A stream waited on an event longer than the backend's timeout.
    #[error("rank {rank}: stream {stream} waited {waited:?} for an event that never completed")]
    StreamWaitTimeout {
        /// The rank.
        rank: usize,
        /// The waiting stream.
        stream: Stream,
        /// How long it waited.
        waited: Duration,
    },
    /// Host buffer access out of range.
    #[error("rank {rank}: {what}")]
    OutOfRange {
        /// The rank.
        rank: usize,
        /// Which access, and the sizes involved.
        what: String,
    },
    /// Memory could not be allocated.
    #[error("rank {rank}: cannot allocate {bytes} bytes: {what}")]
    OutOfMemory {
        /// The rank.
        rank: usize,
        /// Bytes requested.
        bytes: usize,
        /// Detail from the allocator.
        what: String,
    },
    /// The backend (or this rank of it) was shut down.
    #[error("rank {rank}: backend is shut down: {what}")]
    Shutdown {
        /// The rank.
        rank: usize,
        /// Detail.
        what: String,
    },
    /// A device or library call failed (CUDA, NCCL): which API, and what it said.
    #[error("rank {rank}: {api} failed: {detail}")]
    Device {
        /// The rank.
        rank: usize,
        /// The failing API (`cuStreamWaitEvent`, `ncclGroupEnd`, ...).
        api: &'static str,
        /// The library's error code and message.
        detail: String,
    },
    /// Not supported by this backend or build.
    #[error("{what}")]
    Unsupported {
        /// What, and what to use instead.
        what: String,
    },
}

fn op_prefix(op: Option<&OpId>) -> String {
    op.map_or(String::new(), |op| format!("{op}: "))
}

/// A launch that was refused: the error, and the collectives with their buffers, untouched.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct LaunchError<Buf> {
    /// Why.
    pub error: BackendError,
    /// The collectives given to the launch, with their buffers.
    pub ops: Vec<Collective<Buf>>,
}

/// A completion event: a fence recorded on a stream. Cheap to clone; usable from any thread.
pub trait BackendEvent: Clone + Send + Sync + fmt::Debug + 'static {
    /// `Ok(true)` once everything before the event on its stream completed, `Ok(false)` while
    /// pending.
    ///
    /// # Errors
    /// The failure of the work before it (a failed collective fails its event and, sticky, every
    /// later event of that stream).
    fn query(&self) -> Result<bool, BackendError>;

    /// Blocks the calling thread until the event completes, at most `timeout`.
    ///
    /// # Errors
    /// [`BackendError::EventTimeout`] if still pending after `timeout`; otherwise as
    /// [`BackendEvent::query`].
    fn wait(&self, timeout: Duration) -> Result<(), BackendError>;
}

/// A buffer of the backend's memory (host memory locally, device memory on CUDA).
pub trait BackendBuffer: Send + fmt::Debug + 'static {
    /// Size in bytes.
    fn len(&self) -> usize;

    /// Whether it has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One rank's handle on a world: streams, events, pooled buffers and collectives.
///
/// See the module documentation for the matching rules and how a driver uses it.
pub trait Backend: Send + Sync {
    /// The backend's buffers.
    type Buffer: BackendBuffer;
    /// The backend's events.
    type Event: BackendEvent;

    /// This rank's number in the world.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// How long collectives wait for peers and streams wait for events before failing (the
    /// backend's timeout knob).
    fn timeout(&self) -> Duration;

    /// A buffer of `bytes` bytes from this rank's pool (its contents are unspecified).
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`]; a failure parked earlier (see [`InFlight`]'s `Drop`).
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer, BackendError>;

    /// Returns `buffer` to the pool: at once, or once `after` completed (the scheduler's deferred
    /// free). Never blocks.
    fn free(&self, buffer: Self::Buffer, after: Option<&Self::Event>);

    /// Copies `src` into `buffer` at byte `offset`, synchronously.
    ///
    /// # Errors
    /// [`BackendError::OutOfRange`] if it does not fit.
    fn write_from_host(
        &self,
        buffer: &mut Self::Buffer,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError>;

    /// Copies `dst.len()` bytes of `buffer` from byte `offset` into `dst`, synchronously.
    ///
    /// # Errors
    /// [`BackendError::OutOfRange`] if it does not fit.
    fn read_to_host(&self, buffer: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<(), BackendError>;

    /// Records an event on `stream`: it completes when everything launched on `stream` before
    /// it has.
    ///
    /// # Errors
    /// [`BackendError::Shutdown`]; a parked failure.
    fn record(&self, stream: Stream) -> Result<Self::Event, BackendError>;

    /// Makes `stream` wait (without blocking the host) until `event` completed; an event that
    /// fails fails the stream's later work.
    ///
    /// # Errors
    /// [`BackendError::Shutdown`]; a parked failure.
    fn wait_event(&self, stream: Stream, event: &Self::Event) -> Result<(), BackendError>;

    /// Launches `ops` as one group on `stream`, after every event in `after`: one rendezvous
    /// with the peers, one completion event (NCCL group semantics). All ops of a group use the
    /// same rank group. Returns at once.
    ///
    /// # Errors
    /// [`LaunchError`] with the ops given back if they are invalid (sizes, membership, mixed
    /// groups, an empty list) or the stream is shut down. Failures while running (peers
    /// missing, mismatches) arrive through the returned [`InFlight`]'s event.
    #[allow(clippy::type_complexity)]
    fn launch_group(
        &self,
        stream: Stream,
        after: &[Self::Event],
        ops: Vec<Collective<Self::Buffer>>,
    ) -> Result<InFlight<Self>, LaunchError<Self::Buffer>>
    where
        Self: Sized;

    /// Launches one collective; see [`Backend::launch_group`].
    ///
    /// # Errors
    /// As [`Backend::launch_group`].
    fn launch(
        &self,
        stream: Stream,
        after: &[Self::Event],
        op: Collective<Self::Buffer>,
    ) -> Result<InFlight<Self>, LaunchError<Self::Buffer>>
    where
        Self: Sized,
    {
        self.launch_group(stream, after, vec![op])
    }

    /// The bytes of `buffer` when they are host memory the caller may read directly (the
    /// local backend), `None` for device memory (CUDA: hand the buffer to device code, or
    /// copy it with [`Backend::read_to_host`]). The default is `None`.
    fn host_bytes<'a>(&self, buffer: &'a Self::Buffer) -> Option<&'a [u8]> {
        let _ = buffer;
        None
    }

    /// Unpacks runs of `packed` into `dst`: the kernels' `copy_out` with one destination
    /// (every segment's `buffer` is 0; offsets and lengths count elements of `elem_size`
    /// bytes), on `stream` in order with its other work. Returns `None` when the copy is
    /// complete on return (host memory, copied on the calling thread), else the event after
    /// which `dst` holds the runs: until it completed, neither buffer may be written, freed
    /// without it, or read by other streams (free them with it: [`Backend::free`]).
    ///
    /// The default copies on the calling thread through [`Backend::host_bytes`] and
    /// [`Backend::write_from_host`].
    ///
    /// # Errors
    /// [`BackendError::OutOfRange`] naming the segment if one does not fit either buffer
    /// (nothing is copied then); [`BackendError::Unsupported`] for the default on a backend
    /// without host bytes; the backend's failures.
    fn unpack(
        &self,
        stream: Stream,
        dst: &mut Self::Buffer,
        packed: &Self::Buffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<Self::Event>, BackendError> {
        let Some(src) = self.host_bytes(packed) else {
            return Err(BackendError::Unsupported {
                what: format!(
                    "rank {}: unpack on stream {stream}: this backend's buffers are not host memory and it \
                     implements no unpack of its own",
                    self.rank()
                ),
            });
        };
        let dst_len = dst.len();
        let byte_range = |k: usize, s: &CopySegment| -> Result<(usize, usize, usize), BackendError> {
            let fits = |off: usize, len: usize| off.checked_add(s.len).filter(|&e| e <= len).is_some();
            let es = elem_size.max(1);
            if s.buffer != 0 || !fits(s.buffer_offset, dst_len / es) || !fits(s.packed_offset, src.len() / es)
            {
                return Err(BackendError::OutOfRange {
                    rank: self.rank(),
                    what: format!(
                        "unpack segment {k} ({s:?}, elements of {elem_size} bytes) does not fit a destination of \
                         {dst_len} bytes and a packed buffer of {} bytes",
                        src.len()
                    ),
                });
            }
            Ok((s.buffer_offset * es, s.packed_offset * es, s.len * es))
        };
        for (k, s) in segments.iter().enumerate() {
            byte_range(k, s)?;
        }
        for (k, s) in segments.iter().enumerate() {
            let (at, from, len) = byte_range(k, s)?;
            self.write_from_host(dst, at, &src[from..from + len])?;
        }
        Ok(None)
    }

    /// Blocks until everything launched on `stream` so far completed (record + wait).
    ///
    /// # Errors
    /// The stream's failure, or [`BackendError::EventTimeout`] after `timeout`.
    fn synchronize(&self, stream: Stream, timeout: Duration) -> Result<(), BackendError> {
        self.record(stream)?.wait(timeout)
    }

    /// Launches `next` on `stream` **behind** `first`, without waiting for it on the host:
    /// each [`Chained`] collective reads the output of one collective of `first` (hybrid
    /// sharding's cross-group all-reduce of the in-group reduce-scatter's shard, say). Returns
    /// the chained launch: its event completes after both, and its collectives (whose inputs
    /// are `first`'s outputs) come back from it; the rest of `first`'s buffers (its inputs,
    /// outputs no collective of `next` reads) go back to the pool once `first` completed.
    ///
    /// Why this is safe although `first` is still running: its buffers move, but their memory
    /// does not (every backend's buffers own their memory through a pointer, as an `InFlight`
    /// moved around already requires); `next` is fenced on `first`'s event, which on the same
    /// stream the stream's order already guarantees (so it costs nothing), and on another
    /// stream makes that stream wait; memory `next` does not take is freed with `first`'s
    /// event as its deferred-free fence, so the pool does not hand it out while `first` reads
    /// it. A failure of `first` fails the chained event (the fence's failure, and on the same
    /// stream the stream's sticky failure), so it is never lost.
    ///
    /// The provided implementation does exactly that with [`Backend::launch_group`] and
    /// [`Backend::free`]; the local and CUDA backends use it.
    ///
    /// # Examples
    /// Hybrid sharding's two stages on 4 ranks: a reduce-scatter within `{0, 1}` and `{2, 3}`,
    /// then, chained behind it, an all-reduce across `{0, 2}` and `{1, 3}`; one host wait.
    /// ```
    /// use collsched::backend::{Backend, Chained, CollDesc, Collective, RankGroup, Stream};
    /// use collsched::backend::local::LocalWorld;
    /// use collsched::kernels::ElemType;
    /// use std::time::Duration;
    ///
    /// let world = LocalWorld::new(4)?;
    /// let sums = world.run(|rank| -> Result<f32, Box<dyn std::error::Error + Send + Sync>> {
    ///     let r = rank.rank();
    ///     let mut input = rank.alloc(8)?;
    ///     rank.write_from_host(&mut input, 0, &[1.0f32.to_le_bytes(), 1.0f32.to_le_bytes()].concat())?;
    ///     let pair = RankGroup::new(vec![r - r % 2, r - r % 2 + 1])?;
    ///     let rs = CollDesc::reduce_scatter(pair, ElemType::F32, 1);
    ///     let first = rank
    ///         .launch(Stream::ReduceScatter, &[], Collective { desc: rs, input: Some(input), output: rank.alloc(4)? })
    ///         .map_err(|e| e.error)?;
    ///     let across = CollDesc::all_reduce(RankGroup::new(vec![r % 2, r % 2 + 2])?, ElemType::F32, 1);
    ///     let next = Chained { desc: across, input_of: 0, output: rank.alloc(4)? };
    ///     let both = rank.launch_then(first, Stream::ReduceScatter, [next]).map_err(|e| e.error.clone())?;
    ///     let done = both.wait(Duration::from_secs(30)).map_err(|e| e.into_error())?;
    ///     let mut host = [0u8; 4];
    ///     rank.read_to_host(&done[0].output, 0, &mut host)?;
    ///     Ok(f32::from_le_bytes(host))
    /// })?;
    /// for s in sums {
    ///     assert_eq!(s.expect("rank thread").map_err(|e| e.to_string())?, 4.0);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ChainError`] (boxed: the failure path is rare) with `first` given back still in flight (untouched) and the `next`
    /// outputs, if an `input_of` names no collective of `first` or two name the same one
    /// ([`BackendError::InvalidCollective`]), if `next` is empty, or if the launch of `next`
    /// was refused (as [`Backend::launch_group`]).
    fn launch_then<I>(
        &self,
        first: InFlight<Self>,
        stream: Stream,
        next: I,
    ) -> Result<InFlight<Self>, Box<ChainError<Self>>>
    where
        Self: Sized,
        I: IntoIterator<Item = Chained<Self::Buffer>>,
    {
        launch_in_stream_order(self, first, stream, next)
    }
}

/// A collective launched behind an in-flight launch ([`Backend::launch_then`]) whose input is
/// the output of one collective of that launch.
#[derive(Debug)]
pub struct Chained<Buf> {
    /// What to do (a reduce-scatter or all-reduce needs its input distinct from its output, as
    /// usual: it is the earlier collective's output).
    pub desc: CollDesc,
    /// The position, in the earlier launch's group, of the collective whose output is this
    /// collective's input.
    pub input_of: usize,
    /// Where the result goes.
    pub output: Buf,
}

/// A refused [`Backend::launch_then`]: the error, the earlier launch given back still in
/// flight and unchanged, and the outputs of the refused collectives (STYLE 7).
pub struct ChainError<B: Backend> {
    /// Why.
    pub error: BackendError,
    /// The earlier launch, still in flight with all its buffers.
    pub first: InFlight<B>,
    /// The `output` buffers of the refused chained collectives, in the order given.
    pub outputs: Vec<B::Buffer>,
}

impl<B: Backend> fmt::Debug for ChainError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChainError")
            .field("error", &self.error)
            .field("first", &self.first)
            .field("outputs", &self.outputs.len())
            .finish()
    }
}

impl<B: Backend> fmt::Display for ChainError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chained launch refused: {}", self.error)
    }
}

impl<B: Backend> std::error::Error for ChainError<B> {}

/// The stream-ordered chain behind [`Backend::launch_then`]'s provided implementation. No heap
/// allocation for up to four collectives per launch: the `Vec` of `first`'s collectives
/// carries the chained ones.
fn launch_in_stream_order<B: Backend, I: IntoIterator<Item = Chained<B::Buffer>>>(
    backend: &B,
    mut first: InFlight<B>,
    stream: Stream,
    next: I,
) -> Result<InFlight<B>, Box<ChainError<B>>> {
    let next: smallvec::SmallVec<[Chained<B::Buffer>; 4]> = next.into_iter().collect();
    let n = first.ops.len();
    let mut taken: smallvec::SmallVec<[bool; 8]> = smallvec::smallvec![false; n];
    let mut bad = None;
    if next.is_empty() {
        bad = Some("launch_then got no collectives to chain".to_string());
    }
    for c in &next {
        match taken.get_mut(c.input_of) {
            None => {
                bad = Some(format!(
                    "input_of {} names no collective of the earlier launch (it has {n})",
                    c.input_of
                ));
            }
            Some(t) if *t => {
                bad = Some(format!("two chained collectives read the output of collective {}", c.input_of));
            }
            Some(t) => *t = true,
        }
    }
    if let Some(what) = bad {
        let op = next.first().map(|c| c.desc.clone()).or_else(|| first.descs().next().cloned());
        let error = match op {
            Some(desc) => BackendError::InvalidCollective {
                rank: backend.rank(),
                op: Box::new(OpId { desc, stream, seq: None }),
                what,
            },
            None => BackendError::Unsupported { what: format!("rank {}: {what}", backend.rank()) },
        };
        let outputs = next.into_iter().map(|c| c.output).collect();
        return Err(Box::new(ChainError { error, first, outputs }));
    }
    let event = first.event.clone();
    let on_drop = first.backend.take();
    let mut ops = std::mem::take(&mut first.ops);
    drop(first);
    // `first`'s collectives, each either whole or with its output lent to a chained one.
    let mut earlier: smallvec::SmallVec<[Option<Collective<B::Buffer>>; 4]> =
        ops.drain(..).map(Some).collect();
    let mut lent: smallvec::SmallVec<[Lent<B::Buffer>; 4]> = smallvec::SmallVec::new();
    for c in next {
        if let Some(e) = earlier.get_mut(c.input_of).and_then(Option::take) {
            lent.push(Lent { at: c.input_of, desc: e.desc, input: e.input });
            ops.push(Collective { desc: c.desc, input: Some(e.output), output: c.output });
        }
    }
    let fence = [event.clone()];
    match backend.launch_group(stream, &fence, ops) {
        Ok(flight) => {
            let rest = earlier.into_iter().flatten().flat_map(|c| c.input.into_iter().chain([c.output]));
            for buf in rest.chain(lent.into_iter().filter_map(|l| l.input)) {
                backend.free(buf, Some(&event));
            }
            Ok(flight)
        }
        Err(LaunchError { error, ops: mut back }) => {
            // Give `first` back whole: the refused collectives' inputs are its outputs.
            let mut outputs = Vec::with_capacity(back.len());
            let mut lent = lent.into_iter();
            for c in back.drain(..) {
                outputs.push(c.output);
                match (c.input, lent.next()) {
                    (Some(output), Some(Lent { at, desc, input })) => {
                        earlier[at] = Some(Collective { desc, input, output });
                    }
                    // A backend that did not give the ops back as launched broke the
                    // contract: keep what is left alive until `first` completed.
                    (output, lent) => {
                        let input = lent.and_then(|l| l.input);
                        for b in output.into_iter().chain(input) {
                            backend.free(b, Some(&event));
                        }
                    }
                }
            }
            for b in lent.filter_map(|l| l.input) {
                backend.free(b, Some(&event));
            }
            back.extend(earlier.into_iter().flatten());
            let first = InFlight { ops: back, event, backend: on_drop };
            Err(Box::new(ChainError { error, first, outputs }))
        }
    }
}

/// A collective of the earlier launch whose output a chained collective took: where it was,
/// and what is left of it.
struct Lent<Buf> {
    at: usize,
    desc: CollDesc,
    input: Option<Buf>,
}

/// What a backend does with the collectives of an [`InFlight`] dropped unfinished: defer their
/// buffers to the pool until the event completed, and park a failure.
pub type OnDrop<B> =
    Arc<dyn Fn(Vec<Collective<<B as Backend>::Buffer>>, &<B as Backend>::Event) + Send + Sync>;

/// Collectives in flight: their buffers and their completion event in one value (STYLE 8).
///
/// Get the buffers back with [`InFlight::wait`] (or [`InFlight::try_finish`] after polling).
/// **Dropping** it never blocks: the buffers go back to the pool once the event completes, and
/// if the collective failed, the failure is parked and reported by the rank's next fallible call
/// ([`Backend::alloc`], [`Backend::record`], a launch).
pub struct InFlight<B: Backend> {
    ops: Vec<Collective<B::Buffer>>,
    event: B::Event,
    backend: Option<OnDrop<B>>,
}

impl<B: Backend> fmt::Debug for InFlight<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let descs: Vec<String> = self.ops.iter().map(|c| c.desc.to_string()).collect();
        f.debug_struct("InFlight").field("ops", &descs).field("event", &self.event).finish()
    }
}

/// Why [`InFlight::wait`] gave no buffers.
pub enum WaitError<B: Backend> {
    /// Still running after the timeout: here it is back, still in flight.
    TimedOut {
        /// The collectives, still in flight.
        in_flight: InFlight<B>,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The collectives failed; their buffers are safe to reuse and come back here.
    Failed {
        /// The failure.
        error: BackendError,
        /// The collectives, with their buffers.
        ops: Vec<Collective<B::Buffer>>,
    },
}

impl<B: Backend> WaitError<B> {
    /// The error, dropping what it carries (a timed-out [`InFlight`] is dropped, which defers
    /// its buffers to the pool).
    pub fn into_error(self) -> BackendError {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                drop(in_flight);
                BackendError::EventTimeout { waited }
            }
            WaitError::Failed { error, .. } => error,
        }
    }
}

impl<B: Backend> fmt::Display for WaitError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                write!(f, "collectives still in flight after waiting {waited:?}: {in_flight:?}")
            }
            WaitError::Failed { error, .. } => write!(f, "{error}"),
        }
    }
}

impl<B: Backend> fmt::Debug for WaitError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                f.debug_struct("TimedOut").field("in_flight", in_flight).field("waited", waited).finish()
            }
            WaitError::Failed { error, ops } => {
                f.debug_struct("Failed").field("error", error).field("ops", &ops.len()).finish()
            }
        }
    }
}

impl<B: Backend> std::error::Error for WaitError<B> {}

impl<B: Backend> InFlight<B> {
    /// Wraps launched collectives and their completion event. For backends: `on_drop` is called
    /// with the ops and event if the value is dropped unfinished (it must defer the buffers to
    /// the pool until the event completed, and park a failure).
    pub fn new(ops: Vec<Collective<B::Buffer>>, event: B::Event, on_drop: OnDrop<B>) -> Self {
        InFlight { ops, event, backend: Some(on_drop) }
    }

    /// The completion event (clone it to make other streams wait on it).
    pub fn event(&self) -> &B::Event {
        &self.event
    }

    /// The collectives in flight (their descriptions; their buffers are not to be touched).
    pub fn descs(&self) -> impl Iterator<Item = &CollDesc> {
        self.ops.iter().map(|c| &c.desc)
    }

    /// Polls the event without blocking.
    ///
    /// # Errors
    /// The collectives' failure.
    pub fn is_done(&self) -> Result<bool, BackendError> {
        self.event.query()
    }

    /// Waits at most `timeout` for completion and returns the collectives with their buffers.
    ///
    /// # Errors
    /// [`WaitError::TimedOut`] gives the value back still in flight; [`WaitError::Failed`] gives
    /// the failure and the buffers.
    pub fn wait(mut self, timeout: Duration) -> Result<Vec<Collective<B::Buffer>>, WaitError<B>> {
        match self.event.wait(timeout) {
            Ok(()) => Ok(self.take()),
            Err(BackendError::EventTimeout { waited }) => {
                Err(WaitError::TimedOut { in_flight: self, waited })
            }
            Err(error) => Err(WaitError::Failed { error, ops: self.take() }),
        }
    }

    /// Returns the buffers if the event completed, or gives the value back if it is pending.
    ///
    /// # Errors
    /// As [`InFlight::wait`].
    pub fn try_finish(self) -> Result<Vec<Collective<B::Buffer>>, WaitError<B>> {
        self.wait(Duration::ZERO)
    }

    fn take(&mut self) -> Vec<Collective<B::Buffer>> {
        self.backend = None;
        std::mem::take(&mut self.ops)
    }
}

impl<B: Backend> Drop for InFlight<B> {
    fn drop(&mut self) {
        if let Some(on_drop) = self.backend.take() {
            on_drop(std::mem::take(&mut self.ops), &self.event);
        }
    }
}
