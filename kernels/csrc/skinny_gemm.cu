// Skinny GEMM for decode steps: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]),
// M = 1..8, bf16 in and out, float32 accumulation. The skinny_rows kernels
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

#include "pdl.cuh"

namespace {

constexpr int kPieces = 4;                 // 16-byte loads per thread per row group per step
constexpr int kStepK = 32 * kPieces;       // 128 K elements per warp step

__device__ __forceinline__ unsigned long long evict_first_policy() {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// 16 bytes of the weight (read once: bypass L1, evict first from L2), or
// zeros when !valid. The predicate lives inside the asm so the load is a
// predicated LDG, never a branch; volatile keeps the weight loads after the
// step's L2 prefetch and ahead of the x loads in the emitted code.
__device__ __forceinline__ uint4 load_weight(const __nv_bfloat16* p, bool valid,
                                             unsigned long long policy) {
    uint4 v;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %6;\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(valid)), "l"(policy));
    return v;
}

// 16 bytes of x (reused by every CTA: cached in L1), or zeros when !valid.
__device__ __forceinline__ uint4 load_x(const __nv_bfloat16* p, bool valid) {
    uint4 v;
    asm("{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(valid)));
    return v;
}

// acc += A * B for one m16n8k16 tile. a_lo / a_hi: x row g at logical
// k = 2t, 2t+1 / 2t+8, 2t+9 (rows g + 8 are zero); b_lo / b_hi: the weight row
// at the same k.
__device__ __forceinline__ void mma_step(float (&acc)[4], unsigned a_lo, unsigned a_hi,
                                         unsigned b_lo, unsigned b_hi) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a_lo), "r"(0u), "r"(a_hi), "r"(0u), "r"(b_lo), "r"(b_hi));
}

// One CTA: output columns [cta * 8 * RG, + 8 * RG) for the x rows row0 +
// [0, 8 * TILES) that are < m_rows. blockDim.x = 32 * W: W <= 32 for the
// decode kernels' RG = 1, else <= 8; steps = ceil(K / 128).
//
// TILES 8-row tiles of x share each weight fragment while it is in
// registers (the weight is read once for 8 * TILES rows). The arithmetic of
// one output element does not depend on TILES, RG, m_rows or the other x
// rows: its accumulators are its own (the mma's D[i][j] reads only row i of
// A and column j of B, and rows of x sit at the same row g of every mma),
// each chain takes the same pieces in the same order, and the warps' partials
// are summed in warp order. Only W and steps (the K split) shape it.
// PDL: the decode kernels' Programmatic Dependent Launch prologue (the
// batch-invariant skinny_rows kernels go without: it cost them spills).
template <int RG, int TILES, bool PDL>
__device__ __forceinline__ void skinny_gemm_body(__nv_bfloat16* __restrict__ out,
                                                 const __nv_bfloat16* __restrict__ x,
                                                 const __nv_bfloat16* __restrict__ weight,
                                                 const __nv_bfloat16* __restrict__ bias,
                                                 int n_rows, int k, int steps, int m_rows,
                                                 int cta, int row0) {
    // Most warps per CTA: 32 for one row group of one tile (1024 threads), else 8.
    constexpr int kMaxWarps = RG == 1 && TILES == 1 ? 32 : 8;
    __shared__ float2 partial[kMaxWarps][RG][TILES][32];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = cta * (8 * RG);
    const unsigned long long policy = evict_first_policy();

    // This warp's next step goes into L2 while it waits for the current one
    // (no registers held): lane l prefetches 128-byte line l & 1 of the
    // step's row n0 + l / 2, so 16 lanes cover 8 rows x 256 bytes, 32 lanes 16.
    const int prefetch_row = n0 + (lane >> 1);
    const bool prefetch_lane = (lane >> 1) < 8 * RG && prefetch_row < n_rows;
    const int prefetch_k = 64 * (lane & 1);
    const __nv_bfloat16* prefetch_ptr =
        weight + static_cast<long long>(prefetch_lane ? prefetch_row : 0) * k + prefetch_k;

    // PDL: before the wait, only this warp's first step of the weight goes
    // into L2 (at the small models' shapes that is the CTA's whole share).
    // The weight is no kernel's output, and a prefetch is a hint into L2,
    // the point of coherence, so it cannot make a later load stale. x, the
    // bias and out are touched only after pdl_wait(). (The row pointers
    // below are set up after it: live across the wait, they cost the RG = 2
    // kernels a spill under their 80-register bound.)
    if constexpr (PDL) {
        if (prefetch_lane && warp < steps && warp * kStepK + prefetch_k < k) {
            prefetch_l2(prefetch_ptr + warp * kStepK);
        }
        pdl_launch_dependents();
        pdl_wait();
    }

    // Thread (g, t)'s weight rows n0 + 8 rg + g and x rows row0 + 8 tile + g,
    // at its 16-byte slot 8 t of each 32-element piece. Rows past the end
    // read nothing.
    const __nv_bfloat16* w_row[RG];
    bool w_valid[RG];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
        const int row = n0 + 8 * rg + g;
        w_valid[rg] = row < n_rows;
        w_row[rg] = weight + static_cast<long long>(w_valid[rg] ? row : 0) * k + 8 * t;
    }
    const __nv_bfloat16* x_row[TILES];
    bool x_valid[TILES];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int row = row0 + 8 * tile + g;
        x_valid[tile] = row < m_rows;
        x_row[tile] = x + static_cast<long long>(x_valid[tile] ? row : 0) * k + 8 * t;
    }

    // Two accumulator chains per tile and row group (even and odd pieces), so
    // that consecutive mmas do not wait on each other's results.
    float acc[TILES][RG][2][4];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[tile][rg][c][i] = 0.0f;
            }
        }
    }

#pragma unroll 1
    for (int step = warp; step < steps; step += warps) {
        const int k0 = step * kStepK;
        const int next_k0 = (step + warps) * kStepK;
        if (prefetch_lane && step + warps < steps && next_k0 + prefetch_k < k) {
            prefetch_l2(prefetch_ptr + next_k0);
        }
        // All of the step's weight loads first (HBM latency), then x (L1/L2).
        uint4 w[RG][kPieces];
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
            const int offset = k0 + 32 * j;
            const bool in_k = offset + 8 * t < k;
#pragma unroll
            for (int rg = 0; rg < RG; ++rg) {
                w[rg][j] = load_weight(w_row[rg] + offset, w_valid[rg] && in_k, policy);
            }
        }
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            uint4 xv[kPieces];
#pragma unroll
            for (int j = 0; j < kPieces; ++j) {
                const int offset = k0 + 32 * j;
                xv[j] = load_x(x_row[tile] + offset, x_valid[tile] && offset + 8 * t < k);
            }
#pragma unroll
            for (int j = 0; j < kPieces; ++j) {
#pragma unroll
                for (int rg = 0; rg < RG; ++rg) {
                    mma_step(acc[tile][rg][j & 1], xv[j].x, xv[j].y, w[rg][j].x, w[rg][j].y);
                    mma_step(acc[tile][rg][j & 1], xv[j].z, xv[j].w, w[rg][j].z, w[rg][j].w);
                }
            }
        }
    }

    // acc[tile][rg][.][0..1] = this warp's partial out[row0 + 8 tile + g][n0 + 8 rg + 2t + 0..1].
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) {
            partial[warp][rg][tile][lane] =
                make_float2(acc[tile][rg][0][0] + acc[tile][rg][1][0],
                            acc[tile][rg][0][1] + acc[tile][rg][1][1]);
        }
    }
    __syncthreads();

    // One thread per (row group, tile, lane), looping when the CTA has fewer
    // threads than that (a short K gives few warps).
    for (int item = threadIdx.x; item < RG * TILES * 32; item += blockDim.x) {
        const int slot = item & 31;
        const int rg = (item >> 5) / TILES;
        const int tile = (item >> 5) % TILES;
        const int m = row0 + 8 * tile + (slot >> 2);
        const int n = n0 + 8 * rg + 2 * (slot & 3);
        if (m >= m_rows || n >= n_rows) continue;
        float2 sum = partial[0][rg][tile][slot];
        for (int other = 1; other < warps; ++other) {
            const float2 p = partial[other][rg][tile][slot];
            sum.x += p.x;
            sum.y += p.y;
        }
        const bool pair = n + 1 < n_rows;
        if (bias != nullptr) {
            sum.x += __bfloat162float(bias[n]);
            if (pair) sum.y += __bfloat162float(bias[n + 1]);
        }
        __nv_bfloat16* dst = out + static_cast<long long>(m) * n_rows + n;
        if (pair && (reinterpret_cast<unsigned long long>(dst) & 3) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(sum.x, sum.y);
        } else {
            dst[0] = __float2bfloat16_rn(sum.x);
            if (pair) dst[1] = __float2bfloat16_rn(sum.y);
        }
    }
}

}  // namespace

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
        skinny_gemm_body<RG, 1, true>(out, x, weight, bias, n_rows, k, steps, M, blockIdx.x, \
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
        skinny_gemm_body<RG, T, false>(out, x, weight, bias, n_rows, k, steps, m_rows,      \
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
