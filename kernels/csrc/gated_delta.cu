// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the causal depthwise
// conv with its state update, and the gated delta rule, token by token, over
// per-sequence state slots. Semantics of kernels/gated_delta_reference.py.
//
// Batch layout (all on the device, read by the kernels, never by the host):
//   query_start_loc int32 [B + 1]: sequence b owns rows qsl[b]..qsl[b+1]-1;
//   slots int64 [B]: its state slot (< 0: no slot, the sequence is skipped);
//   fresh uint8 [B]: non-zero = start from zero state.
// A sequence with no tokens leaves its slot untouched. Two sequences of one
// batch must not share a slot (the wrapper cannot check it without a sync).
// Launch grids depend on the shapes alone, so CUDA graphs capture them.
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing, before any thread can leave (the batch layout,
// the inputs and the states may all be earlier kernels' work), then lets
// the next kernel launch.
// pdl-aware: causal_conv1d_k* conv_state_update_k* gated_delta_rule_dk*
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float bf16_at(const __nv_bfloat16* p, long i) {
    return __bfloat162float(p[i]);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// The sequence owning flat row t: the last b with qsl[b] <= t (binary search;
// qsl is non-decreasing). Returns -1 past qsl[B] (padding rows).
__device__ __forceinline__ int sequence_of(const int* qsl, int num_seqs, int t) {
    if (t >= qsl[num_seqs]) return -1;
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// ---------------------------------------------------------------------------
// Causal conv1d. Window of sequence b, channel c: [state (K-1, oldest first),
// its inputs in this batch]; y[t] = silu(bias + sum_j w[j] * window[t + j]),
// float32 accumulate, rounded to bf16 once.
//
// Two kernels, run in order on one stream: conv reads the old states and
// writes y; state_update then writes the new states. One kernel could not do
// both: its token tiles of one sequence run in any order, so the tile holding
// a sequence's last inputs could overwrite the state before the first tile
// read it.

// The window element w (0-based) of a sequence starting at row `start`.
template <int K>
__device__ __forceinline__ float window_at(const __nv_bfloat16* x, long x_stride,
                                           const __nv_bfloat16* state, bool zero_state,
                                           int start, int w, int c) {
    if (w >= K - 1) return bf16_at(x, static_cast<long>(start + w - (K - 1)) * x_stride + c);
    return zero_state ? 0.0f : bf16_at(state, w);
}

// grid: (ceil(T / TILE), ceil(C / blockDim.x)); a thread per channel walks
// TILE consecutive rows, keeping the last K-1 inputs in registers.
template <int K, int TILE>
__device__ __forceinline__ void conv_tile(__nv_bfloat16* __restrict__ y,
                                          const __nv_bfloat16* __restrict__ x, long x_stride,
                                          const __nv_bfloat16* __restrict__ weight,
                                          const __nv_bfloat16* __restrict__ bias,
                                          const __nv_bfloat16* __restrict__ conv_states,
                                          const long long* __restrict__ slots,
                                          const unsigned char* __restrict__ fresh,
                                          const int* __restrict__ qsl, int num_seqs,
                                          int tokens, int channels) {
    pdl_wait();
    pdl_launch_dependents();
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = bf16_at(weight, static_cast<long>(c) * K + j);
    const float b0 = bias ? bf16_at(bias, c) : 0.0f;
    const int first = blockIdx.x * TILE;
    int seq = -2, start = 0, end = 0;
    float history[K - 1];  // window[t - K + 1 .. t - 1], oldest first (K >= 2)
    for (int t = first; t < first + TILE && t < tokens; ++t) {
        if (t >= end || seq < 0) {
            // A new sequence (or the tile's first row): reload the history.
            seq = sequence_of(qsl, num_seqs, t);
            if (seq < 0) {
                y[static_cast<long>(t) * channels + c] = __float2bfloat16_rn(0.0f);
                continue;
            }
            start = qsl[seq];
            end = qsl[seq + 1];
            const long long slot = slots[seq];
            const bool zero_state = fresh[seq] != 0 || slot < 0;
            const __nv_bfloat16* state =
                conv_states + (slot < 0 ? 0 : (slot * channels + c) * (K - 1));
            const int w_t = (K - 1) + (t - start);  // window index of row t
#pragma unroll
            for (int j = 0; j < K - 1; ++j) {
                history[j] = window_at<K>(x, x_stride, state, zero_state, start,
                                          w_t - (K - 1) + j, c);
            }
        }
        const float current = bf16_at(x, static_cast<long>(t) * x_stride + c);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc = fmaf(w[j], history[j], acc);
        acc = fmaf(w[K - 1], current, acc);
        y[static_cast<long>(t) * channels + c] = __float2bfloat16_rn(silu(acc + b0));
#pragma unroll
        for (int j = 0; j + 1 < K - 1; ++j) history[j] = history[j + 1];
        history[K - 2] = current;
    }
}

// grid: (B, ceil(C / blockDim.x)). conv_states[slot][c] = the last K-1
// window elements: older state entries when the chunk is shorter than K-1.
template <int K>
__device__ __forceinline__ void state_update(const __nv_bfloat16* __restrict__ x, long x_stride,
                                             __nv_bfloat16* __restrict__ conv_states,
                                             const long long* __restrict__ slots,
                                             const unsigned char* __restrict__ fresh,
                                             const int* __restrict__ qsl, int channels) {
    pdl_wait();
    pdl_launch_dependents();
    const int seq = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int start = qsl[seq];
    const int length = qsl[seq + 1] - start;
    const long long slot = slots[seq];
    if (length <= 0 || slot < 0) return;
    __nv_bfloat16* state = conv_states + (slot * channels + c) * (K - 1);
    const bool zero_state = fresh[seq] != 0;
    float next[K - 1];
    // All reads before any write: this thread alone owns these K-1 entries.
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        next[j] = window_at<K>(x, x_stride, state, zero_state, start, length + j, c);
    }
#pragma unroll
    for (int j = 0; j < K - 1; ++j) state[j] = __float2bfloat16_rn(next[j]);
}

// ---------------------------------------------------------------------------
// Gated delta rule, recurrent form. grid: (B, Hv, Dv / 32), 128 threads.
// A CTA owns the Dk x 32 float32 state block of one sequence, value head and
// 32 value columns, in registers across all the sequence's tokens. Warp w
// owns columns 8w..8w+7; lane = kq * 8 + cl holds column cl of rows
// kq, kq + 4, kq + 8, ... (DK / 4 of them): a row's 8 columns are one 32-byte
// sector (coalesced state loads), the dot products over k are an in-thread
// sum plus two shuffles, and the rows kq + 4i read from shared memory by the
// four kq groups fall in four banks (no conflicts).
//
// Per token (q/k head h / (Hv / Hk)), as the reference:
//   q, k <- l2norm(q), l2norm(k) (float32, eps inside the rsqrt); q *= Dk^-0.5
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h]); beta = bf16(sigmoid(b))
//   S *= exp(g); u = beta (v - S^T k); S += k u^T; o = S^T q.
// Each warp normalises q and k itself (one warp-wide sum each) into its own
// shared buffers: no CTA barrier in the token loop.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

// torch's softplus (beta 1, threshold 20): x above the threshold, else log1p(exp(x)).
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

template <int N>
__device__ __forceinline__ float chain_sum(const float (&part)[N]) {
    float total = part[0];
#pragma unroll
    for (int i = 1; i < N; ++i) total += part[i];
    return total;
}

template <int DK>
__device__ __forceinline__ void delta_rule_block(
    __nv_bfloat16* __restrict__ out, float* __restrict__ states,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, long qk_stride,
    const __nv_bfloat16* __restrict__ v, long v_stride,
    const __nv_bfloat16* __restrict__ a, long a_stride,
    const __nv_bfloat16* __restrict__ b, long b_stride,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const long long* __restrict__ slots, const unsigned char* __restrict__ fresh,
    const int* __restrict__ qsl, int num_k_heads, int num_v_heads, int dv, float q_scale,
    float eps) {
    constexpr int kRows = DK / 4;   // state rows per thread
    constexpr int kPerLane = DK / 32;  // q/k elements each lane loads
    constexpr int kChains = 4;         // divides kRows (16, 32 or 64)
    __shared__ float q_norm[4][DK];
    __shared__ float k_norm[4][DK];

    pdl_wait();
    pdl_launch_dependents();
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int kq = lane >> 3;
    const int column = blockIdx.z * 32 + warp * 8 + (lane & 7);
    const int start = qsl[seq];
    const int end = qsl[seq + 1];
    const long long slot = slots[seq];
    if (end <= start || slot < 0) return;
    const int key_head = head / (num_v_heads / num_k_heads);
    float* state = states + ((slot * num_v_heads + head) * static_cast<long>(DK)) * dv + column;

    float s[kRows];
    if (fresh[seq]) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = 0.0f;
    } else {
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = state[static_cast<long>(kq + 4 * i) * dv];
    }
    const float decay_rate = expf(a_log[head]);
    const float head_bias = dt_bias[head];

    // The next token's operands, loaded one token ahead so their latency
    // hides behind the current token's arithmetic.
    float next_q[kPerLane], next_k[kPerLane];
    float next_v = 0.0f, next_a = 0.0f, next_b = 0.0f;
    auto load = [&](int t) {
        const long qk_row = static_cast<long>(t) * qk_stride + key_head * DK + lane * kPerLane;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            next_q[i] = bf16_at(q, qk_row + i);
            next_k[i] = bf16_at(k, qk_row + i);
        }
        next_v = bf16_at(v, static_cast<long>(t) * v_stride + static_cast<long>(head) * dv + column);
        next_a = bf16_at(a, static_cast<long>(t) * a_stride + head);
        next_b = bf16_at(b, static_cast<long>(t) * b_stride + head);
    };
    load(start);
    for (int t = start; t < end; ++t) {
        float qv[kPerLane], kv[kPerLane];
        float q_ss = 0.0f, k_ss = 0.0f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            qv[i] = next_q[i];
            kv[i] = next_k[i];
            q_ss = fmaf(qv[i], qv[i], q_ss);
            k_ss = fmaf(kv[i], kv[i], k_ss);
        }
        const float value = next_v, a_t = next_a, b_t = next_b;
        if (t + 1 < end) load(t + 1);
        const float q_inv = rsqrtf(warp_sum(q_ss) + eps);
        const float k_inv = rsqrtf(warp_sum(k_ss) + eps);
        __syncwarp();  // every lane is done reading the previous token's buffers
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
            q_norm[warp][lane * kPerLane + i] = (qv[i] * q_inv) * q_scale;
            k_norm[warp][lane * kPerLane + i] = kv[i] * k_inv;
        }
        __syncwarp();
        const float g = -decay_rate * softplus(a_t + head_bias);
        const float beta =
            __bfloat162float(__float2bfloat16_rn(1.0f / (1.0f + expf(-b_t))));
        const float decay = expf(g);
        // Dot products in kChains independent partial sums: one chain of
        // kRows dependent FMAs would be the token loop's critical path.
        float predicted_part[kChains] = {};
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            s[i] *= decay;
            predicted_part[i % kChains] =
                fmaf(k_norm[warp][kq + 4 * i], s[i], predicted_part[i % kChains]);
        }
        float predicted = chain_sum<kChains>(predicted_part);
        predicted += __shfl_xor_sync(kFullMask, predicted, 8);
        predicted += __shfl_xor_sync(kFullMask, predicted, 16);
        const float delta = beta * (value - predicted);
        float o_part[kChains] = {};
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            s[i] = fmaf(k_norm[warp][kq + 4 * i], delta, s[i]);
            o_part[i % kChains] = fmaf(q_norm[warp][kq + 4 * i], s[i], o_part[i % kChains]);
        }
        float o = chain_sum<kChains>(o_part);
        o += __shfl_xor_sync(kFullMask, o, 8);
        o += __shfl_xor_sync(kFullMask, o, 16);
        if (kq == 0) {
            out[(static_cast<long>(t) * num_v_heads + head) * dv + column] = __float2bfloat16_rn(o);
        }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) state[static_cast<long>(kq + 4 * i) * dv] = s[i];
}

}  // namespace

#define ROUNDHOUSE_CONV_KERNELS(K)                                                                \
    extern "C" __global__ void causal_conv1d_k##K(                                                \
        __nv_bfloat16* y, const __nv_bfloat16* x, long x_stride, const __nv_bfloat16* weight,   \
        const __nv_bfloat16* bias, const __nv_bfloat16* conv_states, const long long* slots,     \
        const unsigned char* fresh, const int* qsl, int num_seqs, int tokens, int channels) {     \
        conv_tile<K, 16>(y, x, x_stride, weight, bias, conv_states, slots, fresh, qsl, num_seqs,  \
                         tokens, channels);                                                       \
    }                                                                                             \
    extern "C" __global__ void conv_state_update_k##K(                                            \
        const __nv_bfloat16* x, long x_stride, __nv_bfloat16* conv_states,                       \
        const long long* slots, const unsigned char* fresh, const int* qsl, int channels) {       \
        state_update<K>(x, x_stride, conv_states, slots, fresh, qsl, channels);                   \
    }

ROUNDHOUSE_CONV_KERNELS(2)
ROUNDHOUSE_CONV_KERNELS(3)
ROUNDHOUSE_CONV_KERNELS(4)

#define ROUNDHOUSE_DELTA_KERNEL(DK)                                                               \
    extern "C" __global__ void __launch_bounds__(128) gated_delta_rule_dk##DK(                    \
        __nv_bfloat16* out, float* states, const __nv_bfloat16* q, const __nv_bfloat16* k,       \
        long qk_stride, const __nv_bfloat16* v, long v_stride, const __nv_bfloat16* a,           \
        long a_stride, const __nv_bfloat16* b, long b_stride, const float* a_log,                \
        const float* dt_bias, const long long* slots, const unsigned char* fresh, const int* qsl, \
        int num_k_heads, int num_v_heads, int dv, float q_scale, float eps) {                     \
        delta_rule_block<DK>(out, states, q, k, qk_stride, v, v_stride, a, a_stride, b, b_stride, \
                             a_log, dt_bias, slots, fresh, qsl, num_k_heads, num_v_heads, dv,     \
                             q_scale, eps);                                                                \
    }

ROUNDHOUSE_DELTA_KERNEL(64)
ROUNDHOUSE_DELTA_KERNEL(128)
ROUNDHOUSE_DELTA_KERNEL(256)
