// The argument set-up of every op, written once for both of its entry points: the CPU kernel
// (cpu/*.cpp) and the CUDA kernel (cuda/*.cu, which the host-execution test build compiles too).
// Each <op>_args() checks the tensor lists (length, dtype, device, size, layout), the scalar
// tensors and the scalar arguments, in one order, and packs what both kernels need: the device, the
// pointers of the optional scalar tensors, and the hyperparameters rounded to fp32 once. The entry
// points then differ only in the kernel they launch (the CPU kernels read the scalar tensors on the
// host, the CUDA kernels on the device).
//
// Only one check depends on the backend (Backend): a CUDA launch dispatches on the dtype of a
// list's first tensor, so there each list must hold one dtype; the CPU kernels dispatch per tensor.
//
// When the lists are empty, the scalar tensors are checked against the device of an anchor tensor
// (step, or the op's scale/flag): the dispatcher chose the kernel from that device, and a call with
// no tensors must still not read a scalar tensor of the wrong shape.
//
// Host code only, included by nvcc-compiled files: ATen/c10 headers and the standard library, no
// device code. c10::optional spelling: Note [optional arguments] in bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/minifloat.h"
#include "mp_wrappers/scale_update.h"
#include "mp_wrappers/torch_compat.h"

namespace mp_wrappers {

enum class Backend { kCpu, kCuda };

// ---- building blocks ----------------------------------------------------------------------------

// State lists (moments, momentum buffers, sums) are float32: the kernels load them as float*.
inline void check_fp32_list(const char* op, const char* name, at::TensorList list) {
  for (size_t i = 0; i < list.size(); ++i)
    TORCH_CHECK(list[i].scalar_type() == at::kFloat, op, ": ", name, "[", i, "] has dtype ",
                list[i].scalar_type(), "; optimizer state must be float32");
}

// One dtype per list, on CUDA only (a launch dispatches on the dtype of the list's first tensor).
inline void check_one_dtype(Backend backend, const char* op,
                            std::initializer_list<NamedTensorList> lists) {
  if (backend != Backend::kCuda) return;
  for (const NamedTensorList& l : lists)
    for (size_t i = 1; i < l.second.size(); ++i)
      TORCH_CHECK(l.second[i].scalar_type() == l.second[0].scalar_type(), op, ": ", l.first,
                  " mixes dtypes ", l.second[0].scalar_type(), " and ", l.second[i].scalar_type(),
                  " (index ", i, "); on CUDA each list must hold one dtype");
}

// The device the scalar tensors must be on: the tensors', or the anchor's when there are none.
inline at::Device call_device(const at::Device& lists_device, bool no_tensors,
                              const at::Tensor& anchor) {
  return no_tensors ? anchor.device() : lists_device;
}

// step: the 1-element float32 counter of applied updates, on the tensors' device.
inline void check_step(const char* op, const at::Tensor& step, const at::Device& device) {
  check_scalar_tensor(op, "step", step, device);
  TORCH_CHECK(step.is_contiguous(), op, ": step (strides ", step.strides(),
              ") must be contiguous");
}

// An optional 1-element float32 tensor: nullptr when absent, else its (checked) data.
inline const float* optional_scalar(const char* op, const char* name,
                                    const c10::optional<at::Tensor>& t, const at::Device& device) {
  if (!(t.has_value() && t->defined())) return nullptr;
  check_scalar_tensor(op, name, *t, device);
  return t->data_ptr<float>();
}

// The scalar tensors of an optimizer update, checked in this order.
struct UpdateScalars {
  const float* grad_scale;  // nullptr: the grads are not scaled
  const float* found_inf;   // nullptr: the update is never skipped
  const float* lr_tensor;   // nullptr: lr is the float below (capturable=False)
  float lr;
};

inline UpdateScalars update_scalars(const char* op, const at::Device& device, double lr,
                                    const c10::optional<at::Tensor>& grad_scale,
                                    const c10::optional<at::Tensor>& found_inf,
                                    const c10::optional<at::Tensor>& lr_tensor) {
  UpdateScalars s;
  s.grad_scale = optional_scalar(op, "grad_scale", grad_scale, device);
  s.found_inf = optional_scalar(op, "found_inf", found_inf, device);
  s.lr_tensor = optional_scalar(op, "lr_tensor", lr_tensor, device);
  s.lr = static_cast<float>(lr);
  return s;
}

// ---- multi-tensor building blocks ---------------------------------------------------------------

inline at::Device multi_tensor_scale_args(at::TensorList inputs, at::TensorList outputs,
                                          const at::Tensor& scale, const at::Tensor& found_inf) {
  constexpr const char* op = "multi_tensor_scale_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"inputs", inputs}, {"outputs", outputs}}), inputs.empty(), scale);
  check_scalar_tensor(op, "scale", scale, device);
  check_found_inf(op, found_inf, device);
  return device;
}

struct AxpbyArgs {
  at::Device device;
  // torch rounds a Python float multiplier to the tensor's fp32 opmath type; so do the kernels.
  float a, b;
  bool check_x, check_y;
};

inline AxpbyArgs multi_tensor_axpby_args(at::TensorList x, at::TensorList y, at::TensorList out,
                                         double a, double b, int64_t arg_to_check,
                                         const at::Tensor& found_inf) {
  constexpr const char* op = "multi_tensor_axpby_";
  TORCH_CHECK(arg_to_check >= -1 && arg_to_check <= 1, op, ": arg_to_check=", arg_to_check,
              "; allowed: -1 (x and y), 0 (x), 1 (y)");
  const at::Device device = call_device(
      check_tensor_lists(op, {{"x", x}, {"y", y}, {"out", out}}), x.empty(), found_inf);
  check_found_inf(op, found_inf, device);
  return AxpbyArgs{device, static_cast<float>(a), static_cast<float>(b), arg_to_check != 1,
                   arg_to_check != 0};
}

inline at::Device multi_tensor_l2norm_args(at::TensorList tensors) {
  return check_tensor_lists("multi_tensor_l2norm", {{"tensors", tensors}});
}

inline at::Device multi_tensor_unscale_l2norm_args(at::TensorList tensors,
                                                   const at::Tensor& inv_scale,
                                                   const at::Tensor& found_inf) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  const at::Device device =
      call_device(check_tensor_lists(op, {{"tensors", tensors}}), tensors.empty(), inv_scale);
  check_scalar_tensor(op, "inv_scale", inv_scale, device);
  check_found_inf(op, found_inf, device);
  return device;
}

inline ScaleUpdateParams update_scale_hysteresis_args(
    const at::Tensor& scale, const at::Tensor& growth_tracker,
    const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf, double growth_factor,
    double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
    double max_scale) {
  check_scale_update_args("update_scale_hysteresis_", scale, growth_tracker, hysteresis_tracker,
                          found_inf, growth_interval, hysteresis);
  return make_scale_update_params(growth_factor, backoff_factor, growth_interval, hysteresis,
                                  min_scale, max_scale);
}

// ---- optimizer updates --------------------------------------------------------------------------
//
// The *Hyper structs hold the hyperparameters as both kernels use them: Python floats rounded to
// fp32 once (as torch does for `tensor * python_float`), (1 - beta) formed in double and rounded
// once (as Python does before torch sees it), the betas also kept in double for the bias
// corrections (_bias_correction in mp_wrappers/ops/reference/_common.py), and the weight-decay
// mode as two flags. Kernel-side structs derive from them, so they are plain data (a CUDA kernel
// argument).

struct AdamHyper {
  double beta1_d, beta2_d;
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool l2, decoupled, use_bias_correction;
};

inline AdamHyper adam_hyper(double beta1, double beta2, double eps, double weight_decay,
                            bool adam_w_mode, bool bias_correction) {
  AdamHyper h;
  h.beta1_d = beta1;
  h.beta2_d = beta2;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.l2 = !adam_w_mode && weight_decay != 0.0;
  h.decoupled = adam_w_mode && weight_decay != 0.0;
  h.use_bias_correction = bias_correction;
  return h;
}

struct SgdHyper {
  float momentum, one_minus_dampening, weight_decay;
  bool has_momentum, nesterov, wd_before, wd_after;
};

inline SgdHyper sgd_hyper(double momentum, double dampening, double weight_decay, bool nesterov,
                          bool wd_after_momentum) {
  SgdHyper h;
  h.momentum = static_cast<float>(momentum);
  h.one_minus_dampening = static_cast<float>(1.0 - dampening);
  h.weight_decay = static_cast<float>(weight_decay);
  h.has_momentum = momentum != 0.0;
  h.nesterov = nesterov;
  h.wd_before = weight_decay != 0.0 && !wd_after_momentum;
  h.wd_after = weight_decay != 0.0 && wd_after_momentum;
  return h;
}

// What every fp32-master update set-up returns: its device, scalar tensors and hyperparameters.
template <class Hyper>
struct UpdateArgs {
  at::Device device;
  UpdateScalars scalars;
  Hyper hyper;
};

inline UpdateArgs<AdamHyper> multi_tensor_adam_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step, double lr,
    double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
    bool bias_correction, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_adam_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
                              {"exp_avg_sqs", exp_avg_sqs}, {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_fp32_list(op, "exp_avgs", exp_avgs);
  check_fp32_list(op, "exp_avg_sqs", exp_avg_sqs);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor),
          adam_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction)};
}

// momentum_buffers may be empty when momentum == 0 (hyper.has_momentum).
inline UpdateArgs<SgdHyper> multi_tensor_sgd_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
    at::TensorList model_params, const at::Tensor& step, double lr, double momentum,
    double dampening, double weight_decay, bool nesterov, bool wd_after_momentum,
    const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf,
    const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_sgd_";
  const SgdHyper hyper = sgd_hyper(momentum, dampening, weight_decay, nesterov, wd_after_momentum);
  const at::Device device = call_device(
      check_tensor_lists(
          op, {{"params", params}, {"grads", grads}, {"momentum_buffers", momentum_buffers},
               {"model_params", model_params}},
          hyper.has_momentum
              ? std::initializer_list<const char*>{"model_params"}
              : std::initializer_list<const char*>{"model_params", "momentum_buffers"}),
      params.empty(), step);
  check_fp32_list(op, "momentum_buffers", momentum_buffers);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor), hyper};
}

struct LambHyper {
  double beta1_d, beta2_d;
  float beta1, beta2, beta3, one_minus_beta2, eps, weight_decay, max_grad_norm;
  bool l2, decoupled, use_bias_correction;
  bool trust_ratio;  // use_nvlamb or weight decay: per-tensor trust ratios, else one fused pass
};

inline UpdateArgs<LambHyper> multi_tensor_lamb_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList model_params, const at::Tensor& step, double lr,
    double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
    bool bias_correction, bool grad_averaging, double max_grad_norm, bool use_nvlamb,
    const at::Tensor& global_grad_norm, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_lamb_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
                              {"exp_avg_sqs", exp_avg_sqs}, {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_fp32_list(op, "exp_avgs", exp_avgs);
  check_fp32_list(op, "exp_avg_sqs", exp_avg_sqs);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  check_scalar_tensor(op, "global_grad_norm", global_grad_norm, device);
  const UpdateScalars scalars = update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor);
  TORCH_CHECK(max_grad_norm >= 0.0, op, ": max_grad_norm=", max_grad_norm,
              "; expected >= 0 (0 disables clipping)");
  LambHyper h;
  h.beta1_d = beta1;
  h.beta2_d = beta2;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.f;
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.max_grad_norm = static_cast<float>(max_grad_norm);
  h.l2 = !adam_w_mode && weight_decay != 0.0;
  h.decoupled = adam_w_mode && weight_decay != 0.0;
  h.use_bias_correction = bias_correction;
  h.trust_ratio = use_nvlamb || weight_decay != 0.0;
  return {device, scalars, h};
}

struct AdagradHyper {
  float eps, weight_decay;
  bool l2, decoupled;
};

inline UpdateArgs<AdagradHyper> multi_tensor_adagrad_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList state_sums,
    at::TensorList model_params, const at::Tensor& step, double lr, double eps,
    double weight_decay, bool adagrad_w_mode, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_adagrad_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"state_sums", state_sums},
                              {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_fp32_list(op, "state_sums", state_sums);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  AdagradHyper h;
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.l2 = !adagrad_w_mode && weight_decay != 0.0;
  h.decoupled = adagrad_w_mode && weight_decay != 0.0;
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor), h};
}

struct NovoHyper {
  double beta1_d, beta2_d;
  float beta1, beta3, beta2, one_minus_beta2, eps, weight_decay;
  bool reg_inside_moment, use_bias_correction;
  bool l2_norm;    // norm_type 2 (else 0: the infinity norm)
  bool init_zero;  // the first update blends into zero norms instead of taking the grad's norm
};

inline UpdateArgs<NovoHyper> multi_tensor_novograd_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    const at::Tensor& exp_avg_sq_norms, at::TensorList model_params, const at::Tensor& step,
    double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
    bool grad_averaging, bool reg_inside_moment, int64_t norm_type, bool init_zero,
    const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf,
    const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_novograd_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
                              {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_fp32_list(op, "exp_avgs", exp_avgs);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  TORCH_CHECK(norm_type == 2 || norm_type == 0, op, ": norm_type=", norm_type,
              "; expected 2 (L2 norm) or 0 (infinity norm)");
  TORCH_CHECK(exp_avg_sq_norms.scalar_type() == at::kFloat && exp_avg_sq_norms.is_contiguous() &&
                  exp_avg_sq_norms.numel() == static_cast<int64_t>(params.size()),
              op, ": exp_avg_sq_norms must be a contiguous float32 tensor with one element per "
              "param (", params.size(), "), got dtype ", exp_avg_sq_norms.scalar_type(), " with ",
              exp_avg_sq_norms.numel(), " elements");
  TORCH_CHECK(exp_avg_sq_norms.device() == device, op, ": exp_avg_sq_norms is on ",
              exp_avg_sq_norms.device(), " but the tensors are on ", device);
  check_step(op, step, device);
  NovoHyper h;
  h.beta1_d = beta1;
  h.beta2_d = beta2;
  h.beta1 = static_cast<float>(beta1);
  h.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.f;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.reg_inside_moment = reg_inside_moment;
  h.use_bias_correction = bias_correction;
  h.l2_norm = norm_type == 2;
  h.init_zero = init_zero;
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor), h};
}

// ---- block-wise 8-bit states (Note [8-bit optimizer states] in mp_wrappers/ops/reference/quant.py)

// uint8 codes, one per element of the parallel param.
inline void check_codes(const char* op, const char* name, at::TensorList codes,
                        at::TensorList params, const at::Device& device) {
  TORCH_CHECK(codes.size() == params.size(), op, ": ", name, " has ", codes.size(),
              " tensors but params has ", params.size(), "; the lists must be parallel");
  for (size_t i = 0; i < codes.size(); ++i) {
    const at::Tensor& t = codes[i];
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kByte && t.is_contiguous() &&
                    t.device() == device && t.numel() == params[i].numel(),
                op, ": ", name, "[", i, "] must be a contiguous uint8 tensor on ", device,
                " with ", params[i].numel(), " elements");
  }
}

// float32 absmaxes, one per quantization block of the parallel param.
inline void check_absmax(const char* op, const char* name, at::TensorList absmax,
                         at::TensorList params, const at::Device& device) {
  TORCH_CHECK(absmax.size() == params.size(), op, ": ", name, " has ", absmax.size(),
              " tensors but params has ", params.size(), "; the lists must be parallel");
  for (size_t i = 0; i < absmax.size(); ++i) {
    const at::Tensor& t = absmax[i];
    const int64_t blocks = quant::num_blocks(params[i].numel());
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.device() == device && t.numel() == blocks,
                op, ": ", name, "[", i, "] must be a contiguous float32 tensor on ", device,
                " with ", blocks, " elements (one per block of ", quant::kBlock, ")");
  }
}

// lr the float, or (capturable=True) read from lr_tensor where the kernel runs.
inline UpdateArgs<AdamHyper> multi_tensor_adam8bit_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_absmaxes, at::TensorList exp_avg_sqs,
    at::TensorList exp_avg_sq_absmaxes, at::TensorList model_params, const at::Tensor& step,
    double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
    bool bias_correction, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_adam8bit_";
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_codes(op, "exp_avgs", exp_avgs, params, device);
  check_codes(op, "exp_avg_sqs", exp_avg_sqs, params, device);
  check_absmax(op, "exp_avg_absmaxes", exp_avg_absmaxes, params, device);
  check_absmax(op, "exp_avg_sq_absmaxes", exp_avg_sq_absmaxes, params, device);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor),
          adam_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction)};
}

// SGD with an 8-bit momentum buffer: momentum must be nonzero (without it there is no buffer).
inline UpdateArgs<SgdHyper> multi_tensor_sgd8bit_args(
    Backend backend, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
    at::TensorList momentum_buffer_absmaxes, at::TensorList model_params, const at::Tensor& step,
    double lr, double momentum, double dampening, double weight_decay, bool nesterov,
    bool wd_after_momentum, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_sgd8bit_";
  const SgdHyper hyper = sgd_hyper(momentum, dampening, weight_decay, nesterov, wd_after_momentum);
  TORCH_CHECK(hyper.has_momentum, op, ": momentum=0 keeps no momentum buffer to quantize; use "
              "multi_tensor_sgd_ (FusedSGD with momentum=0 keeps no state)");
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"model_params", model_params}},
                         {"model_params"}),
      params.empty(), step);
  check_codes(op, "momentum_buffers", momentum_buffers, params, device);
  check_absmax(op, "momentum_buffer_absmaxes", momentum_buffer_absmaxes, params, device);
  check_one_dtype(backend, op,
                  {{"params", params}, {"grads", grads}, {"model_params", model_params}});
  check_step(op, step, device);
  return {device, update_scalars(op, device, lr, grad_scale, found_inf, lr_tensor), hyper};
}

// ---- lean bf16 storage (Note [lean bf16 storage] in mp_wrappers/ops/reference/lean.py) ----------

enum class LeanStorage : int { kSplit = 0, kKahan = 1, kStochastic = 2 };

inline LeanStorage parse_lean_storage(const char* op, c10::string_view name) {
  const std::string s(name);
  if (s == "split") return LeanStorage::kSplit;
  if (s == "kahan") return LeanStorage::kKahan;
  TORCH_CHECK(s == "stochastic", op, ": storage='", s,
              "' is not allowed; expected 'split', 'kahan' or 'stochastic'");
  return LeanStorage::kStochastic;
}

// bfloat16 params; aux as the storage needs it; the state lists all float32 or all bfloat16.
inline void check_lean_lists(const char* op, LeanStorage storage, at::TensorList params,
                             at::TensorList aux, const at::Device& device,
                             std::initializer_list<NamedTensorList> state) {
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(params[i].scalar_type() == at::kBFloat16, op, ": params[", i, "] has dtype ",
                params[i].scalar_type(), "; the lean storages hold bfloat16 params");
  if (storage == LeanStorage::kStochastic) {
    TORCH_CHECK(aux.empty(), op, ": storage='stochastic' keeps no aux state, got ", aux.size(),
                " aux tensors");
  } else {
#if MP_WRAPPERS_HAS_UINT16
    const at::ScalarType want = storage == LeanStorage::kSplit ? at::kUInt16 : at::kBFloat16;
#else
    TORCH_CHECK(storage != LeanStorage::kSplit, op, ": storage='split' needs torch >= 2.3 "
                "(torch.uint16; this build is against torch " MP_WRAPPERS_TORCH_VERSION_STR ")");
    const at::ScalarType want = at::kBFloat16;
#endif
    TORCH_CHECK(aux.size() == params.size(), op, ": aux has ", aux.size(),
                " tensors but params has ", params.size(), "; the lists must be parallel");
    for (size_t i = 0; i < aux.size(); ++i) {
      TORCH_CHECK(aux[i].scalar_type() == want, op, ": aux[", i, "] has dtype ",
                  aux[i].scalar_type(), "; storage='",
                  storage == LeanStorage::kSplit ? "split" : "kahan", "' needs ", want);
      TORCH_CHECK(aux[i].is_contiguous() && aux[i].layout() == at::kStrided, op, ": aux[", i,
                  "] must be a dense contiguous tensor");
      TORCH_CHECK(aux[i].device() == device, op, ": aux[", i, "] is on ", aux[i].device(),
                  " but the params are on ", device);
      TORCH_CHECK(aux[i].numel() == params[i].numel(), op, ": aux[", i, "] has ",
                  aux[i].numel(), " elements but params[", i, "] has ", params[i].numel());
    }
  }
  std::optional<at::ScalarType> state_dtype;
  for (const NamedTensorList& l : state) {
    for (size_t i = 0; i < l.second.size(); ++i) {
      const at::ScalarType t = l.second[i].scalar_type();
      TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, op, ": ", l.first, "[", i,
                  "] has dtype ", t, "; optimizer state must be float32 or bfloat16");
      if (!state_dtype.has_value()) state_dtype = t;
      TORCH_CHECK(t == *state_dtype, op, ": ", l.first, "[", i, "] has dtype ", t,
                  " but other state tensors are ", *state_dtype, "; use one state dtype");
    }
  }
}

template <class Hyper>
struct LeanArgs {
  at::Device device;
  LeanStorage storage;
  UpdateScalars scalars;  // lr_tensor is always nullptr: the lean ops take a float lr
  Hyper hyper;
};

inline LeanArgs<AdamHyper> multi_tensor_adam_lean_args(
    Backend backend, at::TensorList params, at::TensorList aux, at::TensorList grads,
    at::TensorList exp_avgs, at::TensorList exp_avg_sqs, const at::Tensor& step, double lr,
    double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
    bool bias_correction, c10::string_view storage_name,
    const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_adam_lean_";
  const LeanStorage storage = parse_lean_storage(op, storage_name);
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
                              {"exp_avg_sqs", exp_avg_sqs}}),
      params.empty(), step);
  check_lean_lists(op, storage, params, aux, device,
                   {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}});
  check_one_dtype(backend, op, {{"grads", grads}});
  check_step(op, step, device);
  return {device, storage, update_scalars(op, device, lr, grad_scale, found_inf, c10::nullopt),
          adam_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction)};
}

// multi_tensor_adam8bit_lean_'s lists, in its schema's order.
struct Adam8bitLeanLists {
  at::TensorList params, aux, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes;
};
using Adam8bitLeanRun = void (*)(const LeanArgs<AdamHyper>& args, const Adam8bitLeanLists& lists,
                                 const at::Tensor& step, int64_t seed);

// The entry point of multi_tensor_adam8bit_lean_ on kBackend (the schema's signature, once for
// both backends): bf16 params, aux as the storage needs it, the 8-bit state lists as
// multi_tensor_adam8bit_'s; then kRun does the update.
template <Backend kBackend, Adam8bitLeanRun kRun>
void multi_tensor_adam8bit_lean_entry(
    at::TensorList params, at::TensorList aux, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_absmaxes, at::TensorList exp_avg_sqs,
    at::TensorList exp_avg_sq_absmaxes, const at::Tensor& step, double lr, double beta1,
    double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
    c10::string_view storage_name, int64_t seed, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_adam8bit_lean_";
  const LeanStorage storage = parse_lean_storage(op, storage_name);
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}}), params.empty(), step);
  check_lean_lists(op, storage, params, aux, device, {});
  check_codes(op, "exp_avgs", exp_avgs, params, device);
  check_codes(op, "exp_avg_sqs", exp_avg_sqs, params, device);
  check_absmax(op, "exp_avg_absmaxes", exp_avg_absmaxes, params, device);
  check_absmax(op, "exp_avg_sq_absmaxes", exp_avg_sq_absmaxes, params, device);
  check_one_dtype(kBackend, op, {{"grads", grads}});
  check_step(op, step, device);
  kRun({device, storage, update_scalars(op, device, lr, grad_scale, found_inf, c10::nullopt),
        adam_hyper(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction)},
       {params, aux, grads, exp_avgs, exp_avg_absmaxes, exp_avg_sqs, exp_avg_sq_absmaxes}, step,
       seed);
}

// multi_tensor_sgd8bit_lean_: bf16 params, aux as the storage needs it, the 8-bit buffer lists as
// multi_tensor_sgd8bit_'s (momentum must be nonzero).
inline LeanArgs<SgdHyper> multi_tensor_sgd8bit_lean_args(
    Backend backend, at::TensorList params, at::TensorList aux, at::TensorList grads,
    at::TensorList momentum_buffers, at::TensorList momentum_buffer_absmaxes,
    const at::Tensor& step, double lr, double momentum, double dampening, double weight_decay,
    bool nesterov, bool wd_after_momentum, c10::string_view storage_name,
    const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_sgd8bit_lean_";
  const LeanStorage storage = parse_lean_storage(op, storage_name);
  const SgdHyper hyper = sgd_hyper(momentum, dampening, weight_decay, nesterov, wd_after_momentum);
  TORCH_CHECK(hyper.has_momentum, op, ": momentum=0 keeps no momentum buffer to quantize; use "
              "multi_tensor_sgd_lean_ (FusedSGD with momentum=0 keeps no state)");
  const at::Device device = call_device(
      check_tensor_lists(op, {{"params", params}, {"grads", grads}}), params.empty(), step);
  check_lean_lists(op, storage, params, aux, device, {});
  check_codes(op, "momentum_buffers", momentum_buffers, params, device);
  check_absmax(op, "momentum_buffer_absmaxes", momentum_buffer_absmaxes, params, device);
  check_one_dtype(backend, op, {{"grads", grads}});
  check_step(op, step, device);
  return {device, storage, update_scalars(op, device, lr, grad_scale, found_inf, c10::nullopt),
          hyper};
}

inline LeanArgs<SgdHyper> multi_tensor_sgd_lean_args(
    Backend backend, at::TensorList params, at::TensorList aux, at::TensorList grads,
    at::TensorList momentum_buffers, const at::Tensor& step, double lr, double momentum,
    double dampening, double weight_decay, bool nesterov, bool wd_after_momentum,
    c10::string_view storage_name, const c10::optional<at::Tensor>& grad_scale,
    const c10::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_sgd_lean_";
  const LeanStorage storage = parse_lean_storage(op, storage_name);
  const SgdHyper hyper = sgd_hyper(momentum, dampening, weight_decay, nesterov, wd_after_momentum);
  const at::Device device = call_device(
      check_tensor_lists(
          op, {{"params", params}, {"grads", grads}, {"momentum_buffers", momentum_buffers}},
          {"momentum_buffers"}),
      params.empty(), step);
  TORCH_CHECK(!hyper.has_momentum || momentum_buffers.size() == params.size(), op,
              ": momentum_buffers is empty but momentum=", momentum, " needs one per param");
  check_lean_lists(op, storage, params, aux, device, {{"momentum_buffers", momentum_buffers}});
  check_one_dtype(backend, op, {{"grads", grads}});
  check_step(op, step, device);
  return {device, storage, update_scalars(op, device, lr, grad_scale, found_inf, c10::nullopt),
          hyper};
}

}  // namespace mp_wrappers
