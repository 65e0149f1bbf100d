//! [`Region`]: a span of memory the library owns (a shard, a gathered parameter), exported to
//! Python through the buffer protocol (`torch.frombuffer` views it without a copy) and as a
//! DLPack capsule (`torch.from_dlpack(region.dlpack(dtype, shape))`: a typed, shaped tensor in
//! one step, the exchange that also carries device memory).
//!
//! This file holds the crate's `unsafe`: filling a `Py_buffer`, the DLPack capsule and its
//! deleters, and reading a tensor's memory given by address (`tensor_bytes`).

use std::ffi::{c_void, CStr};
use std::os::raw::c_int;

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The DLPack structures this file exports (DLPack's unversioned ABI, `dlpack.h` v0.8: what
/// every consumer reads, torch's `from_dlpack` included).
mod dl {
    use std::ffi::c_void;

    /// `kDLCPU`.
    pub const CPU: i32 = 1;
    /// `kDLCUDA`.
    pub const CUDA: i32 = 2;
    /// `kDLFloat`.
    pub const FLOAT: u8 = 2;
    /// `kDLBfloat`.
    pub const BFLOAT: u8 = 4;

    #[repr(C)]
    pub struct Device {
        pub device_type: i32,
        pub device_id: i32,
    }

    #[repr(C)]
    pub struct DataType {
        pub code: u8,
        pub bits: u8,
        pub lanes: u16,
    }

    #[repr(C)]
    pub struct Tensor {
        pub data: *mut c_void,
        pub device: Device,
        pub ndim: i32,
        pub dtype: DataType,
        pub shape: *mut i64,
        /// Null: compact and row-major.
        pub strides: *mut i64,
        pub byte_offset: u64,
    }

    #[repr(C)]
    pub struct ManagedTensor {
        pub dl_tensor: Tensor,
        pub manager_ctx: *mut c_void,
        pub deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
    }
}

/// The capsule's name before a consumer takes the tensor (it renames it `used_dltensor`).
const DLTENSOR: &CStr = c"dltensor";

/// One exported tensor: the DLPack header first (its address is the capsule's pointer), the
/// shape it points to, and the region it views (kept alive until the deleter runs).
#[repr(C)]
struct Exported {
    managed: dl::ManagedTensor,
    shape: Vec<i64>,
    _region: Py<PyAny>,
}

/// The tensor's deleter: its consumer calls it when done (torch, when the tensor is freed, on
/// whatever thread, and with the interpreter's lock held or not: torch 2.11 frees a tensor's
/// storage with the lock released, inside a call that PyO3 counts as attached).
///
/// # Safety
/// `m` came from [`Region::dlpack`] (a leaked `Box<Exported>`) and is deleted once.
unsafe extern "C" fn delete_exported(m: *mut dl::ManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` is the first field of a `#[repr(C)] Exported` leaked by `Region::dlpack`, so
    // it is that box's pointer; DLPack calls the deleter once.
    let exported = unsafe { Box::from_raw(m.cast::<Exported>()) };
    // The region's reference goes now, with the lock taken for real: PyO3's own check reads
    // its count of attached calls on this thread, which a C++ caller that released the lock
    // inside such a call leaves above zero (a reference dropped then is freed without a thread
    // state: a crash). An interpreter no longer running keeps the reference (a leak at exit).
    // SAFETY: `Py_IsInitialized` may be called at any time; `PyGILState_Ensure` attaches this
    // thread (taking the lock back where this thread released it, making a thread state for a
    // thread that has none) and `PyGILState_Release` restores exactly the state before, in
    // pairs. Not covered: an interpreter that begins to finalize between the check and the
    // attach, where a thread other than the main one ends inside `PyGILState_Ensure` (the
    // limited API of 3.11 has no `Py_IsFinalizing` to check first).
    unsafe {
        if ffi::Py_IsInitialized() == 0 {
            std::mem::forget(exported);
            return;
        }
        let gil = ffi::PyGILState_Ensure();
        // Attached now: PyO3 frees the reference at once (inside a `__traverse__`, where PyO3
        // refuses to attach, the closure does not run and the reference waits in PyO3's pool).
        let _ = Python::try_attach(move |_| drop(exported));
        ffi::PyGILState_Release(gil);
    }
}

/// The capsule's destructor: deletes the tensor if no consumer took it (the capsule still has
/// its first name); a consumer that renamed it owns the tensor and deletes it itself.
///
/// # Safety
/// Called by the interpreter with the capsule being destroyed, the GIL held.
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (the interpreter's call); `PyCapsule_IsValid` sets no
    // error, and with the name valid `PyCapsule_GetPointer` returns the pointer stored by
    // `Region::dlpack`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()).cast::<dl::ManagedTensor>();
            delete_exported(m);
        }
    }
}

/// A span of library memory: `len` bytes at `addr`, alive as long as `owner` (the Python
/// object whose Rust value owns the memory: a model for its shards and its gathered buffers).
///
/// Python sees a one-dimensional, writable byte buffer (`memoryview(region)`,
/// `torch.frombuffer(region, dtype=...)`); the buffer keeps the region, and so the owner,
/// alive. What the bytes mean over time is the owner's contract: a shard is the optimizer's
/// for the model's life; a gathered parameter is valid until it is released.
#[pyclass(module = "collsched._native", frozen)]
pub struct Region {
    addr: usize,
    len: usize,
    /// The CUDA device the memory is on, `None` for host memory.
    device: Option<usize>,
    /// Memory of an emulated device (`World.emulated()`): host memory the bindings treat as
    /// device memory (no buffer protocol), exported to DLPack as the host's.
    emulated: bool,
    /// Keeps the memory's owner alive.
    _owner: Py<PyAny>,
}

impl Region {
    /// A region of `len` bytes of host memory at `addr`, owned by `owner`'s value.
    pub fn new(owner: Py<PyAny>, addr: *const u8, len: usize) -> Region {
        Region::on(owner, addr, len, None, false)
    }

    /// A region of `len` bytes at `addr` on CUDA device `device` (`None`: host memory), owned
    /// by `owner`'s value; `emulated`: the device is the emulated one (its memory is the
    /// host's, exported as such to DLPack, never as a host buffer).
    pub fn on(
        owner: Py<PyAny>,
        addr: *const u8,
        len: usize,
        device: Option<usize>,
        emulated: bool,
    ) -> Region {
        Region { addr: addr as usize, len, device, emulated, _owner: owner }
    }
}

#[pymethods]
impl Region {
    /// Bytes in the region.
    fn __len__(&self) -> usize {
        self.len
    }

    /// The address of the first byte (for checks: two views of one region share it).
    #[getter]
    fn address(&self) -> usize {
        self.addr
    }

    /// The device the region is on: the CUDA device's ordinal (0 for the emulated device),
    /// `None` for host memory.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }

    /// Whether the device is the emulated one (`World.emulated()`).
    #[getter]
    fn emulated(&self) -> bool {
        self.emulated
    }

    /// The buffer protocol: a writable, contiguous byte buffer over the region.
    ///
    /// # Safety
    /// Called by the interpreter with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (addr, len) = {
            let r = slf.get();
            if let Some(d) = r.device {
                let what =
                    if r.emulated { "the emulated device".to_string() } else { format!("CUDA device {d}") };
                return Err(PyValueError::new_err(format!(
                    "a region on {what} has no host buffer; view it with torch.from_dlpack(region.dlpack(...))"
                )));
            }
            (r.addr, r.len)
        };
        let len = isize::try_from(len).map_err(|_| PyValueError::new_err("region too large for a buffer"))?;
        // SAFETY: `view` is the interpreter's, valid for writing; `addr..addr+len` is memory
        // the owner keeps alive for as long as this object lives, and PyBuffer_FillInfo stores
        // a new reference to this object in the view (so the memory outlives every consumer).
        // A zero-length region may have a dangling (never dereferenced) address.
        let rc = unsafe { pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), addr as *mut _, len, 0, flags) };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Nothing to undo: the view's reference to this object is dropped by the interpreter.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    /// A DLPack capsule viewing the region's first bytes as a contiguous, row-major tensor of
    /// `dtype` ("f32", "bf16" or "f16") and `shape`: `torch.from_dlpack(capsule)` makes it a
    /// tensor without a copy, which keeps the region (and so the memory's owner) alive. One
    /// consumer may take a capsule; one that nobody takes frees what it holds when dropped. A
    /// region on a CUDA device gives a `kDLCUDA` tensor of that device.
    fn dlpack(slf: Bound<'_, Self>, dtype: &str, shape: Vec<i64>) -> PyResult<Py<PyAny>> {
        let (code, bits) = match dtype {
            "f32" => (dl::FLOAT, 32u8),
            "f16" => (dl::FLOAT, 16),
            "bf16" => (dl::BFLOAT, 16),
            other => {
                return Err(PyValueError::new_err(format!(
                    "dlpack: dtype {other:?}; the regions hold \"f32\", \"bf16\" or \"f16\""
                )))
            }
        };
        let bytes = shape.iter().try_fold(usize::from(bits / 8), |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        });
        let (addr, len, device) = {
            let r = slf.get();
            (r.addr, r.len, if r.emulated { None } else { r.device })
        };
        let device = match device {
            None => dl::Device { device_type: dl::CPU, device_id: 0 },
            Some(d) => dl::Device {
                device_type: dl::CUDA,
                device_id: i32::try_from(d)
                    .map_err(|_| PyValueError::new_err("dlpack: device ordinal too large"))?,
            },
        };
        match bytes {
            Some(b) if b <= len => {}
            _ => {
                return Err(PyValueError::new_err(format!(
                    "dlpack: a {dtype} tensor of shape {shape:?} does not fit a region of {len} bytes"
                )))
            }
        }
        let ndim =
            i32::try_from(shape.len()).map_err(|_| PyValueError::new_err("dlpack: too many dimensions"))?;
        let mut exported = Box::new(Exported {
            managed: dl::ManagedTensor {
                dl_tensor: dl::Tensor {
                    data: addr as *mut c_void,
                    device,
                    ndim,
                    dtype: dl::DataType { code, bits, lanes: 1 },
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_exported),
            },
            shape,
            _region: slf.clone().into_any().unbind(),
        });
        // The shape's heap buffer does not move with the box.
        exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
        let raw = Box::into_raw(exported);
        // SAFETY: `raw` is a valid `Exported` whose first field is the DLPack header the capsule
        // hands out; `drop_capsule` and the deleter free it exactly once between them (the
        // capsule's destructor only while no consumer renamed it). The region it views is kept
        // alive by the reference inside, so the memory outlives every tensor made from it.
        unsafe {
            (*raw).managed.manager_ctx = raw.cast();
            let capsule = ffi::PyCapsule_New(raw.cast(), DLTENSOR.as_ptr(), Some(drop_capsule));
            if capsule.is_null() {
                delete_exported(raw.cast());
                return Err(PyErr::fetch(slf.py()));
            }
            Ok(Bound::from_owned_ptr(slf.py(), capsule).unbind())
        }
    }
}

/// Where a tensor the engine hands over lies: `len` bytes at `addr`, on the host (`device`
/// `None`) or on CUDA device `device`. Read from the tensor itself ([`tensor_span`]), never
/// from an address the caller asserts is host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSpan {
    /// The first byte (`t.data_ptr()`).
    pub addr: usize,
    /// Bytes (`t.nbytes`).
    pub len: usize,
    /// The CUDA device the bytes are on, `None` for host memory.
    pub device: Option<usize>,
}

/// DLPack's `kDLCUDAHost`: page-locked host memory, readable by the host.
const DL_CUDA_HOST: i32 = 3;

/// Where tensor `t` lies, by its own account: a torch tensor's `is_cuda` / `is_cpu` and
/// `get_device()` (attribute reads in C, a twentieth of the next one's cost: this runs for
/// every gradient and every collective's tensor), otherwise `__dlpack_device__()` (DLPack's
/// device type and ordinal, which torch and every array library answer); then `data_ptr()`
/// and `nbytes`. `what` names the tensor in errors (e.g. "parameter h.0.weight's initial
/// value").
///
/// # Errors
/// A tensor that is not contiguous, or on a device that is neither the host nor CUDA.
pub fn tensor_span(t: &Bound<'_, PyAny>, what: &str) -> PyResult<TensorSpan> {
    let py = t.py();
    let flag = |name: &Bound<'_, PyString>| t.getattr(name).and_then(|v| v.extract::<bool>()).ok();
    let device = match (flag(intern!(py, "is_cuda")), flag(intern!(py, "is_cpu"))) {
        (Some(true), _) => {
            let ordinal: i64 = t.call_method0(intern!(py, "get_device"))?.extract()?;
            Some(cuda_ordinal(ordinal, what)?)
        }
        (Some(false), Some(true)) => None,
        _ => dlpack_device(t, what)?,
    };
    if !t.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!("{what}: not contiguous; pass t.contiguous()")));
    }
    let addr = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let len = t.getattr(intern!(py, "nbytes"))?.extract()?;
    Ok(TensorSpan { addr, len, device })
}

/// The device of `t` by DLPack's `__dlpack_device__()`: `None` for the host, or a CUDA
/// ordinal; any other device is refused, named by its DLPack type.
fn dlpack_device(t: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<usize>> {
    let (kind, ordinal): (i32, i64) = t.call_method0("__dlpack_device__")?.extract()?;
    match kind {
        dl::CPU | DL_CUDA_HOST => Ok(None),
        dl::CUDA => Ok(Some(cuda_ordinal(ordinal, what)?)),
        other => Err(PyValueError::new_err(format!(
            "{what}: on a device of DLPack type {other}; collsched takes host (CPU) and CUDA tensors"
        ))),
    }
}

fn cuda_ordinal(ordinal: i64, what: &str) -> PyResult<usize> {
    usize::try_from(ordinal)
        .map_err(|_| PyValueError::new_err(format!("{what}: CUDA device ordinal {ordinal} is not a device")))
}

/// The place of a device name for messages: `cpu` or `cuda:N`.
fn place(device: Option<usize>) -> String {
    device.map_or_else(|| "cpu".to_string(), |d| format!("cuda:{d}"))
}

/// The bytes of tensor `t` in host memory, for the duration of one call; `what` names it.
///
/// # Errors
/// A tensor on a CUDA device (its address is not host memory: reading it would be a crash or
/// garbage), or one [`tensor_span`] refuses.
///
/// # Safety
/// Nothing may write the tensor's memory while the slice is alive: the caller holds `t` (so
/// the memory stays allocated) and does not return to Python before it is done with the
/// bytes.
pub unsafe fn host_tensor_bytes<'a>(t: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a [u8]> {
    let span = tensor_span(t, what)?;
    if span.device.is_some() {
        return Err(PyValueError::new_err(format!(
            "{what}: on {}, where the library reads it from host memory; move it to the CPU first \
             (t.to(\"cpu\"))",
            place(span.device)
        )));
    }
    // SAFETY: the tensor says it is contiguous host memory of `span.len` bytes at `span.addr`;
    // it stays allocated while `t` is held ('a), and the caller's contract keeps writers out.
    Ok(unsafe { tensor_bytes(span.addr, span.len) })
}

/// The bytes of a tensor the engine hands over by address (`t.data_ptr()`, `t.numel() *
/// t.element_size()`), for the duration of one call.
///
/// # Safety
/// `addr..addr+len` must be readable memory that nothing writes during the call: the caller
/// passes a contiguous CPU tensor it holds a reference to, and the call does not return to
/// Python before it is done with the bytes.
pub unsafe fn tensor_bytes<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract above.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The bytes of a tensor the engine hands over by address, for writing a result into it.
///
/// # Safety
/// `addr..addr+len` must be writable memory of a contiguous CPU tensor that stays alive and
/// that nothing else reads or writes during the call (torch reads a collective's output only
/// after its work was waited for, and the Python work object holds the tensor until then).
pub unsafe fn tensor_bytes_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract above.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
