// The shared-expert MoE's combine (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE), one
// launch for torch's three (sigmoid, product, sum), rounded as they round:
//   out[t, i] = bf16(routed[t, i] + bf16(bf16(sigmoid(gate[t])) * shared[t, i]))
// sigmoid as torch's CUDA sigmoid, 1 / (1 + expf(-x)) in float32.
// routed, shared, out: bf16 [T, H] contiguous (out may be either input);
// gate: bf16 [T] (the shared_expert_gate logit, one per token).
// One thread per 8 elements; grid: ceil(T * H / 8 / blockDim.x).
// Programmatic Dependent Launch (pdl.cuh): it waits for its predecessor
// first thing, then lets the next kernel launch.
// pdl-aware: shared_expert_combine
#include <cuda_bf16.h>

#include "bf16_vec.cuh"
#include "pdl.cuh"

extern "C" __global__ void shared_expert_combine(__nv_bfloat16* out, const __nv_bfloat16* routed,
                                                 const __nv_bfloat16* shared,
                                                 const __nv_bfloat16* __restrict__ gate,
                                                 int tokens, int hidden) {
    pdl_wait();  // before any thread leaves: every input is an earlier kernel's output
    pdl_launch_dependents();
    const long long vector = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int vectors_per_row = hidden / 8;
    if (vector >= static_cast<long long>(tokens) * vectors_per_row) return;
    const long long token = vector / vectors_per_row;
    const float g = __bfloat162float(gate[token]);
    const float scale = round_bf16(__fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g))));
    const uint4 r = load_vec(routed + vector * 8);
    const uint4 s = load_vec(shared + vector * 8);
    uint4 result;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float product = round_bf16(__fmul_rn(scale, vec_get(s, i)));
        vec_set(result, i, __float2bfloat16_rn(__fadd_rn(vec_get(r, i), product)));
    }
    store_vec(out + vector * 8, result);
}
