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
use super::input::{BucketInput, ScheduleInput};

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
struct Gathered {
    launch: LaunchId,
    done: bool,
    /// Unreleased fetches of the bucket's parameters (all schedulers).
    users: u32,
    /// The scheduler slot that prefetched it, until the first fetch.
    prefetched_by: Option<u32>,
    /// Latest consumer event per engine queue.
    consumers: Fences,
}

#[derive(Clone, Debug)]
struct Slot {
    id: BucketId,
    bytes: usize,
    gathered: Option<Gathered>,
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
///
/// Invariants, kept by its operations: `live_bytes` is the sum of the bytes of the gathered
/// slots; a slot's `users` is the sum of `param_users` over its parameters; `ahead[o]` counts
/// the slots with `prefetched_by == Some(o)`; launch serials only grow.
pub struct InflightRegistry {
    uid: u64,
    /// Per parameter: the position of its gather bucket.
    param_bucket: Vec<u32>,
    /// Per parameter: unreleased fetches (all schedulers).
    param_users: Vec<u32>,
    /// Per gather bucket (by position).
    slots: Vec<Slot>,
    live_bytes: usize,
    peak_live_bytes: usize,
    /// Per attached scheduler.
    ahead: Vec<Ahead>,
    next_serial: u64,
    /// The optimizer's last shard update: later gathers wait for it.
    shards_fence: Option<EngineEvent>,
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

    /// Which registry this is (schedulers check they were attached to it).
    pub(crate) fn uid(&self) -> u64 {
        self.uid
    }

    /// Whether this registry was created for gather buckets `gather` holding parameters as
    /// `param_bucket` says.
    pub(crate) fn fits(&self, param_bucket: &[u32], gather: &[BucketInput]) -> bool {
        self.param_bucket == param_bucket
            && self.slots.len() == gather.len()
            && self.slots.iter().zip(gather).all(|(s, b)| s.id == b.id && s.bytes == b.memory_bytes())
    }

    /// Gather buckets (slots).
    pub(crate) fn buckets(&self) -> usize {
        self.slots.len()
    }

    /// Launch serials issued so far (every id below is known).
    pub(crate) fn issued(&self) -> u64 {
        self.next_serial
    }

    /// Bytes of bucket `g` when gathered (with its unpacked copy).
    pub(crate) fn bucket_bytes(&self, g: usize) -> usize {
        self.slots[g].bytes
    }

    /// The launch gathering bucket `g` and whether it completed, if gathered.
    pub(crate) fn launch_of(&self, g: usize) -> Option<(LaunchId, bool)> {
        self.slots[g].gathered.as_ref().map(|s| (s.launch, s.done))
    }

    /// Whether bucket `g` is gathered and was prefetched by scheduler `owner`, not fetched yet.
    pub(crate) fn prefetched_by(&self, g: usize, owner: u32) -> bool {
        self.slots[g].gathered.as_ref().is_some_and(|s| s.prefetched_by == Some(owner))
    }

    /// Whether bucket `g` is a prefetch (of `owner`, or of anyone when `None`) nobody uses.
    pub(crate) fn unused_prefetch(&self, g: usize, owner: Option<u32>) -> bool {
        self.slots[g].gathered.as_ref().is_some_and(|s| {
            s.users == 0 && s.prefetched_by.is_some() && (owner.is_none() || s.prefetched_by == owner)
        })
    }

    /// The optimizer's last shard update, which new gathers wait for.
    pub(crate) fn shards_fence(&self) -> Option<EngineEvent> {
        self.shards_fence
    }

    /// Records the optimizer's shard update `ev`.
    pub(crate) fn set_shards_fence(&mut self, ev: EngineEvent) {
        self.shards_fence = Some(ev);
    }

    /// Marks bucket `g` gathered by `launch` (prefetched by scheduler `prefetched_by`, or
    /// fetched); counts its bytes live (and ahead for a prefetch). Returns the live bytes.
    pub(crate) fn start_gather(&mut self, g: usize, launch: LaunchId, prefetched_by: Option<u32>) -> usize {
        let bytes = self.slots[g].bytes;
        self.slots[g].gathered =
            Some(Gathered { launch, done: false, users: 0, prefetched_by, consumers: Fences::new() });
        self.live_bytes += bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        if let Some(a) = prefetched_by.and_then(|o| self.ahead.get_mut(o as usize)) {
            a.bytes += bytes;
            a.count += 1;
        }
        self.live_bytes
    }

    /// Gather `id` of bucket `g` completed (a stale id, of a buffer already freed, changes
    /// nothing).
    pub(crate) fn complete(&mut self, g: usize, id: LaunchId) {
        if let Some(s) = self.slots[g].gathered.as_mut().filter(|s| s.launch == id) {
            s.done = true;
        }
    }

    /// One more fetch of parameter `p` of bucket `g`.
    pub(crate) fn add_user(&mut self, p: ParamId, g: usize) {
        self.param_users[p.index()] += 1;
        if let Some(s) = self.slots[g].gathered.as_mut() {
            s.users += 1;
        }
    }

    /// One fetch of parameter `p` of bucket `g` released after `after`; returns whether it was
    /// the bucket's last user (then the caller frees it with [`take`](Self::take)).
    pub(crate) fn release_user(&mut self, p: ParamId, g: usize, after: Option<EngineEvent>) -> bool {
        self.param_users[p.index()] -= 1;
        match self.slots[g].gathered.as_mut() {
            Some(s) => {
                s.users -= 1;
                if let Some(ev) = after {
                    add_consumer(&mut s.consumers, ev);
                }
                s.users == 0
            }
            None => false,
        }
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
fn add_consumer(fences: &mut Fences, ev: EngineEvent) {
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
