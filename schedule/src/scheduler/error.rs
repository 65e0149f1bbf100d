//! [`ScheduleError`]: every way an event can be wrong, with the values that make it wrong.
//!
//! A failed event changes no state: the scheduler is as it was before the call (actions
//! pushed by earlier events stay valid; an erroring event pushes none, except
//! [`Event::EndStep`](super::Event::EndStep), whose actions are pushed before the
//! trainability check that may fail and must be run).

use crate::buckets::{BucketId, LayoutError, ParamId};

use super::action::LaunchId;

/// An error of the scheduler.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ScheduleError {
    /// An event names a parameter id the plan does not have.
    #[error("{op}(rank {rank}): parameter id {param} is not in the plan ({count} parameters); pass ids of the ParamSet the plan was built from")]
    UnknownParam {
        /// The event (`fetch`, `release`, `grad_ready`).
        op: &'static str,
        /// This scheduler's rank.
        rank: u32,
        /// The offending id.
        param: ParamId,
        /// Parameters in the plan.
        count: usize,
    },
    /// A release of a parameter this scheduler never fetched (or already released).
    #[error("release(rank {rank}): parameter `{name}` (id {param}, gather bucket {bucket}) was {}; call fetch before release, once per release (nothing was changed)", if *.twice { "already released" } else { "never fetched by this scheduler" })]
    NotFetched {
        /// This scheduler's rank.
        rank: u32,
        /// The parameter.
        param: ParamId,
        /// Its name.
        name: String,
        /// Its gather bucket.
        bucket: BucketId,
        /// Whether it was fetched and released before (a double release).
        twice: bool,
    },
    /// A gradient for a parameter the plan treats as frozen.
    #[error("grad_ready(rank {rank}): parameter `{name}` (id {param}, gather bucket {bucket}) is frozen in the current plan; make it trainable with set_trainable/refresh_trainable at a step boundary first")]
    GradOfFrozen {
        /// This scheduler's rank.
        rank: u32,
        /// The parameter.
        param: ParamId,
        /// Its name.
        name: String,
        /// Its gather bucket.
        bucket: BucketId,
    },
    /// A second gradient for one parameter in one step.
    #[error("grad_ready(rank {rank}): parameter `{name}` (id {param}, gradient bucket {bucket}) already gave its gradient this step; call grad_ready once per parameter per step, when its gradient is complete")]
    GradTwice {
        /// This scheduler's rank.
        rank: u32,
        /// The parameter.
        param: ParamId,
        /// Its name.
        name: String,
        /// Its gradient bucket.
        bucket: BucketId,
    },
    /// A completion for a launch that was never issued.
    #[error("op_done(rank {rank}): {launch} was never launched (the registry issued {issued} launches); pass back the id of a Launch action")]
    UnknownLaunch {
        /// This scheduler's rank.
        rank: u32,
        /// The id.
        launch: LaunchId,
        /// Launches issued so far.
        issued: u64,
    },
    /// no_sync switched after gradients arrived in the step.
    #[error("set_no_sync(rank {rank}): {arrived} gradients already arrived this step with no_sync={current}; switch no_sync only between steps (before the first grad_ready)")]
    NoSyncMidStep {
        /// This scheduler's rank.
        rank: u32,
        /// The current setting.
        current: bool,
        /// Gradients already given this step.
        arrived: usize,
    },
    /// A trainability mask of the wrong length.
    #[error("set_trainable(rank {rank}): mask has {got} entries, the plan has {expected} parameters; give one entry per parameter, by id")]
    MaskLength {
        /// This scheduler's rank.
        rank: u32,
        /// Entries given.
        got: usize,
        /// Parameters in the plan.
        expected: usize,
    },
    /// A trainability refresh while no_sync-accumulated gradients exist.
    #[error("refresh_trainable(rank {rank}): {count} parameters hold un-synced (no_sync-accumulated) gradients, first `{first}`; run a step without no_sync to reduce them, then change trainability (the plan was not changed)")]
    RefreshWithUnsynced {
        /// This scheduler's rank.
        rank: u32,
        /// Parameters with accumulated gradients.
        count: usize,
        /// The first of them.
        first: String,
    },
    /// A trainability refresh in the middle of a step.
    #[error("refresh_trainable(rank {rank}): {arrived} gradients arrived this step; refresh at a step boundary (after end_step)")]
    RefreshMidStep {
        /// This scheduler's rank.
        rank: u32,
        /// Gradients given this step.
        arrived: usize,
    },
    /// A refresh on a scheduler that has no layout/plan to refresh from.
    #[error("refresh_trainable(rank {rank}): this scheduler was built from raw tables; build it with Scheduler::from_plan, or call Scheduler::replace_grad_tables with refreshed tables")]
    NoRefreshSource {
        /// This scheduler's rank.
        rank: u32,
    },
    /// The layout rejected the refresh.
    #[error("refresh_trainable(rank {rank}): {source}")]
    Refresh {
        /// This scheduler's rank.
        rank: u32,
        /// The layout's error.
        source: LayoutError,
    },
    /// Refreshed tables changed the gather buckets.
    #[error("refresh_trainable(rank {rank}): the refreshed plan changed gather bucket {bucket}; a trainability refresh must keep gather buckets and shards")]
    RefreshChangedGather {
        /// This scheduler's rank.
        rank: u32,
        /// The first gather bucket that differs.
        bucket: BucketId,
    },
    /// A knob with a value that cannot work.
    #[error("scheduler config: {what}")]
    BadConfig {
        /// What is wrong and what to use instead.
        what: String,
    },
    /// Tables that do not describe a valid plan.
    #[error("scheduler input: {what}")]
    BadInput {
        /// What is wrong.
        what: String,
    },
    /// A registry built for another parameter set / layout, or another registry than the one
    /// the scheduler was attached to.
    #[error("rank {rank}: {what}; pass the InflightRegistry this scheduler was created with (one per rank per model)")]
    WrongRegistry {
        /// This scheduler's rank.
        rank: u32,
        /// What differs.
        what: String,
    },
    /// Ranks disagree on the plan.
    #[error("plan agreement: rank {rank} has fingerprint {mine:016x}, rank {peer} has {theirs:016x}; first differing bucket: {}; build both plans from the same parameters, strategy, world, bucket size and bucket boundaries", match bucket { Some(b) => format!("{b}"), None => "none (the parameter list or settings differ)".to_string() })]
    PlanMismatch {
        /// This rank.
        rank: u32,
        /// The peer rank.
        peer: u32,
        /// This rank's fingerprint.
        mine: u64,
        /// The peer's fingerprint.
        theirs: u64,
        /// The first bucket whose digest differs (or that only one side has).
        bucket: Option<BucketId>,
    },
}
