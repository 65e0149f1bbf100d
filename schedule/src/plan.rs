//! [`Plan`]: the coalesced collective ops of a [`Layout`], with their copy-in / copy-out
//! lists and a [`PlanFingerprint`].
//!
//! One op per bucket and step of the data path (FSDP2's copy-in / collective / copy-out):
//!
//! | bucket | op | input -> output | copy-in | copy-out |
//! |---|---|---|---|---|
//! | gather | `AllGather` over each shard group | shard -> gathered | shard segments | gathered segments |
//! | gather, single owner (Greedy) | `Broadcast` from the owner | shard -> gathered (= shard) | on the owner | gathered segments |
//! | grad | `ReduceScatter` over each shard group | gathered -> shard | gathered segments | shard segments (not for Hybrid with several groups) |
//! | grad, Hybrid with several groups | then `AllReduce` across groups (ranks `{i, i+G, ...}`) | shard -> shard, in place | - | shard segments |
//! | grad, single owner (Greedy) | `AllReduce` over the world | gathered (= shard) -> shard | gathered segments | shard segments (the owner's) |
//!
//! Op ids are numbered bucket by bucket in bucket-id order, so the ops of gather buckets keep
//! their ids when only the trainability mask changes.
//!
//! [`Plan::json`] is the plan as `collsched plan --json` prints it ([`json`]).

use std::sync::Arc;

use collsched_buckets::{
    Boundary, BucketId, BucketKind, Layout, LayoutBuilder, LayoutDiff, LayoutError, ModuleKey,
    ParamFileError, ParamId, ParamSet, Sharding,
};

use crate::fingerprint::{PlanFingerprint, StableHasher};
use collsched_topo::CollectiveKind;

pub mod json;

pub use json::PlanJson;

/// Dense index of an op in its [`Plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

impl OpId {
    /// The id as an index into [`Plan::ops`].
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The fingerprint's code of a collective kind (part of the plan's canonical encoding).
const fn kind_code(kind: CollectiveKind) -> u64 {
    match kind {
        CollectiveKind::AllGather => 1,
        CollectiveKind::ReduceScatter => 2,
        CollectiveKind::AllReduce => 3,
        CollectiveKind::Broadcast => 4,
    }
}

/// A partition of the world into equal rank groups; an op runs in every group separately.
///
/// Either blocks of consecutive ranks (`{kG .. kG+G}`, shard groups) or strided sets
/// (`{i, i+S, i+2S, ...}`, the replicas of one shard position across hybrid groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankGroups {
    world: u32,
    /// Block size, or stride when `strided`.
    step: u32,
    strided: bool,
}

impl RankGroups {
    /// Groups of `size` consecutive ranks (`size` divides `world`, as a [`Layout`] guarantees).
    pub const fn blocks(world: u32, size: u32) -> Self {
        RankGroups { world, step: size, strided: false }
    }

    /// Groups `{i, i + stride, i + 2*stride, ...}` for `i < stride` (`stride` divides `world`).
    pub const fn strided(world: u32, stride: u32) -> Self {
        RankGroups { world, step: stride, strided: true }
    }

    /// The world size.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Whether the groups are strided (else blocks of consecutive ranks).
    pub fn is_strided(&self) -> bool {
        self.strided
    }

    /// Ranks per group.
    pub fn group_size(&self) -> u32 {
        if self.strided {
            self.world / self.step
        } else {
            self.step
        }
    }

    /// Number of groups.
    pub fn count(&self) -> u32 {
        self.world / self.group_size()
    }

    /// The index of the group `rank` belongs to (`None` outside the world).
    pub fn group_of(&self, rank: u32) -> Option<u32> {
        (rank < self.world).then(|| if self.strided { rank % self.step } else { rank / self.step })
    }

    /// The position of `rank` inside its group (`None` outside the world).
    pub fn position(&self, rank: u32) -> Option<u32> {
        (rank < self.world).then(|| if self.strided { rank / self.step } else { rank % self.step })
    }

    /// The ranks of group `group`, ascending (empty for a group index out of range).
    pub fn ranks(&self, group: u32) -> impl Iterator<Item = u32> {
        let (n, strided, step) =
            if group < self.count() { (self.group_size(), self.strided, self.step) } else { (0, false, 0) };
        (0..n).map(move |j| if strided { group + j * step } else { group * step + j })
    }

    /// The ranks of the group `rank` belongs to, ascending (empty outside the world).
    pub fn ranks_of(&self, rank: u32) -> impl Iterator<Item = u32> {
        self.ranks(self.group_of(rank).unwrap_or(u32::MAX))
    }
}

/// Which of a bucket's two buffers an op reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferRole {
    /// The rank's shard: `shard_numel` elements, laid out by
    /// [`Bucket::segments`](collsched_buckets::Bucket::segments).
    Shard,
    /// The gathered buffer: `gathered_numel` elements, laid out by
    /// [`Bucket::gathered_segments`](collsched_buckets::Bucket::gathered_segments).
    Gathered,
}

/// One collective of a plan on one bucket, run in every group of [`groups`](Op::groups).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    id: OpId,
    kind: CollectiveKind,
    bucket: BucketId,
    groups: RankGroups,
    bytes_per_rank: usize,
    root: Option<u32>,
    input: BufferRole,
    output: BufferRole,
    copy_in: bool,
    copy_out: bool,
}

impl Op {
    /// This op's id.
    pub fn id(&self) -> OpId {
        self.id
    }

    /// The collective.
    pub fn kind(&self) -> CollectiveKind {
        self.kind
    }

    /// The bucket it moves.
    pub fn bucket(&self) -> BucketId {
        self.bucket
    }

    /// The rank groups it runs in (one collective per group).
    pub fn groups(&self) -> RankGroups {
        self.groups
    }

    /// Bytes each rank contributes (the bucket's shard bytes).
    pub fn bytes_per_rank(&self) -> usize {
        self.bytes_per_rank
    }

    /// For a broadcast, the group position of the root; else `None`.
    pub fn root(&self) -> Option<u32> {
        self.root
    }

    /// The buffer the collective reads.
    pub fn input(&self) -> BufferRole {
        self.input
    }

    /// The buffer the collective writes.
    pub fn output(&self) -> BufferRole {
        self.output
    }

    /// Whether the input is packed from per-parameter memory before launch (copy-in), with
    /// [`Plan::runs`]`(op, rank, op.input())`. For a broadcast only the root packs.
    pub fn copy_in(&self) -> bool {
        self.copy_in
    }

    /// Whether the output is unpacked into per-parameter memory after completion (copy-out),
    /// with [`Plan::runs`]`(op, rank, op.output())`.
    pub fn copy_out(&self) -> bool {
        self.copy_out
    }

    fn encode(&self, h: &mut StableHasher) {
        h.word(u64::from(self.id.0));
        h.word(kind_code(self.kind));
        h.word(u64::from(self.bucket.0));
        h.word(u64::from(self.groups.world) | (u64::from(self.groups.step) << 32));
        h.word(u64::from(self.groups.strided));
        h.word(self.bytes_per_rank as u64);
        h.word(self.root.map_or(u64::MAX, u64::from));
        let role = |r: BufferRole| match r {
            BufferRole::Shard => 1u64,
            BufferRole::Gathered => 2,
        };
        h.word(
            role(self.input)
                | role(self.output) << 8
                | u64::from(self.copy_in) << 16
                | u64::from(self.copy_out) << 24,
        );
    }
}

/// One run of a copy-in or copy-out list: elements `param_offset .. param_offset + numel` of
/// `param` sit at `offset` of the op's buffer. Counts are elements of the bucket's dtype.
///
/// Converts to the kernels' `CopySegment` as `{ buffer: <index of param>, buffer_offset:
/// param_offset, packed_offset: offset, len: numel }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyRun {
    /// The parameter (or its gradient).
    pub param: ParamId,
    /// First element of the parameter (flattened).
    pub param_offset: usize,
    /// Number of elements.
    pub numel: usize,
    /// Offset in the op's buffer (shard or gathered, per the role asked for).
    pub offset: usize,
}

/// A validated, immutable plan: the ops of every bucket of a [`Layout`], and its fingerprint.
///
/// # Examples
/// ```
/// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
/// use collsched_schedule::{CollectiveKind, Plan};
/// let set = ParamSet::new(vec![ParamSpec::new("w", [4096], DType::BF16)]).unwrap();
/// let layout = LayoutBuilder::new(&set, Sharding::Hybrid(2), 4).build().unwrap();
/// let plan = Plan::new(layout);
/// let grad = plan.layout().grad_buckets()[0].id();
/// let kinds: Vec<_> = plan.grad_ops(grad).iter().map(|&o| plan.op(o).unwrap().kind()).collect();
/// assert_eq!(kinds, [CollectiveKind::ReduceScatter, CollectiveKind::AllReduce]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    layout: Arc<Layout>,
    ops: Vec<Op>,
    ids: Vec<OpId>,
    /// Ops of bucket `b` are `ids[first[b] .. first[b + 1]]`.
    first: Vec<u32>,
    fingerprint: PlanFingerprint,
}

impl Plan {
    /// The plan of a layout. Infallible: a [`Layout`] is already validated.
    pub fn new(layout: impl Into<Arc<Layout>>) -> Plan {
        let layout: Arc<Layout> = layout.into();
        let world = layout.world();
        let g = layout.group_size();
        let shard_groups = RankGroups::blocks(world, g);
        let mut ops = Vec::with_capacity(layout.buckets().len() * 2);
        let mut first = Vec::with_capacity(layout.buckets().len() + 1);
        for b in layout.buckets() {
            first.push(ops.len() as u32);
            let mut push = |kind, groups, root, (input, output), (copy_in, copy_out)| {
                let id = OpId(ops.len() as u32);
                let bytes_per_rank = b.shard_bytes();
                ops.push(Op {
                    id,
                    kind,
                    bucket: b.id(),
                    groups,
                    bytes_per_rank,
                    root,
                    input,
                    output,
                    copy_in,
                    copy_out,
                });
            };
            use BufferRole::{Gathered, Shard};
            match (b.kind(), b.single_owner()) {
                (BucketKind::Gather, Some(o)) => {
                    push(CollectiveKind::Broadcast, shard_groups, Some(o), (Shard, Gathered), (true, true));
                }
                (BucketKind::Gather, None) => {
                    push(CollectiveKind::AllGather, shard_groups, None, (Shard, Gathered), (true, true));
                }
                (BucketKind::Grad, Some(_)) => {
                    push(CollectiveKind::AllReduce, shard_groups, None, (Gathered, Shard), (true, true));
                }
                (BucketKind::Grad, None) => {
                    let replicated = matches!(layout.sharding(), Sharding::Hybrid(_)) && g < world;
                    push(
                        CollectiveKind::ReduceScatter,
                        shard_groups,
                        None,
                        (Gathered, Shard),
                        (true, !replicated),
                    );
                    if replicated {
                        let across = RankGroups::strided(world, g);
                        push(CollectiveKind::AllReduce, across, None, (Shard, Shard), (false, true));
                    }
                }
            }
        }
        first.push(ops.len() as u32);
        let ids = (0..ops.len() as u32).map(OpId).collect();

        let mut h = StableHasher::new();
        h.bytes(b"collsched plan v1");
        layout.encode_canonical(&mut h);
        h.word(ops.len() as u64);
        for op in &ops {
            op.encode(&mut h);
        }
        // The knob trails the self-delimited encoding above (nothing for size bucketing, so
        // those fingerprints are unchanged).
        layout.encode_boundary(&mut h);
        let fingerprint = PlanFingerprint(h.finish());
        Plan { layout, ops, ids, first, fingerprint }
    }

    /// The layout the plan moves.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The layout, shared.
    pub fn layout_arc(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The stable digest of the plan (see [`PlanFingerprint`]).
    pub fn fingerprint(&self) -> PlanFingerprint {
        self.fingerprint
    }

    /// A stable digest of one bucket and its ops (`None` for an unknown bucket): when two
    /// ranks' fingerprints differ, the first bucket whose digests differ is the culprit.
    /// Computed on demand, in O(parameters of the bucket).
    pub fn bucket_digest(&self, bucket: BucketId) -> Option<u64> {
        let b = self.layout.bucket(bucket)?;
        let mut h = StableHasher::new();
        b.encode_canonical(&mut h);
        for &op in self.ops_of(bucket) {
            self.ops[op.index()].encode(&mut h);
        }
        Some(h.finish())
    }

    /// All ops, by id: per bucket in bucket-id order, gather buckets first.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The op with this id, if any.
    pub fn op(&self, id: OpId) -> Option<&Op> {
        self.ops.get(id.index())
    }

    /// The ops of a bucket, in the order they run (empty for an unknown bucket).
    pub fn ops_of(&self, bucket: BucketId) -> &[OpId] {
        let b = bucket.index();
        match (self.first.get(b), self.first.get(b + 1)) {
            (Some(&s), Some(&e)) => &self.ids[s as usize..e as usize],
            _ => &[],
        }
    }

    /// The all-gather (or broadcast) of a gather bucket; `None` for a gradient bucket or an
    /// unknown one.
    pub fn gather_op(&self, bucket: BucketId) -> Option<OpId> {
        match self.layout.bucket(bucket)?.kind() {
            BucketKind::Gather => self.ops_of(bucket).first().copied(),
            BucketKind::Grad => None,
        }
    }

    /// The ops of a gradient bucket in order (reduce-scatter, then for Hybrid the all-reduce
    /// across groups; or a single all-reduce); empty for a gather bucket or an unknown one.
    pub fn grad_ops(&self, bucket: BucketId) -> &[OpId] {
        match self.layout.bucket(bucket).map(|b| b.kind()) {
            Some(BucketKind::Grad) => self.ops_of(bucket),
            _ => &[],
        }
    }

    /// The copy list of `op` on `rank` for one of its buffers: where each parameter run sits
    /// in the rank's shard ([`BufferRole::Shard`]) or in the gathered buffer
    /// ([`BufferRole::Gathered`]). Derived on demand; empty for an unknown op or a rank
    /// outside the world.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// use collsched_schedule::{BufferRole, Plan};
    /// let set = ParamSet::new(vec![ParamSpec::new("w", [100], DType::F32)]).unwrap();
    /// let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).align(16).build().unwrap());
    /// let ag = plan.gather_op(plan.layout().gather_buckets()[0].id()).unwrap();
    /// let out: Vec<_> = plan.runs(ag, 0, BufferRole::Gathered).collect();
    /// assert_eq!(out.len(), 2); // one run from each rank's shard
    /// assert_eq!(out.iter().map(|r| r.numel).sum::<usize>(), 100);
    /// ```
    pub fn runs(&self, op: OpId, rank: u32, role: BufferRole) -> impl Iterator<Item = CopyRun> + '_ {
        let bucket = self.op(op).and_then(|o| self.layout.bucket(o.bucket()));
        let bucket = bucket.filter(|_| rank < self.layout.world());
        let shard = bucket.filter(|_| role == BufferRole::Shard).map(|b| b.segments(rank));
        let gathered = bucket.filter(|_| role == BufferRole::Gathered).map(|b| b.gathered_segments());
        let shard = shard.into_iter().flatten().map(|s| CopyRun {
            param: s.param,
            param_offset: s.param_offset,
            numel: s.numel,
            offset: s.shard_offset,
        });
        let gathered = gathered.into_iter().flatten().map(|s| CopyRun {
            param: s.param,
            param_offset: s.param_offset,
            numel: s.numel,
            offset: s.offset,
        });
        shard.chain(gathered)
    }

    /// The plan for a new `requires_grad` mask: the layout's
    /// [`with_trainable`](Layout::with_trainable) (gather buckets, shards and gather ops
    /// unchanged), and what changed.
    ///
    /// # Errors
    /// [`LayoutError::Param`] if the mask length is not the number of parameters.
    pub fn with_trainable(&self, mask: &[bool]) -> Result<(Plan, LayoutDiff), LayoutError> {
        let (layout, diff) = self.layout.with_trainable(mask)?;
        Ok((Plan::new(layout), diff))
    }
}

/// Why [`plan_from_json`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanInputError {
    /// The parameter file is malformed or invalid.
    #[error(transparent)]
    Params(#[from] ParamFileError),
    /// The layout cannot be built with these knobs.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Builds the plan of a parameter file's text (see
/// [`ParamSet::from_json`]) with the knobs of `collsched plan` (`--strategy`, `--world`,
/// `--bucket-mb`, `--align`, `--bucket-by`): what the CLI runs, and the entry point of the plan
/// fuzz target.
///
/// # Errors
/// [`PlanInputError`]: the file's error (with line and column, or naming the parameter) or
/// the layout's (naming the knob and parameter).
///
/// # Examples
/// ```
/// use collsched_buckets::{Boundary, Sharding};
/// use collsched_schedule::plan_from_json;
/// let text = r#"{"params": [{"name": "w", "shape": [64, 64], "dtype": "bf16"}]}"#;
/// let plan = plan_from_json(text, Sharding::EvenSplit, 8, 64 << 20, 256, Boundary::Size).unwrap();
/// assert_eq!(plan.ops().len(), 2); // all_gather + reduce_scatter
/// assert!(plan_from_json(text, Sharding::Hybrid(3), 8, 64 << 20, 256, Boundary::Size).is_err());
/// ```
pub fn plan_from_json(
    text: &str,
    sharding: Sharding,
    world: u32,
    bucket_bytes: usize,
    align: usize,
    boundary: Boundary,
) -> Result<Plan, PlanInputError> {
    let set = ParamSet::from_json(text)?;
    let layout = LayoutBuilder::new(&set, sharding, world)
        .bucket_bytes(bucket_bytes)
        .align(align)
        .boundary(boundary)
        .build()?;
    Ok(Plan::new(layout))
}

/// The entry point of the `build_plan` fuzz target (`fuzz/`): maps raw knob bytes onto a
/// strategy (`strategy & 3`: even, flat, greedy, hybrid with group `strategy >> 2`) and a
/// bucket boundary (`boundary & 3`: 0 and 3 size, 1 module with layer keys, 2 module of depth
/// `boundary >> 3` (0 included, an error); bit 2 packs), builds the plan of `text` with
/// [`plan_from_json`], then walks every copy list of the first and the last rank. Returns the
/// number of runs walked.
///
/// # Errors
/// What [`plan_from_json`] returns for bad input.
#[doc(hidden)]
pub fn fuzz_build_plan(
    text: &str,
    strategy: u8,
    world: u8,
    bucket_bytes: u32,
    align: u16,
    boundary: u8,
) -> Result<usize, PlanInputError> {
    let group = u32::from(strategy >> 2);
    let sharding = [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(group)]
        [usize::from(strategy & 3)];
    let pack = boundary & 4 != 0;
    let boundary = match boundary & 3 {
        1 => Boundary::Module { key: ModuleKey::Layer, pack },
        2 => Boundary::Module { key: ModuleKey::Depth(u32::from(boundary >> 3)), pack },
        _ => Boundary::Size,
    };
    let plan = plan_from_json(
        text,
        sharding,
        u32::from(world),
        bucket_bytes as usize,
        usize::from(align),
        boundary,
    )?;
    let mut runs = 0;
    for op in plan.ops() {
        for rank in [0, plan.layout().world() - 1] {
            for role in [BufferRole::Shard, BufferRole::Gathered] {
                runs += plan.runs(op.id(), rank, role).count();
            }
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests;
