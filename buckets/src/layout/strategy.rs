//! The sharding strategies: how one bucket's parameters are split into shards (EvenSplit,
//! Flat, Greedy; Hybrid is EvenSplit inside a group).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::error::LayoutError;
use crate::{DType, ParamId};

use super::bucket::{Bucket, BucketId, BucketKind, ShardMap};

/// Greedy's bytes per rank over all buckets so far, plus scratch buffers reused from bucket to
/// bucket (so a bucket of `k` parameters allocates only its own `O(k)` results). Ranks that
/// never received a parameter (`fresh..world`) have 0 bytes and come first (lowest rank
/// first); the others sit in a heap keyed by `(bytes << 32) | rank`. Nothing is O(world).
pub(super) struct RankLoads {
    pub(super) used: BinaryHeap<Reverse<u128>>,
    pub(super) fresh: u32,
    pub(super) world: u32,
    /// Per parameter of the bucket: its padded element count.
    pub(super) padded: Vec<usize>,
    /// Indices of the bucket's parameters, largest first (ties: bucket order).
    pub(super) by_size: Vec<u32>,
    /// Sort keys `(!padded << 32) | index` when every padded size fits in 32 bits.
    pub(super) keys: Vec<u64>,
    /// Sort keys `(!padded << 64) | index` otherwise.
    pub(super) wide_keys: Vec<u128>,
    /// The candidate ranks as `(bytes over all buckets, rank)`, ascending.
    pub(super) candidates: Vec<(usize, u32)>,
    /// Per parameter: the index of its owner in `candidates`.
    pub(super) local: Vec<u32>,
    /// Per candidate: its fill of the bucket's shard.
    pub(super) fill: Vec<usize>,
    /// The heap of the many-parameters-per-rank case: `(load in this bucket, bytes over all
    /// buckets, rank, candidate index)`.
    pub(super) heap: BinaryHeap<Reverse<(usize, usize, u32, u32)>>,
}

impl RankLoads {
    pub(super) fn new(world: u32) -> Self {
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
    pub(super) fn take(&mut self, k: usize) {
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
    pub(super) fn sort_by_size(&mut self) {
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
    pub(super) fn put_back(&mut self, total: usize, rank: u32) {
        self.used.push(Reverse(((total as u128) << 32) | u128::from(rank)));
    }
}

/// Offsets of whole parameters packed per owner in bucket order; the largest owner's fill
/// (the shard size); the owner if there is only one. `distinct`: the caller knows that no two
/// parameters share an owner (then every offset is 0 and nothing is sorted).
pub(super) fn pack_by_owner(
    owner: &[u32],
    padded: &[usize],
    distinct: bool,
) -> (Vec<usize>, usize, Option<u32>) {
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
pub(super) fn single_owner(owner: &[u32]) -> Option<u32> {
    let &first = owner.first()?;
    owner.iter().all(|&o| o == first).then_some(first)
}

pub(super) fn dtype_slot(d: DType) -> usize {
    DType::ALL.iter().position(|&x| x == d).unwrap_or(0)
}

pub(super) fn align_up(x: usize, a: usize) -> Option<usize> {
    x.checked_add(a - 1).map(|y| y / a * a)
}

/// What every bucket of one layout shares.
pub(super) struct Sharder {
    pub(super) world: u32,
    pub(super) group: u32,
    pub(super) align: usize,
}

impl Sharder {
    pub(super) fn bucket(
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

    pub(super) fn even(
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

    pub(super) fn flat(
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
    pub(super) fn greedy(
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
}
