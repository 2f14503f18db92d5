// The param side of the CPU 8-bit updates (cpu/multi_tensor_adam8bit.cpp and
// cpu/multi_tensor_sgd8bit.cpp): how a block's params are read as fp32 and how the step from the
// update's direction is written back, for fp32-master params (fp32 or half, with an optional half
// model copy) and for lean bf16 params (cpu_lean_param.h), plus the prefetch of their streams.
// One definition for both optimizers, so that each composes its master step exactly as its
// reference does (reference/quant.py: `fma(-lr, q, p)` on a master, `p32 - lr * q` on a lean
// storage).
#pragma once

#include <cstdint>
#include <type_traits>

#include "mp_wrappers/cpu_lean_param.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {

// The param's update from a direction q (Adam's m / den, SGD's d), as vectors. `decoupled`:
// AdamW's decay, applied to the param beside the direction (SGD's decay is in d: false).
template <class V>
struct ParamStep {
  typename V::F lr, neg_lr, weight_decay, neg_lr_wd;
  bool decoupled;
  ParamStep(float lr_, float weight_decay_, bool decoupled_)
      : lr(V::set1(lr_)), neg_lr(V::set1(-lr_)), weight_decay(V::set1(weight_decay_)),
        neg_lr_wd(V::set1(-(lr_ * weight_decay_))), decoupled(decoupled_) {}
};

// In whole blocks, a prefetch at every 64 bytes of a stream, kPrefetchAhead elements ahead
// (cpu_optim.h), without prefetch_*_line's test at every vector: the element offsets are fixed
// (whatever the alignment, consecutive 64-byte steps reach consecutive lines).
template <class T>
inline void prefetch_every_line(T* p, int64_t i, int write) {
  if constexpr (!std::is_same<std::remove_cv_t<T>, optim::NoOut>::value) {
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
    if (i % kLine == 0) {
      if (write) __builtin_prefetch(optim::ahead(p + i), 1);
      else __builtin_prefetch(optim::ahead(p + i), 0);
    }
  }
}

// The param of the fp32-master update: fp32 (or half) params and the optional half model copy.
template <class V, class P, class O>
struct MasterParam {
  using F = typename V::F;
  P* p;
  O* out;
  inline MasterParam at(int64_t i) const { return {p + i, optim::at_offset(out, i)}; }
  inline F load(int64_t i, int64_t k) const { return load_n<V>(p + i, k); }
  // p = fma(-lr, q, fma(-fl(lr * weight_decay), p, p)): AdamW's decay applied to the param
  inline void store_update(int64_t i, int64_t k, F p32, F q, const ParamStep<V>& s) const {
    const F p_new = V::fmadd(s.neg_lr, q, s.decoupled ? V::fmadd(s.neg_lr_wd, p32, p32) : p32);
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
  }
  inline void prefetch_lines(int64_t i) const {
    optim::prefetch_write_line<V>(p, i);
    optim::prefetch_write_line<V>(out, i);
  }
  inline void prefetch_every_line(int64_t i) const {
    cpu::prefetch_every_line(p, i, 1);
    cpu::prefetch_every_line(out, i, 1);
  }
};

// A lean bf16 param (cpu_lean_param.h): the master step composed as the lean kernels compose it.
template <class V, LeanStorage S>
struct LeanMasterParam {
  using F = typename V::F;
  LeanParam<V, S> lp;
  inline LeanMasterParam at(int64_t i) const { return {lp.at(i)}; }
  inline F load(int64_t i, int64_t k) const { return lp.load(i, k); }
  // The lean step is lr * update, the decay in the update: fma(weight_decay, p, q).
  inline void store_update(int64_t i, int64_t k, F p32, F q, const ParamStep<V>& s) const {
    lp.store(i, k, p32, V::mul(s.lr, s.decoupled ? V::fmadd(s.weight_decay, p32, q) : q));
  }
  inline void prefetch_lines(int64_t i) const {
    optim::prefetch_write_line<V>(lp.p, i);
    if constexpr (S != LeanStorage::kStochastic) optim::prefetch_write_line<V>(lp.lo(), i);
  }
  inline void prefetch_every_line(int64_t i) const {
    cpu::prefetch_every_line(lp.p, i, 1);
    if constexpr (S != LeanStorage::kStochastic) cpu::prefetch_every_line(lp.lo(), i, 1);
  }
};

}  // namespace cpu
}  // namespace mp_wrappers
