//! Reductions, accumulation and casts: argument checks, then the blocked kernels.

use crate::block::{accumulate_blocks, cast_blocks, reduce_blocks};
use crate::codec::{Codec, Divisor, Isa};
use crate::convert::{Bf16Codec, F16Codec, F32Codec};
use crate::elem::{
    check_accumulate, check_cast, check_reduce, check_reduce_in_place, post_divisor, ElemType, KernelError,
    ReduceOp, Scaling,
};
use crate::stream::STREAM_MIN_BYTES;

/// Reduces `inputs` element-wise into `out`, accumulating in `f32` in input order and rounding
/// once to `ty`.
///
/// For each element, `acc = 0f32; for x in inputs (in order): acc += (x as f32) / pre_divide;
/// out = round(acc / post)` where `post` is `post_divide` for [`ReduceOp::Sum`] and
/// `post_divide * inputs.len()` for [`ReduceOp::Avg`]; `round` is round-to-nearest-even into
/// `ty`. Buffers are little-endian bytes and need no alignment.
///
/// `out` may not alias an input (Rust's borrows see to that); to reduce in place, pass the old
/// contents as one of the inputs from a copy, or use [`accumulate`].
///
/// # Errors
/// [`KernelError::BadLength`] if a buffer is not a whole number of elements, the inputs differ
/// in length from `out`, or there are no inputs.
///
/// # Examples
/// ```
/// use collsched_kernels::{reduce, ElemType, ReduceOp, Scaling};
/// let a: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let b: Vec<u8> = [3.0f32, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let mut out = vec![0u8; 8];
/// reduce(ElemType::F32, ReduceOp::Avg, Scaling::default(), &mut out, &[&a, &b])?;
/// assert_eq!(out[4..], 4.0f32.to_le_bytes());
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn reduce(
    ty: ElemType,
    op: ReduceOp,
    scaling: Scaling,
    out: &mut [u8],
    inputs: &[&[u8]],
) -> Result<(), KernelError> {
    reduce_piece(ty, op, scaling, out, inputs, out.len())
}

/// One piece of a larger reduction: [`reduce`] on `out` and the same elements of every input,
/// with the choice of stores made for `whole_bytes`, the size of the whole output.
///
/// From 8 MiB of output on, [`reduce`] writes with streaming stores, which bypass the caches
/// (an output that large would not stay in them anyway, and reading it in first would cost a
/// third more memory traffic). A caller that splits one large reduction into pieces, to share
/// it between threads, passes the whole output's size so that every piece keeps that choice.
/// The results are the same bits either way.
///
/// # Errors
/// As [`reduce`].
pub fn reduce_piece(
    ty: ElemType,
    op: ReduceOp,
    scaling: Scaling,
    out: &mut [u8],
    inputs: &[&[u8]],
    whole_bytes: usize,
) -> Result<(), KernelError> {
    check_reduce(ty, out, inputs)?;
    let pre = Divisor::new(scaling.pre_divide);
    let post = Divisor::new(post_divisor(op, scaling, inputs.len()));
    let stream = whole_bytes.max(out.len()) >= STREAM_MIN_BYTES;
    reduce_with(Isa::detect(), ty, pre, post, false, out, inputs, stream);
    Ok(())
}

/// Reduces in place: like [`reduce`] with the old contents of `inout` as the first input and
/// `others` as the rest, writing the result over `inout` (an in-place reduce-scatter or
/// all-reduce needs no staging copy).
///
/// The result is bit for bit that of `reduce(ty, op, scaling, out, &[old inout, others..])`;
/// [`ReduceOp::Avg`] divides by `1 + others.len()`. `others` may be empty (then `inout` is
/// only scaled and rounded).
///
/// # Errors
/// [`KernelError::BadLength`] if `inout` is not a whole number of elements or an input differs
/// from it in length (input numbers count `inout` as input 0).
///
/// # Examples
/// ```
/// use collsched_kernels::{reduce_in_place, ElemType, ReduceOp, Scaling};
/// let mut mine: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// let peer: Vec<u8> = [3.0f32, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
/// reduce_in_place(ElemType::F32, ReduceOp::Sum, Scaling::default(), &mut mine, &[&peer])?;
/// assert_eq!(mine[4..], 8.0f32.to_le_bytes());
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn reduce_in_place(
    ty: ElemType,
    op: ReduceOp,
    scaling: Scaling,
    inout: &mut [u8],
    others: &[&[u8]],
) -> Result<(), KernelError> {
    check_reduce_in_place(ty, inout, others)?;
    let pre = Divisor::new(scaling.pre_divide);
    let post = Divisor::new(post_divisor(op, scaling, 1 + others.len()));
    reduce_with(Isa::detect(), ty, pre, post, true, inout, others, false);
    Ok(())
}

/// [`reduce`] (or, if `in_place`, [`reduce_in_place`]) after its checks, compiled for `isa`;
/// `stream` writes the output with streaming stores (out of place, and not on the F16C path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_with(
    isa: Isa,
    ty: ElemType,
    pre: Divisor,
    post: Divisor,
    in_place: bool,
    out: &mut [u8],
    inputs: &[&[u8]],
    stream: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if ty == ElemType::F16 && isa == Isa::Avx2 {
        return crate::block::reduce_f16c(isa, pre, post, in_place, out, inputs);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && stream && !in_place && crate::nt::takes(ty, out) {
        return crate::nt::reduce(isa, ty, pre, post, out, inputs);
    }
    match ty {
        ElemType::F32 => reduce_blocks(isa, F32Codec, pre, post, in_place, out, inputs, stream),
        ElemType::F16 => reduce_blocks(isa, F16Codec, pre, post, in_place, out, inputs, stream),
        ElemType::BF16 => reduce_blocks(isa, Bf16Codec, pre, post, in_place, out, inputs, stream),
    }
}

/// Adds `src` into `acc` element-wise (`acc += src`), in `f32`, rounding once to `ty`: the
/// local gradient accumulation of `no_sync` steps.
///
/// # Errors
/// [`KernelError::BadLength`] if the lengths differ or are not whole elements.
///
/// # Examples
/// ```
/// use collsched_kernels::{accumulate, ElemType};
/// let mut acc = half::bf16::from_f32(1.5).to_le_bytes();
/// accumulate(ElemType::BF16, &mut acc, &half::bf16::from_f32(2.0).to_le_bytes())?;
/// assert_eq!(half::bf16::from_le_bytes(acc).to_f32(), 3.5);
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn accumulate(ty: ElemType, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    check_accumulate(ty, acc, src)?;
    accumulate_with(Isa::detect(), ty, acc, src);
    Ok(())
}

/// [`accumulate`] after its checks, compiled for `isa`.
pub(crate) fn accumulate_with(isa: Isa, ty: ElemType, acc: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if ty == ElemType::F16 && isa == Isa::Avx2 {
        // SAFETY: `Isa::Avx2` exists only when the CPU has AVX2 and F16C (the `Isa` invariant).
        return unsafe { crate::f16c::accumulate(acc, src) };
    }
    match ty {
        ElemType::F32 => accumulate_blocks(isa, F32Codec, acc, src),
        ElemType::F16 => accumulate_blocks(isa, F16Codec, acc, src),
        ElemType::BF16 => accumulate_blocks(isa, Bf16Codec, acc, src),
    }
}

/// Converts `src` of type `from` into `dst` of type `to` (round to nearest even).
///
/// `f32` to `f32` is a plain copy; every other pair goes through `f32`, so a signalling NaN
/// in `f16` or `bf16` comes out quiet even when `from == to`.
///
/// # Errors
/// [`KernelError::BadLength`] if the element counts differ.
///
/// # Examples
/// ```
/// use collsched_kernels::{cast, ElemType};
/// let src = 1.0f32.to_le_bytes();
/// let mut dst = [0u8; 2];
/// cast(ElemType::F32, &src, ElemType::BF16, &mut dst)?;
/// assert_eq!(dst, half::bf16::ONE.to_le_bytes());
/// # Ok::<(), collsched_kernels::KernelError>(())
/// ```
pub fn cast(from: ElemType, src: &[u8], to: ElemType, dst: &mut [u8]) -> Result<(), KernelError> {
    check_cast(from, src, to, dst)?;
    cast_with(Isa::detect(), from, src, to, dst);
    Ok(())
}

/// [`cast`] after its checks, compiled for `isa`.
pub(crate) fn cast_with(isa: Isa, from: ElemType, src: &[u8], to: ElemType, dst: &mut [u8]) {
    fn to_any<F: Codec>(isa: Isa, f: F, src: &[u8], to: ElemType, dst: &mut [u8]) {
        match to {
            ElemType::F32 => cast_blocks(isa, f, src, F32Codec, dst),
            ElemType::F16 => cast_blocks(isa, f, src, F16Codec, dst),
            ElemType::BF16 => cast_blocks(isa, f, src, Bf16Codec, dst),
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && (from == ElemType::F16) != (to == ElemType::F16) {
        // SAFETY: `Isa::Avx2` exists only when the CPU has AVX2 and F16C (the `Isa` invariant).
        unsafe {
            match (from, to) {
                (ElemType::F16, ElemType::F32) => crate::f16c::cast_from(src, F32Codec, dst),
                (ElemType::F16, _) => crate::f16c::cast_from(src, Bf16Codec, dst),
                (ElemType::F32, _) => crate::f16c::cast_to(F32Codec, src, dst),
                _ => crate::f16c::cast_to(Bf16Codec, src, dst),
            }
        }
        return;
    }
    match from {
        ElemType::F32 if to == ElemType::F32 => dst.copy_from_slice(src),
        ElemType::F32 => to_any(isa, F32Codec, src, to, dst),
        ElemType::F16 => to_any(isa, F16Codec, src, to, dst),
        ElemType::BF16 => to_any(isa, Bf16Codec, src, to, dst),
    }
}
