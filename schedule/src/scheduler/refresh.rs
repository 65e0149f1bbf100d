//! Trainability changes: the scheduler switches to the gradient buckets of a new
//! `requires_grad` mask at a step boundary (the gather buckets and shards stay).

use super::tables::NONE;
use super::{ScheduleError, ScheduleInput, Scheduler};
use crate::buckets::BucketId;

impl Scheduler {
    /// Switches to the plan for a new `requires_grad` mask now (at a step boundary): gather
    /// buckets and shards stay, gradient buckets are rebuilt. Returns whether anything
    /// changed. The plan fingerprint changes: exchange it with the peers again.
    ///
    /// # Errors
    /// [`ScheduleError::MaskLength`], [`ScheduleError::RefreshWithUnsynced`] (no_sync
    /// gradients not yet reduced), [`ScheduleError::RefreshMidStep`],
    /// [`ScheduleError::NoRefreshSource`], [`ScheduleError::Refresh`]. Nothing changes on error.
    pub fn refresh_trainable(&mut self, mask: &[bool]) -> Result<bool, ScheduleError> {
        let c = &self.core;
        if mask.len() != c.t.params.len() {
            return Err(ScheduleError::MaskLength {
                rank: c.rank,
                got: mask.len(),
                expected: c.t.params.len(),
            });
        }
        if c.t.params.specs().iter().zip(mask).all(|(s, &m)| s.trainable == m) {
            return Ok(false);
        }
        c.check_boundary()?;
        let Some(plan) = &c.source else {
            return Err(ScheduleError::NoRefreshSource { rank: c.rank });
        };
        let (next, _diff) =
            plan.with_trainable(mask).map_err(|source| ScheduleError::Refresh { rank: c.rank, source })?;
        let mut input = ScheduleInput::from_plan(&next);
        // The gather buckets stay as the driver adjusted them.
        for (b, now) in input.gather.iter_mut().zip(&self.core.t.gather) {
            b.placed = now.placed;
        }
        self.replace_grad_tables(&input)?;
        self.core.source = Some(next);
        Ok(true)
    }

    /// Switches to refreshed tables (same gather buckets, new gradient buckets and
    /// trainability), for schedulers built from raw tables. At a step boundary only.
    ///
    /// # Errors
    /// [`ScheduleError::RefreshChangedGather`] if a gather bucket differs, the boundary errors
    /// of [`refresh_trainable`](Self::refresh_trainable), [`ScheduleError::BadInput`].
    pub fn replace_grad_tables(&mut self, input: &ScheduleInput) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_boundary()?;
        input.validate()?;
        if input.params.len() != c.t.params.len() || input.gather.len() != c.t.gather.len() {
            let bucket =
                input.gather.get(c.t.gather.len().min(input.gather.len())).map_or(BucketId(0), |b| b.id);
            return Err(ScheduleError::RefreshChangedGather { rank: c.rank, bucket });
        }
        if let Some((b, _)) = input.gather.iter().zip(&c.t.gather).find(|(a, b)| a != b) {
            return Err(ScheduleError::RefreshChangedGather { rank: c.rank, bucket: b.id });
        }
        c.t.set_grad(input, &c.config);
        let n_grad = c.t.grad.len();
        c.grad_arrived = vec![0; n_grad];
        c.grad_buffer = vec![None; n_grad];
        c.grad_launched = vec![false; n_grad];
        c.reduce_slot = vec![NONE; n_grad];
        c.reduces = Vec::with_capacity(n_grad);
        let max_id = input.gather.iter().chain(&input.grad).map(|b| b.id.index() + 1).max().unwrap_or(0);
        c.t.bucket_index.resize(max_id.max(c.t.bucket_index.len()), NONE);
        Ok(())
    }
}
