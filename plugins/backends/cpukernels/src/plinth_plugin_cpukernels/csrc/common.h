// plinth cpukernels: what every kernel source shares (kernels.load_extension
// puts this text before each source, and it is part of every build key).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace plinth {

// Work items 0..n-1 spread over the OpenMP team: worker(take) runs once on
// each thread, and take() returns its next item, or -1 when none is left.
// Each thread starts on its own contiguous run of items (thread t of T:
// items tn/T up to (t+1)n/T) and takes them in order; a thread whose run is
// done takes the back half of the largest run left (at least one item), and
// goes on in order from there. In order, so a weight stream's software
// prefetches, which run past the end of an item, land in the same thread's
// next item instead of another thread's (where they were fetched twice and
// left the next item's first lines cold). Taking what is left keeps the
// point of a dynamic split: a static one (at::parallel_for) gives each thread
// the same count, so the team waits for the slowest: items of unequal cost
// (attention tiles of a prefill chunk beside decode rows) or a thread the OS
// preempts (the server's event loop and the client share the cores). Each
// item still runs whole on one thread, so results never depend on which
// thread ran it or on the team's size.
struct alignas(64) TakeRun {
  std::atomic<uint64_t> span;  // first item << 32 | one past the last
};

template <typename Worker>
inline void parallel_take(int64_t n, Worker&& worker) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t(1) << 31), "parallel_take: too many items");
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  std::unique_ptr<TakeRun[]> runs(new TakeRun[threads]);
  for (int64_t t = 0; t < threads; ++t)
    runs[t].span.store(uint64_t(t * n / threads) << 32 | uint64_t((t + 1) * n / threads), std::memory_order_relaxed);
  auto first = [](uint64_t s) { return int64_t(s >> 32); };
  auto last = [](uint64_t s) { return int64_t(s & 0xffffffffu); };
  // one index per thread (nested in a parallel region: every run on this thread, in turn)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      auto take = [&, t]() -> int64_t {
        std::atomic<uint64_t>& own = runs[t].span;
        for (;;) {
          uint64_t s = own.load(std::memory_order_relaxed);
          while (first(s) < last(s))
            if (own.compare_exchange_weak(s, s + (uint64_t(1) << 32), std::memory_order_relaxed)) return first(s);
          // this run is done: the back half of the largest one left (as read
          // here; the swap below fails and the search reruns if it moved since)
          int64_t victim = -1, most = 0;
          uint64_t sv = 0;
          for (int64_t v = 0; v < threads; ++v) {
            const uint64_t sr = runs[v].span.load(std::memory_order_relaxed);
            if (last(sr) - first(sr) > most) {
              most = last(sr) - first(sr);
              victim = v;
              sv = sr;
            }
          }
          if (victim < 0) return -1;
          const int64_t a = first(sv), b = last(sv), mid = a + (b - a) / 2;  // [mid, b): at least one item
          if (!runs[victim].span.compare_exchange_strong(sv, uint64_t(a) << 32 | uint64_t(mid), std::memory_order_relaxed))
            continue;
          own.store(uint64_t(mid + 1) << 32 | uint64_t(b), std::memory_order_relaxed);
          return mid;
        }
      };
      worker(take);
    }
  });
}

#if defined(__AMX_TILE__) && defined(__linux__)
// ---- AMX tiles: the configuration, loaded whole, and the permission
// The 64 bytes LDTILECFG reads (palette 1): rows and bytes a row per tile.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Loads cfg into this thread's tile unit. Not _tile_loadconfig: GCC 12 gives
// its asm an 8-byte memory operand, so the compiler took the other 56 bytes
// of a stack config for never read and deleted their stores (an Intel Xeon
// then faulted at ldtilecfg, #GP, or at the first tile instruction, #UD).
// This operand is the whole struct, so every byte is stored before the load;
// always inlined, so the load sits in the function that fills the config
// (tests/test_amx_assembly.py reads the compiled code for it).
__attribute__((always_inline)) inline void load_tile_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// Back to the init state after a thread's last tile instruction, so nothing
// on the thread (or a later kernel that has not configured) meets stale tiles.
__attribute__((always_inline)) inline void release_tiles() { __asm__ volatile("tilerelease" ::: "memory"); }

// Whether Linux grants this process the tile registers: ARCH_REQ_XCOMP_PERM
// (0x1023) for XFEATURE_XTILEDATA (18); process-wide, idempotent.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#endif

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

// ---- long-lived tensors on 2 MB pages
// A decode step streams every weight and its sequences' KV pages from DRAM.
// On 4 KB pages the weight stream crosses a page every 64 lines (where the
// hardware prefetchers stop and the TLB misses, a nested walk in a VM) and
// the KV pages of a batch scatter over the pool: a decode step's linears at
// 16 rows, cold, took 19.3 -> 16.6 ms on 2 MB pages (Zen 4 VM, 2 threads).
// Linux gives 2 MB pages to an aligned range advised MADV_HUGEPAGE when
// transparent huge pages are "madvise" or "always". Tensors of at least
// LARGE_PAGE_MIN bytes come from here; those up to a quarter of a chunk
// share 32 MB chunks (packed one after the other, 4 KB aligned, a bump
// allocator: weights and pages live as long as the model), larger ones get
// their own mapping. A chunk is unmapped when its last tensor goes.
// PLINTH_CPU_LARGE_PAGES=0 turns it off (torch::zeros, as before).
namespace {
constexpr size_t LARGE_PAGE = size_t(2) << 20;
constexpr size_t LARGE_PAGE_CHUNK = size_t(32) << 20;
constexpr size_t LARGE_PAGE_MIN = size_t(64) << 10;

struct LargePageChunk {
  char* base;
  size_t size;
  size_t used;
  int64_t refs;  // its tensors, and the arena's own while it is the open chunk
};

inline std::mutex& large_page_lock() {
  static std::mutex m;
  return m;
}

inline bool large_pages_enabled() {
#if defined(__linux__)
  static const bool on = [] {
    const char* v = std::getenv("PLINTH_CPU_LARGE_PAGES");
    return !(v && v[0] == '0' && v[1] == 0);
  }();
  return on;
#else
  return false;
#endif
}

#if defined(__linux__)
// a fresh zeroed mapping of size bytes (a multiple of LARGE_PAGE) at a 2 MB
// boundary; its first `advised` bytes advised onto 2 MB pages (the rest
// stays on 4 KB pages, so a partial last page costs no more than it holds)
inline char* large_page_map(size_t size, size_t advised) {
  void* p = mmap(nullptr, size + LARGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
  const uintptr_t base = (raw + LARGE_PAGE - 1) & ~uintptr_t(LARGE_PAGE - 1);
  if (base > raw) munmap(p, base - raw);
  if (base + size < raw + size + LARGE_PAGE) munmap(reinterpret_cast<void*>(base + size), raw + LARGE_PAGE - base);
  if (advised) madvise(reinterpret_cast<void*>(base), advised, MADV_HUGEPAGE);  // advice only: 4 KB pages if refused
  return reinterpret_cast<char*>(base);
}

inline void large_page_release(LargePageChunk* c) {  // with large_page_lock() held
  if (--c->refs == 0) {
    munmap(c->base, c->size);
    delete c;
  }
}
#endif

// A zeroed tensor of these sizes, on 2 MB pages where the OS grants them.
// (Internal linkage, like the arena: each extension keeps its own, and two
// builds loaded side by side never share a chunk list under two locks.)
inline torch::Tensor large_page_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  if (!large_pages_enabled() || bytes < LARGE_PAGE_MIN) return torch::zeros(sizes, torch::dtype(dtype));
#if defined(__linux__)
  LargePageChunk* chunk = nullptr;
  char* data = nullptr;
  {
    std::lock_guard<std::mutex> guard(large_page_lock());
    static LargePageChunk* open = nullptr;  // the chunk small tensors are carved from
    const size_t need = (bytes + 4095) & ~size_t(4095);
    if (need > LARGE_PAGE_CHUNK / 4) {
      const size_t size = (need + LARGE_PAGE - 1) & ~(LARGE_PAGE - 1);
      if (char* base = large_page_map(size, bytes & ~(LARGE_PAGE - 1))) {
        chunk = new LargePageChunk{base, size, size, 1};
        data = base;
      }
    } else {
      if (!open || open->used + need > open->size) {
        if (char* base = large_page_map(LARGE_PAGE_CHUNK, LARGE_PAGE_CHUNK)) {
          if (open) large_page_release(open);
          open = new LargePageChunk{base, LARGE_PAGE_CHUNK, 0, 1};
        }
      }
      if (open && open->used + need <= open->size) {
        chunk = open;
        data = open->base + open->used;
        open->used += need;
        ++open->refs;
      }
    }
  }
  if (data) {
    auto t = torch::from_blob(
        data, sizes,
        [chunk](void*) {
          std::lock_guard<std::mutex> guard(large_page_lock());
          large_page_release(chunk);
        },
        torch::dtype(dtype));
    // written now, as torch::zeros would: the memory is taken at start-up
    // (where a pool too big for the machine fails), not at a later first write
    return t.zero_();
  }
#endif
  return torch::zeros(sizes, torch::dtype(dtype));  // no mapping: the allocator's pages
}
}  // namespace

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

// Bound by each extension that hands Python tensors to stream (the KV pages,
// GGUF blocks): plinth::large_page_zeros.
inline torch::Tensor zeros_on_large_pages(std::vector<int64_t> sizes, at::ScalarType dtype) {
  return plinth::large_page_zeros(sizes, dtype);
}
