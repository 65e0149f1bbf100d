//! Scalar reference versions of the CPU kernels (the contract; faster versions keep these
//! semantics).

use half::{bf16, f16};

/// Element types the kernels reduce and cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl ElemType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::F16 | ElemType::BF16 => 2,
        }
    }

    /// Lower-case name, as on the command line (`f32`, `f16`, `bf16`).
    pub const fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
        }
    }
}

/// One contiguous run of elements copied by [`copy_in`] or [`copy_out`].
///
/// Offsets and lengths count elements, not bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopySegment {
    /// Which of the many buffers (sources for copy-in, destinations for copy-out) this run
    /// belongs to.
    pub buffer: usize,
    /// Offset in that many-side buffer.
    pub buffer_offset: usize,
    /// Offset in the one contiguous (packed) buffer.
    pub packed_offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// How [`reduce`] combines its inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum of the inputs.
    Sum,
    /// Sum divided by the number of inputs.
    Avg,
}

/// Pre- and post-divide factors of a reduction (FSDP's gradient pre/post-divide).
///
/// The result is `(sum_i x_i / pre_divide) / post_divide` (and for [`ReduceOp::Avg`] further
/// divided by the number of inputs), computed in `f32`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scaling {
    /// Each input is divided by this before it is summed. Default 1.
    pub pre_divide: f32,
    /// The sum is divided by this. Default 1.
    pub post_divide: f32,
}

impl Default for Scaling {
    fn default() -> Self {
        Scaling { pre_divide: 1.0, post_divide: 1.0 }
    }
}

/// What a kernel refuses to do.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KernelError {
    /// A segment reaches past the end of a buffer.
    #[error("{kernel}: segment {segment} ({len} elements at {offset}) overruns the {side} buffer of {available} elements")]
    SegmentOutOfBounds {
        /// The kernel (`copy_in`, `copy_out`).
        kernel: &'static str,
        /// Index of the segment in the list.
        segment: usize,
        /// `packed` or `buffer N`.
        side: String,
        /// Segment start.
        offset: usize,
        /// Segment length.
        len: usize,
        /// Elements available in that buffer.
        available: usize,
    },
    /// A segment names a buffer that was not passed.
    #[error("{kernel}: segment {segment} names buffer {buffer}, but only {count} buffers were given")]
    NoSuchBuffer {
        /// The kernel.
        kernel: &'static str,
        /// Index of the segment in the list.
        segment: usize,
        /// The buffer it names.
        buffer: usize,
        /// How many buffers there are.
        count: usize,
    },
    /// Byte lengths that do not fit the element type or each other.
    #[error("{kernel}: {what}")]
    BadLength {
        /// The kernel.
        kernel: &'static str,
        /// What does not fit.
        what: String,
    },
}

fn check_len(kernel: &'static str, bytes: usize, ty: ElemType, what: &str) -> Result<usize, KernelError> {
    if !bytes.is_multiple_of(ty.size()) {
        return Err(KernelError::BadLength {
            kernel,
            what: format!("{what} has {bytes} bytes, not a multiple of {} ({})", ty.size(), ty.name()),
        });
    }
    Ok(bytes / ty.size())
}

fn check_segment(
    kernel: &'static str,
    i: usize,
    s: &CopySegment,
    many_lens: &[usize],
    packed_len: usize,
) -> Result<(), KernelError> {
    let Some(&avail) = many_lens.get(s.buffer) else {
        return Err(KernelError::NoSuchBuffer {
            kernel,
            segment: i,
            buffer: s.buffer,
            count: many_lens.len(),
        });
    };
    if s.buffer_offset.checked_add(s.len).is_none_or(|end| end > avail) {
        return Err(KernelError::SegmentOutOfBounds {
            kernel,
            segment: i,
            side: format!("buffer {}", s.buffer),
            offset: s.buffer_offset,
            len: s.len,
            available: avail,
        });
    }
    if s.packed_offset.checked_add(s.len).is_none_or(|end| end > packed_len) {
        return Err(KernelError::SegmentOutOfBounds {
            kernel,
            segment: i,
            side: "packed".into(),
            offset: s.packed_offset,
            len: s.len,
            available: packed_len,
        });
    }
    Ok(())
}

/// Packs runs of `sources` into `packed` (all-gather / reduce-scatter copy-in).
///
/// Buffers are bytes; `elem_size` is the element size in bytes that offsets are counted in.
///
/// # Errors
/// [`KernelError`] if a segment names a missing buffer or overruns one; nothing is copied then.
pub fn copy_in(
    packed: &mut [u8],
    sources: &[&[u8]],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    let lens: Vec<usize> = sources.iter().map(|b| b.len() / elem_size).collect();
    for (i, s) in segments.iter().enumerate() {
        check_segment("copy_in", i, s, &lens, packed.len() / elem_size)?;
    }
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        packed[p..p + n].copy_from_slice(&sources[s.buffer][b..b + n]);
    }
    Ok(())
}

/// Unpacks runs of `packed` into `destinations` (all-gather copy-out).
///
/// # Errors
/// [`KernelError`] if a segment names a missing buffer or overruns one; nothing is copied then.
pub fn copy_out(
    destinations: &mut [&mut [u8]],
    packed: &[u8],
    segments: &[CopySegment],
    elem_size: usize,
) -> Result<(), KernelError> {
    let lens: Vec<usize> = destinations.iter().map(|b| b.len() / elem_size).collect();
    for (i, s) in segments.iter().enumerate() {
        check_segment("copy_out", i, s, &lens, packed.len() / elem_size)?;
    }
    for s in segments {
        let (p, b, n) = (s.packed_offset * elem_size, s.buffer_offset * elem_size, s.len * elem_size);
        destinations[s.buffer][b..b + n].copy_from_slice(&packed[p..p + n]);
    }
    Ok(())
}

fn load(ty: ElemType, bytes: &[u8], i: usize) -> f32 {
    match ty {
        ElemType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap_or([0; 4])),
        ElemType::F16 => f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        ElemType::BF16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
    }
}

fn store(ty: ElemType, bytes: &mut [u8], i: usize, v: f32) {
    match ty {
        ElemType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        ElemType::F16 => bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
        ElemType::BF16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
    }
}

/// Reduces `inputs` element-wise into `out`, accumulating in `f32` in input order and rounding
/// once to `ty`.
///
/// `out` may not alias an input (Rust's borrows see to that); to reduce in place, pass the old
/// contents as one of the inputs from a copy, or use [`accumulate`].
///
/// # Errors
/// [`KernelError::BadLength`] if a buffer is not a whole number of elements, the inputs differ
/// in length from `out`, or there are no inputs.
pub fn reduce(
    ty: ElemType,
    op: ReduceOp,
    scaling: Scaling,
    out: &mut [u8],
    inputs: &[&[u8]],
) -> Result<(), KernelError> {
    let n = check_len("reduce", out.len(), ty, "the output")?;
    if inputs.is_empty() {
        return Err(KernelError::BadLength { kernel: "reduce", what: "no inputs".into() });
    }
    for (k, inp) in inputs.iter().enumerate() {
        if inp.len() != out.len() {
            return Err(KernelError::BadLength {
                kernel: "reduce",
                what: format!("input {k} has {} bytes, the output {}", inp.len(), out.len()),
            });
        }
    }
    let post = match op {
        ReduceOp::Sum => scaling.post_divide,
        ReduceOp::Avg => scaling.post_divide * inputs.len() as f32,
    };
    for i in 0..n {
        let mut acc = 0.0f32;
        for inp in inputs {
            acc += load(ty, inp, i) / scaling.pre_divide;
        }
        store(ty, out, i, acc / post);
    }
    Ok(())
}

/// Adds `src` into `acc` element-wise (`acc += src`), in `f32`, rounding once to `ty`: the
/// local gradient accumulation of `no_sync` steps.
///
/// # Errors
/// [`KernelError::BadLength`] if the lengths differ or are not whole elements.
pub fn accumulate(ty: ElemType, acc: &mut [u8], src: &[u8]) -> Result<(), KernelError> {
    let n = check_len("accumulate", acc.len(), ty, "the accumulator")?;
    if src.len() != acc.len() {
        return Err(KernelError::BadLength {
            kernel: "accumulate",
            what: format!("source has {} bytes, the accumulator {}", src.len(), acc.len()),
        });
    }
    for i in 0..n {
        let v = load(ty, acc, i) + load(ty, src, i);
        store(ty, acc, i, v);
    }
    Ok(())
}

/// Converts `src` of type `from` into `dst` of type `to` (round to nearest even).
///
/// # Errors
/// [`KernelError::BadLength`] if the element counts differ.
pub fn cast(from: ElemType, src: &[u8], to: ElemType, dst: &mut [u8]) -> Result<(), KernelError> {
    let n = check_len("cast", src.len(), from, "the source")?;
    let m = check_len("cast", dst.len(), to, "the destination")?;
    if n != m {
        return Err(KernelError::BadLength {
            kernel: "cast",
            what: format!("source has {n} elements, destination {m}"),
        });
    }
    for i in 0..n {
        store(to, dst, i, load(from, src, i));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reduce_avg_with_predivide() {
        let a = f32_bytes(&[1.0, 2.0, 3.0]);
        let b = f32_bytes(&[3.0, 4.0, 5.0]);
        let mut out = vec![0u8; a.len()];
        let s = Scaling { pre_divide: 2.0, post_divide: 1.0 };
        reduce(ElemType::F32, ReduceOp::Avg, s, &mut out, &[&a, &b]).unwrap();
        let want: Vec<f32> = (0..3)
            .map(|i| (load(ElemType::F32, &a, i) / 2.0 + load(ElemType::F32, &b, i) / 2.0) / 2.0)
            .collect();
        assert_eq!(out, f32_bytes(&want));
    }

    #[test]
    fn copy_in_rejects_overrun_without_copying() {
        let src = [1u8, 2, 3, 4];
        let mut packed = [0u8; 4];
        let segs = [
            CopySegment { buffer: 0, buffer_offset: 0, packed_offset: 0, len: 1 },
            CopySegment { buffer: 0, buffer_offset: 1, packed_offset: 1, len: 2 },
        ];
        let err = copy_in(&mut packed, &[&src], &segs, 2).unwrap_err();
        assert!(matches!(err, KernelError::SegmentOutOfBounds { segment: 1, .. }), "{err}");
        assert_eq!(packed, [0; 4]);
    }
}
