//! Stream threads of the local backend: one thread per (rank, stream), running its work in
//! order.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crossbeam::channel::{self, Receiver, Sender};
use smallvec::SmallVec;

use super::event::LocalEvent;
use super::rendezvous::{Arrival, Caller, Channel, Post};
use super::Shared;
use crate::backend::{BackendError, BackendEvent, CollDesc, OpId, RankGroup, Stream};

/// Host work enqueued on a stream.
pub(super) type HostFn = Box<dyn FnOnce() -> Result<(), BackendError> + Send>;

/// One item of a stream's queue.
pub(super) enum Work {
    /// A (group of) collective(s).
    Coll {
        group: RankGroup,
        first: CollDesc,
        post: Box<Post>,
        after: SmallVec<[LocalEvent; 4]>,
        event: LocalEvent,
    },
    /// Complete an event when reached.
    Record(LocalEvent),
    /// Wait for an event before going on.
    Wait(LocalEvent),
    /// Run host code.
    Host { f: HostFn, event: LocalEvent },
}

/// Starts the thread of (`rank`, `stream`) and returns its queue. If the thread cannot be
/// started, the queue is closed (launches then fail with `Shutdown`).
pub(super) fn spawn(rank: usize, stream: Stream, shared: Arc<Shared>) -> Sender<Work> {
    let (tx, rx) = channel::unbounded();
    let name = format!("collsched-r{rank}-{stream}");
    let started = std::thread::Builder::new()
        .name(name)
        .spawn(move || StreamThread { rank, stream, shared, poison: None, channels: HashMap::new() }.run(rx));
    if let Err(e) = started {
        tracing::error!(target: "collsched::init", rank, %stream, error = %e, "cannot start stream thread");
        let (dead_tx, _) = channel::unbounded();
        return dead_tx;
    }
    tx
}

struct StreamThread {
    rank: usize,
    stream: Stream,
    shared: Arc<Shared>,
    /// The first failure on this stream: every later item fails with it (CUDA's sticky errors).
    poison: Option<BackendError>,
    /// Channels used so far and the next sequence number on each.
    channels: HashMap<RankGroup, (Arc<Channel>, u64)>,
}

impl StreamThread {
    fn run(mut self, rx: Receiver<Work>) {
        while let Ok(work) = rx.recv() {
            self.step(work);
        }
        // Every collective this (rank, stream) will ever post has been posted: tell waiters.
        self.shared.departures.set_departed(self.rank, self.stream);
        self.shared.channels.poke(self.rank, self.stream);
    }

    fn fail(&mut self, e: BackendError) {
        if self.poison.is_none() {
            tracing::warn!(target: "collsched::coll", rank = self.rank, stream = %self.stream, error = %e, "stream failed");
            self.poison = Some(e);
        }
    }

    fn wait_for(&mut self, event: &LocalEvent) -> Result<(), BackendError> {
        match event.wait(self.shared.config.timeout) {
            Err(BackendError::EventTimeout { waited }) => {
                Err(BackendError::StreamWaitTimeout { rank: self.rank, stream: self.stream, waited })
            }
            other => other,
        }
    }

    fn step(&mut self, work: Work) {
        match work {
            Work::Record(event) => event.complete(self.poison.clone().map_or(Ok(()), Err)),
            Work::Wait(event) => {
                if self.poison.is_none() {
                    if let Err(e) = self.wait_for(&event) {
                        self.fail(e);
                    }
                }
            }
            Work::Host { f, event } => {
                let result = match self.poison.clone() {
                    Some(p) => Err(p),
                    None => catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                        Err(BackendError::Unsupported {
                            what: format!("rank {}: host work on stream {} panicked", self.rank, self.stream),
                        })
                    }),
                };
                if let Err(e) = &result {
                    self.fail(e.clone());
                }
                event.complete(result);
            }
            Work::Coll { group, first, post, after, event } => {
                let shared = Arc::clone(&self.shared);
                let entry = self
                    .channels
                    .entry(group)
                    .or_insert_with_key(|g| (shared.channels.get(self.stream, g), 0));
                let chan = Arc::clone(&entry.0);
                let seq = entry.1;
                entry.1 += 1;
                let op = OpId { desc: first, stream: self.stream, seq: Some(seq) };
                tracing::trace!(target: "collsched::coll", rank = self.rank, %op, ops = post.len(), "collective starts");
                let arrival = match self.poison.clone() {
                    Some(p) => Arrival::Failed(p),
                    None => match after.iter().try_for_each(|e| self.wait_for(e)) {
                        Ok(()) => Arrival::Ops(*post),
                        Err(e) => Arrival::Failed(e),
                    },
                };
                let caller = Caller {
                    rank: self.rank,
                    config: &shared.config,
                    departures: &shared.departures,
                    spin: chan.group().len() <= shared.cores,
                };
                let result = chan.run(&caller, seq, arrival, &op);
                if let Err(e) = &result {
                    self.fail(e.clone());
                }
                event.complete(result);
            }
        }
    }
}
