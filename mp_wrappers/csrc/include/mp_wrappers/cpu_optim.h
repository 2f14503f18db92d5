// Shared pieces of the CPU fused-optimizer kernels (cpu/multi_tensor_{adam,sgd,lamb,adagrad,
// novograd,lean}.cpp): the host-side reads of the scalar tensors (their checks are the ops' set-up,
// op_args.h), the skip, the unscale, the bias corrections and the dtype dispatch of one chunk.
//
// Semantics are those of mp_wrappers/ops/reference/. The kernels repeat the reference's fp32
// operations in the same order (Python float hyperparameters rounded to fp32 once, as torch does
// for `tensor * python_float`), with no FMA contraction (-ffp-contract=off) and correctly rounded
// divide and sqrt. fp32 results therefore match the reference bit for bit except (a) where torch's
// CPU sqrt is not correctly rounded (measured on torch 2.13 / AVX-512: ~16% of results 1 ulp off),
// so Adam-family params can differ by an ulp, and (b) where the reference reduces in another order
// (LAMB's and NovoGrad's norms: fp32 vector_norm there, double here). All three ISA flavours give
// the same bits (tests/kernels/test_cpu_kernels.py::test_isa_flavours_agree).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace optim {

// ---- host-side scalars ---------------------------------------------------------------------------
//
// The scalar tensors were checked by the op's set-up (op_args.h), which hands over their data
// pointers (nullptr when absent). They live on the CPU with the tensors, so reading them here costs
// no synchronisation.

// lr: the float, or (capturable=True) the value lr_tensor holds.
inline float resolve_lr(const UpdateScalars& s) {
  return s.lr_tensor == nullptr ? s.lr : *s.lr_tensor;
}

// A nonzero found_inf turns the whole call (state, params, model copies and step) into a no-op.
inline bool should_skip(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

// The reference divides the fp32 grad by grad_scale. When the scale is a finite power of two (every
// dynamic loss scale is), multiplying by its exact reciprocal rounds the same real number and is
// therefore bit-identical, and a multiply is several times cheaper than a divide; any other scale
// is divided, as the reference does.
struct Unscale {
  float factor = 1.f;
  bool divide = false;

  static Unscale from(const float* grad_scale) {
    Unscale u;
    if (grad_scale == nullptr) return u;  // g * 1 is exact
    const float s = *grad_scale;
    int exp = 0;
    const float mant = std::frexp(s, &exp);
    const float inv = 1.f / s;
    // Exact for a power of two, normal or subnormal, while it is finite: below 2^-127 the
    // reciprocal overflows to inf (g * inf, where g / s is finite), so those divide.
    if (std::isfinite(s) && mant == 0.5f && std::isfinite(inv)) {
      u.factor = inv;
    } else {
      u.factor = s;
      u.divide = true;
    }
    return u;
  }

  template <class V>
  inline typename V::F apply(typename V::F g, typename V::F f) const {
    return divide ? V::div(g, f) : V::mul(g, f);
  }
};

// 1 - beta**count in float64, rounded to float32 (reference._bias_correction); 1 when disabled.
inline float bias_correction(double beta, float count, bool enabled) {
  if (!enabled) return 1.f;
  return static_cast<float>(1.0 - std::pow(beta, static_cast<double>(count)));
}

// The reference computes `step + 1` in float32.
inline float read_count(const at::Tensor& step) { return *step.data_ptr<float>() + 1.f; }
inline void commit_count(const at::Tensor& step, float count) { *step.data_ptr<float>() = count; }

// ---- dtype dispatch --------------------------------------------------------------------------------

// Stands in for an absent model_params list: stores to it do nothing and compile away.
struct NoOut {};

template <class T>
inline T* at_offset(T* p, int64_t offset) { return p + offset; }
inline NoOut* at_offset(NoOut* p, int64_t) { return p; }

// Store min(n, kWidth) lanes into a typed pointer; no-op for NoOut.
template <class V, class T>
inline void store_out(T* p, typename V::F a, int64_t n) {
  if constexpr (!std::is_same<T, NoOut>::value) store_n<V>(p, a, n);
}

// Calls fn(typed pointer) for the storage dtype of t.
template <class Fn>
inline void with_typed(const RawTensor& t, const Fn& fn) {
  switch (t.dtype) {
    case StorageDtype::kHalf: return fn(static_cast<c10::Half*>(t.data));
    case StorageDtype::kBFloat16: return fn(static_cast<c10::BFloat16*>(t.data));
    default: return fn(static_cast<float*>(t.data));
  }
}

// Same, with NoOut* when the optional tensor is absent (t == nullptr).
template <class Fn>
inline void with_typed_opt(const RawTensor* t, const Fn& fn) {
  if (t == nullptr) return fn(static_cast<NoOut*>(nullptr));
  with_typed(*t, fn);
}

// Raw views of an optional list (empty vector when the list is empty).
inline const RawTensor* raw_at(const std::vector<RawTensor>& list, int64_t i) {
  return list.empty() ? nullptr : &list[static_cast<size_t>(i)];
}

// ---- software prefetch ---------------------------------------------------------------------------

// The update loops stream 4-6 arrays at once (p, g, state, model copy), more than the hardware
// prefetchers track well: an explicit prefetch 512 elements ahead of each stream made the fp32
// Adam step ~10% faster on one thread on the AVX-512 VM (interleaved A/B against torch's fused
// Adam: time ratio 0.99-1.03 without, 0.88-0.89 with; neutral to slightly positive on two
// threads). On the Zen 3 (AVX2), with the loop of Note [whole lines per step], the step ran as
// fast without them (one in-process A/B: 1.01x against 1.04x torch's fused step). A prefetch
// never faults, so running past the end of an array is harmless.
constexpr int64_t kPrefetchAhead = 512;

// The address is formed as an integer: `p + kPrefetchAhead` past the end of an array would be
// undefined behaviour even though the prefetch itself is not.
template <class T>
inline const void* ahead(const T* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchAhead * sizeof(T));
}
template <class T>
inline void prefetch_read(const T* p) { __builtin_prefetch(ahead(p), 0); }
template <class T>
inline void prefetch_write(T* p) {
  if constexpr (!std::is_same<T, NoOut>::value) __builtin_prefetch(ahead(p), 1);
}

// One prefetch per 64 bytes of a stream: every 16 elements of fp32, every 32 of a 2-byte type,
// every 64 of bytes. For loops whose step (in elements) divides 64 / sizeof(T) for every stream
// they prefetch (for_each_vector's 16, the 8-bit kernels' vectors of 8 or 16; an 8-byte type would
// need a step of 8): the loop then meets each multiple, and consecutive 64-byte steps reach
// consecutive lines whatever the array's alignment, so every line is asked for once.
template <class T>
inline void prefetch_line_read(const T* p, int64_t i) {
  if (i % (64 / static_cast<int64_t>(sizeof(T))) == 0) prefetch_read(p + i);
}
template <class T>
inline void prefetch_line_write(T* p, int64_t i) {
  if constexpr (!std::is_same<std::remove_cv_t<T>, NoOut>::value) {
    if (i % (64 / static_cast<int64_t>(sizeof(T))) == 0) prefetch_write(p + i);
  }
}

// ---- the update loop -----------------------------------------------------------------------------

// Note [whole lines per step]
//   The elementwise update loops walk n elements a 64-byte line of fp32 at a time (kStepElems,
//   two AVX2 vectors or one AVX-512 vector): prefetch(i) once per step, then update(j, k) for each
//   vector of the step with k = kWidth, a constant once inlined, so the loads and stores are whole
//   vectors with no test; the last n % kStepElems elements go vector by vector with k = n - j
//   (load_n / store_n pad and trim). The update is the same per vector either way: the bits do
//   not depend on the loop's shape.
//   Before, every vector tested each stream for the end of a line (the lean loops prefetched every
//   stream at every vector instead) and each load and store for a short tail: ~30 scalar
//   micro-ops beside ~20 vector ones per AVX2 vector of fp32 Adam, which kept its divider-bound
//   loop from overlapping consecutive vectors. On the 2-core Zen 3 (AVX2, 2026-12-07) the fp32 Adam
//   op took 0.61-0.94x its old time in cache (0.61-0.79x at 262,144 elements), fp32 FusedAdam's
//   25M-param step went from 1.03-1.18x to 0.98-1.08x torch's fused AdamW at one thread and from
//   0.95-1.13x to 0.93-0.97x at two, and the O2 step from 65-66% to 78-81% of the in-place
//   bandwidth at one thread (benchmarks/RESULTS.md, "The update loops' scalar work").
constexpr int64_t kStepElems = 16;

template <class V, class Prefetch, class Update>
inline void for_each_vector(int64_t n, const Prefetch& prefetch, const Update& update) {
  constexpr int64_t kStep = kStepElems > V::kWidth ? kStepElems : V::kWidth;
  static_assert(kStep % V::kWidth == 0 && kStep % kStepElems == 0, "a step is whole vectors");
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    prefetch(i);
    for (int64_t j = i; j < i + kStep; j += V::kWidth) update(j, static_cast<int64_t>(V::kWidth));
  }
  for (; i < n; i += V::kWidth) update(i, n - i);
}

}  // namespace optim
}  // namespace cpu
}  // namespace mp_wrappers
