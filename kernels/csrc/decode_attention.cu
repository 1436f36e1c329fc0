// Paged decode attention: one query token per sequence over a paged bf16 (or
// fp8 e4m3: the _fp8 kernels) KV cache, grouped-query heads, split-K over the context. Semantics are those of
// kernels.reference.paged_attention with q_len = 1 per row.
//
// Work split. A CTA (4 warps) owns one (batch row b, kv head, split s) (at
// head dim 256 with more than 8 query heads a kv head, two CTAs do, 8 heads
// each: decode_split's HT). The
// context is cut into chunks of 64 tokens (one 16-token tile per warp) dealt
// round-robin to the num_splits splits of a row: split s takes chunks s,
// s + num_splits, ... so a short sequence under a large max_seq_len still
// spreads over many CTAs, and CTAs whose first chunk starts at or past seq_len
// return at once. Each warp keeps its own online softmax; the CTA merges its
// warps through shared memory and then either writes bf16 out (num_splits == 1)
// or a float32 partial (max, sum of exp, unnormalized output) that
// paged_decode_reduce merges.
//
// Tensor cores. All the GQA group's query heads share each K/V row, so a warp
// computes S^T = K Q^T (m16 = 16 tokens, n8 = 8 query heads, k = head dim) and
// O^T += V^T P^T (m16 = 16 head-dim rows, n8 = heads, k = 16 tokens) with
// mma.m16n8k16 bf16 -> f32. K rows go straight from global memory (16 bytes
// per lane) into A fragments: the order of the head-dim inside the k dimension
// is free as long as Q's B fragments use the same order, so lane (row g, quad
// t) loads K[token g][32c + 8t .. +8] and Q[head g][32c + 8t .. +8] and both
// are used as is. V rows are d-contiguous but V^T's A fragment needs tokens
// along the lane's pair, so each 16-byte V load (token g, d 32c + 8t + 2j +
// {0,1} in register j) is transposed in registers with movmatrix; the output
// rows come out in a permuted head-dim order that the shared-memory scatter
// undoes. P^T (the S^T accumulator rounded to bf16) is likewise moved into B
// fragments with movmatrix. Scores are kept in the log2 domain (scale * log2 e
// folded into the float32 scores) so softmax uses exp2f.
//
// Programmatic Dependent Launch (pdl.cuh): every kernel waits for its
// predecessor first thing (q, the cache rows and seq_lens are earlier
// kernels' outputs), then lets the next kernel launch.
// pdl-aware: paged_decode_*
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;                      // tokens per warp step (one MMA m16)
constexpr int kChunkTokens = kWarps * kTileTokens;   // tokens per CTA step; kernels/decode_attention.py

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned transpose_8x8(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// c += a * b for one m16n8k16 tile (bf16 inputs, float32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&pair);
}

__device__ __forceinline__ uint4 load_16b(const __nv_bfloat16* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// An fp8 KV cache (--kv-dtype fp8) holds float8 e4m3 bytes. A lane reads 8
// of them where it would read 8 bf16 (8 bytes instead of 16) and widens them
// to the same bf16 fragment registers, value * scale (widen_e4m3x2). A bf16
// cache's registers pass through untouched, so its kernels are as before.
__device__ __forceinline__ uint4 load_row8(const __nv_bfloat16* p) { return load_16b(p); }

__device__ __forceinline__ uint2 load_row8(const unsigned char* p) {
    return __ldg(reinterpret_cast<const uint2*>(p));
}

__device__ __forceinline__ uint4 as_bf16x8(const uint4& v, float) { return v; }

// Two e4m3 codes, in bytes 1 and 3 of `spread` (the other bytes zero), to
// bf16x2 of value * scale (the byte-1 code in the low half); mul = scale * 2^8.
// e4m3 is fp16 with a 4-bit exponent: a code's sign moved to bit 15 and its
// other 7 bits to bits 7..13 make the fp16 of value * 2^-8 exactly, e4m3's
// subnormals as fp16 subnormals, and fp16 -> float is exact. So the float
// product rounds once, as torch's (value * scale) does. Not float bits
// holding value * 2^-120: e4m3's subnormals would be float subnormals there,
// and CuPy compiles every kernel with -ftz=true, which flushes them to zero
// in the multiply. Codes 0x7f / 0xff (NaN) read as +-480 * scale; the
// writers never store them (they saturate).
__device__ __forceinline__ unsigned widen_e4m3x2(unsigned spread, float mul) {
    const unsigned half2 = (spread & 0x80008000u) | ((spread >> 1) & 0x3f803f80u);
    float low;
    float high;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(low), "=f"(high)
        : "r"(half2));
    return pack_bf16x2(low * mul, high * mul);
}

// 8 e4m3 codes (byte i of the row chunk = element i) to bf16 fragment words.
__device__ __forceinline__ uint4 as_bf16x8(const uint2& v, float mul) {
    // __byte_perm selector 0x1404: bytes 0, 1 of a word into bytes 1, 3 (zeros
    // elsewhere); 0x3424: bytes 2, 3.
    return make_uint4(widen_e4m3x2(__byte_perm(v.x, 0u, 0x1404u), mul),
                      widen_e4m3x2(__byte_perm(v.x, 0u, 0x3424u), mul),
                      widen_e4m3x2(__byte_perm(v.y, 0u, 0x1404u), mul),
                      widen_e4m3x2(__byte_perm(v.y, 0u, 0x3424u), mul));
}

__device__ __forceinline__ unsigned word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Element offset of a token's cache row (kv head 0): page from the block table.
__device__ __forceinline__ long long token_row(const int* table, int token, int page_shift,
                                               long long row_elems) {
    const int page = __ldg(table + (token >> page_shift));
    const int slot = token & ((1 << page_shift) - 1);
    return ((static_cast<long long>(page) << page_shift) + slot) * row_elems;
}

// One CTA: batch row blockIdx.z, kv head blockIdx.y, split blockIdx.x / HT,
// head tile blockIdx.x % HT. D: head dim (64, 128 or 256). NT: tiles of 8
// query heads per CTA. HT: CTAs that share a (row, kv head, split), each
// taking 8 * NT of the group's heads (group <= 8 * NT * HT); every one reads
// the split's K/V (the second read mostly from L2). HT = 2 is for D = 256,
// where a CTA cannot hold 16 heads' accumulators in registers (nor their
// 64 KB of merge buffers in static shared memory); HT = 1 compiles to the
// one-CTA-per-split kernel.
template <int D, int NT, int HT, typename Cache>
__device__ __forceinline__ void decode_split(
    __nv_bfloat16* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_stats, const __nv_bfloat16* __restrict__ q,
    const Cache* __restrict__ k_cache, const Cache* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float scale_log2,
    int num_kv_heads, int group, int page_shift, int table_stride, int num_splits, float k_mul,
    float v_mul) {
    // A row's 8 cache values as loaded (uint4 of bf16, uint2 of e4m3).
    using Raw = decltype(load_row8(k_cache));
    constexpr int kChunks = D / 32;   // 32-wide head-dim chunks: a lane quad reads one per row
    constexpr int kRowTiles = D / 16; // m16 tiles of O^T
    constexpr int kHeads = 8 * NT;
    constexpr int kStride = D + 1;    // odd row stride: the permuted scatter is conflict-free
    __shared__ float s_out[kWarps][kHeads][kStride];
    __shared__ float s_max[kWarps][kHeads];
    __shared__ float s_sum[kWarps][kHeads];

    pdl_wait();
    pdl_launch_dependents();
    const int split = blockIdx.x / HT;
    const int head_tile = blockIdx.x % HT;
    const int kv_head = blockIdx.y;
    const int b = blockIdx.z;
    const int seq_len = __ldg(seq_lens + b);
    const int num_heads = num_kv_heads * group;
    // This CTA's query heads: head0 + 0 .. tile_heads - 1.
    const int head0 = kv_head * group + head_tile * kHeads;
    const int tile_heads = HT == 1 ? group : min(kHeads, group - head_tile * kHeads);
    // A split whose first chunk is past the end has no work (the reduce skips
    // it too). Split 0 always runs so that an empty row still gets a defined
    // (zero) output rather than stale memory.
    if (split * kChunkTokens >= seq_len && !(split == 0 && seq_len <= 0)) return;
    if (HT > 1 && tile_heads <= 0) return;  // a group too small for this head tile

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // MMA group id: token row of K/V/S^T, head of Q
    const int t = lane & 3;   // lane within the quad
    const long long row_elems = static_cast<long long>(num_kv_heads) * D;
    const int* table = block_tables + static_cast<long long>(b) * table_stride;
    const Cache* k_base = k_cache + kv_head * D + t * 8;
    const Cache* v_base = v_cache + kv_head * D + t * 8;

    // Q^T B fragments, head dim in the same order as the K A fragments.
    unsigned q_frag[NT][kChunks][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int h = nt * 8 + g;
        const __nv_bfloat16* q_row =
            q + (static_cast<long long>(b) * num_heads + head0 + h) * D + t * 8;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < tile_heads) v = load_16b(q_row + 32 * c);
            q_frag[nt][c][0] = v.x;
            q_frag[nt][c][1] = v.y;
            q_frag[nt][c][2] = v.z;
            q_frag[nt][c][3] = v.w;
        }
    }

    // O^T accumulators: tile r covers head-dim rows of chunk r / 2; thread
    // holds heads 2t, 2t + 1 (+ 8 nt) for two rows (see the scatter below).
    float acc[NT][kRowTiles][4];
    float run_max[NT][2];
    float run_sum[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][r][i] = 0.0f;
        }
        run_max[nt][0] = run_max[nt][1] = neg_inf();
        run_sum[nt][0] = run_sum[nt][1] = 0.0f;
    }

    int tile = split * kWarps + warp;
    const int tile_step = num_splits * kWarps;
    if (tile * kTileTokens < seq_len) {  // warp-uniform
        const int last = seq_len - 1;
        // Tokens past the end are clamped to the last one: always a valid
        // cache row (block table entries past the sequence may be anything),
        // and their scores are masked to -inf so they weigh nothing.
        long long off0 = token_row(table, min(tile * kTileTokens + g, last), page_shift, row_elems);
        long long off1 =
            token_row(table, min(tile * kTileTokens + 8 + g, last), page_shift, row_elems);
        Raw k_regs[2][kChunks];
        Raw v_regs[2][kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            k_regs[0][c] = load_row8(k_base + off0 + 32 * c);
            k_regs[1][c] = load_row8(k_base + off1 + 32 * c);
        }
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            v_regs[0][c] = load_row8(v_base + off0 + 32 * c);
            v_regs[1][c] = load_row8(v_base + off1 + 32 * c);
        }
        while (true) {
            const int next = tile + tile_step;
            const bool has_next = next * kTileTokens < seq_len;
            long long next0 = off0;
            long long next1 = off1;
            if (has_next) {
                next0 = token_row(table, min(next * kTileTokens + g, last), page_shift, row_elems);
                next1 =
                    token_row(table, min(next * kTileTokens + 8 + g, last), page_shift, row_elems);
            }

            // S^T[token][head] = K Q^T.
            float score[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int i = 0; i < 4; ++i) score[nt][i] = 0.0f;
            }
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                const uint4 k0 = as_bf16x8(k_regs[0][c], k_mul);
                const uint4 k1 = as_bf16x8(k_regs[1][c], k_mul);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned a0 = word(k0, 2 * h);
                    const unsigned a1 = word(k1, 2 * h);
                    const unsigned a2 = word(k0, 2 * h + 1);
                    const unsigned a3 = word(k1, 2 * h + 1);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        mma_bf16(score[nt], a0, a1, a2, a3, q_frag[nt][c][2 * h],
                                 q_frag[nt][c][2 * h + 1]);
                    }
                }
            }
            // The K registers are free: start the next tile's K now so its
            // latency hides behind this tile's softmax and PV.
            if (has_next) {
#pragma unroll
                for (int c = 0; c < kChunks; ++c) {
                    k_regs[0][c] = load_row8(k_base + next0 + 32 * c);
                    k_regs[1][c] = load_row8(k_base + next1 + 32 * c);
                }
            }

            // Online softmax per head (accumulator column); a column's 16
            // tokens live in the 8 lanes with the same t (xor 4, 8, 16).
            const int token = tile * kTileTokens + g;
            const bool valid0 = token < seq_len;
            const bool valid1 = token + 8 < seq_len;
            unsigned p_frag[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float s0 = valid0 ? score[nt][e] * scale_log2 : neg_inf();
                    const float s1 = valid1 ? score[nt][e + 2] * scale_log2 : neg_inf();
                    float tile_max = fmaxf(s0, s1);
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 4));
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 8));
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 16));
                    // Token 0 of every tile this warp visits is valid, so
                    // new_max is finite and alpha is 0 on the first tile.
                    const float new_max = fmaxf(run_max[nt][e], tile_max);
                    const float alpha = exp2f(run_max[nt][e] - new_max);
                    run_max[nt][e] = new_max;
                    p[e] = exp2f(s0 - new_max);
                    p[e + 2] = exp2f(s1 - new_max);
                    run_sum[nt][e] = run_sum[nt][e] * alpha + (p[e] + p[e + 2]);
#pragma unroll
                    for (int r = 0; r < kRowTiles; ++r) {
                        acc[nt][r][e] *= alpha;
                        acc[nt][r][e + 2] *= alpha;
                    }
                }
                // S^T accumulator (token g, heads 2t..) -> P^T B fragment (head g, tokens 2t..).
                p_frag[nt][0] = transpose_8x8(pack_bf16x2(p[0], p[1]));
                p_frag[nt][1] = transpose_8x8(pack_bf16x2(p[2], p[3]));
            }

            // O^T += V^T P^T. Register j of a V load holds d = 32c + 8t + 2j
            // + {0,1} of token g; after the transpose it is the A fragment
            // piece (rows: d 32c + 8(row/2) + 2j + row%2, cols: tokens 2t..).
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                const uint4 v0 = as_bf16x8(v_regs[0][c], v_mul);
                const uint4 v1 = as_bf16x8(v_regs[1][c], v_mul);
                unsigned lo[4];
                unsigned hi[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    lo[j] = transpose_8x8(word(v0, j));
                    hi[j] = transpose_8x8(word(v1, j));
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        mma_bf16(acc[nt][2 * c + u], lo[2 * u], lo[2 * u + 1], hi[2 * u],
                                 hi[2 * u + 1], p_frag[nt][0], p_frag[nt][1]);
                    }
                }
            }
            if (!has_next) break;
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                v_regs[0][c] = load_row8(v_base + next0 + 32 * c);
                v_regs[1][c] = load_row8(v_base + next1 + 32 * c);
            }
            tile = next;
            off0 = next0;
            off1 = next1;
        }
    }

    // Each lane summed only its own two tokens per tile; finish the column sums.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float s = run_sum[nt][e];
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            run_sum[nt][e] = s;
        }
    }

    // Scatter this warp's state to shared memory in natural head-dim order.
    // Tile r = 2c + u, accumulator row g -> d = 32c + 8(g/2) + 4u + g%2,
    // row g + 8 -> d + 2; columns 2t, 2t + 1 -> heads.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int h = nt * 8 + 2 * t;
#pragma unroll
        for (int r = 0; r < kRowTiles; ++r) {
            const int d = 32 * (r >> 1) + 8 * (g >> 1) + 4 * (r & 1) + (g & 1);
            s_out[warp][h][d] = acc[nt][r][0];
            s_out[warp][h + 1][d] = acc[nt][r][1];
            s_out[warp][h][d + 2] = acc[nt][r][2];
            s_out[warp][h + 1][d + 2] = acc[nt][r][3];
        }
        if (g == 0) {
            s_max[warp][h] = run_max[nt][0];
            s_max[warp][h + 1] = run_max[nt][1];
            s_sum[warp][h] = run_sum[nt][0];
            s_sum[warp][h + 1] = run_sum[nt][1];
        }
    }
    __syncthreads();

    // Merge the warps (a warp that saw no tile has max -inf: weight 0).
    for (int i = threadIdx.x; i < tile_heads * D; i += kThreads) {
        const int h = i / D;
        const int d = i % D;
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_max[w][h]);
        float total = 0.0f;
        float value = 0.0f;
        if (m != neg_inf()) {
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float weight = exp2f(s_max[w][h] - m);
                total += weight * s_sum[w][h];
                value += weight * s_out[w][h][d];
            }
        }
        const long long head_row = static_cast<long long>(b) * num_heads + head0 + h;
        if (num_splits == 1) {
            out[head_row * D + d] = __float2bfloat16(total > 0.0f ? value / total : 0.0f);
        } else {
            const long long part_row = head_row * num_splits + split;
            part_out[part_row * D + d] = value;
            if (d == 0) {
                part_stats[2 * part_row] = m;
                part_stats[2 * part_row + 1] = total;
            }
        }
    }
}

}  // namespace

// Grid (num_splits * HT, num_kv_heads, batch), block 128, no dynamic shared memory.
// q [B, Hq, D], caches [P, S, Hkv, D] (S = 1 << page_shift), block_tables
// [>= B, table_stride], seq_lens [>= B]; out [B, Hq, D] when num_splits == 1,
// else part_out [B * Hq * num_splits, D] and part_stats [B * Hq * num_splits, 2]
// (max in the log2 domain, sum of exp2).
#define DECODE_SPLIT_KERNEL(NAME, D, NT, HT)                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads) NAME(                               \
        __nv_bfloat16* __restrict__ out, float* __restrict__ part_out,                         \
        float* __restrict__ part_stats, const __nv_bfloat16* __restrict__ q,                  \
        const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache, \
        const int* __restrict__ block_tables, const int* __restrict__ seq_lens,              \
        float scale_log2, int num_kv_heads, int group, int page_shift, int table_stride,      \
        int num_splits) {                                                                     \
        decode_split<D, NT, HT>(out, part_out, part_stats, q, k_cache, v_cache, block_tables,  \
                            seq_lens, scale_log2, num_kv_heads, group, page_shift,             \
                            table_stride, num_splits, 1.0f, 1.0f);                             \
    }

// The fp8 cache's kernels (NAME_fp8): e4m3 caches, read as value * k_scale /
// v_scale; k_mul = k_scale * 2^8, v_mul = v_scale * 2^8 (widen_e4m3x2).
#define DECODE_SPLIT_FP8_KERNEL(NAME, D, NT, HT)                                               \
    extern "C" __global__ void __launch_bounds__(kThreads) NAME##_fp8(                         \
        __nv_bfloat16* __restrict__ out, float* __restrict__ part_out,                         \
        float* __restrict__ part_stats, const __nv_bfloat16* __restrict__ q,                  \
        const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache, \
        const int* __restrict__ block_tables, const int* __restrict__ seq_lens,              \
        float scale_log2, int num_kv_heads, int group, int page_shift, int table_stride,      \
        int num_splits, float k_mul, float v_mul) {                                           \
        decode_split<D, NT, HT>(out, part_out, part_stats, q, k_cache, v_cache, block_tables,  \
                            seq_lens, scale_log2, num_kv_heads, group, page_shift,             \
                            table_stride, num_splits, k_mul, v_mul);                           \
    }

DECODE_SPLIT_KERNEL(paged_decode_d64_g8, 64, 1, 1)
DECODE_SPLIT_KERNEL(paged_decode_d64_g16, 64, 2, 1)
DECODE_SPLIT_KERNEL(paged_decode_d128_g8, 128, 1, 1)
DECODE_SPLIT_KERNEL(paged_decode_d128_g16, 128, 2, 1)
// D = 256 (Qwen3-Next, Qwen3.5): 8 heads a CTA; 255 registers a thread, no
// spills, so 2 CTAs a multiprocessor (3 at D = 128). Groups of 9-16 take two
// CTAs a split (HT = 2) rather than NT = 2, which would need ~320 registers.
DECODE_SPLIT_KERNEL(paged_decode_d256_g8, 256, 1, 1)
DECODE_SPLIT_KERNEL(paged_decode_d256_g16, 256, 1, 2)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d64_g8, 64, 1, 1)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d64_g16, 64, 2, 1)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d128_g8, 128, 1, 1)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d128_g16, 128, 2, 1)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d256_g8, 256, 1, 1)
DECODE_SPLIT_FP8_KERNEL(paged_decode_d256_g16, 256, 1, 2)

// Log-sum-exp merge of the splits that had work. Grid (Hq, B), block
// min(head_dim, 128) (the threads stride over the head dim).
extern "C" __global__ void __launch_bounds__(128) paged_decode_reduce(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ part_out,
    const float* __restrict__ part_stats, const int* __restrict__ seq_lens, int num_heads,
    int head_dim, int num_splits) {
    pdl_wait();
    pdl_launch_dependents();
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int seq_len = __ldg(seq_lens + b);
    // Split s ran iff its first chunk (index s) starts before seq_len.
    const int active = max(0, min(num_splits, (seq_len + kChunkTokens - 1) / kChunkTokens));
    const long long row0 = (static_cast<long long>(b) * num_heads + h) * num_splits;
    const float2* stats = reinterpret_cast<const float2*>(part_stats) + row0;
    float m = neg_inf();
    for (int s = 0; s < active; ++s) m = fmaxf(m, stats[s].x);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float total = 0.0f;
        float value = 0.0f;
        for (int s = 0; s < active; ++s) {
            const float2 st = stats[s];
            const float weight = exp2f(st.x - m);
            total += weight * st.y;
            value += weight * part_out[(row0 + s) * head_dim + d];
        }
        out[(static_cast<long long>(b) * num_heads + h) * head_dim + d] =
            __float2bfloat16(total > 0.0f ? value / total : 0.0f);
    }
}
