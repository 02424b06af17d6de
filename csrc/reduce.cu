// ringcomm reduce kernels: dst[i] = op(a[i], b[i]) (divided by div when use_div), i < n.
//
// dst may be the same memory as a (in place); b may be a neighbour's memory mapped by CUDA IPC.
// Entry points: ringcomm_reduce_<op>_<dtype>(T* dst, const T* a, const T* b,
//                                            unsigned long long n, int use_div, double div)
// with op in sum, prod, min, max and dtype in f16 bf16 f32 f64 i8 u8 i16 u16 i32 u32 i64 u64.
// AVG is sum with use_div = 1 and div = N on the chunk's final step (float types only).
//
// Access pattern: when the three pointers share the same offset modulo 16 bytes, a few scalar
// head elements bring them to a 16-byte boundary, the body moves 16-byte vectors (RC_UNROLL of
// them in flight per operand and thread, grid-stride), and the last < 16 bytes are a scalar tail.
// Pointers with different offsets modulo 16 take a plain scalar grid-stride loop.
// Launch: any grid of RC_BLOCK-thread blocks (the launcher sizes it from the SM count).
#ifndef RINGCOMM_REDUCE_CU
#define RINGCOMM_REDUCE_CU
#include "common.cuh"

namespace rc {

template <typename T, typename Op>
RC_HD void reduce_thread(u64 tid, u64 nthreads, T* dst, const T* a, const T* b, u64 n, int use_div,
                         double div_in) {
  typedef typename Traits<T>::acc A;
  static_assert(sizeof(Vec16<T>) == 16, "16-byte vector");
  constexpr u64 V = 16 / sizeof(T);
  const bool ud = use_div != 0;
  const A div = (A)div_in;
  const u64 mis = addr(dst) & 15u;
  if ((addr(a) & 15u) != mis || (addr(b) & 15u) != mis || mis % sizeof(T) != 0) {
    for (u64 i = tid; i < n; i += nthreads) dst[i] = combine<T, Op>(a[i], b[i], ud, div);
    return;
  }
  u64 head = ((16u - mis) & 15u) / sizeof(T);  // elements before the first 16-byte boundary
  if (head > n) head = n;
  const u64 nvec = (n - head) / V;
  const u64 done = head + nvec * V;  // first element of the scalar tail (< V elements)
  if (tid < head) dst[tid] = combine<T, Op>(a[tid], b[tid], ud, div);
  if (tid < n - done) dst[done + tid] = combine<T, Op>(a[done + tid], b[done + tid], ud, div);

  const uint4* av = reinterpret_cast<const uint4*>(a + head);
  const uint4* bv = reinterpret_cast<const uint4*>(b + head);
  uint4* dv = reinterpret_cast<uint4*>(dst + head);
  if (nvec) {
    RC_ASSERT_ALIGNED(av, 16);
    RC_ASSERT_ALIGNED(bv, 16);
    RC_ASSERT_ALIGNED(dv, 16);
  }
  u64 i = tid;
  for (; i + (RC_UNROLL - 1) * nthreads < nvec; i += RC_UNROLL * nthreads) {
    Vec16<T> x[RC_UNROLL], y[RC_UNROLL];
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) {  // all loads first: 2 * RC_UNROLL independent loads
      x[k].u = av[i + k * nthreads];
      y[k].u = bv[i + k * nthreads];
    }
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) {
#pragma unroll
      for (int j = 0; j < (int)V; ++j) x[k].v[j] = combine<T, Op>(x[k].v[j], y[k].v[j], ud, div);
      dv[i + k * nthreads] = x[k].u;
    }
  }
  for (; i < nvec; i += nthreads) {
    Vec16<T> x, y;
    x.u = av[i];
    y.u = bv[i];
#pragma unroll
    for (int j = 0; j < (int)V; ++j) x.v[j] = combine<T, Op>(x.v[j], y.v[j], ud, div);
    dv[i] = x.u;
  }
}

}  // namespace rc

// (RC_NO_ENTRY_POINTS: only the device functions, for a file that includes this one: ring.cu)
#if !defined(RC_HOST_EMULATION) && !defined(RC_NO_ENTRY_POINTS)
#define RC_REDUCE_ENTRY(OPNAME, OP, SUFFIX, T)                                                    \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK, RC_MIN_BLOCKS) ringcomm_reduce_##OPNAME##_##SUFFIX(    \
      T* dst, const T* a, const T* b, unsigned long long n, int use_div, double div) {          \
    rc::reduce_thread<T, OP>((rc::u64)blockIdx.x * blockDim.x + threadIdx.x,                     \
                             (rc::u64)gridDim.x * blockDim.x, dst, a, b, n, use_div, div);       \
  }

#define RC_REDUCE_OPS(SUFFIX, T)                  \
  RC_REDUCE_ENTRY(sum, rc::OpSum, SUFFIX, T)      \
  RC_REDUCE_ENTRY(prod, rc::OpProd, SUFFIX, T)    \
  RC_REDUCE_ENTRY(min, rc::OpMin, SUFFIX, T)      \
  RC_REDUCE_ENTRY(max, rc::OpMax, SUFFIX, T)

RC_REDUCE_OPS(f16, rc::half_t)
RC_REDUCE_OPS(bf16, rc::bf16_t)
RC_REDUCE_OPS(f32, float)
RC_REDUCE_OPS(f64, double)
RC_REDUCE_OPS(i8, signed char)
RC_REDUCE_OPS(u8, unsigned char)
RC_REDUCE_OPS(i16, short)
RC_REDUCE_OPS(u16, unsigned short)
RC_REDUCE_OPS(i32, int)
RC_REDUCE_OPS(u32, unsigned int)
RC_REDUCE_OPS(i64, long long)
RC_REDUCE_OPS(u64, unsigned long long)
#endif
#endif  // RINGCOMM_REDUCE_CU
