//! [`Region`]: a span of memory the library owns (a shard, a gathered parameter), exported to
//! Python through the buffer protocol so that `torch.frombuffer` views it without a copy.
//!
//! This file holds the crate's `unsafe`: filling a `Py_buffer`, and reading a tensor's memory
//! given by address (`tensor_bytes`).

use std::os::raw::c_int;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

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
    /// Keeps the memory's owner alive.
    _owner: Py<PyAny>,
}

impl Region {
    /// A region of `len` bytes at `addr`, owned by `owner`'s value.
    pub fn new(owner: Py<PyAny>, addr: *const u8, len: usize) -> Region {
        Region { addr: addr as usize, len, _owner: owner }
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
