//! [`LayoutBuilder`] -> [`Layout`]: parameters grouped into buckets, each bucket's shards.
//!
//! # Data model
//! A bucket is a list of parameters of one dtype that move in one collective. Every rank of a
//! shard group (the whole world, or a hybrid group) holds one **shard** of `shard_numel`
//! elements of each bucket; the **gathered buffer** is the shards of the group concatenated
//! rank-major (what `all_gather_into_tensor` produces), or for a single-owner bucket just the
//! owner's shard. A [`Segment`] says which elements of which parameter sit where in a shard.
//!
//! Segments are not stored per rank: each strategy keeps O(parameters) numbers per bucket and
//! [`Bucket::segments`] derives a rank's segments on demand, so building a layout costs
//! O(parameters) whatever the world size (Greedy: O(k log world) per bucket of `k` parameters).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::error::LayoutError;
use crate::{Boundary, DType, ModuleKey, ParamId, ParamSet, Sharding};

/// Default cap on a bucket's parameter bytes: 64 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 64 << 20;

/// Default alignment of shard offsets and segment starts: 256 bytes.
pub const DEFAULT_ALIGN: usize = 256;

/// Dense index of a bucket in its [`Layout`]: gather buckets first, then gradient buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketId(pub u32);

impl BucketId {
    /// The id as an index into [`Layout::buckets`].
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
enum ShardMap {
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
    id: BucketId,
    kind: BucketKind,
    dtype: DType,
    params: Vec<ParamId>,
    numels: Vec<usize>,
    param_numel: usize,
    shard_numel: usize,
    world: u32,
    group_size: u32,
    single_owner: Option<u32>,
    /// For a gradient bucket, its gather bucket.
    source: Option<BucketId>,
    map: ShardMap,
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
    /// the other direction is [`Layout::grad_bucket_for`]).
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

    /// Elements of the parameters that are not one contiguous run of the gathered buffer
    /// ([`Bucket::contiguous_offset`] is `None`): what a driver unpacks (copies out) to hand
    /// out contiguous views. 0 for Flat, Greedy and single-owner buckets.
    pub fn unpacked_numel(&self) -> usize {
        (0..self.params.len()).filter(|&i| self.contiguous_offset(i).is_none()).map(|i| self.numels[i]).sum()
    }

    /// Offset in the gathered buffer of the shard of group position `q`.
    fn gathered_base(&self, q: u32) -> usize {
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
    bucket: &'a Bucket,
    q: usize,
    i: usize,
    end: usize,
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
    bucket: &'a Bucket,
    next: u32,
    last: u32,
    current: Option<(u32, Segments<'a>)>,
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

/// Receives the canonical encoding of a [`Layout`] (see [`Layout::encode_canonical`]); the
/// plan fingerprint hashes it.
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

/// Configures and builds a [`Layout`].
///
/// # Examples
/// ```
/// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
/// let set = ParamSet::new(vec![
///     ParamSpec::new("a", [1000], DType::BF16),
///     ParamSpec::new("b", [10], DType::BF16).trainable(false),
/// ])
/// .unwrap();
/// let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 8).bucket_bytes(1 << 20).build().unwrap();
/// assert_eq!(layout.gather_buckets().len(), 1);
/// assert_eq!(layout.grad_buckets()[0].params().len(), 1); // frozen `b` takes no gradient
/// ```
#[derive(Clone, Debug)]
pub struct LayoutBuilder {
    params: ParamSet,
    sharding: Sharding,
    world: u32,
    bucket_bytes: usize,
    align: usize,
    boundary: Boundary,
    order: Option<Vec<ParamId>>,
}

impl LayoutBuilder {
    /// A builder for `params` sharded with `sharding` over `world` ranks, with the default
    /// bucket cap ([`DEFAULT_BUCKET_BYTES`]) and alignment ([`DEFAULT_ALIGN`]).
    pub fn new(params: &ParamSet, sharding: Sharding, world: u32) -> Self {
        LayoutBuilder {
            params: params.clone(),
            sharding,
            world,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            align: DEFAULT_ALIGN,
            boundary: Boundary::Size,
            order: None,
        }
    }

    /// Where buckets may end (default [`Boundary::Size`]: by the cap alone, across modules).
    /// [`Boundary::Module`] starts a new bucket wherever the module changes, so a bucket never
    /// holds parameters of two modules (unless it packs small whole modules); see
    /// [`Boundary`] for how modules are found and the exact rules. The plan fingerprint
    /// covers this knob.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{Boundary, DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// let set = ParamSet::new(vec![
    ///     ParamSpec::new("h.0.attn.weight", [256], DType::F32),
    ///     ParamSpec::new("h.0.mlp.weight", [256], DType::F32),
    ///     ParamSpec::new("h.1.attn.weight", [256], DType::F32),
    ///     ParamSpec::new("h.1.mlp.weight", [256], DType::F32),
    /// ])?;
    /// // A 3 KiB cap puts three parameters in the first bucket: h.1 is split over two buckets.
    /// let by_size = LayoutBuilder::new(&set, Sharding::EvenSplit, 2).bucket_bytes(3 << 10).build()?;
    /// assert_eq!(by_size.gather_buckets().len(), 2);
    /// assert_eq!(by_size.gather_buckets()[0].params().len(), 3);
    /// // One bucket per layer.
    /// let by_layer = LayoutBuilder::new(&set, Sharding::EvenSplit, 2)
    ///     .bucket_bytes(3 << 10)
    ///     .boundary(Boundary::LAYER)
    ///     .build()?;
    /// let sizes: Vec<usize> = by_layer.gather_buckets().iter().map(|b| b.params().len()).collect();
    /// assert_eq!(sizes, [2, 2]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn boundary(mut self, boundary: Boundary) -> Self {
        self.boundary = boundary;
        self
    }

    /// Cap on the parameter bytes of a bucket (default 64 MiB). Padding comes on top; a
    /// parameter larger than the cap gets a bucket of its own.
    #[must_use]
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Alignment in bytes of shard offsets and segment starts (default 256): a power of two
    /// and a multiple of every dtype's size.
    #[must_use]
    pub fn align(mut self, bytes: usize) -> Self {
        self.align = bytes;
        self
    }

    /// Bucket the parameters in this order (e.g. a recorded execution order) instead of the
    /// set's order. Parameters not listed follow, in the set's order.
    #[must_use]
    pub fn order(mut self, order: Vec<ParamId>) -> Self {
        self.order = Some(order);
        self
    }

    /// Validates the inputs and builds the layout.
    ///
    /// # Errors
    /// [`LayoutError`]: world 0, a hybrid group that is 0 or does not divide the world, a zero
    /// bucket cap, a module depth of 0, an alignment that is not a power of two or not a
    /// multiple of a parameter's dtype size (naming the parameter), a bad execution order,
    /// sizes that overflow.
    pub fn build(self) -> Result<Layout, LayoutError> {
        let world = self.world;
        if world == 0 {
            return Err(LayoutError::ZeroWorld);
        }
        let group = match self.sharding {
            Sharding::Hybrid(0) => return Err(LayoutError::ZeroGroup { world }),
            Sharding::Hybrid(g) if !world.is_multiple_of(g) => {
                return Err(LayoutError::GroupNotDivisor { group: g, world });
            }
            Sharding::Hybrid(g) => g,
            _ => world,
        };
        if self.bucket_bytes == 0 {
            return Err(LayoutError::ZeroBucketBytes);
        }
        if let Boundary::Module { key: ModuleKey::Depth(0), .. } = self.boundary {
            return Err(LayoutError::ZeroModuleDepth);
        }
        if !self.align.is_power_of_two() {
            return Err(LayoutError::AlignNotPowerOfTwo { align: self.align });
        }
        let specs = self.params.specs();
        let mut seen = [false; DType::ALL.len()];
        for s in specs {
            let k = dtype_slot(s.dtype);
            if !seen[k] {
                seen[k] = true;
                if !self.align.is_multiple_of(s.dtype.size()) {
                    return Err(LayoutError::AlignNotMultipleOfDType {
                        align: self.align,
                        dtype: s.dtype,
                        size: s.dtype.size(),
                        param: s.name.clone(),
                    });
                }
            }
        }
        let order = self.resolve_order()?;

        // Group into buckets: one open bucket per dtype, closed when the next parameter would
        // push it over the cap, and (with module boundaries) where the module changes.
        // Buckets are numbered by their first parameter's position.
        let numels = self.params.numels();
        let mut groups: Vec<(DType, Vec<ParamId>)> = Vec::new();
        let mut open: OpenBuckets = [None; DType::ALL.len()];
        let mut modules = Modules::new(&self.params, &order, self.boundary);
        for &p in &order {
            let dtype = specs[p.index()].dtype;
            let bytes = numels[p.index()] * dtype.size();
            modules.advance(&specs[p.index()], &mut open, self.bucket_bytes);
            let slot = &mut open[dtype_slot(dtype)];
            match slot {
                Some((g, used)) if used.saturating_add(bytes) <= self.bucket_bytes => {
                    groups[*g].1.push(p);
                    *used += bytes;
                }
                _ => {
                    *slot = Some((groups.len(), bytes));
                    groups.push((dtype, vec![p]));
                }
            }
        }
        let n_gather = groups.len();
        if u32::try_from(n_gather.saturating_mul(2)).is_err() {
            return Err(LayoutError::TooManyBuckets);
        }
        let ctx = Ctx { world, group, align: self.align };
        let mut buckets = Vec::with_capacity(n_gather * 2);
        let mut ranks = RankLoads::new(world);
        for (i, (dtype, ps)) in groups.into_iter().enumerate() {
            let id = BucketId(i as u32);
            let ns: Vec<usize> = ps.iter().map(|p| numels[p.index()]).collect();
            let b = match self.sharding {
                Sharding::EvenSplit | Sharding::Hybrid(_) => {
                    ctx.even(id, BucketKind::Gather, dtype, ps, ns)?
                }
                Sharding::Flat => ctx.flat(id, dtype, ps, ns)?,
                Sharding::Greedy => ctx.greedy(id, dtype, ps, ns, &mut ranks)?,
            };
            buckets.push(b);
        }
        let mut layout = Layout {
            params: self.params,
            sharding: self.sharding,
            world,
            align: self.align,
            bucket_bytes: self.bucket_bytes,
            boundary: self.boundary,
            n_gather,
            buckets,
            grad_for: Vec::new(),
            placement: Vec::new(),
        };
        layout.rebuild_grad_buckets()?;
        Ok(layout)
    }

    fn resolve_order(&self) -> Result<Vec<ParamId>, LayoutError> {
        let n = self.params.len();
        let Some(given) = &self.order else {
            return Ok(self.params.ids().collect());
        };
        let mut at: Vec<Option<usize>> = vec![None; n];
        let mut order = Vec::with_capacity(n);
        for (i, &p) in given.iter().enumerate() {
            let Some(slot) = at.get_mut(p.index()) else {
                return Err(LayoutError::OrderUnknownParam { index: i, param: p, count: n });
            };
            if let Some(first) = *slot {
                return Err(LayoutError::OrderDuplicate {
                    name: self.params.name(p).to_string(),
                    first,
                    second: i,
                });
            }
            *slot = Some(i);
            order.push(p);
        }
        order.extend(self.params.ids().filter(|p| at[p.index()].is_none()));
        Ok(order)
    }
}

/// Open buckets per dtype, as the grouping loop keeps them: `(group index, bytes used)`.
type OpenBuckets = [Option<(usize, usize)>; DType::ALL.len()];

/// The module-boundary state of the grouping loop: closes open buckets where the module
/// changes (see [`Boundary`]). Keys are slices of the specs (no allocation per parameter);
/// with packing, a first pass sums each module run's bytes per dtype.
struct Modules<'a> {
    key: Option<ModuleKey>,
    pack: bool,
    prev: Option<&'a str>,
    /// With packing: bytes per dtype of each module run, in order.
    runs: Vec<[usize; DType::ALL.len()]>,
    run: usize,
}

impl<'a> Modules<'a> {
    fn new(params: &'a ParamSet, order: &[ParamId], boundary: Boundary) -> Self {
        let (key, pack) = match boundary {
            Boundary::Size => (None, false),
            Boundary::Module { key, pack } => (Some(key), pack),
        };
        let mut runs = Vec::new();
        if let (Some(key), true) = (key, pack) {
            let (specs, numels) = (params.specs(), params.numels());
            let mut prev = None;
            for &p in order {
                let spec = &specs[p.index()];
                let m = Boundary::module_of(spec, key);
                if prev != Some(m) {
                    runs.push([0usize; DType::ALL.len()]);
                    prev = Some(m);
                }
                if let Some(run) = runs.last_mut() {
                    let d = &mut run[dtype_slot(spec.dtype)];
                    *d = d.saturating_add(numels[p.index()] * spec.dtype.size());
                }
            }
        }
        Modules { key, pack, prev: None, runs, run: 0 }
    }

    /// Called before `spec` is placed: if its module differs from the previous parameter's,
    /// closes every open bucket (without packing), or each open bucket that the new module
    /// has no parameters for or cannot fit into under `cap` (with packing).
    fn advance(&mut self, spec: &'a crate::ParamSpec, open: &mut OpenBuckets, cap: usize) {
        let Some(key) = self.key else { return };
        let m = Boundary::module_of(spec, key);
        match self.prev {
            Some(prev) if prev != m => {
                self.run += 1;
                match self.runs.get(self.run).filter(|_| self.pack) {
                    Some(next) => {
                        for (slot, &need) in open.iter_mut().zip(next) {
                            if slot.is_some_and(|(_, used)| need == 0 || used.saturating_add(need) > cap) {
                                *slot = None;
                            }
                        }
                    }
                    None => *open = [None; DType::ALL.len()],
                }
            }
            _ => {}
        }
        self.prev = Some(m);
    }
}

/// Greedy's bytes per rank over all buckets so far, plus scratch buffers reused from bucket to
/// bucket (so a bucket of `k` parameters allocates only its own `O(k)` results). Ranks that
/// never received a parameter (`fresh..world`) have 0 bytes and come first (lowest rank
/// first); the others sit in a heap keyed by `(bytes << 32) | rank`. Nothing is O(world).
struct RankLoads {
    used: BinaryHeap<Reverse<u128>>,
    fresh: u32,
    world: u32,
    /// Per parameter of the bucket: its padded element count.
    padded: Vec<usize>,
    /// Indices of the bucket's parameters, largest first (ties: bucket order).
    by_size: Vec<u32>,
    /// Sort keys `(!padded << 32) | index` when every padded size fits in 32 bits.
    keys: Vec<u64>,
    /// Sort keys `(!padded << 64) | index` otherwise.
    wide_keys: Vec<u128>,
    /// The candidate ranks as `(bytes over all buckets, rank)`, ascending.
    candidates: Vec<(usize, u32)>,
    /// Per parameter: the index of its owner in `candidates`.
    local: Vec<u32>,
    /// Per candidate: its fill of the bucket's shard.
    fill: Vec<usize>,
    /// The heap of the many-parameters-per-rank case: `(load in this bucket, bytes over all
    /// buckets, rank, candidate index)`.
    heap: BinaryHeap<Reverse<(usize, usize, u32, u32)>>,
}

impl RankLoads {
    fn new(world: u32) -> Self {
        RankLoads {
            used: BinaryHeap::new(),
            fresh: 0,
            world,
            padded: Vec::new(),
            by_size: Vec::new(),
            keys: Vec::new(),
            wide_keys: Vec::new(),
            candidates: Vec::new(),
            local: Vec::new(),
            fill: Vec::new(),
            heap: BinaryHeap::new(),
        }
    }

    /// Moves the `k` least-loaded ranks (fewer if the world is smaller) into `candidates`, as
    /// `(bytes, rank)`, ordered by bytes then rank.
    fn take(&mut self, k: usize) {
        self.candidates.clear();
        let fresh = (self.world - self.fresh).min(u32::try_from(k).unwrap_or(u32::MAX));
        self.candidates.extend((self.fresh..self.fresh + fresh).map(|r| (0, r)));
        self.fresh += fresh;
        while self.candidates.len() < k {
            let Some(Reverse(x)) = self.used.pop() else { break };
            self.candidates.push(((x >> 32) as usize, x as u32));
        }
    }

    /// Fills `by_size` from `padded`: largest first, ties in bucket order. The keys are
    /// unique (they hold the index), so an unstable sort is exact; indices fit in 32 bits
    /// because parameter ids are `u32`.
    fn sort_by_size(&mut self) {
        self.by_size.clear();
        if self.padded.iter().all(|&p| u32::try_from(p).is_ok()) {
            self.keys.clear();
            self.keys.extend(
                self.padded.iter().enumerate().map(|(i, &p)| (u64::from(!(p as u32)) << 32) | i as u64),
            );
            self.keys.sort_unstable();
            self.by_size.extend(self.keys.iter().map(|&k| k as u32));
        } else {
            self.wide_keys.clear();
            self.wide_keys.extend(
                self.padded.iter().enumerate().map(|(i, &p)| (u128::from(!(p as u64)) << 64) | i as u128),
            );
            self.wide_keys.sort_unstable();
            self.by_size.extend(self.wide_keys.iter().map(|&k| k as u32));
        }
    }

    /// Returns a rank with its new bytes over all buckets to the heap.
    fn put_back(&mut self, total: usize, rank: u32) {
        self.used.push(Reverse(((total as u128) << 32) | u128::from(rank)));
    }
}

/// Offsets of whole parameters packed per owner in bucket order; the largest owner's fill
/// (the shard size); the owner if there is only one. `distinct`: the caller knows that no two
/// parameters share an owner (then every offset is 0 and nothing is sorted).
fn pack_by_owner(owner: &[u32], padded: &[usize], distinct: bool) -> (Vec<usize>, usize, Option<u32>) {
    let mut offset = vec![0usize; owner.len()];
    let mut shard = 0usize;
    if distinct {
        shard = padded.iter().copied().max().unwrap_or(0);
    } else {
        // Keys are unique, so the unstable sort gives owner order, bucket order within one.
        let mut keys: Vec<u64> =
            owner.iter().enumerate().map(|(i, &o)| (u64::from(o) << 32) | i as u64).collect();
        keys.sort_unstable();
        let (mut fill, mut prev) = (0usize, None);
        for &key in &keys {
            let (o, i) = ((key >> 32) as u32, key as u32 as usize);
            if prev != Some(o) {
                fill = 0;
                prev = Some(o);
            }
            offset[i] = fill;
            fill += padded[i];
            shard = shard.max(fill);
        }
    }
    (offset, shard, single_owner(owner))
}

/// The owner of every parameter, if it is the same one.
fn single_owner(owner: &[u32]) -> Option<u32> {
    let &first = owner.first()?;
    owner.iter().all(|&o| o == first).then_some(first)
}

fn dtype_slot(d: DType) -> usize {
    DType::ALL.iter().position(|&x| x == d).unwrap_or(0)
}

fn align_up(x: usize, a: usize) -> Option<usize> {
    x.checked_add(a - 1).map(|y| y / a * a)
}

/// What every bucket of one layout shares.
struct Ctx {
    world: u32,
    group: u32,
    align: usize,
}

impl Ctx {
    fn bucket(
        &self,
        (id, kind, dtype): (BucketId, BucketKind, DType),
        params: Vec<ParamId>,
        numels: Vec<usize>,
        shard_numel: usize,
        single_owner: Option<u32>,
        map: ShardMap,
    ) -> Result<Bucket, LayoutError> {
        let overflow = LayoutError::Overflow { bucket: id, world: self.world };
        // The gathered buffer's bytes must be addressable.
        shard_numel
            .checked_mul(self.group as usize)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or(overflow.clone())?;
        let param_numel = numels.iter().try_fold(0usize, |a, &n| a.checked_add(n)).ok_or(overflow)?;
        Ok(Bucket {
            id,
            kind,
            dtype,
            params,
            numels,
            param_numel,
            shard_numel,
            world: self.world,
            group_size: self.group,
            single_owner,
            source: None,
            map,
        })
    }

    fn even(
        &self,
        id: BucketId,
        kind: BucketKind,
        dtype: DType,
        params: Vec<ParamId>,
        numels: Vec<usize>,
    ) -> Result<Bucket, LayoutError> {
        let ae = self.align / dtype.size();
        let g = self.group as usize;
        let overflow = || LayoutError::Overflow { bucket: id, world: self.world };
        let mut chunk = Vec::with_capacity(numels.len());
        let mut slot = Vec::with_capacity(numels.len());
        let mut at = 0usize;
        for &n in &numels {
            let c = align_up(n.div_ceil(g), ae).ok_or_else(overflow)?;
            chunk.push(c);
            slot.push(at);
            at = at.checked_add(c).ok_or_else(overflow)?;
        }
        self.bucket((id, kind, dtype), params, numels, at, None, ShardMap::Even { chunk, slot })
    }

    fn flat(
        &self,
        id: BucketId,
        dtype: DType,
        params: Vec<ParamId>,
        numels: Vec<usize>,
    ) -> Result<Bucket, LayoutError> {
        let ae = self.align / dtype.size();
        let overflow = || LayoutError::Overflow { bucket: id, world: self.world };
        let mut start = Vec::with_capacity(numels.len());
        let mut at = 0usize;
        for &n in &numels {
            start.push(at);
            at = at.checked_add(n).and_then(|e| align_up(e, ae)).ok_or_else(overflow)?;
        }
        let shard = align_up(at.div_ceil(self.group as usize), ae).ok_or_else(overflow)?;
        self.bucket((id, BucketKind::Gather, dtype), params, numels, shard, None, ShardMap::Flat { start })
    }

    /// Largest parameter first to the rank with the least bytes in this bucket (ties: least
    /// bytes over all buckets so far, then lowest rank); offsets in bucket order.
    ///
    /// Only the `min(k, world)` globally least-loaded ranks can receive one of the bucket's
    /// `k` parameters, so they are taken from `ranks` (a heap over all ranks kept across
    /// buckets): O(k log world) per bucket, never O(world).
    fn greedy(
        &self,
        id: BucketId,
        dtype: DType,
        params: Vec<ParamId>,
        numels: Vec<usize>,
        ranks: &mut RankLoads,
    ) -> Result<Bucket, LayoutError> {
        let ae = self.align / dtype.size();
        let overflow = || LayoutError::Overflow { bucket: id, world: self.world };
        let k = numels.len();
        ranks.padded.clear();
        for &n in &numels {
            ranks.padded.push(align_up(n, ae).ok_or_else(overflow)?);
        }
        ranks.sort_by_size();
        ranks.take(k);
        let mut owner = vec![0u32; k];
        if ranks.candidates.len() == k {
            // A rank for every parameter: the j-th largest goes to the j-th least loaded (what
            // the heap below would do, as every rank's load in this bucket starts at 0). Every
            // parameter has its own owner, so every offset is 0.
            for j in 0..k {
                let i = ranks.by_size[j] as usize;
                let (total, r) = ranks.candidates[j];
                owner[i] = r;
                ranks.put_back(total.saturating_add(ranks.padded[i]), r);
            }
            let (offset, shard, single) = pack_by_owner(&owner, &ranks.padded, true);
            let map = ShardMap::Greedy { owner, offset };
            return self.bucket((id, BucketKind::Gather, dtype), params, numels, shard, single, map);
        }
        // Fewer ranks than parameters: a heap of (load in this bucket, load over all buckets,
        // rank), carrying the candidate's index to pack the offsets below without sorting.
        ranks.heap.clear();
        ranks.heap.extend(
            ranks.candidates.iter().enumerate().map(|(c, &(total, r))| Reverse((0, total, r, c as u32))),
        );
        ranks.local.clear();
        ranks.local.resize(k, 0);
        for j in 0..k {
            let i = ranks.by_size[j] as usize;
            let Some(Reverse((load, total, r, c))) = ranks.heap.pop() else { break };
            owner[i] = r;
            ranks.local[i] = c;
            let load = load.checked_add(ranks.padded[i]).ok_or_else(overflow)?;
            ranks.heap.push(Reverse((load, total.saturating_add(ranks.padded[i]), r, c)));
        }
        // In any order: the keys of `used` are unique, so its pops do not depend on it.
        let mut heap = std::mem::take(&mut ranks.heap);
        for Reverse((_, total, r, _)) in heap.drain() {
            ranks.put_back(total, r);
        }
        ranks.heap = heap;
        // Pack each owner's parameters in bucket order (the loads above bound every fill).
        ranks.fill.clear();
        ranks.fill.resize(ranks.candidates.len(), 0);
        let mut offset = Vec::with_capacity(k);
        let mut shard = 0usize;
        for (&c, &p) in ranks.local.iter().zip(&ranks.padded) {
            let fill = &mut ranks.fill[c as usize];
            offset.push(*fill);
            *fill += p;
            shard = shard.max(*fill);
        }
        let single = single_owner(&owner);
        let map = ShardMap::Greedy { owner, offset };
        self.bucket((id, BucketKind::Gather, dtype), params, numels, shard, single, map)
    }

    /// The gradient bucket of a gather bucket: its trainable parameters, each element owned by
    /// the same rank as in the gather bucket. `None` if no parameter is trainable.
    fn grad_of(&self, gather: &Bucket, id: BucketId, mask: &[bool]) -> Result<Option<Bucket>, LayoutError> {
        let keep: Vec<usize> = (0..gather.params.len()).filter(|&i| mask[gather.params[i].index()]).collect();
        if keep.is_empty() {
            return Ok(None);
        }
        let params: Vec<ParamId> = keep.iter().map(|&i| gather.params[i]).collect();
        let numels: Vec<usize> = keep.iter().map(|&i| gather.numels[i]).collect();
        let dtype = gather.dtype;
        let mut b = match &gather.map {
            // Same chunks, slots packed over the trainable parameters only.
            ShardMap::Even { .. } => self.even(id, BucketKind::Grad, dtype, params, numels)?,
            // Same concatenation: frozen parameters stay as holes, so every trainable element
            // keeps its owner and offset (and the shard size stays the gather bucket's).
            ShardMap::Flat { start } => {
                let start = keep.iter().map(|&i| start[i]).collect();
                let key = (id, BucketKind::Grad, dtype);
                self.bucket(key, params, numels, gather.shard_numel, None, ShardMap::Flat { start })?
            }
            // Same owners, offsets packed over each owner's trainable parameters.
            ShardMap::Greedy { owner, offset } => {
                let ae = self.align / dtype.size();
                // All gather offsets 0: no two parameters share an owner (a second one would
                // sit after the first), so none of the kept ones do either.
                let distinct = offset.iter().all(|&o| o == 0);
                let owner: Vec<u32> = keep.iter().map(|&i| owner[i]).collect();
                // Fits: the gather bucket held these with the same padding.
                let padded: Vec<usize> = numels.iter().map(|&n| align_up(n, ae).unwrap_or(n)).collect();
                let (offset, shard, single) = pack_by_owner(&owner, &padded, distinct);
                let key = (id, BucketKind::Grad, dtype);
                self.bucket(key, params, numels, shard, single, ShardMap::Greedy { owner, offset })?
            }
        };
        b.source = Some(gather.id);
        Ok(Some(b))
    }
}

/// What changed between two layouts of one model whose trainability mask changed (see
/// [`Layout::with_trainable`]). Gather buckets and shards never change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayoutDiff {
    /// Parameters that were frozen and are now trainable.
    pub now_trainable: Vec<ParamId>,
    /// Parameters that were trainable and are now frozen.
    pub now_frozen: Vec<ParamId>,
    /// Gather buckets whose gradient bucket was added, removed or changed.
    pub grad_changed: Vec<BucketId>,
}

impl LayoutDiff {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.now_trainable.is_empty() && self.now_frozen.is_empty() && self.grad_changed.is_empty()
    }
}

/// A validated, immutable layout: every parameter's gather bucket, every trainable
/// parameter's gradient bucket, and how each bucket is split into shards.
///
/// Bucket ids: gather buckets are `0 .. gather_buckets().len()`, in order of their first
/// parameter; gradient buckets follow, in the order of their gather buckets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    params: ParamSet,
    sharding: Sharding,
    world: u32,
    align: usize,
    bucket_bytes: usize,
    boundary: Boundary,
    n_gather: usize,
    buckets: Vec<Bucket>,
    /// Per gather bucket, its gradient bucket.
    grad_for: Vec<Option<BucketId>>,
    placement: Vec<Placement>,
}

impl Layout {
    /// The parameters (with the trainability mask this layout was built for).
    pub fn params(&self) -> &ParamSet {
        &self.params
    }

    /// The sharding strategy.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// Number of ranks.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Ranks that share one copy of each bucket: the world, or `G` for `Hybrid(G)`.
    pub fn group_size(&self) -> u32 {
        match self.sharding {
            Sharding::Hybrid(g) => g,
            _ => self.world,
        }
    }

    /// Alignment in bytes of shard offsets and segment starts.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The cap on a bucket's parameter bytes.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// Where buckets may end (see [`LayoutBuilder::boundary`]).
    pub fn boundary(&self) -> Boundary {
        self.boundary
    }

    /// All buckets, by id: gather buckets, then gradient buckets.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The gather buckets (ids `0 .. len`).
    pub fn gather_buckets(&self) -> &[Bucket] {
        &self.buckets[..self.n_gather]
    }

    /// The gradient buckets (ids from `gather_buckets().len()`).
    pub fn grad_buckets(&self) -> &[Bucket] {
        &self.buckets[self.n_gather..]
    }

    /// The bucket with this id, if any.
    pub fn bucket(&self, id: BucketId) -> Option<&Bucket> {
        self.buckets.get(id.index())
    }

    /// The gradient bucket of a gather bucket (`None` if all its parameters are frozen, or
    /// for any other id).
    pub fn grad_bucket_for(&self, gather: BucketId) -> Option<BucketId> {
        self.grad_for.get(gather.index()).copied().flatten()
    }

    /// Where a parameter sits (`None` for an id outside the set).
    pub fn placement(&self, param: ParamId) -> Option<Placement> {
        self.placement.get(param.index()).copied()
    }

    /// The part of `param` that `rank` owns (the run in its gather bucket's shard; the same
    /// elements as in its gradient bucket), in O(1); `None` if the rank owns none of it or an
    /// argument is out of range. What an optimizer step on `rank` updates.
    pub fn owned(&self, param: ParamId, rank: u32) -> Option<Segment> {
        let pl = self.placement(param)?;
        self.bucket(pl.gather)?.param_segment(pl.gather_index as usize, rank)
    }

    /// The gather bucket of a parameter (`None` for an id outside the set).
    pub fn gather_bucket_of(&self, param: ParamId) -> Option<BucketId> {
        self.placement(param).map(|p| p.gather)
    }

    /// The gradient bucket of a parameter (`None` if frozen or outside the set).
    pub fn grad_bucket_of(&self, param: ParamId) -> Option<BucketId> {
        self.placement(param).and_then(|p| p.grad.map(|g| g.0))
    }

    /// Total elements of all gather buckets' gathered buffers (padding included) minus the
    /// parameters' elements, over the latter: the padding overhead of all-gathers (0.0 = none).
    pub fn padding_overhead(&self) -> f64 {
        let (mut padded, mut real) = (0f64, 0f64);
        for b in self.gather_buckets() {
            padded += b.gathered_numel() as f64;
            real += b.param_numel() as f64;
        }
        if real == 0.0 {
            0.0
        } else {
            (padded - real) / real
        }
    }

    /// The same layout for a new `requires_grad` mask (one entry per parameter, by id): gather
    /// buckets and shards unchanged (no element changes owner, so optimizer state stays
    /// valid), gradient buckets rebuilt for the new mask; plus what changed.
    ///
    /// # Errors
    /// [`LayoutError::Param`] if the mask length is not the number of parameters.
    ///
    /// # Examples
    /// ```
    /// use collsched_buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// let set = ParamSet::new(vec![ParamSpec::new("a", [64], DType::F32), ParamSpec::new("b", [64], DType::F32)]).unwrap();
    /// let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 2).build().unwrap();
    /// let (frozen, diff) = layout.with_trainable(&[true, false]).unwrap();
    /// assert_eq!(frozen.gather_buckets(), layout.gather_buckets());
    /// assert_eq!(diff.now_frozen.len(), 1);
    /// ```
    pub fn with_trainable(&self, mask: &[bool]) -> Result<(Layout, LayoutDiff), LayoutError> {
        let params = self.params.with_trainable(mask)?;
        let old = self.params.trainable_mask();
        let mut diff = LayoutDiff::default();
        for (i, (&was, &is)) in old.iter().zip(mask).enumerate() {
            match (was, is) {
                (false, true) => diff.now_trainable.push(ParamId(i as u32)),
                (true, false) => diff.now_frozen.push(ParamId(i as u32)),
                _ => {}
            }
        }
        let mut next = Layout {
            params,
            buckets: self.buckets[..self.n_gather].to_vec(),
            grad_for: Vec::new(),
            placement: Vec::new(),
            ..*self
        };
        next.rebuild_grad_buckets()?;
        for g in next.gather_buckets() {
            let before = self.grad_bucket_for(g.id).and_then(|id| self.bucket(id));
            let after = next.grad_bucket_for(g.id).and_then(|id| next.bucket(id));
            let same = match (before, after) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    a.params == b.params && a.map == b.map && a.shard_numel == b.shard_numel
                }
                _ => false,
            };
            if !same {
                diff.grad_changed.push(g.id);
            }
        }
        Ok((next, diff))
    }

    /// Feeds a canonical, platform-independent encoding of everything the layout shows to
    /// the ranks (world; strategy; parameters' names, element counts, dtypes and
    /// trainability; every bucket with its shard map, which determines its segments) to
    /// `sink`. Two layouts encode equally exactly when all of that is equal; the knobs that
    /// only shaped it (alignment, bucket cap, parameter shapes of equal element count) are
    /// not encoded, since they change nothing that moves. The bucket-boundary knob is encoded
    /// apart, by [`encode_boundary`](Self::encode_boundary).
    pub fn encode_canonical(&self, sink: &mut dyn CanonicalSink) {
        sink.word(u64::from(self.world));
        sink.word(self.sharding.code());
        sink.word(self.params.len() as u64);
        for (s, &n) in self.params.specs().iter().zip(self.params.numels()) {
            sink.bytes(s.name.as_bytes());
            sink.word(n as u64);
            sink.word(u64::from(s.dtype.code()) | (u64::from(s.trainable) << 8));
        }
        sink.word(self.n_gather as u64);
        sink.word(self.buckets.len() as u64);
        for b in &self.buckets {
            b.encode_canonical(sink);
        }
    }

    /// Feeds the bucket-boundary knob ([`boundary`](Self::boundary)) to `sink`: nothing for
    /// [`Boundary::Size`], so layouts bucketed by size encode exactly as before the knob
    /// existed; for module boundaries the string `bucket-by`, the key (`1` = layer, `2 | d <<
    /// 8` = depth `d`) and the packing flag. The plan fingerprint appends it after its ops
    /// (where the encoding is self-delimited, so the trailer is unambiguous), so ranks built
    /// with different boundary settings disagree even when their buckets happen to be equal.
    pub fn encode_boundary(&self, sink: &mut dyn CanonicalSink) {
        if let Boundary::Module { key, pack } = self.boundary {
            sink.bytes(b"bucket-by");
            sink.word(match key {
                ModuleKey::Layer => 1,
                ModuleKey::Depth(d) => 2 | (u64::from(d) << 8),
            });
            sink.word(u64::from(pack));
        }
    }

    /// Drops the gradient buckets and rebuilds them (and the placements) from the gather
    /// buckets and the parameters' trainability.
    fn rebuild_grad_buckets(&mut self) -> Result<(), LayoutError> {
        self.buckets.truncate(self.n_gather);
        let mask = self.params.trainable_mask();
        let ctx = Ctx { world: self.world, group: self.group_size(), align: self.align };
        let mut placement =
            vec![Placement { gather: BucketId(0), gather_index: 0, grad: None }; self.params.len()];
        let mut grads = Vec::new();
        let mut grad_for = vec![None; self.n_gather];
        for g in &self.buckets {
            for (i, &p) in g.params.iter().enumerate() {
                placement[p.index()].gather = g.id;
                placement[p.index()].gather_index = i as u32;
            }
            let id = BucketId((self.n_gather + grads.len()) as u32);
            if let Some(grad) = ctx.grad_of(g, id, &mask)? {
                grad_for[g.id.index()] = Some(id);
                for (i, &p) in grad.params.iter().enumerate() {
                    placement[p.index()].grad = Some((id, i as u32));
                }
                grads.push(grad);
            }
        }
        self.buckets.extend(grads);
        self.placement = placement;
        self.grad_for = grad_for;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ParamSpec;
    use proptest::prelude::*;

    /// `(owner, offset, shard_numel, single_owner)` of a Greedy bucket.
    type Parts = (Vec<u32>, Vec<usize>, usize, Option<u32>);

    /// Greedy's assignment spelt out naively over all ranks (O(world) per parameter): per
    /// gather bucket, parameters largest first (ties: bucket order), each to the rank with the
    /// least `(padded elements in this bucket, padded elements over all buckets, rank)`; per
    /// owner the parameters packed in bucket order. Returns `(owner, offset, shard, single)`.
    fn reference(buckets: &[(Vec<usize>, usize)], world: u32) -> Vec<Parts> {
        let mut total = vec![0usize; world as usize];
        let mut out = Vec::new();
        for (numels, ae) in buckets {
            let padded: Vec<usize> = numels.iter().map(|&n| n.div_ceil(*ae) * ae).collect();
            let mut order: Vec<usize> = (0..padded.len()).collect();
            order.sort_by_key(|&i| (Reverse(padded[i]), i));
            let mut load = vec![0usize; world as usize];
            let mut owner = vec![0u32; padded.len()];
            for i in order {
                let r = (0..world as usize).min_by_key(|&r| (load[r], total[r], r)).unwrap();
                owner[i] = r as u32;
                load[r] += padded[i];
                total[r] += padded[i];
            }
            out.push(pack_reference(&owner, &padded, world));
        }
        out
    }

    fn pack_reference(owner: &[u32], padded: &[usize], world: u32) -> Parts {
        let mut fill = vec![0usize; world as usize];
        let offset: Vec<usize> = owner
            .iter()
            .zip(padded)
            .map(|(&o, &p)| {
                let at = fill[o as usize];
                fill[o as usize] += p;
                at
            })
            .collect();
        let shard = fill.iter().copied().max().unwrap_or(0);
        let single = owner.iter().all(|&o| o == owner[0]).then_some(owner[0]);
        (owner.to_vec(), offset, shard, single)
    }

    fn parts(b: &Bucket) -> Parts {
        let ShardMap::Greedy { owner, offset } = &b.map else { panic!("bucket {} is not greedy", b.id) };
        (owner.clone(), offset.clone(), b.shard_numel, b.single_owner)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The heap-based, sort-free builder gives exactly the naive assignment and packing,
        /// for gather and gradient buckets, both when a bucket has fewer parameters than
        /// ranks and when it has more.
        #[test]
        fn greedy_matches_naive_reference(
            ps in prop::collection::vec(
                (1usize..=1 << 16, prop::sample::select(vec![DType::F32, DType::BF16, DType::U8]), any::<bool>()),
                1..=300,
            ),
            world in 1u32..=64,
            align in prop::sample::select(vec![4usize, 64, 256]),
            bucket_bytes in prop::sample::select(vec![1usize << 12, 1 << 16, 1 << 20, 1 << 26]),
        ) {
            let specs = ps
                .iter()
                .enumerate()
                .map(|(i, &(n, d, t))| ParamSpec::new(format!("p{i}"), [n], d).trainable(t))
                .collect();
            let set = ParamSet::new(specs).unwrap();
            let layout = LayoutBuilder::new(&set, Sharding::Greedy, world)
                .align(align)
                .bucket_bytes(bucket_bytes)
                .build()
                .unwrap();
            let gathers: Vec<(Vec<usize>, usize)> =
                layout.gather_buckets().iter().map(|b| (b.numels.clone(), align / b.dtype.size())).collect();
            let want = reference(&gathers, world);
            for (b, w) in layout.gather_buckets().iter().zip(&want) {
                prop_assert_eq!(&parts(b), w, "gather bucket {}", b.id);
                if let Some(g) = layout.grad_bucket_for(b.id).and_then(|id| layout.bucket(id)) {
                    let ae = align / b.dtype.size();
                    let keep: Vec<usize> =
                        (0..b.params.len()).filter(|&i| set.specs()[b.params[i].index()].trainable).collect();
                    let owner: Vec<u32> = keep.iter().map(|&i| w.0[i]).collect();
                    let padded: Vec<usize> = keep.iter().map(|&i| b.numels[i].div_ceil(ae) * ae).collect();
                    prop_assert_eq!(parts(g), pack_reference(&owner, &padded, world), "grad bucket {}", g.id);
                }
            }
        }
    }
}
