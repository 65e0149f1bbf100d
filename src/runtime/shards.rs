//! [`Shards`]: this rank's shard of every gather bucket (the parameters its optimizer owns),
//! in host memory, or in the backend's buffers on a device backend ([`Backend::device`]).
//!
//! On a device the shards are where the engine's optimizer updates them (an engine views them
//! as device tensors, [`ModelState::shard_region`](super::ModelState::shard_region)) and where a
//! gather copies them in from, on its stream, after everything the compute stream ran so far
//! (the engine's optimizer runs there). Host reads and writes of a device shard (checkpoints,
//! [`Coordinator::update_shards`](super::Coordinator::update_shards)) copy through the host,
//! ordered against every stream that touches the shards:
//! - a host **read** waits for the streams that write them: the compute stream;
//! - a host **write** (and the read of a read-modify-write before it) waits for those and for
//!   the streams that read them: every stream a gather copied a shard in on (the all-gather
//!   stream), so that a gather still queued there copies the values it was launched for, not
//!   the new ones halfway.
//!
//! The waits are host waits on events recorded on each stream (all recorded first, then waited
//! for within one backend timeout): any backend's `read_to_host` / `write_from_host` may then
//! copy at once.

use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use collsched_kernels::CopySegment;

use super::bytes::Bytes;
use super::flight::backend_err;
use super::RuntimeError;
use crate::backend::{Backend, BackendError, BackendEvent, Stream};

/// One gather bucket's shard.
enum Shard<B: Backend> {
    /// In host memory (host backends, and an empty shard anywhere).
    Host(Bytes),
    /// In a backend buffer on the device, of this many bytes (the buffer may be longer).
    Device(B::Buffer, usize),
}

/// This rank's shard of every gather bucket, by position in the plan.
pub(crate) struct Shards<B: Backend> {
    shards: Vec<Shard<B>>,
    /// The streams a gather copied a device shard in on, one bit per [`Stream::index`].
    readers: AtomicU8,
}

/// The streams that write device shards: the compute stream (the engine's optimizer).
const WRITERS: [Stream; 1] = [Stream::Compute];

/// Waits on the host until each of `streams` passed everything queued on it so far: an event
/// recorded on each (all first), then waited for, within one backend timeout in all.
fn settle<B: Backend>(be: &B, streams: &[Stream]) -> Result<(), BackendError> {
    let events = streams.iter().map(|&s| be.record(s)).collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    for e in events {
        e.wait(be.timeout().saturating_sub(start.elapsed()))?;
    }
    Ok(())
}

impl<B: Backend> Shards<B> {
    /// The shards cut on the host (`cut`, by gather bucket), moved into the backend's buffers
    /// on a device backend.
    ///
    /// # Errors
    /// The backend's failure to allocate or copy (nothing is kept then).
    pub(crate) fn new(be: &B, cut: Vec<Bytes>) -> Result<Shards<B>, BackendError> {
        let mut shards = Shards { shards: Vec::with_capacity(cut.len()), readers: AtomicU8::new(0) };
        if be.device().is_none() {
            shards.shards.extend(cut.into_iter().map(Shard::Host));
            return Ok(shards);
        }
        for c in cut {
            if c.as_bytes().is_empty() {
                shards.shards.push(Shard::Host(c));
                continue;
            }
            let placed = be.alloc(c.as_bytes().len()).and_then(|mut b| {
                match be.write_from_host(&mut b, 0, c.as_bytes()) {
                    Ok(()) => Ok(b),
                    Err(e) => {
                        be.free(b, None);
                        Err(e)
                    }
                }
            });
            match placed {
                Ok(b) => shards.shards.push(Shard::Device(b, c.as_bytes().len())),
                Err(e) => {
                    shards.release(be);
                    return Err(e);
                }
            }
        }
        Ok(shards)
    }

    /// The streams a host write must wait for: the writers, and every stream a gather copied
    /// a shard in on.
    fn touching(&self) -> Vec<Stream> {
        let readers = self.readers.load(Ordering::Acquire);
        let mut streams = WRITERS.to_vec();
        streams.extend(
            Stream::ALL.into_iter().filter(|s| readers & (1 << s.index()) != 0 && !WRITERS.contains(s)),
        );
        streams
    }

    /// Gives the device buffers back to the backend's pool (the rank's streams are done with
    /// them: the model state's teardown synchronized them).
    pub(crate) fn release(&mut self, be: &B) {
        for s in self.shards.drain(..) {
            if let Shard::Device(b, _) = s {
                be.free(b, None);
            }
        }
    }

    /// A gather's copy-in: bucket `g`'s shard into `input`, from the host at once, or on the
    /// device on `stream` behind everything the compute stream ran so far (the optimizer's
    /// writes).
    pub(crate) fn copy_into(
        &self,
        be: &B,
        g: usize,
        stream: Stream,
        input: &mut B::Buffer,
    ) -> Result<(), BackendError> {
        match &self.shards[g] {
            Shard::Host(b) => be.write_from_host(input, 0, b.as_bytes()),
            Shard::Device(shard, len) => {
                // Before the copy is queued: a host write that comes after it waits for `stream`.
                self.readers.fetch_or(1 << stream.index(), Ordering::AcqRel);
                let written = be.record(Stream::Compute)?;
                be.wait_event(stream, &written)?;
                let whole = CopySegment { buffer: 0, buffer_offset: 0, packed_offset: 0, len: *len };
                // The collective follows on the same stream: the copy's own event adds nothing.
                be.unpack(stream, input, shard, &[whole], 1).map(drop)
            }
        }
    }

    /// `f` on bytes `range` of bucket `g`'s shard (a host copy of a device shard, read once
    /// the streams that write shards passed what they hold now).
    pub(crate) fn read<R>(
        &self,
        be: &B,
        g: usize,
        range: Range<usize>,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, BackendError> {
        match &self.shards[g] {
            Shard::Host(b) => Ok(f(&b.as_bytes()[range])),
            Shard::Device(shard, _) => {
                settle(be, &WRITERS)?;
                let mut host = vec![0; range.len()];
                be.read_to_host(shard, range.start, &mut host)?;
                Ok(f(&host))
            }
        }
    }

    /// `f` on bytes `range` of bucket `g`'s shard to overwrite (through a host copy of a
    /// device shard, read once every stream that touches shards passed what it holds now, and
    /// written back when `f` returns).
    pub(crate) fn write<R>(
        &mut self,
        be: &B,
        g: usize,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, BackendError> {
        let touching = self.touching();
        match &mut self.shards[g] {
            Shard::Host(b) => Ok(f(&mut b.as_bytes_mut()[range])),
            Shard::Device(shard, _) => {
                settle(be, &touching)?;
                let mut host = vec![0; range.len()];
                be.read_to_host(shard, range.start, &mut host)?;
                let r = f(&mut host);
                be.write_from_host(shard, range.start, &host)?;
                Ok(r)
            }
        }
    }

    /// `f` on every shard as host bytes ([`HostShards::get`]; device shards through host copies,
    /// made once every stream that touches shards passed what it holds now, and written back
    /// when `f` returns `Ok`); `op` names the copies' failures. Host shards are
    /// handed over as they are (nothing allocated).
    pub(crate) fn with_host<R>(
        &mut self,
        be: &B,
        op: &'static str,
        f: impl FnOnce(&mut HostShards<'_, B>) -> Result<R, RuntimeError>,
    ) -> Result<R, RuntimeError> {
        let err = |e| backend_err(be.rank(), op, None)(e);
        let mut copies: Vec<Vec<u8>> = Vec::new();
        if self.shards.iter().any(|s| matches!(s, Shard::Device(..))) {
            // Written back below: wait for the readers too.
            settle(be, &self.touching()).map_err(err)?;
            for s in &self.shards {
                let mut host = Vec::new();
                if let Shard::Device(shard, len) = s {
                    host.resize(*len, 0);
                    be.read_to_host(shard, 0, &mut host).map_err(err)?;
                }
                copies.push(host);
            }
        }
        let r = f(&mut HostShards { shards: &mut self.shards, copies: &mut copies })?;
        for (s, host) in self.shards.iter_mut().zip(&copies) {
            if let Shard::Device(shard, _) = s {
                be.write_from_host(shard, 0, host).map_err(err)?;
            }
        }
        Ok(r)
    }

    /// Where bytes `range` of bucket `g`'s shard start: a host address, or the device address
    /// and the device's ordinal.
    ///
    /// # Errors
    /// [`RuntimeError::Internal`] if a device backend gives no address for its buffer.
    pub(crate) fn address(
        &mut self,
        be: &B,
        g: usize,
        range: Range<usize>,
    ) -> Result<(*mut u8, Option<usize>), RuntimeError> {
        Ok(match &mut self.shards[g] {
            Shard::Host(b) => (b.as_bytes_mut()[range].as_mut_ptr(), None),
            Shard::Device(shard, _) => ((device_address(be, shard)? + range.start) as *mut u8, be.device()),
        })
    }
}

/// The device address of `buffer`, which a device backend always has.
///
/// # Errors
/// [`RuntimeError::Internal`] if the backend gives none.
pub(crate) fn device_address<B: Backend>(be: &B, buffer: &B::Buffer) -> Result<usize, RuntimeError> {
    be.device_address(buffer).map(|a| a as usize).ok_or_else(|| RuntimeError::Internal {
        rank: be.rank(),
        what: "a device backend gave no address for one of its buffers (Backend::device_address)".into(),
    })
}

/// Every shard as host bytes, inside [`Shards::with_host`].
pub(crate) struct HostShards<'a, B: Backend> {
    shards: &'a mut [Shard<B>],
    /// Host copies of the device shards, by gather bucket (empty when every shard is on the
    /// host).
    copies: &'a mut [Vec<u8>],
}

impl<B: Backend> HostShards<'_, B> {
    /// Bucket `g`'s shard.
    pub(crate) fn get(&mut self, g: usize) -> &mut [u8] {
        match &mut self.shards[g] {
            Shard::Host(b) => b.as_bytes_mut(),
            Shard::Device(..) => &mut self.copies[g],
        }
    }
}
