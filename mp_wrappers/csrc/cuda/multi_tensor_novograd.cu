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

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/optim_apply.cuh"

namespace mp_wrappers {
namespace cuda {
namespace {

struct NovoOp {
  static constexpr bool kWritesState = true;
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  const float* denom;  // [n_tensors], from pass 2
  double beta1_d;
  DeviceLr lr;
  float beta1, beta3, weight_decay;
  bool reg_inside_moment, use_bias_correction;

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
  constexpr const char* op = "multi_tensor_novograd_";
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
           {"model_params", model_params}},
      {"model_params"});
  check_fp32_list(op, "exp_avgs", exp_avgs);
  check_one_dtype(op, "params", params);
  check_one_dtype(op, "grads", grads);
  check_one_dtype(op, "model_params", model_params);
  TORCH_CHECK(norm_type == 2 || norm_type == 0, op, ": norm_type=", norm_type,
              "; expected 2 (L2 norm) or 0 (infinity norm)");
  check_step(op, step, device, !params.empty());
  TORCH_CHECK(exp_avg_sq_norms.scalar_type() == at::kFloat && exp_avg_sq_norms.is_contiguous() &&
                  exp_avg_sq_norms.numel() == static_cast<int64_t>(params.size()) &&
                  exp_avg_sq_norms.device() == step.device(),
              op, ": exp_avg_sq_norms must be a contiguous float32 tensor on ", step.device(),
              " with one element per param (", params.size(), "), got dtype ",
              exp_avg_sq_norms.scalar_type(), " on ", exp_avg_sq_norms.device(), " with ",
              exp_avg_sq_norms.numel(), " elements");
  const DeviceGuard guard(step.device());
  const Stream stream = current_stream();

  NovoOp o;
  o.found_inf = optional_ptr(op, "found_inf", found_inf, step.device());
  o.grad_scale = optional_ptr(op, "grad_scale", grad_scale, step.device());
  o.step = step.data_ptr<float>();
  o.beta1_d = beta1;
  o.lr = make_lr(op, lr, lr_tensor, step.device());
  o.beta1 = static_cast<float>(beta1);
  o.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.f;
  o.weight_decay = static_cast<float>(weight_decay);
  o.reg_inside_moment = reg_inside_moment;
  o.use_bias_correction = bias_correction;
  const bool l2 = norm_type == 2;

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
           kPerTensorThreads, stream, o.found_inf, o.step, partials, n_tensors, l2, init_zero,
           beta2, bias_correction, static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
           static_cast<float>(eps), exp_avg_sq_norms.data_ptr<float>(), denom.data_ptr<float>());
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
