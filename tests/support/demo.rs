//! The small demo run the parity tests share (`tests/demo_parity.rs` on the local backend,
//! `tests/gpu_demo.rs` on GPUs), included with `#[path]`.
#![allow(dead_code)]

use std::time::Duration;

use collsched::buckets::Sharding;
use collsched::demo::model::Mlp;
use collsched::demo::{DemoConfig, ShardedOptions};
use collsched::schedule::PolicyKind;

/// A small model (fast in debug builds) with odd widths, 3 steps of 2 micro-batches, layer 1
/// frozen in step 1 only, an evaluation after steps 1 and 3.
pub fn small(world: usize) -> DemoConfig {
    DemoConfig {
        model: Mlp { dims: vec![7, 13, 9, 5] },
        world,
        steps: 3,
        micro_batches: 2,
        batch: 3,
        lr: 0.1,
        seed: 11 + world as u64,
        freeze: Some((1, 1, 2)),
        eval_every: 2,
    }
}

/// 128-byte buckets (every parameter in a bucket of its own or two per bucket), a 60 s timeout.
pub fn opts(sharding: Sharding, policy: PolicyKind) -> ShardedOptions {
    ShardedOptions { sharding, policy, bucket_bytes: 128, timeout: Duration::from_secs(60), flight_out: None }
}
