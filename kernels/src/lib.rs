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
