// Chunked multi-tensor launches for every CUDA kernel of mp_wrappers (the idea of apex's
// multi_tensor_apply, written anew), and the device helpers the kernels share.
//
// The ONE launch planner (for_each_launch): kDepth parallel lists (e.g. inputs and outputs, or
// params, grads, moments and model copies) are cut into chunks of kChunkSize elements; one CUDA
// block handles one chunk. Tensor addresses, sizes, dtypes and the block -> (tensor, chunk) map
// travel in the kernel-argument struct TensorListMeta, so one launch covers many tensors without any
// host-to-device copy, and a long list becomes a few launches on the current stream (no host
// synchronisation anywhere). Blocks are numbered across the launches of one call in (tensor, chunk)
// order (Chunk::block), which is how reductions lay out their per-chunk partials.
//
// The geometry (chunk, block and launch sizes) comes from geometry.cuh, a compile-time parameter.
// Every global-memory load and store of a kernel goes through ld/st/load_pack/store_pack/load_one/
// store_one below, so the host-execution build can count each kernel's bytes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/geometry.cuh"
#include "mp_wrappers/cuda/runtime.cuh"

namespace mp_wrappers {
namespace cuda {

// kChunk: elements per chunk (kChunkSize; the quantized kernels use kQuantChunkSize).
template <int kDepth, int64_t kChunk = kChunkSize>
struct TensorListMeta {
  static constexpr int kMaxTensors = Geometry::max_tensors(kDepth);
  void* addresses[kDepth][kMaxTensors];  // nullptr for an absent optional list (model_params)
  int64_t numel[kMaxTensors];
  int64_t first_block;  // blocks of the earlier launches of this call
  int32_t tensor_index[kMaxTensors];  // position of the slot's tensor in the caller's lists
  uint8_t dtype[kDepth][kMaxTensors];  // StorageDtype, per tensor and list
  uint8_t block_to_slot[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];

  struct Chunk {
    int slot;              // tensor slot in this launch
    int32_t tensor_index;  // the tensor's index in the caller's lists
    int64_t chunk;         // chunk index inside the tensor
    int64_t begin;         // first element of the chunk
    int64_t size;          // elements in the chunk (the last one may be short)
    int64_t block;         // the block's number across the launches of the call
  };
  __device__ __forceinline__ Chunk chunk_of_block() const {
    const int slot = block_to_slot[blockIdx.x];
    const int64_t chunk = block_to_chunk[blockIdx.x];
    const int64_t begin = chunk * kChunk;
    const int64_t left = numel[slot] - begin;
    return {slot, tensor_index[slot], chunk, begin, left < kChunk ? left : kChunk,
            first_block + static_cast<int64_t>(blockIdx.x)};
  }
};
static_assert(Geometry::max_tensors(5) < 256, "block_to_slot is a uint8_t");

inline int64_t chunks_of(int64_t numel, int64_t chunk = kChunkSize) {
  return (numel + chunk - 1) / chunk;
}

// Chunks of a whole list (the number of blocks of a call over it, and of its partials).
inline int64_t total_chunks(at::TensorList list, int64_t chunk = kChunkSize) {
  int64_t n = 0;
  for (const at::Tensor& t : list) n += chunks_of(t.numel(), chunk);
  return n;
}

// Blocks per launch for a call of `total` blocks when the device holds `resident` blocks of the
// kernel at once, so that no launch ends in a partial extra wave: launches of at most the whole
// waves that fit in kMaxBlocks, as few as that allows. Within one wave the call's blocks are spread
// evenly over them; past one wave a launch takes whole waves (an even spread would give each
// launch a partial one). For kernels whose launches run one after another, with blocks that take
// the same time wherever they land. Why: the H100 holds 264 blocks of the 8-bit Adam kernel, so a
// launch of 320 was 1.21 waves (Nsight Compute, 2026-11-27): its last 56 blocks ran after the
// first wave, most of the GPU idle. Its 320-block launches reached 43.5% achieved occupancy (of
// 50%), its last, 72-block launch 25%. A device that cannot say (resident <= 0) or holds more than
// kMaxBlocks: launches of at most kMaxBlocks, spread evenly. Always 1..kMaxBlocks.
inline int blocks_per_launch(int64_t total, int resident) {
  const int waves = resident > 0 ? kMaxBlocks / resident : 0;
  const int most = waves > 0 ? waves * resident : kMaxBlocks;
  const int64_t launches = std::max<int64_t>(1, (total + most - 1) / most);
  int64_t per = std::max<int64_t>(1, (total + launches - 1) / launches);
  if (waves > 0 && per > resident) per = (per + resident - 1) / resident * resident;  // <= most
  return static_cast<int>(per);
}

// Calls launch(blocks, meta) once per launch over the parallel `lists` (validated by the caller:
// same length and numel, contiguous), at most `max_blocks` (1..kMaxBlocks) blocks a launch. An empty
// list in `lists` (an optional list such as model_params) gets nullptr addresses. Empty tensors get
// no block; an all-empty list no launch.
template <int kDepth, int64_t kChunk = kChunkSize, class Launch>
void for_each_launch(const std::array<at::TensorList, kDepth>& lists, const Launch& launch,
                     int max_blocks = kMaxBlocks) {
  TORCH_INTERNAL_ASSERT(max_blocks >= 1 && max_blocks <= kMaxBlocks, "for_each_launch: max_blocks ",
                        max_blocks, " outside 1..", kMaxBlocks);
  using Meta = TensorListMeta<kDepth, kChunk>;
  const int64_t n_tensors = static_cast<int64_t>(lists[0].size());
  Meta meta;
  meta.first_block = 0;
  int slots = 0, blocks = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int d = 0; d < kDepth; ++d) {
      const bool absent = lists[d].empty();
      meta.addresses[d][slots] = absent ? nullptr : lists[d][t].data_ptr();
      meta.dtype[d][slots] =
          absent ? 0 : static_cast<uint8_t>(storage_dtype(lists[d][t].scalar_type()));
    }
    meta.numel[slots] = numel;
    meta.tensor_index[slots] = static_cast<int32_t>(t);
    ++slots;
    const int64_t chunks = chunks_of(numel, kChunk);
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_slot[blocks] = static_cast<uint8_t>(slots - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == max_blocks || (last_chunk && slots == Meta::kMaxTensors)) {
        launch(blocks, meta);
        meta.first_block += blocks;
        blocks = 0;
        if (last_chunk) {
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
  if (blocks > 0) launch(blocks, meta);
}

// ---- global memory: every load and store of a kernel goes through these -----------------------

template <class T>
__device__ __forceinline__ T ld(const T* p) {
  count_load(sizeof(T));
  check_aligned(p, alignof(T));
  return *p;
}
template <class T>
__device__ __forceinline__ void st(T* p, T v) {
  count_store(sizeof(T));
  check_aligned(p, alignof(T));
  *p = v;
}
// A value every thread of the block reads (a flag, a scale, a step): one transaction per block.
template <class T>
__device__ __forceinline__ T ld_uniform(const T* p) {
  if (threadIdx.x == 0) count_load(sizeof(T));
  return *p;
}
// A value every lane of a warp reads (a quantization block's absmax): one transaction per warp.
template <class T>
__device__ __forceinline__ T ld_warp_uniform(const T* p) {
  if (threadIdx.x % kWarp == 0) count_load(sizeof(T));
  return *p;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(c10::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Round-to-nearest-even, as torch's .to() does.
template <class T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// Stands in for an absent list (model_params, or the grads of a pass that reads none): loads and
// stores through it compile away.
struct NoOut {};

template <class T>
struct alignas(sizeof(T) * kILP) Pack {
  T v[kILP];
};

template <class T>
__device__ __forceinline__ bool pack_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}
__device__ __forceinline__ bool pack_aligned(const NoOut*) { return true; }

// Vector path: elements i0..i0+kILP-1 into fp32 (i0 a multiple of kILP, p aligned).
template <class T>
__device__ __forceinline__ void load_pack(float (&r)[kILP], const T* p, int64_t i0) {
  const Pack<T> pk = ld(reinterpret_cast<const Pack<T>*>(p + i0));
#pragma unroll
  for (int j = 0; j < kILP; ++j) r[j] = to_float(pk.v[j]);
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, int64_t i0, const float (&r)[kILP]) {
  if constexpr (!std::is_same<T, NoOut>::value) {
    Pack<T> pk;
#pragma unroll
    for (int j = 0; j < kILP; ++j) pk.v[j] = from_float<T>(r[j]);
    st(reinterpret_cast<Pack<T>*>(p + i0), pk);
  }
}

// Guarded path: element i (any alignment); loads give 0 and stores do nothing when i >= n.
template <class T>
__device__ __forceinline__ float load_one(const T* p, int64_t i, int64_t n) {
  if constexpr (std::is_same<T, NoOut>::value) {
    return 0.f;
  } else {
    return i < n ? to_float(ld(p + i)) : 0.f;
  }
}
template <class T>
__device__ __forceinline__ void store_one(T* p, int64_t i, int64_t n, float x) {
  if constexpr (!std::is_same<T, NoOut>::value) {
    if (i < n) st(p + i, from_float<T>(x));
  }
}

template <class T>
__device__ __forceinline__ T* offset_ptr(void* base, int64_t off) {
  if constexpr (std::is_same<T, NoOut>::value) {
    return nullptr;
  } else {
    return static_cast<T*>(base) + off;
  }
}

// Calls fn(T()) with T the storage type of `dtype` (a block-uniform branch, no divergence).
template <class Fn>
__device__ __forceinline__ void with_storage_type(uint8_t dtype, const Fn& fn) {
  switch (static_cast<StorageDtype>(dtype)) {
    case StorageDtype::kHalf: fn(c10::Half()); break;
    case StorageDtype::kBFloat16: fn(c10::BFloat16()); break;
    default: fn(float()); break;
  }
}

// ---- IEEE fp32 arithmetic, immune to --use_fast_math and FMA contraction --------------------------
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float fsqrt(float a) { return __fsqrt_rn(a); }
// a * b + c with one rounding, where a reference asks for a fused multiply-add.
__device__ __forceinline__ float ffma(float a, float b, float c) { return __fmaf_rn(a, b, c); }

__device__ __forceinline__ bool not_finite(float x) { return !(fabsf(x) <= 3.402823466e38f); }

// The square of an fp32 value, exact in double (24 + 24 bits < 53): sums of squares are accumulated
// in double, as the CPU kernels do, so finite values up to FLT_MAX never overflow a norm.
__device__ __forceinline__ double square(float x) {
  const double d = x;
  return d * d;
}

// ---- block reductions ---------------------------------------------------------------------------
struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
// max that propagates NaN (fmax would drop it).
struct NanMaxOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return (isnan(a) || isnan(b)) ? a + b : (a > b ? a : b);
  }
};

// Reduces one value per thread over the block; every thread gets the result. `shared` needs
// kBlockSize / 32 entries and may be reused right after the call.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* shared, Op op) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  if (warp == 0) {
    v = lane < n_warps ? shared[lane] : T(0);
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  const T result = shared[0];
  __syncthreads();  // shared may be reused right away
  return result;
}

// ---- per-chunk partial results of a reduction -----------------------------------------------------
// One slot of kWidth doubles per block of the call (so the buffer is exactly as large as the call
// needs: total_chunks(list) * kWidth), in (tensor, chunk) order; the block of a tensor's chunk 0 also
// records where the tensor's partials start and how many there are. A tensor without chunks (empty)
// keeps the zeroed range {0, 0}. Reading them back in chunk order keeps results deterministic.
template <int kWidth>
struct ChunkPartials {
  double* part;    // [total_chunks * kWidth]
  int64_t* range;  // [n_tensors * 2], zero-initialised: first block, number of chunks

  template <class Chunk>
  __device__ __forceinline__ void write(const Chunk& c, int64_t numel,
                                        const double (&v)[kWidth]) const {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int k = 0; k < kWidth; ++k) st(part + c.block * kWidth + k, v[k]);
    if (c.chunk == 0) {
      st(range + 2 * static_cast<int64_t>(c.tensor_index), c.block);
      st(range + 2 * static_cast<int64_t>(c.tensor_index) + 1, chunks_of_device(numel));
    }
  }
  // Combines tensor t's partials with `op`, in chunk order, starting from `init`.
  template <class Op>
  __device__ __forceinline__ double combine(int64_t t, int k, double init, Op op) const {
    const int64_t first = ld(range + 2 * t), count = ld(range + 2 * t + 1);
    double acc = init;
    for (int64_t c = 0; c < count; ++c) acc = op(acc, ld(part + (first + c) * kWidth + k));
    return acc;
  }
  __device__ __forceinline__ static int64_t chunks_of_device(int64_t numel) {
    return (numel + kChunkSize - 1) / kChunkSize;
  }
};

}  // namespace cuda
}  // namespace mp_wrappers
