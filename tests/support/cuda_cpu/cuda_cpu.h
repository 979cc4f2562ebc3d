// The CUDA subset kernels/bucket.cu uses, for running it on the CPU with g++ (tests only).
//
// - A launch runs every block, warp by warp; a warp's 32 lanes are ucontext fibers, so
//   __any_sync is a true vote (a lane that exits before a vote its mask names is an error).
// - Device memory is a reserved PROT_NONE range: kernel code can reach it only through the
//   checked accessors (__ldg, __ldca, __stwb, atomicExch), which check each access against the
//   live allocations and its natural alignment (memcheck), record which thread wrote and read
//   every 2-byte granule during the launch (racecheck: write/write, read/write between threads)
//   and report __ldg reads of data the same launch writes. A plain dereference of a device
//   pointer faults and is reported.
// - Arithmetic: the inline PTX of the kernel is mapped by translate.py to the ptx_* functions
//   below (round to nearest even, subnormals kept, the GPU's canonical NaN); the CUDA intrinsics
//   __fmul_rn/__fadd_rn flush subnormals when the build models NVRTC's -ftz=true
//   (CUDA_CPU_FTZ=1), as CuPy's compile does. So does every other float operation of the kernel
//   written in plain C++ (a * b, a + b, static_cast<float>(d)): with CUDA_CPU_FTZ=1 a launch runs
//   with the x86 MXCSR's FTZ and DAZ bits set (subnormal inputs and results of f32 arithmetic
//   flushed, as -ftz=true makes NVRTC compile them), and only the functions below that model
//   non-.ftz PTX and f64 arithmetic (which -ftz leaves alone) run with them cleared (`ieee`). A
//   kernel edit that drops its round-to-nearest PTX for plain arithmetic is caught by behaviour.
// - Launch parameters: the glue (translate.py) exports every kernel's C++ parameter types (size,
//   alignment, kind) so the Python side can check the arguments the way cuLaunchKernel lays
//   them out, and the __launch_bounds__ of each kernel.
#pragma once

#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#ifndef CUDA_CPU_FTZ
#error "CUDA_CPU_FTZ must be defined (1: model NVRTC -ftz=true, 0: not)"
#endif

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __grid_constant__

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };

namespace cuda_cpu {

// ---------------------------------------------------------------------------------------------
// software PTX

template <typename To, typename From> inline To bits_as(From f) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}

constexpr uint32_t kCanonicalNaN32 = 0x7fffffffu;   // NaN result of f32 arithmetic / cvt to f32
constexpr uint16_t kCanonicalNaN16 = 0x7fffu;       // NaN result of cvt to f16 / bf16

inline float canon(float r) { return r != r ? bits_as<float>(kCanonicalNaN32) : r; }
inline bool is_subnormal(float x) {
  const uint32_t u = bits_as<uint32_t>(x) & 0x7fffffffu;
  return u != 0 && u < 0x00800000u;
}
inline float flush(float x) {
  return is_subnormal(x) ? bits_as<float>(bits_as<uint32_t>(x) & 0x80000000u) : x;
}

// f(a...) with MXCSR's FTZ and DAZ cleared, whatever the launch set (the empty asm statements pin
// the arithmetic between the two MXCSR writes).
constexpr unsigned kFtzDaz = 0x8040u;
template <typename T> inline void pin(T& v) {
#if defined(__x86_64__)
  asm volatile("" : "+x"(v));
#endif
}
template <typename F, typename... A> inline auto ieee(F f, A... a) {
#if defined(__x86_64__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved & ~kFtzDaz);
  (pin(a), ...);
  auto r = f(a...);
  pin(r);
  _mm_setcsr(saved);
  return r;
#else
  return f(a...);
#endif
}

// mul.rn.f32 / add.rn.f32: IEEE round to nearest even, subnormals kept.
inline float ptx_mul_rn_f32(float a, float b) {
  return canon(ieee([](float x, float y) { return x * y; }, a, b));
}
inline float ptx_add_rn_f32(float a, float b) {
  return canon(ieee([](float x, float y) { return x + y; }, a, b));
}
// sub/div/sqrt.rn.f32 (IEEE, correctly rounded; sqrtss/divss) and fma.rn.f32 (one rounding:
// glibc's fmaf is exact), subnormals kept.
inline float ptx_sub_rn_f32(float a, float b) {
  return canon(ieee([](float x, float y) { return x - y; }, a, b));
}
inline float ptx_div_rn_f32(float a, float b) {
  return canon(ieee([](float x, float y) { return x / y; }, a, b));
}
inline float ptx_sqrt_rn_f32(float a) {
  return canon(ieee([](float x) { return std::sqrt(x); }, a));
}
inline float ptx_fma_rn_f32(float a, float b, float c) {
  return canon(ieee([](float x, float y, float z) { return std::fma(x, y, z); }, a, b, c));
}
// mul.rn.ftz.f32 / add.rn.ftz.f32: subnormal inputs and results flushed to sign-preserving zero.
inline float ptx_mul_rn_ftz_f32(float a, float b) { return flush(canon(flush(a) * flush(b))); }
inline float ptx_add_rn_ftz_f32(float a, float b) { return flush(canon(flush(a) + flush(b))); }

// cvt.rn.bf16.f32: round to nearest even on the bits (subnormals and overflow to inf included).
inline uint16_t ptx_cvt_rn_bf16_f32(float f) {
  uint32_t u = bits_as<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return kCanonicalNaN16;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// cvt.rn.f16.f32: round to nearest even, f16 subnormals produced, overflow to inf.
inline uint16_t ptx_cvt_rn_f16_f32(float f) {
  uint32_t x = bits_as<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return kCanonicalNaN16;
  if (x >= 0x477ff000u) return sign | 0x7c00u;          // >= 65520 rounds to inf
  if (x >= 0x38800000u) {                               // normal f16 (>= 2^-14)
    uint32_t m = x - 0x38000000u;                       // rebias 127 -> 15
    m += 0xfffu + ((m >> 13) & 1u);
    return static_cast<uint16_t>(sign | (m >> 13));
  }
  const uint32_t e = x >> 23;
  if (e < 102) return sign;                             // < 2^-25: rounds to zero
  const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e;                       // units of 2^-24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

// cvt.rn.f32.f64: round to nearest even, subnormals kept (the host's conversion).
inline float ptx_cvt_rn_f32_f64(double d) {
  return canon(ieee([](double x) { return static_cast<float>(x); }, d));
}

// cvt.f32.f16: exact.
inline float ptx_cvt_f32_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return m ? bits_as<float>(kCanonicalNaN32) : bits_as<float>(sign | 0x7f800000u);
  if (e != 0) return bits_as<float>(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_as<float>(sign);
  int shift = 0;                                        // subnormal: normalise
  uint32_t mm = m;
  while (!(mm & 0x400u)) { mm <<= 1; ++shift; }
  return bits_as<float>(sign | ((113u - shift) << 23) | ((mm & 0x3ffu) << 13));
}

// ---------------------------------------------------------------------------------------------
// device memory, the shadow of every granule, and the launch state

struct Shadow {       // one 2-byte granule
  uint32_t epoch;     // launch that last touched it (older: treat as untouched)
  int32_t writer;     // global thread id of the writer in this launch, -1 none
  int32_t reader;     // global thread id of the reader, -1 none, -2 several
  uint32_t nc;        // read through __ldg in this launch
};

struct Heap {
  uintptr_t base = 0;      // device addresses: [base, base + cap), PROT_NONE
  uint8_t* host = nullptr; // the storage, at the same offsets
  size_t cap = 0;
  Shadow* shadow = nullptr;
  std::map<uintptr_t, size_t> allocs;
  uint32_t epoch = 0;
};

enum LaneState { kReady, kVoting, kDone };

struct Lane {
  ucontext_t ctx;
  LaneState state;
  dim3 tid;
  unsigned vote_mask;
  bool vote_pred, vote_result;
};

constexpr size_t kStack = 128 << 10;
constexpr int kMaxErrors = 12;

struct Launch {
  Heap* heap = nullptr;
  dim3 grid, block, block_idx;
  Lane lanes[32];
  Lane* cur = nullptr;
  int warp_base = 0;                 // global thread id of lane 0 of the running warp
  ucontext_t sched;
  std::function<void()> body;
  std::vector<std::string> errors;
  long total_errors = 0;
  bool abort = false;
};

inline Launch g;

inline int me() { return g.warp_base + static_cast<int>(g.cur - g.lanes); }

inline void report(const std::string& msg) {
  ++g.total_errors;
  if (static_cast<int>(g.errors.size()) < kMaxErrors) g.errors.push_back(msg);
}

inline std::string where() {
  char buf[96];
  std::snprintf(buf, sizeof buf, "thread (%u,0,0) in block (%u,0,0)", g.cur ? g.cur->tid.x : 0u,
                g.block_idx.x);
  return buf;
}

inline std::string hex(uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

inline std::string tid_name(int t) {
  const int per_block = static_cast<int>(g.block.x);
  char buf[64];
  std::snprintf(buf, sizeof buf, "thread (%d,0,0) in block (%d,0,0)", t % per_block,
                t / per_block);
  return buf;
}

// memcheck: [a, a + n) inside one live allocation, naturally aligned. Returns false (and
// reports) when the access must not happen.
inline bool check_access(uintptr_t a, size_t n, const char* what) {
  Heap& h = *g.heap;
  if (a % n != 0) {
    report(std::string("Invalid __global__ ") + what + " of size " + std::to_string(n) + " at " +
           hex(a) + " by " + where() + ": address is misaligned");
    return false;
  }
  auto it = h.allocs.upper_bound(a);
  if (it == h.allocs.begin() || a < h.base || a + n > h.base + h.cap) {
    report(std::string("Invalid __global__ ") + what + " of size " + std::to_string(n) + " at " +
           hex(a) + " by " + where() + ": address is not in any live allocation");
    return false;
  }
  --it;
  if (a + n > it->first + it->second) {
    const bool inside = a < it->first + it->second;
    report(std::string("Invalid __global__ ") + what + " of size " + std::to_string(n) + " at " +
           hex(a) + " by " + where() + ": address is " +
           (inside ? "partly " : "not in any live allocation: ") +
           std::to_string(a + n - it->first - it->second) +
           " bytes past the end of the allocation at " + hex(it->first) + " (" +
           std::to_string(it->second) + " bytes)");
    return false;
  }
  return true;
}

inline Shadow& granule(uintptr_t a) {
  Heap& h = *g.heap;
  Shadow& s = h.shadow[(a - h.base) / 2];
  if (s.epoch != h.epoch) s = Shadow{h.epoch, -1, -1, 0};
  return s;
}

enum Access { kLoad, kLoadNC, kStore };

// racecheck: hazards between different threads of the launch on the same granule.
inline void track(uintptr_t a, size_t n, Access kind) {
  const int t = me();
  for (uintptr_t p = a; p < a + n; p += 2) {
    Shadow& s = granule(p);
    if (kind == kStore) {
      if (s.nc)
        report("__ldg hazard: " + where() + " writes " + hex(p) +
               ", which this launch read through __ldg (the read-only cache may return stale "
               "data)");
      if (s.writer >= 0 && s.writer != t)
        report("Race (write-write) at " + hex(p) + ": " + where() + " and " +
               tid_name(s.writer));
      if (s.reader == -2 || (s.reader >= 0 && s.reader != t))
        report("Race (read-write) at " + hex(p) + ": " + where() + " writes what " +
               (s.reader == -2 ? std::string("several threads") : tid_name(s.reader)) +
               " read");
      s.writer = t;
    } else {
      if (kind == kLoadNC && s.writer >= 0)
        report("__ldg hazard: " + where() + " reads " + hex(p) + " through __ldg, but " +
               tid_name(s.writer) + " wrote it in this launch");
      else if (s.writer >= 0 && s.writer != t)
        report("Race (write-read) at " + hex(p) + ": " + where() + " reads what " +
               tid_name(s.writer) + " wrote");
      if (kind == kLoadNC) s.nc = 1;
      s.reader = (s.reader == -1 || s.reader == t) ? t : -2;
    }
  }
}

template <typename T> inline T load(const T* p, Access kind, const char* what) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  T v{};
  if (!check_access(a, sizeof(T), what)) return v;
  track(a, sizeof(T), kind);
  std::memcpy(&v, g.heap->host + (a - g.heap->base), sizeof(T));
  return v;
}

template <typename T> inline void store(T* p, const T& v) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (!check_access(a, sizeof(T), "write")) return;
  track(a, sizeof(T), kStore);
  std::memcpy(g.heap->host + (a - g.heap->base), &v, sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// warps: fibers and votes

inline bool vote_any(unsigned mask, bool pred) {
  Lane* l = g.cur;
  const unsigned bit = 1u << (l - g.lanes);
  if (!(mask & bit)) {
    report("__any_sync by " + where() + " whose lane is not in the mask " + hex(mask));
  }
  l->state = kVoting;
  l->vote_mask = mask;
  l->vote_pred = pred;
  swapcontext(&l->ctx, &g.sched);
  return l->vote_result;
}

inline void lane_main() {
  g.body();
  g.cur->state = kDone;   // returns to g.sched through uc_link
}

// Run one warp (`n` lanes) to completion, resolving votes; false on a fatal error.
inline bool run_warp(int n, std::vector<char>& stacks) {
  for (int i = 0; i < n; ++i) {
    Lane& l = g.lanes[i];
    l.state = kReady;
    l.tid.x = static_cast<unsigned>(g.warp_base) % g.block.x + static_cast<unsigned>(i);
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = stacks.data() + static_cast<size_t>(i) * kStack;
    l.ctx.uc_stack.ss_size = kStack;
    l.ctx.uc_link = &g.sched;
    makecontext(&l.ctx, lane_main, 0);
  }
  for (;;) {
    for (int i = 0; i < n; ++i) {
      if (g.lanes[i].state != kReady) continue;
      g.cur = &g.lanes[i];
      swapcontext(&g.sched, &g.lanes[i].ctx);
      if (g.abort) return false;
    }
    g.cur = nullptr;
    int voting = -1;
    for (int i = 0; i < n; ++i)
      if (g.lanes[i].state == kVoting) { voting = i; break; }
    if (voting < 0) return true;   // every lane done
    const unsigned mask = g.lanes[voting].vote_mask;
    bool any = false, ok = true;
    for (int i = 0; i < 32; ++i) {
      const bool in_mask = (mask >> i) & 1u;
      const Lane* l = i < n ? &g.lanes[i] : nullptr;
      if (in_mask && (!l || l->state != kVoting)) {
        report("__any_sync(" + hex(mask) + ") in block (" + std::to_string(g.block_idx.x) +
               ",0,0), warp " + std::to_string(g.warp_base % g.block.x / 32) + ": lane " +
               std::to_string(i) + (l ? " exited without joining the vote"
                                      : " does not exist"));
        ok = false;
      } else if (l && l->state == kVoting && l->vote_mask != mask) {
        report("__any_sync in block (" + std::to_string(g.block_idx.x) + ",0,0): lanes " +
               std::to_string(voting) + " and " + std::to_string(i) +
               " vote with different masks");
        ok = false;
      } else if (in_mask) {
        any = any || l->vote_pred;
      }
    }
    if (!ok) return false;
    for (int i = 0; i < n; ++i)
      if (g.lanes[i].state == kVoting) {
        g.lanes[i].vote_result = any;
        g.lanes[i].state = kReady;
      }
  }
}

inline sigjmp_buf g_fault_jmp;
inline volatile uintptr_t g_fault_addr = 0;

inline void on_fault(int, siginfo_t* info, void*) {
  g_fault_addr = reinterpret_cast<uintptr_t>(info->si_addr);
  siglongjmp(g_fault_jmp, 1);
}

// Every block, warp by warp, faults caught; FTZ/DAZ on when the build models -ftz=true (the
// fibers' contexts are made inside, so they inherit it), else off.
inline void run_grid(Heap& heap, unsigned grid, unsigned block, std::function<void()> body) {
  g.heap = &heap;
  g.grid.x = grid;
  g.block.x = block;
  g.body = std::move(body);
  g.errors.clear();
  g.total_errors = 0;
  g.abort = false;
  ++heap.epoch;
  std::vector<char> stacks(kStack * 32);
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr((csr & ~(kFtzDaz | 0x6000u)) | (CUDA_CPU_FTZ ? kFtzDaz : 0u));   // round to nearest
#endif
  struct sigaction sa{}, old_segv{}, old_bus{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  if (sigsetjmp(g_fault_jmp, 1) == 0) {
    for (unsigned b = 0; b < grid && !g.abort; ++b) {
      g.block_idx.x = b;
      for (unsigned w = 0; w * 32 < block; ++w) {
        g.warp_base = static_cast<int>(b * block + w * 32);
        const int n = static_cast<int>(block - w * 32 < 32 ? block - w * 32 : 32);
        if (!run_warp(n, stacks)) { g.abort = true; break; }
      }
    }
  } else {
    const uintptr_t a = g_fault_addr;
    const bool dev = a >= heap.base && a < heap.base + heap.cap;
    report("Invalid memory access at " + hex(a) + " by " + where() +
           (dev ? ": a plain dereference of device memory (kernel code must use "
                  "__ldg/__ldca/__stwb so that every access is checked)"
                : ": not device memory at all (wild pointer)"));
  }
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
#if defined(__x86_64__)
  _mm_setcsr(csr);
#endif
  g.cur = nullptr;
}

// ---------------------------------------------------------------------------------------------
// kernel parameters, described to the Python side

enum ParamKind { kPointer = 0, kInteger = 1, kFloat = 2, kStruct = 3 };

struct ParamInfo { int size, align, kind; };

template <typename P> constexpr ParamInfo param_info() {
  return ParamInfo{static_cast<int>(sizeof(P)), static_cast<int>(alignof(P)),
                   std::is_pointer<P>::value ? kPointer
                   : std::is_integral<P>::value ? kInteger
                   : std::is_floating_point<P>::value ? kFloat : kStruct};
}

struct Entry {
  const char* name;
  int launch_bounds;
  std::vector<ParamInfo> params;
  std::function<void(const uint8_t*, unsigned, unsigned, Heap&)> launch;
};

inline size_t align_up(size_t off, size_t a) { return (off + a - 1) / a * a; }

template <typename... P> Entry make_entry(const char* name, int bounds, void (*fn)(P...)) {
  Entry e;
  e.name = name;
  e.launch_bounds = bounds;
  e.params = {param_info<std::remove_cv_t<P>>()...};
  e.launch = [fn](const uint8_t* buf, unsigned grid, unsigned block, Heap& heap) {
    std::tuple<std::remove_cv_t<P>...> args;
    size_t off = 0;
    std::apply([&](auto&... a) {
      ((off = align_up(off, alignof(decltype(a))), std::memcpy(&a, buf + off, sizeof a),
        off += sizeof a), ...);
    }, args);
    run_grid(heap, grid, block, [&]() { std::apply(fn, args); });
  };
  return e;
}

}  // namespace cuda_cpu

#define threadIdx (::cuda_cpu::g.cur->tid)
#define blockIdx (::cuda_cpu::g.block_idx)
#define blockDim (::cuda_cpu::g.block)
#define gridDim (::cuda_cpu::g.grid)

// ---------------------------------------------------------------------------------------------
// the intrinsics bucket.cu uses (translate.py refuses any other __name)

inline unsigned __float_as_uint(float x) { return cuda_cpu::bits_as<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return cuda_cpu::bits_as<float>(x); }
inline long long __double_as_longlong(double x) { return cuda_cpu::bits_as<long long>(x); }

#if CUDA_CPU_FTZ
inline float __fmul_rn(float a, float b) { return cuda_cpu::ptx_mul_rn_ftz_f32(a, b); }
inline float __fadd_rn(float a, float b) { return cuda_cpu::ptx_add_rn_ftz_f32(a, b); }
#else
inline float __fmul_rn(float a, float b) { return cuda_cpu::ptx_mul_rn_f32(a, b); }
inline float __fadd_rn(float a, float b) { return cuda_cpu::ptx_add_rn_f32(a, b); }
#endif
// f64 is never flushed; NaN results keep the host's payload (tests compare NaN as NaN).
inline double __dmul_rn(double a, double b) {
  return cuda_cpu::ieee([](double x, double y) { return x * y; }, a, b);
}
inline double __dadd_rn(double a, double b) {
  return cuda_cpu::ieee([](double x, double y) { return x + y; }, a, b);
}

template <typename T> inline T __ldg(const T* p) {
  return cuda_cpu::load(p, cuda_cpu::kLoadNC, "read (__ldg)");
}
template <typename T> inline T __ldca(const T* p) {
  return cuda_cpu::load(p, cuda_cpu::kLoad, "read");
}
template <typename T> inline void __stwb(T* p, T v) { cuda_cpu::store(p, v); }

inline int atomicExch(int* p, int v) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (!cuda_cpu::check_access(a, sizeof(int), "atomic")) return 0;
  int old;
  std::memcpy(&old, cuda_cpu::g.heap->host + (a - cuda_cpu::g.heap->base), sizeof old);
  std::memcpy(cuda_cpu::g.heap->host + (a - cuda_cpu::g.heap->base), &v, sizeof v);
  return old;
}

inline bool __any_sync(unsigned mask, int pred) { return cuda_cpu::vote_any(mask, pred != 0); }

// ---------------------------------------------------------------------------------------------
// the C interface of the built library (ctypes, tests/cuda_cpu/runtime.py); the glue defines
// cuda_cpu::entries()

namespace cuda_cpu { std::vector<Entry>& entries(); }

extern "C" {

void* cc_heap_new(size_t cap) {
  cap = (cap + 4095) / 4096 * 4096;
  const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  void* dev = mmap(nullptr, cap, PROT_NONE, flags, -1, 0);
  void* host = mmap(nullptr, cap, PROT_READ | PROT_WRITE, flags, -1, 0);
  void* sh = mmap(nullptr, cap / 2 * sizeof(cuda_cpu::Shadow), PROT_READ | PROT_WRITE, flags, -1, 0);
  if (dev == MAP_FAILED || host == MAP_FAILED || sh == MAP_FAILED) {
    if (dev != MAP_FAILED) munmap(dev, cap);
    if (host != MAP_FAILED) munmap(host, cap);
    if (sh != MAP_FAILED) munmap(sh, cap / 2 * sizeof(cuda_cpu::Shadow));
    return nullptr;
  }
  auto* h = new cuda_cpu::Heap;
  h->base = reinterpret_cast<uintptr_t>(dev);
  h->host = static_cast<uint8_t*>(host);
  h->cap = cap;
  h->shadow = static_cast<cuda_cpu::Shadow*>(sh);
  return h;
}

void cc_heap_delete(void* p) {
  auto* h = static_cast<cuda_cpu::Heap*>(p);
  munmap(reinterpret_cast<void*>(h->base), h->cap);
  munmap(h->host, h->cap);
  munmap(h->shadow, h->cap / 2 * sizeof(cuda_cpu::Shadow));
  delete h;
}

uintptr_t cc_heap_base(void* p) { return static_cast<cuda_cpu::Heap*>(p)->base; }
void* cc_heap_host(void* p) { return static_cast<cuda_cpu::Heap*>(p)->host; }
size_t cc_heap_cap(void* p) { return static_cast<cuda_cpu::Heap*>(p)->cap; }
void cc_alloc(void* p, uintptr_t addr, size_t n) { static_cast<cuda_cpu::Heap*>(p)->allocs[addr] = n; }
int cc_free(void* p, uintptr_t addr) {
  return static_cast<int>(static_cast<cuda_cpu::Heap*>(p)->allocs.erase(addr));
}

int cc_kernel_count() { return static_cast<int>(cuda_cpu::entries().size()); }
const char* cc_kernel_name(int k) { return cuda_cpu::entries()[k].name; }
int cc_kernel_bounds(int k) { return cuda_cpu::entries()[k].launch_bounds; }
int cc_param_count(int k) { return static_cast<int>(cuda_cpu::entries()[k].params.size()); }
void cc_param(int k, int i, int* size, int* align, int* kind) {
  const cuda_cpu::ParamInfo& p = cuda_cpu::entries()[k].params[i];
  *size = p.size;
  *align = p.align;
  *kind = p.kind;
}

// Runs kernel k; returns the number of errors found, their first messages in `err`.
long cc_launch(void* heap, int k, const uint8_t* params, unsigned grid, unsigned block, char* err,
               size_t cap) {
  cuda_cpu::entries()[k].launch(params, grid, block, *static_cast<cuda_cpu::Heap*>(heap));
  std::string all;
  for (const std::string& e : cuda_cpu::g.errors) all += e + "\n";
  if (cap) {
    std::strncpy(err, all.c_str(), cap - 1);
    err[cap - 1] = 0;
  }
  return cuda_cpu::g.total_errors;
}

// The software PTX over arrays (tests against NumPy): 0 mul.rn.f32, 1 add.rn.f32,
// 2 cvt.rn.bf16.f32, 3 cvt.rn.f16.f32, 4 cvt.f32.f16, 5 cvt.rn.f32.f64, 6 mul.rn.ftz.f32.
void cc_ptx(int op, const void* a, const void* b, void* out, size_t n) {
  using namespace cuda_cpu;
  const float* fa = static_cast<const float*>(a);
  const float* fb = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) {
    switch (op) {
      case 0: static_cast<float*>(out)[i] = ptx_mul_rn_f32(fa[i], fb[i]); break;
      case 1: static_cast<float*>(out)[i] = ptx_add_rn_f32(fa[i], fb[i]); break;
      case 2: static_cast<uint16_t*>(out)[i] = ptx_cvt_rn_bf16_f32(fa[i]); break;
      case 3: static_cast<uint16_t*>(out)[i] = ptx_cvt_rn_f16_f32(fa[i]); break;
      case 4: static_cast<float*>(out)[i] = ptx_cvt_f32_f16(static_cast<const uint16_t*>(a)[i]); break;
      case 5: static_cast<float*>(out)[i] = ptx_cvt_rn_f32_f64(static_cast<const double*>(a)[i]); break;
      case 6: static_cast<float*>(out)[i] = ptx_mul_rn_ftz_f32(fa[i], fb[i]); break;
    }
  }
}

}  // extern "C"
