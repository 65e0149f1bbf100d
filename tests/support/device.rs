//! `OnDevice` (`collsched::backend::ondevice`): a host backend seen as a device backend, the
//! paths CUDA takes run on the CPU. Included with `#[path]` (files under `tests/support/` are
//! not test targets of their own).
//!
//! `Logged`: a backend that hands everything on to another one and writes down, in order, what
//! it was asked to do on which stream (records, stream waits, launches, host copies), so that a
//! test can check that a fence comes before the copy it guards.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use collsched::backend::ondevice::OnDevice;
use collsched::backend::{Backend, BackendError, Collective, InFlight, LaunchError, Stream};
use collsched::kernels::CopySegment;

/// One call a [`Logged`] backend was asked to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `record(stream)` (what `synchronize(stream, ..)` starts with, too).
    Record(Stream),
    /// `wait_event(stream, ..)`.
    WaitEvent(Stream),
    /// A launch on the stream.
    Launch(Stream),
    /// `pack` on the stream.
    Pack(Stream),
    /// `unpack` on the stream.
    Unpack(Stream),
    /// `zero` on the stream.
    Zero(Stream),
    /// `read_to_host` of this many bytes.
    Read(usize),
    /// `write_from_host` of this many bytes.
    Write(usize),
}

/// `B`, with every call written down in order (see the module docs).
pub struct Logged<B> {
    inner: B,
    log: Arc<Mutex<Vec<Call>>>,
}

impl<B> Logged<B> {
    /// `inner`, logged.
    pub fn new(inner: B) -> Self {
        Logged { inner, log: Arc::default() }
    }

    /// The calls so far, taken (the log starts over).
    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push(&self, c: Call) {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(c);
    }
}

impl<B: Backend> Backend for Logged<B> {
    type Buffer = B::Buffer;
    type Event = B::Event;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn alloc(&self, bytes: usize) -> Result<B::Buffer, BackendError> {
        self.inner.alloc(bytes)
    }

    fn alloc_preferring(&self, bytes: usize, key: usize) -> Result<B::Buffer, BackendError> {
        self.inner.alloc_preferring(bytes, key)
    }

    fn free(&self, buffer: B::Buffer, after: Option<&B::Event>) {
        self.inner.free(buffer, after)
    }

    fn write_from_host(&self, buffer: &mut B::Buffer, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        self.push(Call::Write(src.len()));
        self.inner.write_from_host(buffer, offset, src)
    }

    fn read_to_host(&self, buffer: &B::Buffer, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        self.push(Call::Read(dst.len()));
        self.inner.read_to_host(buffer, offset, dst)
    }

    fn record(&self, stream: Stream) -> Result<B::Event, BackendError> {
        self.push(Call::Record(stream));
        self.inner.record(stream)
    }

    fn wait_event(&self, stream: Stream, event: &B::Event) -> Result<(), BackendError> {
        self.push(Call::WaitEvent(stream));
        self.inner.wait_event(stream, event)
    }

    fn launch_group(
        &self,
        stream: Stream,
        after: &[B::Event],
        ops: Vec<Collective<B::Buffer>>,
    ) -> Result<InFlight<Self>, LaunchError<B::Buffer>> {
        self.push(Call::Launch(stream));
        self.inner.launch_group(stream, after, ops).map(InFlight::rebind)
    }

    fn host_bytes<'a>(&self, buffer: &'a B::Buffer) -> Option<&'a [u8]> {
        self.inner.host_bytes(buffer)
    }

    fn host_bytes_mut<'a>(&self, buffer: &'a mut B::Buffer) -> Option<&'a mut [u8]> {
        self.inner.host_bytes_mut(buffer)
    }

    fn device(&self) -> Option<usize> {
        self.inner.device()
    }

    fn device_address(&self, buffer: &B::Buffer) -> Option<u64> {
        self.inner.device_address(buffer)
    }

    fn gathers_unpacked(&self) -> bool {
        self.inner.gathers_unpacked()
    }

    fn pack(
        &self,
        stream: Stream,
        packed: &mut B::Buffer,
        sources: &[&B::Buffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        self.push(Call::Pack(stream));
        self.inner.pack(stream, packed, sources, segments, elem_size)
    }

    fn zero(
        &self,
        stream: Stream,
        buffer: &mut B::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        self.push(Call::Zero(stream));
        self.inner.zero(stream, buffer, offset, len)
    }

    fn unpack(
        &self,
        stream: Stream,
        dst: &mut B::Buffer,
        packed: &B::Buffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<B::Event>, BackendError> {
        self.push(Call::Unpack(stream));
        self.inner.unpack(stream, dst, packed, segments, elem_size)
    }
}
