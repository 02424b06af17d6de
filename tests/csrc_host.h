// What csrc/ needs to compile with the host C++ compiler (tests/csrc_harness.cpp and
// tests/ring_selftest.cpp): the CUDA words it uses, uint4 / uint2, and the alignment check.
#ifndef RINGCOMM_CSRC_HOST_H
#define RINGCOMM_CSRC_HOST_H
#define RC_HOST_EMULATION 1
#define __host__
#define __device__
#define __forceinline__ inline
#include <math.h>

#include <atomic>

// (atomic: the ring executor's blocks run on threads of their own)
static std::atomic<unsigned long long> misaligned_accesses{0};
void rc_check_aligned(const void* p, unsigned long long bytes) {
  if ((unsigned long long)p % bytes) misaligned_accesses.fetch_add(1, std::memory_order_relaxed);
}

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};

#endif  // RINGCOMM_CSRC_HOST_H
