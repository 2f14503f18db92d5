// CUDA kernels of multi_tensor_adam8bit_ and multi_tensor_adam8bit_lean_: Adam / AdamW with
// block-wise 8-bit moments (Note [8-bit optimizer states] in mp_wrappers/ops/reference/quant.py,
// the executable definition; the CPU twin is cpu/multi_tensor_adam8bit.cpp), on fp32 / half params
// (with an optional model copy) or on bf16 params with a lean storage (cuda/lean_param.cuh: the
// same block update, each param element read and written as the lean kernels do). Same structure
// as the other fused optimizers (cuda/optim_apply.cuh): the one launch planner, the IEEE
// round-to-nearest arithmetic, the device-side skip, unscale and step increment, per-block
// constants computed once by thread 0, every global access through ld/st.
//
// One warp per quantization block of 256 elements, one pass: each lane dequantizes 8 elements of
// both moments, applies the fp32 Adam update (the CPU kernel's operations in its order, so the same
// bits), stores the param and the model copy, and keeps its 8 new moments in registers while the
// warp reduces the block's new absmaxes with shuffles (no shared memory, no __syncthreads); then
// every lane encodes its 8 elements with the new factors and lane 0 stores the absmaxes. A CUDA
// block takes a chunk of kQuantChunkSize elements (a multiple of 256: a quantization block never
// spans two chunks), its warps taking the chunk's quantization blocks in turn.
//
// Whole blocks with 16-byte-aligned params and grads (4-byte-aligned codes) use vector accesses:
// lane l holds elements 4l..4l+3 and 128+4l..128+4l+3. A short last block, or misaligned storage,
// takes the guarded path: lane l holds elements l, l+32, ..., l+224, each checked against the block's
// size. Elements are independent and the max is exact in any order, so both give the same bits.
//
// 16 bytes of traffic per fp32 parameter (p read and written, g read, one byte per moment read and
// written) plus 16 bytes of absmaxes per block, against fp32 Adam's 28. Lean bf16 params with bf16
// grads: 14 bytes per parameter (the bf16 param and its split low half or kahan compensation read
// and written, 2 + 2 bytes each), 10 with stochastic rounding (no aux); their param elements are
// read and written one at a time in either layout (2-byte params beside 1-byte codes).
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <cstdint>
#include <optional>
#include <type_traits>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/cuda/quant_block.cuh"
#include "mp_wrappers/cuda/quant_lean_param.cuh"
#include "mp_wrappers/minifloat.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

using quant::ExpAvgCode;
using quant::ExpAvgSqCode;

struct Adam8bitOp : AdamHyper {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;  // the float, or (capturable=True) lr_tensor, read by thread 0 of each block

  // The update's constants: reference/quant.py _step_constants (float64, rounded once), as the
  // CPU kernel computes them on the host.
  struct Ctx {
    float sqrt_scale, eps_scaled, lr;
    DeviceUnscale unscale;
  };
  // The number of this update, as the reference counts.
  __device__ __forceinline__ float count() const { return fadd(ld(step), 1.f); }
  __device__ __forceinline__ Ctx begin(int32_t /*tensor_index*/) const { return begin_at(count()); }
  __device__ __forceinline__ Ctx begin_at(float count) const {
    Ctx c{1.f, eps, lr.get(), make_unscale(grad_scale)};
    if (use_bias_correction) {
      const double n = static_cast<double>(count);
      const double bc1 = 1.0 - pow(beta1_d, n);
      c.sqrt_scale = static_cast<float>(bc1 / sqrt(1.0 - pow(beta2_d, n)));
      c.eps_scaled = static_cast<float>(static_cast<double>(eps) * bc1);
    }
    return c;
  }
  // One element: g unscaled; m and v the code values in, the new moments out, m_fac and v_fac the
  // block's decays times decode factors; -> the Adam direction q (Note [8-bit optimizer states]
  // in reference/quant.py: its fused multiply-adds are FMAs).
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float& m, float& v,
                                          float m_fac, float v_fac) const {
    if (l2) g = ffma(weight_decay, p, g);
    m = ffma(m, m_fac, fmul(one_minus_beta1, g));
    v = ffma(fmul(one_minus_beta2, g), g, fmul(v, v_fac));
    return fdiv(m, ffma(fsqrt(v), c.sqrt_scale, c.eps_scaled));
  }
  // The fp32-master param after the step: fma(-lr, q, fma(-(lr * weight_decay), p, p)). The decay
  // factor is a multiply per element, not a constant of Ctx: a register more spilled (64-register
  // budget, kMinBlocksPerSm), and the multiply is free in a memory-bound kernel.
  __device__ __forceinline__ float master_param(const Ctx& c, float p, float q) const {
    return ffma(-c.lr, q, decoupled ? ffma(-fmul(c.lr, weight_decay), p, p) : p);
  }
  // The lean step lr * update, AdamW's decay in the update: fma(weight_decay, p, q).
  __device__ __forceinline__ float lean_step(const Ctx& c, float p, float q) const {
    return fmul(c.lr, decoupled ? ffma(weight_decay, p, q) : q);
  }
};
static_assert(std::is_trivial<Adam8bitOp::Ctx>::value, "Ctx lives in shared memory");

// Lean bf16 params: the storage, and the stochastic rounding's per-tensor key in the constants.
struct Adam8bitLeanOp : Adam8bitOp {
  int storage;
  uint32_t seed;

  struct Ctx : Adam8bitOp::Ctx {
    uint32_t key;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor_index) const {
    const float c = count();
    return Ctx{{begin_at(c)}, lean_key(seed, c, tensor_index)};
  }
};
static_assert(std::is_trivial<Adam8bitLeanOp::Ctx>::value, "Ctx lives in shared memory");

// params, grads, exp_avgs, their absmaxes, exp_avg_sqs, theirs, then the param's second list: the
// model copy (fp32 / half params) or aux (lean bf16 params).
constexpr int kLists = 7;
using Meta = TensorListMeta<kLists, kQuantChunkSize>;

// A chunk's pointers (at its first element, or its first block's absmax) and one quantization block
// in it: `b0` its first element, `n` its size (at most kQBlock). Offsets are 32-bit (chunks are at
// most 64K elements): fewer registers than a pointer per list and block.
template <class PM, class G>
struct QBlock {
  PM pm;
  const G* g;
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
  int b0, n;
};

// The lane's two groups of kILP elements are loaded, updated and stored one after the other (fewer
// values live at once); only the new moments stay in registers for the encode.
template <class PM, class G>
__device__ __forceinline__ void adam8bit_block(const Adam8bitOp& op, const Adam8bitOp::Ctx& ctx,
                                               const QBlock<PM, G>& b, bool vector, int lane) {
  const float m_fac =
      fmul(op.beta1, fdiv(ld_warp_uniform(b.ma + b.b0 / kQBlock), ExpAvgCode::kMax));
  const float v_fac =
      fmul(op.beta2, fdiv(ld_warp_uniform(b.va + b.b0 / kQBlock), ExpAvgSqCode::kMax));
  float m[kPerLane], v[kPerLane];
  float m_abs = 0.f, v_abs = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float rp[kILP], rg[kILP], q[kILP];
    // The group's codes, byte j the code of element j: one register per moment, not kILP (the
    // block update needs every register of its 64-register budget, kMinBlocksPerSm).
    uint32_t mk = 0u, vk = 0u;
    if (vector) {
      const int i0 = b.b0 + lane_element(true, lane, h, 0);
      b.pm.load_pack(rp, i0);
      load_pack(rg, b.g, i0);
      mk = packed_bytes(ld(reinterpret_cast<const Pack<uint8_t>*>(b.mc + i0)));
      vk = packed_bytes(ld(reinterpret_cast<const Pack<uint8_t>*>(b.vc + i0)));
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int i = lane_element(false, lane, h, j);
        rp[j] = b.pm.load_one(b.b0 + i, b.b0 + b.n);
        rg[j] = load_one(b.g + b.b0, i, b.n);
        if (i < b.n) {
          mk |= static_cast<uint32_t>(ld(b.mc + b.b0 + i)) << (8 * j);
          vk |= static_cast<uint32_t>(ld(b.vc + b.b0 + i)) << (8 * j);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      float& mj = m[h * kILP + j];
      float& vj = v[h * kILP + j];
      mj = decode<ExpAvgCode>((mk >> (8 * j)) & 0xFFu);
      vj = decode<ExpAvgSqCode>((vk >> (8 * j)) & 0xFFu);
      q[j] = op.update(ctx, rp[j], ctx.unscale(rg[j]), mj, vj, m_fac, v_fac);
      if (lane_element(vector, lane, h, j) < b.n) {  // elements past a short block do not count
        m_abs = max_nan(m_abs, fabsf(mj));
        v_abs = max_nan(v_abs, vj);
      }
    }
    if (vector) {
      const int i0 = b.b0 + lane_element(true, lane, h, 0);
      b.pm.store_pack(op, ctx, i0, rp, q);
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int i = lane_element(false, lane, h, j);
        b.pm.store_one(op, ctx, b.b0 + i, b.b0 + b.n, rp[j], q[j]);
      }
    }
  }
  m_abs = warp_max(m_abs);
  v_abs = warp_max(v_abs);
  // An all-zero block keeps absmax 0 and codes 0, 0x80 for -0.0 (reference/quant.py).
  const float m_enc = m_abs > 0.f ? fdiv(ExpAvgCode::kMax, m_abs) : 0.f;
  const float v_enc = v_abs > 0.f ? fdiv(ExpAvgSqCode::kMax, v_abs) : 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (vector) {
      Pack<uint8_t> mpk, vpk;
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        mpk.v[j] = static_cast<uint8_t>(encode<ExpAvgCode>(m[h * kILP + j], m_enc));
        vpk.v[j] = static_cast<uint8_t>(encode<ExpAvgSqCode>(v[h * kILP + j], v_enc));
      }
      const int i0 = b.b0 + lane_element(true, lane, h, 0);
      st(reinterpret_cast<Pack<uint8_t>*>(b.mc + i0), mpk);
      st(reinterpret_cast<Pack<uint8_t>*>(b.vc + i0), vpk);
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int i = lane_element(false, lane, h, j);
        if (i < b.n) {
          st(b.mc + b.b0 + i, static_cast<uint8_t>(encode<ExpAvgCode>(m[h * kILP + j], m_enc)));
          st(b.vc + b.b0 + i, static_cast<uint8_t>(encode<ExpAvgSqCode>(v[h * kILP + j], v_enc)));
        }
      }
    }
  }
  if (lane == 0) {
    st(b.ma + b.b0 / kQBlock, m_abs);
    st(b.va + b.b0 / kQBlock, v_abs);
  }
}

// The warp's next quantization block (a whole one, at `b0` of the chunk), asked of L2 while this
// one computes: one 128-byte line per lane and list, so that its loads wait for L2, not DRAM (the
// H100 profile of 2026-11-27: warps stalled on their loads half of the time, 47% of the DRAM
// bandwidth used). The model copy is only written: not asked for.
template <class PM, class G>
__device__ __forceinline__ void prefetch_qblock(const QBlock<PM, G>& b, int b0, int lane) {
  constexpr int kLine = 128;
  const int byte = lane * kLine;
  b.pm.prefetch(b0, byte);
  prefetch_line(b.g + b0, byte);
  prefetch_line(b.mc + b0, byte);
  prefetch_line(b.vc + b0, byte);
  if (lane == 0) {
    prefetch_l2(b.ma + b0 / kQBlock);
    prefetch_l2(b.va + b0 / kQBlock);
  }
}

// PM: MasterParam (cuda/quant_block.cuh) or LeanParam, with its launch bound
// (cuda/quant_lean_param.cuh).
template <class Op, class PM, class G>
__global__ void __launch_bounds__(kBlockSize, MinBlocksPerSm<PM, G>::value)
    adam8bit_kernel(Meta meta, Op op) {
  const auto ch = meta.chunk_of_block();
  __shared__ typename Op::Ctx shared_ctx;
  __shared__ bool shared_skip;
  if (threadIdx.x == 0) {
    shared_skip = skip_update(op.found_inf);
    if (!shared_skip) shared_ctx = op.begin(ch.tensor_index);
  }
  __syncthreads();
  if (shared_skip) return;
  const typename Op::Ctx ctx = shared_ctx;
  const int slot = ch.slot;
  const PM pm = PM::at_chunk(op, ctx, meta.addresses[0][slot], meta.addresses[6][slot], ch.begin);
  const G* g = offset_ptr<G>(meta.addresses[1][slot], ch.begin);
  uint8_t* mc = offset_ptr<uint8_t>(meta.addresses[2][slot], ch.begin);
  float* ma = offset_ptr<float>(meta.addresses[3][slot], ch.begin / kQBlock);
  uint8_t* vc = offset_ptr<uint8_t>(meta.addresses[4][slot], ch.begin);
  float* va = offset_ptr<float>(meta.addresses[5][slot], ch.begin / kQBlock);
  // Chunks start at multiples of 256 elements: a block is aligned if its chunk is.
  const bool aligned = pm.aligned() && pack_aligned(g) && pack_aligned(mc) && pack_aligned(vc);
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  const int size = static_cast<int>(ch.size);  // at most kQuantChunkSize
  QBlock<PM, G> b{pm, g, mc, ma, vc, va, 0, 0};
  for (int q = static_cast<int>(threadIdx.x) / kWarp; q * kQBlock < size; q += warps) {
    b.b0 = q * static_cast<int>(kQBlock);
    b.n = size - b.b0 < kQBlock ? size - b.b0 : static_cast<int>(kQBlock);
    const int next = b.b0 + warps * static_cast<int>(kQBlock);
    if (PM::kPrefetch && next <= size - kQBlock) prefetch_qblock(b, next, lane);
    adam8bit_block(op, ctx, b, aligned && b.n == kQBlock, lane);
  }
}

void multi_tensor_adam8bit_cuda(at::TensorList params, at::TensorList grads,
                                at::TensorList exp_avgs, at::TensorList exp_avg_absmaxes,
                                at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_absmaxes,
                                at::TensorList model_params, const at::Tensor& step, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                bool adam_w_mode, bool bias_correction,
                                const c10::optional<at::Tensor>& grad_scale,
                                const c10::optional<at::Tensor>& found_inf,
                                const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdamHyper> args = multi_tensor_adam8bit_args(
      Backend::kCuda, params, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes,
      model_params, step, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction,
      grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());
  const Adam8bitOp a{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                     step.data_ptr<float>(), device_lr(args.scalars)};
  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_quantized<&adam8bit_kernel<Adam8bitOp, MasterParam<P, M>, G>, kLists>(
              "adam8bit",
              {params, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes,
               model_params},
              a);
        });
      });
    });
  }
  launch_increment_step(step, a.found_inf);
}

// bf16 params stored the lean way (op_args.h multi_tensor_adam8bit_lean_entry checked the
// arguments): aux takes the model copy's place in the lists.
void adam8bit_lean_cuda(const LeanArgs<AdamHyper>& args, const Adam8bitLeanLists& l,
                        const at::Tensor& step, int64_t seed) {
  const DeviceGuard guard(step.device());
  const Adam8bitLeanOp a{{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                          step.data_ptr<float>(), device_lr(args.scalars)},
                         static_cast<int>(args.storage),
                         static_cast<uint32_t>(seed)};
  if (!l.params.empty()) {
    dispatch_dtype(l.grads, [&](auto* g_tag) {
      using G = std::remove_pointer_t<decltype(g_tag)>;
      launch_quantized<&adam8bit_kernel<Adam8bitLeanOp, LeanParam, G>, kLists>(
          "adam8bit_lean",
          {l.params, l.grads, l.exp_avgs, l.exp_avg_absmaxes, l.exp_avg_sqs,
           l.exp_avg_sq_absmaxes, l.aux},
          a);
    });
  }
  // After the update kernels: they read step for the bias corrections and the stochastic key.
  launch_increment_step(step, a.found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_adam8bit_", &mp_wrappers::cuda::multi_tensor_adam8bit_cuda);
  m.impl("multi_tensor_adam8bit_lean_",
         &mp_wrappers::multi_tensor_adam8bit_lean_entry<mp_wrappers::Backend::kCuda,
                                                        &mp_wrappers::cuda::adam8bit_lean_cuda>);
}
