// sim: the CUDA device code of a kernel header, compiled by the host C++ compiler and run on the CPU
// with GPU semantics (the `sim` backend).
//
// The loader's generated translation unit for the sim backend includes this header first, then the
// kernel header, which sees __CUDACC__ and __CUDA_ARCH__ (Hopper, 900) and so compiles its CUDA
// path: the __global__ kernels and their launches (launch_kernel in portability.h), not its host
// implementations. What this header provides, for the host compiler:
//   threadIdx, blockIdx, blockDim, gridDim, warpSize; __syncthreads, __syncwarp, __shfl_*_sync,
//   __ballot_sync, __any_sync, __all_sync; __popc, __ffs, __clz, __brev and friends; atomics on
//   global and shared memory; static __shared__ variables (dynamic shared memory through
//   sparsekv::dynamic_shared<T>()); the _rn arithmetic intrinsics and float/int bit casts; int4 and
//   friends; the runtime calls the headers use (cudaFuncSetAttribute, cudaGetLastError).
// Not provided here: tensor-core instructions, TMA, clusters, inline PTX. The warp MMA
// (mma.sync m16n8k16 bf16) is emulated by sparsekv/mma.h as a warp-collective operation with the
// PTX fragment layout; a kernel that needs anything else guards its code with `#ifdef SPARSEKV_SIM` /
// `#error "<kernel> uses <feature>: no sim build"`.
//
// Execution (cuda_sim::launch). A launch is first checked against Hopper's limits (block size,
// grid dimensions, dynamic shared memory); a violation is a launch error naming the kernel and the
// limit. Blocks then run one at a time, in an order drawn from the seed. A block's threads are
// cooperative fibers on the calling OS thread: a thread runs until it reaches a barrier or a
// warp-synchronous operation, then the scheduler picks the next runnable thread at random. The
// random stream is seeded from SPARSEKV_SIM_SEED (default 0), the kernel and the launch shape, so a
// launch is reproducible and a race between threads shows up as a result that changes with the
// seed. Static and dynamic shared memory are filled with kPoisonWord at every block start. A warp
// operation that part of its mask never reaches, a __syncthreads that part of the block never
// reaches, and a shuffle that reads a lane outside its mask are errors naming the kernel, the
// block and the thread (not a hang); the launch then returns cudaErrorLaunchFailure and
// cudaGetErrorString-like sparsekv_cuda_error_string gives the message.
//
// Memory model: threads switch only at barriers and warp operations, so data races between two
// barriers are explored only at that grain (the order of whole thread segments), and atomics are
// trivially atomic. Timing, the memory model beyond barriers, FMA contraction and the exact ulp of
// expf/logf (glibc here, the CUDA math library there) are not emulated.
#pragma once

// Every standard header the kernel headers use comes first, before __CUDACC__ is defined below
// (libstdc++ and glibc change a few declarations for nvcc).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#pragma GCC visibility push(hidden)  // every module has its own simulator state

#define SPARSEKV_SIM 1
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static shared memory: one copy per module, in a section of its own, so that it can be poisoned
// at every block start (blocks run one at a time, so one copy serves every block).
#define __shared__ static __attribute__((section("cuda_sim_shared")))

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;

inline constexpr int warpSize = 32;

namespace cuda_sim {

// Hopper (sm_90) launch limits.
inline constexpr unsigned kMaxThreadsPerBlock = 1024;
inline constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
inline constexpr unsigned long long kMaxGridDim[3] = {2147483647ull, 65535ull, 65535ull};
inline constexpr size_t kDefaultDynamicSmem = size_t{48} << 10;
inline constexpr size_t kMaxDynamicSmem = size_t{227} << 10;

// Shared memory before its first write: as float a NaN, as int32 2141563301 (bytes A5 A5 A5 7F).
inline constexpr uint32_t kPoisonWord = 0x7FA5A5A5u;

#if defined(__SANITIZE_ADDRESS__)
inline constexpr size_t kStackBytes = size_t{1} << 20;  // ASan's redzones grow every frame
#else
inline constexpr size_t kStackBytes = size_t{256} << 10;
#endif
inline constexpr size_t kGuardBytes = 4096;  // a PROT_NONE page below each stack: overflow faults

enum class Wait { kRunnable, kBarrier, kWarpOp, kDone };
enum class WarpOp { kSync, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };

inline const char* warp_op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kShflIdx: return "__shfl_sync";
    case WarpOp::kShflUp: return "__shfl_up_sync";
    case WarpOp::kShflDown: return "__shfl_down_sync";
    case WarpOp::kShflXor: return "__shfl_xor_sync";
    case WarpOp::kBallot: return "__ballot_sync";
    case WarpOp::kAny: return "__any_sync";
    case WarpOp::kAll: return "__all_sync";
  }
  return "?";
}

struct Thread {
  void* sp = nullptr;  // saved stack pointer while switched out
#if !defined(__x86_64__)
  ucontext_t context;
#endif
  char* stack = nullptr;  // lowest usable byte
  uint3 idx{0, 0, 0};
  int linear = 0;
  Wait wait = Wait::kRunnable;
  // The pending warp operation.
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  uint64_t value = 0;  // the operand's bytes
  int arg = 0;         // source lane, delta or lane mask
  int width = 32;
  uint64_t result = 0;
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
#endif
};

// The state of the launch in progress (one at a time per module: see Sim::mutex).
struct Sim {
  std::mutex mutex;
  std::string kernel;
  uint3 block_idx{0, 0, 0};
  dim3 block_dim, grid_dim;
  std::vector<Thread> threads;
  std::vector<int> runnable;
  int done = 0;
  int at_barrier = 0;
  Thread* current = nullptr;
  void* scheduler_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t scheduler_context;
#endif
  void (*body)(const void*) = nullptr;
  const void* body_args = nullptr;
  std::string error;  // set by a fiber that found a fault; ends the launch
  unsigned char* dynamic_smem = nullptr;
  std::vector<std::pair<const void*, size_t>> opt_in;  // kernel -> max dynamic shared memory
  // Fiber stacks, kept across launches.
  char* stacks = nullptr;
  size_t stacks_count = 0;
#if defined(__SANITIZE_ADDRESS__)
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
#endif
};

inline Sim g;
inline thread_local std::string last_error;
inline thread_local cudaError_t last_code = cudaSuccess;

// The qualified name in a function signature "... [with auto Kernel = NAME; ...]".
inline std::string kernel_name_in(std::string signature) {
  const std::string key = "Kernel = ";
  const size_t at = signature.find(key);
  if (at != std::string::npos) signature = signature.substr(at + key.size());
  signature = signature.substr(0, signature.find_first_of(";]"));
  // The sim translation unit renames namespace sparsekv (see the loader); show the real name.
  for (size_t p; (p = signature.find("sparsekv_sim::")) != std::string::npos;) signature.erase(p + 8, 4);
  return signature;
}

template <auto Kernel>
const std::string& kernel_name() {
  static const std::string name = kernel_name_in(__PRETTY_FUNCTION__);
  return name;
}

inline std::string triple(uint3 v) {
  return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}
inline std::string triple(dim3 v) { return triple(uint3{v.x, v.y, v.z}); }

inline std::string where(const Thread& t) {
  return "sim: kernel `" + g.kernel + "`, block " + triple(g.block_idx) + ", thread " + triple(t.idx) + " (warp " +
         std::to_string(t.linear / warpSize) + ", lane " + std::to_string(t.linear % warpSize) + "): ";
}

inline std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Fibers. On x86-64 a switch saves the callee-saved registers and the FP control words on the old
// stack and pops them from the new one (a few ns; swapcontext costs a signal-mask syscall per
// switch); elsewhere ucontext.

#if defined(__x86_64__)
__attribute__((naked, noinline)) static void switch_stacks(void** /*save*/, void* /*load*/) {
  __asm__(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#endif

inline void fiber_main();

// A fresh fiber for thread t, entering fiber_main on its first switch.
inline void prepare_fiber(Thread& t) {
#if defined(__SANITIZE_ADDRESS__)
  // A fiber abandoned mid-frame (a fault) leaves poisoned redzones on the reused stack.
  __asan_unpoison_memory_region(t.stack, kStackBytes);
  t.fake_stack = nullptr;
#endif
#if defined(__x86_64__)
  // [mxcsr, fpu cw][r15 r14 r13 r12 rbx rbp][fiber_main][0]: after the final `ret` the stack
  // pointer is 8 mod 16, as at the entry of a called function.
  auto* top = reinterpret_cast<uint64_t*>(t.stack + kStackBytes);
  uint64_t* sp = top - 9;
  uint32_t mxcsr;
  uint16_t fpucw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = mxcsr | (static_cast<uint64_t>(fpucw) << 32);
  for (int r = 1; r <= 6; ++r) sp[r] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fiber_main);
  sp[8] = 0;
  t.sp = sp;
#else
  getcontext(&t.context);
  t.context.uc_stack.ss_sp = t.stack;
  t.context.uc_stack.ss_size = kStackBytes;
  t.context.uc_link = nullptr;
  makecontext(&t.context, &fiber_main, 0);
#endif
}

// Scheduler -> thread t; returns when t blocks, finishes or faults.
inline void resume(Thread& t) {
  g.current = &t;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&g.scheduler_fake_stack, t.stack, kStackBytes);
#endif
#if defined(__x86_64__)
  switch_stacks(&g.scheduler_sp, t.sp);
#else
  swapcontext(&g.scheduler_context, &t.context);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(g.scheduler_fake_stack, nullptr, nullptr);
#endif
  g.current = nullptr;
}

// Current thread -> scheduler; returns when the scheduler resumes it (never once it is done).
inline void yield() {
  Thread& t = *g.current;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(t.wait == Wait::kDone ? nullptr : &t.fake_stack, g.scheduler_stack_bottom,
                                 g.scheduler_stack_size);
#endif
#if defined(__x86_64__)
  switch_stacks(&t.sp, g.scheduler_sp);
#else
  swapcontext(&t.context, &g.scheduler_context);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(t.fake_stack, nullptr, nullptr);
#endif
}

inline void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &g.scheduler_stack_bottom, &g.scheduler_stack_size);
#endif
  g.body(g.body_args);
  Thread& t = *g.current;
  t.wait = Wait::kDone;
  ++g.done;
  yield();
  std::abort();  // a finished fiber is never resumed
}

// A fault of thread `who`, found by the running thread: record it and leave the block for good.
[[noreturn]] inline void fault(const Thread& who, const std::string& message) {
  g.error = where(who) + message;
  yield();
  std::abort();  // the scheduler abandons the block
}

// ---------------------------------------------------------------------------------------------
// Barriers and warp operations, called from kernel code.

inline void syncthreads() {
  Thread& t = *g.current;
  t.wait = Wait::kBarrier;
  ++g.at_barrier;
  yield();
}

inline int lane_of(const Thread& t) { return t.linear % warpSize; }

// The lane whose value lane `lane` receives (PTX shfl.sync semantics; `width` splits the warp into
// segments), or `lane` itself when the source falls outside the segment.
inline int shuffle_source(WarpOp op, int lane, int arg, int width) {
  const int min_lane = lane & ~(width - 1);
  const int max_lane = min_lane + width - 1;
  int src = lane;
  switch (op) {
    case WarpOp::kShflIdx: src = min_lane + (arg & (width - 1)); break;
    case WarpOp::kShflUp: src = lane - arg >= min_lane ? lane - arg : lane; break;
    case WarpOp::kShflDown: src = lane + arg <= max_lane ? lane + arg : lane; break;
    case WarpOp::kShflXor: src = (lane ^ arg) <= max_lane ? (lane ^ arg) : lane; break;
    default: break;
  }
  return src;
}

// Lane `lane` of the current thread's warp.
inline Thread* warp_lane(const Thread& t, int lane) {
  const size_t i = static_cast<size_t>(t.linear - lane_of(t) + lane);
  return i < g.threads.size() ? &g.threads[i] : nullptr;
}

// Arrive at a warp operation; completes it when every lane of the mask is there, then yields.
inline uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  Thread& t = *g.current;
  const int lane = lane_of(t);
  if (!(mask >> lane & 1u)) fault(t, std::string(warp_op_name(op)) + "(mask " + hex(mask) + ") called by lane " +
                                  std::to_string(lane) + ", which is not in its mask");
  if (width < 1 || width > warpSize || (width & (width - 1)) != 0) {
    fault(t, std::string(warp_op_name(op)) + " width " + std::to_string(width) + " is not a power of two in [1, 32]");
  }
  for (int l = 0; l < warpSize; ++l) {
    if ((mask >> l & 1u) && warp_lane(t, l) == nullptr) {
      fault(t, std::string(warp_op_name(op)) + "(mask " + hex(mask) + ") names lane " + std::to_string(l) +
            ", but the block has only " + std::to_string(g.threads.size()) + " threads");
    }
  }
  t.wait = Wait::kWarpOp;
  t.op = op;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = width;
  bool complete = true;
  for (int l = 0; l < warpSize && complete; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Thread& u = *warp_lane(t, l);
    complete = u.wait == Wait::kWarpOp && u.op == op && u.mask == mask;
  }
  if (complete) {
    uint64_t ballot = 0;
    bool any = false, all = true;
    for (int l = 0; l < warpSize; ++l) {
      if (!(mask >> l & 1u)) continue;
      const bool pred = warp_lane(t, l)->value != 0;
      ballot |= static_cast<uint64_t>(pred) << l;
      any = any || pred;
      all = all && pred;
    }
    for (int l = 0; l < warpSize; ++l) {
      if (!(mask >> l & 1u)) continue;
      Thread& u = *warp_lane(t, l);
      switch (op) {
        case WarpOp::kSync: u.result = 0; break;
        case WarpOp::kBallot: u.result = ballot; break;
        case WarpOp::kAny: u.result = any; break;
        case WarpOp::kAll: u.result = all; break;
        default: {
          const int src = shuffle_source(op, l, u.arg, u.width);
          if (!(mask >> src & 1u)) {
            fault(u, std::string(warp_op_name(op)) + "(mask " + hex(mask) + ") reads lane " + std::to_string(src) +
                  ", which is not in its mask");
          }
          u.result = warp_lane(t, src)->value;
        }
      }
      u.wait = Wait::kRunnable;
      g.runnable.push_back(u.linear);
    }
  }
  yield();
  return t.result;
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "sim: warp operands are at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Why thread u has not reached the warp operation `op`/`mask` others wait at.
inline std::string absent_because(const Thread& u, WarpOp op, unsigned mask) {
  switch (u.wait) {
    case Wait::kDone: return "had exited";
    case Wait::kBarrier: return "waits at __syncthreads()";
    case Wait::kWarpOp:
      if (u.op != op || u.mask != mask) {
        return std::string("waits at ") + warp_op_name(u.op) + "(mask " + hex(u.mask) + ")";
      }
      return "is there";
    case Wait::kRunnable: break;
  }
  return "is still running";
}

// Every thread is blocked or done and no barrier can open: name the fault.
inline std::string deadlock() {
  for (const Thread& t : g.threads) {
    if (t.wait != Wait::kWarpOp) continue;
    int arrived = 0, expected = 0;
    const Thread* missing = nullptr;
    for (int l = 0; l < warpSize; ++l) {
      if (!(t.mask >> l & 1u)) continue;
      const Thread& u = *warp_lane(t, l);
      ++expected;
      if (u.wait == Wait::kWarpOp && u.op == t.op && u.mask == t.mask) {
        ++arrived;
      } else if (missing == nullptr) {
        missing = &u;
      }
    }
    return where(t) + warp_op_name(t.op) + "(mask " + hex(t.mask) + ") was reached by only " +
           std::to_string(arrived) + " of the " + std::to_string(expected) + " lanes of its mask; lane " +
           std::to_string(lane_of(*missing)) + " (thread " + triple(missing->idx) + ") " +
           absent_because(*missing, t.op, t.mask);
  }
  const Thread* waiting = nullptr;
  const Thread* gone = nullptr;
  for (const Thread& t : g.threads) {
    if (t.wait == Wait::kBarrier && waiting == nullptr) waiting = &t;
    if (t.wait == Wait::kDone && gone == nullptr) gone = &t;
  }
  if (waiting != nullptr && gone != nullptr) {
    return where(*waiting) + "__syncthreads() was reached by only " + std::to_string(g.at_barrier) + " of the " +
           std::to_string(g.threads.size()) + " threads of the block; thread " + triple(gone->idx) +
           " had exited without reaching it";
  }
  return "sim: kernel `" + g.kernel + "`, block " + triple(g.block_idx) + ": the block's threads deadlocked";
}

// ---------------------------------------------------------------------------------------------
// Launch.

extern "C" {
__attribute__((weak, visibility("hidden"))) extern unsigned char __start_cuda_sim_shared[];
__attribute__((weak, visibility("hidden"))) extern unsigned char __stop_cuda_sim_shared[];
}

inline void poison(unsigned char* begin, unsigned char* end) {
  // Byte p gets byte (p % 4) of the word, so every aligned word reads kPoisonWord.
  const auto byte_of = [](const unsigned char* p) {
    return static_cast<unsigned char>(kPoisonWord >> (8 * (reinterpret_cast<uintptr_t>(p) % 4)));
  };
  for (; begin < end && reinterpret_cast<uintptr_t>(begin) % 4 != 0; ++begin) *begin = byte_of(begin);
  for (; begin + 4 <= end; begin += 4) std::memcpy(begin, &kPoisonWord, 4);
  for (; begin < end; ++begin) *begin = byte_of(begin);
}

inline uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t seed_of(const std::string& kernel, dim3 grid, dim3 block, size_t smem) {
  const char* text = std::getenv("SPARSEKV_SIM_SEED");
  uint64_t h = mix(text ? std::strtoull(text, nullptr, 0) : 0);
  for (const char c : kernel) h = mix(h ^ static_cast<unsigned char>(c));
  for (const uint64_t v : {uint64_t{grid.x}, uint64_t{grid.y}, uint64_t{grid.z}, uint64_t{block.x}, uint64_t{block.y},
                           uint64_t{block.z}, uint64_t{smem}}) {
    h = mix(h ^ v);
  }
  return h;
}

inline cudaError_t fail(cudaError_t code, const std::string& message) {
  last_error = message;
  last_code = code;
  return code;
}

// The Hopper limits a launch must meet, or the message naming the one it breaks.
inline std::string check_limits(const void* kernel, dim3 grid, dim3 block, size_t smem) {
  const std::string who = "sim: kernel `" + g.kernel + "`: ";
  const unsigned gd[3] = {grid.x, grid.y, grid.z}, bd[3] = {block.x, block.y, block.z};
  const char* axis = "xyz";
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads > kMaxThreadsPerBlock) {
    return who + "blockDim " + triple(block) + " has " + std::to_string(threads) + " threads, over the limit of " +
           std::to_string(kMaxThreadsPerBlock) + " threads per block";
  }
  for (int a = 0; a < 3; ++a) {
    if (gd[a] == 0 || bd[a] == 0) {
      return who + "gridDim " + triple(grid) + ", blockDim " + triple(block) + ": a launch dimension is 0";
    }
    if (gd[a] > kMaxGridDim[a]) {
      return who + "gridDim." + axis[a] + " = " + std::to_string(gd[a]) + " exceeds the limit of " +
             std::to_string(kMaxGridDim[a]) + " (maximum gridDim." + axis[a] + ")";
    }
    if (bd[a] > kMaxBlockDim[a]) {
      return who + "blockDim." + axis[a] + " = " + std::to_string(bd[a]) + " exceeds the limit of " +
             std::to_string(kMaxBlockDim[a]) + " (maximum blockDim." + axis[a] + ")";
    }
  }
  if (smem > kMaxDynamicSmem) {
    return who + std::to_string(smem) + " bytes of dynamic shared memory exceed the limit of " +
           std::to_string(kMaxDynamicSmem) + " bytes (227 KiB) per block";
  }
  size_t allowed = kDefaultDynamicSmem;
  for (const auto& [k, bytes] : g.opt_in) allowed = k == kernel ? bytes : allowed;
  if (smem > allowed) {
    return who + std::to_string(smem) + " bytes of dynamic shared memory exceed the limit of " +
           std::to_string(allowed) + " bytes" +
           (allowed == kDefaultDynamicSmem ? " (48 KiB) without the opt-in attribute "
                                             "cudaFuncAttributeMaxDynamicSharedMemorySize"
                                           : " set with cudaFuncAttributeMaxDynamicSharedMemorySize");
  }
  return "";
}

inline void ensure_stacks(size_t count) {
  if (g.stacks_count >= count) return;
  if (g.stacks != nullptr) munmap(g.stacks, g.stacks_count * (kStackBytes + kGuardBytes));
  const size_t bytes = count * (kStackBytes + kGuardBytes);
  void* region = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "sim: fiber stacks");
  g.stacks = static_cast<char*>(region);
  g.stacks_count = count;
  for (size_t i = 0; i < count; ++i) mprotect(g.stacks + i * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
}

// Runs every block of a launch that passed the limit checks; "" or the fault's message.
inline std::string run_blocks(dim3 grid, dim3 block, size_t smem) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  std::mt19937_64 rng(seed_of(g.kernel, grid, block, smem));
  ensure_stacks(static_cast<size_t>(n));
  g.threads.assign(static_cast<size_t>(n), Thread{});
  for (int i = 0; i < n; ++i) {
    Thread& t = g.threads[static_cast<size_t>(i)];
    t.linear = i;
    t.idx = uint3{static_cast<unsigned>(i) % block.x, static_cast<unsigned>(i) / block.x % block.y,
                  static_cast<unsigned>(i) / (block.x * block.y)};
    t.stack = g.stacks + static_cast<size_t>(i) * (kStackBytes + kGuardBytes) + kGuardBytes;
  }
  std::vector<unsigned char> dynamic(smem + 16);
  g.dynamic_smem = dynamic.data() + (16 - reinterpret_cast<uintptr_t>(dynamic.data()) % 16) % 16;
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order(blocks);
  for (uint64_t i = 0; i < blocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (const uint64_t linear : order) {
    g.block_idx = uint3{static_cast<unsigned>(linear % grid.x), static_cast<unsigned>(linear / grid.x % grid.y),
                        static_cast<unsigned>(linear / (uint64_t{grid.x} * grid.y))};
    poison(__start_cuda_sim_shared, __stop_cuda_sim_shared);
    poison(g.dynamic_smem, g.dynamic_smem + smem);
    g.runnable.clear();
    for (Thread& t : g.threads) {
      t.wait = Wait::kRunnable;
      prepare_fiber(t);
      g.runnable.push_back(t.linear);
    }
    g.done = 0;
    g.at_barrier = 0;
    while (g.done < n) {
      while (!g.runnable.empty()) {
        const size_t k = static_cast<size_t>(rng() % g.runnable.size());
        const int next = g.runnable[k];
        g.runnable[k] = g.runnable.back();
        g.runnable.pop_back();
        resume(g.threads[static_cast<size_t>(next)]);
        if (!g.error.empty()) return g.error;
      }
      if (g.done == n) break;
      if (g.at_barrier != n) return deadlock();
      for (Thread& t : g.threads) {
        t.wait = Wait::kRunnable;
        g.runnable.push_back(t.linear);
      }
      g.at_barrier = 0;
    }
  }
  return "";
}

template <class F>
void call_body(const void* f) {
  (*static_cast<const F*>(f))();
}

// Runs Kernel(args...) over the grid; cudaSuccess, or an error whose message last_error holds.
template <auto Kernel, class... Args>
cudaError_t launch(dim3 grid, dim3 block, size_t dynamic_smem, const Args&... args) {
  std::lock_guard<std::mutex> lock(g.mutex);
  g.kernel = kernel_name<Kernel>();
  g.error.clear();
  const std::string limit = check_limits(reinterpret_cast<const void*>(Kernel), grid, block, dynamic_smem);
  if (!limit.empty()) return fail(cudaErrorInvalidConfiguration, limit);
  g.grid_dim = grid;
  g.block_dim = block;
  const auto body = [&args...]() { Kernel(args...); };
  g.body = &call_body<decltype(body)>;
  g.body_args = &body;
  const std::string error = run_blocks(grid, block, dynamic_smem);
  g.body = nullptr;
  g.body_args = nullptr;
  g.dynamic_smem = nullptr;
  if (!error.empty()) return fail(cudaErrorLaunchFailure, error);
  return cudaSuccess;
}

}  // namespace cuda_sim

// ---------------------------------------------------------------------------------------------
// The CUDA names kernel code uses.

#define threadIdx (static_cast<const ::uint3&>(::cuda_sim::g.current->idx))
#define blockIdx (static_cast<const ::uint3&>(::cuda_sim::g.block_idx))
#define blockDim (static_cast<const ::dim3&>(::cuda_sim::g.block_dim))
#define gridDim (static_cast<const ::dim3&>(::cuda_sim::g.grid_dim))

inline void __syncthreads() { cuda_sim::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_sim::warp_op(cuda_sim::WarpOp::kSync, mask, 0, 0, warpSize);
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return cuda_sim::from_bits<T>(
      cuda_sim::warp_op(cuda_sim::WarpOp::kShflIdx, mask, cuda_sim::to_bits(var), src_lane, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return cuda_sim::from_bits<T>(
      cuda_sim::warp_op(cuda_sim::WarpOp::kShflUp, mask, cuda_sim::to_bits(var), static_cast<int>(delta), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return cuda_sim::from_bits<T>(
      cuda_sim::warp_op(cuda_sim::WarpOp::kShflDown, mask, cuda_sim::to_bits(var), static_cast<int>(delta), width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return cuda_sim::from_bits<T>(
      cuda_sim::warp_op(cuda_sim::WarpOp::kShflXor, mask, cuda_sim::to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(cuda_sim::warp_op(cuda_sim::WarpOp::kBallot, mask, predicate != 0, 0, warpSize));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(cuda_sim::warp_op(cuda_sim::WarpOp::kAny, mask, predicate != 0, 0, warpSize));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(cuda_sim::warp_op(cuda_sim::WarpOp::kAll, mask, predicate != 0, 0, warpSize));
}

// Bit manipulation.
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}

// Bit casts and round-to-nearest arithmetic (the host build never contracts a * b + c).
inline unsigned __float_as_uint(float x) { return cuda_sim::from_bits<unsigned>(cuda_sim::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return cuda_sim::from_bits<float>(cuda_sim::to_bits(x)); }
inline int __float_as_int(float x) { return cuda_sim::from_bits<int>(cuda_sim::to_bits(x)); }
inline float __int_as_float(int x) { return cuda_sim::from_bits<float>(cuda_sim::to_bits(x)); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
template <class T>
T __ldg(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return *p;
}

// Atomics, with CUDA's overload set. Threads switch only at barriers and warp operations, so a
// read-modify-write is atomic as written.
#define SPARSEKV_SIM_ATOMIC(name, T, expr) \
  inline T name(T* address, T val) {         \
    const T old = *address;                  \
    *address = (expr);                       \
    return old;                              \
  }
SPARSEKV_SIM_ATOMIC(atomicAdd, int, old + val)
SPARSEKV_SIM_ATOMIC(atomicAdd, unsigned, old + val)
SPARSEKV_SIM_ATOMIC(atomicAdd, unsigned long long, old + val)
SPARSEKV_SIM_ATOMIC(atomicAdd, float, old + val)
SPARSEKV_SIM_ATOMIC(atomicAdd, double, old + val)
SPARSEKV_SIM_ATOMIC(atomicSub, int, old - val)
SPARSEKV_SIM_ATOMIC(atomicSub, unsigned, old - val)
SPARSEKV_SIM_ATOMIC(atomicExch, int, val)
SPARSEKV_SIM_ATOMIC(atomicExch, unsigned, val)
SPARSEKV_SIM_ATOMIC(atomicExch, unsigned long long, val)
SPARSEKV_SIM_ATOMIC(atomicExch, float, val)
SPARSEKV_SIM_ATOMIC(atomicMin, int, val < old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMin, unsigned, val < old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMin, long long, val < old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMax, int, val > old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMax, unsigned, val > old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMax, long long, val > old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
SPARSEKV_SIM_ATOMIC(atomicAnd, int, old & val)
SPARSEKV_SIM_ATOMIC(atomicAnd, unsigned, old & val)
SPARSEKV_SIM_ATOMIC(atomicAnd, unsigned long long, old & val)
SPARSEKV_SIM_ATOMIC(atomicOr, int, old | val)
SPARSEKV_SIM_ATOMIC(atomicOr, unsigned, old | val)
SPARSEKV_SIM_ATOMIC(atomicOr, unsigned long long, old | val)
SPARSEKV_SIM_ATOMIC(atomicXor, int, old ^ val)
SPARSEKV_SIM_ATOMIC(atomicXor, unsigned, old ^ val)
SPARSEKV_SIM_ATOMIC(atomicXor, unsigned long long, old ^ val)
SPARSEKV_SIM_ATOMIC(atomicInc, unsigned, old >= val ? 0u : old + 1u)
SPARSEKV_SIM_ATOMIC(atomicDec, unsigned, (old == 0u || old > val) ? val : old - 1u)
#undef SPARSEKV_SIM_ATOMIC

#define SPARSEKV_SIM_ATOMIC_CAS(T)                         \
  inline T atomicCAS(T* address, T compare, T val) {       \
    const T old = *address;                                \
    if (old == compare) *address = val;                    \
    return old;                                            \
  }
SPARSEKV_SIM_ATOMIC_CAS(int)
SPARSEKV_SIM_ATOMIC_CAS(unsigned)
SPARSEKV_SIM_ATOMIC_CAS(unsigned long long)
SPARSEKV_SIM_ATOMIC_CAS(unsigned short)
#undef SPARSEKV_SIM_ATOMIC_CAS

// The runtime API the kernel headers call.
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  std::lock_guard<std::mutex> lock(cuda_sim::g.mutex);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > cuda_sim::kMaxDynamicSmem) {
      return cuda_sim::fail(cudaErrorInvalidValue,
                            "sim: cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, " +
                                std::to_string(value) + "): over the limit of " +
                                std::to_string(cuda_sim::kMaxDynamicSmem) + " bytes (227 KiB) per block");
    }
    const void* key = reinterpret_cast<const void*>(kernel);
    for (auto& entry : cuda_sim::g.opt_in) {
      if (entry.first == key) {
        entry.second = static_cast<size_t>(value);
        return cudaSuccess;
      }
    }
    cuda_sim::g.opt_in.emplace_back(key, static_cast<size_t>(value));
  }
  return cudaSuccess;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t code = cuda_sim::last_code;
  cuda_sim::last_code = cudaSuccess;
  return code;
}

inline const char* cudaGetErrorString(cudaError_t code) {
  return code == cudaSuccess ? "no error" : cuda_sim::last_error.c_str();
}

#pragma GCC visibility pop
