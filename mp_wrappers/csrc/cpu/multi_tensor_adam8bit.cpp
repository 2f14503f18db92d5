// CPU kernels of multi_tensor_adam8bit_ and multi_tensor_adam8bit_lean_: Adam / AdamW with
// block-wise 8-bit moments (Note [8-bit optimizer states] in mp_wrappers/ops/reference/quant.py, the
// executable definition), on fp32 / half params (with an optional half model copy) or on bf16
// params with a lean storage (cpu_lean_param.h: the same block update, the param read and written
// as the lean kernels do).
//
// Two passes per block of kBlock elements (Note [two passes over a block] below): read both
// moments' codes and compute the new moments into a block buffer (L1) while their absmax is
// reduced, then apply the param step from them (the reference's operations in its order, its fused
// multiply-adds as FMAs: V::fmadd is one rounding in every flavour), storing the param and the
// rounded model copy, and requantize the block beside it. The block is the unit a
// CUDA version maps onto one thread block (absmax reduction, then encode). Chunks of the ChunkPlan
// start at multiples of kChunkElems, a multiple of kBlock, so a block never spans two threads and
// the result does not depend on the thread count.
//
// The codes are minifloats relative to the block's absmax, so encode and decode are a few integer
// and float operations per lane in every flavour (no table search), with the reference's rounding
// (ties away from zero): the normal range rounds the fp32 mantissa by one integer addition, the
// subnormal range truncates and adds the half-up carry. 16 bytes per fp32 parameter (p read and
// written, g read, 1 byte per moment read and written, plus the absmax) against fp32 Adam's 28.
//
// Note [the folded decode factor]
//   The update (Note [8-bit optimizer states]) multiplies each code value by its moment's decay
//   times the block's decode factor, fl(beta * absmax / MAX), one factor per block: a new moment
//   is one FMA (m) or a multiply and an FMA (v) where dequantize, decay and add were three
//   roundings. So the decode paths below return code values, not dequantized moments. On one core
//   the step waits on its floating-point operations and on the divider's chain: this and the
//   update's other FMAs took the AVX2 step from 1.2x to about 1.0x torch's fused fp32 AdamW
//   (docs/quantized_states.md).
//
// Speed (docs/quantized_states.md): on one core the step is bound by vector instructions, not by
// memory, so the common case gets shorter paths that give the same bits. A whole block whose codes
// of both moments all have a nonzero exponent field decodes without the subnormal lanes and without
// the exponent re-base (2-3 instructions per moment; Note [normal decode without the re-base]); the
// encode needs no clamp when the block factor is finite (the block's own absmax bounds every scaled
// value by MAX (1 + 2^-23), which rounds to MAX) and no absolute value for exp_avg_sq (never
// negative), exp_avg's sign is the scaled value's sign bit (-0 included: Note [signed zero codes]
// in reference/quant.py), whole blocks store their codes packed 32 or 64 at a time; the block's
// absmax of exp_avg is one VRANGEPS per vector; g * 1 (no loss scale) is skipped.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/cpu_lean_param.h"
#include "mp_wrappers/cpu_multi_tensor.h"
#include "mp_wrappers/cpu_optim.h"
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

using quant::ExpAvgCode;
using quant::ExpAvgSqCode;
// The codes per flavour (cpu_quant.h).
using quant_codes::kDecodeRebase;
using quant_codes::lane_max;
using quant_codes::Quant;

// op_args.h's AdamHyper (the hyperparameters as every Adam kernel rounds them), plus this step's
// lr, denominator constants (reference/quant.py _step_constants: float64, rounded once) and grad
// unscale.
struct Adam8bitConsts : AdamHyper {
  float lr;
  float sqrt_scale, eps_scaled;  // den = fma(sqrt(v), sqrt_scale, eps_scaled)
  optim::Unscale unscale;
};

// The new moment values of a block stay here between the update and the requantization.
struct alignas(64) BlockBuffer {
  float m[kBlock];
  float v[kBlock];
};

// Note [two passes over a block]
// A block is updated in two passes over its kBlock elements, with the new moments in an L1
// buffer between them:
//   1. the moments: decode both moments' codes, m and v from the grad, store them to the buffer
//      and reduce their absmax (no division);
//   2. the param step from the buffered moments (the square root and the division), and beside
//      it, group by group, the requantization of the moments, whose encode factors the absmax of
//      pass 1 fixed.
// The arithmetic of each element is the one of a single update loop (the same operations on the
// same values in the same order), so the bits are too. What moves is the schedule: on one core
// the divider's chain (a square root and a division per vector) bounds the update, and two
// kinds of work now run in its slack: the encode's integer and float work, which ran in a loop of
// its own after the update, and the prefetches of the next blocks' streams (the grad and the codes,
// which pass 1 reads; the param, which pass 2 writes). Those prefetches are new on AVX2: the single
// loop prefetched whole blocks on AVX-512 only, and the measurements below compare the two
// passes with their prefetches against the single loop without them, so they do not split the gain
// between the schedule and the prefetch. Pass 1 has no division to hide branches
// behind, so its common case (whole blocks of normal codes, no loss scale, no L2 term) is a copy
// of its own without them. Measured on a Zen 3 (AVX2), toggled round by round in one process,
// FusedAdam(state_dtype='int8') on 25M fp32 params: 0.91-0.96x the single loop's time at one
// thread, 0.87-0.92x at two; 0.92-0.98x for the O2 and the 'split' and 'stochastic' lean 8-bit
// steps on a 202-tensor model, 'kahan' unchanged (benchmarks/RESULTS.md, "Two passes over a
// block"). With the data in cache the two schedules take about the same time: what the two passes
// gain is the overlap of memory with the divider.

// One block of n <= kBlock elements; the param `pm`, `g`, the codes and the absmax pointers are at
// the block's start.
template <class V, class PM, class G>
inline void adam8bit_block(const PM& pm, const G* g, uint8_t* mc, float* ma, uint8_t* vc,
                           float* va, int64_t n, const Adam8bitConsts& c, BlockBuffer& buf) {
  using F = typename V::F;
  using Q = Quant<V>;
  // Note [the folded decode factor]: a moment's decay times its block's decode factor, one
  // rounding per block, multiplies the code values in the update's fused multiply-add.
  const float m_fac = c.beta1 * (*ma / ExpAvgCode::kMax);
  const float v_fac = c.beta2 * (*va / ExpAvgSqCode::kMax);
  // Note [normal decode without the re-base]: the factors of decode_normal's codes
  const float m_fac_rebased = m_fac * kDecodeRebase<ExpAvgCode>;
  const float v_fac_rebased = v_fac * kDecodeRebase<ExpAvgSqCode>;
  const bool normal = n == kBlock && m_fac_rebased <= FLT_MAX && v_fac_rebased <= FLT_MAX &&
                      Q::template all_normal<ExpAvgCode>(mc) &&
                      Q::template all_normal<ExpAvgSqCode>(vc);
  F m_max = V::zero(), v_max = V::zero();
  {  // pass 1: the new moments into the buffer, their absmax
    const F omb1 = V::set1(c.one_minus_beta1), omb2 = V::set1(c.one_minus_beta2);
    const F wd = V::set1(c.weight_decay), us = V::set1(c.unscale.factor);
    const bool scaled = c.unscale.divide || c.unscale.factor != 1.f;  // g * 1 is exact: skip it
    const F m_fac_v = V::set1(normal ? m_fac_rebased : m_fac);
    const F v_fac_v = V::set1(normal ? v_fac_rebased : v_fac);
    // Three copies of the loop: whole blocks of normal codes with a plain grad (no unscale, no L2
    // term: AdamW without a loss scale), the same with either, and the rest. The first pass has no
    // division to hide its branches behind, so the common case runs without them; its streams are
    // prefetched by pass 2, which has the divider's slack.
    const bool plain = !scaled && !c.l2;
    const auto moments = [&](auto normal_codes, auto plain_grad) {
      constexpr bool kNormal = decltype(normal_codes)::value;
      constexpr bool kPlain = decltype(plain_grad)::value;
      for (int64_t i = 0; i < n; i += V::kWidth) {
        const int64_t k = kNormal ? V::kWidth : n - i;  // < kWidth only in a tail: loads pad with 0
        F g32 = load_n<V>(g + i, k);
        if constexpr (!kPlain) {
          if (scaled) g32 = c.unscale.template apply<V>(g32, us);
          if (c.l2) g32 = V::fmadd(wd, pm.load(i, k), g32);
        }
        F m_code, v_code;
        if constexpr (kNormal) {
          m_code = Q::template decode_normal<ExpAvgCode>(mc + i);
          v_code = Q::template decode_normal<ExpAvgSqCode>(vc + i);
        } else {
          m_code = Q::template decode<ExpAvgCode>(mc + i, k);
          v_code = Q::template decode<ExpAvgSqCode>(vc + i, k);
        }
        const F m_new = V::fmadd(m_code, m_fac_v, V::mul(omb1, g32));
        const F v_new = V::fmadd(V::mul(omb2, g32), g32, V::mul(v_code, v_fac_v));
        // Padded lanes hold 0 (zero grad, param and codes), so they never raise the absmax.
        V::store(buf.m + i, m_new);
        V::store(buf.v + i, v_new);
        m_max = Q::max_abs(m_max, m_new);
        v_max = V::max(v_max, v_new);
      }
    };
    if (normal && plain) {
      moments(std::true_type{}, std::true_type{});
    } else if (normal) {
      moments(std::true_type{}, std::false_type{});
    } else {
      moments(std::false_type{}, std::false_type{});
    }
  }
  const float m_abs = lane_max<V>(m_max), v_abs = lane_max<V>(v_max);
  // An all-zero block keeps absmax 0 and codes 0, 0x80 for -0.0 (reference/quant.py).
  const float m_enc = m_abs > 0.f ? ExpAvgCode::kMax / m_abs : 0.f;
  const float v_enc = v_abs > 0.f ? ExpAvgSqCode::kMax / v_abs : 0.f;
  // A factor overflows only for a subnormal absmax; then the reference's clamp matters.
  const bool clamp = !(m_enc <= FLT_MAX && v_enc <= FLT_MAX);
  const F m_enc_v = V::set1(m_enc), v_enc_v = V::set1(v_enc);
  // pass 2: the param step from the buffered moments, the requantization beside it
  const F sqrt_scale = V::set1(c.sqrt_scale), eps_scaled = V::set1(c.eps_scaled);
  const ParamStep<V> param_step(c.lr, c.weight_decay, c.decoupled);
  const auto param = [&](int64_t i, int64_t k) {
    const F p32 = pm.load(i, k);
    const F v_new = V::load(buf.v + i);
    const F q = V::div(V::load(buf.m + i), V::fmadd(V::sqrt(v_new), sqrt_scale, eps_scaled));
    pm.store_update(i, k, p32, q, param_step);
  };
  if (n == kBlock && !clamp) {  // a whole block: its codes 32 or 64 at a time (cpu_quant.h)
    for (int64_t j = 0; j < kBlock; j += Q::kGroup) {
      for (int64_t i = j; i < j + Q::kGroup; i += V::kWidth) {
        // The streams of the next blocks, kPrefetchAhead elements ahead (cpu_optim.h), for both
        // passes: here the divider leaves the issue slots.
        pm.prefetch_every_line(i);
        prefetch_every_line(g, i, 0);
        prefetch_every_line(mc, i, 1);
        prefetch_every_line(vc, i, 1);
        param(i, V::kWidth);
      }
      Q::template encode_group<ExpAvgCode, false>(mc + j, buf.m + j, m_enc_v);
      Q::template encode_group<ExpAvgSqCode, false>(vc + j, buf.v + j, v_enc_v);
    }
  } else {  // a tail, or a block with a subnormal absmax (the clamp): rare, vector by vector
    for (int64_t i = 0; i < n; i += V::kWidth) param(i, n - i);
    for (int64_t i = 0; i < n; i += V::kWidth) {
      Q::template encode<ExpAvgCode>(mc + i, V::load(buf.m + i), m_enc_v, clamp, n - i);
      Q::template encode<ExpAvgSqCode>(vc + i, V::load(buf.v + i), v_enc_v, clamp, n - i);
    }
  }
  *ma = m_abs;
  *va = v_abs;
}

// The 8-bit state of one tensor.
struct Codes8bit {
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
};

struct Adam8bitArgs {
  const RawTensor& p;
  const RawTensor& g;
  Codes8bit q;
  const RawTensor* out;
};

// The chunk's blocks, `pm` at the chunk's first element and `g` at the tensor's.
template <class V, class PM, class G>
inline void adam8bit_chunk(const PM& pm, const G* g, const Codes8bit& q, const TensorChunk& ch,
                           const Adam8bitConsts& c) {
  BlockBuffer buf;
  for (int64_t b = ch.begin; b < ch.end; b += kBlock) {
    const int64_t blk = b / kBlock;
    adam8bit_block<V>(pm.at(b - ch.begin), g + b, q.mc + b, q.ma + blk, q.vc + b, q.va + blk,
                      std::min(kBlock, ch.end - b), c, buf);
  }
}

// One chunk with the storage types fixed. The types are resolved before the flavour's flattened
// entry point (below), not inside it: with all 3 x 3 x 4 type combinations inlined into one
// flattened function the fp32 path ran ~15% slower (AVX-512, one thread, same loop otherwise).
struct Adam8bitChunk {
  template <class V, class P, class G, class O>
  static void run(P* p, const G* g, const Adam8bitArgs& a, O* out, const TensorChunk& ch,
                  const Adam8bitConsts& c) {
    adam8bit_chunk<V>(MasterParam<V, P, O>{p + ch.begin, optim::at_offset(out, ch.begin)}, g,
                      a.q, ch, c);
  }
};

// This step's constants: reference/quant.py _step_constants (float64, rounded once).
Adam8bitConsts adam8bit_consts(const AdamHyper& hyper, const UpdateScalars& scalars, float count,
                               double beta1, double beta2, bool bias_correction) {
  Adam8bitConsts c;
  static_cast<AdamHyper&>(c) = hyper;
  c.lr = optim::resolve_lr(scalars);  // the lean ops: always the float
  c.sqrt_scale = 1.f;
  c.eps_scaled = hyper.eps;
  if (bias_correction) {
    const double n = static_cast<double>(count);
    const double bc1 = 1.0 - std::pow(beta1, n);
    c.sqrt_scale = static_cast<float>(bc1 / std::sqrt(1.0 - std::pow(beta2, n)));
    c.eps_scaled = static_cast<float>(static_cast<double>(hyper.eps) * bc1);
  }
  c.unscale = optim::Unscale::from(scalars.grad_scale);
  return c;
}

Codes8bit codes_at(at::TensorList exp_avgs, at::TensorList exp_avg_absmaxes,
                   at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_absmaxes, size_t t) {
  return {exp_avgs[t].data_ptr<uint8_t>(), exp_avg_absmaxes[t].data_ptr<float>(),
          exp_avg_sqs[t].data_ptr<uint8_t>(), exp_avg_sq_absmaxes[t].data_ptr<float>()};
}

void multi_tensor_adam8bit_cpu(at::TensorList params, at::TensorList grads,
                               at::TensorList exp_avgs, at::TensorList exp_avg_absmaxes,
                               at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_absmaxes,
                               at::TensorList model_params, const at::Tensor& step, double lr,
                               double beta1, double beta2, double eps, double weight_decay,
                               bool adam_w_mode, bool bias_correction,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdamHyper> set_up = multi_tensor_adam8bit_args(
      Backend::kCpu, params, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes,
      model_params, step, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction,
      grad_scale, found_inf, lr_tensor);
  // A skipped step returns before touching anything: codes and absmax keep their bits.
  if (optim::should_skip(set_up.scalars.found_inf)) return;

  const float count = optim::read_count(step);
  const Adam8bitConsts c =
      adam8bit_consts(set_up.hyper, set_up.scalars, count, beta1, beta2, bias_correction);
  const std::vector<RawTensor> ps = raw_tensors(params), gs = raw_tensors(grads),
                               os = raw_tensors(model_params);
  std::vector<Adam8bitArgs> args;
  args.reserve(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    args.push_back({ps[t], gs[t], codes_at(exp_avgs, exp_avg_absmaxes, exp_avg_sqs,
                                           exp_avg_sq_absmaxes, t),
                    optim::raw_at(os, static_cast<int64_t>(t))});
  }
  const ChunkPlan plan(params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const Adam8bitArgs& a = args[static_cast<size_t>(ch.tensor)];
    optim::with_typed(a.p, [&](auto* p) {
      optim::with_typed(a.g, [&](auto* g) {
        optim::with_typed_opt(a.out, [&](auto* out) {
          run_cpu_kernel<Adam8bitChunk>(isa, p, g, a, out, ch, c);
        });
      });
    });
  });
  optim::commit_count(step, count);
}

// ---- lean bf16 params (Note [lean bf16 storage] in reference/lean.py) ----------------------------
// The 8-bit update of bf16 params stored 'split', 'kahan' or 'stochastic': the same blocks, with
// the param read and written as the lean kernels do (reference/quant.py multi_tensor_adam8bit_lean_).

template <LeanStorage S>
struct Adam8bitLeanChunk {
  template <class V, class G>
  static void run(const G* g, const LeanChunkArgs& a, const Codes8bit& q, const TensorChunk& ch,
                  const Adam8bitConsts& c) {
    adam8bit_chunk<V>(LeanMasterParam<V, S>{lean_param<V, S>(a, ch)}, g, q, ch, c);
  }
};

// The update of multi_tensor_adam8bit_lean_ (op_args.h multi_tensor_adam8bit_lean_entry checked
// its arguments).
void adam8bit_lean_cpu(const LeanArgs<AdamHyper>& set_up, const Adam8bitLeanLists& l,
                       const at::Tensor& step, int64_t seed) {
  if (optim::should_skip(set_up.scalars.found_inf)) return;

  const float count = optim::read_count(step);
  const AdamHyper& h = set_up.hyper;
  const Adam8bitConsts c = adam8bit_consts(h, set_up.scalars, count, h.beta1_d, h.beta2_d,
                                           h.use_bias_correction);
  const std::vector<RawTensor> ps = raw_tensors(l.params), as = raw_tensors(l.aux),
                               gs = raw_tensors(l.grads);
  const std::vector<uint32_t> keys = tensor_keys(set_up.storage, seed, count, l.params.size());
  const ChunkPlan plan(l.params);
  const CpuIsa isa = cpu_isa();
  plan.parallel_for_each([&](int64_t, const TensorChunk& ch) {
    const int64_t t = ch.tensor;
    const LeanChunkArgs a{set_up.storage, &ps[t], optim::raw_at(as, t), &gs[t], keys[t]};
    const Codes8bit q = codes_at(l.exp_avgs, l.exp_avg_absmaxes, l.exp_avg_sqs,
                                 l.exp_avg_sq_absmaxes, static_cast<size_t>(t));
    with_lean_storage(a.storage, [&](auto s) {
      optim::with_typed(gs[t], [&](auto* g) {
        run_cpu_kernel<Adam8bitLeanChunk<decltype(s)::value>>(isa, g, a, q, ch, c);
      });
    });
  });
  optim::commit_count(step, count);
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("multi_tensor_adam8bit_", &mp_wrappers::cpu::multi_tensor_adam8bit_cpu);
  m.impl("multi_tensor_adam8bit_lean_",
         &mp_wrappers::multi_tensor_adam8bit_lean_entry<mp_wrappers::Backend::kCpu,
                                                        &mp_wrappers::cpu::adam8bit_lean_cpu>);
}
