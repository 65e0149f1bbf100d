//! [`Views`]: what `fetch` hands out, the gathered parameters' full values in backend buffers.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::MutexGuard;

use collsched_buckets::ParamId;
use collsched_kernels::ElemType;

use super::gather::Gathered;
use super::state::{ModelState, RankState};
use super::RuntimeError;
use crate::backend::{Backend, BackendEvent};

/// Gathered parameters, valid until the next call on the coordinator (the views borrow it and
/// hold the rank's model-state lock, so no buffer they show can be freed or reused under
/// them).
///
/// Each parameter's full value is one contiguous byte range of a backend buffer:
/// - of the **gathered buffer itself** when the parameter is one contiguous run of it (Flat
///   and Greedy layouts, single-owner buckets, any layout on a group of one): nothing is
///   copied after the collective;
/// - of an **unpacked buffer** when any parameter of the bucket is not (EvenSplit and Hybrid:
///   every shard holds a chunk of every parameter, so the chunks of one parameter lie a shard
///   apart, as in FSDP2, which copies out too). On the local and shm backends the all-gather
///   itself writes each piece there (`GatherUnpack`); elsewhere the driver unpacks every
///   parameter of such a bucket once, straight from the gathered buffer (the kernels'
///   `copy_out` on the backend: no host staging), into a buffer taken from the backend's pool
///   with the gathered one, and the gathered buffer goes back to the pool as soon as the
///   unpack is done (after its event on a device). Either way a held bucket takes the memory
///   of its parameters only. The scheduler counts what the launch takes in its budgets and in
///   live and peak gathered bytes: both buffers where the driver unpacks (the peak while
///   unpacking), the unpacked one alone where the all-gather places the pieces.
///
/// The buffers exist only while the bucket is gathered (from its gather to the `Free` after
/// its last release): nothing of the model's full size is kept across steps.
///
/// Host backends (the local one) read the bytes directly ([`Views::bytes`], [`Views::f32`]); device
/// backends hand out the buffer and range ([`Views::buffer`]: a CUDA engine takes the device
/// pointer of the buffer plus the range's start), or copy to the host ([`Views::copy_to_host`],
/// [`Views::read_f32`]). Views are **read-only**: writing through a device pointer obtained from
/// one is not allowed (other coordinators on the model see the same buffers, and the shards are the
/// parameters' truth: update them with
/// [`Coordinator::update_shards`](super::Coordinator::update_shards)). No collective reads a buffer
/// a view shows: the gathered buffer is the output of a completed collective, and the pool hands it
/// to a new gather only after its `Free` and the events that free waits for.
pub struct Views<'a, B: Backend> {
    st: MutexGuard<'a, RankState<B>>,
    state: &'a ModelState<B>,
}

impl<'a, B: Backend> Views<'a, B> {
    /// Views of whatever `st` holds gathered, on `state`'s model.
    pub(crate) fn new(st: MutexGuard<'a, RankState<B>>, state: &'a ModelState<B>) -> Self {
        Views { st, state }
    }
}

/// Where a viewed parameter is: its finished gather, the buffer and the byte range.
type Located<'v, B> = (&'v Gathered<B>, &'v <B as Backend>::Buffer, Range<usize>);

impl<B: Backend> Views<'_, B> {
    fn name(&self, param: ParamId) -> Option<String> {
        Some(self.state.plan().layout().params().name(param).to_string())
    }

    /// The finished gather holding `param`, the buffer its value is in and the byte range.
    fn locate(&self, param: ParamId) -> Result<Located<'_, B>, RuntimeError> {
        let t = &self.state.shared.tables;
        let rank = t.rank;
        let slot = t.params.get(param.index()).copied().ok_or_else(|| RuntimeError::Param {
            rank,
            param: Some(format!("id {param}")),
            what: format!("not a parameter of this model ({} parameters)", t.params.len()),
        })?;
        let current = self.st.registry().gathered_by(param);
        let not_gathered = || RuntimeError::Param {
            rank,
            param: self.name(param),
            what: format!(
                "not gathered (gather bucket {}); fetch it before reading it",
                t.gather[slot.gather].id
            ),
        };
        let held = self.st.gather().gathered(slot.gather, current).ok_or_else(not_gathered)?;
        let buffer = if slot.unpacked { held.unpacked.as_ref() } else { held.buffer.as_ref() }
            .ok_or_else(not_gathered)?;
        let es = slot.elem_size;
        Ok((held, buffer, slot.base * es..(slot.base + slot.numel) * es))
    }

    /// Where the full value of `param` is: a backend buffer and the byte range in it
    /// (little-endian bytes of its dtype). The backend-generic form: a CUDA engine reads the
    /// parameter at the buffer's device pointer plus `range.start` on its compute stream
    /// (which already waits for the gather and any unpack; the host may not read it before
    /// they completed: [`Views::copy_to_host`] waits). Read-only (see [`Views`]).
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if the parameter is unknown or not gathered (not fetched).
    pub fn buffer(&self, param: ParamId) -> Result<(&B::Buffer, Range<usize>), RuntimeError> {
        self.locate(param).map(|(_, b, r)| (b, r))
    }

    /// The full value of `param` (little-endian bytes of its dtype), for backends whose
    /// buffers are host memory.
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if the parameter is unknown or not gathered (not fetched);
    /// [`RuntimeError::Unsupported`] on a device backend (use [`Views::buffer`], or copy with
    /// [`Views::copy_to_host`] / [`Views::read_f32`]).
    pub fn bytes(&self, param: ParamId) -> Result<&[u8], RuntimeError> {
        let (_, buffer, range) = self.locate(param)?;
        let be = &*self.state.shared.backend;
        be.host_bytes(buffer).and_then(|b| b.get(range)).ok_or_else(|| RuntimeError::Unsupported {
            rank: be.rank(),
            what: format!(
                "parameter {}: the backend's buffers are device memory, not host bytes; use Views::buffer \
                 (the buffer and byte range, for device code) or Views::copy_to_host / Views::read_f32",
                self.name(param).unwrap_or_default()
            ),
        })
    }

    /// The full value of an `f32` parameter, for backends whose buffers are host memory.
    ///
    /// # Errors
    /// As [`Views::bytes`], and [`RuntimeError::Param`] if the parameter is not `f32`.
    pub fn f32(&self, param: ParamId) -> Result<&[f32], RuntimeError> {
        self.check_f32(param)?;
        let b = self.bytes(param)?;
        // Buffers are 64-byte (local) or 256-byte (CUDA) aligned and f32 runs start at
        // multiples of 4 bytes.
        bytemuck::try_cast_slice(b).map_err(|e| RuntimeError::Param {
            rank: self.state.rank(),
            param: Some(format!("id {param}")),
            what: format!("cannot view as f32: {e}"),
        })
    }

    fn check_f32(&self, param: ParamId) -> Result<(), RuntimeError> {
        let t = &self.state.shared.tables;
        let Some(slot) = t.params.get(param.index()) else { return Ok(()) };
        let elem = t.gather[slot.gather].elem;
        if elem != ElemType::F32 {
            return Err(RuntimeError::Param {
                rank: t.rank,
                param: self.name(param),
                what: format!("is {}, not f32; read it with Views::bytes or Views::buffer", elem.name()),
            });
        }
        Ok(())
    }

    /// Copies the full value of `param` into `dst` (any backend; on a device backend after
    /// waiting for the unpack, at most the backend's timeout).
    ///
    /// # Errors
    /// As [`Views::buffer`]; [`RuntimeError::Param`] if `dst` does not have the parameter's
    /// size; [`RuntimeError::Backend`] if the copy failed.
    pub fn copy_to_host(&self, param: ParamId, dst: &mut [u8]) -> Result<(), RuntimeError> {
        let (held, buffer, range) = self.locate(param)?;
        let be = &*self.state.shared.backend;
        let rank = be.rank();
        if dst.len() != range.len() {
            return Err(RuntimeError::Param {
                rank,
                param: self.name(param),
                what: format!(
                    "copy_to_host: destination has {} bytes, the parameter {}",
                    dst.len(),
                    range.len()
                ),
            });
        }
        let err = |source| RuntimeError::Backend { rank, op: "view copy to host", bucket: None, source };
        if let Some(e) = &held.ready {
            e.wait(be.timeout()).map_err(err)?;
        }
        be.read_to_host(buffer, range.start, dst).map_err(err)
    }

    /// The full value of an `f32` parameter on the host: borrowed from the buffer on host
    /// backends, a copy on device backends.
    ///
    /// # Errors
    /// As [`Views::f32`] and [`Views::copy_to_host`].
    pub fn read_f32(&self, param: ParamId) -> Result<Cow<'_, [f32]>, RuntimeError> {
        self.check_f32(param)?;
        let (_, buffer, range) = self.locate(param)?;
        if self.state.shared.backend.host_bytes(buffer).is_some() {
            return self.f32(param).map(Cow::Borrowed);
        }
        let mut v = vec![0f32; range.len() / 4];
        self.copy_to_host(param, bytemuck::cast_slice_mut(&mut v))?;
        Ok(Cow::Owned(v))
    }
}
