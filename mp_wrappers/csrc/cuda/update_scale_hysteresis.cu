// CUDA kernel of update_scale_hysteresis_: the loss-scale update runs on the device in one thread,
// reading found_inf there, so a training step never waits for the GPU. The rules live in
// mp_wrappers/scale_update.h, shared with the CPU kernel.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "mp_wrappers/scale_update.h"

namespace mp_wrappers {
namespace cuda {
namespace {

template <class I>
__global__ void update_scale_hysteresis_kernel(float* scale, I* growth_tracker,
                                               I* hysteresis_tracker, const float* found_inf,
                                               ScaleUpdateParams params) {
  update_scale_hysteresis_step(scale, growth_tracker, hysteresis_tracker, *found_inf, params);
}

void update_scale_hysteresis_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                  const at::Tensor& hysteresis_tracker,
                                  const at::Tensor& found_inf, double growth_factor,
                                  double backoff_factor, int64_t growth_interval,
                                  int64_t hysteresis, double min_scale, double max_scale) {
  check_scale_update_args("update_scale_hysteresis_", scale, growth_tracker, hysteresis_tracker,
                          found_inf, growth_interval, hysteresis);
  const c10::cuda::CUDAGuard guard(scale.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ScaleUpdateParams params = make_scale_update_params(
      growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  if (growth_tracker.scalar_type() == at::kInt) {
    update_scale_hysteresis_kernel<<<1, 1, 0, stream>>>(
        scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
        hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), params);
  } else {
    update_scale_hysteresis_kernel<<<1, 1, 0, stream>>>(
        scale.data_ptr<float>(), growth_tracker.data_ptr<int64_t>(),
        hysteresis_tracker.data_ptr<int64_t>(), found_inf.data_ptr<float>(), params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CUDA, m) {
  m.impl("update_scale_hysteresis_", &mp_wrappers::cuda::update_scale_hysteresis_cuda);
}
