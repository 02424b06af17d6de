// ringcomm float32-accumulation kernels (accumulate="float32"): a float16 / bfloat16 array a (the
// local data) meets float32 partial sums b; the partials stay float32 and are rounded once, at the end.
//
//   ringcomm_reduce_acc_<op>_<h>(float* dst, const H* a, const float* b, unsigned long long n)
//       dst[i] = op(float(a[i]), b[i])                     float32, not rounded; dst may be b
//   ringcomm_reduce_acc_final_<op>_<h>(H* dst, const H* a, const float* b, unsigned long long n,
//                                      int use_div, float div)
//       dst[i] = H(op(float(a[i]), b[i]) / div)            the division (IEEE, float32) only when use_div;
//                                                          one rounding to H, to nearest even; dst may be a
//   ringcomm_widen_<h>(float* dst, const H* a, unsigned long long n)
//       dst[i] = float(a[i])                               exact
//
// with op in sum, prod, min, max (AVG is sum, and use_div = 1, div = N in the final kernel) and h in
// f16, bf16 (H: half_t, bf16_t). The host (ringcomm/devices/host.py, numpy) gives the same bits:
//   - NaN: every NaN result is written as the positive quiet NaN of its type, float32 0x7fc00000,
//     float16 0x7e00, bfloat16 0x7fc0 (numpy's np.float32(np.nan) and its casts), whatever the NaNs
//     that made it (payloads and signs of NaNs differ between the GPU, x86 and numpy's casts);
//   - MIN / MAX propagate NaN, and between equal operands (+0 and -0) give the first, float(a[i]);
//   - subnormals are kept everywhere, and nothing is fused: every float operation is a PTX wrapper of
//     common.cuh (no plain float arithmetic, comparison or cast below, which CuPy's -ftz=true would
//     flush; tests/test_csrc_host.py also runs this file with float as those options make it).
//
// Access pattern: a unit is 4 elements, 8 bytes of H and 16 bytes of float. When the float pointers
// are 16-byte aligned at the same element as the H pointers are 8-byte aligned, a scalar head of < 4
// elements reaches that element, the body moves whole units (RC_UNROLL in flight per operand and
// thread, grid-stride) and a scalar tail of < 4 elements ends it; otherwise a plain scalar
// grid-stride loop. Launch: any grid of RC_BLOCK-thread blocks (the launcher sizes it from the SM
// count, one thread per RC_UNROLL units).
#ifndef RINGCOMM_ACCUMULATE_CU
#define RINGCOMM_ACCUMULATE_CU
#include "common.cuh"

namespace rc {

// the three kernel kinds
constexpr int ACC_WIDEN = 0, ACC_PARTIAL = 1, ACC_FINAL = 2;

template <bool C, typename X, typename Y> struct Select { typedef X type; };
template <typename X, typename Y> struct Select<false, X, Y> { typedef Y type; };

// The NaN every kernel here writes, per type.
template <typename H> struct CanonicalNaN;
template <> struct CanonicalNaN<half_t> { static constexpr unsigned short bits = 0x7e00u; };
template <> struct CanonicalNaN<bf16_t> { static constexpr unsigned short bits = 0x7fc0u; };
constexpr unsigned F32_CANONICAL_NAN = 0x7fc00000u;

// Traits<H>::acc is float (spelled so, not `float`: the CuPy-options model of the harness redefines
// the word float in this file, and the accumulation type must stay common.cuh's own).
template <typename H> using acc_t = typename Traits<H>::acc;

template <typename H, typename Op, int Kind> struct AccOut {
  typedef typename Select<Kind == ACC_FINAL, H, float>::type type;
};

// One element: op(float(x), y) (x alone for widen), divided (final, use_div), NaN made canonical,
// rounded to H (final).
template <typename H, typename Op, int Kind>
RC_HD typename AccOut<H, Op, Kind>::type acc_one(H x, acc_t<H> y, bool use_div, acc_t<H> div) {
  typedef acc_t<H> A;
  A r = Traits<H>::load(x);
  if constexpr (Kind != ACC_WIDEN) r = Op::template apply<A>(r, y);
  if constexpr (Kind == ACC_FINAL) {
    if (use_div) r = f32_div(r, div);
    H h;
    h.bits = f32_isnan(r) ? CanonicalNaN<H>::bits : Traits<H>::store(r).bits;
    return h;
  } else {
    return f32_isnan(r) ? f32_from_bits(F32_CANONICAL_NAN) : r;
  }
}

// 4 elements of T as one vector of 4 * sizeof(T) bytes (uint2 for 16-bit types, uint4 for float)
template <typename T> struct Vec4Of { typedef typename Select<sizeof(T) == 2, uint2, uint4>::type type; };
template <typename T> union Vec4 {
  typename Vec4Of<T>::type u;
  T v[4];
};

// b[i] as the accumulation type; widen has no b
template <bool HasB, typename A> RC_HD A b_at(const float* b, u64 i) {
  if constexpr (HasB) {
    return b[i];
  } else {
    return f32_from_bits(0u);
  }
}
template <bool HasB, typename A> RC_HD A y_at(const Vec4<float>& y, int j) {
  if constexpr (HasB) {
    return y.v[j];
  } else {
    return f32_from_bits(0u);
  }
}

template <typename H, typename Op, int Kind>
RC_HD void acc_thread(u64 tid, u64 nthreads, typename AccOut<H, Op, Kind>::type* dst, const H* a, const float* b,
                      u64 n, int use_div_in, float div_in) {
  typedef typename AccOut<H, Op, Kind>::type O;
  typedef acc_t<H> A;
  static_assert(sizeof(H) == 2 && sizeof(Vec4<H>) == 8 && sizeof(Vec4<float>) == 16, "vector sizes");
  constexpr bool HAS_B = Kind != ACC_WIDEN;
  const bool use_div = use_div_in != 0;
  const A div = div_in;
  // the element of a at which a (and dst when it is H) reach 8 bytes, b (and dst when float) 16 bytes
  const u64 ph = (addr(a) >> 1) & 3u;
  bool vec = (addr(a) & 1u) == 0;
  if constexpr (HAS_B) vec = vec && (addr(b) & 3u) == 0 && ((addr(b) >> 2) & 3u) == ph;
  if constexpr (sizeof(O) == 2) {
    vec = vec && (addr(dst) & 7u) == (addr(a) & 7u);
  } else {
    vec = vec && (addr(dst) & 3u) == 0 && ((addr(dst) >> 2) & 3u) == ph;
  }
  if (!vec) {
    for (u64 i = tid; i < n; i += nthreads) dst[i] = acc_one<H, Op, Kind>(a[i], b_at<HAS_B, A>(b, i), use_div, div);
    return;
  }
  u64 head = (4u - ph) & 3u;  // elements before the first whole unit
  if (head > n) head = n;
  const u64 nvec = (n - head) / 4u;
  const u64 done = head + nvec * 4u;  // first element of the scalar tail (< 4 elements)
  if (tid < head) dst[tid] = acc_one<H, Op, Kind>(a[tid], b_at<HAS_B, A>(b, tid), use_div, div);
  if (tid < n - done) {
    const u64 i = done + tid;
    dst[i] = acc_one<H, Op, Kind>(a[i], b_at<HAS_B, A>(b, i), use_div, div);
  }

  typedef typename Vec4Of<H>::type HV;
  typedef typename Vec4Of<float>::type FV;
  typedef typename Vec4Of<O>::type OV;
  const HV* av = reinterpret_cast<const HV*>(a + head);
  const FV* bv = reinterpret_cast<const FV*>(HAS_B ? b + head : b);  // widen: b is null and unused
  OV* dv = reinterpret_cast<OV*>(dst + head);
  if (nvec) {
    RC_ASSERT_ALIGNED(av, sizeof(HV));
    if constexpr (HAS_B) RC_ASSERT_ALIGNED(bv, sizeof(FV));
    RC_ASSERT_ALIGNED(dv, sizeof(OV));
  }
  u64 i = tid;
  for (; i + (RC_UNROLL - 1) * nthreads < nvec; i += RC_UNROLL * nthreads) {
    Vec4<H> x[RC_UNROLL];
    Vec4<float> y[RC_UNROLL];
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) {  // all loads first: up to 2 * RC_UNROLL independent loads
      x[k].u = av[i + k * nthreads];
      if constexpr (HAS_B) y[k].u = bv[i + k * nthreads];
    }
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) {
      Vec4<O> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) o.v[j] = acc_one<H, Op, Kind>(x[k].v[j], y_at<HAS_B, A>(y[k], j), use_div, div);
      dv[i + k * nthreads] = o.u;
    }
  }
  for (; i < nvec; i += nthreads) {
    Vec4<H> x;
    Vec4<float> y;
    x.u = av[i];
    if constexpr (HAS_B) y.u = bv[i];
    Vec4<O> o;
#pragma unroll
    for (int j = 0; j < 4; ++j) o.v[j] = acc_one<H, Op, Kind>(x.v[j], y_at<HAS_B, A>(y, j), use_div, div);
    dv[i] = o.u;
  }
}

}  // namespace rc

// (RC_NO_ENTRY_POINTS: only the device functions, for a file that includes this one: ring.cu)
#if !defined(RC_HOST_EMULATION) && !defined(RC_NO_ENTRY_POINTS)
#define RC_TID_NTHREADS (rc::u64)blockIdx.x * blockDim.x + threadIdx.x, (rc::u64)gridDim.x * blockDim.x

#define RC_ACC_ENTRIES(OPNAME, OP, SUFFIX, H)                                                                  \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK, RC_MIN_BLOCKS) ringcomm_reduce_acc_##OPNAME##_##SUFFIX( \
      float* dst, const H* a, const float* b, unsigned long long n) {                                          \
    rc::acc_thread<H, OP, rc::ACC_PARTIAL>(RC_TID_NTHREADS, dst, a, b, n, 0, 1.0f);                             \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK, RC_MIN_BLOCKS)                                        \
      ringcomm_reduce_acc_final_##OPNAME##_##SUFFIX(H* dst, const H* a, const float* b, unsigned long long n,   \
                                                    int use_div, float div) {                                  \
    rc::acc_thread<H, OP, rc::ACC_FINAL>(RC_TID_NTHREADS, dst, a, b, n, use_div, div);                          \
  }

#define RC_ACC_OPS(SUFFIX, H)                 \
  RC_ACC_ENTRIES(sum, rc::OpSum, SUFFIX, H)   \
  RC_ACC_ENTRIES(prod, rc::OpProd, SUFFIX, H) \
  RC_ACC_ENTRIES(min, rc::OpMin, SUFFIX, H)   \
  RC_ACC_ENTRIES(max, rc::OpMax, SUFFIX, H)

#define RC_WIDEN_ENTRY(SUFFIX, H)                                                                                \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK, RC_MIN_BLOCKS) ringcomm_widen_##SUFFIX(                 \
      float* dst, const H* a, unsigned long long n) {                                                            \
    rc::acc_thread<H, rc::OpSum, rc::ACC_WIDEN>(RC_TID_NTHREADS, dst, a, nullptr, n, 0, 1.0f);                    \
  }

RC_ACC_OPS(f16, rc::half_t)
RC_ACC_OPS(bf16, rc::bf16_t)
RC_WIDEN_ENTRY(f16, rc::half_t)
RC_WIDEN_ENTRY(bf16, rc::bf16_t)
#endif
#endif  // RINGCOMM_ACCUMULATE_CU
