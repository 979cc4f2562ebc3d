// Fused optimizer steps of nccl_ddp over ONE flat float32 shard in ONE launch: SGD (momentum,
// dampening, nesterov, weight decay) and AdamW (bias correction, decoupled weight decay, amsgrad).
// Each element reads its grad in the grad's dtype (float32/bfloat16/float16) times a scale (1/world,
// a clip coefficient), updates the float32 master weight and optimizer state, and writes the new
// low-precision parameter copy (bfloat16/float16/float32) in the same pass.
//
// Compiled in one translation unit AFTER bucket.cu (nccl_ddp/kernels/cuda.py concatenates the
// sources): it uses bucket.cu's Conv, VecOf, mul_rn/add_rn, ld_nc/ld_rw/st_g and kThreads.
// nccl_ddp.kernels.optim_spec.sgd_ref / adamw_ref are the specification (bit for bit), and
// optim_spec.sgd_scalars / adamw_scalars compute the float32 scalars passed here.
//
// Arithmetic follows torch.optim's single-tensor CPU path (_single_tensor_sgd, _single_tensor_adam
// with decoupled_weight_decay) operation by operation, including where torch's kernels use a fused
// multiply-add (add with alpha, lerp, addcmul) and where they do not (addcdiv, the decay multiply):
// every float32 operation is explicit inline PTX without .ftz, so CuPy's -ftz=true changes nothing
// and subnormals survive.
//
// Work decomposition: grid-stride over 4-element groups, each array moved as one 16-byte (float32)
// or 8-byte (16-bit) vector when every array is aligned for it after the same scalar head (shards
// cut at any element offset of a bucket usually are); otherwise every element is a coalesced scalar.

__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

// max for amsgrad without float compares (setp would flush subnormals under -ftz=true): NaN if
// either is NaN (torch.maximum), else the larger in the total order where -0.0 < +0.0.
__device__ __forceinline__ int order_key(float x) {
  const int i = static_cast<int>(__float_as_uint(x));
  return i ^ ((i >> 31) & 0x7fffffff);
}
__device__ __forceinline__ bool is_nan(float x) {
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  if (is_nan(a) || is_nan(b)) return __uint_as_float(0x7fffffffu);
  return order_key(b) > order_key(a) ? b : a;
}

enum : int {
  kSgdWeightDecay = 1,   // weight_decay != 0
  kSgdMomentum = 2,      // momentum != 0: the buffer is read/written
  kSgdFreshBuffer = 4,   // first step with momentum: buf = grad (torch clones the grad)
  kSgdNesterov = 8,
  kAdamLerpFromEnd = 1,  // 1 - beta1 >= 0.5: torch's lerp takes the `end` form
  kAdamAmsgrad = 2,
};

// torch: grad += wd * p (add with alpha: fma); buf = buf * mom + (1 - damp) * grad (mul, then
// fma); grad = nesterov ? grad + mom * buf (fma) : buf; p += -lr * grad (fma).
struct SgdOp {
  float scale, weight_decay, momentum, one_minus_dampening, neg_lr;
  int flags;
  __device__ __forceinline__ void operator()(float g, float& p, float& buf, float&,
                                             float&) const {
    g = mul_rn(g, scale);
    if (flags & kSgdWeightDecay) g = fma_rn(p, weight_decay, g);
    if (flags & kSgdMomentum) {
      buf = (flags & kSgdFreshBuffer) ? g : fma_rn(g, one_minus_dampening, mul_rn(buf, momentum));
      g = (flags & kSgdNesterov) ? fma_rn(buf, momentum, g) : buf;
    }
    p = fma_rn(g, neg_lr, p);
  }
};

// torch: p *= 1 - lr * wd; m = lerp(m, g, 1 - beta1) (torch's lerp: one fma from the nearer end);
// v = v * beta2 + ((1 - beta2) * g) * g (mul, then fma); amsgrad: vmax = max(vmax, v);
// p += (-step_size * m) / (sqrt(v or vmax) / sqrt(bias_correction2) + eps) (no fma).
struct AdamWOp {
  float scale, decay, lerp_coef, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step;
  int flags;
  __device__ __forceinline__ void operator()(float g, float& p, float& m, float& v,
                                             float& vmax) const {
    g = mul_rn(g, scale);
    p = mul_rn(p, decay);
    m = fma_rn(lerp_coef, sub_rn(g, m), (flags & kAdamLerpFromEnd) ? g : m);
    v = fma_rn(mul_rn(one_minus_beta2, g), g, mul_rn(v, beta2));
    float second = v;
    if (flags & kAdamAmsgrad) {
      vmax = max_nan(vmax, v);
      second = vmax;
    }
    const float denom = add_rn(div_rn(sqrt_rn(second), bias_correction2_sqrt), eps);
    p = add_rn(p, div_rn(mul_rn(neg_step, m), denom));
  }
};

template <typename T> __device__ __forceinline__ bool aligned_vec4(const T* p) {
  return reinterpret_cast<u64>(p) % (4 * sizeof(T)) == 0;
}

// The arrays of one shard step. s1..s3: float32 state (null when the optimizer has none there);
// out: the low-precision parameter copy (null: not written).
template <typename TG, typename TP> struct Shard {
  const TG* __restrict__ grad;
  float* __restrict__ master;
  float* __restrict__ s1;
  float* __restrict__ s2;
  float* __restrict__ s3;
  TP* __restrict__ out;
  bool read_s1;   // false: s1 is only written (SGD's fresh momentum buffer)

  template <typename Op> __device__ __forceinline__ void scalar(i64 i, const Op& op) const {
    float p = ld_rw(master + i);
    float a = (s1 && read_s1) ? ld_rw(s1 + i) : 0.0f;
    float b = s2 ? ld_rw(s2 + i) : 0.0f;
    float c = s3 ? ld_rw(s3 + i) : 0.0f;
    op(Conv<TG>::load(ld_nc(grad + i)), p, a, b, c);
    st_g(master + i, p);
    if (s1) st_g(s1 + i, a);
    if (s2) st_g(s2 + i, b);
    if (s3) st_g(s3 + i, c);
    if (out) st_g(out + i, Conv<TP>::store(p));
  }

  // elements i .. i+3, every array aligned for a 4-element vector
  template <typename Op> __device__ __forceinline__ void vec4(i64 i, const Op& op) const {
    typedef VecOf<float, 4> VF;
    VecOf<TG, 4> g;
    VF p, a, b, c;
    g.raw = __ldg(reinterpret_cast<const typename VecOf<TG, 4>::raw_t*>(grad + i));
    p.raw = __ldca(reinterpret_cast<const typename VF::raw_t*>(master + i));
    if (s1 && read_s1) a.raw = __ldca(reinterpret_cast<const typename VF::raw_t*>(s1 + i));
    if (s2) b.raw = __ldca(reinterpret_cast<const typename VF::raw_t*>(s2 + i));
    if (s3) c.raw = __ldca(reinterpret_cast<const typename VF::raw_t*>(s3 + i));
    VecOf<TP, 4> o;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float ae = (s1 && read_s1) ? a.e[e] : 0.0f;
      float be = s2 ? b.e[e] : 0.0f;
      float ce = s3 ? c.e[e] : 0.0f;
      op(Conv<TG>::load(g.e[e]), p.e[e], ae, be, ce);
      a.e[e] = ae;
      b.e[e] = be;
      c.e[e] = ce;
      o.e[e] = Conv<TP>::store(p.e[e]);
    }
    __stwb(reinterpret_cast<typename VF::raw_t*>(master + i), p.raw);
    if (s1) __stwb(reinterpret_cast<typename VF::raw_t*>(s1 + i), a.raw);
    if (s2) __stwb(reinterpret_cast<typename VF::raw_t*>(s2 + i), b.raw);
    if (s3) __stwb(reinterpret_cast<typename VF::raw_t*>(s3 + i), c.raw);
    if (out) __stwb(reinterpret_cast<typename VecOf<TP, 4>::raw_t*>(out + i), o.raw);
  }

  // Whether every array is 4-element aligned at element `i`.
  __device__ __forceinline__ bool aligned_at(i64 i) const {
    return aligned_vec4(grad + i) && aligned_vec4(master + i) && (!s1 || aligned_vec4(s1 + i)) &&
           (!s2 || aligned_vec4(s2 + i)) && (!s3 || aligned_vec4(s3 + i)) &&
           (!out || aligned_vec4(out + i));
  }

  // Grid-stride over the shard: a scalar head up to master's 16-byte boundary, 4-element vectors,
  // a scalar tail; all scalar when the arrays' alignments disagree.
  template <typename Op> __device__ __forceinline__ void run(i64 n, const Op& op) const {
    const i64 tid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    i64 head = static_cast<i64>((16 - reinterpret_cast<u64>(master) % 16) % 16 / 4);
    if (head > n || !aligned_at(head)) head = n;
    const i64 nvec = (n - head) / 4;
    const i64 tail = head + 4 * nvec;
    for (i64 i = tid; i < head; i += stride) scalar(i, op);
    for (i64 i = tail + tid; i < n; i += stride) scalar(i, op);
    for (i64 k = tid; k < nvec; k += stride) vec4(head + 4 * k, op);
  }
};

// SGD over one shard: master (float32, updated), buf (float32 momentum buffer, null without
// momentum), out (new parameter copy, may be null).
template <typename TG, typename TP>
__global__ void __launch_bounds__(kThreads)
nd_sgd(const TG* grad, float* master, float* buf, TP* out, i64 n, float scale,
       float weight_decay, float momentum, float one_minus_dampening, float neg_lr, int flags) {
  const Shard<TG, TP> s{grad, master, buf, nullptr, nullptr, out,
                        (flags & kSgdFreshBuffer) == 0};
  s.run(n, SgdOp{scale, weight_decay, momentum, one_minus_dampening, neg_lr, flags});
}

// AdamW over one shard: exp_avg, exp_avg_sq, max_exp_avg_sq (null without amsgrad) float32.
template <typename TG, typename TP>
__global__ void __launch_bounds__(kThreads)
nd_adamw(const TG* grad, float* master, float* exp_avg, float* exp_avg_sq,
         float* max_exp_avg_sq, TP* out, i64 n, float scale, float decay, float lerp_coef,
         float beta2, float one_minus_beta2, float bias_correction2_sqrt, float eps,
         float neg_step, int flags) {
  const Shard<TG, TP> s{grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, out, true};
  s.run(n, AdamWOp{scale, decay, lerp_coef, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                   neg_step, flags});
}
