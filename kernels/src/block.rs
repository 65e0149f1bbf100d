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

use crate::codec::{with_scales, Codec, Divisor, Isa, Raw, Scale, BLOCK, GROUP};
use crate::stream;

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
