// Gated delta rule of prompt sequences, chunked (UT) form on the tensor cores:
// the recurrence of kernels/gated_delta_reference.py's `_chunked`, 64 tokens at
// a time, for a whole batch in one launch. Batch layout as gated_delta.cu's
// (query_start_loc int32 [B + 1], slots int64 [B] (< 0: skipped), fresh uint8
// [B]); everything is read on the device, the grid depends on shapes alone,
// so CUDA graphs capture it.
//
// grid (B, Hv, Dv / 32), 256 threads (8 warps). A CTA owns one sequence's
// value head h and 32 value columns: the Dk x 32 float32 block of its state
// stays in shared memory while it walks the sequence's chunks in order.
// Sequences shorter than min_tokens are skipped (the recurrent kernel serves
// them: a whole chunk's work for a token or two costs more than it saves).
//
// Per chunk of n <= 64 tokens (rows past n are zero: q = k = v = 0, g = 0,
// beta = 0, so they write nothing and leave the decay as it is), with G the
// cumulative log decay, Gam = exp(G), S the state at the chunk's start:
//   P = K K^T, Qk = Q K^T                          (64 x 64, tensor cores)
//   A_ij = beta_i exp(G_i - G_j) P_ij (j < i);  M_ij = exp(G_i - G_j) Qk_ij (j <= i)
//   R = beta (V - Gam (K S))                       (K S: 64 x Dk @ Dk x 32, tensor cores)
//   X = (I + A)^-1 R                               (forward substitution, FP32 FMA)
//   O = Gam (Q S) + M X                            (tensor cores)
//   S <- exp(G_n) S + (K exp(G_n - G))^T X         (tensor cores)
// X is the reference's u (the values written), computed without forming
// w = T (beta Gam K): u = T (beta v) - T (beta Gam K) S = T R.
//
// Precision: every product runs mma.sync m16n8k8 TF32 with float32 accumulate
// as three products (3xTF32: a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, where
// a_hi is a rounded to TF32 and a_lo = tf32(a - a_hi)), which keeps about 21
// bits of each operand: results agree with float32 FMA to float32 summation
// order, so the state stays float32 in effect as well as in storage.
//
// Shared memory (float32, rows padded so the mma fragment loads hit 32
// distinct banks): Q, K [64][132] normalised (q scaled by Dk^-0.5); S [128][40];
// A, M [64][68]; X and Xd (X rows times exp(G_n - G_j)) [64][40]; per-token
// beta, Gam, exp(G_n - G). About 141 KB: one CTA per SM.
#include <cuda_bf16.h>

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kChunk = 64;
constexpr int kDk = 128;
constexpr int kCols = 32;            // value columns per CTA
constexpr int kThreads = 256;
constexpr int kQkStride = kDk + 4;   // Q, K rows
constexpr int kSStride = kCols + 8;  // S, X, Xd rows
constexpr int kAStride = kChunk + 4; // A, M rows

constexpr int kQkFloats = kChunk * kQkStride;
constexpr int kSFloats = kDk * kSStride;
constexpr int kAFloats = kChunk * kAStride;
constexpr int kXFloats = kChunk * kSStride;
// Offsets (floats) of the shared buffers.
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kQkFloats;
constexpr int kOffS = kOffK + kQkFloats;
constexpr int kOffA = kOffS + kSFloats;
constexpr int kOffM = kOffA + kAFloats;
constexpr int kOffX = kOffM + kAFloats;
constexpr int kOffXd = kOffX + kXFloats;
constexpr int kOffBeta = kOffXd + kXFloats;
constexpr int kOffGam = kOffBeta + kChunk;
constexpr int kOffToEnd = kOffGam + kChunk;
constexpr int kOffLogGam = kOffToEnd + kChunk;
constexpr int kOffChunkDecay = kOffLogGam + kChunk;  // exp(G_n)
constexpr int kSharedFloats = kOffChunkDecay + 4;
// kernels/gated_delta_tc.py's SHARED_BYTES must match.
static_assert(kSharedFloats * 4 == 144400, "shared memory layout changed");

__device__ __forceinline__ float bf16_at(const __nv_bfloat16* p, long i) {
    return __bfloat162float(p[i]);
}

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// x = hi + lo, both TF32 (lo carries the next 11 or so bits of x).
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One warp: acc[nt] (the 16 x 8 tiles at rows m0.., columns n0 + 8 nt..) +=
// A[m0:m0+16, 0:8 k_steps] @ B[0:8 k_steps, n0:n0+8 NT], 3xTF32. Operands in
// shared memory, A(r, c) = a[r * a_r + c * a_c], B(k, n) = b[k * b_k + n * b_n].
// Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4): A regs (g, t),
// (g + 8, t), (g, t + 4), (g + 8, t + 4); B regs (t, g), (t + 4, g);
// accumulators (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
template <int NT>
__device__ __forceinline__ void warp_gemm(float (&acc)[NT][4], const float* a, int a_r, int a_c,
                                          const float* b, int b_k, int b_n, int m0, int n0,
                                          int k_steps) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const float* a_row = a + (m0 + g) * a_r + t * a_c;
    const float* b_col = b + t * b_k + (n0 + g) * b_n;
    for (int ks = 0; ks < k_steps; ++ks) {
        const int k0 = ks * 8;
        unsigned a_hi[4], a_lo[4];
        split_tf32(a_row[k0 * a_c], a_hi[0], a_lo[0]);
        split_tf32(a_row[8 * a_r + k0 * a_c], a_hi[1], a_lo[1]);
        split_tf32(a_row[(k0 + 4) * a_c], a_hi[2], a_lo[2]);
        split_tf32(a_row[8 * a_r + (k0 + 4) * a_c], a_hi[3], a_lo[3]);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float* bp = b_col + k0 * b_k + nt * 8 * b_n;
            unsigned b0_hi, b0_lo, b1_hi, b1_lo;
            split_tf32(bp[0], b0_hi, b0_lo);
            split_tf32(bp[4 * b_k], b1_hi, b1_lo);
            // The small terms first: they round less against a small sum.
            mma_tf32(acc[nt], a_lo, b0_hi, b1_hi);
            mma_tf32(acc[nt], a_hi, b0_lo, b1_lo);
            mma_tf32(acc[nt], a_hi, b0_hi, b1_hi);
        }
    }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
}

// Row and column of accumulator element e of tile nt (see warp_gemm).
__device__ __forceinline__ int acc_row(int m0, int e) {
    return m0 + ((threadIdx.x & 31) >> 2) + (e >= 2 ? 8 : 0);
}
__device__ __forceinline__ int acc_col(int n0, int nt, int e) {
    return n0 + nt * 8 + 2 * (threadIdx.x & 3) + (e & 1);
}

// Loads the chunk's q and k rows (L2-normalised in float32, q scaled) into Q
// and K, its 32 value columns into X, and its gating into beta / Gam / ToEnd.
// Rows past n are zeros (beta 0, g 0). Warp w normalises rows w, w + 8, ...
__device__ __forceinline__ void load_chunk(
    float* smem, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    long qk_stride, const __nv_bfloat16* __restrict__ v, long v_stride,
    const __nv_bfloat16* __restrict__ a, long a_stride, const __nv_bfloat16* __restrict__ b,
    long b_stride, int first, int n, int key_head, int head, int column0, float decay_rate,
    float head_bias, float q_scale, float eps) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* qs = smem + kOffQ;
    float* ks = smem + kOffK;
    constexpr int kRowsPerWarp = kChunk / (kThreads / 32);
    float qv[kRowsPerWarp][4], kv[kRowsPerWarp][4];
    // Every load first, then the sums: kRowsPerWarp * 8 loads in flight.
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp + 8 * i;
        const long base = static_cast<long>(first + row) * qk_stride + key_head * kDk + lane * 4;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            qv[i][j] = row < n ? bf16_at(q, base + j) : 0.0f;
            kv[i][j] = row < n ? bf16_at(k, base + j) : 0.0f;
        }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp + 8 * i;
        float q_ss = 0.0f, k_ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            q_ss = fmaf(qv[i][j], qv[i][j], q_ss);
            k_ss = fmaf(kv[i][j], kv[i][j], k_ss);
        }
        const float q_inv = rsqrtf(warp_sum(q_ss) + eps);
        const float k_inv = rsqrtf(warp_sum(k_ss) + eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            qs[row * kQkStride + lane * 4 + j] = (qv[i][j] * q_inv) * q_scale;
            ks[row * kQkStride + lane * 4 + j] = kv[i][j] * k_inv;
        }
    }
    float* xs = smem + kOffX;
    for (int idx = threadIdx.x; idx < kChunk * kCols; idx += kThreads) {
        const int row = idx / kCols, col = idx % kCols;
        xs[row * kSStride + col] =
            row < n ? bf16_at(v, static_cast<long>(first + row) * v_stride + column0 + col) : 0.0f;
    }
    if (warp == 0) {
        // Lane l: tokens 2l and 2l + 1; the cumulative sum as a warp scan.
        float g[2], beta[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * lane + j;
            g[j] = 0.0f;
            beta[j] = 0.0f;
            if (row < n) {
                const float a_t = bf16_at(a, static_cast<long>(first + row) * a_stride + head);
                const float b_t = bf16_at(b, static_cast<long>(first + row) * b_stride + head);
                g[j] = -decay_rate * softplus(a_t + head_bias);
                beta[j] = __bfloat162float(__float2bfloat16_rn(1.0f / (1.0f + expf(-b_t))));
            }
        }
        const float pair = g[0] + g[1];
        float inclusive = pair;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const float up = __shfl_up_sync(kFullMask, inclusive, offset);
            if (lane >= offset) inclusive += up;
        }
        const float before = inclusive - pair;
        const float log_gam[2] = {before + g[0], inclusive};
        const float last = __shfl_sync(kFullMask, inclusive, 31);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * lane + j;
            smem[kOffBeta + row] = beta[j];
            smem[kOffLogGam + row] = log_gam[j];
            smem[kOffGam + row] = expf(log_gam[j]);
            smem[kOffToEnd + row] = expf(last - log_gam[j]);
        }
        if (lane == 0) smem[kOffChunkDecay] = expf(last);
    }
}

__device__ __forceinline__ void gated_delta_chunked_block(
    __nv_bfloat16* __restrict__ out, float* __restrict__ states,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, long qk_stride,
    const __nv_bfloat16* __restrict__ v, long v_stride,
    const __nv_bfloat16* __restrict__ a, long a_stride,
    const __nv_bfloat16* __restrict__ b, long b_stride,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const long long* __restrict__ slots, const unsigned char* __restrict__ fresh,
    const int* __restrict__ qsl, int num_k_heads, int num_v_heads, int dv, int min_tokens,
    float q_scale, float eps) {
    extern __shared__ float smem[];
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int column0 = blockIdx.z * kCols;
    const int start = qsl[seq];
    const int end = qsl[seq + 1];
    const long long slot = slots[seq];
    if (end <= start || end - start < min_tokens || slot < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int key_head = head / (num_v_heads / num_k_heads);
    float* state = states + ((slot * num_v_heads + head) * static_cast<long>(kDk)) * dv + column0;
    float* ss = smem + kOffS;
    const bool zero_state = fresh[seq] != 0;
    for (int idx = threadIdx.x; idx < kDk * kCols; idx += kThreads) {
        const int row = idx / kCols, col = idx % kCols;
        ss[row * kSStride + col] = zero_state ? 0.0f : state[static_cast<long>(row) * dv + col];
    }
    const float decay_rate = expf(a_log[head]);
    const float head_bias = dt_bias[head];
    const __nv_bfloat16* v_head = v + static_cast<long>(head) * dv;
    const float* qs = smem + kOffQ;
    const float* ks = smem + kOffK;
    float* as = smem + kOffA;
    float* ms = smem + kOffM;
    float* xs = smem + kOffX;
    float* xd = smem + kOffXd;
    // The 64 x 32 output tiles: warp w owns rows 16 (w % 4).., columns 16 (w / 4)..
    const int out_m0 = 16 * (warp & 3), out_n0 = 16 * (warp >> 2);
    // The 64 x 64 P and Qk tiles: rows 16 (w % 4).., columns 32 (w / 4)..
    const int sq_m0 = 16 * (warp & 3), sq_n0 = 32 * (warp >> 2);

    for (int first = start; first < end; first += kChunk) {
        const int n = min(kChunk, end - first);
        const int m_tiles = (n + 15) / 16;  // 16-row tiles holding tokens
        const int k_steps_tokens = (n + 7) / 8;
        __syncthreads();  // the previous chunk is done with every buffer
        load_chunk(smem, q, k, qk_stride, v_head, v_stride, a, a_stride, b, b_stride, first, n,
                   key_head, head, column0, decay_rate, head_bias, q_scale, eps);
        __syncthreads();
        const float* beta = smem + kOffBeta;
        const float* gam = smem + kOffGam;
        const float* log_gam = smem + kOffLogGam;
        const float* to_end = smem + kOffToEnd;
        {
            // P = K K^T and Qk = Q K^T, lower triangle only, masked and decayed.
            const bool needed = sq_m0 < 16 * m_tiles && sq_n0 <= sq_m0 + 15;
            const int steps = needed ? kDk / 8 : 0;
            float p[4][4], qk[4][4];
            zero(p);
            zero(qk);
            warp_gemm<4>(p, ks, kQkStride, 1, ks, 1, kQkStride, sq_m0, sq_n0, steps);
            warp_gemm<4>(qk, qs, kQkStride, 1, ks, 1, kQkStride, sq_m0, sq_n0, steps);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = acc_row(sq_m0, e), c = acc_col(sq_n0, nt, e);
                    // exp only where j <= i: above the diagonal it may overflow.
                    const float ratio = c <= r ? expf(log_gam[r] - log_gam[c]) : 0.0f;
                    as[r * kAStride + c] = c < r ? beta[r] * ratio * p[nt][e] : 0.0f;
                    ms[r * kAStride + c] = ratio * qk[nt][e];
                }
            }
        }
        float o[2][4];
        {
            // R = beta (V - Gam (K S)) into X (which holds V); O starts as Gam (Q S).
            const int steps = out_m0 < 16 * m_tiles ? kDk / 8 : 0;
            float kso[2][4];
            zero(kso);
            zero(o);
            warp_gemm<2>(kso, ks, kQkStride, 1, ss, kSStride, 1, out_m0, out_n0, steps);
            warp_gemm<2>(o, qs, kQkStride, 1, ss, kSStride, 1, out_m0, out_n0, steps);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = acc_row(out_m0, e), c = acc_col(out_n0, nt, e);
                    float* x = xs + r * kSStride + c;
                    *x = beta[r] * (*x - gam[r] * kso[nt][e]);
                    o[nt][e] *= gam[r];
                }
            }
        }
        __syncthreads();
        {
            // X = (I + A)^-1 R by forward substitution. Warp w owns columns
            // 4w..4w+3; lane = column * 8 + part holds X rows part, part + 8, ...
            // of its column in registers; row i's sum over j < i is split over
            // the 8 parts and reduced with three shuffles.
            const int part = lane & 7;
            const int col = 4 * warp + (lane >> 3);
            float x[kChunk / 8];
#pragma unroll
            for (int jj = 0; jj < kChunk / 8; ++jj) x[jj] = xs[(8 * jj + part) * kSStride + col];
#pragma unroll
            for (int i = 1; i < kChunk; ++i) {
                if (i >= n) break;
                const float* a_row = as + i * kAStride + part;
                float sum = 0.0f;
#pragma unroll
                for (int jj = 0; jj <= (i - 1) / 8; ++jj) {
                    // Entries j >= i of A's row are zero: no mask needed.
                    sum = fmaf(a_row[8 * jj], x[jj], sum);
                }
                sum += __shfl_xor_sync(kFullMask, sum, 1);
                sum += __shfl_xor_sync(kFullMask, sum, 2);
                sum += __shfl_xor_sync(kFullMask, sum, 4);
                if (part == (i & 7)) x[i / 8] -= sum;
            }
#pragma unroll
            for (int jj = 0; jj < kChunk / 8; ++jj) {
                const int row = 8 * jj + part;
                xs[row * kSStride + col] = x[jj];
                xd[row * kSStride + col] = x[jj] * to_end[row];
            }
        }
        __syncthreads();
        {
            // O += M X, written out; then S <- exp(G_n) S + K^T Xd.
            const int steps = out_m0 < 16 * m_tiles ? k_steps_tokens : 0;
            warp_gemm<2>(o, ms, kAStride, 1, xs, kSStride, 1, out_m0, out_n0, steps);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = acc_row(out_m0, e), c = acc_col(out_n0, nt, e);
                    if (r < n) {
                        out[(static_cast<long>(first + r) * num_v_heads + head) * dv + column0 + c] =
                            __float2bfloat16_rn(o[nt][e]);
                    }
                }
            }
            const float chunk_decay = smem[kOffChunkDecay];
            const int s_m0 = 16 * warp;  // 8 warps x 16 rows = Dk
            float upd[4][4];
            zero(upd);
            warp_gemm<4>(upd, ks, 1, kQkStride, xd, kSStride, 1, s_m0, 0, k_steps_tokens);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float* s = ss + acc_row(s_m0, e) * kSStride + acc_col(0, nt, e);
                    *s = fmaf(chunk_decay, *s, upd[nt][e]);
                }
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kDk * kCols; idx += kThreads) {
        const int row = idx / kCols, col = idx % kCols;
        state[static_cast<long>(row) * dv + col] = ss[row * kSStride + col];
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256, 1) gated_delta_chunked_dk128(
    __nv_bfloat16* out, float* states, const __nv_bfloat16* q, const __nv_bfloat16* k,
    long qk_stride, const __nv_bfloat16* v, long v_stride, const __nv_bfloat16* a, long a_stride,
    const __nv_bfloat16* b, long b_stride, const float* a_log, const float* dt_bias,
    const long long* slots, const unsigned char* fresh, const int* qsl, int num_k_heads,
    int num_v_heads, int dv, int min_tokens, float q_scale, float eps) {
    gated_delta_chunked_block(out, states, q, k, qk_stride, v, v_stride, a, a_stride, b, b_stride,
                              a_log, dt_bias, slots, fresh, qsl, num_k_heads, num_v_heads, dv,
                              min_tokens, q_scale, eps);
}
