//! [`Comm`]: collectives on torch tensors over one rank group of the job (what the
//! `"collsched"` torch.distributed backend runs), and [`Work`]: one launch of them.
//!
//! A tensor crosses as `(address, bytes)` of a contiguous CPU tensor. Peers can read only
//! memory every process maps (the ranks' arenas), so a launch copies each input into a pool
//! buffer (on the calling thread), runs the collective there on the group's stream, and
//! [`Work::wait`] copies the result into the output tensors. The Python caller keeps every
//! tensor it passed alive until the work is waited for (`collsched.torch._distributed`'s
//! `_Work` holds them): that is the contract under which the addresses are used.
//!
//! Element types: all-gather and broadcast move bytes, whatever the tensor's type (each
//! member's part is padded to 4 bytes in the pool buffer and unpadded on the way out);
//! reduce-scatter and all-reduce reduce `f32`, `f16` or `bf16` with the library's kernels
//! (sum or average, accumulated in `f32`, rounded once).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use collsched::backend::local::{LocalBuffer, LocalRank};
use collsched::backend::{
    Backend, BackendError, CollDesc, Collective, InFlight, RankGroup, Stream, WaitError,
};
use collsched::kernels::{copy_piece, ElemType, ReduceOp, Scaling};
use pyo3::prelude::*;

use crate::errors;
use crate::region::{tensor_bytes, tensor_bytes_mut};
use crate::world::World;

/// The stream a process group's collectives run on: the rank's third stream, so that they
/// never share sequence numbers with `collsched.torch.fully_shard`'s gathers and reductions
/// (which run on the all-gather and reduce-scatter streams) in the same process.
const STREAM: Stream = Stream::Compute;

/// Bytes each member's part of an all-gather or broadcast is padded to in the pool buffer.
const PAD: usize = 4;

/// A tensor as the caller passes it: `(address, bytes)`.
type Span = (usize, usize);

/// Collectives over one rank group of the job, on this process's rank.
///
/// `Comm(world, ranks, tag, timeout_secs)`: `ranks` are the group's ranks in the job
/// (ascending; this rank among them), `tag` labels every collective of the group (checked
/// across members, named in errors), `timeout_secs` bounds a wait with no timeout of its own.
#[pyclass(module = "collsched._native", frozen)]
pub struct Comm {
    backend: Arc<LocalRank>,
    group: RankGroup,
    tag: u64,
    timeout: Duration,
}

/// What one launched collective's result becomes: `parts` runs of `len` bytes, run `q` from
/// byte `q * stride` of the pool output to byte `q * len` of the tensor at `dst`.
#[derive(Clone, Copy, Debug)]
struct CopyOut {
    dst: usize,
    len: usize,
    stride: usize,
    parts: usize,
}

impl Comm {
    fn launch(&self, what: String, ops: Vec<(Collective<LocalBuffer>, Option<CopyOut>)>) -> PyResult<Work> {
        let (ops, outs): (Vec<_>, Vec<_>) = ops.into_iter().unzip();
        match self.backend.launch_group(STREAM, &[], ops) {
            Ok(flight) => Ok(Work::pending(Arc::clone(&self.backend), flight, outs, what, self.timeout)),
            Err(refused) => {
                for c in refused.ops {
                    release(&self.backend, c);
                }
                Err(errors::backend(refused.error))
            }
        }
    }

    /// A pool buffer of `bytes` (at least [`PAD`]: an empty buffer has no place in the
    /// arena) holding `src` at its start, copied on the calling thread.
    fn staged(&self, bytes: usize, src: Option<Span>) -> PyResult<LocalBuffer> {
        let mut buf = self.backend.alloc(bytes.max(PAD)).map_err(errors::backend)?;
        if let Some((addr, len)) = src {
            // SAFETY: `tensor_bytes`' contract: the caller passes a contiguous CPU tensor it
            // holds during this call; the bytes are copied before the call returns.
            let src = unsafe { tensor_bytes(addr, len) };
            let dst = &mut buf.as_bytes_mut()[..len];
            copy_piece(dst, src, len).map_err(errors::other)?;
        }
        Ok(buf)
    }

    fn reduction(&self, op: &str, elem: &str, kind: &str) -> PyResult<(ElemType, ReduceOp)> {
        let elem = elem_type(elem, kind)?;
        let op = match op {
            "sum" => ReduceOp::Sum,
            "avg" => ReduceOp::Avg,
            other => {
                return Err(errors::other(format!(
                    "{kind} on group {}: reduction {other:?} is not one the kernels run (sum, avg)",
                    self.group
                )))
            }
        };
        Ok((elem, op))
    }

    fn member_bytes(&self, what: &str, out: usize, inp: usize, out_parts: usize) -> PyResult<()> {
        if inp.checked_mul(out_parts) != Some(out) {
            return Err(errors::other(format!(
                "{what} on group {} (rank {}): the output has {out} bytes, but {} members x {inp} input bytes \
                 are {}; give an output {} times the input",
                self.group,
                self.backend.rank(),
                self.group.len(),
                inp.saturating_mul(out_parts),
                out_parts
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl Comm {
    #[new]
    #[pyo3(signature = (world, ranks, tag, timeout_secs=None))]
    fn new(world: &World, ranks: Vec<usize>, tag: u64, timeout_secs: Option<f64>) -> PyResult<Comm> {
        let backend = Arc::clone(&world.backend);
        let group = RankGroup::new(ranks).map_err(errors::other)?;
        let me = backend.rank();
        if group.position(me).is_none() {
            return Err(errors::other(format!("process group {group}: rank {me} is not a member")));
        }
        if let Some(&r) = group.ranks().iter().find(|&&r| r >= backend.world_size()) {
            return Err(errors::other(format!(
                "process group {group}: rank {r} is not in this job of {} ranks",
                backend.world_size()
            )));
        }
        let timeout = match timeout_secs {
            Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s.min(1e7)),
            _ => backend.timeout(),
        };
        Ok(Comm { backend, group, tag, timeout })
    }

    /// The group's ranks in the job.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.group.ranks().to_vec()
    }

    /// This rank's position in the group.
    #[getter]
    fn group_rank(&self) -> usize {
        self.group.position(self.backend.rank()).unwrap_or(0)
    }

    /// All-gathers each `inputs[i]` (this member's bytes) into `outputs[i]` (every member's,
    /// in group order), as one group launch.
    fn all_gather(&self, outputs: Vec<Span>, inputs: Vec<Span>) -> PyResult<Work> {
        pairs("all_gather", outputs.len(), inputs.len())?;
        let n = self.group.len();
        let mut ops = Vec::with_capacity(inputs.len());
        for (&(out, out_len), &(inp, in_len)) in outputs.iter().zip(&inputs) {
            self.member_bytes("all_gather", out_len, in_len, n)?;
            let part = in_len.next_multiple_of(PAD);
            let desc = CollDesc::all_gather(self.group.clone(), ElemType::F32, part / PAD).with_tag(self.tag);
            let input = self.staged(part, Some((inp, in_len)))?;
            let output = self.staged(part * n, None)?;
            let copy = CopyOut { dst: out, len: in_len, stride: part, parts: n };
            ops.push((Collective { desc, input: Some(input), output }, Some(copy)));
        }
        self.launch(format!("all_gather of {} tensors on group {}", inputs.len(), self.group), ops)
    }

    /// Reduce-scatters each `inputs[i]` (every member's part, in group order) into
    /// `outputs[i]` (this member's part, reduced) with `op` (`"sum"`, `"avg"`) over `elem`
    /// (`"f32"`, `"f16"`, `"bf16"`), each input divided by `pre_divide` first.
    #[pyo3(signature = (outputs, inputs, elem, op, pre_divide=1.0))]
    fn reduce_scatter(
        &self,
        outputs: Vec<Span>,
        inputs: Vec<Span>,
        elem: &str,
        op: &str,
        pre_divide: f32,
    ) -> PyResult<Work> {
        pairs("reduce_scatter", outputs.len(), inputs.len())?;
        let (elem, op) = self.reduction(op, elem, "reduce_scatter")?;
        let scaling = Scaling { pre_divide, ..Scaling::default() };
        let n = self.group.len();
        let mut ops = Vec::with_capacity(inputs.len());
        for (&(out, out_len), &(inp, in_len)) in outputs.iter().zip(&inputs) {
            self.member_bytes("reduce_scatter", in_len, out_len, n)?;
            let count = whole_elements(out_len, elem, "reduce_scatter")?;
            let desc = CollDesc::reduce_scatter(self.group.clone(), elem, count)
                .with_reduce(op, scaling)
                .with_tag(self.tag);
            let input = self.staged(in_len, Some((inp, in_len)))?;
            let output = self.staged(out_len, None)?;
            let copy = CopyOut { dst: out, len: out_len, stride: out_len, parts: 1 };
            ops.push((Collective { desc, input: Some(input), output }, Some(copy)));
        }
        self.launch(format!("reduce_scatter of {} tensors on group {}", inputs.len(), self.group), ops)
    }

    /// All-reduces each of `tensors` in place with `op` over `elem` (as
    /// [`Comm::reduce_scatter`]).
    #[pyo3(signature = (tensors, elem, op, pre_divide=1.0))]
    fn all_reduce(&self, tensors: Vec<Span>, elem: &str, op: &str, pre_divide: f32) -> PyResult<Work> {
        let (elem, op) = self.reduction(op, elem, "all_reduce")?;
        let scaling = Scaling { pre_divide, ..Scaling::default() };
        let mut ops = Vec::with_capacity(tensors.len());
        for &(addr, len) in &tensors {
            let count = whole_elements(len, elem, "all_reduce")?;
            let desc = CollDesc::all_reduce(self.group.clone(), elem, count)
                .with_reduce(op, scaling)
                .with_tag(self.tag);
            let input = self.staged(len, Some((addr, len)))?;
            let output = self.staged(len, None)?;
            let copy = CopyOut { dst: addr, len, stride: len, parts: 1 };
            ops.push((Collective { desc, input: Some(input), output }, Some(copy)));
        }
        self.launch(format!("all_reduce of {} tensors on group {}", tensors.len(), self.group), ops)
    }

    /// Broadcasts each of `tensors` from the member `root` (its rank in the job) to the
    /// others, in place.
    fn broadcast(&self, tensors: Vec<Span>, root: usize) -> PyResult<Work> {
        if self.group.position(root).is_none() {
            return Err(errors::other(format!(
                "broadcast on group {}: root {root} is not a member; give the root's rank in the job",
                self.group
            )));
        }
        let me = self.backend.rank();
        let mut ops = Vec::with_capacity(tensors.len());
        for &(addr, len) in &tensors {
            let part = len.next_multiple_of(PAD);
            let desc =
                CollDesc::broadcast(self.group.clone(), ElemType::F32, part / PAD, root).with_tag(self.tag);
            // The root's data is its output, in place; it has nothing to copy out.
            let (output, copy) = if me == root {
                (self.staged(part, Some((addr, len)))?, None)
            } else {
                (self.staged(part, None)?, Some(CopyOut { dst: addr, len, stride: part, parts: 1 }))
            };
            ops.push((Collective { desc, input: None, output }, copy));
        }
        self.launch(
            format!("broadcast of {} tensors from rank {root} on group {}", tensors.len(), self.group),
            ops,
        )
    }

    /// A barrier: an all-reduce of one element over the group (ordered with the group's other
    /// collectives, as torch's barrier is).
    fn barrier(&self) -> PyResult<Work> {
        let desc = CollDesc::all_reduce(self.group.clone(), ElemType::F32, 1).with_tag(self.tag);
        let input = self.staged(PAD, None)?;
        let output = self.staged(PAD, None)?;
        self.launch(
            format!("barrier on group {}", self.group),
            vec![(Collective { desc, input: Some(input), output }, None)],
        )
    }
}

/// One launch of a [`Comm`]: its collectives in flight and where their results go.
#[pyclass(module = "collsched._native", frozen)]
pub struct Work {
    state: Mutex<State>,
    what: String,
    timeout: Duration,
}

enum State {
    Pending { backend: Arc<LocalRank>, flight: InFlight<LocalRank>, outs: Vec<Option<CopyOut>> },
    Done,
    Failed(BackendError),
}

impl Work {
    fn pending(
        backend: Arc<LocalRank>,
        flight: InFlight<LocalRank>,
        outs: Vec<Option<CopyOut>>,
        what: String,
        timeout: Duration,
    ) -> Work {
        Work { state: Mutex::new(State::Pending { backend, flight, outs }), what, timeout }
    }

    /// Waits (at most `timeout`), copies the results out and gives the buffers back; the
    /// state becomes `Done` or `Failed`. A timeout leaves it pending.
    fn finish(&self, timeout: Duration) -> Result<(), BackendError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match std::mem::replace(&mut *state, State::Done) {
            State::Done => Ok(()),
            State::Failed(e) => {
                *state = State::Failed(e.clone());
                Err(e)
            }
            State::Pending { backend, flight, outs } => match flight.wait(timeout) {
                Ok(ops) => {
                    for (c, copy) in ops.into_iter().zip(outs) {
                        if let Some(copy) = copy {
                            copy_out(&c.output, copy);
                        }
                        release(&backend, c);
                    }
                    Ok(())
                }
                Err(WaitError::TimedOut { in_flight, waited }) => {
                    *state = State::Pending { backend, flight: in_flight, outs };
                    Err(BackendError::EventTimeout { waited })
                }
                Err(WaitError::Failed { error, ops }) => {
                    for c in ops {
                        release(&backend, c);
                    }
                    *state = State::Failed(error.clone());
                    Err(error)
                }
            },
        }
    }
}

#[pymethods]
impl Work {
    /// Blocks until the collectives completed (at most `timeout_secs`, else the group's
    /// timeout) and their results are in the output tensors. Idempotent; raises the
    /// collectives' failure (every call), or `PeerError` on a timeout (still pending then).
    #[pyo3(signature = (timeout_secs=None))]
    fn wait(&self, py: Python<'_>, timeout_secs: Option<f64>) -> PyResult<()> {
        let timeout = match timeout_secs {
            Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s.min(1e7)),
            _ => self.timeout,
        };
        py.detach(|| self.finish(timeout)).map_err(|e| match e {
            BackendError::EventTimeout { waited } => errors::PeerError::new_err(format!(
                "{}: not complete after waiting {waited:?}; a member may not have launched it (every rank \
                 of the group must issue the same collectives in the same order)",
                self.what
            )),
            other => errors::backend(other),
        })
    }

    /// Whether the collectives completed (results copied out or not); raises their failure.
    fn is_completed(&self) -> PyResult<bool> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &*state {
            State::Done => Ok(true),
            State::Failed(e) => Err(errors::backend(e.clone())),
            State::Pending { flight, .. } => flight.is_done().map_err(errors::backend),
        }
    }

    /// What the work is (op, tensors, group), for messages.
    #[getter]
    fn what(&self) -> &str {
        &self.what
    }
}

/// Copies a result from its pool buffer into the tensor `copy` names.
fn copy_out(output: &LocalBuffer, copy: CopyOut) {
    let whole = copy.len * copy.parts;
    if whole == 0 {
        return;
    }
    // SAFETY: `tensor_bytes_mut`'s contract: the tensor at `copy.dst` holds `len * parts`
    // bytes (checked at launch), the Python work object keeps it alive until this work is
    // waited for, and torch does not touch an output before its work completed.
    let dst = unsafe { tensor_bytes_mut(copy.dst, whole) };
    let src = output.as_bytes();
    for q in 0..copy.parts {
        let from = q * copy.stride;
        // Lengths are equal by construction: this cannot fail.
        let _ = copy_piece(&mut dst[q * copy.len..(q + 1) * copy.len], &src[from..from + copy.len], whole);
    }
}

/// Gives a collective's buffers back to the pool.
fn release(backend: &LocalRank, c: Collective<LocalBuffer>) {
    if let Some(input) = c.input {
        backend.free(input, None);
    }
    backend.free(c.output, None);
}

fn pairs(kind: &str, outputs: usize, inputs: usize) -> PyResult<()> {
    if outputs != inputs {
        return Err(errors::other(format!(
            "{kind}: {outputs} output tensors for {inputs} inputs; give one output per input"
        )));
    }
    Ok(())
}

fn elem_type(name: &str, kind: &str) -> PyResult<ElemType> {
    match name {
        "f32" => Ok(ElemType::F32),
        "f16" => Ok(ElemType::F16),
        "bf16" => Ok(ElemType::BF16),
        other => Err(errors::other(format!(
            "{kind}: element type {other:?}; the kernels reduce f32, f16 and bf16"
        ))),
    }
}

fn whole_elements(bytes: usize, elem: ElemType, kind: &str) -> PyResult<usize> {
    if !bytes.is_multiple_of(elem.size()) {
        return Err(errors::other(format!(
            "{kind}: {bytes} bytes are not a whole number of {} elements",
            elem.name()
        )));
    }
    Ok(bytes / elem.size())
}
