// The Gated DeltaNet output norm: RMSNorm per head times silu(gate), bf16 in
// and out, float32 arithmetic. Numerics of kernels.hybrid_reference.gated_rms_norm:
//   scale      = rsqrtf(sum(x^2) * (1/D) + eps)               float32
//   normalized = bf16(x * scale)
//   product    = bf16(weight * normalized)                    (bf16 * bf16)
//   out        = bf16(product * (z / (1 + expf(-z))))         float32 silu, as torch's
// so only the variance's summation order differs from torch on the GPU.
//
// x, out: [T, H, D] contiguous; gate (z): [T, H, D] with its own token and
// head strides (a view into the in_proj output: no copy), the last dim
// contiguous. D / 8 consecutive threads own one (token, head) row, one
// 16-byte vector each; the sum of squares is reduced with shuffles inside
// that group. Rows run flattened, so a 128-thread CTA covers 8 rows (D = 128).
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing, then lets the next kernel launch.
// pdl-aware: gated_rms_norm_d*
#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "pdl.cuh"

namespace {

// torch's CUDA silu: x / (1 + exp(-x)) in float32 (IEEE division, expf).
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, 1.0f + expf(-x)); }

template <int D>
__device__ __forceinline__ void gated_rms_norm(__nv_bfloat16* __restrict__ out,
                                               const __nv_bfloat16* __restrict__ x,
                                               const __nv_bfloat16* __restrict__ gate,
                                               const __nv_bfloat16* __restrict__ weight,
                                               int rows, int heads, long long gate_token_stride,
                                               long long gate_head_stride, float eps) {
    constexpr int kGroup = D / 8;  // threads per row: 32 (D = 256), 16 (128) or 8 (64)
    static_assert(kGroup <= 32 && (kGroup & (kGroup - 1)) == 0, "a row's threads share a warp");
    pdl_wait();  // before any thread leaves: x and the gate are earlier kernels' outputs
    pdl_launch_dependents();
    const int thread = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = thread / kGroup;
    const int j = thread % kGroup;
    // Groups are aligned runs of lanes: a group leaves whole, its shuffles stay full.
    if (row >= rows) return;
    const int token = row / heads;
    const int head = row - token * heads;
    const long long offset = static_cast<long long>(row) * D + j * 8;
    const uint4 xs = load_vec(x + offset);
    const uint4 zs = load_vec(gate + token * gate_token_stride + head * gate_head_stride + j * 8);
    const uint4 ws = load_vec(weight + j * 8);

    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float v = vec_get(xs, i);
        sum = fmaf(v, v, sum);
    }
    const unsigned lane = threadIdx.x & 31;
    const unsigned mask = kGroup == 32 ? 0xffffffffu
                                       : ((1u << kGroup) - 1u)
                                             << (lane & ~static_cast<unsigned>(kGroup - 1));
#pragma unroll
    for (int step = kGroup / 2; step > 0; step >>= 1) sum += __shfl_xor_sync(mask, sum, step);
    // D is a power of two: 1/D is exact, the factor torch's mean multiplies by.
    // _rn: one rounding each, no FMA contraction (torch rounds the mean).
    const float scale = rsqrtf(__fadd_rn(__fmul_rn(sum, 1.0f / D), eps));

    uint4 result;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float normalized = round_bf16(__fmul_rn(vec_get(xs, i), scale));
        const float product = round_bf16(__fmul_rn(vec_get(ws, i), normalized));
        vec_set(result, i, __float2bfloat16_rn(__fmul_rn(product, silu(vec_get(zs, i)))));
    }
    store_vec(out + offset, result);
}

}  // namespace

// grid: ceil(rows * D / 8 / blockDim.x), blockDim.x a multiple of 32; rows = T * H.
#define ROUNDHOUSE_GATED_NORM_KERNEL(D)                                                         \
    extern "C" __global__ void gated_rms_norm_d##D(                                             \
        __nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* gate,                  \
        const __nv_bfloat16* weight, int rows, int heads, long long gate_token_stride,          \
        long long gate_head_stride, float eps) {                                                \
        gated_rms_norm<D>(out, x, gate, weight, rows, heads, gate_token_stride,                 \
                          gate_head_stride, eps);                                               \
    }

ROUNDHOUSE_GATED_NORM_KERNEL(64)
// D = 128: Qwen3-Next's and Qwen3.5's value heads.
ROUNDHOUSE_GATED_NORM_KERNEL(128)
ROUNDHOUSE_GATED_NORM_KERNEL(256)
