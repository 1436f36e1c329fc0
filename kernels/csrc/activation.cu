// SwiGLU on a fused gate/up projection: out[t, i] = silu(x[t, i]) * x[t, I + i].
// bf16 in and out, float32 arithmetic; 8 bf16 (16 bytes) per thread per load.
// Programmatic Dependent Launch (pdl.cuh): it waits for its predecessor first
// thing, then lets the next kernel launch.
// pdl-aware: silu_and_mul_bf16
#include <cuda_bf16.h>

#include "pdl.cuh"
#include "swiglu.cuh"

// grid: (T, ceil(I / (8 * blockDim.x))); I must be a multiple of 8. Rows go
// in grid.x: a grouped MoE step has T = tokens x top-k rows, past grid.y's 65535.
extern "C" __global__ void silu_and_mul_bf16(__nv_bfloat16* __restrict__ out,
                                             const __nv_bfloat16* __restrict__ x,
                                             int intermediate) {
    pdl_wait();
    pdl_launch_dependents();
    const long row = blockIdx.x;
    const int col = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (col >= intermediate) return;
    const __nv_bfloat16* gate = x + row * 2 * intermediate + col;
    const __nv_bfloat16* up = gate + intermediate;
    uint4 gate_bits = *reinterpret_cast<const uint4*>(gate);
    uint4 up_bits = *reinterpret_cast<const uint4*>(up);
    const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gate_bits);
    const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&up_bits);
    uint4 result;
    __nv_bfloat16* r = reinterpret_cast<__nv_bfloat16*>(&result);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        r[i] = __float2bfloat16_rn(swiglu(__bfloat162float(g[i]), __bfloat162float(u[i])));
    }
    *reinterpret_cast<uint4*>(out + row * intermediate + col) = result;
}
