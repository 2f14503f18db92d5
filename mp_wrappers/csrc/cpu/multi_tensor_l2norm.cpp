// CPU kernels of multi_tensor_l2norm and multi_tensor_unscale_l2norm: the global and per-tensor L2
// norms in one read-only pass (the unscale variant multiplies by inv_scale in fp32 first, as the
// reference does, and checks the raw values for inf/nan). Semantics: mp_wrappers/ops/reference/multi_tensor.py.
//
// Accuracy and determinism: squares are accumulated in double with SumSq32 (flavour-independent
// lane layout), one partial per fixed 64K-element chunk, and partials are summed in chunk order, so
// the result does not depend on the ISA or on the number of threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

// How the unscale variant finds non-finite values.
enum class Check {
  kNone,   // multi_tensor_l2norm: no unscale, no flag
  kProbe,  // unscale, and a probe on the raw values (any inv_scale)
  // Unscale with a finite |inv_scale| <= 1 (every loss scale >= 1): no probe, the chunk's own sum
  // of squares tells. A finite x gives a finite x * s in fp32, whose square in double is at most
  // ~1.2e77, and 64K of them sum far below double's max; an inf or nan gives inf or nan (inf * 0
  // is nan), which stays in the sum. So the sum is non-finite exactly when an input is. The
  // probe's two adds per vector were ~20% of this pass's arithmetic, and on two threads the pass
  // is compute-bound (the double conversions), not memory-bound.
  kSum,
};

// Software prefetch distance of the read-only pass, in bytes. With none, one core read the half
// grads of the O2 step at ~6 GB/s from DRAM (the hardware prefetcher alone does not keep enough
// lines in flight for a single stream while the core converts to double); 4 KB ahead took it to
// 8-10 GB/s on one thread and the check pass from 4.4 to 2.9 ms on two (25M bf16, 2026-11-23, Intel
// VM, benchmarks/RESULTS.md). 2 KB was ~5% slower, 8 KB the same as 4 KB. A prefetch never faults
// past the end.
constexpr uintptr_t kPrefetchBytes = 4096;

// Sum of squares of (p[i] * inv_scale, rounded to fp32) for n elements.
template <class V, Check kCheck, class T>
inline double sumsq_span(const T* p, int64_t n, float inv_scale, bool* bad) {
  constexpr bool kUnscale = kCheck != Check::kNone;
  constexpr bool kProbe = kCheck == Check::kProbe;
  using F = typename V::F;
  using Acc = SumSq32<V>;
  constexpr int64_t kBlockBytes = Acc::kLanes * static_cast<int64_t>(sizeof(T));
  Acc acc;
  // One probe per vector of a block, so the probes are independent add chains.
  F probe[Acc::kVecs];
  for (int k = 0; k < Acc::kVecs; ++k) probe[k] = V::zero();
  const F s = V::set1(inv_scale);
  F block[Acc::kVecs];
  auto prepare = [&](F x, int k) {
    if (kProbe) probe[k] = V::nonfinite_probe(probe[k], x);
    if (kUnscale) x = V::mul(x, s);
    return x;
  };
  int64_t i = 0;
  for (; i + Acc::kLanes <= n; i += Acc::kLanes) {
    // One prefetch per 64-byte line of the block (1 for half, 2 for fp32); formed as an integer,
    // since a pointer past the end of the array would be undefined behaviour.
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(p + i) + kPrefetchBytes;
    for (int64_t b = 0; b < kBlockBytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + static_cast<uintptr_t>(b)), 0);
    for (int k = 0; k < Acc::kVecs; ++k) block[k] = prepare(V::load(p + i + k * V::kWidth), k);
    acc.add_block(block);
  }
  if (i < n) {
    // Zero-padded tail: 0 * inv_scale squared adds exactly nothing, on every flavour.
    for (int k = 0; k < Acc::kVecs; ++k) {
      const int64_t m = n - i - k * V::kWidth;
      block[k] = m > 0 ? prepare(load_n<V>(p + i + k * V::kWidth, m), k) : V::zero();
    }
    acc.add_block(block);
  }
  const double total = acc.total();
  if (kProbe) {
    bool any = false;
    for (int k = 0; k < Acc::kVecs; ++k) any |= V::any_nonfinite(probe[k]);
    *bad = any;
  } else if (kCheck == Check::kSum) {
    *bad = !std::isfinite(total);
  }
  return total;
}

template <Check kCheck>
struct SumSqChunk {
  template <class V>
  static void run(const RawTensor& t, const TensorChunk& c, float inv_scale, double* sumsq,
                  bool* bad) {
    const int64_t n = c.end - c.begin;
    switch (t.dtype) {
      case StorageDtype::kHalf:
        *sumsq = sumsq_span<V, kCheck>(static_cast<const c10::Half*>(t.data) + c.begin, n,
                                       inv_scale, bad);
        break;
      case StorageDtype::kBFloat16:
        *sumsq = sumsq_span<V, kCheck>(static_cast<const c10::BFloat16*>(t.data) + c.begin, n,
                                       inv_scale, bad);
        break;
      default:
        *sumsq = sumsq_span<V, kCheck>(static_cast<const float*>(t.data) + c.begin, n,
                                       inv_scale, bad);
    }
  }
};

template <Check kCheck>
std::tuple<at::Tensor, at::Tensor> l2norm_impl(at::TensorList tensors, float inv_scale,
                                               bool per_tensor, bool* any_bad) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  const std::vector<RawTensor> raw = raw_tensors(tensors);
  const ChunkPlan plan(tensors);
  std::vector<double> partial(plan.size(), 0.0);
  std::vector<uint8_t> bad(plan.size(), 0);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t i, const TensorChunk& c) {
    bool b = false;
    run_cpu_kernel<SumSqChunk<kCheck>>(isa, raw[c.tensor], c, inv_scale, &partial[i], &b);
    bad[i] = b;
  });

  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  at::Tensor total = at::empty({}, options);
  at::Tensor norms = at::empty({per_tensor ? n : 0}, options);
  std::vector<double> per(n, 0.0);
  for (size_t i = 0; i < plan.size(); ++i) per[plan[i].tensor] += partial[i];  // chunk order
  double sum = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    sum += per[t];
    if (per_tensor) norms.data_ptr<float>()[t] = static_cast<float>(std::sqrt(per[t]));
  }
  *total.data_ptr<float>() = static_cast<float>(std::sqrt(sum));
  *any_bad = false;
  for (uint8_t b : bad) *any_bad |= (b != 0);
  return {total, norms};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(at::TensorList tensors,
                                                           bool per_tensor) {
  multi_tensor_l2norm_args(tensors);
  bool unused = false;
  return l2norm_impl<Check::kNone>(tensors, 1.f, per_tensor, &unused);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cpu(at::TensorList tensors,
                                                                   const at::Tensor& inv_scale,
                                                                   const at::Tensor& found_inf,
                                                                   bool per_tensor) {
  multi_tensor_unscale_l2norm_args(tensors, inv_scale, found_inf);
  bool bad = false;
  const float s = *inv_scale.data_ptr<float>();
  auto result = (std::isfinite(s) && std::fabs(s) <= 1.f)
                    ? l2norm_impl<Check::kSum>(tensors, s, per_tensor, &bad)
                    : l2norm_impl<Check::kProbe>(tensors, s, per_tensor, &bad);
  set_found_inf_cpu(found_inf, bad);
  return result;
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_l2norm", &mp_wrappers::cpu::multi_tensor_l2norm_cpu);
  m.impl("multi_tensor_unscale_l2norm", &mp_wrappers::cpu::multi_tensor_unscale_l2norm_cpu);
}
