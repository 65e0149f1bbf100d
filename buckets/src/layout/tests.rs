use super::bucket::ShardMap;
use super::*;
use crate::{DType, ParamSpec};
use proptest::prelude::*;
use std::cmp::Reverse;

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
