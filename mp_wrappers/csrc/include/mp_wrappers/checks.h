// Argument validation shared by the CPU and CUDA kernels of every multi-tensor op.
//
// The Python API (mp_wrappers/ops/_dispatch.py) validates the same things with Python exceptions;
// these checks guard direct torch.ops.mp_wrappers.* calls, where a wrong argument would otherwise
// read out of bounds. Messages name the op, the argument, the index and the offending value.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace mp_wrappers {

// Storage dtypes of the tensors the kernels read and write. Kernels switch on this once per chunk
// (CPU) or per launch (CUDA), never per element.
enum class StorageDtype : int8_t { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

inline bool is_storage_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline StorageDtype storage_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return StorageDtype::kHalf;
    case at::kBFloat16: return StorageDtype::kBFloat16;
    default: return StorageDtype::kFloat;
  }
}

// A named tensor list, e.g. {"inputs", inputs}.
using NamedTensorList = std::pair<const char*, at::TensorList>;

// Parallel tensor lists: the same length, every tensor dense, contiguous, float32/float16/bfloat16
// and on one device, and tensors at the same index with the same number of elements. A list whose
// name is in `optional` may also be empty (e.g. model_params of the fused optimizer steps).
// Returns the common device (CPU when every list is empty).
inline at::Device check_tensor_lists(const char* op, std::initializer_list<NamedTensorList> lists,
                                     std::initializer_list<const char*> optional = {}) {
  TORCH_CHECK(lists.size() > 0, op, ": no tensor lists given");
  const NamedTensorList& ref = *lists.begin();
  auto is_optional = [&](const char* name) {
    for (const char* o : optional)
      if (std::string(o) == name) return true;
    return false;
  };
  for (const NamedTensorList& l : lists) {
    if (is_optional(l.first) && l.second.empty()) continue;
    TORCH_CHECK(l.second.size() == ref.second.size(), op, ": ", l.first, " has ", l.second.size(),
                " tensors but ", ref.first, " has ", ref.second.size(),
                "; the lists must be parallel");
  }
  std::optional<at::Device> device;
  for (const NamedTensorList& l : lists) {
    for (size_t i = 0; i < l.second.size(); ++i) {
      const at::Tensor& t = l.second[i];
      TORCH_CHECK(t.defined(), op, ": ", l.first, "[", i, "] is an undefined tensor");
      TORCH_CHECK(t.layout() == at::kStrided, op, ": ", l.first, "[", i, "] has layout ",
                  t.layout(), "; only dense (strided) tensors are supported");
      TORCH_CHECK(is_storage_dtype(t.scalar_type()), op, ": ", l.first, "[", i, "] has dtype ",
                  t.scalar_type(), "; expected Float, Half or BFloat16");
      TORCH_CHECK(t.is_contiguous(), op, ": ", l.first, "[", i, "] (sizes ", t.sizes(),
                  ", strides ", t.strides(), ") is not contiguous; call .contiguous() first");
      if (!device.has_value()) device = t.device();
      TORCH_CHECK(t.device() == *device, op, ": ", l.first, "[", i, "] is on ", t.device(),
                  " but the other tensors are on ", *device,
                  "; all tensors of one call must share a device");
      TORCH_CHECK(t.numel() == ref.second[i].numel(), op, ": ", l.first, "[", i, "] has ",
                  t.numel(), " elements but ", ref.first, "[", i, "] has ",
                  ref.second[i].numel());
    }
  }
  return device.value_or(at::Device(at::kCPU));
}

// found_inf: the 1-element float32 overflow flag, on the tensors' device.
inline void check_found_inf(const char* op, const at::Tensor& found_inf, const at::Device& device,
                            const char* name = "found_inf") {
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, op, ": ", name,
              " must be a 1-element float32 tensor, got dtype ", found_inf.scalar_type(),
              " with ", found_inf.numel(), " elements");
  TORCH_CHECK(found_inf.device() == device, op, ": ", name, " is on ", found_inf.device(),
              " but the tensors are on ", device);
}

// A 1-element float32 tensor argument such as scale or inv_scale.
inline void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t,
                                const at::Device& device) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a 1-element float32 tensor, got dtype ", t.scalar_type(), " with ",
              t.numel(), " elements");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but the tensors are on ", device);
}

}  // namespace mp_wrappers
