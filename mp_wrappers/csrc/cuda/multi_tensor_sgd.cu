// CUDA kernel of multi_tensor_sgd_ (torch.optim.SGD math plus apex's wd_after_momentum; semantics
// and op order: mp_wrappers/ops/reference/optimizers.py::multi_tensor_sgd_). One element-wise pass; whether
// this is the first applied update (buffer := direction) is read from step on the device.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <optional>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/optim_apply.cuh"

namespace mp_wrappers {
namespace cuda {
namespace {

// kMomentum: one state list (the buffers) or none (momentum == 0, buffers may be absent).
template <bool kMomentum>
struct SgdOp {
  static constexpr bool kWritesState = true;
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;
  float momentum, one_minus_dampening, weight_decay;
  bool wd_before, wd_after, nesterov;

  struct Ctx {
    bool first;
    float lr;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t) const {
    return Ctx{ld(step) == 0.f, lr.get(), make_unscale(grad_scale)};
  }
  template <int K>
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[K]) const {
    float d = c.unscale(g);
    if (wd_before) d = fadd(d, fmul(weight_decay, p));
    if constexpr (kMomentum) {
      const float buf = c.first ? d : fadd(fmul(momentum, s[0]), fmul(one_minus_dampening, d));
      d = nesterov ? fadd(d, fmul(momentum, buf)) : buf;
      s[0] = buf;
    }
    if (wd_after) d = fadd(d, fmul(weight_decay, p));
    return fsub(p, fmul(c.lr, d));
  }
};

void multi_tensor_sgd_cuda(at::TensorList params, at::TensorList grads,
                           at::TensorList momentum_buffers, at::TensorList model_params,
                           const at::Tensor& step, double lr, double momentum, double dampening,
                           double weight_decay, bool nesterov, bool wd_after_momentum,
                           const c10::optional<at::Tensor>& grad_scale,
                           const c10::optional<at::Tensor>& found_inf,
                           const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_sgd_";
  const bool has_momentum = momentum != 0.0;
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"momentum_buffers", momentum_buffers},
           {"model_params", model_params}},
      has_momentum ? std::initializer_list<const char*>{"model_params"}
                   : std::initializer_list<const char*>{"model_params", "momentum_buffers"});
  check_fp32_list(op, "momentum_buffers", momentum_buffers);
  check_one_dtype(op, "params", params);
  check_one_dtype(op, "grads", grads);
  check_one_dtype(op, "model_params", model_params);
  check_step(op, step, device, !params.empty());
  const DeviceGuard guard(step.device());

  auto run = [&](auto momentum_tag) {
    constexpr bool kMomentum = decltype(momentum_tag)::value;
    SgdOp<kMomentum> s;
    s.found_inf = optional_ptr(op, "found_inf", found_inf, step.device());
    s.grad_scale = optional_ptr(op, "grad_scale", grad_scale, step.device());
    s.step = step.data_ptr<float>();
    s.lr = make_lr(op, lr, lr_tensor, step.device());
    s.momentum = static_cast<float>(momentum);
    s.one_minus_dampening = static_cast<float>(1.0 - dampening);
    s.weight_decay = static_cast<float>(weight_decay);
    s.wd_before = weight_decay != 0.0 && !wd_after_momentum;
    s.wd_after = weight_decay != 0.0 && wd_after_momentum;
    s.nesterov = nesterov;
    if (!params.empty()) {
      dispatch_dtype(params, [&](auto* p_tag) {
        dispatch_dtype(grads, [&](auto* g_tag) {
          dispatch_dtype_opt(model_params, [&](auto* m_tag) {
            using P = std::remove_pointer_t<decltype(p_tag)>;
            using G = std::remove_pointer_t<decltype(g_tag)>;
            using M = std::remove_pointer_t<decltype(m_tag)>;
            if constexpr (kMomentum) {
              launch_elementwise<SgdOp<true>, P, G, M, 1>(
                  "sgd_momentum", {params, grads, momentum_buffers, model_params}, s);
            } else {
              launch_elementwise<SgdOp<false>, P, G, M, 0>("sgd",
                                                           {params, grads, model_params}, s);
            }
          });
        });
      });
    }
    // After the update kernels: they read step to tell the first update.
    launch_increment_step(step, s.found_inf);
  };
  if (has_momentum) run(std::true_type{});
  else run(std::false_type{});
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_sgd_", &mp_wrappers::cuda::multi_tensor_sgd_cuda);
}
