// Host execution of the CUDA kernels: the small part of the CUDA programming model they use,
// emulated with fibers, so that the same .cu / .cuh lines run on the CPU in CI (issue 17).
//
// Included only by mp_wrappers/cuda/runtime.cuh when MP_WRAPPERS_CUDA_HOST is defined (the test
// build made by tests/cuda_host.py); nvcc never sees this file.
//
// The model, as numba's CUDA simulator does it:
//   * a launch runs its blocks one after another (blockIdx.x = 0, 1, ...); the threads of a block
//     are fibers (user-level contexts, each with a stack of its own) of a persistent team (one team
//     per block size, reused across launches), run on the launching OS thread and switched at
//     every barrier, so a block reduction really interleaves its threads as the GPU's warps do;
//   * __syncthreads() is a barrier among the block's live threads (a thread that has returned no
//     longer counts, as on the GPU); warp shuffles exchange values through a per-warp slot array
//     between two warp barriers; a barrier some live thread never reaches (a divergent
//     __syncthreads would hang a GPU too) aborts the process with a message as soon as no thread
//     can go on;
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
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

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

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "mp_wrappers cuda host emulation: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Suspends the running thread (a fiber of the Team below) until *generation differs from seen.
void wait_for_release(const uint64_t* generation, uint64_t seen, const char* what);

// A reusable barrier over the live threads of a group (block or warp); drop() removes a thread
// that has returned from the kernel. The threads are fibers of one OS thread: a thread that
// arrives before the last one suspends until that one releases the barrier.
class Barrier {
 public:
  void reset(int n) {
    expected_ = n;
    arrived_ = 0;
  }
  void arrive_and_wait(const char* what) {
    const uint64_t gen = generation_;
    if (++arrived_ == expected_) {
      release();
      return;
    }
    wait_for_release(&generation_, gen, what);
  }
  void drop() {
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    ++generation_;
  }
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

// The emulated CUDA thread that runs now and its traffic counters (the team swaps it in and out
// with the fiber of each thread, so it is no thread_local: every block runs on one OS thread).
struct ThreadState {
  dim3 thread_idx, block_idx;
  Block* block = nullptr;
  uint64_t bytes_read = 0, bytes_written = 0;
  // Global stores as issued (one per st()/store_pack access, whatever its width): with the bytes,
  // which path a kernel took (16-byte packs or element stores), which the bytes alone cannot tell.
  uint64_t stores = 0;
};
inline ThreadState t_state;
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
// n persistent fibers that run one block at a time on the launching OS thread: run_block resumes
// each runnable thread in turn (in index order, so a run repeats exactly); a thread runs until it
// waits at a barrier or returns from the kernel, and run_block returns when all have returned.
//
// Why fibers and not OS threads (which this emulation used first): a block of the real geometry
// is 512 threads, and every block start, barrier and shuffle woke them all through futexes. On
// the 2-core CI machine one host test spent 32 s in the OS kernel against 20 s in user code, and
// the host check's tests took 641 s for the real and tiny builds. A fiber switch is glibc's
// swapcontext: a register save and restore and one signal-mask system call.
class Team {
 public:
  explicit Team(int n) : fibers_(static_cast<size_t>(n)) {
    for (Fiber& f : fibers_) {
      void* region = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (region == MAP_FAILED) fail("cannot map a fiber's stack");
      // The lowest page faults: a thread that overflows its stack crashes at once instead of
      // writing into its neighbour's.
      if (mprotect(region, kGuardBytes, PROT_NONE) != 0) fail("cannot protect a fiber's guard page");
      f.region = region;
      f.stack = static_cast<char*>(region) + kGuardBytes;
      if (getcontext(&f.context) != 0) fail("getcontext failed");
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = nullptr;
      makecontext(&f.context, &Team::entry, 0);
    }
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;
  // A fiber between blocks is parked at the end of entry()'s loop with nothing to destroy.
  ~Team() {
    for (Fiber& f : fibers_) munmap(f.region, kGuardBytes + kStackBytes);
  }

  // Returns the bytes read and written and the stores issued by the block.
  std::tuple<uint64_t, uint64_t, uint64_t> run_block(dim3 block_idx, const std::function<void()>& body,
                                                     Block* block) {
    body_ = &body;
    read_ = written_ = stores_ = 0;
    for (size_t t = 0; t < fibers_.size(); ++t) {
      Fiber& f = fibers_[t];
      f.state = ThreadState{dim3(static_cast<unsigned int>(t)), block_idx, block, 0, 0, 0};
      f.done = false;
      f.waits_on = nullptr;
    }
    const ThreadState caller = t_state;
    size_t live = fibers_.size();
    while (live > 0) {
      bool resumed = false;
      for (Fiber& f : fibers_) {
        if (f.done || (f.waits_on != nullptr && *f.waits_on == f.seen)) continue;
        f.waits_on = nullptr;
        resume(f);
        resumed = true;
        if (f.done) --live;
      }
      if (!resumed) {
        // Every live thread waits and none released a barrier: one that some of them wait at
        // is never reached by the others.
        for (const Fiber& f : fibers_)
          if (!f.done)
            fail(std::string(f.waits_for) +
                 " not reached by every live thread of the group (deadlock)");
      }
    }
    t_state = caller;
    return std::make_tuple(read_, written_, stores_);
  }

  // In a fiber: suspends its thread until *generation differs from seen.
  void wait(const uint64_t* generation, uint64_t seen, const char* what) {
    Fiber& f = *current_;
    f.waits_on = generation;
    f.seen = seen;
    f.waits_for = what;
    suspend(f);
  }

 private:
  // 256 KiB of address space per thread, committed only as touched; the kernels' frames (at -O0,
  // with sanitizer redzones) take a few KiB.
  static constexpr size_t kStackBytes = 256 * 1024;
  static constexpr size_t kGuardBytes = 4096;

  struct Fiber {
    ucontext_t context;
    void* region = nullptr;
    char* stack = nullptr;
    ThreadState state;
    bool done = true;
    const uint64_t* waits_on = nullptr;  // a barrier's generation, while waiting there
    uint64_t seen = 0;
    const char* waits_for = "";
    void* fake_stack = nullptr;  // AddressSanitizer's, while suspended
  };

  void resume(Fiber& f) {
    current_ = &f;
    t_state = f.state;
    start_switch(&scheduler_fake_stack_, f.stack, kStackBytes);
    if (swapcontext(&scheduler_, &f.context) != 0) fail("swapcontext failed");
    finish_switch(scheduler_fake_stack_, nullptr, nullptr);
    f.state = t_state;
  }
  void suspend(Fiber& f) {
    start_switch(&f.fake_stack, scheduler_stack_, scheduler_stack_size_);
    if (swapcontext(&f.context, &scheduler_) != 0) fail("swapcontext failed");
    finish_switch(f.fake_stack, &scheduler_stack_, &scheduler_stack_size_);
  }

  // Every fiber runs this, once: the thread's kernel body for each block it is resumed for.
  static void entry();

  // AddressSanitizer follows the stack switches (it would take a fiber's frames for overflows of
  // the thread's stack); nothing without it.
  static void start_switch(void** fake_stack, const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#else
    (void)fake_stack, (void)bottom, (void)size;
#endif
  }
  static void finish_switch(void* fake_stack, const void** bottom_old, size_t* size_old) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, bottom_old, size_old);
#else
    (void)fake_stack, (void)bottom_old, (void)size_old;
#endif
  }

  std::vector<Fiber> fibers_;
  Fiber* current_ = nullptr;
  ucontext_t scheduler_;
  void* scheduler_fake_stack_ = nullptr;
  const void* scheduler_stack_ = nullptr;
  size_t scheduler_stack_size_ = 0;
  const std::function<void()>* body_ = nullptr;
  uint64_t read_ = 0, written_ = 0, stores_ = 0;
};

// The team running a block (one launch at a time: g_launch_mutex).
inline Team* g_team = nullptr;

inline void Team::entry() {
  Team& team = *g_team;
  Fiber& self = *team.current_;
  team.finish_switch(nullptr, &team.scheduler_stack_, &team.scheduler_stack_size_);
  for (;;) {
    (*team.body_)();
    // The scheduler resumed this fiber with its thread's state (run_block set it per block).
    const int tid = static_cast<int>(t_state.thread_idx.x);
    Block& block = *t_state.block;
    const int warp = tid / kWarpSize;
    block.warps[warp]->live[tid % kWarpSize] = false;
    block.warps[warp]->barrier.drop();
    block.barrier.drop();
    team.read_ += t_state.bytes_read;
    team.written_ += t_state.bytes_written;
    team.stores_ += t_state.stores;
    self.done = true;
    team.suspend(self);  // until the next block
  }
}

inline void wait_for_release(const uint64_t* generation, uint64_t seen, const char* what) {
  g_team->wait(generation, seen, what);
}

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
  g_team = &team;
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
