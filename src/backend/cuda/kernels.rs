//! The CUDA backend's own kernels on its streams: copy-in, copy-out, reduce, accumulate and
//! cast on device buffers (the CUDA C twins of the CPU kernels), with their scratch uploads.
//!
//! An argument table (copy pieces, input pointers) goes to a device scratch buffer of the pool
//! through pinned host staging (`super::staging`): the copy never blocks the host, and the
//! staging block is reused only once the copy that read it completed. The scratch buffer goes
//! back to the pool behind the kernel's event.

use collsched_kernels::cuda::{device_segments, reduce_post_divisor, DeviceRegion, DeviceSegment};
use collsched_kernels::{CopySegment, ElemType, ReduceOp, Scaling};

use super::{CudaBackend, CudaBuffer, CudaError, CudaEvent, StreamHandle};
use crate::backend::Stream;

impl CudaBackend {
    pub(super) fn upload<T: bytemuck::Pod>(
        &self,
        stream: &StreamHandle,
        data: &[T],
    ) -> Result<CudaBuffer, CudaError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buf = self.pool.alloc(bytes.len().max(1))?;
        // SAFETY: `buf` has at least `bytes.len()` bytes and goes back to the pool only behind
        // the kernel's event (`finish_kernel`), which follows the copy on `stream`.
        unsafe { self.staging.copy_to_device(stream, buf.ptr(), bytes) }?;
        Ok(buf)
    }

    pub(super) fn finish_kernel(
        &self,
        stream: &StreamHandle,
        scratch: Vec<CudaBuffer>,
    ) -> Result<CudaEvent, CudaError> {
        let event = stream.record()?;
        for b in scratch {
            self.pool.free_after(b, std::slice::from_ref(&event));
        }
        Ok(event)
    }

    /// Copy-in on `stream`: packs runs of `sources` into `packed` ([`collsched_kernels::copy_in`]
    /// semantics, one launch for every segment); offsets count elements of `elem_size` bytes.
    /// Returns the event after the copy.
    ///
    /// # Errors
    /// [`CudaError::KernelInput`] for the same bad segments the CPU kernel refuses (nothing is
    /// launched then); kernel or driver errors.
    pub fn copy_in(
        &self,
        stream: Stream,
        packed: &CudaBuffer,
        sources: &[&CudaBuffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.copy(stream, "copy_in", packed, sources, segments, elem_size)
    }

    /// Copy-out on `stream`: unpacks runs of `packed` into `destinations`
    /// ([`collsched_kernels::copy_out`] semantics). Returns the event after the copy.
    ///
    /// # Errors
    /// As [`CudaBackend::copy_in`].
    pub fn copy_out(
        &self,
        stream: Stream,
        destinations: &[&CudaBuffer],
        packed: &CudaBuffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.copy(stream, "copy_out", packed, destinations, segments, elem_size)
    }

    pub(super) fn copy(
        &self,
        stream: Stream,
        kernel: &'static str,
        packed: &CudaBuffer,
        many: &[&CudaBuffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        // (Divides by 1 for an element size of 0, which `device_segments` refuses by name.)
        let es = elem_size.max(1);
        let regions: Vec<DeviceRegion> =
            many.iter().map(|b| DeviceRegion { ptr: b.ptr(), len: b.len() / es }).collect();
        let table: Vec<DeviceSegment> =
            device_segments(kernel, segments, &regions, packed.len() / es, elem_size).map_err(|source| {
                CudaError::KernelInput { context: format!("rank {}", self.rank), source: Box::new(source) }
            })?;
        let count = u32::try_from(table.len()).map_err(|_| CudaError::Invalid {
            op: format!("rank {}: {kernel}", self.rank),
            what: format!("{} copy pieces do not fit one launch; split the bucket", table.len()),
        })?;
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        let t = self.upload(s, &table)?;
        // SAFETY: the table and every run were checked against the buffers' lengths; the
        // buffers are the caller's and must stay alive until the returned event completed (the
        // table is freed after it).
        let r = unsafe {
            if kernel == "copy_in" {
                k.copy_in(s.raw(), t.ptr(), count, packed.ptr())
            } else {
                k.copy_out(s.raw(), t.ptr(), count, packed.ptr())
            }
        };
        r.map_err(|e| CudaError::driver(format!("rank {}: {kernel}", self.rank), e))?;
        self.finish_kernel(s, vec![t])
    }

    /// Reduce on `stream`: `out = (sum_k inputs[k] / pre) / post` element-wise
    /// ([`collsched_kernels::reduce`] semantics, bit for bit except NaN payloads; `out` may be
    /// one of the inputs). Returns the event after it.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for no inputs or lengths that differ; kernel or driver errors.
    pub fn reduce(
        &self,
        stream: Stream,
        ty: ElemType,
        op: ReduceOp,
        scaling: Scaling,
        out: &CudaBuffer,
        inputs: &[&CudaBuffer],
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        let bad = |what: String| CudaError::Invalid { op: format!("rank {}: reduce", self.rank), what };
        if inputs.is_empty() {
            return Err(bad("no inputs".into()));
        }
        if !out.len().is_multiple_of(ty.size()) {
            return Err(bad(format!(
                "the output has {} bytes, not a multiple of {} ({})",
                out.len(),
                ty.size(),
                ty.name()
            )));
        }
        if let Some((k, i)) = inputs.iter().enumerate().find(|(_, i)| i.len() != out.len()) {
            return Err(bad(format!("input {k} has {} bytes, the output {}", i.len(), out.len())));
        }
        let count = u32::try_from(inputs.len()).map_err(|_| bad("too many inputs".into()))?;
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        let ptrs: Vec<u64> = inputs.iter().map(|b| b.ptr()).collect();
        let t = self.upload(s, &ptrs)?;
        let n = (out.len() / ty.size()) as u64;
        let post = reduce_post_divisor(op, scaling, inputs.len());
        // SAFETY: lengths checked above; the buffers must stay alive until the event completed.
        unsafe { k.reduce(s.raw(), ty, out.ptr(), t.ptr(), count, n, scaling.pre_divide, post) }
            .map_err(|e| CudaError::driver(format!("rank {}: reduce", self.rank), e))?;
        self.finish_kernel(s, vec![t])
    }

    /// Accumulate on `stream`: `acc += src` ([`collsched_kernels::accumulate`] semantics).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for lengths that differ; kernel or driver errors.
    pub fn accumulate(
        &self,
        stream: Stream,
        ty: ElemType,
        acc: &CudaBuffer,
        src: &CudaBuffer,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        if acc.len() != src.len() || !acc.len().is_multiple_of(ty.size()) {
            return Err(CudaError::Invalid {
                op: format!("rank {}: accumulate", self.rank),
                what: format!(
                    "source has {} bytes, the accumulator {} ({})",
                    src.len(),
                    acc.len(),
                    ty.name()
                ),
            });
        }
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        // SAFETY: lengths checked; the buffers must stay alive until the event completed.
        unsafe { k.accumulate(s.raw(), ty, acc.ptr(), src.ptr(), (acc.len() / ty.size()) as u64) }
            .map_err(|e| CudaError::driver(format!("rank {}: accumulate", self.rank), e))?;
        self.finish_kernel(s, Vec::new())
    }

    /// Cast on `stream`: `dst = to(from(src))`, round to nearest even ([`collsched_kernels::cast`]).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for element counts that differ; kernel or driver errors.
    pub fn cast(
        &self,
        stream: Stream,
        from: ElemType,
        src: &CudaBuffer,
        to: ElemType,
        dst: &CudaBuffer,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        let n = src.len() / from.size();
        if !src.len().is_multiple_of(from.size()) || dst.len() != n * to.size() {
            return Err(CudaError::Invalid {
                op: format!("rank {}: cast", self.rank),
                what: format!(
                    "source has {} bytes of {}, destination {} bytes of {}",
                    src.len(),
                    from.name(),
                    dst.len(),
                    to.name()
                ),
            });
        }
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        // SAFETY: lengths checked; the buffers must stay alive until the event completed.
        unsafe { k.cast(s.raw(), from, src.ptr(), to, dst.ptr(), n as u64) }
            .map_err(|e| CudaError::driver(format!("rank {}: cast", self.rank), e))?;
        self.finish_kernel(s, Vec::new())
    }
}
