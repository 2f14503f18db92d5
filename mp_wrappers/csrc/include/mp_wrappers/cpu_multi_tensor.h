// The CPU counterpart of multi_tensor_apply: cut a list of tensors into fixed-size chunks and run a
// kernel over them on at::parallel_for threads.
//
// Chunk boundaries depend only on the tensor sizes (never on the thread count), so a kernel that
// writes one partial result per chunk (a sum of squares, a found-non-finite bit) and combines them
// in chunk order afterwards is deterministic for any number of threads.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "mp_wrappers/checks.h"

namespace mp_wrappers {
namespace cpu {

// 64K elements: big enough that per-chunk overhead (ISA switch, dtype switch, a partial result)
// vanishes, small enough to balance a few hundred tensors over the threads.
constexpr int64_t kChunkElems = 65536;
// Below this many elements in total, forking threads costs more than it saves.
constexpr int64_t kMinParallelElems = 32768;

struct TensorChunk {
  int64_t tensor;  // index in the tensor lists
  int64_t begin;   // element offset inside that tensor
  int64_t end;     // one past the last element
};

// Raw view of one tensor for use inside the parallel region (no Tensor calls there).
struct RawTensor {
  void* data;
  StorageDtype dtype;
};

inline std::vector<RawTensor> raw_tensors(at::TensorList list) {
  std::vector<RawTensor> out;
  out.reserve(list.size());
  for (const at::Tensor& t : list) out.push_back({t.data_ptr(), storage_dtype(t.scalar_type())});
  return out;
}

class ChunkPlan {
 public:
  // numels[i] is the element count of the tensors at index i of the (parallel) lists.
  explicit ChunkPlan(const std::vector<int64_t>& numels, int64_t chunk_elems = kChunkElems) {
    for (int64_t t = 0; t < static_cast<int64_t>(numels.size()); ++t) {
      for (int64_t b = 0; b < numels[t]; b += chunk_elems) {
        starts_.push_back(total_);
        const int64_t e = std::min(numels[t], b + chunk_elems);
        chunks_.push_back({t, b, e});
        total_ += e - b;
      }
    }
  }
  explicit ChunkPlan(at::TensorList tensors, int64_t chunk_elems = kChunkElems)
      : ChunkPlan(numels_of(tensors), chunk_elems) {}

  size_t size() const { return chunks_.size(); }
  const TensorChunk& operator[](size_t i) const { return chunks_[i]; }
  int64_t total_elems() const { return total_; }

  // Calls fn(chunk_index, chunk) once for every chunk. Each thread gets one contiguous run of
  // chunks holding about the same number of elements (mixed tensor sizes would leave a plain
  // split by chunk count unbalanced). Exceptions propagate through at::parallel_for.
  template <class Fn>
  void parallel_for_each(const Fn& fn) const {
    const int64_t n = static_cast<int64_t>(chunks_.size());
    if (n == 0) return;
    int64_t threads = total_ < kMinParallelElems ? 1 : at::get_num_threads();
    threads = std::max<int64_t>(1, std::min<int64_t>(threads, n));
    if (threads == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i, chunks_[i]);
      return;
    }
    // One index per thread (grain 1); nested inside another parallel region at::parallel_for runs
    // the whole range inline, which still covers every chunk.
    at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t lo = first_chunk_at(total_ * t / threads);
        const int64_t hi = t + 1 == threads ? n : first_chunk_at(total_ * (t + 1) / threads);
        for (int64_t i = lo; i < hi; ++i) fn(i, chunks_[i]);
      }
    });
  }

 private:
  static std::vector<int64_t> numels_of(at::TensorList tensors) {
    std::vector<int64_t> n;
    n.reserve(tensors.size());
    for (const at::Tensor& t : tensors) n.push_back(t.numel());
    return n;
  }
  // Index of the first chunk that starts at or after element `offset` of the concatenated lists.
  int64_t first_chunk_at(int64_t offset) const {
    return std::lower_bound(starts_.begin(), starts_.end(), offset) - starts_.begin();
  }

  std::vector<TensorChunk> chunks_;
  std::vector<int64_t> starts_;
  int64_t total_ = 0;
};

// Sets a float32 found_inf flag on the CPU to 1 when `bad`; never clears it.
inline void set_found_inf_cpu(const at::Tensor& found_inf, bool bad) {
  if (bad) *found_inf.data_ptr<float>() = 1.f;
}

}  // namespace cpu
}  // namespace mp_wrappers
