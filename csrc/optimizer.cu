// ringcomm fused AdamW: one pass over a shard, updating the master weights and both moments in
// place and, optionally, writing the updated weights cast to a working dtype.
//
//   g  = grad * grad_scale
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p * decay                               (decay = 1 - lr * weight_decay)
//   p  = p - lr * (m / bc1) / (sqrt(v / bc2) + eps)   (bc1 = 1 - beta1^step, bc2 = 1 - beta2^step)
//   out = (O) p                                  (when out is given; round to nearest even)
//
// All arithmetic in P (the master dtype: float or double); the host computes decay, bc1, bc2.
// Every operation is one of common.cuh's rn_* / fp_cast (PTX, rounded once, subnormals kept, never
// fused into an FMA), in the order of ringcomm.zero.adam.adam_update, so the two agree bit for bit
// whatever NVRTC's flags (CuPy forces -ftz=true; -fmad=true is NVRTC's default). No plain float
// operator or cast below: under those flags it would flush or fuse (tests/test_csrc_host.py builds
// this file with float and double as those flags make them and checks it against adam_update).
// Entry points: ringcomm_adam_<P>_<G>_<O>(P* p, const G* g, P* m, P* v, O* out,
//     unsigned long long n, double lr, double beta1, double beta2, double eps, double decay,
//     double bc1, double bc2, double grad_scale)
// with P in f32 f64, G in f16 bf16 f32 f64, O in none f16 bf16 f32 f64 (out is ignored for none).
// The arrays must not overlap. Launch: any grid of RC_BLOCK-thread blocks.
#include "common.cuh"

namespace rc {

struct NoOut {};

RC_HD void store_out(float& o, float x) { o = x; }
RC_HD void store_out(float& o, double x) { o = f32_from_f64(x); }
RC_HD void store_out(double& o, float x) { o = f64_from_f32(x); }
RC_HD void store_out(double& o, double x) { o = x; }
RC_HD void store_out(half_t& o, float x) { o.bits = float_to_half(x); }
RC_HD void store_out(half_t& o, double x) { o.bits = float_to_half(f64_to_f32_odd(x)); }
RC_HD void store_out(bf16_t& o, float x) { o.bits = float_to_bf16(x); }
RC_HD void store_out(bf16_t& o, double x) { o.bits = float_to_bf16(f64_to_f32_odd(x)); }

template <typename P, typename G, typename O>
RC_HD void adam_thread(u64 tid, u64 nthreads, P* __restrict__ p, const G* __restrict__ g, P* __restrict__ m,
                       P* __restrict__ v, O* __restrict__ out, u64 n, double lr, double beta1, double beta2,
                       double eps, double decay, double bc1, double bc2, double grad_scale) {
  const P lr_ = fp_cast<P>(lr), b1 = fp_cast<P>(beta1), b2 = fp_cast<P>(beta2);
  const P c1 = fp_cast<P>(rn_sub(1.0, beta1)), c2 = fp_cast<P>(rn_sub(1.0, beta2));
  const P eps_ = fp_cast<P>(eps), decay_ = fp_cast<P>(decay), bc1_ = fp_cast<P>(bc1), bc2_ = fp_cast<P>(bc2);
  const P scale = fp_cast<P>(grad_scale);
  for (u64 i = tid; i < n; i += nthreads) {
    const P gi = rn_mul(fp_cast<P>(Traits<G>::load(g[i])), scale);         // g = grad * scale
    const P mi = rn_add(rn_mul(b1, m[i]), rn_mul(c1, gi));                 // beta1*m + (1-beta1)*g
    const P vi = rn_add(rn_mul(b2, v[i]), rn_mul(rn_mul(c2, gi), gi));     // beta2*v + ((1-beta2)*g)*g
    const P mhat = rn_div(mi, bc1_), vhat = rn_div(vi, bc2_);
    const P upd = rn_div(rn_mul(lr_, mhat), rn_add(rn_sqrt(vhat), eps_));  // (lr*mhat) / (sqrt(vhat)+eps)
    const P pi = rn_sub(rn_mul(p[i], decay_), upd);                         // p*decay - upd
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!is_same<O, NoOut>::value) store_out(out[i], pi);
  }
}

}  // namespace rc

#ifndef RC_HOST_EMULATION
#define RC_ADAM_ENTRY(PS, P, GS, G, OS, O)                                                              \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK) ringcomm_adam_##PS##_##GS##_##OS(              \
      P* p, const G* g, P* m, P* v, O* out, unsigned long long n, double lr, double beta1, double beta2, \
      double eps, double decay, double bc1, double bc2, double grad_scale) {                           \
    rc::adam_thread<P, G, O>((rc::u64)blockIdx.x * blockDim.x + threadIdx.x,                            \
                             (rc::u64)gridDim.x * blockDim.x, p, g, m, v, out, n, lr, beta1, beta2, eps, \
                             decay, bc1, bc2, grad_scale);                                              \
  }

#define RC_ADAM_OUTS(PS, P, GS, G)              \
  RC_ADAM_ENTRY(PS, P, GS, G, none, rc::NoOut)  \
  RC_ADAM_ENTRY(PS, P, GS, G, f16, rc::half_t)  \
  RC_ADAM_ENTRY(PS, P, GS, G, bf16, rc::bf16_t) \
  RC_ADAM_ENTRY(PS, P, GS, G, f32, float)       \
  RC_ADAM_ENTRY(PS, P, GS, G, f64, double)

#define RC_ADAM_GRADS(PS, P)               \
  RC_ADAM_OUTS(PS, P, f16, rc::half_t)     \
  RC_ADAM_OUTS(PS, P, bf16, rc::bf16_t)    \
  RC_ADAM_OUTS(PS, P, f32, float)          \
  RC_ADAM_OUTS(PS, P, f64, double)

RC_ADAM_GRADS(f32, float)
RC_ADAM_GRADS(f64, double)
#endif
