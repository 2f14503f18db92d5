// The Python module of the host-execution build (docs/cuda.md "Host execution"): importing it
// registers the CUDA entry points of mp_wrappers/csrc/cuda/*.cu, compiled for the host, as CPU
// kernels of the op namespace MP_WRAPPERS_CUDA_HOST_NS (defined from mp_wrappers' own schemas by
// tests/cuda_host.py before the import). This module adds the build facts and the traffic
// log of the emulated launches. Never part of the installed package's extension.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "mp_wrappers/cuda/geometry.cuh"
#include "mp_wrappers/cuda/runtime.cuh"
#include "mp_wrappers/cuda_host/emulation.h"

#define MPW_STR2(x) #x
#define MPW_STR(x) MPW_STR2(x)

// Two kernels of the emulation's own tests (tests/kernels/test_cuda_host_emulation.py), never
// built by nvcc: what the CUDA sources rely on of its barriers, shown without a real kernel.
namespace {

// Each live thread writes its slot of shared memory, waits at the block barrier, then reads its
// neighbour's: every value read is one written before the barrier only if the barrier holds every
// live thread until the last arrives. Threads from `live` on return first and no longer count.
__global__ void rotate_through_shared(int* out, int live) {
  __shared__ int slots[1024];
  const int t = static_cast<int>(threadIdx.x);
  if (t >= live) return;
  slots[t] = static_cast<int>(blockIdx.x) * 10000 + t;
  __syncthreads();
  out[blockIdx.x * blockDim.x + t] = slots[(t + 1) % live];
}

// A divergent barrier: thread 0 waits at the block's, the rest of its warp at a shuffle that needs
// thread 0; a GPU would hang, the emulation must abort with a message.
__global__ void divergent_barrier() {
  if (threadIdx.x == 0)
    __syncthreads();
  else
    (void)__shfl_sync(0xffffffffu, 1, 0);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace mc = mp_wrappers::cuda;
  namespace host = mp_wrappers::cuda_host;
  m.doc() = "mp_wrappers CUDA kernels executed on the host (test build)";
  m.attr("namespace") = MPW_STR(MP_WRAPPERS_CUDA_HOST_NS);
  pybind11::dict g;
  g["name"] = MPW_STR(MP_WRAPPERS_CUDA_GEOMETRY);
  g["chunk_size"] = mc::kChunkSize;
  g["quant_chunk_size"] = mc::kQuantChunkSize;
  g["block_size"] = mc::kBlockSize;
  g["max_blocks"] = mc::kMaxBlocks;
  g["per_tensor_threads"] = mc::kPerTensorThreads;
  std::vector<int> max_tensors;
  for (int depth = 1; depth <= 7; ++depth) max_tensors.push_back(mc::Geometry::max_tensors(depth));
  g["max_tensors"] = max_tensors;  // by list depth 1..7
  m.attr("geometry") = g;
  m.def("traffic_reset", &host::traffic_reset, "Forget the recorded launches and prefetches.");
  m.def("prefetch_log", &host::prefetch_log,
        "The addresses asked of L2 (prefetch_l2) since traffic_reset(), one per request, in no "
        "particular order (the threads of a block run at once).");
  m.def(
      "resident_blocks", [] { return host::g_resident_blocks.load(); },
      "Blocks of a kernel the emulated device holds at once.");
  m.def(
      "set_resident_blocks", [](int n) { host::g_resident_blocks.store(n); },
      "Set the blocks of a kernel the emulated device holds at once (0: a device that cannot "
      "say); returns nothing.");
  m.def(
      "traffic_log",
      [] {
        std::vector<std::tuple<std::string, unsigned, unsigned, uint64_t, uint64_t>> out;
        for (const host::LaunchRecord& r : host::traffic_log())
          out.emplace_back(r.kernel, r.grid, r.block, r.bytes_read, r.bytes_written);
        return out;
      },
      "The launches since traffic_reset(): (kernel, blocks, threads per block, bytes read, "
      "bytes written).");
  m.def(
      "store_log",
      [] {
        std::vector<std::tuple<std::string, uint64_t>> out;
        for (const host::LaunchRecord& r : host::traffic_log()) out.emplace_back(r.kernel, r.stores);
        return out;
      },
      "The launches since traffic_reset(): (kernel, global stores issued), one per access "
      "whatever its width (16-byte packs count one).");
  // launch()'s 4 KB kernel-argument check counts bytes with param_buffer_size; its value for a
  // few argument lists (alignment padding between arguments, none after the last), so that a
  // test can hold it to the C layout (the check itself only fails a build near the limit).
  pybind11::dict sizes;
  sizes["double,char"] = mc::param_buffer_size<double, char>();
  sizes["char,double"] = mc::param_buffer_size<char, double>();
  sizes["char,int32,char,int64"] = mc::param_buffer_size<char, int32_t, char, int64_t>();
  sizes["int16,char,float"] = mc::param_buffer_size<int16_t, char, float>();
  m.attr("param_buffer_sizes") = sizes;
  m.def(
      "emulation_rotate_through_shared",
      [](unsigned int blocks, unsigned int threads, int live) {
        std::vector<int> out(static_cast<size_t>(blocks) * threads, -1);
        mc::launch("rotate_through_shared", rotate_through_shared, blocks, threads,
                   mc::current_stream(), out.data(), live);
        return out;
      },
      "Test of the emulation's block barrier: out[b * threads + t] is the value the live thread t "
      "of block b read from its neighbour's shared slot after the barrier (-1 where t >= live).");
  m.def(
      "emulation_divergent_barrier",
      [](unsigned int threads) {
        mc::launch("divergent_barrier", divergent_barrier, 1, threads, mc::current_stream());
      },
      "Test of the emulation: a launch whose threads wait at different barriers; aborts the "
      "process with a message.");
}
