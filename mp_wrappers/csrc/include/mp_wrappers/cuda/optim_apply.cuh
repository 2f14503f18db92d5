// Multi-tensor launches for the CUDA fused-optimizer kernels (cuda/multi_tensor_{adam,sgd,lamb,
// adagrad,novograd}.cu). Self-contained on purpose: the building-block kernels have their own
// helper, and the two can evolve independently.
//
// Launch scheme (the idea of apex's multi_tensor_apply, written anew): the tensors of N parallel
// lists are cut into 65536-element chunks; one CUDA block processes one chunk; a launch carries, in
// its kernel-argument struct, the addresses of up to kMaxTensors(N) tensors and the (tensor, chunk)
// pair of up to kMaxBlocks blocks, and as many launches as needed cover the lists. Everything stays
// on the device: found_inf and step are read by the kernels, never by the host.
//
// Arithmetic: setup.py compiles .cu files with --use_fast_math (approximate divide and sqrt,
// denormals flushed, FMA contraction). The references in mp_wrappers/ops/reference.py round every
// fp32 operation separately, so the optimizer math below uses the IEEE round-to-nearest intrinsics
// (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn), which the compiler neither approximates nor
// contracts into FMAs whatever the flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "mp_wrappers/checks.h"

namespace mp_wrappers {
namespace cuda_optim {

constexpr int64_t kChunkSize = 65536;
constexpr int kBlockSize = 512;
constexpr int kILP = 4;  // elements per thread and vector access (16 bytes of fp32)
constexpr int kMaxBlocks = 320;

// Kernel parameters must fit in 4 KB (the limit before CUDA 12.1 / on every architecture we build
// for); the tensor count per launch shrinks as the number of lists grows.
constexpr int kMaxTensors(int depth) {
  return depth <= 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : 30;
}

template <int N>
struct TensorListMeta {
  void* addresses[N][kMaxTensors(N)];  // nullptr for an absent optional list (model_params)
  int64_t sizes[kMaxTensors(N)];
  int32_t tensor_index[kMaxTensors(N)];  // index of the tensor in the op's lists
  uint8_t block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta<5>) < 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMeta<4>) < 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMeta<3>) < 3600, "kernel arguments must stay under 4 KB");
static_assert(kMaxTensors(5) < 256, "block_to_tensor is a uint8_t");

// Stands in for an absent model_params list: stores to it compile away.
struct NoOut {};

// ---- IEEE fp32 arithmetic, immune to --use_fast_math -----------------------------------------------
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float fsqrt(float a) { return __fsqrt_rn(a); }

// ---- loads and stores of ILP elements --------------------------------------------------------------
template <class T>
struct alignas(sizeof(T) * kILP) Pack {
  T v[kILP];
};

template <class T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <class T>
__device__ __forceinline__ bool pack_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}
__device__ __forceinline__ bool pack_aligned(const NoOut*) { return true; }

// Vector path: element i0..i0+kILP-1, i0 a multiple of kILP, pointer aligned.
template <class T>
__device__ __forceinline__ void load_pack(float (&r)[kILP], const T* p, int64_t i0) {
  const Pack<T> pk = *reinterpret_cast<const Pack<T>*>(p + i0);
#pragma unroll
  for (int j = 0; j < kILP; ++j) r[j] = to_float(pk.v[j]);
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, int64_t i0, const float (&r)[kILP]) {
  if constexpr (!std::is_same<T, NoOut>::value) {
    Pack<T> pk;
#pragma unroll
    for (int j = 0; j < kILP; ++j) pk.v[j] = static_cast<T>(r[j]);  // round to nearest even
    *reinterpret_cast<Pack<T>*>(p + i0) = pk;
  }
}

// Guarded path: element i (any alignment), skipped when i >= n.
template <class T>
__device__ __forceinline__ float load_one(const T* p, int64_t i, int64_t n) {
  return i < n ? to_float(p[i]) : 0.f;
}
template <class T>
__device__ __forceinline__ void store_one(T* p, int64_t i, int64_t n, float x) {
  if constexpr (!std::is_same<T, NoOut>::value) {
    if (i < n) p[i] = static_cast<T>(x);
  }
}

template <class T>
__device__ __forceinline__ T* offset_ptr(void* base, int64_t off) {
  if constexpr (std::is_same<T, NoOut>::value) {
    return nullptr;
  } else {
    return static_cast<T*>(base) + off;
  }
}

// ---- skip, unscale, bias correction (device side) --------------------------------------------------

// Whether this launch must do nothing: found_inf is read on the device, no host sync.
__device__ __forceinline__ bool skip_update(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.f;
}

// grad / grad_scale as the reference computes it; for a finite power of two the exact reciprocal
// gives the same bits with a multiply (see cpu_optim.h, Unscale).
struct DeviceUnscale {
  float factor;
  bool divide;
  __device__ __forceinline__ explicit DeviceUnscale(const float* grad_scale) {
    factor = 1.f;
    divide = false;
    if (grad_scale != nullptr) {
      const float s = *grad_scale;
      int e = 0;
      const float mant = frexpf(s, &e);
      if (isfinite(s) && mant == 0.5f) {
        factor = fdiv(1.f, s);
      } else {
        factor = s;
        divide = true;
      }
    }
  }
  __device__ __forceinline__ float operator()(float g) const {
    return divide ? fdiv(g, factor) : fmul(g, factor);
  }
};

// 1 - beta**count in float64, rounded to float32 (reference._bias_correction); 1 when disabled.
__device__ __forceinline__ float bias_correction(double beta, float count, bool enabled) {
  return enabled ? static_cast<float>(1.0 - pow(beta, static_cast<double>(count))) : 1.f;
}

// One thread increments the step counter after the update kernels of a call (same stream, so they
// have all read the old value), unless the update was skipped. A template so that every .cu file
// may instantiate it without a multiple-definition clash.
template <int kUnused = 0>
__global__ void increment_step_kernel(float* step, const float* found_inf) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && !skip_update(found_inf)) *step = fadd(*step, 1.f);
}

// ---- host side -----------------------------------------------------------------------------------

// The device guard, the stream and the kernel-argument packing of one multi-tensor call. `lists`
// holds N parallel lists; an empty list (optional model_params) is passed as nullptr addresses.
// Calls launch(blocks, meta) for every launch; launch enqueues the kernel on the current stream.
template <int N, class Launch>
void for_each_launch(const std::vector<at::TensorList>& lists, const Launch& launch) {
  TORCH_CHECK(static_cast<int>(lists.size()) == N, "mp_wrappers internal: expected ", N,
              " tensor lists, got ", lists.size());
  const int64_t n = static_cast<int64_t>(lists[0].size());
  TensorListMeta<N> meta;
  int loc_tensor = 0, loc_block = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    for (int k = 0; k < N; ++k)
      meta.addresses[k][loc_tensor] = lists[k].empty() ? nullptr : lists[k][t].data_ptr();
    meta.sizes[loc_tensor] = numel;
    meta.tensor_index[loc_tensor] = static_cast<int32_t>(t);
    ++loc_tensor;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[loc_block] = static_cast<uint8_t>(loc_tensor - 1);
      meta.block_to_chunk[loc_block] = static_cast<int32_t>(c);
      ++loc_block;
      const bool last_chunk = c == chunks - 1;
      if (loc_block == kMaxBlocks || (last_chunk && loc_tensor == kMaxTensors(N))) {
        launch(loc_block, meta);
        loc_block = 0;
        if (last_chunk) {
          loc_tensor = 0;
        } else {  // the current tensor continues in the next launch, as its slot 0
          for (int k = 0; k < N; ++k) meta.addresses[k][0] = meta.addresses[k][loc_tensor - 1];
          meta.sizes[0] = meta.sizes[loc_tensor - 1];
          meta.tensor_index[0] = meta.tensor_index[loc_tensor - 1];
          loc_tensor = 1;
        }
      }
    }
  }
  if (loc_block > 0) launch(loc_block, meta);
}

// Element range of this block's chunk: [0, n) relative to `offset` in its tensor.
template <int N>
struct BlockChunk {
  int tensor_loc;
  int32_t tensor_index;
  int64_t offset;
  int64_t n;
  __device__ __forceinline__ explicit BlockChunk(const TensorListMeta<N>& meta) {
    tensor_loc = meta.block_to_tensor[blockIdx.x];
    tensor_index = meta.tensor_index[tensor_loc];
    offset = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
    const int64_t left = meta.sizes[tensor_loc] - offset;
    n = left < kChunkSize ? left : kChunkSize;
  }
};

// ---- the element-wise update kernel ----------------------------------------------------------------
//
// Lists, in order: params (P), grads (G; NoOut when the op reads no grad), S float32 state lists,
// model_params (M; NoOut when absent). Op provides
//   const float* found_inf;                 nullptr or the device flag
//   static constexpr bool kWritesState;     whether the state lists are stored back
//   struct Ctx; __device__ Ctx begin(int32_t tensor_index) const;   per-block constants
//   __device__ float update(const Ctx&, float p, float g, float (&s)[S + 1]) const;  -> new p
// Every value goes through fp32 registers; params and the model copy are stored rounded to their
// own dtype.
template <class Op, class P, class G, class M, int S>
struct ElementwiseFunctor {
  static constexpr bool kHasGrad = !std::is_same<G, NoOut>::value;
  static constexpr int N = 2 + (kHasGrad ? 1 : 0) + S;

  __device__ __forceinline__ void operator()(const TensorListMeta<N>& meta, const Op& op) const {
    if (skip_update(op.found_inf)) return;
    const BlockChunk<N> ch(meta);
    const typename Op::Ctx ctx = op.begin(ch.tensor_index);
    const int loc = ch.tensor_loc;
    P* p = offset_ptr<P>(meta.addresses[0][loc], ch.offset);
    const G* g = offset_ptr<G>(meta.addresses[kHasGrad ? 1 : 0][loc], ch.offset);
    float* st[S + 1];
#pragma unroll
    for (int k = 0; k < S; ++k)
      st[k] = offset_ptr<float>(meta.addresses[1 + (kHasGrad ? 1 : 0) + k][loc], ch.offset);
    M* out = meta.addresses[N - 1][loc] == nullptr
                 ? nullptr
                 : offset_ptr<M>(meta.addresses[N - 1][loc], ch.offset);
    const int64_t n = ch.n;

    bool aligned = n % kILP == 0 && pack_aligned(p) && pack_aligned(g);
#pragma unroll
    for (int k = 0; k < S; ++k) aligned = aligned && pack_aligned(st[k]);
    if (out != nullptr) aligned = aligned && pack_aligned(out);

    float rp[kILP], rg[kILP], rs[S + 1][kILP];
    if (aligned) {
      // Vector path: 16-byte (fp32) or 8-byte (half) accesses, no bounds checks.
      for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kILP; i0 < n;
           i0 += static_cast<int64_t>(blockDim.x) * kILP) {
        load_pack(rp, p, i0);
        if constexpr (kHasGrad) load_pack(rg, g, i0);
#pragma unroll
        for (int k = 0; k < S; ++k) load_pack(rs[k], st[k], i0);
        compute(op, ctx, rp, rg, rs);
        store_pack(p, i0, rp);
        if constexpr (Op::kWritesState) {
#pragma unroll
          for (int k = 0; k < S; ++k) store_pack(st[k], i0, rs[k]);
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
          rg[j] = 0.f;
          if constexpr (kHasGrad) rg[j] = load_one(g, i, n);
#pragma unroll
          for (int k = 0; k < S; ++k) rs[k][j] = load_one(st[k], i, n);
        }
        compute(op, ctx, rp, rg, rs);
#pragma unroll
        for (int j = 0; j < kILP; ++j) {
          const int64_t i = base + threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
          store_one(p, i, n, rp[j]);
          if constexpr (Op::kWritesState) {
#pragma unroll
            for (int k = 0; k < S; ++k) store_one(st[k], i, n, rs[k][j]);
          }
          if (out != nullptr) store_one(out, i, n, rp[j]);
        }
      }
    }
  }

  __device__ __forceinline__ static void compute(const Op& op, const typename Op::Ctx& ctx,
                                                 float (&rp)[kILP], const float (&rg)[kILP],
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
void launch_elementwise(const std::vector<at::TensorList>& lists, const Op& op) {
  using Fn = ElementwiseFunctor<Op, P, G, M, S>;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for_each_launch<Fn::N>(lists, [&](int blocks, const TensorListMeta<Fn::N>& meta) {
    elementwise_kernel<Fn, Fn::N, Op><<<blocks, kBlockSize, 0, stream>>>(meta, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ---- block reductions (LAMB and NovoGrad norms) ----------------------------------------------------

// Sum (kMax false) or NaN-propagating max (kMax true) of one value per thread over the block;
// the result is valid in thread 0. `shared` holds kBlockSize / 32 floats.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* shared) {
  auto combine = [](float a, float b) {
    if (kMax) return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
    return a + b;
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = combine(x, __shfl_down_sync(0xffffffffu, x, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : (kMax ? 0.f : 0.f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = combine(x, __shfl_down_sync(0xffffffffu, x, o));
  }
  __syncthreads();  // shared may be reused by the caller
  return x;
}

// Chunks per tensor of the longest tensor: the per-chunk partials of a reduction are laid out as
// [tensor][chunk] with this stride, so no offsets need to travel from the host.
inline int64_t max_chunks(at::TensorList list) {
  int64_t m = 1;
  for (const at::Tensor& t : list) {
    const int64_t c = (t.numel() + kChunkSize - 1) / kChunkSize;
    m = c > m ? c : m;
  }
  return m;
}

// Host checks shared by the CUDA entry points: one dtype per list (a launch dispatches on the
// dtype of the list's first tensor).
inline void check_one_dtype(const char* op, const char* name, at::TensorList list) {
  for (size_t i = 1; i < list.size(); ++i)
    TORCH_CHECK(list[i].scalar_type() == list[0].scalar_type(), op, ": ", name, " mixes dtypes ",
                list[0].scalar_type(), " and ", list[i].scalar_type(), " (index ", i,
                "); on CUDA each list must hold one dtype");
}

inline void check_fp32_list(const char* op, const char* name, at::TensorList list) {
  for (size_t i = 0; i < list.size(); ++i)
    TORCH_CHECK(list[i].scalar_type() == at::kFloat, op, ": ", name, "[", i, "] has dtype ",
                list[i].scalar_type(), "; optimizer state must be float32");
}

inline const float* optional_ptr(const char* op, const char* name,
                                 const std::optional<at::Tensor>& t, const at::Device& device) {
  if (!(t.has_value() && t->defined())) return nullptr;
  check_scalar_tensor(op, name, *t, device);
  return t->data_ptr<float>();
}

inline void check_step(const char* op, const at::Tensor& step, const at::Device& device) {
  check_scalar_tensor(op, "step", step, device);
  TORCH_CHECK(step.is_contiguous(), op, ": step (strides ", step.strides(),
              ") must be contiguous");
}

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
  increment_step_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(step.data_ptr<float>(),
                                                                        found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_optim
}  // namespace mp_wrappers
