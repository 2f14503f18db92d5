// CUDA kernel of multi_tensor_adam8bit_: Adam / AdamW with block-wise 8-bit moments (Note [8-bit
// optimizer states] in mp_wrappers/ops/reference/quant.py, the executable definition; the CPU twin
// is cpu/multi_tensor_adam8bit.cpp). Same structure as the other fused optimizers
// (cuda/optim_apply.cuh): the one launch planner, the IEEE round-to-nearest arithmetic, the
// device-side skip, unscale and step increment, per-block constants computed once by thread 0,
// every global access through ld/st.
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
// written) plus 16 bytes of absmaxes per block, against fp32 Adam's 28.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <cstdint>
#include <optional>
#include <type_traits>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/minifloat.h"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

using quant::ExpAvgCode;
using quant::ExpAvgSqCode;
constexpr int64_t kQBlock = quant::kBlock;
constexpr int kPerLane = static_cast<int>(kQBlock / kWarp);  // 8
static_assert(kPerLane == 2 * kILP, "a lane holds two vector packs of its block");
static_assert(kQuantChunkSize % kQBlock == 0, "chunks hold whole quantization blocks");

// ---- the codes: cpu/multi_tensor_adam8bit.cpp's scalar forms, with the IEEE intrinsics ---------

template <class C>
__device__ __forceinline__ float decode(uint32_t byte, float dec) {
  const int32_t c = C::S ? static_cast<int32_t>(byte & 0x7Fu) : static_cast<int32_t>(byte);
  const float mag = c < C::kFirstNormal ? fmul(static_cast<float>(c), C::kSubDec)
                                        : __int_as_float((c + C::kRebase) << C::kShift);
  const float v = fmul(mag, dec);
  return C::S && byte >= 0x80u ? -v : v;
}

// The nearest code of x * enc (ties to the even mantissa). `enc` infinite (a subnormal absmax):
// clamped to MAX as torch.clamp does, NaN (0 * inf) passes and encodes as the reference's integer
// arithmetic on its bits does; the low byte is the code, as the reference's uint8 cast.
template <class C>
__device__ __forceinline__ uint32_t encode(float x, float enc) {
  const float scaled = fmul(x, enc);
  const float mag = fabsf(scaled);
  const float a = mag > C::kMax ? C::kMax : mag;
  int32_t c;
  if (a < C::kMinNormal) {
    c = __float2int_rn(fmul(a, C::kSubEnc));
  } else {
    const int32_t bits = __float_as_int(a);
    c = ((bits + ((1 << (C::kShift - 1)) - 1) + ((bits >> C::kShift) & 1)) >> C::kShift) -
        C::kRebase;
  }
  if (C::S && scaled < 0.f) c |= 0x80;
  return static_cast<uint32_t>(c) & 0xFFu;
}

// max that propagates NaN, as the reference's amax does.
__device__ __forceinline__ float max_nan(float acc, float x) { return NanMaxOp()(acc, x); }

// Every lane gets the warp's max.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct Adam8bitOp : AdamHyper {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  float lr;

  // The update's constants: reference/quant.py _reciprocal_bias_corrections (float64, rounded
  // once), as the CPU kernel computes them on the host.
  struct Ctx {
    float rbc1, rsbc2;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin() const {
    const float count = fadd(ld(step), 1.f);  // the number of this update, as the reference counts
    Ctx c{1.f, 1.f, make_unscale(grad_scale)};
    if (use_bias_correction) {
      const double n = static_cast<double>(count);
      c.rbc1 = static_cast<float>(1.0 / (1.0 - pow(beta1_d, n)));
      c.rsbc2 = static_cast<float>(1.0 / sqrt(1.0 - pow(beta2_d, n)));
    }
    return c;
  }
  // One element: g unscaled; m and v the dequantized moments in, the new ones out; -> new p.
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float& m,
                                          float& v) const {
    if (l2) g = fadd(g, fmul(weight_decay, p));
    m = fadd(fmul(beta1, m), fmul(one_minus_beta1, g));
    v = fadd(fmul(beta2, v), fmul(fmul(one_minus_beta2, g), g));
    float u = fdiv(fmul(m, c.rbc1), fadd(fmul(fsqrt(v), c.rsbc2), eps));
    if (decoupled) u = fadd(u, fmul(weight_decay, p));
    return fsub(p, fmul(lr, u));
  }
};
static_assert(std::is_trivial<Adam8bitOp::Ctx>::value, "Ctx lives in shared memory");

constexpr int kLists = 7;  // params, grads, exp_avgs, their absmaxes, exp_avg_sqs, theirs, model
using Meta = TensorListMeta<kLists, kQuantChunkSize>;

// One quantization block's pointers (at the block's first element) and size.
template <class P, class G, class M>
struct QBlock {
  P* p;
  const G* g;
  uint8_t* mc;
  float* ma;
  uint8_t* vc;
  float* va;
  M* out;  // nullptr: no model copy
  int64_t n;
};

// Element k (0..7) of the lane: vector layout (two packs) or guarded layout (strided by the warp).
__device__ __forceinline__ int64_t lane_element(bool vector, int lane, int k) {
  return vector ? (k / kILP) * (kQBlock / 2) + lane * kILP + k % kILP
                : static_cast<int64_t>(k) * kWarp + lane;
}

template <class P, class G, class M>
__device__ __forceinline__ void adam8bit_block(const Adam8bitOp& op, const Adam8bitOp::Ctx& ctx,
                                               const QBlock<P, G, M>& b, bool vector, int lane) {
  const float m_dec = fdiv(ld_warp_uniform(b.ma), ExpAvgCode::kMax);
  const float v_dec = fdiv(ld_warp_uniform(b.va), ExpAvgSqCode::kMax);
  float rp[kPerLane], rg[kPerLane], m[kPerLane], v[kPerLane];
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i0 = h * (kQBlock / 2) + lane * kILP;
      float pp[kILP], gg[kILP];
      load_pack(pp, b.p, i0);
      load_pack(gg, b.g, i0);
      const Pack<uint8_t> mk = ld(reinterpret_cast<const Pack<uint8_t>*>(b.mc + i0));
      const Pack<uint8_t> vk = ld(reinterpret_cast<const Pack<uint8_t>*>(b.vc + i0));
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        rp[h * kILP + j] = pp[j];
        rg[h * kILP + j] = gg[j];
        m[h * kILP + j] = decode<ExpAvgCode>(mk.v[j], m_dec);
        v[h * kILP + j] = decode<ExpAvgSqCode>(vk.v[j], v_dec);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = lane_element(false, lane, k);
      rp[k] = load_one(b.p, i, b.n);
      rg[k] = load_one(b.g, i, b.n);
      m[k] = decode<ExpAvgCode>(i < b.n ? ld(b.mc + i) : 0u, m_dec);
      v[k] = decode<ExpAvgSqCode>(i < b.n ? ld(b.vc + i) : 0u, v_dec);
    }
  }
  float m_abs = 0.f, v_abs = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    rp[k] = op.update(ctx, rp[k], ctx.unscale(rg[k]), m[k], v[k]);
    if (lane_element(vector, lane, k) < b.n) {  // elements past a short block do not count
      m_abs = max_nan(m_abs, fabsf(m[k]));
      v_abs = max_nan(v_abs, v[k]);
    }
  }
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i0 = h * (kQBlock / 2) + lane * kILP;
      float pp[kILP];
#pragma unroll
      for (int j = 0; j < kILP; ++j) pp[j] = rp[h * kILP + j];
      store_pack(b.p, i0, pp);
      if (b.out != nullptr) store_pack(b.out, i0, pp);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = lane_element(false, lane, k);
      store_one(b.p, i, b.n, rp[k]);
      if (b.out != nullptr) store_one(b.out, i, b.n, rp[k]);
    }
  }
  m_abs = warp_max(m_abs);
  v_abs = warp_max(v_abs);
  // An all-zero block keeps absmax 0 and codes 0 (reference/quant.py _block_factors).
  const float m_enc = m_abs > 0.f ? fdiv(ExpAvgCode::kMax, m_abs) : 0.f;
  const float v_enc = v_abs > 0.f ? fdiv(ExpAvgSqCode::kMax, v_abs) : 0.f;
  if (vector) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i0 = h * (kQBlock / 2) + lane * kILP;
      Pack<uint8_t> mk, vk;
#pragma unroll
      for (int j = 0; j < kILP; ++j) {
        mk.v[j] = static_cast<uint8_t>(encode<ExpAvgCode>(m[h * kILP + j], m_enc));
        vk.v[j] = static_cast<uint8_t>(encode<ExpAvgSqCode>(v[h * kILP + j], v_enc));
      }
      st(reinterpret_cast<Pack<uint8_t>*>(b.mc + i0), mk);
      st(reinterpret_cast<Pack<uint8_t>*>(b.vc + i0), vk);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = lane_element(false, lane, k);
      if (i < b.n) {
        st(b.mc + i, static_cast<uint8_t>(encode<ExpAvgCode>(m[k], m_enc)));
        st(b.vc + i, static_cast<uint8_t>(encode<ExpAvgSqCode>(v[k], v_enc)));
      }
    }
  }
  if (lane == 0) {
    st(b.ma, m_abs);
    st(b.va, v_abs);
  }
}

template <class T>
__device__ __forceinline__ T* at_element(void* base, int64_t off) {
  return base == nullptr ? nullptr : offset_ptr<T>(base, off);
}

template <class P, class G, class M>
__global__ void __launch_bounds__(kBlockSize) adam8bit_kernel(Meta meta, Adam8bitOp op) {
  const auto ch = meta.chunk_of_block();
  __shared__ Adam8bitOp::Ctx shared_ctx;
  __shared__ bool shared_skip;
  if (threadIdx.x == 0) {
    shared_skip = skip_update(op.found_inf);
    if (!shared_skip) shared_ctx = op.begin();
  }
  __syncthreads();
  if (shared_skip) return;
  const Adam8bitOp::Ctx ctx = shared_ctx;
  const int slot = ch.slot;
  P* p = offset_ptr<P>(meta.addresses[0][slot], ch.begin);
  const G* g = offset_ptr<G>(meta.addresses[1][slot], ch.begin);
  uint8_t* mc = offset_ptr<uint8_t>(meta.addresses[2][slot], ch.begin);
  float* ma = offset_ptr<float>(meta.addresses[3][slot], ch.begin / kQBlock);
  uint8_t* vc = offset_ptr<uint8_t>(meta.addresses[4][slot], ch.begin);
  float* va = offset_ptr<float>(meta.addresses[5][slot], ch.begin / kQBlock);
  M* out = at_element<M>(meta.addresses[6][slot], ch.begin);
  // Chunks start at multiples of 256 elements: a block is aligned if its chunk is.
  const bool aligned = pack_aligned(p) && pack_aligned(g) && pack_aligned(mc) &&
                       pack_aligned(vc) && (out == nullptr || pack_aligned(out));
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t warps = static_cast<int64_t>(blockDim.x) / kWarp;
  for (int64_t q = static_cast<int64_t>(threadIdx.x) / kWarp; q * kQBlock < ch.size; q += warps) {
    const int64_t b0 = q * kQBlock;
    const int64_t left = ch.size - b0;
    const QBlock<P, G, M> b{p + b0,  g + b0,
                            mc + b0, ma + q,
                            vc + b0, va + q,
                            out == nullptr ? nullptr : out + b0,
                            left < kQBlock ? left : kQBlock};
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
                                const c10::optional<at::Tensor>& found_inf) {
  const UpdateArgs<AdamHyper> args = multi_tensor_adam8bit_args(
      Backend::kCuda, params, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes,
      model_params, step, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction,
      grad_scale, found_inf);
  const DeviceGuard guard(step.device());
  const Adam8bitOp a{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                     step.data_ptr<float>(), args.scalars.lr};
  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          const Stream stream = current_stream();
          for_each_launch<kLists, kQuantChunkSize>(
              {params, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes,
               model_params},
              [&](int blocks, const Meta& meta) {
                launch("adam8bit", &adam8bit_kernel<P, G, M>, blocks, kBlockSize, stream, meta,
                       a);
              });
        });
      });
    });
  }
  launch_increment_step(step, a.found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_adam8bit_", &mp_wrappers::cuda::multi_tensor_adam8bit_cuda);
}
