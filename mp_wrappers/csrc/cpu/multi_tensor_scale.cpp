// CPU kernels of multi_tensor_scale_ (out = in * scale) and multi_tensor_axpby_ (out = a*x + b*y),
// both with the non-finite check on their inputs. Semantics: mp_wrappers/ops/reference/multi_tensor.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

// Calls fn(typed pointer) for the storage dtype of a raw tensor.
template <class Fn>
inline void with_typed(const RawTensor& t, const Fn& fn) {
  switch (t.dtype) {
    case StorageDtype::kHalf: return fn(static_cast<c10::Half*>(t.data));
    case StorageDtype::kBFloat16: return fn(static_cast<c10::BFloat16*>(t.data));
    default: return fn(static_cast<float*>(t.data));
  }
}

// out[i] = in[i] * scale for n elements; returns whether any *input* was inf or nan. The input,
// not the product, is checked: a finite gradient times a huge scale is not an overflow, and
// inf * 0 must still be reported.
template <class V, class Tin, class Tout>
inline bool scale_span(const Tin* in, Tout* out, int64_t n, float scale) {
  using F = typename V::F;
  const F s = V::set1(scale);
  // Four independent probes: one add chain would cap the loop at one vector per add latency,
  // below the memory bandwidth of a single core.
  F p0 = V::zero(), p1 = V::zero(), p2 = V::zero(), p3 = V::zero();
  int64_t i = 0;
  for (; i + 4 * V::kWidth <= n; i += 4 * V::kWidth) {
    const F x0 = V::load(in + i), x1 = V::load(in + i + V::kWidth);
    const F x2 = V::load(in + i + 2 * V::kWidth), x3 = V::load(in + i + 3 * V::kWidth);
    p0 = V::nonfinite_probe(p0, x0);
    p1 = V::nonfinite_probe(p1, x1);
    p2 = V::nonfinite_probe(p2, x2);
    p3 = V::nonfinite_probe(p3, x3);
    V::store(out + i, V::mul(x0, s));
    V::store(out + i + V::kWidth, V::mul(x1, s));
    V::store(out + i + 2 * V::kWidth, V::mul(x2, s));
    V::store(out + i + 3 * V::kWidth, V::mul(x3, s));
  }
  F probe = V::add(V::add(p0, p1), V::add(p2, p3));  // NaN survives the adds
  for (; i + V::kWidth <= n; i += V::kWidth) {
    const typename V::F x = V::load(in + i);
    probe = V::nonfinite_probe(probe, x);
    V::store(out + i, V::mul(x, s));
  }
  if (i < n) {
    const typename V::F x = load_partial<V>(in + i, n - i);
    probe = V::nonfinite_probe(probe, x);
    store_partial<V>(out + i, V::mul(x, s), n - i);
  }
  return V::any_nonfinite(probe);
}

struct ScaleChunk {
  template <class V>
  static void run(const RawTensor& in, const RawTensor& out, const TensorChunk& c, float scale,
                  bool* bad) {
    with_typed(in, [&](auto* src) {
      with_typed(out, [&](auto* dst) {
        *bad = scale_span<V>(src + c.begin, dst + c.begin, c.end - c.begin, scale);
      });
    });
  }
};

// out = a*x + b*y as torch computes `a * x.float() + b * y.float()`: two products and a sum, each
// rounded to fp32 (no FMA, so the result matches the reference bit for bit).
template <class V, class Tx, class Ty, class To>
inline bool axpby_span(const Tx* x, const Ty* y, To* out, int64_t n, float a, float b,
                       bool check_x, bool check_y) {
  const typename V::F va = V::set1(a), vb = V::set1(b);
  typename V::F probe = V::zero();
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t m = n - i;
    const typename V::F xv = load_n<V>(x + i, m);
    const typename V::F yv = load_n<V>(y + i, m);
    if (check_x) probe = V::nonfinite_probe(probe, xv);
    if (check_y) probe = V::nonfinite_probe(probe, yv);
    store_n<V>(out + i, V::add(V::mul(va, xv), V::mul(vb, yv)), m);
  }
  return V::any_nonfinite(probe);
}

struct AxpbyChunk {
  template <class V>
  static void run(const RawTensor& x, const RawTensor& y, const RawTensor& out,
                  const TensorChunk& c, float a, float b, bool check_x, bool check_y, bool* bad) {
    with_typed(x, [&](auto* xp) {
      with_typed(y, [&](auto* yp) {
        with_typed(out, [&](auto* op) {
          *bad = axpby_span<V>(xp + c.begin, yp + c.begin, op + c.begin, c.end - c.begin, a, b,
                               check_x, check_y);
        });
      });
    });
  }
};

void multi_tensor_scale_cpu(at::TensorList inputs, at::TensorList outputs, const at::Tensor& scale,
                            const at::Tensor& found_inf) {
  multi_tensor_scale_args(inputs, outputs, scale, found_inf);
  const float s = *scale.data_ptr<float>();
  const std::vector<RawTensor> in = raw_tensors(inputs), out = raw_tensors(outputs);
  const ChunkPlan plan(inputs);
  std::vector<uint8_t> bad(plan.size(), 0);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t i, const TensorChunk& c) {
    bool b = false;
    run_cpu_kernel<ScaleChunk>(isa, in[c.tensor], out[c.tensor], c, s, &b);
    bad[i] = b;
  });
  set_found_inf_cpu(found_inf, std::any_of(bad.begin(), bad.end(), [](uint8_t v) { return v; }));
}

void multi_tensor_axpby_cpu(at::TensorList x, at::TensorList y, at::TensorList out, double a,
                            double b, int64_t arg_to_check, const at::Tensor& found_inf) {
  const AxpbyArgs args = multi_tensor_axpby_args(x, y, out, a, b, arg_to_check, found_inf);
  const std::vector<RawTensor> xs = raw_tensors(x), ys = raw_tensors(y), os = raw_tensors(out);
  const ChunkPlan plan(x);
  std::vector<uint8_t> bad(plan.size(), 0);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t i, const TensorChunk& c) {
    bool bd = false;
    run_cpu_kernel<AxpbyChunk>(isa, xs[c.tensor], ys[c.tensor], os[c.tensor], c, args.a, args.b,
                               args.check_x, args.check_y, &bd);
    bad[i] = bd;
  });
  set_found_inf_cpu(found_inf, std::any_of(bad.begin(), bad.end(), [](uint8_t v) { return v; }));
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_scale_", &mp_wrappers::cpu::multi_tensor_scale_cpu);
  m.impl("multi_tensor_axpby_", &mp_wrappers::cpu::multi_tensor_axpby_cpu);
}
