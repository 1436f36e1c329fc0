// Skinny GEMM for decode steps: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]),
// M = 1..8, bf16 in and out, float32 accumulation. The body is in
// skinny_gemm.cuh, shared with the fused decode kernels (skinny_fused.cu). The skinny_rows kernels
// at the end are its batch-invariant form (--deterministic): any M, in
// chunks of up to 64 rows, each row computed with the arithmetic it gets
// alone (the body's comment says why).
//
// The op is memory-bound: each weight element is read once from HBM and used
// for all M rows; x (at most 8 x K bf16) stays in L1/L2. The multiplications
// run on the tensor cores (mma.sync m16n8k16, bf16 operands, float32
// accumulators), so the instruction count per weight byte does not grow with
// M: one mma covers 8 weight rows x 16 K for all 8 x rows, where float32 FMAs
// would need 8 per weight element at M = 8 and compete with the loads for
// issue slots.
//
// Operands of one mma (thread (g, t) = lane (4g + t) of the warp):
//   A (16 x 16, row-major) = x: rows 0..7 are the x rows (rows >= M and 8..15
//     are zero); thread (g, t) holds row g at k = 2t, 2t+1, 2t+8, 2t+9.
//   B (16 x 8, "col" = one weight row per column): thread (g, t) holds weight
//     row n0 + g at the same four k.
//   D (16 x 8): thread (g, t) gets out[m = g][n0 + 2t], out[g][n0 + 2t + 1]
//     (rows 8..15 of D are zero and ignored).
// A dot product is a sum over k, so any permutation of k applied to both x
// and the weight gives the same result. We pick the one that lets every thread
// load 16 contiguous bytes: thread (g, t) loads 8 bf16 of weight row n0 + g
// and 8 bf16 of x row g at the same physical offset, and feeds elements 0..3
// to one mma and 4..7 to the next as if they were its four logical k. The
// four threads of a group load consecutive 16-byte pieces, so each load
// instruction reads 64 contiguous bytes (two whole 32-byte sectors) of 8
// weight rows: no sector is fetched twice.
//
// Work split (the wrapper picks RG and the warp count from N and K only):
//   CTA     = 8 * RG weight rows x all of K; RG = 1 or 2 row groups of 8
//             that share each x fragment (RG = 2 halves the x loads).
//   step    = 128 K (4 loads of 16 bytes per thread per row group): a warp
//             step reads 8 * RG rows x 256 bytes = 2 or 4 KB of the weight.
//   warp w  = steps w, w + W, w + 2W, ... of the CTA's rows (split K), so
//             all warps of a CTA have their loads in flight at once; at the
//             decode shapes of small models each warp does one step and the
//             whole matrix is requested in the first few hundred cycles.
//   reduce  = the W warps' float32 partial sums through shared memory, in a
//             fixed order (deterministic), + bias, one bf16 rounding.
//   prefetch = a warp with more than one step asks L2 for its next step
//             (prefetch.global.L2) before loading the current one, so two
//             steps per warp are in flight without registers for the second
//             (the 8B-model shapes: 4 to 12 steps per warp).
// The weight is streamed with L1::no_allocate and an L2 evict_first policy
// (it is read once per step; x and the other activations should stay).
// K needs only be a multiple of 8: 16-byte pieces past K load as zeros.
//
// Programmatic Dependent Launch (pdl.cuh; inside CUDA graphs on Hopper): in
// the decode kernels a warp asks L2 for its first step of the weight, lets
// the next kernel launch, and only then waits for the kernel that wrote x.
// The weight streams while the previous kernel finishes, and the next
// kernel's CTAs are resident when this one ends. Numerics are unchanged (the
// same loads, in the same order, after the wait).
// pdl-aware: skinny_gemm_m*_rg*
#include <cuda_bf16.h>

#include "skinny_gemm.cuh"

// The decode kernels: M = 1..8 x rows (one tile). RG = 1: up to 32 warps per
// CTA (few rows, long K); RG = 2: up to 8 warps, at most 80 registers so that
// 3 CTAs of 256 threads fit on an SM.
#define SKINNY_GEMM_KERNEL(M, RG, THREADS, MIN_BLOCKS)                                       \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                      \
        skinny_gemm_m##M##_rg##RG(__nv_bfloat16* __restrict__ out,                         \
                                  const __nv_bfloat16* __restrict__ x,                     \
                                  const __nv_bfloat16* __restrict__ weight,                \
                                  const __nv_bfloat16* __restrict__ bias, int n_rows, int k, \
                                  int steps) {                                             \
        skinny::gemm_body<RG, 1, true>(out, x, weight, bias, n_rows, k, steps, M, blockIdx.x, \
                                      0);                                                \
    }

#define SKINNY_GEMM_KERNELS(M)             \
    SKINNY_GEMM_KERNEL(M, 1, 1024, 1)      \
    SKINNY_GEMM_KERNEL(M, 2, 256, 3)

SKINNY_GEMM_KERNELS(1)
SKINNY_GEMM_KERNELS(2)
SKINNY_GEMM_KERNELS(3)
SKINNY_GEMM_KERNELS(4)
SKINNY_GEMM_KERNELS(5)
SKINNY_GEMM_KERNELS(6)
SKINNY_GEMM_KERNELS(7)
SKINNY_GEMM_KERNELS(8)

// The batch-invariant kernels (--deterministic): any number of x rows, in
// chunks of 8 * T (T tiles of 8 rows), at most 8 warps per CTA. CTAs are
// ordered so that `group_chunks` chunks in turn take each CTA's weight rows
// (blockIdx.x = (group, cta, chunk in group)): those chunks' x stays in L2
// while the weight streams through once per group. Grid: ctas * chunks.
#define SKINNY_ROWS_KERNEL(T, RG, MIN_BLOCKS)                                                \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) skinny_rows_t##T##_rg##RG( \
        __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,                \
        const __nv_bfloat16* __restrict__ weight, const __nv_bfloat16* __restrict__ bias,    \
        int n_rows, int k, int steps, int m_rows, int chunks, int group_chunks) {           \
        const int ctas = static_cast<int>(gridDim.x) / chunks;                               \
        const int group = static_cast<int>(blockIdx.x) / (group_chunks * ctas);              \
        const int first = group * group_chunks;                                              \
        const int in_group = min(group_chunks, chunks - first);                              \
        const int rest = static_cast<int>(blockIdx.x) - first * ctas;                        \
        const int chunk = first + rest % in_group;                                           \
        skinny::gemm_body<RG, T, false>(out, x, weight, bias, n_rows, k, steps, m_rows,      \
                                rest / in_group, chunk * 8 * T);                             \
    }

SKINNY_ROWS_KERNEL(1, 1, 3)
SKINNY_ROWS_KERNEL(1, 2, 3)
SKINNY_ROWS_KERNEL(2, 1, 3)
SKINNY_ROWS_KERNEL(2, 2, 2)
SKINNY_ROWS_KERNEL(4, 1, 2)
SKINNY_ROWS_KERNEL(4, 2, 1)
SKINNY_ROWS_KERNEL(8, 1, 2)
SKINNY_ROWS_KERNEL(8, 2, 1)
