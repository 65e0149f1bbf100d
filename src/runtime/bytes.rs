//! [`Bytes`]: the host byte buffers of the runtime (shards, gradient shards, accumulators, a
//! device backend's gradient staging).

/// A byte buffer aligned to 8 bytes (so it can be viewed as `f32`, `f16` or `bf16`), grown
/// but never shrunk, so reuse allocates nothing.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bytes {
    words: Vec<u64>,
    len: usize,
}

impl Bytes {
    pub(crate) fn zeroed(len: usize) -> Bytes {
        Bytes { words: vec![0; len.div_ceil(8)], len }
    }

    /// Sets the length to `len` bytes, all zero (allocates only when growing).
    pub(crate) fn reset_zeroed(&mut self, len: usize) {
        let words = len.div_ceil(8);
        self.words.clear();
        self.words.resize(words, 0);
        self.len = len;
    }

    /// Sets the length to `len` bytes, keeping what the first `len` held (bytes past the old
    /// length are zero; allocates only when growing).
    pub(crate) fn resize(&mut self, len: usize) {
        self.words.resize(len.div_ceil(8), 0);
        self.len = len;
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..len]
    }
}
