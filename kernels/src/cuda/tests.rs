//! Unit tests of the CUDA kernels' host side: tables, arguments, errors (no GPU needed).

use super::*;

/// `nvrtcGetSupportedArchs` of NVRTC 12.9 and 13.0.
const CUDA12: &[u32] = &[50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121];
const CUDA13: &[u32] = &[75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];

#[test]
fn load_asks_nvrtc_only_for_architectures_it_supports() {
    let t = |cubin, ptx| LoadTargets { cubin, ptx };
    assert_eq!(load_targets(90, CUDA13), t(Some(90), Some(80)));
    assert_eq!(load_targets(90, CUDA12), t(Some(90), Some(80)));
    // A GPU newer than NVRTC: PTX for compute_80 only.
    assert_eq!(load_targets(130, CUDA13), t(None, Some(80)));
    assert_eq!(load_targets(110, CUDA12), t(None, Some(80)));
    // Volta: CUDA 12 compiles for it, CUDA 13 has nothing that old.
    assert_eq!(load_targets(70, CUDA12), t(Some(70), Some(70)));
    assert_eq!(load_targets(70, CUDA13), t(None, None));
    assert_eq!(load_targets(75, CUDA13), t(Some(75), Some(75)));
}

#[test]
fn unsupported_arch_says_what_nvrtc_supports_and_what_to_do() {
    let e = CudaKernelError::UnsupportedArch {
        arch: 70,
        version: (13, 0),
        path: "/site/nvidia/cu13/lib/libnvrtc.so.13".into(),
        supported: CUDA13.to_vec(),
    };
    let s = e.to_string();
    assert!(
        s.starts_with("NVRTC 13.0 (/site/nvidia/cu13/lib/libnvrtc.so.13) cannot compile for sm_70"),
        "{s}"
    );
    assert!(s.contains("sm_75, sm_80"), "{s}");
    assert!(s.contains("COLLSCHED_NVRTC_LIB"), "{s}");
}

#[test]
fn segments_split_into_pieces_and_check_bounds_like_the_cpu() {
    let many = [DeviceRegion { ptr: 0x1000, len: 1_000_000 }];
    let segs = [CopySegment { buffer: 0, buffer_offset: 3, packed_offset: 5, len: 200_000 }];
    let t = device_segments("copy_in", &segs, &many, 300_000, 4).unwrap();
    let total: u64 = t.iter().map(|s| s.bytes).sum();
    assert_eq!(total, 200_000 * 4);
    assert!(t.iter().all(|s| s.bytes <= COPY_CHUNK_BYTES));
    assert_eq!(t[0].many, 0x1000 + 12);
    assert_eq!(t[0].packed, 20);
    for w in t.windows(2) {
        assert_eq!(w[1].many, w[0].many + w[0].bytes);
        assert_eq!(w[1].packed, w[0].packed + w[0].bytes);
    }
    let bad = [CopySegment { buffer: 0, buffer_offset: 0, packed_offset: 299_999, len: 2 }];
    let e = device_segments("copy_in", &bad, &many, 300_000, 4).unwrap_err();
    let cpu = crate::copy_in(&mut vec![0u8; 300_000 * 4], &[&vec![0u8; 1_000_000 * 4]], &bad, 4).unwrap_err();
    assert_eq!(e, cpu);
    let missing = [CopySegment { buffer: 1, buffer_offset: 0, packed_offset: 0, len: 1 }];
    let e = device_segments("copy_out", &missing, &many, 10, 4).unwrap_err();
    assert!(matches!(e, KernelError::NoSuchBuffer { buffer: 1, count: 1, .. }), "{e}");
    let e = device_segments("copy_in", &segs, &many, 300_000, 0).unwrap_err();
    assert!(matches!(e, KernelError::BadLength { .. }), "elem_size 0: {e}");
}

/// Where the CPU lets the later of two overlapping segments win, the GPU refuses them: on
/// the destination side only, by address (two destinations over one allocation too).
#[test]
fn segments_writing_the_same_destination_bytes_are_refused() {
    let seg =
        |buffer, buffer_offset, packed_offset, len| CopySegment { buffer, buffer_offset, packed_offset, len };
    let two = [DeviceRegion { ptr: 0x1000, len: 100 }, DeviceRegion { ptr: 0x1000 + 40, len: 100 }];
    // Sources may overlap (copy_in reads them); packed runs side by side are fine.
    let ok = [seg(0, 0, 0, 20), seg(0, 10, 20, 20), seg(1, 0, 40, 5)];
    assert!(device_segments("copy_in", &ok, &two, 100, 4).is_ok());
    // The third packed run starts inside the first (listed out of order).
    let bad = [seg(0, 0, 30, 10), seg(0, 0, 0, 20), seg(1, 0, 35, 2)];
    let e = device_segments("copy_in", &bad, &two, 100, 4).unwrap_err();
    assert_eq!(
        e,
        KernelError::OverlappingDestinations {
            kernel: "copy_in",
            first: 0,
            second: 2,
            side: "packed".into()
        }
    );
    // copy_out: buffer 1 starts 10 f32 into buffer 0; a run of 0 past element 10 overlaps it.
    let e = device_segments("copy_out", &[seg(0, 5, 0, 6), seg(1, 0, 50, 3)], &two, 100, 4).unwrap_err();
    assert!(matches!(e, KernelError::OverlappingDestinations { first: 0, second: 1, .. }), "{e}");
    assert!(e.to_string().contains("disjoint"), "{e}");
    // Runs that touch end to start do not overlap; empty runs never do.
    assert!(device_segments(
        "copy_out",
        &[seg(0, 0, 0, 10), seg(1, 0, 20, 3), seg(1, 0, 0, 0)],
        &two,
        100,
        4
    )
    .is_ok());
}
