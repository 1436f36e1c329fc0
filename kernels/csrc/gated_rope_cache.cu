// Qwen3-Next's and Qwen3.5's GatedAttention before the attention proper, in
// one launch: zero-centred q/k RMSNorm per head, RoPE on the first R dims of
// each head (partial rotary), the paged K/V cache write and q out, reading
// the projection's interleaved output in place. Plus the output gate
// (attention output times sigmoid(gate)), a second small kernel.
//
// projected: [T, W], W = 2 Hq D + 2 Hkv D; per token: for each q head h, D
// values of q at h * 2D and D of its gate at h * 2D + D; then the Hkv k
// heads (D each), then the Hkv v heads. For every (token, head):
//   q head: q_out[t, h]                    = rope_R(zc_norm(q, q_norm_weight))
//   k head: k_cache.view(-1, Hkv, D)[slot] = rope_R(zc_norm(k, k_norm_weight))  (slot >= 0)
//   v head: v_cache.view(-1, Hkv, D)[slot] = v                                  (slot >= 0)
// Numerics of kernels.hybrid_reference.gated_qk_norm_rope (torch's ops):
//   zc_norm: bf16((x * rsqrtf(sum(x^2) * (1/D) + eps)) * (1 + w)), float32, one rounding
//   rope_R:  on dims [0, R): out1 = bf16(bf16(x1 c) - bf16(x2 s)),
//            out2 = bf16(bf16(x2 c) + bf16(x1 s)), x1 = dims [0, R/2), x2 = [R/2, R);
//            dims [R, D) pass through.
// Only the variance's summation order differs from torch.
//
// Work split (as rope_cache.cu): D / 16 consecutive threads own one head;
// thread j holds 16-byte vector j of the head's first half (lo) and vector j
// of its second half (hi). With R = D the rotation pairs are (lo, hi) of one
// thread. With R <= D / 2 (R / 16 a power of two) the rotated dims are the
// first R / 8 lo vectors: thread j < R / 16 holds an x1 vector whose x2 is
// thread j + R / 16's lo, exchanged with one xor shuffle.
//
// Programmatic Dependent Launch (pdl.cuh): both kernels wait for their
// predecessor first thing, then let the next kernel launch.
// pdl-aware: gated_rope_and_cache_d* sigmoid_gate_mul
#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "pdl.cuh"

namespace {

// An fp8 KV cache (--kv-dtype fp8) holds float8 e4m3 bytes: x / scale rounded
// to nearest even and saturated at +-448 (e4m3's largest finite value), as
// torch's (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn). Done
// in integer steps, not with cuda_fp8.h: the same on every architecture and
// nothing included beyond cuda_bf16.h. (NaN saturates to 448 here.)
__device__ __forceinline__ unsigned float_to_e4m3(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), 448.0f);
    unsigned code;
    if (a < 0.015625f) {
        // Below 2^-6, e4m3's subnormals: steps of 2^-9 (8 steps reach the
        // smallest normal, whose code is 8 as well).
        code = static_cast<unsigned>(__float2int_rn(a * 512.0f));
    } else {
        // Round the 23-bit mantissa to 3 bits (nearest even; a carry moves
        // into the exponent), then rebias the exponent from 127 to 7.
        unsigned bits = __float_as_uint(a);
        bits += 0x7ffffu + ((bits >> 20) & 1u);
        code = (bits >> 20) - (120u << 3);
    }
    return sign | code;
}

// A cache row's 8 values (bf16, as computed) into the cache at p: as they
// are for a bf16 cache, as e4m3(x / scale) bytes for an fp8 one.
__device__ __forceinline__ void store_cache(__nv_bfloat16* p, const uint4& v, float) {
    store_vec(p, v);
}

__device__ __forceinline__ void store_cache(unsigned char* p, const uint4& v, float scale) {
    unsigned words[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        words[i >> 2] |= float_to_e4m3(__fdiv_rn(vec_get(v, i), scale)) << (8 * (i & 3));
    }
    *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
}

// bf16((x * scale) * (1 + w)), each float32 step rounded once (no FMA).
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

// The first half's output of rotate_half for 8 pairs: bf16(bf16(x1 c) - bf16(x2 s)).
__device__ __forceinline__ uint4 rotate_first(const uint4& x1, const uint4& x2, const uint4& cos,
                                              const uint4& sin, bool position_ok) {
    const float nan = __int_as_float(0x7fc00000);
    uint4 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        // An out-of-range position has no table row: NaN out, never a stray read.
        const float c = position_ok ? vec_get(cos, i) : nan;
        const float s = position_ok ? vec_get(sin, i) : nan;
        const float r = __fsub_rn(round_bf16(__fmul_rn(vec_get(x1, i), c)),
                                  round_bf16(__fmul_rn(vec_get(x2, i), s)));
        vec_set(out, i, __float2bfloat16_rn(r));
    }
    return out;
}

// The second half's: bf16(bf16(x2 c) + bf16(x1 s)).
__device__ __forceinline__ uint4 rotate_second(const uint4& x1, const uint4& x2, const uint4& cos,
                                               const uint4& sin, bool position_ok) {
    const float nan = __int_as_float(0x7fc00000);
    uint4 out;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float c = position_ok ? vec_get(cos, i) : nan;
        const float s = position_ok ? vec_get(sin, i) : nan;
        const float r = __fadd_rn(round_bf16(__fmul_rn(vec_get(x2, i), c)),
                                  round_bf16(__fmul_rn(vec_get(x1, i), s)));
        vec_set(out, i, __float2bfloat16_rn(r));
    }
    return out;
}

__device__ __forceinline__ uint4 shfl_xor_vec(unsigned mask, const uint4& v, int offset) {
    return make_uint4(__shfl_xor_sync(mask, v.x, offset), __shfl_xor_sync(mask, v.y, offset),
                      __shfl_xor_sync(mask, v.z, offset), __shfl_xor_sync(mask, v.w, offset));
}

template <int D, typename Cache>
__device__ __forceinline__ void gated_rope_and_cache(
    __nv_bfloat16* __restrict__ q_out, Cache* __restrict__ k_cache,
    Cache* __restrict__ v_cache, const __nv_bfloat16* __restrict__ projected,
    const long long* __restrict__ positions, const __nv_bfloat16* __restrict__ cos_sin_cache,
    const long long* __restrict__ slot_mapping, const __nv_bfloat16* __restrict__ q_norm_weight,
    const __nv_bfloat16* __restrict__ k_norm_weight, int tokens, int num_heads,
    int num_kv_heads, int rotary_dim, int max_positions, long long num_slots, float eps,
    float k_scale, float v_scale) {
    constexpr int kGroup = D / 16;  // threads per head: 16 (D = 256), 8 (128) or 4 (64)
    static_assert(kGroup <= 32, "a head's threads share one warp (the shuffles)");
    constexpr int kHalf = D / 2;
    pdl_wait();  // before anything is read: projected, positions and slots are earlier outputs
    pdl_launch_dependents();
    const int heads_per_token = num_heads + 2 * num_kv_heads;
    const int thread = blockIdx.x * blockDim.x + threadIdx.x;
    const int group = thread / kGroup;
    const int j = thread % kGroup;
    // Groups are aligned runs of kGroup lanes: a group leaves (or stays) whole,
    // so its shuffles below only involve lanes that are all present.
    if (group >= tokens * heads_per_token) return;
    const int token = group / heads_per_token;
    const int head = group - token * heads_per_token;

    // The head's place in the projection row: q heads every 2D (gate between).
    const long long row_width = 2LL * (num_heads + num_kv_heads) * D;
    long long column;
    if (head < num_heads) {
        column = 2LL * head * D;
    } else {
        column = 2LL * num_heads * D + static_cast<long long>(head - num_heads) * D;
    }
    const __nv_bfloat16* src = projected + token * row_width + column + j * 8;
    uint4 lo = load_vec(src);
    uint4 hi = load_vec(src + kHalf);
    const bool is_q = head < num_heads;
    long long slot = -1;
    if (!is_q) {
        slot = slot_mapping[token];
        // < 0: a padding row of a graph batch, not cached; past the cache's
        // end (not checkable without a sync): skipped, never a stray write.
        if (slot >= num_slots) slot = -1;
    }

    if (head >= num_heads + num_kv_heads) {  // v: a straight copy
        if (slot >= 0) {
            Cache* dst = v_cache + (slot * num_kv_heads + (head - num_heads - num_kv_heads)) * D +
                         j * 8;
            store_cache(dst, lo, v_scale);
            store_cache(dst + kHalf, hi, v_scale);
        }
        return;
    }

    const long long position = positions[token];
    const bool position_ok = position >= 0 && position < max_positions;
    const int rotary_half = rotary_dim / 2;
    // Table row: cos of the R/2 frequencies, then their sin. Thread j's pair
    // index: j (full rotary) or j mod R/16 (partial).
    const int pair_vector = rotary_dim == D ? j : (j & (rotary_dim / 16 - 1));
    const __nv_bfloat16* table =
        cos_sin_cache + (position_ok ? position : 0LL) * rotary_dim + pair_vector * 8;
    const uint4 cos = load_vec(table);
    const uint4 sin = load_vec(table + rotary_half);

    const __nv_bfloat16* weight = is_q ? q_norm_weight : k_norm_weight;
    const uint4 w_lo = load_vec(weight + j * 8);
    const uint4 w_hi = load_vec(weight + kHalf + j * 8);
    const unsigned lane = threadIdx.x & 31;
    const unsigned mask = kGroup == 32 ? 0xffffffffu
                                       : ((1u << kGroup) - 1u)
                                             << (lane & ~static_cast<unsigned>(kGroup - 1));
    float sum = vec_sum_squares(hi, vec_sum_squares(lo, 0.0f));
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(mask, sum, offset);
    }
    // D is a power of two: 1/D is exact, the factor torch's mean multiplies by.
    const float scale = rsqrtf(__fadd_rn(__fmul_rn(sum, 1.0f / D), eps));
    lo = vec_normalize_zero_centred(lo, w_lo, scale);
    hi = vec_normalize_zero_centred(hi, w_hi, scale);

    if (rotary_dim == D) {
        const uint4 first = rotate_first(lo, hi, cos, sin, position_ok);
        hi = rotate_second(lo, hi, cos, sin, position_ok);
        lo = first;
    } else {
        // Every lane of the group shuffles (the mask names them all).
        const int partner_offset = rotary_dim / 16;
        const uint4 partner = shfl_xor_vec(mask, lo, partner_offset);
        if (j < partner_offset) {
            lo = rotate_first(lo, partner, cos, sin, position_ok);
        } else if (j < 2 * partner_offset) {
            lo = rotate_second(partner, lo, cos, sin, position_ok);
        }
    }

    if (is_q) {
        __nv_bfloat16* dst = q_out + (static_cast<long long>(token) * num_heads + head) * D + j * 8;
        store_vec(dst, lo);
        store_vec(dst + kHalf, hi);
    } else if (slot >= 0) {
        Cache* dst = k_cache + (slot * num_kv_heads + (head - num_heads)) * D + j * 8;
        store_cache(dst, lo, k_scale);
        store_cache(dst + kHalf, hi, k_scale);
    }
}

// torch's CUDA sigmoid: 1 / (1 + exp(-x)) in float32, rounded to bf16.
__device__ __forceinline__ float sigmoid_bf16(float x) {
    return round_bf16(__fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))));
}

}  // namespace

// grid: ceil(T * (Hq + 2 Hkv) * D / 16 / blockDim.x), blockDim.x a multiple of 32.
// rotary_dim: D, or R <= D / 2 with R / 16 a power of two. num_slots = P * S.
#define ROUNDHOUSE_GATED_ROPE_KERNEL(D)                                                         \
    extern "C" __global__ void gated_rope_and_cache_d##D(                                       \
        __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,                   \
        const __nv_bfloat16* projected, const long long* positions,                             \
        const __nv_bfloat16* cos_sin_cache, const long long* slot_mapping,                      \
        const __nv_bfloat16* q_norm_weight, const __nv_bfloat16* k_norm_weight, int tokens,     \
        int num_heads, int num_kv_heads, int rotary_dim, int max_positions,                     \
        long long num_slots, float eps) {                                                       \
        gated_rope_and_cache<D>(q_out, k_cache, v_cache, projected, positions, cos_sin_cache,   \
                                slot_mapping, q_norm_weight, k_norm_weight, tokens, num_heads,  \
                                num_kv_heads, rotary_dim, max_positions, num_slots, eps, 1.0f,  \
                                1.0f);                                                          \
    }

// The fp8 cache's kernels: k_cache / v_cache hold e4m3 bytes (rope_cache.cu's).
#define ROUNDHOUSE_GATED_ROPE_FP8_KERNEL(D)                                                     \
    extern "C" __global__ void gated_rope_and_cache_d##D##_fp8(                                 \
        __nv_bfloat16* q_out, unsigned char* k_cache, unsigned char* v_cache,                   \
        const __nv_bfloat16* projected, const long long* positions,                             \
        const __nv_bfloat16* cos_sin_cache, const long long* slot_mapping,                      \
        const __nv_bfloat16* q_norm_weight, const __nv_bfloat16* k_norm_weight, int tokens,     \
        int num_heads, int num_kv_heads, int rotary_dim, int max_positions,                     \
        long long num_slots, float eps, float k_scale, float v_scale) {                         \
        gated_rope_and_cache<D>(q_out, k_cache, v_cache, projected, positions, cos_sin_cache,   \
                                slot_mapping, q_norm_weight, k_norm_weight, tokens, num_heads,  \
                                num_kv_heads, rotary_dim, max_positions, num_slots, eps,        \
                                k_scale, v_scale);                                              \
    }

ROUNDHOUSE_GATED_ROPE_KERNEL(64)
ROUNDHOUSE_GATED_ROPE_KERNEL(128)
// D = 256: Qwen3-Next's and Qwen3.5's full-attention layers (R = 64).
ROUNDHOUSE_GATED_ROPE_KERNEL(256)
ROUNDHOUSE_GATED_ROPE_FP8_KERNEL(64)
ROUNDHOUSE_GATED_ROPE_FP8_KERNEL(128)
ROUNDHOUSE_GATED_ROPE_FP8_KERNEL(256)

// The output gate: out[t, h, :] = bf16(attn[t, h, :] * bf16(sigmoid(gate[t, h, :]))),
// as torch's bf16 ops (sigmoid rounded to bf16, then the bf16 product). attn,
// out: [T, Hq * D] contiguous (out may be attn); the gate is read from the
// projection row (row_width elements a token, head h's at h * 2D + D).
// One thread per 8 elements; grid: ceil(T * Hq * D / 8 / blockDim.x).
extern "C" __global__ void sigmoid_gate_mul(__nv_bfloat16* out, const __nv_bfloat16* attn,
                                            const __nv_bfloat16* __restrict__ projected,
                                            int tokens, int num_heads, int head_dim,
                                            long long row_width) {
    pdl_wait();  // before any thread leaves: attn and the projection are earlier outputs
    pdl_launch_dependents();
    const long long vector = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int vectors_per_head = head_dim / 8;
    const long long vectors_per_token = static_cast<long long>(num_heads) * vectors_per_head;
    if (vector >= tokens * vectors_per_token) return;
    const long long token = vector / vectors_per_token;
    const int within = static_cast<int>(vector - token * vectors_per_token);
    const int head = within / vectors_per_head;
    const int j = within - head * vectors_per_head;
    const uint4 a = load_vec(attn + vector * 8);
    const uint4 g = load_vec(projected + token * row_width +
                             (2LL * head + 1) * head_dim + j * 8);
    uint4 result;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        vec_set(result, i,
                __float2bfloat16_rn(__fmul_rn(vec_get(a, i), sigmoid_bf16(vec_get(g, i)))));
    }
    store_vec(out + vector * 8, result);
}
