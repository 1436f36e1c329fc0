// The skinny GEMM's body (skinny_gemm.cu describes the kernel: operands of
// one mma, the work split, the streaming of the weight) and the fusions of
// its decode kernels (skinny_fused.cu): an RMSNorm of x in the prologue, and
// in the epilogue SwiGLU of a gate/up pair or an add into the residual
// stream. Pasted into both sources by kernels/cuda_build.py.
#pragma once

#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "pdl.cuh"
#include "swiglu.cuh"

namespace skinny {

// What the epilogue does with a finished output element (one bf16 rounding
// of the float32 sum, + bias, first in every case):
//   kStore:    out[m][n] = v.
//   kSwiglu:   the CTA's row group 0 holds gate rows, group 1 the matching up
//              rows (weight rows I + n); out[m][n] = swiglu(v_gate, v_up), as
//              silu_and_mul_bf16 computes it from the rounded projection.
//   kResidual: out is the residual stream: out[m][n] = bf16(out[m][n] + v),
//              torch's bf16 add (the decoder's residual + sublayer output).
enum Epilogue { kStore = 0, kSwiglu = 1, kResidual = 2 };

// The fusions' extra operands. With the NORM prologue the CTA computes
// norm.cu's RMSNorm of each x row (the same sums in the same order, so the
// same bits as rms_norm before an unfused GEMM) into dynamic shared memory,
// and the mma loop multiplies by the normalized x. up_rows: kSwiglu's I.
struct Fusion {
    const __nv_bfloat16* norm_weight;
    float eps;
    float inv_k;
    int up_rows;
};


constexpr int kPieces = 4;                 // 16-byte loads per thread per row group per step
constexpr int kStepK = 32 * kPieces;       // 128 K elements per warp step

__device__ __forceinline__ unsigned long long evict_first_policy() {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// 16 bytes of the weight (read once: bypass L1, evict first from L2), or
// zeros when !valid. The predicate lives inside the asm so the load is a
// predicated LDG, never a branch; volatile keeps the weight loads after the
// step's L2 prefetch and ahead of the x loads in the emitted code.
__device__ __forceinline__ uint4 load_weight(const __nv_bfloat16* p, bool valid,
                                             unsigned long long policy) {
    uint4 v;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %6;\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(valid)), "l"(policy));
    return v;
}

// 16 bytes of x (reused by every CTA: cached in L1), or zeros when !valid.
__device__ __forceinline__ uint4 load_x(const __nv_bfloat16* p, bool valid) {
    uint4 v;
    asm("{\n\t.reg .pred p;\n\t"
        "setp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(valid)));
    return v;
}

// acc += A * B for one m16n8k16 tile. a_lo / a_hi: x row g at logical
// k = 2t, 2t+1 / 2t+8, 2t+9 (rows g + 8 are zero); b_lo / b_hi: the weight row
// at the same k.
__device__ __forceinline__ void mma_step(float (&acc)[4], unsigned a_lo, unsigned a_hi,
                                         unsigned b_lo, unsigned b_hi) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a_lo), "r"(0u), "r"(a_hi), "r"(0u), "r"(b_lo), "r"(b_hi));
}

// One CTA: output columns [cta * 8 * RG, + 8 * RG) for the x rows row0 +
// [0, 8 * TILES) that are < m_rows. blockDim.x = 32 * W: W <= 32 for the
// decode kernels' RG = 1, else <= 8; steps = ceil(K / 128).
//
// TILES 8-row tiles of x share each weight fragment while it is in
// registers (the weight is read once for 8 * TILES rows). The arithmetic of
// one output element does not depend on TILES, RG, m_rows or the other x
// rows: its accumulators are its own (the mma's D[i][j] reads only row i of
// A and column j of B, and rows of x sit at the same row g of every mma),
// each chain takes the same pieces in the same order, and the warps' partials
// are summed in warp order. Only W and steps (the K split) shape it.
// PDL: the decode kernels' Programmatic Dependent Launch prologue (the
// batch-invariant skinny_rows kernels go without: it cost them spills).

// The CTA's weight row for its local row r (0 .. 8 * RG - 1): n0 + r, or
// with kSwiglu the gate row n0 + r (r < 8) and the up row up_rows + n0 + r - 8.
template <int EPI>
__device__ __forceinline__ int weight_row(int n0, int r, int up_rows) {
    if constexpr (EPI == kSwiglu) return r < 8 ? n0 + r : up_rows + n0 + r - 8;
    return n0 + r;
}

// norm.cu's sum of squares of one row of `vectors` 16-byte vectors, by one
// warp that plays norm.cu's row layout for that width (kernels/norm.py
// _layout): a warp of VPT = ceil(vectors / 32) vectors a lane for rows of at
// most 128 vectors, else a CTA of `group` threads (a multiple of 32) holding
// `per_thread` vectors each, whose warps' butterflies are added in warp
// order. Every lane returns the same bits, those norm.cu's threads reach.
__device__ __forceinline__ float row_sum_squares(const __nv_bfloat16* row, int vectors, int lane) {
    const bool block_row = vectors > 128;
    int per_thread, group;
    if (!block_row) {
        per_thread = (vectors + 31) / 32;
        group = 32;
    } else {
        per_thread = vectors <= 512 ? 2 : vectors <= 1024 ? 4 : 8;
        group = ((vectors + per_thread - 1) / per_thread + 31) / 32 * 32;
    }
    float total = 0.0f;
    for (int virtual_warp = 0; virtual_warp < group / 32; ++virtual_warp) {
        const int member = 32 * virtual_warp + lane;
        float sum = 0.0f;
        for (int i = 0; i < per_thread; ++i) {
            const int v = member + i * group;
            if (v < vectors) sum = vec_sum_squares(load_vec(row + v * 8), sum);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        // norm.cu: a warp row keeps its butterfly; a block row adds the warp
        // sums to 0.0f in warp order (0.0f + s is s exactly).
        total = block_row ? total + sum : sum;
    }
    return total;
}

template <int RG, int TILES, bool PDL, bool NORM = false, int EPI = kStore>
__device__ __forceinline__ void gemm_body(__nv_bfloat16* __restrict__ out,
                                          const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ weight,
                                          const __nv_bfloat16* __restrict__ bias,
                                          int n_rows, int k, int steps, int m_rows,
                                          int cta, int row0, Fusion fusion = Fusion{}) {
    static_assert(EPI != kSwiglu || RG == 2, "SwiGLU pairs a gate and an up row group");
    static_assert(!NORM || TILES == 1, "the norm prologue serves the decode kernels");
    // Most warps per CTA: 32 for one row group of one tile (1024 threads), else 8.
    constexpr int kMaxWarps = RG == 1 && TILES == 1 ? 32 : 8;
    __shared__ float2 partial[kMaxWarps][RG][TILES][32];
    extern __shared__ uint4 normalized_x[];  // NORM only: [m_rows][x_pitch]
    const int x_pitch = k / 8 + 1;

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = cta * (EPI == kSwiglu ? 8 : 8 * RG);
    // Rows of the output (kSwiglu: of the gate and the up halves each).
    const int out_rows = EPI == kSwiglu ? fusion.up_rows : n_rows;
    const unsigned long long policy = evict_first_policy();

    // This warp's next step goes into L2 while it waits for the current one
    // (no registers held): lane l prefetches 128-byte line l & 1 of the
    // step's local row l / 2, so 16 lanes cover 8 rows x 256 bytes, 32 lanes 16.
    const int prefetch_local = lane >> 1;
    const bool prefetch_lane = prefetch_local < 8 * RG &&
        (EPI == kSwiglu ? n0 + (prefetch_local & 7) : n0 + prefetch_local) < out_rows;
    const int prefetch_k = 64 * (lane & 1);
    const __nv_bfloat16* prefetch_ptr =
        weight + static_cast<long long>(
                     prefetch_lane ? weight_row<EPI>(n0, prefetch_local, fusion.up_rows) : 0) * k +
        prefetch_k;

    // PDL: before the wait, only this warp's first step of the weight goes
    // into L2 (at the small models' shapes that is the CTA's whole share).
    // The weight is no kernel's output, and a prefetch is a hint into L2,
    // the point of coherence, so it cannot make a later load stale. x, the
    // bias and out are touched only after pdl_wait(). (The row pointers
    // below are set up after it: live across the wait, they cost the RG = 2
    // kernels a spill under their 80-register bound.)
    if constexpr (PDL) {
        if (prefetch_lane && warp < steps && warp * kStepK + prefetch_k < k) {
            prefetch_l2(prefetch_ptr + warp * kStepK);
        }
        pdl_launch_dependents();
        pdl_wait();
    }

    // The norm prologue: warp w normalizes x rows w, w + W, ... into shared
    // memory (kernels/skinny_fused.py sizes it: x_pitch 16-byte vectors a
    // row, one more than K / 8 so that the 8 rows of a load phase fall in
    // different banks), and the mma loop reads x from there.
    if constexpr (NORM) {
        const int vectors = k / 8;
        for (int m = warp; m < m_rows; m += warps) {
            const __nv_bfloat16* row = x + static_cast<long long>(m) * k;
            const float scale =
                rms_scale(row_sum_squares(row, vectors, lane), fusion.inv_k, fusion.eps);
            for (int v = lane; v < vectors; v += 32) {
                normalized_x[m * x_pitch + v] =
                    vec_normalize(load_vec(row + v * 8), load_vec(fusion.norm_weight + v * 8), scale);
            }
        }
        __syncthreads();
    }

    // Thread (g, t)'s weight rows (local rows 8 rg + g) and x rows row0 +
    // 8 tile + g, at its 16-byte slot 8 t of each 32-element piece. Rows past
    // the end read nothing.
    const __nv_bfloat16* w_row[RG];
    bool w_valid[RG];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
        const int local = 8 * rg + g;
        w_valid[rg] = (EPI == kSwiglu ? n0 + g : n0 + local) < out_rows;
        const int row = weight_row<EPI>(n0, local, fusion.up_rows);
        w_row[rg] = weight + static_cast<long long>(w_valid[rg] ? row : 0) * k + 8 * t;
    }
    const __nv_bfloat16* x_row[TILES];
    bool x_valid[TILES];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int row = row0 + 8 * tile + g;
        x_valid[tile] = row < m_rows;
        x_row[tile] = x + static_cast<long long>(x_valid[tile] ? row : 0) * k + 8 * t;
    }
    // NORM: thread (g, t)'s vector of a piece at k offset o is
    // normalized_x[g * x_pitch + o / 8 + t].
    const int x_vector = (x_valid[0] ? g : 0) * x_pitch + t;

    // Two accumulator chains per tile and row group (even and odd pieces), so
    // that consecutive mmas do not wait on each other's results.
    float acc[TILES][RG][2][4];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[tile][rg][c][i] = 0.0f;
            }
        }
    }

#pragma unroll 1
    for (int step = warp; step < steps; step += warps) {
        const int k0 = step * kStepK;
        const int next_k0 = (step + warps) * kStepK;
        if (prefetch_lane && step + warps < steps && next_k0 + prefetch_k < k) {
            prefetch_l2(prefetch_ptr + next_k0);
        }
        // All of the step's weight loads first (HBM latency), then x (L1/L2).
        uint4 w[RG][kPieces];
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
            const int offset = k0 + 32 * j;
            const bool in_k = offset + 8 * t < k;
#pragma unroll
            for (int rg = 0; rg < RG; ++rg) {
                w[rg][j] = load_weight(w_row[rg] + offset, w_valid[rg] && in_k, policy);
            }
        }
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            uint4 xv[kPieces];
#pragma unroll
            for (int j = 0; j < kPieces; ++j) {
                const int offset = k0 + 32 * j;
                const bool in_k = offset + 8 * t < k;
                if constexpr (NORM) {
                    xv[j] = x_valid[tile] && in_k ? normalized_x[x_vector + offset / 8]
                                                  : make_uint4(0u, 0u, 0u, 0u);
                } else {
                    xv[j] = load_x(x_row[tile] + offset, x_valid[tile] && in_k);
                }
            }
#pragma unroll
            for (int j = 0; j < kPieces; ++j) {
#pragma unroll
                for (int rg = 0; rg < RG; ++rg) {
                    mma_step(acc[tile][rg][j & 1], xv[j].x, xv[j].y, w[rg][j].x, w[rg][j].y);
                    mma_step(acc[tile][rg][j & 1], xv[j].z, xv[j].w, w[rg][j].z, w[rg][j].w);
                }
            }
        }
    }

    // acc[tile][rg][.][0..1] = this warp's partial out[row0 + 8 tile + g][local 8 rg + 2t + 0..1].
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) {
            partial[warp][rg][tile][lane] =
                make_float2(acc[tile][rg][0][0] + acc[tile][rg][1][0],
                            acc[tile][rg][0][1] + acc[tile][rg][1][1]);
        }
    }
    __syncthreads();

    // One thread per (output row group, tile, lane), looping when the CTA has
    // fewer threads than that (a short K gives few warps). kSwiglu's thread
    // finishes its gate pair and the matching up pair together.
    constexpr int kOutGroups = EPI == kSwiglu ? 1 : RG;
    for (int item = threadIdx.x; item < kOutGroups * TILES * 32; item += blockDim.x) {
        const int slot = item & 31;
        const int rg = (item >> 5) / TILES;
        const int tile = (item >> 5) % TILES;
        const int m = row0 + 8 * tile + (slot >> 2);
        const int n = n0 + 8 * rg + 2 * (slot & 3);
        if (m >= m_rows || n >= out_rows) continue;
        const bool pair = n + 1 < out_rows;
        float2 sum = partial[0][rg][tile][slot];
        for (int other = 1; other < warps; ++other) {
            const float2 p = partial[other][rg][tile][slot];
            sum.x += p.x;
            sum.y += p.y;
        }
        if constexpr (EPI == kSwiglu) {
            float2 up = partial[0][1][tile][slot];
            for (int other = 1; other < warps; ++other) {
                const float2 p = partial[other][1][tile][slot];
                up.x += p.x;
                up.y += p.y;
            }
            // The unfused path rounds the projection to bf16, then applies
            // silu_and_mul_bf16's arithmetic.
            sum.x = swiglu(round_bf16(sum.x), round_bf16(up.x));
            sum.y = swiglu(round_bf16(sum.y), round_bf16(up.y));
        } else if (bias != nullptr) {
            sum.x += __bfloat162float(bias[n]);
            if (pair) sum.y += __bfloat162float(bias[n + 1]);
        }
        __nv_bfloat16* dst = out + static_cast<long long>(m) * out_rows + n;
        if constexpr (EPI == kResidual) {
            // bf16(residual + bf16(v)): the sublayer's rounded output added
            // to the stream as torch adds two bf16 tensors.
            sum.x = __bfloat162float(dst[0]) + round_bf16(sum.x);
            if (pair) sum.y = __bfloat162float(dst[1]) + round_bf16(sum.y);
        }
        if (pair && (reinterpret_cast<unsigned long long>(dst) & 3) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(sum.x, sum.y);
        } else {
            dst[0] = __float2bfloat16_rn(sum.x);
            if (pair) dst[1] = __float2bfloat16_rn(sum.y);
        }
    }
}

}  // namespace skinny
