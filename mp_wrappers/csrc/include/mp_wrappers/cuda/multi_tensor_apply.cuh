// Chunked multi-tensor launches for the CUDA kernels (the idea of apex's multi_tensor_apply).
//
// A list of up to a few dozen tensors (kDepth parallel lists: e.g. inputs and outputs) is cut into
// chunks of kChunkSize elements; one CUDA block handles one chunk. Tensor addresses, sizes, dtypes
// and the block -> (tensor, chunk) map travel in the kernel-argument struct TensorListMeta, so one
// launch covers many tensors without any host-to-device copy, and a long list becomes a few
// launches on the current stream (no host synchronisation anywhere).
//
// A functor does the per-chunk work:
//   struct MyFunctor {
//     template <int kDepth> __device__ void operator()(const TensorListMeta<kDepth>& meta,
//                                                      Args... args) const;
//   };
// and finds its chunk with meta.chunk_of_block() (64-bit element offsets throughout).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>

#include "mp_wrappers/checks.h"

namespace mp_wrappers {
namespace cuda {

constexpr int64_t kChunkSize = 65536;
constexpr int kBlockSize = 512;
constexpr int kILP = 4;  // elements per vector load on the aligned fast path

// Tensors per launch for a given list depth, chosen (as apex does) so that TensorListMeta stays
// within the classic 4 KB kernel-parameter limit.
constexpr int max_tensors_for_depth(int depth) {
  return depth == 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : 30;
}
constexpr int kMaxBlocksPerLaunch = 320;

template <int kDepth>
struct TensorListMeta {
  static constexpr int kMaxTensors = max_tensors_for_depth(kDepth);
  void* addresses[kDepth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t tensor_index[kMaxTensors];  // position of the slot's tensor in the caller's lists
  uint8_t dtype[kDepth][kMaxTensors];  // StorageDtype, per tensor and list
  uint8_t block_to_slot[kMaxBlocksPerLaunch];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];

  struct Chunk {
    int slot;        // tensor slot in this launch
    int64_t chunk;   // chunk index inside the tensor
    int64_t begin;   // first element of the chunk
    int64_t size;    // elements in the chunk (the last one may be short)
  };
  __device__ __forceinline__ Chunk chunk_of_block() const {
    const int slot = block_to_slot[blockIdx.x];
    const int64_t chunk = block_to_chunk[blockIdx.x];
    const int64_t begin = chunk * kChunkSize;
    const int64_t left = numel[slot] - begin;
    return {slot, chunk, begin, left < kChunkSize ? left : kChunkSize};
  }
};

template <int kDepth, class Functor, class... Args>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_apply_kernel(const TensorListMeta<kDepth> meta, Functor functor, Args... args) {
  functor(meta, args...);
}

// Run `functor` over every chunk of the parallel lists (all already validated with
// check_tensor_lists: same length, numel, device, contiguous). Launches go to the current stream of
// the tensors' device.
template <int kDepth, class Functor, class... Args>
void multi_tensor_apply(const std::array<at::TensorList, kDepth>& lists, Functor functor,
                        Args... args) {
  using Meta = TensorListMeta<kDepth>;
  const int64_t n_tensors = static_cast<int64_t>(lists[0].size());
  if (n_tensors == 0) return;
  const c10::cuda::CUDAGuard guard(lists[0][0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  Meta meta;
  int slots = 0, blocks = 0;
  auto launch = [&]() {
    multi_tensor_apply_kernel<kDepth><<<blocks, kBlockSize, 0, stream>>>(meta, functor, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int d = 0; d < kDepth; ++d) {
      meta.addresses[d][slots] = lists[d][t].data_ptr();
      meta.dtype[d][slots] = static_cast<uint8_t>(storage_dtype(lists[d][t].scalar_type()));
    }
    meta.numel[slots] = numel;
    meta.tensor_index[slots] = static_cast<int32_t>(t);
    ++slots;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_slot[blocks] = static_cast<uint8_t>(slots - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool blocks_full = blocks == kMaxBlocksPerLaunch;
      const bool slots_full = slots == Meta::kMaxTensors && c == chunks - 1;
      const bool last = t == n_tensors - 1 && c == chunks - 1;
      if (blocks_full || slots_full || last) {
        launch();
        blocks = 0;
        if (c == chunks - 1) {
          slots = 0;
        } else {
          // The current tensor continues in the next launch: move it to slot 0.
          for (int d = 0; d < kDepth; ++d) {
            meta.addresses[d][0] = meta.addresses[d][slots - 1];
            meta.dtype[d][0] = meta.dtype[d][slots - 1];
          }
          meta.numel[0] = meta.numel[slots - 1];
          meta.tensor_index[0] = meta.tensor_index[slots - 1];
          slots = 1;
        }
      }
    }
  }
  if (blocks > 0) launch();  // only reachable when trailing tensors were empty
}

// ---- device helpers shared by the functors ---------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(c10::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Round-to-nearest-even, as torch's .to() does.
template <class T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }

// Calls fn(T()) with T the storage type of `dtype` (a block-uniform branch, no divergence).
template <class Fn>
__device__ __forceinline__ void with_storage_type(uint8_t dtype, const Fn& fn) {
  switch (static_cast<StorageDtype>(dtype)) {
    case StorageDtype::kHalf: fn(c10::Half()); break;
    case StorageDtype::kBFloat16: fn(c10::BFloat16()); break;
    default: fn(float()); break;
  }
}

template <class T>
struct alignas(sizeof(T) * kILP) VecN {
  T v[kILP];
};

template <class T>
__device__ __forceinline__ bool is_aligned_for_ilp(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(VecN<T>) == 0;
}

// Loads kILP values at p[i*kILP...] into fp32 (p must be aligned, see is_aligned_for_ilp).
template <class T>
__device__ __forceinline__ void load_ilp(float (&dst)[kILP], const T* p, int64_t i) {
  const VecN<T> v = reinterpret_cast<const VecN<T>*>(p)[i];
#pragma unroll
  for (int k = 0; k < kILP; ++k) dst[k] = to_float(v.v[k]);
}

template <class T>
__device__ __forceinline__ void store_ilp(T* p, int64_t i, const float (&src)[kILP]) {
  VecN<T> v;
#pragma unroll
  for (int k = 0; k < kILP; ++k) v.v[k] = from_float<T>(src[k]);
  reinterpret_cast<VecN<T>*>(p)[i] = v;
}

__device__ __forceinline__ bool not_finite(float x) { return !(fabsf(x) <= 3.402823466e38f); }

// Block-wide sum; every thread gets the result. `shared` needs kBlockSize / 32 entries.
template <class T>
__device__ __forceinline__ T block_reduce_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int n_warps = (blockDim.x + 31) / 32;
  v = threadIdx.x < n_warps ? shared[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const T result = shared[0];
  __syncthreads();  // shared may be reused right away
  return result;
}

}  // namespace cuda
}  // namespace mp_wrappers
