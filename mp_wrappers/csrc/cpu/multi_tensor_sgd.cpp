// CPU kernel of multi_tensor_sgd_ (torch.optim.SGD math plus apex's wd_after_momentum; semantics
// and op order: mp_wrappers/ops/reference/optimizers.py::multi_tensor_sgd_).
//
// One pass per chunk: load grad and param, unscale, decay, momentum in registers, store param,
// buffer and the rounded model copy. The first applied update (step == 0, read on the host with
// found_inf) initialises the buffer to the direction, as torch does.
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

struct SgdConsts : SgdHyper {
  float lr;
  bool first;  // the first applied update (step == 0): buf := direction
  optim::Unscale unscale;
};

template <class V, class P, class G, class M>
inline void sgd_span(P* p, const G* g, float* buf, M* out, int64_t n, const SgdConsts& c) {
  using F = typename V::F;
  const F lr = V::set1(c.lr), mom = V::set1(c.momentum), omd = V::set1(c.one_minus_dampening);
  const F wd = V::set1(c.weight_decay), us = V::set1(c.unscale.factor);
  const bool wd_before = c.wd_before, wd_after = c.wd_after;
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;
    optim::prefetch_write_line<V>(p, i);
    optim::prefetch_read_line<V>(g, i);
    if (c.has_momentum) optim::prefetch_write_line<V>(buf, i);
    optim::prefetch_write_line<V>(out, i);
    const F p32 = load_n<V>(p + i, k);
    F d = c.unscale.template apply<V>(load_n<V>(g + i, k), us);
    if (wd_before) d = V::add(d, V::mul(wd, p32));
    if (c.has_momentum) {
      // buf is only read after the first applied update: before it, it may hold anything.
      const F buf_new =
          c.first ? d : V::add(V::mul(mom, load_n<V>(buf + i, k)), V::mul(omd, d));
      d = c.nesterov ? V::add(d, V::mul(mom, buf_new)) : buf_new;
      store_n<V>(buf + i, buf_new, k);
    }
    if (wd_after) d = V::add(d, V::mul(wd, p32));
    const F p_new = V::sub(p32, V::mul(lr, d));
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
  }
}

struct SgdChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor* buf,
                  const RawTensor* out, const TensorChunk& ch, const SgdConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    float* bp = buf == nullptr ? nullptr : static_cast<float*>(buf->data) + b;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        optim::with_typed_opt(out, [&](auto* op) {
          sgd_span<V>(pp + b, gp + b, bp, optim::at_offset(op, b), n, c);
        });
      });
    });
  }
};

void multi_tensor_sgd_cpu(at::TensorList params, at::TensorList grads,
                          at::TensorList momentum_buffers, at::TensorList model_params,
                          const at::Tensor& step, double lr, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool wd_after_momentum,
                          const c10::optional<at::Tensor>& grad_scale,
                          const c10::optional<at::Tensor>& found_inf,
                          const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<SgdHyper> args = multi_tensor_sgd_args(
      Backend::kCpu, params, grads, momentum_buffers, model_params, step, lr, momentum, dampening,
      weight_decay, nesterov, wd_after_momentum, grad_scale, found_inf, lr_tensor);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const float step_value = *step.data_ptr<float>();
  const SgdConsts c{args.hyper, optim::resolve_lr(args.scalars), step_value == 0.f,
                    optim::Unscale::from(args.scalars.grad_scale)};
  const bool has_momentum = c.has_momentum;

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               bs = raw_tensors(has_momentum ? momentum_buffers : at::TensorList()),
                               os = raw_tensors(model_params);
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<SgdChunk>(isa, ps[t], gs[t], optim::raw_at(bs, t), optim::raw_at(os, t), ch,
                             c);
  });
  optim::commit_count(step, step_value + 1.f);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_sgd_", &mp_wrappers::cpu::multi_tensor_sgd_cpu);
}
