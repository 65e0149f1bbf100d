//! Copy-in and copy-out: batched segment copies between one packed buffer and many buffers.
//!
//! Every segment is checked before the first byte moves, so a bad list copies nothing. The
//! checks and the copies allocate nothing; each segment is one `copy_from_slice` (a `memcpy`).

use crate::elem::{check_elem_size, check_segment, CopySegment, KernelError};

/// Packs runs of `sources` into `packed` (all-gather / reduce-scatter copy-in).
///
/// Buffers are bytes; `elem_size` is the element size in bytes that offsets are counted in
/// (any alignment is fine). Segments are copied in list order, so if two overlap in `packed`
/// the later one wins. Allocates nothing.
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
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        packed[p..p + n].copy_from_slice(&sources[s.buffer][b..b + n]);
    }
    Ok(())
}

/// Unpacks runs of `packed` into `destinations` (all-gather copy-out).
///
/// Segments are copied in list order, so if two overlap in one destination the later one
/// wins. Allocates nothing.
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
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        destinations[s.buffer][b..b + n].copy_from_slice(&packed[p..p + n]);
    }
    Ok(())
}
