// bf16 vectors and the RMSNorm element step, shared by the norm, RoPE,
// gated and shared-expert kernels (norm.cu, rope_cache.cu, gated_norm.cu,
// gated_rope_cache.cu, shared_expert.cu) and the skinny GEMM's fusions.
// Pasted into each including source by kernels/cuda_build.py before NVRTC
// compiles it (CuPy's compile cache is keyed on the source text alone).
#pragma once

#include <cuda_bf16.h>

// 16-byte bf16 vectors (8 bf16 in a uint4: one LDG.128/STG.128) and the
// RMSNorm element step with kernels.reference.rms_norm's rounding.
__device__ __forceinline__ uint4 load_vec(const __nv_bfloat16* p) {
    return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const uint4& v) {
    *reinterpret_cast<uint4*>(p) = v;
}

// Element i (0..7) of a packed vector, as float (exact).
__device__ __forceinline__ float vec_get(const uint4& v, int i) {
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
    return __bfloat162float(h[i]);
}

__device__ __forceinline__ void vec_set(uint4& v, int i, __nv_bfloat16 x) {
    __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&v);
    h[i] = x;
}

// float -> bf16 -> float: what torch does after every bf16 elementwise op
// (its opmath is float32, each result rounded to nearest even once).
__device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

// Sum of squares of the 8 elements, accumulated into acc.
__device__ __forceinline__ float vec_sum_squares(const uint4& v, float acc) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x = vec_get(v, i);
        acc = fmaf(x, x, acc);
    }
    return acc;
}

// torch's mean on the GPU is sum * (1/N) (ATen's MeanOps multiplies by a
// float factor), stored rounded; then rsqrt(variance + eps) with CUDA's rsqrtf
// as torch.rsqrt does. __fmul_rn/__fadd_rn keep the compiler from fusing the
// two into one FMA, which would round once where torch rounds twice.
__device__ __forceinline__ float rms_scale(float sum_squares, float inv_n, float eps) {
    return rsqrtf(__fadd_rn(__fmul_rn(sum_squares, inv_n), eps));
}

// weight * bf16(x * scale), each product rounded to bf16 once: the reference
// casts the normalized float32 value to bf16 before the bf16 * bf16 product.
__device__ __forceinline__ uint4 vec_normalize(const uint4& x, const uint4& weight, float scale) {
    uint4 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float normalized = round_bf16(vec_get(x, i) * scale);
        vec_set(out, i, __float2bfloat16_rn(vec_get(weight, i) * normalized));
    }
    return out;
}
