//! Plans, fingerprints and the sans-IO scheduler: *when* things move.
//!
//! No I/O, no threads, no clocks, no unsafe.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use collsched_buckets as buckets;

pub mod fingerprint;
pub mod plan;

pub use collsched_topo::CollectiveKind;
pub use fingerprint::{PlanFingerprint, StableHasher};
pub use plan::{plan_from_json, BufferRole, CopyRun, Op, OpId, Plan, PlanInputError, PlanJson, RankGroups};

pub mod scheduler;
pub use scheduler::{
    split_divide, Action, BucketInput, BufferId, EngineEvent, Event, Explicit, Fence, Fences, GradReduce,
    GradSource, InflightRegistry, Launch, LaunchId, NoPrefetch, Offer, Ops, ParamState, PlanDigests,
    PolicyKind, PrefetchPolicy, ReduceSpec, Role, ScheduleError, ScheduleInput, Scheduler, SchedulerConfig,
    StepCounters, StepReport, Stream, TraceReplay, WaitOn,
};
