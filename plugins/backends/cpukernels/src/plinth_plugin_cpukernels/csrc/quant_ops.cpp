// plinth cpukernels: linear layers on GGUF weights kept in their quantized blocks.
//
// As llama.cpp does it: each activation row is quantized to int8 (one scale per
// 32 values for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, per 256 for the K-quants, with the
// integer sums the weight offsets need), then every weight block is multiplied
// with integer dot products and scaled once per block. The weights are read once
// per call, in their file layout (rows of blocks), so a batch-1 step reads
// 4.5-8.5 bits a weight instead of 16 or 32.
//
// The activations are rounded by llama.cpp's own rules (ggml-cpu
// quantize_row_q8_0 / q8_1 / q8_K), so that the same file gives the same
// products: blocks of 32 take d = amax / 127 stored as float16 and
// q = round(x * (127 / amax)) (Q4_1/Q5_1's minimum term d * sum rounded to
// float16 too, q8_1's s); blocks of 256 take the signed value of largest
// magnitude, iscale = -127 / max, q = round(iscale * x), d = 1 / iscale. A
// tiny model (gemma-3-270m) turns one rounding step into another greedy token.
//
// The code path is chosen at COMPILE time from the -m flags the build passes
// (the instruction sets the accelerator reports, never -march=native):
//   __AVX512VNNI__ + __AVX512VL__: 256-bit vpdpbusd (u8 x s8 -> s32 in one step)
//   __AVXVNNI__:                   the same instruction, VEX-encoded
//   __AVX2__ + __FMA__:            vpmaddubsw + vpmaddwd
//   otherwise:                     portable scalar code (any CPU, aarch64 too)
// Weights are unpacked to unsigned bytes (4-, 5-, 6-bit values; Q8_0 offset by
// 128 on the VNNI paths) so one u8 x s8 product serves every format; the
// offsets (Q4_0's -8, Q6_K's -32, Q8_0's -128) are taken back exactly in
// integers from the activation block sums, the K-quant minimums in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define PLINTH_QUANT_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PLINTH_QUANT_VNNI 1
#define PLINTH_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define PLINTH_QUANT_PATH "avx512-vnni (256-bit vpdpbusd)"
#elif defined(__AVXVNNI__)
#define PLINTH_QUANT_VNNI 1
#define PLINTH_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define PLINTH_QUANT_PATH "avx-vnni (vpdpbusd)"
#else
#define PLINTH_QUANT_PATH "avx2+fma (vpmaddubsw)"
#endif
#else
#define PLINTH_QUANT_PATH "scalar"
#endif

namespace {

// format codes shared with quant.py
enum Format : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, Q5_0 = 6, Q5_1 = 7 };

struct Layout {
  int block;  // weights per block
  int bytes;  // bytes per block
};

inline Layout layout_of(int fmt) {
  switch (fmt) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
  }
  TORCH_CHECK(false, "cpukernels: unknown GGUF format code ", fmt);
}

inline bool is_k_quant(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K; }
// formats whose minimum multiplies the activation block sum (llama.cpp's q8_1 partner)
inline bool has_min_32(int fmt) { return fmt == Q4_1 || fmt == Q5_1; }

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// float -> float16 -> float, round to nearest even (ggml's conversion)
inline float round_f16(float f) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t w;
  std::memcpy(&w, &f, 4);
  const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
  float bias_f;
  std::memcpy(&bias_f, &bias_bits, 4);
  base = bias_f + base;
  uint32_t bits;
  std::memcpy(&bits, &base, 4);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return f16_to_f32(static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign)));
#endif
}

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

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

// the 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---- the activations, quantized ------------------------------------------------------
// Per row: int8 values; per block (32, or 256 for the K-quants) a float scale;
// integer sums per 32 (per 16 for the K-quants, Q8_K's bsums).
struct QuantizedActivations {
  int64_t K = 0, block = 32, sum_group = 32;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
  std::vector<float> ds;  // blocks of 32: d * float(sum) per block (the weight offsets' and minimums' term;
                          // rounded to float16 for Q4_1/Q5_1, as llama.cpp's q8_1 stores it)
  const int8_t* row_q(int64_t m) const { return q.data() + m * K; }
  const float* row_d(int64_t m) const { return d.data() + m * (K / block); }
  const int32_t* row_sums(int64_t m) const { return sums.data() + m * (K / sum_group); }
  const float* row_ds(int64_t m) const { return ds.data() + m * (K / block); }
};

template <typename T>
inline float load_act(const T* p);
template <>
inline float load_act<float>(const float* p) { return *p; }
template <>
inline float load_act<uint16_t>(const uint16_t* p) { return bf16_to_f32(*p); }

// llama.cpp's rules (see the top of the file); min_f16: the d * sum term as q8_1 rounds it
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t block, bool min_f16, QuantizedActivations& out) {
  out.K = K;
  out.block = block;
  out.sum_group = block == 256 ? 16 : 32;
  out.q.resize(M * K);
  out.d.resize(M * (K / block));
  out.sums.resize(M * (K / out.sum_group));
  out.ds.resize(block == 32 ? M * (K / block) : 0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < K; ++k) row[k] = load_act<T>(x + m * K + k);
      int8_t* q = out.q.data() + m * K;
      std::vector<float> d32(block == 32 ? K / 32 : 0);  // q8_1's unrounded d
      for (int64_t b = 0; b < K / block; ++b) {
        const float* v = row.data() + b * block;
        int8_t* qb = q + b * block;
        float amax = 0.f, max = 0.f;
        for (int64_t i = 0; i < block; ++i) {
          const float a = std::fabs(v[i]);
          if (a > amax) {
            amax = a;
            max = v[i];
          }
        }
        float d;
        if (block == 32) {  // quantize_row_q8_0 / q8_1
          d32[b] = amax / 127.f;
          d = round_f16(d32[b]);
          const float id = amax != 0.f ? 127.f / amax : 0.f;
          for (int64_t i = 0; i < block; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
        } else if (amax == 0.f) {  // quantize_row_q8_K_ref
          d = 0.f;
          std::memset(qb, 0, block);
        } else {
          const float iscale = -127.f / max;
          for (int64_t i = 0; i < block; ++i) qb[i] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * v[i])));
          d = 1.f / iscale;
        }
        out.d[m * (K / block) + b] = d;
      }
      int32_t* s = out.sums.data() + m * (K / out.sum_group);
      for (int64_t g = 0; g < K / out.sum_group; ++g) {
        int32_t acc = 0;
        for (int64_t i = 0; i < out.sum_group; ++i) acc += q[g * out.sum_group + i];
        s[g] = acc;
      }
      if (block == 32)
        for (int64_t b = 0; b < K / 32; ++b)
          out.ds[m * (K / 32) + b] = min_f16 ? round_f16(d32[b] * static_cast<float>(s[b])) : out.d[m * (K / 32) + b] * static_cast<float>(s[b]);
    }
  });
}

// ---- scalar unpacking (the portable path, and dequantization) ---------------------------
// Chunk j (32 weights) of a block as unsigned bytes u, with w = scale * (u - offset) + min
// (for Q6_K the scale differs between the chunk's two halves of 16).
struct Chunk {
  uint8_t u[32];
  float scale[2];  // values 0-15, 16-31
  int offset;      // subtracted from u (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q8_0: 128)
  float min;       // added (Q4_1/Q5_1: m, K-quants: -dmin * m_j)
};

inline void unpack_chunk(int fmt, const uint8_t* blk, int j, Chunk& c) {
  c.offset = 0;
  c.min = 0.f;
  switch (fmt) {
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = blk + (fmt == Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        c.u[i] = qs[i] & 0xF;
        c.u[i + 16] = qs[i] >> 4;
      }
      c.scale[0] = c.scale[1] = load_f16(blk);
      if (fmt == Q4_0) c.offset = 8;
      else c.min = load_f16(blk + 2);
      break;
    }
    case Q5_0:
    case Q5_1: {  // f16 d (Q5_1: then f16 m), 32 high bits, 16 bytes of nibbles; w = d * (u - 16) or d * u + m
      const int at = fmt == Q5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, blk + at, 4);
      const uint8_t* qs = blk + at + 4;
      for (int i = 0; i < 16; ++i) {
        c.u[i] = static_cast<uint8_t>((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
        c.u[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
      }
      c.scale[0] = c.scale[1] = load_f16(blk);
      if (fmt == Q5_0) c.offset = 16;
      else c.min = load_f16(blk + 2);
      break;
    }
    case Q8_0: {
      for (int i = 0; i < 32; ++i) c.u[i] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + i]) + 128);
      c.scale[0] = c.scale[1] = load_f16(blk);
      c.offset = 128;
      break;
    }
    case Q4_K:
    case Q5_K: {
      const float d = load_f16(blk), dmin = load_f16(blk + 2);
      int sc, m;
      scale_min_k4(j, blk + 4, &sc, &m);
      const uint8_t* qs = blk + (fmt == Q4_K ? 16 : 48) + 32 * (j / 2);
      const uint8_t* qh = blk + 16;
      for (int i = 0; i < 32; ++i) {
        uint8_t v = (j & 1) ? (qs[i] >> 4) : (qs[i] & 0xF);
        if (fmt == Q5_K && (qh[i] >> j) & 1) v |= 16;
        c.u[i] = v;
      }
      c.scale[0] = c.scale[1] = d * sc;
      c.min = -dmin * m;
      break;
    }
    case Q6_K: {
      const int h = j / 4, c4 = j % 4;
      const uint8_t* ql = blk + 64 * h + 32 * (c4 & 1);
      const uint8_t* qh = blk + 128 + 32 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * h + 2 * c4;
      const float d = load_f16(blk + 208);
      for (int i = 0; i < 32; ++i) {
        const uint8_t lo = c4 < 2 ? (ql[i] & 0xF) : (ql[i] >> 4);
        c.u[i] = lo | (((qh[i] >> (2 * c4)) & 3) << 4);
      }
      c.scale[0] = d * sc[0];
      c.scale[1] = d * sc[1];
      c.offset = 32;
      break;
    }
  }
}

// ---- one weight row . R activation rows -------------------------------------------------
// The activation rows are a.row_*(m0 .. m0 + R - 1); out[r] gets the dot product.

#if !defined(PLINTH_QUANT_SIMD)

// each row's order is the same for every R: INVARIANT changes nothing here
template <int R, bool INVARIANT = false>
void dot_rows(int fmt, const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const Layout L = layout_of(fmt);
  const int64_t K = a.K;
  float acc[R] = {};
  Chunk c;
  for (int64_t b = 0; b < K / L.block; ++b) {
    const uint8_t* blk = row + b * L.bytes;
    for (int j = 0; j < L.block / 32; ++j) {
      unpack_chunk(fmt, blk, j, c);
      const int64_t k0 = b * L.block + 32 * j;
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.row_q(m0 + r) + k0;
        int32_t lo = 0, hi = 0, sum = 0;
        for (int i = 0; i < 16; ++i) lo += static_cast<int32_t>(c.u[i]) * q[i];
        for (int i = 16; i < 32; ++i) hi += static_cast<int32_t>(c.u[i]) * q[i];
        for (int i = 0; i < 32; ++i) sum += q[i];
        // exact integer offsets; the sums could come from a.row_sums, recomputed here for clarity
        int32_t sum_lo = 0;
        for (int i = 0; i < 16; ++i) sum_lo += q[i];
        const float dq = a.row_d(m0 + r)[k0 / a.block];
        const float dot = c.scale[0] * static_cast<float>(lo - c.offset * sum_lo) +
                          c.scale[1] * static_cast<float>(hi - c.offset * (sum - sum_lo));
        // blocks of 32: the minimum times the activations' d * sum (float16 for q8_1's partners)
        const float min_term = a.block == 32 ? c.min * a.row_ds(m0 + r)[k0 / 32] : dq * c.min * static_cast<float>(sum);
        acc[r] += dq * dot + min_term;
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#else  // AVX2 (+ VNNI)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int32 lanes, lane i = sum over bytes 4i..4i+3 of u * s (u unsigned, s signed)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(PLINTH_QUANT_VNNI)
  return PLINTH_DPBUSD(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the same, each lane times the 16-bit scale of its half (lanes 0-3: sc_lo, 4-7: sc_hi)
inline __m256i dot_u8s8_scaled(__m256i u, __m256i s, int sc_lo, int sc_hi) {
#if defined(PLINTH_QUANT_VNNI)
  const __m256i scales = _mm256_set_m128i(_mm_set1_epi32(sc_hi), _mm_set1_epi32(sc_lo));
  return _mm256_mullo_epi32(PLINTH_DPBUSD(_mm256_setzero_si256(), u, s), scales);
#else
  const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(sc_hi)), _mm_set1_epi16(static_cast<int16_t>(sc_lo)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scales);
#endif
}

inline __m256i lane0(int32_t v) { return _mm256_setr_epi32(v, 0, 0, 0, 0, 0, 0, 0); }

// 16 bytes of nibbles -> 32 bytes: low nibbles first, then high ones
inline __m256i nibbles_32(const uint8_t* p) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q5_0 / Q5_1 block -> its 32 five-bit values as bytes: the nibbles (as
// nibbles_32), bit i of the 32-bit qh giving value i its 16
inline __m256i q5_values(const uint8_t* blk, bool with_min) {
  const int at = with_min ? 4 : 2;
  uint32_t qh;
  std::memcpy(&qh, blk + at, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(nibbles_32(blk + at + 4), _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// Q4_0 and Q4_1 for one or two rows, Q8_0: per block, the scale product dw * da broadcast
template <int R>
void dot_rows_q4_0_q4_1(bool with_min, const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const int bytes = with_min ? 20 : 18, qs_at = with_min ? 4 : 2;
  const int64_t nb = a.K / 32;
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    corr[r] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const __m256i u = nibbles_32(blk + qs_at);
    const float dw = load_f16(blk);
    const float mw = with_min ? load_f16(blk + 2) : 0.f;
    for (int r = 0; r < R; ++r) {
      const float da = a.row_d(m0 + r)[b];
      const int32_t sum = a.row_sums(m0 + r)[b];
      __m256i dot = dot_u8s8(u, load32(a.row_q(m0 + r) + 32 * b));
      if (!with_min) dot = _mm256_sub_epi32(dot, lane0(8 * sum));  // Q4_0 weights are u - 8
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * da), acc[r]);
      if (with_min) corr[r] += mw * a.row_ds(m0 + r)[b];  // q8_1's float16 d * sum
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

// Q5_0 (values u - 16) and Q5_1 (d * u + m, the minimum through the activations' float16 d * sum)
template <int R>
void dot_rows_q5(bool with_min, const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const int bytes = with_min ? 24 : 22;
  const int64_t nb = a.K / 32;
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    corr[r] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const __m256i u = q5_values(blk, with_min);
    const float dw = load_f16(blk);
    const float mw = with_min ? load_f16(blk + 2) : 0.f;
    for (int r = 0; r < R; ++r) {
      __m256i dot = dot_u8s8(u, load32(a.row_q(m0 + r) + 32 * b));
      if (!with_min) dot = _mm256_sub_epi32(dot, lane0(16 * a.row_sums(m0 + r)[b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * a.row_d(m0 + r)[b]), acc[r]);
      if (with_min) corr[r] += mw * a.row_ds(m0 + r)[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

template <int R>
void dot_rows_q8_0(const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const int64_t nb = a.K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const __m256i w = load32(blk + 2);
    const float dw = load_f16(blk);
#if defined(PLINTH_QUANT_VNNI)
    const __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
#else
    const __m256i u = _mm256_sign_epi8(w, w);  // |w|; the sign moves to the activations
#endif
    for (int r = 0; r < R; ++r) {
      const __m256i q = load32(a.row_q(m0 + r) + 32 * b);
#if defined(PLINTH_QUANT_VNNI)
      const __m256i dot = _mm256_sub_epi32(dot_u8s8(u, q), lane0(128 * a.row_sums(m0 + r)[b]));
#else
      const __m256i dot = dot_u8s8(u, _mm256_sign_epi8(q, w));
#endif
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * a.row_d(m0 + r)[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Q4_0 and Q4_1 from 3 rows (blocks of 32, one f16 scale each; Q4_1 an f16 minimum too).
// Per row and block: one activation load, the integer dot product, its
// conversion, a multiply by the block's weight scale (shared by the rows) and
// an fma with the row's activation scale broadcast from memory. The weight
// offset (Q4_0: -8) and Q4_1's minimum are a float term
// c_b * (d_a * sum_a) per block, taken 8 blocks at a time as one vector fma
// with the row's precomputed d_a * sum_a (QuantizedActivations::ds).
// P accumulators a row (blocks alternate between them) so that few rows
// do not wait on one chain of fma latencies; P fixes each row's summation
// order, so the batch-invariant mode passes one P for every R.
template <int R, int FMT, int P = (R == 1 ? 4 : R <= 4 ? 2 : 1)>
void dot_rows_32(const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  static_assert(FMT == Q4_0 || FMT == Q4_1, "dot_rows_32: Q4_0 or Q4_1");
  constexpr int bytes = FMT == Q4_0 ? 18 : 20;
  constexpr bool offset_term = true;
  const int64_t nb = a.K / 32;
  __m256 acc[R * P];
  for (int i = 0; i < R * P; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* q[R];
  const float* da[R];
  const float* ds[R];
  for (int r = 0; r < R; ++r) {
    q[r] = a.row_q(m0 + r);
    da[r] = a.row_d(m0 + r);
    ds[r] = a.row_ds(m0 + r);
  }
  alignas(32) float dw[8];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);  // blocks b0 .. b0 + n - 1
    // the 8 blocks' first 4 bytes (f16 d, then Q4_1's f16 m), masked lanes 0
    const __m256i head = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(row + b0 * bytes),
                                                      _mm256_mullo_epi32(lane, _mm256_set1_epi32(bytes)), mask, 1);
#if defined(__F16C__)
    const __m256i lohi = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(head, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(head, 16)), 0xD8);
    const __m256 dwv = _mm256_cvtph_ps(_mm256_castsi256_si128(lohi));
#else
    alignas(32) uint32_t h[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(h), head);
    alignas(32) float mf[8];
    for (int i = 0; i < 8; ++i) {
      dw[i] = f16_to_f32(static_cast<uint16_t>(h[i]));
      mf[i] = f16_to_f32(static_cast<uint16_t>(h[i] >> 16));
    }
    const __m256 dwv = _mm256_load_ps(dw);
#endif
    _mm256_store_ps(dw, dwv);
    if constexpr (offset_term) {
      __m256 c;
      if constexpr (FMT == Q4_1) {
#if defined(__F16C__)
        c = _mm256_cvtph_ps(_mm256_extracti128_si256(lohi, 1));
#else
        c = _mm256_load_ps(mf);
#endif
      } else {
        c = _mm256_mul_ps(dwv, _mm256_set1_ps(-8.f));
      }
      for (int r = 0; r < R; ++r) acc[r * P] = _mm256_fmadd_ps(c, _mm256_maskload_ps(ds[r] + b0, mask), acc[r * P]);
    }
    auto block = [&](int i, int slot) __attribute__((always_inline)) {
      const int64_t b = b0 + i;
      const uint8_t* blk = row + b * bytes;
      const __m256 scale = _mm256_broadcast_ss(dw + i);
      {
        const __m256i u = nibbles_32(blk + (FMT == Q4_0 ? 2 : 4));
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(u, load32(q[r] + 32 * b))), scale);
          acc[r * P + slot] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(da[r] + b), acc[r * P + slot]);
        }
      }
    };
    if (n == 8) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) block(i, i % P);
    } else {
      for (int i = 0; i < n; ++i) block(i, 0);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r * P];
    for (int p = 1; p < P; ++p) t = _mm256_add_ps(t, acc[r * P + p]);
    out[r] = hsum(t);
  }
}

// Q4_K and Q5_K: 8 chunks of 32 per super-block, 6-bit scales and minimums
template <int R>
void dot_rows_q45_k(bool five, const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const int bytes = five ? 176 : 144;
  const int64_t nsb = a.K / 256;
  __m256 acc[R];
  float corr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    corr[r] = 0.f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * bytes;
    const float d = load_f16(blk), dmin = load_f16(blk + 2);
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
    const uint8_t* qs = blk + (five ? 48 : 16);
    const __m256i qh = five ? load32(blk + 16) : _mm256_setzero_si256();
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i bytes32 = load32(qs + 32 * g);
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * g + half;
        __m256i u = half ? _mm256_and_si256(_mm256_srli_epi16(bytes32, 4), low4) : _mm256_and_si256(bytes32, low4);
        if (five) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
          u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i q = load32(a.row_q(m0 + r) + 256 * s + 32 * j);
          sumi[r] = _mm256_add_epi32(sumi[r], dot_u8s8_scaled(u, q, sc[j], sc[j]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float da = a.row_d(m0 + r)[s];
      const int32_t* bs = a.row_sums(m0 + r) + 16 * s;
      int32_t msum = 0;
      for (int j = 0; j < 8; ++j) msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * da), acc[r]);
      corr[r] -= dmin * da * static_cast<float>(msum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + corr[r];
}

// Q6_K: 16 signed 8-bit scales per super-block (one per 16 weights), values u - 32
template <int R>
void dot_rows_q6_k(const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  const int64_t nsb = a.K / 256;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(3);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = load_f16(blk + 208);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
      const __m256i qh = load32(blk + 128 + 32 * h);
      for (int c4 = 0; c4 < 4; ++c4) {
        const __m256i ql = (c4 & 1) ? ql1 : ql0;
        const __m256i lo = c4 < 2 ? _mm256_and_si256(ql, low4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4);
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c4), two_bits), 4);
        const __m256i u = _mm256_or_si256(lo, hi);
        const int j = 4 * h + c4, s_lo = sc[8 * h + 2 * c4], s_hi = sc[8 * h + 2 * c4 + 1];
        for (int r = 0; r < R; ++r) {
          const __m256i q = load32(a.row_q(m0 + r) + 256 * s + 32 * j);
          sumi[r] = _mm256_add_epi32(sumi[r], dot_u8s8_scaled(u, q, s_lo, s_hi));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t* bs = a.row_sums(m0 + r) + 16 * s;
      int32_t offset = 0;
      for (int i = 0; i < 16; ++i) offset += sc[i] * bs[i];
      const __m256i exact = _mm256_sub_epi32(sumi[r], lane0(32 * offset));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(d * a.row_d(m0 + r)[s]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// INVARIANT: every row summed in one order whatever R (Q4_0/Q4_1 through
// dot_rows_32 with P = 2, R <= 4); the other kernels' per-row order never
// depends on R.
template <int R, bool INVARIANT = false>
void dot_rows(int fmt, const uint8_t* row, const QuantizedActivations& a, int64_t m0, float* out) {
  switch (fmt) {
    // dot_rows_32 measured faster from 3 rows (SmolLM2-135M's Q4_1 shapes, one
    // thread), slower at 1-2 rows with K = 576 and for Q8_0 (its head) at every count
    case Q4_0:
      if constexpr (INVARIANT) return dot_rows_32<R, Q4_0, 2>(row, a, m0, out);
      else if constexpr (R >= 3) return dot_rows_32<R, Q4_0>(row, a, m0, out);
      else return dot_rows_q4_0_q4_1<R>(false, row, a, m0, out);
    case Q4_1:
      if constexpr (INVARIANT) return dot_rows_32<R, Q4_1, 2>(row, a, m0, out);
      else if constexpr (R >= 3) return dot_rows_32<R, Q4_1>(row, a, m0, out);
      else return dot_rows_q4_0_q4_1<R>(true, row, a, m0, out);
    case Q8_0: return dot_rows_q8_0<R>(row, a, m0, out);
    case Q5_0: return dot_rows_q5<R>(false, row, a, m0, out);
    case Q5_1: return dot_rows_q5<R>(true, row, a, m0, out);
    case Q4_K: if constexpr (R <= 4) return dot_rows_q45_k<R>(false, row, a, m0, out); break;
    case Q5_K: if constexpr (R <= 4) return dot_rows_q45_k<R>(true, row, a, m0, out); break;
    case Q6_K: if constexpr (R <= 4) return dot_rows_q6_k<R>(row, a, m0, out); break;
  }
}

#endif

// ---- dequantization (the GEMM path of large batches) ------------------------------------

#if defined(PLINTH_QUANT_SIMD)
// chunk j of a block as 32 unsigned bytes in a register, the rest as in Chunk
inline __m256i simd_chunk(int fmt, const uint8_t* blk, int j, Chunk& c) {
  c.offset = 0;
  c.min = 0.f;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  switch (fmt) {
    case Q4_0:
    case Q4_1:
      c.scale[0] = c.scale[1] = load_f16(blk);
      if (fmt == Q4_0) c.offset = 8;
      else c.min = load_f16(blk + 2);
      return nibbles_32(blk + (fmt == Q4_0 ? 2 : 4));
    case Q5_0:
    case Q5_1:
      c.scale[0] = c.scale[1] = load_f16(blk);
      if (fmt == Q5_0) c.offset = 16;
      else c.min = load_f16(blk + 2);
      return q5_values(blk, fmt == Q5_1);
    case Q8_0:
      c.scale[0] = c.scale[1] = load_f16(blk);
      c.offset = 128;
      return _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
    case Q4_K:
    case Q5_K: {
      int sc, m;
      scale_min_k4(j, blk + 4, &sc, &m);
      c.scale[0] = c.scale[1] = load_f16(blk) * sc;
      c.min = -load_f16(blk + 2) * m;
      const __m256i bytes32 = load32(blk + (fmt == Q4_K ? 16 : 48) + 32 * (j / 2));
      __m256i u = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(bytes32, 4), low4) : _mm256_and_si256(bytes32, low4);
      if (fmt == Q5_K) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(blk + 16), bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
      }
      return u;
    }
    default: {  // Q6_K
      const int h = j / 4, c4 = j % 4;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * h + 2 * c4;
      const float d = load_f16(blk + 208);
      c.scale[0] = d * sc[0];
      c.scale[1] = d * sc[1];
      c.offset = 32;
      const __m256i ql = load32(blk + 64 * h + 32 * (c4 & 1));
      const __m256i lo = c4 < 2 ? _mm256_and_si256(ql, low4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4);
      const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(blk + 128 + 32 * h), 2 * c4), _mm256_set1_epi8(3)), 4);
      return _mm256_or_si256(lo, hi);
    }
  }
}
#endif

// one row dequantized into float32 (T = float) or bfloat16 (T = uint16_t)
template <typename T>
void dequantize_row(int fmt, const uint8_t* row, int64_t K, T* out) {
  const Layout L = layout_of(fmt);
  Chunk c;
  for (int64_t b = 0; b < K / L.block; ++b) {
    const uint8_t* blk = row + b * L.bytes;
    for (int j = 0; j < L.block / 32; ++j) {
      T* o = out + b * L.block + 32 * j;
#if defined(PLINTH_QUANT_SIMD)
      const __m256i u8 = simd_chunk(fmt, blk, j, c);
      const __m128i halves[2] = {_mm256_castsi256_si128(u8), _mm256_extracti128_si256(u8, 1)};
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_set1_ps(c.scale[h]), shift = _mm256_set1_ps(c.min - c.scale[h] * c.offset);
        for (int e = 0; e < 2; ++e) {
          const __m256 u = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e ? _mm_srli_si128(halves[h], 8) : halves[h]));
          const __m256 v = _mm256_fmadd_ps(u, scale, shift);
          if constexpr (std::is_same_v<T, float>) {
            _mm256_storeu_ps(o + 16 * h + 8 * e, v);
          } else {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * h + 8 * e), (__m128i)_mm256_cvtneps_pbh(v));
#else  // round to nearest even, as f32_to_bf16
            const __m256i bits = _mm256_castps_si256(v);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
            const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * h + 8 * e), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
#endif
          }
        }
      }
#else
      unpack_chunk(fmt, blk, j, c);
      for (int i = 0; i < 32; ++i) {
        const float v = c.scale[i / 16] * static_cast<float>(static_cast<int>(c.u[i]) - c.offset) + c.min;
        if constexpr (std::is_same_v<T, float>) o[i] = v;
        else o[i] = f32_to_bf16(v);
      }
#endif
    }
  }
}

template <typename T>
inline void store_out(T* p, float v);
template <>
inline void store_out<float>(float* p, float v) { *p = v; }
template <>
inline void store_out<uint16_t>(uint16_t* p, float v) { *p = f32_to_bf16(v); }

}  // namespace

// ---- ops -------------------------------------------------------------------------------

// x [M, K] (float32 or bfloat16, contiguous) times the GGUF weight w: uint8 [N,
// K / block * bytes] rows of blocks (format code fmt) -> [M, N] in x's dtype.
// Threads split the output rows; each takes a tile of rows at a time and runs
// every activation row (up to 8 at once for blocks of 32, 4 for the K-quants)
// over it while it is in L1. invariant: each row's sums in one order whatever
// M (4 rows at once for every format; deterministic mode).
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t fmt, bool invariant) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == torch::kUInt8, "gguf_linear: x [M, K], w uint8 [N, row bytes]");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "gguf_linear: w must be contiguous");
  const Layout L = layout_of(static_cast<int>(fmt));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % L.block == 0 && w.size(1) == K / L.block * L.bytes, "gguf_linear: K=", K, " does not fit rows of ", w.size(1), " bytes");
  QuantizedActivations a;
  const int64_t block = is_k_quant(static_cast<int>(fmt)) ? 256 : 32;
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(reinterpret_cast<const T*>(x.data_ptr()), M, K, block, has_min_32(static_cast<int>(fmt)), a);
    T* op = reinterpret_cast<T*>(out.data_ptr());
    const int64_t tile = std::max<int64_t>(1, 16384 / row_bytes);
    at::parallel_for(0, N, std::max<int64_t>(4, 65536 / (row_bytes * std::max<int64_t>(1, M))), [&](int64_t begin, int64_t end) {
      float res[8];
      const int64_t rmax = is_k_quant(static_cast<int>(fmt)) || invariant ? 4 : 8;
      for (int64_t n0 = begin; n0 < end; n0 += tile) {
        const int64_t n1 = std::min(end, n0 + tile);
        for (int64_t m0 = 0; m0 < M; m0 += rmax) {
          const int64_t r = std::min<int64_t>(rmax, M - m0);
          for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = wp + n * row_bytes;
            if (invariant) {
              switch (r) {
                case 4: dot_rows<4, true>(static_cast<int>(fmt), row, a, m0, res); break;
                case 3: dot_rows<3, true>(static_cast<int>(fmt), row, a, m0, res); break;
                case 2: dot_rows<2, true>(static_cast<int>(fmt), row, a, m0, res); break;
                default: dot_rows<1, true>(static_cast<int>(fmt), row, a, m0, res); break;
              }
            } else switch (r) {
              case 8: dot_rows<8>(static_cast<int>(fmt), row, a, m0, res); break;
              case 7: dot_rows<7>(static_cast<int>(fmt), row, a, m0, res); break;
              case 6: dot_rows<6>(static_cast<int>(fmt), row, a, m0, res); break;
              case 5: dot_rows<5>(static_cast<int>(fmt), row, a, m0, res); break;
              case 4: dot_rows<4>(static_cast<int>(fmt), row, a, m0, res); break;
              case 3: dot_rows<3>(static_cast<int>(fmt), row, a, m0, res); break;
              case 2: dot_rows<2>(static_cast<int>(fmt), row, a, m0, res); break;
              default: dot_rows<1>(static_cast<int>(fmt), row, a, m0, res); break;
            }
            for (int64_t i = 0; i < r; ++i) store_out<T>(op + (m0 + i) * N + n, res[i]);
          }
        }
      }
    });
  };
  if (x.scalar_type() == torch::kBFloat16) run(uint16_t{});
  else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "gguf_linear: bfloat16 or float32 activations, got ", x.scalar_type());
    run(float{});
  }
  return out;
}

// rows [row_begin, row_end) of the GGUF weight w, dequantized: [rows, K] float32
// (or bfloat16), for the matmul path of large batches
torch::Tensor gguf_dequantize(torch::Tensor w, int64_t fmt, int64_t K, int64_t row_begin, int64_t row_end, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "gguf_dequantize: w uint8 [N, row bytes]");
  const Layout L = layout_of(static_cast<int>(fmt));
  TORCH_CHECK(K % L.block == 0 && w.size(1) == K / L.block * L.bytes, "gguf_dequantize: K=", K, " does not fit rows of ", w.size(1), " bytes");
  TORCH_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= w.size(0), "gguf_dequantize: bad row range");
  const int64_t rows = row_end - row_begin, row_bytes = w.size(1);
  auto out = torch::empty({rows, K}, torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>() + row_begin * row_bytes;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (bf16) dequantize_row(static_cast<int>(fmt), wp + n * row_bytes, K, reinterpret_cast<uint16_t*>(out.data_ptr()) + n * K);
      else dequantize_row(static_cast<int>(fmt), wp + n * row_bytes, K, out.data_ptr<float>() + n * K);
    }
  });
  return out;
}

// which code path this build compiled (from the instruction-set flags)
std::string gguf_kernel_path() { return PLINTH_QUANT_PATH; }
