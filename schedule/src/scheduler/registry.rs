//! The in-flight registry: which gather buckets are gathered, by which launch, who uses them.
//!
//! # Design note: in-flight tracking and deferred frees
//! One registry exists per rank per model (per [`ParamSet`](crate::buckets::ParamSet)); every
//! scheduler of that rank on that model borrows it for each event, so a training and an
//! evaluation scheduler share it (`src/` keeps it behind a lock). State is kept per **gather
//! bucket**, because a bucket is gathered as a whole:
//!
//! - no slot: every parameter of the bucket is [`ParamState::NotAvailable`];
//! - a slot with `launch` and `done == false`: [`ParamState::InFlight`];
//! - a slot with `done == true`: [`ParamState::Available`], with a user count per parameter.
//!
//! `done` is the only field that completions ([`Event::OpDone`](super::Event::OpDone)) touch,
//! and no launch decision reads it: it only saves `Wait` actions. Everything else changes only
//! with engine events, so it is the same on every rank.
//!
//! A slot also remembers who prefetched it (until the first fetch) and the latest consumer
//! event per engine queue. When the last user releases, the slot goes away and the scheduler
//! emits `Free { after: consumer events }`: the driver reuses the memory only after the
//! consumers' work completed (the safe form of CUDA's `record_stream`). A bucket held by one
//! scheduler is never freed by another (the user count is shared), and a bucket gathered by
//! one is used, not gathered again, by the other.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::buckets::{BucketId, ParamId};

use super::action::{BufferId, EngineEvent, Fence, Fences, LaunchId};
use super::input::ScheduleInput;

static NEXT_REGISTRY: AtomicU64 = AtomicU64::new(1);

/// The state of one parameter on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamState {
    /// Not gathered.
    NotAvailable,
    /// Its bucket's gather was launched and has not been reported complete.
    InFlight(LaunchId),
    /// Gathered; `users` fetches of this parameter are not yet released.
    Available {
        /// Unreleased fetches of this parameter (all schedulers).
        users: u32,
    },
}

/// A gathered bucket.
#[derive(Clone, Debug)]
pub(crate) struct Gathered {
    pub(crate) launch: LaunchId,
    pub(crate) done: bool,
    /// Unreleased fetches of the bucket's parameters (all schedulers).
    pub(crate) users: u32,
    /// The scheduler slot that prefetched it, until the first fetch.
    pub(crate) prefetched_by: Option<u32>,
    /// Latest consumer event per engine queue.
    pub(crate) consumers: Fences,
}

#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub(crate) id: BucketId,
    pub(crate) bytes: usize,
    pub(crate) gathered: Option<Gathered>,
}

/// Prefetch budget use of one attached scheduler.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ahead {
    pub(crate) bytes: usize,
    pub(crate) count: usize,
}

/// Per-rank, per-model state of every gather bucket, shared by all schedulers on the model.
///
/// Create one per rank per model, then attach schedulers to it
/// ([`Scheduler::new`](super::Scheduler::new)); pass it to every
/// [`Scheduler::handle`](super::Scheduler::handle) call.
#[derive(Debug)]
pub struct InflightRegistry {
    pub(crate) uid: u64,
    pub(crate) param_bucket: Vec<u32>,
    pub(crate) param_users: Vec<u32>,
    pub(crate) slots: Vec<Slot>,
    pub(crate) live_bytes: usize,
    pub(crate) peak_live_bytes: usize,
    pub(crate) ahead: Vec<Ahead>,
    pub(crate) next_serial: u64,
    pub(crate) shards_fence: Option<EngineEvent>,
}

impl InflightRegistry {
    /// An empty registry (nothing gathered) for the gather buckets of `input`.
    pub fn new(input: &ScheduleInput) -> InflightRegistry {
        let mut param_bucket = vec![u32::MAX; input.params.len()];
        for (g, b) in input.gather.iter().enumerate() {
            for p in &b.params {
                if let Some(x) = param_bucket.get_mut(p.index()) {
                    *x = g as u32;
                }
            }
        }
        InflightRegistry {
            uid: NEXT_REGISTRY.fetch_add(1, Ordering::Relaxed),
            param_bucket,
            param_users: vec![0; input.params.len()],
            slots: input
                .gather
                .iter()
                .map(|b| Slot { id: b.id, bytes: b.memory_bytes(), gathered: None })
                .collect(),
            live_bytes: 0,
            peak_live_bytes: 0,
            ahead: Vec::new(),
            next_serial: 0,
            shards_fence: None,
        }
    }

    /// The state of a parameter (`NotAvailable` for an id outside the model).
    pub fn param_state(&self, param: ParamId) -> ParamState {
        let Some(&g) = self.param_bucket.get(param.index()) else {
            return ParamState::NotAvailable;
        };
        match self.slots.get(g as usize).and_then(|s| s.gathered.as_ref()) {
            None => ParamState::NotAvailable,
            Some(s) if !s.done => ParamState::InFlight(s.launch),
            Some(_) => ParamState::Available { users: self.param_users[param.index()] },
        }
    }

    /// The launch that gathered a parameter's bucket, if gathered (in flight or available).
    pub fn gathered_by(&self, param: ParamId) -> Option<LaunchId> {
        let g = *self.param_bucket.get(param.index())?;
        self.slots.get(g as usize)?.gathered.as_ref().map(|s| s.launch)
    }

    /// The gathered buffer holding a parameter (its bucket's, named as in the gather
    /// [`Launch`](super::Launch)), if gathered: where a driver finds the parameter's full
    /// value after a fetch.
    pub fn buffer_of(&self, param: ParamId) -> Option<BufferId> {
        self.gathered_by(param).map(|l| BufferId { bucket: l.bucket, serial: l.serial })
    }

    /// Unreleased fetches of a parameter, over all schedulers.
    pub fn users(&self, param: ParamId) -> u32 {
        self.param_users.get(param.index()).copied().unwrap_or(0)
    }

    /// Bytes of all gathered buffers not yet freed, with their unpacked copies
    /// ([`BucketInput::memory_bytes`](super::BucketInput::memory_bytes)).
    pub fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// The highest [`live_bytes`](Self::live_bytes) since creation or the last
    /// [`reset_peak`](Self::reset_peak).
    pub fn peak_live_bytes(&self) -> usize {
        self.peak_live_bytes
    }

    /// Restarts peak tracking from the current live bytes.
    pub fn reset_peak(&mut self) {
        self.peak_live_bytes = self.live_bytes;
    }

    /// Gather buckets currently gathered (in flight or available), with their launch and
    /// their user count.
    pub fn gathered(&self) -> impl Iterator<Item = (BucketId, LaunchId, u32)> + '_ {
        self.slots.iter().filter_map(|s| s.gathered.as_ref().map(|g| (s.id, g.launch, g.users)))
    }

    /// Bytes launched ahead (prefetched, not yet fetched) by the scheduler in slot `owner`.
    pub(crate) fn ahead(&self, owner: u32) -> Ahead {
        self.ahead.get(owner as usize).copied().unwrap_or_default()
    }

    pub(crate) fn attach(&mut self) -> u32 {
        self.ahead.push(Ahead::default());
        (self.ahead.len() - 1) as u32
    }

    pub(crate) fn next_serial(&mut self) -> u64 {
        let s = self.next_serial;
        self.next_serial += 1;
        s
    }

    /// Clears the prefetch mark of a slot and gives back its owner's budget.
    pub(crate) fn unmark_prefetch(&mut self, g: usize) -> bool {
        let bytes = self.slots[g].bytes;
        let Some(s) = self.slots[g].gathered.as_mut() else { return false };
        let Some(owner) = s.prefetched_by.take() else { return false };
        if let Some(a) = self.ahead.get_mut(owner as usize) {
            a.bytes -= bytes;
            a.count -= 1;
        }
        true
    }

    /// Drops a slot's gathered state; returns the fences the free must wait for.
    pub(crate) fn take(&mut self, g: usize) -> Option<(LaunchId, Fences)> {
        self.unmark_prefetch(g);
        let slot = &mut self.slots[g];
        let s = slot.gathered.take()?;
        self.live_bytes -= slot.bytes;
        let mut after = s.consumers;
        if !s.done {
            after.push(Fence::Op(s.launch));
        }
        Some((s.launch, after))
    }
}

/// Adds a consumer event, keeping only the latest per engine queue.
pub(crate) fn add_consumer(fences: &mut Fences, ev: EngineEvent) {
    for f in fences.iter_mut() {
        if let Fence::Engine(e) = f {
            if e.queue == ev.queue {
                if ev.seq > e.seq {
                    *e = ev;
                }
                return;
            }
        }
    }
    fences.push(Fence::Engine(ev));
}
