//! Blocked kernels: the loops of reduce, accumulate and cast, generic over the element codec.
//!
//! A buffer is processed in blocks of [`BLOCK`] elements. Each block of each input is decoded
//! into an `f32` array on the stack, combined element by element with fixed-length loops (which
//! the compiler vectorizes across elements), and encoded back. The accumulation over inputs
//! stays in input order for every element, so the results equal the scalar reference's. The
//! last, partial block goes through a zero-padded stack copy, so byte buffers of any length and
//! any alignment take the same path.
//!
//! Each kernel is compiled twice (see [`Isa`]): for the baseline target and, on x86-64, with
//! AVX2 enabled, chosen at run time.

/// Elements per block: small enough that a block of every operand stays in L1, large enough
/// that the per-block overhead (one pass over the input list) is noise.
pub(crate) const BLOCK: usize = 512;

/// Bytes of the widest element (`f32`): the size of the padded tail buffer.
const MAX_ELEM_BYTES: usize = 4;

/// An element type's conversion of whole blocks between little-endian bytes and `f32`.
pub(crate) trait Codec: Copy {
    /// Bytes per element.
    const SIZE: usize;
    /// Decodes `BLOCK` elements from `src` (exactly `BLOCK * SIZE` bytes, any alignment).
    fn decode(self, src: &[u8], dst: &mut [f32; BLOCK]);
    /// Encodes `BLOCK` elements into `dst` (exactly `BLOCK * SIZE` bytes, any alignment).
    fn encode(self, src: &[f32; BLOCK], dst: &mut [u8]);
}

/// Decodes a full or partial block (a partial one is zero-padded; the padding is discarded).
#[inline(always)]
fn decode_any<C: Codec>(c: C, src: &[u8], dst: &mut [f32; BLOCK]) {
    if src.len() == BLOCK * C::SIZE {
        c.decode(src, dst);
    } else {
        let mut pad = [0u8; BLOCK * MAX_ELEM_BYTES];
        pad[..src.len()].copy_from_slice(src);
        c.decode(&pad[..BLOCK * C::SIZE], dst);
    }
}

/// Encodes a full or partial block (only `dst.len()` bytes are written).
#[inline(always)]
fn encode_any<C: Codec>(c: C, src: &[f32; BLOCK], dst: &mut [u8]) {
    if dst.len() == BLOCK * C::SIZE {
        c.encode(src, dst);
    } else {
        let mut pad = [0u8; BLOCK * MAX_ELEM_BYTES];
        c.encode(src, &mut pad[..BLOCK * C::SIZE]);
        let n = dst.len();
        dst.copy_from_slice(&pad[..n]);
    }
}

/// Division by a fixed `f32`, as cheap as bit-exactness allows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Divisor {
    /// Dividing by 1 is the identity (IEEE division by 1 is exact).
    One,
    /// Divisor `±2^e` with `e` in `-126..=127`: its reciprocal `±2^-e` is exact, and then
    /// `x * (1/d)` and `x / d` are both the correctly rounded value of the same real number,
    /// for every `x` (zeros, infinities, subnormal results and NaN included): the same bits.
    Mul(f32),
    /// Any other divisor: a real division, as the reference does.
    Div(f32),
}

impl Divisor {
    /// The cheapest exact form of division by `d`.
    pub(crate) fn new(d: f32) -> Divisor {
        if d == 1.0 {
            Divisor::One
        } else if d.is_normal() && d.to_bits() & 0x007F_FFFF == 0 {
            Divisor::Mul(1.0 / d)
        } else {
            Divisor::Div(d)
        }
    }
}

/// `acc = 0 + x / d`, element-wise (the `0 +` turns `-0` into `+0`, as the reference does).
#[inline(always)]
fn set_scaled(acc: &mut [f32; BLOCK], x: &[f32; BLOCK], d: Divisor) {
    match d {
        Divisor::One => acc.iter_mut().zip(x).for_each(|(a, x)| *a = 0.0 + *x),
        Divisor::Mul(r) => acc.iter_mut().zip(x).for_each(|(a, x)| *a = 0.0 + *x * r),
        Divisor::Div(q) => acc.iter_mut().zip(x).for_each(|(a, x)| *a = 0.0 + *x / q),
    }
}

/// `acc += x / d`, element-wise.
#[inline(always)]
fn add_scaled(acc: &mut [f32; BLOCK], x: &[f32; BLOCK], d: Divisor) {
    match d {
        Divisor::One => acc.iter_mut().zip(x).for_each(|(a, x)| *a += *x),
        Divisor::Mul(r) => acc.iter_mut().zip(x).for_each(|(a, x)| *a += *x * r),
        Divisor::Div(q) => acc.iter_mut().zip(x).for_each(|(a, x)| *a += *x / q),
    }
}

/// `acc /= d`, element-wise.
#[inline(always)]
fn divide(acc: &mut [f32; BLOCK], d: Divisor) {
    match d {
        Divisor::One => {}
        Divisor::Mul(r) => acc.iter_mut().for_each(|a| *a *= r),
        Divisor::Div(q) => acc.iter_mut().for_each(|a| *a /= q),
    }
}

/// `out = round((sum_k inputs[k] / pre) / post)`; lengths already checked (all equal to
/// `out.len()`, a whole number of elements) and `inputs` is not empty.
#[inline(always)]
fn reduce_impl<C: Codec>(c: C, pre: Divisor, post: Divisor, out: &mut [u8], inputs: &[&[u8]]) {
    let mut acc = [0f32; BLOCK];
    let mut x = [0f32; BLOCK];
    let mut start = 0;
    for o in out.chunks_mut(BLOCK * C::SIZE) {
        let end = start + o.len();
        let mut first = true;
        for inp in inputs {
            decode_any(c, &inp[start..end], &mut x);
            if first {
                set_scaled(&mut acc, &x, pre);
                first = false;
            } else {
                add_scaled(&mut acc, &x, pre);
            }
        }
        divide(&mut acc, post);
        encode_any(c, &acc, o);
        start = end;
    }
}

/// `acc = round(acc + src)`; lengths already checked.
#[inline(always)]
fn accumulate_impl<C: Codec>(c: C, acc: &mut [u8], src: &[u8]) {
    let mut a = [0f32; BLOCK];
    let mut x = [0f32; BLOCK];
    for (ab, sb) in acc.chunks_mut(BLOCK * C::SIZE).zip(src.chunks(BLOCK * C::SIZE)) {
        decode_any(c, ab, &mut a);
        decode_any(c, sb, &mut x);
        a.iter_mut().zip(&x).for_each(|(a, x)| *a += *x);
        encode_any(c, &a, ab);
    }
}

/// `dst = round(src)`; element counts already checked.
#[inline(always)]
fn cast_impl<F: Codec, T: Codec>(from: F, src: &[u8], to: T, dst: &mut [u8]) {
    let mut x = [0f32; BLOCK];
    for (sb, db) in src.chunks(BLOCK * F::SIZE).zip(dst.chunks_mut(BLOCK * T::SIZE)) {
        decode_any(from, sb, &mut x);
        encode_any(to, &x, db);
    }
}

/// The instruction sets a kernel can be compiled for.
///
/// Invariant: a value other than `Baseline` exists only if the CPU running the program has
/// the features it names ([`Isa::detect`] and [`Isa::available`] are the only ways to get one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Whatever the compile target guarantees (SSE2 on x86-64).
    Baseline,
    /// x86-64 with AVX2 (256-bit vectors) and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU supports (the detection is cached by `std`).
    #[inline]
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            return Isa::Avx2;
        }
        Isa::Baseline
    }

    /// Every instruction set this CPU supports (tests run each kernel under all of them).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Baseline];
        if Isa::detect() != Isa::Baseline {
            v.push(Isa::detect());
        }
        v
    }
}

/// Defines `$name(isa, args..)`, which runs `$imp(args..)` compiled for `isa`.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident<$($g:ident),+>($($arg:ident: $ty:ty),* $(,)?) => $imp:ident) => {
        $(#[$doc])*
        pub(crate) fn $name<$($g: Codec),+>(isa: Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,f16c")]
                fn avx2<$($g: Codec),+>($($arg: $ty),*) {
                    $imp($($arg),*)
                }
                if isa == Isa::Avx2 {
                    // SAFETY: `Isa::Avx2` exists only when the running CPU has AVX2 and F16C
                    // (the `Isa` invariant), which is all `avx2` requires.
                    return unsafe { avx2::<$($g),+>($($arg),*) };
                }
            }
            let _ = isa;
            $imp($($arg),*)
        }
    };
}

multiversion! {
    /// [`reduce_impl`] compiled for `isa`.
    fn reduce_blocks<C>(c: C, pre: Divisor, post: Divisor, out: &mut [u8], inputs: &[&[u8]]) => reduce_impl
}

multiversion! {
    /// [`accumulate_impl`] compiled for `isa`.
    fn accumulate_blocks<C>(c: C, acc: &mut [u8], src: &[u8]) => accumulate_impl
}

multiversion! {
    /// [`cast_impl`] compiled for `isa`.
    fn cast_blocks<F, T>(from: F, src: &[u8], to: T, dst: &mut [u8]) => cast_impl
}
