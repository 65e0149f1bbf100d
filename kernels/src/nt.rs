//! `f32` and `bf16` reductions for large outputs on x86-64 with AVX2: the sums go from the
//! registers straight to memory with streaming stores.
//!
//! The portable streaming path (`block::reduce_impl` with `stream`) reduces a block into a
//! buffer on the stack, then copies that buffer out with streaming stores. The copy is a burst
//! of stores with no loads between them, and the loads of the next block wait behind it: on
//! a 2-core Xeon (105 MiB L3), that path moved about a quarter less data per second
//! than a loop that interleaves each vector's loads, additions and streaming store, which is
//! what this module does (`collsched bench --op reduce_scatter` spends its time here).
//!
//! Every element goes through the same operations in the same order as in `block::pass`
//! (`0 + x_0/p + x_1/p + ...`, then `/q`, then the codec's rounding), eight lanes at a time, so
//! the results are the same bits. Only the middle of the output that is aligned to eight
//! elements takes the vector loop; the few elements before and after it take the portable
//! kernel with ordinary stores. (`f16` has its own F16C kernel, `f16c.rs`.)

use core::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmpgt_epi32, _mm256_div_ps, _mm256_loadu_ps,
    _mm256_loadu_si256, _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32, _mm256_permute2f128_ps,
    _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_srli_epi32,
    _mm256_stream_ps, _mm256_stream_si256, _mm256_unpackhi_epi16, _mm256_unpacklo_epi16, _mm_sfence,
};
use core::ops::Range;

use crate::block::{self, Ops};
use crate::codec::{with_scales, Codec, Divisor, Isa, Raw, Scale, BLOCK, GROUP};
use crate::convert::{Bf16Codec, F32Codec};

/// Sixteen elements of a type as two vectors of `f32` lanes: widened, rounded back, and the
/// matching `f32` accumulators.
///
/// The lanes need not be in element order (for `bf16` they are not, which saves a shuffle per
/// vector), but loads, accumulators and stores agree on it, so element `i` of the output is
/// computed from element `i` of every input.
///
/// # Safety
/// Implementations need AVX2 and nothing more, and give the same bits as the type's [`Codec`]
/// (`load_operand` and `store`).
unsafe trait Lanes: Codec {
    /// Bytes of one element.
    const SIZE: usize;
    /// Widens the sixteen elements at `src` (any alignment).
    ///
    /// # Safety
    /// AVX2; `16 * SIZE` bytes readable at `src`.
    unsafe fn load16(src: *const u8) -> [__m256; 2];
    /// Loads sixteen `f32` accumulators at `acc` (any alignment) in the lane order of `load16`.
    ///
    /// # Safety
    /// AVX2; sixteen `f32` readable at `acc`.
    unsafe fn load_acc16(acc: *const f32) -> [__m256; 2];
    /// Rounds the lanes to the type and writes them to `dst` with streaming stores.
    ///
    /// # Safety
    /// AVX2; `16 * SIZE` bytes writable at `dst`, which is 32-byte aligned.
    unsafe fn stream16(dst: *mut u8, v: [__m256; 2]);
}

// SAFETY: the bits are the `f32`'s own both ways, as with `F32Codec`, in element order; AVX only.
unsafe impl Lanes for F32Codec {
    const SIZE: usize = 4;

    #[inline(always)]
    unsafe fn load16(src: *const u8) -> [__m256; 2] {
        // SAFETY: 64 bytes readable (the caller's contract); `loadu` needs no alignment.
        unsafe { [_mm256_loadu_ps(src.cast::<f32>()), _mm256_loadu_ps(src.add(32).cast::<f32>())] }
    }

    #[inline(always)]
    unsafe fn load_acc16(acc: *const f32) -> [__m256; 2] {
        // SAFETY: as `load16`.
        unsafe { Self::load16(acc.cast::<u8>()) }
    }

    #[inline(always)]
    unsafe fn stream16(dst: *mut u8, v: [__m256; 2]) {
        // SAFETY: 64 bytes writable at a 32-byte-aligned `dst` (the caller's contract).
        unsafe {
            _mm256_stream_ps(dst.cast::<f32>(), v[0]);
            _mm256_stream_ps(dst.add(32).cast::<f32>(), v[1]);
        }
    }
}

// SAFETY: `load16` is `Bf16Codec::load_operand` (each element's bits become the top half of an
// `f32`, a signalling NaN left as it is) and `stream16` is `convert::f32_to_bf16_bits` lane by
// lane (round to nearest even by adding 0x7FFF plus the lowest kept bit; a NaN keeps its top
// half with the quiet bit set). Lane order, within each 128-bit half: the interleave puts
// elements 0-3 and 8-11 in the first vector and 4-7 and 12-15 in the second, and the final
// pack interleaves them back the same way; `load_acc16` moves the accumulators to match.
unsafe impl Lanes for Bf16Codec {
    const SIZE: usize = 2;

    #[inline(always)]
    unsafe fn load16(src: *const u8) -> [__m256; 2] {
        // SAFETY: 32 bytes readable (the caller's contract); `loadu` needs no alignment; the
        // rest is register arithmetic, AVX2 (the caller's contract).
        unsafe {
            let h = _mm256_loadu_si256(src.cast::<__m256i>());
            let zero = _mm256_setzero_si256();
            [
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h)),
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h)),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_acc16(acc: *const f32) -> [__m256; 2] {
        // SAFETY: sixteen `f32` readable (the caller's contract); `loadu` needs no alignment;
        // the rest is register arithmetic, AVX2.
        unsafe {
            let (lo, hi) = (_mm256_loadu_ps(acc), _mm256_loadu_ps(acc.add(8)));
            // Elements 0-3 with 8-11, and 4-7 with 12-15 (see the lane order above).
            [_mm256_permute2f128_ps::<0x20>(lo, hi), _mm256_permute2f128_ps::<0x31>(lo, hi)]
        }
    }

    #[inline(always)]
    unsafe fn stream16(dst: *mut u8, v: [__m256; 2]) {
        /// `f32_to_bf16_bits` on eight lanes, each result in the low half of its lane.
        #[inline(always)]
        unsafe fn round(v: __m256) -> __m256i {
            // SAFETY: register arithmetic needing AVX2 (the caller's contract).
            unsafe {
                let x = _mm256_castps_si256(v);
                let hi = _mm256_srli_epi32::<16>(x);
                let nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
                let bias =
                    _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
                let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
                let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
                let is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F80_0000));
                _mm256_blendv_epi8(rounded, nan, is_nan)
            }
        }
        // SAFETY: register arithmetic needing AVX2 (the caller's contract), then 32 bytes
        // written to a 32-byte-aligned `dst` (the caller's contract), as `_mm256_stream_si256`
        // requires. Every lane is below 2^16, so the pack's signed saturation never saturates.
        unsafe {
            let packed = _mm256_packus_epi32(round(v[0]), round(v[1]));
            _mm256_stream_si256(dst.cast::<__m256i>(), packed);
        }
    }
}

/// Whether [`reduce`] takes elements of `ty` at `out` (else callers take the portable path):
/// `f32` and `bf16` whose output is aligned to the element (else no element of it is aligned
/// to eight).
pub(crate) fn takes(ty: crate::ElemType, out: &[u8]) -> bool {
    let size = ty.size();
    matches!(ty, crate::ElemType::F32 | crate::ElemType::BF16) && out.as_ptr().align_offset(size) == 0
}

/// `out = round((sum_k inputs[k] / pre) / post)` for `ty`, writing the output with streaming
/// stores; [`takes`] holds, lengths already checked (every input as long as `out`, a whole
/// number of elements) and `inputs` is not empty. The data is visible to other threads once
/// this returns (it ends with `sfence`).
pub(crate) fn reduce(
    isa: Isa,
    ty: crate::ElemType,
    pre: Divisor,
    post: Divisor,
    out: &mut [u8],
    inputs: &[&[u8]],
) {
    assert!(isa == Isa::Avx2, "nt::reduce needs Isa::Avx2");
    if ty == crate::ElemType::F32 {
        with_scales(F32Codec, pre, post, out, inputs);
    } else {
        with_scales(Bf16Codec, pre, post, out, inputs);
    }
}

/// [`reduce`] for codec `c`, with the divisors' cases as types.
fn with_scales<L: Lanes>(c: L, pre: Divisor, post: Divisor, out: &mut [u8], inputs: &[&[u8]]) {
    // SAFETY: only called from `reduce`, which checked for `Isa::Avx2`, which exists only when
    // the CPU has AVX2 (the `Isa` invariant).
    unsafe { with_scales!(pre, post, |p, q| reduce_avx2(Ops { c, p, q }, out, inputs)) }
}

/// [`reduce`] with the element type and the divisors' cases as types.
#[target_feature(enable = "avx2")]
fn reduce_avx2<L: Lanes, P: Scale, Q: Scale>(ops: Ops<L, P, Q>, out: &mut [u8], inputs: &[&[u8]]) {
    let n = out.len() / L::SIZE;
    // Elements before the first 32-byte boundary, then groups of sixteen, then the rest.
    let head = (out.as_ptr().align_offset(32) / L::SIZE).min(n);
    let end = head + (n - head) / 16 * 16;
    let mut acc = [0f32; BLOCK];
    portable(ops, inputs, 0..head, &mut acc, out);
    let mut start = head;
    while start < end {
        let stop = (start + BLOCK).min(end);
        block_nt(
            ops,
            inputs,
            start..stop,
            &mut acc[..stop - start],
            &mut out[L::SIZE * start..L::SIZE * stop],
        );
        start = stop;
    }
    portable(ops, inputs, end..n, &mut acc, out);
    _mm_sfence();
}

/// Elements `range` (fewer than a block) through the portable kernel, with ordinary stores.
#[inline(always)]
fn portable<L: Lanes, P: Scale, Q: Scale>(
    ops: Ops<L, P, Q>,
    inputs: &[&[u8]],
    range: Range<usize>,
    acc: &mut [f32; BLOCK],
    out: &mut [u8],
) {
    let o = &mut L::Raw::view_mut(out)[range.clone()];
    block::reduce_block(ops, inputs, range.clone(), &mut acc[..range.len()], o);
}

/// Every pass over one block (elements `range`, a multiple of 8 of them; `out` is those
/// elements' bytes, 32-byte aligned): the passes before the last sum into `acc` as the
/// portable kernel does, the last one streams.
#[target_feature(enable = "avx2")]
fn block_nt<L: Lanes, P: Scale, Q: Scale>(
    ops: Ops<L, P, Q>,
    inputs: &[&[u8]],
    range: Range<usize>,
    acc: &mut [f32],
    out: &mut [u8],
) {
    let k = inputs.len();
    if k <= GROUP {
        return last::<L, P, Q, true>(ops, inputs, 0, range, acc, out);
    }
    block::group_pass::<L, P, Q, GROUP, true, false>(ops, inputs, 0, range.clone(), acc, &mut []);
    let mut first = GROUP;
    while k - first > GROUP {
        block::group_pass::<L, P, Q, GROUP, false, false>(ops, inputs, first, range.clone(), acc, &mut []);
        first += GROUP;
    }
    last::<L, P, Q, false>(ops, inputs, first, range, acc, out);
}

/// The last pass over the `inputs.len() - first` (1 to `GROUP`) remaining inputs.
#[target_feature(enable = "avx2")]
#[inline]
fn last<L: Lanes, P: Scale, Q: Scale, const FIRST: bool>(
    ops: Ops<L, P, Q>,
    inputs: &[&[u8]],
    first: usize,
    range: Range<usize>,
    acc: &[f32],
    out: &mut [u8],
) {
    fn xs<const G: usize>(inputs: &[&[u8]], first: usize, bytes: &Range<usize>) -> [*const u8; G] {
        core::array::from_fn(|g| inputs[first + g][bytes.clone()].as_ptr())
    }
    let bytes = L::SIZE * range.start..L::SIZE * range.end;
    let (p, q) = (ops.p, ops.q);
    match inputs.len() - first {
        1 => last_pass::<L, P, Q, 1, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        2 => last_pass::<L, P, Q, 2, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        3 => last_pass::<L, P, Q, 3, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        _ => last_pass::<L, P, Q, GROUP, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
    }
}

/// `out[j] = round(q((FIRST ? 0 : acc[j]) + p(x_0[j]) + ... + p(x_{G-1}[j])))` for the elements
/// of a block (`out.len() / L::SIZE` of them, a multiple of 16), sixteen at a time, with
/// streaming stores. `out` is 32-byte aligned; each `xs[g]` points to as many elements (any
/// alignment), and `acc` holds at least as many unless `FIRST`.
#[target_feature(enable = "avx2")]
#[inline]
fn last_pass<L: Lanes, P: Scale, Q: Scale, const G: usize, const FIRST: bool>(
    p: P,
    q: Q,
    xs: [*const u8; G],
    acc: &[f32],
    out: &mut [u8],
) {
    let m = out.len() / L::SIZE;
    let acc = if FIRST { acc } else { &acc[..m] };
    let dst = out.as_mut_ptr();
    // Sixteen elements' loads, sums and streaming stores, at element `j` (`j + 16 <= m`).
    let sixteen = |j: usize| {
        let mut a = if FIRST {
            [_mm256_setzero_ps(); 2]
        } else {
            // SAFETY: `j + 16 <= m = acc.len()`; this function has AVX2.
            unsafe { L::load_acc16(acc.as_ptr().add(j)) }
        };
        for x in xs {
            // SAFETY: each input points to `m` elements (this function's contract) and
            // `j + 16 <= m`; this function has AVX2.
            let v = unsafe { L::load16(x.add(j * L::SIZE)) };
            a = [_mm256_add_ps(a[0], scale(p, v[0])), _mm256_add_ps(a[1], scale(p, v[1]))];
        }
        // SAFETY: elements `j..j + 16` of `out` are in bounds (`j + 16 <= m`); `dst` is 32-byte
        // aligned (the contract) and so is element `j`, a multiple of 16 (of at least 2 bytes);
        // AVX2.
        unsafe { L::stream16(dst.add(j * L::SIZE), [scale(q, a[0]), scale(q, a[1])]) };
    };
    let mut j = 0;
    // Two cache lines of `f32` per round: the loop's own work is noise next to the memory traffic.
    while j + 32 <= m {
        sixteen(j);
        sixteen(j + 16);
        j += 32;
    }
    if j + 16 <= m {
        sixteen(j);
    }
}

/// `x / d` on eight lanes: the vector form of `S::apply`.
#[target_feature(enable = "avx2")]
#[inline]
fn scale<S: Scale>(s: S, x: __m256) -> __m256 {
    let d = _mm256_set1_ps(s.factor());
    if S::MULTIPLY {
        _mm256_mul_ps(x, d)
    } else {
        _mm256_div_ps(x, d)
    }
}
