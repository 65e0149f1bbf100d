//! CUDA C twins of the CPU kernels, compiled by NVRTC (feature `cuda`).
//!
//! - [`loader`]: opens the CUDA driver, NVRTC and NCCL (CUDA 12 or 13) without cudarc's panics;
//! - [`SOURCES`]: the CUDA C sources (`kernels/cuda/*.cu`, built in with `include_str!`);
//! - [`nvrtc`]: NVRTC through its own function table ([`compile`], [`compile_ptx`],
//!   [`supported_archs`], [`include_dirs`]); [`compiled`] caches once per process per
//!   (architecture, kind);
//! - [`KernelModule`]: the kernels loaded into a CUDA context (a CUBIN for the device, PTX as
//!   the fallback, for architectures NVRTC supports: [`load_targets`]), with one launch
//!   function per kernel that takes raw device pointers and a raw stream (so the backend can
//!   run them on streams and memory an engine owns).
//!
//! The semantics are those of the CPU kernels in this crate ([`crate::copy_in`],
//! [`crate::copy_out`], [`crate::reduce`], [`crate::accumulate`], [`crate::cast`]), but for
//! copy segments that overlap in their destination, which the CPU lets the later one win and
//! the GPU, copying them at once, refuses ([`device_segments`]); the GPU tests of the
//! `collsched` crate check them against each other where a GPU exists.
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_CUDA_INCLUDE` | unset | where `cuda_fp16.h` / `cuda_bf16.h` are (see [`nvrtc`]) |
//! | `COLLSCHED_NVRTC_LIB`, `COLLSCHED_CUDA_DRIVER_LIB`, `COLLSCHED_CUDA_SEARCH` | unset | where the libraries are (see [`loader`]) |

pub mod loader;
pub mod nvrtc;

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as cu, sys as cusys};

use crate::{CopySegment, ElemType, KernelError};
pub use loader::{CudaLibrary, LoadError};
pub use nvrtc::{
    compile, compile_ptx, include_dirs, include_dirs_in, nvrtc_version, supported_archs, CodeKind,
};

/// One CUDA C source file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`.
    pub file: &'static str,
    /// The source text.
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Every CUDA C source of the crate.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "copy.cu",
        source: include_str!("../../cuda/copy.cu"),
        kernels: &["collsched_copy_in", "collsched_copy_out"],
    },
    KernelSource {
        file: "elementwise.cu",
        source: include_str!("../../cuda/elementwise.cu"),
        kernels: &[
            "collsched_reduce_f32",
            "collsched_reduce_f16",
            "collsched_reduce_bf16",
            "collsched_accumulate_f32",
            "collsched_accumulate_f16",
            "collsched_accumulate_bf16",
            "collsched_divide_f32",
            "collsched_divide_f16",
            "collsched_divide_bf16",
            "collsched_cast_f32_to_f32",
            "collsched_cast_f32_to_f16",
            "collsched_cast_f32_to_bf16",
            "collsched_cast_f16_to_f32",
            "collsched_cast_f16_to_f16",
            "collsched_cast_f16_to_bf16",
            "collsched_cast_bf16_to_f32",
            "collsched_cast_bf16_to_f16",
            "collsched_cast_bf16_to_bf16",
        ],
    },
];

/// Copy runs longer than this are split into pieces, so that the blocks of one launch share
/// the work of a bucket evenly. A multiple of 16, so pieces keep the 16-byte alignment.
pub const COPY_CHUNK_BYTES: u64 = 256 << 10;
/// Threads per block of every kernel.
pub const BLOCK_THREADS: u32 = 256;
/// Upper bound on the blocks of one launch (the kernels loop, so any length is covered).
pub const MAX_GRID_BLOCKS: u32 = 8192;

/// A failed CUDA driver call, with the driver's own name and description of the error.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{api} failed: {name}: {description}")]
pub struct DriverCallError {
    /// The driver function (`cuLaunchKernel`, ...).
    pub api: &'static str,
    /// The `CUresult` name (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub name: String,
    /// The driver's description of it.
    pub description: String,
}

impl DriverCallError {
    /// Wraps cudarc's error, asking the driver for its name and description.
    pub fn new(api: &'static str, e: cu::DriverError) -> Self {
        let name =
            e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
        let description = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "no description".into());
        DriverCallError { api, name, description }
    }
}

/// Helper for the driver's C return convention: names the API that failed.
pub fn check(api: &'static str, r: Result<(), cu::DriverError>) -> Result<(), DriverCallError> {
    r.map_err(|e| DriverCallError::new(api, e))
}

/// Why the CUDA kernels could not be compiled or loaded.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CudaKernelError {
    /// A library could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// An NVRTC call failed.
    #[error("NVRTC {api} for {file} (compute_{arch}) failed: {code}")]
    Nvrtc {
        /// The NVRTC function.
        api: &'static str,
        /// The source file.
        file: &'static str,
        /// The compute capability (80 for sm_80).
        arch: u32,
        /// NVRTC's result code.
        code: String,
    },
    /// NVRTC cannot compile for the architecture asked for.
    #[error(
        "NVRTC {}.{} ({path}) cannot compile for sm_{arch}: it supports {}; {}",
        .version.0, .version.1, fmt_archs(.supported), arch_hint(*.arch, .supported)
    )]
    UnsupportedArch {
        /// The compute capability asked for.
        arch: u32,
        /// NVRTC's `(major, minor)`.
        version: (i32, i32),
        /// Where NVRTC was loaded from.
        path: String,
        /// What it supports (`nvrtcGetSupportedArchs`), ascending.
        supported: Vec<u32>,
    },
    /// The source did not compile; NVRTC's log says why.
    #[error("NVRTC could not compile {file} for compute_{arch} (include path {include:?}): {log}")]
    Compile {
        /// The source file.
        file: &'static str,
        /// The compute capability.
        arch: u32,
        /// The include directories given to NVRTC.
        include: Vec<String>,
        /// NVRTC's log.
        log: String,
    },
    /// A driver call failed while loading the PTX or looking up a kernel.
    #[error("loading {what}: {source}")]
    Driver {
        /// What was being loaded.
        what: String,
        /// The driver's error.
        source: DriverCallError,
    },
}

fn fmt_archs(archs: &[u32]) -> String {
    archs.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>().join(", ")
}

fn arch_hint(arch: u32, supported: &[u32]) -> &'static str {
    match supported.first() {
        Some(&oldest) if arch < oldest => {
            "a GPU older than this NVRTC's oldest architecture needs an older NVRTC (CUDA 13 dropped \
             sm_50 to sm_72; CUDA 12's, the nvidia-cuda-nvrtc-cu12 wheel, supports sm_50 and newer): \
             set COLLSCHED_NVRTC_LIB to the directory holding its libnvrtc.so.12"
        }
        _ => {
            "for a GPU newer than NVRTC, PTX for an older compute_ architecture runs through the \
             driver's JIT (KernelModule::load falls back to it), or use a newer NVRTC"
        }
    }
}

/// The images [`KernelModule::load`] tries for a GPU of compute capability `arch`, given the
/// architectures NVRTC supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadTargets {
    /// A CUBIN for `sm_{arch}`, tried first, when NVRTC supports `arch`.
    pub cubin: Option<u32>,
    /// PTX for the newest supported `compute_` at or below `min(arch, 80)`, the fallback: it
    /// runs on `arch` through the driver's JIT. `None` when NVRTC supports nothing that old
    /// (CUDA 13's NVRTC and an sm_70 GPU).
    pub ptx: Option<u32>,
}

/// What [`KernelModule::load`] asks NVRTC for on a GPU of compute capability `arch`.
pub fn load_targets(arch: u32, supported: &[u32]) -> LoadTargets {
    LoadTargets {
        cubin: supported.contains(&arch).then_some(arch),
        ptx: supported.iter().copied().filter(|&a| a <= arch.min(80)).max(),
    }
}

/// Every source compiled for one target.
#[derive(Debug)]
pub struct CompiledKernels {
    /// Compute capability (80 = sm_80).
    pub arch: u32,
    /// PTX or CUBIN.
    pub kind: CodeKind,
    /// `(source, image)` in the order of [`SOURCES`]; a PTX image ends with a NUL, as
    /// `cuModuleLoadData` wants.
    pub images: Vec<(&'static KernelSource, Vec<u8>)>,
}

type Cache = Mutex<HashMap<(u32, CodeKind), Arc<CompiledKernels>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Every source compiled for `arch` as `kind`, once per process (later calls share the result).
///
/// # Errors
/// As [`compile`]; a failure is not cached.
pub fn compiled(arch: u32, kind: CodeKind) -> Result<Arc<CompiledKernels>, CudaKernelError> {
    // A poisoned lock only means another compile panicked; the map is still consistent.
    let mut map = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = map.get(&(arch, kind)) {
        return Ok(Arc::clone(k));
    }
    let include = include_dirs();
    let mut images = Vec::with_capacity(SOURCES.len());
    for s in SOURCES {
        let mut image = compile(s, arch, kind, &include)?;
        if kind == CodeKind::Ptx {
            image.push(0);
        }
        images.push((s, image));
    }
    let k = Arc::new(CompiledKernels { arch, kind, images });
    map.insert((arch, kind), Arc::clone(&k));
    Ok(k)
}

/// One copy piece as the copy kernels read it (`DeviceSegment` in `copy.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DeviceSegment {
    /// Device address in the many-side buffer (offset applied).
    pub many: u64,
    /// Byte offset in the packed buffer.
    pub packed: u64,
    /// Bytes.
    pub bytes: u64,
}

/// A device buffer as the copy table builder sees it: address and length in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    /// Device address.
    pub ptr: u64,
    /// Length in elements.
    pub len: usize,
}

/// Checks `segments` as the CPU kernels do and turns them into the copy kernels' table,
/// splitting runs longer than [`COPY_CHUNK_BYTES`].
///
/// `kernel` is `copy_in` or `copy_out` (for the error); `many` are the sources (copy-in) or
/// destinations (copy-out); lengths count elements of `elem_size` bytes.
///
/// # Errors
/// The same [`KernelError`]s as [`crate::copy_in`] / [`crate::copy_out`] for the same input;
/// and, where the CPU kernels let the later segment win, [`KernelError::OverlappingDestinations`]
/// for two segments writing the same destination bytes (the GPU copies them at once).
pub fn device_segments(
    kernel: &'static str,
    segments: &[CopySegment],
    many: &[DeviceRegion],
    packed_len: usize,
    elem_size: usize,
) -> Result<Vec<DeviceSegment>, KernelError> {
    crate::elem::check_elem_size(kernel, elem_size)?;
    let mut out = Vec::with_capacity(segments.len());
    for (i, s) in segments.iter().enumerate() {
        let Some(region) = many.get(s.buffer) else {
            return Err(KernelError::NoSuchBuffer {
                kernel,
                segment: i,
                buffer: s.buffer,
                count: many.len(),
            });
        };
        if s.buffer_offset.checked_add(s.len).is_none_or(|end| end > region.len) {
            return Err(KernelError::SegmentOutOfBounds {
                kernel,
                segment: i,
                side: format!("buffer {}", s.buffer),
                offset: s.buffer_offset,
                len: s.len,
                available: region.len,
            });
        }
        if s.packed_offset.checked_add(s.len).is_none_or(|end| end > packed_len) {
            return Err(KernelError::SegmentOutOfBounds {
                kernel,
                segment: i,
                side: "packed".into(),
                offset: s.packed_offset,
                len: s.len,
                available: packed_len,
            });
        }
        let es = elem_size as u64;
        let (many_at, packed_at, bytes) =
            (region.ptr + s.buffer_offset as u64 * es, s.packed_offset as u64 * es, s.len as u64 * es);
        let mut done = 0;
        while done < bytes {
            let piece = (bytes - done).min(COPY_CHUNK_BYTES);
            out.push(DeviceSegment { many: many_at + done, packed: packed_at + done, bytes: piece });
            done += piece;
        }
    }
    check_disjoint(kernel, segments, many, elem_size)?;
    Ok(out)
}

/// Refuses two segments whose destination bytes overlap: the packed side's for `copy_in`, the
/// many side's for `copy_out` (by device address, so two destinations over one allocation
/// count too). The segments were checked against their buffers.
fn check_disjoint(
    kernel: &'static str,
    segments: &[CopySegment],
    many: &[DeviceRegion],
    elem_size: usize,
) -> Result<(), KernelError> {
    let es = elem_size as u64;
    let copy_in = kernel == "copy_in";
    let mut runs: Vec<(u64, u64, usize)> = segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.len > 0)
        .map(|(i, s)| {
            let at = if copy_in {
                s.packed_offset as u64 * es
            } else {
                many[s.buffer].ptr + s.buffer_offset as u64 * es
            };
            (at, at + s.len as u64 * es, i)
        })
        .collect();
    runs.sort_unstable();
    // The run reaching furthest so far: any later start before its end overlaps it.
    let mut reach: Option<(u64, usize)> = None;
    for &(start, end, i) in &runs {
        if let Some((_, j)) = reach.filter(|&(far, _)| start < far) {
            let side = if copy_in { "packed".to_string() } else { format!("buffer {}", segments[i].buffer) };
            return Err(KernelError::OverlappingDestinations {
                kernel,
                first: i.min(j),
                second: i.max(j),
                side,
            });
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, i));
        }
    }
    Ok(())
}

/// Grid size for `items` work items (at least one block, at most [`MAX_GRID_BLOCKS`]).
pub fn grid_for(items: u64, per_block: u64) -> u32 {
    items.div_ceil(per_block.max(1)).clamp(1, MAX_GRID_BLOCKS as u64) as u32
}

const fn type_index(t: ElemType) -> usize {
    match t {
        ElemType::F32 => 0,
        ElemType::F16 => 1,
        ElemType::BF16 => 2,
    }
}

/// The kernels loaded into one CUDA context.
///
/// Created with the context current on the calling thread; every launch must happen with that
/// context current and on a stream of that context. The module is unloaded on drop (an error
/// there is ignored: the context is going away with it).
#[derive(Debug)]
pub struct KernelModule {
    modules: Vec<cusys::CUmodule>,
    copy_in: cusys::CUfunction,
    copy_out: cusys::CUfunction,
    reduce: [cusys::CUfunction; 3],
    accumulate: [cusys::CUfunction; 3],
    divide: [cusys::CUfunction; 3],
    cast: [[cusys::CUfunction; 3]; 3],
    arch: u32,
    kind: CodeKind,
}

// SAFETY: CUmodule and CUfunction are driver handles usable from any thread (with the owning
// context current); the struct has no interior mutability.
unsafe impl Send for KernelModule {}
// SAFETY: as above; launches only read the handles.
unsafe impl Sync for KernelModule {}

/// `launch!(self, "name", function, (items, per_block), stream, [a, b, ..])`: nothing for zero
/// items; else copies each argument into a local and launches `function` on
/// `grid_for(items, per_block)` blocks with pointers to them, in order (the kernel's signature).
macro_rules! launch {
    ($self:ident, $name:literal, $f:expr, ($items:expr, $per_block:expr), $stream:expr, [$($arg:ident),+]) => {{
        let items: u64 = $items;
        if items == 0 {
            return Ok(());
        }
        $(let mut $arg = $arg;)+
        let mut params = [$((&raw mut $arg).cast::<c_void>()),+];
        $self.launch($name, $f, grid_for(items, $per_block), $stream, &mut params)
    }};
}

impl KernelModule {
    /// Compiles (once per process, see [`compiled`]) and loads every kernel for a device of
    /// compute capability `arch` (e.g. 80) into the context current on this thread.
    ///
    /// The images of [`load_targets`]: first a CUBIN for `sm_{arch}` (no JIT, so a driver older
    /// than NVRTC is fine); if NVRTC does not know that GPU or the driver refuses the CUBIN,
    /// PTX for `compute_80` (JIT, for GPUs newer than NVRTC; the newest supported
    /// `compute_` at or below `arch` for older GPUs).
    ///
    /// # Errors
    /// [`CudaKernelError`] if a library is missing, NVRTC fails or supports no image for
    /// `arch` ([`CudaKernelError::UnsupportedArch`]), or the driver refuses both images (no
    /// current context, a driver older than the PTX).
    pub fn load(arch: u32) -> Result<Self, CudaKernelError> {
        loader::driver()?;
        let targets = load_targets(arch, supported_archs()?);
        let mut first_err = None;
        if let Some(cubin) = targets.cubin {
            match compiled(cubin, CodeKind::Cubin).and_then(|k| Self::load_images(&k)) {
                Ok(m) => return Ok(m),
                Err(CudaKernelError::Load(e)) => return Err(CudaKernelError::Load(e)),
                Err(e) => first_err = Some(e),
            }
        }
        if let Some(ptx) = targets.ptx {
            match compiled(ptx, CodeKind::Ptx).and_then(|k| Self::load_images(&k)) {
                Ok(m) => return Ok(m),
                Err(e) => return Err(first_err.unwrap_or(e)),
            }
        }
        // Neither image exists when NVRTC does not support `arch` or anything older.
        Err(first_err.unwrap_or_else(|| nvrtc::unsupported_arch(arch)))
    }

    fn load_images(compiled: &CompiledKernels) -> Result<Self, CudaKernelError> {
        let arch = compiled.arch;
        let mut modules = Vec::new();
        let mut functions: HashMap<&'static str, cusys::CUfunction> = HashMap::new();
        let drv = |what: String| move |source: DriverCallError| CudaKernelError::Driver { what, source };
        let result = (|| {
            for (src, image) in &compiled.images {
                // SAFETY: `image` is a whole CUBIN or a NUL-terminated PTX image that lives
                // across the call.
                let module = unsafe { cu::module::load_data(image.as_ptr().cast::<c_void>()) }
                    .map_err(|e| DriverCallError::new("cuModuleLoadData", e))
                    .map_err(drv(format!("{} ({:?}, arch {arch})", src.file, compiled.kind)))?;
                modules.push(module);
                for name in src.kernels {
                    let cname = CString::new(*name).unwrap_or_default();
                    // SAFETY: `module` was just loaded and is not unloaded before the lookup.
                    let f = unsafe { cu::module::get_function(module, cname) }
                        .map_err(|e| DriverCallError::new("cuModuleGetFunction", e))
                        .map_err(drv(format!("kernel {name} of {}", src.file)))?;
                    functions.insert(name, f);
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            for m in &modules {
                // SAFETY: each module was loaded above and is unloaded once, here.
                let _ = unsafe { cu::module::unload(*m) };
            }
            return Err(e);
        }
        let get = |n: &str| functions.get(n).copied().unwrap_or(std::ptr::null_mut());
        let names = ["f32", "f16", "bf16"];
        Ok(KernelModule {
            copy_in: get("collsched_copy_in"),
            copy_out: get("collsched_copy_out"),
            reduce: names.map(|t| get(&format!("collsched_reduce_{t}"))),
            accumulate: names.map(|t| get(&format!("collsched_accumulate_{t}"))),
            divide: names.map(|t| get(&format!("collsched_divide_{t}"))),
            cast: names.map(|f| names.map(|t| get(&format!("collsched_cast_{f}_to_{t}")))),
            modules,
            arch,
            kind: compiled.kind,
        })
    }

    /// What was loaded: a CUBIN for the device, or PTX.
    pub fn kind(&self) -> CodeKind {
        self.kind
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// Launches `f` with `params` (pointers to the argument values, as `cuLaunchKernel`
    /// takes them); use the `launch!` macro, which builds them from the arguments.
    fn launch(
        &self,
        api_kernel: &'static str,
        f: cusys::CUfunction,
        grid: u32,
        stream: cusys::CUstream,
        params: &mut [*mut c_void],
    ) -> Result<(), DriverCallError> {
        // SAFETY: `f` belongs to this module (loaded in the current context), the parameters
        // point at live locals of the caller matching the kernel's signature; the caller of the
        // public unsafe launch functions guarantees the device pointers and the stream.
        let r = unsafe { cu::launch_kernel(f, (grid, 1, 1), (BLOCK_THREADS, 1, 1), 0, stream, params) };
        r.map_err(|e| DriverCallError::new("cuLaunchKernel", e)).map_err(|mut e| {
            e.description = format!("{} ({api_kernel})", e.description);
            e
        })
    }

    /// Copy-in: packs the runs of a [`DeviceSegment`] table (`count` entries at `table`) into
    /// `packed`, in one launch on `stream`.
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// `table` holds `count` valid entries in device memory, every `many` run is readable,
    /// `packed` is writable for every `packed + bytes`; all stay valid until the launch has
    /// completed on `stream`, which belongs to this module's context.
    pub unsafe fn copy_in(
        &self,
        stream: cusys::CUstream,
        table: u64,
        count: u32,
        packed: u64,
    ) -> Result<(), DriverCallError> {
        launch!(self, "collsched_copy_in", self.copy_in, (count as u64, 1), stream, [table, count, packed])
    }

    /// Copy-out: the reverse of [`KernelModule::copy_in`].
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// As [`KernelModule::copy_in`], with the `many` runs writable and `packed` readable.
    pub unsafe fn copy_out(
        &self,
        stream: cusys::CUstream,
        table: u64,
        count: u32,
        packed: u64,
    ) -> Result<(), DriverCallError> {
        launch!(self, "collsched_copy_out", self.copy_out, (count as u64, 1), stream, [table, count, packed])
    }

    /// Reduce: `out[i] = (sum_k inputs[k][i] / pre_divide) / post` over `n` elements of `ty`,
    /// where `inputs` is a device array of `count` device pointers and `post` is what
    /// [`reduce_post_divisor`] returns.
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// `inputs` holds `count` device pointers, each to `n` readable elements; `out` has `n`
    /// writable elements (it may be one of the inputs); all stay valid until the launch has
    /// completed on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        stream: cusys::CUstream,
        ty: ElemType,
        out: u64,
        inputs: u64,
        count: u32,
        n: u64,
        pre_divide: f32,
        post: f32,
    ) -> Result<(), DriverCallError> {
        launch!(
            self,
            "collsched_reduce",
            self.reduce[type_index(ty)],
            (n, BLOCK_THREADS as u64),
            stream,
            [out, inputs, count, n, pre_divide, post]
        )
    }

    /// Accumulate: `acc[i] += src[i]` over `n` elements of `ty`, in `f32`, rounded once.
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// `acc` and `src` have `n` elements (read-write and read) valid until the launch has
    /// completed on `stream`.
    pub unsafe fn accumulate(
        &self,
        stream: cusys::CUstream,
        ty: ElemType,
        acc: u64,
        src: u64,
        n: u64,
    ) -> Result<(), DriverCallError> {
        launch!(
            self,
            "collsched_accumulate",
            self.accumulate[type_index(ty)],
            (n, BLOCK_THREADS as u64),
            stream,
            [acc, src, n]
        )
    }

    /// Divide in place: `data[i] = data[i] / divisor` over `n` elements of `ty` (in `f32`,
    /// rounded once): a collective's pre- or post-divide, as the one-input case of reduce.
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// `data` has `n` read-write elements valid until the launch has completed on `stream`.
    pub unsafe fn divide(
        &self,
        stream: cusys::CUstream,
        ty: ElemType,
        data: u64,
        n: u64,
        divisor: f32,
    ) -> Result<(), DriverCallError> {
        launch!(
            self,
            "collsched_divide",
            self.divide[type_index(ty)],
            (n, BLOCK_THREADS as u64),
            stream,
            [data, n, divisor]
        )
    }

    /// Cast: `dst[i] = to(from(src[i]))` over `n` elements, rounding to nearest even.
    ///
    /// # Errors
    /// The driver's launch error.
    ///
    /// # Safety
    /// `src` has `n` readable `from` elements and `dst` `n` writable `to` elements, valid until
    /// the launch has completed on `stream`.
    pub unsafe fn cast(
        &self,
        stream: cusys::CUstream,
        from: ElemType,
        src: u64,
        to: ElemType,
        dst: u64,
        n: u64,
    ) -> Result<(), DriverCallError> {
        launch!(
            self,
            "collsched_cast",
            self.cast[type_index(from)][type_index(to)],
            (n, BLOCK_THREADS as u64),
            stream,
            [src, dst, n]
        )
    }
}

impl Drop for KernelModule {
    fn drop(&mut self) {
        for m in self.modules.drain(..) {
            // SAFETY: each module was loaded by `load` and is unloaded exactly once, here. An
            // error (context already destroyed) leaves nothing to clean up.
            let _ = unsafe { cu::module::unload(m) };
        }
    }
}

/// The divisor the reduce kernel applies to the sum: `post_divide` for a sum and
/// `post_divide * inputs` (as `f32`) for an average, exactly as the CPU [`crate::reduce`] does.
pub fn reduce_post_divisor(op: crate::ReduceOp, scaling: crate::Scaling, inputs: usize) -> f32 {
    match op {
        crate::ReduceOp::Sum => scaling.post_divide,
        crate::ReduceOp::Avg => scaling.post_divide * inputs as f32,
    }
}

/// Returns the string `CStr` of a driver-owned C string, or `""` for null.
///
/// # Safety
/// `p` is null or points at a NUL-terminated string that outlives the returned reference.
pub unsafe fn c_str<'a>(p: *const std::ffi::c_char) -> &'a str {
    if p.is_null() {
        return "";
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("(not UTF-8)")
}

#[cfg(test)]
mod tests;
