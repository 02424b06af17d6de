// Host emulation of ringcomm's kernels, for tests/test_csrc_host.py and the emulated GPU
// (tests/emulated/cupy; built with the host C++ compiler; no GPU, no nvcc). Each kernel body in
// csrc/ is a __host__ __device__ function of (thread index, thread count); here every "thread" of a
// grid runs in turn, which is exact for these kernels (threads touch disjoint elements and never
// synchronise). The ring executor (csrc/ring.cu, rc_ring_block below) does synchronise: its blocks
// wait on each other's counters, so each block runs on an OS thread of its own, all at once, and a
// block's threads advance phase by phase between its barriers (ring.cu: RC_THREADS); its ordering
// primitives are common.cuh's std::atomic_ref ones (tests/ring_selftest.cpp runs it under
// ThreadSanitizer). What differs from the GPU:
// the 16-bit conversions use the integer code paths of common.cuh instead of PTX cvt, and the PTX
// wrappers of common.cuh (f32_*, rn_*, fp_cast) are the plain IEEE operations they stand for (build
// with -ffp-contract=off so that the host compiler does not fuse them either).
//
// Built with -DRC_HOST_CUPY_OPTIONS, the harness also models what CuPy's NVRTC options do to the
// plain float arithmetic of optimizer.cu and accumulate.cu: CuPy appends -ftz=true, and NVRTC's defaults
// include -fmad=true. In those files (only), float and double are the types nvrtc_model::F32 / F64 below: float
// operations flush subnormal inputs and results to sign-preserving zero (add/sub/mul/div/neg, sqrtf,
// and float <-> double casts), and a product followed by an add or subtract is fused into one FMA
// (float and double), as nvvm does (of a*b + c*d it fuses a*b). The PTX wrappers of common.cuh keep
// IEEE semantics there, as on the GPU: a kernel written only with them gives the same bits either way.
#include "csrc_host.h"

#include "../csrc/reduce.cu"
#include "../csrc/copy.cu"

#ifdef RC_HOST_CUPY_OPTIONS
namespace nvrtc_model {

inline float ftz(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }

struct F64;
struct F32 {  // float under -ftz=true -fmad=true
  float v;
  F32() = default;
  F32(float x) : v(x) {}  // a float from common.cuh (a PTX wrapper's result, a load): no instruction
  F32(double x) : v(ftz((float)x)) {}  // cvt.rn.ftz.f32.f64
  explicit F32(F64 x);
  operator float() const { return v; }  // handed to common.cuh (a PTX wrapper): no instruction
};
struct F64 {  // double under -fmad=true (no flush-to-zero exists for double)
  double v;
  F64() = default;
  F64(double x) : v(x) {}
  F64(float x) : v(ftz(x)) {}  // cvt.ftz.f64.f32
  F64(F32 x) : v(ftz(x.v)) {}
  operator double() const { return v; }
};
inline F32::F32(F64 x) : F32(x.v) {}

// A product not yet rounded: rounded when used as a value, fused into an add or subtract that uses it.
struct Mul32 {
  F32 a, b;
  operator F32() const { return ftz(ftz(a.v) * ftz(b.v)); }
};
struct Mul64 {
  F64 a, b;
  operator F64() const { return a.v * b.v; }
};
inline F32 fused(Mul32 p, F32 c) { return ftz(fmaf(ftz(p.a.v), ftz(p.b.v), ftz(c.v))); }
inline F64 fused(Mul64 p, F64 c) { return fma(p.a.v, p.b.v, c.v); }

inline F32 operator-(F32 x) { return -ftz(x.v); }
inline F64 operator-(F64 x) { return -x.v; }

#define RC_MODEL_OPS(F, M, RAW, FLUSH)                                                          \
  inline F operator+(F x, F y) { return FLUSH(FLUSH(x.v) + FLUSH(y.v)); }                     \
  inline F operator-(F x, F y) { return FLUSH(FLUSH(x.v) - FLUSH(y.v)); }                     \
  inline M operator*(F x, F y) { return M{x, y}; }                                            \
  inline F operator/(F x, F y) { return FLUSH(FLUSH(x.v) / FLUSH(y.v)); }                     \
  inline F operator+(M p, F c) { return fused(p, c); }                                        \
  inline F operator+(F c, M p) { return fused(p, c); }                                        \
  inline F operator+(M p, M q) { return fused(p, F(q)); }                                     \
  inline F operator-(M p, F c) { return fused(p, -c); }                                       \
  inline F operator-(F c, M p) { return fused(M{-p.a, p.b}, c); }                             \
  inline F operator-(M p, M q) { return fused(p, -F(q)); }                                    \
  inline F operator+(RAW x, F y) { return F(x) + y; }                                         \
  inline F operator+(F x, RAW y) { return x + F(y); }                                         \
  inline F operator-(RAW x, F y) { return F(x) - y; }                                         \
  inline F operator-(F x, RAW y) { return x - F(y); }                                         \
  inline M operator*(RAW x, F y) { return M{F(x), y}; }                                       \
  inline M operator*(F x, RAW y) { return M{x, F(y)}; }                                       \
  inline F operator/(RAW x, F y) { return F(x) / y; }                                         \
  inline F operator/(F x, RAW y) { return x / F(y); }
inline double no_flush(double x) { return x; }
RC_MODEL_OPS(F32, Mul32, float, ftz)
RC_MODEL_OPS(F64, Mul64, double, no_flush)
#undef RC_MODEL_OPS

// CUDA's math functions under -ftz=true -prec-sqrt=true: sqrt.rn.ftz.f32 (found by argument lookup).
inline F32 sqrtf(F32 x) { return ftz(::sqrtf(ftz(x.v))); }
inline F32 sqrt(F32 x) { return sqrtf(x); }
inline F64 sqrt(F64 x) { return ::sqrt(x.v); }

}  // namespace nvrtc_model

typedef nvrtc_model::F32 kfloat;  // float and double as the kernel file sees them
typedef nvrtc_model::F64 kdouble;
#define float kfloat
#define double kdouble
#else
typedef float kfloat;
typedef double kdouble;
#endif

#include "../csrc/optimizer.cu"
#include "../csrc/accumulate.cu"

// Plain float arithmetic as the kernel file sees it (IEEE, or the CuPy-options model), so that the
// tests can check that the model flushes and fuses where it should.
namespace probe {
RC_HD float mul_add(float x, float y, float z) { return x * y + z; }
RC_HD float mul(float x, float y) { return x * y; }
RC_HD float div(float x, float y) { return x / y; }
RC_HD float root(float x) { return sqrtf(x); }
RC_HD float narrow(double x) { return (float)x; }
RC_HD double widen(float x) { return (double)x; }
RC_HD double mul_add64(double x, double y, double z) { return x * y + z; }
RC_HD double mul64(double x, double y) { return x * y; }
}  // namespace probe

#ifdef RC_HOST_CUPY_OPTIONS
#undef float
#undef double
#else
// (not in the CuPy-options build: there accumulate.cu's float is the model's, which ring.cu does not
// take; ring.cu has no float arithmetic of its own)
#include "../csrc/ring.cu"
#endif

using rc::u64;

namespace {

// dtype codes: the order of DTYPES in tests/test_csrc_host.py
template <typename F> int by_dtype(int dtype, F&& f) {
  switch (dtype) {
    case 0: f(rc::half_t()); return 0;
    case 1: f(rc::bf16_t()); return 0;
    case 2: f(float()); return 0;
    case 3: f(double()); return 0;
    case 4: f((signed char)0); return 0;
    case 5: f((unsigned char)0); return 0;
    case 6: f((short)0); return 0;
    case 7: f((unsigned short)0); return 0;
    case 8: f(int()); return 0;
    case 9: f((unsigned int)0); return 0;
    case 10: f((long long)0); return 0;
    case 11: f((unsigned long long)0); return 0;
  }
  return -1;
}

// the float dtype codes 0..3 as the kernel file sees the types (kfloat, kdouble: see RC_HOST_CUPY_OPTIONS)
template <typename F> int by_fp_dtype(int dtype, F&& f) {
  switch (dtype) {
    case 0: f(rc::half_t()); return 0;
    case 1: f(rc::bf16_t()); return 0;
    case 2: f(kfloat()); return 0;
    case 3: f(kdouble()); return 0;
  }
  return -1;
}

template <typename T, typename Op>
void run_reduce(void* d, const void* a, const void* b, u64 n, int use_div, double div, u64 nthreads) {
  for (u64 t = 0; t < nthreads; ++t)
    rc::reduce_thread<T, Op>(t, nthreads, (T*)d, (const T*)a, (const T*)b, n, use_div, div);
}

// accumulate.cu's kernels; b and the float dst as the file sees float (kfloat)
template <typename H, typename Op, int Kind>
void run_acc(void* d, const void* a, const void* b, u64 n, int use_div, float div, u64 nthreads) {
  typedef typename rc::AccOut<H, Op, Kind>::type O;
  for (u64 t = 0; t < nthreads; ++t)
    rc::acc_thread<H, Op, Kind>(t, nthreads, (O*)d, (const H*)a, (const kfloat*)b, n, use_div, div);
}

// dtype 0 (f16) or 1 (bf16), op 0..3 (sum, prod, min, max): f(H(), Op())
template <typename F> int by_half_op(int dtype, int op, F&& f) {
  if ((dtype != 0 && dtype != 1) || op < 0 || op > 3) return -1;
  auto with_op = [&](auto h) {
    if (op == 0) f(h, rc::OpSum());
    if (op == 1) f(h, rc::OpProd());
    if (op == 2) f(h, rc::OpMin());
    if (op == 3) f(h, rc::OpMax());
  };
  if (dtype == 0) with_op(rc::half_t());
  else with_op(rc::bf16_t());
  return 0;
}

template <typename P, typename G, typename O>
void run_adam(void* p, const void* g, void* m, void* v, void* out, u64 n, const double* s, u64 nthreads) {
  for (u64 t = 0; t < nthreads; ++t)
    rc::adam_thread<P, G, O>(t, nthreads, (P*)p, (const G*)g, (P*)m, (P*)v, (O*)out, n, s[0], s[1], s[2], s[3], s[4],
                             s[5], s[6], s[7]);
}

}  // namespace

extern "C" {

// One block (channel) of csrc/ring.cu's ring executor, run to its end on the calling thread; every
// block of every rank must run at once, each on its own thread (tests/emulated/cupy starts them).
// op: 0 sum, 1 prod, 2 min, 3 max. -1 for a bad dtype or op.
#ifndef RC_HOST_CUPY_OPTIONS
int rc_ring_block(int dtype, int op, unsigned channel, unsigned channels, const long long* table, int nsteps,
                  int nchunks, void* work, const void* src, void* acc, void* own, u64* mine, u64* left, u64* right,
                  u64* err, u64 sig, u64 count, u64 timeout_ns, int place, int slots, u64 slot_bytes, int use_div,
                  double div) {
  if (op < 0 || op > 3) return -1;
  const rc::RingArgs a{table, nsteps, nchunks, (unsigned char*)work, (const unsigned char*)src, (unsigned char*)acc,
                       (unsigned char*)own, mine, left, right, err, sig, count, timeout_ns, slots, slot_bytes, use_div,
                       div, channel, channels};
  return by_dtype(dtype, [&](auto x) {
    typedef decltype(x) T;
    if (op == 0) rc::ring_block<T, rc::OpSum>(a, (u64)place);
    if (op == 1) rc::ring_block<T, rc::OpProd>(a, (u64)place);
    if (op == 2) rc::ring_block<T, rc::OpMin>(a, (u64)place);
    if (op == 3) rc::ring_block<T, rc::OpMax>(a, (u64)place);
  });
}
#endif

// Vector accesses found misaligned since the last call (reset to 0 by each call).
unsigned long long rc_host_misaligned() {
  return misaligned_accesses.exchange(0, std::memory_order_relaxed);
}

// op: 0 sum, 1 prod, 2 min, 3 max
int rc_host_reduce(int dtype, int op, void* d, const void* a, const void* b, u64 n, int use_div, double div,
                   u64 nthreads) {
  if (op < 0 || op > 3) return -1;
  return by_dtype(dtype, [&](auto x) {
    typedef decltype(x) T;
    if (op == 0) run_reduce<T, rc::OpSum>(d, a, b, n, use_div, div, nthreads);
    if (op == 1) run_reduce<T, rc::OpProd>(d, a, b, n, use_div, div, nthreads);
    if (op == 2) run_reduce<T, rc::OpMin>(d, a, b, n, use_div, div, nthreads);
    if (op == 3) run_reduce<T, rc::OpMax>(d, a, b, n, use_div, div, nthreads);
  });
}

void rc_host_copy(void* d, const void* s, u64 nbytes, u64 nthreads) {
  for (u64 t = 0; t < nthreads; ++t) rc::copy_thread(t, nthreads, (unsigned char*)d, (const unsigned char*)s, nbytes);
}

// 1 when built with -DRC_HOST_CUPY_OPTIONS (optimizer.cu's float and double as CuPy's NVRTC options make them)
int rc_host_cupy_options() {
#ifdef RC_HOST_CUPY_OPTIONS
  return 1;
#else
  return 0;
#endif
}

// probe::<op> on (x, y, z) (float ops on the arguments rounded to float): 0 mul_add, 1 mul, 2 div, 3 root,
// 4 narrow (x itself), 5 widen, 6 mul_add64, 7 mul64 (the doubles themselves)
double rc_host_probe(int op, double x, double y, double z) {
  const float fx = (float)x, fy = (float)y, fz = (float)z;
  switch (op) {
    case 0: return probe::mul_add(fx, fy, fz);
    case 1: return probe::mul(fx, fy);
    case 2: return probe::div(fx, fy);
    case 3: return probe::root(fx);
    case 4: return probe::narrow(x);
    case 5: return probe::widen(fx);
    case 6: return probe::mul_add64(x, y, z);
    case 7: return probe::mul64(x, y);
  }
  return -1.0;
}

// pdt: 2 (f32) or 3 (f64); gdt: 0..3; odt: -1 (none) or 0..3. s: lr, beta1, beta2, eps, decay, bc1, bc2, scale
int rc_host_adam(int pdt, int gdt, int odt, void* p, const void* g, void* m, void* v, void* out, u64 n,
                 const double* s, u64 nthreads) {
  if ((pdt != 2 && pdt != 3) || gdt < 0 || gdt > 3 || odt < -1 || odt > 3) return -1;
  return by_fp_dtype(pdt, [&](auto px) {
    typedef decltype(px) P;
    if constexpr (rc::is_same<P, kfloat>::value || rc::is_same<P, kdouble>::value) {
      by_fp_dtype(gdt, [&](auto gx) {
        typedef decltype(gx) G;
        if (odt == -1) {
          run_adam<P, G, rc::NoOut>(p, g, m, v, out, n, s, nthreads);
        } else {
          by_fp_dtype(odt, [&](auto ox) {
            typedef decltype(ox) O;
            run_adam<P, G, O>(p, g, m, v, out, n, s, nthreads);
          });
        }
      });
    }
  });
}

// accumulate.cu: dtype 0 (f16) or 1 (bf16); op: 0 sum, 1 prod, 2 min, 3 max. d: float32, a: dtype, b: float32.
int rc_host_reduce_acc(int dtype, int op, void* d, const void* a, const void* b, u64 n, u64 nthreads) {
  return by_half_op(dtype, op, [&](auto h, auto o) {
    run_acc<decltype(h), decltype(o), rc::ACC_PARTIAL>(d, a, b, n, 0, 1.0f, nthreads);
  });
}

// d: dtype (may be a), a: dtype, b: float32; divided by div when use_div
int rc_host_reduce_acc_final(int dtype, int op, void* d, const void* a, const void* b, u64 n, int use_div, float div,
                             u64 nthreads) {
  return by_half_op(dtype, op, [&](auto h, auto o) {
    run_acc<decltype(h), decltype(o), rc::ACC_FINAL>(d, a, b, n, use_div, div, nthreads);
  });
}

// d: float32, a: dtype
int rc_host_widen(int dtype, void* d, const void* a, u64 n, u64 nthreads) {
  return by_half_op(dtype, 0, [&](auto h, auto) {
    run_acc<decltype(h), rc::OpSum, rc::ACC_WIDEN>(d, a, nullptr, n, 0, 1.0f, nthreads);
  });
}

// kind: 0 f32->f16, 1 f16->f32, 2 f32->bf16, 3 bf16->f32, 4 f64->f16, 5 f64->bf16
void rc_host_convert(int kind, const void* src, void* dst, u64 n) {
  for (u64 i = 0; i < n; ++i) {
    switch (kind) {
      case 0: ((unsigned short*)dst)[i] = rc::float_to_half(((const float*)src)[i]); break;
      case 1: ((float*)dst)[i] = rc::half_to_float(((const unsigned short*)src)[i]); break;
      case 2: ((unsigned short*)dst)[i] = rc::float_to_bf16(((const float*)src)[i]); break;
      case 3: ((float*)dst)[i] = rc::bf16_to_float(((const unsigned short*)src)[i]); break;
      case 4: ((unsigned short*)dst)[i] = rc::float_to_half(rc::f64_to_f32_odd(((const double*)src)[i])); break;
      case 5: ((unsigned short*)dst)[i] = rc::float_to_bf16(rc::f64_to_f32_odd(((const double*)src)[i])); break;
    }
  }
}

}  // extern "C"
