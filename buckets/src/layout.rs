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
//! O(parameters) whatever the world size (Greedy additionally O(world) per bucket).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::error::LayoutError;
use crate::{DType, ParamId, ParamSet, Sharding};

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

    /// Every run of the gathered buffer, group position by group position: the copy-out list
    /// of an all-gather (or broadcast) and the copy-in list of a reduce-scatter.
    pub fn gathered_segments(&self) -> GatheredSegments<'_> {
        let (first, last) = match self.single_owner {
            Some(o) => (o, o + 1),
            None => (0, self.group_size),
        };
        GatheredSegments { bucket: self, next: first, last, current: None }
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
            order: None,
        }
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
    /// bucket cap, an alignment that is not a power of two or not a multiple of a parameter's
    /// dtype size (naming the parameter), a bad execution order, sizes that overflow.
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
        // push it over the cap. Buckets are numbered by their first parameter's position.
        let numels = self.params.numels();
        let mut groups: Vec<(DType, Vec<ParamId>)> = Vec::new();
        let mut open: [Option<(usize, usize)>; DType::ALL.len()] = [None; DType::ALL.len()];
        for &p in &order {
            let dtype = specs[p.index()].dtype;
            let bytes = numels[p.index()] * dtype.size();
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
        let mut ranks = RankLoads { used: BinaryHeap::new(), fresh: 0, world };
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

/// Greedy's bytes per rank over all buckets so far. Ranks that never received a parameter
/// (`fresh..world`) have 0 bytes and come first (lowest rank first); the others sit in a
/// heap. Nothing is O(world).
struct RankLoads {
    used: BinaryHeap<Reverse<(usize, u32)>>,
    fresh: u32,
    world: u32,
}

impl RankLoads {
    /// Removes and returns the `k` least-loaded ranks (fewer if the world is smaller), as
    /// `(bytes, rank)`, ordered by bytes then rank.
    fn take(&mut self, k: usize) -> Vec<(usize, u32)> {
        let fresh = (self.world - self.fresh).min(u32::try_from(k).unwrap_or(u32::MAX));
        let mut out: Vec<(usize, u32)> = (self.fresh..self.fresh + fresh).map(|r| (0, r)).collect();
        self.fresh += fresh;
        while out.len() < k {
            let Some(Reverse(x)) = self.used.pop() else { break };
            out.push(x);
        }
        out
    }
}

/// Offsets of whole parameters packed per owner in bucket order; the largest owner's fill
/// (the shard size); the owner if there is only one.
fn pack_by_owner(owner: &[u32], padded: &[usize]) -> (Vec<usize>, usize, Option<u32>) {
    let mut idx: Vec<usize> = (0..owner.len()).collect();
    idx.sort_by_key(|&i| owner[i]); // stable: bucket order within an owner
    let mut offset = vec![0usize; owner.len()];
    let (mut shard, mut fill, mut prev) = (0usize, 0usize, None);
    for &i in &idx {
        if prev != Some(owner[i]) {
            fill = 0;
            prev = Some(owner[i]);
        }
        offset[i] = fill;
        fill += padded[i];
        shard = shard.max(fill);
    }
    let single = match (owner.first(), owner.iter().all(|&o| Some(&o) == owner.first())) {
        (Some(&o), true) => Some(o),
        _ => None,
    };
    (offset, shard, single)
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
        let padded: Vec<usize> =
            numels.iter().map(|&n| align_up(n, ae).ok_or_else(overflow)).collect::<Result<_, _>>()?;
        let mut by_size: Vec<usize> = (0..numels.len()).collect();
        by_size.sort_by_key(|&i| (Reverse(padded[i]), i));
        let candidates = ranks.take(by_size.len());
        let mut owner = vec![0u32; numels.len()];
        if candidates.len() == by_size.len() {
            // A rank for every parameter: the j-th largest goes to the j-th least loaded (what
            // the heap below would do, as every rank's load in this bucket starts at 0).
            for (&i, &(total, r)) in by_size.iter().zip(&candidates) {
                owner[i] = r;
                ranks.used.push(Reverse((total.saturating_add(padded[i]), r)));
            }
        } else {
            // (load in this bucket, load over all buckets, rank)
            let mut heap: BinaryHeap<Reverse<(usize, usize, u32)>> =
                candidates.into_iter().map(|(total, r)| Reverse((0, total, r))).collect();
            for &i in &by_size {
                let Some(Reverse((load, total, r))) = heap.pop() else { break };
                owner[i] = r;
                let load = load.checked_add(padded[i]).ok_or_else(overflow)?;
                heap.push(Reverse((load, total.saturating_add(padded[i]), r)));
            }
            for Reverse((_, total, r)) in heap {
                ranks.used.push(Reverse((total, r)));
            }
        }
        let (offset, shard, single) = pack_by_owner(&owner, &padded);
        self.bucket(
            (id, BucketKind::Gather, dtype),
            params,
            numels,
            shard,
            single,
            ShardMap::Greedy { owner, offset },
        )
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
            ShardMap::Greedy { owner, .. } => {
                let ae = self.align / dtype.size();
                let owner: Vec<u32> = keep.iter().map(|&i| owner[i]).collect();
                // Fits: the gather bucket held these with the same padding.
                let padded: Vec<usize> = numels.iter().map(|&n| align_up(n, ae).unwrap_or(n)).collect();
                let (offset, shard, single) = pack_by_owner(&owner, &padded);
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
    /// not encoded, since they change nothing that moves.
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
