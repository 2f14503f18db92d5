// The lean bf16 param of the 8-bit CUDA kernels' block update (cuda/multi_tensor_adam8bit.cu's
// multi_tensor_adam8bit_lean_, cuda/multi_tensor_sgd8bit.cu's multi_tensor_sgd8bit_lean_): the
// twin of MasterParam (cuda/quant_block.cuh) for bf16 params stored 'split', 'kahan' or
// 'stochastic', each element read and written as the lean kernels do (cuda/lean_param.cuh), so
// that both 8-bit updates compose the master step exactly as the lean reference does. The CPU twin
// is LeanMasterParam in cpu_quant_param.h. Also the launch bound of a block update by its param.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mp_wrappers/cuda/lean_param.cuh"
#include "mp_wrappers/cuda/quant_block.cuh"

namespace mp_wrappers {
namespace cuda {

// bf16 params stored the lean way, at the tensor's first element: the stochastic hash takes the
// element's index in the tensor. Element by element in either layout (2-byte params beside 1-byte
// codes). store* step p32 by the op's lean step of the direction q: `op.lean_step(ctx, p32, q)`,
// the op's `storage` and its Ctx's stochastic `key` (lean_key) given at the chunk.
struct LeanParam {
  uint16_t* p;
  uint16_t* aux;  // nullptr for 'stochastic'
  int64_t begin;  // the chunk's first element
  int storage;
  uint32_t key;

  template <class Op>
  __device__ __forceinline__ static LeanParam at_chunk(const Op& op, const typename Op::Ctx& ctx,
                                                       void* p, void* aux, int64_t begin) {
    return {static_cast<uint16_t*>(p), static_cast<uint16_t*>(aux), begin, op.storage, ctx.key};
  }
  __device__ __forceinline__ bool aligned() const { return true; }
  __device__ __forceinline__ void load_pack(float (&r)[kILP], int i0) const {
#pragma unroll
    for (int j = 0; j < kILP; ++j) r[j] = lean_load(storage, p, aux, begin + i0 + j);
  }
  __device__ __forceinline__ float load_one(int i, int n) const {
    return i < n ? lean_load(storage, p, aux, begin + i) : 0.f;
  }
  // Not asked for: any prefetch in the lean kernels spilled registers (nvcc 13.0, sm_80, sm_90).
  static constexpr bool kPrefetch = false;
  __device__ __forceinline__ void prefetch(int, int) const {}
  template <class Op>
  __device__ __forceinline__ void store_pack(const Op& op, const typename Op::Ctx& ctx, int i0,
                                             const float (&p32)[kILP],
                                             const float (&q)[kILP]) const {
#pragma unroll
    for (int j = 0; j < kILP; ++j)
      lean_store(storage, p, aux, begin + i0 + j, p32[j], op.lean_step(ctx, p32[j], q[j]), key);
  }
  template <class Op>
  __device__ __forceinline__ void store_one(const Op& op, const typename Op::Ctx& ctx, int i,
                                            int n, float p32, float q) const {
    if (i < n) lean_store(storage, p, aux, begin + i, p32, op.lean_step(ctx, p32, q), key);
  }
};

// A block update's launch bound: kMinBlocksPerSm (cuda/quant_block.cuh) for fp32 / half params;
// for lean bf16 params two, except with fp32 grads, which no wrapper makes (autograd gives bf16
// params bf16 grads): the 8-bit Adam update spilled 4 bytes within 64 registers there (nvcc 13.0,
// sm_90): one block, no spill.
template <class PM, class G>
struct MinBlocksPerSm;
template <class P, class M, class G>
struct MinBlocksPerSm<MasterParam<P, M>, G> {
  static constexpr int value = kMinBlocksPerSm<P, M>;
};
template <class G>
struct MinBlocksPerSm<LeanParam, G> {
  static constexpr int value = std::is_same<G, float>::value ? 1 : 2;
};

}  // namespace cuda
}  // namespace mp_wrappers
