//! The scheduler's tables: per parameter and per bucket, what a plan says, built once.
//!
//! Index names used throughout the scheduler: `g` is a gather bucket's position in
//! `Tables::gather` (and in the registry's slots), `j` a gradient bucket's position in
//! `Tables::grad`, `p` a parameter (`ParamId`, or its index); bucket *ids* (`BucketId`) are
//! the layout's and are only translated at the edges (`gather_index`, `grad_index`).

use crate::buckets::{BucketId, DType, ParamSet};

use super::action::ReduceSpec;
use super::config::{split_divide, SchedulerConfig};
use super::error::ScheduleError;
use super::input::{BucketInput, PlanDigests, ScheduleInput};

pub(super) const NONE: u32 = u32::MAX;

/// The scheduler's tables, built once from a plan (see [`ScheduleInput`]).
#[derive(Debug, Clone)]
pub(super) struct Tables {
    pub(super) params: ParamSet,
    pub(super) world: u32,
    pub(super) param_gather: Vec<u32>,
    pub(super) param_grad: Vec<u32>,
    pub(super) gather: Vec<BucketInput>,
    pub(super) grad: Vec<BucketInput>,
    pub(super) grad_reduce: Vec<ReduceSpec>,
    /// Gather bucket position by `BucketId` index.
    pub(super) bucket_index: Vec<u32>,
    /// Gradient bucket position by `BucketId` index.
    pub(super) grad_bucket_index: Vec<u32>,
    pub(super) digests: PlanDigests,
}

impl Tables {
    pub(super) fn new(input: &ScheduleInput, config: &SchedulerConfig) -> Result<Tables, ScheduleError> {
        input.validate()?;
        let n = input.params.len();
        let mut param_gather = vec![NONE; n];
        let max_id = input.gather.iter().chain(&input.grad).map(|b| b.id.index() + 1).max().unwrap_or(0);
        let mut bucket_index = vec![NONE; max_id];
        for (g, b) in input.gather.iter().enumerate() {
            bucket_index[b.id.index()] = g as u32;
            for p in &b.params {
                param_gather[p.index()] = g as u32;
            }
        }
        let mut t = Tables {
            params: input.params.clone(),
            world: input.world.max(1),
            param_gather,
            param_grad: Vec::new(),
            gather: input.gather.clone(),
            grad: Vec::new(),
            grad_reduce: Vec::new(),
            bucket_index,
            grad_bucket_index: Vec::new(),
            digests: input.digests.clone(),
        };
        t.set_grad(input, config);
        Ok(t)
    }

    pub(super) fn set_grad(&mut self, input: &ScheduleInput, config: &SchedulerConfig) {
        self.params = input.params.clone();
        self.digests = input.digests.clone();
        self.param_grad = vec![NONE; input.params.len()];
        let max_id = input.grad.iter().map(|b| b.id.index() + 1).max().unwrap_or(0);
        self.grad_bucket_index = vec![NONE; max_id];
        for (j, b) in input.grad.iter().enumerate() {
            self.grad_bucket_index[b.id.index()] = j as u32;
            for p in &b.params {
                self.param_grad[p.index()] = j as u32;
            }
        }
        self.grad_reduce = input
            .grad
            .iter()
            .map(|b| {
                let o = b
                    .partner
                    .and_then(|g| config.reduce_per_bucket.iter().find(|(id, _)| *id == g))
                    .map(|x| x.1)
                    .unwrap_or_default();
                let base = config.reduce;
                let dtype = o.dtype.or(base.dtype).unwrap_or(b.dtype);
                let (pre, post) = match (o.pre_divide.or(base.pre_divide), o.post_divide.or(base.post_divide))
                {
                    (None, post) if config.split_f16_divide && dtype == DType::F16 => {
                        split_divide(post.unwrap_or(f64::from(self.world)))
                    }
                    (pre, post) => {
                        let pre = pre.unwrap_or(1.0);
                        (pre, post.unwrap_or(f64::from(self.world) / pre))
                    }
                };
                ReduceSpec { dtype, pre_divide: pre, post_divide: post }
            })
            .collect();
        self.grad = input.grad.clone();
    }

    /// Bytes of gradient bucket `j`'s full-size buffer in its reduction dtype (the driver casts
    /// gradients to it at copy-in: a bf16 bucket reduced in f32 takes twice its gathered bytes).
    pub(super) fn grad_bytes(&self, j: usize) -> usize {
        let b = &self.grad[j];
        b.gathered_bytes / b.dtype.size() * self.grad_reduce[j].dtype.size()
    }

    pub(super) fn gather_index(&self, b: BucketId) -> Option<usize> {
        match self.bucket_index.get(b.index()) {
            Some(&g) if g != NONE => Some(g as usize),
            _ => None,
        }
    }

    pub(super) fn grad_index(&self, b: BucketId) -> Option<usize> {
        match self.grad_bucket_index.get(b.index()) {
            Some(&j) if j != NONE => Some(j as usize),
            _ => None,
        }
    }
}
