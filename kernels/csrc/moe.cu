// Mixture-of-experts decode: top-k routing and a SwiGLU expert GEMV that reads
// only the selected experts' weights (kernels/moe.py; reference:
// kernels/moe_reference.py).
//
// Layouts: router logits [T, E]; expert stacks gate_up [E, 2I, H] (the gate's
// I rows, then up's I rows) and down [E, H, I], bf16, row-major; ids int32
// [T, k] and weights float32 [T, k]; a (token t, slot j) pair is p = t * k + j.
//
// Routing (moe_route_*): one warp per token. Lane l holds experts l, l + 32,
// ... (E <= 512: 16 per lane) in registers. Softmax in float32 (max
// subtracted, expf, IEEE division; sums by a xor butterfly, so every lane
// holds the same bits). Top-k as k rounds of a warp-wide argmax on a 64-bit
// key (probability bits << 32 | ~expert): probabilities are >= 0, so their
// bits order like the values, and equal values prefer the lower expert.
//
// Experts, two launches:
//   moe_gate_up_silu: grid (pairs, ceil(I / 4)), 4 warps. Warp w computes
//     gate row i and up row i (i = 4 * blockIdx.y + w) of the pair's expert
//     against the token's hidden row: 16-byte loads along H, four of each in
//     flight per lane, float32 per-lane sums, then a xor-butterfly reduction.
//     act[p, i] = bf16(bf16(silu(bf16(g))) * bf16(u)), as F.linear then
//     kernels/activation.cu round. Pairs vary fastest in the grid, so pairs
//     that share an expert read the same rows at about the same time (L2).
//   moe_down_sum: grid (T, ceil(H / 4)), 8 warps. The CTA's 4 rows x k slots
//     are spread over its warps; each computes y = bf16(down[e, h] . act[p])
//     and c = bf16(y * w[p]) and leaves float(c) in shared memory; then
//     out[t, h] = bf16(c_0 + c_1 + ...) summed in float32 in slot order.
// An id outside [0, E) contributes nothing (no weight is read for it).
//
// Host-resident experts (engine/execution/expert_cache.py): the stacks may be
// page-locked host memory, read over the bus through unified addressing,
// and `slots` (int32 [E], or null) names the device cache slot of each
// expert held there (-1: read the stack): a cached expert's rows are read
// from cache_gate_up [S, 2I, H] / cache_down [S, H, I] instead.
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing (which expert rows to read is the routing's
// output, and the stacks may be host memory: nothing is prefetched), then
// lets the next kernel launch.
// pdl-aware: moe_route_* moe_gate_up_silu moe_down_sum
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr int kRouteMaxPerLane = 16;  // E <= 32 * 16 = 512
constexpr int kMaxTopK = 16;
constexpr int kGateUpWarps = 4;  // I rows per gate/up CTA
constexpr int kDownRows = 4;     // H rows per down CTA
constexpr int kDownWarps = 8;
constexpr int kUnroll = 4;       // 16-byte loads per lane per operand in flight
constexpr int kWarpSpan = 32 * 8;  // bf16 covered by one warp-wide 16-byte load

// -inf without <cmath> (NVRTC).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    }
    return x;
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long key) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, offset);
        key = other > key ? other : key;
    }
    return key;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ uint4 load16(const __nv_bfloat16* p, bool valid) {
    return valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

// acc += sum of the 8 products of two 16-byte bf16 vectors, in element order.
__device__ __forceinline__ float dot8(uint4 a_bits, uint4 b_bits, float acc) {
    const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(&a_bits);
    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&b_bits);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(__bfloat162float(a[i]), __bfloat162float(b[i]), acc);
    return acc;
}

// One warp's dot product of two bf16 rows of length n (a multiple of 8),
// reduced over the warp: every lane returns the same float32.
__device__ __forceinline__ float warp_dot(const __nv_bfloat16* __restrict__ a,
                                          const __nv_bfloat16* __restrict__ b, int n, int lane) {
    float acc = 0.0f;
    for (int base = 8 * lane; base < n; base += kUnroll * kWarpSpan) {
        uint4 av[kUnroll], bv[kUnroll];
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) av[c] = load16(a + base + c * kWarpSpan, base + c * kWarpSpan < n);
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) bv[c] = load16(b + base + c * kWarpSpan, base + c * kWarpSpan < n);
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) acc = dot8(av[c], bv[c], acc);
    }
    return warp_sum(acc);
}

// One warp per token; blockDim.x = 32 * warps. Needs 1 <= top_k <= min(E, 16), E <= 512.
template <typename T>
__device__ __forceinline__ void route_body(float* __restrict__ weights_out,
                                           int* __restrict__ ids_out,
                                           const T* __restrict__ logits, int tokens,
                                           int num_experts, int top_k, int normalize) {
    pdl_wait();  // before any thread leaves: the logits are an earlier kernel's output
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (token >= tokens) return;  // the whole warp leaves together
    const T* row = logits + static_cast<long long>(token) * num_experts;

    float value[kRouteMaxPerLane];
    float local_max = neg_inf();
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; ++j) {
        const int expert = lane + 32 * j;
        value[j] = expert < num_experts ? to_float(row[expert]) : neg_inf();
        local_max = fmaxf(local_max, value[j]);
    }
    const float row_max = warp_max(local_max);
    float local_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; ++j) {
        const int expert = lane + 32 * j;
        value[j] = expert < num_experts ? expf(value[j] - row_max) : 0.0f;
        local_sum += value[j];
    }
    const float total = warp_sum(local_sum);

    // Key 0 marks "not a candidate" (past E, or already taken); every real
    // expert's key is > 0 because ~expert != 0 in the low half.
    unsigned long long key[kRouteMaxPerLane];
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; ++j) {
        const int expert = lane + 32 * j;
        const float prob = value[j] / total;
        // NaN (a NaN logit) ranks with zero probability rather than breaking the order.
        const unsigned bits = prob > 0.0f ? __float_as_uint(prob) : 0u;
        key[j] = expert < num_experts
                     ? (static_cast<unsigned long long>(bits) << 32) | (0xffffffffu - static_cast<unsigned>(expert))
                     : 0ull;
    }

    float my_weight = 0.0f;  // lane j keeps slot j
    int my_id = 0;
    float picked_sum = 0.0f;
    for (int slot = 0; slot < top_k; ++slot) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int j = 0; j < kRouteMaxPerLane; ++j) best = key[j] > best ? key[j] : best;
        best = warp_max_key(best);
#pragma unroll
        for (int j = 0; j < kRouteMaxPerLane; ++j) key[j] = key[j] == best ? 0ull : key[j];
        const float weight = __uint_as_float(static_cast<unsigned>(best >> 32));
        picked_sum += weight;
        if (lane == slot) {
            my_weight = weight;
            my_id = static_cast<int>(0xffffffffu - static_cast<unsigned>(best & 0xffffffffull));
        }
    }
    if (lane < top_k) {
        const long long at = static_cast<long long>(token) * top_k + lane;
        weights_out[at] = normalize ? my_weight / picked_sum : my_weight;
        ids_out[at] = my_id;
    }
}

}  // namespace

// grid: ceil(T / warps); block: 32 * warps.
extern "C" __global__ void moe_route_bf16(float* __restrict__ weights_out, int* __restrict__ ids_out,
                                          const __nv_bfloat16* __restrict__ logits, int tokens,
                                          int num_experts, int top_k, int normalize) {
    route_body(weights_out, ids_out, logits, tokens, num_experts, top_k, normalize);
}

extern "C" __global__ void moe_route_f32(float* __restrict__ weights_out, int* __restrict__ ids_out,
                                         const float* __restrict__ logits, int tokens,
                                         int num_experts, int top_k, int normalize) {
    route_body(weights_out, ids_out, logits, tokens, num_experts, top_k, normalize);
}

// grid: (T * k, ceil(I / 4)); block: 128. act: [T * k, I] bf16.
extern "C" __global__ void __launch_bounds__(32 * kGateUpWarps)
    moe_gate_up_silu(__nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ hidden,
                     const __nv_bfloat16* __restrict__ gate_up, const int* __restrict__ ids,
                     const int* __restrict__ slots, const __nv_bfloat16* __restrict__ cache_gate_up,
                     int top_k, int num_experts, int hidden_size, int intermediate) {
    pdl_wait();  // before any thread leaves: ids and hidden are earlier kernels' outputs
    pdl_launch_dependents();
    const int pair = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.y * kGateUpWarps + (threadIdx.x >> 5);
    if (row >= intermediate) return;
    const int expert = ids[pair];
    if (expert < 0 || expert >= num_experts) return;
    const int token = pair / top_k;
    const __nv_bfloat16* x = hidden + static_cast<long long>(token) * hidden_size;
    const int slot = slots != nullptr ? slots[expert] : -1;
    const __nv_bfloat16* stack = slot >= 0 ? cache_gate_up : gate_up;
    const __nv_bfloat16* gate =
        stack + (static_cast<long long>(slot >= 0 ? slot : expert) * 2 * intermediate + row) * hidden_size;
    const __nv_bfloat16* up = gate + static_cast<long long>(intermediate) * hidden_size;

    float g = 0.0f, u = 0.0f;
    for (int base = 8 * lane; base < hidden_size; base += kUnroll * kWarpSpan) {
        uint4 gv[kUnroll], uv[kUnroll], xv[kUnroll];
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) {
            const int at = base + c * kWarpSpan;
            gv[c] = load16(gate + at, at < hidden_size);
            uv[c] = load16(up + at, at < hidden_size);
        }
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) {
            const int at = base + c * kWarpSpan;
            xv[c] = load16(x + at, at < hidden_size);
        }
#pragma unroll
        for (int c = 0; c < kUnroll; ++c) {
            g = dot8(gv[c], xv[c], g);
            u = dot8(uv[c], xv[c], u);
        }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) {
        // F.linear rounds g and u to bf16; silu(gate) is rounded before the
        // product, as in kernels/activation.cu.
        const float g_rounded = __bfloat162float(__float2bfloat16(g));
        const float u_rounded = __bfloat162float(__float2bfloat16(u));
        const float activated = __bfloat162float(__float2bfloat16(silu(g_rounded)));
        act[static_cast<long long>(pair) * intermediate + row] = __float2bfloat16(activated * u_rounded);
    }
}

// grid: (T, ceil(H / 4)); block: 256. top_k <= 16.
extern "C" __global__ void __launch_bounds__(32 * kDownWarps)
    moe_down_sum(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ act,
                 const __nv_bfloat16* __restrict__ down, const int* __restrict__ ids,
                 const float* __restrict__ weights, const int* __restrict__ slots,
                 const __nv_bfloat16* __restrict__ cache_down, int top_k, int num_experts,
                 int hidden_size, int intermediate) {
    __shared__ float contribution[kMaxTopK][kDownRows];
    pdl_wait();  // act, ids and weights are earlier kernels' outputs
    pdl_launch_dependents();
    const int token = blockIdx.x;
    const int h0 = blockIdx.y * kDownRows;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int items = top_k * kDownRows;
    for (int item = warp; item < items; item += kDownWarps) {
        const int slot = item / kDownRows;
        const int r = item % kDownRows;
        const int h = h0 + r;
        const int pair = token * top_k + slot;
        const int expert = ids[pair];
        float c = 0.0f;
        // Warp-uniform conditions: the whole warp takes the same branch.
        if (h < hidden_size && expert >= 0 && expert < num_experts) {
            const int slot = slots != nullptr ? slots[expert] : -1;
            const __nv_bfloat16* w_row = (slot >= 0 ? cache_down : down)
                + (static_cast<long long>(slot >= 0 ? slot : expert) * hidden_size + h) * intermediate;
            const __nv_bfloat16* a_row = act + static_cast<long long>(pair) * intermediate;
            const float y = __bfloat162float(__float2bfloat16(warp_dot(w_row, a_row, intermediate, lane)));
            c = __bfloat162float(__float2bfloat16(y * weights[pair]));
        }
        if (lane == 0) contribution[slot][r] = c;
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r >= kDownRows || h0 + r >= hidden_size) return;
    float sum = 0.0f;
    for (int slot = 0; slot < top_k; ++slot) sum += contribution[slot][r];
    out[static_cast<long long>(token) * hidden_size + h0 + r] = __float2bfloat16(sum);
}
