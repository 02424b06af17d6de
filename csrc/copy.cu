// ringcomm copy kernel: dst[i] = src[i] for nbytes bytes (any dtype; the regions must not overlap
// unless they are the same). src may be a neighbour's memory mapped by CUDA IPC.
// Entry point: ringcomm_copy(unsigned char* dst, const unsigned char* src, unsigned long long nbytes)
//
// The word is the widest of 16, 8, 4, 2, 1 bytes at which dst and src have the same offset; a
// scalar byte head reaches the word boundary, the body moves words (RC_UNROLL in flight per
// thread, grid-stride) and a byte tail ends it. Launch: any grid of RC_BLOCK-thread blocks.
#ifndef RINGCOMM_COPY_CU
#define RINGCOMM_COPY_CU
#include "common.cuh"

namespace rc {

template <typename W>
RC_HD void copy_words(u64 tid, u64 nthreads, unsigned char* dst, const unsigned char* src, u64 nbytes) {
  constexpr u64 S = sizeof(W);
  u64 head = (S - (addr(dst) & (S - 1))) & (S - 1);  // bytes before dst's first word boundary
  if (head > nbytes) head = nbytes;
  const u64 nw = (nbytes - head) / S;
  const u64 done = head + nw * S;  // first byte of the tail (< S bytes)
  if (tid < head) dst[tid] = src[tid];
  if (tid < nbytes - done) dst[done + tid] = src[done + tid];

  const W* s = reinterpret_cast<const W*>(src + head);
  W* d = reinterpret_cast<W*>(dst + head);
  if (nw) {
    RC_ASSERT_ALIGNED(s, S);
    RC_ASSERT_ALIGNED(d, S);
  }
  u64 i = tid;
  for (; i + (RC_UNROLL - 1) * nthreads < nw; i += RC_UNROLL * nthreads) {
    W w[RC_UNROLL];
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) w[k] = s[i + k * nthreads];
#pragma unroll
    for (int k = 0; k < RC_UNROLL; ++k) d[i + k * nthreads] = w[k];
  }
  for (; i < nw; i += nthreads) d[i] = s[i];
}

RC_HD void copy_thread(u64 tid, u64 nthreads, unsigned char* dst, const unsigned char* src, u64 nbytes) {
  const u64 x = addr(dst) ^ addr(src);  // the bits in which the two offsets differ
  if ((x & 15u) == 0) copy_words<uint4>(tid, nthreads, dst, src, nbytes);
  else if ((x & 7u) == 0) copy_words<unsigned long long>(tid, nthreads, dst, src, nbytes);
  else if ((x & 3u) == 0) copy_words<unsigned int>(tid, nthreads, dst, src, nbytes);
  else if ((x & 1u) == 0) copy_words<unsigned short>(tid, nthreads, dst, src, nbytes);
  else copy_words<unsigned char>(tid, nthreads, dst, src, nbytes);
}

}  // namespace rc

// (RC_NO_ENTRY_POINTS: only the device functions, for a file that includes this one: ring.cu)
#if !defined(RC_HOST_EMULATION) && !defined(RC_NO_ENTRY_POINTS)
extern "C" __global__ void __launch_bounds__(RC_BLOCK)
    ringcomm_copy(unsigned char* dst, const unsigned char* src, unsigned long long nbytes) {
  rc::copy_thread((rc::u64)blockIdx.x * blockDim.x + threadIdx.x, (rc::u64)gridDim.x * blockDim.x, dst,
                  src, nbytes);
}
#endif
#endif  // RINGCOMM_COPY_CU
