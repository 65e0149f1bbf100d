//! Loading the CUDA driver, NVRTC and NCCL without panicking.
//!
//! cudarc (feature `dynamic-loading`) opens its libraries lazily on the first call and
//! **panics** when none of the names it tries can be opened. This module opens them first, with
//! `dlopen` through `libloading` (what cudarc uses itself), and turns a missing library into a
//! [`LoadError`] that says what was tried and what to do.
//!
//! # Where a library is looked for
//! [`candidates`] lists the places, in this order, and [`open`] takes the first that opens:
//! 1. each entry of the library's own knob (a file, or a directory joined with each of
//!    [`CudaLibrary::file_names`]);
//! 2. each root of `COLLSCHED_CUDA_SEARCH`: its NVIDIA wheel folders
//!    ([`CudaLibrary::wheel_dirs`]: `nvidia/cuda_nvrtc/lib` for CUDA 12 wheels, `nvidia/cu13/lib`
//!    for CUDA 13 ones, `nvidia/nccl/lib`), then its `lib64` and `lib`, those that exist. A root
//!    is a Python `site-packages` (torch's, so that the NVRTC and NCCL of torch's own wheels are
//!    used) or a CUDA toolkit;
//! 3. the bare file names, for the system loader (`LD_LIBRARY_PATH`, the loader cache);
//! 4. the toolkits: `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda`, their `lib64` and `lib`.
//!
//! Steps 2 and 4 do not apply to the driver: it comes with the NVIDIA kernel driver, never in a
//! wheel or a toolkit's `lib64` (whose `stubs/libcuda.so` must not be loaded). Within one root,
//! and within one folder, CUDA 12's NVRTC is tried before CUDA 13's: its code runs under a CUDA 12
//! driver as well as under a CUDA 13 one, and CUDA 13's does not.
//!
//! # cudarc's own loader, and why only the driver goes through it
//! cudarc's `culib()` (in `driver/sys`, `nvrtc/sys`, `nccl/sys`) calls
//! `libloading::Library::new(name)` on bare file names only (`libcuda.so`, `libcuda.so.1`,
//! `libnvrtc.so`, `libnvrtc.so.12`, `libnccl.so`, ..., from `cudarc::get_lib_name_candidates`);
//! it reads no environment variable of its own. A bare name is looked up by the dynamic loader:
//! first among the objects **already loaded** (matched by file name or `DT_SONAME`), then in
//! `LD_LIBRARY_PATH` (read once at process start), the cache and the default directories.
//! So a library that we open by full path stays loaded (we never close it) and cudarc finds it
//! as long as its SONAME is one of cudarc's candidates: `libcuda.so.1` is, so the driver goes
//! through cudarc. `libnccl.so.2` (the SONAME of every NCCL 2.x, and the only file the
//! `nvidia-nccl-cu12` / `-cu13` wheels ship) and `libnvrtc.so.13` (CUDA 13's NVRTC) are
//! **not**, and preloading them, with `RTLD_GLOBAL` or not, does not change that; so neither is
//! ever called through cudarc: the NCCL layer of the `collsched` crate and this crate's
//! `cuda::nvrtc` module resolve their functions themselves from the [`Library`] returned
//! here, with cudarc's `sys` types.
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_CUDA_DRIVER_LIB` | unset | `:`-separated files or directories tried before the system's `libcuda.so.1` |
//! | `COLLSCHED_NVRTC_LIB` | unset | the same for `libnvrtc.so.12` / `libnvrtc.so.13` (a wheel's `nvidia/cuda_nvrtc/lib` or `nvidia/cu13/lib`) |
//! | `COLLSCHED_NCCL_LIB` | unset | the same for `libnccl.so.2` / `libnccl.so` (the `nvidia-nccl-cu12` / `-cu13` wheel's `nvidia/nccl/lib`) |
//! | `COLLSCHED_CUDA_SEARCH` | unset | `:`-separated roots searched for NVRTC, NCCL (their wheel folders, `lib64`, `lib`) and the CUDA headers (`cuda` module): torch's `site-packages`, or a toolkit |
//! | `CUDA_HOME`, `CUDA_PATH` | unset | toolkits tried after the system loader, before `/usr/local/cuda` |

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
    /// The runtime compiler, `libnvrtc.so.12` (CUDA 12) or `libnvrtc.so.13` (CUDA 13).
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

    /// File names tried, in order, in each folder and then by the system loader. CUDA 12's NVRTC
    /// comes first: its code runs under CUDA 12 and CUDA 13 drivers alike.
    pub const fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLibrary::Nvrtc => &["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"],
            CudaLibrary::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// Folders of NVIDIA's pip wheels that hold the library, relative to a `site-packages`:
    /// CUDA 12 wheels have one folder per package, CUDA 13 wheels put every library in
    /// `nvidia/cu13/lib` (CUDA 12 first, as in [`CudaLibrary::file_names`]); NCCL's wheels keep
    /// `nvidia/nccl/lib` for both.
    pub const fn wheel_dirs(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &[],
            CudaLibrary::Nvrtc => &["nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib"],
            CudaLibrary::Nccl => &["nvidia/nccl/lib"],
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
                "cuMemHostAlloc",
                "cuMemFreeHost",
            ],
            CudaLibrary::Nvrtc => &[
                "nvrtcVersion",
                "nvrtcGetErrorString",
                "nvrtcGetNumSupportedArchs",
                "nvrtcGetSupportedArchs",
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
                "install a CUDA toolkit or NVRTC's wheel (nvidia-cuda-nvrtc-cu12 for CUDA 12, \
                 nvidia-cuda-nvrtc for CUDA 13) and set COLLSCHED_NVRTC_LIB to the directory holding \
                 libnvrtc.so.12 or libnvrtc.so.13, or COLLSCHED_CUDA_SEARCH to the site-packages \
                 holding the wheel's nvidia/ folder"
            }
            CudaLibrary::Nccl => {
                "install NCCL (e.g. the nvidia-nccl-cu12 or nvidia-nccl-cu13 wheel) and set \
                 COLLSCHED_NCCL_LIB to the directory holding libnccl.so.2, or COLLSCHED_CUDA_SEARCH \
                 to the site-packages holding the wheel's nvidia/ folder"
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
    #[error("{library} at {path} has no symbol {symbol} ({error}); it is older than collsched needs (CUDA 12 or newer driver and NVRTC, NCCL 2.18 or newer)")]
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
    /// We loaded the driver, but cudarc's own loader (bare names only) would still not find it.
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

/// Variable that names extra roots to search (see the module docs).
pub const SEARCH_KNOB: &str = "COLLSCHED_CUDA_SEARCH";

/// The values [`candidates`] reads: the environment, or a test's own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Places {
    /// The library's knob ([`CudaLibrary::knob`]): `:`-separated files or directories.
    pub knob: Option<String>,
    /// [`SEARCH_KNOB`]: `:`-separated roots (a `site-packages`, a toolkit).
    pub search: Option<String>,
    /// Toolkit roots tried after the system loader.
    pub toolkits: Vec<PathBuf>,
}

impl Places {
    /// The places named by the environment for `library`.
    pub fn from_env(library: CudaLibrary) -> Self {
        Places {
            knob: std::env::var(library.knob()).ok(),
            search: std::env::var(SEARCH_KNOB).ok(),
            toolkits: toolkit_roots(),
        }
    }

    /// The roots of [`Places::search`], in order.
    pub fn search_roots(&self) -> impl Iterator<Item = &Path> {
        self.search.as_deref().unwrap_or("").split(':').filter(|e| !e.is_empty()).map(Path::new)
    }
}

/// `$CUDA_HOME`, `$CUDA_PATH` and `/usr/local/cuda`, in that order, without repeats.
pub fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut seen = Vec::new();
    roots.retain(|r| {
        let new = !seen.contains(r);
        seen.push(r.clone());
        new
    });
    roots
}

/// Candidates, in the order of the module docs: the knob's entries (files as given, directories
/// joined with each file name, whether they exist or not, so an error names them), then the
/// search roots' and, after the bare file names, the toolkits' folders that exist.
pub fn candidates(library: CudaLibrary, places: &Places) -> Vec<String> {
    let mut out = Vec::new();
    let in_dir = |out: &mut Vec<String>, dir: &Path| {
        out.extend(library.file_names().iter().map(|n| dir.join(n).to_string_lossy().into_owned()));
    };
    for entry in places.knob.as_deref().unwrap_or("").split(':').filter(|e| !e.is_empty()) {
        let p = Path::new(entry);
        if p.is_dir() {
            in_dir(&mut out, p);
        } else {
            out.push(entry.to_string());
        }
    }
    // The driver is never in a wheel or a toolkit's library folders (see the module docs).
    let searched = library != CudaLibrary::Driver;
    let lib_dirs = ["lib64", "lib"];
    if searched {
        for root in places.search_roots() {
            let dirs = library.wheel_dirs().iter().chain(&lib_dirs).map(|d| root.join(d));
            for dir in dirs.filter(|d| d.is_dir()) {
                in_dir(&mut out, &dir);
            }
        }
    }
    out.extend(library.file_names().iter().map(|n| n.to_string()));
    if searched {
        for root in &places.toolkits {
            for dir in lib_dirs.iter().map(|d| root.join(d)).filter(|d| d.is_dir()) {
                in_dir(&mut out, &dir);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| seen.insert(c.clone()));
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

/// Opens `library` from the first of its [`candidates`] that opens, checking its required
/// symbols.
///
/// Does not cache; most callers want [`load`].
///
/// # Errors
/// [`LoadError::NotFound`] with every candidate tried, or [`LoadError::MissingSymbol`].
pub fn open(library: CudaLibrary, places: &Places) -> Result<Loaded, LoadError> {
    let mut tried = Vec::new();
    for candidate in candidates(library, places) {
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

/// Opens `library` once per process (places from the environment) and keeps it open.
///
/// A failure is not cached: a later call tries again.
///
/// # Errors
/// [`LoadError`] as for [`open`], and [`LoadError::HiddenFromCudarc`] when cudarc's own loader
/// (used for the driver only) would still not find the driver we opened.
pub fn load(library: CudaLibrary) -> Result<&'static Loaded, LoadError> {
    let cell = match library {
        CudaLibrary::Driver => &DRIVER,
        CudaLibrary::Nvrtc => &NVRTC,
        CudaLibrary::Nccl => &NCCL,
    };
    if let Some(loaded) = cell.get() {
        return Ok(loaded);
    }
    let loaded = open(library, &Places::from_env(library))?;
    // Check before caching, so a driver cudarc cannot see is never handed out as usable.
    let visible = match library {
        // SAFETY: `is_culib_present` only dlopens cudarc's candidate names and closes them again.
        CudaLibrary::Driver => unsafe { cudarc::driver::sys::is_culib_present() },
        // We never let cudarc load NVRTC or NCCL (see the module docs).
        CudaLibrary::Nvrtc | CudaLibrary::Nccl => true,
    };
    if !visible {
        let names = cudarc::get_lib_name_candidates("cuda");
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

/// Opens NVRTC (see [`load`]); the handle is what the `cuda::nvrtc` module resolves its
/// symbols from.
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

    /// A fresh, empty folder under the system's temporary one, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("collsched-loader-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        /// Creates an empty file at `rel` (and its folders).
        fn touch(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"").unwrap();
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn s(p: &Path) -> String {
        p.to_string_lossy().into_owned()
    }

    #[test]
    fn missing_library_is_an_error_naming_every_candidate() {
        let dir = TempDir::new("empty");
        let places = Places { knob: Some(s(&dir.0)), ..Places::default() };
        let cands = candidates(CudaLibrary::Nccl, &places);
        assert_eq!(cands[0], s(&dir.0.join("libnccl.so.2")));
        assert_eq!(cands[1], s(&dir.0.join("libnccl.so")));
        assert_eq!(&cands[2..], &["libnccl.so.2", "libnccl.so"]);
        let err = open_one(&cands[0]).unwrap_err();
        assert!(!err.is_empty());
    }

    #[test]
    fn cuda13_wheels_in_a_search_root_are_found_before_the_system_loader() {
        // The layout of torch's site-packages with CUDA 13 wheels (nvidia-cuda-nvrtc 13.0,
        // nvidia-nccl-cu13): NVRTC in nvidia/cu13/lib, NCCL in nvidia/nccl/lib.
        let site = TempDir::new("cu13-site");
        let nvrtc = site.touch("nvidia/cu13/lib/libnvrtc.so.13");
        site.touch("nvidia/cu13/lib/libnvrtc-builtins.so.13.0");
        let nccl = site.touch("nvidia/nccl/lib/libnccl.so.2");
        let toolkit = TempDir::new("cu13-toolkit");
        let toolkit_nvrtc = toolkit.touch("lib64/libnvrtc.so.13");
        let places = Places {
            knob: None,
            search: Some(format!("/nonexistent-collsched-root:{}", s(&site.0))),
            toolkits: vec![toolkit.0.clone()],
        };
        let cands = candidates(CudaLibrary::Nvrtc, &places);
        let first_existing = cands.iter().find(|c| Path::new(c).is_file());
        assert_eq!(first_existing, Some(&s(&nvrtc)), "{cands:#?}");
        let pos = |c: &str| cands.iter().position(|x| x == c).unwrap_or_else(|| panic!("{c} in {cands:#?}"));
        // The wheel's folder, then the system loader's bare names, then the toolkit.
        assert!(pos(&s(&nvrtc)) < pos("libnvrtc.so.12"));
        assert!(pos("libnvrtc.so.13") < pos(&s(&toolkit_nvrtc)));
        // Folders that do not exist are not listed.
        assert!(!cands.iter().any(|c| c.contains("nonexistent") || c.contains("cuda_nvrtc")), "{cands:#?}");
        let cands = candidates(CudaLibrary::Nccl, &places);
        assert_eq!(cands.iter().find(|c| Path::new(c).is_file()), Some(&s(&nccl)), "{cands:#?}");
        // No wheel or toolkit is searched for the driver.
        assert_eq!(candidates(CudaLibrary::Driver, &places), ["libcuda.so.1", "libcuda.so"]);
    }

    #[test]
    fn cuda12_nvrtc_comes_before_cuda13_within_one_root() {
        let site = TempDir::new("cu12-cu13-site");
        let cu12 = site.touch("nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        let cu13 = site.touch("nvidia/cu13/lib/libnvrtc.so.13");
        let places = Places { search: Some(s(&site.0)), ..Places::default() };
        let existing: Vec<String> =
            candidates(CudaLibrary::Nvrtc, &places).into_iter().filter(|c| Path::new(c).is_file()).collect();
        assert_eq!(existing, [s(&cu12), s(&cu13)]);
        assert_eq!(CudaLibrary::Nvrtc.file_names(), ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]);
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
