//! Loading the CUDA driver, NVRTC and NCCL without panicking.
//!
//! cudarc (feature `dynamic-loading`) opens its libraries lazily on the first call and
//! **panics** when none of the names it tries can be opened. This module opens them first, with
//! `dlopen` through `libloading` (what cudarc uses itself), and turns a missing library into a
//! [`LoadError`] that says what was tried and what to do.
//!
//! # How cudarc finds a library, and how we make it find ours
//! cudarc's `culib()` (in `driver/sys`, `nvrtc/sys`, `nccl/sys`) calls
//! `libloading::Library::new(name)` on bare file names only (`libcuda.so`, `libcuda.so.1`,
//! `libnvrtc.so`, `libnvrtc.so.12`, `libnccl.so`, ..., from `cudarc::get_lib_name_candidates`);
//! it reads no environment variable of its own. A bare name is looked up by the dynamic loader:
//! first among the objects **already loaded** (matched by file name or `DT_SONAME`), then in
//! `LD_LIBRARY_PATH` (read once at process start), the cache and the default directories.
//! So a library that we open by full path stays loaded (we never close it) and cudarc finds it
//! as long as its SONAME is one of cudarc's candidates: `libcuda.so.1` and `libnvrtc.so.12` are.
//! `libnccl.so.2` (the SONAME of every NCCL 2.x, and the only file the `nvidia-nccl-cu12` wheel
//! ships) is **not** among cudarc's candidates, and preloading it, with `RTLD_GLOBAL` or not,
//! does not change that; so the NCCL layer of the `collsched` crate never calls cudarc's NCCL
//! functions: it resolves NCCL's symbols itself from the [`Library`] returned here, with
//! cudarc's `nccl::sys` types.
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_CUDA_DRIVER_LIB` | unset | `:`-separated files or directories tried before the system's `libcuda.so.1` |
//! | `COLLSCHED_NVRTC_LIB` | unset | the same for `libnvrtc.so.12` (the `nvidia-cuda-nvrtc-cu12` wheel's `nvidia/cuda_nvrtc/lib`) |
//! | `COLLSCHED_NCCL_LIB` | unset | the same for `libnccl.so.2` / `libnccl.so` (the `nvidia-nccl-cu12` wheel's `nvidia/nccl/lib`) |

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
pub use libloading::Library;

/// One of the shared libraries the CUDA backend loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The CUDA driver, `libcuda.so.1` (comes with the NVIDIA kernel driver, not the toolkit).
    Driver,
    /// The runtime compiler, `libnvrtc.so.12`.
    Nvrtc,
    /// NCCL, `libnccl.so.2`.
    Nccl,
}

impl CudaLibrary {
    /// Environment variable with extra places to look (files or directories, `:`-separated).
    pub const fn knob(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "COLLSCHED_CUDA_DRIVER_LIB",
            CudaLibrary::Nvrtc => "COLLSCHED_NVRTC_LIB",
            CudaLibrary::Nccl => "COLLSCHED_NCCL_LIB",
        }
    }

    /// File names tried, in order, in each knob directory and then by the system loader.
    pub const fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLibrary::Nvrtc => &["libnvrtc.so.12", "libnvrtc.so"],
            CudaLibrary::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// Symbols that must be present; cudarc panics on a missing one, so we check them first.
    pub const fn required_symbols(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &[
                "cuInit",
                "cuGetErrorName",
                "cuGetErrorString",
                "cuDeviceGet",
                "cuDeviceGetCount",
                "cuDeviceGetAttribute",
                "cuDevicePrimaryCtxRetain",
                "cuDevicePrimaryCtxRelease_v2",
                "cuCtxSetCurrent",
                "cuCtxGetStreamPriorityRange",
                "cuStreamCreateWithPriority",
                "cuStreamDestroy_v2",
                "cuStreamSynchronize",
                "cuStreamWaitEvent",
                "cuEventCreate",
                "cuEventRecord",
                "cuEventQuery",
                "cuEventSynchronize",
                "cuEventDestroy_v2",
                "cuMemAlloc_v2",
                "cuMemFree_v2",
                "cuMemcpyHtoDAsync_v2",
                "cuMemcpyDtoHAsync_v2",
                "cuMemcpyDtoDAsync_v2",
                "cuMemsetD8Async",
                "cuModuleLoadData",
                "cuModuleGetFunction",
                "cuModuleUnload",
                "cuLaunchKernel",
                "cuLaunchHostFunc",
            ],
            CudaLibrary::Nvrtc => &[
                "nvrtcVersion",
                "nvrtcCreateProgram",
                "nvrtcCompileProgram",
                "nvrtcGetPTXSize",
                "nvrtcGetPTX",
                "nvrtcGetCUBINSize",
                "nvrtcGetCUBIN",
                "nvrtcGetProgramLogSize",
                "nvrtcGetProgramLog",
                "nvrtcDestroyProgram",
            ],
            // The NCCL layer checks its own symbol table when it resolves it.
            CudaLibrary::Nccl => &["ncclGetVersion", "ncclGetErrorString"],
        }
    }

    /// What to do when it is missing.
    const fn hint(self) -> &'static str {
        match self {
            CudaLibrary::Driver => {
                "this machine has no NVIDIA driver (or it is not on the loader's path); \
                 use the local backend, or set COLLSCHED_CUDA_DRIVER_LIB to the directory of libcuda.so.1"
            }
            CudaLibrary::Nvrtc => {
                "install the nvidia-cuda-nvrtc-cu12 wheel or a CUDA toolkit and set \
                 COLLSCHED_NVRTC_LIB to the directory holding libnvrtc.so.12"
            }
            CudaLibrary::Nccl => {
                "install NCCL (e.g. the nvidia-nccl-cu12 wheel) and set COLLSCHED_NCCL_LIB to the \
                 directory holding libnccl.so.2"
            }
        }
    }
}

impl fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaLibrary::Driver => "CUDA driver",
            CudaLibrary::Nvrtc => "NVRTC",
            CudaLibrary::Nccl => "NCCL",
        })
    }
}

/// One place that was tried and why it failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// A path, or a bare file name for the system loader.
    pub candidate: String,
    /// The loader's message (`dlerror`).
    pub error: String,
}

/// Why a CUDA library cannot be used.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// No candidate could be opened.
    #[error("no {library} found: tried {}; {}", fmt_attempts(.tried), .library.hint())]
    NotFound {
        /// Which library.
        library: CudaLibrary,
        /// Every candidate and its loader error, in order.
        tried: Vec<Attempt>,
    },
    /// The library opened but lacks a function collsched calls (it is too old).
    #[error("{library} at {path} has no symbol {symbol} ({error}); it is older than collsched needs (CUDA 12 driver and NVRTC, NCCL 2.18 or newer)")]
    MissingSymbol {
        /// Which library.
        library: CudaLibrary,
        /// Where it was opened from.
        path: String,
        /// The missing function.
        symbol: String,
        /// The loader's message.
        error: String,
    },
    /// We loaded it, but cudarc's own loader (bare names only) would still not find it.
    #[error("{library} was loaded from {path}, but cudarc looks for it only under the names {names:?}; add its directory to LD_LIBRARY_PATH before starting the process")]
    HiddenFromCudarc {
        /// Which library.
        library: CudaLibrary,
        /// Where we opened it.
        path: String,
        /// The names cudarc tries.
        names: Vec<String>,
    },
}

fn fmt_attempts(tried: &[Attempt]) -> String {
    tried.iter().map(|a| format!("{} ({})", a.candidate, a.error)).collect::<Vec<_>>().join(", ")
}

/// A library that was opened, and from where.
#[derive(Debug)]
pub struct Loaded {
    /// The handle (never closed: cudarc's own `dlopen` of the same object relies on it).
    pub library: Library,
    /// The path or bare name it was opened by.
    pub opened_as: String,
}

/// Candidates, in order: every entry of the knob (a file, or a directory joined with each file
/// name), then the bare file names for the system loader.
pub fn candidates(library: CudaLibrary, knob_value: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    for entry in knob_value.unwrap_or("").split(':').filter(|e| !e.is_empty()) {
        let p = Path::new(entry);
        if p.is_dir() {
            for name in library.file_names() {
                out.push(p.join(name).to_string_lossy().into_owned());
            }
        } else {
            out.push(entry.to_string());
        }
    }
    out.extend(library.file_names().iter().map(|n| n.to_string()));
    out
}

fn open_one(candidate: &str) -> Result<Library, String> {
    // SAFETY: opening a shared library runs its initialisers. The candidates are the CUDA
    // driver, NVRTC and NCCL (or what a user's knob points at in their place), whose
    // initialisers only set up their own state; this is the same call cudarc makes.
    unsafe { UnixLibrary::open(Some(candidate), RTLD_NOW | RTLD_LOCAL) }
        .map(Library::from)
        .map_err(|e| describe(&e))
}

/// libloading's `Display` says only "dlopen failed"; the loader's own message is its source.
fn describe(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(inner) => format!("{e}: {inner}"),
        None => e.to_string(),
    }
}

/// Opens `library` from the knob's places or the system's, checking its required symbols.
///
/// Does not cache; most callers want [`load`].
///
/// # Errors
/// [`LoadError::NotFound`] with every candidate tried, or [`LoadError::MissingSymbol`].
pub fn open(library: CudaLibrary, knob_value: Option<&str>) -> Result<Loaded, LoadError> {
    let mut tried = Vec::new();
    for candidate in candidates(library, knob_value) {
        match open_one(&candidate) {
            Ok(lib) => {
                for symbol in library.required_symbols() {
                    // SAFETY: we only look the symbol up (as a raw pointer), never call it here.
                    if let Err(e) = unsafe { lib.get::<*const ()>(symbol.as_bytes()) } {
                        return Err(LoadError::MissingSymbol {
                            library,
                            path: candidate,
                            symbol: symbol.to_string(),
                            error: describe(&e),
                        });
                    }
                }
                if library == CudaLibrary::Nvrtc {
                    preload_nvrtc_builtins(Path::new(&candidate));
                }
                return Ok(Loaded { library: lib, opened_as: candidate });
            }
            Err(error) => tried.push(Attempt { candidate, error }),
        }
    }
    Err(LoadError::NotFound { library, tried })
}

/// NVRTC opens `libnvrtc-builtins.so.MAJOR.MINOR` by bare name at compile time; when NVRTC came
/// from a directory that is not on the loader's path, open the builtins beside it by full path
/// first, so NVRTC's lookup finds the loaded object by its SONAME. Best effort: a failure here
/// shows up as NVRTC's own compile error.
fn preload_nvrtc_builtins(nvrtc: &Path) {
    let Some(dir) = nvrtc.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut builtins: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.") && !n.contains(".alt."))
        })
        .collect();
    builtins.sort();
    for path in builtins {
        if let Ok(lib) = open_one(&path.to_string_lossy()) {
            // Keep it loaded for the life of the process (NVRTC may dlopen it at any compile).
            std::mem::forget(lib);
        }
    }
}

static DRIVER: OnceLock<Loaded> = OnceLock::new();
static NVRTC: OnceLock<Loaded> = OnceLock::new();
static NCCL: OnceLock<Loaded> = OnceLock::new();

/// Opens `library` once per process (knob from the environment) and keeps it open.
///
/// A failure is not cached: a later call tries again.
///
/// # Errors
/// [`LoadError`] as for [`open`], and [`LoadError::HiddenFromCudarc`] when cudarc's own loader
/// (used for the driver and NVRTC) would still not find the library we opened.
pub fn load(library: CudaLibrary) -> Result<&'static Loaded, LoadError> {
    let cell = match library {
        CudaLibrary::Driver => &DRIVER,
        CudaLibrary::Nvrtc => &NVRTC,
        CudaLibrary::Nccl => &NCCL,
    };
    if let Some(loaded) = cell.get() {
        return Ok(loaded);
    }
    let knob = std::env::var(library.knob()).ok();
    let loaded = open(library, knob.as_deref())?;
    // Check before caching, so a library cudarc cannot see is never handed out as usable.
    let visible = match library {
        // SAFETY: `is_culib_present` only dlopens cudarc's candidate names and closes them again.
        CudaLibrary::Driver => unsafe { cudarc::driver::sys::is_culib_present() },
        // SAFETY: as above.
        CudaLibrary::Nvrtc => unsafe { cudarc::nvrtc::sys::is_culib_present() },
        // We never let cudarc load NCCL (see the module docs).
        CudaLibrary::Nccl => true,
    };
    if !visible {
        let names = match library {
            CudaLibrary::Driver => cudarc::get_lib_name_candidates("cuda"),
            _ => cudarc::get_lib_name_candidates("nvrtc"),
        };
        // Keep it open anyway (closing a CUDA library is never safe to rely on).
        std::mem::forget(loaded.library);
        return Err(LoadError::HiddenFromCudarc { library, path: loaded.opened_as, names });
    }
    Ok(cell.get_or_init(|| loaded))
}

/// Checks that the CUDA driver can be loaded (see [`load`]).
///
/// # Errors
/// `no CUDA driver found: ...` ([`LoadError::NotFound`]) on a machine without one.
pub fn driver() -> Result<&'static Loaded, LoadError> {
    load(CudaLibrary::Driver)
}

/// Checks that NVRTC can be loaded (see [`load`]).
///
/// # Errors
/// [`LoadError`] when it cannot.
pub fn nvrtc() -> Result<&'static Loaded, LoadError> {
    load(CudaLibrary::Nvrtc)
}

/// Opens NCCL (see [`load`]); the handle is what the NCCL layer resolves its symbols from.
///
/// # Errors
/// [`LoadError`] when it cannot.
pub fn nccl() -> Result<&'static Loaded, LoadError> {
    load(CudaLibrary::Nccl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_naming_every_candidate() {
        let dir = std::env::temp_dir().join(format!("collsched-loader-test-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let knob = dir.to_string_lossy().into_owned();
        // A library name nothing on a machine has: use the NCCL entry but through a file knob
        // that does not exist, and only look at the knob candidates.
        let cands = candidates(CudaLibrary::Nccl, Some(&knob));
        assert_eq!(cands[0], dir.join("libnccl.so.2").to_string_lossy());
        assert_eq!(cands[1], dir.join("libnccl.so").to_string_lossy());
        assert_eq!(&cands[2..], &["libnccl.so.2", "libnccl.so"]);
        let err = open_one(&cands[0]).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!err.is_empty());
    }

    #[test]
    fn not_found_message_says_what_and_what_to_do() {
        let e = LoadError::NotFound {
            library: CudaLibrary::Driver,
            tried: vec![Attempt { candidate: "libcuda.so.1".into(), error: "cannot open".into() }],
        };
        let s = e.to_string();
        assert!(s.starts_with("no CUDA driver found: tried libcuda.so.1 (cannot open)"), "{s}");
        assert!(s.contains("COLLSCHED_CUDA_DRIVER_LIB"), "{s}");
    }

    #[test]
    fn driver_is_loaded_or_the_error_is_clear() {
        // On this project's machines there is no driver: the call must return an error, not
        // panic. Where a driver exists it must load.
        match driver() {
            Ok(l) => assert!(!l.opened_as.is_empty()),
            Err(e) => assert!(e.to_string().contains("CUDA driver"), "{e}"),
        }
    }
}
