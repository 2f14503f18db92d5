// CUDA kernel of multi_tensor_novograd_ (apex FusedNovoGrad math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_novograd_).
//
// Three launches on the current stream, no host synchronisation:
//   1. read-only over the grads: per chunk, the block's sum of squares (norm_type 2, in double so
//      finite grads never overflow it) or NaN-propagating max |g| (norm_type 0) of the unscaled
//      grad, into the chunk's partial slot;
//   2. one thread per tensor: combine its partials in chunk order, blend the running norm
//      (first applied step: the norm itself unless init_zero), store it and the denominator;
//   3. element-wise: moment and param update with the tensor's denominator, rounded model copy.
// found_inf is checked by every kernel, and step is incremented on the device after the last one.
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

struct NovoOp : NovoHyper {
  static constexpr bool kWritesState = true;
  static constexpr bool kUnscaleOnLoad = false;
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;
  const float* denom;  // [n_tensors], from pass 2

  struct Ctx {
    float bc1, denom, lr;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor) const {
    const float count = fadd(ld(step), 1.f);
    return Ctx{bias_correction(beta1_d, count, use_bias_correction), ld(denom + tensor),
               lr.get(), make_unscale(grad_scale)};
  }
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[2]) const {
    g = c.unscale(g);
    const float m_old = fmul(beta1, s[0]);
    // The reference adds wd * p even when wd is 0 (the sign of a zero result depends on it).
    if (reg_inside_moment) {
      s[0] = fadd(m_old, fmul(beta3, fadd(fdiv(g, c.denom), fmul(weight_decay, p))));
      return fsub(p, fmul(c.lr, fdiv(s[0], c.bc1)));
    }
    s[0] = fadd(m_old, fmul(beta3, g));
    return fsub(p, fmul(c.lr, fadd(fdiv(fdiv(s[0], c.bc1), c.denom), fmul(weight_decay, p))));
  }
};

// Pass 1: lists [g].
template <class G, bool kL2>
__global__ void __launch_bounds__(kBlockSize)
    grad_norm_kernel(const TensorListMeta<1> meta, const float* found_inf,
                     const float* grad_scale, ChunkPartials<1> partials) {
  if (skip_update(found_inf)) return;
  __shared__ double shared[kBlockSize / kWarp];
  __shared__ DeviceUnscale shared_unscale;
  const auto ch = meta.chunk_of_block();
  if (threadIdx.x == 0) shared_unscale = make_unscale(grad_scale);
  __syncthreads();
  const DeviceUnscale unscale = shared_unscale;
  const G* g = static_cast<const G*>(meta.addresses[0][ch.slot]) + ch.begin;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < ch.size; i += blockDim.x) {
    const float x = unscale(to_float(ld(g + i)));
    acc = kL2 ? acc + square(x) : NanMaxOp()(acc, static_cast<double>(fabsf(x)));
  }
  if (kL2) {
    acc = block_reduce(acc, shared, SumOp());
  } else {
    acc = block_reduce(acc, shared, NanMaxOp());
  }
  const double v[1] = {acc};
  partials.write(ch, meta.numel[ch.slot], v);
}

// Pass 2: one thread per tensor.
__global__ void novograd_norms_kernel(const float* found_inf, const float* step,
                                      ChunkPartials<1> partials, int64_t n_tensors, bool l2,
                                      bool init_zero, double beta2_d, bool use_bias_correction,
                                      float beta2, float one_minus_beta2, float eps, float* norms,
                                      float* denom) {
  if (skip_update(found_inf)) return;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tensors) return;
  const double acc = l2 ? partials.combine(t, 0, 0.0, SumOp())
                        : partials.combine(t, 0, 0.0, NanMaxOp());
  const float norm = static_cast<float>(l2 ? sqrt(acc) : acc);
  const float old = ld(norms + t);
  const float blended =
      l2 ? fsqrt(fadd(fmul(fmul(beta2, old), old), fmul(fmul(one_minus_beta2, norm), norm)))
         : fadd(fmul(beta2, old), fmul(one_minus_beta2, norm));
  const float s = ld(step);
  const float updated = (s == 0.f && !init_zero) ? norm : blended;
  const float bc2 = fsqrt(bias_correction(beta2_d, fadd(s, 1.f), use_bias_correction));
  st(norms + t, updated);
  st(denom + t, fadd(fdiv(updated, bc2), eps));
}

// Pass 1 over the grads. A function template (not a lambda) so that nvcc names the kernel
// instantiations by template parameters.
template <class G>
void launch_grad_norms(at::TensorList grads, bool l2, const float* found_inf,
                       const float* grad_scale, const ChunkPartials<1>& partials, Stream stream) {
  for_each_launch<1>({grads}, [&](int blocks, const TensorListMeta<1>& meta) {
    if (l2) {
      launch("novograd_grad_norm", &grad_norm_kernel<G, true>, blocks, kBlockSize, stream, meta,
             found_inf, grad_scale, partials);
    } else {
      launch("novograd_grad_norm", &grad_norm_kernel<G, false>, blocks, kBlockSize, stream, meta,
             found_inf, grad_scale, partials);
    }
  });
}

void multi_tensor_novograd_cuda(at::TensorList params, at::TensorList grads,
                                at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                                at::TensorList model_params, const at::Tensor& step, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                bool bias_correction, bool grad_averaging,
                                bool reg_inside_moment, int64_t norm_type, bool init_zero,
                                const c10::optional<at::Tensor>& grad_scale,
                                const c10::optional<at::Tensor>& found_inf,
                                const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<NovoHyper> args = multi_tensor_novograd_args(
      Backend::kCuda, params, grads, exp_avgs, exp_avg_sq_norms, model_params, step, lr, beta1,
      beta2, eps, weight_decay, bias_correction, grad_averaging, reg_inside_moment, norm_type,
      init_zero, grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());
  const Stream stream = current_stream();
  NovoOp o{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale, step.data_ptr<float>(),
           device_lr(args.scalars), nullptr};
  const bool l2 = o.l2_norm;

  if (!params.empty()) {
    const int64_t n_tensors = static_cast<int64_t>(params.size());
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(step.device());
    // One double per chunk of the call; ranges zeroed so that empty tensors have norm 0.
    const at::Tensor part = at::empty({total_chunks(grads)}, f32.dtype(at::kDouble));
    const at::Tensor range = at::zeros({2 * n_tensors}, f32.dtype(at::kLong));
    const ChunkPartials<1> partials{part.data_ptr<double>(), range.data_ptr<int64_t>()};
    const at::Tensor denom = at::empty({n_tensors}, f32);
    dispatch_dtype(grads, [&](auto* g_tag) {
      launch_grad_norms<std::remove_pointer_t<decltype(g_tag)>>(grads, l2, o.found_inf,
                                                               o.grad_scale, partials, stream);
    });
    launch("novograd_norms", &novograd_norms_kernel,
           static_cast<unsigned int>((n_tensors + kPerTensorThreads - 1) / kPerTensorThreads),
           kPerTensorThreads, stream, o.found_inf, o.step, partials, n_tensors, l2, o.init_zero,
           o.beta2_d, o.use_bias_correction, o.beta2, o.one_minus_beta2, o.eps,
           exp_avg_sq_norms.data_ptr<float>(), denom.data_ptr<float>());
    o.denom = denom.data_ptr<float>();
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_elementwise<NovoOp, P, G, M, 1>("novograd", {params, grads, exp_avgs, model_params}, o);
        });
      });
    });
  }
  launch_increment_step(step, o.found_inf);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_novograd_", &mp_wrappers::cuda::multi_tensor_novograd_cuda);
}
