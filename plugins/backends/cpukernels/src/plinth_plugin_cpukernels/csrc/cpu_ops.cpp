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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// ---- paged decode attention --------------------------------------------------------
// q [B, Hq, D]; pages [Hkv, N, page_size, D] (V: Dv); block_tables [B, max_pages]
// int32; seq_lens [B] int32. For each (sequence, KV head): scores of the group's
// query heads over the context read straight from the pages, softmax, weighted
// sum of V. Every K and V row is read once; nothing is padded. The queries come
// in as float32, already scaled (the fused op below rotates them straight
// into that buffer).
//
// With AVX-512 or AVX2+FMA (and D, Dv multiples of the vector width) the
// context goes in blocks of W tokens (16 or 8): the block's K rows are
// converted to float32 once, each query head of the group keeps one
// accumulator per token (D/W FMAs each) and one transpose-reduce turns the W
// accumulators into W scores (instead of a horizontal sum per token); the
// weighted sum of V loads each V chunk of the block once for all the group's
// heads. Otherwise (no AVX, odd head sizes) the portable loops below.
namespace {

#if defined(__AVX512F__)
struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm512_set1_ps(x); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
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
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline R load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static inline R set1(float x) { return _mm256_set1_ps(x); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline void reduce(const R* a, float* out) {  // out[t] = sum of the lanes of a[t], t < 8
    const R t01 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const R t23 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t01, t23, 0x20), _mm256_permute2f128_ps(t01, t23, 0x31)));
  }
};
#define PLINTH_VEC_ATTENTION 1
#endif

// softmax over the n scores in place (the portable loops vectorize: fast_exp)
inline void softmax_inplace(float* sg, int64_t n) {
  float m = -std::numeric_limits<float>::max();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    sg[t] = fast_exp(sg[t] - m);
    sum += sg[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
}

#ifdef PLINTH_VEC_ATTENTION
// rows[t] = the page row (page * ps + offset) of position pos + t, t < m:
// one division per block, not one per token
inline int64_t block_rows(const int32_t* table, int64_t pos, int64_t m, int64_t ps, int64_t* rows) {
  int64_t page = pos / ps, off = pos % ps;
  for (int64_t t = 0; t < m; ++t) {
    rows[t] = static_cast<int64_t>(table[page]) * ps + off;
    if (++off == ps) {
      off = 0;
      ++page;
    }
  }
  return m;
}

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// one (sequence, KV head): qf [G, D] scaled queries; out [G, Dv] (stride Dv);
// scratch: scores G * npad, kbuf W * D, acc G * Dv floats, qbf 2 G D; zrow max(D, Dv) zeros.
template <typename T>
void attend_blocks(const float* qf, const T* kp, const T* vp, T* out, const int32_t* table, int64_t start,
                   int64_t n, int64_t G, int64_t D, int64_t Dv, int64_t ps, float* scores, float* kbuf, float* acc,
                   uint16_t* qbf, const T* zrow) {
  using R = Vec::R;
  constexpr int W = Vec::W;
  const int64_t npad = (n + W - 1) / W * W, DC = D / W, DVC = Dv / W;
  int64_t krows[W], nrows[W];
  // scores: a block of W K rows at a time, all the group's heads against it.
  // float32 rows are read in place; bfloat16 rows with AVX512-BF16 too, by
  // dot products of bf16 pairs against the query split in two bf16 parts
  // (hi + lo: the query's float32 value to 16 bits, each product exact);
  // otherwise the block's rows are converted to float32 once, into kbuf.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const bool dot = std::is_same<T, uint16_t>::value && D % 32 == 0;
  bool lo_parts = false;  // a bf16 query times a power-of-two scale (D = 64) has none
  if (dot) {
    for (int64_t g = 0; g < G; ++g) {  // qbf: [g][hi: D][lo: D]
      const float* x = qf + g * D;
      uint16_t* hi = qbf + 2 * g * D;
      uint16_t* lo = hi + D;
      uint16_t any_lo = 0;
      for (int64_t d = 0; d < D; ++d) {
        hi[d] = f32_to_bf16(x[d]);
        lo[d] = f32_to_bf16(x[d] - bf16_to_f32(hi[d]));
        any_lo |= lo[d] & 0x7FFF;
      }
      lo_parts |= any_lo != 0;
    }
  }
#else
  const bool dot = false;
#endif
  const bool direct = std::is_same<T, float>::value || dot;
  const T* kr[W];
  for (int64_t blk = 0; blk < n; blk += W) {
    const int64_t m = std::min<int64_t>(W, n - blk);
    block_rows(table, start + blk, m, ps, krows);
    if (direct) {
      for (int64_t t = 0; t < W; ++t) kr[t] = t < m ? kp + krows[t] * D : zrow;
    } else {
      for (int64_t t = 0; t < m; ++t) {
        const T* k = kp + krows[t] * D;
        float* kb = kbuf + t * D;
        for (int64_t c = 0; c < DC; ++c) Vec::store(kb + c * W, Vec::load(k + c * W));
      }
      for (int64_t t = m; t < W; ++t) std::memset(kbuf + t * D, 0, D * sizeof(float));
    }
    if (blk + W < n) {  // the next block's K rows and this block's V rows, from pages in no order
      const int64_t mn = block_rows(table, start + blk + W, std::min<int64_t>(W, n - blk - W), ps, nrows);
      for (int64_t t = 0; t < mn; ++t) prefetch_row(kp + nrows[t] * D, D * sizeof(T));
    }
    for (int64_t t = 0; t < m; ++t) prefetch_row(vp + krows[t] * Dv, Dv * sizeof(T));
    for (int64_t g = 0; g < G; ++g) {
      R a[W];
      for (int t = 0; t < W; ++t) a[t] = Vec::zero();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if (dot) {
        const uint16_t* qh = qbf + 2 * g * D;
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
        Vec::reduce(a, scores + g * npad + blk);
        continue;
      }
#endif
      const float* qg = qf + g * D;
      if (direct) {
        for (int64_t c = 0; c < DC; ++c) {
          const R qc = Vec::load(qg + c * W);
          for (int t = 0; t < W; ++t) a[t] = Vec::fma(qc, Vec::load(reinterpret_cast<const float*>(kr[t]) + c * W), a[t]);
        }
      } else {
        for (int64_t c = 0; c < DC; ++c) {
          const R qc = Vec::load(qg + c * W);
          const float* kb = kbuf + c * W;
          for (int t = 0; t < W; ++t) a[t] = Vec::fma(qc, Vec::load(kb + t * D), a[t]);
        }
      }
      Vec::reduce(a, scores + g * npad + blk);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * npad;
    softmax_inplace(sg, n);
    for (int64_t t = n; t < npad; ++t) sg[t] = 0.f;
  }
  // weighted sum of V: each chunk of the block's V rows loaded once for the group
  std::fill(acc, acc + G * Dv, 0.f);
  const T* rows[W];
  for (int64_t blk = 0; blk < n; blk += W) {
    const int64_t m = std::min<int64_t>(W, n - blk);
    block_rows(table, start + blk, m, ps, krows);
    for (int64_t t = 0; t < W; ++t) rows[t] = t < m ? vp + krows[t] * Dv : zrow;
    for (int64_t c = 0; c < DVC; ++c) {
      R v[W];
      for (int t = 0; t < W; ++t) v[t] = Vec::load(rows[t] + c * W);
      for (int64_t g = 0; g < G; ++g) {
        const float* p = scores + g * npad + blk;
        R a0 = Vec::mul(Vec::set1(p[0]), v[0]), a1 = Vec::mul(Vec::set1(p[1]), v[1]);
        R a2 = Vec::mul(Vec::set1(p[2]), v[2]), a3 = Vec::mul(Vec::set1(p[3]), v[3]);
        for (int t = 4; t < W; t += 4) {
          a0 = Vec::fma(Vec::set1(p[t]), v[t], a0);
          a1 = Vec::fma(Vec::set1(p[t + 1]), v[t + 1], a1);
          a2 = Vec::fma(Vec::set1(p[t + 2]), v[t + 2], a2);
          a3 = Vec::fma(Vec::set1(p[t + 3]), v[t + 3], a3);
        }
        float* o = acc + g * Dv + c * W;
        Vec::store(o, Vec::add(Vec::load(o), Vec::add(Vec::add(a0, a1), Vec::add(a2, a3))));
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(out + g * Dv + d, acc[g * Dv + d]);
}
#endif

template <typename T>
void decode_attention_impl(const float* qf_all, const T* kp, const T* vp, T* op, const int32_t* tables,
                           const int32_t* lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t N,
                           int64_t ps, int64_t max_pages, int64_t window) {
  const int64_t G = Hq / Hkv;
#ifdef PLINTH_VEC_ATTENTION
  if (D % Vec::W == 0 && Dv % Vec::W == 0) {
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, kbuf(Vec::W * D), acc(G * Dv);
      std::vector<T> zrow(std::max(D, Dv), T{});
      std::vector<uint16_t> qbf(2 * G * D);
      for (int64_t idx = begin; idx < end; ++idx) {
        const int64_t b = idx / Hkv, h = idx % Hkv;
        const int64_t L = lens[b];
        const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t n = L - start;
        scores.resize(G * ((n + Vec::W - 1) / Vec::W * Vec::W));
        attend_blocks<T>(qf_all + (b * Hq + h * G) * D, kp + h * N * ps * D, vp + h * N * ps * Dv,
                         op + (b * Hq + h * G) * Dv, tables + b * max_pages, start, n, G, D, Dv, ps, scores.data(),
                         kbuf.data(), acc.data(), qbf.data(), zrow.data());
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * Dv), row(std::max(D, Dv));
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const int64_t L = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      const int32_t* table = tables + b * max_pages;
      const float* qf = qf_all + (b * Hq + h * G) * D;
      scores.resize(G * n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const T* k = kp + ((h * N + table[pos / ps]) * ps + pos % ps) * D;
        float* r = row.data();
        for (int64_t d = 0; d < D; ++d) r[d] = Elem<T>::load(k + d);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * r[d];
          scores[g * n + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_inplace(scores.data() + g * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const T* v = vp + ((h * N + table[pos / ps]) * ps + pos % ps) * Dv;
        float* r = row.data();
        for (int64_t d = 0; d < Dv; ++d) r[d] = Elem<T>::load(v + d);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * Dv;
          for (int64_t d = 0; d < Dv; ++d) a[d] += p * r[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(op + (b * Hq + h * G + g) * Dv + d, acc[g * Dv + d]);
    }
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

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale_d,
                                     int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_pages.is_contiguous() && v_pages.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pages.size(0), N = k_pages.size(1), ps = k_pages.size(2), Dv = v_pages.size(3);
  auto tables_t = block_tables.contiguous();
  auto lens_t = seq_lens.contiguous();
  auto out = torch::empty({B, Hq, Dv}, q.options());
  auto qf = torch::empty({B, Hq, D}, q.options().dtype(torch::kFloat32));
  const float scale = static_cast<float>(scale_d);
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const T* qp = cptr<T>(q);
    float* qfp = qf.data_ptr<float>();
    for (int64_t i = 0; i < B * Hq * D; ++i) qfp[i] = Elem<T>::load(qp + i) * scale;  // as q.float() * scale
    decode_attention_impl<T>(qfp, cptr<T>(k_pages), cptr<T>(v_pages), ptr<T>(out),
                             tables_t.data_ptr<int32_t>(), lens_t.data_ptr<int32_t>(), B, Hq, Hkv, D, Dv, N, ps,
                             tables_t.size(1), window);
  });
  return out;
}

// ---- a decode step's attention block from the fused q/k/v projection --------------------
// qkv [B, (Hq + 2 Hkv) * D] (one token per sequence); rotates q and k (positions
// [B] int64, cos_sin [max_pos, R] float32), writes k and v into the pages at
// slots [B] int64, then attends as paged_decode_attention. Returns [B, Hq * D].
// One call for what is otherwise a split, two rotary calls, two page writes and
// the attention (the rounding of q and k to the activation dtype is kept, so
// the result equals the unfused ops').
torch::Tensor decode_qkv_attention(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin, bool is_neox,
                                   torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor slots,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, int64_t Hq, double scale_d,
                                   int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_pages.is_contiguous() && v_pages.is_contiguous());
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32);
  TORCH_CHECK(k_pages.scalar_type() == qkv.scalar_type() && v_pages.scalar_type() == qkv.scalar_type());
  const int64_t B = qkv.size(0), Hkv = k_pages.size(0), N = k_pages.size(1), ps = k_pages.size(2),
                D = k_pages.size(3);
  TORCH_CHECK(v_pages.size(3) == D && qkv.size(1) == (Hq + 2 * Hkv) * D, "cpukernels: qkv is not [B, (Hq + 2 Hkv) * D]");
  const int64_t R = cos_sin.size(1), half = R / 2, row_stride = qkv.stride(0);
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
    decode_attention_impl<T>(qfp, kp, vp, ptr<T>(out), tables_t.data_ptr<int32_t>(), lens_t.data_ptr<int32_t>(), B, Hq,
                             Hkv, D, D, N, ps, tables_t.size(1), window);
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
