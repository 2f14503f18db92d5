// CUDA kernel of multi_tensor_adagrad_ (apex FusedAdagrad math; semantics and op order:
// mp_wrappers/ops/reference/optimizers.py::multi_tensor_adagrad_). One element-wise pass; step only counts
// applied updates.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <optional>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/optim_apply.cuh"

namespace mp_wrappers {
namespace cuda {
namespace {

struct AdagradOp {
  static constexpr bool kWritesState = true;
  const float* found_inf;
  const float* grad_scale;
  DeviceLr lr;
  float eps, weight_decay;
  bool l2, decoupled;

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
  constexpr const char* op = "multi_tensor_adagrad_";
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"state_sums", state_sums},
           {"model_params", model_params}},
      {"model_params"});
  check_fp32_list(op, "state_sums", state_sums);
  check_one_dtype(op, "params", params);
  check_one_dtype(op, "grads", grads);
  check_one_dtype(op, "model_params", model_params);
  check_step(op, step, device, !params.empty());
  const DeviceGuard guard(step.device());

  AdagradOp a;
  a.found_inf = optional_ptr(op, "found_inf", found_inf, step.device());
  a.grad_scale = optional_ptr(op, "grad_scale", grad_scale, step.device());
  a.lr = make_lr(op, lr, lr_tensor, step.device());
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.l2 = !adagrad_w_mode && weight_decay != 0.0;
  a.decoupled = adagrad_w_mode && weight_decay != 0.0;
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
