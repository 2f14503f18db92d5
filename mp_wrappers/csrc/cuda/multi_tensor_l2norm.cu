// CUDA kernels of multi_tensor_l2norm and multi_tensor_unscale_l2norm. Semantics:
// mp_wrappers/ops/reference/multi_tensor.py.
//
// Two stages, no host synchronisation: every block writes the sum of squares of its chunk (double
// per thread, then a block reduction in double: finite fp32 values never overflow it, as on the
// CPU) to its partial slot, and one cleanup block adds each tensor's partials in chunk order,
// writing the per-tensor norms and the total. No atomics, so the result is deterministic.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <tuple>

#include "mp_wrappers/cuda/multi_tensor_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

template <bool kUnscale, class T>
__device__ __forceinline__ double sumsq_chunk(const T* p, int64_t n, float inv_scale, bool* bad) {
  double acc[kILP] = {0.0, 0.0, 0.0, 0.0};  // kILP independent chains hide the latency
  int64_t done = 0;
  if (pack_aligned(p)) {
    const int64_t n_vec = n / kILP;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      float x[kILP];
      load_pack(x, p, i * kILP);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        if (kUnscale) {
          *bad |= not_finite(x[k]);
          x[k] = fmul(x[k], inv_scale);  // the reference rounds the product to fp32
        }
        acc[k] += square(x[k]);
      }
    }
    done = n_vec * kILP;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float x = load_one(p, i, n);
    if (kUnscale) {
      *bad |= not_finite(x);
      x = fmul(x, inv_scale);
    }
    acc[0] += square(x);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <bool kUnscale>
__global__ void __launch_bounds__(kBlockSize)
    sumsq_kernel(const TensorListMeta<1> meta, ChunkPartials<1> partials, const float* inv_scale,
                 float* found_inf) {
  __shared__ double shared[kBlockSize / kWarp];
  const auto c = meta.chunk_of_block();
  const float s = kUnscale ? ld_uniform(inv_scale) : 1.f;
  bool bad = false;
  double v = 0.0;
  with_storage_type(meta.dtype[0][c.slot], [&](auto t) {
    using T = decltype(t);
    v = sumsq_chunk<kUnscale>(static_cast<const T*>(meta.addresses[0][c.slot]) + c.begin, c.size,
                              s, &bad);
  });
  if (kUnscale && bad) st(found_inf, 1.f);
  const double sum[1] = {block_reduce(v, shared, SumOp())};
  partials.write(c, meta.numel[c.slot], sum);
}

// One block: thread i adds the partials of tensors i, i + blockDim, ... in chunk order, then the
// block adds the per-tensor sums in a fixed tree.
__global__ void __launch_bounds__(kBlockSize)
    l2norm_cleanup_kernel(ChunkPartials<1> partials, int64_t n_tensors, float* per_tensor,
                          float* total) {
  __shared__ double shared[kBlockSize / kWarp];
  double v = 0.0;
  for (int64_t t = threadIdx.x; t < n_tensors; t += blockDim.x) {
    const double sumsq = partials.combine(t, 0, 0.0, SumOp());
    if (per_tensor != nullptr) st(per_tensor + t, static_cast<float>(sqrt(sumsq)));
    v += sumsq;
  }
  v = block_reduce(v, shared, SumOp());
  if (threadIdx.x == 0) st(total, static_cast<float>(sqrt(v)));
}

template <bool kUnscale>
std::tuple<at::Tensor, at::Tensor> l2norm_cuda_impl(at::TensorList tensors,
                                                    const at::Device& device,
                                                    const float* inv_scale, float* found_inf,
                                                    bool per_tensor) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  if (n == 0) return {at::zeros({}, f32), at::empty({0}, f32)};  // as the CPU kernel: no launch
  const DeviceGuard guard(device);
  const Stream stream = current_stream();
  at::Tensor total = at::empty({}, f32);
  at::Tensor norms = at::empty({per_tensor ? n : 0}, f32);
  // One double per chunk of the call; ranges zeroed so that empty tensors sum to 0.
  at::Tensor part = at::empty({total_chunks(tensors)}, f32.dtype(at::kDouble));
  at::Tensor range = at::zeros({2 * n}, f32.dtype(at::kLong));
  const ChunkPartials<1> partials{part.data_ptr<double>(), range.data_ptr<int64_t>()};
  for_each_launch<1>({tensors}, [&](int blocks, const TensorListMeta<1>& meta) {
    launch("l2norm_sumsq", &sumsq_kernel<kUnscale>, blocks, kBlockSize, stream, meta, partials,
           inv_scale, found_inf);
  });
  launch("l2norm_cleanup", &l2norm_cleanup_kernel, 1, kBlockSize, stream, partials, n,
         per_tensor ? norms.data_ptr<float>() : nullptr, total.data_ptr<float>());
  return {total, norms};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors,
                                                            bool per_tensor) {
  const at::Device device = multi_tensor_l2norm_args(tensors);
  return l2norm_cuda_impl<false>(tensors, device, nullptr, nullptr, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm_cuda(at::TensorList tensors,
                                                                    const at::Tensor& inv_scale,
                                                                    const at::Tensor& found_inf,
                                                                    bool per_tensor) {
  const at::Device device = multi_tensor_unscale_l2norm_args(tensors, inv_scale, found_inf);
  return l2norm_cuda_impl<true>(tensors, device, inv_scale.data_ptr<float>(),
                                found_inf.data_ptr<float>(), per_tensor);
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_l2norm", &mp_wrappers::cuda::multi_tensor_l2norm_cuda);
  m.impl("multi_tensor_unscale_l2norm", &mp_wrappers::cuda::multi_tensor_unscale_l2norm_cuda);
}
