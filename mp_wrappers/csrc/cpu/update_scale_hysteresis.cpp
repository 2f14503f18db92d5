// CPU kernel of update_scale_hysteresis_: one dynamic loss-scale update (DeepSpeed/Megatron-style
// hysteresis, apex amp's scaler when hysteresis == 1). Semantics: mp_wrappers/ops/reference/multi_tensor.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "mp_wrappers/op_args.h"
#include "mp_wrappers/scale_update.h"

namespace mp_wrappers {
namespace cpu {
namespace {

void update_scale_hysteresis_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                 const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                 double growth_factor, double backoff_factor,
                                 int64_t growth_interval, int64_t hysteresis, double min_scale,
                                 double max_scale) {
  const ScaleUpdateParams params = update_scale_hysteresis_args(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale);
  float* s = scale.data_ptr<float>();
  const float flag = *found_inf.data_ptr<float>();
  if (growth_tracker.scalar_type() == at::kInt) {
    update_scale_hysteresis_step(s, growth_tracker.data_ptr<int32_t>(),
                                 hysteresis_tracker.data_ptr<int32_t>(), flag, params);
  } else {
    update_scale_hysteresis_step(s, growth_tracker.data_ptr<int64_t>(),
                                 hysteresis_tracker.data_ptr<int64_t>(), flag, params);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CPU, m) {
  m.impl("update_scale_hysteresis_", &mp_wrappers::cpu::update_scale_hysteresis_cpu);
}
