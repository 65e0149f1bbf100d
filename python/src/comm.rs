//! [`Comm`]: collectives on torch tensors over one rank group of the job (what the
//! `"collsched"` torch.distributed backend runs), and [`Work`]: one launch of them.
//!
//! A tensor crosses as `(address, bytes)` of a contiguous CPU tensor. Peers read a
//! collective's inputs in place, so an input must be memory every process maps (the rank's
//! arena): a tensor there (from [`Comm::alloc`], torch's `allocate_tensor`) is used as it is,
//! any other is copied into a pool buffer on the calling thread. Not copied: a reduce-scatter's
//! own chunk, which only this rank reads (`CollDesc::own_chunk`),
//! and, in an in-place all-gather, the copied input back over its own part
//! (`CollDesc::own_part_in_place`). Outputs that only their owner writes (all-gather,
//! reduce-scatter, a broadcast's receivers) are written straight into the tensor; an
//! all-reduce's result, which peers read, goes through a pool buffer that [`Work::wait`]
//! copies out. The [`Work`] holds the Python objects it is given (the tensors)
//! until the collectives completed, waiting for them if it is dropped first: that is the
//! contract under which the addresses are used.
//!
//! Element types: all-gather and broadcast move bytes, whatever the tensor's type (a member's
//! part that is not a whole number of 4-byte words is padded in a pool buffer and unpadded on
//! the way out); reduce-scatter and all-reduce reduce `f32`, `f16` or `bf16` with the
//! library's kernels (sum or average, accumulated in `f32`, rounded once).

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use collsched::backend::local::{LocalBuffer, LocalRank};
use collsched::backend::{
    Backend, BackendError, CollDesc, Collective, InFlight, OwnChunk, RankGroup, Stream, WaitError,
};
use collsched::kernels::{copy_piece, ElemType, ReduceOp, Scaling};
use pyo3::prelude::*;

use crate::errors;
use crate::region::{tensor_bytes, tensor_bytes_mut, Region};
use crate::world::World;

/// The stream a process group's collectives run on: the rank's third stream, so that they
/// never share sequence numbers with `collsched.torch.fully_shard`'s gathers and reductions
/// (which run on the all-gather and reduce-scatter streams) in the same process.
const STREAM: Stream = Stream::Compute;

/// Bytes of a tensor from which [`Comm::all_reduce`] runs a reduce-scatter and an all-gather
/// instead of one all-reduce (two meetings instead of one, fewer bytes copied).
const SPLIT_ALL_REDUCE_BYTES: usize = 256 << 10;

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

/// A collective to launch, with where its result goes.
type Op = (Collective<LocalBuffer>, Option<CopyOut>);

/// Collectives launched together.
type Ops = Vec<Op>;

impl Comm {
    fn launch(&self, what: String, ops: Ops, keep: Py<PyAny>) -> PyResult<Work> {
        self.launch_stages(what, vec![ops], keep)
    }

    /// Launches `stages` one after the other on the group's stream (each runs once the one
    /// before completed); a refused stage gives its error once the stages launched before it
    /// ended.
    fn launch_stages(&self, what: String, stages: Vec<Ops>, keep: Py<PyAny>) -> PyResult<Work> {
        let mut launched = Vec::with_capacity(stages.len());
        let mut refusal = None;
        for ops in stages {
            if refusal.is_some() {
                ops.into_iter().for_each(|(c, _)| release(&self.backend, c));
                continue;
            }
            let (ops, outs): (Vec<_>, Vec<_>) = ops.into_iter().unzip();
            match self.backend.launch_group(STREAM, &[], ops) {
                Ok(flight) => launched.push(Stage { flight: Some(flight), outs, landed: Vec::new() }),
                Err(refused) => {
                    refused.ops.into_iter().for_each(|c| release(&self.backend, c));
                    refusal = Some(refused.error);
                }
            }
        }
        let work = Work::pending(Arc::clone(&self.backend), launched, keep, what, self.timeout);
        match refusal {
            None => Ok(work),
            Some(e) => {
                drop(work);
                Err(errors::backend(e))
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

    /// An input: the tensor itself when peers can read it (it lies in this rank's arena) and
    /// it does not overlap `output` (which this rank writes while peers read the input) other
    /// than as `output`'s bytes from `in_place` on (an all-gather's own part), else a pool
    /// buffer holding a copy.
    fn input(
        &self,
        (addr, len): Span,
        bytes: usize,
        output: Span,
        in_place: Option<usize>,
    ) -> PyResult<LocalBuffer> {
        let overlaps = addr < output.0.saturating_add(output.1) && output.0 < addr.saturating_add(len);
        let allowed = in_place.is_some_and(|at| output.0.checked_add(at) == Some(addr));
        let shared = len > 0 && len == bytes && self.backend.peers_can_read(addr as *const u8, len);
        if shared && (!overlaps || allowed) {
            // SAFETY: a contiguous CPU tensor of `len` bytes at `addr` that the returned Work
            // holds (the Python object given as `keep`) until the collective completed.
            return Ok(unsafe { borrowed(addr, len) });
        }
        self.staged(bytes, Some((addr, len)))
    }

    /// A pool buffer holding the input's chunks of `chunk` bytes but this member's (which it
    /// reads where it is, [`Comm::own_chunk_apart`]): what peers read, copied for them.
    fn staged_but_own(&self, (inp, in_len): Span, chunk: usize) -> PyResult<LocalBuffer> {
        let mut buf = self.backend.alloc(in_len).map_err(errors::backend)?;
        let at = self.group_rank() * chunk;
        // SAFETY: `tensor_bytes`' contract: a contiguous CPU tensor the caller holds during
        // this call; the bytes are copied before it returns.
        let src = unsafe { tensor_bytes(inp, in_len) };
        let dst = buf.as_bytes_mut();
        for (lo, hi) in [(0, at), (at + chunk, in_len)] {
            copy_piece(&mut dst[lo..hi], &src[lo..hi], in_len).map_err(errors::other)?;
        }
        Ok(buf)
    }

    /// This member's chunk of a reduce-scatter's input, to be read where it is, when the
    /// input must be copied for the peers (it is not in the arena), the backend reads a chunk
    /// apart ([`LocalRank::takes_own_chunk`]), and input and output do not overlap.
    fn own_chunk_apart(&self, (out, out_len): Span, (inp, in_len): Span) -> Option<OwnChunk> {
        let overlaps = inp < out.saturating_add(out_len) && out < inp.saturating_add(in_len);
        let staged = !self.backend.peers_can_read(inp as *const u8, in_len);
        if out_len == 0 || overlaps || !staged || !self.backend.takes_own_chunk() {
            return None;
        }
        let ptr = NonNull::new((inp + self.group_rank() * out_len) as *mut u8)?;
        // SAFETY: the chunk lies in the input tensor (`out_len` bytes at this member's
        // position of `in_len = n * out_len`), which the returned Work holds (`keep`) until
        // the collective completed; torch does not write a collective's input meanwhile.
        Some(unsafe { OwnChunk::new(ptr, out_len) })
    }

    /// The two collectives of an all-reduce of the tensor `(addr, len)` split in `part`
    /// elements a member (see [`Comm::all_reduce`]): a reduce-scatter into a pool buffer,
    /// then an all-gather of it into the tensor, launched after it on the same stream (so it
    /// runs once the first completed); the work gives the buffer back after both.
    fn split_all_reduce(
        &self,
        (addr, len): Span,
        elem: ElemType,
        part: usize,
        op: ReduceOp,
        scaling: Scaling,
    ) -> PyResult<(Op, Op)> {
        let bytes = part * elem.size();
        let reduced = self.backend.alloc(bytes).map_err(errors::backend)?;
        let at = reduced.as_bytes().as_ptr() as usize;
        let mut desc = CollDesc::reduce_scatter(self.group.clone(), elem, part)
            .with_reduce(op, scaling)
            .with_tag(self.tag);
        let input = match self.own_chunk_apart((at, bytes), (addr, len)) {
            Some(own) => {
                desc = desc.with_own_chunk(own);
                self.staged_but_own((addr, len), bytes)?
            }
            None => self.input((addr, len), len, (at, bytes), None)?,
        };
        let scatter = Collective { desc, input: Some(input), output: reduced };
        // SAFETY: the pool buffer is the reduce-scatter's output, which the work gives back
        // only once every stage landed (`State::Pending`), after this all-gather; it runs after
        // the reduce-scatter completed (the next launch on the same stream), and only reads it.
        let gathered = unsafe { borrowed(at, bytes) };
        let desc = CollDesc::all_gather(self.group.clone(), elem, part).with_tag(self.tag);
        let gather = Collective { desc, input: Some(gathered), output: self.direct_output((addr, len))? };
        Ok(((scatter, None), (gather, None)))
    }

    /// An output only this rank writes: the tensor itself.
    fn direct_output(&self, (addr, len): Span) -> PyResult<LocalBuffer> {
        if len == 0 {
            return self.staged(0, None);
        }
        // SAFETY: as in `input`: the Work holds the tensor until the collective completed, and
        // torch reads an output only after its work was waited for.
        Ok(unsafe { borrowed(addr, len) })
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
        let backend = Arc::clone(world.backend.host("Comm (the \"collsched\" process group)")?);
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
    /// in group order), as one group launch. `keep` (the tensors) is held until the
    /// collectives completed.
    fn all_gather(&self, outputs: Vec<Span>, inputs: Vec<Span>, keep: Py<PyAny>) -> PyResult<Work> {
        pairs("all_gather", outputs.len(), inputs.len())?;
        let n = self.group.len();
        let mut ops = Vec::with_capacity(inputs.len());
        for (&(out, out_len), &(inp, in_len)) in outputs.iter().zip(&inputs) {
            self.member_bytes("all_gather", out_len, in_len, n)?;
            let part = in_len.next_multiple_of(PAD).max(PAD);
            let mut desc =
                CollDesc::all_gather(self.group.clone(), ElemType::F32, part / PAD).with_tag(self.tag);
            let own = self.group_rank() * in_len;
            let input = self.input((inp, in_len), part, (out, out_len), Some(own))?;
            // Whole words: the parts land in place in the tensor; else through a padded buffer.
            let (output, copy) = if part == in_len {
                if in_len > 0
                    && out.checked_add(own) == Some(inp)
                    && input.as_bytes().as_ptr() as usize != inp
                {
                    // In place, with the input copied out for the peers: our part is there.
                    desc = desc.with_own_part_in_place();
                }
                (self.direct_output((out, out_len))?, None)
            } else {
                (
                    self.staged(part * n, None)?,
                    Some(CopyOut { dst: out, len: in_len, stride: part, parts: n }),
                )
            };
            ops.push((Collective { desc, input: Some(input), output }, copy));
        }
        self.launch(format!("all_gather of {} tensors on group {}", inputs.len(), self.group), ops, keep)
    }

    /// Reduce-scatters each `inputs[i]` (every member's part, in group order) into
    /// `outputs[i]` (this member's part, reduced) with `op` (`"sum"`, `"avg"`) over `elem`
    /// (`"f32"`, `"f16"`, `"bf16"`), each input divided by `pre_divide` first. `keep` as for
    /// [`Comm::all_gather`].
    #[pyo3(signature = (outputs, inputs, elem, op, keep, pre_divide=1.0))]
    fn reduce_scatter(
        &self,
        outputs: Vec<Span>,
        inputs: Vec<Span>,
        elem: &str,
        op: &str,
        keep: Py<PyAny>,
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
            let (input, desc) = match self.own_chunk_apart((out, out_len), (inp, in_len)) {
                Some(own) => (self.staged_but_own((inp, in_len), out_len)?, desc.with_own_chunk(own)),
                None => (self.input((inp, in_len), in_len, (out, out_len), None)?, desc),
            };
            let output = self.direct_output((out, out_len))?;
            ops.push((Collective { desc, input: Some(input), output }, None));
        }
        self.launch(format!("reduce_scatter of {} tensors on group {}", inputs.len(), self.group), ops, keep)
    }

    /// All-reduces each of `tensors` in place with `op` over `elem` (as
    /// [`Comm::reduce_scatter`]). From [`SPLIT_ALL_REDUCE_BYTES`], when every member's part is
    /// whole and the data moves through the library's own code, as a reduce-scatter into a
    /// pool buffer (each member's part, read by the peers next) and then an all-gather of
    /// those parts into the tensor: fewer copies than one all-reduce, whose result peers read,
    /// so that it is computed in a pool buffer and copied into the tensor by [`Work::wait`].
    /// The choice depends on sizes and the backend only, the same on every member.
    #[pyo3(signature = (tensors, elem, op, keep, pre_divide=1.0))]
    fn all_reduce(
        &self,
        tensors: Vec<Span>,
        elem: &str,
        op: &str,
        keep: Py<PyAny>,
        pre_divide: f32,
    ) -> PyResult<Work> {
        let (elem, op) = self.reduction(op, elem, "all_reduce")?;
        let scaling = Scaling { pre_divide, ..Scaling::default() };
        let n = self.group.len();
        let (mut first, mut second) = (Vec::with_capacity(tensors.len()), Vec::new());
        for &(addr, len) in &tensors {
            let count = whole_elements(len, elem, "all_reduce")?;
            let split =
                n > 1 && len >= SPLIT_ALL_REDUCE_BYTES && count % n == 0 && self.backend.takes_own_chunk();
            if split {
                let (a, b) = self.split_all_reduce((addr, len), elem, count / n, op, scaling)?;
                first.push(a);
                second.push(b);
                continue;
            }
            let desc = CollDesc::all_reduce(self.group.clone(), elem, count)
                .with_reduce(op, scaling)
                .with_tag(self.tag);
            let input = self.staged(len, Some((addr, len)))?;
            let (output, copy) = if len > 0 && self.backend.peers_can_read(addr as *const u8, len) {
                (self.direct_output((addr, len))?, None)
            } else {
                (self.staged(len, None)?, Some(CopyOut { dst: addr, len, stride: len, parts: 1 }))
            };
            first.push((Collective { desc, input: Some(input), output }, copy));
        }
        let what = format!("all_reduce of {} tensors on group {}", tensors.len(), self.group);
        let stages = if second.is_empty() { vec![first] } else { vec![first, second] };
        self.launch_stages(what, stages, keep)
    }

    /// Broadcasts each of `tensors` from the member `root` (its rank in the job) to the
    /// others, in place. `keep` as for [`Comm::all_gather`].
    fn broadcast(&self, tensors: Vec<Span>, root: usize, keep: Py<PyAny>) -> PyResult<Work> {
        if self.group.position(root).is_none() {
            return Err(errors::other(format!(
                "broadcast on group {}: root {root} is not a member; give the root's rank in the job",
                self.group
            )));
        }
        let me = self.backend.rank();
        let mut ops = Vec::with_capacity(tensors.len());
        for &(addr, len) in &tensors {
            let part = len.next_multiple_of(PAD).max(PAD);
            let desc =
                CollDesc::broadcast(self.group.clone(), ElemType::F32, part / PAD, root).with_tag(self.tag);
            let op = if me == root {
                // The root's data is its output, in place, where peers read it.
                let output = self.input((addr, len), part, (0, 0), None)?;
                (Collective { desc, input: None, output }, None)
            } else if part == len {
                (Collective { desc, input: None, output: self.direct_output((addr, len))? }, None)
            } else {
                let copy = CopyOut { dst: addr, len, stride: part, parts: 1 };
                (Collective { desc, input: None, output: self.staged(part, None)? }, Some(copy))
            };
            ops.push(op);
        }
        let what = format!("broadcast of {} tensors from rank {root} on group {}", tensors.len(), self.group);
        self.launch(what, ops, keep)
    }

    /// A barrier: an all-reduce of one element over the group (ordered with the group's other
    /// collectives, as torch's barrier is).
    fn barrier(&self, py: Python<'_>) -> PyResult<Work> {
        let desc = CollDesc::all_reduce(self.group.clone(), ElemType::F32, 1).with_tag(self.tag);
        let input = self.staged(PAD, None)?;
        let output = self.staged(PAD, None)?;
        let op = (Collective { desc, input: Some(input), output }, None);
        self.launch(format!("barrier on group {}", self.group), vec![op], py.None())
    }

    /// `bytes` of this rank's shared arena, as a [`Region`] (`torch.frombuffer` views it),
    /// back to the pool when the last view of it is gone. Collectives on tensors there copy
    /// nothing in: torch's `allocate_tensor` (FSDP2's
    /// `set_allocate_memory_from_process_group_for_comm`).
    fn alloc(&self, py: Python<'_>, bytes: usize) -> PyResult<Region> {
        let buf = self.backend.alloc(bytes.max(PAD)).map_err(errors::backend)?;
        let addr = buf.as_bytes().as_ptr();
        let block = Py::new(py, Block { backend: Arc::clone(&self.backend), buf: Mutex::new(Some(buf)) })?;
        Ok(Region::new(block.into_any(), addr, bytes))
    }
}

/// A pool buffer lent to Python (the owner of a [`Region`] from [`Comm::alloc`]): back to the
/// pool when dropped.
#[pyclass(module = "collsched._native", frozen)]
pub struct Block {
    backend: Arc<LocalRank>,
    buf: Mutex<Option<LocalBuffer>>,
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.lock().unwrap_or_else(PoisonError::into_inner).take() {
            self.backend.free(buf, None);
        }
    }
}

/// One launch of a [`Comm`]: its collectives in flight and where their results go.
#[pyclass(module = "collsched._native", frozen)]
pub struct Work {
    state: Mutex<State>,
    what: String,
    timeout: Duration,
}

/// One launch of a [`Work`]: in flight, then landed (its collectives back).
struct Stage {
    flight: Option<InFlight<LocalRank>>,
    outs: Vec<Option<CopyOut>>,
    landed: Vec<Collective<LocalBuffer>>,
}

enum State {
    Pending {
        backend: Arc<LocalRank>,
        /// Launched one after the other on one stream; a later one may read a buffer an
        /// earlier one wrote, so none is given back before all landed.
        stages: Vec<Stage>,
        /// The first failure of a landed stage.
        failed: Option<BackendError>,
        /// The tensors whose memory the collectives use, held until they completed.
        keep: Py<PyAny>,
    },
    Done,
    Failed(BackendError),
}

impl Work {
    fn pending(
        backend: Arc<LocalRank>,
        stages: Vec<Stage>,
        keep: Py<PyAny>,
        what: String,
        timeout: Duration,
    ) -> Work {
        Work { state: Mutex::new(State::Pending { backend, stages, failed: None, keep }), what, timeout }
    }

    /// Waits (at most `timeout` in all), copies the results out and gives the buffers back;
    /// the state becomes `Done` or `Failed`. A timeout leaves it pending.
    ///
    /// Returns the tensors the work held (`keep`) once it is done: the caller drops them with
    /// the interpreter attached, so that they go at once (dropped without it, pyo3 defers them
    /// to its next call into Python).
    fn finish(&self, timeout: Duration) -> Result<Option<Py<PyAny>>, BackendError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut *state {
            State::Done => return Ok(None),
            State::Failed(e) => return Err(e.clone()),
            State::Pending { stages, failed, .. } => {
                for st in stages.iter_mut() {
                    let Some(flight) = st.flight.take() else { continue };
                    match flight.wait(deadline.saturating_duration_since(Instant::now())) {
                        Ok(ops) => st.landed = ops,
                        Err(WaitError::TimedOut { in_flight, waited }) => {
                            st.flight = Some(in_flight);
                            return Err(BackendError::EventTimeout { waited });
                        }
                        Err(WaitError::Failed { error, ops }) => {
                            st.landed = ops;
                            st.outs.clear();
                            failed.get_or_insert(error);
                        }
                    }
                }
            }
        }
        let State::Pending { backend, stages, failed, keep } = std::mem::replace(&mut *state, State::Done)
        else {
            return Ok(None);
        };
        if failed.is_none() {
            for st in &stages {
                for (c, copy) in st.landed.iter().zip(&st.outs) {
                    if let Some(copy) = copy {
                        copy_out(&c.output, *copy);
                    }
                }
            }
        }
        for c in stages.into_iter().flat_map(|st| st.landed) {
            release(&backend, c);
        }
        match failed {
            None => Ok(Some(keep)),
            Some(error) => {
                *state = State::Failed(error.clone());
                // The tensors go with the state's lock released, the interpreter attached
                // (the caller's `keep` of a failed work is not needed).
                drop(state);
                Python::attach(|_| drop(keep));
                Err(error)
            }
        }
    }
}

impl Drop for Work {
    /// Collectives still running may write into the tensors `keep` holds, or read buffers an
    /// earlier stage wrote: wait for them (bounded by the group's timeout; a failure ends them
    /// sooner) before anything goes, and leak the tensors and buffers of collectives that did
    /// not end rather than free memory they use.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let State::Pending { stages, keep, .. } = std::mem::replace(state, State::Done) {
            let deadline = Instant::now() + self.timeout;
            let mut stuck = Vec::new();
            let mut landed = Vec::new();
            for st in stages {
                landed.push(st.landed);
                let Some(flight) = st.flight else { continue };
                match flight.wait(deadline.saturating_duration_since(Instant::now())) {
                    Ok(ops) => landed.push(ops),
                    Err(WaitError::Failed { ops, .. }) => landed.push(ops),
                    Err(WaitError::TimedOut { in_flight, .. }) => stuck.push(in_flight),
                }
            }
            if !stuck.is_empty() {
                tracing::warn!(
                    target: "collsched::coll",
                    "{}: dropped unwaited and still running after {:?}; its tensors are leaked",
                    self.what,
                    self.timeout
                );
                std::mem::forget(keep);
                std::mem::forget(landed);
                drop(stuck);
            }
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
        py.detach(|| self.finish(timeout)).map(drop).map_err(|e| match e {
            BackendError::EventTimeout { waited } => {
                // " Timed out " as torch's own backends say it (tools and torch's tests match on it).
                let msg = format!(
                    "{}: Timed out waiting {}ms: not complete after waiting {waited:?}; a member may not have \
                     launched it (every rank of the group must issue the same collectives in the same order)",
                    self.what,
                    timeout.as_millis()
                );
                let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                if let State::Pending { backend, .. } = &*state {
                    backend.write_flight_record(&msg);
                }
                errors::PeerError::new_err(msg)
            }
            other => errors::backend(other),
        })
    }

    /// Whether the collectives completed (results copied out or not); raises their failure.
    fn is_completed(&self) -> PyResult<bool> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &*state {
            State::Done => Ok(true),
            State::Failed(e) => Err(errors::backend(e.clone())),
            State::Pending { stages, .. } => {
                for st in stages {
                    if let Some(flight) = &st.flight {
                        if !flight.is_done().map_err(errors::backend)? {
                            return Ok(false);
                        }
                    }
                }
                Ok(true)
            }
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

/// A pool-less buffer over a tensor's memory.
///
/// # Safety
/// [`LocalBuffer::borrowed`]'s contract: `len` bytes at `addr` (not null) of a live
/// contiguous tensor, used by nothing else until the collective given the buffer completed.
unsafe fn borrowed(addr: usize, len: usize) -> LocalBuffer {
    match NonNull::new(addr as *mut u8) {
        // SAFETY: the caller's contract.
        Some(ptr) => unsafe { LocalBuffer::borrowed(ptr, len) },
        // SAFETY: no bytes at all (a null address is an empty tensor's); callers pass `len > 0`.
        None => unsafe { LocalBuffer::borrowed(NonNull::dangling(), 0) },
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
