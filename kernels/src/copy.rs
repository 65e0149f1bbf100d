//! Copy-in and copy-out: batched segment copies between one packed buffer and many buffers.
//!
//! Every segment is checked before the first byte moves, so a bad list copies nothing. The
//! checks and the copies allocate nothing; each segment is one `copy_from_slice` (a `memcpy`),
//! or, when the packed buffer has at least `STREAM_MIN_BYTES` (8 MiB), a copy with streaming
//! stores (see `stream`): the segments of a big bucket are small, so `memcpy`'s own size
//! threshold for streaming would never trigger.

use crate::elem::{check_elem_size, check_segment, CopySegment, KernelError};
use crate::stream::{self, STREAM_MIN_BYTES};

/// Copies `src` into `dst` (equal lengths), one piece of a larger copy of `whole_bytes` bytes
/// in all: from 8 MiB of the whole on, with streaming stores (x86-64), as [`copy_in`] and
/// [`copy_out`] do. `memcpy` streams only the copies that are large by themselves (glibc:
/// above about 3/4 of the last-level cache); a collective that fills one big output from many
/// smaller pieces (an all-gather's shards) passes the output's size here instead. A piece of
/// [`MEMCPY_PIECE_BYTES`] or more is left to `memcpy`, whose own streaming loop for copies that
/// large is faster than ours.
///
/// # Errors
/// [`KernelError::BadLength`] if the lengths differ; nothing is copied then.
///
/// # Examples
/// ```
/// let src = vec![7u8; 1000];
/// let mut dst = vec![0u8; 4000];
/// collsched_kernels::copy_piece(&mut dst[1000..2000], &src, 64 << 20)?;
/// assert!(dst[1000..2000].iter().all(|&b| b == 7));
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn copy_piece(dst: &mut [u8], src: &[u8], whole_bytes: usize) -> Result<(), KernelError> {
    if dst.len() != src.len() {
        return Err(KernelError::BadLength {
            kernel: "copy_piece",
            what: format!("the destination has {} bytes and the source {}", dst.len(), src.len()),
        });
    }
    let stream = whole_bytes.max(dst.len()) >= STREAM_MIN_BYTES && dst.len() < MEMCPY_PIECE_BYTES;
    stream::copy(dst, src, stream);
    stream::fence(stream);
    Ok(())
}

/// Pieces of [`copy_piece`] from this size on go to `memcpy` (64 MiB). Measured on a 2-core
/// Xeon with 105 MiB of L3, per thread: a 128 MiB copy 9.2-10.3 GB/s with glibc's
/// `memcpy` (which streams it) against 8.6-9.3 with our AVX2 loop; 32 MiB pieces 5.0-5.5 with
/// `memcpy` (not streamed: read for ownership) against 6.5-7.7 with ours. A machine whose
/// `memcpy` streams only larger copies loses some of that gain on pieces of 64 MiB and more.
pub const MEMCPY_PIECE_BYTES: usize = 64 << 20;

/// Packs runs of `sources` into `packed` (all-gather / reduce-scatter copy-in).
///
/// Buffers are bytes; `elem_size` is the element size in bytes that offsets are counted in
/// (any alignment is fine). Segments are copied in list order, so if two overlap in `packed`
/// the later one wins. Allocates nothing. From 8 MiB of `packed` on, x86-64 uses streaming
/// (cache-bypassing) stores.
///
/// # Errors
/// [`KernelError`] if a segment names a missing buffer or overruns one, or `elem_size` is 0;
/// nothing is copied then.
///
/// # Examples
/// ```
/// use collsched_kernels::{copy_in, CopySegment};
/// let (a, b) = ([1u8, 2, 3, 4], [5u8, 6]);
/// let mut packed = [0u8; 4];
/// let segs = [
///     CopySegment { buffer: 1, buffer_offset: 0, packed_offset: 0, len: 1 },
///     CopySegment { buffer: 0, buffer_offset: 1, packed_offset: 1, len: 1 },
/// ];
/// copy_in(&mut packed, &[&a, &b], &segs, 2)?;
/// assert_eq!(packed, [5, 6, 3, 4]);
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn copy_in(
    packed: &mut [u8],
    sources: &[&[u8]],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    check_elem_size("copy_in", elem_size)?;
    let packed_len = packed.len() / elem_size;
    for (i, s) in segments.iter().enumerate() {
        let avail = sources.get(s.buffer).map(|b| b.len() / elem_size);
        check_segment("copy_in", i, s, avail, sources.len(), packed_len)?;
    }
    let stream = packed.len() >= STREAM_MIN_BYTES;
    copy_in_unchecked(packed, sources, segments, elem_size, stream);
    Ok(())
}

/// Unpacks runs of `packed` into `destinations` (all-gather copy-out).
///
/// Segments are copied in list order, so if two overlap in one destination the later one
/// wins. Allocates nothing. From 8 MiB of `packed` on, x86-64 uses streaming (cache-bypassing)
/// stores.
///
/// # Errors
/// [`KernelError`] if a segment names a missing buffer or overruns one, or `elem_size` is 0;
/// nothing is copied then.
///
/// # Examples
/// ```
/// use collsched_kernels::{copy_out, CopySegment};
/// let packed = [1u8, 2, 3, 4];
/// let (mut a, mut b) = ([0u8; 2], [0u8; 2]);
/// let segs = [
///     CopySegment { buffer: 0, buffer_offset: 0, packed_offset: 1, len: 1 },
///     CopySegment { buffer: 1, buffer_offset: 0, packed_offset: 0, len: 1 },
/// ];
/// copy_out(&mut [&mut a, &mut b], &packed, &segs, 2)?;
/// assert_eq!((a, b), ([3, 4], [1, 2]));
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn copy_out(
    destinations: &mut [&mut [u8]],
    packed: &[u8],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    check_elem_size("copy_out", elem_size)?;
    let packed_len = packed.len() / elem_size;
    for (i, s) in segments.iter().enumerate() {
        let avail = destinations.get(s.buffer).map(|b| b.len() / elem_size);
        check_segment("copy_out", i, s, avail, destinations.len(), packed_len)?;
    }
    let stream = packed.len() >= STREAM_MIN_BYTES;
    copy_out_unchecked(destinations, packed, segments, elem_size, stream);
    Ok(())
}

/// The copies of [`copy_in`] after its checks; `stream` selects streaming stores.
pub(crate) fn copy_in_unchecked(
    packed: &mut [u8],
    sources: &[&[u8]],
    segments: &[CopySegment],
    elem_size: usize,
    stream: bool,
) {
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        stream::copy(&mut packed[p..p + n], &sources[s.buffer][b..b + n], stream);
    }
    stream::fence(stream);
}

/// The copies of [`copy_out`] after its checks; `stream` selects streaming stores.
pub(crate) fn copy_out_unchecked(
    destinations: &mut [&mut [u8]],
    packed: &[u8],
    segments: &[CopySegment],
    elem_size: usize,
    stream: bool,
) {
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        stream::copy(&mut destinations[s.buffer][b..b + n], &packed[p..p + n], stream);
    }
    stream::fence(stream);
}
