// CUDA kernel of multi_tensor_adagrad_ (apex FusedAdagrad math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_adagrad_). One element-wise pass; step only counts
// applied updates.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <optional>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

struct AdagradOp : AdagradHyper {
  static constexpr bool kWritesState = true;
  static constexpr bool kUnscaleOnLoad = false;
  const float* found_inf;
  const float* grad_scale;
  DeviceLr lr;

  struct Ctx {
    float lr;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t) const {
    return Ctx{lr.get(), make_unscale(grad_scale)};
  }
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[2]) const {
    g = c.unscale(g);
    if (l2) g = fadd(g, fmul(weight_decay, p));
    const float h = fadd(s[0], fmul(g, g));
    float u = fdiv(g, fadd(fsqrt(h), eps));
    if (decoupled) u = fadd(u, fmul(weight_decay, p));
    s[0] = h;
    return fsub(p, fmul(c.lr, u));
  }
};

void multi_tensor_adagrad_cuda(at::TensorList params, at::TensorList grads,
                               at::TensorList state_sums, at::TensorList model_params,
                               const at::Tensor& step, double lr, double eps,
                               double weight_decay, bool adagrad_w_mode,
                               const c10::optional<at::Tensor>& grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& lr_tensor) {
  const UpdateArgs<AdagradHyper> args = multi_tensor_adagrad_args(
      Backend::kCuda, params, grads, state_sums, model_params, step, lr, eps, weight_decay,
      adagrad_w_mode, grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());
  const AdagradOp a{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                    device_lr(args.scalars)};
  if (!params.empty()) {
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_elementwise<AdagradOp, P, G, M, 1>(
              "adagrad", {params, grads, state_sums, model_params}, a);
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
  m.impl("multi_tensor_adagrad_", &mp_wrappers::cuda::multi_tensor_adagrad_cuda);
}
