//! NVRTC through a table of its functions, resolved from the library the [`loader`] opened.
//!
//! Why not cudarc's `nvrtc` functions: cudarc opens NVRTC itself, under bare names that do not
//! include CUDA 13's `libnvrtc.so.13`, and panics when none opens (see [`loader`]). So this
//! module resolves the dozen NVRTC functions it calls from [`loader::nvrtc`]'s library, with
//! cudarc's `nvrtc::sys` program handle; every `nvrtcResult` is taken as a plain `c_int` (a
//! newer NVRTC may return a code cudarc's enum does not list, which must not become undefined
//! behaviour). The same code drives CUDA 12's and CUDA 13's NVRTC.
//!
//! - [`compile`] / [`compile_ptx`]: one source to PTX or a CUBIN, for an architecture NVRTC
//!   supports ([`supported_archs`]: CUDA 13 dropped sm_50 to sm_72);
//! - [`include_dirs`]: where `cuda_fp16.h` / `cuda_bf16.h` are, with CCCL's `cccl` folder where
//!   a toolkit keeps one (CUDA 13 moved `<cuda/std/...>` and `<nv/target>` there).
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_CUDA_INCLUDE` | unset | `:`-separated directories with `cuda_fp16.h` / `cuda_bf16.h` (a CUDA runtime wheel's `nvidia/cuda_runtime/include` or `nvidia/cu13/include`); after them the `include` folder beside the loaded NVRTC (and, for CUDA 12 wheels, `nvidia/cuda_runtime/include` beside its `nvidia/cuda_nvrtc`), then each `COLLSCHED_CUDA_SEARCH` root's `nvidia/cuda_runtime/include`, `nvidia/cu13/include` and `include`, then `include` of `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda` are tried |

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys as nvrtc_sys;

use super::loader::{self, CudaLibrary, LoadError, Places};
use super::{c_str, CudaKernelError, KernelSource};

/// The knob with the header directories (see the module docs).
pub const INCLUDE_KNOB: &str = "COLLSCHED_CUDA_INCLUDE";

type RawResult = c_int;
type RawProgram = nvrtc_sys::nvrtcProgram;

macro_rules! nvrtc_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// NVRTC's functions, resolved from the loaded library.
        struct NvrtcFns {
            $( $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        impl NvrtcFns {
            fn resolve(loaded: &'static loader::Loaded) -> Result<Self, LoadError> {
                Ok(NvrtcFns {
                    $( $field: {
                        // SAFETY: the symbol is NVRTC's public function of this name, whose C
                        // signature (CUDA 12 and 13, as in cudarc's `nvrtc::sys`, with
                        // `nvrtcResult` as the C `int` it is) is the type given; the library
                        // stays loaded for the life of the process.
                        let s = unsafe {
                            loaded.library.get::<unsafe extern "C" fn($($arg),*) -> $ret>($sym.as_bytes())
                        };
                        match s {
                            Ok(s) => *s,
                            Err(e) => return Err(LoadError::MissingSymbol {
                                library: CudaLibrary::Nvrtc,
                                path: loaded.opened_as.clone(),
                                symbol: $sym.to_string(),
                                error: e.to_string(),
                            }),
                        }
                    }, )*
                })
            }
        }
    };
}

nvrtc_api! {
    version = "nvrtcVersion": fn(*mut c_int, *mut c_int) -> RawResult;
    get_error_string = "nvrtcGetErrorString": fn(RawResult) -> *const c_char;
    get_num_supported_archs = "nvrtcGetNumSupportedArchs": fn(*mut c_int) -> RawResult;
    get_supported_archs = "nvrtcGetSupportedArchs": fn(*mut c_int) -> RawResult;
    create_program = "nvrtcCreateProgram": fn(*mut RawProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> RawResult;
    compile_program = "nvrtcCompileProgram": fn(RawProgram, c_int, *const *const c_char) -> RawResult;
    get_ptx_size = "nvrtcGetPTXSize": fn(RawProgram, *mut usize) -> RawResult;
    get_ptx = "nvrtcGetPTX": fn(RawProgram, *mut c_char) -> RawResult;
    get_cubin_size = "nvrtcGetCUBINSize": fn(RawProgram, *mut usize) -> RawResult;
    get_cubin = "nvrtcGetCUBIN": fn(RawProgram, *mut c_char) -> RawResult;
    get_program_log_size = "nvrtcGetProgramLogSize": fn(RawProgram, *mut usize) -> RawResult;
    get_program_log = "nvrtcGetProgramLog": fn(RawProgram, *mut c_char) -> RawResult;
    destroy_program = "nvrtcDestroyProgram": fn(*mut RawProgram) -> RawResult;
}

/// NVRTC as loaded: its functions, where it came from, its version and architectures.
struct Nvrtc {
    fns: NvrtcFns,
    path: &'static str,
    version: (i32, i32),
    supported: Vec<u32>,
}

impl Nvrtc {
    /// `Ok` for `NVRTC_SUCCESS`, else [`CudaKernelError::Nvrtc`] naming `api` and the result.
    fn check(
        &self,
        code: RawResult,
        api: &'static str,
        file: &'static str,
        arch: u32,
    ) -> Result<(), CudaKernelError> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a pointer to a static string (or null) for any code.
        let name = unsafe { c_str((self.fns.get_error_string)(code)) };
        Err(CudaKernelError::Nvrtc { api, file, arch, code: format!("{name} ({code})") })
    }

    fn unsupported(&self, arch: u32) -> CudaKernelError {
        CudaKernelError::UnsupportedArch {
            arch,
            version: self.version,
            path: self.path.to_string(),
            supported: self.supported.clone(),
        }
    }

    fn resolve(loaded: &'static loader::Loaded) -> Result<Self, CudaKernelError> {
        let mut nvrtc = Nvrtc {
            fns: NvrtcFns::resolve(loaded)?,
            path: &loaded.opened_as,
            version: (0, 0),
            supported: Vec::new(),
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the pointers are to live locals.
        let r = unsafe { (nvrtc.fns.version)(&mut major, &mut minor) };
        nvrtc.check(r, "nvrtcVersion", "-", 0)?;
        let mut count: c_int = 0;
        // SAFETY: as above.
        let r = unsafe { (nvrtc.fns.get_num_supported_archs)(&mut count) };
        nvrtc.check(r, "nvrtcGetNumSupportedArchs", "-", 0)?;
        let mut archs: Vec<c_int> = vec![0; usize::try_from(count).unwrap_or(0)];
        if !archs.is_empty() {
            // SAFETY: `archs` has room for the `count` entries NVRTC said it writes.
            let r = unsafe { (nvrtc.fns.get_supported_archs)(archs.as_mut_ptr()) };
            nvrtc.check(r, "nvrtcGetSupportedArchs", "-", 0)?;
        }
        nvrtc.version = (major, minor);
        nvrtc.supported = archs.into_iter().filter_map(|a| u32::try_from(a).ok()).collect();
        nvrtc.supported.sort_unstable();
        Ok(nvrtc)
    }
}

/// [`CudaKernelError::UnsupportedArch`] for `arch`, naming this NVRTC and what it supports; the
/// load error instead when NVRTC cannot be loaded.
pub fn unsupported_arch(arch: u32) -> CudaKernelError {
    match api() {
        Ok(nv) => nv.unsupported(arch),
        Err(e) => e,
    }
}

/// Loads NVRTC (once per process) and resolves its functions.
fn api() -> Result<&'static Nvrtc, CudaKernelError> {
    static API: OnceLock<Nvrtc> = OnceLock::new();
    if let Some(a) = API.get() {
        return Ok(a);
    }
    let a = Nvrtc::resolve(loader::nvrtc()?)?;
    Ok(API.get_or_init(|| a))
}

/// NVRTC's version, `(major, minor)`.
///
/// # Errors
/// [`CudaKernelError::Load`] without NVRTC.
pub fn nvrtc_version() -> Result<(i32, i32), CudaKernelError> {
    Ok(api()?.version)
}

/// The architectures NVRTC compiles for (`nvrtcGetSupportedArchs`), ascending: 50 to 121 for
/// NVRTC 12.9, 75 to 121 for 13.0.
///
/// # Errors
/// [`CudaKernelError::Load`] without NVRTC.
pub fn supported_archs() -> Result<&'static [u32], CudaKernelError> {
    Ok(&api()?.supported)
}

/// Destroys an NVRTC program when dropped (errors ignored: nothing to do about them).
struct Program {
    fns: &'static NvrtcFns,
    raw: RawProgram,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from `nvrtcCreateProgram` and is destroyed only here.
        let _ = unsafe { (self.fns.destroy_program)(&mut self.raw) };
    }
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodeKind {
    /// PTX for `compute_{arch}`: JIT-compiled by the driver, runs on that and later GPUs, but
    /// needs a driver at least as new as NVRTC's PTX version.
    Ptx,
    /// A CUBIN (machine code) for `sm_{arch}`: no JIT, runs on drivers older than NVRTC.
    Cubin,
}

/// Compiles one source to PTX for `compute_{arch}` (e.g. 80, 90), uncached.
///
/// # Errors
/// As [`compile`].
pub fn compile_ptx(source: &KernelSource, arch: u32, include: &[PathBuf]) -> Result<String, CudaKernelError> {
    let image = compile(source, arch, CodeKind::Ptx, include)?;
    Ok(String::from_utf8_lossy(&image).into_owned())
}

/// Bytes up to the first NUL.
fn until_nul(bytes: &[u8]) -> &[u8] {
    bytes.iter().position(|&b| b == 0).map_or(bytes, |n| &bytes[..n])
}

/// Compiles one source for `arch` to PTX or a CUBIN, uncached. PTX comes without the final NUL.
///
/// # Errors
/// [`CudaKernelError::Load`] without NVRTC; [`CudaKernelError::UnsupportedArch`] for an
/// architecture this NVRTC lacks; [`CudaKernelError::Compile`] with NVRTC's log.
pub fn compile(
    source: &KernelSource,
    arch: u32,
    kind: CodeKind,
    include: &[PathBuf],
) -> Result<Vec<u8>, CudaKernelError> {
    let nv = api()?;
    if !nv.supported.contains(&arch) {
        return Err(nv.unsupported(arch));
    }
    let check = |code, api| nv.check(code, api, source.file, arch);
    // The sources are ours and contain no NUL.
    let src = CString::new(source.source).unwrap_or_default();
    let name = CString::new(source.file).unwrap_or_default();
    let mut raw: RawProgram = std::ptr::null_mut();
    // SAFETY: `raw` is a live out-pointer; the strings live across the call; no headers are
    // passed (0, null, null).
    let r = unsafe {
        (nv.fns.create_program)(&mut raw, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    check(r, "nvrtcCreateProgram")?;
    let prog = Program { fns: &nv.fns, raw };
    let target = match kind {
        CodeKind::Ptx => format!("--gpu-architecture=compute_{arch}"),
        CodeKind::Cubin => format!("--gpu-architecture=sm_{arch}"),
    };
    let mut options = vec![
        target,
        "--std=c++17".to_string(),
        // The kernels spell out every rounding; keep the compiler from fusing anything anyway.
        "--fmad=false".to_string(),
        "--prec-div=true".to_string(),
        "--ftz=false".to_string(),
    ];
    let include_strs: Vec<String> = include.iter().map(|d| d.to_string_lossy().into_owned()).collect();
    options.extend(include_strs.iter().map(|d| format!("--include-path={d}")));
    // Paths come from the environment; one with a NUL cannot be passed and is dropped.
    let options: Vec<CString> = options.into_iter().filter_map(|o| CString::new(o).ok()).collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let count = c_int::try_from(option_ptrs.len()).unwrap_or(c_int::MAX);
    // SAFETY: `prog.raw` is live; `option_ptrs` holds `count` NUL-terminated strings that
    // live across the call.
    let r = unsafe { (nv.fns.compile_program)(prog.raw, count, option_ptrs.as_ptr()) };
    if r != 0 {
        let log = program_log(&prog).unwrap_or_default();
        let log = if log.trim().is_empty() {
            // SAFETY: a static string (or null) for any code.
            format!("{} (no log)", unsafe { c_str((nv.fns.get_error_string)(r)) })
        } else {
            log
        };
        return Err(CudaKernelError::Compile { file: source.file, arch, include: include_strs, log });
    }
    let (size_fn, get_fn, size_api, get_api) = match kind {
        CodeKind::Ptx => (nv.fns.get_ptx_size, nv.fns.get_ptx, "nvrtcGetPTXSize", "nvrtcGetPTX"),
        CodeKind::Cubin => (nv.fns.get_cubin_size, nv.fns.get_cubin, "nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
    };
    let mut size = 0usize;
    // SAFETY: `prog.raw` is live and compiled; `size` is a live local.
    check(unsafe { size_fn(prog.raw, &mut size) }, size_api)?;
    let mut image = vec![0u8; size];
    if size > 0 {
        // SAFETY: as above; `image` has the size NVRTC asked for.
        check(unsafe { get_fn(prog.raw, image.as_mut_ptr().cast()) }, get_api)?;
    }
    if kind == CodeKind::Ptx {
        let len = until_nul(&image).len();
        image.truncate(len);
    }
    Ok(image)
}

/// NVRTC's log for `prog`, or `None` when NVRTC cannot give it.
fn program_log(prog: &Program) -> Option<String> {
    let mut size = 0usize;
    // SAFETY: `prog.raw` is live; `size` is a live local.
    if unsafe { (prog.fns.get_program_log_size)(prog.raw, &mut size) } != 0 {
        return None;
    }
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: as above; `log` has room for the `size` bytes NVRTC writes.
    if unsafe { (prog.fns.get_program_log)(prog.raw, log.as_mut_ptr().cast()) } != 0 {
        return None;
    }
    Some(String::from_utf8_lossy(until_nul(&log)).into_owned())
}

/// Include directories for NVRTC, as the module docs list them: those that hold
/// `cuda_fp16.h`, each followed by its `cccl` folder where one exists.
pub fn include_dirs() -> Vec<PathBuf> {
    let places = Places {
        knob: std::env::var(INCLUDE_KNOB).ok(),
        search: std::env::var(loader::SEARCH_KNOB).ok(),
        toolkits: loader::toolkit_roots(),
    };
    let nvrtc = loader::nvrtc().ok().map(|l| PathBuf::from(&l.opened_as));
    include_dirs_in(&places, nvrtc.as_deref())
}

/// [`include_dirs`] for given places (`places.knob` is `COLLSCHED_CUDA_INCLUDE`'s value) and
/// the path NVRTC was opened by (a bare name has no folder beside it).
pub fn include_dirs_in(places: &Places, nvrtc: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    dirs.extend(places.knob.as_deref().unwrap_or("").split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    if let Some(lib_dir) = nvrtc.and_then(Path::parent).filter(|d| !d.as_os_str().is_empty()) {
        // `<toolkit>/lib64/..` or a CUDA 13 wheel's `nvidia/cu13/lib/..`; a CUDA 12 wheel's
        // headers are in the runtime wheel beside `nvidia/cuda_nvrtc`.
        dirs.push(lib_dir.join("../include"));
        dirs.push(lib_dir.join("../../cuda_runtime/include"));
    }
    for root in places.search_roots() {
        for sub in ["nvidia/cuda_runtime/include", "nvidia/cu13/include", "include"] {
            dirs.push(root.join(sub));
        }
    }
    dirs.extend(places.toolkits.iter().map(|t| t.join("include")));
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in dirs.into_iter().filter(|d| d.join("cuda_fp16.h").is_file()) {
        // One folder reached by two spellings (`lib/../include`) is passed once.
        let dir = dir.canonicalize().unwrap_or(dir);
        let cccl = dir.join("cccl");
        for d in [Some(dir), cccl.is_dir().then_some(cccl)].into_iter().flatten() {
            if !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_dirs_find_cuda13_wheels_and_a_toolkits_cccl_folder() {
        let root = std::env::temp_dir().join(format!("collsched-nvrtc-include-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let touch = |rel: &str| {
            let p = root.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"").unwrap();
        };
        // torch's site-packages with CUDA 13 wheels, and a toolkit with CCCL in include/cccl.
        touch("site/nvidia/cu13/include/cuda_fp16.h");
        touch("site/nvidia/cu13/lib/libnvrtc.so.13");
        touch("toolkit/include/cuda_fp16.h");
        touch("toolkit/include/cccl/cuda/std/cstdint");
        let site = root.join("site").canonicalize().unwrap();
        let toolkit = root.join("toolkit").canonicalize().unwrap();
        let places = Places {
            knob: Some("/nonexistent-collsched-include".into()),
            search: Some(site.to_string_lossy().into_owned()),
            toolkits: vec![toolkit.clone()],
        };
        let cu13 = site.join("nvidia/cu13/include");
        let want = [cu13.clone(), toolkit.join("include"), toolkit.join("include/cccl")];
        assert_eq!(include_dirs_in(&places, None), want);
        // Beside the loaded NVRTC comes first, and is not repeated.
        let nvrtc = site.join("nvidia/cu13/lib/libnvrtc.so.13");
        assert_eq!(include_dirs_in(&places, Some(&nvrtc)), want);
        let without_search = Places { search: None, ..places };
        assert_eq!(include_dirs_in(&without_search, Some(&nvrtc))[0], cu13);
        let _ = std::fs::remove_dir_all(&root);
    }
}
