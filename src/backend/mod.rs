//! Backends: where the scheduler's actions run (`local` threads, `shm` processes, `mpi` hosts,
//! `cuda` GPUs; the simulator runs the scheduler on its own virtual clock, `crate::sim`).
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
use std::time::Duration;

use collsched_kernels::CopySegment;

mod chain;
#[cfg(feature = "cuda")]
pub mod cuda;
mod desc;
mod error;
pub mod flight;
mod inflight;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ondevice;
pub mod shm;

pub use chain::{ChainError, Chained};
pub use collsched_schedule::Stream;
pub use collsched_topo::CollectiveKind;
pub use desc::{CollDesc, CollRef, Collective, GatherUnpack, InvalidGroup, Origin, OwnChunk, RankGroup};
pub use error::{BackendError, LaunchError};
pub use inflight::{InFlight, OnDrop, WaitError};

use chain::launch_in_stream_order;

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

    /// What tells this buffer's memory apart from the pool's other buffers while the pool
    /// keeps it (the host backends: its address), for [`Backend::alloc_preferring`]; 0 for
    /// a backend whose pool does not tell them apart.
    fn key(&self) -> usize {
        0
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

    /// This rank's flight record as it is now (`backend::flight`), taken because of `reason`;
    /// `None` for a backend that keeps none (the local backend and those built on it keep one).
    fn flight_dump(&self, reason: &str) -> Option<flight::FlightDump> {
        let _ = reason;
        None
    }

    /// A buffer of `bytes` bytes from this rank's pool (its contents are unspecified).
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`]; a failure parked earlier (see [`InFlight`]'s `Drop`).
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer, BackendError>;

    /// As [`Backend::alloc`], taking the free buffer whose [`BackendBuffer::key`] is `key` when
    /// the pool holds it: a bucket gathered again lands where it was, so that what a caller
    /// made of its address (a framework's views of the parameters) is still right. Any free
    /// buffer otherwise; a backend without keys allocates as `alloc` does.
    ///
    /// # Errors
    /// As [`Backend::alloc`].
    fn alloc_preferring(&self, bytes: usize, key: usize) -> Result<Self::Buffer, BackendError> {
        let _ = key;
        self.alloc(bytes)
    }

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

    /// The bytes of `buffer` to write in place when they are host memory (the local backend;
    /// the caller owns the buffer, so no stream reads it), `None` for device memory (write it
    /// with [`Backend::write_from_host`]). The default is `None`.
    fn host_bytes_mut<'a>(&self, buffer: &'a mut Self::Buffer) -> Option<&'a mut [u8]> {
        let _ = buffer;
        None
    }

    /// The device this rank's buffers live on (`Some(ordinal)`: CUDA), or `None` when they
    /// are host memory (the default). The runtime keeps a device backend's shards in its
    /// buffers, so that gathers copy them in on the device and an engine's optimizer updates
    /// them there.
    fn device(&self) -> Option<usize> {
        None
    }

    /// The address of `buffer`'s first byte on [`Backend::device`] (what an engine views as a
    /// device tensor), or `None` for host memory (the default).
    fn device_address(&self, buffer: &Self::Buffer) -> Option<u64> {
        let _ = buffer;
        None
    }

    /// Whether an all-gather may carry a [`GatherUnpack`] (place each
    /// member's shard in pieces, leaving parameters whole in one pass). The default is `false`:
    /// such a launch is refused, and the caller gathers, then unpacks.
    fn gathers_unpacked(&self) -> bool {
        false
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

    /// Packs runs of `sources` into `packed`: the kernels' `copy_in` (offsets and lengths count
    /// elements of `elem_size` bytes), on `stream` in order with its other work. Returns `None`
    /// when the copy is complete on return, else the event after which `packed` holds the runs
    /// (until then neither side may be written, nor `packed` read by other streams).
    ///
    /// The default copies on the calling thread through [`Backend::host_bytes`] and
    /// [`Backend::host_bytes_mut`].
    ///
    /// # Errors
    /// [`BackendError::OutOfRange`] naming the segment if one does not fit (nothing is copied
    /// then); [`BackendError::Unsupported`] for the default on a backend without host bytes;
    /// the backend's failures.
    fn pack(
        &self,
        stream: Stream,
        packed: &mut Self::Buffer,
        sources: &[&Self::Buffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<Self::Event>, BackendError> {
        let rank = self.rank();
        let unsupported = || BackendError::Unsupported {
            what: format!(
                "rank {rank}: pack on stream {stream}: this backend's buffers are not host memory and it \
                 implements no pack of its own"
            ),
        };
        let srcs: Vec<&[u8]> =
            sources.iter().map(|b| self.host_bytes(b)).collect::<Option<_>>().ok_or_else(unsupported)?;
        let dst = self.host_bytes_mut(packed).ok_or_else(unsupported)?;
        collsched_kernels::copy_in(dst, &srcs, segments, elem_size)
            .map(|()| None)
            .map_err(|e| BackendError::OutOfRange { rank, what: format!("pack: {e}") })
    }

    /// Sets bytes `offset..offset + len` of `buffer` to zero, on `stream` in order with its
    /// other work. The default writes zeros from the host ([`Backend::write_from_host`]).
    ///
    /// # Errors
    /// [`BackendError::OutOfRange`] if the range does not fit; the backend's failures.
    fn zero(
        &self,
        stream: Stream,
        buffer: &mut Self::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        let _ = stream;
        match self.host_bytes_mut(buffer).and_then(|b| b.get_mut(offset..offset.checked_add(len)?)) {
            Some(bytes) => {
                bytes.fill(0);
                Ok(())
            }
            None => self.write_from_host(buffer, offset, &vec![0; len]),
        }
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
    /// [`ChainError`] (boxed: the failure path is rare) with `first` given back still in flight
    /// (untouched) and the `next` outputs, if an `input_of` names no collective of `first` or two
    /// name the same one ([`BackendError::InvalidCollective`]), if `next` is empty, or if the
    /// launch of `next` was refused (as [`Backend::launch_group`]).
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

/// A job's small blocking exchange between its processes: the bootstrap
/// [`Hub`](crate::bootstrap::Hub), or an MPI job's communicator (`backend::mpi::MpiJob`). For
/// results and rows, not for data.
pub trait Exchange: Send {
    /// Every process's `mine` (any length), in rank order; collective over the job.
    ///
    /// # Errors
    /// The exchange failed (a peer gone, the transport broken), named.
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BackendError>;
}

impl Exchange for crate::bootstrap::Hub {
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BackendError> {
        Ok(self.all_gather(mine)?)
    }
}
