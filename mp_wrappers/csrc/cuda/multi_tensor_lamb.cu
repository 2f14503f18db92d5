// CUDA kernel of multi_tensor_lamb_ (apex FusedLAMB math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_lamb_).
//
// With the trust ratio (weight_decay != 0 or use_nvlamb), three launches on the current stream and
// no host synchronisation:
//   1. per chunk: unscale and clip the grad, store the new moments, and reduce the block's sums of
//      squares of p and of the update (double, so finite values never overflow) into the chunk's
//      partial slot;
//   2. one thread per tensor: sum its partials in chunk order, ratio = lr * ||p|| / ||u||;
//   3. element-wise: recompute the update from the stored moments (same fp32 operations, same
//      bits) and apply p -= ratio[tensor] * update, writing the rounded model copy.
// Without the trust ratio, a single element-wise pass. found_inf is checked by every kernel, and
// step is incremented on the device after the last one.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <optional>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

// Hyperparameters and device pointers shared by the three kernels.
struct LambArgs : LambHyper {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  const float* global_grad_norm;
  DeviceLr lr;
};

struct LambCtx {
  float bc1, bc2, clip, lr;
  DeviceUnscale unscale;
};

// Per-block constants (computed by one thread of the block).
__device__ __forceinline__ LambCtx lamb_ctx(const LambArgs& a) {
  const float count = fadd(ld(a.step), 1.f);
  const float gnorm = ld(a.global_grad_norm);
  // fp32 as the reference computes it; a NaN norm compares false and leaves the grads unclipped.
  const float clip = (a.max_grad_norm > 0.f && gnorm > a.max_grad_norm)
                         ? fdiv(gnorm, a.max_grad_norm) : 1.f;
  return LambCtx{bias_correction(a.beta1_d, count, a.use_bias_correction),
                 bias_correction(a.beta2_d, count, a.use_bias_correction), clip, a.lr.get(),
                 make_unscale(a.grad_scale)};
}

__device__ __forceinline__ void lamb_moments(const LambArgs& a, const LambCtx& c, float p, float g,
                                             float* m, float* v) {
  g = c.unscale(g);
  if (c.clip != 1.f) g = fdiv(g, c.clip);
  if (a.l2) g = fadd(g, fmul(a.weight_decay, p));
  *m = fadd(fmul(a.beta1, *m), fmul(a.beta3, g));
  *v = fadd(fmul(a.beta2, *v), fmul(fmul(a.one_minus_beta2, g), g));
}

__device__ __forceinline__ float lamb_update(const LambArgs& a, const LambCtx& c, float p, float m,
                                             float v) {
  float u = fdiv(fdiv(m, c.bc1), fadd(fsqrt(fdiv(v, c.bc2)), a.eps));
  if (a.decoupled) u = fadd(u, fmul(a.weight_decay, p));
  return u;
}

// Single pass, no trust ratio: p -= lr * update.
struct LambFusedOp {
  static constexpr bool kWritesState = true;
  static constexpr bool kUnscaleOnLoad = false;
  const float* found_inf;
  LambArgs a;
  using Ctx = LambCtx;
  __device__ __forceinline__ Ctx begin(int32_t) const { return lamb_ctx(a); }
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[3]) const {
    lamb_moments(a, c, p, g, &s[0], &s[1]);
    return fsub(p, fmul(c.lr, lamb_update(a, c, p, s[0], s[1])));
  }
};

// Pass 3: lists [p, m, v, model]; moments are read, not written.
struct LambApplyOp {
  static constexpr bool kWritesState = false;
  static constexpr bool kUnscaleOnLoad = false;  // no grads
  const float* found_inf;
  const float* ratio;  // [n_tensors], from pass 2
  LambArgs a;
  struct Ctx {
    LambCtx c;
    float ratio;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor) const {
    return Ctx{lamb_ctx(a), ld(ratio + tensor)};
  }
  __device__ __forceinline__ float update(const Ctx& c, float p, float, float (&s)[3]) const {
    return fsub(p, fmul(c.ratio, lamb_update(a, c.c, p, s[0], s[1])));
  }
};

// Pass 1: lists [p, g, m, v]. Coalesced strided loop (each thread's elements are blockDim apart);
// the sums are reduced over the block and written once per chunk.
template <class P, class G>
__global__ void __launch_bounds__(kBlockSize)
    lamb_norms_kernel(const TensorListMeta<4> meta, LambArgs a, ChunkPartials<2> partials) {
  if (skip_update(a.found_inf)) return;
  __shared__ double shared[kBlockSize / kWarp];
  __shared__ LambCtx shared_ctx;
  const auto ch = meta.chunk_of_block();
  if (threadIdx.x == 0) shared_ctx = lamb_ctx(a);
  __syncthreads();
  const LambCtx c = shared_ctx;
  const P* p = static_cast<const P*>(meta.addresses[0][ch.slot]) + ch.begin;
  const G* g = static_cast<const G*>(meta.addresses[1][ch.slot]) + ch.begin;
  float* m = static_cast<float*>(meta.addresses[2][ch.slot]) + ch.begin;
  float* v = static_cast<float*>(meta.addresses[3][ch.slot]) + ch.begin;
  double p_sq = 0.0, u_sq = 0.0;
  for (int64_t i = threadIdx.x; i < ch.size; i += blockDim.x) {
    const float p32 = to_float(ld(p + i));
    float mi = ld(m + i), vi = ld(v + i);
    lamb_moments(a, c, p32, to_float(ld(g + i)), &mi, &vi);
    st(m + i, mi);
    st(v + i, vi);
    const float u = lamb_update(a, c, p32, mi, vi);
    p_sq += square(p32);
    u_sq += square(u);
  }
  p_sq = block_reduce(p_sq, shared, SumOp());
  u_sq = block_reduce(u_sq, shared, SumOp());
  const double sums[2] = {p_sq, u_sq};
  partials.write(ch, meta.numel[ch.slot], sums);
}

// Pass 2: one thread per tensor; a tensor without chunks has zero norms (ratio lr).
__global__ void lamb_ratio_kernel(const float* found_inf, ChunkPartials<2> partials,
                                  int64_t n_tensors, DeviceLr device_lr, float* ratio) {
  if (skip_update(found_inf)) return;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tensors) return;
  const float lr = device_lr.get();
  const float p_norm = static_cast<float>(sqrt(partials.combine(t, 0, 0.0, SumOp())));
  const float u_norm = static_cast<float>(sqrt(partials.combine(t, 1, 0.0, SumOp())));
  st(ratio + t, (p_norm != 0.f && u_norm != 0.f) ? fmul(lr, fdiv(p_norm, u_norm)) : lr);
}

// The three launches of the trust-ratio path. A function template (not a lambda) so that nvcc
// names the kernel instantiations by template parameters.
template <class P, class G, class M>
void launch_trust_ratio(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList model_params,
                        const LambArgs& a, const at::Device& device, Stream stream) {
  const int64_t n_tensors = static_cast<int64_t>(params.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  // Two doubles per chunk of the call; ranges zeroed so that empty tensors have norm 0.
  const at::Tensor part = at::empty({2 * total_chunks(params)}, f32.dtype(at::kDouble));
  const at::Tensor range = at::zeros({2 * n_tensors}, f32.dtype(at::kLong));
  const ChunkPartials<2> partials{part.data_ptr<double>(), range.data_ptr<int64_t>()};
  const at::Tensor ratio = at::empty({n_tensors}, f32);
  for_each_launch<4>({params, grads, exp_avgs, exp_avg_sqs},
                     [&](int blocks, const TensorListMeta<4>& meta) {
                       launch("lamb_norms", &lamb_norms_kernel<P, G>, blocks, kBlockSize, stream,
                              meta, a, partials);
                     });
  launch("lamb_ratio", &lamb_ratio_kernel,
         static_cast<unsigned int>((n_tensors + kPerTensorThreads - 1) / kPerTensorThreads),
         kPerTensorThreads, stream, a.found_inf, partials, n_tensors, a.lr,
         ratio.data_ptr<float>());
  launch_elementwise<LambApplyOp, P, NoOut, M, 2>(
      "lamb_apply", {params, exp_avgs, exp_avg_sqs, model_params},
      LambApplyOp{a.found_inf, ratio.data_ptr<float>(), a});
}

void multi_tensor_lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList model_params,
                            const at::Tensor& step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, bool adam_w_mode,
                            bool bias_correction, bool grad_averaging, double max_grad_norm,
                            bool use_nvlamb, const at::Tensor& global_grad_norm,
                            const c10::optional<at::Tensor>& grad_scale,
                            const c10::optional<at::Tensor>& found_inf,
                            const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<LambHyper> args = multi_tensor_lamb_args(
      Backend::kCuda, params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2,
      eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, max_grad_norm, use_nvlamb,
      global_grad_norm, grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());
  const Stream stream = current_stream();
  const LambArgs a{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                   step.data_ptr<float>(), global_grad_norm.data_ptr<float>(),
                   device_lr(args.scalars)};

  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          if (!a.trust_ratio) {
            launch_elementwise<LambFusedOp, P, G, M, 2>(
                "lamb_fused", {params, grads, exp_avgs, exp_avg_sqs, model_params},
                LambFusedOp{a.found_inf, a});
            return;
          }
          launch_trust_ratio<P, G, M>(params, grads, exp_avgs, exp_avg_sqs, model_params, a,
                                      step.device(), stream);
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
  m.impl("multi_tensor_lamb_", &mp_wrappers::cuda::multi_tensor_lamb_cuda);
}
