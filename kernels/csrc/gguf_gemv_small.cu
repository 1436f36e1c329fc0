// GGUF packed-weight GEMV for 1..4 rows of x on the CUDA cores (issue 19:
// batch-1 decode at >= 75% of the packed bytes' roofline).
//
// out[M, N] = x[M, K] @ dequantize(W)^T, W in its file layout [N, row_bytes]
// (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K). gguf_quant.cu's tensor-core GEMV serves
// 5..16 rows; at 1..4 rows its 16x16 weight tiles, shared-memory ring and
// per-warp copy/decode/mma chain leave most of the memory system idle. This
// kernel loads the weight straight into registers and does float32 FMAs.
//
// Budget. An 8B Q4_K step at 75% of the copy rate leaves about 6 issue slots
// per weight element per lane (Q6_K 8.5, Q8_0 11), so the decode must be a
// few instructions per element, and what the tensor-core kernel lacked is
// bytes in flight, not arithmetic. Per element at M = 1 a lane spends one
// PRMT (the integer becomes a float, below), one FFMA, a quarter of a
// shared-memory load of x, and the masks, funnel shifts, loads and block
// scales. ptxas 13.0 (sm_90) makes the decode loop, per 64-element unit of
// one row and lane: Q4_K 259 instructions at M = 1 (4.0 per element), Q4_0
// 274, Q5_K 304, Q6_K 326, Q8_0 333 (its FADD per element); at M = 4: 529,
// 536, 571, 623, 592. Each more row of x adds an FFMA and a quarter load per
// element; the weight is decoded once for all M rows.
//
// Self-contained but for pdl.cuh: this file shares only trivial helpers
// with gguf_quant.cu (that one decodes into bf16 pairs for mma, this one into
// float32).
//
// Exactness: as gguf_quant.cu, the result differs from "dequantize to float32,
// then a float32 matmul" only by float32 accumulation order, rounded to bf16
// once. Block integers become floats exactly:
//   - Q8_0: q + 128 goes into the mantissa of 2^23 (one PRMT), one FADD
//     leaves q; sum(w x) = d * sum(q x).
//   - the others (values v < 128): PRMT puts v into bits 16..22 under the
//     exponent of 0.5, i.e. f = (128 + v) / 256, exact, and products f * x are
//     exact inside the FFMA. The bias comes back out through the group's sum
//     of x, which a CTA computes once when it stages x:
//       Q4_K/Q5_K (w = a q - b, a = d sc, b = dmin m): sum(w x) = 256 a S - (128 a + b) X
//       Q6_K (w = a (q - 32), a = d sc):                sum(w x) = 256 a S - 160 a X
//       Q4_0 (w = d (q - 8)):                           sum(w x) = 256 d S - 136 d X
//     with S = sum(f x) and X = sum(x) over the group (256 a, 160 a, 136 d
//     are exact). The same bias (128) as the tensor-core kernel's A operand.
//
// Data path. A lane is (row group g = lane / 4, K lane t = lane % 4): a warp
// takes 8 weight rows (a tile) and walks K in units of 256 elements, lane t
// taking 64 of each unit: Q8_0/Q4_0 blocks 2t and 2t+1, Q4_K/Q5_K qs chunk t
// (groups 2t, 2t + 1), Q6_K the quarter (H = t / 2, j0 = 16 (t % 2)), i.e.
// elements 128 H + 32 S + j0 + [0, 16) for S = 0..3. Each lane issues all its
// loads for the unit before using any (Q4_K: 3 x 16 bytes; Q8_0: 2 x 9 words;
// Q6_K: 18 words), and asks L2 for its next unit's lines (prefetch.global.L2:
// no registers; at a tile's start also for its first unit of the next tile),
// so about two units per warp are in flight. Four lanes read
// one row's unit (a contiguous 144..272 bytes) and 8 rows make one load
// instruction: a few 128-byte lines per instruction, each sector used by the
// same or the next instruction (L1-allocating __ldg, so the next one hits).
// Q4_K/Q5_K blocks are 16-byte aligned (144, 176 bytes; the wrapper checks the
// base): 16-byte loads. Q8_0 (34), Q4_0 (18) and Q6_K (210) are only 2-byte
// aligned (also a row slice of any type but the two K-quants): the lane loads
// the aligned 32-bit words covering its bytes (every word holds a needed
// byte, so nothing past the tensor's pages is touched) and a funnel shift by 0
// or 16 bits realigns them; Q8_0/Q4_0's scale is the low or high half of the
// first word.
//
// x: staged once per CTA in shared memory as float32 (the wrapper only picks
// this kernel when M * K * 4 bytes fit its limit), 4 floats of padding after
// every 64 so the four K lanes' 16-byte loads hit different banks, and the
// per-group sums of x beside it. A CTA is 32 warps and there is one per SM
// (grid <= #SMs), so x is converted once per SM, not once per tile; before
// staging, each warp prefetches its first unit so HBM is busy meanwhile.
//
// Work split (the wrapper picks W from N, K and the SM count only):
//   slot   = W consecutive warps of the CTA (W <= 32, at most 15 slots: one
//            named barrier each); they share tiles, warp i of a slot taking
//            units i, i + W, ... of the tile's K.
//   tiles  = 8-row tiles, slot s of CTA b takes tiles s * grid + b, then
//            += grid * slots, so a small N spreads over all SMs first.
//   reduce = per tile: a lane's M partials summed over the 4 K lanes by
//            shuffles (xor 1, 2), then the W warps' partials through shared
//            memory (double-buffered by tile parity, one named barrier) in
//            warp order; one bf16 rounding. Deterministic: the order depends
//            on W, which depends only on (N, K, SM count).
//
// Programmatic Dependent Launch (pdl.cuh; inside CUDA graphs on Hopper): a
// warp asks L2 for its first unit of the weight, lets the next kernel
// launch, and only then waits for the kernel that wrote x, as
// skinny_gemm.cu's decode kernels do. The weight is no kernel's output and a
// prefetch is only a hint into L2 (the point of coherence); x and out are
// touched after pdl_wait(), which every thread reaches before it can return.
// Numerics are unchanged.
// pdl-aware: gguf_gemv_small_*
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr int kTileRows = 8;    // weight rows per warp (lane / 4)
constexpr int kUnitElems = 256; // K elements per warp step (64 per K lane)
constexpr int kMaxThreads = 1024;

// Per type: block bytes, blocks per 256-element unit, elements per scale
// group (the sum-of-x granularity), whether the bias needs those sums.
struct Q8_0 {
    static constexpr int kBlockBytes = 34, kBlocksPerUnit = 8, kGroup = 32;
    static constexpr bool kSums = false;
};
struct Q4_0 {
    static constexpr int kBlockBytes = 18, kBlocksPerUnit = 8, kGroup = 32;
    static constexpr bool kSums = true;
};
struct Q4_K {
    static constexpr int kBlockBytes = 144, kBlocksPerUnit = 1, kGroup = 32;
    static constexpr bool kSums = true;
};
struct Q5_K {
    static constexpr int kBlockBytes = 176, kBlocksPerUnit = 1, kGroup = 32;
    static constexpr bool kSums = true;
};
struct Q6_K {
    static constexpr int kBlockBytes = 210, kBlocksPerUnit = 1, kGroup = 16;
    static constexpr bool kSums = true;
};

// Shared memory, in floats (the wrapper mirrors these): x [M][x_stride],
// then the sums [M][sum_stride] (types with kSums), then the reduction
// scratch [2][slots][W][8][M].
__device__ __forceinline__ int x_stride(int k) { return k + 4 * ((k + 63) >> 6); }
__device__ __forceinline__ int sum_stride(int k, int group) { return ((k / group) + 3) & ~3; }
// Element e's place in a staged x row (e a multiple of 64 here).
__device__ __forceinline__ int padded(int e) { return e + ((e >> 6) << 2); }

// ---- loads ----

__device__ __forceinline__ unsigned ldg32(const unsigned char* p) {
    return __ldg(reinterpret_cast<const unsigned*>(p));
}
__device__ __forceinline__ uint4 ldg128(const unsigned char* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ const unsigned char* align4(const unsigned char* p) {
    return reinterpret_cast<const unsigned char*>(reinterpret_cast<unsigned long long>(p) & ~3ull);
}
// 16 when p is 2 mod 4, else 0: the funnel shift that realigns words loaded
// from align4(p).
__device__ __forceinline__ unsigned misalign_bits(const unsigned char* p) {
    return static_cast<unsigned>(reinterpret_cast<unsigned long long>(p) & 2ull) << 3;
}

// N words of bytes [p, p + 4N), p 2-byte aligned, from the aligned words at
// a = align4(p): N + 1 loads, N funnel shifts. The last word (unused when p
// is aligned) must still hold a byte of the tensor: Q6_K's callers read at
// most up to its d, bytes 208..209 of the super-block.
template <int N>
__device__ __forceinline__ void words_a2(const unsigned char* a, unsigned shift,
                                         unsigned (&out)[N]) {
    unsigned w[N + 1];
#pragma unroll
    for (int i = 0; i <= N; ++i) w[i] = ldg32(a + 4 * i);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __funnelshift_r(w[i], w[i + 1], shift);
}

// ---- integers to floats ----

__device__ __forceinline__ float low_half_to_float(unsigned w) {
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(w));
    return f;
}
__device__ __forceinline__ float high_half_to_float(unsigned w) {
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi; }" : "=f"(f) : "r"(w));
    return f;
}

// (128 + byte I of v) / 256 for bytes < 128: the byte in bits 16..22 under
// 0x3F (exponent of 0.5), one PRMT.
template <int I>
__device__ __forceinline__ float biased(unsigned v) {
    return __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7044u | (I << 8)));
}

// Signed byte I of w exactly, given u = w ^ 0x80808080: 2^23 + (q + 128) - (2^23 + 128).
template <int I>
__device__ __forceinline__ float signed_byte(unsigned u) {
    return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u | I)) - 8388736.0f;
}

// Byte `selector & 3` of w (unsigned) exactly; selector = 0x7440 | byte.
__device__ __forceinline__ float unsigned_byte(unsigned w, unsigned selector) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, selector)) - 8388608.0f;
}

// s + a . x in a fixed order.
__device__ __forceinline__ float dot4(float a0, float a1, float a2, float a3, float4 x, float s) {
    s = fmaf(a0, x.x, s);
    s = fmaf(a1, x.y, s);
    s = fmaf(a2, x.z, s);
    return fmaf(a3, x.w, s);
}

__device__ __forceinline__ float4 x4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Where a lane's x and group sums are for the current unit: row m of x at
// x + m * x_step (element 0 = the lane's first), sums likewise.
struct LaneX {
    const float* x;
    const float* sums;
    int x_step;
    int sum_step;
};

// ---- one 256-element unit of one row, lane t; acc[m] += its part ----

// Q8_0 (kQ8 = true) and Q4_0: blocks 2t, 2t + 1 of the unit at `blocks`
// (the row's first block of the unit); `count` = blocks of this unit (8 but
// in the last unit of a row with K % 256 != 0).
template <int M, bool kQ8>
__device__ __forceinline__ void unit_small_blocks(const unsigned char* row_unit, int count, int t,
                                                  const LaneX& lx, float (&acc)[M]) {
    constexpr int kBytes = kQ8 ? Q8_0::kBlockBytes : Q4_0::kBlockBytes;
    constexpr int kWords = kQ8 ? 9 : 5;  // aligned words covering a block at either parity
    unsigned w[2][kWords];
    unsigned shift[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
        const unsigned char* p = row_unit + (2 * t + b) * kBytes;
        shift[b] = misalign_bits(p);
        if (2 * t + b < count) {
            const unsigned char* a = align4(p);
#pragma unroll
            for (int i = 0; i < kWords; ++i) w[b][i] = ldg32(a + 4 * i);
        }
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) {
        if (2 * t + b >= count) break;
        // The scale is the first word's low half (block 4-byte aligned) or
        // high half; the quants start 2 bytes later: a funnel shift by 16,
        // or (clamped shift 32) the next word.
        const float d = low_half_to_float(w[b][0] >> shift[b]);
        const unsigned qshift = 16 + shift[b];
        float s[M];
#pragma unroll
        for (int m = 0; m < M; ++m) s[m] = 0.0f;
        if constexpr (kQ8) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned u = __funnelshift_rc(w[b][i], w[b][i + 1], qshift) ^ 0x80808080u;
                const float q0 = signed_byte<0>(u), q1 = signed_byte<1>(u);
                const float q2 = signed_byte<2>(u), q3 = signed_byte<3>(u);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    s[m] = dot4(q0, q1, q2, q3, x4(lx.x + m * lx.x_step + 32 * b + 4 * i), s[m]);
                }
            }
#pragma unroll
            for (int m = 0; m < M; ++m) acc[m] = fmaf(d, s[m], acc[m]);
        } else {
            // Byte j: low nibble = element j, high nibble = element j + 16.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned v = __funnelshift_rc(w[b][i], w[b][i + 1], qshift);
                const unsigned lo = v & 0x0F0F0F0Fu;
                const unsigned hi = (v >> 4) & 0x0F0F0F0Fu;
                const float l0 = biased<0>(lo), l1 = biased<1>(lo), l2 = biased<2>(lo),
                            l3 = biased<3>(lo);
                const float h0 = biased<0>(hi), h1 = biased<1>(hi), h2 = biased<2>(hi),
                            h3 = biased<3>(hi);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    const float* xm = lx.x + m * lx.x_step + 32 * b + 4 * i;
                    s[m] = dot4(l0, l1, l2, l3, x4(xm), s[m]);
                    s[m] = dot4(h0, h1, h2, h3, x4(xm + 16), s[m]);
                }
            }
            const float a = 256.0f * d;
            const float bias = 0.53125f * a;  // 136 d
#pragma unroll
            for (int m = 0; m < M; ++m) {
                acc[m] = fmaf(a, s[m], acc[m]);
                acc[m] = fmaf(-bias, lx.sums[m * lx.sum_step + b], acc[m]);
            }
        }
    }
}

// Q4_K (kHigh = false) and Q5_K: qs chunk t of the super-block `sb` holds
// elements 64t + j (low nibbles, group 2t) and 64t + 32 + j (high nibbles,
// group 2t + 1); Q5_K's fifth bit of element 32 i + j is bit i of qh[j].
template <int M, bool kHigh>
__device__ __forceinline__ void unit_k(const unsigned char* sb, int t, const LaneX& lx,
                                       float (&acc)[M]) {
    constexpr int kQs = kHigh ? 48 : 16;
    const uint4 head = ldg128(sb);
    const uint4 qa = ldg128(sb + kQs + 32 * t);
    const uint4 qb = ldg128(sb + kQs + 32 * t + 16);
    uint4 ha = make_uint4(0, 0, 0, 0), hb = make_uint4(0, 0, 0, 0);
    if constexpr (kHigh) {
        ha = ldg128(sb + 16);
        hb = ldg128(sb + 32);
    }
    // 6-bit scales and minimums of groups 2t, 2t + 1 (bytes 2 (t % 2) and
    // +1 of the 4 groups' word): groups 0..3 are the low 6 bits of scale
    // bytes 0..3 / 4..7; groups 4..7 the nibbles of bytes 8..11 under the top
    // 2 bits of bytes 0..3 / 4..7.
    const bool upper = t >= 2;
    const unsigned keep = upper ? 0x0F0F0F0Fu : 0x3F3F3F3Fu;
    const unsigned top = upper ? 0x30303030u : 0u;
    const unsigned sc4 = ((upper ? head.w : head.y) & keep) | ((head.y >> 2) & top);
    const unsigned mn4 = ((upper ? head.w >> 4 : head.z) & keep) | ((head.z >> 2) & top);
    const unsigned sel0 = 0x7440u | (2u * (t & 1));
    const unsigned sel1 = sel0 + 1;
    const float d256 = 256.0f * low_half_to_float(head.x);
    const float dmin = high_half_to_float(head.x);
    const float a0 = d256 * unsigned_byte(sc4, sel0);  // 256 d sc, exact
    const float a1 = d256 * unsigned_byte(sc4, sel1);
    const float b0 = fmaf(a0, 0.5f, dmin * unsigned_byte(mn4, sel0));  // 128 a + b
    const float b1 = fmaf(a1, 0.5f, dmin * unsigned_byte(mn4, sel1));

    const unsigned qs[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
    const unsigned qh[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
    float lo_sum[M], hi_sum[M];
#pragma unroll
    for (int m = 0; m < M; ++m) lo_sum[m] = hi_sum[m] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        unsigned lo = qs[i] & 0x0F0F0F0Fu;
        unsigned hi = (qs[i] >> 4) & 0x0F0F0F0Fu;
        if constexpr (kHigh) {
            const unsigned bits = qh[i] >> (2 * t);  // bit 0: group 2t, bit 1: 2t + 1
            lo |= (bits << 4) & 0x10101010u;
            hi |= (bits << 3) & 0x10101010u;
        }
        const float l0 = biased<0>(lo), l1 = biased<1>(lo), l2 = biased<2>(lo), l3 = biased<3>(lo);
        const float h0 = biased<0>(hi), h1 = biased<1>(hi), h2 = biased<2>(hi), h3 = biased<3>(hi);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float* xm = lx.x + m * lx.x_step + 4 * i;
            lo_sum[m] = dot4(l0, l1, l2, l3, x4(xm), lo_sum[m]);
            hi_sum[m] = dot4(h0, h1, h2, h3, x4(xm + 32), hi_sum[m]);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float* sums = lx.sums + m * lx.sum_step;
        acc[m] = fmaf(a0, lo_sum[m], acc[m]);
        acc[m] = fmaf(-b0, sums[0], acc[m]);
        acc[m] = fmaf(a1, hi_sum[m], acc[m]);
        acc[m] = fmaf(-b1, sums[1], acc[m]);
    }
}

// Q6_K: element 128 H + 32 S + j has low 4 bits in nibble S / 2 of
// ql[64 H + 32 (S % 2) + j], high 2 bits at bit 2S of qh[32 H + j], scale
// int8 sc[(element) / 16], d at byte 208; value d sc (q - 32). Lane t: H = t
// / 2, j = 16 (t % 2) + [0, 16), S = 0..3: four groups of 16. Every field's
// offset is a multiple of 4, so one shift realigns them all.
template <int M>
__device__ __forceinline__ void unit_q6_k(const unsigned char* sb, int t, const LaneX& lx,
                                          float (&acc)[M]) {
    const int half = t >> 1;
    const int j0 = 16 * (t & 1);
    const unsigned char* a = align4(sb);
    const unsigned shift = misalign_bits(sb);
    unsigned ql_even[4], ql_odd[4], qh[4], sc[2];
    words_a2<4>(a + 64 * half + j0, shift, ql_even);
    words_a2<4>(a + 64 * half + 32 + j0, shift, ql_odd);
    words_a2<4>(a + 128 + 32 * half + j0, shift, qh);
    words_a2<2>(a + 192 + 8 * half, shift, sc);
    const float d256 =
        256.0f * low_half_to_float(__ldg(reinterpret_cast<const unsigned short*>(sb + 208)));
    // sc[8 H + 2 S + (t % 2)] = byte (t % 2) + 2 (S % 2) of word S / 2.
    const unsigned sel = 0x7440u | (t & 1);
    const unsigned sc_u[2] = {sc[0] ^ 0x80808080u, sc[1] ^ 0x80808080u};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const float scale =
            __uint_as_float(__byte_perm(sc_u[s >> 1], 0x4B000000u, sel + 2 * (s & 1))) - 8388736.0f;
        const float a_s = d256 * scale;  // 256 d sc, exact
        const float bias = 0.625f * a_s; // 160 d sc, exact
        float sum[M];
#pragma unroll
        for (int m = 0; m < M; ++m) sum[m] = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned low_src = (s & 1) ? ql_odd[i] : ql_even[i];
            const unsigned low = ((s >> 1) ? (low_src >> 4) : low_src) & 0x0F0F0F0Fu;
            const int up = 4 - 2 * s;  // bits 2s, 2s + 1 of each qh byte -> bits 4, 5
            const unsigned high = (up >= 0 ? qh[i] << up : qh[i] >> -up) & 0x30303030u;
            const unsigned q = low | high;
            const float f0 = biased<0>(q), f1 = biased<1>(q), f2 = biased<2>(q), f3 = biased<3>(q);
            // Elements 32 S + 4 i .. of the lane's 16-runs; runs S = 2, 3 are
            // in the next 64-element stretch of the staged row (+4 padding).
            const int offset = 32 * s + 4 * i + (s >= 2 ? 4 : 0);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                sum[m] = dot4(f0, f1, f2, f3, x4(lx.x + m * lx.x_step + offset), sum[m]);
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m] = fmaf(a_s, sum[m], acc[m]);
            acc[m] = fmaf(-bias, lx.sums[m * lx.sum_step + 2 * s], acc[m]);
        }
    }
}

// ---- staging x ----

// x bf16 [M, k] -> float32 rows (padded) and, for kSums, the sum of each
// group of G elements. Thread i converts 8 elements (one 16-byte load);
// groups are summed across G / 8 adjacent lanes with shuffles (fixed order).
template <int M, int G, bool kSums>
__device__ __forceinline__ void stage_x(const __nv_bfloat16* __restrict__ x, int k, float* xs,
                                        int xs_step, float* sums, int sums_step) {
    const int per_row = k >> 3;  // 8-element chunks per row: a multiple of 4
    const int chunks = M * per_row;
    const int lane = threadIdx.x & 31;
    for (int base = threadIdx.x - lane; base < chunks; base += blockDim.x) {
        const int i = base + lane;
        const bool real = i < chunks;
        const int m = real ? i / per_row : 0;
        const int c = i - m * per_row;
        float s = 0.0f;
        if (real) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(x) + i);
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
            float f[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f[2 * j] = __uint_as_float(words[j] << 16);
                f[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
            }
            float* dst = xs + m * xs_step + padded(8 * c & ~63) + (8 * c & 63);
            *reinterpret_cast<float4*>(dst) = make_float4(f[0], f[1], f[2], f[3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
#pragma unroll
            for (int j = 0; j < 8; ++j) s += f[j];
        }
        if constexpr (kSums) {
            s += __shfl_xor_sync(0xFFFFFFFFu, s, 1);
            if constexpr (G == 32) s += __shfl_xor_sync(0xFFFFFFFFu, s, 2);
            if (real && (lane & (G / 8 - 1)) == 0) sums[m * sums_step + c / (G / 8)] = s;
        }
    }
}

__device__ __forceinline__ void slot_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Grid <= #SMs CTAs of 32 * W * slots threads, dynamic shared memory as
// above. `blocks` = GGUF blocks per row.
template <class T, int M>
__device__ __forceinline__ void gemv_small_body(__nv_bfloat16* __restrict__ out,
                                                const __nv_bfloat16* __restrict__ x,
                                                const unsigned char* __restrict__ weight,
                                                int n_rows, int k, int blocks, int out_stride,
                                                int warps_per_slot, int slots) {
    extern __shared__ __align__(16) float smem[];
    constexpr int kUnitBytes = T::kBlockBytes * T::kBlocksPerUnit;
    const int xs_step = x_stride(k);
    const int sums_step = sum_stride(k, T::kGroup);
    float* xs = smem;
    float* sums = xs + M * xs_step;
    float* scratch = sums + (T::kSums ? M * sums_step : 0);

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int slot = warp / warps_per_slot;
    const int wi = warp - slot * warps_per_slot;
    const long long row_bytes = static_cast<long long>(blocks) * T::kBlockBytes;
    const int units = (blocks + T::kBlocksPerUnit - 1) / T::kBlocksPerUnit;
    const int tiles = (n_rows + kTileRows - 1) / kTileRows;
    const int tile_step = gridDim.x * slots;

    // Byte offsets from `weight` fit 32 bits (the wrapper keeps N * K < 2^31,
    // so N * row_bytes < 2^32): one register per pointer, which matters
    // under the 64-register cap. Rows past N use the last row's offset (they
    // are only prefetched, never read).
    const unsigned row_bytes32 = static_cast<unsigned>(row_bytes);
    auto row_offset = [&](int row) { return static_cast<unsigned>(min(row, n_rows - 1)) * row_bytes32; };
    // Prefetch lines are 128-byte aligned in the address space: count from
    // the line below `weight`.
    const unsigned lead = static_cast<unsigned>(reinterpret_cast<unsigned long long>(weight) & 127ull);
    const unsigned char* lines = weight - lead;
    // Lane t asks L2 for the t-th line of the unit at `offset` (<= 272 bytes:
    // at most 4 lines); the last unit of a Q8_0/Q4_0 row may be shorter.
    auto prefetch_unit = [&](unsigned offset, int unit) {
        unsigned bytes = kUnitBytes;
        if constexpr (T::kBlocksPerUnit > 1) {
            bytes = min(static_cast<unsigned>(kUnitBytes), row_bytes32 - unit * kUnitBytes);
        }
        const unsigned start = offset + lead;
        const unsigned line = (start & ~127u) + 128u * t;
        if (line < start + bytes) prefetch_l2(reinterpret_cast<unsigned long long>(lines + line));
    };

    const int first_tile = slot * gridDim.x + blockIdx.x;
    if (slot < slots && first_tile < tiles && wi < units) {
        prefetch_unit(row_offset(first_tile * kTileRows + g) + wi * kUnitBytes, wi);
    }
    pdl_launch_dependents();
    pdl_wait();  // x is the previous kernel's output
    stage_x<M, T::kGroup, T::kSums>(x, k, xs, xs_step, sums, sums_step);
    __syncthreads();
    if (slot >= slots) return;

    // Where this lane's x and sums start inside a unit (+ unit * 256
    // elements): Q6_K's quarter (H, j0) or 64 t.
    constexpr bool kQ6 = T::kBlockBytes == Q6_K::kBlockBytes;
    const int lane_e = kQ6 ? 128 * (t >> 1) : 64 * t;
    const float* lane_x = xs + padded(lane_e) + (kQ6 ? 16 * (t & 1) : 0);
    const float* lane_sums = sums + lane_e / T::kGroup + (kQ6 ? (t & 1) : 0);
    constexpr int kUnitX = kUnitElems + kUnitElems / 16;  // 256 elements, padded
    constexpr int kUnitGroups = kUnitElems / T::kGroup;
    const unsigned step_bytes = static_cast<unsigned>(warps_per_slot) * kUnitBytes;

    int parity = 0;
    for (int tile = first_tile; tile < tiles; tile += tile_step, parity ^= 1) {
        const int row = tile * kTileRows + g;
        const bool real = row < n_rows;
        unsigned offset = row_offset(row) + wi * kUnitBytes;
        // The warp's first unit of its next tile, a tile ahead (it stays in
        // L2); its next unit in this row, a unit ahead.
        if (tile + tile_step < tiles) {
            prefetch_unit(row_offset(row + tile_step * kTileRows) + wi * kUnitBytes, wi);
        }
        float acc[M];
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.0f;
        for (int unit = wi; unit < units; unit += warps_per_slot, offset += step_bytes) {
            if (unit + warps_per_slot < units) {
                prefetch_unit(offset + step_bytes, unit + warps_per_slot);
            }
            if (!real) continue;
            const unsigned char* p = weight + offset;
            const LaneX lx{lane_x + unit * kUnitX, lane_sums + unit * kUnitGroups, xs_step,
                           sums_step};
            if constexpr (kQ6) {
                unit_q6_k<M>(p, t, lx, acc);
            } else if constexpr (T::kBlockBytes == Q4_K::kBlockBytes ||
                                 T::kBlockBytes == Q5_K::kBlockBytes) {
                unit_k<M, T::kBlockBytes == Q5_K::kBlockBytes>(p, t, lx, acc);
            } else {
                const int count = min(T::kBlocksPerUnit, blocks - unit * T::kBlocksPerUnit);
                unit_small_blocks<M, T::kBlockBytes == Q8_0::kBlockBytes>(p, count, t, lx, acc);
            }
        }
        // The 4 K lanes of a row, then the slot's warps in order.
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[m] += __shfl_xor_sync(0xFFFFFFFFu, acc[m], 1);
            acc[m] += __shfl_xor_sync(0xFFFFFFFFu, acc[m], 2);
        }
        if (warps_per_slot == 1) {
            if (t == 0 && real) {
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    out[static_cast<long long>(m) * out_stride + row] = __float2bfloat16_rn(acc[m]);
                }
            }
            continue;
        }
        float* buf = scratch + (parity * slots + slot) * warps_per_slot * kTileRows * M;
        if (t == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) buf[(wi * kTileRows + g) * M + m] = acc[m];
        }
        slot_barrier(1 + slot, 32 * warps_per_slot);
        if (wi == 0 && lane < kTileRows * M) {
            const int rg = lane / M;
            const int m = lane - rg * M;
            float sum = buf[rg * M + m];
            for (int w = 1; w < warps_per_slot; ++w) sum += buf[(w * kTileRows + rg) * M + m];
            const int out_row = tile * kTileRows + rg;
            if (out_row < n_rows) {
                out[static_cast<long long>(m) * out_stride + out_row] = __float2bfloat16_rn(sum);
            }
        }
        // The next tile writes the other buffer; this one is rewritten only
        // after every warp of the slot has passed the next tile's barrier.
    }
}

}  // namespace

#define GGUF_GEMV_SMALL(TYPE, M)                                                                 \
    extern "C" __global__ void __launch_bounds__(kMaxThreads, 1)                                 \
        gguf_gemv_small_##TYPE##_m##M(__nv_bfloat16* __restrict__ out,                           \
                                      const __nv_bfloat16* __restrict__ x,                       \
                                      const unsigned char* __restrict__ weight, int n_rows,      \
                                      int k, int blocks, int out_stride, int warps_per_slot,     \
                                      int slots) {                                               \
        gemv_small_body<TYPE, M>(out, x, weight, n_rows, k, blocks, out_stride, warps_per_slot,  \
                                 slots);                                                         \
    }

#define GGUF_GEMV_SMALL_TYPE(TYPE) \
    GGUF_GEMV_SMALL(TYPE, 1)       \
    GGUF_GEMV_SMALL(TYPE, 2)       \
    GGUF_GEMV_SMALL(TYPE, 3)       \
    GGUF_GEMV_SMALL(TYPE, 4)

GGUF_GEMV_SMALL_TYPE(Q8_0)
GGUF_GEMV_SMALL_TYPE(Q4_0)
GGUF_GEMV_SMALL_TYPE(Q4_K)
GGUF_GEMV_SMALL_TYPE(Q5_K)
GGUF_GEMV_SMALL_TYPE(Q6_K)
