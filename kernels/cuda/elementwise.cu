// Reductions (sum / avg with pre- and post-divide), accumulation and casts for f32, f16 and
// bf16: the CUDA twins of kernels/src/elem.rs, with the same results.
//
// Semantics (exactly the CPU reference):
// - every value is widened to f32 (exact for f16 and bf16);
// - reduce: acc = 0; for each input k in order: acc = acc + x_k / pre; out = acc / post, where
//   the host passes post = post_divide (sum) or post_divide * inputs as an f32 (avg), computed
//   the way the CPU computes it;
// - accumulate: acc = acc + src;
// - every f32 operation is one IEEE operation rounded to nearest even (__fadd_rn, __fdiv_rn:
//   never contracted into an FMA, never approximated, whatever the compile flags);
// - the result is rounded once to the output type, to nearest even (__float2half_rn,
//   __float2bfloat16_rn). Only the payload of a NaN may differ from the CPU's (both are NaN).
//
// Element-wise and index-aligned, so `out` may alias any input (in-place reduce is allowed).
// Grid-stride loops: any grid size covers any length.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float load_f32(const void* p, unsigned long long i) {
    return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ float load_f16(const void* p, unsigned long long i) {
    return __half2float(static_cast<const __half*>(p)[i]);
}
__device__ __forceinline__ float load_bf16(const void* p, unsigned long long i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
__device__ __forceinline__ void store_f32(void* p, unsigned long long i, float v) {
    static_cast<float*>(p)[i] = v;
}
__device__ __forceinline__ void store_f16(void* p, unsigned long long i, float v) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
}
__device__ __forceinline__ void store_bf16(void* p, unsigned long long i, float v) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}

#define GRID_STRIDE_LOOP(i, n)                                                        \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

// out[i] = (sum_k inputs[k][i] / pre) / post, inputs in order.
#define DEFINE_REDUCE(T)                                                              \
    extern "C" __global__ void collsched_reduce_##T(                                  \
        void* out, const void* const* __restrict__ inputs, unsigned int count,        \
        unsigned long long n, float pre, float post) {                                \
        GRID_STRIDE_LOOP(i, n) {                                                      \
            float acc = 0.0f;                                                         \
            for (unsigned int k = 0; k < count; ++k)                                  \
                acc = __fadd_rn(acc, __fdiv_rn(load_##T(inputs[k], i), pre));         \
            store_##T(out, i, __fdiv_rn(acc, post));                                  \
        }                                                                             \
    }

// acc[i] = acc[i] + src[i].
#define DEFINE_ACCUMULATE(T)                                                          \
    extern "C" __global__ void collsched_accumulate_##T(                              \
        void* acc, const void* src, unsigned long long n) {                           \
        GRID_STRIDE_LOOP(i, n) {                                                      \
            store_##T(acc, i, __fadd_rn(load_##T(acc, i), load_##T(src, i)));         \
        }                                                                             \
    }

// data[i] = data[i] / divisor: the pre-divide of a collective's input and the post-divide of its
// output (the single-input case of reduce: (x / pre) / 1 and (x / 1) / post are x / pre, x / post).
#define DEFINE_DIVIDE(T)                                                              \
    extern "C" __global__ void collsched_divide_##T(                                  \
        void* data, unsigned long long n, float divisor) {                            \
        GRID_STRIDE_LOOP(i, n) { store_##T(data, i, __fdiv_rn(load_##T(data, i), divisor)); } \
    }

// dst[i] = round_to_nearest_even<TO>(widen<FROM>(src[i])).
#define DEFINE_CAST(FROM, TO)                                                         \
    extern "C" __global__ void collsched_cast_##FROM##_to_##TO(                       \
        const void* src, void* dst, unsigned long long n) {                           \
        GRID_STRIDE_LOOP(i, n) { store_##TO(dst, i, load_##FROM(src, i)); }           \
    }

DEFINE_REDUCE(f32)
DEFINE_REDUCE(f16)
DEFINE_REDUCE(bf16)

DEFINE_ACCUMULATE(f32)
DEFINE_ACCUMULATE(f16)
DEFINE_ACCUMULATE(bf16)

DEFINE_DIVIDE(f32)
DEFINE_DIVIDE(f16)
DEFINE_DIVIDE(bf16)

DEFINE_CAST(f32, f32)
DEFINE_CAST(f32, f16)
DEFINE_CAST(f32, bf16)
DEFINE_CAST(f16, f32)
DEFINE_CAST(f16, f16)
DEFINE_CAST(f16, bf16)
DEFINE_CAST(bf16, f32)
DEFINE_CAST(bf16, f16)
DEFINE_CAST(bf16, bf16)
