// CPU kernel of multi_tensor_adam_ (Adam / AdamW, apex FusedAdam math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_adam_).
//
// One pass per 64K-element chunk: load grad (fp32/fp16/bf16) and param, unscale, update the fp32
// moments in registers, store param, moments and, for the fused mixed-precision step, the rounded
// model copy. 28 bytes per fp32 parameter, 30 for the O2 step with half grads and a half model.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <optional>
#include <vector>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

using optim::AdamConsts;

// The update of elements [i, end) (Note [whole vectors] in cpu_optim.h).
struct AdamSpan {
  template <class V, bool kWhole, class P, class G, class M>
  static void run(int64_t i, int64_t end, P* p, const G* g, float* m, float* v, M* out,
                  const AdamConsts& c) {
    using F = typename V::F;
    const optim::AdamVec<V> a(c);
    for (; i < end; i += V::kWidth) {
      const int64_t k = optim::lanes<V, kWhole>(end - i);
      if (kWhole && optim::prefetch_due(i)) {
        optim::prefetch_write(p + i);
        optim::prefetch_read(g + i);
        optim::prefetch_write(m + i);
        optim::prefetch_write(v + i);
        optim::prefetch_write(optim::at_offset(out, i));
      }
      const F p32 = load_n<V>(p + i, k);
      F m_new, v_new;
      const F step = a.step(p32, load_n<V>(g + i, k), load_n<V>(m + i, k), load_n<V>(v + i, k),
                            &m_new, &v_new);
      const F p_new = V::sub(p32, step);
      store_n<V>(m + i, m_new, k);
      store_n<V>(v + i, v_new, k);
      store_n<V>(p + i, p_new, k);
      optim::store_out<V>(optim::at_offset(out, i), p_new, k);
    }
  }
};

struct AdamChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor& m, const RawTensor& v,
                  const RawTensor* out, const TensorChunk& ch, const AdamConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        optim::with_typed_opt(out, [&](auto* op) {
          optim::run_span<AdamSpan, V>(n, pp + b, gp + b, static_cast<float*>(m.data) + b,
                                       static_cast<float*>(v.data) + b, optim::at_offset(op, b),
                                       c);
        });
      });
    });
  }
};

void multi_tensor_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList model_params,
                           const at::Tensor& step, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool adam_w_mode,
                           bool bias_correction, const c10::optional<at::Tensor>& grad_scale,
                           const c10::optional<at::Tensor>& found_inf,
                           const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdamHyper> args = multi_tensor_adam_args(
      Backend::kCpu, params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2,
      eps, weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, lr_tensor);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const float count = optim::read_count(step);
  const AdamHyper& h = args.hyper;
  const AdamConsts c{h, optim::resolve_lr(args.scalars),
                     optim::bias_correction(h.beta1_d, count, h.use_bias_correction),
                     optim::bias_correction(h.beta2_d, count, h.use_bias_correction),
                     optim::Unscale::from(args.scalars.grad_scale)};

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               ms = raw_tensors(exp_avgs), vs = raw_tensors(exp_avg_sqs),
                               os = raw_tensors(model_params);
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<AdamChunk>(isa, ps[t], gs[t], ms[t], vs[t], optim::raw_at(os, t), ch, c);
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_adam_", &mp_wrappers::cpu::multi_tensor_adam_cpu);
}
