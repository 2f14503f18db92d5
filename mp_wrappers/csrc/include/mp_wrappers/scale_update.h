// The dynamic loss-scale update with hysteresis, shared by the CPU kernel and the one-thread CUDA
// kernel so both follow mp_wrappers/ops/reference/multi_tensor.py::update_scale_hysteresis_ to the bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

namespace mp_wrappers {

// The float arguments rounded to fp32 once on the host: torch multiplies an fp32 tensor by a Python
// float in fp32, so the reference does exactly this rounding.
struct ScaleUpdateParams {
  float growth_factor;
  float backoff_factor;
  float min_scale;
  float max_scale;
  int64_t growth_interval;
  int64_t hysteresis;
};

inline ScaleUpdateParams make_scale_update_params(double growth_factor, double backoff_factor,
                                                  int64_t growth_interval, int64_t hysteresis,
                                                  double min_scale, double max_scale) {
  return {static_cast<float>(growth_factor), static_cast<float>(backoff_factor),
          static_cast<float>(min_scale), static_cast<float>(max_scale), growth_interval,
          hysteresis};
}

inline void check_scale_update_args(const char* op, const at::Tensor& scale,
                                    const at::Tensor& growth_tracker,
                                    const at::Tensor& hysteresis_tracker,
                                    const at::Tensor& found_inf, int64_t growth_interval,
                                    int64_t hysteresis) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat, op,
              ": scale must be a 1-element float32 tensor, got dtype ", scale.scalar_type(),
              " with ", scale.numel(), " elements");
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, op,
              ": found_inf must be a 1-element float32 tensor, got dtype ",
              found_inf.scalar_type(), " with ", found_inf.numel(), " elements");
  for (const auto& named : {std::make_pair("growth_tracker", &growth_tracker),
                            std::make_pair("hysteresis_tracker", &hysteresis_tracker)}) {
    const at::Tensor& t = *named.second;
    TORCH_CHECK(t.numel() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
                op, ": ", named.first, " must be a 1-element int32 (or int64) tensor, got dtype ",
                t.scalar_type(), " with ", t.numel(), " elements");
  }
  TORCH_CHECK(growth_tracker.scalar_type() == hysteresis_tracker.scalar_type(), op,
              ": growth_tracker (", growth_tracker.scalar_type(), ") and hysteresis_tracker (",
              hysteresis_tracker.scalar_type(), ") must have the same dtype");
  for (const auto& named : {std::make_pair("growth_tracker", &growth_tracker),
                            std::make_pair("hysteresis_tracker", &hysteresis_tracker),
                            std::make_pair("found_inf", &found_inf)}) {
    TORCH_CHECK(named.second->device() == scale.device(), op, ": ", named.first, " is on ",
                named.second->device(), " but scale is on ", scale.device());
  }
  TORCH_CHECK(growth_interval > 0, op, ": growth_interval must be positive, got ",
              growth_interval);
  (void)hysteresis;
}

// One update; see the reference's docstring for the rules. NaN handling follows torch: a NaN scale
// stays NaN through clamp, and "finite" excludes both inf and NaN.
template <class I>
C10_HOST_DEVICE inline void update_scale_hysteresis_step(float* scale, I* growth_tracker,
                                                         I* hysteresis_tracker, float found_inf,
                                                         const ScaleUpdateParams& p) {
  const float s = *scale;
  const bool overflow = found_inf > 0.f;
  const I hyst_left = overflow ? static_cast<I>(*hysteresis_tracker - 1)
                               : static_cast<I>(p.hysteresis);
  const bool backoff = overflow && hyst_left <= 0;
  const I grown = static_cast<I>(*growth_tracker + 1);
  const bool grow = !overflow && static_cast<int64_t>(grown) >= p.growth_interval;
  float down = s * p.backoff_factor;
  down = down < p.min_scale ? p.min_scale : down;  // clamp(min=...), NaN passes through
  float up = s * p.growth_factor;
  up = up > p.max_scale ? p.max_scale : up;
  if (!(fabsf(up) <= FLT_MAX)) up = s;  // never grow to inf (or NaN)
  *scale = backoff ? down : (grow ? up : s);
  *growth_tracker = (overflow || grow) ? I(0) : grown;
  *hysteresis_tracker = hyst_left;
}

}  // namespace mp_wrappers
