//! The scheduler's state and the moves every event handler is made of: acquiring a bucket,
//! making room, launching a gather, offering a prefetch, freeing a slot, opening and launching
//! a gradient bucket.

use std::collections::VecDeque;

use crate::buckets::{BucketId, ParamId};
use crate::plan::Plan;

use super::action::{Action, BufferId, Fence, Fences, Launch, LaunchId, Role, Stream, WaitOn};
use super::config::SchedulerConfig;
use super::error::ScheduleError;
use super::prefetch::Offer;
use super::registry::InflightRegistry;
use super::report::{self, StepCounters, StepReport};
use super::tables::Tables;

#[derive(Debug)]
/// The scheduler's state apart from its policy: per parameter, per bucket and per step.
pub(super) struct Core {
    pub(super) rank: u32,
    pub(super) config: SchedulerConfig,
    pub(super) registry: u64,
    pub(super) owner: u32,
    pub(super) t: Tables,
    pub(super) source: Option<Plan>,
    // per parameter
    pub(super) my_users: Vec<u32>,
    pub(super) released: Vec<bool>,
    pub(super) grad_seen: Vec<bool>,
    pub(super) accumulated: Vec<bool>,
    pub(super) n_accumulated: usize,
    pub(super) mask: Vec<bool>,
    pub(super) mask_pending: bool,
    // per gather bucket
    pub(super) my_bucket_users: Vec<u32>,
    pub(super) waited: Vec<Option<LaunchId>>,
    /// Fetched when a step ended and not fetched since: its next fetch is the new step's
    /// first use of it (the engine kept it across the boundary), told to the policy. Per
    /// bucket: of two units sharing a held bucket (a tied parameter) the first fetch is told,
    /// the second is not (as within a step).
    pub(super) held_over: Vec<bool>,
    /// This scheduler's unused prefetches, oldest first (fetches usually hit the front;
    /// evictions take the back).
    pub(super) pending: VecDeque<u32>,
    // per gradient bucket
    pub(super) grad_arrived: Vec<u32>,
    pub(super) grad_buffer: Vec<Option<BufferId>>,
    pub(super) grad_launched: Vec<bool>,
    /// Position in `reduces` of the gradient bucket's reduce this step (checked against the
    /// id, so stale entries of earlier steps are harmless): makes `OpDone` O(1).
    pub(super) reduce_slot: Vec<u32>,
    /// The step's reduce launches in launch order, with their completion.
    pub(super) reduces: Vec<(LaunchId, bool)>,
    pub(super) grads_this_step: usize,
    /// A fetch came since the last step ended (a release between steps prefetches nothing).
    pub(super) fetched_this_step: bool,
    pub(super) no_sync: bool,
    pub(super) counters: StepCounters,
    pub(super) report: StepReport,
    pub(super) step: u64,
}

impl Core {
    pub(super) fn check_registry(&self, registry: &InflightRegistry) -> Result<(), ScheduleError> {
        if registry.uid() != self.registry {
            return Err(ScheduleError::WrongRegistry {
                rank: self.rank,
                what: "this is not the registry the scheduler was attached to".to_string(),
            });
        }
        Ok(())
    }

    pub(super) fn check_ids(&self, op: &'static str, params: &[ParamId]) -> Result<(), ScheduleError> {
        let count = self.t.params.len();
        match params.iter().find(|p| p.index() >= count) {
            Some(&param) => Err(ScheduleError::UnknownParam { op, rank: self.rank, param, count }),
            None => Ok(()),
        }
    }

    pub(super) fn check_boundary(&self) -> Result<(), ScheduleError> {
        if self.n_accumulated > 0 {
            let first = self.accumulated.iter().position(|&a| a).map_or(0, |i| i as u32);
            return Err(ScheduleError::RefreshWithUnsynced {
                rank: self.rank,
                count: self.n_accumulated,
                first: self.t.params.name(ParamId(first)).to_string(),
            });
        }
        if self.grads_this_step > 0 {
            return Err(ScheduleError::RefreshMidStep { rank: self.rank, arrived: self.grads_this_step });
        }
        Ok(())
    }

    /// First fetch of bucket `g` by this scheduler: use it if gathered, else launch it; wait
    /// for it if not known complete.
    pub(super) fn acquire(&mut self, reg: &mut InflightRegistry, g: usize, out: &mut Vec<Action>) {
        if reg.launch_of(g).is_none() {
            self.make_room(reg, g, out);
            self.launch_gather(reg, g, false, out);
            self.counters.prefetch_misses += 1;
        } else if reg.unmark_prefetch(g) {
            self.counters.prefetch_hits += 1;
            if let Some(k) = self.pending.iter().position(|&x| x as usize == g) {
                self.pending.remove(k);
            }
        } else {
            self.counters.already_gathered += 1;
        }
        if let Some((launch, false)) = reg.launch_of(g) {
            if self.waited[g] != Some(launch) {
                out.push(Action::Wait { fence: Fence::Op(launch), on: WaitOn::Stream(Stream::Compute) });
                self.counters.waits += 1;
                self.waited[g] = Some(launch);
            }
        }
    }

    /// Before a fetch launches bucket `g`: evict this scheduler's unused prefetches (newest
    /// first) while the gathered memory would exceed `max_live_bytes`.
    pub(super) fn make_room(&mut self, reg: &mut InflightRegistry, g: usize, out: &mut Vec<Action>) {
        let need = reg.bucket_bytes(g);
        while reg.live_bytes().saturating_add(need) > self.config.max_live_bytes {
            let Some(v) = self.pending.pop_back() else { break };
            let v = v as usize;
            if reg.prefetched_by(v, self.owner) {
                self.free_slot(reg, v, out);
                self.counters.evictions += 1;
            }
        }
        if reg.live_bytes().saturating_add(need) > self.config.max_live_bytes {
            self.counters.live_overruns += 1;
        }
    }

    pub(super) fn launch_gather(
        &mut self,
        reg: &mut InflightRegistry,
        g: usize,
        prefetch: bool,
        out: &mut Vec<Action>,
    ) {
        let b = &self.t.gather[g];
        let serial = reg.next_serial();
        let id = LaunchId { serial, bucket: b.id, role: Role::Gather };
        let mut after = Fences::new();
        if let Some(ev) = reg.shards_fence() {
            after.push(Fence::Engine(ev));
        }
        out.push(Action::Launch(Launch {
            id,
            ops: b.ops.clone(),
            stream: Stream::AllGather,
            buffer: BufferId { bucket: b.id, serial },
            bytes: b.memory_bytes(),
            after,
            prefetch,
            step: self.step,
            reduce: None,
        }));
        let live = reg.start_gather(g, id, prefetch.then_some(self.owner));
        self.counters.peak_gathered_bytes = self.counters.peak_gathered_bytes.max(live as u64);
        self.counters.all_gathers += 1;
        self.counters.ops_issued += b.ops.len() as u64;
        for &k in &b.kinds {
            self.counters.ops_by_kind[report::kind_slot(k)] += 1;
        }
        self.counters.gathered_bytes += b.gathered_bytes as u64;
        if prefetch {
            self.pending.push_back(g as u32);
            self.counters.prefetch_launches += 1;
        }
    }

    /// The prefetch policy proposes `b`.
    pub(super) fn offer(&mut self, reg: &mut InflightRegistry, b: BucketId, out: &mut Vec<Action>) -> Offer {
        let Some(g) = self.t.gather_index(b) else { return Offer::Skipped };
        if reg.launch_of(g).is_some() {
            return Offer::Live;
        }
        let bytes = reg.bucket_bytes(g);
        let a = reg.ahead(self.owner);
        let cfg = &self.config;
        // The first bucket ahead is admitted whatever its size (a bucket larger than
        // `prefetch_bytes` would otherwise never be prefetched); beyond it, `prefetch_bytes`
        // bounds the bytes ahead. `max_inflight` and `max_live_bytes` always hold.
        let over_bytes = a.count > 0 && a.bytes.saturating_add(bytes) > cfg.prefetch_bytes;
        if a.count + 1 > cfg.max_inflight
            || over_bytes
            || reg.live_bytes().saturating_add(bytes) > cfg.max_live_bytes
        {
            return Offer::Stop;
        }
        self.launch_gather(reg, g, true, out);
        Offer::Launched
    }

    /// The policy gave up on bucket `b`: free it if it is still this scheduler's unused
    /// prefetch.
    pub(super) fn discard_prefetch(
        &mut self,
        reg: &mut InflightRegistry,
        b: BucketId,
        out: &mut Vec<Action>,
    ) {
        let Some(g) = self.t.gather_index(b) else { return };
        if reg.unused_prefetch(g, Some(self.owner)) {
            if let Some(k) = self.pending.iter().position(|&x| x as usize == g) {
                self.pending.remove(k);
            }
            self.free_slot(reg, g, out);
            self.counters.discarded_prefetches += 1;
        }
    }

    pub(super) fn free_slot(&mut self, reg: &mut InflightRegistry, g: usize, out: &mut Vec<Action>) {
        if let Some((launch, after)) = reg.take(g) {
            out.push(Action::Free {
                buffer: BufferId { bucket: launch.bucket, serial: launch.serial },
                after,
            });
            self.waited[g] = None;
        }
    }

    pub(super) fn open_grad(
        &mut self,
        reg: &mut InflightRegistry,
        j: usize,
        out: &mut Vec<Action>,
    ) -> BufferId {
        if let Some(b) = self.grad_buffer[j] {
            return b;
        }
        let b = BufferId { bucket: self.t.grad[j].id, serial: reg.next_serial() };
        out.push(Action::AllocGrad { buffer: b, bytes: self.t.grad_bytes(j) });
        self.grad_buffer[j] = Some(b);
        b
    }

    pub(super) fn launch_reduce(&mut self, reg: &mut InflightRegistry, j: usize, out: &mut Vec<Action>) {
        let buffer = self.open_grad(reg, j, out);
        self.grad_buffer[j] = None;
        let bytes = self.t.grad_bytes(j);
        let b = &self.t.grad[j];
        let id = LaunchId { serial: reg.next_serial(), bucket: b.id, role: Role::Reduce };
        out.push(Action::Launch(Launch {
            id,
            ops: b.ops.clone(),
            stream: Stream::ReduceScatter,
            buffer,
            bytes,
            after: Fences::new(),
            prefetch: false,
            reduce: Some(self.t.grad_reduce[j]),
            step: self.step,
        }));
        let mut after = Fences::new();
        after.push(Fence::Op(id));
        out.push(Action::Free { buffer, after });
        self.grad_launched[j] = true;
        self.reduce_slot[j] = self.reduces.len() as u32;
        self.reduces.push((id, false));
        self.counters.reduce_scatters += 1;
        self.counters.ops_issued += b.ops.len() as u64;
        for &k in &b.kinds {
            self.counters.ops_by_kind[report::kind_slot(k)] += 1;
        }
        self.counters.reduced_bytes += bytes as u64;
    }
}
