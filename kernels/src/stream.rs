//! Copies with non-temporal (streaming) stores, for buffers much larger than the caches.
//!
//! A normal store first reads the destination's cache line from memory (read for ownership);
//! a streaming store writes the line without reading it and without evicting useful data, so
//! a large copy moves two bytes of memory traffic per byte instead of three. `memcpy` does the
//! same above a size threshold; the batched segment copies decide once per call, from the
//! total size, because their segments are individually small.

/// Total bytes of a copy-in / copy-out at and above which segments are copied with streaming
/// stores: well above what the L2 of one core holds, so the destination would not be reused
/// from the cache anyway.
pub(crate) const STREAM_MIN_BYTES: usize = 8 << 20;

/// Copies `src` into `dst` (equal lengths). With `stream`, bypasses the caches where the
/// target supports it (x86-64: SSE2 `movntdq`, 16 bytes at a time on the 16-byte-aligned
/// middle of `dst`); the caller calls [`fence`] before anyone else reads `dst`.
#[inline]
pub(crate) fn copy(dst: &mut [u8], src: &[u8], stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && dst.len() >= 256 {
        use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let n = dst.len();
        let src = &src[..n];
        let head = dst.as_ptr().align_offset(16).min(n);
        let body = (n - head) / 16 * 16;
        dst[..head].copy_from_slice(&src[..head]);
        let mut i = head;
        while i < head + body {
            // SAFETY: `i + 16 <= head + body <= n`, so both 16-byte ranges are in bounds;
            // `dst + i` is 16-byte aligned (`head` aligns it and `i - head` is a multiple of
            // 16), as `_mm_stream_si128` requires; `loadu` needs no alignment. SSE2 is part
            // of the x86-64 baseline.
            unsafe {
                let v = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm_stream_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), v);
            }
            i += 16;
        }
        dst[i..].copy_from_slice(&src[i..]);
        return;
    }
    let _ = stream;
    dst.copy_from_slice(src);
}

/// Orders earlier streaming stores before every later store (x86-64 `sfence`), so that the
/// data is visible to whoever is signalled after the kernel returns.
#[inline]
pub(crate) fn fence(stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: `sfence` needs SSE, which is part of the x86-64 baseline.
        unsafe { core::arch::x86_64::_mm_sfence() };
    }
    let _ = stream;
}
