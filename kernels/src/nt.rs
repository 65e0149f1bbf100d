//! `f32` reductions for large outputs on x86-64 with AVX2: the sums go from the registers
//! straight to memory with 32-byte streaming stores.
//!
//! The portable streaming path (`block::reduce_impl` with `stream`) reduces a block into a
//! buffer on the stack, then copies that buffer out with streaming stores. The copy is a burst
//! of stores with no loads between them, and the loads of the next block wait behind it: on
//! the 2-core Xeon these sessions run on, that path moved about a quarter less data per second
//! than a loop that interleaves each vector's loads, additions and streaming store, which is
//! what this module does (`collsched bench --op reduce_scatter` spends its time here).
//!
//! Every element goes through the same operations in the same order as in `block::pass`
//! (`0 + x_0/p + x_1/p + ...`, then `/q`), eight lanes at a time, so the results are the same
//! bits. Only the middle of the output that is 32-byte aligned takes the vector loop; the few
//! elements before and after it take the portable kernel with ordinary stores.

use core::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_div_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_stream_ps, _mm_sfence,
};
use core::ops::Range;

use crate::block::{self, DivBy, Divisor, Isa, MulBy, Ops, Raw, Scale, BLOCK, GROUP};
use crate::convert::F32Codec;

/// Bytes of one vector, the alignment `_mm256_stream_ps` needs.
const VECTOR: usize = 32;

/// `out = (sum_k inputs[k] / pre) / post` for `f32`, writing the output with streaming stores;
/// lengths already checked (every input as long as `out`, a whole number of elements), `inputs`
/// not empty, and `out` 4-byte aligned (else no element of it is 32-byte aligned: callers take
/// the portable path then). The caller's data is visible to other threads once this returns
/// (it ends with `sfence`).
pub(crate) fn reduce(isa: Isa, pre: Divisor, post: Divisor, out: &mut [u8], inputs: &[&[u8]]) {
    use Divisor::{Div, Mul};
    assert!(isa == Isa::Avx2, "nt::reduce needs Isa::Avx2");
    // SAFETY: `Isa::Avx2` exists only when the CPU has AVX2 (the `Isa` invariant).
    unsafe {
        match (pre, post) {
            (Mul(p), Mul(q)) => reduce_avx2(MulBy(p), MulBy(q), out, inputs),
            (Mul(p), Div(q)) => reduce_avx2(MulBy(p), DivBy(q), out, inputs),
            (Div(p), Mul(q)) => reduce_avx2(DivBy(p), MulBy(q), out, inputs),
            (Div(p), Div(q)) => reduce_avx2(DivBy(p), DivBy(q), out, inputs),
        }
    }
}

/// [`reduce`] with the divisors' cases as types.
#[target_feature(enable = "avx2")]
fn reduce_avx2<P: Scale, Q: Scale>(p: P, q: Q, out: &mut [u8], inputs: &[&[u8]]) {
    let ops = Ops { c: F32Codec, p, q };
    let n = out.len() / 4;
    // Elements before the first 32-byte boundary, then whole vectors, then the rest.
    let head = (out.as_ptr().align_offset(VECTOR) / 4).min(n);
    let end = head + (n - head) / 8 * 8;
    let mut acc = [0f32; BLOCK];
    portable(ops, inputs, 0..head, &mut acc, out);
    let mut start = head;
    while start < end {
        let stop = (start + BLOCK).min(end);
        block_nt(ops, inputs, start..stop, &mut acc[..stop - start], &mut out[4 * start..4 * stop]);
        start = stop;
    }
    portable(ops, inputs, end..n, &mut acc, out);
    _mm_sfence();
}

/// Elements `range` (fewer than a block) through the portable kernel, with ordinary stores.
#[inline(always)]
fn portable<P: Scale, Q: Scale>(
    ops: Ops<F32Codec, P, Q>,
    inputs: &[&[u8]],
    range: Range<usize>,
    acc: &mut [f32; BLOCK],
    out: &mut [u8],
) {
    let o = &mut <[u8; 4] as Raw>::view_mut(out)[range.clone()];
    block::reduce_block(ops, inputs, range.clone(), &mut acc[..range.len()], o);
}

/// Every pass over one block (elements `range`, a multiple of 8 of them; `out` is those
/// elements' bytes, 32-byte aligned): the passes before the last sum into `acc` as the
/// portable kernel does, the last one streams.
#[target_feature(enable = "avx2")]
fn block_nt<P: Scale, Q: Scale>(
    ops: Ops<F32Codec, P, Q>,
    inputs: &[&[u8]],
    range: Range<usize>,
    acc: &mut [f32],
    out: &mut [u8],
) {
    let k = inputs.len();
    if k <= GROUP {
        return last::<P, Q, true>(ops, inputs, 0, range, acc, out);
    }
    block::group_pass::<F32Codec, P, Q, GROUP, true, false>(ops, inputs, 0, range.clone(), acc, &mut []);
    let mut first = GROUP;
    while k - first > GROUP {
        block::group_pass::<F32Codec, P, Q, GROUP, false, false>(
            ops,
            inputs,
            first,
            range.clone(),
            acc,
            &mut [],
        );
        first += GROUP;
    }
    last::<P, Q, false>(ops, inputs, first, range, acc, out);
}

/// The last pass over the `inputs.len() - first` (1 to `GROUP`) remaining inputs.
#[target_feature(enable = "avx2")]
#[inline]
fn last<P: Scale, Q: Scale, const FIRST: bool>(
    ops: Ops<F32Codec, P, Q>,
    inputs: &[&[u8]],
    first: usize,
    range: Range<usize>,
    acc: &[f32],
    out: &mut [u8],
) {
    fn xs<const G: usize>(inputs: &[&[u8]], first: usize, bytes: &Range<usize>) -> [*const f32; G] {
        core::array::from_fn(|g| inputs[first + g][bytes.clone()].as_ptr().cast::<f32>())
    }
    let bytes = 4 * range.start..4 * range.end;
    let (p, q) = (ops.p, ops.q);
    match inputs.len() - first {
        1 => last_pass::<P, Q, 1, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        2 => last_pass::<P, Q, 2, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        3 => last_pass::<P, Q, 3, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
        _ => last_pass::<P, Q, GROUP, FIRST>(p, q, xs(inputs, first, &bytes), acc, out),
    }
}

/// `out[j] = q((FIRST ? 0 : acc[j]) + p(x_0[j]) + ... + p(x_{G-1}[j]))` for the `out.len() / 4`
/// elements of a block, eight at a time, with streaming stores. `out` is 32-byte aligned and
/// holds a multiple of 8 elements; each `xs[g]` points to as many elements (any alignment), and
/// `acc` holds at least as many unless `FIRST`.
#[target_feature(enable = "avx2")]
#[inline]
fn last_pass<P: Scale, Q: Scale, const G: usize, const FIRST: bool>(
    p: P,
    q: Q,
    xs: [*const f32; G],
    acc: &[f32],
    out: &mut [u8],
) {
    let m = out.len() / 4;
    let acc = if FIRST { acc } else { &acc[..m] };
    let dst = out.as_mut_ptr().cast::<f32>();
    // One vector's loads, sums and streaming store, at element `j` (`j + 8 <= m`).
    let one = |j: usize| {
        let mut a = if FIRST {
            _mm256_setzero_ps()
        } else {
            // SAFETY: `j + 8 <= m = acc.len()`; `loadu` needs no alignment.
            unsafe { _mm256_loadu_ps(acc.as_ptr().add(j)) }
        };
        for x in xs {
            // SAFETY: each input points to `m` elements (this function's contract) and
            // `j + 8 <= m`; `loadu` needs no alignment.
            let v = unsafe { _mm256_loadu_ps(x.add(j)) };
            a = _mm256_add_ps(a, scale(p, v));
        }
        // SAFETY: elements `j..j + 8` of `out` are in bounds (`j + 8 <= m`); `dst` is 32-byte
        // aligned (the contract) and `4j` is a multiple of 32, as `_mm256_stream_ps` requires.
        unsafe { _mm256_stream_ps(dst.add(j), scale(q, a)) };
    };
    let mut j = 0;
    // Two cache lines per round: the loop's own work is noise next to the memory traffic.
    while j + 32 <= m {
        one(j);
        one(j + 8);
        one(j + 16);
        one(j + 24);
        j += 32;
    }
    while j + 8 <= m {
        one(j);
        j += 8;
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
