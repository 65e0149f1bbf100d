//! Kernels between two element types: a gradient in the parameters' dtype packed into, or
//! accumulated in, a buffer of the reduction dtype (mixed-precision gradient reduction).

use crate::arith::{accumulate, cast};
use crate::copy::copy_in;
use crate::elem::{check_len, CopySegment, ElemType, KernelError};

/// Elements per block of [`accumulate_cast`]'s stack scratch.
const BLOCK: usize = 1024;

/// `dst` (in `dst_elem`) = `src` (in `src_elem`): a byte copy when the types agree (payloads
/// kept), else [`cast`] (round to nearest even).
///
/// # Errors
/// [`KernelError::BadLength`] if the element counts differ.
pub fn cast_or_copy(
    src_elem: ElemType,
    src: &[u8],
    dst_elem: ElemType,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    if src_elem == dst_elem && src.len() == dst.len() {
        dst.copy_from_slice(src);
        return Ok(());
    }
    cast(src_elem, src, dst_elem, dst)
}

/// Copy-in with a cast: the runs `segs` of the single source `src` (in `src_elem`) into
/// `packed` (in `packed_elem`). [`copy_in`] when the types agree; else one cast per run,
/// checked like `copy_in` (nothing is written if a run overruns).
///
/// # Errors
/// As [`copy_in`] with one source buffer.
pub fn copy_in_cast(
    packed: &mut [u8],
    packed_elem: ElemType,
    src: &[u8],
    src_elem: ElemType,
    segs: &[CopySegment],
) -> Result<(), KernelError> {
    if packed_elem == src_elem {
        return copy_in(packed, &[src], segs, src_elem.size());
    }
    let (ps, ss) = (packed_elem.size(), src_elem.size());
    let oob = |segment: usize, s: &CopySegment, side: &str, offset: usize, available: usize| {
        KernelError::SegmentOutOfBounds {
            kernel: "copy_in",
            segment,
            side: side.to_string(),
            offset,
            len: s.len,
            available,
        }
    };
    for (i, s) in segs.iter().enumerate() {
        if s.buffer != 0 {
            return Err(KernelError::NoSuchBuffer {
                kernel: "copy_in",
                segment: i,
                buffer: s.buffer,
                count: 1,
            });
        }
        if s.buffer_offset.checked_add(s.len).is_none_or(|end| end > src.len() / ss) {
            return Err(oob(i, s, "buffer 0", s.buffer_offset, src.len() / ss));
        }
        if s.packed_offset.checked_add(s.len).is_none_or(|end| end > packed.len() / ps) {
            return Err(oob(i, s, "packed", s.packed_offset, packed.len() / ps));
        }
    }
    for s in segs {
        let from = &src[s.buffer_offset * ss..(s.buffer_offset + s.len) * ss];
        cast(src_elem, from, packed_elem, &mut packed[s.packed_offset * ps..(s.packed_offset + s.len) * ps])?;
    }
    Ok(())
}

/// Accumulation across types: `acc` (in `acc_elem`) += `src` (in `src_elem`), each sum
/// computed in `f32` and rounded once to `acc_elem` ([`accumulate`] when the types agree).
/// Works through two blocks of `f32` scratch on the stack: allocates nothing.
///
/// # Errors
/// [`KernelError::BadLength`] if a length is not whole elements or the counts differ.
pub fn accumulate_cast(
    acc_elem: ElemType,
    acc: &mut [u8],
    src_elem: ElemType,
    src: &[u8],
) -> Result<(), KernelError> {
    if acc_elem == src_elem {
        return accumulate(acc_elem, acc, src);
    }
    let n = check_len("accumulate", acc.len(), acc_elem, "acc")?;
    let m = check_len("accumulate", src.len(), src_elem, "src")?;
    if n != m {
        return Err(KernelError::BadLength {
            kernel: "accumulate",
            what: format!("acc has {n} elements ({}), src {m} ({})", acc_elem.name(), src_elem.name()),
        });
    }
    let (aes, ses) = (acc_elem.size(), src_elem.size());
    let mut wide_acc = [0f32; BLOCK];
    let mut wide_src = [0f32; BLOCK];
    for start in (0..n).step_by(BLOCK) {
        let len = BLOCK.min(n - start);
        let a = &mut acc[start * aes..(start + len) * aes];
        let s = &src[start * ses..(start + len) * ses];
        let wa = bytemuck::cast_slice_mut(&mut wide_acc[..len]);
        cast(acc_elem, a, ElemType::F32, wa)?;
        let ws = bytemuck::cast_slice_mut(&mut wide_src[..len]);
        cast(src_elem, s, ElemType::F32, ws)?;
        accumulate(
            ElemType::F32,
            bytemuck::cast_slice_mut(&mut wide_acc[..len]),
            bytemuck::cast_slice(&wide_src[..len]),
        )?;
        cast(ElemType::F32, bytemuck::cast_slice(&wide_acc[..len]), acc_elem, a)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Against a scalar sum computed here with `half` (widen, add in f32, round once), over
    /// more than one block.
    #[test]
    fn accumulate_cast_sums_in_f32_and_rounds_once() {
        let n = 2 * BLOCK + 37;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
        let s: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.3).collect();
        // bf16 accumulator, f32 source.
        let mut acc: Vec<u8> = a.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
        accumulate_cast(ElemType::BF16, &mut acc, ElemType::F32, &f32_bytes(&s)).expect("sizes agree");
        assert_eq!(acc.len(), n * 2);
        for i in 0..n {
            let want = bf16::from_f32(bf16::from_f32(a[i]).to_f32() + s[i]);
            let got = bf16::from_le_bytes([acc[2 * i], acc[2 * i + 1]]);
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
        }
        // f32 accumulator, f16 source.
        let mut acc = f32_bytes(&a);
        let src: Vec<u8> = s.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect();
        accumulate_cast(ElemType::F32, &mut acc, ElemType::F16, &src).expect("sizes agree");
        for i in 0..n {
            let want = a[i] + f16::from_f32(s[i]).to_f32();
            let got = f32::from_le_bytes(acc[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
        }
    }

    #[test]
    fn accumulate_cast_refuses_a_length_mismatch() {
        let mut acc = vec![0u8; 8];
        let e = accumulate_cast(ElemType::BF16, &mut acc, ElemType::F32, &[0u8; 12]).unwrap_err();
        assert!(e.to_string().contains("4 elements"), "{e}");
        assert_eq!(acc, vec![0u8; 8], "nothing written");
    }

    #[test]
    fn copy_in_cast_casts_each_run_and_checks_first() {
        let src = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
        let mut packed = vec![0u8; 4 * 2];
        let segs = [
            CopySegment { buffer: 0, buffer_offset: 2, packed_offset: 0, len: 2 },
            CopySegment { buffer: 0, buffer_offset: 0, packed_offset: 2, len: 2 },
        ];
        copy_in_cast(&mut packed, ElemType::BF16, &src, ElemType::F32, &segs).expect("in bounds");
        let got: Vec<f32> =
            packed.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
        assert_eq!(got, vec![3.0, 4.0, 1.0, 2.0]);
        let bad = [segs[0], CopySegment { buffer: 0, buffer_offset: 3, packed_offset: 0, len: 2 }];
        let mut untouched = vec![0u8; 8];
        assert!(copy_in_cast(&mut untouched, ElemType::BF16, &src, ElemType::F32, &bad).is_err());
        assert_eq!(untouched, vec![0u8; 8], "a bad list writes nothing");
    }
}
