//! Branch-free conversions between `f32` and the 16-bit types, and the block codecs built on
//! them.
//!
//! Each conversion gives the same bits as the `half` crate's scalar conversion (which is what
//! the reference kernels use): round to nearest, ties to even; subnormals kept; a NaN stays a
//! NaN with its quiet bit set and its payload truncated. They are written as straight-line
//! integer and float operations with selects instead of branches, so that a loop over a block
//! of them vectorizes.

use crate::codec::Codec;

/// `2^-24`, the value of the lowest mantissa bit of an `f16` subnormal.
const F16_SUBNORMAL_STEP: f32 = f32::from_bits((127 - 24) << 23);
/// `0.5`: adding it to a value below `2^-14` rounds that value to a multiple of `2^-24`, the
/// `f16` subnormal step, with the hardware's round-to-nearest-even.
const F16_DENORM_MAGIC: f32 = f32::from_bits(((127 - 15) + (23 - 10) + 1) << 23);

// None of the float operations below sees a subnormal operand or produces a subnormal result:
// on x86 those take a microcode assist (around a hundred cycles each), and f16 gradients are
// often subnormal.

/// `f16` bits to `f32`, exactly.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let a = u32::from(h & 0x7FFF);
    // Normal: rebias the exponent (15 -> 127) and widen the mantissa.
    let norm = (a << 13) + ((127 - 15) << 23);
    // Zero and subnormal: the mantissa counts steps of 2^-24 (an exact integer conversion and an
    // exact product, both normal).
    let sub = (a as i32 as f32 * F16_SUBNORMAL_STEP).to_bits();
    // Infinity and NaN: all exponent bits set; a NaN also gets its quiet bit.
    let special = (a << 13) | 0x7F80_0000 | if (a as i32) > 0x7C00 { 0x0040_0000 } else { 0 };
    let u = if (a as i32) >= 0x7C00 {
        special
    } else if (a as i32) < 0x0400 {
        sub
    } else {
        norm
    };
    f32::from_bits(u | (u32::from(h & 0x8000) << 16))
}

/// `f32` to `f16` bits, rounding to nearest even; overflow gives infinity.
#[inline(always)]
pub(crate) fn f32_to_f16_bits(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7FFF_FFFF;
    // NaN: quiet, payload truncated to the top 9 bits below the quiet bit.
    let nan = 0x7E00 | ((a >> 13) & 0x03FF);
    // Subnormal or zero result (|f| < 2^-14): let the FPU round at the 2^-24 step. An `f32`
    // subnormal rounds to zero anyway; it is zeroed first so that the addition stays fast.
    let tiny = if (a as i32) < 0x0080_0000 { 0 } else { a };
    let sub = (f32::from_bits(tiny) + F16_DENORM_MAGIC).to_bits().wrapping_sub(F16_DENORM_MAGIC.to_bits());
    // Normal result: rebias the exponent, round to nearest even on the 13 dropped bits; a
    // carry out of the mantissa bumps the exponent, up to infinity (0x7C00) for |f| >= 65520.
    let odd = (a >> 13) & 1;
    let norm = a.wrapping_sub((127 - 15) << 23).wrapping_add(0x0FFF + odd) >> 13;
    // `a` fits in an i32: signed compares are one vector instruction, unsigned ones two.
    let ai = a as i32;
    let r = if ai > 0x7F80_0000 {
        nan
    } else if ai >= 0x4780_0000 {
        0x7C00
    } else if ai < 0x3880_0000 {
        sub
    } else {
        norm
    };
    (r | sign) as u16
}

/// `bf16` bits to `f32`: the top half of an `f32`; a NaN gets its quiet bit.
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(h: u16) -> f32 {
    let q = if h & 0x7FFF > 0x7F80 { 0x0040 } else { 0 };
    f32::from_bits(u32::from(h | q) << 16)
}

/// `f32` to `bf16` bits, rounding to nearest even; a NaN stays a NaN (quiet bit set).
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(f: f32) -> u16 {
    let x = f.to_bits();
    let nan = (x >> 16) | 0x0040;
    // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the
    // dropped half is above one half, or exactly one half and the kept part is odd.
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    // The magnitude fits in an i32: a signed compare is one vector instruction, unsigned two.
    let is_nan = (x & 0x7FFF_FFFF) as i32 > 0x7F80_0000;
    (if is_nan { nan } else { rounded }) as u16
}

/// Little-endian `f32` elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct F32Codec;

impl Codec for F32Codec {
    type Raw = [u8; 4];
    const FUSED_STORE: bool = true;

    #[inline(always)]
    fn load(self, r: [u8; 4]) -> f32 {
        f32::from_le_bytes(r)
    }

    #[inline(always)]
    fn store(self, v: f32) -> [u8; 4] {
        v.to_le_bytes()
    }
}

/// Little-endian `bf16` elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bf16Codec;

impl Codec for Bf16Codec {
    type Raw = [u8; 2];
    const FUSED_STORE: bool = false;

    #[inline(always)]
    fn load(self, r: [u8; 2]) -> f32 {
        bf16_bits_to_f32(u16::from_le_bytes(r))
    }

    #[inline(always)]
    fn load_operand(self, r: [u8; 2]) -> f32 {
        f32::from_bits(u32::from(u16::from_le_bytes(r)) << 16)
    }

    #[inline(always)]
    fn store(self, v: f32) -> [u8; 2] {
        f32_to_bf16_bits(v).to_le_bytes()
    }
}

/// Little-endian `f16` elements, converted in software (portable; vectorizes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct F16Codec;

impl Codec for F16Codec {
    type Raw = [u8; 2];
    const FUSED_STORE: bool = false;

    #[inline(always)]
    fn load(self, r: [u8; 2]) -> f32 {
        f16_bits_to_f32(u16::from_le_bytes(r))
    }

    #[inline(always)]
    fn store(self, v: f32) -> [u8; 2] {
        f32_to_f16_bits(v).to_le_bytes()
    }
}
