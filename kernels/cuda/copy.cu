// Batched copy-in and copy-out: one launch moves every segment of a bucket.
//
// The host resolves each CopySegment (kernels/src/elem.rs) to a DeviceSegment: the address of
// the run in its many-side buffer (a parameter, a shard), the byte offset of the run in the one
// packed buffer (a collective's send or receive buffer) and its length in bytes. Long runs are
// split by the host into pieces of at most COPY_CHUNK_BYTES, so the blocks of the grid walk the
// table (block b takes pieces b, b + gridDim.x, ...) with balanced work. Within a piece the
// threads of the block copy 16, 4 or 1 bytes at a time, whichever the alignment of both ends
// and of the length allows. Byte-exact: nothing is converted.
//
// Layout must match `DeviceSegment` in kernels/src/cuda/mod.rs (three 64-bit words).

struct DeviceSegment {
    unsigned long long many;    // device address in the many-side buffer (already offset)
    unsigned long long packed;  // byte offset in the packed buffer
    unsigned long long bytes;   // length of the run in bytes
};

__device__ __forceinline__ void copy_run(char* dst, const char* src, unsigned long long bytes) {
    const unsigned long long first = threadIdx.x;
    const unsigned long long stride = blockDim.x;
    const unsigned long long bits =
        (unsigned long long)dst | (unsigned long long)src | bytes;
    if ((bits & 15ull) == 0) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        const unsigned long long n = bytes >> 4;
        for (unsigned long long i = first; i < n; i += stride) d[i] = s[i];
    } else if ((bits & 3ull) == 0) {
        unsigned int* d = reinterpret_cast<unsigned int*>(dst);
        const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
        const unsigned long long n = bytes >> 2;
        for (unsigned long long i = first; i < n; i += stride) d[i] = s[i];
    } else {
        for (unsigned long long i = first; i < bytes; i += stride) dst[i] = src[i];
    }
}

// Packs: packed[seg.packed ..] = *seg.many, for every piece.
extern "C" __global__ void collsched_copy_in(
    const DeviceSegment* __restrict__ segments, unsigned int count, char* packed) {
    for (unsigned int s = blockIdx.x; s < count; s += gridDim.x) {
        const DeviceSegment seg = segments[s];
        copy_run(packed + seg.packed, reinterpret_cast<const char*>(seg.many), seg.bytes);
    }
}

// Unpacks: *seg.many = packed[seg.packed ..], for every piece.
extern "C" __global__ void collsched_copy_out(
    const DeviceSegment* __restrict__ segments, unsigned int count, const char* packed) {
    for (unsigned int s = blockIdx.x; s < count; s += gridDim.x) {
        const DeviceSegment seg = segments[s];
        copy_run(reinterpret_cast<char*>(seg.many), packed + seg.packed, seg.bytes);
    }
}
