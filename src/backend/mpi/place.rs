//! Where the members of an `mpi` collective meet: one communicator per (group, stream), made
//! on first use (`MPI_Comm_create_group`, collective over the group alone), on which each
//! collective runs in two steps:
//! 1. **Agree.** Every member sends every other member a header (its status, the first
//!    collective of its post and a digest of all of them) and receives theirs
//!    (`MPI_Isend`/`MPI_Irecv`). A member that arrived failed fails the others naming it; posts
//!    that differ fail every member with a mismatch naming both; a member whose header does not
//!    come within the timeout is named (or at once, when its process on this machine exited).
//!    Nothing of the data is moved unless every member agreed: MPI itself would hang or
//!    corrupt memory on a mismatch.
//! 2. **Move data** with non-blocking MPI collectives on raw bytes: all-gather
//!    (`MPI_Iallgather`), broadcast (`MPI_Ibcast`), reduce-scatter (`MPI_Ialltoall` of the
//!    pieces, then the library's reduction kernel over them) and all-reduce (`MPI_Ialltoallv`,
//!    the kernel on this member's chunk, `MPI_Iallgatherv`). Reductions are the library's:
//!    sums in `f32` in rank order, rounded once, pre/post-divide and average included, bit for
//!    bit the other backends' results, in f16 and bf16 too (MPI's own reductions would choose
//!    their order, and round at each step in a 2-byte type).
//!
//! A collective whose requests could not complete (a timeout after the agreement: a peer or
//! the network stalled) leaves MPI owning its buffers: the job is then broken, and every later
//! collective of this process fails at once naming the first.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use collsched_kernels::{reduce, ElemType, ReduceOp, Scaling};

use super::ffi::{self, Comm, MpiError, Requests};
use crate::backend::desc::{elem_code, elem_of, kind_code, kind_of};
use crate::backend::local::meeting::{Meeting, Place};
use crate::backend::local::moves::{chunk, OpPost, Post};
use crate::backend::local::rendezvous::{guarded, Arrival, Caller};
use crate::backend::{BackendError, CollDesc, CollRef, CollectiveKind, RankGroup, Stream};
use crate::bootstrap::Liveness;

/// What the places of one process share.
#[derive(Debug)]
pub(super) struct Job {
    world: usize,
    /// One duplicate of the world's communicator per stream, parent of that stream's groups.
    parents: Vec<Comm>,
    /// Processes of peers on this machine (pid 0: elsewhere, not watched).
    liveness: Liveness,
    places: Mutex<HashMap<(Stream, RankGroup), Arc<MpiPlace>>>,
    /// Whether MPI may still be called: `false` once the job closed (before MPI_Finalize).
    /// Collectives hold it shared while they run.
    open: RwLock<bool>,
    /// The first collective that left MPI owning buffers (module docs).
    broken: Mutex<Option<String>>,
}

impl Job {
    pub(super) fn new(world: usize, parents: Vec<Comm>, liveness: Liveness) -> Self {
        Job {
            world,
            parents,
            liveness,
            places: Mutex::default(),
            open: RwLock::new(true),
            broken: Mutex::new(None),
        }
    }

    /// Why the job broke, if it did (module docs).
    /// Marks the job broken (MPI keeps buffers of `why`'s call), once: the first reason stays.
    pub(super) fn set_broken(&self, why: String) {
        let mut b = self.broken.lock().unwrap_or_else(PoisonError::into_inner);
        if b.is_none() {
            *b = Some(why);
        }
    }

    pub(super) fn broken(&self) -> Option<String> {
        self.broken.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Stops every later collective (before MPI_Finalize); waits for collectives running now
    /// (each bounded by its timeout).
    pub(super) fn close(&self) {
        let mut open = self.open.write().unwrap_or_else(PoisonError::into_inner);
        if !*open {
            return;
        }
        *open = false;
    }
}

/// The [`Meeting`] of an `mpi` job.
#[derive(Debug)]
pub(crate) struct MpiMeeting {
    pub(super) job: Arc<Job>,
}

impl Meeting for MpiMeeting {
    fn place(&self, stream: Stream, group: &RankGroup) -> Arc<dyn Place> {
        let mut places = self.job.places.lock().unwrap_or_else(PoisonError::into_inner);
        places
            .entry((stream, group.clone()))
            .or_insert_with(|| {
                // Distinct tags per group keep groups' headers apart (a collision would only
                // matter if two groups' collectives were issued in different orders by ranks in
                // both, which a plan never does), within MPI's guaranteed tag range.
                let tag = group.ranks().iter().fold(17u64, |h, &r| h.wrapping_mul(31).wrapping_add(r as u64));
                Arc::new(MpiPlace {
                    job: Arc::clone(&self.job),
                    stream,
                    group: group.clone(),
                    tag: (tag % 32_000) as c_int + 1,
                    state: Mutex::default(),
                })
            })
            .clone()
    }

    /// Peers learn nothing from a departure here: a member that never posts is named when its
    /// header does not come (or its process exited).
    fn departed(&self, _rank: usize, _stream: Stream) {}

    fn panicked(&self, _rank: usize) {}

    fn gathers_unpacked(&self) -> bool {
        false
    }
}

/// Words of a member's header.
const HEADER: usize = 12;
const OK: u64 = 0;
const FAILED: u64 = 1;

/// Per-collective scratch memory, kept for reuse (steady state allocates nothing).
#[derive(Debug)]
struct OpScratch {
    /// Received pieces (reduce-scatter, all-reduce) or this member's shard (in-place
    /// all-gather).
    data: Vec<u8>,
    /// This member's reduced chunk of an all-reduce, gathered from.
    reduced: Vec<u8>,
    /// Counts and displacements of the `v` calls (alive until their requests complete).
    scounts: Vec<c_int>,
    sdispls: Vec<c_int>,
    rcounts: Vec<c_int>,
    rdispls: Vec<c_int>,
}

impl Default for OpScratch {
    /// Buffers start allocated: an empty `Vec`'s pointer is 1 (dangling, aligned), which Open
    /// MPI reads as `MPI_IN_PLACE`.
    fn default() -> Self {
        OpScratch {
            data: Vec::with_capacity(64),
            reduced: Vec::with_capacity(64),
            scounts: Vec::new(),
            sdispls: Vec::new(),
            rcounts: Vec::new(),
            rdispls: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct PlaceState {
    comm: Option<Comm>,
    header: Vec<u64>,
    headers: Vec<u64>,
    /// For each pending request of the agreement, the member it receives from.
    from: Vec<Option<usize>>,
    ops: Vec<OpScratch>,
    reqs: Requests,
}

/// One (group, stream)'s communicator and its scratch memory.
#[derive(Debug)]
pub(super) struct MpiPlace {
    job: Arc<Job>,
    stream: Stream,
    group: RankGroup,
    /// The group's tag on its stream's world communicator (headers, communicator creation).
    tag: c_int,
    state: Mutex<PlaceState>,
}

fn device(rank: usize, op: &CollRef, e: MpiError) -> BackendError {
    BackendError::Device { rank, api: e.api, detail: format!("{op}: {}", e.text) }
}

/// FNV-1a over what every member must agree on (`CollDesc::matches`, the group aside: the
/// communicator is the group).
fn digest(post: &Post) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut mix = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    };
    for o in post.iter() {
        let d = &o.desc;
        mix(kind_code(d.kind));
        mix(d.root as u64);
        mix(elem_code(d.elem));
        mix(d.count as u64);
        mix(d.tag);
        if d.kind.reduces() {
            mix(matches!(d.op, ReduceOp::Avg) as u64);
            mix(u64::from(d.scaling.pre_divide.to_bits()));
            mix(u64::from(d.scaling.post_divide.to_bits()));
        }
    }
    h
}

/// A member's header: status, collectives, digest, then its first collective's description.
fn header(out: &mut Vec<u64>, seq: u64, arrival: &Arrival) {
    out.clear();
    out.resize(HEADER, 0);
    out[11] = seq;
    let Arrival::Ops(post) = arrival else {
        out[0] = FAILED;
        return;
    };
    out[0] = OK;
    out[1] = post.len() as u64;
    out[2] = digest(post);
    if let Some(o) = post.first() {
        let d = &o.desc;
        out[3] = kind_code(d.kind);
        out[4] = d.root as u64;
        out[5] = elem_code(d.elem);
        out[6] = d.count as u64;
        out[7] = matches!(d.op, ReduceOp::Avg) as u64;
        out[8] = u64::from(d.scaling.pre_divide.to_bits());
        out[9] = u64::from(d.scaling.post_divide.to_bits());
        out[10] = d.tag;
    }
}

/// What a header says a member posted, for a mismatch message.
fn describe(h: &[u64], group: &RankGroup) -> String {
    let kind = kind_of(h[3]).unwrap_or(CollectiveKind::Broadcast);
    let elem = elem_of(h[5]).unwrap_or(ElemType::BF16);
    let desc = CollDesc {
        kind,
        root: h[4] as usize,
        group: group.clone(),
        elem,
        count: h[6] as usize,
        op: if h[7] == 1 { ReduceOp::Avg } else { ReduceOp::Sum },
        scaling: Scaling {
            pre_divide: f32::from_bits(h[8] as u32),
            post_divide: f32::from_bits(h[9] as u32),
        },
        tag: h[10],
        unpack: None,
        own_part_in_place: false,
        own_chunk: None,
        origin: None,
    };
    match h[1] {
        0 => "nothing".into(),
        1 => format!("[{desc}]"),
        n => format!("[{desc} and {} more]", n - 1),
    }
}

/// How long a wait keeps testing its requests (yielding between tests) before it naps 50 µs
/// between them.
const ACTIVE_POLL: Duration = Duration::from_millis(20);

/// Why a wait ended without its requests done.
enum Stalled {
    /// Members whose processes on this machine exited.
    Dead(Vec<usize>),
    /// The timeout passed.
    Timeout(Duration),
}

/// Where a collective's wait stalled.
enum Phase {
    /// Agreeing on the collective: `missing` are the members whose headers never came.
    Agreement { missing: Vec<usize> },
    /// Moving the data, after every member posted it.
    Data,
}

impl MpiPlace {
    /// Tests `reqs` until done, the timeout passes, or a member's process on this machine
    /// exited: spinning (yielding) for a while, then napping, since MPI progresses in tests.
    fn wait(&self, reqs: &mut Requests, caller: &Caller<'_>) -> Result<Result<(), Stalled>, MpiError> {
        let start = Instant::now();
        let mut last_check = start;
        loop {
            if reqs.test()? {
                return Ok(Ok(()));
            }
            let now = Instant::now();
            let waited = now - start;
            if waited >= caller.config.timeout {
                return Ok(Err(Stalled::Timeout(waited)));
            }
            if now - last_check >= Duration::from_millis(10) {
                last_check = now;
                let dead: Vec<usize> =
                    self.group.ranks().iter().copied().filter(|&r| self.job.liveness.is_dead(r)).collect();
                if !dead.is_empty() {
                    return Ok(Err(Stalled::Dead(dead)));
                }
            }
            // MPI moves a large message only while someone tests it (Open MPI's shared-memory
            // transport hands it over in fragments): keep testing through a transfer's
            // milliseconds, and nap only in long waits for a peer.
            if waited < ACTIVE_POLL {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Marks the job broken (MPI keeps buffers of `op`), once.
    fn break_job(&self, why: String) {
        self.job.set_broken(why);
    }

    fn run_locked(
        &self,
        st: &mut PlaceState,
        caller: &Caller<'_>,
        seq: u64,
        arrival: Arrival,
        op: &CollRef,
    ) -> Result<(), BackendError> {
        let rank = caller.rank;
        let n = self.group.len();
        let Some(me) = self.group.position(rank) else {
            return Err(BackendError::InvalidCollective {
                rank,
                op: Box::new(op.clone()),
                what: "this rank is not a member of the group".into(),
            });
        };
        if let Some(why) = self.job.broken.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Err(BackendError::Shutdown { rank, what: format!("{op}: not run: {why}") });
        }
        let parent = &self.job.parents[self.stream.index()];
        let world_ranks = self.group.ranks();
        let PlaceState { comm, header: mine, headers, from, ops, reqs } = st;

        // Step 1: agree.
        header(mine, seq, &arrival);
        headers.clear();
        headers.resize(HEADER * n, 0);
        headers[me * HEADER..(me + 1) * HEADER].copy_from_slice(mine);
        from.clear();
        // On the stream's world communicator, point to point: a member that never comes leaves
        // nothing blocked (making the group's communicator would block until every member came).
        let tag = self.tag;
        for q in (0..n).filter(|&q| q != me) {
            let peer = world_ranks[q];
            // SAFETY: `mine` and member q's slot of `headers` hold HEADER words each, live in
            // this place's state until the requests complete (a place whose requests never
            // complete is never reused: the job breaks), and nothing else touches them.
            unsafe {
                reqs.send(parent, mine.as_ptr().cast(), HEADER * 8, peer, tag)
                    .map_err(|e| device(rank, op, e))?;
                from.push(None);
                reqs.recv(parent, headers[q * HEADER..].as_mut_ptr().cast(), HEADER * 8, peer, tag)
                    .map_err(|e| device(rank, op, e))?;
                from.push(Some(peer));
            }
        }
        match self.wait(reqs, caller).map_err(|e| device(rank, op, e))? {
            Ok(()) => {}
            Err(stalled) => {
                let missing: Vec<usize> = reqs.pending().iter().filter_map(|&i| from[i]).collect();
                return Err(self.stalled(stalled, rank, op, Phase::Agreement { missing }));
            }
        }
        let failed: Vec<usize> =
            (0..n).filter(|&q| headers[q * HEADER] == FAILED).map(|q| self.group.ranks()[q]).collect();
        let post = match arrival {
            Arrival::Failed(cause) => {
                return Err(BackendError::Aborted {
                    rank,
                    op: Some(Box::new(op.clone())),
                    cause: Box::new(cause),
                })
            }
            Arrival::Ops(post) => post,
        };
        if !failed.is_empty() {
            return Err(BackendError::PeerFailed {
                rank,
                op: Box::new(op.clone()),
                missing: failed,
                reason: "they failed before this collective (an earlier failure on their stream)".into(),
            });
        }
        let h = |q: usize| &headers[q * HEADER..(q + 1) * HEADER];
        if let Some(q) = (0..n).find(|&q| h(q)[1..3] != h(0)[1..3] || h(q)[11] != h(0)[11]) {
            let r = self.group.ranks();
            return Err(BackendError::Mismatch {
                rank,
                op: Box::new(op.clone()),
                detail: format!(
                    "rank {} posted {}, rank {} posted {}",
                    r[0],
                    describe(h(0), &self.group),
                    r[q],
                    describe(h(q), &self.group)
                ),
            });
        }

        // Step 2: move data, on the group's communicator (the world's own for the world; made
        // now for a subgroup: every member agreed, so every member makes it now too).
        let comm = if world_ranks.iter().copied().eq(0..self.job.world) {
            parent
        } else {
            if comm.is_none() {
                *comm = Some(parent.subgroup(world_ranks, tag).map_err(|e| device(rank, op, e))?);
            }
            comm.as_ref().ok_or_else(|| BackendError::Internal { what: format!("{op}: no communicator") })?
        };
        ops.resize_with(ops.len().max(post.len()), OpScratch::default);
        for (o, s) in post.iter().zip(ops.iter_mut()) {
            // SAFETY: launch checked that `o`'s buffers hold what its description needs; the
            // stream thread keeps them (in the collective's `InFlight`) until this returns, and
            // a place whose requests do not complete breaks the job (module docs).
            unsafe { start_phase_one(comm, o, s, reqs, n, me) }
                .map_err(|e| self.failed_start(reqs, rank, op, e))?;
        }
        self.finish(reqs, caller, op)?;
        let mut again = false;
        for (o, s) in post.iter().zip(ops.iter_mut()) {
            guarded(caller, op, || reduce_phase(o, s, n, me, rank, op))?;
            if o.desc.kind == CollectiveKind::AllReduce {
                // SAFETY: as above; `s.reduced` and the counts live in this place's state.
                unsafe { start_all_reduce_gather(comm, o, s, reqs, n, me) }
                    .map_err(|e| device(rank, op, e))?;
                again = true;
            }
        }
        if again {
            self.finish(reqs, caller, op)?;
        }
        Ok(())
    }

    /// A call that could not start: with earlier requests of the collective still pending (MPI
    /// owns their buffers, and peers wait in them) the job breaks.
    fn failed_start(&self, reqs: &Requests, rank: usize, op: &CollRef, e: MpiError) -> BackendError {
        let err = device(rank, op, e);
        if !reqs.pending().is_empty() {
            self.break_job(err.to_string());
        }
        err
    }

    /// Waits for the data requests; a stall breaks the job.
    fn finish(&self, reqs: &mut Requests, caller: &Caller<'_>, op: &CollRef) -> Result<(), BackendError> {
        let rank = caller.rank;
        match self.wait(reqs, caller).map_err(|e| device(rank, op, e))? {
            Ok(()) => Ok(()),
            Err(stalled) => Err(self.stalled(stalled, rank, op, Phase::Data)),
        }
    }

    /// The error of a wait that stalled in `phase`, which breaks the job (MPI keeps the
    /// buffers).
    fn stalled(&self, stalled: Stalled, rank: usize, op: &CollRef, phase: Phase) -> BackendError {
        let err = match (stalled, phase) {
            (Stalled::Dead(dead), phase) => {
                let reason = match phase {
                    // A member that had posted its header may have left for a reason of its
                    // own (it gave up waiting for another): name the ones still absent too.
                    Phase::Agreement { missing } => {
                        let absent: Vec<usize> = missing.into_iter().filter(|r| !dead.contains(r)).collect();
                        if absent.is_empty() {
                            "their processes exited".into()
                        } else {
                            format!("their processes exited, and ranks {absent:?} had not launched it")
                        }
                    }
                    Phase::Data => "their processes exited while the data moved".into(),
                };
                BackendError::PeerFailed { rank, op: Box::new(op.clone()), missing: dead, reason }
            }
            (Stalled::Timeout(waited), Phase::Agreement { missing }) => {
                BackendError::PeerTimeout { rank, op: Box::new(op.clone()), missing, waited }
            }
            (Stalled::Timeout(waited), Phase::Data) => BackendError::Device {
                rank,
                api: "MPI_Testall",
                detail: format!(
                    "{op}: every member posted it, but its transfers did not complete within {waited:?} \
                     (a peer or the network stalled; raise COLLSCHED_TIMEOUT_SECS if merely slow)"
                ),
            },
        };
        self.break_job(err.to_string());
        err
    }
}

/// Starts the first (or only) MPI call of collective `o`.
///
/// # Safety
/// `o`'s buffers are valid for its description and untouched by anyone else until the
/// requests complete; `s` stays in place (not moved nor resized) until then.
unsafe fn start_phase_one(
    comm: &Comm,
    o: &OpPost,
    s: &mut OpScratch,
    reqs: &mut Requests,
    n: usize,
    me: usize,
) -> Result<(), MpiError> {
    let d = &o.desc;
    let es = d.elem.size();
    match d.kind {
        CollectiveKind::AllGather => {
            let bytes = d.count * es;
            let own = o.dst.0.wrapping_add(me * bytes);
            let send: *const u8 = if !o.src.0.is_null() && !std::ptr::eq(o.src.0, own) {
                o.src.0
            } else if let Some(p) = ffi::in_place() {
                p
            } else {
                // In place, on an MPI whose MPI_IN_PLACE is unknown: send a copy (MPI forbids a
                // send buffer inside the receive buffer).
                s.data.clear();
                // SAFETY: in place, this member's shard sits at `own` in its output (launch
                // checked the output holds `n * bytes`).
                s.data.extend_from_slice(unsafe { std::slice::from_raw_parts(own, bytes) });
                s.data.as_ptr()
            };
            // SAFETY: the caller's contract; `send` is the input, MPI_IN_PLACE or `s.data`.
            unsafe { reqs.all_gather(comm, send, ffi::count(bytes)?, o.dst.0) }
        }
        CollectiveKind::Broadcast => {
            let bytes = d.count * es;
            let root = d.group.position(d.root).unwrap_or(0);
            if root == me && !o.src.0.is_null() {
                // SAFETY: the root's input and output each hold `bytes` and are different
                // allocations (launch checks).
                unsafe { std::ptr::copy_nonoverlapping(o.src.0, o.dst.0, bytes) };
            }
            // SAFETY: the caller's contract.
            unsafe { reqs.broadcast(comm, o.dst.0, ffi::count(bytes)?, root) }
        }
        CollectiveKind::ReduceScatter => {
            let bytes = d.count * es;
            s.data.clear();
            s.data.resize(n * bytes, 0);
            // SAFETY: the input holds `n * bytes` (launch check); `s.data` as many.
            unsafe { reqs.all_to_all(comm, o.src.0, ffi::count(bytes)?, s.data.as_mut_ptr()) }
        }
        CollectiveKind::AllReduce => {
            let (lo, hi) = chunk(d.count, n, me);
            let mine = (hi - lo) * es;
            s.data.clear();
            s.data.resize(n * mine, 0);
            s.scounts.clear();
            s.sdispls.clear();
            s.rcounts.clear();
            s.rdispls.clear();
            for q in 0..n {
                let (a, b) = chunk(d.count, n, q);
                s.scounts.push(ffi::count((b - a) * es)?);
                s.sdispls.push(ffi::count(a * es)?);
                s.rcounts.push(ffi::count(mine)?);
                s.rdispls.push(ffi::count(q * mine)?);
            }
            // SAFETY: the input holds `count` elements, `s.data` `n` chunks of this member's
            // size; the count vectors live in `s` until completion.
            unsafe {
                reqs.all_to_all_v(
                    comm,
                    o.src.0,
                    &s.scounts,
                    &s.sdispls,
                    s.data.as_mut_ptr(),
                    &s.rcounts,
                    &s.rdispls,
                )
            }
        }
    }
}

/// After the first step's requests completed: the reductions, with the library's kernel.
fn reduce_phase(
    o: &OpPost,
    s: &mut OpScratch,
    n: usize,
    me: usize,
    rank: usize,
    op: &CollRef,
) -> Result<(), BackendError> {
    let d = &o.desc;
    let es = d.elem.size();
    let (out, len): (&mut [u8], usize) = match d.kind {
        CollectiveKind::ReduceScatter => {
            let bytes = d.count * es;
            // SAFETY: the output holds `count` elements (launch check) and is this member's
            // alone once the data moved.
            (unsafe { std::slice::from_raw_parts_mut(o.dst.0, bytes) }, bytes)
        }
        CollectiveKind::AllReduce => {
            let (lo, hi) = chunk(d.count, n, me);
            let bytes = (hi - lo) * es;
            s.reduced.clear();
            s.reduced.resize(bytes, 0);
            (&mut s.reduced[..], bytes)
        }
        CollectiveKind::AllGather | CollectiveKind::Broadcast => return Ok(()),
    };
    let inputs: smallvec::SmallVec<[&[u8]; 16]> = (0..n).map(|q| &s.data[q * len..(q + 1) * len]).collect();
    reduce(d.elem, d.op, d.scaling, out, &inputs).map_err(|source| BackendError::Kernel {
        rank,
        op: Box::new(op.clone()),
        source,
    })
}

/// All-reduce's second call: every member's reduced chunk into every output.
///
/// # Safety
/// As [`start_phase_one`].
unsafe fn start_all_reduce_gather(
    comm: &Comm,
    o: &OpPost,
    s: &mut OpScratch,
    reqs: &mut Requests,
    n: usize,
    me: usize,
) -> Result<(), MpiError> {
    let d = &o.desc;
    let es = d.elem.size();
    s.rcounts.clear();
    s.rdispls.clear();
    for q in 0..n {
        let (a, b) = chunk(d.count, n, q);
        s.rcounts.push(ffi::count((b - a) * es)?);
        s.rdispls.push(ffi::count(a * es)?);
    }
    // SAFETY: the caller's contract; `s.reduced` holds this member's chunk, the output `count`
    // elements, and they do not overlap.
    unsafe { reqs.all_gather_v(comm, s.reduced.as_ptr(), o.dst.0, &s.rcounts, &s.rdispls, me) }
}

impl Place for MpiPlace {
    fn run(&self, caller: &Caller<'_>, seq: u64, arrival: Arrival, op: &CollRef) -> Result<(), BackendError> {
        let open = self.job.open.read().unwrap_or_else(PoisonError::into_inner);
        if !*open {
            return Err(BackendError::Shutdown {
                rank: caller.rank,
                what: format!("{op}: the MPI job was closed (MpiJob dropped) before this collective ran"),
            });
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let result = self.run_locked(&mut st, caller, seq, arrival, op);
        drop(st);
        drop(open);
        result
    }
}
