// The one place where every mp_wrappers op schema is declared.
//
// Each kernel file registers only its own implementations with TORCH_LIBRARY_IMPL (cpu/*.cpp for
// CPU, cuda/*.cu for CUDA), so a CPU-only build simply leaves the .cu files out and the dispatcher
// picks the device. Python calls the ops as torch.ops.mp_wrappers.<name>; mp_wrappers/ops holds the
// pure-PyTorch reference of every op (same signature) and the single place that chooses between them.
//
// Conventions shared by all ops (see mp_wrappers/ops/reference/ for the executable definition):
//   * found_inf is a 1-element float32 tensor on the tensors' device. Kernels set it to 1 when they
//     see a non-finite value and never clear it, so one flag can be accumulated across calls.
//   * Update ops take optional grad_scale / found_inf tensors: grads are divided by grad_scale inside
//     the kernel, and when found_inf is nonzero the whole update, step counter included, is skipped on
//     the device, with no host synchronisation.
//   * step is a 1-element float32 tensor per parameter group, incremented by the kernel only when the
//     update is applied.
//   * model_params is either empty or parallel to params: after the update the new fp32 master value is
//     also written, rounded, into the fp16/bf16 model copy (the fused mixed-precision step).
//   * Tensor lists must match in length, device and numel, and every tensor must be contiguous.
//
// Note [optional arguments]
//   A `Tensor?` argument is received as `c10::optional<at::Tensor>`, never `std::optional`: torch
//   2.1-2.3's schema inference (ATen/core/ivalue_inl.h) recognises only c10::optional, then a class
//   of its own (std::optional fails to compile there: "no type named 'element_type'"), and from
//   torch 2.4 on c10::optional is an alias of std::optional, so the spelling works on every torch
//   we support (docs/compatibility.md).
#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "mp_wrappers/cpu_features.h"
#include "mp_wrappers/slot_check.h"

TORCH_LIBRARY(mp_wrappers, m) {
  // ---- multi-tensor building blocks -------------------------------------------------------------
  m.def("multi_tensor_scale_(Tensor[] inputs, Tensor(a!)[] outputs, Tensor scale, "
        "Tensor(b!) found_inf) -> ()");
  m.def("multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)");
  m.def("multi_tensor_unscale_l2norm(Tensor[] tensors, Tensor inv_scale, Tensor(a!) found_inf, "
        "bool per_tensor) -> (Tensor, Tensor)");
  m.def("multi_tensor_axpby_(Tensor[] x, Tensor[] y, Tensor(a!)[] out, float a, float b, "
        "int arg_to_check, Tensor(b!) found_inf) -> ()");
  m.def("update_scale_hysteresis_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
        "float max_scale) -> ()");

  // ---- optimizer updates ------------------------------------------------------------------------
  // Executable definitions: mp_wrappers/ops/reference/optimizers.py (conventions: reference/_common.py).
  // Math is fp32 on fp32 state; grads are divided by grad_scale first; a nonzero found_inf leaves
  // every output bit-identical. Each list holds one dtype (the Python entry points check it, and the
  // optimizers bucket by dtype). multi_tensor_sgd_'s momentum_buffers is empty when momentum == 0;
  // it sets buf = grad while step == 0. exp_avg_sq_norms has one element per tensor. lr_tensor, when
  // given, is a 1-element float32 tensor the kernels read lr from (on the device, at run time: a
  // CUDA graph replays with its current value) in place of the float lr (capturable=True).
  m.def("multi_tensor_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor(e!) step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
        "bool bias_correction, Tensor? grad_scale, Tensor? found_inf, "
        "Tensor? lr_tensor=None) -> ()");
  m.def("multi_tensor_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
        "Tensor(c!)[] model_params, Tensor(d!) step, float lr, float momentum, float dampening, "
        "float weight_decay, bool nesterov, bool wd_after_momentum, Tensor? grad_scale, "
        "Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  m.def("multi_tensor_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, Tensor(e!) step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
        "bool bias_correction, bool grad_averaging, float max_grad_norm, bool use_nvlamb, "
        "Tensor global_grad_norm, Tensor? grad_scale, Tensor? found_inf, "
        "Tensor? lr_tensor=None) -> ()");
  m.def("multi_tensor_adagrad_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
        "Tensor(c!)[] model_params, Tensor(d!) step, float lr, float eps, float weight_decay, "
        "bool adagrad_w_mode, Tensor? grad_scale, Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  m.def("multi_tensor_novograd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!) exp_avg_sq_norms, Tensor(d!)[] model_params, Tensor(e!) step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool bias_correction, "
        "bool grad_averaging, bool reg_inside_moment, int norm_type, bool init_zero, "
        "Tensor? grad_scale, Tensor? found_inf, Tensor? lr_tensor=None) -> ()");

  // ---- lean bf16 storage: optimizer updates without a separate fp32 master -----------------------
  // Executable definitions: mp_wrappers/ops/reference/lean.py (Note [lean bf16 storage]). params
  // are bfloat16; storage is 'split' (aux: uint16 low halves, params + aux ARE the fp32 master),
  // 'kahan' (aux: bfloat16 compensation) or 'stochastic' (aux empty; seed keys the rounding hash).
  // State lists are float32 or bfloat16. Otherwise the conventions of the updates above.
  m.def("multi_tensor_adam_lean_(Tensor(a!)[] params, Tensor(b!)[] aux, Tensor[] grads, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!) step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
        "bool bias_correction, str storage, int seed, Tensor? grad_scale, "
        "Tensor? found_inf) -> ()");
  m.def("multi_tensor_sgd_lean_(Tensor(a!)[] params, Tensor(b!)[] aux, Tensor[] grads, "
        "Tensor(c!)[] momentum_buffers, Tensor(d!) step, float lr, float momentum, "
        "float dampening, float weight_decay, bool nesterov, bool wd_after_momentum, "
        "str storage, int seed, Tensor? grad_scale, Tensor? found_inf) -> ()");
  // ---- block-wise 8-bit optimizer states ------------------------------------------------------------
  // Executable definition: mp_wrappers/ops/reference/quant.py (Note [8-bit optimizer states]).
  // exp_avgs / exp_avg_sqs are uint8 codes with the params' element counts, their absmax lists
  // float32 with one element per block of 256. Otherwise the conventions of multi_tensor_adam_.
  m.def("multi_tensor_adam8bit_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_absmaxes, Tensor(d!)[] exp_avg_sqs, "
        "Tensor(e!)[] exp_avg_sq_absmaxes, Tensor(f!)[] model_params, Tensor(g!) step, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, bool adam_w_mode, "
        "bool bias_correction, Tensor? grad_scale, Tensor? found_inf, "
        "Tensor? lr_tensor=None) -> ()");
  // SGD with an 8-bit momentum buffer (momentum != 0): uint8 codes and their float32 absmax
  // lists as above; otherwise the conventions of multi_tensor_sgd_ (reference/quant.py
  // multi_tensor_sgd8bit_).
  m.def("multi_tensor_sgd8bit_(Tensor(a!)[] params, Tensor[] grads, "
        "Tensor(b!)[] momentum_buffers, Tensor(c!)[] momentum_buffer_absmaxes, "
        "Tensor(d!)[] model_params, Tensor(e!) step, float lr, float momentum, "
        "float dampening, float weight_decay, bool nesterov, bool wd_after_momentum, "
        "Tensor? grad_scale, Tensor? found_inf, Tensor? lr_tensor=None) -> ()");
  // The same on bfloat16 params stored the lean way (storage, aux and seed as in
  // multi_tensor_adam_lean_); reference/quant.py multi_tensor_adam8bit_lean_.
  m.def("multi_tensor_adam8bit_lean_(Tensor(a!)[] params, Tensor(b!)[] aux, Tensor[] grads, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_absmaxes, Tensor(e!)[] exp_avg_sqs, "
        "Tensor(f!)[] exp_avg_sq_absmaxes, Tensor(g!) step, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, bool adam_w_mode, bool bias_correction, str storage, "
        "int seed, Tensor? grad_scale, Tensor? found_inf) -> ()");
  // multi_tensor_sgd8bit_ on bfloat16 params stored the lean way (storage, aux and seed as in
  // multi_tensor_sgd_lean_); reference/quant.py multi_tensor_sgd8bit_lean_.
  m.def("multi_tensor_sgd8bit_lean_(Tensor(a!)[] params, Tensor(b!)[] aux, Tensor[] grads, "
        "Tensor(c!)[] momentum_buffers, Tensor(d!)[] momentum_buffer_absmaxes, Tensor(e!) step, "
        "float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
        "bool wd_after_momentum, str storage, int seed, Tensor? grad_scale, "
        "Tensor? found_inf) -> ()");
}

// pybind11 only makes the module importable (importing it runs the registrations above) and carries
// build facts that Python reports through mp_wrappers.ops.backend().
PYBIND11_MODULE(_C, m) {
  m.doc() = "mp_wrappers C++ extension: registers the torch.ops.mp_wrappers operators";
#ifdef MP_WRAPPERS_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.def("cpu_isa", &mp_wrappers::cpu_isa_name,
        "The instruction set the CPU kernels selected at run time (avx512, avx2 or baseline).");
#if defined(__clang__)
  m.attr("compiler") = "clang " __clang_version__;
#elif defined(__GNUC__)
  m.attr("compiler") = "gcc " __VERSION__;
#elif defined(_MSC_VER)
  m.attr("compiler") = "msvc " + std::to_string(_MSC_VER);
#endif
  m.def("cpu_isa_hardware", &mp_wrappers::cpu_isa_hardware_name,
        "The widest instruction set this CPU can run (ignores MP_WRAPPERS_CPU_ISA).");
  m.def("_set_cpu_isa", &mp_wrappers::set_cpu_isa,
        "Switch the CPU kernels' instruction set (tests); returns the previous one's name.");
  m.def(
      "slots_dense",
      [](pybind11::handle targets, pybind11::handle grads, pybind11::handle models,
         pybind11::handle states, pybind11::handle allowed) {
        return mp_wrappers::slots_dense(targets.ptr(), grads.ptr(), models.ptr(), states.ptr(),
                                        allowed.ptr());
      },
      "Whether a fused step's lists can go to an op as they are (mp_wrappers.ops.slots).",
      pybind11::arg("targets"), pybind11::arg("grads"), pybind11::arg("models"),
      pybind11::arg("states"), pybind11::arg("allowed"));
}
