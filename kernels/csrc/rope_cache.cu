// Rotary embedding fused with the paged KV-cache write, with Qwen3's per-head
// q/k RMSNorm before the rotation. bf16 everywhere, float32 arithmetic; the
// cache is bf16 or fp8 (float8 e4m3 with per-tensor scales: the _fp8 kernels).
//
// qkv: [T, (Hq + 2 Hkv) * D], per token the q heads, then the k heads, then
// the v heads, each D contiguous values. For every (token, head):
//   q head: q_out[t, h]                     = rope(norm?(q))
//   k head: k_cache.view(-1, Hkv, D)[slot]  = rope(norm?(k))   (slot >= 0)
//   v head: v_cache.view(-1, Hkv, D)[slot]  = v                (slot >= 0)
//
// Work split: D / 16 consecutive threads own one head ("group"); thread j of
// it holds the 16-byte vector j of the head's first half (x1) and vector j of
// its second half (x2), exactly the pairs that rotate_half combines, so the
// rotation needs no data exchange. The norm's sum of squares is reduced with
// shuffles inside the group. Groups run over (token, head) flattened, so a
// 128-thread CTA covers 8 heads (D = 256), 16 (D = 128) or 32 (D = 64)
// whatever Hq/Hkv are; T = 1 in Qwen3-0.6B (32 heads) is 2 CTAs, T = 8192 is 16384 CTAs.
//
// Rounding follows kernels.reference.apply_rope/_rotate, torch's bf16
// elementwise semantics: each product x * cos is a bf16 * bf16 product
// rounded to bf16, then the difference / sum of two such is rounded to bf16.
// The result is therefore bitwise equal to the reference.
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing, then lets the next kernel launch.
// pdl-aware: rope_and_cache_d*
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

// out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin, torch's rounding.
// On return lo holds out1 and hi out2.
__device__ __forceinline__ void rotate(uint4& lo, uint4& hi, const uint4& cos, const uint4& sin,
                                       bool position_ok) {
    const float nan = __int_as_float(0x7fc00000);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x1 = vec_get(lo, i);
        const float x2 = vec_get(hi, i);
        // An out-of-range position has no table row: NaN out, never a stray read.
        const float c = position_ok ? vec_get(cos, i) : nan;
        const float s = position_ok ? vec_get(sin, i) : nan;
        const float out1 = round_bf16(x1 * c) - round_bf16(x2 * s);
        const float out2 = round_bf16(x2 * c) + round_bf16(x1 * s);
        vec_set(lo, i, __float2bfloat16_rn(out1));
        vec_set(hi, i, __float2bfloat16_rn(out2));
    }
}

template <int D, typename Cache>
__device__ __forceinline__ void rope_and_cache(
    __nv_bfloat16* __restrict__ q_out, Cache* __restrict__ k_cache,
    Cache* __restrict__ v_cache, const __nv_bfloat16* __restrict__ qkv,
    const long long* __restrict__ positions, const __nv_bfloat16* __restrict__ cos_sin_cache,
    const long long* __restrict__ slot_mapping, const __nv_bfloat16* __restrict__ q_norm_weight,
    const __nv_bfloat16* __restrict__ k_norm_weight, int tokens, int num_heads,
    int num_kv_heads, int max_positions, long long num_slots, float eps, float k_scale,
    float v_scale) {
    constexpr int kGroup = D / 16;  // threads per head: 16 (D = 256), 8 (D = 128) or 4 (D = 64)
    static_assert(kGroup <= 32, "a head's threads share one warp (the norm's shuffles)");
    constexpr int kHalf = D / 2;
    pdl_wait();  // before anything is read: qkv, positions and slots are earlier kernels' outputs
    pdl_launch_dependents();
    const int heads_per_token = num_heads + 2 * num_kv_heads;
    const int thread = blockIdx.x * blockDim.x + threadIdx.x;
    const int group = thread / kGroup;
    const int j = thread % kGroup;
    // Groups are aligned runs of kGroup lanes, so a group leaves (or stays)
    // whole and its shuffles below only involve lanes that are all present.
    if (group >= tokens * heads_per_token) return;
    const int token = group / heads_per_token;
    const int head = group - token * heads_per_token;

    // Independent loads first: the head's two vectors, the slot, the position.
    const __nv_bfloat16* src = qkv + static_cast<long long>(group) * D + j * 8;
    uint4 lo = load_vec(src);
    uint4 hi = load_vec(src + kHalf);
    const bool is_q = head < num_heads;
    long long slot = -1;
    if (!is_q) {
        slot = slot_mapping[token];
        // < 0: a padding row of a graph batch, not cached. Past the cache's
        // end cannot be caught on the host without a sync: skipped too, so a
        // bad slot never writes outside the cache.
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
    const __nv_bfloat16* row = cos_sin_cache + (position_ok ? position : 0LL) * D + j * 8;
    const uint4 cos = load_vec(row);
    const uint4 sin = load_vec(row + kHalf);

    const __nv_bfloat16* weight = is_q ? q_norm_weight : k_norm_weight;
    if (weight != nullptr) {
        const uint4 w_lo = load_vec(weight + j * 8);
        const uint4 w_hi = load_vec(weight + kHalf + j * 8);
        float sum = vec_sum_squares(hi, vec_sum_squares(lo, 0.0f));
        const unsigned lane = threadIdx.x & 31;
        const unsigned mask = ((1u << kGroup) - 1u) << (lane & ~static_cast<unsigned>(kGroup - 1));
#pragma unroll
        for (int offset = kGroup / 2; offset > 0; offset >>= 1) {
            sum += __shfl_xor_sync(mask, sum, offset);
        }
        // D is a power of two: 1/D is exact, the same factor torch's mean uses.
        const float scale = rms_scale(sum, 1.0f / D, eps);
        lo = vec_normalize(lo, w_lo, scale);
        hi = vec_normalize(hi, w_hi, scale);
    }

    rotate(lo, hi, cos, sin, position_ok);

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

}  // namespace

// grid: ceil(T * (Hq + 2 Hkv) * D / 16 / blockDim.x), blockDim.x a multiple of 32.
// q_norm_weight / k_norm_weight: 0 for no norm. num_slots = P * S.
#define ROUNDHOUSE_ROPE_KERNEL(D)                                                               \
    extern "C" __global__ void rope_and_cache_d##D(                                             \
        __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,                   \
        const __nv_bfloat16* qkv, const long long* positions,                                   \
        const __nv_bfloat16* cos_sin_cache, const long long* slot_mapping,                      \
        const __nv_bfloat16* q_norm_weight, const __nv_bfloat16* k_norm_weight, int tokens,     \
        int num_heads, int num_kv_heads, int max_positions, long long num_slots, float eps) {   \
        rope_and_cache<D>(q_out, k_cache, v_cache, qkv, positions, cos_sin_cache, slot_mapping, \
                          q_norm_weight, k_norm_weight, tokens, num_heads, num_kv_heads,        \
                          max_positions, num_slots, eps, 1.0f, 1.0f);                           \
    }

// The fp8 cache's kernels: k_cache / v_cache hold e4m3 bytes, written as
// e4m3(x / k_scale) and e4m3(x / v_scale).
#define ROUNDHOUSE_ROPE_FP8_KERNEL(D)                                                           \
    extern "C" __global__ void rope_and_cache_d##D##_fp8(                                       \
        __nv_bfloat16* q_out, unsigned char* k_cache, unsigned char* v_cache,                   \
        const __nv_bfloat16* qkv, const long long* positions,                                   \
        const __nv_bfloat16* cos_sin_cache, const long long* slot_mapping,                      \
        const __nv_bfloat16* q_norm_weight, const __nv_bfloat16* k_norm_weight, int tokens,     \
        int num_heads, int num_kv_heads, int max_positions, long long num_slots, float eps,     \
        float k_scale, float v_scale) {                                                         \
        rope_and_cache<D>(q_out, k_cache, v_cache, qkv, positions, cos_sin_cache, slot_mapping, \
                          q_norm_weight, k_norm_weight, tokens, num_heads, num_kv_heads,        \
                          max_positions, num_slots, eps, k_scale, v_scale);                     \
    }

ROUNDHOUSE_ROPE_KERNEL(64)
ROUNDHOUSE_ROPE_KERNEL(128)
// D = 256: Qwen3-Next's and Qwen3.5's full-attention layers (q/k arrive
// rotated there; this kernel writes the cache with the identity rotation).
ROUNDHOUSE_ROPE_KERNEL(256)
ROUNDHOUSE_ROPE_FP8_KERNEL(64)
ROUNDHOUSE_ROPE_FP8_KERNEL(128)
ROUNDHOUSE_ROPE_FP8_KERNEL(256)
