// CUDA kernel of update_scale_hysteresis_: the loss-scale update runs on the device in one thread,
// reading found_inf there, so a training step never waits for the GPU. The rules live in
// mp_wrappers/scale_update.h, shared with the CPU kernel.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mp_wrappers/cuda/multi_tensor_apply.cuh"
#include "mp_wrappers/op_args.h"
#include "mp_wrappers/scale_update.h"

namespace mp_wrappers {
namespace cuda {
namespace {

// The state is loaded into registers and stored back through the kernels' load/store helpers.
template <class I>
__global__ void update_scale_hysteresis_kernel(float* scale, I* growth_tracker,
                                               I* hysteresis_tracker, const float* found_inf,
                                               ScaleUpdateParams params) {
  float s = ld(scale);
  I growth = ld(growth_tracker), hyst = ld(hysteresis_tracker);
  update_scale_hysteresis_step(&s, &growth, &hyst, ld(found_inf), params);
  st(scale, s);
  st(growth_tracker, growth);
  st(hysteresis_tracker, hyst);
}

template <class I>
void launch_update(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   const ScaleUpdateParams& params) {
  launch("update_scale_hysteresis", &update_scale_hysteresis_kernel<I>, 1, 1, current_stream(),
         scale.data_ptr<float>(), growth_tracker.data_ptr<I>(), hysteresis_tracker.data_ptr<I>(),
         found_inf.data_ptr<float>(), params);
}

void update_scale_hysteresis_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                  const at::Tensor& hysteresis_tracker,
                                  const at::Tensor& found_inf, double growth_factor,
                                  double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis, double min_scale, double max_scale) {
  const ScaleUpdateParams params = update_scale_hysteresis_args(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale);
  const DeviceGuard guard(scale.device());
  if (growth_tracker.scalar_type() == at::kInt) {
    launch_update<int32_t>(scale, growth_tracker, hysteresis_tracker, found_inf, params);
  } else {
    launch_update<int64_t>(scale, growth_tracker, hysteresis_tracker, found_inf, params);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("update_scale_hysteresis_", &mp_wrappers::cuda::update_scale_hysteresis_cuda);
}
