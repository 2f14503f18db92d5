// CUDA kernels of multi_tensor_scale_ (out = in * scale) and multi_tensor_axpby_ (out = a*x + b*y),
// with the non-finite check on their inputs. Semantics: mp_wrappers/ops/reference/multi_tensor.py.
#include <ATen/core/Tensor.h>

#include "mp_wrappers/cuda/multi_tensor_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

// The input, not the product, is checked: inf * 0 must still be reported.
template <class Tin, class Tout>
__device__ __forceinline__ void scale_chunk(const Tin* in, Tout* out, int64_t n, float s,
                                            float* found_inf) {
  bool bad = false;
  int64_t done = 0;
  if (pack_aligned(in) && pack_aligned(out)) {
    const int64_t n_vec = n / kILP;
    // Not unrolled: to unroll a grid-stride loop the compiler divides the trip count by blockDim.x
    // in 64 bits, a called routine around which ptxas spilled for sm_121 (8 B stack, 16 B spills).
    // Each iteration already moves kILP elements; the tail loop below likewise.
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      float x[kILP];
      load_pack(x, in, i * kILP);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        bad |= not_finite(x[k]);
        x[k] = fmul(x[k], s);
      }
      store_pack(out, i * kILP, x);
    }
    done = n_vec * kILP;
  }
#pragma unroll 1
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {  // unaligned data or the tail
    const float x = load_one(in, i, n);
    bad |= not_finite(x);
    store_one(out, i, n, fmul(x, s));
  }
  if (bad) st(found_inf, 1.f);  // every writer stores the same value: a benign race
}

__global__ void __launch_bounds__(kBlockSize)
    scale_kernel(const TensorListMeta<2> meta, const float* scale, float* found_inf) {
  const auto c = meta.chunk_of_block();
  const float s = ld_uniform(scale);
  with_storage_type(meta.dtype[0][c.slot], [&](auto in_t) {
    with_storage_type(meta.dtype[1][c.slot], [&](auto out_t) {
      using Tin = decltype(in_t);
      using Tout = decltype(out_t);
      scale_chunk(static_cast<const Tin*>(meta.addresses[0][c.slot]) + c.begin,
                  static_cast<Tout*>(meta.addresses[1][c.slot]) + c.begin, c.size, s, found_inf);
    });
  });
}

// Two products and a sum, each rounded to fp32, like the reference `a * x.float() + b * y.float()`.
template <class Tx, class Ty, class To>
__device__ __forceinline__ void axpby_chunk(const Tx* x, const Ty* y, To* out, int64_t n, float a,
                                            float b, bool check_x, bool check_y,
                                            float* found_inf) {
  bool bad = false;
  int64_t done = 0;
  if (pack_aligned(x) && pack_aligned(y) && pack_aligned(out)) {
    const int64_t n_vec = n / kILP;
    for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
      float xv[kILP], yv[kILP], r[kILP];
      load_pack(xv, x, i * kILP);
      load_pack(yv, y, i * kILP);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        bad |= (check_x && not_finite(xv[k])) || (check_y && not_finite(yv[k]));
        r[k] = fadd(fmul(a, xv[k]), fmul(b, yv[k]));
      }
      store_pack(out, i * kILP, r);
    }
    done = n_vec * kILP;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    const float xv = load_one(x, i, n), yv = load_one(y, i, n);
    bad |= (check_x && not_finite(xv)) || (check_y && not_finite(yv));
    store_one(out, i, n, fadd(fmul(a, xv), fmul(b, yv)));
  }
  if (bad) st(found_inf, 1.f);
}

__global__ void __launch_bounds__(kBlockSize)
    axpby_kernel(const TensorListMeta<3> meta, float a, float b, bool check_x, bool check_y,
                 float* found_inf) {
  const auto c = meta.chunk_of_block();
  with_storage_type(meta.dtype[0][c.slot], [&](auto x_t) {
    with_storage_type(meta.dtype[1][c.slot], [&](auto y_t) {
      with_storage_type(meta.dtype[2][c.slot], [&](auto o_t) {
        using Tx = decltype(x_t);
        using Ty = decltype(y_t);
        using To = decltype(o_t);
        axpby_chunk(static_cast<const Tx*>(meta.addresses[0][c.slot]) + c.begin,
                    static_cast<const Ty*>(meta.addresses[1][c.slot]) + c.begin,
                    static_cast<To*>(meta.addresses[2][c.slot]) + c.begin, c.size, a, b, check_x,
                    check_y, found_inf);
      });
    });
  });
}

void multi_tensor_scale_cuda(at::TensorList inputs, at::TensorList outputs,
                             const at::Tensor& scale, const at::Tensor& found_inf) {
  const at::Device device = multi_tensor_scale_args(inputs, outputs, scale, found_inf);
  if (inputs.empty()) return;
  const DeviceGuard guard(device);
  const Stream stream = current_stream();
  // scale stays on the device: reading it on the host would synchronise.
  for_each_launch<2>({inputs, outputs}, [&](int blocks, const TensorListMeta<2>& meta) {
    launch("scale", &scale_kernel, blocks, kBlockSize, stream, meta, scale.data_ptr<float>(),
           found_inf.data_ptr<float>());
  });
}

void multi_tensor_axpby_cuda(at::TensorList x, at::TensorList y, at::TensorList out, double a,
                             double b, int64_t arg_to_check, const at::Tensor& found_inf) {
  const AxpbyArgs args = multi_tensor_axpby_args(x, y, out, a, b, arg_to_check, found_inf);
  if (x.empty()) return;
  const DeviceGuard guard(args.device);
  const Stream stream = current_stream();
  for_each_launch<3>({x, y, out}, [&](int blocks, const TensorListMeta<3>& meta) {
    launch("axpby", &axpby_kernel, blocks, kBlockSize, stream, meta, args.a, args.b, args.check_x,
           args.check_y, found_inf.data_ptr<float>());
  });
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_scale_", &mp_wrappers::cuda::multi_tensor_scale_cuda);
  m.impl("multi_tensor_axpby_", &mp_wrappers::cuda::multi_tensor_axpby_cuda);
}
