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

// ---- the fp32 Adam update of one vector ---------------------------------------------------------
//
// One definition for the fp32-master kernel (cpu/multi_tensor_adam.cpp) and the lean one
// (cpu/multi_tensor_lean.cpp): reference/optimizers.py::multi_tensor_adam_'s operations in its
// order, so that the lean 'split' masters stay bit-identical to the fused O2 step's fp32 masters.

// This step's constants: the hyperparameters, lr, the two bias corrections and the grad unscale.
struct AdamConsts : AdamHyper {
  float lr, bc1, bc2;
  Unscale unscale;
};

// The constants as vectors, made once per span by the loop's own function (a local whose address
// never escapes, so no store of the loop can alias it).
template <class V>
struct AdamVec {
  using F = typename V::F;
  F lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2, us;
  Unscale unscale;
  bool l2, decoupled;

  explicit AdamVec(const AdamConsts& c)
      : lr(V::set1(c.lr)), b1(V::set1(c.beta1)), b2(V::set1(c.beta2)),
        omb1(V::set1(c.one_minus_beta1)), omb2(V::set1(c.one_minus_beta2)), eps(V::set1(c.eps)),
        wd(V::set1(c.weight_decay)), bc1(V::set1(c.bc1)), bc2(V::set1(c.bc2)),
        us(V::set1(c.unscale.factor)), unscale(c.unscale), l2(c.l2), decoupled(c.decoupled) {}

  // The new moments of (param p32, raw grad g, moments m and v), and the step lr * update that
  // the param loses (the callers subtract it: p32 - step keeps the reference's signed zeros).
  inline F step(F p32, F g, F m, F v, F* m_new, F* v_new) const {
    F g32 = unscale.template apply<V>(g, us);
    if (l2) g32 = V::add(g32, V::mul(wd, p32));
    *m_new = V::add(V::mul(b1, m), V::mul(omb1, g32));
    *v_new = V::add(V::mul(b2, v), V::mul(V::mul(omb2, g32), g32));
    F update = V::div(V::div(*m_new, bc1), V::add(V::sqrt(V::div(*v_new, bc2)), eps));
    if (decoupled) update = V::add(update, V::mul(wd, p32));
    return V::mul(lr, update);
  }
};

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
// Adam step ~10% faster on one thread here (interleaved A/B against torch's fused Adam: time ratio
// 0.99-1.03 without, 0.88-0.89 with; neutral to slightly positive on two threads). A prefetch
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

// Once per cache line, not once per vector, for the loops that test each vector for its tail (SGD,
// NovoGrad, LAMB, the 8-bit SGD block; the others prefetch by the counter, Note [whole vectors]). An
// 8-lane AVX2 vector covers half a 64-byte line of fp32 and a quarter of a line of fp16/bf16, so
// prefetching at every vector (as the 16-lane AVX-512 loop naturally does once per fp32 line) asked
// for each line 2-4 times: 5-10 extra load-port micro-ops per 8 elements on the AVX2 path. These
// issue the prefetch only for the vector that reaches the end of a line, whatever the array's
// alignment (for a 64-byte vector: every time). `i` is the element index of the vector's first
// element.
template <class V, class T>
inline bool ends_line(const T* p, int64_t i) {
  constexpr uintptr_t kBytes = static_cast<uintptr_t>(V::kWidth) * sizeof(T);
  return (reinterpret_cast<uintptr_t>(p + i) & 63u) + kBytes >= 64u;
}
template <class V, class T>
inline void prefetch_read_line(const T* p, int64_t i) {
  if (ends_line<V>(p, i)) __builtin_prefetch(ahead(p + i), 0);
}
template <class V, class T>
inline void prefetch_write_line(T* p, int64_t i) {
  if constexpr (!std::is_same<T, NoOut>::value) {
    if (ends_line<V>(p, i)) __builtin_prefetch(ahead(p + i), 1);
  }
}

// ---- whole vectors, then the tail ---------------------------------------------------------------
//
// Note [whole vectors]
// An update loop that tests at every vector whether it reached the short tail of its span
// (`load_n`/`store_n` with k = n - i) and whether each stream crossed a cache line (`ends_line`)
// spends ~30 scalar instructions, 7 of them branches, beside ~20 vector ones per AVX2 vector of the
// fp32 Adam step (perf annotate, Zen 3). run_span splits a span instead: the whole vectors run with
// the lane count a compile-time constant, so every load and store is a plain vector one, and their
// prefetches are issued every 16 elements (prefetch_due: a 64-byte line of fp32, half a line of a
// 16-bit dtype; every vector of AVX-512), a test of the loop counter alone; the fewer than kWidth
// elements left run through OutOfLine (cpu_vec.h), one copy of the body that need not be fast. The
// arithmetic per element is unchanged, so the bits are those of the single loop. Measured on a
// Zen 3 (AVX2), one thread, 25M params: fp32 FusedAdam 1.16-1.25x -> 0.95-1.10x torch's fused
// AdamW, the O2 bf16 step 61-67% -> 77-78% of the in-place bandwidth (benchmarks/RESULTS.md, "The
// update loops' scalar work"). The Adam, Adagrad and lean loops use it; SGD, NovoGrad, LAMB and the
// 8-bit SGD block keep their per-vector tests, which cost them nothing measurable (no division per
// element, two passes, or bound by vector throughput).
//
// A span is a struct with
//   template <class V, bool kWhole, class... A> static void run(int64_t i, int64_t end, A... args);
// (its arguments by value or const&) that steps i by V::kWidth up to `end`, with
// lanes<V, kWhole>(end - i) lanes per vector; the tail issues no prefetches.

// The lanes a vector of the span holds: all of them in the whole part, the rest in the tail.
template <class V, bool kWhole>
inline int64_t lanes(int64_t left) {
  return kWhole ? int64_t{V::kWidth} : left;
}

// Whether the whole-vector loop at element i issues its prefetches.
inline bool prefetch_due(int64_t i) { return (i & 15) == 0; }

template <class Span, bool kWhole>
struct SpanPart {
  template <class V, class... Args>
  static void run(Args... args) {
    Span::template run<V, kWhole>(args...);
  }
};

// Span::run over elements [0, n): the whole vectors inline, the tail out of line. The arguments are
// taken by value on purpose: a span's const& then binds to this function's own copy, which nothing
// outside can reach, rather than to an object whose address the tail call lets escape.
template <class Span, class V, class... Args>
inline void run_span(int64_t n, Args... args) {
  const int64_t whole = n - n % V::kWidth;
  Span::template run<V, true>(int64_t{0}, whole, args...);
  if (whole < n) OutOfLine<V>::template run<SpanPart<Span, false>>(whole, n, args...);
}

}  // namespace optim
}  // namespace cpu
}  // namespace mp_wrappers
