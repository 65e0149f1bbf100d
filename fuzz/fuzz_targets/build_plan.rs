//! Layout and plan building on arbitrary parameter files and knobs, then every copy list of
//! rank 0: an error or a plan, never a panic or an overflow.
#![no_main]
use collsched_buckets::Sharding;
use collsched_schedule::{plan_from_json, BufferRole};

libfuzzer_sys::fuzz_target!(|x: (&str, u8, u8, u32, u16)| {
    let sharding =
        [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(u32::from(x.1 >> 2))]
            [usize::from(x.1 & 3)];
    if let Ok(plan) = plan_from_json(x.0, sharding, u32::from(x.2), x.3 as usize, usize::from(x.4)) {
        plan.ops().iter().for_each(|op| {
            plan.runs(op.id(), 0, BufferRole::Gathered)
                .chain(plan.runs(op.id(), 0, BufferRole::Shard))
                .for_each(drop)
        });
    }
});
