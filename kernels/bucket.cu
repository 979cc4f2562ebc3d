// Gradient-bucket kernels of nccl_ddp: multi-tensor pack/unpack between K tensors and one flat
// bucket in ONE launch whatever K is, with a fused scale, an optional cast (f32 <-> bf16/f16) and
// an optional non-finite flag; plus an in-place scale of a flat buffer.
//
// Loaded by nccl_ddp/kernels/cuda.py with cupy.RawModule (NVRTC, -std=c++17, name_expressions for
// the template instantiations). nccl_ddp.kernels.pack_ref/unpack_ref/scale_ref are the
// specification.
//
// Work decomposition: every non-empty tensor ("segment") is cut into chunks of `chunk` elements;
// one chunk is one work item, processed by ONE WARP (so 10,000 tiny tensors give 10,000 short warp
// jobs, not 10,000 mostly idle blocks). The caller sizes `chunk` so that, whenever the tensor
// count allows, every item gets its own resident warp: one wave, no tail of late blocks.
// Item lookup:
//   - table kernels (any K): a device-memory array of pre-chunked items {address, bucket offset,
//     length}, one independent load per warp, built once per layout + pointer set and cached;
//   - small kernels (K <= kSmallMax): the segments passed by value as a __grid_constant__
//     parameter (no upload at all), the item's segment found by scanning `first_item`.
// Within a chunk a warp moves 16-byte vectors when both sides are aligned for it (the bucket side
// always is when offsets are 16-byte aligned), ILP vectors in flight per lane; otherwise it falls
// back to coalesced scalar accesses. Arithmetic is explicit round-to-nearest multiplies and adds
// (never contracted to a multiply-add, never flushed to zero under CuPy's -ftz=true): results are
// bit-identical to the NumPy references, subnormals and -0.0 included (NaN payloads are not kept:
// the GPU returns its canonical NaN).

typedef unsigned long long u64;
typedef long long i64;

// Storage types of the 16-bit floats (no cuda_fp16.h / cuda_bf16.h needed: conversions are PTX).
struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

// ---------------------------------------------------------------------------------------------
// per-type conversions to/from the arithmetic type, and finiteness of a stored value

template <typename T> struct Conv;

template <> struct Conv<float> {
  typedef float acc;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float a) { return a; }
  static __device__ __forceinline__ bool finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
  }
};

template <> struct Conv<double> {
  typedef double acc;
  static __device__ __forceinline__ double load(double x) { return x; }
  static __device__ __forceinline__ double store(double a) { return a; }
  static __device__ __forceinline__ bool finite(double x) {
    return (static_cast<u64>(__double_as_longlong(x)) & 0x7ff0000000000000ull) !=
           0x7ff0000000000000ull;
  }
};

template <> struct Conv<bf16_t> {
  typedef float acc;
  static __device__ __forceinline__ float load(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
  }
  static __device__ __forceinline__ bf16_t store(float a) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(a));
    return r;
  }
  static __device__ __forceinline__ bool finite(bf16_t x) { return (x.bits & 0x7f80u) != 0x7f80u; }
};

template <> struct Conv<f16_t> {
  typedef float acc;
  static __device__ __forceinline__ float load(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
  }
  static __device__ __forceinline__ f16_t store(float a) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(a));
    return r;
  }
  static __device__ __forceinline__ bool finite(f16_t x) { return (x.bits & 0x7c00u) != 0x7c00u; }
};

// float32 arithmetic as inline PTX without .ftz: CuPy compiles every RawModule with -ftz=true
// (after our options; NVRTC keeps the last), which would turn __fmul_rn/__fadd_rn into
// mul.rn.ftz.f32/add.rn.ftz.f32 and flush subnormal grads to zero. Inline PTX is emitted as
// written, so these keep subnormals (IEEE round to nearest even) whatever the flag.
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// The scale in the arithmetic type; float as inline PTX too (a static_cast would become
// cvt.rn.ftz.f32.f64 under -ftz=true and flush a subnormal scale).
template <typename A> __device__ __forceinline__ A to_acc(double x);
template <> __device__ __forceinline__ float to_acc<float>(double x) {
  float r;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
  return r;
}
template <> __device__ __forceinline__ double to_acc<double>(double x) { return x; }

// The arithmetic type of a (source, destination) pair: double only for f64 -> f64.
template <typename TS, typename TD> struct AccOf { typedef float type; };
template <> struct AccOf<double, double> { typedef double type; };

// ---------------------------------------------------------------------------------------------
// vector access: N elements of T moved as one raw 4/8/16-byte word

template <int BYTES> struct RawWord;
template <> struct RawWord<2> { typedef unsigned short type; };
template <> struct RawWord<4> { typedef unsigned type; };
template <> struct RawWord<8> { typedef unsigned long long type; };
template <> struct RawWord<16> { typedef uint4 type; };

template <typename T, int N> union VecOf {
  typedef typename RawWord<sizeof(T) * N>::type raw_t;
  raw_t raw;
  T e[N];
};

// Global-memory access of any T through its raw word. The addresses come from tables (not kernel
// pointer parameters), so plain dereferences would compile to generic ld/st: these pin them to
// ld.global.nc (read-only sources), ld.global and st.global. Every global access of this file
// goes through them (the CPU build in tests/support/cuda_cpu checks each one; a plain dereference of a
// device pointer faults there).
template <typename T> __device__ __forceinline__ T ld_nc(const T* p) {
  VecOf<T, 1> u;
  u.raw = __ldg(reinterpret_cast<const typename VecOf<T, 1>::raw_t*>(p));
  return u.e[0];
}
template <typename T> __device__ __forceinline__ T ld_rw(const T* p) {
  VecOf<T, 1> u;
  u.raw = __ldca(reinterpret_cast<const typename VecOf<T, 1>::raw_t*>(p));
  return u.e[0];
}
template <typename T> __device__ __forceinline__ void st_g(T* p, T v) {
  VecOf<T, 1> u;
  u.e[0] = v;
  __stwb(reinterpret_cast<typename VecOf<T, 1>::raw_t*>(p), u.raw);
}

enum : int {
  kWarp = 32,
  kThreads = 256,   // threads per block of every kernel here
  kIlp = 4,         // independent vectors (or scalars x 2) in flight per lane
  kSmallMax = 32,   // most segments passed by value
};

// A source element in the arithmetic type. Narrowing (f32 -> bf16/f16, pack into a compressed
// wire) rounds to the destination type FIRST, so the scale then multiplies the wire value: torch's
// fp16/bf16_compress_hook order (cast, then divide in the wire dtype; a subnormal-range mean then
// rounds as torch's does, and a grad above the wire's range is inf, as in torch).
template <typename TS, typename TD>
__device__ __forceinline__ typename AccOf<TS, TD>::type load_src(TS x) {
  if constexpr (sizeof(TD) < sizeof(TS)) {
    return Conv<TD>::load(Conv<TD>::store(Conv<TS>::load(x)));
  } else {
    return Conv<TS>::load(x);
  }
}

// One warp moves dst[0:n] = cast(load_src(src[0:n]) * scale) (or dst += ...), `lane` in [0, 32).
// n is at most one chunk, so indices here are 32-bit (fewer registers than 64-bit addressing).
template <typename TS, typename TD, bool kAccum, bool kCheck>
__device__ __forceinline__ void copy_span(const TS* __restrict__ src, TD* __restrict__ dst,
                                          int n, typename AccOf<TS, TD>::type scale, int lane,
                                          bool& bad) {
  typedef typename AccOf<TS, TD>::type A;
  constexpr int kVec = 16 / (sizeof(TS) > sizeof(TD) ? sizeof(TS) : sizeof(TD));
  typedef VecOf<TS, kVec> VS;
  typedef VecOf<TD, kVec> VD;
  typedef typename VS::raw_t RS;
  typedef typename VD::raw_t RD;

  const bool aligned = (reinterpret_cast<u64>(src) % sizeof(RS)) == 0 &&
                       (reinterpret_cast<u64>(dst) % sizeof(RD)) == 0;
  if (aligned) {
    const RS* __restrict__ s = reinterpret_cast<const RS*>(src);
    RD* __restrict__ d = reinterpret_cast<RD*>(dst);
    const int nvec = n / kVec;
    // The last n % kVec elements: loaded now, with the first vectors, so that a small tensor
    // costs one memory round trip, not two.
    const int t = nvec * kVec + lane;
    const bool has_tail = t < n;
    TS tail_in{};
    TD tail_old{};
    if (has_tail) {
      tail_in = ld_nc(src + t);
      if constexpr (kAccum) tail_old = ld_rw(dst + t);
    }
    for (int base = lane; base < nvec; base += kWarp * kIlp) {
      VS in[kIlp];
      VD old[kIlp];
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int i = base + k * kWarp;
        if (i < nvec) {
          in[k].raw = __ldg(s + i);
          if constexpr (kAccum) old[k].raw = __ldca(d + i);
        }
      }
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        const int i = base + k * kWarp;
        if (i < nvec) {
          VD out;
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            A v = mul_rn(load_src<TS, TD>(in[k].e[e]), scale);
            if constexpr (kAccum) v = add_rn(Conv<TD>::load(old[k].e[e]), v);
            out.e[e] = Conv<TD>::store(v);
            if constexpr (kCheck) bad |= !Conv<TD>::finite(out.e[e]);
          }
          __stwb(d + i, out.raw);
        }
      }
    }
    if (has_tail) {
      A v = mul_rn(load_src<TS, TD>(tail_in), scale);
      if constexpr (kAccum) v = add_rn(Conv<TD>::load(tail_old), v);
      const TD out = Conv<TD>::store(v);
      if constexpr (kCheck) bad |= !Conv<TD>::finite(out);
      st_g(dst + t, out);
    }
    return;
  }
  // Misaligned spans: coalesced scalars, 2*kIlp per lane in flight (kIlp for 8-byte types).
  constexpr int kScalarIlp = sizeof(TS) >= 8 ? kIlp : 2 * kIlp;
  for (int base = lane; base < n; base += kWarp * kScalarIlp) {
    TS in[kScalarIlp];
#pragma unroll
    for (int k = 0; k < kScalarIlp; ++k) {
      const int i = base + k * kWarp;
      if (i < n) in[k] = ld_nc(src + i);
    }
#pragma unroll
    for (int k = 0; k < kScalarIlp; ++k) {
      const int i = base + k * kWarp;
      if (i < n) {
        A v = mul_rn(load_src<TS, TD>(in[k]), scale);
        if constexpr (kAccum) v = add_rn(Conv<TD>::load(ld_rw(dst + i)), v);
        const TD out = Conv<TD>::store(v);
        if constexpr (kCheck) bad |= !Conv<TD>::finite(out);
        st_g(dst + i, out);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// segment tables (layouts mirrored by nccl_ddp/kernels/cuda.py: SEG_DTYPE, SMALL_DTYPE)

struct Seg {
  u64 ptr;   // tensor-side address (source of pack, destination of unpack)
  i64 off;   // offset in the bucket, in bucket elements
  i64 n;     // elements
};
static_assert(sizeof(Seg) == 24, "Seg layout is mirrored in nccl_ddp/kernels/cuda.py");

// Device table: one Seg per work item, already cut to at most `chunk` elements.
struct TableRef {
  const Seg* __restrict__ items;
  int nitems;
  __device__ __forceinline__ int count() const { return nitems; }
  __device__ __forceinline__ void find(int item, u64& ptr, i64& off, i64& n, i64& j) const {
    ptr = __ldg(&items[item].ptr);
    off = __ldg(&items[item].off);
    n = __ldg(&items[item].n);
    j = 0;
  }
};

struct SmallTable {
  u64 ptr[kSmallMax];
  i64 off[kSmallMax];
  i64 n[kSmallMax];
  int first_item[kSmallMax + 1];   // first_item[nseg] == item count
  int nseg;
  __device__ __forceinline__ int count() const { return first_item[nseg]; }
  // Unrolled over every slot with constant indices: the table stays in the parameter bank (a
  // run-time index into a kernel parameter can make the compiler copy it to local memory).
  // first_item[k] == count() for every k >= nseg, so unused slots never match.
  __device__ __forceinline__ void find(int item, u64& p, i64& o, i64& cnt, i64& j) const {
    p = ptr[0];
    o = off[0];
    cnt = n[0];
    int first = first_item[0];
#pragma unroll
    for (int k = 1; k < kSmallMax; ++k) {
      if (item >= first_item[k]) {
        p = ptr[k];
        o = off[k];
        cnt = n[k];
        first = first_item[k];
      }
    }
    j = item - first;
  }
};
static_assert(sizeof(SmallTable) == 24 * kSmallMax + 4 * (kSmallMax + 2),
              "SmallTable layout is mirrored in nccl_ddp/kernels/cuda.py");

// Every warp takes items warp_id, warp_id + total_warps, ...; pack reads the segments and writes
// the bucket, unpack the reverse.
template <typename TS, typename TD, bool kPack, bool kAccum, bool kCheck, typename Table>
__device__ __forceinline__ void run_items(const Table& tab, u64 bucket, int chunk, double scale,
                                          int* flag) {
  typedef typename AccOf<TS, TD>::type A;
  const A s = to_acc<A>(scale);
  const int lane = threadIdx.x & (kWarp - 1);
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / kWarp);
  const int nitems = tab.count();
  bool bad = false;
  for (i64 item = static_cast<i64>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
       item < nitems; item += warps) {
    u64 ptr;
    i64 off, n, j;
    tab.find(static_cast<int>(item), ptr, off, n, j);
    const i64 start = j * chunk;
    const int len = static_cast<int>((n - start < chunk) ? (n - start) : chunk);
    if constexpr (kPack) {
      copy_span<TS, TD, false, kCheck>(reinterpret_cast<const TS*>(ptr) + start,
                                       reinterpret_cast<TD*>(bucket) + off + start, len, s, lane,
                                       bad);
    } else {
      copy_span<TS, TD, kAccum, kCheck>(reinterpret_cast<const TS*>(bucket) + off + start,
                                        reinterpret_cast<TD*>(ptr) + start, len, s, lane, bad);
    }
  }
  if constexpr (kCheck) {
    // Every lane of the warp reaches this point (the item loop is warp-uniform); `flag` is the
    // same for all of them, so all or none return here (unpack's is null when no check is asked).
    if (flag == nullptr) return;
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicExch(flag, 1);
  }
}

// pack: bucket[off_i + k] = cast(load_src(src_i[k]) * scale); flag := 1 if any written value is
// not finite.
template <typename TS, typename TD, bool kCheck>
__global__ void __launch_bounds__(kThreads)
nd_pack(const Seg* items, int nitems, u64 bucket, int chunk, double scale, int* flag) {
  const TableRef tab{items, nitems};
  run_items<TS, TD, true, false, kCheck>(tab, bucket, chunk, scale, flag);
}

template <typename TS, typename TD, bool kCheck>
__global__ void __launch_bounds__(kThreads)
nd_pack_small(const __grid_constant__ SmallTable tab, u64 bucket, int chunk, double scale,
              int* flag) {
  run_items<TS, TD, true, false, kCheck>(tab, bucket, chunk, scale, flag);
}

// unpack: dst_i[k] = cast(bucket[off_i + k] * scale), or dst_i[k] += ... when kAccum; unless
// `flag` is null, flag := 1 if any written value is not finite: the check sees what the reduction
// (and the widening cast) handed back, in the pass that writes it anyway. The check is a run-time
// choice (a bit test per element, free in a memory-bound copy), not another instantiation.
template <typename TS, typename TD, bool kAccum>
__global__ void __launch_bounds__(kThreads)
nd_unpack(const Seg* items, int nitems, u64 bucket, int chunk, double scale, int* flag) {
  const TableRef tab{items, nitems};
  run_items<TS, TD, false, kAccum, true>(tab, bucket, chunk, scale, flag);
}

template <typename TS, typename TD, bool kAccum>
__global__ void __launch_bounds__(kThreads)
nd_unpack_small(const __grid_constant__ SmallTable tab, u64 bucket, int chunk, double scale,
                int* flag) {
  run_items<TS, TD, false, kAccum, true>(tab, bucket, chunk, scale, flag);
}

// In place buf[k] = buf[k] * factor over a flat buffer; grid-stride, 16-byte vectors when aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads) nd_scale(T* buf, i64 n, double factor) {
  typedef typename AccOf<T, T>::type A;
  constexpr int kVec = 16 / sizeof(T);
  typedef VecOf<T, kVec> V;
  const A f = to_acc<A>(factor);
  const i64 tid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  i64 done = 0;
  if (reinterpret_cast<u64>(buf) % sizeof(typename V::raw_t) == 0) {
    typename V::raw_t* p = reinterpret_cast<typename V::raw_t*>(buf);
    const i64 nvec = n / kVec;
    for (i64 i = tid; i < nvec; i += stride) {
      V v;
      v.raw = ld_rw(p + i);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v.e[e] = Conv<T>::store(mul_rn(Conv<T>::load(v.e[e]), f));
      st_g(p + i, v.raw);
    }
    done = nvec * kVec;
  }
  for (i64 i = done + tid; i < n; i += stride) {
    st_g(buf + i, Conv<T>::store(mul_rn(Conv<T>::load(ld_rw(buf + i)), f)));
  }
}
