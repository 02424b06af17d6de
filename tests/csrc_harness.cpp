// Host emulation of ringcomm's kernels, for tests/test_csrc_host.py (built with the host C++
// compiler; no GPU, no nvcc). Each kernel body in csrc/ is a __host__ __device__ function of
// (thread index, thread count); here every "thread" of a grid runs in turn, which is exact for
// these kernels (threads touch disjoint elements and never synchronise). What differs from the GPU:
// the 16-bit conversions use the integer code paths of common.cuh instead of PTX cvt.
#define RC_HOST_EMULATION 1
#define __host__
#define __device__
#define __forceinline__ inline
#include <math.h>

static unsigned long long misaligned_accesses = 0;
void rc_check_aligned(const void* p, unsigned long long bytes) {
  if ((unsigned long long)p % bytes) ++misaligned_accesses;
}

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

#include "../csrc/reduce.cu"
#include "../csrc/copy.cu"
#include "../csrc/optimizer.cu"

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

template <typename T, typename Op>
void run_reduce(void* d, const void* a, const void* b, u64 n, int use_div, double div, u64 nthreads) {
  for (u64 t = 0; t < nthreads; ++t)
    rc::reduce_thread<T, Op>(t, nthreads, (T*)d, (const T*)a, (const T*)b, n, use_div, div);
}

template <typename P, typename G, typename O>
void run_adam(void* p, const void* g, void* m, void* v, void* out, u64 n, const double* s, u64 nthreads) {
  for (u64 t = 0; t < nthreads; ++t)
    rc::adam_thread<P, G, O>(t, nthreads, (P*)p, (const G*)g, (P*)m, (P*)v, (O*)out, n, s[0], s[1], s[2], s[3], s[4],
                             s[5], s[6], s[7]);
}

}  // namespace

extern "C" {

// Vector accesses found misaligned since the last call (reset to 0 by each call).
unsigned long long rc_host_misaligned() {
  unsigned long long n = misaligned_accesses;
  misaligned_accesses = 0;
  return n;
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

// pdt: 2 (f32) or 3 (f64); gdt: 0..3; odt: -1 (none) or 0..3. s: lr, beta1, beta2, eps, decay, bc1, bc2, scale
int rc_host_adam(int pdt, int gdt, int odt, void* p, const void* g, void* m, void* v, void* out, u64 n,
                 const double* s, u64 nthreads) {
  if ((pdt != 2 && pdt != 3) || gdt < 0 || gdt > 3 || odt < -1 || odt > 3) return -1;
  return by_dtype(pdt, [&](auto px) {
    typedef decltype(px) P;
    if constexpr (rc::is_same<P, float>::value || rc::is_same<P, double>::value) {
      by_dtype(gdt, [&](auto gx) {
        typedef decltype(gx) G;
        if (odt == -1) {
          run_adam<P, G, rc::NoOut>(p, g, m, v, out, n, s, nthreads);
        } else {
          by_dtype(odt, [&](auto ox) {
            typedef decltype(ox) O;
            if constexpr (rc::is_same<O, rc::half_t>::value || rc::is_same<O, rc::bf16_t>::value ||
                          rc::is_same<O, float>::value || rc::is_same<O, double>::value)
              run_adam<P, G, O>(p, g, m, v, out, n, s, nthreads);
          });
        }
      });
    }
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
