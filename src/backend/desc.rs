//! What a collective is: its kind, rank group, element type, reduction, tag.

use std::fmt;
use std::sync::Arc;

use collsched_kernels::{ElemType, ReduceOp, Scaling};
use collsched_topo::CollectiveKind;

use super::Stream;

/// A rank group that is not one: the ranks given and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank group {ranks:?}: {what}")]
pub struct InvalidGroup {
    /// The ranks given.
    pub ranks: Vec<usize>,
    /// What is wrong and what to do.
    pub what: String,
}

/// The ranks taking part in a collective: distinct, in ascending order, validated.
///
/// The position of a rank in the group is its chunk index (all-gather output, reduce-scatter
/// input). Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RankGroup(Arc<[usize]>);

impl RankGroup {
    /// A group of the given ranks.
    ///
    /// # Errors
    /// [`InvalidGroup`] if `ranks` is empty, not strictly ascending (which also
    /// rules out duplicates).
    pub fn new(ranks: impl Into<Vec<usize>>) -> Result<Self, InvalidGroup> {
        let ranks: Vec<usize> = ranks.into();
        if ranks.is_empty() {
            return Err(InvalidGroup { ranks, what: "a group needs at least one rank".into() });
        }
        if let Some(w) = ranks.windows(2).find(|w| w[0] >= w[1]) {
            let what = format!(
                "ranks must be distinct and ascending, but {} comes before {}; sort and deduplicate them",
                w[0], w[1]
            );
            return Err(InvalidGroup { ranks, what });
        }
        Ok(RankGroup(ranks.into()))
    }

    /// The group `0..n` (the whole world of `n` ranks). `n == 0` gives the group `[0]`.
    pub fn world(n: usize) -> Self {
        RankGroup((0..n.max(1)).collect())
    }

    /// The ranks, ascending.
    pub fn ranks(&self) -> &[usize] {
        &self.0
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always `false` (a group has at least one rank); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The position of `rank` in the group, if it is a member.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.0.binary_search(&rank).ok()
    }
}

impl fmt::Debug for RankGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RankGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// What a collective does, without its buffers: the part every member must agree on.
#[derive(Clone, Debug, PartialEq)]
pub struct CollDesc {
    /// Which collective.
    pub kind: CollectiveKind,
    /// The rank (not group position) whose data a broadcast sends; 0 for other kinds.
    pub root: usize,
    /// Who takes part.
    pub group: RankGroup,
    /// Element type of the buffers.
    pub elem: ElemType,
    /// Elements per member's shard for all-gather (input) and reduce-scatter (output); elements
    /// of the whole buffer for all-reduce and broadcast.
    pub count: usize,
    /// Reduction (reduce-scatter, all-reduce; ignored otherwise). Default sum.
    pub op: ReduceOp,
    /// Pre/post-divide (reduce-scatter, all-reduce; ignored otherwise). Default 1 / 1.
    pub scaling: Scaling,
    /// Caller's label, normally the bucket id; checked across ranks and named in errors.
    pub tag: u64,
}

impl CollDesc {
    fn new(kind: CollectiveKind, group: RankGroup, elem: ElemType, count: usize) -> Self {
        CollDesc { kind, root: 0, group, elem, count, op: ReduceOp::Sum, scaling: Scaling::default(), tag: 0 }
    }

    /// An all-gather of `count` elements per member.
    pub fn all_gather(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollectiveKind::AllGather, group, elem, count)
    }

    /// A reduce-scatter to `count` elements per member (the input holds `group.len() * count`).
    pub fn reduce_scatter(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollectiveKind::ReduceScatter, group, elem, count)
    }

    /// An all-reduce of `count` elements.
    pub fn all_reduce(group: RankGroup, elem: ElemType, count: usize) -> Self {
        Self::new(CollectiveKind::AllReduce, group, elem, count)
    }

    /// A broadcast of `count` elements from rank `root`.
    pub fn broadcast(group: RankGroup, elem: ElemType, count: usize, root: usize) -> Self {
        CollDesc { root, ..Self::new(CollectiveKind::Broadcast, group, elem, count) }
    }

    /// Sets the tag (bucket id).
    #[must_use]
    pub fn with_tag(mut self, tag: u64) -> Self {
        self.tag = tag;
        self
    }

    /// Sets the reduction and its scaling.
    #[must_use]
    pub fn with_reduce(mut self, op: ReduceOp, scaling: Scaling) -> Self {
        self.op = op;
        self.scaling = scaling;
        self
    }

    /// Elements the input must hold (if one is given).
    pub fn input_count(&self) -> usize {
        match self.kind {
            CollectiveKind::ReduceScatter => self.count * self.group.len(),
            _ => self.count,
        }
    }

    /// Elements the output must hold.
    pub fn output_count(&self) -> usize {
        match self.kind {
            CollectiveKind::AllGather => self.count * self.group.len(),
            _ => self.count,
        }
    }

    /// Whether `other` (another member's description) describes the same collective.
    pub fn matches(&self, other: &CollDesc) -> bool {
        let reduce_same = !self.kind.reduces()
            || (self.op == other.op
                && self.scaling.pre_divide.to_bits() == other.scaling.pre_divide.to_bits()
                && self.scaling.post_divide.to_bits() == other.scaling.post_divide.to_bits());
        self.kind == other.kind
            && self.root == other.root
            && self.group == other.group
            && self.elem == other.elem
            && self.count == other.count
            && self.tag == other.tag
            && reduce_same
    }
}

impl fmt::Display for CollDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CollectiveKind::Broadcast => write!(f, "broadcast(root {}, ", self.root)?,
            k => write!(f, "{k}(")?,
        }
        write!(f, "tag {}, {} x {}", self.tag, self.count, self.elem.name())?;
        if self.kind.reduces() {
            let op = match self.op {
                ReduceOp::Sum => "sum",
                ReduceOp::Avg => "avg",
            };
            write!(f, ", {op}")?;
            if self.scaling != Scaling::default() {
                write!(f, " /{} /{}", self.scaling.pre_divide, self.scaling.post_divide)?;
            }
        }
        write!(f, ")")
    }
}

/// One collective with its buffers, as launched.
///
/// `input` is `None` for an **in-place** collective:
/// - all-gather: this member's shard already sits at its position in `output`
///   (`output[p * count..(p + 1) * count]`), as FSDP's copy-in leaves it;
/// - broadcast: on the root, `output` already holds the data; on every other member the input
///   must be `None`.
///
/// Reduce-scatter and all-reduce need an input distinct from the output. Buffers may be larger
/// than the collective needs; it uses their prefix.
#[derive(Debug)]
pub struct Collective<Buf> {
    /// What to do.
    pub desc: CollDesc,
    /// The data sent, or `None` for in place (see above).
    pub input: Option<Buf>,
    /// Where the result goes.
    pub output: Buf,
}

/// Names one collective in errors: what, on which stream, at which sequence number.
#[derive(Clone, Debug, PartialEq)]
pub struct CollRef {
    /// The collective as this rank described it (the first of its group launch).
    pub desc: CollDesc,
    /// The stream it was launched on.
    pub stream: Stream,
    /// Its sequence number on (group, stream), counted from 0; `None` if it never got one
    /// (rejected at launch).
    pub seq: Option<u64>,
}

impl fmt::Display for CollRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} over group {} on stream {}", self.desc, self.desc.group, self.stream)?;
        if let Some(seq) = self.seq {
            write!(f, " (sequence number {seq})")?;
        }
        Ok(())
    }
}

/// A collective kind as the multi-process backends write it (shm's control words, mpi's
/// headers); [`kind_of`] reads it back.
pub(crate) fn kind_code(k: CollectiveKind) -> u64 {
    match k {
        CollectiveKind::AllGather => 0,
        CollectiveKind::ReduceScatter => 1,
        CollectiveKind::AllReduce => 2,
        CollectiveKind::Broadcast => 3,
    }
}

/// The kind [`kind_code`] wrote, if `code` is one.
pub(crate) fn kind_of(code: u64) -> Option<CollectiveKind> {
    CollectiveKind::ALL.into_iter().find(|&k| kind_code(k) == code)
}

/// An element type as the multi-process backends write it; [`elem_of`] reads it back.
pub(crate) fn elem_code(e: ElemType) -> u64 {
    match e {
        ElemType::F32 => 0,
        ElemType::F16 => 1,
        ElemType::BF16 => 2,
    }
}

/// The element type [`elem_code`] wrote, if `code` is one.
pub(crate) fn elem_of(code: u64) -> Option<ElemType> {
    [ElemType::F32, ElemType::F16, ElemType::BF16].into_iter().find(|&e| elem_code(e) == code)
}
