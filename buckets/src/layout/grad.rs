//! Gradient buckets: a gather bucket's trainable parameters, every element owned by the rank
//! that owns it in the gather bucket, so no gradient element changes owner.

use super::error::LayoutError;
use crate::ParamId;

use super::bucket::{Bucket, BucketId, BucketKind, ShardMap};
use super::strategy::{align_up, pack_by_owner, Sharder};

impl Sharder {
    /// The gradient bucket of a gather bucket: its trainable parameters, each element owned by
    /// the same rank as in the gather bucket. `None` if no parameter is trainable.
    pub(super) fn grad_of(
        &self,
        gather: &Bucket,
        id: BucketId,
        mask: &[bool],
    ) -> Result<Option<Bucket>, LayoutError> {
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
