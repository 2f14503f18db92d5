// CPU kernels of multi_tensor_l2norm and multi_tensor_unscale_l2norm: the global and per-tensor L2
// norms in one read-only pass (the unscale variant multiplies by inv_scale in fp32 first, as the
// reference does, and checks the raw values for inf/nan). Semantics: mp_wrappers/ops/reference.py.
//
// Accuracy and determinism: squares are accumulated in double with SumSq32 (flavour-independent
// lane layout), one partial per fixed 64K-element chunk, and partials are summed in chunk order, so
// the result does not depend on the ISA or on the number of threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_vec.h"

namespace mp_wrappers {
namespace cpu {
namespace {

// Sum of squares of (p[i] * inv_scale, rounded to fp32) for n elements. With kUnscale false the
// values are used as they are and no non-finite check is made (multi_tensor_l2norm has no flag).
template <class V, bool kUnscale, class T>
inline double sumsq_span(const T* p, int64_t n, float inv_scale, bool* bad) {
  using F = typename V::F;
  using Acc = SumSq32<V>;
  Acc acc;
  F probe = V::zero();
  const F s = V::set1(inv_scale);
  F block[Acc::kVecs];
  auto prepare = [&](F x) {
    if (kUnscale) {
      probe = V::nonfinite_probe(probe, x);
      x = V::mul(x, s);
    }
    return x;
  };
  int64_t i = 0;
  for (; i + Acc::kLanes <= n; i += Acc::kLanes) {
    for (int k = 0; k < Acc::kVecs; ++k) block[k] = prepare(V::load(p + i + k * V::kWidth));
    acc.add_block(block);
  }
  if (i < n) {
    // Zero-padded tail: 0 * inv_scale squared adds exactly nothing, on every flavour.
    for (int k = 0; k < Acc::kVecs; ++k) {
      const int64_t m = n - i - k * V::kWidth;
      block[k] = m > 0 ? prepare(load_n<V>(p + i + k * V::kWidth, m)) : V::zero();
    }
    acc.add_block(block);
  }
  if (kUnscale) *bad = V::any_nonfinite(probe);
  return acc.total();
}

template <bool kUnscale>
struct SumSqChunk {
  template <class V>
  static void run(const RawTensor& t, const TensorChunk& c, float inv_scale, double* sumsq,
                  bool* bad) {
    const int64_t n = c.end - c.begin;
    switch (t.dtype) {
      case StorageDtype::kHalf:
        *sumsq = sumsq_span<V, kUnscale>(static_cast<const c10::Half*>(t.data) + c.begin, n,
                                         inv_scale, bad);
        break;
      case StorageDtype::kBFloat16:
        *sumsq = sumsq_span<V, kUnscale>(static_cast<const c10::BFloat16*>(t.data) + c.begin, n,
                                         inv_scale, bad);
        break;
      default:
        *sumsq = sumsq_span<V, kUnscale>(static_cast<const float*>(t.data) + c.begin, n,
                                         inv_scale, bad);
    }
  }
};

template <bool kUnscale>
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
    run_cpu_kernel<SumSqChunk<kUnscale>>(isa, raw[c.tensor], c, inv_scale, &partial[i], &b);
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
  check_tensor_lists("multi_tensor_l2norm", {{"tensors", tensors}});
  bool unused = false;
  return l2norm_impl<false>(tensors, 1.f, per_tensor, &unused);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cpu(at::TensorList tensors,
                                                                   const at::Tensor& inv_scale,
                                                                   const at::Tensor& found_inf,
                                                                   bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  const at::Device device = check_tensor_lists(op, {{"tensors", tensors}});
  check_scalar_tensor(op, "inv_scale", inv_scale, device);
  check_found_inf(op, found_inf, device);
  bool bad = false;
  auto result = l2norm_impl<true>(tensors, *inv_scale.data_ptr<float>(), per_tensor, &bad);
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
