// RMSNorm and the fused residual add + RMSNorm, bf16 [T, H] rows, H a multiple
// of 8 up to 16384. Numerics of kernels.reference.rms_norm / add_rms_norm:
//   summed = bf16(x + residual)                      (add variant: the new residual)
//   scale  = rsqrtf(sum(summed^2) * (1/H) + eps)      float32
//   out    = bf16(weight * bf16(summed * scale))
// and of the zero-centred variant (Qwen3-Next's and Qwen3.5's norms,
// kernels.hybrid_reference.zero_centred_rms_norm), float32 until one rounding:
//   out    = bf16((summed * scale) * (1 + weight))
//
// Each row is read once and written once; it stays in registers (packed bf16,
// VPT 16-byte vectors per thread) between the sum-of-squares pass and the
// normalize pass. Two layouts, chosen by the wrapper from H:
//   warp rows  (H <= 1024): one warp per row, 1 or 4 rows per CTA; the
//              reduction is shuffles only, no shared memory, no barrier.
//   block rows (H > 1024):  one CTA per row, blockDim.x = 32 * k threads;
//              shuffles, then one barrier and a read of the <= 8 warp sums.
// Thread t of a row owns vectors t, t + G, t + 2G, ... (G threads per row), so
// each load instruction is contiguous across the row's threads (coalesced).
//
// Aliasing: every thread writes exactly the elements it read, after reading
// them, so out may be x itself. The pointers are therefore not __restrict__.
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing, then lets the next kernel launch.
// pdl-aware: *rms_norm_*
#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "pdl.cuh"

namespace {

// bf16((x * scale) * (1 + weight)): the zero-centred form, float32 throughout
// (1 + w in float32: a bf16 1 + w would drop w's low bits) and rounded once.
// The _rn intrinsics pin each step to one rounding, as torch's three ops.
__device__ __forceinline__ uint4 vec_normalize_zero_centred(const uint4& x, const uint4& weight,
                                                            float scale) {
    uint4 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float normalized = __fmul_rn(vec_get(x, i), scale);
        const float factor = __fadd_rn(1.0f, vec_get(weight, i));
        vec_set(out, i, __float2bfloat16_rn(__fmul_rn(normalized, factor)));
    }
    return out;
}

constexpr unsigned kFullMask = 0xffffffffu;
// Block rows use at most 256 threads (the wrapper picks VPT so).
constexpr int kMaxBlockWarps = 8;

__device__ __forceinline__ float warp_sum(float v) {
    // Butterfly: every lane ends with the same bits (a + b == b + a exactly).
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(kFullMask, v, offset);
    }
    return v;
}

// bf16(x + r) elementwise, as torch's bf16 add (float32 sum, rounded once).
__device__ __forceinline__ uint4 vec_add(const uint4& x, const uint4& r) {
    uint4 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        vec_set(out, i, __float2bfloat16_rn(vec_get(x, i) + vec_get(r, i)));
    }
    return out;
}

// One row. group_size threads (lane `member` of them) share it.
// BLOCK_ROW: the group is the whole CTA and needs shared memory for the sum.
// ZC: the zero-centred weight (1 + w).
template <int VPT, bool ADD, bool BLOCK_ROW, bool ZC>
__device__ __forceinline__ void norm_row(__nv_bfloat16* out, __nv_bfloat16* residual,
                                         const __nv_bfloat16* x,
                                         const __nv_bfloat16* __restrict__ weight, int vectors,
                                         int member, int group_size, float inv_hidden, float eps) {
    uint4 row[VPT];
    // All loads first (independent, in flight together); lanes past the row's
    // end hold zeros, which add nothing to the sum of squares.
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = member + i * group_size;
        row[i] = make_uint4(0u, 0u, 0u, 0u);
        if (v < vectors) row[i] = load_vec(x + v * 8);
    }
    if (ADD) {
        uint4 res[VPT];
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int v = member + i * group_size;
            res[i] = make_uint4(0u, 0u, 0u, 0u);
            if (v < vectors) res[i] = load_vec(residual + v * 8);
        }
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int v = member + i * group_size;
            row[i] = vec_add(row[i], res[i]);
            if (v < vectors) store_vec(residual + v * 8, row[i]);
        }
    }
    // The weights are loaded now, before the reduction, so their latency hides
    // behind it; loaded next to the stores below they would wait one by one
    // (out is not __restrict__, so the compiler may not hoist them itself).
    uint4 scale_by[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = member + i * group_size;
        scale_by[i] = make_uint4(0u, 0u, 0u, 0u);
        if (v < vectors) scale_by[i] = load_vec(weight + v * 8);
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) sum = vec_sum_squares(row[i], sum);
    sum = warp_sum(sum);
    if (BLOCK_ROW) {
        __shared__ float warp_sums[kMaxBlockWarps];
        const int warp = threadIdx.x >> 5;
        if ((threadIdx.x & 31) == 0) warp_sums[warp] = sum;
        __syncthreads();
        // Every thread adds the warp sums in the same order: identical scales.
        sum = 0.0f;
        const int warps = blockDim.x >> 5;
#pragma unroll
        for (int w = 0; w < kMaxBlockWarps; ++w) {
            if (w < warps) sum += warp_sums[w];
        }
    }
    const float scale = rms_scale(sum, inv_hidden, eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = member + i * group_size;
        if (v < vectors) {
            store_vec(out + v * 8, ZC ? vec_normalize_zero_centred(row[i], scale_by[i], scale)
                                      : vec_normalize(row[i], scale_by[i], scale));
        }
    }
}

// grid: ceil(T / (blockDim.x / 32)); a warp per row, blockDim.x / 32 rows per CTA.
template <int VPT, bool ADD, bool ZC>
__device__ __forceinline__ void warp_rows(__nv_bfloat16* out, __nv_bfloat16* residual,
                                          const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                          int tokens, int hidden, float inv_hidden, float eps) {
    const long row = static_cast<long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= tokens) return;  // whole warps leave together: shuffles stay full
    const long offset = row * hidden;
    norm_row<VPT, ADD, false, ZC>(out + offset, ADD ? residual + offset : nullptr, x + offset,
                              weight, hidden / 8, threadIdx.x & 31, 32, inv_hidden, eps);
}

// grid: T; a CTA per row; blockDim.x a multiple of 32, at most 256.
template <int VPT, bool ADD, bool ZC>
__device__ __forceinline__ void block_rows(__nv_bfloat16* out, __nv_bfloat16* residual,
                                           const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                           int hidden, float inv_hidden, float eps) {
    const long offset = static_cast<long>(blockIdx.x) * hidden;
    norm_row<VPT, ADD, true, ZC>(out + offset, ADD ? residual + offset : nullptr, x + offset, weight,
                             hidden / 8, threadIdx.x, blockDim.x, inv_hidden, eps);
}

}  // namespace

// Entry points: {,add_}rms_norm_{warp,block}{VPT} and the zero-centred
// {,add_}zc_rms_norm_{warp,block}{VPT}. residual is unused (may be 0) by the
// variants without the add.
#define ROUNDHOUSE_NORM_KERNEL(NAME, LAYOUT, VPT, ADD, ZC, CALL)                                 \
    extern "C" __global__ void NAME##_##LAYOUT##VPT(                                             \
        __nv_bfloat16* out, __nv_bfloat16* residual, const __nv_bfloat16* x,                     \
        const __nv_bfloat16* weight, int tokens, int hidden, float inv_hidden, float eps) {      \
        pdl_wait();                                                                              \
        pdl_launch_dependents();                                                                 \
        CALL;                                                                                    \
    }

#define ROUNDHOUSE_WARP_KERNEL(NAME, VPT, ADD, ZC)                                               \
    ROUNDHOUSE_NORM_KERNEL(NAME, warp, VPT, ADD, ZC,                                             \
                           (warp_rows<VPT, ADD, ZC>(out, residual, x, weight, tokens, hidden,    \
                                                    inv_hidden, eps)))
#define ROUNDHOUSE_BLOCK_KERNEL(NAME, VPT, ADD, ZC)                                              \
    ROUNDHOUSE_NORM_KERNEL(NAME, block, VPT, ADD, ZC,                                            \
                           (block_rows<VPT, ADD, ZC>(out, residual, x, weight, hidden,           \
                                                     inv_hidden, eps)))

#define ROUNDHOUSE_WARP_KERNELS(VPT)                                                             \
    ROUNDHOUSE_WARP_KERNEL(rms_norm, VPT, false, false)                                          \
    ROUNDHOUSE_WARP_KERNEL(add_rms_norm, VPT, true, false)                                       \
    ROUNDHOUSE_WARP_KERNEL(zc_rms_norm, VPT, false, true)                                        \
    ROUNDHOUSE_WARP_KERNEL(add_zc_rms_norm, VPT, true, true)

#define ROUNDHOUSE_BLOCK_KERNELS(VPT)                                                            \
    ROUNDHOUSE_BLOCK_KERNEL(rms_norm, VPT, false, false)                                         \
    ROUNDHOUSE_BLOCK_KERNEL(add_rms_norm, VPT, true, false)                                      \
    ROUNDHOUSE_BLOCK_KERNEL(zc_rms_norm, VPT, false, true)                                       \
    ROUNDHOUSE_BLOCK_KERNEL(add_zc_rms_norm, VPT, true, true)

// Warp rows: H <= 1024 (<= 128 vectors): VPT = ceil(H / 256).
ROUNDHOUSE_WARP_KERNELS(1)
ROUNDHOUSE_WARP_KERNELS(2)
ROUNDHOUSE_WARP_KERNELS(3)
ROUNDHOUSE_WARP_KERNELS(4)
// Block rows: H in (1024, 16384]: VPT 2, 4 or 8, at most 256 threads.
ROUNDHOUSE_BLOCK_KERNELS(2)
ROUNDHOUSE_BLOCK_KERNELS(4)
ROUNDHOUSE_BLOCK_KERNELS(8)
