// Causal prefill attention of a flat varlen batch over the paged KV cache, on
// the tensor cores (mma.sync m16n8k16 bf16 -> f32 with ldmatrix operands).
// Reference: kernels.reference.paged_attention.
//
// Work split. One block owns one kv head of one sequence and a tile of 128
// "packed" query rows. A packed row is one (new token, query head of this kv
// head's group) pair, numbered token * group + head, so the group's query
// heads share every K/V tile the block stages in shared memory, and a decode
// row (q_len 1) still fills `group` rows of a tile. Each warp owns 16 or 32
// consecutive packed rows (one or two m16 tiles; Shape below): its scores
// S = Q K^T and output accumulator O (rows x D) are mma accumulators in
// registers, and softmax is the flash-attention online one in float32
// (running max and sum per row, O rescaled when the max grows; P rounded to
// bf16 for the P V product).
//
// Keys. Key tiles of 32 or 64 cached tokens are gathered from the pages with
// cp.async (16-byte chunks, zero-filled past the sequence) into a 3-stage
// shared-memory ring (2 at D = 256), so the gather of tile j + 2 (j + 1)
// overlaps the math of tile j and one __syncthreads per tile suffices. Row r of the block sees keys
// 0 .. (seq_len - q_len) + token(r) (causal, bottom-right aligned); the block
// visits only the key tiles its last row can see, a warp skips the math of
// tiles none of its rows can see, and the per-element mask runs only on the
// tiles that straddle a row's limit.
//
// Shared memory rows are D bf16 (D / 8 chunks of 16 bytes); chunk c of row r is
// stored at chunk c ^ (r & 7), so the 8 rows an ldmatrix 8x8 reads (and the
// cp.async writes) fall in distinct banks.
#include <cuda_bf16.h>

namespace {

constexpr int kBlockM = 128;  // packed query rows per block

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, bypassing L1 (K/V are reused across blocks
// through L2, not within one SM's L1). src_bytes 0 writes zeros and reads
// nothing.
__device__ __forceinline__ void copy_async_16(unsigned destination, const void* source,
                                              bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination),
                 "l"(source), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned address, unsigned& r0, unsigned& r1,
                                            unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned address, unsigned& r0, unsigned& r1,
                                                  unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address)
                 : "memory");
}

// acc (16x8 f32) += A (16x16 bf16, row) * B (16x8 bf16, col).
__device__ __forceinline__ void mma_bf16(float (&acc)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as one bf16x2 register, `low` in the low half (the lower column
// of an mma fragment pair).
__device__ __forceinline__ unsigned pack_bf16x2(float low, float high) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<unsigned*>(&pair);
}

// An fp8 KV cache (--kv-dtype fp8) holds float8 e4m3 bytes; its tiles are
// widened to bf16 (value * scale) on the way into shared memory, so the
// tiles and all the math are a bf16 cache's.
//
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

// 8 e4m3 codes (byte i of the row chunk = element i) to 8 bf16.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(const uint2& v, float mul) {
    // __byte_perm selector 0x1404: bytes 0, 1 of a word into bytes 1, 3 (zeros
    // elsewhere); 0x3424: bytes 2, 3.
    return make_uint4(widen_e4m3x2(__byte_perm(v.x, 0u, 0x1404u), mul),
                      widen_e4m3x2(__byte_perm(v.x, 0u, 0x3424u), mul),
                      widen_e4m3x2(__byte_perm(v.y, 0u, 0x1404u), mul),
                      widen_e4m3x2(__byte_perm(v.y, 0u, 0x3424u), mul));
}

__device__ __forceinline__ void store_shared_16(unsigned address, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

template <typename Cache>
struct IsFp8Cache {
    static constexpr bool value = false;
};

template <>
struct IsFp8Cache<unsigned char> {
    static constexpr bool value = true;
};

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
template <int D>
__device__ __forceinline__ unsigned tile_offset(int row, int chunk) {
    return static_cast<unsigned>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// A compiled kernel shape. MTiles m16 row tiles per warp: with 2, every K/V
// fragment read from shared memory feeds two mma, which halves the K/V
// shared-memory traffic per FLOP (what bounds a 16-row warp); Warps * MTiles
// * 16 = kBlockM. BlockN keys per tile, Stages tiles in the ring, and Q
// fragments either held in registers for the whole key loop or re-read from
// shared memory each tile (fewer registers).
template <int D, int Warps, int MTiles, int BlockN, int Stages, bool QInRegisters>
struct Shape {
    static constexpr int kD = D;
    static constexpr int kMTiles = MTiles;
    static constexpr int kBlockN = BlockN;  // keys per tile
    static constexpr int kStages = Stages;
    static constexpr bool kQInRegisters = QInRegisters;
    static constexpr int kThreads = Warps * 32;
    static constexpr int kWarpRows = MTiles * 16;
    static_assert(Warps * MTiles * 16 == kBlockM, "warps cover the row tile");
};

template <class Cfg, typename Cache>
__device__ __forceinline__ void prefill_attention(
    unsigned char* smem, __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const Cache* __restrict__ k_cache, const Cache* __restrict__ v_cache,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int num_q_heads, int num_kv_heads, int num_pages,
    int page_shift, int max_pages, float scale_log2, float k_mul, float v_mul) {
    constexpr int D = Cfg::kD;
    constexpr int kThreads = Cfg::kThreads;
    constexpr int kMTiles = Cfg::kMTiles;
    constexpr int kBlockN = Cfg::kBlockN;
    constexpr int kStages = Cfg::kStages;
    constexpr bool kQInRegisters = Cfg::kQInRegisters;
    constexpr int kChunks = D / 8;            // 16-byte chunks per row
    constexpr int kSteps = D / 16;            // mma k-steps over the head dim
    constexpr int kTileBytes = kBlockN * D * 2;
    constexpr int kQBytes = kBlockM * D * 2;
    static_assert(kThreads % kChunks == 0, "a thread keeps one chunk column");
    static_assert((kBlockN * kChunks) % kThreads == 0, "whole K/V tile passes");
    static_assert((kBlockM * kChunks) % kThreads == 0, "whole Q tile passes");
    static_assert(kStages >= 2, "the ring needs two stages");

    const int group = num_q_heads / num_kv_heads;
    const int num_row_tiles = gridDim.x / num_kv_heads;
    const int kv_head = blockIdx.x % num_kv_heads;
    // Row tiles with more visible keys first: a late token's tile is the
    // longest, and starting it first shortens the tail of the grid.
    const int row_tile = num_row_tiles - 1 - blockIdx.x / num_kv_heads;
    const int seq = blockIdx.y;

    const int q_start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_start;
    const int packed_rows = q_len * group;
    const int row0 = row_tile * kBlockM;
    if (row0 >= packed_rows) return;  // past this sequence's query rows
    const int seq_len = seq_lens[seq];
    const int context = seq_len - q_len;  // cached tokens before the first new one
    // Keys that can be gathered: guards a malformed seq_len from reading past
    // the block table row (it cannot be checked on the host without a sync).
    const int kv_len = min(seq_len, max_pages << page_shift);

    // The last key the block's last valid row sees decides the tiles visited.
    const int last_token = min((row0 + kBlockM - 1) / group, q_len - 1);
    const int num_key_tiles = (context + last_token + kBlockN) / kBlockN;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;

    const unsigned smem_q = shared_address(smem);
    const unsigned smem_kv = smem_q + kQBytes;  // stage s: K at + 2s tiles, V after it

    // ---- Q tile: packed rows -> shared (zeros past q_len) ----
    const long long q_row_stride = static_cast<long long>(num_q_heads) * D;
    const __nv_bfloat16* q_seq = q + static_cast<long long>(q_start) * q_row_stride +
                                 static_cast<long long>(kv_head) * group * D;
#pragma unroll
    for (int pass = 0; pass < kBlockM * kChunks / kThreads; ++pass) {
        const int index = tid + pass * kThreads;
        const int row = index / kChunks;
        const int chunk = index % kChunks;
        const int packed = row0 + row;
        const bool valid = packed < packed_rows;
        const int token = packed / group;
        const int head = packed - token * group;
        const __nv_bfloat16* source =
            valid ? q_seq + token * q_row_stride + head * D + chunk * 8 : q;
        copy_async_16(smem_q + tile_offset<D>(row, chunk), source, valid);
    }
    copy_async_commit();

    // ---- K/V tile gather: keys n0 .. n0 + kBlockN - 1 of the sequence -> stage ----
    const long long token_stride = static_cast<long long>(num_kv_heads) * D;
    const int* table = block_tables + static_cast<long long>(seq) * max_pages;
    const int load_chunk = tid % kChunks;
    const int load_row = tid / kChunks;
    const int page_mask = (1 << page_shift) - 1;
    constexpr int kLoadPasses = kBlockN * kChunks / kThreads;
    auto load_tile = [&](int tile, int stage) {
        const unsigned k_stage = smem_kv + stage * 2 * kTileBytes;
        const unsigned v_stage = k_stage + kTileBytes;
        const int n0 = tile * kBlockN;
        if constexpr (IsFp8Cache<Cache>::value) {
            // NOTE: no cp.async for a conversion on the way: every load of
            // the tile is issued first, then widened and stored, so a tile
            // costs one memory latency (not overlapped with the math as a
            // bf16 cache's gather is).
            uint2 k_raw[kLoadPasses];
            uint2 v_raw[kLoadPasses];
            unsigned destination[kLoadPasses];
#pragma unroll
            for (int pass = 0; pass < kLoadPasses; ++pass) {
                const int row = load_row + pass * (kThreads / kChunks);
                const int key = n0 + row;
                int page = -1;
                if (key < kv_len) page = table[key >> page_shift];
                const bool valid = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
                k_raw[pass] = v_raw[pass] = make_uint2(0u, 0u);  // zeros: e4m3 0
                if (valid) {
                    const long long offset =
                        ((static_cast<long long>(page) << page_shift) + (key & page_mask)) *
                            token_stride +
                        kv_head * D + load_chunk * 8;
                    k_raw[pass] = __ldg(reinterpret_cast<const uint2*>(k_cache + offset));
                    v_raw[pass] = __ldg(reinterpret_cast<const uint2*>(v_cache + offset));
                }
                destination[pass] = tile_offset<D>(row, load_chunk);
            }
#pragma unroll
            for (int pass = 0; pass < kLoadPasses; ++pass) {
                store_shared_16(k_stage + destination[pass], e4m3x8_to_bf16x8(k_raw[pass], k_mul));
                store_shared_16(v_stage + destination[pass], e4m3x8_to_bf16x8(v_raw[pass], v_mul));
            }
        } else {
#pragma unroll
            for (int pass = 0; pass < kLoadPasses; ++pass) {
                const int row = load_row + pass * (kThreads / kChunks);
                const int key = n0 + row;
                int page = -1;
                if (key < kv_len) page = table[key >> page_shift];
                // A page id outside the cache (malformed table) reads zeros, not memory.
                const bool valid = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
                const long long offset =
                    valid ? ((static_cast<long long>(page) << page_shift) + (key & page_mask)) *
                                    token_stride +
                                kv_head * D + load_chunk * 8
                          : 0;
                const unsigned destination = tile_offset<D>(row, load_chunk);
                copy_async_16(k_stage + destination, k_cache + offset, valid);
                copy_async_16(v_stage + destination, v_cache + offset, valid);
            }
        }
    };

#pragma unroll
    for (int stage = 0; stage < kStages - 1; ++stage) {
        if (stage < num_key_tiles) load_tile(stage, stage);
        copy_async_commit();  // possibly empty: keeps the group count fixed
    }

    // ---- this thread's rows, limits and Q fragments ----
    const int warp_row0 = warp * Cfg::kWarpRows;  // first row of this warp in the tile
    const int g = lane >> 2;               // mma group: rows g and g + 8 of an m-tile
    const int t = lane & 3;                // thread in group: columns 2t, 2t + 1
    const bool warp_active = row0 + warp_row0 < packed_rows;
    // Last key row r sees. Padding rows past q_len borrow the last valid
    // token's limit: they compute finite garbage that is never stored.
    auto row_limit = [&](int row) {
        return context + min((row0 + row) / group, q_len - 1);
    };
    int limit[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        limit[mt][0] = row_limit(warp_row0 + mt * 16 + g);
        limit[mt][1] = row_limit(warp_row0 + mt * 16 + g + 8);
    }
    // Rows are in token order, so limits grow with the row.
    const int warp_first_limit = row_limit(warp_row0);
    const int warp_last_limit = row_limit(warp_row0 + Cfg::kWarpRows - 1);

    // Per-lane ldmatrix offsets inside a tile. For Q (A operand) matrix i of
    // an x4 holds rows 8 * (i & 1) + 0..7 and head-dim chunk (i >> 1) of a
    // k-step; for K (non-transposed, B operand of S = Q K^T) keys 8 * (i >> 1)
    // + 0..7 and chunk (i & 1) of a k-step; for V (transposed, B operand of
    // O = P V) keys 8 * (i & 1) + 0..7 and chunk (i >> 1) of a pair of
    // 8-column output tiles. Every such row is 8-aligned plus (lane & 7), and
    // chunk 2s + h lands at (2s + h) ^ (lane & 7) = 2s ^ (h ^ (lane & 7)),
    // which for s >= 4 is 8 + its value at s - 4: four offsets per lane cover
    // every step, the rest is an immediate.
    const int swz = lane & 7;
    const int q_row = warp_row0 + (lane & 15);
    const int k_row = (lane & 7) + ((lane >> 4) << 3);
    const int k_half = (lane >> 3) & 1;
    const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
    const int v_half = lane >> 4;
    unsigned q_offset[4], k_offset[4], v_offset[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        q_offset[s] = static_cast<unsigned>(q_row * (D * 2) + (((2 * s) ^ (v_half ^ swz)) << 4));
        k_offset[s] = static_cast<unsigned>(k_row * (D * 2) + (((2 * s) ^ (k_half ^ swz)) << 4));
        v_offset[s] = static_cast<unsigned>(v_row * (D * 2) + (((2 * s) ^ (v_half ^ swz)) << 4));
    }
    // The x4 of m-tile mt, k-step s of the warp's Q rows.
    auto load_q = [&](int mt, int step, unsigned (&frag)[4]) {
        ldmatrix_x4(smem_q + q_offset[step & 3] + (step >> 2) * 128 + mt * 16 * (D * 2),
                    frag[0], frag[1], frag[2], frag[3]);
    };

    copy_async_wait<kStages - 1>();  // the Q group (the oldest) has landed
    __syncthreads();
    // Q fragments either stay in registers for the whole key loop or are
    // re-read from shared memory every key tile (fewer registers, more
    // shared-memory reads); the shape picks.
    unsigned q_frag[kQInRegisters ? kSteps : 1][kMTiles][4];
    if (kQInRegisters) {
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) load_q(mt, step, q_frag[step][mt]);
        }
    }

    float acc_o[kMTiles][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            acc_o[mt][j][0] = acc_o[mt][j][1] = acc_o[mt][j][2] = acc_o[mt][j][3] = 0.0f;
        }
    }
    const float neg_inf = __int_as_float(0xff800000);
    float row_max[kMTiles][2];  // running row max of raw scores
    float row_sum[kMTiles][2];  // this lane's part of the running row sum
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        row_max[mt][0] = row_max[mt][1] = neg_inf;
        row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }

    for (int tile = 0; tile < num_key_tiles; ++tile) {
        copy_async_wait<kStages - 2>();  // tile `tile` landed (this thread's part)
        __syncthreads();                 // ... everyone's; and tile - 1 is consumed
        {
            const int next = tile + kStages - 1;
            if (next < num_key_tiles) load_tile(next, next % kStages);
            copy_async_commit();
        }
        const int n0 = tile * kBlockN;
        if (!warp_active || n0 > warp_last_limit) continue;  // warp-uniform

        const unsigned k_stage = smem_kv + (tile % kStages) * 2 * kTileBytes;
        const unsigned v_stage = k_stage + kTileBytes;

        // S = Q K^T: per m-tile 16 rows x kBlockN keys, in accumulator tiles of 8 keys.
        float acc_s[kMTiles][kBlockN / 8][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int n = 0; n < kBlockN / 8; ++n) {
                acc_s[mt][n][0] = acc_s[mt][n][1] = acc_s[mt][n][2] = acc_s[mt][n][3] = 0.0f;
            }
        }
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
            const int q_index = kQInRegisters ? step : 0;
            if (!kQInRegisters) {
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) load_q(mt, step, q_frag[0][mt]);
            }
#pragma unroll
            for (int pair = 0; pair < kBlockN / 16; ++pair) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4(k_stage + k_offset[step & 3] + (step >> 2) * 128 +
                                pair * 16 * (D * 2),
                            b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    mma_bf16(acc_s[mt][2 * pair], q_frag[q_index][mt], b0, b1);
                    mma_bf16(acc_s[mt][2 * pair + 1], q_frag[q_index][mt], b2, b3);
                }
            }
        }

        // Causal mask, only on tiles that reach past the warp's first row's
        // limit (every row's limit is below seq_len, so this covers the end of
        // the sequence too).
        if (n0 + kBlockN - 1 > warp_first_limit) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int lim0 = limit[mt][0] - n0 - 2 * t;  // key column c masked if c > lim
                const int lim1 = limit[mt][1] - n0 - 2 * t;
#pragma unroll
                for (int n = 0; n < kBlockN / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int column = n * 8 + e;
                        if (column > lim0) acc_s[mt][n][e] = neg_inf;
                        if (column > lim1) acc_s[mt][n][2 + e] = neg_inf;
                    }
                }
            }
        }

        // Online softmax in base 2: p = 2^(s * scale_log2 - max * scale_log2).
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            float tile_max0 = row_max[mt][0], tile_max1 = row_max[mt][1];
#pragma unroll
            for (int n = 0; n < kBlockN / 8; ++n) {
                tile_max0 = fmaxf(tile_max0, fmaxf(acc_s[mt][n][0], acc_s[mt][n][1]));
                tile_max1 = fmaxf(tile_max1, fmaxf(acc_s[mt][n][2], acc_s[mt][n][3]));
            }
            tile_max0 = quad_max(tile_max0);
            tile_max1 = quad_max(tile_max1);
            // A row with no visible key yet (only on malformed input) keeps
            // -inf; shift by 0 instead so that it gives zeros, not NaN.
            const float shift0 = tile_max0 == neg_inf ? 0.0f : tile_max0 * scale_log2;
            const float shift1 = tile_max1 == neg_inf ? 0.0f : tile_max1 * scale_log2;
            // 0 on a row's first tile (its max was -inf).
            const float alpha0 = exp2_approx(row_max[mt][0] * scale_log2 - shift0);
            const float alpha1 = exp2_approx(row_max[mt][1] * scale_log2 - shift1);
            row_max[mt][0] = tile_max0;
            row_max[mt][1] = tile_max1;
            float tile_sum0 = 0.0f, tile_sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < kBlockN / 8; ++n) {
                acc_s[mt][n][0] = exp2_approx(fmaf(acc_s[mt][n][0], scale_log2, -shift0));
                acc_s[mt][n][1] = exp2_approx(fmaf(acc_s[mt][n][1], scale_log2, -shift0));
                acc_s[mt][n][2] = exp2_approx(fmaf(acc_s[mt][n][2], scale_log2, -shift1));
                acc_s[mt][n][3] = exp2_approx(fmaf(acc_s[mt][n][3], scale_log2, -shift1));
                tile_sum0 += acc_s[mt][n][0] + acc_s[mt][n][1];
                tile_sum1 += acc_s[mt][n][2] + acc_s[mt][n][3];
            }
            row_sum[mt][0] = row_sum[mt][0] * alpha0 + tile_sum0;
            row_sum[mt][1] = row_sum[mt][1] * alpha1 + tile_sum1;
            // Past the first tiles a row's max rarely grows, and alpha is then
            // exactly 1 (2^0): skip the D / 2 multiplies unless some row of
            // the m-tile needs them (warp-uniform).
            if (__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) {
#pragma unroll
                for (int j = 0; j < D / 8; ++j) {
                    acc_o[mt][j][0] *= alpha0;
                    acc_o[mt][j][1] *= alpha0;
                    acc_o[mt][j][2] *= alpha1;
                    acc_o[mt][j][3] *= alpha1;
                }
            }
        }

        // O += P V: P (16 x kBlockN per m-tile, bf16) is the S accumulators
        // re-packed as A fragments, 16 keys per k-step.
#pragma unroll
        for (int kstep = 0; kstep < kBlockN / 16; ++kstep) {
            unsigned p[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                p[mt][0] = pack_bf16x2(acc_s[mt][2 * kstep][0], acc_s[mt][2 * kstep][1]);
                p[mt][1] = pack_bf16x2(acc_s[mt][2 * kstep][2], acc_s[mt][2 * kstep][3]);
                p[mt][2] = pack_bf16x2(acc_s[mt][2 * kstep + 1][0], acc_s[mt][2 * kstep + 1][1]);
                p[mt][3] = pack_bf16x2(acc_s[mt][2 * kstep + 1][2], acc_s[mt][2 * kstep + 1][3]);
            }
#pragma unroll
            for (int pair = 0; pair < D / 16; ++pair) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(v_stage + v_offset[pair & 3] + (pair >> 2) * 128 +
                                      kstep * 16 * (D * 2),
                                  b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    mma_bf16(acc_o[mt][2 * pair], p[mt], b0, b1);
                    mma_bf16(acc_o[mt][2 * pair + 1], p[mt], b2, b3);
                }
            }
        }
    }

    if (!warp_active) return;

    // ---- normalize, stage the warp's rows in its own Q rows, store ----
    unsigned char* tile_rows = smem;  // generic pointer to the Q tile
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        const float sum0 = quad_sum(row_sum[mt][0]);
        const float sum1 = quad_sum(row_sum[mt][1]);
        const float inverse0 = sum0 > 0.0f ? 1.0f / sum0 : 0.0f;
        const float inverse1 = sum1 > 0.0f ? 1.0f / sum1 : 0.0f;
        const int row_a = warp_row0 + mt * 16 + g;
        const int row_b = row_a + 8;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<unsigned*>(tile_rows + tile_offset<D>(row_a, j) + 4 * t) =
                pack_bf16x2(acc_o[mt][j][0] * inverse0, acc_o[mt][j][1] * inverse0);
            *reinterpret_cast<unsigned*>(tile_rows + tile_offset<D>(row_b, j) + 4 * t) =
                pack_bf16x2(acc_o[mt][j][2] * inverse1, acc_o[mt][j][3] * inverse1);
        }
    }
    __syncwarp();
    __nv_bfloat16* out_seq = out + static_cast<long long>(q_start) * q_row_stride +
                             static_cast<long long>(kv_head) * group * D;
#pragma unroll
    for (int pass = 0; pass < Cfg::kWarpRows * kChunks / 32; ++pass) {
        const int index = lane + pass * 32;
        const int row = warp_row0 + index / kChunks;
        const int chunk = index % kChunks;
        const int packed = row0 + row;
        if (packed < packed_rows) {
            const int token = packed / group;
            const int head = packed - token * group;
            *reinterpret_cast<uint4*>(out_seq + token * q_row_stride + head * D + chunk * 8) =
                *reinterpret_cast<const uint4*>(tile_rows + tile_offset<D>(row, chunk));
        }
    }
}

}  // namespace

// grid: (row_tiles * Hkv, B), row_tiles = ceil(max_query_len * Hq / Hkv / 128);
// block: Shape::kThreads; dynamic shared memory: (128 + stages * 2 * block_n)
// * D * 2 bytes (above 48 KB: the wrapper raises the kernel's limit). out, q: [T, Hq, D]; k_cache, v_cache: [P, S, Hkv, D];
// query_start_loc: [B + 1]; seq_lens: [B]; block_tables: [B, max_pages];
// page_shift = log2(S) (the engine's page sizes are powers of two);
// scale_log2 = scale * log2(e).
#define PREFILL_ATTENTION_KERNEL(NAME, MIN_BLOCKS, ...)                                      \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__::kThreads, MIN_BLOCKS)          \
        NAME(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,           \
             const __nv_bfloat16* __restrict__ k_cache,                                      \
             const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ query_start_loc, \
             const int* __restrict__ seq_lens, const int* __restrict__ block_tables,         \
             int num_q_heads, int num_kv_heads, int num_pages, int page_shift, int max_pages, \
             float scale_log2) {                                                             \
        extern __shared__ __align__(128) unsigned char smem[];                               \
        prefill_attention<__VA_ARGS__>(smem, out, q, k_cache, v_cache, query_start_loc,      \
                                       seq_lens, block_tables, num_q_heads, num_kv_heads,    \
                                       num_pages, page_shift, max_pages, scale_log2, 1.0f,   \
                                       1.0f);                                                \
    }                                                                                        \
    /* The fp8 cache's kernel: e4m3 caches, k_mul = k_scale * 2^8, v_mul likewise. */       \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__::kThreads, MIN_BLOCKS)          \
        NAME##_fp8(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,     \
                   const unsigned char* __restrict__ k_cache,                                \
                   const unsigned char* __restrict__ v_cache,                                \
                   const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens, \
                   const int* __restrict__ block_tables, int num_q_heads, int num_kv_heads,  \
                   int num_pages, int page_shift, int max_pages, float scale_log2,           \
                   float k_mul, float v_mul) {                                               \
        extern __shared__ __align__(128) unsigned char smem[];                               \
        prefill_attention<__VA_ARGS__>(smem, out, q, k_cache, v_cache, query_start_loc,      \
                                       seq_lens, block_tables, num_q_heads, num_kv_heads,    \
                                       num_pages, page_shift, max_pages, scale_log2, k_mul,  \
                                       v_mul);                                               \
    }

// Two shapes per head dim (the wrapper picks by grid size):
// w32: 4 warps of 32 rows. Each K/V fragment feeds two mma, so shared-memory
//   reads per FLOP are ~3/4 of w16's (Q re-read included), and two blocks
//   share an SM. For grids of at least two blocks an SM (long prompts, big
//   batches). D = 128 takes 32-key tiles to fit 255 registers.
// w16: 8 warps of 16 rows, twice the warps for the same rows: for small grids
//   (one chunk over a long prefix: T * Hq / 128 blocks, about one an SM),
//   where w32 would leave each SM 4 warps. D = 128 keeps Q in registers at
//   one block an SM; D = 64 re-reads Q to fit two blocks an SM in 128
//   registers.
// D = 256 (Qwen3-Next, Qwen3.5) has w16 only: O alone is 128 float registers
//   a thread at 16 rows (w32's 32 rows would need 256). Q is re-read from
//   shared memory (in registers it spills), and 64-key tiles in a 2-stage
//   ring: (128 + 2 * 2 * 64) rows * 512 bytes = 192 KB of dynamic shared
//   memory (Hopper allows 227 KB a block), 252 registers, one block of 8
//   warps an SM. 32-key tiles in 3 stages (160 KB, 245 registers) also fit:
//   the same 64 KB of K/V in flight, twice the barriers and softmax passes.
PREFILL_ATTENTION_KERNEL(paged_prefill_attention_d128_w32, 2, Shape<128, 4, 2, 32, 3, false>)
PREFILL_ATTENTION_KERNEL(paged_prefill_attention_d128_w16, 1, Shape<128, 8, 1, 64, 3, true>)
PREFILL_ATTENTION_KERNEL(paged_prefill_attention_d64_w32, 2, Shape<64, 4, 2, 64, 3, false>)
PREFILL_ATTENTION_KERNEL(paged_prefill_attention_d64_w16, 2, Shape<64, 8, 1, 64, 3, false>)
PREFILL_ATTENTION_KERNEL(paged_prefill_attention_d256_w16, 1, Shape<256, 8, 1, 64, 2, false>)
