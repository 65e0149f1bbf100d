//! The gather side of the driver: launches of all-gathers, the gathered (and unpacked)
//! buffers held until their `Free`, the engine's consumer events, deferred frees.
//!
//! It is shared by every coordinator of a rank on a model (it lives in the model state,
//! because gathered buckets are shared through the registry). It never touches the scheduler:
//! a finished gather is reported through the `done` callback its caller passes, which feeds
//! `OpDone` to the scheduler.
//!
//! *Finishing* a gather keeps its gathered buffer until its `Free` (views of parameters that
//! are one contiguous run of it point straight into it) and unpacks the other parameters once,
//! with the backend's `unpack` (the kernels' `copy_out`, straight from the gathered buffer: on
//! the calling thread for host memory, on the all-gather stream for a device, with the compute
//! stream waiting for it), into the unpacked buffer allocated with the gathered one.
//!
//! On a backend that places pieces (`Backend::gathers_unpacked`: the host backends whose
//! all-gather is `moves.rs`'s), an unpacked bucket skips both the gathered buffer and the
//! unpack: its all-gather carries the copy-out runs as a `GatherUnpack` and writes each
//! member's shard straight to where the parameters' full values go, one copy of each byte
//! instead of two.

use collsched_schedule::{EngineEvent, Fence, Launch, LaunchId};
use smallvec::SmallVec;

use super::flight::{backend_err, launch, wait_flight, DriverCounters, Waited};
use super::tables::{GatherTable, GatherTables};
use super::RuntimeError;
use crate::backend::{
    Backend, BackendBuffer, BackendError, BackendEvent, Collective, InFlight, Origin, Stream,
};

/// What a finished gather reports to the scheduler (`OpDone` of the launch).
pub(crate) type Done<'a> = &'a mut dyn FnMut(LaunchId) -> Result<(), RuntimeError>;

struct PendingGather<B: Backend> {
    id: LaunchId,
    /// Position of the bucket among the gather buckets.
    g: usize,
    flight: InFlight<B>,
    /// The unpacked buffer, allocated with the gathered one (buckets with parameters that are
    /// not contiguous in the gathered buffer).
    unpacked: Option<B::Buffer>,
    /// The collective's output is the unpacked buffer (it placed the pieces itself).
    unpacking: bool,
}

/// A finished gather, kept until its `Free`: what `fetch` hands out views of.
pub(crate) struct Gathered<B: Backend> {
    /// The launch that gathered it.
    pub(crate) id: LaunchId,
    /// The gathered buffer, which views point into; `None` for an unpacked bucket (every view
    /// is in `unpacked`), whose gathered buffer went back to the pool after the unpack.
    pub(crate) buffer: Option<B::Buffer>,
    /// The unpacked copy of the other parameters, if the bucket has any.
    pub(crate) unpacked: Option<B::Buffer>,
    /// The unpack's event when it runs on a stream (device backends): the compute stream
    /// already waits for it; host reads wait for it first. `None`: complete.
    pub(crate) ready: Option<B::Event>,
}

impl<B: Backend> Gathered<B> {
    fn buffers(self) -> SmallVec<[B::Buffer; 2]> {
        let mut v = SmallVec::new();
        v.extend(self.buffer);
        v.extend(self.unpacked);
        v
    }
}

/// Buffers whose free waits for more than one event (the backend's `free` takes one): kept
/// here until all but one completed.
struct Deferred<B: Backend> {
    buffers: SmallVec<[B::Buffer; 2]>,
    after: SmallVec<[B::Event; 2]>,
}

/// How [`GatherSide::finish`] finishes a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum How {
    /// Only if it completed.
    Poll,
    /// Waiting for it on the host.
    Block,
    /// For the engine's compute stream: on a device backend without a host wait (the compute
    /// stream waits for the gather, the buffers are handed out before completion and the
    /// event is watched for a failure); elsewhere as `Block`.
    OnStream,
}

/// Whether [`GatherSide::finish`] finished the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Finished now, or earlier.
    Done,
    /// Still running (only when not blocking).
    Running,
}

/// Launches in flight, gathered buffers, consumer events and deferred frees of one rank on
/// one model. Buckets are indexed by their position `g` among the plan's gather buckets.
pub(crate) struct GatherSide<B: Backend> {
    pending: Vec<PendingGather<B>>,
    /// Per gather bucket: the finished gather, kept until its `Free`.
    held: Vec<Option<Gathered<B>>>,
    /// Per gather bucket: the engine's consumer events given since it was last freed (the
    /// latest per engine queue), which its `Free` names.
    consumers: Vec<Vec<(EngineEvent, B::Event)>>,
    deferred: Vec<Deferred<B>>,
    /// Gathers handed out before completion (`How::OnStream`): their launch, bucket position
    /// and event, until it completed (a failure is reported by the next poll).
    watched: Vec<(LaunchId, usize, B::Event)>,
    /// Engine queue id of the next coordinator (one queue per coordinator).
    next_queue: u32,
    spare: Vec<Vec<Collective<B::Buffer>>>,
    events: Vec<B::Event>,
    /// Per gather bucket: the keys of the input, output and unpacked buffers it last had
    /// ([`BackendBuffer::key`]), asked for again at its next launch: the parameters' full
    /// values land where they were, and the views a framework made of them stay right (the
    /// input keeps to its own too, so that it takes no other bucket's).
    last: Vec<[usize; 3]>,
}

impl<B: Backend> GatherSide<B> {
    pub(crate) fn new(tables: &GatherTables) -> Self {
        let n = tables.gather.len();
        GatherSide {
            pending: Vec::with_capacity(n),
            held: (0..n).map(|_| None).collect(),
            consumers: (0..n).map(|_| Vec::with_capacity(2)).collect(),
            deferred: Vec::with_capacity(n),
            watched: Vec::with_capacity(n),
            next_queue: 0,
            spare: Vec::with_capacity(n),
            events: Vec::with_capacity(8),
            last: vec![[0; 3]; n],
        }
    }

    /// Launches not finished yet.
    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The event of launch `id` if it is in flight here (a fence for a later launch).
    pub(crate) fn pending_event(&self, id: LaunchId) -> Option<&B::Event> {
        self.pending.iter().find(|p| p.id == id).map(|p| p.flight.event())
    }

    /// The finished gather of bucket `g` if it is launch `id`'s.
    pub(crate) fn gathered(&self, g: usize, id: Option<LaunchId>) -> Option<&Gathered<B>> {
        self.held.get(g)?.as_ref().filter(|h| Some(h.id) == id)
    }

    /// A new engine queue id (one per coordinator).
    pub(crate) fn new_queue(&mut self) -> u32 {
        let q = self.next_queue;
        self.next_queue += 1;
        q
    }

    /// Records that the engine's use of bucket `g` ends at `event` (named `id` for the
    /// scheduler), keeping the latest event per engine queue.
    pub(crate) fn add_consumer(&mut self, g: usize, id: EngineEvent, event: &B::Event) {
        let list = &mut self.consumers[g];
        match list.iter_mut().find(|(e, _)| e.queue == id.queue) {
            Some(slot) if slot.0.seq < id.seq => *slot = (id, event.clone()),
            Some(_) => {}
            None => list.push((id, event.clone())),
        }
    }

    /// Frees buffers of deferred frees whose events (all but one) completed.
    fn reap(&mut self, be: &B) {
        let mut i = 0;
        while i < self.deferred.len() {
            let d = &mut self.deferred[i];
            d.after.retain(|e| matches!(e.query(), Ok(false)));
            if d.after.len() > 1 {
                i += 1;
                continue;
            }
            let d = self.deferred.swap_remove(i);
            for b in d.buffers {
                be.free(b, d.after.first());
            }
        }
    }

    /// Frees `buffers` once every event of `after` completed (all at once when there is at
    /// most one pending event; else through the deferred list).
    fn retire(&mut self, be: &B, buffers: SmallVec<[B::Buffer; 2]>, mut after: SmallVec<[B::Event; 2]>) {
        after.retain(|e| matches!(e.query(), Ok(false)));
        if after.len() <= 1 {
            for b in buffers {
                be.free(b, after.first());
            }
        } else {
            self.deferred.push(Deferred { buffers, after });
        }
    }

    /// At teardown (the rank's streams synchronized): every buffer back to the pool, waiting
    /// (at most the backend's timeout) for deferred frees; a buffer whose events did not
    /// complete is leaked rather than handed back under a reader.
    pub(crate) fn shut_down(&mut self, be: &B) {
        for d in self.deferred.drain(..) {
            if d.after.iter().all(|e| e.wait(be.timeout()).is_ok()) {
                d.buffers.into_iter().for_each(|b| be.free(b, None));
            } else {
                tracing::warn!(target: "collsched::alloc", rank = be.rank(),
                    "leaking gathered buffers whose consumers' events did not complete at teardown");
                std::mem::forget(d.buffers);
            }
        }
    }

    /// Launches bucket `g`'s gather `l`: this rank's shard into a pool buffer (`copy_in`), the
    /// gathered buffer (and the unpacked one) from the pool, the bucket's collective as one
    /// group on the launch's stream after its fences. An unpacked bucket on a backend that
    /// places pieces gathers straight into its unpacked buffer instead (no gathered buffer, no
    /// unpack). `engine` marks the collective in the flight record, with the launch's step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &mut self,
        be: &B,
        g: usize,
        t: &GatherTable,
        copy_in: impl FnOnce(&mut B::Buffer) -> Result<(), BackendError>,
        l: &Launch,
        engine: u32,
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        let err = |op| backend_err(be.rank(), op, Some(t.id));
        // Deferred frees that completed go back to the pool first, so that they can be reused.
        self.reap(be);
        let [input_key, out_key, unpacked_key] = self.last[g];
        let input = if t.sends {
            let mut b = be.alloc_preferring(t.shard_bytes, input_key).map_err(err("all_gather"))?;
            if let Err(e) = copy_in(&mut b) {
                be.free(b, None);
                return Err(err("all_gather copy-in")(e));
            }
            Some(b)
        } else {
            None
        };
        let unpacking = t.placing(be);
        // The gathered buffer and the unpacked one are taken together (the scheduler counts both;
        // an all-gather that places the pieces takes the unpacked one alone, and it counts that).
        let buffers = match unpacking {
            Some(_) => be.alloc_preferring(t.unpacked_bytes, out_key).map(|out| (out, None)),
            None => be.alloc_preferring(t.gathered_bytes, out_key).and_then(|out| match t.unpacked_bytes {
                0 => Ok((out, None)),
                n => match be.alloc_preferring(n, unpacked_key) {
                    Ok(u) => Ok((out, Some(u))),
                    Err(e) => {
                        be.free(out, None);
                        Err(e)
                    }
                },
            }),
        };
        let (output, unpacked) = match buffers {
            Ok(b) => b,
            Err(e) => {
                if let Some(i) = input {
                    be.free(i, None);
                }
                return Err(err("all_gather")(e));
            }
        };
        let key = |b: Option<&B::Buffer>| b.map_or(0, BackendBuffer::key);
        self.last[g] = [key(input.as_ref()), output.key(), key(unpacked.as_ref())];
        let mut ops = self.spare.pop().unwrap_or_default();
        ops.push(Collective { desc: unpacking.unwrap_or(&t.desc).clone(), input, output });
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        for f in &l.after {
            if let Fence::Op(id) = f {
                events.extend(self.pending_event(*id).cloned());
            }
        }
        let origin = Origin { engine, step: l.step };
        let r = launch(be, l.stream, &events, ops, t.id, origin, "all_gather");
        self.events = events;
        let flight = match r {
            Ok(f) => f,
            Err(e) => {
                if let Some(u) = unpacked {
                    be.free(u, None);
                }
                return Err(e);
            }
        };
        counters.collectives += 1;
        counters.bytes_moved += t.gathered_bytes as u64;
        self.pending.push(PendingGather { id: l.id, g, flight, unpacked, unpacking: unpacking.is_some() });
        Ok(())
    }

    /// Finishes gather `id` (`how`): unpacks the parameters that are
    /// not contiguous in the gathered buffer (straight from it, on the all-gather stream; the
    /// compute stream waits for it), keeps both buffers until the bucket's `Free`, reports it
    /// to `done`. A launch not in flight here finished earlier.
    pub(crate) fn finish(
        &mut self,
        be: &B,
        tables: &GatherTables,
        id: LaunchId,
        how: How,
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<Finish, RuntimeError> {
        let rank = be.rank();
        let Some(k) = self.pending.iter().position(|p| p.id == id) else { return Ok(Finish::Done) };
        let p = self.pending.swap_remove(k);
        let g = p.g;
        let t = &tables.gather[g];
        let (unpacked, unpacking) = (p.unpacked, p.unpacking);
        // Handed out before completion: later frees and host reads wait for this event.
        let mut on_stream = None;
        let waited = if how == How::OnStream && be.device().is_some() {
            let (ops, event) = p.flight.hand_out();
            on_stream = Some(event);
            Ok(ops)
        } else {
            wait_flight(p.flight, how != How::Poll, be, counters)
        };
        let mut ops = match waited {
            Ok(ops) => ops,
            Err(Waited::Pending(flight)) => {
                self.pending.push(PendingGather { id, g, flight, unpacked, unpacking });
                return Ok(Finish::Running);
            }
            Err(Waited::Failed(source)) => {
                if let Some(u) = unpacked {
                    be.free(u, None);
                }
                return Err(RuntimeError::Backend { rank, op: "all_gather", bucket: Some(t.id), source });
            }
        };
        let mut gathered = None;
        for c in ops.drain(..) {
            if let Some(i) = c.input {
                be.free(i, on_stream.as_ref());
            }
            match gathered {
                None => gathered = Some(c.output),
                Some(_) => be.free(c.output, on_stream.as_ref()),
            }
        }
        self.spare.push(ops);
        let Some(buffer) = gathered else {
            return Err(RuntimeError::Internal {
                rank,
                what: format!("all_gather(bucket {}) returned no buffer", t.id),
            });
        };
        // An unpacking all-gather left every parameter whole in its output: that output is the
        // unpacked buffer, and there is no gathered one.
        let (buffer, mut unpacked) = if unpacking { (None, Some(buffer)) } else { (Some(buffer), unpacked) };
        let unpack = |u: &mut B::Buffer,
                      buffer: &B::Buffer|
         -> Result<Option<B::Event>, crate::backend::BackendError> {
            let ready = be.unpack(Stream::AllGather, u, buffer, &t.copy_out, t.elem.size())?;
            if let Some(e) = &ready {
                // The engine reads the views on the compute stream.
                be.wait_event(Stream::Compute, e)?;
            }
            Ok(ready)
        };
        let ready = match (unpacked.as_mut(), buffer.as_ref()) {
            (Some(u), Some(b)) => unpack(u, b).map(Some),
            _ => Ok(None),
        };
        // Without an unpack the compute stream waits for the gather itself.
        let ready = match ready.map(Option::flatten) {
            Ok(None) => match on_stream.clone() {
                Some(e) => be.wait_event(Stream::Compute, &e).map(|()| Some(e)),
                None => Ok(None),
            },
            r => r,
        };
        let ready = match ready {
            Ok(r) => r,
            Err(source) => {
                // Nobody saw these buffers yet; the fetch reports the failure.
                if let Some(b) = buffer {
                    be.free(b, on_stream.as_ref());
                }
                if let Some(u) = unpacked {
                    be.free(u, on_stream.as_ref());
                }
                return Err(RuntimeError::Backend {
                    rank,
                    op: "all_gather unpack",
                    bucket: Some(t.id),
                    source,
                });
            }
        };
        // Every parameter of an unpacked bucket is in the unpacked buffer: the gathered one is
        // free once the unpack read it.
        let buffer = match (buffer, &unpacked) {
            (Some(b), Some(_)) => {
                be.free(b, ready.as_ref());
                None
            }
            (b, _) => b,
        };
        if let Some(e) = on_stream {
            self.watched.push((id, g, e));
        }
        if let Some(old) = self.held[g].replace(Gathered { id, buffer, unpacked, ready }) {
            // A gather of the bucket that was never freed (a driver bug): nothing views it.
            let ready = old.ready.clone().into_iter().collect();
            self.retire(be, old.buffers(), ready);
        }
        done(id)?;
        Ok(Finish::Done)
    }

    /// The scheduler's `Free` of gather bucket `g`'s launch `serial`: an unfinished gather (an
    /// unused prefetch) is dropped (the backend frees its buffers when it completes); a
    /// finished one's buffers go back to the pool after the consumers' engine events and the
    /// unpack.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn free(
        &mut self,
        be: &B,
        tables: &GatherTables,
        g: usize,
        serial: u64,
        after: &[Fence],
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<(), RuntimeError> {
        let engine = after.iter().any(|f| matches!(f, Fence::Engine(_)));
        if let Some(k) = self.pending.iter().position(|p| p.id.serial == serial) {
            if !engine {
                // Still in flight and never viewed: dropping it defers its buffers to the pool
                // until the collective completed; the unpacked buffer was not touched yet.
                let p = self.pending.swap_remove(k);
                drop(p.flight);
                if let Some(u) = p.unpacked {
                    be.free(u, None);
                }
                self.consumers[g].clear();
                return Ok(());
            }
            // Consumers' events with a gather still in flight: finish it, then free as below.
            let id = self.pending[k].id;
            self.finish(be, tables, id, How::Block, counters, done)?;
        }
        let Some(held) = self.held[g].take_if(|h| h.id.serial == serial) else {
            self.consumers[g].clear();
            return Ok(());
        };
        let mut events: SmallVec<[B::Event; 2]> = SmallVec::new();
        let mut missing = None;
        for f in after {
            if let Fence::Engine(e) = f {
                match self.consumers[g].iter().find(|(id, _)| id == e) {
                    Some((_, ev)) => events.push(ev.clone()),
                    None => missing = Some(*e),
                }
            }
        }
        self.consumers[g].clear();
        events.extend(held.ready.clone());
        if let Some(e) = missing {
            // Not safe to hand back: drop the buffers (host memory goes away, nothing else reads it).
            drop(held);
            return Err(RuntimeError::Internal {
                rank: be.rank(),
                what: format!(
                    "the scheduler frees gather bucket {} after engine event {e:?}, which no release_after \
                     gave",
                    tables.gather[g].id
                ),
            });
        }
        self.retire(be, held.buffers(), events);
        Ok(())
    }

    /// Finishes every gather that already completed, without blocking, and returns deferred
    /// frees that completed to the pool.
    pub(crate) fn poll(
        &mut self,
        be: &B,
        tables: &GatherTables,
        counters: &mut DriverCounters,
        done: Done<'_>,
    ) -> Result<(), RuntimeError> {
        self.reap(be);
        let mut failed = None;
        self.watched.retain(|(_, g, e)| match e.query() {
            Ok(done) => !done,
            Err(source) => {
                failed.get_or_insert((*g, source));
                false
            }
        });
        if let Some((g, source)) = failed {
            let bucket = Some(tables.gather[g].id);
            return Err(RuntimeError::Backend { rank: be.rank(), op: "all_gather", bucket, source });
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            if matches!(p.flight.is_done(), Ok(false)) {
                i += 1;
                continue;
            }
            let id = p.id;
            // `finish` swap-removes index i: look at i again.
            self.finish(be, tables, id, How::Poll, counters, &mut *done)?;
        }
        Ok(())
    }
}
