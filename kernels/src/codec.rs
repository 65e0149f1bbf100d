//! The vocabulary of the kernels' loops: elements as bytes ([`Raw`]), an element type's
//! conversion to and from `f32` ([`Codec`]), divisors as types ([`Divisor`], [`Scale`]), block
//! sizes, and the instruction sets a loop is compiled for ([`Isa`]). It depends on nothing else
//! of the crate: the loops (`block`), the conversions (`convert`), the x86-64 variants (`f16c`,
//! `nt`) and the streaming copies (`stream`) all build on it.

/// Elements per block of a reduction: small enough that the accumulator (4 KiB) and a block of
/// each input stay in L1, large enough that the per-block overhead is noise.
pub(crate) const BLOCK: usize = 1024;

/// Inputs summed per pass over a block; more passes read and write the accumulator again.
pub(crate) const GROUP: usize = 4;

/// A little-endian element as bytes: `[u8; N]`.
pub(crate) trait Raw: Copy {
    /// The element whose bytes are all zero.
    const ZERO: Self;
    /// Views bytes as elements (a trailing partial element, which callers rule out, is dropped).
    fn view(bytes: &[u8]) -> &[Self];
    /// Views bytes as elements, mutably.
    fn view_mut(bytes: &mut [u8]) -> &mut [Self];
    /// Views elements as bytes.
    fn bytes(elems: &[Self]) -> &[u8];
    /// Views elements as bytes, mutably.
    fn bytes_mut(elems: &mut [Self]) -> &mut [u8];
}

impl<const N: usize> Raw for [u8; N] {
    const ZERO: Self = [0; N];

    #[inline(always)]
    fn bytes(elems: &[Self]) -> &[u8] {
        elems.as_flattened()
    }

    #[inline(always)]
    fn bytes_mut(elems: &mut [Self]) -> &mut [u8] {
        elems.as_flattened_mut()
    }

    #[inline(always)]
    fn view(bytes: &[u8]) -> &[Self] {
        bytes.as_chunks::<N>().0
    }

    #[inline(always)]
    fn view_mut(bytes: &mut [u8]) -> &mut [Self] {
        bytes.as_chunks_mut::<N>().0
    }
}

/// An element type's conversion between its little-endian bytes and `f32`.
pub(crate) trait Codec: Copy {
    /// One element's bytes.
    type Raw: Raw;
    /// Whether a reduction's last pass should round and store in the same loop that sums
    /// (`f32`), or sum into the accumulator and convert it in a second, simpler loop, which the
    /// compiler vectorizes better when the conversion is long (`f16`, `bf16`).
    const FUSED_STORE: bool;
    /// Widens one element to `f32` (exactly; a NaN comes out quiet).
    fn load(self, r: Self::Raw) -> f32;
    /// Widens one element that only feeds `f32` arithmetic: like [`Codec::load`], except that a
    /// signalling NaN may stay signalling, since the first addition or multiplication quiets
    /// it anyway (IEEE 754), giving the same result as [`Codec::load`].
    #[inline(always)]
    fn load_operand(self, r: Self::Raw) -> f32 {
        self.load(r)
    }
    /// Rounds an `f32` to the element type (to nearest even).
    fn store(self, v: f32) -> Self::Raw;
}

/// Division by a fixed `f32`, as cheap as bit-exactness allows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Divisor {
    /// Divisor `±2^e` with `e` in `-126..=127` (1 included): its reciprocal `±2^-e` is exact,
    /// and then `x * (1/d)` and `x / d` are both the correctly rounded value of the same real
    /// number, for every `x` (zeros, infinities, subnormal results and NaN included): the same
    /// bits. Multiplying is several times cheaper than dividing.
    Mul(f32),
    /// Any other divisor: a real division, as the reference does.
    Div(f32),
}

impl Divisor {
    /// The cheapest exact form of division by `d`.
    pub(crate) fn new(d: f32) -> Divisor {
        if d.is_normal() && d.to_bits() & 0x007F_FFFF == 0 {
            Divisor::Mul(1.0 / d)
        } else {
            Divisor::Div(d)
        }
    }
}

/// Evaluates `$body` with `$p` and `$q` bound to the two divisors as [`Scale`] types ([`MulBy`]
/// or [`DivBy`]): one match arm per pair of cases, so the body is compiled for each.
macro_rules! with_scales {
    ($pre:expr, $post:expr, |$p:ident, $q:ident| $body:expr) => {{
        use $crate::codec::{DivBy, Divisor, MulBy};
        match ($pre, $post) {
            (Divisor::Mul(a), Divisor::Mul(b)) => {
                let ($p, $q) = (MulBy(a), MulBy(b));
                $body
            }
            (Divisor::Mul(a), Divisor::Div(b)) => {
                let ($p, $q) = (MulBy(a), DivBy(b));
                $body
            }
            (Divisor::Div(a), Divisor::Mul(b)) => {
                let ($p, $q) = (DivBy(a), MulBy(b));
                $body
            }
            (Divisor::Div(a), Divisor::Div(b)) => {
                let ($p, $q) = (DivBy(a), DivBy(b));
                $body
            }
        }
    }};
}
pub(crate) use with_scales;

/// A [`Divisor`] case as a type, so that loops are compiled per case.
pub(crate) trait Scale: Copy {
    /// Whether [`Scale::apply`] multiplies by [`Scale::factor`] (else it divides by it).
    const MULTIPLY: bool;
    /// `x / d`.
    fn apply(self, x: f32) -> f32;
    /// The operand of [`Scale::apply`]: `1/d` if [`Scale::MULTIPLY`], else `d` (the explicitly
    /// vectorized kernels apply it to whole vectors).
    fn factor(self) -> f32;
}

/// Division by a power of two, as multiplication by its exact reciprocal.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MulBy(pub(crate) f32);

impl Scale for MulBy {
    const MULTIPLY: bool = true;

    #[inline(always)]
    fn apply(self, x: f32) -> f32 {
        x * self.0
    }

    #[inline(always)]
    fn factor(self) -> f32 {
        self.0
    }
}

/// Division.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DivBy(pub(crate) f32);

impl Scale for DivBy {
    const MULTIPLY: bool = false;

    #[inline(always)]
    fn apply(self, x: f32) -> f32 {
        x / self.0
    }

    #[inline(always)]
    fn factor(self) -> f32 {
        self.0
    }
}

/// The instruction sets a kernel can be compiled for.
///
/// Invariant: a value other than `Baseline` exists only if the CPU running the program has
/// the features it names ([`Isa::detect`] and `Isa::available` (tests) are the only ways to get one).
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
