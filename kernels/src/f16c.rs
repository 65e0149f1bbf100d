//! `f16` kernels for x86-64 CPUs with F16C: the conversions are single instructions
//! (`vcvtph2ps`, `vcvtps2ph` with round-to-nearest-even), eight elements at a time.
//!
//! The portable `f16` conversion (in `convert`) takes some twenty vector operations per eight
//! elements; with F16C the `f16` kernels run as fast as the `bf16` ones. Blocks are widened into
//! an `f32` array on the stack, combined there in input order, and narrowed back; results are
//! the same bits as the reference's (`half` itself uses these instructions when it can). Every
//! function here requires AVX2 and F16C: callers check [`crate::codec::Isa::Avx2`].

use core::arch::x86_64::{
    __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps, _mm_loadu_si128,
    _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};

use crate::codec::{Codec, Raw, Scale, BLOCK};
use crate::convert::{f16_bits_to_f32, f32_to_f16_bits};

/// Widens `dst.len()` `f16` elements from the bytes `src` (exactly twice as long, any
/// alignment).
#[target_feature(enable = "avx2,f16c")]
fn widen(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let src = &src[..2 * n];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: bytes `2i..2i + 16` of `src` are in bounds (`2(i + 8) <= 2n = src.len()`);
        // `loadu` has no alignment requirement.
        let h = unsafe { _mm_loadu_si128(src.as_ptr().add(2 * i).cast::<__m128i>()) };
        // SAFETY: elements `i..i + 8` of `dst` are in bounds; `storeu` needs no alignment.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h)) };
        i += 8;
    }
    for (d, s) in dst[i..].iter_mut().zip(src[2 * i..].as_chunks::<2>().0) {
        *d = f16_bits_to_f32(u16::from_le_bytes(*s));
    }
}

/// Narrows `src` to `f16` (round to nearest even) into the bytes `dst` (exactly twice as long
/// as `src`, any alignment).
#[target_feature(enable = "avx2,f16c")]
fn narrow(src: &[f32], dst: &mut [u8]) {
    let n = src.len();
    let dst = &mut dst[..2 * n];
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements `i..i + 8` of `src` are in bounds; `loadu` needs no alignment.
        let f = unsafe { _mm256_loadu_ps(src.as_ptr().add(i)) };
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
        // SAFETY: bytes `2i..2i + 16` of `dst` are in bounds; `storeu` needs no alignment.
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast::<__m128i>(), h) };
        i += 8;
    }
    for (d, s) in dst[2 * i..].as_chunks_mut::<2>().0.iter_mut().zip(&src[i..]) {
        *d = f32_to_f16_bits(*s).to_le_bytes();
    }
}

/// `out = round((sum_k inputs[k] / p) / q)` for `f16`, where the inputs are the old contents of
/// `out` followed by `others` if `in_place`, else `others`; lengths already checked.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn reduce<P: Scale, Q: Scale>(p: P, q: Q, in_place: bool, out: &mut [u8], others: &[&[u8]]) {
    let mut acc = [0f32; BLOCK];
    let mut x = [0f32; BLOCK];
    for (b, o) in out.chunks_mut(2 * BLOCK).enumerate() {
        let m = o.len() / 2;
        let (acc, x) = (&mut acc[..m], &mut x[..m]);
        let range = 2 * BLOCK * b..2 * BLOCK * b + o.len();
        let own = if in_place { Some(&*o) } else { None };
        for (k, inp) in own.into_iter().chain(others.iter().map(|i| &i[range.clone()])).enumerate() {
            widen(inp, x);
            if k == 0 {
                acc.iter_mut().zip(&*x).for_each(|(a, x)| *a = 0.0 + p.apply(*x));
            } else {
                acc.iter_mut().zip(&*x).for_each(|(a, x)| *a += p.apply(*x));
            }
        }
        acc.iter_mut().for_each(|a| *a = q.apply(*a));
        narrow(acc, o);
    }
}

/// `acc = round(acc + src)` for `f16`; lengths already checked.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn accumulate(acc: &mut [u8], src: &[u8]) {
    let mut a = [0f32; BLOCK];
    let mut x = [0f32; BLOCK];
    for (ab, sb) in acc.chunks_mut(2 * BLOCK).zip(src.chunks(2 * BLOCK)) {
        let m = ab.len() / 2;
        let (a, x) = (&mut a[..m], &mut x[..m]);
        widen(ab, a);
        widen(sb, x);
        a.iter_mut().zip(&*x).for_each(|(a, x)| *a += *x);
        narrow(a, ab);
    }
}

/// `f16` to another type; element counts already checked.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn cast_from<T: Codec>(src: &[u8], to: T, dst: &mut [u8]) {
    let mut x = [0f32; BLOCK];
    let dst = T::Raw::view_mut(dst);
    for (sb, db) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(BLOCK)) {
        let x = &mut x[..db.len()];
        widen(sb, x);
        db.iter_mut().zip(&*x).for_each(|(d, x)| *d = to.store(*x));
    }
}

/// Another type to `f16`; element counts already checked.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn cast_to<F: Codec>(from: F, src: &[u8], dst: &mut [u8]) {
    let mut x = [0f32; BLOCK];
    let src = F::Raw::view(src);
    for (sb, db) in src.chunks(BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
        let x = &mut x[..sb.len()];
        x.iter_mut().zip(sb).for_each(|(x, s)| *x = from.load(*s));
        narrow(x, db);
    }
}
