// CPU kernel of multi_tensor_novograd_ (apex FusedNovoGrad math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_novograd_).
//
// NovoGrad normalises each tensor's grad by a running per-tensor grad norm, so the update takes
// two passes:
//   1. read-only over the grads: per chunk, the sum of squares (norm_type 2, SumSq32 in double with
//      a flavour-independent layout) or the max-abs (norm_type 0) of the unscaled grad; chunks are
//      combined in chunk order, so the norms do not depend on the ISA or the thread count;
//   2. on the host, the blended running norms and each tensor's denominator (a few flops per
//      tensor), then per chunk the moment and param update and the rounded model copy.
// The reference's norms come from torch.linalg.vector_norm in fp32; ours are accumulated in double
// and rounded once, so they can differ from the reference's in the last bit.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <cmath>
#include <limits>
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

struct NovoConsts : NovoHyper {
  float lr, bc1;
  optim::Unscale unscale;
};

// Pass 1, L2: sum of squares of the unscaled grad (padded lanes load as 0 and add nothing).
template <class V, class G>
inline double grad_sumsq_span(const G* g, int64_t n, const optim::Unscale& u) {
  using F = typename V::F;
  using Acc = SumSq32<V>;
  Acc acc;
  const F us = V::set1(u.factor);
  F block[Acc::kVecs];
  for (int64_t i = 0; i < n; i += Acc::kLanes) {
    for (int j = 0; j < Acc::kVecs; ++j) {
      const int64_t off = i + j * V::kWidth, k = n - off;
      block[j] = k > 0 ? u.template apply<V>(load_n<V>(g + off, k), us) : V::zero();
    }
    acc.add_block(block);
  }
  return acc.total();
}

// Pass 1, infinity norm: max |g| of the unscaled grad, NaN when any element is NaN (as
// torch.linalg.vector_norm(ord=inf) gives). maxps drops a NaN operand, so a chunk whose probe flags
// a non-finite value is redone by a scalar loop that tells inf from NaN.
template <class V, class G>
inline float grad_maxabs_span(const G* g, int64_t n, const optim::Unscale& u) {
  using F = typename V::F;
  const F us = V::set1(u.factor);
  F acc = V::zero(), probe = V::zero();
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;
    const F a = V::abs(u.template apply<V>(load_n<V>(g + i, k), us));  // padding: |0| = 0
    probe = V::nonfinite_probe(probe, a);
    acc = V::max(acc, a);
  }
  float lanes[V::kWidth];
  V::store(lanes, acc);
  float best = 0.f;
  for (int j = 0; j < V::kWidth; ++j) best = lanes[j] > best ? lanes[j] : best;
  if (!V::any_nonfinite(probe)) return best;
  best = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::fabs(u.divide ? static_cast<float>(g[i]) / u.factor
                                       : static_cast<float>(g[i]) * u.factor);
    if (std::isnan(x)) return x;
    best = x > best ? x : best;
  }
  return best;
}

// Pass 2: moment and param update with the tensor's denominator.
template <class V, class P, class G, class M>
inline void novograd_span(P* p, const G* g, float* m, M* out, int64_t n, float denom,
                          const NovoConsts& c) {
  using F = typename V::F;
  const F lr = V::set1(c.lr), b1 = V::set1(c.beta1), b3 = V::set1(c.beta3);
  const F wd = V::set1(c.weight_decay), bc1 = V::set1(c.bc1), dn = V::set1(denom);
  const F us = V::set1(c.unscale.factor);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;
    optim::prefetch_write_line<V>(p, i);
    optim::prefetch_read_line<V>(g, i);
    optim::prefetch_write_line<V>(m, i);
    optim::prefetch_write_line<V>(out, i);
    const F p32 = load_n<V>(p + i, k);
    const F g32 = c.unscale.template apply<V>(load_n<V>(g + i, k), us);
    const F m_old = V::mul(b1, load_n<V>(m + i, k));
    // The reference adds wd * p even when wd is 0 (the sign of a zero result depends on it).
    F m_new, p_new;
    if (c.reg_inside_moment) {
      m_new = V::add(m_old, V::mul(b3, V::add(V::div(g32, dn), V::mul(wd, p32))));
      p_new = V::sub(p32, V::mul(lr, V::div(m_new, bc1)));
    } else {
      m_new = V::add(m_old, V::mul(b3, g32));
      p_new = V::sub(p32, V::mul(lr, V::add(V::div(V::div(m_new, bc1), dn), V::mul(wd, p32))));
    }
    store_n<V>(m + i, m_new, k);
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
  }
}

struct GradNormChunk {
  template <class V>
  static void run(const RawTensor& g, const TensorChunk& ch, bool l2, const optim::Unscale& u,
                  double* partial) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(g, [&](auto* gp) {
      *partial = l2 ? grad_sumsq_span<V>(gp + b, n, u)
                    : static_cast<double>(grad_maxabs_span<V>(gp + b, n, u));
    });
  }
};

struct NovoChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor& m,
                  const RawTensor* out, const TensorChunk& ch, float denom, const NovoConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        optim::with_typed_opt(out, [&](auto* op) {
          novograd_span<V>(pp + b, gp + b, static_cast<float*>(m.data) + b,
                           optim::at_offset(op, b), n, denom, c);
        });
      });
    });
  }
};

void multi_tensor_novograd_cpu(at::TensorList params, at::TensorList grads,
                               at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                               at::TensorList model_params, const at::Tensor& step, double lr,
                               double beta1, double beta2, double eps, double weight_decay,
                               bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                               int64_t norm_type, bool init_zero,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<NovoHyper> args = multi_tensor_novograd_args(
      Backend::kCpu, params, grads, exp_avgs, exp_avg_sq_norms, model_params, step, lr, beta1,
      beta2, eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type,
      init_zero, grad_scale, found_inf, lr_tensor);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const float step_value = *step.data_ptr<float>();
  const float count = step_value + 1.f;
  const size_t n_tensors = params.size();
  if (n_tensors == 0) {
    optim::commit_count(step, count);
    return;
  }
  const NovoHyper& h = args.hyper;
  const NovoConsts c{h, optim::resolve_lr(args.scalars),
                     optim::bias_correction(h.beta1_d, count, h.use_bias_correction),
                     optim::Unscale::from(args.scalars.grad_scale)};
  const float bc2 = std::sqrt(optim::bias_correction(h.beta2_d, count, h.use_bias_correction));
  const bool l2 = h.l2_norm;

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               ms = raw_tensors(exp_avgs), os = raw_tensors(model_params);
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();

  std::vector<double> part(plan.size(), 0.0);
  plan.parallel_for_each([&](int64_t i, const TensorChunk& ch) {
    run_cpu_kernel<GradNormChunk>(isa, gs[ch.tensor], ch, l2, c.unscale, &part[i]);
  });
  // Combine in chunk order; a max combines NaN-first so a NaN chunk poisons its tensor's norm.
  std::vector<double> acc(n_tensors, 0.0);
  for (size_t i = 0; i < plan.size(); ++i) {
    double& a = acc[plan[i].tensor];
    if (l2) a += part[i];
    else a = (std::isnan(a) || std::isnan(part[i])) ? std::numeric_limits<double>::quiet_NaN()
                                                     : std::max(a, part[i]);
  }
  // The running norms, in the reference's fp32 operations.
  float* norms = exp_avg_sq_norms.data_ptr<float>();
  const float b2 = c.beta2, omb2 = c.one_minus_beta2, eps_f = c.eps;
  const bool first = step_value == 0.f && !c.init_zero;
  std::vector<float> denom(n_tensors);
  for (size_t t = 0; t < n_tensors; ++t) {
    const float norm = static_cast<float>(l2 ? std::sqrt(acc[t]) : acc[t]);
    const float old = norms[t];
    const float blended = l2 ? std::sqrt(b2 * old * old + omb2 * norm * norm)
                             : b2 * old + omb2 * norm;
    norms[t] = first ? norm : blended;
    denom[t] = norms[t] / bc2 + eps_f;
  }
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<NovoChunk>(isa, ps[t], gs[t], ms[t], optim::raw_at(os, t), ch, denom[t], c);
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_novograd_", &mp_wrappers::cpu::multi_tensor_novograd_cpu);
}
