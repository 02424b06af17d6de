// ringcomm kernels: what every kernel file shares.
//
//   - 16-bit float storage types (half_t, bf16_t) with their float conversions,
//   - dtype traits (the accumulation type: float for the half types),
//   - float and double arithmetic in PTX that is rounded once and never flushed to zero or fused into an
//     FMA, whatever NVRTC's flags (CuPy forces -ftz=true; -fmad=true is the default): f32_*, rn_*, fp_cast,
//   - the op functors SUM / PROD / MIN / MAX (integers wrap like numpy; MIN/MAX propagate NaN),
//   - the 16-byte vector type and the launch constants.
//
// The same text is compiled by NVRTC at run time (through CuPy's RawModule; the Python loader
// pastes this header in place of the #include, so no include path is needed) and by nvcc in CI
// (tests/test_csrc_compile.py). It includes nothing on purpose: cuda_fp16.h / cuda_bf16.h are not
// reliably on NVRTC's path (CuPy bundles cuda_fp16.h only), so the 16-bit conversions are written
// here, as PTX `cvt` on the device and the same IEEE rounding in integer arithmetic elsewhere.
// Every function is __host__ __device__ so tests/csrc_harness.cpp can run the index arithmetic of
// each kernel on the CPU (thread by thread) against numpy.
#ifndef RINGCOMM_COMMON_CUH
#define RINGCOMM_COMMON_CUH

// Threads per block; the Python launcher uses the same number (ringcomm/devices/cuda.py: BLOCK).
#define RC_BLOCK 512
// 16-byte vectors each thread keeps in flight per operand in the main loops.
#define RC_UNROLL 4
// Blocks per multiprocessor the compiler must leave room for (caps registers at 64 per thread).
#define RC_MIN_BLOCKS 2

#define RC_HD __host__ __device__ __forceinline__

// The host emulation (tests/csrc_harness.cpp) checks that every vector access is aligned, which
// the CPU would otherwise forgive; on the GPU this is nothing.
#ifdef RC_HOST_EMULATION
void rc_check_aligned(const void* p, unsigned long long bytes);
#define RC_ASSERT_ALIGNED(p, bytes) rc_check_aligned((p), (bytes))
#else
#define RC_ASSERT_ALIGNED(p, bytes) ((void)0)
#endif

namespace rc {

typedef unsigned long long u64;

template <typename A, typename B> struct is_same { static constexpr bool value = false; };
template <typename A> struct is_same<A, A> { static constexpr bool value = true; };

// ------------------------------------------------------------------------------------- bit casts
RC_HD unsigned f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  union { float f; unsigned u; } x;
  x.f = f;
  return x.u;
#endif
}

RC_HD float f32_from_bits(unsigned u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  union { unsigned u; float f; } x;
  x.u = u;
  return x.f;
#endif
}

// ------------------------------------------------------------- float32 <-> float64 conversions
// PTX cvt without .ftz: CuPy's -ftz=true would make the plain casts cvt.rn.ftz.f32.f64 and
// cvt.ftz.f64.f32, which flush float32 subnormals (see "float32 without flush-to-zero" below).
RC_HD float f32_from_f64(double x) {  // round to nearest even, subnormals kept
#ifdef __CUDA_ARCH__
  float r;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
  return r;
#else
  return (float)x;
#endif
}

RC_HD double f64_from_f32(float x) {  // exact
#ifdef __CUDA_ARCH__
  double r;
  asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
  return r;
#else
  return (double)x;
#endif
}

// ------------------------------------------------------------------------- 16-bit float types
// Storage only: arithmetic happens in float (Traits<...>::acc).
struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

RC_HD float half_to_float(unsigned short h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  unsigned exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (man << 13));    // inf, NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));  // normal
  if (man == 0) return f32_from_bits(sign);                                      // +-0
  unsigned e = 113u;                                                             // subnormal
  while (!(man & 0x400u)) { man <<= 1; --e; }
  return f32_from_bits(sign | (e << 23) | ((man & 0x3ffu) << 13));
#endif
}

// Round to nearest, ties to even (IEEE; numpy's float32 -> float16 cast).
RC_HD unsigned short float_to_half(float f) {
#ifdef __CUDA_ARCH__
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const unsigned u = f32_bits(f);
  const unsigned sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);   // NaN -> quiet NaN
  if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 (and inf) -> inf
  if (a >= 0x38800000u) {                                          // normal half: >= 2^-14
    const unsigned r = a + 0x0fffu + ((a >> 13) & 1u);
    return (unsigned short)(sign | ((r >> 13) - (112u << 10)));
  }
  if (a <= 0x33000000u) return (unsigned short)sign;  // <= 2^-25 (a tie at 2^-25 goes to even 0)
  const unsigned e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;  // 14..24
  unsigned q = m >> shift;
  const unsigned rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // q == 0x400 is the smallest normal
  return (unsigned short)(sign | q);
#endif
}

RC_HD float bf16_to_float(unsigned short b) { return f32_from_bits((unsigned)b << 16); }

// Round to nearest, ties to even (ml_dtypes' float32 -> bfloat16 cast); NaN stays a quiet NaN.
RC_HD unsigned short float_to_bf16(float f) {
  unsigned u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

// double -> float rounded to odd: a second rounding of the result to a type of <= 22 significant
// bits (half, bfloat16) is then exactly the correctly rounded double -> half / bfloat16 cast.
RC_HD float f64_to_f32_odd(double d) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.rz.f32.f64 %0, %1;" : "=f"(f) : "d"(d));
#else
  float f = (float)d;  // nearest; step one ulp towards zero where that rounded away
  const double af = f < 0 ? -(double)f : (double)f, ad = d < 0 ? -d : d;
  if (af > ad) f = f32_from_bits(f32_bits(f) - 1u);
#endif
  if (d == d && f64_from_f32(f) != d) f = f32_from_bits(f32_bits(f) | 1u);  // not (double)f: cvt.ftz under -ftz
  return f;
}

// -------------------------------------------------------------------------------- dtype traits
// acc: the type an element is combined in; load/store convert between storage and acc.
template <typename T> struct Traits {  // the integer types: combined in their own type
  typedef T acc;
  static constexpr bool is_float = false;
  RC_HD static acc load(T x) { return x; }
  RC_HD static T store(acc x) { return x; }
};
template <> struct Traits<half_t> {
  typedef float acc;
  static constexpr bool is_float = true;
  RC_HD static float load(half_t x) { return half_to_float(x.bits); }
  RC_HD static half_t store(float x) { half_t h; h.bits = float_to_half(x); return h; }
};
template <> struct Traits<bf16_t> {
  typedef float acc;
  static constexpr bool is_float = true;
  RC_HD static float load(bf16_t x) { return bf16_to_float(x.bits); }
  RC_HD static bf16_t store(float x) { bf16_t h; h.bits = float_to_bf16(x); return h; }
};
template <> struct Traits<float> {
  typedef float acc;
  static constexpr bool is_float = true;
  RC_HD static float load(float x) { return x; }
  RC_HD static float store(float x) { return x; }
};
template <> struct Traits<double> {
  typedef double acc;
  static constexpr bool is_float = true;
  RC_HD static double load(double x) { return x; }
  RC_HD static double store(double x) { return x; }
};

// Integers add and multiply in the unsigned type of their width (or wider): wrap-around like
// numpy, and no signed-overflow undefined behaviour.
template <typename A> struct Wide { typedef A type; };
template <> struct Wide<signed char> { typedef unsigned int type; };
template <> struct Wide<unsigned char> { typedef unsigned int type; };
template <> struct Wide<short> { typedef unsigned int type; };
template <> struct Wide<unsigned short> { typedef unsigned int type; };
template <> struct Wide<int> { typedef unsigned int type; };
template <> struct Wide<long long> { typedef unsigned long long type; };

// ------------------------------------------------------------------ float32 without flush-to-zero
// CuPy appends -ftz=true to every NVRTC compile, after the caller's options (so it cannot be undone
// there): plain float arithmetic, sqrtf, comparisons and float <-> double casts would then flush
// subnormals to zero, unlike numpy (and ml_dtypes, whose bfloat16 has float32's exponent range). The
// float32 operations the kernels use are therefore PTX without .ftz: IEEE results, subnormals kept,
// whatever the flags. add/sub/mul carry an explicit .rn, which also keeps them out of FMA contraction.
RC_HD float f32_add(float x, float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x + y;
#endif
}

RC_HD float f32_sub(float x, float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x - y;
#endif
}

RC_HD float f32_mul(float x, float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x * y;
#endif
}

RC_HD float f32_div(float x, float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return x / y;
#endif
}

RC_HD float f32_sqrt(float x) {  // correctly rounded (sqrtf is too, but flushes under -ftz)
#ifdef __CUDA_ARCH__
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return sqrtf(x);
#endif
}

RC_HD bool f32_le(float x, float y) {  // x <= y (false when either is NaN)
#ifdef __CUDA_ARCH__
  unsigned r;
  asm("{\n\t.reg .pred p;\n\tsetp.le.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(x), "f"(y));
  return r != 0;
#else
  return x <= y;
#endif
}

// x is a NaN, tested on the bits: an integer comparison, so no setp.*.ftz.f32 under -ftz=true.
RC_HD bool f32_isnan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }

RC_HD bool f32_ge(float x, float y) {  // x >= y (false when either is NaN)
#ifdef __CUDA_ARCH__
  unsigned r;
  asm("{\n\t.reg .pred p;\n\tsetp.ge.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(x), "f"(y));
  return r != 0;
#else
  return x >= y;
#endif
}

// ------------------------------------------------------------- rounded once, never fused (float, double)
// NVRTC's default -fmad=true lets nvvm and ptxas fuse a multiply and the add that uses it into one FMA
// (float and double alike): one rounding where the source has two. PTX add/sub/mul.rn are never fused
// (an explicit rounding modifier forbids it), so code that must equal a host computation bit for bit
// (the fused Adam and ringcomm.zero.adam) does every operation through these overloads: the float ones
// are the PTX wrappers above, the double ones the same instructions in .f64 (no flush-to-zero exists
// for double). fp_cast converts between float and double without .ftz (by width, so that code
// templated on the type needs no other dispatch).
RC_HD float rn_add(float x, float y) { return f32_add(x, y); }
RC_HD float rn_sub(float x, float y) { return f32_sub(x, y); }
RC_HD float rn_mul(float x, float y) { return f32_mul(x, y); }
RC_HD float rn_div(float x, float y) { return f32_div(x, y); }
RC_HD float rn_sqrt(float x) { return f32_sqrt(x); }

RC_HD double rn_add(double x, double y) {
#ifdef __CUDA_ARCH__
  double r;
  asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(x), "d"(y));
  return r;
#else
  return x + y;
#endif
}

RC_HD double rn_sub(double x, double y) {
#ifdef __CUDA_ARCH__
  double r;
  asm("sub.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(x), "d"(y));
  return r;
#else
  return x - y;
#endif
}

RC_HD double rn_mul(double x, double y) {
#ifdef __CUDA_ARCH__
  double r;
  asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(x), "d"(y));
  return r;
#else
  return x * y;
#endif
}

RC_HD double rn_div(double x, double y) {
#ifdef __CUDA_ARCH__
  double r;
  asm("div.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(x), "d"(y));
  return r;
#else
  return x / y;
#endif
}

RC_HD double rn_sqrt(double x) {
#ifdef __CUDA_ARCH__
  double r;
  asm("sqrt.rn.f64 %0, %1;" : "=d"(r) : "d"(x));
  return r;
#else
  return sqrt(x);
#endif
}

template <typename To, typename From> RC_HD To fp_cast(From x) {  // float <-> double, or the same type
  static_assert(sizeof(To) == 4 || sizeof(To) == 8, "float or double");
  if constexpr (sizeof(To) == sizeof(From)) {
    return x;
  } else if constexpr (sizeof(To) == 4) {
    return f32_from_f64(x);
  } else {
    return f64_from_f32(x);
  }
}

// ------------------------------------------------------------------------------------ op functors
struct OpSum {
  template <typename A> RC_HD static A apply(A x, A y) {
    if constexpr (is_same<A, float>::value) {
      return f32_add(x, y);
    } else {
      typedef typename Wide<A>::type W;
      return (A)((W)x + (W)y);
    }
  }
};
struct OpProd {
  template <typename A> RC_HD static A apply(A x, A y) {
    if constexpr (is_same<A, float>::value) {
      return f32_mul(x, y);
    } else {
      typedef typename Wide<A>::type W;
      return (A)((W)x * (W)y);
    }
  }
};
// numpy.minimum / numpy.maximum: a NaN in either operand gives NaN (x != x is false for integers);
// between equal operands (+0 and -0) the first, x (numpy's scalar loop does the same; its SIMD loops
// may return y).
struct OpMin {
  template <typename A> RC_HD static A apply(A x, A y) {
    if constexpr (is_same<A, float>::value) {
      return (f32_le(x, y) || f32_isnan(x)) ? x : y;
    } else {
      return (x <= y || x != x) ? x : y;
    }
  }
};
struct OpMax {
  template <typename A> RC_HD static A apply(A x, A y) {
    if constexpr (is_same<A, float>::value) {
      return (f32_ge(x, y) || f32_isnan(x)) ? x : y;
    } else {
      return (x >= y || x != x) ? x : y;
    }
  }
};

// op(x, y) in the accumulation type, divided by div when use_div (float types only: AVG's final
// step), rounded once to T.
template <typename T, typename Op>
RC_HD T combine(T x, T y, bool use_div, typename Traits<T>::acc div) {
  typedef Traits<T> Tr;
  typedef typename Tr::acc A;
  A r = Op::template apply<A>(Tr::load(x), Tr::load(y));
  if constexpr (Tr::is_float) {
    if (use_div) {
      if constexpr (is_same<A, float>::value) {
        r = f32_div(r, div);
      } else {
        r = r / div;
      }
    }
  }
  return Tr::store(r);
}

// ------------------------------------------------------------------------------- 16-byte vectors
template <typename T> union Vec16 {
  uint4 u;
  T v[16 / sizeof(T)];
};

RC_HD u64 addr(const void* p) { return (u64)p; }

// ------------------------------------------------ ordering between processes (the ring executor)
// Every load, store and read-modify-write of a word another process (or another block) may touch
// at the same time goes through these, never through plain or volatile accesses: on the GPU they
// are PTX at system scope (the other process may be on another GPU, or the host); in the host
// emulation they are std::atomic_ref with the same orderings (ThreadSanitizer understands them) and
// a steady clock. Producer: data, then st_release (its release covers the block's writes ordered
// before it by a block barrier). Consumer: ld_acquire of the flag, then (after a block barrier) data.
#ifdef RC_HOST_EMULATION
}  // namespace rc
#include <atomic>
#include <chrono>
#include <thread>
namespace rc {
// tests/test_ring_kernel.py builds the harness with one of these to show that ThreadSanitizer
// catches a missing acquire or release (never defined anywhere else).
#if defined(RC_TEST_RELAXED_ACQUIRE)
constexpr std::memory_order RC_ACQ = std::memory_order_relaxed;
#else
constexpr std::memory_order RC_ACQ = std::memory_order_acquire;
#endif
#if defined(RC_TEST_RELAXED_RELEASE)
constexpr std::memory_order RC_REL = std::memory_order_relaxed;
#else
constexpr std::memory_order RC_REL = std::memory_order_release;
#endif
inline u64 ld_acquire(const u64* p) { return std::atomic_ref<u64>(*const_cast<u64*>(p)).load(RC_ACQ); }
inline u64 ld_relaxed(const u64* p) {
  return std::atomic_ref<u64>(*const_cast<u64*>(p)).load(std::memory_order_relaxed);
}
inline void st_release(u64* p, u64 v) { std::atomic_ref<u64>(*p).store(v, RC_REL); }
inline void st_relaxed(u64* p, u64 v) { std::atomic_ref<u64>(*p).store(v, std::memory_order_relaxed); }
// compare-and-swap, acquire and release: true when *p was ``expected`` and is now ``desired``
inline bool cas(u64* p, u64 expected, u64 desired) {
  return std::atomic_ref<u64>(*p).compare_exchange_strong(expected, desired, std::memory_order_acq_rel);
}
inline u64 clock_ns() {
  return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// A spinning thread lets the others run: the emulation has far fewer cores than a GPU has SMs, and
// shares them with the ranks' host threads (a long wait sleeps between looks).
inline void spin_pause(u64 spins) {
  if (spins < 64) std::this_thread::yield();
  else std::this_thread::sleep_for(std::chrono::microseconds(20));
}
#else
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_relaxed(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ bool cas(u64* p, u64 expected, u64 desired) {
  u64 old;
  asm volatile("atom.acq_rel.sys.cas.b64 %0, [%1], %2, %3;"
               : "=l"(old)
               : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old == expected;
}
__device__ __forceinline__ u64 clock_ns() {  // %globaltimer: nanoseconds, the same on every SM
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Spin freely at first (a neighbour a step behind answers within microseconds), then sleep a
// little between looks so that a long wait leaves the memory system to the others.
__device__ __forceinline__ void spin_pause(u64 spins) {
  if (spins > 2048) __nanosleep(256);
}
#endif

// ``counter`` (which only grows) has reached ``want``: a comparison that survives wrap-around.
RC_HD bool reached(u64 counter, u64 want) { return (long long)(counter - want) >= 0; }

}  // namespace rc

#endif  // RINGCOMM_COMMON_CUH
