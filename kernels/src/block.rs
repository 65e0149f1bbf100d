//! The loops of reduce, accumulate and cast, generic over the element codec.
//!
//! Every loop runs over elements with the element type, the scaling and the number of inputs
//! it combines fixed at compile time, so it has no branch inside and the compiler vectorizes
//! it across elements. Bytes are read and written as `[u8; N]` arrays (`from_le_bytes`), which
//! needs no alignment: a misaligned buffer takes the same vectorized path. Lengths need not be
//! multiples of anything; the compiler's scalar epilogue handles the last few elements.
//!
//! A reduction goes through the buffer in blocks of [`BLOCK`] elements. Within a block it sums
//! up to [`GROUP`] inputs per pass into an `f32` accumulator on the stack (the first pass starts
//! from `0.0`, the last pass divides, rounds and stores): with up to `GROUP` inputs that is a
//! single pass that reads each input once and writes the output once. The accumulation over
//! inputs stays in input order for every element, so results equal the scalar reference's.
//!
//! Each kernel is compiled twice (see [`Isa`]): for the baseline target and, on x86-64, with
//! AVX2 enabled, chosen at run time.

use crate::stream;

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
        use $crate::block::{DivBy, Divisor, MulBy};
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

/// One pass over a block: `a = (FIRST ? 0 : acc) + x_0/p + ... + x_{G-1}/p` in that order, then
/// `out = round(a / q)` if `LAST`, else `acc = a`. All slices have the block's length.
#[inline(always)]
fn pass<C: Codec, P: Scale, Q: Scale, const G: usize, const FIRST: bool, const LAST: bool>(
    c: C,
    p: P,
    q: Q,
    xs: [&[C::Raw]; G],
    acc: &mut [f32],
    out: &mut [C::Raw],
) {
    let m = acc.len();
    let xs = xs.map(|x| &x[..m]);
    let out = if LAST { &mut out[..m] } else { &mut out[..0] };
    let fused = LAST && C::FUSED_STORE;
    for j in 0..m {
        let mut a = if FIRST { 0.0 } else { acc[j] };
        for x in &xs {
            a += p.apply(c.load_operand(x[j]));
        }
        if fused {
            out[j] = c.store(q.apply(a));
        } else if LAST {
            acc[j] = q.apply(a);
        } else {
            acc[j] = a;
        }
    }
    if LAST && !fused {
        for (o, a) in out.iter_mut().zip(&*acc) {
            *o = c.store(*a);
        }
    }
}

/// The element codec and the two divisors of a reduction.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ops<C, P, Q> {
    pub(crate) c: C,
    pub(crate) p: P,
    pub(crate) q: Q,
}

/// A pass over `G` of the `inputs`, starting at input `first` (the block is `range`).
#[inline(always)]
pub(crate) fn group_pass<
    C: Codec,
    P: Scale,
    Q: Scale,
    const G: usize,
    const FIRST: bool,
    const LAST: bool,
>(
    ops: Ops<C, P, Q>,
    inputs: &[&[u8]],
    first: usize,
    range: core::ops::Range<usize>,
    acc: &mut [f32],
    out: &mut [C::Raw],
) {
    let xs: [&[C::Raw]; G] = core::array::from_fn(|g| &C::Raw::view(inputs[first + g])[range.clone()]);
    pass::<C, P, Q, G, FIRST, LAST>(ops.c, ops.p, ops.q, xs, acc, out);
}

/// The last pass over a block, over the `inputs.len() - first` (1 to `GROUP`) remaining inputs.
#[inline(always)]
fn last_pass<C: Codec, P: Scale, Q: Scale, const FIRST: bool>(
    ops: Ops<C, P, Q>,
    inputs: &[&[u8]],
    first: usize,
    range: core::ops::Range<usize>,
    acc: &mut [f32],
    out: &mut [C::Raw],
) {
    match inputs.len() - first {
        1 => group_pass::<C, P, Q, 1, FIRST, true>(ops, inputs, first, range, acc, out),
        2 => group_pass::<C, P, Q, 2, FIRST, true>(ops, inputs, first, range, acc, out),
        3 => group_pass::<C, P, Q, 3, FIRST, true>(ops, inputs, first, range, acc, out),
        _ => group_pass::<C, P, Q, GROUP, FIRST, true>(ops, inputs, first, range, acc, out),
    }
}

/// All passes over one block of `out` (the elements `range` of every input).
#[inline(always)]
pub(crate) fn reduce_block<C: Codec, P: Scale, Q: Scale>(
    ops: Ops<C, P, Q>,
    inputs: &[&[u8]],
    range: core::ops::Range<usize>,
    acc: &mut [f32],
    out: &mut [C::Raw],
) {
    let k = inputs.len();
    if k <= GROUP {
        return last_pass::<C, P, Q, true>(ops, inputs, 0, range, acc, out);
    }
    group_pass::<C, P, Q, GROUP, true, false>(ops, inputs, 0, range.clone(), acc, out);
    let mut first = GROUP;
    while k - first > GROUP {
        group_pass::<C, P, Q, GROUP, false, false>(ops, inputs, first, range.clone(), acc, out);
        first += GROUP;
    }
    last_pass::<C, P, Q, false>(ops, inputs, first, range, acc, out);
}

/// `out = round((sum_k inputs[k] / p) / q)`; lengths already checked (all equal to `out.len()`,
/// a whole number of elements) and `inputs` is not empty.
///
/// With `stream` (callers set it from `stream::STREAM_MIN_BYTES` of output on), each block is
/// reduced into a buffer on the stack (in L1) and then written out with streaming stores: the
/// output is not read from memory first (no read for ownership) and does not evict the inputs
/// from the caches.
#[inline(always)]
fn reduce_impl<C: Codec, P: Scale, Q: Scale>(
    c: C,
    p: P,
    q: Q,
    out: &mut [u8],
    inputs: &[&[u8]],
    stream: bool,
) {
    let out = C::Raw::view_mut(out);
    let mut acc = [0f32; BLOCK];
    let mut staged = [C::Raw::ZERO; BLOCK];
    let ops = Ops { c, p, q };
    for (b, o) in out.chunks_mut(BLOCK).enumerate() {
        let range = b * BLOCK..b * BLOCK + o.len();
        let acc = &mut acc[..o.len()];
        if stream {
            let staged = &mut staged[..o.len()];
            reduce_block(ops, inputs, range, acc, staged);
            stream::copy(C::Raw::bytes_mut(o), C::Raw::bytes(staged), true);
        } else {
            reduce_block(ops, inputs, range, acc, o);
        }
    }
    stream::fence(stream);
}

/// `out = round((out / p + sum_k others[k] / p) / q)`: [`reduce_impl`] with the old contents of
/// `out` as the first input; lengths already checked (`others` may be empty).
#[inline(always)]
fn reduce_in_place_impl<C: Codec, P: Scale, Q: Scale>(c: C, p: P, q: Q, out: &mut [u8], others: &[&[u8]]) {
    let out = C::Raw::view_mut(out);
    let mut acc = [0f32; BLOCK];
    let k = others.len();
    let ops = Ops { c, p, q };
    for (b, o) in out.chunks_mut(BLOCK).enumerate() {
        let range = b * BLOCK..b * BLOCK + o.len();
        let acc = &mut acc[..o.len()];
        // The block's old contents first (this pass writes only `acc`).
        pass::<C, P, Q, 1, true, false>(c, p, q, [&*o], acc, &mut []);
        let mut first = 0;
        while k - first > GROUP {
            group_pass::<C, P, Q, GROUP, false, false>(ops, others, first, range.clone(), acc, o);
            first += GROUP;
        }
        if k == first {
            pass::<C, P, Q, 0, false, true>(c, p, q, [], acc, o);
        } else {
            last_pass::<C, P, Q, false>(ops, others, first, range, acc, o);
        }
    }
}

/// `acc = round(acc + src)`; lengths already checked.
#[inline(always)]
fn accumulate_impl<C: Codec>(c: C, acc: &mut [u8], src: &[u8]) {
    let acc = C::Raw::view_mut(acc);
    let src = &C::Raw::view(src)[..acc.len()];
    for (a, s) in acc.iter_mut().zip(src) {
        *a = c.store(c.load_operand(*a) + c.load_operand(*s));
    }
}

/// `dst = round(src)`; element counts already checked.
#[inline(always)]
fn cast_impl<F: Codec, T: Codec>(from: F, src: &[u8], to: T, dst: &mut [u8]) {
    let dst = T::Raw::view_mut(dst);
    let src = &F::Raw::view(src)[..dst.len()];
    for (d, s) in dst.iter_mut().zip(src) {
        *d = to.store(from.load(*s));
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

/// Defines `$name(isa, args..)`, which runs `$imp(args..)` compiled for `isa`.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident<$($g:ident: $bound:ident),+>($($arg:ident: $ty:ty),* $(,)?) => $imp:ident) => {
        $(#[$doc])*
        pub(crate) fn $name<$($g: $bound),+>(isa: Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,f16c")]
                fn avx2<$($g: $bound),+>($($arg: $ty),*) {
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
    fn reduce_scaled<C: Codec, P: Scale, Q: Scale>(c: C, p: P, q: Q, out: &mut [u8], inputs: &[&[u8]], stream: bool) => reduce_impl
}

multiversion! {
    /// [`reduce_in_place_impl`] compiled for `isa`.
    fn reduce_in_place_scaled<C: Codec, P: Scale, Q: Scale>(c: C, p: P, q: Q, out: &mut [u8], others: &[&[u8]]) => reduce_in_place_impl
}

/// `out = round((sum_k inputs[k] / pre) / post)` compiled for `isa`, where the inputs are the
/// old contents of `out` followed by `others` if `in_place`, else `others`; lengths already
/// checked. `stream`: write the output with streaming stores (out of place only; see
/// [`reduce_impl`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_blocks<C: Codec>(
    isa: Isa,
    c: C,
    pre: Divisor,
    post: Divisor,
    in_place: bool,
    out: &mut [u8],
    others: &[&[u8]],
    stream: bool,
) {
    with_scales!(pre, post, |p, q| if in_place {
        reduce_in_place_scaled(isa, c, p, q, out, others)
    } else {
        reduce_scaled(isa, c, p, q, out, others, stream)
    })
}

/// [`reduce_blocks`] for `f16` with F16C; lengths already checked.
#[cfg(target_arch = "x86_64")]
pub(crate) fn reduce_f16c(
    isa: Isa,
    pre: Divisor,
    post: Divisor,
    in_place: bool,
    out: &mut [u8],
    inputs: &[&[u8]],
) {
    use crate::f16c::reduce;
    assert!(isa == Isa::Avx2, "reduce_f16c needs Isa::Avx2");
    // SAFETY: `Isa::Avx2` exists only when the CPU has AVX2 and F16C (the `Isa` invariant).
    unsafe { with_scales!(pre, post, |p, q| reduce(p, q, in_place, out, inputs)) }
}

multiversion! {
    /// [`accumulate_impl`] compiled for `isa`.
    fn accumulate_blocks<C: Codec>(c: C, acc: &mut [u8], src: &[u8]) => accumulate_impl
}

multiversion! {
    /// [`cast_impl`] compiled for `isa`.
    fn cast_blocks<F: Codec, T: Codec>(from: F, src: &[u8], to: T, dst: &mut [u8]) => cast_impl
}
