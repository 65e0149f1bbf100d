//! Compiles every CUDA C source to PTX with NVRTC for compute_80 and compute_90 (no GPU needed).
//!
//! NVRTC comes from `COLLSCHED_NVRTC_LIB` (see `ci/env.sh`), the fp16/bf16 headers from
//! `COLLSCHED_CUDA_INCLUDE`. Without NVRTC the test fails in CI (`CI=true`) and otherwise
//! prints that it skipped. With `COLLSCHED_PTX_OUT=DIR` it writes `DIR/<source>.sm_<arch>.ptx`
//! for `ci/ptx.sh` to assemble with ptxas.
#![cfg(feature = "cuda")]

use collsched_kernels::cuda::{
    compile, compile_ptx, compiled, include_dirs, loader, nvrtc_version, CodeKind, SOURCES,
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
    let (major, minor) = nvrtc_version().expect("NVRTC loaded but nvrtcVersion failed");
    assert!(major >= 12, "NVRTC {major}.{minor} is older than CUDA 12");
    let include = include_dirs();
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
fn every_source_compiles_to_a_cubin_from_sm70_to_sm120() {
    // What a GPU run loads first (no driver JIT needed).
    if !nvrtc_or_skip("every_source_compiles_to_a_cubin_from_sm70_to_sm120") {
        return;
    }
    // sm_70 takes the software bf16 paths of cuda_bf16.h; sm_100 / sm_120 are the newest NVRTC
    // 12.9 knows.
    for arch in [70, 80, 90, 100, 120] {
        for src in SOURCES {
            let cubin =
                compile(src, arch, CodeKind::Cubin, &include_dirs()).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{} sm_{arch}: a CUBIN is an ELF image", src.file);
        }
    }
}
