// The lean bf16 param of the CUDA kernels that step bf16 params without a separate fp32 master
// (cuda/multi_tensor_lean.cu, and the 8-bit Adam kernel's lean entry point in
// cuda/multi_tensor_adam8bit.cu): how one element of a bf16 param and its aux state is read as fp32
// and written back, the storage way (Note [lean bf16 storage] in mp_wrappers/ops/reference/lean.py;
// the CPU twin is cpu_lean_param.h). Shared so that every update composes the master step exactly
// as the lean reference does.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {

// LeanStorage (op_args.h) as the int the kernels compare.
enum LeanStorageId : int {
  kSplit = static_cast<int>(LeanStorage::kSplit),
  kKahan = static_cast<int>(LeanStorage::kKahan),
  kStochastic = static_cast<int>(LeanStorage::kStochastic)
};

// The hash of reference.lean.stochastic_bits (same constants as cpu_lean.h).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  return x ^ (x >> 16);
}

__device__ __forceinline__ float bits_to_float(uint32_t b) {
  return __int_as_float(static_cast<int>(b));
}
__device__ __forceinline__ uint32_t float_to_bits(float x) {
  return static_cast<uint32_t>(__float_as_int(x));
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) {
  return bits_to_float(static_cast<uint32_t>(h) << 16);
}
// Round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion, as the CPU kernels store).
__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  return from_float<c10::BFloat16>(x).x;
}

// Per-tensor key of the stochastic rounding: reference.lean.stochastic_bits.
__device__ __forceinline__ uint32_t lean_key(uint32_t seed, float count, int32_t index) {
  const uint32_t c = static_cast<uint32_t>(static_cast<int64_t>(count));
  return mix32(mix32(seed ^ mix32(c)) ^ (static_cast<uint32_t>(index) * 0x9E3779B1u));
}

// The fp32 value of element i of a lean bf16 param (p: bf16 bits; aux: low halves for split).
__device__ __forceinline__ float lean_load(int storage, const uint16_t* p, const uint16_t* aux,
                                           int64_t i) {
  const uint32_t hi = static_cast<uint32_t>(ld(p + i)) << 16;
  if (storage == kSplit) return bits_to_float(hi | ld(aux + i));
  return bits_to_float(hi);
}

// Writes p32 - delta into element i the storage's way (Note [lean bf16 storage]). Subtraction, not
// addition of a negated step, keeps the signed zeros of the fp32-master kernels.
__device__ __forceinline__ void lean_store(int storage, uint16_t* p, uint16_t* aux, int64_t i,
                                           float p32, float delta, uint32_t key) {
  if (storage == kKahan) {
    const float c = fsub(bf16_bits_to_float(ld(aux + i)), delta);
    const uint16_t rounded = float_to_bf16_bits(fadd(p32, c));
    st(p + i, rounded);
    st(aux + i, float_to_bf16_bits(fsub(c, fsub(bf16_bits_to_float(rounded), p32))));
    return;
  }
  const float x = fsub(p32, delta);
  const uint32_t bits = float_to_bits(x);
  if (storage == kSplit) {
    st(p + i, static_cast<uint16_t>(bits >> 16));
    st(aux + i, static_cast<uint16_t>(bits & 0xFFFFu));
  } else {
    const uint32_t r = mix32(static_cast<uint32_t>(i) ^ key);
    st(p + i, isnan(x) ? static_cast<uint16_t>(0x7FC0u)
                       : static_cast<uint16_t>((bits + (r & 0xFFFFu)) >> 16));
  }
}

}  // namespace cuda
}  // namespace mp_wrappers
