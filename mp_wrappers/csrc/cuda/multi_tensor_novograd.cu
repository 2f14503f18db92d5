// CUDA kernel of multi_tensor_novograd_ (apex FusedNovoGrad math; semantics and op order:
// mp_wrappers/ops/reference.py::multi_tensor_novograd_).
//
// Three launches on the current stream, no host synchronisation:
//   1. read-only over the grads: per chunk, the block's sum of squares (norm_type 2) or NaN-
//      propagating max |g| (norm_type 0) of the unscaled grad, into partials[tensor][chunk];
//   2. one thread per tensor: combine its partials in chunk order (double), blend the running norm
//      (first applied step: the norm itself unless init_zero), store it and the denominator;
//   3. element-wise: moment and param update with the tensor's denominator, rounded model copy.
// found_inf is checked by every kernel, and step is incremented on the device after the last one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/optim_apply.cuh"

namespace mp_wrappers {
namespace cuda_optim {
namespace {

struct NovoOp {
  static constexpr bool kWritesState = true;
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  const float* denom;  // [n_tensors], from pass 2
  double beta1_d;
  float lr, beta1, beta3, weight_decay;
  bool reg_inside_moment, use_bias_correction;

  struct Ctx {
    float bc1, denom;
    DeviceUnscale unscale;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor) const {
    const float count = fadd(*step, 1.f);
    return Ctx{bias_correction(beta1_d, count, use_bias_correction), denom[tensor],
               DeviceUnscale(grad_scale)};
  }
  __device__ __forceinline__ float update(const Ctx& c, float p, float g, float (&s)[2]) const {
    g = c.unscale(g);
    const float m_old = fmul(beta1, s[0]);
    // The reference adds wd * p even when wd is 0 (the sign of a zero result depends on it).
    if (reg_inside_moment) {
      s[0] = fadd(m_old, fmul(beta3, fadd(fdiv(g, c.denom), fmul(weight_decay, p))));
      return fsub(p, fmul(lr, fdiv(s[0], c.bc1)));
    }
    s[0] = fadd(m_old, fmul(beta3, g));
    return fsub(p, fmul(lr, fadd(fdiv(fdiv(s[0], c.bc1), c.denom), fmul(weight_decay, p))));
  }
};

// Pass 1: lists [g].
template <class G, bool kL2>
__global__ void __launch_bounds__(kBlockSize)
    grad_norm_kernel(TensorListMeta<1> meta, const float* found_inf, const float* grad_scale,
                     float* part, int64_t max_chunks) {
  if (skip_update(found_inf)) return;
  __shared__ float shared[kBlockSize / 32];
  const BlockChunk<1> ch(meta);
  const DeviceUnscale unscale(grad_scale);
  const G* g = static_cast<const G*>(meta.addresses[0][ch.tensor_loc]) + ch.offset;
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < ch.n; i += blockDim.x) {
    const float x = unscale(to_float(g[i]));
    if (kL2) {
      acc = fmaf(x, x, acc);
    } else {
      const float a = fabsf(x);
      acc = (isnan(a) || isnan(acc)) ? __int_as_float(0x7fc00000) : fmaxf(acc, a);
    }
  }
  acc = block_reduce<!kL2>(acc, shared);
  if (threadIdx.x == 0)
    part[static_cast<int64_t>(ch.tensor_index) * max_chunks + meta.block_to_chunk[blockIdx.x]] =
        acc;
}

// Pass 2: one thread per tensor.
__global__ void novograd_norms_kernel(const float* found_inf, const float* step, const float* part,
                                      int64_t n_tensors, int64_t max_chunks, bool l2,
                                      bool init_zero, double beta2_d, bool use_bias_correction,
                                      float beta2, float one_minus_beta2, float eps,
                                      float* norms, float* denom) {
  if (skip_update(found_inf)) return;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n_tensors) return;
  double acc = 0.0;
  for (int64_t c = 0; c < max_chunks; ++c) {
    const double x = part[t * max_chunks + c];
    acc = l2 ? acc + x : ((isnan(acc) || isnan(x)) ? x + acc : fmax(acc, x));
  }
  const float norm = static_cast<float>(l2 ? sqrt(acc) : acc);
  const float old = norms[t];
  const float blended =
      l2 ? fsqrt(fadd(fmul(fmul(beta2, old), old), fmul(fmul(one_minus_beta2, norm), norm)))
         : fadd(fmul(beta2, old), fmul(one_minus_beta2, norm));
  const float s = *step;
  const float updated = (s == 0.f && !init_zero) ? norm : blended;
  const float bc2 = fsqrt(bias_correction(beta2_d, fadd(s, 1.f), use_bias_correction));
  norms[t] = updated;
  denom[t] = fadd(fdiv(updated, bc2), eps);
}

void multi_tensor_novograd_cuda(at::TensorList params, at::TensorList grads,
                                at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                                at::TensorList model_params, const at::Tensor& step, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                bool bias_correction, bool grad_averaging,
                                bool reg_inside_moment, int64_t norm_type, bool init_zero,
                                const std::optional<at::Tensor>& grad_scale,
                                const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "multi_tensor_novograd_";
  const at::Device device = check_tensor_lists(
      op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs},
           {"model_params", model_params}},
      {"model_params"});
  check_fp32_list(op, "exp_avgs", exp_avgs);
  check_one_dtype(op, "params", params);
  check_one_dtype(op, "grads", grads);
  check_one_dtype(op, "model_params", model_params);
  TORCH_CHECK(norm_type == 2 || norm_type == 0, op, ": norm_type=", norm_type,
              "; expected 2 (L2 norm) or 0 (infinity norm)");
  check_step(op, step, step.device());
  TORCH_CHECK(params.empty() || step.device() == device, op, ": step is on ", step.device(),
              " but the tensors are on ", device);
  TORCH_CHECK(exp_avg_sq_norms.scalar_type() == at::kFloat && exp_avg_sq_norms.is_contiguous() &&
                  exp_avg_sq_norms.numel() == static_cast<int64_t>(params.size()) &&
                  exp_avg_sq_norms.device() == step.device(),
              op, ": exp_avg_sq_norms must be a contiguous float32 tensor on ", step.device(),
              " with one element per param (", params.size(), "), got dtype ",
              exp_avg_sq_norms.scalar_type(), " on ", exp_avg_sq_norms.device(), " with ",
              exp_avg_sq_norms.numel(), " elements");
  const c10::cuda::CUDAGuard guard(step.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  NovoOp o;
  o.found_inf = optional_ptr(op, "found_inf", found_inf, step.device());
  o.grad_scale = optional_ptr(op, "grad_scale", grad_scale, step.device());
  o.step = step.data_ptr<float>();
  o.beta1_d = beta1;
  o.lr = static_cast<float>(lr);
  o.beta1 = static_cast<float>(beta1);
  o.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.f;
  o.weight_decay = static_cast<float>(weight_decay);
  o.reg_inside_moment = reg_inside_moment;
  o.use_bias_correction = bias_correction;
  const bool l2 = norm_type == 2;

  if (!params.empty()) {
    const int64_t n_tensors = static_cast<int64_t>(params.size());
    const int64_t chunks = max_chunks(params);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(step.device());
    const at::Tensor part = at::zeros({n_tensors * chunks}, f32);
    const at::Tensor denom = at::empty({n_tensors}, f32);
    dispatch_dtype(grads, [&](auto* g_tag) {
      using G = std::remove_pointer_t<decltype(g_tag)>;
      for_each_launch<1>({grads}, [&](int blocks, const TensorListMeta<1>& meta) {
        if (l2) {
          grad_norm_kernel<G, true><<<blocks, kBlockSize, 0, stream>>>(
              meta, o.found_inf, o.grad_scale, part.data_ptr<float>(), chunks);
        } else {
          grad_norm_kernel<G, false><<<blocks, kBlockSize, 0, stream>>>(
              meta, o.found_inf, o.grad_scale, part.data_ptr<float>(), chunks);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    const int threads = 128;
    novograd_norms_kernel<<<static_cast<int>((n_tensors + threads - 1) / threads), threads, 0,
                            stream>>>(
        o.found_inf, o.step, part.data_ptr<float>(), n_tensors, chunks, l2, init_zero, beta2,
        bias_correction, static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
        static_cast<float>(eps), exp_avg_sq_norms.data_ptr<float>(), denom.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    o.denom = denom.data_ptr<float>();
    dispatch_dtype(params, [&](auto* p_tag) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        dispatch_dtype_opt(model_params, [&](auto* m_tag) {
          using P = std::remove_pointer_t<decltype(p_tag)>;
          using G = std::remove_pointer_t<decltype(g_tag)>;
          using M = std::remove_pointer_t<decltype(m_tag)>;
          launch_elementwise<NovoOp, P, G, M, 1>({params, grads, exp_avgs, model_params}, o);
        });
      });
    });
  }
  launch_increment_step(step, o.found_inf);
}

}  // namespace
}  // namespace cuda_optim
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CUDA, m) {
  m.impl("multi_tensor_novograd_", &mp_wrappers::cuda_optim::multi_tensor_novograd_cuda);
}
