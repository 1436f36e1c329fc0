// SwiGLU's element step, shared by silu_and_mul_bf16 (activation.cu) and the
// skinny GEMM's fused epilogue (skinny_gemm.cuh), so both round alike.
#pragma once

#include "bf16_vec.cuh"

// silu(gate) * up from the bf16 values of the projection; transformers
// rounds silu(gate) to bf16 before the product, and so do we. The caller
// rounds the product to bf16 once.
__device__ __forceinline__ float swiglu(float gate, float up) {
    return round_bf16(gate / (1.0f + expf(-gate))) * up;
}
