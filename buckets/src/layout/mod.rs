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

mod bucket;
mod builder;
mod error;
mod grad;
mod strategy;
#[cfg(test)]
mod tests;

pub use bucket::{
    Bucket, BucketId, BucketKind, CanonicalSink, GatheredSegment, GatheredSegments, Placement, Segment,
    Segments,
};
pub use builder::LayoutBuilder;
pub use error::LayoutError;

use crate::{Boundary, ModuleKey, ParamId, ParamSet, Sharding};

use strategy::Sharder;

/// Default cap on a bucket's parameter bytes: 64 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 64 << 20;

/// Default alignment of shard offsets and segment starts: 256 bytes.
pub const DEFAULT_ALIGN: usize = 256;

/// The largest alignment a layout accepts (1 MiB): a shard is padded to a multiple of it, so a
/// larger one would pad every shard of every bucket by up to that much (NCCL aligns to 512 bytes
/// at most; huge pages are 2 MiB).
pub const MAX_ALIGN: usize = 1 << 20;

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
        let ctx = Sharder { world: self.world, group: self.group_size(), align: self.align };
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
