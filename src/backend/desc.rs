//! What a collective is: its kind, rank group, element type, reduction, tag.

use std::fmt;
use std::sync::Arc;

use collsched_kernels::{CopySegment, ElemType, ReduceOp, Scaling};
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
    /// All-gather only: where each member's shard lands in this member's output, when not
    /// member after member (see [`GatherUnpack`]). This member's own choice: not compared
    /// across members. Backends that cannot place pieces refuse it
    /// ([`Backend::gathers_unpacked`](super::Backend::gathers_unpacked)).
    pub unpack: Option<Arc<GatherUnpack>>,
    /// All-gather with an input only: this member's part of its output already holds what its
    /// input holds (the input is a copy of that part, made so that peers can read it), so the
    /// member does not copy its own part. This member's own fact: not compared across members.
    pub own_part_in_place: bool,
    /// Reduce-scatter only: where this member's own chunk of the input (the chunk at its group
    /// position, which only the reduction into its own output reads) is read from instead of
    /// from the input buffer, whose bytes there are then never read: a caller that copies its
    /// input into memory its peers can read leaves that chunk where it is. The reduction into
    /// this member's output is then its own alone (peers' threads or processes take none of
    /// its pieces). This member's own fact: not compared across members.
    pub own_chunk: Option<OwnChunk>,
    /// Which engine's step launched it (the runtime's collectives; `None` for a caller of the
    /// backend's own): written to the flight record, so that a record holding several engines'
    /// collectives can be read one engine at a time. Not compared across members.
    pub origin: Option<Origin>,
}

/// The engine and step a collective was launched for ([`CollDesc::origin`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Origin {
    /// The engine: a number the process gives each runtime engine as it is made (1, 2, ... in
    /// the order they are made; one process a rank numbers a job's engines alike on every rank
    /// that makes them in one order, ranks that are threads of one process share the count).
    pub engine: u32,
    /// The engine's step (0-based: its count of ended steps; a micro-batch under `no_sync` ends
    /// one, as a simulated step is one forward and backward).
    pub step: u64,
}

/// Memory of this process holding a member's own chunk of a reduce-scatter's input
/// ([`CollDesc::own_chunk`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnChunk {
    addr: usize,
    len: usize,
}

impl OwnChunk {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The bytes stay valid for reads, and unwritten, until every collective given this chunk
    /// completed (as for [`LocalBuffer::borrowed`](super::local::LocalBuffer::borrowed)).
    pub unsafe fn new(ptr: std::ptr::NonNull<u8>, len: usize) -> Self {
        OwnChunk { addr: ptr.as_ptr() as usize, len }
    }

    /// Its first byte.
    pub fn ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    /// Its bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// An all-gather's output layout other than member after member: runs of the gathered order
/// (the members' shards one after the other, `packed_offset`) placed at `buffer_offset` of the
/// output, in elements, so that an all-gather of sharded parameters leaves each parameter whole
/// in one pass instead of a gather and then an unpack (the kernels' `copy_out`). Elements of
/// the gathered order no run names are not written anywhere.
#[derive(Clone, Debug, PartialEq)]
pub struct GatherUnpack {
    /// The runs, by member (a run never spans two members' shards), each member's ascending.
    segments: Vec<CopySegment>,
    /// `segments[by_member[q]..by_member[q + 1]]`: member q's runs.
    by_member: Vec<usize>,
    /// Elements per member's shard.
    count: usize,
    /// Elements the output must hold.
    output_count: usize,
}

impl GatherUnpack {
    /// The layout placing `segments` (copy-out runs of a gathered buffer of `members` shards of
    /// `count` elements: `packed_offset` in it, `buffer_offset` in the output; `buffer` 0).
    ///
    /// # Errors
    /// A run that names another buffer or leaves the gathered buffer, or sizes that overflow.
    pub fn new(segments: &[CopySegment], count: usize, members: usize) -> Result<Self, String> {
        let total = count.checked_mul(members).ok_or("the gathered size overflows")?;
        let mut split = Vec::with_capacity(segments.len() + members);
        let mut output_count = 0usize;
        for (k, s) in segments.iter().enumerate() {
            let end = s.packed_offset.checked_add(s.len).filter(|&e| e <= total);
            let out_end = s.buffer_offset.checked_add(s.len);
            let (Some(_), Some(out_end)) = (end, out_end) else {
                return Err(format!("run {k} ({s:?}) leaves a gathered buffer of {total} elements"));
            };
            if s.buffer != 0 {
                return Err(format!("run {k} ({s:?}) names buffer {}; an unpack has one output", s.buffer));
            }
            output_count = output_count.max(out_end);
            // Cut at member boundaries: member q copies its own shard's runs.
            let mut s = *s;
            while s.len > 0 {
                let room = count - s.packed_offset % count;
                let len = s.len.min(room);
                split.push(CopySegment { len, ..s });
                s = CopySegment {
                    buffer_offset: s.buffer_offset + len,
                    packed_offset: s.packed_offset + len,
                    len: s.len - len,
                    ..s
                };
            }
        }
        split.sort_unstable_by_key(|s| s.packed_offset);
        let by_member =
            (0..=members).map(|q| split.partition_point(|s| s.packed_offset < q * count)).collect();
        Ok(GatherUnpack { segments: split, by_member, count, output_count })
    }

    /// Member `q`'s runs (`packed_offset` counts from the start of the gathered order).
    pub fn member(&self, q: usize) -> &[CopySegment] {
        match (self.by_member.get(q), self.by_member.get(q + 1)) {
            (Some(&lo), Some(&hi)) => &self.segments[lo..hi],
            _ => &[],
        }
    }

    /// Members the layout was made for.
    pub fn members(&self) -> usize {
        self.by_member.len().saturating_sub(1)
    }

    /// Elements per member's shard.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Elements the output must hold.
    pub fn output_count(&self) -> usize {
        self.output_count
    }
}

impl CollDesc {
    fn new(kind: CollectiveKind, group: RankGroup, elem: ElemType, count: usize) -> Self {
        CollDesc {
            kind,
            root: 0,
            group,
            elem,
            count,
            op: ReduceOp::Sum,
            scaling: Scaling::default(),
            tag: 0,
            unpack: None,
            own_part_in_place: false,
            own_chunk: None,
            origin: None,
        }
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

    /// Sets the engine and step that launch it ([`Origin`]).
    #[must_use]
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// Sets an all-gather's output layout ([`GatherUnpack`]).
    #[must_use]
    pub fn with_unpack(mut self, unpack: Arc<GatherUnpack>) -> Self {
        self.unpack = Some(unpack);
        self
    }

    /// Says that this member's part of the all-gather's output already holds its input
    /// ([`CollDesc::own_part_in_place`]): a caller that copied that part out for its peers to
    /// read saves copying it back.
    #[must_use]
    pub fn with_own_part_in_place(mut self) -> Self {
        self.own_part_in_place = true;
        self
    }

    /// Reads this member's own chunk of a reduce-scatter's input from `chunk`
    /// ([`CollDesc::own_chunk`]).
    #[must_use]
    pub fn with_own_chunk(mut self, chunk: OwnChunk) -> Self {
        self.own_chunk = Some(chunk);
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
            CollectiveKind::AllGather if self.unpack.is_some() => {
                self.unpack.as_ref().map_or(0, |u| u.output_count())
            }
            CollectiveKind::AllGather => self.count * self.group.len(),
            _ => self.count,
        }
    }

    /// Why this member's own facts ([`CollDesc::unpack`], [`CollDesc::own_part_in_place`],
    /// [`CollDesc::own_chunk`]) cannot go with a launch that gives an input or not
    /// (`has_input`), on a backend whose own code moves the data (`moves_here`: it places
    /// pieces and reads chunks apart), if they cannot.
    pub(crate) fn own_facts_refused(&self, has_input: bool, moves_here: bool) -> Option<String> {
        let es = self.elem.size();
        if let Some(u) = &self.unpack {
            if self.kind != CollectiveKind::AllGather {
                return Some(format!(
                    "{} cannot carry an unpack layout (all-gathers only)",
                    self.kind.name()
                ));
            }
            if !has_input {
                return Some("an unpacking all-gather needs an input (in place is not supported)".into());
            }
            if u.members() != self.group.len() || u.count() != self.count {
                return Some(format!(
                    "the unpack layout was made for {} members of {} elements, the collective has {} of {}",
                    u.members(),
                    u.count(),
                    self.group.len(),
                    self.count
                ));
            }
            if !moves_here {
                return Some("this backend's all-gather cannot place pieces; gather, then unpack".into());
            }
        }
        if self.own_part_in_place
            && (self.kind != CollectiveKind::AllGather || !has_input || self.unpack.is_some())
        {
            return Some(format!(
                "{}: own_part_in_place is for an all-gather with an input and without an unpack layout",
                self.kind.name()
            ));
        }
        let own = self.own_chunk?;
        if self.kind != CollectiveKind::ReduceScatter || !has_input {
            return Some("own_chunk is for a reduce-scatter with an input".into());
        }
        if own.len() < self.count.saturating_mul(es) {
            return Some(format!(
                "own_chunk has {} bytes but the chunk needs {}",
                own.len(),
                self.count * es
            ));
        }
        (!moves_here).then(|| "this backend reads the whole input buffer; give no own_chunk".into())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(buffer_offset: usize, packed_offset: usize, len: usize) -> CopySegment {
        CopySegment { buffer: 0, buffer_offset, packed_offset, len }
    }

    #[test]
    fn an_unpack_cuts_runs_at_member_boundaries_and_sorts_them_by_member() {
        // Two members of 4 elements: a run across both shards, and one of member 0's.
        let u = GatherUnpack::new(&[seg(10, 2, 5), seg(0, 0, 2)], 4, 2).expect("layout");
        assert_eq!(u.member(0), &[seg(0, 0, 2), seg(10, 2, 2)]);
        assert_eq!(u.member(1), &[seg(12, 4, 3)]);
        assert_eq!(u.member(2), &[] as &[CopySegment]);
        assert_eq!((u.members(), u.count(), u.output_count()), (2, 4, 15));
    }

    #[test]
    fn an_unpack_refuses_runs_outside_the_gathered_buffer_or_in_another_buffer() {
        let out = GatherUnpack::new(&[seg(0, 6, 3)], 4, 2).expect_err("past the end");
        assert!(out.contains("leaves a gathered buffer of 8 elements"), "{out}");
        let other =
            GatherUnpack::new(&[CopySegment { buffer: 1, ..seg(0, 0, 1) }], 4, 2).expect_err("buffer 1");
        assert!(other.contains("names buffer 1"), "{other}");
        assert!(GatherUnpack::new(&[seg(0, 0, 1)], usize::MAX, 2).is_err(), "overflow");
    }

    #[test]
    fn an_unpacking_all_gather_needs_the_layouts_output() {
        let u = GatherUnpack::new(&[seg(3, 0, 8)], 4, 2).expect("layout");
        let d = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 4);
        assert_eq!(d.output_count(), 8);
        assert_eq!(d.clone().with_unpack(Arc::new(u)).output_count(), 11);
        // The layout is each member's own: it does not take part in matching.
        let plain = CollDesc::all_gather(RankGroup::world(2), ElemType::F32, 4);
        let u2 = GatherUnpack::new(&[seg(0, 0, 8)], 4, 2).expect("layout");
        assert!(plain.matches(&d.with_unpack(Arc::new(u2))));
    }
}
