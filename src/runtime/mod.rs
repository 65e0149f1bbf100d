//! The runtime: the driver that runs the scheduler's actions on a backend, the per-rank model
//! state, and the engine-facing [`Coordinator`].
//!
//! # A training step on one rank
//! ```text
//! let state = ModelState::new(Arc::new(backend), &plan, &initial_values)?;  // this rank's shards
//! let mut train = state.coordinator(SchedulerConfig::default())?;           // exchanges fingerprints
//! let mut eval  = state.coordinator(SchedulerConfig::default())?;           // shares the registry
//! for micro-batch in all but the last: { let mut g = train.no_sync()?; step(&mut g)?; g.end_step()?; }
//! step(&mut train)?; train.end_step()?;             // reduces everything (accumulated too)
//! train.update_shards_f32(|_, _, w, g| sgd(w, g))?;  // the optimizer runs on shards
//! where step = for each layer: let v = c.fetch(&layer)?; compute(v); c.release(&layer)?;
//!              then backward in reverse: fetch, backward, grad_ready per parameter, release
//! ```
//! Trainability changes go through [`Coordinator::refresh_trainable`] between steps (or
//! [`Coordinator::set_trainable`], applied at the next `end_step`); both exchange the new plan
//! fingerprint with the peers, so ranks that disagree get `PlanMismatch` naming the first
//! differing bucket instead of a hang.
//!
//! # Gradients in another dtype, and hybrid's two stages
//! A bucket of dtype P reduced in R (`GradReduce::dtype`: f16/bf16 -> f32, f32 -> bf16/f16, or
//! P itself; other pairs are [`RuntimeError::ReduceDtype`] when the coordinator is created):
//! the engine's gradient (P) is cast into the gradient buffer (R) at copy-in; no_sync
//! accumulators hold R (as FSDP2 keeps the unsharded gradient in `reduce_dtype`; each later
//! micro-batch is added in f32 and rounded to R); the collectives run in R with the pre/post
//! divide factors; the optimizer hook gets the reduced gradient in R
//! ([`ShardUpdate::grad_elem`]), never rounded again ([`Coordinator::update_shards_f32`]
//! widens it for f32 parameters). Hybrid sharding's cross-group all-reduce is chained behind
//! the in-group reduce-scatter on the same stream
//! ([`Backend::launch_then`](crate::backend::Backend::launch_then)): no host wait between the
//! stages.
//!
//! # Views and engine events
//! `fetch` returns [`Views`]: each parameter is a byte range of a backend buffer, either the
//! gathered buffer itself (parameters that are one contiguous run of it: Flat, Greedy,
//! single-owner buckets; zero copies after the collective) or, for a bucket with any parameter
//! that is not (EvenSplit, Hybrid), an unpacked buffer holding every parameter of the bucket,
//! filled once from the gathered buffer by the backend's `unpack`, taken from the pool with the
//! gathered buffer, which goes back to the pool as soon as the unpack is done; the scheduler
//! counts both (the peak while unpacking), or the unpacked buffer alone where the all-gather
//! places the pieces itself (local, shm: `ScheduleInput::placing`). Host backends
//! read them as slices (`bytes`, `f32`); device backends get the buffer and range (`buffer`)
//! or a host copy (`copy_to_host`, `read_f32`).
//!
//! `release` / `grad_ready` are host-synchronous ("done now"). An engine that overlaps passes
//! the event it recorded after its work: [`Coordinator::release_after`] (the buckets' buffers
//! are freed, and reused, only after it) and [`Coordinator::grad_ready_after`] (waits for it
//! on the host before taking the gradient).
//!
//! # On a device backend
//! A backend whose buffers live on a device ([`Backend::device`](crate::backend::Backend::device):
//! CUDA) changes where things are, not what an engine calls:
//! - **Shards** live in the backend's buffers: an engine's optimizer updates them there
//!   ([`ModelState::shard_region`] names the device), a gather copies its shard in on its own
//!   stream behind everything the compute stream ran so far, and host reads and writes
//!   (checkpoints, [`Coordinator::update_shards`]) go through host copies after the compute
//!   stream.
//! - **A fetch does not wait on the host**: the compute stream waits for the gathers (and any
//!   unpack, queued right behind the gather on its stream), and the views are handed out
//!   before the collectives completed; host reads of them wait first, and a gather that
//!   fails after the fetch is reported by the coordinator's next call.
//! - **Gradients** may be given in the backend's memory ([`Coordinator::grad_ready_on_device`],
//!   in the reduction dtype): packed into the gradient bucket on the compute stream, the
//!   reduction fenced behind it, the reduced shard kept there
//!   ([`Coordinator::take_grad_shards`]). The engine accumulates micro-batches under
//!   `no_sync` itself. Host gradients ([`Coordinator::grad_ready`]) are staged on the host
//!   and copied in at launch, as before.
//!
//! # Departures
//! - On a host backend a fetch waits on the host for its gathers (the scheduler's `Wait` on
//!   the compute stream runs as a host wait), so views are complete when `fetch` returns;
//!   `grad_ready_after` waits on the host too (the gradient is a host slice borrowed for the
//!   call). Releases with events never block.
//! - Gradient shards and no_sync accumulators live in the model state: one coordinator per
//!   model should produce gradients at a time (the evaluation one only fetches).

mod agreement;
mod bytes;
mod coordinator;
mod driver;
mod flight;
mod gather;
mod reduce;
mod shards;
mod state;
mod tables;
mod views;

pub use coordinator::{Coordinator, NoSync, StepStats};
pub use flight::DriverCounters;
pub use state::{GradRegion, ModelState, ShardRegion, ShardUpdate};
pub use views::Views;

use collsched_buckets::{BucketId, DType};
use collsched_schedule::ScheduleError;

use crate::backend::BackendError;

/// An error of the runtime: names the rank and, where one is involved, the parameter, the
/// bucket and the op.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The scheduler refused the event (it names rank, parameter, bucket and op); nothing
    /// changed.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A collective or buffer operation of the backend failed.
    #[error("rank {rank}: {op}{}: {source}", bucket.map_or(String::new(), |b| format!(" (bucket {b})")))]
    Backend {
        /// The rank.
        rank: usize,
        /// The operation (`all_gather`, `reduce_scatter`, `plan fingerprint exchange`, ...).
        op: &'static str,
        /// The bucket, if the op moves one.
        bucket: Option<BucketId>,
        /// The backend's error.
        source: BackendError,
    },
    /// A parameter value or gradient the engine passed is wrong, or a parameter is not
    /// available.
    #[error("rank {rank}: parameter {}: {what}", param.as_deref().unwrap_or("(all)"))]
    Param {
        /// The rank.
        rank: usize,
        /// The parameter's name (or id), when one is concerned.
        param: Option<String>,
        /// What is wrong and what to do.
        what: String,
    },
    /// The plan does not fit the backend or the call order.
    #[error("rank {rank}: {what}")]
    Plan {
        /// The rank.
        rank: usize,
        /// What is wrong and what to do.
        what: String,
    },
    /// A gradient bucket's reduction dtype (`GradReduce::dtype`) cannot be used with its
    /// gradients' dtype.
    #[error(
        "rank {rank}: gradient bucket {bucket}{}: holds {dtype} gradients, reduction dtype {reduce} \
         refused: {what}",
        gather_bucket.map_or(String::new(), |g| format!(" (of gather bucket {g}, the key of reduce_per_bucket)"))
    )]
    ReduceDtype {
        /// The rank.
        rank: usize,
        /// The gradient bucket.
        bucket: BucketId,
        /// The gather bucket it belongs to (the key of `SchedulerConfig::reduce_per_bucket`),
        /// if one.
        gather_bucket: Option<BucketId>,
        /// The bucket's (parameters' and gradients') dtype.
        dtype: DType,
        /// The reduction dtype asked for.
        reduce: DType,
        /// Why, and what to do.
        what: String,
    },
    /// A broken invariant of the runtime itself (a bug in collsched, not in the caller's
    /// input): report it with the message.
    #[error("rank {rank}: internal error (a bug in collsched; please report it): {what}")]
    Internal {
        /// The rank.
        rank: usize,
        /// The invariant that broke.
        what: String,
    },
    /// Something this driver does not support yet.
    #[error("rank {rank}: {what}")]
    Unsupported {
        /// The rank.
        rank: usize,
        /// What, and what to do instead.
        what: String,
    },
}
