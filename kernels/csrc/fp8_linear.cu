// FP8 weights: float8 e4m3 bytes W [N, K] (row-major, K a multiple of 128)
// with float32 scales S [ceil(N/128), K/128], one per 128 x 128 block;
// the weight is W * S of its block (kernels/fp8_reference.py).
//
// fp8_gemv: out[M, N] = x[M, K] @ (W * S)^T for M = 1..16 (decode).
//   Memory-bound: every weight byte is read from HBM once per call and used
//   for all M rows of x. The products run on the tensor cores (mma.sync
//   m16n8k16, bf16 operands, float32 accumulators) with the weight as operand
//   A (16 weight rows x 16 k) and x as operand B (16 k x 8 x-rows; a second
//   mma for x rows 8..15). CTA = 16 weight rows x all of K; its warps take
//   128-column blocks in turn, so the CTA's rows (16 inside one 128-row block)
//   share one scale per column block: each block's mmas sum into fresh
//   float32 accumulators, which are scaled once in float32 and added up.
//
//   Exactness: e4m3 values are exact in bf16 (4 significant bits, exponents
//   -9..8), so every product value * x is exact and summed in float32; the
//   result differs from "dequantize in float32, then a float32 matmul" by the
//   rounding of value * scale and float32 accumulation order, and is rounded
//   to bf16 once.
//
//   e4m3 -> bf16 in registers: a byte's exponent and mantissa shifted right by
//   4 inside its 16-bit half line up with bf16's fields (the sign stays), so
//   the bf16 so made is value * 2^-120 (the biases are 7 and 127), subnormals
//   included (bf16 has them too); a bf16x2 multiply by 2^120 (exact) restores
//   the value. Two pairs come from four bytes: (b0, b2) and (b1, b3). The dot
//   product does not care how k is permuted as long as x uses the same
//   permutation: a thread's four bytes of a tile are physical columns
//   4t .. 4t+3 and stand for logical k (2t, 2t+1) = columns (0, 2) and
//   (2t+8, 2t+9) = columns (1, 3), so its x fragment is 8 contiguous bytes
//   of x, its halves regrouped with two byte permutes.
//
//   Fragment layout (thread (g, t) = lane 4g + t): A rows g and g + 8 are
//   weight rows n0 + g and n0 + g + 8; each thread loads 16 bytes of each of
//   its two rows per 64 columns (four tiles), 16-byte loads that bypass L1.
//   D gives thread (g, t) out[x rows 2t, 2t+1][weight rows n0 + g, n0 + g + 8].
//   The warps' float32 partials are summed through shared memory in a fixed
//   order (deterministic). out rows may have a stride (a column range of a
//   wider output).
//
// fp8_dequantize: out[N, K] bf16 = (value * scale in float32) rounded to bf16
//   (round to nearest even), as torch's (W.float() * S).to(bfloat16). Each
//   thread converts 16 bytes and writes two 16-byte stores.
//
// Programmatic Dependent Launch (pdl.cuh; inside CUDA graphs on Hopper): in
// fp8_gemv a warp asks L2 for its first column block of the CTA's 16 weight
// rows, lets the next kernel launch, and only then waits for the kernel that
// wrote x, as skinny_gemm.cu's decode kernels do (the weight is no kernel's
// output; a prefetch is only a hint into L2, the point of coherence). The
// weight's loads, the scales, x and out all come after the wait.
// fp8_dequantize waits first thing (out is a scratch an earlier GEMM may
// still read), then lets the next kernel launch. Numerics are unchanged.
// pdl-aware: fp8_gemv_nt* fp8_dequantize
#include <cuda_bf16.h>

#include "pdl.cuh"

namespace {

constexpr int kRows = 16;       // weight rows per CTA (operand A's M)
constexpr int kBlock = 128;     // rows and columns one scale covers
constexpr int kMaxWarps = 16;
constexpr unsigned kPow120 = 0x7B807B80u;   // bf16 2^120 twice
constexpr unsigned kNegZero = 0x80008000u;  // bf16 -0.0 twice: fma(a, b, -0) == a * b

__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(kNegZero));
    return d;
}

// Bytes b0..b3 of w (e4m3) -> bf16 pairs (b0, b2) and (b1, b3), exactly.
__device__ __forceinline__ void e4m3x4_to_bf16(unsigned w, unsigned& p02, unsigned& p13) {
    const unsigned high = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 4);  // bytes 1, 3
    const unsigned shifted = w << 8;
    const unsigned low = (shifted & 0x80008000u) | ((shifted & 0x7F007F00u) >> 4);  // 0, 2
    p02 = bf16x2_mul(low, kPow120);
    p13 = bf16x2_mul(high, kPow120);
}

// One e4m3 byte as float32. e4m3 is fp16 with a 4-bit exponent: its sign
// moved to bit 15 and its other 7 bits to bits 7..13 make the fp16 of
// value * 2^-8 exactly (e4m3's subnormals as fp16 subnormals), fp16 -> float
// is exact, and * 2^8 restores the value. Not float bits holding
// value * 2^-120: e4m3's subnormals would be float subnormals there, and CuPy
// compiles every kernel with -ftz=true, which flushes them in the multiply.
__device__ __forceinline__ float e4m3_to_float(unsigned byte) {
    const unsigned short bits =
        static_cast<unsigned short>(((byte & 0x80u) << 8) | ((byte & 0x7Fu) << 7));
    float f;
    asm("{\n.reg .f16 h;\nmov.b16 h, %1;\ncvt.f32.f16 %0, h;\n}\n" : "=f"(f) : "h"(bits));
    return f * 0x1p8f;
}

// 16 weight bytes, read once: not kept in L1. kCoherent: without .nc, for
// fp8_gemv's first block, which follows pdl_wait(): ptxas 13.0 scheduled a
// .nc load of it above the wait (.nc data is read-only for the kernel's
// lifetime, so it may), harmless for the weight but indistinguishable from
// an early read of x in the machine code tests/kernels/test_pdl.py checks.
template <bool kCoherent = false>
__device__ __forceinline__ uint4 load_stream(const unsigned char* p) {
    uint4 v;
    if constexpr (kCoherent) {
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    }
    return v;
}

__device__ __forceinline__ unsigned word(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// d += A * B, m16n8k16, bf16 in, float32 accumulate. A registers: (row g, k
// 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..).
__device__ __forceinline__ void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                    unsigned a3, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 16 weight bytes per row a thread reads for one 128-column block: two
// 64-column chunks of rows g and g + 8.
struct BlockBytes {
    uint4 row_g[2];
    uint4 row_g8[2];
};

template <bool kCoherent = false>
__device__ __forceinline__ BlockBytes load_block(const unsigned char* row_g,
                                                 const unsigned char* row_g8, bool ok_g,
                                                 bool ok_g8, int kb) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    BlockBytes bytes;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const size_t offset = static_cast<size_t>(kb) * kBlock + 64 * c;
        bytes.row_g[c] = ok_g ? load_stream<kCoherent>(row_g + offset) : zero;
        bytes.row_g8[c] = ok_g8 ? load_stream<kCoherent>(row_g8 + offset) : zero;
    }
    return bytes;
}

template <int NT>
__device__ __forceinline__ void fp8_gemv(__nv_bfloat16* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ x,
                                         const unsigned char* __restrict__ weight,
                                         const float* __restrict__ scales, int n, int k, int m,
                                         int out_stride) {
    __shared__ float partial[kMaxWarps][NT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * kRows;
    const int blocks = k / kBlock;
    // PDL: lane (g, t) asks L2 for the line of the first (t < 2) or last
    // byte of row g (t even) or g + 8's 128 bytes in the warp's first column
    // block: the 128 bytes span one or two lines.
    const int prefetch_row = n0 + g + 8 * (t & 1);
    if (warp < blocks && prefetch_row < n) {
        prefetch_l2(weight + static_cast<size_t>(prefetch_row) * k + warp * kBlock +
                    (t >> 1) * (kBlock - 1));
    }
    pdl_launch_dependents();
    pdl_wait();  // x is an earlier kernel's output, out may be an earlier kernel's input
    const float* scale_row = scales + static_cast<size_t>(n0 / kBlock) * blocks;
    const bool ok_g = n0 + g < n, ok_g8 = n0 + g + 8 < n;
    const unsigned char* row_g = weight + static_cast<size_t>(n0 + g) * k + 16 * t;
    const unsigned char* row_g8 = weight + static_cast<size_t>(n0 + g + 8) * k + 16 * t;
    const __nv_bfloat16* x_row[NT];
    bool ok_x[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        ok_x[i] = g + 8 * i < m;
        x_row[i] = x + static_cast<size_t>(g + 8 * i) * k + 16 * t;
    }

    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    BlockBytes next = load_block<true>(row_g, row_g8, ok_g, ok_g8, warp < blocks ? warp : 0);
    for (int kb = warp; kb < blocks; kb += warps) {
        const BlockBytes bytes = next;
        // The next block's bytes are in flight while this one is multiplied.
        if (kb + warps < blocks) next = load_block(row_g, row_g8, ok_g, ok_g8, kb + warps);
        float part[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) part[i][0] = part[i][1] = part[i][2] = part[i][3] = 0.0f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            uint4 xv[NT][2];
            const size_t column = static_cast<size_t>(kb) * kBlock + 64 * c;
#pragma unroll
            for (int i = 0; i < NT; ++i) {
                const uint4* source = reinterpret_cast<const uint4*>(x_row[i] + column);
                xv[i][0] = ok_x[i] ? source[0] : make_uint4(0u, 0u, 0u, 0u);
                xv[i][1] = ok_x[i] ? source[1] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned g02, g13, g8_02, g8_13;
                e4m3x4_to_bf16(word(bytes.row_g[c], j), g02, g13);
                e4m3x4_to_bf16(word(bytes.row_g8[c], j), g8_02, g8_13);
#pragma unroll
                for (int i = 0; i < NT; ++i) {
                    const uint4& half = xv[i][j >> 1];
                    const unsigned x01 = (j & 1) ? half.z : half.x;
                    const unsigned x23 = (j & 1) ? half.w : half.y;
                    mma(part[i], g02, g8_02, g13, g8_13, __byte_perm(x01, x23, 0x5410),
                        __byte_perm(x01, x23, 0x7632));
                }
            }
        }
        const float scale = scale_row[kb];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][r] = fmaf(scale, part[i][r], acc[i][r]);
    }

#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) partial[warp][i * 4 + r][lane] = acc[i][r];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float sum = 0.0f;
            for (int w = 0; w < warps; ++w) sum += partial[w][i * 4 + r][lane];
            const int x_index = 8 * i + 2 * t + (r & 1);
            const int row = n0 + g + 8 * (r >> 1);
            if (x_index < m && row < n)
                out[static_cast<size_t>(x_index) * out_stride + row] = __float2bfloat16_rn(sum);
        }
    }
}

}  // namespace

// x rows 1..8 (one n8 tile of the mma) and 9..16 (two).
extern "C" __global__ void fp8_gemv_nt1(__nv_bfloat16* out, const __nv_bfloat16* x,
                                        const unsigned char* weight, const float* scales, int n,
                                        int k, int m, int out_stride) {
    fp8_gemv<1>(out, x, weight, scales, n, k, m, out_stride);
}

extern "C" __global__ void fp8_gemv_nt2(__nv_bfloat16* out, const __nv_bfloat16* x,
                                        const unsigned char* weight, const float* scales, int n,
                                        int k, int m, int out_stride) {
    fp8_gemv<2>(out, x, weight, scales, n, k, m, out_stride);
}

// groups: N * K / 16; K a multiple of 128.
extern "C" __global__ void fp8_dequantize(__nv_bfloat16* __restrict__ out,
                                          const unsigned char* __restrict__ weight,
                                          const float* __restrict__ scales, int groups, int k) {
    pdl_wait();
    pdl_launch_dependents();
    const int blocks = k / kBlock;
    for (int group = blockIdx.x * blockDim.x + threadIdx.x; group < groups;
         group += gridDim.x * blockDim.x) {
        const size_t element = static_cast<size_t>(group) * 16;
        const int row = static_cast<int>(element / k);
        const int column = static_cast<int>(element % k);
        const float scale = scales[(row / kBlock) * blocks + column / kBlock];
        const uint4 bytes = load_stream(weight + element);
        unsigned packed[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned w = word(bytes, i >> 1);
            const int shift = 16 * (i & 1);
            const float lo = e4m3_to_float((w >> shift) & 0xFFu) * scale;
            const float hi = e4m3_to_float((w >> (shift + 8)) & 0xFFu) * scale;
            const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
            packed[i] = *reinterpret_cast<const unsigned*>(&pair);
        }
        uint4* target = reinterpret_cast<uint4*>(out + element);
        target[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        target[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
}
