// The skinny GEMM's decode kernels (skinny_gemm.cu, M = 1..8 rows) with the
// work of their neighbours in a dense decoder layer folded in, so that a
// batch-1 layer is six kernels instead of nine (kernels/skinny_fused.py):
//
//   skinny_norm_gemm_m*_rg*  out = rms_norm(x) @ W^T (+ bias)   (QKV)
//   skinny_norm_swiglu_m*    out = swiglu(rms_norm(x) @ [G; U]^T) (gate/up)
//   skinny_gemm_add_m*_rg*   residual += x @ W^T (+ bias)        (o, down)
//
// Each gives the bits of the unfused chain (rms_norm, skinny_linear,
// silu_and_mul, a bf16 add): the prologue repeats norm.cu's sums in norm.cu's
// order per x row (every CTA for itself: a row is at most 32 KB, read from
// L2), the epilogues round where the unfused kernels round (skinny_gemm.cuh).
// The residual is updated in place: each element is read and written by one
// thread, and nothing else in the kernel reads it.
// pdl-aware: skinny_norm_gemm_m*_rg*
// pdl-aware: skinny_norm_swiglu_m*
// pdl-aware: skinny_gemm_add_m*_rg*
#include <cuda_bf16.h>

#include "skinny_gemm.cuh"

// As skinny_gemm.cu's decode kernels: RG = 1 up to 32 warps, RG = 2 up to 8
// warps under 80 registers (3 CTAs of 256 threads an SM).
#define SKINNY_NORM_GEMM_KERNEL(M, RG, THREADS, MIN_BLOCKS)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                        \
        skinny_norm_gemm_m##M##_rg##RG(                                                      \
            __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,            \
            const __nv_bfloat16* __restrict__ weight, const __nv_bfloat16* __restrict__ bias, \
            int n_rows, int k, int steps, const __nv_bfloat16* __restrict__ norm_weight,     \
            float eps, float inv_k) {                                                        \
        skinny::gemm_body<RG, 1, true, true, skinny::kStore>(                                \
            out, x, weight, bias, n_rows, k, steps, M, blockIdx.x, 0,                        \
            skinny::Fusion{norm_weight, eps, inv_k, 0});                                     \
    }

// weight: [2 I, K], the gate rows then the up rows; out [M, I]; a CTA takes
// 8 gate rows and their 8 up rows (n_rows = I).
#define SKINNY_NORM_SWIGLU_KERNEL(M)                                                         \
    extern "C" __global__ void __launch_bounds__(256, 3) skinny_norm_swiglu_m##M(            \
        __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,                \
        const __nv_bfloat16* __restrict__ weight, int n_rows, int k, int steps,             \
        const __nv_bfloat16* __restrict__ norm_weight, float eps, float inv_k) {            \
        skinny::gemm_body<2, 1, true, true, skinny::kSwiglu>(                                \
            out, x, weight, nullptr, 2 * n_rows, k, steps, M, blockIdx.x, 0,                 \
            skinny::Fusion{norm_weight, eps, inv_k, n_rows});                                \
    }

// residual [M, N] is read and written (the bf16 stream of the decoder).
#define SKINNY_GEMM_ADD_KERNEL(M, RG, THREADS, MIN_BLOCKS)                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                        \
        skinny_gemm_add_m##M##_rg##RG(                                                       \
            __nv_bfloat16* __restrict__ residual, const __nv_bfloat16* __restrict__ x,       \
            const __nv_bfloat16* __restrict__ weight, const __nv_bfloat16* __restrict__ bias, \
            int n_rows, int k, int steps) {                                                  \
        skinny::gemm_body<RG, 1, true, false, skinny::kResidual>(                            \
            residual, x, weight, bias, n_rows, k, steps, M, blockIdx.x, 0);                  \
    }

#define SKINNY_FUSED_KERNELS(M)                   \
    SKINNY_NORM_GEMM_KERNEL(M, 1, 1024, 1)        \
    SKINNY_NORM_GEMM_KERNEL(M, 2, 256, 3)         \
    SKINNY_NORM_SWIGLU_KERNEL(M)                  \
    SKINNY_GEMM_ADD_KERNEL(M, 1, 1024, 1)         \
    SKINNY_GEMM_ADD_KERNEL(M, 2, 256, 3)

SKINNY_FUSED_KERNELS(1)
SKINNY_FUSED_KERNELS(2)
SKINNY_FUSED_KERNELS(3)
SKINNY_FUSED_KERNELS(4)
SKINNY_FUSED_KERNELS(5)
SKINNY_FUSED_KERNELS(6)
SKINNY_FUSED_KERNELS(7)
SKINNY_FUSED_KERNELS(8)
