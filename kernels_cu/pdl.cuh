// Programmatic dependent launch (Hopper, sm_90+): a kernel launched with the
// programmatic-stream-serialization attribute may start while the kernel before it on the
// stream is still running, once every CTA of that kernel has called launch_dependents()
// (or exited). It must then call grid_dependency_wait() before it touches anything the
// previous kernel writes or reads: the wait returns when that kernel has completed and its
// memory is visible. Work on data nothing upstream writes (a GEMV's weights) can go first.
//
// Both are no-ops below sm_90, and on a kernel launched without the attribute, so every
// kernel may call them whatever its launch.
#pragma once

namespace streamkv {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace streamkv
