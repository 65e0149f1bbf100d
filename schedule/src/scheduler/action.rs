//! What goes into the scheduler ([`Event`]) and what comes out ([`Action`]).
//!
//! The scheduler never touches a buffer or a stream: it names them. A driver maps
//! [`BufferId`]s to memory, [`Stream`]s to its queues, [`Fence`]s to completion events, and runs
//! the actions in the order they were pushed.

use smallvec::SmallVec;

use crate::buckets::{BucketId, DType, ParamId};

use crate::plan::OpId;

/// An event the engine recorded on one of its queues: a CUDA event recorded on a compute
/// stream, a fence of the local backend.
///
/// Events of one `queue` complete in `seq` order, so a later event of a queue implies the
/// earlier ones; the scheduler keeps only the latest event per queue when it collects the
/// consumers of a buffer (which keeps deferred frees allocation-free).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineEvent {
    /// The engine's queue (stream) the event was recorded on.
    pub queue: u32,
    /// Record order on that queue (increasing).
    pub seq: u64,
}

/// Whether a launch gathers parameters or reduces gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// All-gather (or broadcast) of a gather bucket into its gathered buffer.
    Gather,
    /// Reduce-scatter (possibly followed by the plan's cross-group all-reduce) of a gradient
    /// bucket.
    Reduce,
}

/// Identity of one launch of a bucket's collective(s). Unique per [`InflightRegistry`]
/// (so schedulers sharing a registry never reuse an id); the driver hands it back in
/// [`Event::OpDone`].
///
/// [`InflightRegistry`]: super::InflightRegistry
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaunchId {
    /// Launch counter of the registry (0, 1, 2, ...), in launch order.
    pub serial: u64,
    /// The bucket the launch moves.
    pub bucket: BucketId,
    /// Gather or reduce.
    pub role: Role,
}

impl std::fmt::Display for LaunchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = match self.role {
            Role::Gather => "all_gather",
            Role::Reduce => "reduce_scatter",
        };
        write!(f, "{r}(bucket {}) launch #{}", self.bucket, self.serial)
    }
}

/// Something an action must wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fence {
    /// Completion of a launch.
    Op(LaunchId),
    /// An event the engine recorded (passed in [`Event::Release`], [`Event::GradReady`] or
    /// [`Event::ShardsUpdated`]).
    Engine(EngineEvent),
}

/// A short list of fences (inline up to 4: no heap allocation in the common case).
pub type Fences = SmallVec<[Fence; 4]>;

/// A named, in-order execution queue of one rank: the scheduler's actions name one, and the
/// backends run collectives on them (`collsched::backend` re-exports this type).
///
/// Work on one stream runs in launch order; work on different streams may overlap unless
/// ordered by events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stream {
    /// The dedicated all-gather stream (copy-in, all-gather, copy-out run in order on it).
    AllGather,
    /// The dedicated reduce-scatter stream (gradient copy-in and reduce-scatter run in order).
    ReduceScatter,
    /// The engine's compute stream (copy-in, copy-out, the engine's own work).
    Compute,
}

impl Stream {
    /// Every stream, in index order.
    pub const ALL: [Stream; 3] = [Stream::AllGather, Stream::ReduceScatter, Stream::Compute];

    /// A dense index (`0..Stream::ALL.len()`), for per-stream tables.
    pub const fn index(self) -> usize {
        match self {
            Stream::AllGather => 0,
            Stream::ReduceScatter => 1,
            Stream::Compute => 2,
        }
    }

    /// Lower-case name (`all_gather`, `reduce_scatter`, `compute`).
    pub const fn name(self) -> &'static str {
        match self {
            Stream::AllGather => "all_gather",
            Stream::ReduceScatter => "reduce_scatter",
            Stream::Compute => "compute",
        }
    }
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Who waits in [`Action::Wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitOn {
    /// A stream waits (CUDA `cudaStreamWaitEvent`): nothing blocks on the host.
    Stream(Stream),
    /// The calling thread blocks until the fence completed.
    Host,
}

/// A buffer the driver owns, named by the bucket and the serial of the launch (or gradient
/// bucket opening) that created it. A bucket can have an old buffer waiting for its deferred
/// free while a new one is in use: the serial tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId {
    /// The bucket whose gathered (or full-size gradient) buffer this is.
    pub bucket: BucketId,
    /// Serial from the registry's launch counter.
    pub serial: u64,
}

/// How a gradient bucket is reduced: the element type of the collective and the divide
/// factors, `(sum_r x_r / pre_divide) / post_divide` (the kernels' contract).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReduceSpec {
    /// Element type the reduction runs in (e.g. `F32` for `BF16` parameters).
    pub dtype: DType,
    /// Divide each rank's contribution before the sum (guards fp16 overflow).
    pub pre_divide: f64,
    /// Divide the sum after the reduction (world size / pre_divide for a mean).
    pub post_divide: f64,
}

/// The plan op ids one launch runs, in order, on one stream (one for a plain collective; two
/// for hybrid sharding's reduce-scatter + cross-group all-reduce).
pub type Ops = SmallVec<[OpId; 2]>;

/// Run a bucket's collective(s).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// Identity; the driver reports completion with [`Event::OpDone`]`(id)`.
    pub id: LaunchId,
    /// The plan ops to run, in order, on `stream`.
    pub ops: Ops,
    /// The stream to run on.
    pub stream: Stream,
    /// For [`Role::Gather`]: the gathered buffer, which the driver allocates now (with the
    /// unpacked copy, `bytes` in all). For [`Role::Reduce`]: the full-size gradient buffer opened by
    /// [`Action::AllocGrad`], the input of the reduce-scatter.
    pub buffer: BufferId,
    /// Bytes of `buffer`; for [`Role::Gather`] with the unpacked copy the driver allocates
    /// beside it ([`BucketInput::memory_bytes`](super::BucketInput::memory_bytes): the memory
    /// the launch takes, as the budgets count it).
    pub bytes: usize,
    /// Fences the stream waits for before the launch.
    pub after: Fences,
    /// Launched ahead of a fetch by the prefetch policy (for traces and counters).
    pub prefetch: bool,
    /// For reductions: the dtype and divide factors.
    pub reduce: Option<ReduceSpec>,
    /// The step it belongs to (0-based: the steps ended before it), for records and traces.
    pub step: u64,
}

/// Where the contents of a gradient copied into its bucket come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradSource {
    /// The gradient the engine just handed over.
    Fresh,
    /// The fresh gradient plus the local accumulator built under no_sync (which the driver
    /// then frees).
    FreshPlusAccumulated,
    /// Only the local accumulator (the parameter took no gradient in the sync step).
    Accumulated,
}

/// One thing for the driver to do. Actions are pushed in order; run them in that order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Launch a bucket's collective(s).
    Launch(Launch),
    /// Make `on` wait until `fence` completed.
    Wait {
        /// What to wait for.
        fence: Fence,
        /// Who waits.
        on: WaitOn,
    },
    /// Free `buffer` once every fence in `after` completed (the deferred free: CUDA's
    /// `record_stream`, done safely). An empty list means "now".
    Free {
        /// The buffer.
        buffer: BufferId,
        /// Fences to wait for before the memory may be reused.
        after: Fences,
    },
    /// Allocate a zero-filled full-size gradient buffer for a gradient bucket.
    AllocGrad {
        /// The buffer.
        buffer: BufferId,
        /// Its bytes: the gradient bucket's elements in its reduction dtype
        /// ([`ReduceSpec::dtype`]), into which gradients are cast as they are copied in.
        bytes: usize,
    },
    /// Copy a parameter's gradient into its place in a gradient buffer, on the reduce-scatter
    /// stream after `after`.
    CopyGradIn {
        /// The parameter.
        param: ParamId,
        /// The gradient buffer (opened by an earlier [`Action::AllocGrad`]).
        buffer: BufferId,
        /// Fresh gradient, accumulator, or both.
        source: GradSource,
        /// The engine's event after which the gradient is complete.
        after: Option<EngineEvent>,
    },
    /// no_sync: add the parameter's full-size gradient into its local accumulator (allocated
    /// zero-filled on first use), after `after`. Nothing is communicated.
    AccumulateGrad {
        /// The parameter.
        param: ParamId,
        /// The engine's event after which the gradient is complete.
        after: Option<EngineEvent>,
    },
}

/// An engine call or a completion, fed to [`Scheduler::handle`](super::Scheduler::handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event<'a> {
    /// The engine needs these parameters gathered (their whole buckets are).
    Fetch(&'a [ParamId]),
    /// The engine is done with these parameters; `after` is the event after which its use of
    /// them is complete (`None`: already complete on the host).
    Release {
        /// The parameters (each must have been fetched by this scheduler).
        params: &'a [ParamId],
        /// The consumer's completion event.
        after: Option<EngineEvent>,
    },
    /// The gradient of `param` is complete (after `after`).
    GradReady {
        /// The parameter (trainable in the current plan).
        param: ParamId,
        /// The producer's completion event.
        after: Option<EngineEvent>,
    },
    /// A launch completed. Only moves state from in-flight to available (saves `Wait`s);
    /// never changes what is launched.
    OpDone(LaunchId),
    /// The optimizer wrote the shards (after this event): gathers launched from now on wait for
    /// it. Shared by every scheduler on the registry.
    ShardsUpdated(EngineEvent),
    /// The step ends: unfilled gradient buckets are reduced, unused prefetches drained,
    /// trainability changes applied.
    EndStep,
    /// Turn no_sync (local gradient accumulation without communication) on or off, before the
    /// step's first gradient.
    SetNoSync(bool),
    /// The engine's current `requires_grad` mask (one entry per parameter); applied at the
    /// next step boundary when it differs from the plan's.
    SetTrainable(&'a [bool]),
}
