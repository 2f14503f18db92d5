// CPU kernel of multi_tensor_adagrad_ (apex FusedAdagrad math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_adagrad_).
//
// One pass per chunk: load grad and param, unscale, decay, accumulate the squared grad into the
// fp32 sum, store param, sum and the rounded model copy. step only counts applied updates.
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

struct AdagradConsts : AdagradHyper {
  float lr;
  optim::Unscale unscale;
};

// The update of elements [i, end) (Note [whole vectors] in cpu_optim.h).
struct AdagradSpan {
  template <class V, bool kWhole, class P, class G, class M>
  static void run(int64_t i, int64_t end, P* p, const G* g, float* h, M* out,
                  const AdagradConsts& c) {
    using F = typename V::F;
    const F lr = V::set1(c.lr), eps = V::set1(c.eps), wd = V::set1(c.weight_decay);
    const F us = V::set1(c.unscale.factor);
    const bool l2 = c.l2, decoupled = c.decoupled;
    for (; i < end; i += V::kWidth) {
      const int64_t k = optim::lanes<V, kWhole>(end - i);
      if (kWhole && optim::prefetch_due(i)) {
        optim::prefetch_write(p + i);
        optim::prefetch_read(g + i);
        optim::prefetch_write(h + i);
        optim::prefetch_write(optim::at_offset(out, i));
      }
      const F p32 = load_n<V>(p + i, k);
      F g32 = c.unscale.template apply<V>(load_n<V>(g + i, k), us);
      if (l2) g32 = V::add(g32, V::mul(wd, p32));
      const F h_new = V::add(load_n<V>(h + i, k), V::mul(g32, g32));
      F update = V::div(g32, V::add(V::sqrt(h_new), eps));
      if (decoupled) update = V::add(update, V::mul(wd, p32));
      const F p_new = V::sub(p32, V::mul(lr, update));
      store_n<V>(h + i, h_new, k);
      store_n<V>(p + i, p_new, k);
      optim::store_out<V>(optim::at_offset(out, i), p_new, k);
    }
  }
};

struct AdagradChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor& h,
                  const RawTensor* out, const TensorChunk& ch, const AdagradConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        optim::with_typed_opt(out, [&](auto* op) {
          optim::run_span<AdagradSpan, V>(n, pp + b, gp + b, static_cast<float*>(h.data) + b,
                                          optim::at_offset(op, b), c);
        });
      });
    });
  }
};

void multi_tensor_adagrad_cpu(at::TensorList params, at::TensorList grads,
                              at::TensorList state_sums, at::TensorList model_params,
                              const at::Tensor& step, double lr, double eps, double weight_decay,
                              bool adagrad_w_mode, const c10::optional<at::Tensor>& grad_scale,
                              const c10::optional<at::Tensor>& found_inf,
                              const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdagradHyper> args = multi_tensor_adagrad_args(
      Backend::kCpu, params, grads, state_sums, model_params, step, lr, eps, weight_decay,
      adagrad_w_mode, grad_scale, found_inf, lr_tensor);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const AdagradConsts c{args.hyper, optim::resolve_lr(args.scalars),
                        optim::Unscale::from(args.scalars.grad_scale)};

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               hs = raw_tensors(state_sums), os = raw_tensors(model_params);
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<AdagradChunk>(isa, ps[t], gs[t], hs[t], optim::raw_at(os, t), ch, c);
  });
  optim::commit_count(step, optim::read_count(step));
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_adagrad_", &mp_wrappers::cpu::multi_tensor_adagrad_cpu);
}
