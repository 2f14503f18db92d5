// CPU kernel of multi_tensor_lamb_ (apex FusedLAMB math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_lamb_).
//
// The trust ratio lr * ||p|| / ||update|| needs two per-tensor norms before any param may move, so
// when it is used (weight_decay != 0 or use_nvlamb) the update takes two passes:
//   1. per chunk: unscale and clip the grad, update and store the fp32 moments, and accumulate the
//      sums of squares of p and of the update (SumSq32: double lanes, flavour-independent layout,
//      one partial per fixed chunk, combined in chunk order, so the norms do not depend on the ISA
//      or the thread count);
//   2. per chunk: recompute the update from the stored moments (the same fp32 operations, hence
//      the same bits) and apply it with the tensor's trust ratio.
// That is 24 + 16 bytes per fp32 parameter instead of storing the update (which would cost a
// scratch buffer as large as the params and the same traffic). Without the trust ratio the moments
// and the param are updated in a single pass.
//
// The reference computes the norms with torch.linalg.vector_norm in fp32; ours are accumulated in
// double and rounded once, so the ratio may differ from the reference's in its last bit.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <cmath>
#include <cstring>
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

struct LambConsts : LambHyper {
  float bc1, bc2, clip;
  optim::Unscale unscale;
};

// The direction of one vector: update = m_hat / (sqrt(v_hat) + eps) (+ wd * p in AdamW mode).
template <class V>
inline typename V::F lamb_update(typename V::F p32, typename V::F m_new, typename V::F v_new,
                                 const LambConsts& c) {
  using F = typename V::F;
  F update = V::div(V::div(m_new, V::set1(c.bc1)),
                    V::add(V::sqrt(V::div(v_new, V::set1(c.bc2))), V::set1(c.eps)));
  if (c.decoupled)
    update = V::add(update, V::mul(V::set1(c.weight_decay), p32));
  return update;
}

// New moments of one vector from the raw grad.
template <class V, class G>
inline void lamb_moments(typename V::F p32, const G* g, const float* m, const float* v,
                         int64_t k, const LambConsts& c, typename V::F* m_new,
                         typename V::F* v_new) {
  using F = typename V::F;
  F g32 = c.unscale.template apply<V>(load_n<V>(g, k), V::set1(c.unscale.factor));
  if (c.clip != 1.f) g32 = V::div(g32, V::set1(c.clip));  // x / 1 is x: skip the divide
  if (c.l2)
    g32 = V::add(g32, V::mul(V::set1(c.weight_decay), p32));
  *m_new = V::add(V::mul(V::set1(c.beta1), load_n<V>(m, k)), V::mul(V::set1(c.beta3), g32));
  *v_new = V::add(V::mul(V::set1(c.beta2), load_n<V>(v, k)),
                  V::mul(V::mul(V::set1(c.one_minus_beta2), g32), g32));
}

// Lanes >= k set to 0, so a padded tail adds nothing to a sum of squares (with eps == 0 the update
// of a zero-padded lane would be 0/0).
template <class V>
inline typename V::F zero_tail(typename V::F a, int64_t k) {
  if (k >= V::kWidth) return a;
  float buf[V::kWidth];
  V::store(buf, a);
  std::memset(buf + k, 0, sizeof(float) * static_cast<size_t>(V::kWidth - k));
  return V::load(buf);
}

// Single pass (no trust ratio): moments and param, p -= lr * update.
template <class V, class P, class G, class M>
inline void lamb_fused_span(P* p, const G* g, float* m, float* v, M* out, int64_t n, float lr,
                            const LambConsts& c) {
  using F = typename V::F;
  const F ratio = V::set1(lr);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;
    optim::prefetch_write_line<V>(p, i);
    optim::prefetch_read_line<V>(g, i);
    optim::prefetch_write_line<V>(m, i);
    optim::prefetch_write_line<V>(v, i);
    optim::prefetch_write_line<V>(out, i);
    const F p32 = load_n<V>(p + i, k);
    F m_new, v_new;
    lamb_moments<V>(p32, g + i, m + i, v + i, k, c, &m_new, &v_new);
    const F p_new = V::sub(p32, V::mul(ratio, lamb_update<V>(p32, m_new, v_new, c)));
    store_n<V>(m + i, m_new, k);
    store_n<V>(v + i, v_new, k);
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
  }
}

// Pass 1: moments stored, sums of squares of p and of the update returned.
template <class V, class P, class G>
inline void lamb_norms_span(const P* p, const G* g, float* m, float* v, int64_t n,
                            const LambConsts& c, double* p_sumsq, double* u_sumsq) {
  using F = typename V::F;
  using Acc = SumSq32<V>;
  Acc p_acc, u_acc;
  F p_block[Acc::kVecs], u_block[Acc::kVecs];
  for (int64_t i = 0; i < n; i += Acc::kLanes) {
    for (int j = 0; j < Acc::kVecs; ++j) {
      const int64_t off = i + j * V::kWidth, k = n - off;
      if (k <= 0) {
        p_block[j] = u_block[j] = V::zero();
        continue;
      }
      const F p32 = load_n<V>(p + off, k);
      F m_new, v_new;
      lamb_moments<V>(p32, g + off, m + off, v + off, k, c, &m_new, &v_new);
      store_n<V>(m + off, m_new, k);
      store_n<V>(v + off, v_new, k);
      p_block[j] = p32;  // zero-padded by load_n
      u_block[j] = zero_tail<V>(lamb_update<V>(p32, m_new, v_new, c), k);
    }
    p_acc.add_block(p_block);
    u_acc.add_block(u_block);
  }
  *p_sumsq = p_acc.total();
  *u_sumsq = u_acc.total();
}

// Pass 2: p -= ratio * update, the update recomputed from the moments stored by pass 1.
template <class V, class P, class M>
inline void lamb_apply_span(P* p, const float* m, const float* v, M* out, int64_t n, float ratio,
                            const LambConsts& c) {
  using F = typename V::F;
  const F r = V::set1(ratio);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const int64_t k = n - i;
    const F p32 = load_n<V>(p + i, k);
    const F update = lamb_update<V>(p32, load_n<V>(m + i, k), load_n<V>(v + i, k), c);
    const F p_new = V::sub(p32, V::mul(r, update));
    store_n<V>(p + i, p_new, k);
    optim::store_out<V>(optim::at_offset(out, i), p_new, k);
  }
}

struct LambFusedChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor& m, const RawTensor& v,
                  const RawTensor* out, const TensorChunk& ch, float lr, const LambConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        optim::with_typed_opt(out, [&](auto* op) {
          lamb_fused_span<V>(pp + b, gp + b, static_cast<float*>(m.data) + b,
                             static_cast<float*>(v.data) + b, optim::at_offset(op, b), n, lr, c);
        });
      });
    });
  }
};

struct LambNormsChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& g, const RawTensor& m, const RawTensor& v,
                  const TensorChunk& ch, const LambConsts& c, double* p_sumsq, double* u_sumsq) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed(g, [&](auto* gp) {
        lamb_norms_span<V>(pp + b, gp + b, static_cast<float*>(m.data) + b,
                           static_cast<float*>(v.data) + b, n, c, p_sumsq, u_sumsq);
      });
    });
  }
};

struct LambApplyChunk {
  template <class V>
  static void run(const RawTensor& p, const RawTensor& m, const RawTensor& v,
                  const RawTensor* out, const TensorChunk& ch, float ratio, const LambConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    optim::with_typed(p, [&](auto* pp) {
      optim::with_typed_opt(out, [&](auto* op) {
        lamb_apply_span<V>(pp + b, static_cast<const float*>(m.data) + b,
                           static_cast<const float*>(v.data) + b, optim::at_offset(op, b), n,
                           ratio, c);
      });
    });
  }
};

void multi_tensor_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList model_params,
                           const at::Tensor& step, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool adam_w_mode,
                           bool bias_correction, bool grad_averaging, double max_grad_norm,
                           bool use_nvlamb, const at::Tensor& global_grad_norm,
                           const c10::optional<at::Tensor>& grad_scale,
                           const c10::optional<at::Tensor>& found_inf,
                           const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<LambHyper> args = multi_tensor_lamb_args(
      Backend::kCpu, params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2,
      eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, max_grad_norm, use_nvlamb,
      global_grad_norm, grad_scale, found_inf, lr_tensor);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const float count = optim::read_count(step);
  const LambHyper& h = args.hyper;
  // Global clipping factor, in fp32 as the reference computes it (a NaN norm compares false).
  const float gnorm = *global_grad_norm.data_ptr<float>();
  const float max_norm = h.max_grad_norm;
  const LambConsts c{h, optim::bias_correction(h.beta1_d, count, h.use_bias_correction),
                     optim::bias_correction(h.beta2_d, count, h.use_bias_correction),
                     (max_grad_norm > 0.0 && gnorm > max_norm) ? gnorm / max_norm : 1.f,
                     optim::Unscale::from(args.scalars.grad_scale)};
  const float lr_f = optim::resolve_lr(args.scalars);

  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               ms = raw_tensors(exp_avgs), vs = raw_tensors(exp_avg_sqs),
                               os = raw_tensors(model_params);
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();

  if (!c.trust_ratio) {
    plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
      const int64_t t = ch.tensor;
      run_cpu_kernel<LambFusedChunk>(isa, ps[t], gs[t], ms[t], vs[t], optim::raw_at(os, t), ch,
                                     lr_f, c);
    });
    optim::commit_count(step, count);
    return;
  }

  std::vector<double> p_part(plan.size(), 0.0), u_part(plan.size(), 0.0);
  plan.parallel_for_each([&](int64_t i, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<LambNormsChunk>(isa, ps[t], gs[t], ms[t], vs[t], ch, c, &p_part[i],
                                   &u_part[i]);
  });
  const size_t n_tensors = params.size();
  std::vector<double> p_sum(n_tensors, 0.0), u_sum(n_tensors, 0.0);
  for (size_t i = 0; i < plan.size(); ++i) {  // chunk order: deterministic
    p_sum[plan[i].tensor] += p_part[i];
    u_sum[plan[i].tensor] += u_part[i];
  }
  std::vector<float> ratio(n_tensors);
  for (size_t t = 0; t < n_tensors; ++t) {
    const float p_norm = static_cast<float>(std::sqrt(p_sum[t]));
    const float u_norm = static_cast<float>(std::sqrt(u_sum[t]));
    ratio[t] = (p_norm != 0.f && u_norm != 0.f) ? lr_f * (p_norm / u_norm) : lr_f;
  }
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    run_cpu_kernel<LambApplyChunk>(isa, ps[t], ms[t], vs[t], optim::raw_at(os, t), ch, ratio[t],
                                   c);
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_lamb_", &mp_wrappers::cpu::multi_tensor_lamb_cpu);
}
