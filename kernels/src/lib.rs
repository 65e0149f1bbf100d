//! Copy-in / copy-out, reductions and casts: how bytes are packed and reduced.
//!
//! Everything here works on dtype-erased byte buffers plus an [`ElemType`], because the
//! backends move untyped buffers. The CPU versions are always built; the CUDA C twins of the
//! same kernels live behind feature `cuda`.
//!
//! Semantics shared by CPU and CUDA versions:
//! - **copy-in** ([`copy_in`]) packs many sources (parameter shards) into one contiguous
//!   destination (a collective's send buffer) following a list of [`CopySegment`]s;
//! - **copy-out** ([`copy_out`]) unpacks one contiguous source (a gathered buffer) into many
//!   destinations (per-parameter memory);
//! - **reduce** ([`reduce`]) combines several inputs element-wise, accumulating in `f32`
//!   (in input order), applying a pre-divide to each input and a post-divide to the sum, and
//!   rounding once to the output type;
//! - **cast** ([`cast`]) converts between element types with round-to-nearest-even.
//!
//! The CPU kernels are single-threaded (the backend owns the threads), allocate nothing, take
//! byte buffers of any alignment, and process blocks of elements with fixed-width loops that
//! the compiler vectorizes; on x86-64 they also run an AVX2 build chosen at run time. They give
//! the same bits as the scalar reference (`reference`, hidden), NaN payloads aside.
//!
//! # Numerics (the contract every implementation keeps, CPU and CUDA)
//! - **Reduce**, per element: `acc = 0f32; for x in inputs (in order) { acc += f32(x) /
//!   pre_divide }; out = round(acc / post)` with `post = post_divide` (Sum) or `post_divide *
//!   n_inputs` computed in `f32` (Avg). Vectorized across elements, never across inputs.
//!   Division stays division, except by `±2^e` (`e` in `-126..=127`, 1 included), where
//!   `x * 2^-e` is the same correctly rounded value for every `x`.
//! - **Accumulate**: `acc = round(f32(acc) + f32(src))`; [`accumulate_cast`] does the same
//!   across two types. **Cast**: `f32 -> f32` is a byte copy; every other pair (also `f16 ->
//!   f16`) widens to `f32` and rounds; [`cast_or_copy`] copies bytes when the types agree.
//! - **Rounding**: to nearest, ties to even, once per output element. Subnormals are kept (no
//!   flush to zero); `|x| >= 65520` becomes `f16` infinity; `bf16` overflows to infinity as the
//!   rounding carries. `0 + (-0) = +0`.
//! - **NaN and infinities**: IEEE arithmetic in `f32`. A NaN stays a NaN through every
//!   conversion (widening sets the quiet bit; narrowing keeps the sign and the top payload bits
//!   and sets the quiet bit). Which payload a sum of two NaNs carries is not specified.
//! - **Copies**: every segment is checked before the first byte moves (a bad list copies
//!   nothing; errors name the segment index); overlapping segments: the later wins (the CUDA
//!   twins refuse segments that overlap in their destination: `cuda::device_segments`).
//! - **Alignment**: any; elements are read as `[u8; N]`, which compiles to unaligned vector
//!   loads. From 8 MiB of output on, x86-64 writes with streaming stores
//!   (no read for ownership of the destination); [`reduce_piece`] and [`copy_piece`] keep the
//!   whole output's choice when a caller splits one large output into pieces.
//! - **Instruction sets**: each kernel is compiled for the baseline target and, on x86-64, with
//!   AVX2 and F16C, chosen per call at run time; tests run every kernel under every instruction
//!   set the machine has against the scalar reference.
//!
//! Buffers are little-endian bytes. Typed slices (`f32`, [`half::f16`], [`half::bf16`]) pass
//! through `bytemuck` at no cost on little-endian hosts:
//! ```
//! use collsched_kernels::{reduce, ElemType, ReduceOp, Scaling};
//! use half::bf16;
//! let a = vec![bf16::from_f32(1.5); 5];
//! let b = vec![bf16::from_f32(2.0); 5];
//! let mut out = vec![bf16::ZERO; 5];
//! let inputs = [bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)];
//! reduce(ElemType::BF16, ReduceOp::Sum, Scaling::default(), bytemuck::cast_slice_mut(&mut out), &inputs)?;
//! assert_eq!(out, vec![bf16::from_f32(3.5); 5]);
//! # Ok::<(), collsched_kernels::KernelError>(())
//! ```

#![warn(missing_docs)]

mod arith;
mod block;
mod codec;
mod convert;
mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod elem;
#[cfg(target_arch = "x86_64")]
mod f16c;
mod mixed;
#[cfg(target_arch = "x86_64")]
mod nt;
#[doc(hidden)]
pub mod reference;
mod stream;
#[cfg(test)]
mod tests;

pub use arith::{accumulate, cast, reduce, reduce_in_place, reduce_piece};
pub use copy::{copy_in, copy_out, copy_piece, MEMCPY_PIECE_BYTES};
pub use elem::{CopySegment, ElemType, KernelError, ReduceOp, Scaling};
pub use mixed::{accumulate_cast, cast_or_copy, copy_in_cast};
