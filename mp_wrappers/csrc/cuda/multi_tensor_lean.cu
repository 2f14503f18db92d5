// CUDA kernels of multi_tensor_adam_lean_ and multi_tensor_sgd_lean_ (Note [lean bf16 storage] in
// mp_wrappers/ops/reference_lean.py; the CPU twins are cpu/multi_tensor_lean.cpp). Written on
// today's optim_apply.cuh pattern: its launch planner (for_each_launch, BlockChunk), its IEEE
// round-to-nearest arithmetic (immune to --use_fast_math) and its device-side skip, unscale, bias
// correction and step increment. One thread per element of a 64K-element chunk (guarded, no vector
// path): the aux and state lists mix 2- and 4-byte types. found_inf, grad_scale and step are read on
// the device; the stochastic key uses the update number read there too, so no host sync.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/optim_apply.cuh"

namespace mp_wrappers {
namespace cuda_optim {
namespace {

enum Storage : int { kSplit = 0, kKahan = 1, kStochastic = 2 };

// The hash of reference_lean.stochastic_bits (same constants as cpu_lean.h).
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  return x ^ (x >> 16);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion, as the CPU kernels store).
__device__ __forceinline__ uint16_t float_to_bf16_bits(float x) {
  return c10::BFloat16(x).x;
}

struct LeanParams {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  int storage;
  uint32_t seed;
};

// Reads the fp32 value of element i of a lean bf16 param.
__device__ __forceinline__ float lean_load(int storage, const uint16_t* p, const void* aux,
                                           int64_t i) {
  if (storage == kSplit)
    return __uint_as_float((static_cast<uint32_t>(p[i]) << 16) |
                           static_cast<const uint16_t*>(aux)[i]);
  return bf16_bits_to_float(p[i]);
}

// Writes p32 - step into element i the storage's way (Note [lean bf16 storage]).
__device__ __forceinline__ void lean_store(int storage, uint16_t* p, void* aux, int64_t i,
                                           float p32, float step, uint32_t key) {
  if (storage == kKahan) {
    uint16_t* comp = static_cast<uint16_t*>(aux);
    const float c = fsub(bf16_bits_to_float(comp[i]), step);
    const uint16_t rounded = float_to_bf16_bits(fadd(p32, c));
    p[i] = rounded;
    comp[i] = float_to_bf16_bits(fsub(c, fsub(bf16_bits_to_float(rounded), p32)));
    return;
  }
  const float x = fsub(p32, step);
  const uint32_t bits = __float_as_uint(x);
  if (storage == kSplit) {
    p[i] = static_cast<uint16_t>(bits >> 16);
    static_cast<uint16_t*>(aux)[i] = static_cast<uint16_t>(bits & 0xFFFFu);
  } else {
    const uint32_t r = mix32(static_cast<uint32_t>(i) ^ key);
    p[i] = isnan(x) ? static_cast<uint16_t>(0x7FC0u)
                    : static_cast<uint16_t>((bits + (r & 0xFFFFu)) >> 16);
  }
}

__device__ __forceinline__ uint32_t lean_key(const LeanParams& lp, float count, int32_t index) {
  const uint32_t c = static_cast<uint32_t>(static_cast<int64_t>(count));
  return mix32(mix32(lp.seed ^ mix32(c)) ^ (static_cast<uint32_t>(index) * 0x9E3779B1u));
}

template <class T>
__device__ __forceinline__ float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <class T>
__device__ __forceinline__ void st(T* p, int64_t i, float x) {
  p[i] = static_cast<T>(x);
}

// ---- Adam: lists [params, aux, grads, exp_avgs, exp_avg_sqs] ------------------------------------
struct AdamLeanArgs {
  LeanParams lp;
  double beta1_d, beta2_d;
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool l2, decoupled, use_bias_correction;
};

template <class G, class S>
__global__ void __launch_bounds__(kBlockSize)
    adam_lean_kernel(TensorListMeta<5> meta, AdamLeanArgs a) {
  if (skip_update(a.lp.found_inf)) return;
  const BlockChunk<5> ch(meta);
  const float count = fadd(*a.lp.step, 1.f);
  const float bc1 = bias_correction(a.beta1_d, count, a.use_bias_correction);
  const float bc2 = bias_correction(a.beta2_d, count, a.use_bias_correction);
  const DeviceUnscale unscale(a.lp.grad_scale);
  const uint32_t key = lean_key(a.lp, count, ch.tensor_index);
  const int loc = ch.tensor_loc;
  uint16_t* p = static_cast<uint16_t*>(meta.addresses[0][loc]);
  void* aux = meta.addresses[1][loc];
  const G* g = static_cast<const G*>(meta.addresses[2][loc]);
  S* m = static_cast<S*>(meta.addresses[3][loc]);
  S* v = static_cast<S*>(meta.addresses[4][loc]);
  for (int64_t j = threadIdx.x; j < ch.n; j += blockDim.x) {
    const int64_t i = ch.offset + j;  // element index in the tensor (the stochastic hash input)
    const float p32 = lean_load(a.lp.storage, p, aux, i);
    float gr = unscale(ld(g, i));
    if (a.l2) gr = fadd(gr, fmul(a.weight_decay, p32));
    const float mn = fadd(fmul(a.beta1, ld(m, i)), fmul(a.one_minus_beta1, gr));
    const float vn = fadd(fmul(a.beta2, ld(v, i)), fmul(fmul(a.one_minus_beta2, gr), gr));
    float u = fdiv(fdiv(mn, bc1), fadd(fsqrt(fdiv(vn, bc2)), a.eps));
    if (a.decoupled) u = fadd(u, fmul(a.weight_decay, p32));
    st(m, i, mn);
    st(v, i, vn);
    lean_store(a.lp.storage, p, aux, i, p32, fmul(a.lr, u), key);
  }
}

// ---- SGD: lists [params, aux, grads, momentum_buffers] ------------------------------------------
struct SgdLeanArgs {
  LeanParams lp;
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, wd_before, wd_after, has_momentum;
};

template <class G, class S>
__global__ void __launch_bounds__(kBlockSize)
    sgd_lean_kernel(TensorListMeta<4> meta, SgdLeanArgs a) {
  if (skip_update(a.lp.found_inf)) return;
  const BlockChunk<4> ch(meta);
  const float count = fadd(*a.lp.step, 1.f);
  const bool first = *a.lp.step == 0.f;
  const DeviceUnscale unscale(a.lp.grad_scale);
  const uint32_t key = lean_key(a.lp, count, ch.tensor_index);
  const int loc = ch.tensor_loc;
  uint16_t* p = static_cast<uint16_t*>(meta.addresses[0][loc]);
  void* aux = meta.addresses[1][loc];
  const G* g = static_cast<const G*>(meta.addresses[2][loc]);
  S* buf = static_cast<S*>(meta.addresses[3][loc]);
  for (int64_t j = threadIdx.x; j < ch.n; j += blockDim.x) {
    const int64_t i = ch.offset + j;
    const float p32 = lean_load(a.lp.storage, p, aux, i);
    float d = unscale(ld(g, i));
    if (a.wd_before) d = fadd(d, fmul(a.weight_decay, p32));
    if (a.has_momentum) {
      const float b = first ? d : fadd(fmul(a.momentum, ld(buf, i)), fmul(a.one_minus_dampening, d));
      d = a.nesterov ? fadd(d, fmul(a.momentum, b)) : b;
      st(buf, i, b);
    }
    if (a.wd_after) d = fadd(d, fmul(a.weight_decay, p32));
    lean_store(a.lp.storage, p, aux, i, p32, fmul(a.lr, d), key);
  }
}

// ---- host side ------------------------------------------------------------------------------------
int parse_storage(const char* op, const std::string& s) {
  if (s == "split") return kSplit;
  if (s == "kahan") return kKahan;
  TORCH_CHECK(s == "stochastic", op, ": storage='", s,
              "' is not allowed; expected 'split', 'kahan' or 'stochastic'");
  return kStochastic;
}

void check_lean(const char* op, int storage, at::TensorList params, at::TensorList aux,
                const at::Device& device, at::TensorList state) {
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK(params[i].scalar_type() == at::kBFloat16, op, ": params[", i, "] has dtype ",
                params[i].scalar_type(), "; the lean storages hold bfloat16 params");
  if (storage == kStochastic) {
    TORCH_CHECK(aux.empty(), op, ": storage='stochastic' keeps no aux state, got ", aux.size(),
                " aux tensors");
  } else {
    const at::ScalarType want = storage == kSplit ? at::kUInt16 : at::kBFloat16;
    TORCH_CHECK(aux.size() == params.size(), op, ": aux has ", aux.size(),
                " tensors but params has ", params.size(), "; the lists must be parallel");
    for (size_t i = 0; i < aux.size(); ++i)
      TORCH_CHECK(aux[i].scalar_type() == want && aux[i].is_contiguous() &&
                      aux[i].device() == device && aux[i].numel() == params[i].numel(),
                  op, ": aux[", i, "] must be a contiguous ", want, " tensor on ", device,
                  " with ", params[i].numel(), " elements");
  }
  for (size_t i = 0; i < state.size(); ++i)
    TORCH_CHECK((state[i].scalar_type() == at::kFloat || state[i].scalar_type() == at::kBFloat16) &&
                    state[i].scalar_type() == state[0].scalar_type(),
                op, ": optimizer state must be all float32 or all bfloat16, got ",
                state[i].scalar_type(), " at index ", i);
}

LeanParams lean_params(const char* op, int storage, int64_t seed, const at::Tensor& step,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  return LeanParams{optional_ptr(op, "found_inf", found_inf, step.device()),
                    optional_ptr(op, "grad_scale", grad_scale, step.device()),
                    step.data_ptr<float>(), storage, static_cast<uint32_t>(seed)};
}

// Calls fn(S*) with the state element type (float or bfloat16; float when there is no state).
template <class Fn>
void dispatch_state(at::TensorList state, const Fn& fn) {
  if (!state.empty() && state[0].scalar_type() == at::kBFloat16)
    return fn(static_cast<c10::BFloat16*>(nullptr));
  fn(static_cast<float*>(nullptr));
}

void multi_tensor_adam_lean_cuda(at::TensorList params, at::TensorList aux, at::TensorList grads,
                                 at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                 const at::Tensor& step, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, bool adam_w_mode,
                                 bool bias_correction, c10::string_view storage_name,
                                 int64_t seed, const std::optional<at::Tensor>& grad_scale,
                                 const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_adam_lean_";
  const int storage = parse_storage(op, std::string(storage_name));
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
           {"exp_avg_sqs", exp_avg_sqs}});
  check_lean(op, storage, params, aux, device, exp_avgs);
  check_lean(op, storage, params, aux, device, exp_avg_sqs);
  TORCH_CHECK(exp_avgs.empty() || exp_avgs[0].scalar_type() == exp_avg_sqs[0].scalar_type(), op,
              ": exp_avgs and exp_avg_sqs must share one dtype");
  check_one_dtype(op, "grads", grads);
  check_step(op, step, step.device());
  TORCH_CHECK(params.empty() || step.device() == device, op, ": step is on ", step.device(),
              " but the tensors are on ", device);
  const c10::cuda::CUDAGuard guard(step.device());

  AdamLeanArgs a;
  a.lp = lean_params(op, storage, seed, step, grad_scale, found_inf);
  a.beta1_d = beta1;
  a.beta2_d = beta2;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.l2 = !adam_w_mode && weight_decay != 0.0;
  a.decoupled = adam_w_mode && weight_decay != 0.0;
  a.use_bias_correction = bias_correction;
  if (!params.empty()) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    dispatch_dtype(grads, [&](auto* g_tag) {
      dispatch_state(exp_avgs, [&](auto* s_tag) {
        using G = std::remove_pointer_t<decltype(g_tag)>;
        using S = std::remove_pointer_t<decltype(s_tag)>;
        for_each_launch<5>({params, aux, grads, exp_avgs, exp_avg_sqs},
                           [&](int blocks, const TensorListMeta<5>& meta) {
                             adam_lean_kernel<G, S><<<blocks, kBlockSize, 0, stream>>>(meta, a);
                             C10_CUDA_KERNEL_LAUNCH_CHECK();
                           });
      });
    });
  }
  launch_increment_step(step, a.lp.found_inf);
}

void multi_tensor_sgd_lean_cuda(at::TensorList params, at::TensorList aux, at::TensorList grads,
                                at::TensorList momentum_buffers, const at::Tensor& step, double lr,
                                double momentum, double dampening, double weight_decay,
                                bool nesterov, bool wd_after_momentum,
                                c10::string_view storage_name, int64_t seed,
                                const std::optional<at::Tensor>& grad_scale,
                                const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_sgd_lean_";
  const int storage = parse_storage(op, std::string(storage_name));
  const bool has_momentum = momentum != 0.0;
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"momentum_buffers", momentum_buffers}},
      {"momentum_buffers"});
  TORCH_CHECK(!has_momentum || momentum_buffers.size() == params.size(), op,
              ": momentum_buffers is empty but momentum=", momentum, " needs one per param");
  check_lean(op, storage, params, aux, device, momentum_buffers);
  check_one_dtype(op, "grads", grads);
  check_step(op, step, step.device());
  TORCH_CHECK(params.empty() || step.device() == device, op, ": step is on ", step.device(),
              " but the tensors are on ", device);
  const c10::cuda::CUDAGuard guard(step.device());

  SgdLeanArgs a;
  a.lp = lean_params(op, storage, seed, step, grad_scale, found_inf);
  a.lr = static_cast<float>(lr);
  a.momentum = static_cast<float>(momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - dampening);
  a.weight_decay = static_cast<float>(weight_decay);
  a.nesterov = nesterov;
  a.wd_before = weight_decay != 0.0 && !wd_after_momentum;
  a.wd_after = weight_decay != 0.0 && wd_after_momentum;
  a.has_momentum = has_momentum;
  if (!params.empty()) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const at::TensorList bufs = has_momentum ? momentum_buffers : at::TensorList();
    dispatch_dtype(grads, [&](auto* g_tag) {
      dispatch_state(bufs, [&](auto* s_tag) {
        using G = std::remove_pointer_t<decltype(g_tag)>;
        using S = std::remove_pointer_t<decltype(s_tag)>;
        for_each_launch<4>({params, aux, grads, bufs},
                           [&](int blocks, const TensorListMeta<4>& meta) {
                             sgd_lean_kernel<G, S><<<blocks, kBlockSize, 0, stream>>>(meta, a);
                             C10_CUDA_KERNEL_LAUNCH_CHECK();
                           });
      });
    });
  }
  launch_increment_step(step, a.lp.found_inf);
}

}  // namespace
}  // namespace cuda_optim
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CUDA, m) {
  m.impl("multi_tensor_adam_lean_", &mp_wrappers::cuda_optim::multi_tensor_adam_lean_cuda);
  m.impl("multi_tensor_sgd_lean_", &mp_wrappers::cuda_optim::multi_tensor_sgd_lean_cuda);
}
