// csrc/ring.cu's ring executor with its ranks as threads of one process (tests/test_ring_kernel.py):
// N ranks x C channels, each block on its own thread, every rank's control block and FIFO in one
// address space, so that ThreadSanitizer (-fsanitize=thread) sees every access of every rank. Runs
// all-reduce, reduce-scatter, all-gather and one-shot all-reduce calls back to back on fresh data (the
// step tables built here from the schedule's rule, as ringcomm.schedule and engine.bind give them; a
// one-shot call's chunks, every rank's control block and its inbox's bytes per sender), and the
// reduce-scatters and all-gathers whose own chunk lies in a buffer of its own ("own": the result, or
// the shard sent and copied from there, as ringcomm.executor.step_table marks them), checks each result
// against the ring's fold computed here element by element and across ranks, bitwise, and prints
// "ok <calls>". With an argument "timeout", rank N-1 skips the last call: every other rank must
// record a failure (a timeout, or an abort naming the origin) within the deadline and return.
#include "csrc_host.h"

#include "../csrc/ring.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using rc::u64;

namespace {

struct Rank {
  std::vector<u64> ctl;  // control block and FIFO (u64 words: 8-byte aligned, 4096 is enough below)
  std::vector<float> src, work;
  std::vector<long long> table;
  u64 err[RC_RING_ERR_WORDS];
};

constexpr int CHANNELS = 2, SLOTS = 2;
constexpr u64 SLOT_BYTES = 256;    // small slots: many pieces per chunk, so the FIFO wraps many times
constexpr u64 ONESHOT = 16640;     // a one-shot inbox's bytes per sender and half (4099 floats, in 256s)

// the steps of ringcomm.schedule for place r (send chunk, from, recv chunk, reduce, divide, local)
std::vector<long long> steps(const char* what, int n, int r, bool in_place) {
  std::vector<long long> t;
  std::vector<int> written(n, in_place ? 1 : 0);
  auto add = [&](int send, int recv, int reduce) {
    const long long rows[8] = {send, written[send], recv, reduce, 0, written[recv], -1, 0};
    t.insert(t.end(), rows, rows + 8);
    written[recv] = 1;
  };
  if (!strcmp(what, "all_reduce") || !strcmp(what, "reduce_scatter"))
    for (int s = 0; s < n - 1; ++s) add(((r - s - 1) % n + n) % n, ((r - s - 2) % n + n) % n, 1);
  if (!strcmp(what, "all_reduce") || !strcmp(what, "all_gather"))
    for (int s = 0; s < n - 1; ++s) add(((r - s) % n + n) % n, ((r - s - 1) % n + n) % n, 0);
  return t;
}

// One call for every rank: its inputs, step table and expected result.
struct Call {
  const char* what;
  u64 count;
  std::vector<long long> bounds;
};

Call make_call(int n, const char* what, u64 count) {
  Call c{what, count, {}};
  const u64 units = (count + 15) / 16;  // chunks as schedule.partition(count, n)
  u64 start = 0;
  for (int i = 0; i < n; ++i) {
    const u64 stop = std::min<u64>(count, start + (units / n + (i < (int)(units % n))) * 16);
    c.bounds.push_back((long long)start);
    c.bounds.push_back((long long)stop);
    start = stop;
  }
  return c;
}

// Runs ``calls`` back to back on every rank (each rank at its own pace: a rank starts its next call
// once its own blocks are done, as kernels on one stream), on the same control blocks, so counters
// and epochs carry over from call to call. ``skip_last``: rank N-1 does not make the last call.
int run(int n, const std::vector<Call>& calls, unsigned seed, bool skip_last) {
  std::vector<Rank> ranks(n);
  const u64 fifo = RC_RING_FIFO_OFFSET(CHANNELS) + (u64)CHANNELS * SLOTS * SLOT_BYTES + 2 * n * ONESHOT;
  for (auto& k : ranks) {
    k.ctl.assign(fifo / 8, 0);
    memset(k.err, 0, sizeof k.err);
  }
  // every rank's inputs and results of every call (own: its own chunk alone, where the call has one)
  std::vector<std::vector<std::vector<float>>> src(calls.size()), work(calls.size()), own(calls.size());
  std::vector<std::vector<std::vector<long long>>> tables(calls.size());
  srand(seed);
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    src[i].resize(n);
    work[i].resize(n);
    own[i].resize(n);
    tables[i].resize(n);
    for (int r = 0; r < n; ++r) {
      src[i][r].resize(c.count);
      for (auto& x : src[i][r]) x = (float)((rand() % 2001) - 1000) / 7.0f;
      work[i][r].assign(c.count, -1.0f);
      std::vector<long long>& t = tables[i][r];
      if (!strcmp(c.what, "one_shot")) {  // the chunks, every rank's control block, the inbox row's bytes
        t = c.bounds;
        for (int q = 0; q < n; ++q) t.push_back((long long)ranks[q].ctl.data());
        t.push_back((long long)ONESHOT);
        continue;
      }
      const bool ag = !strncmp(c.what, "all_gather", 10), mine = strstr(c.what, "_own") != nullptr;
      t = steps(ag ? "all_gather" : mine ? "reduce_scatter" : c.what, n, r, false);
      t.insert(t.end(), c.bounds.begin(), c.bounds.end());
      for (int ch = 0; ch < n; ++ch) t.push_back(ag && ch == r ? 1 + mine : 0);  // all-gather's own: src, or own
      if (!mine) continue;
      const u64 lo = (u64)c.bounds[2 * r], hi = (u64)c.bounds[2 * r + 1];
      if (ag) {  // the shard alone: sent from own (send from 3), src's copy of it poisoned (read from own only)
        own[i][r].assign(src[i][r].begin() + lo, src[i][r].begin() + hi);
        std::fill(src[i][r].begin() + lo, src[i][r].begin() + hi, -9999.0f);
        for (size_t k = 0; k + 8 <= t.size() - 3 * n; k += 8)
          if (t[k] == r) t[k + 1] = 3;
      } else {  // the result alone: the own chunk's last reduction into own (into 1)
        own[i][r].assign(hi - lo, -1.0f);
        for (size_t k = 0; k + 8 <= t.size() - 3 * n; k += 8)
          if (t[k + 2] == r) t[k + 7] = 1;
      }
    }
  }
  std::vector<std::thread> drivers;
  for (int r = 0; r < n; ++r) {
    drivers.emplace_back([&, r] {
      for (size_t i = 0; i < calls.size(); ++i) {
        if (skip_last && r == n - 1 && i + 1 == calls.size()) return;
        const Call& c = calls[i];
        const int nsteps = !strcmp(c.what, "one_shot") ? -1 : (int)(tables[i][r].size() - 3 * n) / 8;
        std::vector<std::thread> blocks;
        for (unsigned ch = 0; ch < CHANNELS; ++ch)
          blocks.emplace_back([&, ch] {
            const rc::RingArgs a{tables[i][r].data(), nsteps, n, (unsigned char*)work[i][r].data(),
                                 (const unsigned char*)src[i][r].data(), nullptr,
                                 own[i][r].empty() ? nullptr : (unsigned char*)own[i][r].data(), ranks[r].ctl.data(),
                                 ranks[(r + n - 1) % n].ctl.data(), ranks[(r + 1) % n].ctl.data(), ranks[r].err,
                                 (u64)(1 + (c.what[4] << 8)), c.count, skip_last ? 300000000ull : 60000000000ull,
                                 SLOTS, SLOT_BYTES, 0, 1.0, ch, CHANNELS};
            rc::ring_block<float, rc::OpSum>(a, (u64)r);
          });
        for (auto& t : blocks) t.join();
        if (ranks[r].err[0]) return;
      }
    });
  }
  for (auto& t : drivers) t.join();
  if (skip_last) {
    for (int r = 0; r < n - 1; ++r) {
      if (ranks[r].err[0] != 2 || (ranks[r].err[1] != RC_RING_TIMEOUT && ranks[r].err[1] != RC_RING_ABORTED)) {
        printf("rank %d recorded no failure (state %llu kind %llu)\n", r, ranks[r].err[0], ranks[r].err[1]);
        return 1;
      }
    }
    return 0;
  }
  for (int r = 0; r < n; ++r) {
    if (ranks[r].err[0]) {
      printf("n=%d: rank %d failed: kind %llu call %llu step %lld\n", n, r, ranks[r].err[1], ranks[r].err[3],
             (long long)ranks[r].err[4]);
      return 1;
    }
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& k = calls[i];
    // the ring's fold: chunk c of an all-reduce is x[c] + (x[c-1] + (... + x[c+1])) (engine.fold's order)
    for (int c = 0; c < n; ++c) {
      for (u64 e = (u64)k.bounds[2 * c]; e < (u64)k.bounds[2 * c + 1]; ++e) {
        float acc = src[i][(c + 1) % n][e];
        for (int j = 2; j <= n; ++j) acc = src[i][(c + j) % n][e] + acc;
        for (int r = 0; r < n; ++r) {
          float want;
          const float* got = &work[i][r][e];
          if (!strcmp(k.what, "all_reduce") || !strcmp(k.what, "one_shot")) want = acc;
          else if (!strncmp(k.what, "reduce_scatter", 14)) {
            if (r != c) continue;  // only the owner's chunk is the result (in own, where the call has one)
            want = acc;
            if (!own[i][r].empty()) got = &own[i][r][e - (u64)k.bounds[2 * c]];
          } else want = strstr(k.what, "_own") ? own[i][c][e - (u64)k.bounds[2 * c]] : src[i][c][e];
          if (memcmp(&want, got, 4)) {
            printf("%s n=%d count=%llu (call %zu): rank %d element %llu: %g, want %g\n", k.what, n, k.count, i, r, e,
                   *got, want);
            return 1;
          }
        }
      }
    }
  }
  // the epoch advanced by one per call on every channel of every rank
  for (int r = 0; r < n; ++r)
    for (unsigned c = 0; c < CHANNELS; ++c)
      if (ranks[r].ctl[(2 * CHANNELS + c) * RC_RING_LINE + 2] != calls.size()) {
        printf("rank %d channel %u: call counter %llu after %zu calls\n", r, c,
               ranks[r].ctl[(2 * CHANNELS + c) * RC_RING_LINE + 2], calls.size());
        return 1;
      }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "timeout")) {
    const int bad = run(3, {make_call(3, "all_reduce", 1000), make_call(3, "all_reduce", 1000)}, 7, true);
    printf(bad ? "failed\n" : "ok timeout\n");
    return bad;
  }
  // "short": N = 2 and 3, one round, three counts (what the weakened ThreadSanitizer builds run: every
  // report of a race costs ThreadSanitizer time, and the first calls already race)
  const bool brief = argc > 1 && !strcmp(argv[1], "short");
  int calls = 0;
  const char* whats[] = {"all_reduce",     "one_shot",   "reduce_scatter", "one_shot",
                         "reduce_scatter_own", "all_gather", "all_gather_own"};
  for (int n = 2; n <= (brief ? 3 : 5); ++n) {
    std::vector<Call> sequence;
    const std::vector<u64> counts = brief ? std::vector<u64>{1, 333, 4099} : std::vector<u64>{0, 1, (u64)n - 1, 3, 333, 4099};
    for (int round = 0; round < (brief ? 1 : 2); ++round)
      for (const char* what : whats)
        for (u64 count : counts) sequence.push_back(make_call(n, what, count));
    if (run(n, sequence, (unsigned)n, false)) return 1;
    calls += (int)sequence.size();
  }
  printf("ok %d\n", calls);
  return 0;
}
