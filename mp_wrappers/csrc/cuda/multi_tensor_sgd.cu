// CUDA kernel of multi_tensor_sgd_ (torch.optim.SGD math plus apex's wd_after_momentum; semantics
// and op order: mp_wrappers/ops/reference/optimizers.py::multi_tensor_sgd_). One element-wise pass; whether
// this is the first applied update (buffer := direction) is read from step on the device.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp

#include <optional>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

// kMomentum: one state list (the buffers) or none (momentum == 0, buffers may be absent).
template <bool kMomentum>
struct SgdOp : SgdHyper {
  static constexpr bool kWritesState = true;
  static constexpr bool kUnscaleOnLoad = true;  // Note in optim_apply.cuh: no spill for sm_121
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  DeviceLr lr;

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
    float d = g;  // unscaled as it was loaded (kUnscaleOnLoad)
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
  const UpdateArgs<SgdHyper> args = multi_tensor_sgd_args(
      Backend::kCuda, params, grads, momentum_buffers, model_params, step, lr, momentum, dampening,
      weight_decay, nesterov, wd_after_momentum, grad_scale, found_inf, lr_tensor);
  const DeviceGuard guard(step.device());

  auto run = [&](auto momentum_tag) {
    constexpr bool kMomentum = decltype(momentum_tag)::value;
    const SgdOp<kMomentum> s{{args.hyper}, args.scalars.found_inf, args.scalars.grad_scale,
                             step.data_ptr<float>(), device_lr(args.scalars)};
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
  if (args.hyper.has_momentum) run(std::true_type{});
  else run(std::false_type{});
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_sgd_", &mp_wrappers::cuda::multi_tensor_sgd_cuda);
}
