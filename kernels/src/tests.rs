//! The fast kernels against the scalar reference, under every instruction set this CPU has.

use half::{bf16, f16};
use proptest::prelude::*;

use crate::arith::{accumulate_with, cast_with, reduce_with};
use crate::codec::{Divisor, Isa, BLOCK};
use crate::convert::{bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits};
use crate::elem::post_divisor;
use crate::{copy_in, copy_out, reference, CopySegment, ElemType, KernelError, ReduceOp, Scaling};

const TYPES: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];

/// Equal bits, or both NaN (NaN payloads are not part of the contract).
fn same(ty: ElemType, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("lengths {} and {}", got.len(), want.len()));
    }
    let s = ty.size();
    for (i, (g, w)) in got.chunks(s).zip(want.chunks(s)).enumerate() {
        let (gv, wv) = (reference::load(ty, g, 0), reference::load(ty, w, 0));
        if g != w && !(gv.is_nan() && wv.is_nan()) {
            return Err(format!("{} element {i}: got {g:02x?} ({gv}), reference {w:02x?} ({wv})", ty.name()));
        }
    }
    Ok(())
}

/// A byte buffer of `len` bytes starting `offset` bytes into a fresh allocation, so that it is
/// misaligned for `f32` / `f16` when `offset` is odd or 2.
fn at_offset(bytes: &[u8], offset: usize) -> Vec<u8> {
    let mut v = vec![0xA5u8; offset];
    v.extend_from_slice(bytes);
    v
}

/// `f32` values that stress rounding: specials, subnormals, halfway cases, arbitrary bits.
fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        3 => any::<u32>().prop_map(f32::from_bits),
        2 => -1.0e4f32..1.0e4,
        1 => prop::sample::select(vec![
            0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN,
            f32::from_bits(0x7F80_0001), // signalling NaN
            f32::MIN_POSITIVE, -f32::MIN_POSITIVE, f32::from_bits(1), f32::from_bits(0x8000_0001),
            f32::MAX, f32::MIN, 65504.0, 65519.99, 65520.0, -65520.0, 6.1e-5, 5.96e-8, 2.98e-8,
            1.0 + f32::EPSILON, f32::from_bits(0x3F80_8000), f32::from_bits(0x3F81_8000),
        ]),
        1 => (any::<bool>(), 0u32..0x0100_0000).prop_map(|(s, m)| f32::from_bits(m | (u32::from(s) << 31))),
    ]
}

/// One element of type `ty` as bytes: arbitrary bits, or a rounded `f32` from [`any_f32`].
fn any_elem(ty: ElemType) -> BoxedStrategy<Vec<u8>> {
    match ty {
        ElemType::F32 => any_f32().prop_map(|f| f.to_le_bytes().to_vec()).boxed(),
        _ => prop_oneof![
            any::<u16>().prop_map(|h| h.to_le_bytes().to_vec()),
            any_f32().prop_map(move |f| {
                let mut b = vec![0u8; 2];
                reference::store(ty, &mut b, 0, f);
                b
            }),
        ]
        .boxed(),
    }
}

fn buffer(ty: ElemType, n: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any_elem(ty), n).prop_map(|v| v.concat())
}

fn any_type() -> impl Strategy<Value = ElemType> {
    prop::sample::select(TYPES.to_vec())
}

/// Divisors: exact reciprocals, 1, ordinary values, zero and specials, arbitrary floats.
fn any_divisor() -> impl Strategy<Value = f32> {
    prop_oneof![
        2 => prop::sample::select(vec![
            1.0f32, 2.0, 0.5, 4.0, 8.0, 3.0, 6.0, 0.1, 7.0, -2.0, 0.0, -0.0, f32::INFINITY, f32::NAN,
            f32::from_bits(1), 1.0e-40, 2f32.powi(127), 2f32.powi(-126), 2f32.powi(-127),
        ]),
        1 => any_f32(),
        1 => (1i32..64).prop_map(|i| i as f32),
    ]
}

/// Lengths that cross block boundaries and leave odd tails.
fn any_len() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..40, (BLOCK - 3)..(BLOCK + 4), 0usize..(3 * BLOCK + 7)]
}

#[test]
fn f16_to_f32_matches_half_for_every_f16() {
    for h in 0..=u16::MAX {
        let (got, want) = (f16_bits_to_f32(h), f16::from_bits(h).to_f32());
        assert_eq!(got.to_bits(), want.to_bits(), "f16 bits {h:#06x}");
    }
}

#[test]
fn bf16_to_f32_matches_half_for_every_bf16() {
    for h in 0..=u16::MAX {
        let (got, want) = (bf16_bits_to_f32(h), bf16::from_bits(h).to_f32());
        assert_eq!(got.to_bits(), want.to_bits(), "bf16 bits {h:#06x}");
    }
}

/// All 2^32 `f32` values through both narrowing conversions: about a minute in release mode.
#[test]
#[ignore = "exhaustive over 2^32 inputs; run with `cargo test -p collsched-kernels --release -- --ignored`"]
fn narrowing_matches_half_for_every_f32() {
    for x in 0..=u32::MAX {
        let f = f32::from_bits(x);
        assert_eq!(f32_to_f16_bits(f), f16::from_f32(f).to_bits(), "f16 of {x:#010x}");
        assert_eq!(f32_to_bf16_bits(f), bf16::from_f32(f).to_bits(), "bf16 of {x:#010x}");
    }
}

#[test]
fn narrowing_matches_half_near_every_f16_and_bf16_boundary() {
    // Around each 16-bit value: the value itself, the halfway points and their neighbours.
    for h in 0..=u16::MAX {
        for base in [u32::from(h) << 16, u32::from(h) << 13, (u32::from(h) << 13) + (112 << 23)] {
            for d in [0u32, 1, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                for x in [base.wrapping_add(d), base.wrapping_sub(d), base.wrapping_add(d) ^ 0x8000_0000] {
                    let f = f32::from_bits(x);
                    assert_eq!(f32_to_f16_bits(f), f16::from_f32(f).to_bits(), "f16 of {x:#010x}");
                    assert_eq!(f32_to_bf16_bits(f), bf16::from_f32(f).to_bits(), "bf16 of {x:#010x}");
                }
            }
        }
    }
}

#[test]
fn nan_stays_nan_through_every_cast() {
    for ty in TYPES {
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFF80_0001)] {
            let mut b = vec![0u8; ty.size()];
            reference::store(ty, &mut b, 0, nan);
            assert!(reference::load(ty, &b, 0).is_nan(), "{} of {:#x}", ty.name(), nan.to_bits());
            for isa in Isa::available() {
                let mut out = vec![0u8; 4];
                cast_with(isa, ty, &b, ElemType::F32, &mut out);
                assert!(f32::from_le_bytes(out[..].try_into().unwrap()).is_nan());
            }
        }
    }
}

#[test]
fn copy_rejects_zero_elem_size() {
    let mut packed = [0u8; 4];
    let err = copy_in(&mut packed, &[&[1, 2]], &[], 0).unwrap_err();
    assert!(matches!(err, KernelError::BadLength { kernel: "copy_in", .. }), "{err}");
    let err = copy_out(&mut [&mut [0u8; 2]], &packed, &[], 0).unwrap_err();
    assert!(matches!(err, KernelError::BadLength { kernel: "copy_out", .. }), "{err}");
}

#[test]
fn reduce_and_friends_report_the_reference_errors() {
    let a = [0u8; 8];
    let mut out = [0u8; 8];
    let mut odd = [0u8; 7];
    for ty in TYPES {
        let sc = Scaling::default();
        let cases: [(Result<(), KernelError>, Result<(), KernelError>); 6] = [
            (
                crate::reduce(ty, ReduceOp::Sum, sc, &mut out, &[]),
                reference::reduce(ty, ReduceOp::Sum, sc, &mut out.clone(), &[]),
            ),
            (
                crate::reduce(ty, ReduceOp::Sum, sc, &mut out, &[&a, &a[..6]]),
                reference::reduce(ty, ReduceOp::Sum, sc, &mut out.clone(), &[&a, &a[..6]]),
            ),
            (
                crate::reduce(ty, ReduceOp::Avg, sc, &mut odd, &[&a[..7]]),
                reference::reduce(ty, ReduceOp::Avg, sc, &mut odd.clone(), &[&a[..7]]),
            ),
            (crate::accumulate(ty, &mut out, &a[..4]), reference::accumulate(ty, &mut out.clone(), &a[..4])),
            (
                crate::reduce_in_place(ty, ReduceOp::Sum, sc, &mut odd, &[]),
                reference::reduce(ty, ReduceOp::Sum, sc, &mut odd.clone(), &[&a[..7]]).map_err(|e| match e {
                    KernelError::BadLength { what, .. } => KernelError::BadLength {
                        kernel: "reduce_in_place",
                        what: what.replace("the output", "the in-out buffer (input 0)"),
                    },
                    e => e,
                }),
            ),
            (
                crate::cast(ty, &a, ElemType::F32, &mut odd),
                reference::cast(ty, &a, ElemType::F32, &mut odd.clone()),
            ),
        ];
        for (got, want) in cases {
            assert!(got.is_err(), "{}: {want:?}", ty.name());
            assert_eq!(got, want);
        }
    }
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn divisor_shortcut_is_exact(x in any_f32(), d in any_divisor()) {
        let want = x / d;
        let got = match Divisor::new(d) {
            Divisor::Mul(r) => x * r,
            Divisor::Div(q) => x / q,
        };
        prop_assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{x:e} / {d:e}: got {got:e}, want {want:e}");
    }

    #[test]
    fn narrowing_matches_half(x in any_f32()) {
        prop_assert_eq!(f32_to_f16_bits(x), f16::from_f32(x).to_bits());
        prop_assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits());
    }

    #[test]
    fn reduce_matches_reference(
        (ty, bufs) in (any_type(), any_len(), 1usize..=8).prop_flat_map(|(ty, n, k)| {
            (Just(ty), prop::collection::vec(buffer(ty, n), k))
        }),
        avg in any::<bool>(),
        pre in any_divisor(),
        post_divide in any_divisor(),
        offsets in prop::collection::vec(0usize..36, 9),
        cut in any::<prop::sample::Index>(),
    ) {
        let op = if avg { ReduceOp::Avg } else { ReduceOp::Sum };
        let scaling = Scaling { pre_divide: pre, post_divide };
        let stored: Vec<Vec<u8>> = bufs.iter().zip(&offsets).map(|(b, &o)| at_offset(b, o)).collect();
        let inputs: Vec<&[u8]> = stored.iter().zip(&offsets).map(|(b, &o)| &b[o..]).collect();
        let mut want = vec![0u8; bufs[0].len()];
        reference::reduce(ty, op, scaling, &mut want, &inputs).unwrap();
        // The public entry point, then each instruction set.
        let mut out = at_offset(&vec![0x5Au8; want.len()], offsets[8]);
        crate::reduce(ty, op, scaling, &mut out[offsets[8]..], &inputs).unwrap();
        same(ty, &out[offsets[8]..], &want).map_err(TestCaseError::fail)?;
        // In two pieces of a (pretend) large output, so with streaming stores.
        let mut out = at_offset(&vec![0x5Au8; want.len()], offsets[8]);
        let at = cut.index(want.len() / ty.size() + 1) * ty.size();
        let (lo, hi) = out[offsets[8]..].split_at_mut(at);
        let (ins_lo, ins_hi): (Vec<&[u8]>, Vec<&[u8]>) = inputs.iter().map(|i| i.split_at(at)).unzip();
        crate::reduce_piece(ty, op, scaling, lo, &ins_lo, 1 << 30).unwrap();
        crate::reduce_piece(ty, op, scaling, hi, &ins_hi, 1 << 30).unwrap();
        same(ty, &out[offsets[8]..], &want).map_err(|e| TestCaseError::fail(format!("in pieces split at byte {at}: {e}")))?;
        for isa in Isa::available() {
            let (pre, post) = (Divisor::new(pre), Divisor::new(post_divisor(op, scaling, inputs.len())));
            // Normal and streaming stores.
            for stream in [false, true] {
                let mut out = at_offset(&vec![0x5Au8; want.len()], offsets[8]);
                reduce_with(isa, ty, pre, post, false, &mut out[offsets[8]..], &inputs, stream);
                same(ty, &out[offsets[8]..], &want)
                    .map_err(|e| TestCaseError::fail(format!("{isa:?} stream {stream}: {e}")))?;
                prop_assert!(out[..offsets[8]].iter().all(|&b| b == 0xA5), "wrote before the output");
            }
            // In place: the first input's buffer becomes the output.
            let mut inout = stored[0].clone();
            reduce_with(isa, ty, pre, post, true, &mut inout[offsets[0]..], &inputs[1..], false);
            same(ty, &inout[offsets[0]..], &want)
                .map_err(|e| TestCaseError::fail(format!("{isa:?} in place: {e}")))?;
        }
        let mut inout = stored[0].clone();
        crate::reduce_in_place(ty, op, scaling, &mut inout[offsets[0]..], &inputs[1..]).unwrap();
        same(ty, &inout[offsets[0]..], &want).map_err(|e| TestCaseError::fail(format!("in place: {e}")))?;
    }

    #[test]
    fn accumulate_matches_reference(
        (ty, acc, src) in (any_type(), any_len()).prop_flat_map(|(ty, n)| (Just(ty), buffer(ty, n), buffer(ty, n))),
        (oa, os) in (0usize..4, 0usize..4),
    ) {
        let mut want = acc.clone();
        reference::accumulate(ty, &mut want, &src).unwrap();
        let src_s = at_offset(&src, os);
        let mut got = at_offset(&acc, oa);
        crate::accumulate(ty, &mut got[oa..], &src_s[os..]).unwrap();
        same(ty, &got[oa..], &want).map_err(TestCaseError::fail)?;
        for isa in Isa::available() {
            let mut got = at_offset(&acc, oa);
            accumulate_with(isa, ty, &mut got[oa..], &src_s[os..]);
            same(ty, &got[oa..], &want).map_err(|e| TestCaseError::fail(format!("{isa:?}: {e}")))?;
        }
    }

    #[test]
    fn cast_matches_reference(
        (from, src) in (any_type(), any_len()).prop_flat_map(|(ty, n)| (Just(ty), buffer(ty, n))),
        to in any_type(),
        (os, od) in (0usize..4, 0usize..4),
    ) {
        let n = src.len() / from.size();
        let mut want = vec![0u8; n * to.size()];
        reference::cast(from, &src, to, &mut want).unwrap();
        let src_s = at_offset(&src, os);
        let mut got = at_offset(&vec![0u8; want.len()], od);
        crate::cast(from, &src_s[os..], to, &mut got[od..]).unwrap();
        same(to, &got[od..], &want).map_err(TestCaseError::fail)?;
        for isa in Isa::available() {
            let mut got = at_offset(&vec![0u8; want.len()], od);
            cast_with(isa, from, &src_s[os..], to, &mut got[od..]);
            same(to, &got[od..], &want).map_err(|e| TestCaseError::fail(format!("{isa:?}: {e}")))?;
        }
    }
}

/// A copy-in / copy-out problem: many buffers, and segments that cover parts of them without
/// overlapping on either side, in shuffled order, at random places of the packed buffer.
#[derive(Debug, Clone)]
struct Layout {
    elem_size: usize,
    buffers: Vec<Vec<u8>>,
    offsets: Vec<usize>,
    packed_len: usize,
    segments: Vec<CopySegment>,
}

fn any_layout() -> impl Strategy<Value = Layout> {
    (prop::sample::select(vec![1usize, 2, 4, 8]), prop::collection::vec(0usize..60, 1..7))
        .prop_flat_map(|(elem_size, lens)| {
            let bufs: Vec<_> =
                lens.iter().map(|&n| prop::collection::vec(any::<u8>(), n * elem_size)).collect();
            // Cut points per buffer, and whether each run becomes a segment.
            let cuts: Vec<_> =
                lens.iter().map(|&n| prop::collection::vec((0..=n, any::<bool>()), 0..6)).collect();
            (Just(elem_size), bufs, cuts, prop::collection::vec(0usize..4, 7), any::<u64>())
        })
        .prop_map(|(elem_size, buffers, cuts, offsets, seed)| {
            let mut runs = Vec::new();
            for (b, (buf, cuts)) in buffers.iter().zip(cuts).enumerate() {
                let n = buf.len() / elem_size;
                let mut pts: Vec<usize> = cuts.iter().map(|c| c.0).chain([0, n]).collect();
                pts.sort_unstable();
                pts.dedup();
                for (w, keep) in pts.windows(2).zip(cuts.iter().map(|c| c.1).chain([true; 2])) {
                    if keep {
                        runs.push((b, w[0], w[1] - w[0]));
                    }
                }
            }
            // Shuffle deterministically from the seed, then lay out with gaps.
            let mut state = seed | 1;
            for i in (1..runs.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                runs.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let mut at = 0;
            let segments = runs
                .into_iter()
                .map(|(buffer, buffer_offset, len)| {
                    at += (buffer_offset + len) % 3; // a gap
                    let s = CopySegment { buffer, buffer_offset, packed_offset: at, len };
                    at += len;
                    s
                })
                .collect();
            Layout { elem_size, buffers, offsets, packed_len: at + 1, segments }
        })
}

/// Ways to spoil one segment.
fn spoil(s: &mut CopySegment, how: u8, buffers: usize, packed_len: usize) {
    match how % 5 {
        0 => s.buffer = buffers + usize::from(how / 5),
        1 => s.len = packed_len + 1,
        2 => {
            s.len = s.len.max(1);
            s.packed_offset = packed_len - s.len / 2;
        }
        3 => s.buffer_offset = usize::MAX - s.len / 2,
        _ => s.packed_offset = usize::MAX,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn copy_in_matches_reference(l in any_layout(), fill in any::<u8>()) {
        let stored: Vec<Vec<u8>> = l.buffers.iter().zip(&l.offsets).map(|(b, &o)| at_offset(b, o)).collect();
        let sources: Vec<&[u8]> = stored.iter().zip(&l.offsets).map(|(b, &o)| &b[o..]).collect();
        let mut want = vec![fill; l.packed_len * l.elem_size];
        reference::copy_in(&mut want, &sources, &l.segments, l.elem_size).unwrap();
        let po = l.offsets[6];
        let mut got = at_offset(&vec![fill; want.len()], po);
        copy_in(&mut got[po..], &sources, &l.segments, l.elem_size).unwrap();
        prop_assert_eq!(&got[po..], &want[..]);
        // And directly: each segment's bytes landed where it says.
        let e = l.elem_size;
        for s in &l.segments {
            prop_assert_eq!(
                &got[po + s.packed_offset * e..po + (s.packed_offset + s.len) * e],
                &sources[s.buffer][s.buffer_offset * e..(s.buffer_offset + s.len) * e]
            );
        }
    }

    #[test]
    fn copy_out_matches_reference(l in any_layout(), packed_seed in any::<u8>()) {
        let e = l.elem_size;
        let packed: Vec<u8> =
            (0..l.packed_len * e).map(|i| (i as u8).wrapping_mul(31).wrapping_add(packed_seed)).collect();
        let mut want = l.buffers.clone();
        {
            let mut dests: Vec<&mut [u8]> = want.iter_mut().map(|b| &mut b[..]).collect();
            reference::copy_out(&mut dests, &packed, &l.segments, e).unwrap();
        }
        let mut stored: Vec<Vec<u8>> = l.buffers.iter().zip(&l.offsets).map(|(b, &o)| at_offset(b, o)).collect();
        {
            let mut dests: Vec<&mut [u8]> =
                stored.iter_mut().zip(&l.offsets).map(|(b, &o)| &mut b[o..]).collect();
            copy_out(&mut dests, &packed, &l.segments, e).unwrap();
        }
        for ((got, want), &o) in stored.iter().zip(&want).zip(&l.offsets) {
            prop_assert_eq!(&got[o..], &want[..]);
        }
        for s in &l.segments {
            let (got, o) = (&stored[s.buffer], l.offsets[s.buffer]);
            prop_assert_eq!(
                &got[o + s.buffer_offset * e..o + (s.buffer_offset + s.len) * e],
                &packed[s.packed_offset * e..(s.packed_offset + s.len) * e]
            );
        }
    }

    #[test]
    fn bad_segments_copy_nothing(l in any_layout(), pick in any::<prop::sample::Index>(), how in any::<u8>()) {
        prop_assume!(!l.segments.is_empty());
        let mut segs = l.segments.clone();
        let i = pick.index(segs.len());
        spoil(&mut segs[i], how, l.buffers.len(), l.packed_len);
        let e = l.elem_size;
        let sources: Vec<&[u8]> = l.buffers.iter().map(|b| &b[..]).collect();
        let mut packed = vec![0xEEu8; l.packed_len * e];
        let got = copy_in(&mut packed, &sources, &segs, e);
        let want = reference::copy_in(&mut vec![0xEEu8; l.packed_len * e], &sources, &segs, e);
        prop_assert!(got.is_err(), "segment {} = {:?} accepted", i, segs[i]);
        prop_assert_eq!(&got, &want);
        prop_assert!(packed.iter().all(|&b| b == 0xEE), "copy_in copied before failing");
        let mut bufs = l.buffers.clone();
        let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let got = copy_out(&mut dests, &packed, &segs, e);
        prop_assert!(got.is_err());
        prop_assert_eq!(&bufs, &l.buffers, "copy_out copied before failing");
    }
}

#[test]
fn reduce_in_place_rejects_mismatched_inputs() {
    let mut inout = [0u8; 8];
    let err = crate::reduce_in_place(
        ElemType::F32,
        ReduceOp::Sum,
        Scaling::default(),
        &mut inout,
        &[&[0u8; 8], &[0u8; 4]],
    )
    .unwrap_err();
    assert!(
        matches!(&err, KernelError::BadLength { kernel: "reduce_in_place", what } if what.contains("input 2 has 4 bytes")),
        "{err}"
    );
}

#[test]
fn streaming_copy_copies_every_length_and_alignment() {
    let src: Vec<u8> = (0..1200u32).map(|i| (i * 37 % 256) as u8).collect();
    for (isa, len) in Isa::available().into_iter().flat_map(|isa| {
        [0usize, 1, 15, 16, 17, 255, 256, 257, 300, 511, 512, 1000, 1100].map(move |len| (isa, len))
    }) {
        for dst_off in 0..33 {
            for src_off in [0usize, 1, 3] {
                let mut dst = vec![0xEEu8; len + 40];
                crate::stream::copy_with(
                    isa,
                    &mut dst[dst_off..dst_off + len],
                    &src[src_off..src_off + len],
                    true,
                );
                crate::stream::fence(true);
                assert_eq!(
                    &dst[dst_off..dst_off + len],
                    &src[src_off..src_off + len],
                    "{isa:?} len {len} at {dst_off}"
                );
                assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&b| b == 0xEE));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn streaming_copy_in_and_out_match_reference(l in any_layout()) {
        let e = l.elem_size;
        let sources: Vec<&[u8]> = l.buffers.iter().map(|b| &b[..]).collect();
        let mut want = vec![0x11u8; l.packed_len * e];
        reference::copy_in(&mut want, &sources, &l.segments, e).unwrap();
        let mut got = vec![0x11u8; l.packed_len * e];
        crate::copy::copy_in_unchecked(&mut got, &sources, &l.segments, e, true);
        prop_assert_eq!(&got, &want);
        let mut want_out = l.buffers.clone();
        let mut got_out = l.buffers.clone();
        {
            let mut d: Vec<&mut [u8]> = want_out.iter_mut().map(|b| &mut b[..]).collect();
            reference::copy_out(&mut d, &want, &l.segments, e).unwrap();
            let mut d: Vec<&mut [u8]> = got_out.iter_mut().map(|b| &mut b[..]).collect();
            crate::copy::copy_out_unchecked(&mut d, &want, &l.segments, e, true);
        }
        prop_assert_eq!(got_out, want_out);
    }
}

#[test]
fn copy_piece_copies_with_either_store_and_refuses_other_lengths() {
    let src: Vec<u8> = (0..5000u32).map(|i| (i * 13 % 251) as u8).collect();
    for whole in [0usize, 64 << 20] {
        for off in [0usize, 1, 7, 32] {
            let mut dst = vec![0u8; 5100];
            crate::copy_piece(&mut dst[off..off + 5000], &src, whole).unwrap();
            assert_eq!(&dst[off..off + 5000], &src[..], "whole {whole}, offset {off}");
            assert!(dst[..off].iter().chain(&dst[off + 5000..]).all(|&b| b == 0));
        }
    }
    let err = crate::copy_piece(&mut [0u8; 3], &[0u8; 4], 0).unwrap_err();
    assert!(
        matches!(&err, KernelError::BadLength { kernel: "copy_piece", what } if what.contains("3 bytes and the source 4")),
        "{err}"
    );
}
