//! The data model: buckets, their shard maps and segments, placements.

use crate::{DType, ParamId};

/// Dense index of a bucket in its [`Layout`](super::Layout): gather buckets first, then gradient buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketId(pub u32);

impl BucketId {
    /// The id as an index into [`Layout::buckets`](super::Layout::buckets).
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for BucketId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a bucket carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BucketKind {
    /// Parameters (trainable or frozen): all-gathered before use.
    Gather,
    /// Gradients of trainable parameters: reduce-scattered after backward.
    Grad,
}

impl BucketKind {
    /// `"gather"` or `"grad"`, as in the plan JSON.
    pub const fn name(self) -> &'static str {
        match self {
            BucketKind::Gather => "gather",
            BucketKind::Grad => "grad",
        }
    }
}

/// A run of one parameter's elements inside a rank's shard: the shard holds elements
/// `param_offset .. param_offset + numel` of `param` at `shard_offset .. shard_offset + numel`.
///
/// All counts are elements of the bucket's dtype. Converts to the kernels' `CopySegment` as
/// `{ buffer: <index of param>, buffer_offset: param_offset, packed_offset: shard_offset, len: numel }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// The parameter.
    pub param: ParamId,
    /// First element of the parameter (flattened) in this run.
    pub param_offset: usize,
    /// Number of elements (at least 1).
    pub numel: usize,
    /// Where the run starts in the shard.
    pub shard_offset: usize,
}

/// A run of one parameter's elements inside a bucket's gathered buffer (see
/// [`Bucket::gathered_segments`]): the buffer holds elements `param_offset .. param_offset + numel`
/// of `param` at `offset .. offset + numel`, coming from the shard of group position `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GatheredSegment {
    /// Position in the shard group of the rank whose shard holds this run.
    pub rank: u32,
    /// The parameter.
    pub param: ParamId,
    /// First element of the parameter (flattened) in this run.
    pub param_offset: usize,
    /// Number of elements (at least 1).
    pub numel: usize,
    /// Where the run starts in the gathered buffer.
    pub offset: usize,
}

/// How a bucket's elements map to shards; O(parameters of the bucket) numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ShardMap {
    /// Per parameter a slot of `chunk` elements at `slot` in every shard; position `q` of the
    /// group holds elements `q*chunk .. min((q+1)*chunk, numel)`.
    Even { chunk: Vec<usize>, slot: Vec<usize> },
    /// Per parameter its (aligned, ascending) start in the concatenation; position `q` holds
    /// concatenation elements `q*shard_numel .. (q+1)*shard_numel`. Gaps (alignment, or frozen
    /// parameters in a gradient bucket) are padding.
    Flat { start: Vec<usize> },
    /// Per parameter its owner (group position) and its offset in the owner's shard.
    Greedy { owner: Vec<u32>, offset: Vec<usize> },
}

/// A bucket of one dtype: its parameters and how their elements are split into shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub(super) id: BucketId,
    pub(super) kind: BucketKind,
    pub(super) dtype: DType,
    pub(super) params: Vec<ParamId>,
    pub(super) numels: Vec<usize>,
    pub(super) param_numel: usize,
    pub(super) shard_numel: usize,
    pub(super) world: u32,
    pub(super) group_size: u32,
    pub(super) single_owner: Option<u32>,
    /// For a gradient bucket, its gather bucket.
    pub(super) source: Option<BucketId>,
    pub(super) map: ShardMap,
}

impl Bucket {
    /// This bucket's id.
    pub fn id(&self) -> BucketId {
        self.id
    }

    /// Gather (parameters) or Grad (gradients of trainable parameters).
    pub fn kind(&self) -> BucketKind {
        self.kind
    }

    /// The dtype of every parameter in the bucket.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The parameters, in bucket order.
    pub fn params(&self) -> &[ParamId] {
        &self.params
    }

    /// Element counts of [`params`](Self::params), in the same order.
    pub fn param_numels(&self) -> &[usize] {
        &self.numels
    }

    /// Sum of the parameters' element counts (no padding).
    pub fn param_numel(&self) -> usize {
        self.param_numel
    }

    /// Elements of every rank's shard (equal for all ranks; padding included; a multiple of
    /// the alignment in elements).
    pub fn shard_numel(&self) -> usize {
        self.shard_numel
    }

    /// Bytes of every rank's shard: the per-rank payload of the bucket's collective.
    pub fn shard_bytes(&self) -> usize {
        self.shard_numel * self.dtype.size()
    }

    /// Elements of the gathered buffer: `group_size * shard_numel`, or `shard_numel` for a
    /// single-owner bucket (see [`single_owner`](Self::single_owner)).
    pub fn gathered_numel(&self) -> usize {
        match self.single_owner {
            Some(_) => self.shard_numel,
            None => self.shard_numel * self.group_size as usize,
        }
    }

    /// Bytes of the gathered buffer.
    pub fn gathered_bytes(&self) -> usize {
        self.gathered_numel() * self.dtype.size()
    }

    /// World size of the layout.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Ranks that share one copy of the bucket (hold distinct shards): the world, or `G` for
    /// `Hybrid(G)`.
    pub fn group_size(&self) -> u32 {
        self.group_size
    }

    /// `Some(position)` when only one group position holds any element (a Greedy bucket
    /// whose parameters all went to one rank): then the gathered buffer is that shard alone,
    /// and the plan broadcasts it instead of all-gathering padding.
    pub fn single_owner(&self) -> Option<u32> {
        self.single_owner
    }

    /// For a gradient bucket, the gather bucket it belongs to (`None` for a gather bucket;
    /// the other direction is [`Layout::grad_bucket_for`](super::Layout::grad_bucket_for)).
    pub fn gather_bucket(&self) -> Option<BucketId> {
        self.source
    }

    /// The position of `rank` in its shard group (`rank % G` for `Hybrid(G)`, else `rank`).
    pub fn group_rank(&self, rank: u32) -> u32 {
        rank % self.group_size
    }

    /// The segments of `rank`'s shard (a global rank), in shard order, derived on demand.
    /// Empty for a rank outside the world or a rank holding nothing of this bucket.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// let set = ParamSet::new(vec![ParamSpec::new("w", [10], DType::F32)]).unwrap();
    /// let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 4).align(4).build().unwrap();
    /// let b = &layout.gather_buckets()[0];
    /// // ceil(10 / 4) = 3 elements per rank; rank 3 holds the last one.
    /// let last: Vec<_> = b.segments(3).collect();
    /// assert_eq!((last[0].param_offset, last[0].numel), (9, 1));
    /// ```
    pub fn segments(&self, rank: u32) -> Segments<'_> {
        if rank >= self.world {
            return Segments { bucket: self, q: 0, i: 0, end: 0 };
        }
        let q = self.group_rank(rank);
        let (i, end) = match &self.map {
            ShardMap::Flat { start } => {
                let lo = q as usize * self.shard_numel;
                let hi = lo + self.shard_numel;
                // First parameter ending after `lo`, first starting at or after `hi`.
                let i = start.partition_point(|&s| s < lo);
                let i = if i > 0 && start[i - 1] + self.numels[i - 1] > lo { i - 1 } else { i };
                (i, start.partition_point(|&s| s < hi))
            }
            _ => (0, self.params.len()),
        };
        Segments { bucket: self, q: q as usize, i, end }
    }

    /// The one run of the `index`-th parameter of the bucket that `rank`'s shard holds (a
    /// parameter never has two runs in one shard), in O(1); `None` if the shard holds none of
    /// it, or for an index or rank out of range.
    pub fn param_segment(&self, index: usize, rank: u32) -> Option<Segment> {
        if rank >= self.world || index >= self.params.len() {
            return None;
        }
        let q = self.group_rank(rank) as usize;
        let (param, numel) = (self.params[index], self.numels[index]);
        match &self.map {
            ShardMap::Even { chunk, slot } => {
                let off = q * chunk[index];
                (off < numel).then(|| Segment {
                    param,
                    param_offset: off,
                    numel: chunk[index].min(numel - off),
                    shard_offset: slot[index],
                })
            }
            ShardMap::Flat { start } => {
                let (lo, hi) = (q * self.shard_numel, (q + 1) * self.shard_numel);
                let (s, e) = (start[index].max(lo), (start[index] + numel).min(hi));
                (s < e).then(|| Segment {
                    param,
                    param_offset: s - start[index],
                    numel: e - s,
                    shard_offset: s - lo,
                })
            }
            ShardMap::Greedy { owner, offset } => (owner[index] as usize == q).then(|| Segment {
                param,
                param_offset: 0,
                numel,
                shard_offset: offset[index],
            }),
        }
    }

    /// Every run of the gathered buffer, group position by group position: the copy-out list
    /// of an all-gather (or broadcast) and the copy-in list of a reduce-scatter.
    pub fn gathered_segments(&self) -> GatheredSegments<'_> {
        let (first, last) = match self.single_owner {
            Some(o) => (o, o + 1),
            None => (0, self.group_size),
        };
        GatheredSegments { bucket: self, next: first, last, current: None }
    }

    /// Where the `index`-th parameter of the bucket starts in the gathered buffer (in
    /// elements) when all of it is **one contiguous run** there, so a view can point straight
    /// into the gathered buffer: always for Greedy (a parameter lives in one shard) and
    /// single-owner buckets, for Flat (shards are consecutive slices of the concatenation),
    /// and for every layout in a group of one. `None` when its elements lie apart (EvenSplit
    /// and Hybrid with a group of two or more: each shard holds a chunk of every parameter,
    /// so the chunks of one parameter are a shard apart), or for an index out of range.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// // Two parameters of 1,000 elements over 4 ranks: EvenSplit gives every shard a chunk
    /// // of each, so `w`'s chunks are a shard apart; Flat keeps the concatenation in order.
    /// let set = ParamSet::new(vec![
    ///     ParamSpec::new("w", [1000], DType::F32),
    ///     ParamSpec::new("b", [1000], DType::F32),
    /// ])
    /// .unwrap();
    /// let even = LayoutBuilder::new(&set, Sharding::EvenSplit, 4).build().unwrap();
    /// assert_eq!(even.gather_buckets()[0].contiguous_offset(0), None);
    /// let flat = LayoutBuilder::new(&set, Sharding::Flat, 4).build().unwrap();
    /// assert_eq!(flat.gather_buckets()[0].contiguous_offset(0), Some(0));
    /// // `b` starts at the next multiple of DEFAULT_ALIGN (256 bytes: 64 f32 elements).
    /// assert_eq!(flat.gather_buckets()[0].contiguous_offset(1), Some(1024));
    /// ```
    pub fn contiguous_offset(&self, index: usize) -> Option<usize> {
        let numel = *self.numels.get(index)?;
        let (first, last) = match self.single_owner {
            Some(o) => (o, o + 1),
            None => (0, self.group_size),
        };
        // (elements seen so far, where the next run must start, where the first started)
        let mut run: Option<(usize, usize, usize)> = None;
        for q in first..last {
            // Group position q is global rank q (the first group), as in `gathered_segments`.
            let Some(s) = self.param_segment(index, q) else { continue };
            let at = self.gathered_base(q) + s.shard_offset;
            run = match run {
                None if s.param_offset == 0 => Some((s.numel, at + s.numel, at)),
                Some((seen, next, start)) if s.param_offset == seen && at == next => {
                    Some((seen + s.numel, next + s.numel, start))
                }
                _ => return None,
            };
        }
        run.filter(|&(seen, _, _)| seen == numel).map(|(_, _, start)| start)
    }

    /// Elements a driver unpacks (copies out of the gathered buffer) to hand out contiguous
    /// views: every parameter's when any parameter is not one contiguous run of the gathered
    /// buffer ([`Bucket::contiguous_offset`] is `None`), so that the gathered buffer can be
    /// freed as soon as it is unpacked; 0 otherwise (Flat, Greedy and single-owner buckets).
    pub fn unpacked_numel(&self) -> usize {
        if (0..self.params.len()).all(|i| self.contiguous_offset(i).is_some()) {
            return 0;
        }
        self.numels.iter().sum()
    }

    /// Offset in the gathered buffer of the shard of group position `q`.
    pub(super) fn gathered_base(&self, q: u32) -> usize {
        match self.single_owner {
            Some(_) => 0,
            None => q as usize * self.shard_numel,
        }
    }

    /// Feeds a canonical, platform-independent encoding of the bucket (everything that
    /// determines its segments) to `sink`; equal buckets encode equally, different ones
    /// differently. The plan fingerprint (and its per-bucket digests) hash it.
    pub fn encode_canonical(&self, sink: &mut dyn CanonicalSink) {
        sink.word(u64::from(self.id.0));
        sink.word(match self.kind {
            BucketKind::Gather => 1,
            BucketKind::Grad => 2,
        });
        sink.word(u64::from(self.dtype.code()));
        sink.word(self.shard_numel as u64);
        sink.word(u64::from(self.world));
        sink.word(u64::from(self.group_size));
        sink.word(self.single_owner.map_or(u64::MAX, u64::from));
        sink.word(self.source.map_or(u64::MAX, |b| u64::from(b.0)));
        sink.word(self.params.len() as u64);
        for (&p, &n) in self.params.iter().zip(&self.numels) {
            sink.word(u64::from(p.0));
            sink.word(n as u64);
        }
        match &self.map {
            ShardMap::Even { chunk, slot } => {
                sink.word(1);
                for (&c, &s) in chunk.iter().zip(slot) {
                    sink.word(c as u64);
                    sink.word(s as u64);
                }
            }
            ShardMap::Flat { start } => {
                sink.word(2);
                for &s in start {
                    sink.word(s as u64);
                }
            }
            ShardMap::Greedy { owner, offset } => {
                sink.word(3);
                for (&o, &s) in owner.iter().zip(offset) {
                    sink.word(u64::from(o));
                    sink.word(s as u64);
                }
            }
        }
    }
}

/// Iterator over one rank's [`Segment`]s of a bucket (see [`Bucket::segments`]).
#[derive(Clone, Debug)]
pub struct Segments<'a> {
    pub(super) bucket: &'a Bucket,
    pub(super) q: usize,
    pub(super) i: usize,
    pub(super) end: usize,
}

impl Iterator for Segments<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        let b = self.bucket;
        while self.i < self.end {
            let i = self.i;
            self.i += 1;
            let (param, numel) = (b.params[i], b.numels[i]);
            match &b.map {
                ShardMap::Even { chunk, slot } => {
                    let off = self.q * chunk[i];
                    if off < numel {
                        let len = chunk[i].min(numel - off);
                        return Some(Segment { param, param_offset: off, numel: len, shard_offset: slot[i] });
                    }
                }
                ShardMap::Flat { start } => {
                    let lo = self.q * b.shard_numel;
                    let hi = lo + b.shard_numel;
                    let (s, e) = (start[i].max(lo), (start[i] + numel).min(hi));
                    if s < e {
                        return Some(Segment {
                            param,
                            param_offset: s - start[i],
                            numel: e - s,
                            shard_offset: s - lo,
                        });
                    }
                }
                ShardMap::Greedy { owner, offset } => {
                    if owner[i] as usize == self.q {
                        return Some(Segment { param, param_offset: 0, numel, shard_offset: offset[i] });
                    }
                }
            }
        }
        None
    }
}

/// Iterator over a bucket's [`GatheredSegment`]s (see [`Bucket::gathered_segments`]).
#[derive(Clone, Debug)]
pub struct GatheredSegments<'a> {
    pub(super) bucket: &'a Bucket,
    pub(super) next: u32,
    pub(super) last: u32,
    pub(super) current: Option<(u32, Segments<'a>)>,
}

impl Iterator for GatheredSegments<'_> {
    type Item = GatheredSegment;

    fn next(&mut self) -> Option<GatheredSegment> {
        loop {
            if let Some((q, segs)) = &mut self.current {
                if let Some(s) = segs.next() {
                    return Some(GatheredSegment {
                        rank: *q,
                        param: s.param,
                        param_offset: s.param_offset,
                        numel: s.numel,
                        offset: self.bucket.gathered_base(*q) + s.shard_offset,
                    });
                }
            }
            if self.next >= self.last {
                return None;
            }
            let q = self.next;
            self.next += 1;
            // Group position q is global rank q (the first group).
            self.current = Some((q, self.bucket.segments(q)));
        }
    }
}

/// Receives the canonical encoding of a [`Layout`](super::Layout) (see
/// [`Layout::encode_canonical`](super::Layout::encode_canonical)); the plan fingerprint hashes it.
pub trait CanonicalSink {
    /// One 64-bit word.
    fn word(&mut self, w: u64);
    /// A byte string (the sink must make the encoding prefix-free, e.g. length first).
    fn bytes(&mut self, b: &[u8]);
}

/// Where a parameter sits: its gather bucket and index in it, and its gradient bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Placement {
    /// The gather bucket.
    pub gather: BucketId,
    /// Index of the parameter in the gather bucket's [`Bucket::params`].
    pub gather_index: u32,
    /// The gradient bucket and index in it; `None` for a frozen parameter.
    pub grad: Option<(BucketId, u32)>,
}
