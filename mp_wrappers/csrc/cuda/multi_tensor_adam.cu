// CUDA kernel of multi_tensor_adam_ (Adam / AdamW, apex FusedAdam math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_adam_). One element-wise pass over chunked tensor
// lists (see mp_wrappers/cuda/optim_apply.cuh); found_inf, grad_scale and step are read on the
// device, and one thread increments step afterwards unless the update was skipped.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <optional>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

struct AdamOp : AdamHyper {
  static constexpr bool kWritesState = true;
  static constexpr bool kUnscaleOnLoad = false;
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;

  struct Ctx {
    float bc1, bc2, lr;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t) const {
    const float count = fadd(ld(step), 1.f);  // the number of this update, as the reference counts
    return Ctx{bias_correction(beta1_d, count, use_bias_correction),
               bias_correction(beta2_d, count, use_bias_correction), lr.get(),
               make_unscale(grad_scale)};
  }
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[3]) const {
    g = c.unscale(g);
    if (l2) g = fadd(g, fmul(weight_decay, p));
    const float m = fadd(fmul(beta1, s[0]), fmul(one_minus_beta1, g));
    const float v = fadd(fmul(beta2, s[1]), fmul(fmul(one_minus_beta2, g), g));
    float u = fdiv(fdiv(m, c.bc1), fadd(fsqrt(fdiv(v, c.bc2)), eps));
    if (decoupled) u = fadd(u, fmul(weight_decay, p));
    s[0] = m;
    s[1] = v;
    return fsub(p, fmul(c.lr, u));
  }
};

void multi_tensor_adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList model_params,
                            const at::Tensor& step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, bool adam_w_mode,
                            bool bias_correction, const c10::optional<at::Tensor>& grad_scale,
                            const c10::optional<at::Tensor>& found_inf,
                            const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdamHyper> args = multi_tensor_adam_args(
      Backend::kCuda, params, grads, exp_avgs, exp_avg_sqs, model_params, step, lr, beta1, beta2,
      eps, weight_decay, adam_w_mode, bias_correction, grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());
  const AdamOp a{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                 step.data_ptr<float>(), device_lr(args.scalars)};
  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_elementwise<AdamOp, P, G, M, 2>(
              "adam", {params, grads, exp_avgs, exp_avg_sqs, model_params}, a);
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
  m.impl("multi_tensor_adam_", &mp_wrappers::cuda::multi_tensor_adam_cuda);
}
