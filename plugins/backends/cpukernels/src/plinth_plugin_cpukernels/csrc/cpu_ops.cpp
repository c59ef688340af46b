// plinth cpukernels: C++ kernels for CPUs, built with torch's cpp_extension.
//
// Each op does in one pass what the reference backend does in several torch
// ops (a decode step runs ~400 of those, at 10-30 us each on 2 cores). All
// arithmetic is float32; bfloat16 is read and written by bit shifts.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> struct Elem;
template <> struct Elem<float> {
  static inline float load(const float* p) { return *p; }
  static inline void store(float* p, float v) { *p = v; }
  static inline float round(float v) { return v; }
};
template <> struct Elem<uint16_t> {
  static inline float load(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline void store(uint16_t* p, float v) { *p = f32_to_bf16(v); }
  static inline float round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
};

// exp by 2^(x log2 e) with a degree-6 polynomial for the fraction: plain
// arithmetic, so loops over it vectorize (libm's expf does not here);
// relative error about 2e-7.
inline float fast_exp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

template <typename F>
void dispatch(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "cpukernels: bfloat16 or float32 only, got ", t.scalar_type());
    f(float{});
  }
}

template <typename T>
inline T* ptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T>
inline const T* cptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }

// rows per task: small batches stay on one thread (a fork costs more than the work)
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

}  // namespace

// ---- paged attention ----------------------------------------------------------------
// q [T, Hq, D]: the tokens of B sequences, sequence b's rows query_start_loc[b] to
// query_start_loc[b + 1], at the last positions of its context of seq_lens[b]
// tokens (a decode row, a speculative verification's k + 1 rows, or a prefill
// chunk after any cached prefix); pages [Hkv, N, page_size, D] (V: Dv);
// block_tables [B, max_pages] int32. Each row attends causally over its
// sequence's pages (the last `window` positions when window > 0).
//
// Batch-invariant by construction: a row's result is a function of its own
// query, its position and its keys, never of the other rows, the page size,
// the chunking or the threads. Keys go in blocks of W tokens (16 with AVX-512,
// else 8) at fixed absolute positions (block j holds positions jW..jW+W-1, read
// across page boundaries); a score is a dot product in a fixed order; the
// softmax sum adds the blocks' exponentials lane-wise in block order and then
// the W lanes in a fixed tree; the weighted sum of V adds one block at a time in
// the same order. Positions outside a row's range inside one of its blocks get
// probability 0 (an exact no-op in the sums). Work items are (tile of up to
// `tile` consecutive rows of one sequence, KV head): no reduction is split
// across threads, and rows of a tile only share the loads of each K and V block
// (the group's query heads and the tile's rows all read it from L1).
//
// The block code is one function per (vector type, dtype), never inlined, so
// every caller (decode, verification, prefill, the fused qkv op) runs the same
// instructions. With AVX-512 or AVX2+FMA and D, Dv multiples of the vector width
// it uses those registers; otherwise a portable 8-wide vector of plain floats
// (D, Dv multiples of 8). The queries come in as float32, already scaled.
namespace {

#if defined(__AVX512F__)
struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static constexpr bool native = true;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm512_set1_ps(x); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static inline R max(R a, R b) { return _mm512_max_ps(a, b); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline R clamp(R x, float lo, float hi) { return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x)); }
  static inline R floor(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static inline R pow2(R fi) {  // 2^fi for integral fi in [-127, 128)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23));
  }
  // out[t] = sum of the lanes of a[t], t < 16: a tree of 128-bit and in-lane shuffles
  static inline void reduce(const R* a, float* out) {
    R r[8], u[4];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j)  // quarter k of u[j]: token 4j + k
      u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0xDD));
    const R s0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    const R s1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x88), _mm512_shuffle_ps(u[2], u[3], 0xDD));
    const R s = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x88), _mm512_shuffle_ps(s0, s1, 0xDD));
    // lane 4k + m holds token 4m + k
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, s));
  }
};
#define PLINTH_VEC_ATTENTION 1
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static constexpr bool native = true;
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm256_set1_ps(x); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static inline R max(R a, R b) { return _mm256_max_ps(a, b); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline R clamp(R x, float lo, float hi) { return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x)); }
  static inline R floor(R x) { return _mm256_floor_ps(x); }
  static inline R pow2(R fi) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23));
  }
  static inline void reduce(const R* a, float* out) {  // out[t] = sum of the lanes of a[t], t < 8
    const R t01 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const R t23 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t01, t23, 0x20), _mm256_permute2f128_ps(t01, t23, 0x31)));
  }
};
#define PLINTH_VEC_ATTENTION 1
#endif

// 8 plain floats: the same algorithm where there is no AVX2 (or the head size
// is no multiple of the native width); the compiler maps it to what it has
struct Vec8 {
  struct R {
    float v[8];
  };
  static constexpr int W = 8;
  static constexpr bool native = false;
  static inline R zero() { return R{}; }
  static inline R load(const float* p) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static inline R load(const uint16_t* p) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = bf16_to_f32(p[i]);
    return r;
  }
  static inline void store(float* p, R a) {
    for (int i = 0; i < 8; ++i) p[i] = a.v[i];
  }
  static inline R set1(float x) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = x;
    return r;
  }
#define PLINTH_VEC8_OP(name, expr)          \
  static inline R name(R a, R b) {          \
    R r;                                    \
    for (int i = 0; i < 8; ++i) r.v[i] = expr; \
    return r;                               \
  }
  PLINTH_VEC8_OP(add, a.v[i] + b.v[i])
  PLINTH_VEC8_OP(sub, a.v[i] - b.v[i])
  PLINTH_VEC8_OP(max, std::max(a.v[i], b.v[i]))
  PLINTH_VEC8_OP(mul, a.v[i] * b.v[i])
#undef PLINTH_VEC8_OP
  static inline R fma(R a, R b, R c) {
    R r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static inline R clamp(R x, float lo, float hi) {
    for (int i = 0; i < 8; ++i) x.v[i] = std::min(hi, std::max(lo, x.v[i]));
    return x;
  }
  static inline R floor(R x) {
    for (int i = 0; i < 8; ++i) x.v[i] = std::floor(x.v[i]);
    return x;
  }
  static inline R pow2(R fi) {
    R r;
    for (int i = 0; i < 8; ++i) {
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  static inline void reduce(const R* a, float* out) {  // a fixed tree per token
    for (int t = 0; t < 8; ++t) {
      const float* x = a[t].v;
      out[t] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
    }
  }
};

// fast_exp's polynomial on a whole vector (every lane by the same instructions)
template <class V>
inline typename V::R vexp(typename V::R x) {
  x = V::clamp(x, -87.0f, 88.0f);
  const auto t = V::mul(x, V::set1(1.4426950408889634f));
  const auto fi = V::floor(t);
  const auto f = V::sub(t, fi);
  auto p = V::set1(1.535336188319500e-4f);
  p = V::fma(p, f, V::set1(1.339887440266574e-3f));
  p = V::fma(p, f, V::set1(9.618437357674640e-3f));
  p = V::fma(p, f, V::set1(5.550332471162809e-2f));
  p = V::fma(p, f, V::set1(2.402264791363012e-1f));
  p = V::fma(p, f, V::set1(6.931472028550421e-1f));
  p = V::fma(p, f, V::set1(1.0f));
  return V::mul(p, V::pow2(fi));
}

// rows[t] = the page row (page * ps + offset) of position pos + t, t < m:
// one division per block, not one per token
inline void block_rows(const int32_t* table, int64_t pos, int64_t m, int64_t ps, int64_t* rows) {
  int64_t page = pos / ps, off = pos % ps;
  for (int64_t t = 0; t < m; ++t) {
    rows[t] = static_cast<int64_t>(table[page]) * ps + off;
    if (++off == ps) {
      off = 0;
      ++page;
    }
  }
}

// a row of `bytes` (its lines) into L2
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) plinth::prefetch_l2(c + i);
}

// the rows (D elements each) of the n <= 16 positions from blk (none at or past
// last) prefetched from pages in no order: a block's K rows, ahead of use
template <typename T>
inline void prefetch_block(const T* base, const int32_t* table, int64_t blk, int64_t n, int64_t last, int64_t ps,
                           int64_t D) {
  if (blk >= last) return;
  int64_t rows[16];
  const int64_t m = std::min(n, last - blk);
  block_rows(table, blk, m, ps, rows);
  for (int64_t t = 0; t < m; ++t) prefetch_row(base + rows[t] * D, D * sizeof(T));
}

// Softmax of each query i < NQ (row i / G) over its own blocks of scores
// [NQ][span] (position first + j at column j; first a multiple of W): max
// (exact in any order), the exponentials (0 outside [lo, hi)), their sum
// block by block, lane-wise, then across the lanes in a fixed tree. Columns
// outside the row's blocks are left as they are.
template <class V>
inline void softmax_rows(float* scores, int64_t span, int64_t first, const int64_t* lo, const int64_t* hi,
                         int64_t NQ, int64_t G) {
  using Reg = typename V::R;
  constexpr int W = V::W;
  for (int64_t i = 0; i < NQ; ++i) {
    const int64_t r = i / G, b0 = lo[r] / W * W - first, b1 = (hi[r] - first + W - 1) / W * W;
    const int64_t vlo = lo[r] - first, vhi = hi[r] - first;
    float* s = scores + i * span;
    // the max (exact in any order): whole blocks lane-wise, the edges' partial blocks by scalars
    float mx = -std::numeric_limits<float>::max();
    Reg vmx = V::set1(mx);
    for (int64_t j = b0; j < b1; j += W) {
      if (j >= vlo && j + W <= vhi) {
        vmx = V::max(vmx, V::load(s + j));
      } else {
        for (int64_t t = std::max(j, vlo); t < std::min(j + W, vhi); ++t) mx = std::max(mx, s[t]);
      }
    }
    {
      float lanes[W];
      V::store(lanes, vmx);
      for (int k = 0; k < W; ++k) mx = std::max(mx, lanes[k]);
    }
    Reg sum = V::zero();
    const Reg vm = V::set1(mx);
    for (int64_t j = b0; j < b1; j += W) {
      V::store(s + j, vexp<V>(V::sub(V::load(s + j), vm)));
      if (j < vlo || j + W > vhi)
        for (int64_t t = j; t < j + W; ++t)
          if (t < vlo || t >= vhi) s[t] = 0.f;
      sum = V::add(sum, V::load(s + j));
    }
    float lanes[W], total;
    V::store(lanes, sum);
    if constexpr (W == 16) {
      float h8[8];
      for (int k = 0; k < 8; ++k) h8[k] = lanes[k] + lanes[k + 8];
      total = ((h8[0] + h8[4]) + (h8[2] + h8[6])) + ((h8[1] + h8[5]) + (h8[3] + h8[7]));
    } else {
      total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    }
    const Reg inv = V::set1(1.f / total);
    for (int64_t j = b0; j < b1; j += W) V::store(s + j, V::mul(V::load(s + j), inv));
  }
}

#if defined(__AVX512F__)
// f32_to_bf16 on 16 lanes (the same integer rounding), in the low halves of the dwords
inline __m512i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
}

// x (n floats, n % 16 == 0) -> hi + lo, two bf16 parts (hi = bf16(x), lo =
// bf16(x - hi)): a float's value to 16 significant bits, each part's product
// with a bf16 exact. Returns whether any lo part is nonzero.
inline bool split_bf16(const float* x, uint16_t* hi, uint16_t* lo, int64_t n) {
  __m512i any = _mm512_setzero_si512();
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 xv = _mm512_loadu_ps(x + d);
    const __m512i hv = round_bf16(xv);
    const __m512i lv = round_bf16(_mm512_sub_ps(xv, _mm512_castsi512_ps(_mm512_slli_epi32(hv, 16))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + d), _mm512_cvtepi32_epi16(hv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + d), _mm512_cvtepi32_epi16(lv));
    any = _mm512_or_si512(any, _mm512_and_si512(lv, _mm512_set1_epi32(0x7FFF)));
  }
  return _mm512_reduce_or_epi32(any) != 0;
}
#endif

// per-thread scratch of the block code
struct AttendScratch {
  std::vector<float> scores, kbuf, acc;
  std::vector<uint16_t> qbf, pbf, kt, vt;
  int tile_rows = 0;  // the AMX tile configuration this task loaded (0: none yet)
};

// One tile: rows r < R of one sequence and KV head. Row r's G query heads are
// qf + r * qs (G x D floats, scaled); it attends positions [lo[r], hi[r]) and
// writes G x Dv to out + r * os. zrow: max(D, Dv) zeros.
template <class V, typename T>
__attribute__((noinline)) void attend_tile(const float* qf, int64_t qs, T* out, int64_t os, const T* kp, const T* vp,
                                           const int32_t* table, const int64_t* lo, const int64_t* hi, int64_t R,
                                           int64_t G, int64_t D, int64_t Dv, int64_t ps, AttendScratch& sc,
                                           const T* zrow) {
  using Reg = typename V::R;
  constexpr int W = V::W;
  int64_t first = hi[0], last = 0;
  for (int64_t r = 0; r < R; ++r) {
    first = std::min(first, lo[r] / W * W);
    last = std::max(last, hi[r]);
  }
  const int64_t span = (last - first + W - 1) / W * W, NQ = R * G, DC = D / W, DVC = Dv / W;
  sc.scores.resize(NQ * span);
  sc.acc.assign(NQ * Dv, 0.f);
  sc.kbuf.resize(W * D);
  float* scores = sc.scores.data();
  float* kbuf = sc.kbuf.data();
  float* acc = sc.acc.data();
  int64_t krows[W];
  auto in_block = [&](int64_t r, int64_t blk) { return blk < hi[r] && blk + W > lo[r]; };
  // scores: a block of W K rows at a time, every query of the tile against it.
  // float32 rows are read in place; bfloat16 rows with AVX512-BF16 too, by dot
  // products of bf16 pairs against the query split in two bf16 parts (hi + lo:
  // the query's float32 value to 16 bits, each product exact; a zero lo part
  // adds exact zeros, so skipping it when the tile has none changes nothing);
  // otherwise the block's rows are converted to float32 once, into kbuf.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const bool dot = V::native && std::is_same<T, uint16_t>::value && D % 32 == 0;
  bool lo_parts = false;
  if (dot) {
    sc.qbf.resize(2 * NQ * D);
    for (int64_t i = 0; i < NQ; ++i) {  // qbf: [query][hi: D][lo: D]
      const float* x = qf + (i / G) * qs + (i % G) * D;
      uint16_t* h = sc.qbf.data() + 2 * i * D;
      uint16_t* l = h + D;
      lo_parts |= split_bf16(x, h, l, D);
    }
  }
#else
  const bool dot = false;
#endif
  const bool direct = std::is_same<T, float>::value || dot;
  const T* kr[W];
  auto prefetch_k = [&](int64_t blk) { prefetch_block(kp, table, blk, W, last, ps, D); };
  for (int64_t blk = first; blk < last; blk += W) {
    const int64_t m = std::min<int64_t>(W, last - blk);
    block_rows(table, blk, m, ps, krows);
    if (direct) {
      for (int64_t t = 0; t < W; ++t) kr[t] = t < m ? kp + krows[t] * D : zrow;
    } else {
      for (int64_t t = 0; t < m; ++t) {
        const T* k = kp + krows[t] * D;
        float* kb = kbuf + t * D;
        for (int64_t c = 0; c < DC; ++c) V::store(kb + c * W, V::load(k + c * W));
      }
      for (int64_t t = m; t < W; ++t) std::memset(kbuf + t * D, 0, D * sizeof(float));
    }
    // K rows two blocks ahead (the first block also starts the second's), from
    // pages in no order, and this block's V rows for the weighted sum, into L2.
    // Cold pages, 16 decode rows, 30 layers, one thread (Zen 4): 18.2 ms with
    // none, 15.5 with these into L1 (a block's K and V lines stall L1's miss
    // buffers), 6.4 into L2 (hot pages: 4.3); 2 to 6 blocks ahead alike
    if (blk == first) prefetch_k(blk + W);
    prefetch_k(blk + 2 * W);
    for (int64_t t = 0; t < m; ++t) prefetch_row(vp + krows[t] * Dv, Dv * sizeof(T));
    for (int64_t i = 0; i < NQ; ++i) {
      if (!in_block(i / G, blk)) continue;
      float* dst = scores + i * span + (blk - first);
      Reg a[W];
      for (int t = 0; t < W; ++t) a[t] = V::zero();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (V::native) {
        if (dot) {
          const uint16_t* qh = sc.qbf.data() + 2 * i * D;
          for (int64_t c = 0; c < D; c += 32) {
            const __m512bh h = (__m512bh)_mm512_loadu_si512(qh + c);
            const __m512bh l = (__m512bh)_mm512_loadu_si512(qh + D + c);
            if (lo_parts) {
              for (int t = 0; t < W; ++t) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(kr[t]) + c);
                a[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[t], h, kv), l, kv);
              }
            } else {
              for (int t = 0; t < W; ++t)
                a[t] = _mm512_dpbf16_ps(a[t], h, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(kr[t]) + c));
            }
          }
          V::reduce(a, dst);
          continue;
        }
      }
#endif
      const float* qg = qf + (i / G) * qs + (i % G) * D;
      if (direct) {
        for (int64_t c = 0; c < DC; ++c) {
          const Reg qc = V::load(qg + c * W);
          for (int t = 0; t < W; ++t) a[t] = V::fma(qc, V::load(kr[t] + c * W), a[t]);
        }
      } else {
        for (int64_t c = 0; c < DC; ++c) {
          const Reg qc = V::load(qg + c * W);
          const float* kb = kbuf + c * W;
          for (int t = 0; t < W; ++t) a[t] = V::fma(qc, V::load(kb + t * D), a[t]);
        }
      }
      V::reduce(a, dst);
    }
  }
  softmax_rows<V>(scores, span, first, lo, hi, NQ, G);
  // weighted sum of V, block by block: each chunk of the block's V rows loaded
  // once for every query of the tile
  const T* rows[W];
  for (int64_t blk = first; blk < last; blk += W) {
    const int64_t m = std::min<int64_t>(W, last - blk);
    block_rows(table, blk, m, ps, krows);
    for (int64_t t = 0; t < W; ++t) rows[t] = t < m ? vp + krows[t] * Dv : zrow;
    for (int64_t c = 0; c < DVC; ++c) {
      Reg v[W];
      for (int t = 0; t < W; ++t) v[t] = V::load(rows[t] + c * W);
      for (int64_t i = 0; i < NQ; ++i) {
        if (!in_block(i / G, blk)) continue;
        const float* p = scores + i * span + (blk - first);
        Reg a0 = V::mul(V::set1(p[0]), v[0]), a1 = V::mul(V::set1(p[1]), v[1]);
        Reg a2 = V::mul(V::set1(p[2]), v[2]), a3 = V::mul(V::set1(p[3]), v[3]);
        for (int t = 4; t < W; t += 4) {
          a0 = V::fma(V::set1(p[t]), v[t], a0);
          a1 = V::fma(V::set1(p[t + 1]), v[t + 1], a1);
          a2 = V::fma(V::set1(p[t + 2]), v[t + 2], a2);
          a3 = V::fma(V::set1(p[t + 3]), v[t + 3], a3);
        }
        float* o = acc + i * Dv + c * W;
        V::store(o, V::add(V::load(o), V::add(V::add(a0, a1), V::add(a2, a3))));
      }
    }
  }
  for (int64_t i = 0; i < NQ; ++i) {
    T* o = out + (i / G) * os + (i % G) * Dv;
    for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(o + d, acc[i * Dv + d]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PLINTH_AMX_ATTENTION 1
// ---- the block code on AMX tiles (bfloat16 pages, D % 32 == 0, Dv % 16 == 0) ----
// The same blocks, softmax and batch invariance as attend_tile, with both
// products on TDPBF16PS: a C element is summed from its own A row and B
// column in an order the instruction fixes, whatever the other rows (the
// argument of the linears' AMX kernel), so a row's bits never depend on the
// tile's other rows or on how many there are. Scores: C [queries x 16 keys]
// += the query's hi part x K^T, then its lo part x K^T (K^T: the block's
// rows transposed into pair lines), chunk by chunk of 32 features. Weighted
// sum: C [queries x 16 features] += P hi x V, then P lo x V (P, normalized,
// split in two bf16 parts like the query; V: pairs of rows interleaved), 32
// keys at a time at absolute positions that are multiples of 32, so zero
// probabilities outside a row's range sit in the same places for every tile.
// Not bit-identical to attend_tile (other orders): a process takes one of the
// two for every call (set_amx_attention).
// tiles 0-3: C, 4: A (hi part), 5: A (lo part), rows each; 6-7: B, 16 pair lines
inline void attention_tiles_configure(int rows) {
  plinth::TileConfig cfg;
  for (int t = 0; t < 6; ++t) { cfg.rows[t] = uint8_t(rows); cfg.colsb[t] = 64; }
  for (int t = 6; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  plinth::load_tile_config(cfg);
}

// C tiles 0..NE-1 += A (4: hi, 5: lo when lo) times the B tiles at b, b + bs, ... (elements)
template <int NE>
inline void amx_pair_dots(const uint16_t* b, int64_t bs, bool lo) {
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(0, 4, 6);
  if (lo) _tile_dpbf16ps(0, 5, 6);
  if constexpr (NE > 1) {
    _tile_loadd(7, b + bs, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (lo) _tile_dpbf16ps(1, 5, 7);
  }
  if constexpr (NE > 2) {
    _tile_loadd(6, b + 2 * bs, 64);
    _tile_dpbf16ps(2, 4, 6);
    if (lo) _tile_dpbf16ps(2, 5, 6);
  }
  if constexpr (NE > 3) {
    _tile_loadd(7, b + 3 * bs, 64);
    _tile_dpbf16ps(3, 4, 7);
    if (lo) _tile_dpbf16ps(3, 5, 7);
  }
}

// f(std::integral_constant<int, n>) for n in 1..4
template <typename F>
inline void with_tiles(int n, F&& f) {
  if (n >= 4) f(std::integral_constant<int, 4>{});
  else if (n == 3) f(std::integral_constant<int, 3>{});
  else if (n == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

template <int NE>
inline void amx_c_start(const float* c, int64_t ldc_bytes, bool zero) {
  if (zero) {
    _tile_zero(0);
    if constexpr (NE > 1) _tile_zero(1);
    if constexpr (NE > 2) _tile_zero(2);
    if constexpr (NE > 3) _tile_zero(3);
  } else {
    _tile_loadd(0, c, ldc_bytes);
    if constexpr (NE > 1) _tile_loadd(1, c + 16, ldc_bytes);
    if constexpr (NE > 2) _tile_loadd(2, c + 32, ldc_bytes);
    if constexpr (NE > 3) _tile_loadd(3, c + 48, ldc_bytes);
  }
}

template <int NE>
inline void amx_c_store(float* c, int64_t ldc_bytes) {
  _tile_stored(0, c, ldc_bytes);
  if constexpr (NE > 1) _tile_stored(1, c + 16, ldc_bytes);
  if constexpr (NE > 2) _tile_stored(2, c + 32, ldc_bytes);
  if constexpr (NE > 3) _tile_stored(3, c + 48, ldc_bytes);
}

// keys per pass: their K^T and V pair lines are staged once per pass
constexpr int64_t AMX_KEYS_PER_PASS = 256;

// attend_tile's contract, on tiles
__attribute__((noinline)) void attend_tile_amx(const float* qf, int64_t qs, uint16_t* out, int64_t os,
                                               const uint16_t* kp, const uint16_t* vp, const int32_t* table,
                                               const int64_t* lo, const int64_t* hi, int64_t R, int64_t G, int64_t D,
                                               int64_t Dv, int64_t ps, AttendScratch& sc, const uint16_t* zrow) {
  constexpr int64_t KB = 16, PB = 32;  // keys per score block, per weighted-sum step
  int64_t first = hi[0], last = 0;
  for (int64_t r = 0; r < R; ++r) {
    first = std::min(first, lo[r] / PB * PB);
    last = std::max(last, hi[r]);
  }
  const int64_t NQ = R * G, NQP = NQ <= 16 ? NQ : (NQ + 15) / 16 * 16, NG = (NQP + 15) / 16;
  const int64_t span = (last - first + PB - 1) / PB * PB, DC = D / 32, DE = Dv / 16;
  // loaded once per task and row count (a few hundred cycles); nothing else
  // runs on this thread's tiles inside the task
  if (sc.tile_rows != int(std::min<int64_t>(16, NQP))) {
    sc.tile_rows = int(std::min<int64_t>(16, NQP));
    attention_tiles_configure(sc.tile_rows);
  }
  // the queries' hi and lo parts: qbf [hi: NQP x D][lo: NQP x D]
  sc.qbf.assign(2 * NQP * D, 0);
  uint16_t* qhi = sc.qbf.data();
  uint16_t* qlo = qhi + NQP * D;
  bool lo_parts = false;
  for (int64_t i = 0; i < NQ; ++i)
    lo_parts |= split_bf16(qf + (i / G) * qs + (i % G) * D, qhi + i * D, qlo + i * D, D);
  sc.scores.resize(NQP * span);
  sc.kt.resize(AMX_KEYS_PER_PASS / KB * DC * 512);
  float* scores = sc.scores.data();
  int64_t krows[PB];
  const uint16_t* kr[KB];
  auto prefetch_k = [&](int64_t blk) { prefetch_block(kp, table, blk, KB, last, ps, D); };
  // the block's K^T pair lines into kt (line j of chunk c: features 32c + 2j,
  // + 1 of the 16 keys); K rows two blocks ahead and the block's V rows
  // (for the weighted sum) prefetched into L2, from pages in no order (as in
  // attend_tile; not measured on AMX tiles)
  auto stage = [&](int64_t blk, uint16_t* kt) {
    const int64_t m = std::min<int64_t>(KB, last - blk);
    block_rows(table, blk, m, ps, krows);
    for (int64_t t = 0; t < KB; ++t) kr[t] = t < m ? kp + krows[t] * D : zrow;
    prefetch_k(blk + 2 * KB);
    for (int64_t t = 0; t < m; ++t) prefetch_row(vp + krows[t] * Dv, Dv * 2);
    for (int64_t c = 0; c < DC; ++c) {
      __m512 rows[16];
      for (int t = 0; t < 16; ++t) rows[t] = _mm512_loadu_ps(reinterpret_cast<const float*>(kr[t] + 32 * c));
      plinth::transpose_16x16(rows);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(kt + 512 * c + 32 * j), rows[j]);
    }
  };
  // a pass of keys is staged (vector loads and shuffles only, where the core
  // overlaps the cache misses of pages in no order), then its tiles run
  // (measured: staging each block just before its tiles left decode at
  // 0.64-0.83x the vector kernel's speed on pages out of cache)
  prefetch_k(first);
  prefetch_k(first + KB);
  for (int64_t k0 = first; k0 < last; k0 += AMX_KEYS_PER_PASS) {
    const int64_t k1 = std::min(last, k0 + AMX_KEYS_PER_PASS);
    for (int64_t blk = k0; blk < k1; blk += KB) stage(blk, sc.kt.data() + (blk - k0) / KB * DC * 512);
    // 4 blocks at a time on the 4 C tiles: independent accumulations keep the tile unit busy
    for (int64_t blk = k0; blk < k1; blk += 4 * KB) {
      const uint16_t* kt = sc.kt.data() + (blk - k0) / KB * DC * 512;
      for (int64_t g = 0; g < NG; ++g)
        with_tiles(int((std::min(k1, blk + 4 * KB) - blk + KB - 1) / KB), [&](auto tag) {
          constexpr int NB = decltype(tag)::value;
          amx_c_start<NB>(nullptr, 0, true);
          for (int64_t c = 0; c < DC; ++c) {
            _tile_loadd(4, qhi + g * 16 * D + 32 * c, D * 2);
            if (lo_parts) _tile_loadd(5, qlo + g * 16 * D + 32 * c, D * 2);
            amx_pair_dots<NB>(kt + 512 * c, DC * 512, lo_parts);
          }
          amx_c_store<NB>(scores + g * 16 * span + (blk - first), span * 4);
        });
    }
  }
  softmax_rows<Vec>(scores, span, first, lo, hi, NQ, G);
  // P's hi and lo parts over the whole span, exact zeros outside each row's blocks
  sc.pbf.assign(2 * NQP * span, 0);
  uint16_t* phi = sc.pbf.data();
  uint16_t* plo = phi + NQP * span;
  for (int64_t i = 0; i < NQ; ++i) {
    const int64_t r = i / G, b0 = lo[r] / KB * KB - first, b1 = (hi[r] - first + KB - 1) / KB * KB;
    split_bf16(scores + i * span + b0, phi + i * span + b0, plo + i * span + b0, b1 - b0);
  }
  // the weighted sum, AMX_KEYS_PER_PASS keys a pass: their V pair lines
  // (vt [step][Dv / 16][16 lines][16 features][2]), then every query group
  // and 64 features on the 4 C tiles, carried across passes in acc
  sc.acc.resize(NQP * Dv);
  sc.vt.resize(AMX_KEYS_PER_PASS / PB * DE * 512);
  float* acc = sc.acc.data();
  uint16_t* vt = sc.vt.data();
  for (int64_t k0 = 0; k0 < span; k0 += AMX_KEYS_PER_PASS) {
    const int64_t steps = std::min(AMX_KEYS_PER_PASS, span - k0) / PB;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t pos = first + k0 + s * PB, m = std::max<int64_t>(0, std::min(PB, last - pos));
      if (m > 0) block_rows(table, pos, m, ps, krows);
      for (int64_t j = 0; j < 16; ++j) {
        const uint16_t* v0 = 2 * j < m ? vp + krows[2 * j] * Dv : zrow;
        const uint16_t* v1 = 2 * j + 1 < m ? vp + krows[2 * j + 1] * Dv : zrow;
        for (int64_t e = 0; e < DE; ++e) {
          const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * e)));
          const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * e)));
          _mm512_storeu_si512(vt + (s * DE + e) * 512 + 32 * j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
      }
    }
    for (int64_t g = 0; g < NG; ++g)
      for (int64_t e0 = 0; e0 < DE; e0 += 4) {
        float* c = acc + g * 16 * Dv + 16 * e0;
        with_tiles(int(DE - e0), [&](auto tag) {
          constexpr int NE = decltype(tag)::value;
          amx_c_start<NE>(c, Dv * 4, k0 == 0);
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, phi + g * 16 * span + k0 + s * PB, span * 2);
            _tile_loadd(5, plo + g * 16 * span + k0 + s * PB, span * 2);
            amx_pair_dots<NE>(vt + (s * DE + e0) * 512, 512, true);
          }
          amx_c_store<NE>(c, Dv * 4);
        });
      }
  }
  for (int64_t i = 0; i < NQ; ++i) {
    uint16_t* o = out + (i / G) * os + (i % G) * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = f32_to_bf16(acc[i * Dv + d]);
  }
}

#endif

// whether paged attention runs bf16 pages on AMX tiles (set_amx_attention)
bool amx_attention = false;

// query rows per tile of a prefill chunk: its rows share each K/V block's
// loads (on AMX tiles, also the K transposes and V pair lines: 16 rows)
constexpr int64_t ATTENTION_TILE_ROWS = 8, AMX_ATTENTION_TILE_ROWS = 16;

// every row of the batch (see above); qsl [B + 1], lens [B], tables [B, max_pages]
template <typename T>
void paged_attention_impl(const float* qf_all, const T* kp, const T* vp, T* op, const int32_t* tables,
                          const int64_t* qsl, const int32_t* lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                          int64_t Dv, int64_t N, int64_t ps, int64_t max_pages, int64_t window) {
  TORCH_CHECK(D % 8 == 0 && Dv % 8 == 0, "cpukernels attention: head sizes must be multiples of 8, got ", D, " and ", Dv);
  const int64_t G = Hq / Hkv;
  bool on_tiles = false;
#ifdef PLINTH_AMX_ATTENTION
  on_tiles = std::is_same<T, uint16_t>::value && amx_attention && D % 32 == 0 && Dv % 16 == 0;
#endif
  const int64_t tile_rows = on_tiles ? AMX_ATTENTION_TILE_ROWS : ATTENTION_TILE_ROWS;
  std::vector<int64_t> tiles;  // (sequence, first row, rows)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = qsl[b]; r < qsl[b + 1]; r += tile_rows)
      tiles.insert(tiles.end(), {b, r, std::min<int64_t>(tile_rows, qsl[b + 1] - r)});
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) / 3;
  // the position of a tile's first row (its sequence's rows end at the context's end)
  auto first_position = [&](const int64_t* tile) { return lens[tile[0]] - (qsl[tile[0] + 1] - tile[1]); };
  // the costliest tiles first (rows times the context they read), so the team
  // ends together: a prefill chunk's tiles beside a batch of decode rows
  std::vector<int64_t> order(num_tiles);
  std::vector<int64_t> cost(num_tiles);
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t* tile = tiles.data() + i * 3;
    const int64_t R = tile[2], end = first_position(tile) + R;  // one past the tile's last position
    cost[i] = R * (window > 0 ? std::min<int64_t>(end, window) : end);
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  plinth::parallel_take(num_tiles * Hkv, [&](auto&& take) {
    AttendScratch sc;
    std::vector<T> zrow(std::max(D, Dv), T{});
    int64_t lo[AMX_ATTENTION_TILE_ROWS], hi[AMX_ATTENTION_TILE_ROWS];
    for (int64_t idx; (idx = take()) >= 0;) {
      const int64_t* tile = tiles.data() + order[idx / Hkv] * 3;
      const int64_t b = tile[0], row = tile[1], R = tile[2], h = idx % Hkv;
      const int64_t first_pos = first_position(tile);
      for (int64_t r = 0; r < R; ++r) {
        hi[r] = first_pos + r + 1;
        lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window) : 0;
      }
      const float* qf = qf_all + (row * Hq + h * G) * D;
      T* out = op + (row * Hq + h * G) * Dv;
      const int32_t* table = tables + b * max_pages;
      const T* kh = kp + h * N * ps * D;
      const T* vh = vp + h * N * ps * Dv;
#ifdef PLINTH_AMX_ATTENTION
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (on_tiles) {
          attend_tile_amx(qf, Hq * D, out, Hq * Dv, kh, vh, table, lo, hi, R, G, D, Dv, ps, sc, zrow.data());
          continue;
        }
      }
#endif
#ifdef PLINTH_VEC_ATTENTION
      if (D % Vec::W == 0 && Dv % Vec::W == 0) {
        attend_tile<Vec, T>(qf, Hq * D, out, Hq * Dv, kh, vh, table, lo, hi, R, G, D, Dv, ps, sc, zrow.data());
        continue;
      }
#endif
      attend_tile<Vec8, T>(qf, Hq * D, out, Hq * Dv, kh, vh, table, lo, hi, R, G, D, Dv, ps, sc, zrow.data());
    }
#ifdef PLINTH_AMX_ATTENTION
    if (sc.tile_rows) plinth::release_tiles();  // this thread configured them (attend_tile_amx)
#endif
  });
}

// one head's rotary: x (D features, unit stride) -> y; the first R rotate
template <typename X, typename Y>
inline void rotate_head(const X* x, Y* y, const float* c, int64_t half, int64_t R, int64_t D, bool is_neox,
                        float mul) {
  const float* s = c + half;
  if (is_neox) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = Elem<X>::load(x + i), b = Elem<X>::load(x + i + half);
      Elem<Y>::store(y + i, Elem<X>::round(a * c[i] - b * s[i]) * mul);
      Elem<Y>::store(y + i + half, Elem<X>::round(b * c[i] + a * s[i]) * mul);
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = Elem<X>::load(x + 2 * i), b = Elem<X>::load(x + 2 * i + 1);
      Elem<Y>::store(y + 2 * i, Elem<X>::round(a * c[i] - b * s[i]) * mul);
      Elem<Y>::store(y + 2 * i + 1, Elem<X>::round(b * c[i] + a * s[i]) * mul);
    }
  }
  for (int64_t i = R; i < D; ++i) Elem<Y>::store(y + i, Elem<X>::load(x + i) * mul);
}

}  // namespace

namespace {
// query_start_loc as int64 on the host ([0, 1, ..., B] when undefined: one row per sequence)
std::vector<int64_t> query_starts(const c10::optional<torch::Tensor>& qsl, int64_t B, int64_t T) {
  std::vector<int64_t> out(B + 1);
  if (qsl.has_value() && qsl->defined()) {
    TORCH_CHECK(qsl->numel() == B + 1, "cpukernels: query_start_loc needs ", B + 1, " entries, got ", qsl->numel());
    auto t = qsl->to(torch::kInt64).contiguous();
    std::memcpy(out.data(), t.data_ptr<int64_t>(), (B + 1) * sizeof(int64_t));
  } else {
    for (int64_t b = 0; b <= B; ++b) out[b] = b;
  }
  TORCH_CHECK(out[0] == 0 && out[B] == T, "cpukernels: query_start_loc must run from 0 to the ", T, " query rows");
  return out;
}
}  // namespace

// q [T, Hq, D] -> [T, Hq, Dv]: every row over its sequence's pages (see paged_attention_impl)
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_tables,
                              c10::optional<torch::Tensor> query_start_loc, torch::Tensor seq_lens, double scale_d,
                              int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_pages.is_contiguous() && v_pages.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32);
  const int64_t T_ = q.size(0), Hq = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t Hkv = k_pages.size(0), N = k_pages.size(1), ps = k_pages.size(2), Dv = v_pages.size(3);
  const auto qsl = query_starts(query_start_loc, B, T_);
  auto tables_t = block_tables.contiguous();
  auto lens_t = seq_lens.contiguous();
  auto out = torch::empty({T_, Hq, Dv}, q.options());
  auto qf = torch::empty({T_, Hq, D}, q.options().dtype(torch::kFloat32));
  const float scale = static_cast<float>(scale_d);
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const T* qp = cptr<T>(q);
    float* qfp = qf.data_ptr<float>();
    for (int64_t i = 0; i < T_ * Hq * D; ++i) qfp[i] = Elem<T>::load(qp + i) * scale;  // as q.float() * scale
    paged_attention_impl<T>(qfp, cptr<T>(k_pages), cptr<T>(v_pages), ptr<T>(out), tables_t.data_ptr<int32_t>(),
                            qsl.data(), lens_t.data_ptr<int32_t>(), B, Hq, Hkv, D, Dv, N, ps, tables_t.size(1), window);
  });
  return out;
}

// one query row per sequence (block_tables and seq_lens per row)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale_d,
                                     int64_t window) {
  return paged_attention(q, k_pages, v_pages, block_tables, c10::nullopt, seq_lens, scale_d, window);
}

// ---- a step's attention block from the fused q/k/v projection ---------------------------
// qkv [T, (Hq + 2 Hkv) * D]; rotates q and k (positions [T] int64, cos_sin
// [max_pos, R] float32), writes k and v into the pages at slots [T] int64, then
// attends as paged_attention (query_start_loc [B + 1]; none: one row per
// sequence). Returns [T, Hq * D]. One call for what is otherwise a split, two
// rotary calls, two page writes and the attention (the rounding of q and k to
// the activation dtype is kept, so the result equals the unfused ops').
torch::Tensor paged_qkv_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin, bool is_neox,
                                  torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor slots,
                                  torch::Tensor block_tables, c10::optional<torch::Tensor> query_start_loc,
                                  torch::Tensor seq_lens, int64_t Hq, double scale_d, int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_pages.is_contiguous() && v_pages.is_contiguous());
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32);
  TORCH_CHECK(k_pages.scalar_type() == qkv.scalar_type() && v_pages.scalar_type() == qkv.scalar_type());
  const int64_t B = qkv.size(0), Hkv = k_pages.size(0), N = k_pages.size(1), ps = k_pages.size(2),
                D = k_pages.size(3);
  TORCH_CHECK(v_pages.size(3) == D && qkv.size(1) == (Hq + 2 * Hkv) * D, "cpukernels: qkv is not [B, (Hq + 2 Hkv) * D]");
  const int64_t R = cos_sin.size(1), half = R / 2, row_stride = qkv.stride(0), num_seqs = seq_lens.size(0);
  const auto qsl = query_starts(query_start_loc, num_seqs, B);
  auto pos_t = positions.to(torch::kInt64).contiguous();
  auto slots_t = slots.to(torch::kInt64).contiguous();
  auto tables_t = block_tables.contiguous();
  auto lens_t = seq_lens.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* slot = slots_t.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  const float scale = static_cast<float>(scale_d);
  auto qf = torch::empty({B, Hq, D}, qkv.options().dtype(torch::kFloat32));
  auto out = torch::empty({B, Hq * D}, qkv.options());
  dispatch(qkv, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(qkv);
    T* kp = ptr<T>(k_pages);
    T* vp = ptr<T>(v_pages);
    float* qfp = qf.data_ptr<float>();
    at::parallel_for(0, B, grain((Hq + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const T* row = xp + b * row_stride;
        const float* c = table + pos[b] * R;
        const int64_t page = slot[b] / ps, off = slot[b] % ps;
        for (int64_t h = 0; h < Hq; ++h) rotate_head<T, float>(row + h * D, qfp + (b * Hq + h) * D, c, half, R, D, is_neox, scale);
        for (int64_t h = 0; h < Hkv; ++h) {
          rotate_head<T, T>(row + (Hq + h) * D, kp + ((h * N + page) * ps + off) * D, c, half, R, D, is_neox, 1.f);
          std::memcpy(vp + ((h * N + page) * ps + off) * D, row + (Hq + Hkv + h) * D, D * sizeof(T));
        }
      }
    });
    paged_attention_impl<T>(qfp, kp, vp, ptr<T>(out), tables_t.data_ptr<int32_t>(), qsl.data(), lens_t.data_ptr<int32_t>(),
                            num_seqs, Hq, Hkv, D, D, N, ps, tables_t.size(1), window);
  });
  return out;
}

// ---- rms_norm, with the residual add fused ------------------------------------------
// x [..., H] contiguous; weight [H]. Returns [y] or, with a residual, [y, x + residual]
// (the sum rounded to x's dtype first, as the reference adds in that dtype).
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous());
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto y = torch::empty_like(x);
  torch::Tensor sum;
  const bool fused = residual.has_value();
  if (fused) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == x.scalar_type());
    sum = torch::empty_like(x);
  }
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    const T* rp = fused ? cptr<T>(*residual) : nullptr;
    T* sp = fused ? ptr<T>(sum) : nullptr;
    T* yp = ptr<T>(y);
    std::vector<float> wf(H);
    dispatch(weight, [&](auto wtag) {
      using W = decltype(wtag);
      const W* wp = cptr<W>(weight);
      for (int64_t i = 0; i < H; ++i) wf[i] = Elem<W>::load(wp + i);
    });
    at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
      std::vector<float> v(H);
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * H;
        float ss = 0.f;
        if (fused) {
          const T* rr = rp + r * H;
          T* sr = sp + r * H;
          for (int64_t i = 0; i < H; ++i) {
            const float s = Elem<T>::round(Elem<T>::load(xr + i) + Elem<T>::load(rr + i));
            Elem<T>::store(sr + i, s);
            v[i] = s;
            ss += s * s;
          }
        } else {
          for (int64_t i = 0; i < H; ++i) {
            v[i] = Elem<T>::load(xr + i);
            ss += v[i] * v[i];
          }
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
        T* yr = yp + r * H;
        for (int64_t i = 0; i < H; ++i) Elem<T>::store(yr + i, v[i] * inv * wf[i]);
      }
    });
  });
  if (fused) return {y, sum};
  return {y};
}

// ---- silu(x[..., :I]) * x[..., I:] -------------------------------------------------------
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous());
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto shape = x.sizes().vec();
  shape.back() = I;
  auto y = torch::empty(shape, x.options());
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* yp = ptr<T>(y);
    at::parallel_for(0, rows, grain(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = xp + r * 2 * I;
        const T* u = g + I;
        T* o = yp + r * I;
        for (int64_t i = 0; i < I; ++i) {
          const float a = Elem<T>::load(g + i);
          Elem<T>::store(o + i, a / (1.f + fast_exp(-a)) * Elem<T>::load(u + i));
        }
      }
    });
  });
  return y;
}

// ---- rotary embedding ----------------------------------------------------------------------
// x [T, H, D] (any strides with a unit last stride); positions [T] int64;
// cos_sin [max_pos, R] float32 (cos half, then sin half): the first R features
// of each head rotate, in halves (neox) or in even/odd pairs. Returns a new
// contiguous tensor.
torch::Tensor rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin, bool is_neox) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1);
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous());
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), R = cos_sin.size(1), half = R / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto pos_t = positions.to(torch::kInt64).contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  auto y = torch::empty({T_, H, D}, x.options());
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* yp = ptr<T>(y);
    at::parallel_for(0, T_, grain(H * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = table + pos[t] * R;
        const float* s = c + half;
        for (int64_t h = 0; h < H; ++h) {
          const T* xi = xp + t * s0 + h * s1;
          T* yo = yp + (t * H + h) * D;
          if (is_neox) {
            for (int64_t i = 0; i < half; ++i) {
              const float a = Elem<T>::load(xi + i), b = Elem<T>::load(xi + i + half);
              Elem<T>::store(yo + i, a * c[i] - b * s[i]);
              Elem<T>::store(yo + i + half, b * c[i] + a * s[i]);
            }
          } else {
            for (int64_t i = 0; i < half; ++i) {
              const float a = Elem<T>::load(xi + 2 * i), b = Elem<T>::load(xi + 2 * i + 1);
              Elem<T>::store(yo + 2 * i, a * c[i] - b * s[i]);
              Elem<T>::store(yo + 2 * i + 1, b * c[i] + a * s[i]);
            }
          }
          for (int64_t i = R; i < D; ++i) yo[i] = xi[i];
        }
      }
    });
  });
  return y;
}

// Paged attention on AMX tiles for bfloat16 pages (attend_tile_amx) when `on`
// and this build and the kernel allow it; returns whether it now does. One
// setting per process: the two paths round differently.
bool set_amx_attention(bool on) {
#if defined(PLINTH_AMX_ATTENTION)
  amx_attention = on && plinth::amx_granted();
#else
  (void)on;
#endif
  return amx_attention;
}

// parallel_take's schedule, for its tests: row i = (the team thread that took
// item i, how many times it was taken, its place in that thread's takes).
// Items below `slow` each sleep `slow_us` microseconds, so the other threads
// run out of their own items and take from that run.
torch::Tensor take_schedule(int64_t n, int64_t slow, int64_t slow_us) {
  auto out = torch::zeros({n, 3}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<std::atomic<int64_t>> times(n);
  plinth::parallel_take(n, [&](auto&& take) {
    const int64_t thread = at::get_thread_num();
    int64_t place = 0;
    for (int64_t i; (i = take()) >= 0;) {
      o[i * 3] = thread;
      o[i * 3 + 2] = place++;
      times[i].fetch_add(1);
      if (i < slow) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
    }
  });
  for (int64_t i = 0; i < n; ++i) o[i * 3 + 1] = times[i].load();
  return out;
}
