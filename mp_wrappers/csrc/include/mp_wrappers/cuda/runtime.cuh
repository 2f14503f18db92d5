// The one place where the CUDA kernels meet either the CUDA runtime (nvcc, the real build) or the
// host emulation (the host-execution test build, MP_WRAPPERS_CUDA_HOST; see
// mp_wrappers/cuda_host/emulation.h and docs/cuda.md "Host execution").
//
// Kernel files (mp_wrappers/csrc/cuda/*.cu) include no CUDA header themselves: they use
//   DeviceGuard / current_stream()      the device guard and stream of an entry point;
//   launch("name", kernel, grid, block, stream, args...)   instead of kernel<<<...>>>(args...);
//   MP_WRAPPERS_CUDA_OPS(m) { m.impl(...); }               instead of TORCH_LIBRARY_IMPL(..., CUDA, m).
// so nvcc and the host compiler compile the very same lines. Convention for new kernels: every
// .cu file in mp_wrappers/csrc/cuda is built by setup.py (CUDA builds) and by the host-execution
// build (tests/cuda_host.py), with no list to update.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/library.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#ifdef MP_WRAPPERS_CUDA_HOST
#include "mp_wrappers/cuda_host/emulation.h"
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mp_wrappers {
namespace cuda {

// Size of a kernel's parameter buffer: each argument at its alignment, in order.
template <class... Ts>
constexpr size_t param_buffer_size() {
  size_t size = 0;
  ((size = (size + alignof(Ts) - 1) / alignof(Ts) * alignof(Ts) + sizeof(Ts)), ...);
  return size;
}
// The classic kernel-parameter limit (raised to 32 KB only from CUDA 12.1 on Volta+ with a
// toolkit-and-driver pair we do not require).
constexpr size_t kMaxParamBytes = 4096;

#ifdef MP_WRAPPERS_CUDA_HOST

using Stream = int;
struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};
inline Stream current_stream() { return 0; }

template <class... KArgs, class... Args>
inline void launch(const char* name, void (*kernel)(KArgs...), unsigned int grid,
                   unsigned int block, Stream, Args&&... args) {
  static_assert(param_buffer_size<std::decay_t<KArgs>...>() <= kMaxParamBytes,
                "kernel arguments exceed the 4 KB parameter limit");
  cuda_host::launch(name, kernel, dim3(grid), dim3(block), std::forward<Args>(args)...);
}

// The emulated device holds cuda_host::g_resident_blocks blocks of any kernel at once
// (blocks_per_launch, multi_tensor_apply.cuh).
template <auto kKernel, unsigned int kBlock>
inline int resident_blocks() {
  return cuda_host::g_resident_blocks.load();
}

// Traffic counting and alignment hooks of the load/store helpers (multi_tensor_apply.cuh).
__device__ __forceinline__ void count_load(uint64_t bytes) { cuda_host::count_load(bytes); }
__device__ __forceinline__ void count_store(uint64_t bytes) { cuda_host::count_store(bytes); }
__device__ __forceinline__ void check_aligned(const void* p, uint64_t align) {
  cuda_host::check_aligned(p, align);
}
// A hint, not an access: not counted; its address is touched, so that a stray one shows.
__device__ __forceinline__ void prefetch_l2(const void* p) { cuda_host::touch(p); }

#define MP_WRAPPERS_CUDA_OPS(m) TORCH_LIBRARY_IMPL(MP_WRAPPERS_CUDA_HOST_NS, CPU, m)

#else  // nvcc

using Stream = cudaStream_t;
using DeviceGuard = c10::cuda::CUDAGuard;
inline Stream current_stream() { return c10::cuda::getCurrentCUDAStream(); }

template <class... KArgs, class... Args>
inline void launch(const char*, void (*kernel)(KArgs...), unsigned int grid, unsigned int block,
                   Stream stream, Args&&... args) {
  static_assert(param_buffer_size<std::decay_t<KArgs>...>() <= kMaxParamBytes,
                "kernel arguments exceed the 4 KB parameter limit");
  kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Blocks of kKernel, launched with kBlock threads and no dynamic shared memory, the current device
// holds at once: its SMs times the blocks one SM holds (registers, shared memory, warps). Asked of
// the runtime once per kernel and device (the answer does not change while the process runs), so
// that a step's host time does not grow by it.
template <auto kKernel, unsigned int kBlock>
int resident_blocks() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0: not asked yet (static storage starts zeroed)
  const int device = c10::cuda::current_device();
  const bool cached = device >= 0 && device < kDevices;
  if (cached) {
    const int n = known[device].load(std::memory_order_relaxed);
    if (n > 0) return n;
  }
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kBlock, 0));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int n = per_sm * sms;
  if (cached && n > 0) known[device].store(n, std::memory_order_relaxed);
  return n;
}

__device__ __forceinline__ void count_load(uint64_t) {}
__device__ __forceinline__ void count_store(uint64_t) {}
__device__ __forceinline__ void check_aligned(const void*, uint64_t) {}
// Ask L2 for the line holding `p` without waiting for it (no register, no fault; the caller keeps
// `p` inside the tensor all the same).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

#define MP_WRAPPERS_CUDA_OPS(m) TORCH_LIBRARY_IMPL(mp_wrappers, CUDA, m)

#endif

}  // namespace cuda
}  // namespace mp_wrappers
