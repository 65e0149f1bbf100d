//! Shared test rig: a layered model, its plan, and a checking driver that runs the actions.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};

use collsched_schedule::buckets::{BucketId, DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched_schedule::{Action, BufferId, Fence, InflightRegistry, Launch, Plan, Role, ScheduleInput};

/// `layers` layers of a weight `[rows, 32]` f32 and a bias `[32]` f32, one bucket per layer
/// (the bucket cap is one layer's bytes). Row counts vary so bucket sizes differ.
pub fn layered(layers: usize, world: u32) -> Plan {
    layered_with(layers, world, |_| true)
}

pub fn rows(i: usize) -> usize {
    16 + 8 * (i % 3)
}

pub fn layered_with(layers: usize, world: u32, trainable: impl Fn(usize) -> bool) -> Plan {
    let mut specs = Vec::new();
    for i in 0..layers {
        specs.push(ParamSpec::new(format!("l{i}.w"), [rows(i), 32], DType::F32).trainable(trainable(i)));
        specs.push(ParamSpec::new(format!("l{i}.b"), [32], DType::F32).trainable(trainable(i)));
    }
    let set = ParamSet::new(specs).unwrap();
    // One layer per bucket: the largest layer fits, two layers never do.
    let cap = (rows(2) * 32 + 32) * 4;
    Plan::new(
        LayoutBuilder::new(&set, Sharding::EvenSplit, world).bucket_bytes(cap).align(4).build().unwrap(),
    )
}

/// Memory a gathered bucket takes as the scheduler counts it: the gathered buffer and the
/// unpacked copy of the parameters that are not contiguous in it.
pub fn memory_bytes(plan: &Plan, bucket: BucketId) -> usize {
    let b = plan.layout().bucket(bucket).unwrap();
    b.gathered_bytes() + b.unpacked_numel() * b.dtype().size()
}

/// The params of layer `i`.
pub fn layer(i: usize) -> [ParamId; 2] {
    [ParamId(2 * i as u32), ParamId(2 * i as u32 + 1)]
}

pub fn registry(plan: &Plan) -> InflightRegistry {
    InflightRegistry::new(&ScheduleInput::from_plan(plan))
}

pub fn launches(actions: &[Action]) -> Vec<&Launch> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Launch(l) => Some(l),
            _ => None,
        })
        .collect()
}

pub fn gathers(actions: &[Action]) -> Vec<BucketId> {
    launches(actions).iter().filter(|l| l.id.role == Role::Gather).map(|l| l.id.bucket).collect()
}

pub fn reduces(actions: &[Action]) -> Vec<BucketId> {
    launches(actions).iter().filter(|l| l.id.role == Role::Reduce).map(|l| l.id.bucket).collect()
}

pub fn frees(actions: &[Action]) -> Vec<BufferId> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Free { buffer, .. } => Some(*buffer),
            _ => None,
        })
        .collect()
}

/// A driver that runs actions on nothing but checks them: every buffer is created once and
/// freed once, no free names a live user, waits name issued launches.
#[derive(Default, Debug)]
pub struct CheckingDriver {
    /// Live buffers: gathered (bucket, serial) and gradient buffers.
    pub live: HashMap<BufferId, usize>,
    pub freed: HashSet<BufferId>,
    pub launched: Vec<Launch>,
    pub gathered_launches: usize,
}

impl CheckingDriver {
    /// Runs `actions`; `held(bucket)` says whether any parameter of the bucket is held.
    pub fn run(&mut self, actions: &[Action], held: impl Fn(BucketId) -> bool) {
        for a in actions {
            match a {
                Action::Launch(l) => {
                    if l.id.role == Role::Gather {
                        assert!(
                            self.live.insert(l.buffer, l.bytes).is_none(),
                            "buffer {:?} allocated twice",
                            l.buffer
                        );
                        self.gathered_launches += 1;
                    } else {
                        assert!(
                            self.live.contains_key(&l.buffer),
                            "reduce of a buffer never allocated: {l:?}"
                        );
                    }
                    self.launched.push(l.clone());
                }
                Action::AllocGrad { buffer, bytes } => {
                    assert!(
                        self.live.insert(*buffer, *bytes).is_none(),
                        "grad buffer {buffer:?} allocated twice"
                    );
                }
                Action::Free { buffer, after } => {
                    assert!(self.live.remove(buffer).is_some(), "free of a buffer not live: {buffer:?}");
                    assert!(self.freed.insert(*buffer));
                    let is_gather =
                        self.launched.iter().any(|l| l.buffer == *buffer && l.id.role == Role::Gather);
                    if is_gather {
                        assert!(!held(buffer.bucket), "bucket {} freed while a user holds it", buffer.bucket);
                    }
                    for f in after {
                        if let Fence::Op(id) = f {
                            assert!(
                                self.launched.iter().any(|l| l.id == *id),
                                "free waits on a launch never seen"
                            );
                        }
                    }
                }
                Action::Wait { fence: Fence::Op(id), .. } => {
                    assert!(self.launched.iter().any(|l| l.id == *id), "wait on a launch never seen");
                }
                Action::CopyGradIn { buffer, .. } => {
                    assert!(self.live.contains_key(buffer), "copy into a grad buffer not live");
                }
                _ => {}
            }
        }
    }

    pub fn live_gathered_bytes(&self) -> usize {
        self.live
            .iter()
            .filter(|(b, _)| self.launched.iter().any(|l| l.buffer == **b && l.id.role == Role::Gather))
            .map(|(_, &n)| n)
            .sum()
    }
}
