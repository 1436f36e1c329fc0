// GGUF quantized weights read in their packed block layout (the file's bytes,
// [N, row_bytes] row-major): Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
//
// quant_gemv: out[M, N] = x[M, K] @ dequantize(W)^T for M = 1..16 (decode).
//   Memory-bound: every packed byte is read from HBM once per call and used for
//   all M rows of x. The products run on the tensor cores (mma.sync m16n8k16,
//   bf16 operands, float32 accumulators) with the WEIGHT as operand A (16
//   weight rows x 16 k) and x as operand B (16 k x 8 x-rows; a second mma for
//   x rows 8..15), so the decode work per weight element does not grow with M.
//
//   Exactness: operand A never holds a scaled weight. It holds the block's
//   small integer q (plus a bias of 128 for the unsigned types), which bf16
//   represents exactly, so every product q * x is exact and each mma sums a
//   scale group in float32. The group's scales are applied afterwards in
//   float32: for w = a * q - b (Q4_K/Q5_K: a = d * sc, b = dmin * m; Q4_0:
//   a = d, b = 8d; Q6_K: a = d * sc, b = 32a) and A = 128 + q,
//       sum(w x) = a * sum(A x) - (128 a + b) * sum(x),
//   where sum(x) over the group comes from one more mma with A = all ones.
//   Q8_0 (signed bytes, no bias) uses sum(w x) = d * sum(q x) directly.
//   So the result differs from "dequantize in float32, then a float32 matmul"
//   only by float32 accumulation order, and is rounded to bf16 once.
//
//   Data path: CTA = 16 weight rows x all of K; its warps split K into units
//   of 256 elements (Q8_0/Q4_0: 8 blocks; K-quants: 1 super-block). A warp
//   copies each unit's bytes of its 16 rows into its own shared-memory ring
//   with 16-byte cp.async (no L2 cache hint: see copy16), STAGES - 1 units ahead,
//   so several KB per warp are in flight. Block bytes are not 16-byte aligned
//   for Q8_0 (34), Q4_0 (18) and Q6_K (210), for rows of some K, or for a
//   packed tensor that is a slice of rows (2-byte aligned only): the copy
//   rounds each row's byte range out to 16-byte boundaries (the few extra
//   bytes belong to neighbouring blocks; past the tensor's end they read as
//   zeros) and the decode reads shared memory at the row's byte offset with
//   2-byte loads where alignment is not known. Per unit, lanes first decode
//   the scales of (row, group) pairs into a float2 table in shared memory
//   (each pair decoded once), then every lane decodes its 4 bytes per tile
//   and row into bf16 pairs (lop3 with the bf16 128.0 exponent, exact for
//   values < 128; Q8_0 goes through float32 with the 2^23 trick) and issues
//   the mmas. The warps' float32 partials are summed through shared memory
//   in a fixed order (deterministic) and rounded to bf16 once.
//
//   Fragment layout (thread (g, t) = lane 4g + t): A rows g and g + 8 are
//   weight rows n0 + g and n0 + g + 8; logical k 2t, 2t+1, 2t+8, 2t+9 of a
//   tile are the tile's physical elements 4t, 4t+1, 4t+2, 4t+3 (a dot product
//   does not care how k is permuted, as long as x uses the same permutation),
//   so x's B fragment is 8 contiguous bytes of x row g. D gives thread (g, t)
//   out[x row 2t, 2t+1][weight rows n0 + g, n0 + g + 8]. out rows may have
//   a stride (a column range of a wider output).
//
// dequantize: out[N, K] bf16 = the exact float32 dequantized value rounded to
//   bf16 (the products d * sc * q fit float32's significand, and the one
//   subtraction rounds as gguf's numpy code does). Each thread writes 8
//   elements (one scale group) as one 16-byte store.
//
// Programmatic Dependent Launch (pdl.cuh; inside CUDA graphs on Hopper): in
// quant_gemv a warp asks L2 for its first unit of the CTA's 16 weight rows,
// lets the next kernel launch, and only then waits for the kernel that wrote
// x, as skinny_gemm.cu's decode kernels do (the weight is no kernel's
// output; a prefetch is only a hint into L2, the point of coherence). Its
// cp.async copies, x and out all come after the wait. dequantize waits first
// thing (out is a scratch an earlier GEMM may still read), then lets the
// next kernel launch. Numerics are unchanged.
// pdl-aware: gguf_gemv_*_nt* gguf_dequantize_*
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr int kRows = 16;          // weight rows per CTA (operand A's M)
constexpr int kUnitElems = 256;    // K elements per warp step
constexpr int kMaxWarps = 16;
constexpr unsigned kMagic = 0x43004300u;  // bf16 128.0 twice: 0x4300 | q == 128 + q, q < 128
constexpr unsigned kOnes = 0x3F803F80u;   // bf16 1.0 twice

// Per type: bytes per block and per 256-element unit, blocks per unit, the
// largest row misalignment (0 when every unit starts 16-byte aligned), scale
// groups per unit, and shared-memory ring depth.
struct Q8_0 {
    static constexpr int kBlockBytes = 34, kBlocks = 8, kUnitBytes = 272, kMaxOff = 14;
    static constexpr int kGroups = 8, kStages = 2;
};
struct Q4_0 {
    static constexpr int kBlockBytes = 18, kBlocks = 8, kUnitBytes = 144, kMaxOff = 14;
    static constexpr int kGroups = 8, kStages = 3;
};
struct Q4_K {
    static constexpr int kBlockBytes = 144, kBlocks = 1, kUnitBytes = 144, kMaxOff = 0;
    static constexpr int kGroups = 8, kStages = 3;
};
struct Q5_K {
    static constexpr int kBlockBytes = 176, kBlocks = 1, kUnitBytes = 176, kMaxOff = 0;
    static constexpr int kGroups = 8, kStages = 3;
};
struct Q6_K {
    static constexpr int kBlockBytes = 210, kBlocks = 1, kUnitBytes = 210, kMaxOff = 14;
    static constexpr int kGroups = 16, kStages = 3;
};

// Shared-memory geometry of one warp: kStages slots of 16 rows, each row an
// odd number of 16-byte chunks (so 8 rows' 16-byte pieces hit 8 different
// bank groups), then the scale table [16 rows][kGroups] float2.
template <class T>
struct Geometry {
    static constexpr int kChunks = (T::kUnitBytes + T::kMaxOff + 15) / 16;
    static constexpr int kSlotStride = (kChunks | 1) * 16;
    static constexpr int kStageBytes = kRows * kSlotStride;
    static constexpr int kScaleBytes = kRows * T::kGroups * 8;
    static constexpr int kWarpBytes = T::kStages * kStageBytes + kScaleBytes;
};

// 16 bytes global -> shared, the first `bytes` of them from src and the rest
// zero (bytes == 0: src is not read).
// No L2::cache_hint (evict_first) operand: with one, ptxas 13.0 for sm_90
// emits LDGSTS [Ra + URn], desc[URn+1] with the uniform register field
// encoded as 0 in some loops, so the copy reads UR0/UR1, which the kernel
// never writes, as its shared offset and memory descriptor, and faults with
// CUDA_ERROR_ILLEGAL_INSTRUCTION (tests/kernels/test_gguf_quant_sass.py).
__device__ __forceinline__ void copy16(void* dst, const void* src, int bytes) {
    const unsigned dst_s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst_s), "l"(src),
                 "r"(bytes));
}

// Lane l asks L2 for lines l % 2 and l % 2 + 2 of weight row n0 + l / 2's
// bytes of unit `unit` (at most 272 bytes at any misalignment: 4 lines).
// weight: the tensor's own start (before the 16-byte rounding).
template <class T>
__device__ __forceinline__ void prefetch_unit(const unsigned char* weight, long long row_bytes,
                                              int n_rows, int n0, int unit, int lane) {
    const int row = n0 + (lane >> 1);
    if (row >= n_rows) return;
    const long long unit_off = static_cast<long long>(unit) * T::kUnitBytes;
    const unsigned long long start =
        reinterpret_cast<unsigned long long>(weight) + row * row_bytes + unit_off;
    // The last unit of a Q8_0/Q4_0 row may hold fewer blocks.
    const unsigned long long end = start + min(static_cast<long long>(T::kUnitBytes),
                                               row_bytes - unit_off);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned long long line = (start & ~127ull) + 128ull * ((lane & 1) + 2 * i);
        if (line < end) prefetch_l2(line);
    }
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ float half_to_float(unsigned short bits) {
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(bits));
    return f;
}

// Shared-memory reads: 4-byte aligned, or only 2-byte aligned.
__device__ __forceinline__ unsigned lds32(const unsigned char* p) {
    return *reinterpret_cast<const unsigned*>(p);
}
__device__ __forceinline__ unsigned lds32_a2(const unsigned char* p) {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return static_cast<unsigned>(h[0]) | (static_cast<unsigned>(h[1]) << 16);
}
__device__ __forceinline__ unsigned short lds16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

// Bytes 0, 1 (or 2, 3) of w into the low bytes of the two 16-bit halves.
__device__ __forceinline__ unsigned spread01(unsigned w) { return __byte_perm(w, 0, 0x4140); }
__device__ __forceinline__ unsigned spread23(unsigned w) { return __byte_perm(w, 0, 0x4342); }

// (a & b) | c and a | (b & c) as one lop3 each: written in C++, the compiler
// emits two (a LOP3 has one immediate operand) and the decode is
// issue-bound.
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ unsigned or_and(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xF8;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// bf16 pair 128 + (bits [S, S+4) of each half).
template <int S>
__device__ __forceinline__ unsigned nibbles(unsigned s) {
    return and_or(s >> S, 0x000F000Fu, kMagic);
}

// v shifted left by bits (right by -bits when negative); bits is a constant
// once the callers' loops are unrolled.
__device__ __forceinline__ unsigned shift_left(unsigned v, int bits) {
    return bits >= 0 ? v << bits : v >> (-bits);
}

// Four signed bytes -> two bf16 pairs (q0, q1), (q2, q3), exactly: the byte
// plus 128 goes into the mantissa of 2^23, a float subtraction gives q, and q
// (at most 8 significant bits) is the top half of its float32.
__device__ __forceinline__ void int8x4_to_bf16(unsigned w, unsigned& p01, unsigned& p23) {
    const unsigned u = w ^ 0x80808080u;
    const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - 8388736.0f;
    const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - 8388736.0f;
    const float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - 8388736.0f;
    const float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - 8388736.0f;
    p01 = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
    p23 = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
}

// d += A * B, m16n8k16, bf16 in, float32 accumulate. A registers: (row g, k
// 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..).
__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                    unsigned a3, uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

// Per-warp state of one unit: the thread's two weight rows' bytes, its x
// rows, the scale table and the accumulators.
template <int NT>
struct Tile {
    const unsigned char* row_g;    // shared memory: unit bytes of weight row n0 + g
    const unsigned char* row_g8;   // ... of row n0 + g + 8
    const float2* scale_g;         // scale table rows
    const float2* scale_g8;
    const __nv_bfloat16* x_row[NT];  // x rows g (+ 8), at element 4t
    int element0;                    // the unit's first K element
    float acc[NT][4];

    // x row g (+ 8) at elements element0 + element + 4t .. + 3. Lanes whose
    // x row is past M read row M - 1 instead: B column g only reaches D
    // column g, and columns past M are never written, so no predicate.
    __device__ __forceinline__ uint2 x_at(int n, int element) const {
        return __ldg(reinterpret_cast<const uint2*>(x_row[n] + element0 + element));
    }
};

template <int NT>
__device__ __forceinline__ void zero(float (&c)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) c[n][i] = 0.0f;
    }
}

// One tile (16 rows x 16 k at x element `element`): c += A x, and, when the
// type has a bias, xs += 1 x (the group's sum of x).
template <int NT, bool kSum>
__device__ __forceinline__ void tile_mma(const Tile<NT>& tile, int element, unsigned g01,
                                         unsigned g8_01, unsigned g23, unsigned g8_23,
                                         float (&c)[NT][4], float (&xs)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const uint2 b = tile.x_at(n, element);
        mma(c[n], g01, g8_01, g23, g8_23, b);
        if constexpr (kSum) mma(xs[n], kOnes, kOnes, kOnes, kOnes, b);
    }
}

// acc += a * c - b' * xs with (a, b') of rows g and g + 8 for this group.
template <int NT, bool kSum>
__device__ __forceinline__ void apply(Tile<NT>& tile, int group, const float (&c)[NT][4],
                                      const float (&xs)[NT][4]) {
    const float2 sg = tile.scale_g[group];
    const float2 sg8 = tile.scale_g8[group];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        tile.acc[n][0] = fmaf(sg.x, c[n][0], tile.acc[n][0]);
        tile.acc[n][1] = fmaf(sg.x, c[n][1], tile.acc[n][1]);
        tile.acc[n][2] = fmaf(sg8.x, c[n][2], tile.acc[n][2]);
        tile.acc[n][3] = fmaf(sg8.x, c[n][3], tile.acc[n][3]);
        if constexpr (kSum) {
            tile.acc[n][0] = fmaf(-sg.y, xs[n][0], tile.acc[n][0]);
            tile.acc[n][1] = fmaf(-sg.y, xs[n][1], tile.acc[n][1]);
            tile.acc[n][2] = fmaf(-sg8.y, xs[n][2], tile.acc[n][2]);
            tile.acc[n][3] = fmaf(-sg8.y, xs[n][3], tile.acc[n][3]);
        }
    }
}

// ---- scale tables: lane (row r = lane / 2, half h = lane % 2) fills row r's
// groups [h * G / 2, (h + 1) * G / 2) with (a, b') as float2 ----

__device__ __forceinline__ void scales_q8_0(const unsigned char* p, int h, float2* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int blk = 4 * h + i;
        out[blk] = make_float2(half_to_float(lds16(p + Q8_0::kBlockBytes * blk)), 0.0f);
    }
}

__device__ __forceinline__ void scales_q4_0(const unsigned char* p, int h, float2* out) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int blk = 4 * h + i;
        const float d = half_to_float(lds16(p + Q4_0::kBlockBytes * blk));
        out[blk] = make_float2(d, 136.0f * d);  // w = d q - 8 d; A = 128 + q
    }
}

// Q4_K and Q5_K: fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, m) for 8 groups.
__device__ __forceinline__ void scales_k(const unsigned char* p, int h, float2* out) {
    const float d = half_to_float(lds16(p));
    const float dmin = half_to_float(lds16(p + 2));
    const unsigned w0 = lds32(p + 4), w1 = lds32(p + 8), w2 = lds32(p + 12);
    // Groups 0..3: low 6 bits of bytes 0..3 (sc) and 4..7 (m); groups 4..7:
    // nibbles of bytes 8..11 with the top 2 bits of bytes 0..3 / 4..7.
    const unsigned sc = h == 0 ? (w0 & 0x3F3F3F3Fu)
                               : ((w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u));
    const unsigned mn = h == 0 ? (w1 & 0x3F3F3F3Fu)
                               : (((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = d * static_cast<float>((sc >> (8 * i)) & 0xFFu);
        const float b = dmin * static_cast<float>((mn >> (8 * i)) & 0xFFu);
        out[4 * h + i] = make_float2(a, 128.0f * a + b);
    }
}

__device__ __forceinline__ void scales_q6_k(const unsigned char* p, int h, float2* out) {
    const float d = half_to_float(lds16(p + 208));
    const unsigned lo = lds32_a2(p + 192 + 8 * h), hi = lds32_a2(p + 196 + 8 * h);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned word = i < 4 ? lo : hi;
        const int sc = static_cast<signed char>((word >> (8 * (i & 3))) & 0xFFu);
        const float a = d * static_cast<float>(sc);
        out[8 * h + i] = make_float2(a, 160.0f * a);  // A = 128 + (q + 32)
    }
}

// ---- one unit of each type: tiles, mmas, scales ----

template <int NT>
__device__ __forceinline__ void unit_q8_0(Tile<NT>& tile, int t, int blocks) {
    float c[NT][4], xs[NT][4];
#pragma unroll
    for (int blk = 0; blk < Q8_0::kBlocks; ++blk) {
        if (blk >= blocks) break;  // last unit of a row with K % 256 != 0
        zero(c);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int byte = Q8_0::kBlockBytes * blk + 2 + 16 * half + 4 * t;
            unsigned g01, g23, h01, h23;
            int8x4_to_bf16(lds32_a2(tile.row_g + byte), g01, g23);
            int8x4_to_bf16(lds32_a2(tile.row_g8 + byte), h01, h23);
            tile_mma<NT, false>(tile, 32 * blk + 16 * half, g01, h01, g23, h23, c, xs);
        }
        apply<NT, false>(tile, blk, c, xs);
    }
}

template <int NT>
__device__ __forceinline__ void unit_q4_0(Tile<NT>& tile, int t, int blocks) {
    float c[NT][4], xs[NT][4];
#pragma unroll
    for (int blk = 0; blk < Q4_0::kBlocks; ++blk) {
        if (blk >= blocks) break;
        zero(c);
        zero(xs);
        // Byte j of qs: low nibble = element j, high nibble = element j + 16.
        const int byte = Q4_0::kBlockBytes * blk + 2 + 4 * t;
        const unsigned wg = lds32_a2(tile.row_g + byte), wh = lds32_a2(tile.row_g8 + byte);
        const unsigned g01 = spread01(wg), g23 = spread23(wg);
        const unsigned h01 = spread01(wh), h23 = spread23(wh);
        tile_mma<NT, true>(tile, 32 * blk, nibbles<0>(g01), nibbles<0>(h01), nibbles<0>(g23),
                           nibbles<0>(h23), c, xs);
        tile_mma<NT, true>(tile, 32 * blk + 16, nibbles<4>(g01), nibbles<4>(h01),
                           nibbles<4>(g23), nibbles<4>(h23), c, xs);
        apply<NT, true>(tile, blk, c, xs);
    }
}

// Q4_K (kHigh = false) and Q5_K (kHigh = true). qs chunk c (32 bytes) holds
// elements 64c + j (low nibbles, group 2c) and 64c + 32 + j (high nibbles,
// group 2c + 1); Q5_K's fifth bit of element 32 i + j is bit i of qh[j].
template <int NT, bool kHigh>
__device__ __forceinline__ void unit_k(Tile<NT>& tile, int t) {
    constexpr int kQs = kHigh ? 48 : 16;
    unsigned qh_g[2][2], qh_g8[2][2];  // [half][pair] spread qh bytes
    if constexpr (kHigh) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned a = lds32(tile.row_g + 16 + 16 * half + 4 * t);
            const unsigned b = lds32(tile.row_g8 + 16 + 16 * half + 4 * t);
            qh_g[half][0] = spread01(a);
            qh_g[half][1] = spread23(a);
            qh_g8[half][0] = spread01(b);
            qh_g8[half][1] = spread23(b);
        }
    }
#pragma unroll
    for (int chunk = 0; chunk < 4; ++chunk) {
        float c_lo[NT][4], x_lo[NT][4], c_hi[NT][4], x_hi[NT][4];
        zero(c_lo);
        zero(x_lo);
        zero(c_hi);
        zero(x_hi);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int byte = kQs + 32 * chunk + 16 * half + 4 * t;
            const unsigned wg = lds32(tile.row_g + byte), wh = lds32(tile.row_g8 + byte);
            const unsigned g01 = spread01(wg), g23 = spread23(wg);
            const unsigned h01 = spread01(wh), h23 = spread23(wh);
            unsigned lo[4] = {nibbles<0>(g01), nibbles<0>(h01), nibbles<0>(g23), nibbles<0>(h23)};
            unsigned hi[4] = {nibbles<4>(g01), nibbles<4>(h01), nibbles<4>(g23), nibbles<4>(h23)};
            if constexpr (kHigh) {
                // Bit 2c (low nibbles) or 2c + 1 (high) of each qh byte -> bit 4.
                const unsigned src[4] = {qh_g[half][0], qh_g8[half][0], qh_g[half][1],
                                         qh_g8[half][1]};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    lo[i] = or_and(lo[i], shift_left(src[i], 4 - 2 * chunk), 0x00100010u);
                    hi[i] = or_and(hi[i], shift_left(src[i], 3 - 2 * chunk), 0x00100010u);
                }
            }
            const int element = 64 * chunk + 16 * half;
            tile_mma<NT, true>(tile, element, lo[0], lo[1], lo[2], lo[3], c_lo, x_lo);
            tile_mma<NT, true>(tile, element + 32, hi[0], hi[1], hi[2], hi[3], c_hi, x_hi);
        }
        apply<NT, true>(tile, 2 * chunk, c_lo, x_lo);
        apply<NT, true>(tile, 2 * chunk + 1, c_hi, x_hi);
    }
}

// Q6_K: element 128 H + 32 S + j has low 4 bits in nibble S / 2 of
// ql[64 H + 32 (S % 2) + j], high 2 bits at bit 2S of qh[32 H + j], scale
// (e / 16); value q - 32. One group = one tile of 16 elements.
template <int NT>
__device__ __forceinline__ void unit_q6_k(Tile<NT>& tile, int t) {
#pragma unroll
    for (int big = 0; big < 2; ++big) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int j = 16 * half + 4 * t;
            unsigned ql[2][4], qh[4];  // [S % 2][g01, g8_01, g23, g8_23]
#pragma unroll
            for (int odd = 0; odd < 2; ++odd) {
                const int byte = 64 * big + 32 * odd + j;
                const unsigned wg = lds32_a2(tile.row_g + byte), wh = lds32_a2(tile.row_g8 + byte);
                ql[odd][0] = spread01(wg);
                ql[odd][1] = spread01(wh);
                ql[odd][2] = spread23(wg);
                ql[odd][3] = spread23(wh);
            }
            {
                const int byte = 128 + 32 * big + j;
                const unsigned wg = lds32_a2(tile.row_g + byte), wh = lds32_a2(tile.row_g8 + byte);
                qh[0] = spread01(wg);
                qh[1] = spread01(wh);
                qh[2] = spread23(wg);
                qh[3] = spread23(wh);
            }
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                unsigned a[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned low = (s >> 1) ? nibbles<4>(ql[s & 1][i]) : nibbles<0>(ql[s & 1][i]);
                    a[i] = or_and(low, shift_left(qh[i], 4 - 2 * s), 0x00300030u);
                }
                float c[NT][4], xs[NT][4];
                zero(c);
                zero(xs);
                tile_mma<NT, true>(tile, 128 * big + 32 * s + 16 * half, a[0], a[1], a[2], a[3], c,
                                   xs);
                apply<NT, true>(tile, 8 * big + 2 * s + half, c, xs);
            }
        }
    }
}

template <class T>
__device__ __forceinline__ void stage_scales(const unsigned char* p, int h, float2* out) {
    if constexpr (T::kBlockBytes == Q8_0::kBlockBytes) {
        scales_q8_0(p, h, out);
    } else if constexpr (T::kBlockBytes == Q4_0::kBlockBytes) {
        scales_q4_0(p, h, out);
    } else if constexpr (T::kBlockBytes == Q6_K::kBlockBytes) {
        scales_q6_k(p, h, out);
    } else {
        scales_k(p, h, out);
    }
}

template <class T, int NT>
__device__ __forceinline__ void run_unit(Tile<NT>& tile, int t, int blocks) {
    if constexpr (T::kBlockBytes == Q8_0::kBlockBytes) {
        unit_q8_0<NT>(tile, t, blocks);
    } else if constexpr (T::kBlockBytes == Q4_0::kBlockBytes) {
        unit_q4_0<NT>(tile, t, blocks);
    } else if constexpr (T::kBlockBytes == Q4_K::kBlockBytes) {
        unit_k<NT, false>(tile, t);
    } else if constexpr (T::kBlockBytes == Q5_K::kBlockBytes) {
        unit_k<NT, true>(tile, t);
    } else {
        unit_q6_k<NT>(tile, t);
    }
}

// Grid: ceil(N / 16) CTAs; block: 32 * W threads, W <= 16; dynamic shared
// memory W * Geometry<T>::kWarpBytes. `blocks` = blocks per row (K / block
// size), `units` = ceil(blocks / T::kBlocks).
template <class T, int NT>
__device__ __forceinline__ void gemv_body(__nv_bfloat16* __restrict__ out,
                                          const __nv_bfloat16* __restrict__ x,
                                          const unsigned char* __restrict__ weight, int n_rows,
                                          int k, int m_rows, int blocks, int units,
                                          int out_stride) {
    using G = Geometry<T>;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = blockIdx.x * kRows;
    const long long row_bytes = static_cast<long long>(blocks) * T::kBlockBytes;
    // PDL: only the weight is touched before the wait (its first unit, into
    // L2: at the small models' shapes the CTA's whole share).
    if (warp < units) prefetch_unit<T>(weight, row_bytes, n_rows, n0, warp, lane);
    pdl_launch_dependents();
    pdl_wait();  // x is an earlier kernel's output, out may be an earlier kernel's input
    // A packed tensor may start anywhere 2-byte aligned (a slice of rows):
    // count bytes from the 16-byte boundary below it, which lies in the same
    // allocation. Q4_K/Q5_K rows are 16-byte multiples and start aligned.
    const int base_off =
        T::kMaxOff == 0 ? 0 : static_cast<int>(reinterpret_cast<unsigned long long>(weight) & 15);
    weight -= base_off;
    const long long total_bytes = base_off + row_bytes * n_rows;
    unsigned char* mine = smem + warp * G::kWarpBytes;
    float2* scale_table = reinterpret_cast<float2*>(mine + T::kStages * G::kStageBytes);

    // Copy unit `unit` of the CTA's 16 rows into ring slot `stage`. The 16
    // rows x kChunks 16-byte chunks are numbered row by row and lane l copies
    // chunks l, l + 32, ...: consecutive lanes read consecutive bytes of a
    // row, so one copy instruction touches the lines of two or three rows.
    // (Two lanes per row, each taking every other chunk, touched sixteen rows
    // per instruction and held even a copy-only kernel to about half the
    // device's read bandwidth.) Each chunk's place is worked out once here.
    constexpr int kChunkCount = kRows * G::kChunks;
    constexpr int kCopies = (kChunkCount + 31) / 32;
    const long long cta_start = base_off + static_cast<long long>(n0) * row_bytes;
    const int cta_mis = static_cast<int>(cta_start & 15);
    const unsigned char* const cta_base = weight + (cta_start - cta_mis);  // 16-byte aligned
    // The CTA holding the tensor's last row bounds every chunk by the
    // tensor's end (the last row's rounded-out range may pass it) and
    // zero-fills rows past N; the others copy whole chunks.
    const bool tail = n0 + kRows >= n_rows;
    int copy_row_base[kCopies];  // cta_mis + row * row_bytes
    int copy_chunk[kCopies];     // 16 * chunk, or -1: this lane has no chunk there
    int copy_dst[kCopies];       // offset in a ring slot
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
        const int i = lane + 32 * c;
        const int r = i / G::kChunks;
        const int chunk = i - r * G::kChunks;
        const bool real = i < kChunkCount && (!tail || n0 + r < n_rows);
        copy_row_base[c] = cta_mis + r * static_cast<int>(row_bytes);
        copy_chunk[c] = i < kChunkCount ? 16 * chunk : -1;
        copy_dst[c] = real ? r * G::kSlotStride + 16 * chunk : -1 - (r * G::kSlotStride + 16 * chunk);
    }
    auto issue = [&](int unit, int stage) {
        if (unit >= units) return;
        const int unit_off = unit * T::kUnitBytes;
        unsigned char* const slot = mine + stage * G::kStageBytes;
#pragma unroll
        for (int c = 0; c < kCopies; ++c) {
            if (kChunkCount % 32 != 0 && copy_chunk[c] < 0) continue;
            const int off = ((copy_row_base[c] + unit_off) & ~15) + copy_chunk[c];
            if (!tail) {
                copy16(slot + copy_dst[c], cta_base + off, 16);
            } else {
                // Bytes of this chunk inside the tensor; 0 for rows past N.
                const bool real = copy_dst[c] >= 0;
                const long long left = total_bytes - (cta_start - cta_mis + off);
                const int bytes = real ? static_cast<int>(min(max(left, 0LL), 16LL)) : 0;
                const int dst = real ? copy_dst[c] : -1 - copy_dst[c];
                copy16(slot + dst, bytes > 0 ? cta_base + off : weight, bytes);
            }
        }
    };

    Tile<NT> tile;
    zero(tile.acc);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int xr = min(g + 8 * n, m_rows - 1);
        tile.x_row[n] = x + static_cast<long long>(xr) * k + 4 * t;
    }
    tile.scale_g = scale_table + g * T::kGroups;
    tile.scale_g8 = scale_table + (g + 8) * T::kGroups;
    const int scale_row = lane >> 1;
    const int scale_half = lane & 1;

    // Misalignment of a row's unit start inside its first 16-byte chunk.
    auto offset = [&](int r, int unit) -> int {
        const long long start = base_off + static_cast<long long>(n0 + r) * row_bytes +
                                static_cast<long long>(unit) * T::kUnitBytes;
        return T::kMaxOff == 0 ? 0 : static_cast<int>(start & 15);
    };

#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
        issue(warp + s * warps, s);
        copy_commit();
    }
    int stage = 0;
#pragma unroll 1
    for (int unit = warp, step = 0; unit < units; unit += warps, ++step) {
        issue(unit + (T::kStages - 1) * warps, (step + T::kStages - 1) % T::kStages);
        copy_commit();
        copy_wait<T::kStages - 1>();
        __syncwarp();
        const unsigned char* slot = mine + stage * G::kStageBytes;
        stage_scales<T>(slot + scale_row * G::kSlotStride + offset(scale_row, unit), scale_half,
                        scale_table + scale_row * T::kGroups);
        __syncwarp();
        tile.row_g = slot + g * G::kSlotStride + offset(g, unit);
        tile.row_g8 = slot + (g + 8) * G::kSlotStride + offset(g + 8, unit);
        tile.element0 = unit * kUnitElems;
        run_unit<T, NT>(tile, t, min(T::kBlocks, blocks - unit * T::kBlocks));
        __syncwarp();  // the slot and the scale table are refilled next step
        stage = stage + 1 == T::kStages ? 0 : stage + 1;
    }
    copy_wait<0>();
    __syncwarp();

    // Fixed-order reduction of the warps' partials (each warp's own ring
    // holds them), one bf16 rounding.
    float4* partial = reinterpret_cast<float4*>(mine);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        partial[n * 32 + lane] =
            make_float4(tile.acc[n][0], tile.acc[n][1], tile.acc[n][2], tile.acc[n][3]);
    }
    __syncthreads();
    if (threadIdx.x >= 32 * NT) return;  // (the launch has at least NT warps)
    const int n = threadIdx.x >> 5;
    float4 sum = reinterpret_cast<const float4*>(smem)[n * 32 + lane];
    for (int w = 1; w < warps; ++w) {
        const float4 p = reinterpret_cast<const float4*>(smem + w * G::kWarpBytes)[n * 32 + lane];
        sum.x += p.x;
        sum.y += p.y;
        sum.z += p.z;
        sum.w += p.w;
    }
    const int m = 8 * n + 2 * t;
    const int row_a = n0 + g;
    const int row_b = n0 + g + 8;
    __nv_bfloat16* row_m = out + static_cast<long long>(m) * out_stride;
    if (m < m_rows) {
        if (row_a < n_rows) row_m[row_a] = __float2bfloat16_rn(sum.x);
        if (row_b < n_rows) row_m[row_b] = __float2bfloat16_rn(sum.z);
    }
    if (m + 1 < m_rows) {
        if (row_a < n_rows) row_m[out_stride + row_a] = __float2bfloat16_rn(sum.y);
        if (row_b < n_rows) row_m[out_stride + row_b] = __float2bfloat16_rn(sum.w);
    }
}

// ---- dequantize: 8 elements (inside one scale group) per thread ----

__device__ __forceinline__ unsigned char byte_at(const unsigned char* p) { return __ldg(p); }
__device__ __forceinline__ float half_at(const unsigned char* p) {
    return half_to_float(static_cast<unsigned short>(__ldg(p) | (__ldg(p + 1) << 8)));
}

// Element e0..e0+7 of a row (bytes `row`) as exact float32.
template <class T>
__device__ __forceinline__ void dequant8(const unsigned char* row, int e0, float (&v)[8]) {
    if constexpr (T::kBlockBytes == Q8_0::kBlockBytes || T::kBlockBytes == Q4_0::kBlockBytes) {
        const unsigned char* blk = row + (e0 / 32) * T::kBlockBytes;
        const float d = half_at(blk);
        const int i0 = e0 % 32;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int q;
            if constexpr (T::kBlockBytes == Q8_0::kBlockBytes) {
                q = static_cast<signed char>(byte_at(blk + 2 + i0 + i));
            } else {
                const int j = (i0 + i) % 16;
                const unsigned b = byte_at(blk + 2 + j);
                q = static_cast<int>(i0 < 16 ? (b & 15u) : (b >> 4)) - 8;
            }
            v[i] = d * static_cast<float>(q);
        }
    } else if constexpr (T::kBlockBytes == Q6_K::kBlockBytes) {
        const unsigned char* blk = row + (e0 / 256) * T::kBlockBytes;
        const int i0 = e0 % 256;
        const int big = i0 / 128, s = (i0 % 128) / 32, j0 = i0 % 32;
        const float a = half_at(blk + 208) *
                        static_cast<float>(static_cast<signed char>(byte_at(blk + 192 + i0 / 16)));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int j = j0 + i;
            const unsigned low = (byte_at(blk + 64 * big + 32 * (s & 1) + j) >> (4 * (s >> 1))) & 15u;
            const unsigned high = (byte_at(blk + 128 + 32 * big + j) >> (2 * s)) & 3u;
            v[i] = a * static_cast<float>(static_cast<int>(low | (high << 4)) - 32);
        }
    } else {
        constexpr bool kHigh = T::kBlockBytes == Q5_K::kBlockBytes;
        const unsigned char* blk = row + (e0 / 256) * T::kBlockBytes;
        const int i0 = e0 % 256;
        const int group = i0 / 32, chunk = i0 / 64, j0 = i0 % 32;
        const bool upper = (i0 % 64) >= 32;
        unsigned sc, mn;
        if (group < 4) {
            sc = byte_at(blk + 4 + group) & 63u;
            mn = byte_at(blk + 8 + group) & 63u;
        } else {
            const unsigned packed = byte_at(blk + 12 + group - 4);
            sc = (packed & 15u) | ((byte_at(blk + 4 + group - 4) >> 2) & 0x30u);
            mn = (packed >> 4) | ((byte_at(blk + 8 + group - 4) >> 2) & 0x30u);
        }
        const float a = half_at(blk) * static_cast<float>(sc);
        const float b = half_at(blk + 2) * static_cast<float>(mn);
        constexpr int kQs = kHigh ? 48 : 16;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int j = j0 + i;
            const unsigned byte = byte_at(blk + kQs + 32 * chunk + j);
            unsigned q = upper ? (byte >> 4) : (byte & 15u);
            if constexpr (kHigh) q |= ((byte_at(blk + 16 + j) >> group) & 1u) << 4;
            // a * q is exact, so this rounds once, like gguf's d * q - dm.
            v[i] = __fsub_rn(__fmul_rn(a, static_cast<float>(q)), b);
        }
    }
}

template <class T>
__device__ __forceinline__ void dequantize_body(__nv_bfloat16* __restrict__ out,
                                                const unsigned char* __restrict__ weight,
                                                int n_rows, int k, int blocks) {
    pdl_wait();
    pdl_launch_dependents();
    const long long groups = static_cast<long long>(n_rows) * (k / 8);
    const long long row_bytes = static_cast<long long>(blocks) * T::kBlockBytes;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < groups;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long row = i / (k / 8);
        const int e0 = static_cast<int>(i - row * (k / 8)) * 8;
        float v[8];
        dequant8<T>(weight + row * row_bytes, e0, v);
        uint4 packed;
        unsigned* words = reinterpret_cast<unsigned*>(&packed);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * p], v[2 * p + 1]);
            words[p] = *reinterpret_cast<const unsigned*>(&pair);
        }
        *reinterpret_cast<uint4*>(out + row * k + e0) = packed;
    }
}

}  // namespace

#define GGUF_GEMV_KERNEL(TYPE, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * kMaxWarps)                                \
        gguf_gemv_##TYPE##_nt##NT(__nv_bfloat16* __restrict__ out,                              \
                                  const __nv_bfloat16* __restrict__ x,                          \
                                  const unsigned char* __restrict__ weight, int n_rows, int k,  \
                                  int m_rows, int blocks, int units, int out_stride) {          \
        gemv_body<TYPE, NT>(out, x, weight, n_rows, k, m_rows, blocks, units, out_stride);      \
    }

#define GGUF_KERNELS(TYPE)                                                                      \
    GGUF_GEMV_KERNEL(TYPE, 1)                                                                   \
    GGUF_GEMV_KERNEL(TYPE, 2)                                                                   \
    extern "C" __global__ void gguf_dequantize_##TYPE(__nv_bfloat16* __restrict__ out,          \
                                                      const unsigned char* __restrict__ weight, \
                                                      int n_rows, int k, int blocks) {          \
        dequantize_body<TYPE>(out, weight, n_rows, k, blocks);                                  \
    }

GGUF_KERNELS(Q8_0)
GGUF_KERNELS(Q4_0)
GGUF_KERNELS(Q4_K)
GGUF_KERNELS(Q5_K)
GGUF_KERNELS(Q6_K)
