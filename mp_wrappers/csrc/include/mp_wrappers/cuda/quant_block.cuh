// The quantization blocks of the 8-bit CUDA kernels (cuda/multi_tensor_adam8bit.cu: Adam's two
// moments; cuda/multi_tensor_sgd8bit.cu: SGD's momentum buffer), shared so that both quantize as
// the reference does (Note [8-bit optimizer states] in mp_wrappers/ops/reference/quant.py; the CPU
// twin is cpu_quant.h): the codes' decode and encode, the warp's absmax, the lanes' layout of a
// block, the L2 prefetch of a block's lines, the fp32 / half param with its model copy, and the
// launches of one call.
//
// One warp per quantization block of 256 elements: lane l holds 8 elements in two groups of kILP.
// Whole blocks with 16-byte-aligned storage use vector accesses (lane l: elements 4l..4l+3 and
// 128+4l..128+4l+3); a short last block, or misaligned storage, takes the guarded layout (lane l:
// elements l, l+32, ..., l+224, each checked against the block's size). A CUDA block takes a chunk
// of kQuantChunkSize elements (a multiple of 256: a quantization block never spans two chunks).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "mp_wrappers/cuda/optim_apply.cuh"
#include "mp_wrappers/minifloat.h"

namespace mp_wrappers {
namespace cuda {

constexpr int64_t kQBlock = quant::kBlock;
constexpr int kPerLane = static_cast<int>(kQBlock / kWarp);  // 8
static_assert(kPerLane == 2 * kILP, "a lane holds two vector packs of its block");
static_assert(kQuantChunkSize % kQBlock == 0, "chunks hold whole quantization blocks");
static_assert(kQuantChunkSize <= (1 << 30), "in-chunk offsets are int");

// ---- the codes: cpu_quant.h's scalar forms, with the IEEE intrinsics -----------------------------

// The value of a code with absmax = MAX (exact); the update's FMA applies the block's factor (Note
// [the folded decode factor] in cpu/multi_tensor_adam8bit.cpp).
template <class C>
__device__ __forceinline__ float decode(uint32_t byte) {
  const int32_t c = C::S ? static_cast<int32_t>(byte & 0x7Fu) : static_cast<int32_t>(byte);
  const float mag = c < C::kFirstNormal ? fmul(static_cast<float>(c), C::kSubDec)
                                        : __int_as_float((c + C::kRebase) << C::kShift);
  return C::S && byte >= 0x80u ? -mag : mag;
}

// The nearest code of x * enc, ties away from zero as in the reference. `enc` infinite (a
// subnormal absmax): clamped to MAX as torch.clamp does, NaN (0 * inf) passes and encodes as the
// reference's integer arithmetic on its bits does; the low byte is the code (its uint8 cast).
template <class C>
__device__ __forceinline__ uint32_t encode(float x, float enc) {
  const float scaled = fmul(x, enc);
  const float mag = fabsf(scaled);
  const float a = mag > C::kMax ? C::kMax : mag;
  int32_t c;
  if (a < C::kMinNormal) {
    const float y = fmul(a, C::kSubEnc);  // in [0, 2^M): exact
    const int32_t whole = static_cast<int32_t>(y);
    c = whole + (fsub(y, static_cast<float>(whole)) >= 0.5f ? 1 : 0);  // half up
  } else {
    c = ((__float_as_int(a) + (1 << (C::kShift - 1))) >> C::kShift) - C::kRebase;
  }
  if (C::S && signbit(scaled)) c |= 0x80;  // -0 too (Note [signed zero codes])
  return static_cast<uint32_t>(c) & 0xFFu;
}

// max that propagates NaN, as the reference's amax does.
__device__ __forceinline__ float max_nan(float acc, float x) { return NanMaxOp()(acc, x); }

// Every lane gets the warp's max.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The kILP bytes of a pack as one word, byte j element j.
__device__ __forceinline__ uint32_t packed_bytes(const Pack<uint8_t>& pk) {
  uint32_t r = 0u;
#pragma unroll
  for (int j = 0; j < kILP; ++j) r |= static_cast<uint32_t>(pk.v[j]) << (8 * j);
  return r;
}

// Element j (0..3) of the lane's group h (0, 1): vector layout (a pack) or guarded layout (strided
// by the warp, so that neighbouring lanes still touch neighbouring elements).
__device__ __forceinline__ int lane_element(bool vector, int lane, int h, int j) {
  return vector ? h * static_cast<int>(kQBlock / 2) + lane * kILP + j : (h * kILP + j) * kWarp + lane;
}

// Byte `byte` of the kQBlock elements of type T at `first`, asked of L2 when it lies inside them.
template <class T>
__device__ __forceinline__ void prefetch_line(const T* first, int byte) {
  if (byte < static_cast<int>(kQBlock * sizeof(T)))
    prefetch_l2(reinterpret_cast<const char*>(first) + byte);
}

template <class T>
__device__ __forceinline__ T* at_element(void* base, int64_t off) {
  return base == nullptr ? nullptr : offset_ptr<T>(base, off);
}

// Blocks per SM the registers of an 8-bit kernel with fp32 / half params are budgeted for: two (at
// most 64 registers a thread at 512 threads, twice the resident warps of one). Half params with a
// model copy, a combination no wrapper makes (half params step without one; fp32 masters have the
// half copy), spilled 4 bytes within 64 registers (nvcc 13.0; Adam: sm_80 and sm_90, SGD: sm_80):
// one block, no spill.
template <class P, class M>
constexpr int kMinBlocksPerSm =
    !std::is_same<P, float>::value && !std::is_same<M, NoOut>::value ? 1 : 2;

// The param of a block update, as the block reads and writes it: element `i` of the chunk (the
// vector forms: i0..i0+kILP-1), `n` the guarded forms' bound. store* step p32 by the update's
// direction q (the op's master_param).
//
// fp32 or half params at the chunk's first element, with the optional model copy.
template <class P, class M>
struct MasterParam {
  P* p;
  M* out;  // nullptr: no model copy

  template <class Op>
  __device__ __forceinline__ static MasterParam at_chunk(const Op&, const typename Op::Ctx&,
                                                         void* p, void* out, int64_t begin) {
    return {offset_ptr<P>(p, begin), at_element<M>(out, begin)};
  }
  __device__ __forceinline__ bool aligned() const {
    return pack_aligned(p) && (out == nullptr || pack_aligned(out));
  }
  __device__ __forceinline__ void load_pack(float (&r)[kILP], int i0) const {
    cuda::load_pack(r, p, i0);
  }
  __device__ __forceinline__ float load_one(int i, int n) const { return cuda::load_one(p, i, n); }
  static constexpr bool kPrefetch = true;
  __device__ __forceinline__ void prefetch(int b0, int byte) const { prefetch_line(p + b0, byte); }
  template <class Op>
  __device__ __forceinline__ void store_pack(const Op& op, const typename Op::Ctx& ctx, int i0,
                                             const float (&p32)[kILP],
                                             const float (&q)[kILP]) const {
    float r[kILP];
#pragma unroll
    for (int j = 0; j < kILP; ++j) r[j] = op.master_param(ctx, p32[j], q[j]);
    cuda::store_pack(p, i0, r);
    if (out != nullptr) cuda::store_pack(out, i0, r);
  }
  template <class Op>
  __device__ __forceinline__ void store_one(const Op& op, const typename Op::Ctx& ctx, int i,
                                            int n, float p32, float q) const {
    const float r = op.master_param(ctx, p32, q);
    cuda::store_one(p, i, n, r);
    if (out != nullptr) cuda::store_one(out, i, n, r);
  }
};

// The update launches of one call of an 8-bit kernel (`lists` in its Meta's order). No launch ends
// in a partial extra wave of the blocks the device holds at once (blocks_per_launch): a block's
// 256-element quantization blocks are many and alike, so blocks take the same time, and a partial
// last wave is time lost.
template <auto kKernel, int kLists, class Op>
void launch_quantized(const char* name, const std::array<at::TensorList, kLists>& lists,
                      const Op& op) {
  const Stream stream = current_stream();
  const int per_launch = blocks_per_launch(total_chunks(lists[0], kQuantChunkSize),
                                           resident_blocks<kKernel, kBlockSize>());
  for_each_launch<kLists, kQuantChunkSize>(
      lists,
      [&](int blocks, const TensorListMeta<kLists, kQuantChunkSize>& meta) {
        launch(name, kKernel, blocks, kBlockSize, stream, meta, op);
      },
      per_launch);
}

}  // namespace cuda
}  // namespace mp_wrappers
