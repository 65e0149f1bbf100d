//! Scalar reference versions of the CPU kernels: the contract, one element at a time.
//!
//! The fast kernels of this crate are checked against these (bit for bit, NaN payloads aside),
//! and the benches compare against them. They share the argument checks and error values of
//! the fast versions. Not part of the supported API.

use half::{bf16, f16};

use crate::elem::{
    check_accumulate, check_cast, check_elem_size, check_reduce, check_segment, post_divisor, CopySegment,
    ElemType, KernelError, ReduceOp, Scaling,
};

/// Reference of [`crate::copy_in`].
///
/// # Errors
/// As [`crate::copy_in`].
pub fn copy_in(
    packed: &mut [u8],
    sources: &[&[u8]],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    check_elem_size("copy_in", elem_size)?;
    let lens: Vec<usize> = sources.iter().map(|b| b.len() / elem_size).collect();
    for (i, s) in segments.iter().enumerate() {
        check_segment("copy_in", i, s, lens.get(s.buffer).copied(), lens.len(), packed.len() / elem_size)?;
    }
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        packed[p..p + n].copy_from_slice(&sources[s.buffer][b..b + n]);
    }
    Ok(())
}

/// Reference of [`crate::copy_out`].
///
/// # Errors
/// As [`crate::copy_out`].
pub fn copy_out(
    destinations: &mut [&mut [u8]],
    packed: &[u8],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    check_elem_size("copy_out", elem_size)?;
    let lens: Vec<usize> = destinations.iter().map(|b| b.len() / elem_size).collect();
    for (i, s) in segments.iter().enumerate() {
        check_segment("copy_out", i, s, lens.get(s.buffer).copied(), lens.len(), packed.len() / elem_size)?;
    }
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        destinations[s.buffer][b..b + n].copy_from_slice(&packed[p..p + n]);
    }
    Ok(())
}

/// Element `i` of `bytes` as `f32`.
pub(crate) fn load(ty: ElemType, bytes: &[u8], i: usize) -> f32 {
    match ty {
        ElemType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap_or([0; 4])),
        ElemType::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        ElemType::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
    }
}

/// Stores `v` rounded to `ty` as element `i` of `bytes`.
pub(crate) fn store(ty: ElemType, bytes: &mut [u8], i: usize, v: f32) {
    match ty {
        ElemType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        ElemType::F16 => bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        ElemType::BF16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
    }
}

/// Reference of [`crate::reduce`].
///
/// # Errors
/// As [`crate::reduce`].
pub fn reduce(
    ty: ElemType,
    op: ReduceOp,
    scaling: Scaling,
    out: &mut [u8],
    inputs: &[&[u8]],
) -> Result<(), KernelError> {
    let n = check_reduce(ty, out, inputs)?;
    let post = post_divisor(op, scaling, inputs.len());
    for i in 0..n {
        let mut acc = 0.0f32;
        for inp in inputs {
            acc += load(ty, inp, i) / scaling.pre_divide;
        }
        store(ty, out, i, acc / post);
    }
    Ok(())
}

/// Reference of [`crate::accumulate`].
///
/// # Errors
/// As [`crate::accumulate`].
pub fn accumulate(ty: ElemType, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    let n = check_accumulate(ty, acc, src)?;
    for i in 0..n {
        let v = load(ty, acc, i) + load(ty, src, i);
        store(ty, acc, i, v);
    }
    Ok(())
}

/// Reference of [`crate::cast`].
///
/// # Errors
/// As [`crate::cast`].
pub fn cast(from: ElemType, src: &[u8], to: ElemType, dst: &mut [u8]) -> Result<(), KernelError> {
    let n = check_cast(from, src, to, dst)?;
    for i in 0..n {
        store(to, dst, i, load(from, src, i));
    }
    Ok(())
}
