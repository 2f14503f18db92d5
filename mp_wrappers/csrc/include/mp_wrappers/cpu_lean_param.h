// The lean bf16 param of the CPU kernels that step bf16 params without a separate fp32 master
// (cpu/multi_tensor_lean.cpp, and the 8-bit Adam kernel's lean entry point in
// cpu/multi_tensor_adam8bit.cpp): how a span of bf16 params and its aux state are read as fp32 and
// written back, the storage way (Note [lean bf16 storage] in mp_wrappers/ops/reference/lean.py).
// Shared so that every update composes the master step exactly as the lean reference does.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "mp_wrappers/cpu_lean.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {

// The bf16 params, their aux state and the element offset of a span, with the two storage steps
// every update shares: read the fp32 value, and write `p32 - step` back.
template <class V, LeanStorage S>
struct LeanParam {
  using F = typename V::F;
  static constexpr LeanStorage kStorage = S;
  c10::BFloat16* p;
  void* aux;           // uint16 low halves ('split'), bf16 compensation ('kahan'), unused otherwise
  uint32_t index;      // element index of p[0] in its tensor (the stochastic hash input)
  uint32_t key;        // per-tensor key of the stochastic hash

  inline uint16_t* lo() const { return static_cast<uint16_t*>(aux); }
  inline c10::BFloat16* comp() const { return static_cast<c10::BFloat16*>(aux); }

  // The span `i` elements further on (both aux dtypes are 2 bytes wide).
  inline LeanParam at(int64_t i) const {
    return {p + i, S == LeanStorage::kStochastic ? nullptr : static_cast<void*>(lo() + i),
            index + static_cast<uint32_t>(i), key};
  }

  inline F load(int64_t i, int64_t k) const {
    if constexpr (S == LeanStorage::kSplit) return lean::join_n<V>(p + i, lo() + i, k);
    return load_n<V>(p + i, k);
  }

  // Stores p32 - step (step = lr * direction). Subtraction, not addition of a negated step, keeps
  // the signed zeros of the fp32-master kernels.
  inline void store(int64_t i, int64_t k, F p32, F step) const {
    if constexpr (S == LeanStorage::kKahan) {
      const F c = V::sub(load_n<V>(comp() + i, k), step);
      const F rounded = lean::Bits<V>::round_nearest(V::add(p32, c));  // the stored bf16, in fp32
      lean::store_hi_n<V>(p + i, rounded, k);
      store_n<V>(comp() + i, V::sub(c, V::sub(rounded, p32)), k);
    } else if constexpr (S == LeanStorage::kSplit) {
      lean::store_split_n<V>(p + i, lo() + i, V::sub(p32, step), k);
    } else {
      const auto rnd = lean::Bits<V>::random(index + static_cast<uint32_t>(i), key);
      lean::store_stochastic_n<V>(p + i, V::sub(p32, step), rnd, k);
    }
  }

  inline void prefetch(int64_t i) const {
    optim::prefetch_write(p + i);
    if constexpr (S == LeanStorage::kSplit) optim::prefetch_write(lo() + i);
    if constexpr (S == LeanStorage::kKahan) optim::prefetch_write(comp() + i);
  }
};

// The per-chunk arguments of a lean update.
struct LeanChunkArgs {
  LeanStorage storage;
  const RawTensor* p;
  const RawTensor* aux;  // nullptr for 'stochastic'
  const RawTensor* g;
  uint32_t key;
};

// The chunk's span of a lean param stored the S way.
template <class V, LeanStorage S>
inline LeanParam<V, S> lean_param(const LeanChunkArgs& a, const TensorChunk& ch) {
  auto* p = static_cast<c10::BFloat16*>(a.p->data) + ch.begin;
  void* aux = S == LeanStorage::kStochastic
                  ? nullptr
                  : static_cast<void*>(static_cast<uint16_t*>(a.aux->data) + ch.begin);
  return {p, aux, static_cast<uint32_t>(ch.begin), a.key};
}

// Calls fn(std::integral_constant<LeanStorage, S>) with the storage mode as a compile-time value.
template <class Fn>
inline void with_lean_storage(LeanStorage storage, const Fn& fn) {
  using S = LeanStorage;
  switch (storage) {
    case S::kSplit: return fn(std::integral_constant<S, S::kSplit>{});
    case S::kKahan: return fn(std::integral_constant<S, S::kKahan>{});
    default: return fn(std::integral_constant<S, S::kStochastic>{});
  }
}

// Calls fn(LeanParam<V, S>) for the chunk's span, its storage mode resolved at compile time.
template <class V, class Fn>
inline void with_lean_param(const LeanChunkArgs& a, const TensorChunk& ch, const Fn& fn) {
  with_lean_storage(a.storage, [&](auto s) { fn(lean_param<V, decltype(s)::value>(a, ch)); });
}

// The stochastic hash's key of each tensor of a call (zeros for the other storages).
inline std::vector<uint32_t> tensor_keys(LeanStorage storage, int64_t seed, float count, size_t n) {
  std::vector<uint32_t> keys(n, 0u);
  if (storage == LeanStorage::kStochastic)
    for (size_t t = 0; t < n; ++t) keys[t] = lean::tensor_key(seed, count, static_cast<int64_t>(t));
  return keys;
}

}  // namespace cpu
}  // namespace mp_wrappers
