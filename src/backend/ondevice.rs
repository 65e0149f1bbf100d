//! [`OnDevice`]: a host backend seen as a device backend, for running the device paths of the
//! runtime and of the Python package on a machine without a GPU.
//!
//! It adds to another backend (the local or shm one) what a device backend is to the runtime:
//! its buffers are not host memory the runtime may touch (`host_bytes` is `None`), they live
//! on "device 0", and they have device addresses. The runtime then keeps shards in the
//! backend's buffers, copies them in on a stream, stages host gradients, takes gradients
//! packed on the compute stream and copies views to the host: the paths CUDA takes, run on the
//! CPU. Its copies keep a device's ordering: each waits, on the host, for the work queued on
//! its stream (host copies: on every stream), since the host backend's copies run at once. The Python package reaches it as `World.emulated()` (`collsched.torch.init("emulated")`),
//! whose regions refuse the buffer protocol (host reads) as CUDA ones do.

use std::time::Duration;

use collsched_kernels::CopySegment;

use super::{Backend, BackendError, Collective, InFlight, LaunchError, Stream};

/// `B` seen as a device backend (see the module docs).
pub struct OnDevice<B>(pub B);

/// The streams a host copy waits for, as the CUDA backend's do.
const ALL_STREAMS: [Stream; 3] = [Stream::AllGather, Stream::ReduceScatter, Stream::Compute];

impl<B: Backend> OnDevice<B> {
    /// The host waits for the work queued on `streams` so far. A device orders its copies
    /// (pack, unpack, zero) behind the work on their stream, and the CUDA backend's host copies
    /// behind every stream of the rank; `B`'s copies run on the calling thread at once, so the
    /// emulation waits first (an all-gather handed out before it completed, as a device
    /// backend's are, is then complete before its unpack reads it).
    fn after(&self, streams: &[Stream]) -> Result<(), BackendError> {
        streams.iter().try_for_each(|&s| self.0.synchronize(s, self.0.timeout()))
    }
}

impl<B: Backend> Backend for OnDevice<B> {
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

    fn pack(
        &self,
        stream: Stream,
        packed: &mut B::Buffer,
        sources: &[&B::Buffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        self.after(&[stream])?;
        self.0.pack(stream, packed, sources, segments, elem_size)
    }

    fn zero(
        &self,
        stream: Stream,
        buffer: &mut B::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        self.after(&[stream])?;
        self.0.zero(stream, buffer, offset, len)
    }

    fn unpack(
        &self,
        stream: Stream,
        dst: &mut B::Buffer,
        packed: &B::Buffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        self.after(&[stream])?;
        self.0.unpack(stream, dst, packed, segments, elem_size)
    }
}
