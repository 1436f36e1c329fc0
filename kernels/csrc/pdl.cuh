// Programmatic Dependent Launch (Hopper): the device side. A kernel launched
// with the programmatic-stream-serialization attribute (kernels/pdl.py; only
// inside CUDA graph captures, kernels/cuda_build.py) may start while the
// kernel before it in the stream is still running. Such a kernel must call
// pdl_wait() before it reads anything an earlier kernel wrote and before it
// writes anything an earlier kernel may still read; only reads of memory no
// kernel writes (weights) and L2 prefetch hints may come first.
//
// PTX ISA, griddepcontrol (PTX 7.8, sm_90+;
// docs.nvidia.com/cuda/parallel-thread-execution, "Parallel Synchronization
// and Communication Instructions: griddepcontrol"):
//   .wait makes the executing thread wait until all prerequisite grids in
//     flight have completed and their memory operations are performed and
//     visible to the current grid;
//   .launch_dependents lets the dependents the runtime designated be
//     scheduled once every CTA of this grid has issued it or completed; a
//     CTA's repeats have no further effect.
// A kernel launched without the attribute has no prerequisite grid in
// flight (the stream ran its predecessor to completion first) and no
// designated dependents, so both are no-ops there (Triton's gdc_wait /
// gdc_launch_dependents docs say the same: "safe to execute when
// programmatic dependent launch is disabled"). So one build serves eager
// and captured launches.
//
// Every thread calls pdl_wait() before its first dependent access, and no
// thread returns before it: a grid then completes only after its
// predecessor did, which keeps the chain transitive (a kernel that waits on
// its predecessor also waits on everything before it).
//
// Pasted into the including source by kernels/cuda_build.py before NVRTC
// compiles it (CuPy's compile cache is keyed on the source text alone).
#pragma once

// Wait for the predecessor grid to complete and its writes to be visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel of the stream be scheduled (its CTAs then run up to
// their own pdl_wait() while this grid finishes).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Ask L2 for the line holding a byte (a hint: no register, no wait). The
// weight-streaming kernels issue it for bytes no kernel writes before
// pdl_wait(), and for their next step's bytes while they load the current
// one; by pointer or by a generic address as an integer.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ void prefetch_l2(unsigned long long address) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}
