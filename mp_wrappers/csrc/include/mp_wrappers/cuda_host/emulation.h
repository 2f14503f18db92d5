// Host execution of the CUDA kernels: the small part of the CUDA programming model they use,
// emulated with OS threads, so that the same .cu / .cuh lines run on the CPU in CI (issue 17).
//
// Included only by mp_wrappers/cuda/runtime.cuh when MP_WRAPPERS_CUDA_HOST is defined (the test
// build made by tests/cuda_host.py); nvcc never sees this file.
//
// The model, as numba's CUDA simulator does it:
//   * a launch runs its blocks one after another (blockIdx.x = 0, 1, ...); the threads of a block
//     are real OS threads of a persistent team (one team per block size, reused across launches),
//     so a block reduction really runs concurrently;
//   * __syncthreads() is a barrier among the block's live threads (a thread that has returned no
//     longer counts, as on the GPU); warp shuffles exchange values through a per-warp slot array
//     between two warp barriers; a barrier not reached within kDeadlockSeconds aborts the process
//     with a message (a divergent __syncthreads would hang a GPU too);
//   * __shared__ variables are function-local statics: one block runs at a time, so one copy is
//     exactly one block's shared memory;
//   * the __*_rn intrinsics are the IEEE host operations (build with -ffp-contract=off);
//   * atomics are host atomics on the same addresses;
//   * every global load and store of the kernels goes through the helpers of
//     mp_wrappers/cuda/multi_tensor_apply.cuh, which call count_load / count_store here: the bytes
//     each launch reads and writes are recorded per kernel (traffic_log()).
// What this cannot show: timing, the GPU memory model, warp scheduling, real vector loads.
#pragma once

#include <math.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- CUDA keywords ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

namespace mp_wrappers {
namespace cuda_host {

// Blocks of any kernel the emulated device holds at once (the launch planner sizes the launches of
// some kernels by it). Fewer than the tiny geometry's 7 blocks a launch, so that its launches come
// in whole waves; the tests set other values (set_resident_blocks), 0 for a device that cannot say.
inline std::atomic<int> g_resident_blocks{3};

constexpr int kWarpSize = 32;
constexpr int kDeadlockSeconds = 60;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "mp_wrappers cuda host emulation: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// A reusable barrier over the live threads of a group (block or warp); drop() removes a thread
// that has returned from the kernel.
class Barrier {
 public:
  void reset(int n) {
    expected_ = n;
    arrived_ = 0;
  }
  void arrive_and_wait(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t gen = generation_;
    if (++arrived_ == expected_) {
      release();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(kDeadlockSeconds),
                      [&] { return generation_ != gen; }))
      fail(std::string(what) + " not reached by every live thread of the group (deadlock)");
  }
  void drop() {
    std::unique_lock<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  int expected_ = 0, arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Warp {
  Barrier barrier;
  uint64_t slots[kWarpSize];
  bool live[kWarpSize];
};

// The state of the block being run.
struct Block {
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::mutex error_mutex;
  std::string error;

  void reset(int n_threads) {
    barrier.reset(n_threads);
    const int n_warps = (n_threads + kWarpSize - 1) / kWarpSize;
    while (static_cast<int>(warps.size()) < n_warps) warps.emplace_back(new Warp());
    for (int w = 0; w < n_warps; ++w) {
      const int lanes = std::min(kWarpSize, n_threads - w * kWarpSize);
      warps[w]->barrier.reset(lanes);
      for (int l = 0; l < kWarpSize; ++l) warps[w]->live[l] = l < lanes;
    }
    error.clear();
  }
  void report(const std::string& e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (error.empty()) error = e;
  }
};

// Per OS thread: the emulated CUDA thread it runs and its traffic counters.
struct ThreadState {
  dim3 thread_idx, block_idx;
  Block* block = nullptr;
  uint64_t bytes_read = 0, bytes_written = 0;
  // Global stores as issued (one per st()/store_pack access, whatever its width): with the bytes,
  // which path a kernel took (16-byte packs or element stores), which the bytes alone cannot tell.
  uint64_t stores = 0;
};
inline thread_local ThreadState t_state;
inline dim3 g_block_dim, g_grid_dim;

inline void count_load(uint64_t bytes) { t_state.bytes_read += bytes; }
// A global access at an address that is not a multiple of its size faults on the GPU ("misaligned
// address"); host loads would just work, so the emulation reports it instead.
inline void check_aligned(const void* p, uint64_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0 && t_state.block != nullptr)
    t_state.block->report("misaligned global access: " + std::to_string(align) +
                          "-byte access at an address that is not a multiple of it");
}
// A prefetch is a hint the GPU drops at a bad address; here its byte is read (not counted as
// traffic), so that an address outside the kernel's tensors faults, or trips AddressSanitizer, and
// its address is recorded (prefetch_log()): a prefetch of the wrong line, or of none, changes no
// result, so only its addresses can show it.
inline std::mutex g_prefetch_mutex;
inline std::vector<uintptr_t> g_prefetches;
inline void touch(const void* p) {
  (void)*static_cast<const volatile char*>(p);
  std::lock_guard<std::mutex> lock(g_prefetch_mutex);
  g_prefetches.push_back(reinterpret_cast<uintptr_t>(p));
}
inline std::vector<uintptr_t> prefetch_log() {
  std::lock_guard<std::mutex> lock(g_prefetch_mutex);
  return g_prefetches;
}
inline void count_store(uint64_t bytes) {
  t_state.bytes_written += bytes;
  ++t_state.stores;
}

// ---- traffic log ----------------------------------------------------------------------------------
struct LaunchRecord {
  std::string kernel;
  unsigned int grid, block;
  uint64_t bytes_read, bytes_written, stores;
};
inline std::mutex g_log_mutex;
inline std::vector<LaunchRecord> g_log;

inline std::vector<LaunchRecord> traffic_log() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  return g_log;
}
inline void traffic_reset() {
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    g_log.clear();
  }
  std::lock_guard<std::mutex> lock(g_prefetch_mutex);
  g_prefetches.clear();
}

// ---- the thread team ------------------------------------------------------------------------------
// n persistent threads that run one block at a time: run_block wakes them all, each runs the kernel
// body as thread tid of the block, and run_block returns when all have returned.
class Team {
 public:
  explicit Team(int n) : n_(n) {
    for (int t = 0; t < n; ++t) threads_.emplace_back([this, t] { worker(t); });
  }
  ~Team() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  // Returns the bytes read and written and the stores issued by the block.
  std::tuple<uint64_t, uint64_t, uint64_t> run_block(dim3 block_idx, const std::function<void()>& body,
                                          Block* block) {
    std::unique_lock<std::mutex> lock(mutex_);
    block_idx_ = block_idx;
    body_ = &body;
    block_ = block;
    done_ = 0;
    read_ = written_ = stores_ = 0;
    ++epoch_;
    start_.notify_all();
    done_cv_.wait(lock, [&] { return done_ == n_; });
    return std::make_tuple(read_, written_, stores_);
  }

 private:
  void worker(int tid) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return stop_ || epoch_ != seen; });
        if (stop_) return;
        seen = epoch_;
      }
      t_state = ThreadState{dim3(tid), block_idx_, block_, 0, 0, 0};
      (*body_)();
      const int warp = tid / kWarpSize;
      block_->warps[warp]->live[tid % kWarpSize] = false;
      block_->warps[warp]->barrier.drop();
      block_->barrier.drop();
      std::lock_guard<std::mutex> lock(mutex_);
      read_ += t_state.bytes_read;
      written_ += t_state.bytes_written;
      stores_ += t_state.stores;
      if (++done_ == n_) done_cv_.notify_one();
    }
  }

  const int n_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_cv_;
  uint64_t epoch_ = 0;
  int done_ = 0;
  bool stop_ = false;
  dim3 block_idx_;
  const std::function<void()>* body_ = nullptr;
  Block* block_ = nullptr;
  uint64_t read_ = 0, written_ = 0, stores_ = 0;
};

// One launch at a time: __shared__ statics and the block state belong to the running block.
inline std::mutex g_launch_mutex;

inline Team& team_of_size(int n) {
  static std::map<int, std::unique_ptr<Team>> teams;
  std::unique_ptr<Team>& t = teams[n];
  if (!t) t.reset(new Team(n));
  return *t;
}

// Runs body once per (block, thread) of a 1-D grid of 1-D blocks.
inline void run_grid(const char* kernel, dim3 grid, dim3 block, const std::function<void()>& body) {
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1)
    fail(std::string(kernel) + ": only 1-D grids and blocks are emulated");
  if (grid.x == 0 || block.x == 0 || block.x > 1024)
    fail(std::string(kernel) + ": invalid launch configuration (grid " +
         std::to_string(grid.x) + ", block " + std::to_string(block.x) + ")");
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  g_grid_dim = grid;
  g_block_dim = block;
  static Block state;
  Team& team = team_of_size(static_cast<int>(block.x));
  uint64_t read = 0, written = 0, stores = 0;
  for (unsigned int b = 0; b < grid.x; ++b) {
    state.reset(static_cast<int>(block.x));
    const auto traffic = team.run_block(dim3(b), body, &state);
    read += std::get<0>(traffic);
    written += std::get<1>(traffic);
    stores += std::get<2>(traffic);
    if (!state.error.empty()) fail(std::string(kernel) + ": " + state.error);
  }
  std::lock_guard<std::mutex> log_lock(g_log_mutex);
  g_log.push_back(LaunchRecord{kernel, grid.x, block.x, read, written, stores});
}

// kernel<<<grid, block>>>(args...): the arguments are copied once, as the driver copies them into
// the parameter buffer, and every thread runs the kernel on that copy.
template <class... KArgs, class... Args>
void launch(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block, Args&&... args) {
  std::tuple<std::decay_t<KArgs>...> params(std::forward<Args>(args)...);
  run_grid(name, grid, block, [&] { std::apply(kernel, params); });
}

// ---- block and warp primitives --------------------------------------------------------------------
inline void syncthreads() { t_state.block->barrier.arrive_and_wait("__syncthreads()"); }

// Exchanges one value per lane of the calling thread's warp; returns the value of lane src(lane).
template <class T, class Src>
T warp_exchange(T v, const Src& src, const char* what) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value,
                "warp exchange of an unsupported type");
  const int tid = static_cast<int>(t_state.thread_idx.x);
  const int lane = tid % kWarpSize;
  Warp& w = *t_state.block->warps[tid / kWarpSize];
  std::memcpy(&w.slots[lane], &v, sizeof(T));
  w.barrier.arrive_and_wait(what);
  const int s = src(lane);
  T r = v;
  if (s >= 0 && s < kWarpSize) {
    if (!w.live[s])
      t_state.block->report(std::string(what) + " read lane " + std::to_string(s) +
                            ", which is not running");
    else
      std::memcpy(&r, &w.slots[s], sizeof(T));
  }
  w.barrier.arrive_and_wait(what);
  return r;
}

}  // namespace cuda_host
}  // namespace mp_wrappers

#define threadIdx (::mp_wrappers::cuda_host::t_state.thread_idx)
#define blockIdx (::mp_wrappers::cuda_host::t_state.block_idx)
#define blockDim (::mp_wrappers::cuda_host::g_block_dim)
#define gridDim (::mp_wrappers::cuda_host::g_grid_dim)

inline void __syncthreads() { ::mp_wrappers::cuda_host::syncthreads(); }

// Warp shuffles and votes (width 32; the mask is assumed to name every live lane, as our kernels
// pass 0xffffffff with full warps).
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
  return ::mp_wrappers::cuda_host::warp_exchange(
      v, [delta](int lane) { return lane + static_cast<int>(delta) < 32 ? lane + static_cast<int>(delta) : -1; },
      "__shfl_down_sync");
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return ::mp_wrappers::cuda_host::warp_exchange(
      v, [mask](int lane) { return lane ^ mask; }, "__shfl_xor_sync");
}
template <class T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
  return ::mp_wrappers::cuda_host::warp_exchange(v, [src](int) { return src; }, "__shfl_sync");
}
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) {
    const int p = ::mp_wrappers::cuda_host::warp_exchange(
        pred ? 1 : 0, [l](int) { return l; }, "__ballot_sync");
    bits |= (p ? 1u : 0u) << l;
  }
  return bits;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
  const unsigned lanes = __ballot_sync(mask, 1);
  return __ballot_sync(mask, pred) == lanes;
}

// IEEE round-to-nearest arithmetic (the host default; -ffp-contract=off keeps it unfused).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }  // one rounding
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
// Round to nearest even: the host's default rounding mode, as cvt.rni.
inline int __float2int_rn(float f) { return static_cast<int>(nearbyintf(f)); }

// Atomics on the same host addresses (compare-and-swap on the bits for floating types).
template <class T>
T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  } else {
    T old, desired;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    do {
      desired = old + v;
    } while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
    return old;
  }
}
template <class T>
T atomicMax(T* p, T v) {
  T old;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  while (old < v &&
         !__atomic_compare_exchange(p, &old, &v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  T old;
  __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
template <class T>
T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
