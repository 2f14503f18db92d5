// CUDA kernels of multi_tensor_sgd8bit_ and multi_tensor_sgd8bit_lean_: SGD with a block-wise
// 8-bit momentum buffer (Note [8-bit optimizer states] in mp_wrappers/ops/reference/quant.py, the
// executable definition, and its multi_tensor_sgd8bit_; the CPU twin is
// cpu/multi_tensor_sgd8bit.cpp), on fp32 / half params with an optional model copy, or on bf16
// params with a lean storage (cuda/quant_lean_param.cuh: the same block update, each param element
// read and written as the lean kernels do). The 8-bit Adam kernel's structure with one state
// (cuda/quant_block.cuh:
// one warp per quantization block of 256 elements, the codes, the lanes' layout, the launches):
// each lane dequantizes 8 elements of the buffer, applies the SGD update (the CPU kernel's
// operations in its order, its fused multiply-adds as FMAs, so the same bits; only a NaN's code, a
// zero times a subnormal absmax's infinite encode factor, follows the platform's default NaN, as
// in the Adam kernel: docs/quantized_states.md), stores the param and the model copy, and keeps its
// 8 new buffer values in registers while the warp reduces the block's new absmax with shuffles;
// then every lane encodes its elements and lane 0 stores the absmax.
//
// Whether this is the first applied update (step == 0: buffer := direction, its codes not read) is
// read from step on the device by thread 0 of each block, as multi_tensor_sgd_ does: no host sync.
//
// 14 bytes of traffic per fp32 parameter (p read and written, g read, one code read and written)
// plus 8 bytes of absmax per block, against fp32 momentum SGD's 20. Lean bf16 params with bf16
// grads: 12 bytes per parameter (the bf16 param and its split low half or kahan compensation read
// and written, 2 + 2 bytes each, a bf16 grad read, a code read and written), 8 with stochastic
// rounding (no aux), against 18 and 14 with a float32 buffer.
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

using quant::ExpAvgCode;  // the buffer is signed: the code of Adam's first moment

struct Sgd8bitOp : SgdHyper {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;  // the float, or (capturable=True) lr_tensor, read by thread 0 of each block

  struct Ctx {
    bool first;  // the first applied update: buf := direction
    float lr;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t /*tensor_index*/) const {
    return begin_at(ld(step));
  }
  // `s` the step counter's value.
  __device__ __forceinline__ Ctx begin_at(float s) const {
    return Ctx{s == 0.f, lr.get(), make_unscale(grad_scale)};
  }
  // One element: g unscaled; b the code value in, the new buffer out; fac the block's momentum
  // times its decode factor (Note [the folded decode factor] in cpu/multi_tensor_adam8bit.cpp)
  // -> the direction d the param steps by.
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float& b,
                                          float fac) const {
    float d = g;
    if (wd_before) d = ffma(weight_decay, p, d);
    b = c.first ? d : ffma(b, fac, fmul(one_minus_dampening, d));
    d = nesterov ? ffma(momentum, b, d) : b;
    if (wd_after) d = ffma(weight_decay, p, d);
    return d;
  }
  // The param after the step (MasterParam's store): fma(-lr, d, p).
  __device__ __forceinline__ float master_param(const Ctx& c, float p, float d) const {
    return ffma(-c.lr, d, p);
  }
};
static_assert(std::is_trivial<Sgd8bitOp::Ctx>::value, "Ctx lives in shared memory");

// Lean bf16 params: the storage, and the stochastic rounding's per-tensor key in the constants
// (keyed by the count of this update, step + 1, as the reference keys it; step read once).
struct Sgd8bitLeanOp : Sgd8bitOp {
  int storage;
  uint32_t seed;

  struct Ctx : Sgd8bitOp::Ctx {
    uint32_t key;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor_index) const {
    const float s = ld(step);
    return Ctx{{begin_at(s)}, lean_key(seed, fadd(s, 1.f), tensor_index)};
  }
  // The lean step (LeanParam's store): lr * d, the decay already in the direction.
  __device__ __forceinline__ float lean_step(const Ctx& c, float /*p*/, float d) const {
    return fmul(c.lr, d);
  }
};
static_assert(std::is_trivial<Sgd8bitLeanOp::Ctx>::value, "Ctx lives in shared memory");

// params, grads, momentum_buffers, their absmaxes, then the param's second list: the model copy
// (fp32 / half params) or aux (lean bf16 params).
constexpr int kLists = 5;
using Meta = TensorListMeta<kLists, kQuantChunkSize>;

// A chunk's pointers (at its first element, or its first block's absmax) and one quantization block
// in it: `b0` its first element, `n` its size (at most kQBlock).
template <class PM, class G>
struct SgdQBlock {
  PM pm;
  const G* g;
  uint8_t* bc;
  float* ba;
  int b0, n;
};

template <class Op, class PM, class G>
__device__ __forceinline__ void sgd8bit_block(const Op& op, const typename Op::Ctx& ctx,
                                              const SgdQBlock<PM, G>& b, bool vector, int lane) {
  const float fac =
      fmul(op.momentum, fdiv(ld_warp_uniform(b.ba + b.b0 / kQBlock), ExpAvgCode::kMax));
  float buf[kPerLane];
  float b_abs = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float rp[kILP], rg[kILP], d[kILP];
    uint32_t codes = 0u;  // byte j the code of element j; not read on the first update
    if (vector) {
      const int i0 = b.b0 + lane_element(true, lane, h, 0);
      b.pm.load_pack(rp, i0);
      load_pack(rg, b.g, i0);
      if (!ctx.first) codes = packed_bytes(ld(reinterpret_cast<const Pack<uint8_t>*>(b.bc + i0)));
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int i = lane_element(false, lane, h, j);
        rp[j] = b.pm.load_one(b.b0 + i, b.b0 + b.n);
        rg[j] = load_one(b.g + b.b0, i, b.n);
        if (!ctx.first && i < b.n) codes |= static_cast<uint32_t>(ld(b.bc + b.b0 + i)) << (8 * j);
      }
    }
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      float& bj = buf[h * kILP + j];
      bj = decode<ExpAvgCode>((codes >> (8 * j)) & 0xFFu);
      d[j] = op.update(ctx, rp[j], ctx.unscale(rg[j]), bj, fac);
      // Elements past a short block do not count.
      if (lane_element(vector, lane, h, j) < b.n) b_abs = max_nan(b_abs, fabsf(bj));
    }
    if (vector) {
      b.pm.store_pack(op, ctx, b.b0 + lane_element(true, lane, h, 0), rp, d);
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j)
        b.pm.store_one(op, ctx, b.b0 + lane_element(false, lane, h, j), b.b0 + b.n, rp[j], d[j]);
    }
  }
  b_abs = warp_max(b_abs);
  // An all-zero block keeps absmax 0 and codes 0, 0x80 for -0.0 (reference/quant.py).
  const float enc = b_abs > 0.f ? fdiv(ExpAvgCode::kMax, b_abs) : 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (vector) {
      Pack<uint8_t> pk;
#pragma unroll
      for (int j = 0; j < kILP; ++j)
        pk.v[j] = static_cast<uint8_t>(encode<ExpAvgCode>(buf[h * kILP + j], enc));
      st(reinterpret_cast<Pack<uint8_t>*>(b.bc + b.b0 + lane_element(true, lane, h, 0)), pk);
    } else {
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        const int i = lane_element(false, lane, h, j);
        if (i < b.n)
          st(b.bc + b.b0 + i, static_cast<uint8_t>(encode<ExpAvgCode>(buf[h * kILP + j], enc)));
      }
    }
  }
  if (lane == 0) st(b.ba + b.b0 / kQBlock, b_abs);
}

// The warp's next quantization block (a whole one, at `b0` of the chunk), asked of L2 while this
// one computes, as the 8-bit Adam kernel does: one 128-byte line per lane and list. The codes only
// when they will be read (not on the first update); the model copy is only written.
template <class PM, class G>
__device__ __forceinline__ void prefetch_qblock(const SgdQBlock<PM, G>& b, bool first, int b0,
                                                int lane) {
  constexpr int kLine = 128;
  const int byte = lane * kLine;
  b.pm.prefetch(b0, byte);
  prefetch_line(b.g + b0, byte);
  if (!first) prefetch_line(b.bc + b0, byte);
  if (lane == 0) prefetch_l2(b.ba + b0 / kQBlock);
}

// PM: MasterParam (cuda/quant_block.cuh) or LeanParam, with its launch bound
// (cuda/quant_lean_param.cuh); tools/check_cuda_compile.sh --fail-on-spill holds every param x
// grad x model-copy combination to it.
template <class Op, class PM, class G>
__global__ void __launch_bounds__(kBlockSize, MinBlocksPerSm<PM, G>::value)
    sgd8bit_kernel(Meta meta, Op op) {
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
  const PM pm = PM::at_chunk(op, ctx, meta.addresses[0][slot], meta.addresses[4][slot], ch.begin);
  const G* g = offset_ptr<G>(meta.addresses[1][slot], ch.begin);
  uint8_t* bc = offset_ptr<uint8_t>(meta.addresses[2][slot], ch.begin);
  float* ba = offset_ptr<float>(meta.addresses[3][slot], ch.begin / kQBlock);
  // Chunks start at multiples of 256 elements: a block is aligned if its chunk is.
  const bool aligned = pm.aligned() && pack_aligned(g) && pack_aligned(bc);
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  const int size = static_cast<int>(ch.size);  // at most kQuantChunkSize
  SgdQBlock<PM, G> b{pm, g, bc, ba, 0, 0};
  for (int q = static_cast<int>(threadIdx.x) / kWarp; q * kQBlock < size; q += warps) {
    b.b0 = q * static_cast<int>(kQBlock);
    b.n = size - b.b0 < kQBlock ? size - b.b0 : static_cast<int>(kQBlock);
    const int next = b.b0 + warps * static_cast<int>(kQBlock);
    if (PM::kPrefetch && next <= size - kQBlock) prefetch_qblock(b, ctx.first, next, lane);
    sgd8bit_block(op, ctx, b, aligned && b.n == kQBlock, lane);
  }
}

void multi_tensor_sgd8bit_cuda(at::TensorList params, at::TensorList grads,
                               at::TensorList momentum_buffers,
                               at::TensorList momentum_buffer_absmaxes,
                               at::TensorList model_params, const at::Tensor& step, double lr,
                               double momentum, double dampening, double weight_decay,
                               bool nesterov, bool wd_after_momentum,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<SgdHyper> args = multi_tensor_sgd8bit_args(
      Backend::kCuda, params, grads, momentum_buffers, momentum_buffer_absmaxes, model_params, step,
      lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum, grad_scale, found_inf,
      lr_tensor);
  const DeviceGuard guard(step.device());
  const Sgd8bitOp s{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                    step.data_ptr<float>(), device_lr(args.scalars)};
  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_quantized<&sgd8bit_kernel<Sgd8bitOp, MasterParam<P, M>, G>, kLists>(
              "sgd8bit", {params, grads, momentum_buffers, momentum_buffer_absmaxes, model_params},
              s);
        });
      });
    });
  }
  // After the update kernels: they read step to tell the first update.
  launch_increment_step(step, s.found_inf);
}

// bf16 params stored the lean way: aux takes the model copy's place in the lists.
void multi_tensor_sgd8bit_lean_cuda(at::TensorList params, at::TensorList aux,
                                    at::TensorList grads, at::TensorList momentum_buffers,
                                    at::TensorList momentum_buffer_absmaxes,
                                    const at::Tensor& step, double lr, double momentum,
                                    double dampening, double weight_decay, bool nesterov,
                                    bool wd_after_momentum, c10::string_view storage_name,
                                    int64_t seed, const c10::optional<at::Tensor>& grad_scale,
                                    const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<SgdHyper> args = multi_tensor_sgd8bit_lean_args(
      Backend::kCuda, params, aux, grads, momentum_buffers, momentum_buffer_absmaxes, step, lr,
      momentum, dampening, weight_decay, nesterov, wd_after_momentum, storage_name, grad_scale,
      found_inf);
  const DeviceGuard guard(step.device());
  const Sgd8bitLeanOp s{{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                         step.data_ptr<float>(), device_lr(args.scalars)},
                        static_cast<int>(args.storage),
                        static_cast<uint32_t>(seed)};
  if (!params.empty()) {
    dispatch_dtype(grads, [&](auto* g_tag) {
      using G = std::remove_pointer_t<decltype(g_tag)>;
      launch_quantized<&sgd8bit_kernel<Sgd8bitLeanOp, LeanParam, G>, kLists>(
          "sgd8bit_lean", {params, grads, momentum_buffers, momentum_buffer_absmaxes, aux}, s);
    });
  }
  // After the update kernels: they read step for the first update and the stochastic key.
  launch_increment_step(step, s.found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_sgd8bit_", &mp_wrappers::cuda::multi_tensor_sgd8bit_cuda);
  m.impl("multi_tensor_sgd8bit_lean_", &mp_wrappers::cuda::multi_tensor_sgd8bit_lean_cuda);
}
