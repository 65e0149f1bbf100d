//! The data movement of a local collective once every member arrived: the copies and
//! reductions each member's stream thread does on the members' buffers, through raw pointers
//! the members posted. The rendezvous (`rendezvous.rs`) says when this may run; this module
//! says which bytes each member moves, and why that is sound (every byte written by exactly one
//! thread, inputs only read, buffers alive until every member departed).

use collsched_kernels::{copy_piece, reduce_piece};
use smallvec::SmallVec;

#[cfg(test)]
use crate::backend::CollDesc;
use crate::backend::{BackendError, CollRef, CollectiveKind};

/// A raw pointer into a rank's buffer, shared with the peers of one collective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawPtr(pub *mut u8);

// SAFETY: the pointer is only dereferenced under the protocol in the module docs: the memory it
// points to is owned by an `InFlight` (or a pool's pending list) until every member departed, and
// every byte is either only read by everyone or written by exactly one member.
unsafe impl Send for RawPtr {}
// SAFETY: as for `Send`; sharing the pointer value itself is harmless.
unsafe impl Sync for RawPtr {}

/// One collective of a member's post.
#[derive(Debug)]
pub(crate) struct OpPost {
    pub desc: crate::backend::CollDesc,
    /// The input, or null for in place.
    pub src: RawPtr,
    /// The output.
    pub dst: RawPtr,
    /// The output is the owner's private memory (outside every shared mapping): only its owner
    /// writes it, so peers do not take its reduction pieces, and it is null in their posts.
    pub private: bool,
}

/// Collectives of a group launch held inline (no heap allocation) by a [`Post`].
pub(crate) const POST_INLINE: usize = 4;

/// A member's post: its group launch (on the heap only beyond [`POST_INLINE`] collectives).
pub(crate) type Post = SmallVec<[OpPost; POST_INLINE]>;

/// Element range of chunk `q` of `count` elements split over `n` members (every backend's
/// all-reduce split).
pub(crate) fn chunk(count: usize, n: usize, q: usize) -> (usize, usize) {
    (q * count / n, (q + 1) * count / n)
}

/// Where member `q`'s all-gather shard (or broadcast data) is: its input, or in place in its
/// output.
fn shard_src(o: &OpPost, offset: usize) -> *const u8 {
    if o.src.0.is_null() {
        o.dst.0.wrapping_add(offset)
    } else {
        o.src.0
    }
}

/// Copies `bytes` from `src` to `dst` as one piece of an output of `whole` bytes: with
/// streaming stores when the output is big (`kernels::copy_piece`), which `memcpy` would not
/// choose for a shard of it (an all-gather at 8 ranks of 256 MiB copies 32 MiB pieces).
///
/// # Safety
/// Unless `bytes` is 0: `src` is readable and `dst` writable for `bytes`, the two ranges do not
/// overlap, and nobody writes `src` or touches `dst` during the call.
unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize, whole: usize) {
    if bytes == 0 {
        return;
    }
    // SAFETY: the caller's contract (non-null, in bounds, not overlapping, not shared mutably).
    let (d, s) =
        unsafe { (std::slice::from_raw_parts_mut(dst, bytes), std::slice::from_raw_parts(src, bytes)) };
    // The lengths are equal, the one thing `copy_piece` checks: it cannot fail here.
    let _ = copy_piece(d, s, whole);
}

/// First half of the copies: all-gather and broadcast entirely (the reductions are in
/// [`reduce_shared`]).
pub(crate) fn first_half(me: usize, posts: &[Post]) -> Result<(), BackendError> {
    for (i, mine) in posts[me].iter().enumerate() {
        let d = &mine.desc;
        let es = d.elem.size();
        match d.kind {
            CollectiveKind::AllGather if d.unpack.is_some() => {
                let Some(u) = d.unpack.as_deref() else { continue };
                let bytes = d.count * es;
                let whole = u.output_count() * es;
                for (q, post) in posts.iter().enumerate() {
                    let shard = shard_src(&post[i], q * bytes);
                    for s in u.member(q) {
                        let src = shard.wrapping_add((s.packed_offset - q * d.count) * es);
                        let dst = mine.dst.0.wrapping_add(s.buffer_offset * es);
                        // SAFETY: launch checked that our input holds `bytes` (an unpacking
                        // all-gather is never in place) and that our output holds the layout's
                        // `output_count`, every run of which ends within it; member q's run lies
                        // within its shard of `bytes` (`GatherUnpack::new` cuts runs at member
                        // boundaries), which is only read during the collective. Only we write
                        // our output; the buffers live until every member departed.
                        unsafe { copy_bytes(dst, src, s.len * es, whole) };
                    }
                }
            }
            CollectiveKind::AllGather => {
                let bytes = d.count * es;
                for (q, post) in posts.iter().enumerate() {
                    if q == me && (mine.src.0.is_null() || d.own_part_in_place) {
                        // Our part is in place already (launch checked the flag's use).
                        continue;
                    }
                    let src = shard_src(&post[i], q * bytes);
                    let dst = mine.dst.0.wrapping_add(q * bytes);
                    if q == me && std::ptr::eq(src, dst) {
                        // The input is this member's part of its own output: already in place.
                        continue;
                    }
                    // SAFETY: launch checked that member q's input holds `bytes` bytes (or its
                    // output `n * bytes`), and the posts matched (same count and type); this member's
                    // output holds `n * bytes`. Chunk q of our output is written only by us, and
                    // the source is only read during the collective (module docs, step 3). The
                    // buffers stay alive until every member departed (step 4).
                    unsafe { copy_bytes(dst, src, bytes, posts.len() * bytes) };
                }
            }
            // Shared between the members: `reduce_shared`.
            CollectiveKind::ReduceScatter | CollectiveKind::AllReduce => {}
            CollectiveKind::Broadcast => {
                let root = d.root;
                let bytes = d.count * es;
                let Some(rp) = d.group.position(root) else { continue };
                if rp == me {
                    if !mine.src.0.is_null() {
                        // SAFETY: our input and output each hold `bytes` (launch check), are
                        // different allocations, and peers read our input only.
                        unsafe { copy_bytes(mine.dst.0, mine.src.0, bytes, bytes) };
                    }
                } else {
                    let src = shard_src(&posts[rp][i], 0);
                    // SAFETY: the root's data (its input, or its output in place, which it does
                    // not write then) holds `bytes` and is only read; our output is ours alone.
                    unsafe { copy_bytes(mine.dst.0, src, bytes, bytes) };
                }
            }
        }
    }
    Ok(())
}

/// One piece of a reduction: elements `len` of collective `i`, from element `input` of every
/// member's input to element `output` of the owner's output.
struct Piece {
    i: usize,
    input: usize,
    output: usize,
    len: usize,
    /// Bytes of the owner's whole part of the reduction (the kernels choose streaming stores
    /// from it).
    whole: usize,
}

impl Piece {
    /// Piece `u` of member `q`'s part of the reductions in `post` (its post), in collective
    /// order, with pieces of `piece_bytes` of output, or `None` past the last one.
    fn find(post: &Post, n: usize, q: usize, piece_bytes: usize, mut u: usize) -> Option<Piece> {
        for (i, o) in post.iter().enumerate() {
            let d = &o.desc;
            // Member q's part: (first input element, first output element, elements).
            let (input, output, len) = match d.kind {
                CollectiveKind::ReduceScatter => (q * d.count, 0, d.count),
                CollectiveKind::AllReduce => {
                    let (lo, hi) = chunk(d.count, n, q);
                    (lo, lo, hi - lo)
                }
                CollectiveKind::AllGather | CollectiveKind::Broadcast => continue,
            };
            let per = (piece_bytes / d.elem.size()).max(1);
            let pieces = len.div_ceil(per);
            if u < pieces {
                let at = u * per;
                let len_here = per.min(len - at);
                return Some(Piece {
                    i,
                    input: input + at,
                    output: output + at,
                    len: len_here,
                    whole: len * d.elem.size(),
                });
            }
            u -= pieces;
        }
        None
    }
}

/// The reductions of a collective (reduce-scatter, and all-reduce's first half), shared between
/// the members' stream threads.
///
/// Member q's part of each reduction (its reduce-scatter output, or chunk q of the all-reduce) is
/// cut into pieces of `piece_bytes` ([`LocalConfig::piece_bytes`]) of output, handed out by q's
/// counter; whoever takes a piece reads that range of every member's input and writes it into q's
/// output. Each member takes its own pieces first, then helps the others in ring order: when the
/// members run at the same speed nobody helps, and when one is slower (descheduled, or on a busier
/// core) the others finish its pieces instead of waiting for it at the departure barrier. Every
/// piece is written by exactly one thread, and nobody reads a reduced output before the barrier
/// that follows.
pub(crate) fn reduce_shared(
    me: usize,
    posts: &[Post],
    next: &dyn Fn(usize) -> usize,
    piece_bytes: usize,
    rank: usize,
    op: &CollRef,
) -> Result<(), BackendError> {
    let n = posts.len();
    // Every piece's input slices, refilled per piece (on the heap beyond 16 ranks: once per
    // call, not per piece).
    let mut inputs: SmallVec<[&[u8]; 16]> = SmallVec::new();
    for k in 0..n {
        let q = (me + k) % n;
        if q != me && posts[q].iter().any(|o| o.private) {
            // Its output is only its own to write: it takes all its pieces itself.
            continue;
        }
        loop {
            let u = next(q);
            let Some(p) = Piece::find(&posts[q], n, q, piece_bytes, u) else { break };
            let d = &posts[q][p.i].desc;
            faults::piece(d, q, u);
            let es = d.elem.size();
            let bytes = p.len * es;
            inputs.clear();
            inputs.extend(posts.iter().enumerate().map(|(k, post)| match post[p.i].desc.own_chunk {
                // Member q's own chunk, where q said it is (a reduce-scatter's piece of q's
                // output lies in chunk q).
                Some(own) if k == q => {
                    let at = (p.input - q * d.count) * es;
                    // SAFETY: launch checked that the chunk holds `count` elements, and the
                    // piece lies within them; `OwnChunk::new`'s contract keeps them valid and
                    // unwritten until the collective completed. Only q's process reads it:
                    // across processes only q's own view of its post carries the chunk, and
                    // q's output goes as private there, so no peer takes its pieces.
                    unsafe { std::slice::from_raw_parts(own.ptr().add(at), bytes) }
                }
                // SAFETY: every member's input holds the collective's whole input (checked at
                // launch; the posts matched, so all have the same count and type) and the piece
                // lies within member q's part of it; inputs are only read during the collective.
                _ => unsafe { std::slice::from_raw_parts(post[p.i].src.0.add(p.input * es), bytes) },
            }));
            // SAFETY: member q's output holds its part (launch check); this piece of it is written
            // by this thread alone (we took it from q's counter, which hands each piece out once)
            // and read by nobody before the next barrier. Outputs are different allocations from
            // every input. The buffers stay alive until every member departed (step 4).
            let out =
                unsafe { std::slice::from_raw_parts_mut(posts[q][p.i].dst.0.add(p.output * es), bytes) };
            reduce_piece(d.elem, d.op, d.scaling, out, &inputs, p.whole)
                .map_err(|source| kernel_error(rank, op, source))?;
        }
    }
    Ok(())
}

/// Second half, after the middle barrier: all-reduce gathers the other members' reduced chunks.
pub(crate) fn second_half(me: usize, posts: &[Post]) -> Result<(), BackendError> {
    let n = posts.len();
    for (i, mine) in posts[me].iter().enumerate() {
        let d = &mine.desc;
        if d.kind != CollectiveKind::AllReduce {
            continue;
        }
        let es = d.elem.size();
        for (q, post) in posts.iter().enumerate() {
            if q == me {
                continue;
            }
            let (lo, hi) = chunk(d.count, n, q);
            // SAFETY: member q wrote chunk q of its output before the middle barrier and writes
            // nothing in this half; we write chunk q of our own output, which peers do not read
            // in this half (they read our chunk `me`). Both hold `count` elements.
            unsafe {
                copy_bytes(mine.dst.0.add(lo * es), post[i].dst.0.add(lo * es), (hi - lo) * es, d.count * es)
            };
        }
    }
    Ok(())
}

fn kernel_error(rank: usize, op: &CollRef, source: collsched_kernels::KernelError) -> BackendError {
    BackendError::Kernel { rank, op: Box::new(op.clone()), source }
}

/// Failures injected by unit tests (`rendezvous::tests`): a reduction tagged
/// [`faults::FAIL_TAG`] panics in piece 0 of member 0. Compiled to nothing outside tests.
mod faults {
    /// The tag of a collective whose first piece panics (tests only).
    #[cfg(test)]
    pub(crate) const FAIL_TAG: u64 = 0xFA11_0000_0000_FA11;

    #[cfg(test)]
    pub(super) fn piece(d: &super::CollDesc, q: usize, u: usize) {
        if d.tag == FAIL_TAG && q == 0 && u == 0 {
            panic!("injected failure in piece 0 of member 0");
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    pub(super) fn piece(_: &crate::backend::CollDesc, _: usize, _: usize) {}
}

#[cfg(test)]
pub(crate) use faults::FAIL_TAG;
