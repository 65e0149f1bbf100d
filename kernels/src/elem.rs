//! The kernels' vocabulary: element types, copy segments, reduction ops and scaling, errors,
//! and the argument checks every implementation (reference and fast) shares.

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

/// One contiguous run of elements copied by [`copy_in`](crate::copy_in) or [`copy_out`](crate::copy_out).
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

/// How [`reduce`](crate::reduce) combines its inputs.
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
    /// Two segments write the same destination elements: the CUDA kernels copy segments at
    /// once, so their result would be undefined (the CPU kernels' later-wins does not hold).
    #[error("{kernel}: segments {first} and {second} overlap in the destination ({side}); on a GPU the copies run at once, so give disjoint destination runs")]
    OverlappingDestinations {
        /// The kernel.
        kernel: &'static str,
        /// The earlier segment's index.
        first: usize,
        /// The later segment's index.
        second: usize,
        /// `packed`, or `buffer N`.
        side: String,
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

/// Element count of a byte buffer of type `ty`, or a [`KernelError::BadLength`] naming it.
pub(crate) fn check_len(
    kernel: &'static str,
    bytes: usize,
    ty: ElemType,
    what: &str,
) -> Result<usize, KernelError> {
    if !bytes.is_multiple_of(ty.size()) {
        return Err(KernelError::BadLength {
            kernel,
            what: format!("{what} has {bytes} bytes, not a multiple of {} ({})", ty.size(), ty.name()),
        });
    }
    Ok(bytes / ty.size())
}

/// Refuses an element size of zero (offsets are counted in elements of this size).
pub(crate) fn check_elem_size(kernel: &'static str, elem_size: usize) -> Result<(), KernelError> {
    if elem_size == 0 {
        return Err(KernelError::BadLength {
            kernel,
            what: "elem_size is 0; pass the element size in bytes (4 for f32, 2 for f16/bf16)".into(),
        });
    }
    Ok(())
}

/// Checks one segment against the many-side buffer it names (`avail` is that buffer's length
/// in elements, `None` if there is no such buffer among `count`) and the packed buffer.
pub(crate) fn check_segment(
    kernel: &'static str,
    i: usize,
    s: &CopySegment,
    avail: Option<usize>,
    count: usize,
    packed_len: usize,
) -> Result<(), KernelError> {
    let Some(avail) = avail else {
        return Err(KernelError::NoSuchBuffer { kernel, segment: i, buffer: s.buffer, count });
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

/// Checks the arguments of `reduce`; returns the element count.
pub(crate) fn check_reduce(ty: ElemType, out: &[u8], inputs: &[&[u8]]) -> Result<usize, KernelError> {
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
    Ok(n)
}

/// Checks the arguments of `reduce_in_place`; returns the element count.
pub(crate) fn check_reduce_in_place(
    ty: ElemType,
    inout: &[u8],
    others: &[&[u8]],
) -> Result<usize, KernelError> {
    let n = check_len("reduce_in_place", inout.len(), ty, "the in-out buffer (input 0)")?;
    for (k, inp) in others.iter().enumerate() {
        if inp.len() != inout.len() {
            return Err(KernelError::BadLength {
                kernel: "reduce_in_place",
                what: format!("input {} has {} bytes, the in-out buffer {}", k + 1, inp.len(), inout.len()),
            });
        }
    }
    Ok(n)
}

/// The divisor applied to the sum: `post_divide`, times the input count for an average.
pub(crate) fn post_divisor(op: ReduceOp, scaling: Scaling, n_inputs: usize) -> f32 {
    match op {
        ReduceOp::Sum => scaling.post_divide,
        ReduceOp::Avg => scaling.post_divide * n_inputs as f32,
    }
}

/// Checks the arguments of `accumulate`; returns the element count.
pub(crate) fn check_accumulate(ty: ElemType, acc: &[u8], src: &[u8]) -> Result<usize, KernelError> {
    let n = check_len("accumulate", acc.len(), ty, "the accumulator")?;
    if src.len() != acc.len() {
        return Err(KernelError::BadLength {
            kernel: "accumulate",
            what: format!("source has {} bytes, the accumulator {}", src.len(), acc.len()),
        });
    }
    Ok(n)
}

/// Checks the arguments of `cast`; returns the element count.
pub(crate) fn check_cast(from: ElemType, src: &[u8], to: ElemType, dst: &[u8]) -> Result<usize, KernelError> {
    let n = check_len("cast", src.len(), from, "the source")?;
    let m = check_len("cast", dst.len(), to, "the destination")?;
    if n != m {
        return Err(KernelError::BadLength {
            kernel: "cast",
            what: format!("source has {n} elements, destination {m}"),
        });
    }
    Ok(n)
}
