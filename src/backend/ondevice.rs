//! [`OnDevice`]: a host backend seen as a device backend, for running the device paths of the
//! runtime and of the Python package on a machine without a GPU.
//!
//! It adds to another backend (the local or shm one) what a device backend is to the runtime:
//! its buffers are not host memory the runtime may touch (`host_bytes` is `None`), they live
//! on "device 0", and they have device addresses. The runtime then keeps shards in the
//! backend's buffers, copies them in on a stream, stages host gradients, takes gradients
//! packed on the compute stream and copies views to the host: the paths CUDA takes, run on the
//! CPU. Its copies keep a device's ordering: pack, unpack and zero run as host work on their
//! stream, behind the work queued there ([`HostStreams`]), and host copies wait for every
//! stream of the rank, as the CUDA backend's do. Its `unsafe`: the buffers' spans carried into
//! that host work, held by the trait's contract until its event. The Python package reaches it as `World.emulated()` (`collsched.torch.init("emulated")`),
//! whose regions refuse the buffer protocol (host reads) as CUDA ones do.

use std::time::Duration;

use collsched_kernels::CopySegment;

use super::local::{LocalEvent, LocalRank};
use super::{Backend, BackendError, Collective, InFlight, LaunchError, Stream};

/// `B` seen as a device backend (see the module docs).
pub struct OnDevice<B>(pub B);

/// The streams a host copy waits for, as the CUDA backend's do.
const ALL_STREAMS: [Stream; 3] = [Stream::AllGather, Stream::ReduceScatter, Stream::Compute];

/// Host code handed to a stream: runs once, in order with the stream's other work.
pub type HostWork = Box<dyn FnOnce() -> Result<(), BackendError> + Send>;

/// What [`OnDevice`] needs of the backend it wraps: host code run on one of its streams, in
/// order with the stream's other work (what a device's stream-ordered copy is).
pub trait HostStreams: Backend {
    /// Runs `work` on `stream` after the work queued there so far; the event completes with
    /// it (and carries its failure).
    ///
    /// # Errors
    /// The backend's failures (a stream shut down, a parked failure).
    fn run_on(&self, stream: Stream, work: HostWork) -> Result<Self::Event, BackendError>;
}

impl HostStreams for LocalRank {
    fn run_on(&self, stream: Stream, work: HostWork) -> Result<LocalEvent, BackendError> {
        self.enqueue_host(stream, work)
    }
}

/// A byte span of a buffer, carried into host work on a stream.
#[derive(Clone, Copy)]
struct Span(*mut u8, usize);

// SAFETY: a span is an address and a length; the host work that uses it runs while the
// buffer is held by the caller's contract (see the uses), on whichever thread runs the stream.
unsafe impl Send for Span {}

impl Span {
    /// # Safety
    /// The span's memory is alive and nothing else writes it (nor reads it, for `mut`) while
    /// the slice lives.
    unsafe fn slice<'a>(self) -> &'a [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(self.0, self.1) }
    }

    /// # Safety
    /// As [`Span::slice`], and no other reference to the memory lives meanwhile.
    unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

impl<B: HostStreams> OnDevice<B> {
    /// The host waits for the work queued on `streams` so far: the CUDA backend's host copies
    /// wait for every stream of the rank; `B`'s run at once.
    fn after(&self, streams: &[Stream]) -> Result<(), BackendError> {
        streams.iter().try_for_each(|&s| self.0.synchronize(s, self.0.timeout()))
    }

    /// Whether the wrapped backend lets the host write `buffer` (else its own copies, ordered
    /// as it orders them, run instead).
    fn has_host_bytes(&self, buffer: &mut B::Buffer) -> bool {
        self.0.host_bytes_mut(buffer).is_some()
    }

    fn span(&self, buffer: &B::Buffer, op: &str) -> Result<Span, BackendError> {
        let b = self.0.host_bytes(buffer).ok_or_else(|| BackendError::Unsupported {
            what: format!("rank {}: {op}: the wrapped backend's buffers have no host bytes", self.0.rank()),
        })?;
        Ok(Span(b.as_ptr().cast_mut(), b.len()))
    }

    fn span_mut(&self, buffer: &mut B::Buffer, op: &str) -> Result<Span, BackendError> {
        let rank = self.0.rank();
        let b = self.0.host_bytes_mut(buffer).ok_or_else(|| BackendError::Unsupported {
            what: format!("rank {rank}: {op}: the wrapped backend's buffers have no host bytes"),
        })?;
        Ok(Span(b.as_mut_ptr(), b.len()))
    }
}

impl<B: HostStreams> Backend for OnDevice<B> {
    fn flight_dump(&self, reason: &str) -> Option<crate::backend::flight::FlightDump> {
        self.0.flight_dump(reason)
    }

    type Buffer = B::Buffer;
    type Event = B::Event;

    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn timeout(&self) -> Duration {
        self.0.timeout()
    }

    fn alloc(&self, bytes: usize) -> Result<B::Buffer, BackendError> {
        self.0.alloc(bytes)
    }

    fn alloc_preferring(&self, bytes: usize, key: usize) -> Result<B::Buffer, BackendError> {
        self.0.alloc_preferring(bytes, key)
    }

    fn free(&self, buffer: B::Buffer, after: Option<&B::Event>) {
        self.0.free(buffer, after)
    }

    fn write_from_host(&self, buffer: &mut B::Buffer, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        self.after(&ALL_STREAMS)?;
        self.0.write_from_host(buffer, offset, src)
    }

    fn read_to_host(&self, buffer: &B::Buffer, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        self.after(&ALL_STREAMS)?;
        self.0.read_to_host(buffer, offset, dst)
    }

    fn record(&self, stream: Stream) -> Result<B::Event, BackendError> {
        self.0.record(stream)
    }

    fn wait_event(&self, stream: Stream, event: &B::Event) -> Result<(), BackendError> {
        self.0.wait_event(stream, event)
    }

    fn launch_group(
        &self,
        stream: Stream,
        after: &[B::Event],
        ops: Vec<Collective<B::Buffer>>,
    ) -> Result<InFlight<Self>, LaunchError<B::Buffer>> {
        self.0.launch_group(stream, after, ops).map(InFlight::rebind)
    }

    fn device(&self) -> Option<usize> {
        Some(0)
    }

    fn device_address(&self, buffer: &B::Buffer) -> Option<u64> {
        self.0.host_bytes(buffer).map(|b| b.as_ptr() as u64)
    }

    /// On `stream`, behind its work, as a device's pack: `packed` and `sources` are held
    /// until the returned event completed (the trait's contract).
    fn pack(
        &self,
        stream: Stream,
        packed: &mut B::Buffer,
        sources: &[&B::Buffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        let rank = self.0.rank();
        if !self.has_host_bytes(packed) || sources.iter().any(|b| self.0.host_bytes(b).is_none()) {
            return self.0.pack(stream, packed, sources, segments, elem_size);
        }
        let dst = self.span_mut(packed, "pack")?;
        let srcs = sources.iter().map(|b| self.span(b, "pack")).collect::<Result<Vec<_>, _>>()?;
        let segments = segments.to_vec();
        let work: HostWork = Box::new(move || {
            // SAFETY: the trait's contract holds `packed` and `sources` (alive, written by no one,
            // `packed` read by no one) until this work's event completed; the slices end here.
            let (dst, srcs) =
                unsafe { (dst.slice_mut(), srcs.iter().map(|s| s.slice()).collect::<Vec<_>>()) };
            collsched_kernels::copy_in(dst, &srcs, &segments, elem_size)
                .map_err(|e| BackendError::OutOfRange { rank, what: format!("pack: {e}") })
        });
        self.0.run_on(stream, work).map(Some)
    }

    /// On `stream`, behind its work, as a device's memset: the range is zero for whatever is
    /// queued on `stream` after it.
    fn zero(
        &self,
        stream: Stream,
        buffer: &mut B::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        let rank = self.0.rank();
        if !self.has_host_bytes(buffer) {
            return self.0.zero(stream, buffer, offset, len);
        }
        let span = self.span_mut(buffer, "zero")?;
        if offset.checked_add(len).is_none_or(|end| end > span.1) {
            return Err(BackendError::OutOfRange {
                rank,
                what: format!("zero of {len} bytes at {offset} in a buffer of {} bytes", span.1),
            });
        }
        let work: HostWork = Box::new(move || {
            // SAFETY: the buffer is the caller's until the work queued behind this on `stream`
            // (its reader) ran, and the runtime frees it only behind that stream's events;
            // the range was checked above.
            let bytes = unsafe { span.slice_mut() };
            bytes[offset..offset + len].fill(0);
            Ok(())
        });
        self.0.run_on(stream, work).map(drop)
    }

    fn unpack(
        &self,
        stream: Stream,
        dst: &mut B::Buffer,
        packed: &B::Buffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        let rank = self.0.rank();
        if !self.has_host_bytes(dst) || self.0.host_bytes(packed).is_none() {
            return self.0.unpack(stream, dst, packed, segments, elem_size);
        }
        let d = self.span_mut(dst, "unpack")?;
        let p = self.span(packed, "unpack")?;
        let segments = segments.to_vec();
        let work: HostWork = Box::new(move || {
            // SAFETY: the trait's contract holds both buffers (alive, neither written by anyone
            // else, `dst` read by no one) until this work's event completed.
            let (d, p) = unsafe { (d.slice_mut(), p.slice()) };
            collsched_kernels::copy_out(&mut [d], p, &segments, elem_size)
                .map_err(|e| BackendError::OutOfRange { rank, what: format!("unpack: {e}") })
        });
        self.0.run_on(stream, work).map(Some)
    }
}
