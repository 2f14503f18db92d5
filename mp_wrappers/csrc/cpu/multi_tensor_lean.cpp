// CPU kernels of multi_tensor_adam_lean_ and multi_tensor_sgd_lean_: Adam/AdamW and SGD on bf16
// params that carry their own master ('split'), a Kahan compensation ('kahan') or nothing but
// stochastic rounding ('stochastic'). Semantics and op order: mp_wrappers/ops/reference/lean.py
// (Note [lean bf16 storage]); the fp32 arithmetic is that of cpu/multi_tensor_{adam,sgd}.cpp in the
// same order (Adam's is the one optim::AdamVec of cpu_optim.h), so 'split' masters are
// bit-identical to the fused O2 step's fp32 masters.
//
// One pass per 64K-element chunk, like the fp32-master kernels: per bf16 param, 'split' moves
// 2 (param) + 2 (low half) + 8 (fp32 moments) bytes in and out plus the grad, where O2 moves the
// model copy (2) + master (4) + moments (8); 'kahan' and 'stochastic' with bf16 moments move 4-6.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_lean_param.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

using Storage = LeanStorage;

// ---- Adam ---------------------------------------------------------------------------------------

using optim::AdamConsts;

// The update of elements [i, end) (Note [whole vectors] in cpu_optim.h).
struct AdamLeanSpan {
  template <class V, bool kWhole, Storage S, class G, class M>
  static void run(int64_t i, int64_t end, LeanParam<V, S> lp, const G* g, M* m, M* v,
                  const AdamConsts& c) {
    using F = typename V::F;
    const optim::AdamVec<V> a(c);
    for (; i < end; i += V::kWidth) {
      const int64_t k = optim::lanes<V, kWhole>(end - i);
      if (kWhole && optim::prefetch_due(i)) {
        lp.prefetch(i);
        optim::prefetch_read(g + i);
        optim::prefetch_write(m + i);
        optim::prefetch_write(v + i);
      }
      const F p32 = lp.load(i, k);
      F m_new, v_new;
      const F step = a.step(p32, load_n<V>(g + i, k), load_n<V>(m + i, k), load_n<V>(v + i, k),
                            &m_new, &v_new);
      store_n<V>(m + i, m_new, k);
      store_n<V>(v + i, v_new, k);
      lp.store(i, k, p32, step);
    }
  }
};

// State (moments, momentum) is float32 or bfloat16.
template <class Fn>
inline void with_state_typed(const RawTensor& t, const Fn& fn) {
  if (t.dtype == StorageDtype::kBFloat16) return fn(static_cast<c10::BFloat16*>(t.data));
  fn(static_cast<float*>(t.data));
}

struct AdamLeanChunk {
  template <class V>
  static void run(const LeanChunkArgs& a, const RawTensor& m, const RawTensor& v,
                  const TensorChunk& ch, const AdamConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    with_lean_param<V>(a, ch, [&](const auto& lp) {
      optim::with_typed(*a.g, [&](auto* gp) {
        with_state_typed(m, [&](auto* mp) {
          // Both moments share one dtype (checked on entry).
          auto* vp = reinterpret_cast<decltype(mp)>(v.data);
          optim::run_span<AdamLeanSpan, V>(n, lp, gp + b, mp + b, vp + b, c);
        });
      });
    });
  }
};

// ---- SGD ----------------------------------------------------------------------------------------

struct SgdConsts : SgdHyper {
  float lr;
  bool first;  // the first applied update (step == 0): buf := direction
  optim::Unscale unscale;
};

// The update of elements [i, end) (Note [whole vectors] in cpu_optim.h).
struct SgdLeanSpan {
  template <class V, bool kWhole, Storage S, class G, class B>
  static void run(int64_t i, int64_t end, LeanParam<V, S> lp, const G* g, B* buf,
                  const SgdConsts& c) {
    using F = typename V::F;
    const F lr = V::set1(c.lr), mom = V::set1(c.momentum), omd = V::set1(c.one_minus_dampening);
    const F wd = V::set1(c.weight_decay), us = V::set1(c.unscale.factor);
    const bool wd_before = c.wd_before, wd_after = c.wd_after, has_momentum = c.has_momentum;
    for (; i < end; i += V::kWidth) {
      const int64_t k = optim::lanes<V, kWhole>(end - i);
      if (kWhole && optim::prefetch_due(i)) {
        lp.prefetch(i);
        optim::prefetch_read(g + i);
        if (has_momentum) optim::prefetch_write(optim::at_offset(buf, i));
      }
      const F p32 = lp.load(i, k);
      F d = c.unscale.template apply<V>(load_n<V>(g + i, k), us);
      if (wd_before) d = V::add(d, V::mul(wd, p32));
      if constexpr (!std::is_same<B, optim::NoOut>::value) {
        if (has_momentum) {
          const F b_new =
              c.first ? d : V::add(V::mul(mom, load_n<V>(buf + i, k)), V::mul(omd, d));
          d = c.nesterov ? V::add(d, V::mul(mom, b_new)) : b_new;
          store_n<V>(buf + i, b_new, k);
        }
      }
      if (wd_after) d = V::add(d, V::mul(wd, p32));
      lp.store(i, k, p32, V::mul(lr, d));
    }
  }
};

struct SgdLeanChunk {
  template <class V>
  static void run(const LeanChunkArgs& a, const RawTensor* buf, const TensorChunk& ch,
                  const SgdConsts& c) {
    const int64_t b = ch.begin, n = ch.end - ch.begin;
    with_lean_param<V>(a, ch, [&](const auto& lp) {
      optim::with_typed(*a.g, [&](auto* gp) {
        if (buf == nullptr) {
          optim::run_span<SgdLeanSpan, V>(n, lp, gp + b, static_cast<optim::NoOut*>(nullptr),
                                          c);
          return;
        }
        with_state_typed(*buf, [&](auto* bp) {
          optim::run_span<SgdLeanSpan, V>(n, lp, gp + b, bp + b, c);
        });
      });
    });
  }
};

// ---- argument checks and the host side ----------------------------------------------------------

void multi_tensor_adam_lean_cpu(at::TensorList params, at::TensorList aux, at::TensorList grads,
                                at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                const at::Tensor& step, double lr, double beta1, double beta2,
                                double eps, double weight_decay, bool adam_w_mode,
                                bool bias_correction, c10::string_view storage_name, int64_t seed,
                                const c10::optional<at::Tensor>& grad_scale,
                                const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<AdamHyper> args = multi_tensor_adam_lean_args(
      Backend::kCpu, params, aux, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps,
      weight_decay, adam_w_mode, bias_correction, storage_name, grad_scale, found_inf);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const Storage storage = args.storage;
  const float count = optim::read_count(step);
  const AdamHyper& h = args.hyper;
  const AdamConsts c{h, args.scalars.lr,
                     optim::bias_correction(h.beta1_d, count, h.use_bias_correction),
                     optim::bias_correction(h.beta2_d, count, h.use_bias_correction),
                     optim::Unscale::from(args.scalars.grad_scale)};

  const std::vector<RawTensor> ps = raw_tensors(params), as = raw_tensors(aux),
                               gs = raw_tensors(grads), ms = raw_tensors(exp_avgs),
                               vs = raw_tensors(exp_avg_sqs);
  const std::vector<uint32_t> keys = tensor_keys(storage, seed, count, params.size());
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    const LeanChunkArgs a{storage, &ps[t], optim::raw_at(as, t), &gs[t], keys[t]};
    run_cpu_kernel<AdamLeanChunk>(isa, a, ms[t], vs[t], ch, c);
  });
  optim::commit_count(step, count);
}

void multi_tensor_sgd_lean_cpu(at::TensorList params, at::TensorList aux, at::TensorList grads,
                               at::TensorList momentum_buffers, const at::Tensor& step, double lr,
                               double momentum, double dampening, double weight_decay,
                               bool nesterov, bool wd_after_momentum,
                               c10::string_view storage_name, int64_t seed,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<SgdHyper> args = multi_tensor_sgd_lean_args(
      Backend::kCpu, params, aux, grads, momentum_buffers, step, lr, momentum, dampening,
      weight_decay, nesterov, wd_after_momentum, storage_name, grad_scale, found_inf);
  if (optim::should_skip(args.scalars.found_inf)) return;

  const Storage storage = args.storage;
  const float count = optim::read_count(step);
  const SgdConsts c{args.hyper, args.scalars.lr, *step.data_ptr<float>() == 0.f,
                    optim::Unscale::from(args.scalars.grad_scale)};
  const bool has_momentum = c.has_momentum;

  const std::vector<RawTensor> ps = raw_tensors(params), as = raw_tensors(aux),
                               gs = raw_tensors(grads), bs = raw_tensors(momentum_buffers);
  const std::vector<uint32_t> keys = tensor_keys(storage, seed, count, params.size());
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    const LeanChunkArgs a{storage, &ps[t], optim::raw_at(as, t), &gs[t], keys[t]};
    run_cpu_kernel<SgdLeanChunk>(isa, a, has_momentum ? optim::raw_at(bs, t) : nullptr, ch, c);
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_adam_lean_", &mp_wrappers::cpu::multi_tensor_adam_lean_cpu);
  m.impl("multi_tensor_sgd_lean_", &mp_wrappers::cpu::multi_tensor_sgd_lean_cpu);
}
