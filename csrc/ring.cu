// ringcomm ring executor: a whole ring collective in one kernel launch (ringcomm/executor.py).
//
//   ringcomm_ring_<op>_<dtype>(const long long* table, int nsteps, int nchunks, T* work, const T* src,
//                              float* acc, T* own, u64* mine, u64* left, u64* right, u64* err, u64 sig,
//                              u64 count, u64 timeout_ns, int place, int slots, u64 slot_bytes,
//                              int use_div, double div)
// (``place``: this rank's ring place, named in the failures it records; ``acc``: null, or with
// accumulate="float32" on a half type, float32 partial sums as long as work, as the engine's ACC;
// ``own``: null, or one chunk alone, addressed from the chunk's first element: an all-gather's shard,
// sent and copied from there, or a reduce-scatter's result, its last reduction written there, so
// that neither needs a copy of its own around the kernel)
//
// with op in sum, prod, min, max and dtype in f16 bf16 f32 f64 i8 u8 i16 u16 i32 u32 i64 u64.
// Launch: one block of RC_BLOCK threads per channel, as many channels as the communicator's control
// block was laid out for (gridDim.x); every rank's blocks must be resident at once (they wait on
// each other).
//
// The schedule is ringcomm.schedule's, bound by ringcomm.engine.bind, passed as ``table`` (int64):
//   nsteps rows of 8: send chunk (-1: none), send from (0 src, 1 work, 2 acc, 3 own), recv chunk (-1: none),
//                     reduce (1) or copy (0), final (the chunk's last reduction: AVG divides, a wide call
//                     rounds to T), local from (0 src, 1 work), widen from (-1: none; else 0 src, 1 work:
//                     this rank's own data, sent in float32), into (0 work, 1 own)
//   nchunks rows of 2: the chunk's [lo, hi) in elements
//   nchunks words: 1 where the chunk must be copied from src to work at the end (no step wrote it), 2
//                  where from own
// nsteps = -1: a one-shot all-reduce (small counts): nchunks = N ring places, the table is the N
// chunks' (lo, hi), every place's control block as mapped here (N words), and the inbox's bytes per
// sender. Each channel pushes its part of src into every other rank's inbox (half ``call`` & 1, row
// of this place), marks it arrived there, waits for every other rank's, and folds its part of each
// chunk from the N copies in ringcomm.schedule.fold_order (the chunk's next place first, its owner
// last: the ring's bits), into work; then marks each sender's data consumed. Before writing into an
// inbox half it waits until that rank consumed the last call that used the half.
// Each chunk is cut into per-channel ranges (units of 16 elements dealt out evenly, as
// schedule.partition does) and each channel's range into pieces of one FIFO slot. Channel c of rank
// r talks only to channel c of its neighbours.
//
// Each rank's control block (``mine``, one dedicated allocation, mapped by both neighbours), in
// 128-byte lines of 16 words, for C = gridDim.x channels:
//   line c          ready[c]: pieces the left neighbour has put into my FIFO (written by the left)
//   line C + c      freed[c]: pieces the right neighbour has taken out of the FIFO I write into its
//                   memory (written by the right)
//   line 2C + c     state[c]: [0] pieces sent, [1] pieces received, [2] calls (only this rank's
//                   channel c touches it: the epoch lives in device memory, graph replays advance it)
//   line 3C         abort: 0, or 1 + the ring place of the rank whose failure ended the ring
//   line 3C+1 + (k C + c) M + q, M = RC_ONESHOT_MAX_RANKS: one-shot counters of channel c for ring place q,
//                   k = 0 arrived (the last call whose data q put in my inbox; written by q), k = 1
//                   consumed (the last call whose data I put in q's inbox that q has folded; written by q)
//   from byte RC_RING_FIFO_OFFSET(C): C x slots FIFO slots of slot_bytes each (channel-major)
//   then the one-shot inbox: 2 parities x N senders x the table's bytes per sender
// Counters only grow (compared wrap-safe). The left writes my ready and my FIFO, the right my
// freed; each block polls only its own control block and writes into its neighbours'.
//
// Every call begins with a header piece (call number, signature, count): a neighbour that made a
// different call is a mismatch, recorded as one. Every wait has a deadline (timeout_ns, read from
// the clock every 256 looks): on expiry, or on a mismatch, the block records what it waited for in
// ``err`` (pinned host memory, 16 words; the first failure of the ring's rank wins), sets the abort
// word of this rank and of both neighbours, and returns; a block that finds its abort word set does
// the same, naming the origin. Nothing traps: the host raises at the next call (executor.py).
#include "common.cuh"
#define RC_NO_ENTRY_POINTS
#include "reduce.cu"
#include "copy.cu"
#include "accumulate.cu"
#undef RC_NO_ENTRY_POINTS

// Words per 128-byte line; the most ranks of a one-shot call; where the FIFO begins for C channels
// (after the control lines, 4096-byte aligned).
#define RC_RING_LINE 16
#define RC_ONESHOT_MAX_RANKS 8
#define RC_RING_FIFO_OFFSET(C) ((((3 * (C) + 1 + 2 * (C) * RC_ONESHOT_MAX_RANKS) * 128) + 4095) / 4096 * 4096)
// err[] words: state (0 empty, 1 being written, 2 written), kind, origin, call, step (-1: the header),
// peer (which neighbour: 0 left, 1 right), expected, observed, channel, their call, their signature,
// their count, my signature, my count
#define RC_RING_ERR_WORDS 16
#define RC_RING_TIMEOUT 1
#define RC_RING_ABORTED 2
#define RC_RING_MISMATCH 3
// a header piece: call number, signature, count, this magic
#define RC_RING_MAGIC 0x72696e67636f6d6dULL

// A block's threads: on the GPU each runs the body once for itself; in the host emulation the
// block is one OS thread that runs the body for every thread in turn, between barriers (phase by
// phase), so a barrier is where the phase ends and RC_SHARED is a plain local of the block.
#ifdef RC_HOST_EMULATION
#define RC_THREADS(t) for (unsigned t = 0; t < RC_BLOCK; ++t)
#define RC_BARRIER() ((void)0)
#define RC_LEADER true
#define RC_SHARED
#else
#define RC_THREADS(t) for (unsigned t = threadIdx.x, t##_once = 1; t##_once; t##_once = 0)
#define RC_BARRIER() __syncthreads()
#define RC_LEADER (threadIdx.x == 0)
#define RC_SHARED __shared__
#endif

namespace rc {

struct RingArgs {
  const long long* table;
  int nsteps, nchunks;
  unsigned char* work;
  const unsigned char* src;
  unsigned char* acc;  // accumulate="float32": float32 partial sums, as many as work's elements; else null
  unsigned char* own;  // one chunk alone (from its first element): table's "own"; else null
  u64 *mine, *left, *right, *err;
  u64 sig, count, timeout_ns;
  int slots;
  u64 slot_bytes;
  int use_div;
  double div;
  unsigned channel, channels;
};

__device__ __forceinline__ u64* line(u64* ctl, unsigned i) { return ctl + (u64)i * RC_RING_LINE; }

// A one-shot counter (k: 0 arrived, 1 consumed) of the block's channel for ring place q, in ``ctl``.
__device__ __forceinline__ u64* oneshot_line(u64* ctl, const RingArgs& a, unsigned k, unsigned q) {
  return line(ctl, 3 * a.channels + 1 + (k * a.channels + a.channel) * RC_ONESHOT_MAX_RANKS + q);
}

__device__ __forceinline__ unsigned char* slot_of(u64* ctl, const RingArgs& a, u64 piece) {
  return (unsigned char*)ctl + RC_RING_FIFO_OFFSET(a.channels) +
         ((u64)a.channel * a.slots + piece % (u64)a.slots) * a.slot_bytes;
}

// The channel's part [lo, hi) of the elements [start, stop): units of 16 elements dealt out evenly,
// the first channels one more.
__device__ __forceinline__ void channel_range(const RingArgs& a, u64 start, u64 stop, u64& lo, u64& hi) {
  const u64 units = (stop - start + 15) / 16, base = units / a.channels, extra = units % a.channels;
  const u64 c = a.channel;
  lo = start + (c * base + (c < extra ? c : extra)) * 16;
  hi = lo + (base + (c < extra)) * 16;
  if (lo > stop) lo = stop;
  if (hi > stop) hi = stop;
}

// The block's first failure: record it (the ring rank's first wins), abort this rank and both
// neighbours (keeping the first origin), return the kind. ``origin``: a ring place + 1.
__device__ __forceinline__ int fail(const RingArgs& a, int kind, u64 origin, u64 call, long long step, int peer,
                                    u64 expected, u64 observed, const u64* theirs) {
  if (cas(a.err, 0, 1)) {
    u64* e = a.err;
    st_relaxed(e + 1, (u64)kind);
    st_relaxed(e + 2, origin);
    st_relaxed(e + 3, call);
    st_relaxed(e + 4, (u64)step);
    st_relaxed(e + 5, (u64)peer);
    st_relaxed(e + 6, expected);
    st_relaxed(e + 7, observed);
    st_relaxed(e + 8, a.channel);
    for (int i = 0; i < 3; ++i) st_relaxed(e + 9 + i, theirs ? theirs[i] : 0);
    st_relaxed(e + 12, a.sig);
    st_relaxed(e + 13, a.count);
    st_release(e, 2);
  }
  const unsigned at = 3 * a.channels;
  cas(line(a.mine, at), 0, origin);
  cas(line(a.left, at), 0, origin);
  cas(line(a.right, at), 0, origin);
  return kind;
}

// Wait until the counter at ``word`` reaches ``want``, within the deadline; 0, or the failure's kind.
__device__ __forceinline__ int wait_for(const RingArgs& a, const u64* word, u64 want, u64 place, u64 call,
                                        long long step, int peer) {
  const u64* abort = line(a.mine, 3 * a.channels);
  u64 start = 0;
  for (u64 spins = 0;; ++spins) {
    const u64 v = ld_acquire(word);
    if (reached(v, want)) return 0;
    const u64 origin = ld_acquire(abort);
    if (origin) return fail(a, RC_RING_ABORTED, origin, call, step, origin == place + 1 ? peer : -1, want, v, 0);
    if (spins % 256 == 0) {
      const u64 now = clock_ns();
      if (spins == 0) start = now;
      else if (now - start > a.timeout_ns) return fail(a, RC_RING_TIMEOUT, place + 1, call, step, peer, want, v, 0);
    }
    spin_pause(spins);
  }
}

// The one-shot all-reduce of one channel (nsteps = -1; see the top), after the header: 0, or the
// failure's kind. ``status``: ring_block's, written by the leader alone in a wait, read by every thread
// after the barrier that follows (the same discipline as there). A wait for place q names it as peer
// 2 + 2q (its data) or 3 + 2q (its consumption of the last call that used the inbox half).
template <typename T, typename Op>
__device__ __forceinline__ int oneshot_block(const RingArgs& a, u64 place, u64 call, const long long* bounds,
                                             int& status) {
  typedef typename Traits<T>::acc A;
  const u64 isz = sizeof(T), n = (u64)a.nchunks, half = call & 1;
  const long long* peers = bounds + 2 * n;  // every place's control block, as mapped here (mine: a.mine)
  const u64 per = (u64)peers[n];            // inbox bytes per sender and half
  const u64 inbox = RC_RING_FIFO_OFFSET(a.channels) + (u64)a.channels * a.slots * a.slot_bytes + half * n * per;
  u64* state = line(a.mine, 2 * a.channels + a.channel);
  u64 lo, hi;
  channel_range(a, 0, a.count, lo, hi);
  if (RC_LEADER) {
    const u64 last = ld_relaxed(state + 3 + half);  // every other rank has folded it: its inbox half is free
    for (u64 q = 0; q < n && !status; ++q)
      if (q != place) status = wait_for(a, oneshot_line(a.mine, a, 1, (unsigned)q), last, place, call, 0, 3 + 2 * (int)q);
  }
  RC_BARRIER();
  int st = status;
  if (st) return st;
  for (u64 q = 0; q < n; ++q) {  // this channel's part of src into every other rank's inbox, row ``place``
    if (q == place) continue;
    unsigned char* to = (unsigned char*)peers[q] + inbox + place * per + lo * isz;
    RC_THREADS(t) copy_thread(t, RC_BLOCK, to, a.src + lo * isz, (hi - lo) * isz);
  }
  RC_BARRIER();
  if (RC_LEADER) {
    for (u64 q = 0; q < n; ++q)
      if (q != place) st_release(oneshot_line((u64*)peers[q], a, 0, (unsigned)place), call);
    for (u64 q = 0; q < n && !status; ++q)
      if (q != place) status = wait_for(a, oneshot_line(a.mine, a, 0, (unsigned)q), call, place, call, 0, 2 + 2 * (int)q);
  }
  RC_BARRIER();
  if ((st = status)) return st;
  // each element of this channel's part, folded from the N copies in the ring's order (element by
  // element: work may be src, whose element is read before it is written)
  const unsigned char* box = (const unsigned char*)a.mine + inbox;
  const bool ud = a.use_div != 0;
  const A div = (A)a.div;
  T* dst = (T*)a.work;
  for (u64 c = 0; c < n; ++c) {
    const u64 clo = (u64)bounds[2 * c] > lo ? (u64)bounds[2 * c] : lo;
    const u64 chi = (u64)bounds[2 * c + 1] < hi ? (u64)bounds[2 * c + 1] : hi;
    RC_THREADS(t) {
      for (u64 i = clo + t; i < chi; i += RC_BLOCK) {
        u64 p = (c + 1) % n;
        T r = p == place ? ((const T*)a.src)[i] : ((const T*)(box + p * per))[i];
        for (u64 k = 2; k <= n; ++k) {
          p = (c + k) % n;
          const T x = p == place ? ((const T*)a.src)[i] : ((const T*)(box + p * per))[i];
          r = combine<T, Op>(x, r, ud && k == n, div);
        }
        dst[i] = r;
      }
    }
  }
  RC_BARRIER();
  if (RC_LEADER) {
    for (u64 q = 0; q < n; ++q)
      if (q != place) st_release(oneshot_line((u64*)peers[q], a, 1, (unsigned)place), call);
  }
  return 0;
}

// One channel of one rank: the header, every step's pieces, the end copies; then the epoch is kept.
// ``status`` is written by the leader alone, in a wait, and read by every thread only right after
// the barrier that follows that wait (into its own ``st``), with a barrier before the leader's next
// wait: so every thread takes the same branches and meets the same barriers.
template <typename T, typename Op> __device__ __forceinline__ void ring_block(const RingArgs& a, u64 place) {
  constexpr bool half = is_same<T, half_t>::value || is_same<T, bf16_t>::value;
  const u64 isz = sizeof(T);
  const bool wide = a.acc != nullptr;  // accumulate="float32": partial sums travel and are kept in float32
  u64* state = line(a.mine, 2 * a.channels + a.channel);
  u64* ready = line(a.mine, a.channel);                    // my FIFO's fill, written by the left
  u64* freed = line(a.mine, a.channels + a.channel);       // the right's FIFO's drain, written by the right
  u64* right_ready = line(a.right, a.channel);             // what I write into the right
  u64* left_freed = line(a.left, a.channels + a.channel);  // what I write into the left
  const long long* bounds = a.table + 8 * (a.nsteps > 0 ? a.nsteps : 0);
  const bool oneshot = a.nsteps < 0;
  RC_SHARED int status;
  RC_SHARED u64 sent, got, call;
  if (RC_LEADER) {
    status = 0;
    sent = ld_relaxed(state);
    got = ld_relaxed(state + 1);
    call = ld_relaxed(state + 2) + 1;
  }
  RC_BARRIER();
  // the header: sent as a piece of its own, checked against this rank's call; nothing is sent once
  // the ring is aborted (an earlier call that failed did not keep its epoch: its header would lie)
  if (RC_LEADER) {
    const u64 origin = ld_acquire(line(a.mine, 3 * a.channels));
    status = origin ? fail(a, RC_RING_ABORTED, origin, call, -1, 0, 0, 0, 0)
                    : wait_for(a, freed, sent + 1 - a.slots, place, call, -1, 1);
    if (!status) {
      u64* h = (u64*)slot_of(a.right, a, sent);
      st_relaxed(h, call);
      st_relaxed(h + 1, a.sig);
      st_relaxed(h + 2, a.count);
      st_relaxed(h + 3, RC_RING_MAGIC);
      st_release(right_ready, ++sent);
      status = wait_for(a, ready, got + 1, place, call, -1, 0);
    }
    if (!status) {
      const u64* h = (const u64*)slot_of(a.mine, a, got);
      const u64 theirs[3] = {ld_relaxed(h), ld_relaxed(h + 1), ld_relaxed(h + 2)};
      st_release(left_freed, ++got);
      if (theirs[0] != call || theirs[1] != a.sig || theirs[2] != a.count)
        status = fail(a, RC_RING_MISMATCH, place + 1, call, -1, 0, call, theirs[0], theirs);
    }
  }
  RC_BARRIER();
  int st = status;
  RC_BARRIER();
  if (oneshot && !st) st = oneshot_block<T, Op>(a, place, call, bounds, status);
  for (int k = 0; k < a.nsteps && !st; ++k) {
    const long long* row = a.table + 8 * k;
    const long long sc = row[0], rc_ = row[2];
    u64 slo = 0, shi = 0, rlo = 0, rhi = 0;
    if (sc >= 0) channel_range(a, bounds[2 * sc], bounds[2 * sc + 1], slo, shi);
    if (rc_ >= 0) channel_range(a, bounds[2 * rc_], bounds[2 * rc_ + 1], rlo, rhi);
    // what travels: float32 partial sums (sent from ACC; received by a reduce step when wide), else T
    const u64 s_isz = row[1] == 2 ? 4 : isz, r_isz = wide && row[3] ? 4 : isz;
    const u64 s_per = a.slot_bytes / s_isz, r_per = a.slot_bytes / r_isz;
    const u64 ns = (shi - slo + s_per - 1) / s_per, nr = (rhi - rlo + r_per - 1) / r_per;
    // (own holds one chunk from its first element: ``s_at``/``r_at`` the element it starts at, else 0)
    const unsigned char* from = row[1] == 3 ? a.own : row[1] == 2 ? a.acc : row[1] ? a.work : a.src;
    const u64 s_at = row[1] == 3 ? (u64)bounds[2 * sc] : 0, r_at = row[7] ? (u64)bounds[2 * rc_] : 0;
    const T* local = (const T*)(row[5] ? a.work : a.src);
    const T* widen = row[6] < 0 ? nullptr : (const T*)(row[6] ? a.work : a.src);
    T* dst = (T*)(row[7] ? a.own : a.work);
    for (u64 j = 0; j < ns || j < nr; ++j) {
      if (j < ns) {  // piece j of the chunk sent: into the right's FIFO once a slot is free there
        if (RC_LEADER) status = wait_for(a, freed, sent + 1 - a.slots, place, call, k, 1);
        RC_BARRIER();
        if ((st = status)) break;
        const u64 lo = slo + j * s_per, n = (shi - lo < s_per ? shi - lo : s_per);
        unsigned char* slot = slot_of(a.right, a, sent);
        if constexpr (half) {
          if (widen) {  // this rank's own data, sent in float32 (exact) straight into the slot
            RC_THREADS(t) acc_thread<T, OpSum, ACC_WIDEN>(t, RC_BLOCK, (float*)slot, widen + lo, nullptr, n, 0, 1.0f);
          }
        }
        if (!widen) RC_THREADS(t) copy_thread(t, RC_BLOCK, slot, from + (lo - s_at) * s_isz, n * s_isz);
        RC_BARRIER();
        if (RC_LEADER) st_release(right_ready, ++sent);
      }
      if (j < nr) {  // piece j of the chunk received: out of my FIFO once the left has filled it
        if (RC_LEADER) status = wait_for(a, ready, got + 1, place, call, k, 0);
        RC_BARRIER();
        if ((st = status)) break;
        const u64 lo = rlo + j * r_per, n = (rhi - lo < r_per ? rhi - lo : r_per);
        const unsigned char* in = slot_of(a.mine, a, got);
        if (!row[3]) {
          RC_THREADS(t) copy_thread(t, RC_BLOCK, (unsigned char*)(dst + (lo - r_at)), in, n * isz);
        } else if (!wide) {
          const bool div = row[4] && a.use_div;
          RC_THREADS(t) reduce_thread<T, Op>(t, RC_BLOCK, dst + (lo - r_at), local + lo, (const T*)in, n, div, a.div);
        } else if constexpr (half) {
          const float* partial = (const float*)in;
          if (row[4]) {  // the chunk's last reduction: rounded once into work or own (AVG divides in float32)
            RC_THREADS(t) acc_thread<T, Op, ACC_FINAL>(t, RC_BLOCK, dst + (lo - r_at), local + lo, partial, n,
                                                       a.use_div, (float)a.div);
          } else {  // a partial sum, kept in float32 in ACC for the next step to send
            RC_THREADS(t) acc_thread<T, Op, ACC_PARTIAL>(t, RC_BLOCK, (float*)a.acc + lo, local + lo, partial, n, 0,
                                                         1.0f);
          }
        }
        RC_BARRIER();
        if (RC_LEADER) st_release(left_freed, ++got);
      }
    }
  }
  if (st) return;
  const long long* copies = bounds + 2 * a.nchunks;
  for (int c = 0; c < a.nchunks && !oneshot; ++c) {
    if (!copies[c]) continue;
    u64 lo, hi;
    channel_range(a, bounds[2 * c], bounds[2 * c + 1], lo, hi);
    const unsigned char* from = copies[c] == 2 ? a.own + (lo - (u64)bounds[2 * c]) * isz : a.src + lo * isz;
    RC_THREADS(t) copy_thread(t, RC_BLOCK, a.work + lo * isz, from, (hi - lo) * isz);
  }
  if (RC_LEADER) {
    st_relaxed(state, sent);
    st_relaxed(state + 1, got);
    st_relaxed(state + 2, call);
    if (oneshot) st_relaxed(state + 3 + (call & 1), call);  // (the last one-shot call that used this half)
  }
}

}  // namespace rc

#ifndef RC_HOST_EMULATION
#define RC_RING_ENTRY(OPNAME, OP, SUFFIX, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(RC_BLOCK) ringcomm_ring_##OPNAME##_##SUFFIX(                       \
      const long long* table, int nsteps, int nchunks, T* work, const T* src, float* acc, T* own, rc::u64* mine, \
      rc::u64* left, rc::u64* right, rc::u64* err, rc::u64 sig, rc::u64 count, rc::u64 timeout_ns, int place,     \
      int slots, rc::u64 slot_bytes, int use_div, double div) {                                                  \
    const rc::RingArgs a{table, nsteps, nchunks, (unsigned char*)work, (const unsigned char*)src,               \
                         (unsigned char*)acc, (unsigned char*)own, mine, left, right, err, sig, count,         \
                         timeout_ns, slots, slot_bytes, use_div, div, blockIdx.x, gridDim.x};                  \
    rc::ring_block<T, OP>(a, (rc::u64)place);                                                                     \
  }

// (RC_RING_ONE_ENTRY: the loader compiles one kernel at a time, adding its RC_RING_ENTRY line)
#ifndef RC_RING_ONE_ENTRY
#define RC_RING_OPS(SUFFIX, T)                \
  RC_RING_ENTRY(sum, rc::OpSum, SUFFIX, T)    \
  RC_RING_ENTRY(prod, rc::OpProd, SUFFIX, T)  \
  RC_RING_ENTRY(min, rc::OpMin, SUFFIX, T)    \
  RC_RING_ENTRY(max, rc::OpMax, SUFFIX, T)

RC_RING_OPS(f16, rc::half_t)
RC_RING_OPS(bf16, rc::bf16_t)
RC_RING_OPS(f32, float)
RC_RING_OPS(f64, double)
RC_RING_OPS(i8, signed char)
RC_RING_OPS(u8, unsigned char)
RC_RING_OPS(i16, short)
RC_RING_OPS(u16, unsigned short)
RC_RING_OPS(i32, int)
RC_RING_OPS(u32, unsigned int)
RC_RING_OPS(i64, long long)
RC_RING_OPS(u64, unsigned long long)
#endif
#endif
