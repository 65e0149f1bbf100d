//! Launching collectives on a CUDA backend: the checks a launch passes before anything is
//! enqueued, and the NCCL calls (with the divide kernels around reductions) it enqueues on the
//! communicator of its (group, stream), which the caller holds ([`super::comms::CommTable::launch`]).
//! The divide kernels come in with the call, fetched before the collective was numbered and
//! loaded when the backend was built: nothing here compiles or loads a kernel.

use collsched_kernels::cuda::{reduce_post_divisor, KernelModule};
use collsched_kernels::ReduceOp;

use super::{CallSite, Communicator, CudaBackend, CudaBuffer, CudaError, Group, NcclOp};
use crate::backend::CollectiveKind;
use crate::backend::{BackendError, CollDesc, CollRef, Collective, Stream};

/// Whether a launch of `desc` runs a divide kernel (a reduction with a pre- or post-divisor).
pub(super) fn needs_kernels(desc: &CollDesc) -> bool {
    desc.kind.reduces()
        && (desc.scaling.pre_divide != 1.0
            || reduce_post_divisor(desc.op, desc.scaling, desc.group.len()) != 1.0)
}

impl CudaBackend {
    fn invalid(&self, desc: &CollDesc, stream: Stream, what: String) -> BackendError {
        BackendError::InvalidCollective {
            rank: self.rank,
            op: Box::new(CollRef { desc: desc.clone(), stream, seq: None }),
            what,
        }
    }

    pub(super) fn validate(
        &self,
        stream: Stream,
        ops: &[Collective<CudaBuffer>],
    ) -> Result<(), BackendError> {
        let Some(first) = ops.first() else {
            return Err(BackendError::Unsupported {
                what: format!("rank {}: launch_group with no collectives", self.rank),
            });
        };
        for op in ops {
            let d = &op.desc;
            if d.group != first.desc.group {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "mixes groups {} and {} in one launch; launch them separately",
                        first.desc.group, d.group
                    ),
                ));
            }
            if d.group.position(self.rank).is_none() {
                return Err(self.invalid(
                    d,
                    stream,
                    format!("rank {} is not a member of group {}", self.rank, d.group),
                ));
            }
            if !self.comms.contains(&d.group, stream) {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "group {} was not declared in CudaConfig::groups when the backend was built",
                        d.group
                    ),
                ));
            }
            // NCCL moves the data: no placed pieces, no chunk read apart (an unpack layout
            // would otherwise be ignored and the output left member after member).
            if let Some(what) = d.own_facts_refused(op.input.is_some(), false) {
                return Err(self.invalid(d, stream, what));
            }
            let es = d.elem.size();
            let need_out = d.output_count().checked_mul(es);
            if need_out.is_none_or(|n| n > op.output.len()) {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "output has {} bytes, the collective needs {} x {es}",
                        op.output.len(),
                        d.output_count()
                    ),
                ));
            }
            match (&op.input, d.kind) {
                (Some(i), _) => {
                    if d.input_count().checked_mul(es).is_none_or(|n| n > i.len()) {
                        return Err(self.invalid(
                            d,
                            stream,
                            format!(
                                "input has {} bytes, the collective needs {} x {es}",
                                i.len(),
                                d.input_count()
                            ),
                        ));
                    }
                    if d.kind == CollectiveKind::Broadcast {
                        let root = d.root;
                        if root != self.rank {
                            return Err(self.invalid(
                                d,
                                stream,
                                format!("only the root (rank {root}) may pass an input to a broadcast"),
                            ));
                        }
                    }
                }
                (None, CollectiveKind::ReduceScatter | CollectiveKind::AllReduce) => {
                    return Err(self.invalid(
                        d,
                        stream,
                        "reduce-scatter and all-reduce need an input distinct from the output".into(),
                    ));
                }
                (None, _) => {}
            }
            if d.kind == CollectiveKind::Broadcast {
                let root = d.root;
                if d.group.position(root).is_none() {
                    return Err(self.invalid(
                        d,
                        stream,
                        format!("broadcast root {root} is not in group {}", d.group),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Enqueues the ops (validated, all over one group) on `stream` with `comm`, the
    /// communicator of (that group, `stream`): pre-divides, one NCCL group, post-divides.
    /// `kernels` is `Some` when an op [`needs_kernels`].
    pub(super) fn enqueue(
        &self,
        stream: Stream,
        ops: &[Collective<CudaBuffer>],
        comm: &Communicator,
        kernels: Option<&KernelModule>,
    ) -> Result<(), CudaError> {
        let s = self.stream(stream).raw();
        if kernels.is_none() && ops.iter().any(|op| needs_kernels(&op.desc)) {
            return Err(CudaError::Invalid {
                op: format!("rank {}: launching on stream {stream}", self.rank),
                what: "a divide kernel is needed but none was passed (a bug in collsched; please report it)"
                    .into(),
            });
        }
        let kdrv = |what: &str| {
            let what = format!("rank {}: {what}", self.rank);
            move |e| CudaError::driver(what, e)
        };
        for op in ops.iter().filter(|op| op.desc.kind.reduces() && op.desc.scaling.pre_divide != 1.0) {
            let (Some(k), Some(input)) = (kernels, op.input.as_ref()) else { continue };
            // SAFETY: validated: the input holds input_count elements, alive until the returned
            // InFlight's event completed (it owns the buffer).
            unsafe {
                k.divide(
                    s,
                    op.desc.elem,
                    input.ptr(),
                    op.desc.input_count() as u64,
                    op.desc.scaling.pre_divide,
                )
            }
            .map_err(kdrv(&format!("pre-divide of {}", op.desc)))?;
        }
        let group = Group::start(self.park.clone())?;
        for op in ops {
            let d = &op.desc;
            let pos = d.group.position(self.rank).unwrap_or(0);
            let site = CallSite::op(d.kind.name()).bucket(d.tag as usize).rank(self.rank);
            let es = d.elem.size() as u64;
            let out = op.output.ptr();
            let nop = match d.op {
                ReduceOp::Sum | ReduceOp::Avg => NcclOp::Sum,
            };
            // SAFETY (all four): validated sizes; the buffers are owned by the ops, which the
            // InFlight returned from this launch keeps until the stream's event completed.
            match d.kind {
                CollectiveKind::AllGather => {
                    let send =
                        op.input.as_ref().map_or(out + pos as u64 * d.count as u64 * es, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.all_gather(site, send, out, d.count, d.elem, s) }?;
                }
                CollectiveKind::ReduceScatter => {
                    let send = op.input.as_ref().map_or(0, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.reduce_scatter(site, send, out, d.count, d.elem, nop, s) }?;
                }
                CollectiveKind::AllReduce => {
                    let send = op.input.as_ref().map_or(0, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.all_reduce(site, send, out, d.count, d.elem, nop, s) }?;
                }
                CollectiveKind::Broadcast => {
                    let root = d.root;
                    let send = op.input.as_ref().map_or(out, CudaBuffer::ptr);
                    let root_pos = d.group.position(root).unwrap_or(0);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.broadcast(site, send, out, d.count * d.elem.size(), root_pos, s) }?;
                }
            }
        }
        group.end()?;
        for op in ops.iter().filter(|op| op.desc.kind.reduces()) {
            let post = reduce_post_divisor(op.desc.op, op.desc.scaling, op.desc.group.len());
            if post == 1.0 {
                continue;
            }
            let Some(k) = kernels else { continue };
            // SAFETY: validated: the output holds output_count elements, kept alive as above.
            unsafe { k.divide(s, op.desc.elem, op.output.ptr(), op.desc.output_count() as u64, post) }
                .map_err(kdrv(&format!("post-divide of {}", op.desc)))?;
        }
        Ok(())
    }
}
