// CPU kernel of multi_tensor_sgd8bit_: SGD with a block-wise 8-bit momentum buffer (Note [8-bit
// optimizer states] in mp_wrappers/ops/reference/quant.py, the executable definition, and its
// multi_tensor_sgd8bit_), on fp32 / half params with an optional half model copy, and of
// multi_tensor_sgd8bit_lean_, on bf16 params with a lean storage (cpu_quant_param.h: the same block
// update, the param read and written as the lean kernels do).
//
// One pass per block of kBlock elements, as the 8-bit Adam kernel (cpu/multi_tensor_adam8bit.cpp):
// read the buffer's codes, apply the SGD update (the reference's operations in its order, its fused
// multiply-adds as V::fmadd), store the param and the rounded model copy, keep the new buffer in a
// block buffer (L1) while its absmax is reduced, then requantize the block with the codes of
// cpu_quant.h. Chunks hold whole blocks, so the result does not depend on the thread count. 14
// bytes per fp32 parameter (p read and written, g read, one code read and written, plus 8 bytes of
// absmax per block) against fp32 momentum SGD's 20. The first applied update (step == 0, read on the host with found_inf) sets
// the buffer to the direction without reading the codes, as multi_tensor_sgd_ does.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
#include "mp_wrappers/cpu_lean_param.h"
#include "mp_wrappers/cpu_quant.h"
#include "mp_wrappers/cpu_quant_param.h"
#include "mp_wrappers/cpu_vec.h"
#include "mp_wrappers/minifloat.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cpu {
namespace {

constexpr int64_t kBlock = quant::kBlock;
static_assert(kChunkElems % kBlock == 0, "chunks must hold whole quantization blocks");

using quant::ExpAvgCode;  // the buffer is signed: the code of Adam's first moment
using quant_codes::kDecodeRebase;
using quant_codes::lane_max;
using quant_codes::Quant;

struct Sgd8bitConsts : SgdHyper {
  float lr;
  bool first;  // the first applied update (step == 0): buf := direction, codes not read
  optim::Unscale unscale;
};

// One block of n <= kBlock elements; the param `pm` (cpu_quant_param.h) and every pointer are at
// the block's start.
template <class V, class PM, class G>
inline void sgd8bit_block(const PM& pm, const G* g, uint8_t* bc, float* ba, int64_t n,
                          const Sgd8bitConsts& c, float* buf) {
  using F = typename V::F;
  using Q = Quant<V>;
  const F mom = V::set1(c.momentum), omd = V::set1(c.one_minus_dampening);
  const F wd = V::set1(c.weight_decay), us = V::set1(c.unscale.factor);
  const ParamStep<V> param_step(c.lr, 0.f, false);  // the decay is in the direction
  // Note [the folded decode factor] (cpu/multi_tensor_adam8bit.cpp): the buffer's decay times its
  // block's decode factor, one rounding per block.
  const float fac = c.momentum * (*ba / ExpAvgCode::kMax);
  const float fac_rebased = fac * kDecodeRebase<ExpAvgCode>;  // Note [normal decode without ...]
  const bool scaled = c.unscale.divide || c.unscale.factor != 1.f;  // g * 1 is exact: skip it
  const bool damped = c.one_minus_dampening != 1.f;                // d * 1 too
  const bool normal = !c.first && n == kBlock && fac_rebased <= FLT_MAX &&
                      Q::template all_normal<ExpAvgCode>(bc);
  const F fac_v = V::set1(normal ? fac_rebased : fac);
  F b_max = V::zero();
  // Two copies of the loop: whole blocks of normal codes (no tail, no subnormal lanes), the rest.
  const auto update = [&](auto normal_codes) {
    constexpr bool kNormal = decltype(normal_codes)::value;
    for (int64_t i = 0; i < n; i += V::kWidth) {
      const int64_t k = kNormal ? V::kWidth : n - i;  // < kWidth only in a tail: loads pad with 0
      pm.prefetch_lines(i);
      optim::prefetch_read_line<V>(g, i);
      optim::prefetch_write_line<V>(bc, i);
      const F p32 = pm.load(i, k);
      F d = load_n<V>(g + i, k);
      if (scaled) d = c.unscale.template apply<V>(d, us);
      if (c.wd_before) d = V::fmadd(wd, p32, d);
      F b = d;
      if (!c.first) {
        const F code = kNormal ? Q::template decode_normal<ExpAvgCode>(bc + i)
                               : Q::template decode<ExpAvgCode>(bc + i, k);
        b = V::fmadd(code, fac_v, damped ? V::mul(omd, d) : d);
      }
      d = c.nesterov ? V::fmadd(mom, b, d) : b;
      if (c.wd_after) d = V::fmadd(wd, p32, d);
      pm.store_update(i, k, p32, d, param_step);  // fma(-lr, d, p), or p32 - lr * d (lean)
      // Padded lanes hold 0 (zero grad, param and codes), so they never raise the absmax.
      V::store(buf + i, b);
      b_max = Q::max_abs(b_max, b);
    }
  };
  if (normal) {
    update(std::true_type{});
  } else {
    update(std::false_type{});
  }
  const float b_abs = lane_max<V>(b_max);
  // An all-zero block keeps absmax 0 and codes 0 (0x80 for -0.0: Note [signed zero codes]).
  const float enc = b_abs > 0.f ? ExpAvgCode::kMax / b_abs : 0.f;
  const bool clamp = !(enc <= FLT_MAX);  // a subnormal absmax: the reference's clamp matters
  const F enc_v = V::set1(enc);
  if (n == kBlock) {
    Q::template encode_block<ExpAvgCode>(bc, buf, enc_v, clamp);
  } else {
    for (int64_t i = 0; i < n; i += V::kWidth)
      Q::template encode<ExpAvgCode>(bc + i, V::load(buf + i), enc_v, clamp, n - i);
  }
  *ba = b_abs;
}

// The chunk's blocks, `pm` at the chunk's first element, `g`, the codes and the absmax at the
// tensor's.
template <class V, class PM, class G>
inline void sgd8bit_chunk(const PM& pm, const G* g, uint8_t* codes, float* absmax,
                          const TensorChunk& ch, const Sgd8bitConsts& c) {
  alignas(64) float buf[kBlock];
  for (int64_t b = ch.begin; b < ch.end; b += kBlock) {
    sgd8bit_block<V>(pm.at(b - ch.begin), g + b, codes + b, absmax + b / kBlock,
                     std::min(kBlock, ch.end - b), c, buf);
  }
}

struct Sgd8bitArgs {
  const RawTensor& p;
  const RawTensor& g;
  uint8_t* codes;
  float* absmax;
  const RawTensor* out;
};

// One chunk with the storage types fixed before the flavour's flattened entry point (as
// cpu/multi_tensor_adam8bit.cpp's Adam8bitChunk, for the same reason).
struct Sgd8bitChunk {
  template <class V, class P, class G, class O>
  static void run(P* p, const G* g, const Sgd8bitArgs& a, O* out, const TensorChunk& ch,
                  const Sgd8bitConsts& c) {
    sgd8bit_chunk<V>(MasterParam<V, P, O>{p + ch.begin, optim::at_offset(out, ch.begin)}, g,
                     a.codes, a.absmax, ch, c);
  }
};

void multi_tensor_sgd8bit_cpu(at::TensorList params, at::TensorList grads,
                              at::TensorList momentum_buffers,
                              at::TensorList momentum_buffer_absmaxes,
                              at::TensorList model_params, const at::Tensor& step, double lr,
                              double momentum, double dampening, double weight_decay,
                              bool nesterov, bool wd_after_momentum,
                              const c10::optional<at::Tensor>& grad_scale,
                              const c10::optional<at::Tensor>& found_inf,
                              const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<SgdHyper> set_up = multi_tensor_sgd8bit_args(
      Backend::kCpu, params, grads, momentum_buffers, momentum_buffer_absmaxes, model_params, step,
      lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum, grad_scale, found_inf,
      lr_tensor);
  // A skipped step returns before touching anything: codes and absmax keep their bits.
  if (optim::should_skip(set_up.scalars.found_inf)) return;

  const float step_value = *step.data_ptr<float>();
  const Sgd8bitConsts c{set_up.hyper, optim::resolve_lr(set_up.scalars), step_value == 0.f,
                        optim::Unscale::from(set_up.scalars.grad_scale)};
  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               os = raw_tensors(model_params);
  std::vector<Sgd8bitArgs> args;
  args.reserve(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    args.push_back({ps[t], gs[t], momentum_buffers[t].data_ptr<uint8_t>(),
                    momentum_buffer_absmaxes[t].data_ptr<float>(),
                    optim::raw_at(os, static_cast<int64_t>(t))});
  }
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const Sgd8bitArgs& a = args[static_cast<size_t>(ch.tensor)];
    optim::with_typed(a.p, [&](auto* p) {
      optim::with_typed(a.g, [&](auto* g) {
        optim::with_typed_opt(a.out, [&](auto* out) {
          run_cpu_kernel<Sgd8bitChunk>(isa, p, g, a, out, ch, c);
        });
      });
    });
  });
  optim::commit_count(step, step_value + 1.f);
}

// ---- lean bf16 params (Note [lean bf16 storage] in reference/lean.py) ----------------------------
// The 8-bit update of bf16 params stored 'split', 'kahan' or 'stochastic': the same blocks, with
// the param read and written as the lean kernels do (reference/quant.py multi_tensor_sgd8bit_lean_).

template <LeanStorage S>
struct Sgd8bitLeanChunk {
  template <class V, class G>
  static void run(const G* g, const LeanChunkArgs& a, uint8_t* codes, float* absmax,
                  const TensorChunk& ch, const Sgd8bitConsts& c) {
    sgd8bit_chunk<V>(LeanMasterParam<V, S>{lean_param<V, S>(a, ch)}, g, codes, absmax, ch, c);
  }
};

void multi_tensor_sgd8bit_lean_cpu(at::TensorList params, at::TensorList aux,
                                   at::TensorList grads, at::TensorList momentum_buffers,
                                   at::TensorList momentum_buffer_absmaxes,
                                   const at::Tensor& step, double lr, double momentum,
                                   double dampening, double weight_decay, bool nesterov,
                                   bool wd_after_momentum, c10::string_view storage_name,
                                   int64_t seed, const c10::optional<at::Tensor>& grad_scale,
                                   const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<SgdHyper> set_up = multi_tensor_sgd8bit_lean_args(
      Backend::kCpu, params, aux, grads, momentum_buffers, momentum_buffer_absmaxes, step, lr,
      momentum, dampening, weight_decay, nesterov, wd_after_momentum, storage_name, grad_scale,
      found_inf);
  // A skipped step returns before touching anything: codes, absmax and aux keep their bits.
  if (optim::should_skip(set_up.scalars.found_inf)) return;

  const float count = optim::read_count(step);
  const Sgd8bitConsts c{set_up.hyper, set_up.scalars.lr, *step.data_ptr<float>() == 0.f,
                        optim::Unscale::from(set_up.scalars.grad_scale)};
  const std::vector<RawTensor> ps = raw_tensors(params), as = raw_tensors(aux),
                               gs = raw_tensors(grads);
  const std::vector<uint32_t> keys = tensor_keys(set_up.storage, seed, count, params.size());
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    const LeanChunkArgs a{set_up.storage, &ps[t], optim::raw_at(as, t), &gs[t], keys[t]};
    uint8_t* codes = momentum_buffers[t].data_ptr<uint8_t>();
    float* absmax = momentum_buffer_absmaxes[t].data_ptr<float>();
    with_lean_storage(a.storage, [&](auto s) {
      optim::with_typed(gs[t], [&](auto* g) {
        run_cpu_kernel<Sgd8bitLeanChunk<decltype(s)::value>>(isa, g, a, codes, absmax, ch, c);
      });
    });
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_sgd8bit_", &mp_wrappers::cpu::multi_tensor_sgd8bit_cpu);
  m.impl("multi_tensor_sgd8bit_lean_", &mp_wrappers::cpu::multi_tensor_sgd8bit_lean_cpu);
}
