// Launch geometry of the multi-tensor kernels: a compile-time parameter.
//
// The real build uses RealGeometry (apex's: 64K-element chunks, 512-thread blocks, launches of up
// to 320 blocks). The host-execution tests also build with -DMP_WRAPPERS_CUDA_GEOMETRY=TinyGeometry,
// where a few hundred elements already span several chunks and launches, so the planner's
// many-launch paths run in milliseconds. Nothing else may hard-code these numbers.
#pragma once

#include <cstdint>

namespace mp_wrappers {
namespace cuda {

struct RealGeometry {
  static constexpr int64_t kChunkSize = 65536;
  static constexpr int kBlockSize = 512;
  static constexpr int kMaxBlocks = 320;  // blocks (chunks) per launch
  static constexpr int kPerTensorThreads = 128;  // block size of the one-thread-per-tensor kernels
  // Chunks of the block-wise quantized kernels (multi_tensor_adam8bit.cu): whole quantization
  // blocks of 256 elements, so that no block spans two chunks.
  static constexpr int64_t kQuantChunkSize = 65536;
  // Tensors per launch by list depth, so that TensorListMeta stays within the 4 KB argument limit.
  static constexpr int max_tensors(int depth) {
    return depth <= 1 ? 110 : depth == 2 ? 64 : depth == 3 ? 48 : depth == 4 ? 36 : 30;
  }
};

struct TinyGeometry {
  static constexpr int64_t kChunkSize = 448;  // 1.75 strides of a 64-thread block at 4 per thread
  static constexpr int kBlockSize = 64;       // two warps: block reductions cross warps
  static constexpr int kMaxBlocks = 7;
  static constexpr int kPerTensorThreads = 32;
  // Three quantization blocks for two warps: the second pass over a chunk leaves a warp idle.
  static constexpr int64_t kQuantChunkSize = 768;
  static constexpr int max_tensors(int depth) { return depth <= 1 ? 5 : depth <= 3 ? 4 : 3; }
};

#ifndef MP_WRAPPERS_CUDA_GEOMETRY
#define MP_WRAPPERS_CUDA_GEOMETRY RealGeometry
#endif
using Geometry = MP_WRAPPERS_CUDA_GEOMETRY;

constexpr int64_t kChunkSize = Geometry::kChunkSize;
constexpr int kBlockSize = Geometry::kBlockSize;
constexpr int kMaxBlocks = Geometry::kMaxBlocks;
constexpr int kPerTensorThreads = Geometry::kPerTensorThreads;
constexpr int64_t kQuantChunkSize = Geometry::kQuantChunkSize;
constexpr int kILP = 4;  // elements per thread and vector access (16 bytes of fp32)
constexpr int kWarp = 32;

static_assert(kBlockSize % kWarp == 0, "blocks are whole warps");
static_assert(kChunkSize % kILP == 0, "chunks keep vector alignment");
static_assert(kQuantChunkSize % 256 == 0, "quantized chunks hold whole quantization blocks");
static_assert(kMaxBlocks <= 65535, "block_to_chunk bookkeeping");

}  // namespace cuda
}  // namespace mp_wrappers
