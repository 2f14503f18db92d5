// CUDA kernels of multi_tensor_adam_lean_ and multi_tensor_sgd_lean_ (Note [lean bf16 storage] in
// mp_wrappers/ops/reference/lean.py; the CPU twins are cpu/multi_tensor_lean.cpp). Same structure as
// the other fused optimizers (cuda/optim_apply.cuh): the one launch planner (for_each_launch), the
// IEEE round-to-nearest arithmetic (immune to --use_fast_math), the device-side skip, unscale, bias
// correction and step increment, per-block constants computed once by thread 0, every global access
// through ld/st (so the host-execution build runs and counts it). One guarded element per thread
// (no vector path): the lists mix 2- and 4-byte types. found_inf, grad_scale and step are read on
// the device; the stochastic key uses the update number read there too, so no host sync. An
// element is read and written the storage's way by cuda/lean_param.cuh (shared with the 8-bit one).
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>  // Note [optional arguments] in bindings.cpp
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "mp_wrappers/cuda/lean_param.cuh"
#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/op_args.h"

namespace mp_wrappers {
namespace cuda {
namespace {

// What both lean ops share: the device flag and scale, the step counter, the storage and seed.
struct LeanCommon {
  const float* found_inf;
  const float* grad_scale;
  const float* step;
  int storage;
  uint32_t seed;
};

// ---- the lean update kernel --------------------------------------------------------------------
//
// Lists, in order: params (bf16 bits), aux (uint16 low halves, bf16 compensation, or absent for
// stochastic), grads (G), K state lists (S: float or bfloat16). Op provides
//   LeanCommon c;
//   struct Ctx (trivial, with a member `key`);  __device__ Ctx begin(int32_t tensor_index) const;
//   __device__ float delta(const Ctx&, float p32, float g, float (&s)[K + 1]) const;  -> lr * update
template <class Op, class G, class S, int K>
struct LeanFunctor {
  static constexpr int N = 3 + K;
  using Ctx = typename Op::Ctx;
  static_assert(std::is_trivial<Ctx>::value, "Ctx lives in shared memory: it must be trivial");

  __device__ __forceinline__ void operator()(const TensorListMeta<N>& meta, const Op& op) const {
    const auto ch = meta.chunk_of_block();
    __shared__ Ctx shared_ctx;
    __shared__ bool shared_skip;
    if (threadIdx.x == 0) {
      shared_skip = skip_update(op.c.found_inf);
      if (!shared_skip) shared_ctx = op.begin(ch.tensor_index);
    }
    __syncthreads();
    if (shared_skip) return;
    const Ctx ctx = shared_ctx;
    const int slot = ch.slot;
    uint16_t* p = static_cast<uint16_t*>(meta.addresses[0][slot]);
    uint16_t* aux = static_cast<uint16_t*>(meta.addresses[1][slot]);  // nullptr for stochastic
    const G* g = static_cast<const G*>(meta.addresses[2][slot]);
    S* state[K + 1];
#pragma unroll
    for (int k = 0; k < K; ++k) state[k] = static_cast<S*>(meta.addresses[3 + k][slot]);
    for (int64_t j = threadIdx.x; j < ch.size; j += blockDim.x) {
      const int64_t i = ch.begin + j;  // element index in the tensor (the stochastic hash input)
      const float p32 = lean_load(op.c.storage, p, aux, i);
      float s[K + 1];
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] = to_float(ld(state[k] + i));
      const float d = op.delta(ctx, p32, to_float(ld(g + i)), s);
#pragma unroll
      for (int k = 0; k < K; ++k) st(state[k] + i, from_float<S>(s[k]));
      lean_store(op.c.storage, p, aux, i, p32, d, ctx.key);
    }
  }
};

template <class Functor, int N, class Op>
__global__ void __launch_bounds__(kBlockSize) lean_kernel(TensorListMeta<N> meta, Op op) {
  Functor()(meta, op);
}

template <class Op, class G, class S, int K>
void launch_lean(const char* name, const std::array<at::TensorList, 3 + K>& lists, const Op& op) {
  using Fn = LeanFunctor<Op, G, S, K>;
  const Stream stream = current_stream();
  for_each_launch<Fn::N>(lists, [&](int blocks, const TensorListMeta<Fn::N>& meta) {
    launch(name, &lean_kernel<Fn, Fn::N, Op>, blocks, kBlockSize, stream, meta, op);
  });
}

// ---- Adam: lists [params, aux, grads, exp_avgs, exp_avg_sqs] ------------------------------------
struct AdamLeanOp : AdamHyper {
  LeanCommon c;
  float lr;

  struct Ctx {
    float bc1, bc2;
    DeviceUnscale unscale;
    uint32_t key;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor_index) const {
    const float count = fadd(ld(c.step), 1.f);  // the number of this update
    return Ctx{bias_correction(beta1_d, count, use_bias_correction),
               bias_correction(beta2_d, count, use_bias_correction), make_unscale(c.grad_scale),
               lean_key(c.seed, count, tensor_index)};
  }
  __device__ __forceinline__ float delta(const Ctx& x, float p, float g, float (&s)[3]) const {
    g = x.unscale(g);
    if (l2) g = fadd(g, fmul(weight_decay, p));
    const float m = fadd(fmul(beta1, s[0]), fmul(one_minus_beta1, g));
    const float v = fadd(fmul(beta2, s[1]), fmul(fmul(one_minus_beta2, g), g));
    float u = fdiv(fdiv(m, x.bc1), fadd(fsqrt(fdiv(v, x.bc2)), eps));
    if (decoupled) u = fadd(u, fmul(weight_decay, p));
    s[0] = m;
    s[1] = v;
    return fmul(lr, u);
  }
};

// ---- SGD: lists [params, aux, grads, momentum_buffers?] -----------------------------------------
// kMomentum: one state list (the buffers) or none (momentum == 0, buffers may be absent).
template <bool kMomentum>
struct SgdLeanOp : SgdHyper {
  LeanCommon c;
  float lr;

  struct Ctx {
    bool first;
    DeviceUnscale unscale;
    uint32_t key;
  };
  __device__ __forceinline__ Ctx begin(int32_t tensor_index) const {
    const float step = ld(c.step);
    return Ctx{step == 0.f, make_unscale(c.grad_scale),
               lean_key(c.seed, fadd(step, 1.f), tensor_index)};
  }
  template <int K>
  __device__ __forceinline__ float delta(const Ctx& x, float p, float g, float (&s)[K]) const {
    float d = x.unscale(g);
    if (wd_before) d = fadd(d, fmul(weight_decay, p));
    if constexpr (kMomentum) {
      const float b = x.first ? d : fadd(fmul(momentum, s[0]), fmul(one_minus_dampening, d));
      d = nesterov ? fadd(d, fmul(momentum, b)) : b;
      s[0] = b;
    }
    if (wd_after) d = fadd(d, fmul(weight_decay, p));
    return fmul(lr, d);
  }
};

// ---- host side ------------------------------------------------------------------------------------
LeanCommon lean_common(LeanStorage storage, int64_t seed, const at::Tensor& step,
                       const UpdateScalars& scalars) {
  return LeanCommon{scalars.found_inf, scalars.grad_scale, step.data_ptr<float>(),
                    static_cast<int>(storage), static_cast<uint32_t>(seed)};
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
                                 int64_t seed, const c10::optional<at::Tensor>& grad_scale,
                                 const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<AdamHyper> args = multi_tensor_adam_lean_args(
      Backend::kCuda, params, aux, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps,
      weight_decay, adam_w_mode, bias_correction, storage_name, grad_scale, found_inf);
  const DeviceGuard guard(step.device());
  const AdamLeanOp a{{args.hyper}, lean_common(args.storage, seed, step, args.scalars),
                     args.scalars.lr};
  if (!params.empty()) {
    dispatch_dtype(grads, [&](auto* g_tag) {
      dispatch_state(exp_avgs, [&](auto* s_tag) {
        using G = std::remove_pointer_t<decltype(g_tag)>;
        using S = std::remove_pointer_t<decltype(s_tag)>;
        launch_lean<AdamLeanOp, G, S, 2>("adam_lean", {params, aux, grads, exp_avgs, exp_avg_sqs},
                                         a);
      });
    });
  }
  // After the update kernels: they read step for the bias corrections and the stochastic key.
  launch_increment_step(step, a.c.found_inf);
}

void multi_tensor_sgd_lean_cuda(at::TensorList params, at::TensorList aux, at::TensorList grads,
                                at::TensorList momentum_buffers, const at::Tensor& step, double lr,
                                double momentum, double dampening, double weight_decay,
                                bool nesterov, bool wd_after_momentum,
                                c10::string_view storage_name, int64_t seed,
                                const c10::optional<at::Tensor>& grad_scale,
                                const c10::optional<at::Tensor>& found_inf) {
  const LeanArgs<SgdHyper> args = multi_tensor_sgd_lean_args(
      Backend::kCuda, params, aux, grads, momentum_buffers, step, lr, momentum, dampening,
      weight_decay, nesterov, wd_after_momentum, storage_name, grad_scale, found_inf);
  const DeviceGuard guard(step.device());

  auto run = [&](auto momentum_tag) {
    constexpr bool kMomentum = decltype(momentum_tag)::value;
    const SgdLeanOp<kMomentum> a{{args.hyper}, lean_common(args.storage, seed, step, args.scalars),
                                 args.scalars.lr};
    if (!params.empty()) {
      dispatch_dtype(grads, [&](auto* g_tag) {
        using G = std::remove_pointer_t<decltype(g_tag)>;
        if constexpr (kMomentum) {
          dispatch_state(momentum_buffers, [&](auto* s_tag) {
            using S = std::remove_pointer_t<decltype(s_tag)>;
            launch_lean<SgdLeanOp<true>, G, S, 1>("sgd_lean_momentum",
                                                  {params, aux, grads, momentum_buffers}, a);
          });
        } else {
          launch_lean<SgdLeanOp<false>, G, float, 0>("sgd_lean", {params, aux, grads}, a);
        }
      });
    }
    // After the update kernels: they read step to tell the first update.
    launch_increment_step(step, a.c.found_inf);
  };
  if (args.hyper.has_momentum) run(std::true_type{});
  else run(std::false_type{});
}

}  // namespace
}  // namespace cuda
}  // namespace mp_wrappers

MP_WRAPPERS_CUDA_OPS(m) {
  m.impl("multi_tensor_adam_lean_", &mp_wrappers::cuda::multi_tensor_adam_lean_cuda);
  m.impl("multi_tensor_sgd_lean_", &mp_wrappers::cuda::multi_tensor_sgd_lean_cuda);
}
