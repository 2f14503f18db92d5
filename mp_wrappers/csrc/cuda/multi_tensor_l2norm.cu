// CUDA kernels of multi_tensor_l2norm and multi_tensor_unscale_l2norm. Semantics:
// mp_wrappers/ops/reference.py.
//
// Two stages, no host synchronisation: every block writes the sum of squares of its chunk to
// partials[tensor][chunk] (fp32 per thread over at most 128 values, then a block reduction), and
// one cleanup block adds each tensor's partials in double, in chunk order, writing the per-tensor
// norms and the total. No atomics, so the result is deterministic.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "mp_wrappers/checks.h"
#include "mp_wrappers/cuda/multi_tensor_apply.cuh"

namespace mp_wrappers {
namespace cuda {
namespace {

template <bool kUnscale, class T>
__device__ __forceinline__ float sumsq_chunk(const T* p, int64_t n, float inv_scale, bool* bad) {
  float acc[kILP] = {0.f, 0.f, 0.f, 0.f};  // kILP independent chains hide the FMA latency
  int64_t done = 0;
  if (is_aligned_for_ilp(p)) {
    const int64_t n_vec = n / kILP;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      float x[kILP];
      load_ilp(x, p, i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        if (kUnscale) {
          *bad |= not_finite(x[k]);
          x[k] = __fmul_rn(x[k], inv_scale);  // the reference rounds the product to fp32
        }
        acc[k] = fmaf(x[k], x[k], acc[k]);
      }
    }
    done = n_vec * kILP;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float x = to_float(p[i]);
    if (kUnscale) {
      *bad |= not_finite(x);
      x = __fmul_rn(x, inv_scale);
    }
    acc[0] = fmaf(x, x, acc[0]);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <bool kUnscale>
struct SumSqFunctor {
  __device__ __forceinline__ void operator()(const TensorListMeta<1>& meta, float* partials,
                                             int64_t max_chunks, const float* inv_scale,
                                             float* found_inf) const {
    __shared__ float shared[kBlockSize / 32];
    const auto c = meta.chunk_of_block();
    const float s = kUnscale ? *inv_scale : 1.f;
    bool bad = false;
    float v = 0.f;
    with_storage_type(meta.dtype[0][c.slot], [&](auto t) {
      using T = decltype(t);
      v = sumsq_chunk<kUnscale>(static_cast<const T*>(meta.addresses[0][c.slot]) + c.begin, c.size,
                                s, &bad);
    });
    if (kUnscale && bad) *found_inf = 1.f;
    v = block_reduce_sum(v, shared);
    if (threadIdx.x == 0) partials[meta.tensor_index[c.slot] * max_chunks + c.chunk] = v;
  }
};

// One block: warp w sums the partials of tensors w, w + n_warps, ... in double (fixed order per
// lane, then a fixed shuffle tree), then the block adds the per-tensor sums in a fixed order.
__global__ void __launch_bounds__(kBlockSize)
    l2norm_cleanup_kernel(const float* partials, int64_t n_tensors, int64_t max_chunks,
                          double* tensor_sumsq, float* per_tensor, bool write_per_tensor,
                          float* total) {
  __shared__ double shared[kBlockSize / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  for (int64_t t = warp; t < n_tensors; t += n_warps) {
    double v = 0.0;
    for (int64_t c = lane; c < max_chunks; c += 32) v += partials[t * max_chunks + c];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) {
      tensor_sumsq[t] = v;
      if (write_per_tensor) per_tensor[t] = static_cast<float>(sqrt(v));
    }
  }
  __syncthreads();  // tensor_sumsq is written by other warps of this block
  double v = 0.0;
  for (int64_t t = threadIdx.x; t < n_tensors; t += blockDim.x) v += tensor_sumsq[t];
  v = block_reduce_sum(v, shared);
  if (threadIdx.x == 0) *total = static_cast<float>(sqrt(v));
}

template <bool kUnscale>
std::tuple<at::Tensor, at::Tensor> l2norm_cuda_impl(at::TensorList tensors,
                                                    const at::Device& device,
                                                    const float* inv_scale, float* found_inf,
                                                    bool per_tensor) {
  const c10::cuda::CUDAGuard guard(device);
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor total = at::empty({}, f32);
  at::Tensor norms = at::empty({per_tensor ? n : 0}, f32);
  int64_t max_chunks = 1;
  for (const at::Tensor& t : tensors)
    max_chunks = std::max<int64_t>(max_chunks, (t.numel() + kChunkSize - 1) / kChunkSize);
  // Zeroed: chunks that do not exist (short or empty tensors) must contribute 0.
  at::Tensor partials = at::zeros({n, max_chunks}, f32);
  at::Tensor tensor_sumsq =
      at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(device));
  multi_tensor_apply<1>({tensors}, SumSqFunctor<kUnscale>(), partials.data_ptr<float>(),
                        max_chunks, inv_scale, found_inf);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  l2norm_cleanup_kernel<<<1, kBlockSize, 0, stream>>>(
      partials.data_ptr<float>(), n, max_chunks, tensor_sumsq.data_ptr<double>(),
      per_tensor ? norms.data_ptr<float>() : nullptr, per_tensor, total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {total, norms};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors,
                                                            bool per_tensor) {
  const at::Device device = check_tensor_lists("multi_tensor_l2norm", {{"tensors", tensors}});
  TORCH_CHECK(!tensors.empty(), "multi_tensor_l2norm: the CUDA kernel needs at least one tensor");
  return l2norm_cuda_impl<false>(tensors, device, nullptr, nullptr, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(at::TensorList tensors,
                                                                    const at::Tensor& inv_scale,
                                                                    const at::Tensor& found_inf,
                                                                    bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  const at::Device device = check_tensor_lists(op, {{"tensors", tensors}});
  TORCH_CHECK(!tensors.empty(), op, ": the CUDA kernel needs at least one tensor");
  check_scalar_tensor(op, "inv_scale", inv_scale, device);
  check_found_inf(op, found_inf, device);
  return l2norm_cuda_impl<true>(tensors, device, inv_scale.data_ptr<float>(),
                                found_inf.data_ptr<float>(), per_tensor);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

TORCH_LIBRARY_IMPL(mp_wrappers, CUDA, m) {
  m.impl("multi_tensor_l2norm", &mp_wrappers::cuda::multi_tensor_l2norm_cuda);
  m.impl("multi_tensor_unscale_l2norm", &mp_wrappers::cuda::multi_tensor_unscale_l2norm_cuda);
}
