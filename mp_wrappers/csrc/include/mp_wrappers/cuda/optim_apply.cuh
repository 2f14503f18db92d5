// The element-wise update kernel of the CUDA fused optimizers (cuda/multi_tensor_{adam,sgd,lamb,
// adagrad,novograd}.cu) and what their entry points share besides their set-up (op_args.h): dtype
// dispatch, the device-side skip, unscale and bias corrections, the step increment. Launches are
// planned by the one planner of multi_tensor_apply.cuh.
//
// Everything stays on the device: found_inf, grad_scale and step are read by the kernels, never by
// the host. Per-launch constants that depend on them (the bias corrections with their pow, the
// unscale factor) are computed once per block by thread 0 and shared, not per thread.
//
// Arithmetic: the references in mp_wrappers/ops/reference/ round every fp32 operation
// separately, so the optimizer math uses the IEEE round-to-nearest intrinsics (fadd, fmul, fdiv,
// fsqrt of multi_tensor_apply.cuh), which the compiler neither approximates nor contracts into FMAs
// whatever the flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "mp_wrappers/cuda/multi_tensor_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {

// ---- skip, unscale, bias correction (device side) --------------------------------------------------

// Whether this launch must do nothing: found_inf is read on the device, no host sync.
__device__ __forceinline__ bool skip_update(const float* found_inf) {
  return found_inf != nullptr && ld_uniform(found_inf) != 0.f;
}

// grad / grad_scale as the reference computes it; for a power of two whose reciprocal is finite
// the exact reciprocal gives the same bits with a multiply (see cpu_optim.h, Unscale).
struct DeviceUnscale {
  float factor;
  bool divide;
  __device__ __forceinline__ float operator()(float g) const {
    return divide ? fdiv(g, factor) : fmul(g, factor);
  }
};
__device__ __forceinline__ DeviceUnscale make_unscale(const float* grad_scale) {
  if (grad_scale == nullptr) return DeviceUnscale{1.f, false};
  const float s = ld(grad_scale);
  int e = 0;
  const float mant = frexpf(s, &e);
  const float inv = fdiv(1.f, s);
  // Below 2^-127 the reciprocal overflows to inf (g * inf, where g / s is finite): divide.
  if (isfinite(s) && mant == 0.5f && isfinite(inv)) return DeviceUnscale{inv, false};
  return DeviceUnscale{s, true};
}

// 1 - beta**count in float64, rounded to float32 (reference._bias_correction); 1 when disabled.
__device__ __forceinline__ float bias_correction(double beta, float count, bool enabled) {
  return enabled ? static_cast<float>(1.0 - pow(beta, static_cast<double>(count))) : 1.f;
}

// One thread increments the step counter after the update kernels of a call (same stream, so they
// have all read the old value), unless the update was skipped. A template so that every .cu file
// may instantiate it without a multiple-definition clash.
template <int kUnused = 0>
__global__ void increment_step_kernel(float* step, const float* found_inf) {
  if (!skip_update(found_inf)) st(step, fadd(ld(step), 1.f));
}

// ---- the element-wise update kernel ----------------------------------------------------------------
//
// Lists, in order: params (P), grads (G; NoOut when the op reads no grad), S float32 state lists,
// model_params (M; NoOut when absent). Op provides
//   const float* found_inf;                 nullptr or the device flag
//   static constexpr bool kWritesState;     whether the state lists are stored back
//   struct Ctx (trivial);  __device__ Ctx begin(int32_t tensor_index) const;  per-block constants,
//                                           computed by thread 0 only
//   __device__ float update(const Ctx&, float p, float g, float (&s)[S + 1]) const;  -> new p
//   static constexpr bool kUnscaleOnLoad;   true: the functor unscales each gradient with
//                                           Ctx::unscale as it loads it, and update gets it
//                                           unscaled; false: update unscales it
// Why the choice: unscaling by a non-power-of-two scale is an IEEE division whose slow path is a
// call. In SgdOp's update, with the momentum state and the half model copy live across that call,
// ptxas saved registers to the stack for sm_121; loaded and unscaled before the states are, the
// same division spills nothing. The other ops measured no spill with the division in update, and
// moving it there spilled for Adagrad. Either way the same operations run in the same order per
// element: the results are bitwise the same.
// Every value goes through fp32 registers; params and the model copy are stored rounded to their
// own dtype.
template <class Op, class P, class G, class M, int S>
struct ElementwiseFunctor {
  static constexpr bool kHasGrad = !std::is_same<G, NoOut>::value;
  static constexpr int N = 2 + (kHasGrad ? 1 : 0) + S;
  using Ctx = typename Op::Ctx;
  static_assert(std::is_trivial<Ctx>::value, "Ctx lives in shared memory: it must be trivial");

  __device__ __forceinline__ void operator()(const TensorListMeta<N>& meta, const Op& op) const {
    const auto ch = meta.chunk_of_block();
    __shared__ Ctx shared_ctx;
    __shared__ bool shared_skip;
    if (threadIdx.x == 0) {
      shared_skip = skip_update(op.found_inf);
      if (!shared_skip) shared_ctx = op.begin(ch.tensor_index);
    }
    __syncthreads();
    if (shared_skip) return;
    const Ctx ctx = shared_ctx;
    const int slot = ch.slot;
    P* p = offset_ptr<P>(meta.addresses[0][slot], ch.begin);
    const G* g = offset_ptr<G>(meta.addresses[kHasGrad ? 1 : 0][slot], ch.begin);
    float* state[S + 1];
#pragma unroll
    for (int k = 0; k < S; ++k)
      state[k] = offset_ptr<float>(meta.addresses[1 + (kHasGrad ? 1 : 0) + k][slot], ch.begin);
    M* out = meta.addresses[N - 1][slot] == nullptr
                 ? nullptr
                 : offset_ptr<M>(meta.addresses[N - 1][slot], ch.begin);
    const int64_t n = ch.size;

    bool aligned = n % kILP == 0 && pack_aligned(p) && pack_aligned(g);
#pragma unroll
    for (int k = 0; k < S; ++k) aligned = aligned && pack_aligned(state[k]);
    if (out != nullptr) aligned = aligned && pack_aligned(out);

    float rp[kILP], rg[kILP], rs[S + 1][kILP];
    if (aligned) {
      // Vector path: 16-byte (fp32) or 8-byte (half) accesses, no bounds checks.
      for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kILP; i0 < n;
           i0 += static_cast<int64_t>(blockDim.x) * kILP) {
        load_pack(rp, p, i0);
        if constexpr (kHasGrad) {
          load_pack(rg, g, i0);
          if constexpr (Op::kUnscaleOnLoad) {
#pragma unroll
            for (int j = 0; j < kILP; ++j) rg[j] = ctx.unscale(rg[j]);
          }
        }
#pragma unroll
        for (int k = 0; k < S; ++k) load_pack(rs[k], state[k], i0);
        compute(op, ctx, rp, rg, rs);
        store_pack(p, i0, rp);
        if constexpr (Op::kWritesState) {
#pragma unroll
          for (int k = 0; k < S; ++k) store_pack(state[k], i0, rs[k]);
        }
        if (out != nullptr) store_pack(out, i0, rp);
      }
    } else {
      // Guarded path for unaligned data and ragged tails: strided so that neighbouring threads
      // still touch neighbouring elements.
      for (int64_t base = 0; base < n; base += static_cast<int64_t>(blockDim.x) * kILP) {
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
          const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
          rp[j] = load_one(p, i, n);
          rg[j] = load_one(g, i, n);
          if constexpr (kHasGrad && Op::kUnscaleOnLoad) rg[j] = ctx.unscale(rg[j]);
#pragma unroll
          for (int k = 0; k < S; ++k) rs[k][j] = load_one(state[k], i, n);
        }
        compute(op, ctx, rp, rg, rs);
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
          const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
          store_one(p, i, n, rp[j]);
          if constexpr (Op::kWritesState) {
#pragma unroll
            for (int k = 0; k < S; ++k) store_one(state[k], i, n, rs[k][j]);
          }
          if (out != nullptr) store_one(out, i, n, rp[j]);
        }
      }
    }
  }

  __device__ __forceinline__ static void compute(const Op& op, const Ctx& ctx, float (&rp)[kILP],
                                                 const float (&rg)[kILP],
                                                 float (&rs)[S + 1][kILP]) {
#pragma unroll
    for (int j = 0; j < kILP; ++j) {
      float s[S + 1];
#pragma unroll
      for (int k = 0; k < S; ++k) s[k] = rs[k][j];
      rp[j] = op.update(ctx, rp[j], rg[j], s);
#pragma unroll
      for (int k = 0; k < S; ++k) rs[k][j] = s[k];
    }
  }
};

template <class Functor, int N, class Op>
__global__ void __launch_bounds__(kBlockSize) elementwise_kernel(TensorListMeta<N> meta, Op op) {
  Functor()(meta, op);
}

// Enqueue the element-wise update over `lists` ([p, g?, state..., model]) on the current stream.
template <class Op, class P, class G, class M, int S>
void launch_elementwise(const char* name,
                        const std::array<at::TensorList, ElementwiseFunctor<Op, P, G, M, S>::N>& lists,
                        const Op& op) {
  using Fn = ElementwiseFunctor<Op, P, G, M, S>;
  const Stream stream = current_stream();
  for_each_launch<Fn::N>(lists, [&](int blocks, const TensorListMeta<Fn::N>& meta) {
    launch(name, &elementwise_kernel<Fn, Fn::N, Op>, blocks, kBlockSize, stream, meta, op);
  });
}

// ---- host side: scalars and dispatch (the checks are the ops' set-up, op_args.h) ---------------------

// lr: the float, or (capturable=True) read from lr_tensor on the device, by thread 0 of each block
// like grad_scale, so that a captured CUDA graph uses the value the tensor holds at each replay.
struct DeviceLr {
  float value;
  const float* ptr;
  __device__ __forceinline__ float get() const { return ptr != nullptr ? ld(ptr) : value; }
};
inline DeviceLr device_lr(const UpdateScalars& s) { return DeviceLr{s.lr, s.lr_tensor}; }

// Calls fn(T*) with T the element type of the list's dtype (a null typed pointer: only the type
// matters). The list must not be empty.
template <class Fn>
inline void dispatch_dtype(at::TensorList list, const Fn& fn) {
  switch (list[0].scalar_type()) {
    case at::kHalf: return fn(static_cast<c10::Half*>(nullptr));
    case at::kBFloat16: return fn(static_cast<c10::BFloat16*>(nullptr));
    default: return fn(static_cast<float*>(nullptr));
  }
}

// Same for an optional list (model_params): NoOut when it is empty.
template <class Fn>
inline void dispatch_dtype_opt(at::TensorList list, const Fn& fn) {
  if (list.empty()) return fn(static_cast<NoOut*>(nullptr));
  dispatch_dtype(list, fn);
}

// Launch the step increment on the current stream (after the update kernels).
inline void launch_increment_step(const at::Tensor& step, const float* found_inf) {
  launch("increment_step", &increment_step_kernel<0>, 1, 1, current_stream(),
         step.data_ptr<float>(), found_inf);
}

}  // namespace cuda
}  // namespace mp_wrappers
