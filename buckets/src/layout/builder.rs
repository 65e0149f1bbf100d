//! [`LayoutBuilder`]: the knobs, validation, and the grouping loop that cuts parameters into
//! buckets (by size, dtype and module boundary) before a strategy shards each bucket.

use super::error::LayoutError;
use crate::{Boundary, DType, ModuleKey, ParamId, ParamSet, Sharding};

use super::bucket::{BucketId, BucketKind};
use super::strategy::{dtype_slot, RankLoads, Sharder};
use super::{Layout, DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES, MAX_ALIGN};

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
    pub(super) params: ParamSet,
    pub(super) sharding: Sharding,
    pub(super) world: u32,
    pub(super) bucket_bytes: usize,
    pub(super) align: usize,
    pub(super) boundary: Boundary,
    pub(super) order: Option<Vec<ParamId>>,
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
        if self.align > MAX_ALIGN {
            return Err(LayoutError::AlignTooLarge { align: self.align, max: MAX_ALIGN });
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
        let ctx = Sharder { world, group, align: self.align };
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

    pub(super) fn resolve_order(&self) -> Result<Vec<ParamId>, LayoutError> {
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
pub(super) type OpenBuckets = [Option<(usize, usize)>; DType::ALL.len()];

/// The module-boundary state of the grouping loop: closes open buckets where the module
/// changes (see [`Boundary`]). Keys are slices of the specs (no allocation per parameter);
/// with packing, a first pass sums each module run's bytes per dtype.
pub(super) struct Modules<'a> {
    pub(super) key: Option<ModuleKey>,
    pub(super) pack: bool,
    pub(super) prev: Option<&'a str>,
    /// With packing: bytes per dtype of each module run, in order.
    pub(super) runs: Vec<[usize; DType::ALL.len()]>,
    pub(super) run: usize,
}

impl<'a> Modules<'a> {
    pub(super) fn new(params: &'a ParamSet, order: &[ParamId], boundary: Boundary) -> Self {
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
    pub(super) fn advance(&mut self, spec: &'a crate::ParamSpec, open: &mut OpenBuckets, cap: usize) {
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
