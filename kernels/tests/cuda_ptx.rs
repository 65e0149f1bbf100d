//! Compiles every CUDA C source to PTX with NVRTC for compute_80 and compute_90 (no GPU needed).
//!
//! NVRTC comes from `COLLSCHED_NVRTC_LIB` (see `ci/env.sh`), the fp16/bf16 headers from
//! `COLLSCHED_CUDA_INCLUDE`; CUDA 12's and CUDA 13's alike (`ci/ptx.sh` runs it with each).
//! Without NVRTC the test fails in CI (`CI=true`) and otherwise prints that it skipped. With
//! `COLLSCHED_PTX_OUT=DIR` it writes `DIR/<source>.sm_<arch>.ptx` for `ci/ptx.sh` to assemble
//! with ptxas, and prints `NVRTC <major>.<minor> from <path>`.
#![cfg(feature = "cuda")]

use collsched_kernels::cuda::{
    compile, compile_ptx, compiled, include_dirs, load_targets, loader, nvrtc_version, supported_archs,
    CodeKind, CudaKernelError, SOURCES,
};

const ARCHS: [u32; 2] = [80, 90];

fn nvrtc_or_skip(test: &str) -> bool {
    match loader::nvrtc() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: NVRTC is required in CI: {e}");
            }
            println!("{test}: skipped: NVRTC not found ({e})");
            false
        }
    }
}

#[test]
fn every_source_compiles_to_ptx_for_sm80_and_sm90() {
    if !nvrtc_or_skip("every_source_compiles_to_ptx_for_sm80_and_sm90") {
        return;
    }
    let (major, minor) = nvrtc_version().unwrap_or_else(|e| panic!("NVRTC loaded but: {e}"));
    assert!(major >= 12, "NVRTC {major}.{minor} is older than CUDA 12");
    let from = loader::nvrtc().map(|l| l.opened_as.clone()).unwrap_or_default();
    let include = include_dirs();
    println!("NVRTC {major}.{minor} from {from}, headers from {include:?}");
    assert!(!include.is_empty(), "no directory with cuda_fp16.h: set COLLSCHED_CUDA_INCLUDE");
    let out_dir = std::env::var_os("COLLSCHED_PTX_OUT").map(std::path::PathBuf::from);
    if let Some(d) = &out_dir {
        std::fs::create_dir_all(d).expect("create COLLSCHED_PTX_OUT");
    }
    for arch in ARCHS {
        for src in SOURCES {
            let ptx = compile_ptx(src, arch, &include).unwrap_or_else(|e| panic!("{e}"));
            assert!(ptx.contains(&format!(".target sm_{arch}")), "{} for {arch}: no .target line", src.file);
            for k in src.kernels {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "{}: kernel {k} missing from the PTX",
                    src.file
                );
            }
            if let Some(d) = &out_dir {
                let stem = src.file.trim_end_matches(".cu");
                std::fs::write(d.join(format!("{stem}.sm_{arch}.ptx")), &ptx).expect("write PTX");
            }
        }
    }
}

#[test]
fn compiled_kernels_are_cached_per_arch() {
    if !nvrtc_or_skip("compiled_kernels_are_cached_per_arch") {
        return;
    }
    let a = compiled(80, CodeKind::Ptx).unwrap_or_else(|e| panic!("{e}"));
    let b = compiled(80, CodeKind::Ptx).unwrap_or_else(|e| panic!("{e}"));
    assert!(std::sync::Arc::ptr_eq(&a, &b), "second compile for the same arch was not cached");
    assert_eq!(a.images.len(), SOURCES.len());
    assert!(
        a.images.iter().all(|(_, img)| img.last() == Some(&0)),
        "PTX images must end with NUL for cuModuleLoadData"
    );
}

#[test]
fn every_source_compiles_to_a_cubin_for_the_oldest_to_the_newest_arch() {
    // What a GPU run loads first (no driver JIT needed).
    if !nvrtc_or_skip("every_source_compiles_to_a_cubin_for_the_oldest_to_the_newest_arch") {
        return;
    }
    let supported = supported_archs().unwrap_or_else(|e| panic!("{e}"));
    for arch in [80, 90, 100, 120] {
        assert!(supported.contains(&arch), "NVRTC lacks sm_{arch}: it supports {supported:?}");
    }
    // The oldest takes the software bf16 paths of cuda_bf16.h (sm_70 for NVRTC 12, sm_75 for
    // NVRTC 13, which dropped sm_50 to sm_72); sm_120 / sm_121 are the newest both know.
    let (oldest, newest) = (supported[0], supported[supported.len() - 1]);
    let mut archs = vec![oldest.max(70), 80, 90, 100, 120, newest];
    archs.dedup();
    for arch in archs {
        for src in SOURCES {
            let cubin =
                compile(src, arch, CodeKind::Cubin, &include_dirs()).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{} sm_{arch}: a CUBIN is an ELF image", src.file);
        }
    }
}

#[test]
fn an_arch_nvrtc_lacks_is_a_clear_error_and_load_asks_only_for_supported_ones() {
    if !nvrtc_or_skip("an_arch_nvrtc_lacks_is_a_clear_error_and_load_asks_only_for_supported_ones") {
        return;
    }
    let supported = supported_archs().unwrap_or_else(|e| panic!("{e}"));
    let too_old = supported[0].saturating_sub(1);
    let e = compile(&SOURCES[0], too_old, CodeKind::Cubin, &include_dirs()).unwrap_err();
    assert!(matches!(e, CudaKernelError::UnsupportedArch { arch, .. } if arch == too_old), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("cannot compile for sm_{too_old}")), "{msg}");
    assert!(msg.contains("COLLSCHED_NVRTC_LIB"), "{msg}");
    // Every GPU from sm_70 to one newer than NVRTC gets images NVRTC supports.
    for arch in [70, 75, 80, 86, 90, 100, 120, 200] {
        let t = load_targets(arch, supported);
        for a in t.cubin.into_iter().chain(t.ptx) {
            assert!(supported.contains(&a), "sm_{arch}: asks for {a}, NVRTC supports {supported:?}");
        }
        if arch >= 80 {
            assert_eq!(t.ptx, Some(80), "sm_{arch}");
        }
    }
}
