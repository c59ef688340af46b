// plinth cpukernels: what every kernel source shares (kernels.load_extension
// puts this text before each source, and it is part of every build key).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace plinth {

// Work items 0..n-1 handed out in order, one at a time, from a shared counter
// to the OpenMP team: worker(take) runs once on each thread, and take()
// returns its next item, or -1 when none is left. A static split (what
// at::parallel_for does) gives each thread the same count of items, so the
// team waits for the slowest half: items of unequal cost (attention tiles of
// a prefill chunk beside decode rows) or a thread the OS preempts (the
// server's event loop and the client share the cores) leave the others
// spinning at the barrier. Here a thread that is ahead takes what is left.
// Each item still runs whole on one thread, so results never depend on which
// thread ran it or on the team's size.
template <typename Worker>
inline void parallel_take(int64_t n, Worker&& worker) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto take = [&next, n]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  // one index per thread (nested in a parallel region: worker runs once, inline)
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(take); });
}

// Software prefetches the compiler keeps. GCC 12 at -O1 and above dropped
// every _mm_prefetch of the attention kernel (the binary had none,
// 2026-12-06; in a reduced case -fno-tree-dce kept them), so cold K/V pages
// were read on demand; a volatile asm cannot be dropped (x86, aarch64; other
// targets fall back to __builtin_prefetch, best effort). prefetch_l1: into
// L1 (a stream a few lines ahead); prefetch_l2: into L2 only, for lines
// further ahead, where L1's few miss buffers would stall the loads in flight.
inline void prefetch_l1(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  __asm__ volatile("prfm pldl1keep, [%x0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  __asm__ volatile("prfm pldl2keep, [%x0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

#if defined(__AVX512F__)
// r[i] (16 dwords each) -> r[j] = the dwords j of r[0..15]
inline void transpose_16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];  // u[4g + c], 128-bit lane L: rows 4g..4g+3 at column 4L + c
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}
#endif

}  // namespace plinth
