// Small-M dense linear kernels (y = x @ W^T + b) for bfloat16 and float32
// weights, repacked once at load into a layout streamed block by block.
//
// Layouts (N padded to a multiple of 16 with zero rows):
//   bf16: [N/16][K2][16][2]  K2 = ceil(K/2): one 64-byte line holds 2 k for
//         16 outputs (the pairs vdpbf16ps multiplies), K padded with zeros
//   fp32: [N/16][K][16]      one 64-byte line holds 1 k for 16 outputs
//
// The code path is chosen at compile time from the flags the build passes
// (kernels.isa_cflags, never -march=native):
//   bf16 weights: AVX512-BF16 vdpbf16ps; AVX-512F or AVX2+FMA: the pairs
//                 widened to fp32 by a shift and a mask, fp32 FMA; scalar
//   fp32 weights: AVX-512F or AVX2+FMA FMA; scalar
// Accumulation is fp32; the output has x's dtype (the weight's).
// A microkernel keeps MR rows x NR blocks of 16 outputs in registers over the
// whole K; the N tiles are handed out to the threads in chunks
// (plinth::parallel_take, common.h) of about 64 KB of weights each.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define PLINTH_LIN_AVX512 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PLINTH_LIN_AVX512BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define PLINTH_LIN_AVX2 1
#endif
#if defined(PLINTH_LIN_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PLINTH_LIN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t BLK = 16;  // outputs per block
#if !defined(PLINTH_LIN_AVX512) && !defined(PLINTH_LIN_AVX2) && defined(__GNUC__) && !defined(__clang__)
// The plain-C kernels (no vector path) keep their sums over k in the written
// order: -ffast-math lets GCC reassociate them, and it did so differently per
// (rows, blocks) instantiation (one block next to three or more rows gave
// other sums than next to one or two), so a row's result moved with the batch.
#pragma GCC optimize("no-associative-math")
#endif
#if !defined(PLINTH_LIN_AVX512) && !defined(PLINTH_LIN_AVX2) && defined(__clang__)
#define PLINTH_LIN_IN_ORDER _Pragma("clang fp reassociate(off)")
#else
#define PLINTH_LIN_IN_ORDER
#endif

// software prefetch distance along each weight stream, in 64-byte lines
#ifndef PLINTH_LIN_PF_LINES
#define PLINTH_LIN_PF_LINES 48  // 16-row batches: 48 took 0.87x the time of 16, 0.65x of none (bench, one thread)
#endif
constexpr int64_t PF_LINES = PLINTH_LIN_PF_LINES;
// and further ahead into L2 (the vdpbf16ps and AVX2 paths): a decode step's
// linears, cold weights, 2 threads (Zen 4): vdpbf16ps 15.6 -> 14.5 ms/step at
// 16 rows, alike from 96 to 512 lines (hot weights: 12.2); AVX2 14.9 -> 13.5
// at one row, alike at 16 (43.7 / 44.8, bound by its FMAs)
constexpr int64_t PF_L2_LINES = 128;

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// ---------------------------------------------------------------- microkernels
// Each computes acc[MR][NR*16] = x[MR rows] . W[NR blocks] over all K and
// writes it to tile (row stride NR*16 floats).

// bf16 weights, pairs layout. xb (the vdpbf16ps path): the group's MR rows
// as interleave_pairs lays them out ([K2][MR] bf16 pairs); xf (the other
// paths): the rows as fp32, ldx apart (padded to 2*K2).
template <int MR, int NR>
inline void ukernel_bf16(const uint16_t* xb, const float* xf, int64_t ldx, const uint16_t* w, int64_t wstride,
                         int64_t K2, float* tile) {
#if defined(PLINTH_LIN_AVX512BF16)
  (void)xf;
  (void)ldx;
  const int32_t* xp = reinterpret_cast<const int32_t*>(xb);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) {
      const uint16_t* p = w + j * wstride + kk * 32;
      plinth::prefetch_l1(reinterpret_cast<const char*>(p + 32 * PF_LINES));
      plinth::prefetch_l2(reinterpret_cast<const char*>(p + 32 * PF_L2_LINES));
      wv[j] = (__m512bh)_mm512_loadu_si512(p);
    }
    for (int i = 0; i < MR; ++i) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[kk * MR + i]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(tile + i * NR * 16 + j * 16, acc[i][j]);
#elif defined(PLINTH_LIN_AVX512)
  (void)xb;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512 we[NR], wo[NR];
    for (int j = 0; j < NR; ++j) {
      const uint16_t* p = w + j * wstride + kk * 32;
      plinth::prefetch_l1(reinterpret_cast<const char*>(p + 32 * PF_LINES));
      __m512i v = _mm512_loadu_si512(p);
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
    }
    for (int i = 0; i < MR; ++i) {
      __m512 x0 = _mm512_set1_ps(xf[i * ldx + 2 * kk]);
      __m512 x1 = _mm512_set1_ps(xf[i * ldx + 2 * kk + 1]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(wo[j], x1, _mm512_fmadd_ps(we[j], x0, acc[i][j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(tile + i * NR * 16 + j * 16, acc[i][j]);
#elif defined(PLINTH_LIN_AVX2)
  (void)xb;
  // a block's line is two 32-byte halves of 8 outputs each
  __m256 acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(int32_t(0xffff0000u));
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m256 we[NR][2], wo[NR][2];
    for (int j = 0; j < NR; ++j) {
      const uint16_t* p = w + j * wstride + kk * 32;
      plinth::prefetch_l1(reinterpret_cast<const char*>(p + 32 * PF_LINES));
      plinth::prefetch_l2(reinterpret_cast<const char*>(p + 32 * PF_L2_LINES));
      for (int h = 0; h < 2; ++h) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
        we[j][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[j][h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
      }
    }
    for (int i = 0; i < MR; ++i) {
      __m256 x0 = _mm256_set1_ps(xf[i * ldx + 2 * kk]);
      __m256 x1 = _mm256_set1_ps(xf[i * ldx + 2 * kk + 1]);
      for (int j = 0; j < NR; ++j)
        for (int h = 0; h < 2; ++h)
          acc[i][j][h] = _mm256_fmadd_ps(wo[j][h], x1, _mm256_fmadd_ps(we[j][h], x0, acc[i][j][h]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(tile + i * NR * 16 + j * 16 + 8 * h, acc[i][j][h]);
#else
  PLINTH_LIN_IN_ORDER
  (void)xb;
  float acc[MR][NR * 16] = {};
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int i = 0; i < MR; ++i) {
      const float x0 = xf[i * ldx + 2 * kk], x1 = xf[i * ldx + 2 * kk + 1];
      for (int j = 0; j < NR; ++j) {
        const uint16_t* p = w + j * wstride + kk * 32;
        for (int l = 0; l < 16; ++l) acc[i][j * 16 + l] += bf16_to_f32(p[2 * l]) * x0 + bf16_to_f32(p[2 * l + 1]) * x1;
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < NR * 16; ++l) tile[i * NR * 16 + l] = acc[i][l];
#endif
}

// fp32 weights, [N/16][K][16]
template <int MR, int NR>
inline void ukernel_f32(const float* x, int64_t ldx, const float* w, int64_t wstride, int64_t K, float* tile) {
#if defined(PLINTH_LIN_AVX512)
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      const float* p = w + j * wstride + k * 16;
      plinth::prefetch_l1(reinterpret_cast<const char*>(p + 16 * PF_LINES));
      wv[j] = _mm512_loadu_ps(p);
    }
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(tile + i * NR * 16 + j * 16, acc[i][j]);
#elif defined(PLINTH_LIN_AVX2)
  __m256 acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NR][2];
    for (int j = 0; j < NR; ++j) {
      const float* p = w + j * wstride + k * 16;
      plinth::prefetch_l1(reinterpret_cast<const char*>(p + 16 * PF_LINES));
      wv[j][0] = _mm256_loadu_ps(p);
      wv[j][1] = _mm256_loadu_ps(p + 8);
    }
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < NR; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(wv[j][0], xv, acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(wv[j][1], xv, acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(tile + i * NR * 16 + j * 16 + 8 * h, acc[i][j][h]);
#else
  PLINTH_LIN_IN_ORDER
  float acc[MR][NR * 16] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * ldx + k];
      for (int j = 0; j < NR; ++j) {
        const float* p = w + j * wstride + k * 16;
        for (int l = 0; l < 16; ++l) acc[i][j * 16 + l] += p[l] * xv;
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int l = 0; l < NR * 16; ++l) tile[i * NR * 16 + l] = acc[i][l];
#endif
}

#if defined(PLINTH_LIN_AVX512BF16)
// The vdpbf16ps microkernels' activations: rows in groups of `group` (the
// last may be shorter), each group [K2][rows] 32-bit bf16 pairs at pair
// m0 * K2. A microkernel then reads row i's pair kk at xp[kk * MR + i], a
// constant offset from one pointer; with one pointer per row, 16 rows
// outnumbered the general registers and the pointers went through vector
// registers (vmovq), ~1.2x the time at 128 rows (Zen 4, perf annotate).
// A layout only: every output's sum is unchanged, bit for bit. One row is
// already in it (its pairs in order), so a decode of one sequence skips it.
inline torch::Tensor interleave_pairs(const uint16_t* x, int64_t M, int64_t ldx, int64_t K2, int group) {
  auto out = torch::empty({M * K2}, torch::dtype(torch::kInt32));
  int32_t* dst = out.data_ptr<int32_t>();
  // pieces of one group's rows x 16 pairs (a 16x16 transpose of dwords where
  // the group is whole), spread over the threads from 64 KB up: a prefill's
  // copy on one thread left the other idle ~10% of a 512-row linear
  const int64_t groups = (M + group - 1) / group, KB = (K2 + 15) / 16;
  at::parallel_for(0, groups * KB, std::max<int64_t>(1, 16384 / (16 * group)), [&](int64_t p0, int64_t p1) {
    for (int64_t piece = p0; piece < p1; ++piece) {
      const int64_t m0 = (piece / KB) * group, k0 = (piece % KB) * 16;
      const int64_t rows = std::min<int64_t>(group, M - m0), kn = std::min<int64_t>(16, K2 - k0);
      int32_t* g = dst + m0 * K2;
#if defined(__AVX512F__)
      if (rows == 16 && kn == 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(x + (m0 + i) * ldx + 2 * k0));
        plinth::transpose_16x16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(g + (k0 + j) * 16), r[j]);
        continue;
      }
#endif
      for (int64_t i = 0; i < rows; ++i) {
        const uint16_t* row = x + (m0 + i) * ldx;
        for (int64_t kk = k0; kk < k0 + kn; ++kk) std::memcpy(g + kk * rows + i, row + 2 * kk, 4);
      }
    }
  });
  return out;
}
#endif

// ---------------------------------------------------------------- tiling
// Rows per group (MG) and blocks per microkernel (nr_for(rows)), within the
// registers: AVX-512 has 32 zmm, AVX2 16 ymm (a block takes two). All the
// rows of a group share each weight load, so a decode batch of up to MG rows
// reads every weight line once and its multiplies overlap the stream.
#if defined(PLINTH_LIN_AVX512)
constexpr int MG = 16;
constexpr int nr_for(int mr) { return mr == 1 ? 8 : mr <= 4 ? 4 : mr <= 12 ? 2 : 1; }
#elif defined(PLINTH_LIN_AVX2)
constexpr int MG = 6;
constexpr int nr_for(int mr) { return mr == 1 ? 3 : mr == 2 ? 2 : 1; }
#else
constexpr int MG = 4;
constexpr int nr_for(int mr) { return mr > 0 ? 4 : 4; }
#endif
constexpr int TILE_FLOATS = 512;  // >= mr * nr_for(mr) * 16 for every mr <= MG

struct Problem {
  bool bf16;
  const uint16_t* xb;  // bf16 rows (bf16 weights, vdpbf16ps path)
  const float* xf;     // fp32 rows
  int64_t ldx;
  const void* w;
  int64_t wstride;  // elements per block
  int64_t kdim;     // K2 (bf16) or K (fp32)
};

template <int MR, int NR>
inline void run_tile(const Problem& p, int64_t m0, int64_t nb0, float* tile) {
  if (p.bf16) {
    const uint16_t* w = static_cast<const uint16_t*>(p.w) + nb0 * p.wstride;
    ukernel_bf16<MR, NR>(p.xb ? p.xb + m0 * p.ldx : nullptr, p.xf ? p.xf + m0 * p.ldx : nullptr, p.ldx, w, p.wstride,
                         p.kdim, tile);
  } else {
    const float* w = static_cast<const float*>(p.w) + nb0 * p.wstride;
    ukernel_f32<MR, NR>(p.xf + m0 * p.ldx, p.ldx, w, p.wstride, p.kdim, tile);
  }
}

template <int MR, int NR>
inline void run_blocks(const Problem& p, int64_t m0, int64_t nb0, int nr, float* tile) {
  if (nr >= NR) return run_tile<MR, NR>(p, m0, nb0, tile);
  if constexpr (NR > 1) return run_blocks<MR, NR - 1>(p, m0, nb0, nr, tile);
}

template <int MR>
inline void run_group(const Problem& p, int64_t m0, int mr, int64_t nb0, int nr, float* tile) {
  if (mr == MR) return run_blocks<MR, nr_for(MR)>(p, m0, nb0, nr, tile);
  if constexpr (MR > 1) return run_group<MR - 1>(p, m0, mr, nb0, nr, tile);
}

template <typename Out>
inline void store_tile(const float* tile, int nrow, int ncol_tile, int64_t n0, int64_t N, const float* bias, Out* y,
                       int64_t ldy) {
  const int64_t nvalid = std::min<int64_t>(ncol_tile, N - n0);
  for (int i = 0; i < nrow; ++i) {
    Out* out = y + i * ldy + n0;
    const float* t = tile + i * ncol_tile;
    for (int64_t l = 0; l < nvalid; ++l) {
      float v = t[l] + (bias ? bias[n0 + l] : 0.f);
      if constexpr (std::is_same<Out, float>::value) out[l] = v;
      else out[l] = f32_to_bf16(v);
    }
  }
}


// ---------------------------------------------------------------- fused GGUF blocks (deterministic mode)
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights (format codes as quant.py), repacked
// at load by gguf_fused_pack into records of 16 output rows x 32 k (one GGUF
// block per row), still ~4.5-8.5 bits a weight:
//   Q4_x: 4 x 64 bytes of nibbles, then 16 f16 d (Q4_1: then 16 f16 m).
//         Line 2c+h, dword lane 2r+s: row 8h+r's weights k = 2(8c+j)+s at
//         bits 4j..4j+3, j = 0..7 (the pairs of kk = 8c+j for that lane).
//   Q5_x: Q4_x's nibble lines, then 4 x 16 bytes of fifth bits (line 2c+h,
//         byte 2r+s, bit j: the same weight as nibble j there), then d (and m).
//   Q8_0: 32 x 16 bytes: line 2kk+h, byte 2r+s = row 8h+r's q[2kk+s]; then 16 f16 d.
// The kernel dequantizes a record in registers to EXACTLY the bf16 values of
// gguf_dequantize(bf16=True) (quant_ops.cpp): there v = fma(u, d, m - d*offset)
// rounded once to fp32; d*(u - offset) is exact in fp32 (an f16 times at most
// 8 bits), so v = round_fp32(d*(u - offset) + m) whichever way it is computed
// (here d*(u - 8) or d*q with one multiply, Q4_1/Q5_1 one fma), then rounded to
// nearest even into bf16 (vcvtne2ps2bf16, as vcvtneps2bf16 there; no fp32
// subnormal can arise: every value is 0 or a multiple of 2^-24). Each pair
// vector then meets the activations in the SAME vdpbf16ps sequence as
// ukernel_bf16 on the dense copy (same pairs, k in the same order, one fp32
// lane per output from zero), so results are bit-identical to linear_small on
// linear_pack(gguf_dequantize(...)) for every M: deterministic mode can take
// this kernel for few rows (it reads the blocks, not 16 bits a weight) and the
// dense copy for many, and stay batch-invariant.
// Only the AVX512-BF16 build has the kernel (gguf_fused_formats() is empty
// elsewhere, and the dense copy runs as before); the pack is portable.
constexpr int GGUF_Q4_0 = 0, GGUF_Q4_1 = 1, GGUF_Q8_0 = 2, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7;

constexpr bool fused_format(int64_t fmt) {
  return fmt == GGUF_Q4_0 || fmt == GGUF_Q4_1 || fmt == GGUF_Q5_0 || fmt == GGUF_Q5_1 || fmt == GGUF_Q8_0;
}
constexpr bool five_bits(int fmt) { return fmt == GGUF_Q5_0 || fmt == GGUF_Q5_1; }
constexpr bool with_min(int fmt) { return fmt == GGUF_Q4_1 || fmt == GGUF_Q5_1; }
inline int64_t gguf_block_bytes(int fmt) {
  return fmt == GGUF_Q4_0 ? 18 : fmt == GGUF_Q4_1 ? 20 : fmt == GGUF_Q5_0 ? 22 : fmt == GGUF_Q5_1 ? 24 : 34;
}
// where a record's 16 f16 d start (m follows them)
constexpr int64_t fused_scales_at(int fmt) { return fmt == GGUF_Q8_0 ? 512 : five_bits(fmt) ? 320 : 256; }
constexpr int64_t fused_record_bytes(int fmt) { return fused_scales_at(fmt) + (with_min(fmt) ? 64 : 32); }
// run(std::integral_constant<int, FMT>{}) for a fused format code
template <class Run>
inline void with_fused_format(int64_t fmt, Run&& run) {
  switch (fmt) {
    case GGUF_Q4_0: return run(std::integral_constant<int, GGUF_Q4_0>{});
    case GGUF_Q4_1: return run(std::integral_constant<int, GGUF_Q4_1>{});
    case GGUF_Q5_0: return run(std::integral_constant<int, GGUF_Q5_0>{});
    case GGUF_Q5_1: return run(std::integral_constant<int, GGUF_Q5_1>{});
    default: return run(std::integral_constant<int, GGUF_Q8_0>{});
  }
}

#if defined(PLINTH_LIN_AVX512BF16)
constexpr int FUSED_MG = 8;  // rows per group
// blocks per microkernel (2 share each activation load; 4 for Q8_0 at one row measured no faster)
constexpr int fused_nr_for(int /*fmt*/, int mr) { return mr <= 4 ? 2 : 1; }
// Software prefetch: each record's lines in the blocks of the NEXT microkernel call
// (NR * wstride on), into L1 when that tile is small, else L2. Measured (SmolLM2's
// gate_up Q4_1 and Q8_0 head, one row, one thread, loaded): within-stream distances
// of 1-4 KB left the kernel 1.5-1.8x the integer kernel's time, the next tile 0.93-1.1x
// (Q4_1) and 1.15-1.4x (Q8_0 head, L2).
constexpr int64_t FUSED_PF_L1_BYTES = 16 << 10;  // next tiles up to this size: into L1

// lane 2r+s of the pair layout takes row r (lo) or 8+r (hi) of a 16-row vector
inline __m512i pair_rows(int base) {
  return _mm512_set_epi32(base + 7, base + 7, base + 6, base + 6, base + 5, base + 5, base + 4, base + 4, base + 3,
                          base + 3, base + 2, base + 2, base + 1, base + 1, base, base);
}

// One 32-k block of NR records (rec[j], 16 output rows each) dequantized in
// registers: step(kk, wv) gets, for kk = 0..15, NR pair vectors (kk's two k for
// the 16 rows of each record), exactly the dense copy's pair line kk.
template <int NR, int FMT, class Step>
inline void gguf_block_pairs(const uint8_t* const* rec, Step&& step) {
  const __m512i lo_rows = pair_rows(0), hi_rows = pair_rows(8);
  // u -> float(u - offset): vpermps reads only an index's low 4 bits, vpermt2ps 5 (u16 from the second table)
  const __m512 utab = FMT == GGUF_Q4_0   ? _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8)
                      : FMT == GGUF_Q5_0 ? _mm512_set_ps(-1, -2, -3, -4, -5, -6, -7, -8, -9, -10, -11, -12, -13, -14, -15, -16)
                                         : _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 utab16 = FMT == GGUF_Q5_0 ? _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
                                         : _mm512_set_ps(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16);
  __m512 dlo[NR], dhi[NR], mlo[NR], mhi[NR];
  constexpr int64_t SCALES = fused_scales_at(FMT);
  for (int j = 0; j < NR; ++j) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[j] + SCALES)));
    dlo[j] = _mm512_permutexvar_ps(lo_rows, d);
    dhi[j] = _mm512_permutexvar_ps(hi_rows, d);
    if constexpr (with_min(FMT)) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[j] + SCALES + 32)));
      mlo[j] = _mm512_permutexvar_ps(lo_rows, m);
      mhi[j] = _mm512_permutexvar_ps(hi_rows, m);
    } else {
      mlo[j] = mhi[j] = _mm512_setzero_ps();
    }
  }
  if constexpr (FMT == GGUF_Q8_0) {
    for (int kk = 0; kk < 16; ++kk) {
      __m512bh wv[NR];
      for (int j = 0; j < NR; ++j) {
        const __m128i* line = reinterpret_cast<const __m128i*>(rec[j] + 32 * kk);
        const __m512 vlo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(line))), dlo[j]);
        const __m512 vhi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(line + 1))), dhi[j]);
        wv[j] = _mm512_cvtne2ps_pbh(vhi, vlo);  // words 0-15 from vlo: rows 0-7's pairs, then rows 8-15's
      }
      step(kk, wv);
    }
  } else {
    for (int c = 0; c < 2; ++c) {
      __m512i qlo[NR], qhi[NR], hlo[NR], hhi[NR];
      for (int j = 0; j < NR; ++j) {
        qlo[j] = _mm512_loadu_si512(rec[j] + 128 * c);
        qhi[j] = _mm512_loadu_si512(rec[j] + 128 * c + 64);
        if constexpr (five_bits(FMT)) {  // a lane's 8 fifth bits, bit j for its nibble j
          hlo[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[j] + 256 + 32 * c)));
          hhi[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[j] + 256 + 32 * c + 16)));
        }
      }
      for (int p = 0; p < 8; ++p) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; ++j) {
          __m512 vlo, vhi;
          if constexpr (five_bits(FMT)) {
            // index = nibble p (bits 0-3) | fifth bit p moved to bit 4: (A & 0xF) | (B & ~0xF)
            const __m512i nib = _mm512_set1_epi32(0xF);
            const __m512i blo = p <= 4 ? _mm512_slli_epi32(hlo[j], 4 - p) : _mm512_srli_epi32(hlo[j], p - 4);
            const __m512i bhi = p <= 4 ? _mm512_slli_epi32(hhi[j], 4 - p) : _mm512_srli_epi32(hhi[j], p - 4);
            vlo = _mm512_permutex2var_ps(utab, _mm512_ternarylogic_epi32(qlo[j], blo, nib, 0xE4), utab16);
            vhi = _mm512_permutex2var_ps(utab, _mm512_ternarylogic_epi32(qhi[j], bhi, nib, 0xE4), utab16);
          } else {
            vlo = _mm512_permutexvar_ps(qlo[j], utab);
            vhi = _mm512_permutexvar_ps(qhi[j], utab);
          }
          if constexpr (with_min(FMT)) {
            vlo = _mm512_fmadd_ps(vlo, dlo[j], mlo[j]);
            vhi = _mm512_fmadd_ps(vhi, dhi[j], mhi[j]);
          } else {
            vlo = _mm512_mul_ps(vlo, dlo[j]);
            vhi = _mm512_mul_ps(vhi, dhi[j]);
          }
          wv[j] = _mm512_cvtne2ps_pbh(vhi, vlo);
          qlo[j] = _mm512_srli_epi32(qlo[j], 4);
          qhi[j] = _mm512_srli_epi32(qhi[j], 4);
        }
        step(8 * c + p, wv);
      }
    }
  }
}

// the records of the NEXT tile of NR blocks (NR * wstride on): into L1 when that tile is small, else L2
template <int NR, int FMT>
inline void gguf_prefetch_next(const uint8_t* const* rec, int64_t wstride) {
  constexpr int64_t REC = fused_record_bytes(FMT);
  for (int j = 0; j < NR; ++j) {
    const char* next = reinterpret_cast<const char*>(rec[j] + NR * wstride);
    for (int64_t off = 0; off < REC; off += 64) {
      if (NR * wstride <= FUSED_PF_L1_BYTES) plinth::prefetch_l1(next + off);
      else plinth::prefetch_l2(next + off);
    }
  }
}

// xb: the group's MR rows as interleave_pairs lays them out ([K/2][MR] pairs)
template <int MR, int NR, int FMT>
inline void ukernel_gguf(const uint16_t* xb, const uint8_t* w, int64_t wstride, int64_t nblk, float* tile) {
  constexpr int64_t REC = fused_record_bytes(FMT);
  const int32_t* xp = reinterpret_cast<const int32_t*>(xb);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* rec[NR];
    for (int j = 0; j < NR; ++j) rec[j] = w + j * wstride + b * REC;
    gguf_prefetch_next<NR, FMT>(rec, wstride);
    gguf_block_pairs<NR, FMT>(rec, [&](int kk, const __m512bh* wv) {
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[(16 * b + kk) * MR + i]);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    });
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(tile + i * NR * 16 + j * 16, acc[i][j]);
}

template <int MR, int NR, int FMT>
inline void fused_blocks(const uint16_t* xb, const uint8_t* w, int64_t wstride, int64_t nblk, int nr, float* tile) {
  if (nr >= NR) return ukernel_gguf<MR, NR, FMT>(xb, w, wstride, nblk, tile);
  if constexpr (NR > 1) return fused_blocks<MR, NR - 1, FMT>(xb, w, wstride, nblk, nr, tile);
}

template <int MR, int FMT>
inline void fused_group(const uint16_t* xb, int mr, const uint8_t* w, int64_t wstride, int64_t nblk, int nr,
                        float* tile) {
  if (mr == MR) return fused_blocks<MR, fused_nr_for(FMT, MR), FMT>(xb, w, wstride, nblk, nr, tile);
  if constexpr (MR > 1) return fused_group<MR - 1, FMT>(xb, mr, w, wstride, nblk, nr, tile);
}
#endif


// ---------------------------------------------------------------- AMX (bf16 weights, K a multiple of 32)
// The same packed layout feeds Intel AMX: 16 consecutive pair lines of a block
// ([K2][16][2], 64 bytes each) are exactly a TDPBF16PS B tile (16 k-pair rows x
// 16 outputs), and 32 k of up to 16 activation rows its A tile. Each output
// keeps one fp32 accumulator (a C tile row) over K in order, tile after tile,
// whatever the number of rows: a row's result depends on its own data only,
// so the kernel is batch-invariant like the streaming one, and on CPUs with
// AMX it is several times faster from a few rows up (bench/small_gemm.py).
// Its bits are not the vdpbf16ps kernel's (another order inside a tile): a
// weight takes one of the two for every batch in deterministic mode. (The
// tile's order is known, bench/amx_numerics.cpp: per 32-k tile, the even-k
// and the odd-k products each summed in fp32 in k order, then C + (E + O).
// Two vdpbf16ps chains reproduce it bit for bit, but for 1-2 rows they ran
// 1.4-2x slower than the tiles, which cost no more at 1 row than the
// vdpbf16ps kernel: few rows stay on the tiles.)
// Linux grants the tile registers on request (arch_prctl, once per process).
#if defined(PLINTH_LIN_AMX)
// tiles 0-3: C (4 blocks of 16 outputs), 4: A (rows x 32 k), 5-7: B
inline void amx_configure(int rows) {
  plinth::TileConfig cfg;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = uint8_t(rows); cfg.colsb[t] = 64; }
  cfg.rows[4] = uint8_t(rows); cfg.colsb[4] = 64;
  for (int t = 5; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  plinth::load_tile_config(cfg);
}

// C tiles 0..NT-1 += the A tile (4) times NT B tiles of 16 pair lines at b, b + bstride, ... (elements);
// B tiles take 5-7 in turn (the fourth reuses 5)
template <int NT>
inline void amx_dot_b(const uint16_t* b, int64_t bstride) {
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (NT > 1) { _tile_loadd(6, b + bstride, 64); _tile_dpbf16ps(1, 4, 6); }
  if constexpr (NT > 2) { _tile_loadd(7, b + 2 * bstride, 64); _tile_dpbf16ps(2, 4, 7); }
  if constexpr (NT > 3) { _tile_loadd(5, b + 3 * bstride, 64); _tile_dpbf16ps(3, 4, 5); }
}

template <int NT>
inline void amx_zero_c() {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  if constexpr (NT > 3) _tile_zero(3);
}

// C tiles 0..NT-1 -> c [rows][NT * 16] fp32
template <int NT>
inline void amx_store_c(float* c) {
  const int64_t ldc = NT * 64;  // bytes
  _tile_stored(0, c, ldc);
  if constexpr (NT > 1) _tile_stored(1, c + 16, ldc);
  if constexpr (NT > 2) _tile_stored(2, c + 32, ldc);
  if constexpr (NT > 3) _tile_stored(3, c + 48, ldc);
}

// C[rows][NT*16] (row stride NT*16 floats) = x rows . NT blocks over K2 pair lines (K2 % 16 == 0)
template <int NT>
inline void amx_blocks(const uint16_t* x, int64_t ldx_bytes, const uint16_t* w, int64_t wstride, int64_t K2, float* c,
                       bool prefetch) {
  amx_zero_c<NT>();
  for (int64_t kk = 0; kk < K2; kk += 16) {
    _tile_loadd(4, x + 2 * kk, ldx_bytes);
    const uint16_t* wk = w + kk * 32;
    // the weight streams: its lines PF_LINES ahead in each block (few rows leave the tile unit idle on memory)
    if (prefetch)  // the first row tile; the next ones find the lines in cache
      for (int j = 0; j < NT; ++j)
        for (int l = 0; l < 16; ++l)
          plinth::prefetch_l1(reinterpret_cast<const char*>(wk + j * wstride + (PF_LINES + l) * 32));
    amx_dot_b<NT>(wk, wstride);
  }
  amx_store_c<NT>(c);
}

// The fused GGUF records on AMX: each 32-k block of NT records is dequantized
// in registers (gguf_block_pairs, the dense copy's exact bf16 pairs) into a
// 1 KB B tile per record, so the results are bit-identical to amx_blocks on
// the dense copy (the same tiles in the same order) for every batch.
template <int NT, int FMT>
inline void amx_fused_blocks(const uint16_t* x, int64_t ldx_bytes, const uint8_t* w, int64_t wstride, int64_t nblk,
                             float* c) {
  constexpr int64_t REC = fused_record_bytes(FMT);
  alignas(64) uint16_t bt[NT][16 * 32];
  amx_zero_c<NT>();
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* rec[NT];
    for (int j = 0; j < NT; ++j) rec[j] = w + j * wstride + b * REC;
    gguf_prefetch_next<NT, FMT>(rec, wstride);
    gguf_block_pairs<NT, FMT>(rec, [&](int kk, const __m512bh* wv) {
      for (int j = 0; j < NT; ++j) _mm512_store_si512(bt[j] + 32 * kk, (__m512i)wv[j]);
    });
    _tile_loadd(4, x + 32 * b, ldx_bytes);
    amx_dot_b<NT>(bt[0], 16 * 32);
  }
  amx_store_c<NT>(c);
}

#endif

}  // namespace

// ---------------------------------------------------------------- entry points

std::string linear_kernel_path() {
#if defined(PLINTH_LIN_AVX512BF16)
  return "avx512-bf16 (vdpbf16ps)";
#elif defined(PLINTH_LIN_AVX512)
  return "avx512f (fp32 fma)";
#elif defined(PLINTH_LIN_AVX2)
  return "avx2+fma (fp32 fma)";
#else
  return "scalar";
#endif
}

// weight [N, K] bf16 or fp32 -> the streamed layout (1-D tensor of the same dtype)
torch::Tensor linear_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "linear_pack: weight must be 2-D");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "linear_pack: weight must be bfloat16 or float32");
  weight = weight.contiguous();
  const int64_t N = weight.size(0), K = weight.size(1), NB = (N + BLK - 1) / BLK;
  if (weight.scalar_type() == at::kBFloat16) {
    const int64_t K2 = (K + 1) / 2;
    auto out = plinth::large_page_zeros({NB * K2 * 32}, weight.scalar_type());  // streamed each step: 2 MB pages
    const uint16_t* src = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t l = 0; l < BLK && nb * BLK + l < N; ++l) {
          const uint16_t* row = src + (nb * BLK + l) * K;
          uint16_t* d = dst + nb * K2 * 32 + 2 * l;
          for (int64_t k = 0; k < K; ++k) d[(k / 2) * 32 + (k & 1)] = row[k];
        }
    });
    return out;
  }
  auto out = plinth::large_page_zeros({NB * K * BLK}, weight.scalar_type());
  const float* src = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t l = 0; l < BLK && nb * BLK + l < N; ++l) {
        const float* row = src + (nb * BLK + l) * K;
        float* d = dst + nb * K * BLK + l;
        for (int64_t k = 0; k < K; ++k) d[k * BLK] = row[k];
      }
  });
  return out;
}

// x [M, K] (the weight's dtype), packed from linear_pack, bias [N] or None -> [M, N]
torch::Tensor linear_small(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear_small: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear_small: x and the weight must have one dtype");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const int64_t M = x.size(0), NB = (N + BLK - 1) / BLK;
  const int64_t kdim = bf16 ? (K + 1) / 2 : K;
  TORCH_CHECK(packed.numel() == NB * kdim * (bf16 ? 32 : BLK), "linear_small: packed weight does not match N, K");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;

  // x in the form the microkernels read: fp32 rows (and bf16 rows padded to an even K)
  Problem p{};
  p.bf16 = bf16;
  p.w = packed.data_ptr();
  p.wstride = kdim * (bf16 ? 32 : BLK);
  p.kdim = kdim;
  torch::Tensor xb, xf;
  if (bf16) {
    const int64_t Kp = 2 * kdim;
#if defined(PLINTH_LIN_AVX512BF16)
    const torch::Tensor xr = (Kp == K) ? x.contiguous() : torch::constant_pad_nd(x, {0, Kp - K}, 0).contiguous();
    xb = M == 1 ? xr : interleave_pairs(reinterpret_cast<const uint16_t*>(xr.data_ptr<at::BFloat16>()), M, Kp, kdim, MG);
    p.xb = reinterpret_cast<const uint16_t*>(xb.data_ptr());
#else
    xf = torch::constant_pad_nd(x.to(at::kFloat), {0, Kp - K}, 0).contiguous();
    p.xf = xf.data_ptr<float>();
#endif
    p.ldx = Kp;
  } else {
    xf = x.contiguous();
    p.xf = xf.data_ptr<float>();
    p.ldx = K;
  }
  torch::Tensor bias_f;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_small: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
    bptr = bias_f.data_ptr<float>();
  }

  static_assert(MG * nr_for(MG) * 16 <= TILE_FLOATS && nr_for(1) * 16 <= TILE_FLOATS, "tile buffer");
  const int64_t block_bytes = BLK * K * (bf16 ? 2 : 4);
  const int64_t grain = std::max<int64_t>(nr_for(std::min<int64_t>(M, MG)), (int64_t(64) << 10) / std::max<int64_t>(1, block_bytes));
  plinth::parallel_take((NB + grain - 1) / grain, [&](auto&& take) {
    alignas(64) float tile[TILE_FLOATS];
    for (int64_t item; (item = take()) >= 0;) {
      const int64_t c0 = item * grain, c1 = std::min<int64_t>(NB, c0 + grain);
      for (int64_t m0 = 0; m0 < M; m0 += MG) {
        const int mr = int(std::min<int64_t>(MG, M - m0));
        for (int64_t nb = c0; nb < c1;) {
          const int nr = int(std::min<int64_t>(c1 - nb, 8));
          run_group<MG>(p, m0, mr, nb, nr, tile);
          const int done = std::min(nr, nr_for(mr));
          if (bf16)
            store_tile(tile, mr, done * 16, nb * BLK, N, bptr,
                       reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + m0 * N, N);
          else
            store_tile(tile, mr, done * 16, nb * BLK, N, bptr, y.data_ptr<float>() + m0 * N, N);
          nb += done;
        }
      }
    }
  });
  return y;
}


// whether linear_amx runs here: an AMX build on a CPU and kernel that grant the tiles
bool linear_amx_available() {
#if defined(PLINTH_LIN_AMX)
  return plinth::amx_granted();
#else
  return false;
#endif
}

#if defined(PLINTH_LIN_AMX)
namespace {
// y [M, N] bf16 = x [M, K] bf16 times a weight of NB blocks (+ bias) on AMX tiles:
// groups of 4 blocks split over the threads, 16-row tiles of x (rows past M
// zero; each row's result is its own). blocks(nt, x rows, group index, C, first row tile)
template <class Blocks>
torch::Tensor amx_linear_rows(const char* name, torch::Tensor x, int64_t N, int64_t K, const c10::optional<torch::Tensor>& bias,
                              Blocks&& blocks) {
  TORCH_CHECK(plinth::amx_granted(), name, ": the kernel does not grant this process AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16 [M, K]");
  TORCH_CHECK(K % 32 == 0, name, ": K must be a multiple of 32");
  const int64_t M = x.size(0), NB = (N + BLK - 1) / BLK;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t rows = M <= 16 ? M : 16, Mp = (M + rows - 1) / rows * rows;
  torch::Tensor xs = (Mp == M) ? x.contiguous() : torch::constant_pad_nd(x, {0, 0, 0, Mp - M}, 0).contiguous();
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  torch::Tensor bias_f;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, name, ": bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
    bptr = bias_f.data_ptr<float>();
  }
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  constexpr int64_t NT = 4;  // blocks per group: C tiles 0-3
  plinth::parallel_take((NB + NT - 1) / NT, [&](auto&& take) {
    alignas(64) float c[16 * NT * 16];
    amx_configure(int(rows));
    for (int64_t g; (g = take()) >= 0;) {
      const int nt = int(std::min<int64_t>(NT, NB - g * NT));
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        blocks(nt, xb + m0 * K, g * NT, c, m0 == 0);
        store_tile(c, int(std::min<int64_t>(rows, M - m0)), nt * 16, g * NT * BLK, N, bptr, yp + m0 * N, N);
      }
    }
    plinth::release_tiles();
  });
  return y;
}
}  // namespace
#endif

// x [M, K] bfloat16 times a bf16 weight from linear_pack (+ bias) -> [M, N] bfloat16, on AMX tiles;
// K must be a multiple of 32. Batch-invariant; not bit-identical to linear_small.
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t K, c10::optional<torch::Tensor> bias) {
#if defined(PLINTH_LIN_AMX)
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "linear_amx: the weight must be bfloat16");
  const int64_t K2 = K / 2, wstride = K2 * 32;
  TORCH_CHECK(packed.numel() == (N + BLK - 1) / BLK * wstride, "linear_amx: packed weight does not match N, K");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  return amx_linear_rows("linear_amx", x, N, K, bias, [&](int nt, const uint16_t* xr, int64_t nb, float* c, bool first) {
    const uint16_t* wg = w + nb * wstride;
    if (nt == 4) amx_blocks<4>(xr, K * 2, wg, wstride, K2, c, first);
    else if (nt == 3) amx_blocks<3>(xr, K * 2, wg, wstride, K2, c, first);
    else if (nt == 2) amx_blocks<2>(xr, K * 2, wg, wstride, K2, c, first);
    else amx_blocks<1>(xr, K * 2, wg, wstride, K2, c, first);
  });
#else
  (void)x; (void)packed; (void)N; (void)K; (void)bias;
  TORCH_CHECK(false, "linear_amx: this build (", linear_kernel_path(), ") has no AMX kernel: see linear_amx_available()");
#endif
}

// x [M, K] bfloat16 times the fused records of a [N, K] GGUF weight (+ bias) on AMX tiles -> [M, N]
// bfloat16, bit-identical to linear_amx(x, linear_pack(gguf_dequantize(w, bf16=True)), N, K, bias)
torch::Tensor gguf_fused_linear_amx(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N, int64_t K,
                                    c10::optional<torch::Tensor> bias) {
#if defined(PLINTH_LIN_AMX)
  TORCH_CHECK(fused_format(fmt), "gguf_fused_linear_amx: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 only, got format ", fmt);
  const int64_t nblk = K / 32, wstride = nblk * fused_record_bytes(int(fmt));
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == (N + BLK - 1) / BLK * wstride,
              "gguf_fused_linear_amx: packed records do not match N, K");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  return amx_linear_rows("gguf_fused_linear_amx", x, N, K, bias, [&](int nt, const uint16_t* xr, int64_t nb, float* c, bool) {
    const uint8_t* wg = w + nb * wstride;
    with_fused_format(fmt, [&](auto fmt_tag) {
      constexpr int F = decltype(fmt_tag)::value;
      if (nt == 4) amx_fused_blocks<4, F>(xr, K * 2, wg, wstride, nblk, c);
      else if (nt == 3) amx_fused_blocks<3, F>(xr, K * 2, wg, wstride, nblk, c);
      else if (nt == 2) amx_fused_blocks<2, F>(xr, K * 2, wg, wstride, nblk, c);
      else amx_fused_blocks<1, F>(xr, K * 2, wg, wstride, nblk, c);
    });
  });
#else
  (void)x; (void)packed; (void)fmt; (void)N; (void)K; (void)bias;
  TORCH_CHECK(false, "gguf_fused_linear_amx: this build (", linear_kernel_path(), ") has no AMX kernel: see linear_amx_available()");
#endif
}

// ---------------------------------------------------------------- fused GGUF entry points

// the GGUF format codes gguf_fused_linear runs in this build (empty: none)
std::vector<int64_t> gguf_fused_formats() {
#if defined(PLINTH_LIN_AVX512BF16)
  return {GGUF_Q4_0, GGUF_Q4_1, GGUF_Q5_0, GGUF_Q5_1, GGUF_Q8_0};
#else
  return {};
#endif
}

// GGUF blocks uint8 [N, K/32 * block bytes] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) -> the fused
// records, uint8 [ceil(N/16) * K/32 * record bytes] (rows past N: zeros)
torch::Tensor gguf_fused_pack(torch::Tensor blocks, int64_t fmt, int64_t N, int64_t K) {
  TORCH_CHECK(fused_format(fmt), "gguf_fused_pack: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 only, got format ", fmt);
  TORCH_CHECK(K % 32 == 0, "gguf_fused_pack: K must be a multiple of 32");
  blocks = blocks.contiguous();
  const int64_t nblk = K / 32, bb = gguf_block_bytes(int(fmt)), rec = fused_record_bytes(int(fmt));
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(0) == N && blocks.size(1) == nblk * bb,
              "gguf_fused_pack: blocks must be uint8 [N, K/32 * ", bb, "]");
  const int64_t NB = (N + BLK - 1) / BLK;
  auto out = plinth::large_page_zeros({NB * nblk * rec}, at::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nblk; ++b) {
        uint8_t* r = dst + (g * nblk + b) * rec;
        for (int l = 0; l < BLK && g * BLK + l < N; ++l) {
          const uint8_t* blk = src + (g * BLK + l) * nblk * bb + b * bb;
          const int h = l / 8, lane = 2 * (l % 8);
          if (fmt == GGUF_Q8_0) {
            for (int k = 0; k < 32; ++k) r[(2 * (k / 2) + h) * 16 + lane + (k & 1)] = blk[2 + k];
            std::memcpy(r + 512 + 2 * l, blk, 2);
            continue;
          }
          const int f = int(fmt), at = with_min(f) ? 4 : 2;  // after d (and m)
          const uint8_t* qs = blk + at + (five_bits(f) ? 4 : 0);
          uint32_t qh = 0;  // Q5_x: bit k is weight k's fifth bit
          if (five_bits(f)) std::memcpy(&qh, blk + at, 4);
          for (int k = 0; k < 32; ++k) {
            const uint8_t nib = k < 16 ? (qs[k] & 0xF) : (qs[k - 16] >> 4);
            const int kk = k / 2, s = k & 1, c = kk / 8, j = kk % 8;
            uint8_t* dword = r + (2 * c + h) * 64 + 4 * (lane + s);
            dword[j / 2] |= uint8_t(nib << (4 * (j & 1)));
            if (five_bits(f)) r[256 + (2 * c + h) * 16 + lane + s] |= uint8_t(((qh >> k) & 1) << j);
          }
          std::memcpy(r + fused_scales_at(f) + 2 * l, blk, 2);                            // d
          if (with_min(f)) std::memcpy(r + fused_scales_at(f) + 32 + 2 * l, blk + 2, 2);  // m
        }
      }
  });
  return out;
}

// x [M, K] bfloat16 times the fused records of a [N, K] GGUF weight (+ bias) -> [M, N] bfloat16,
// bit-identical to linear_small(x, linear_pack(gguf_dequantize(w, bf16=True)), N, K, bias)
torch::Tensor gguf_fused_linear(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N, int64_t K,
                                c10::optional<torch::Tensor> bias) {
#if defined(PLINTH_LIN_AVX512BF16)
  TORCH_CHECK(fused_format(fmt), "gguf_fused_linear: Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 only, got format ", fmt);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16, "gguf_fused_linear: x must be bfloat16 [M, K]");
  TORCH_CHECK(K % 32 == 0, "gguf_fused_linear: K must be a multiple of 32");
  const int64_t M = x.size(0), NB = (N + BLK - 1) / BLK, nblk = K / 32, rec = fused_record_bytes(int(fmt));
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == NB * nblk * rec, "gguf_fused_linear: packed records do not match N, K");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  x = x.contiguous();
  const torch::Tensor xs = M == 1 ? x : interleave_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, K / 2, FUSED_MG);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xs.data_ptr());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t wstride = nblk * rec;
  torch::Tensor bias_f;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gguf_fused_linear: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
    bptr = bias_f.data_ptr<float>();
  }
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  static_assert(FUSED_MG * fused_nr_for(GGUF_Q4_1, FUSED_MG) * 16 <= TILE_FLOATS && fused_nr_for(GGUF_Q8_0, 1) * 16 <= TILE_FLOATS, "tile buffer");
  const int64_t grain = std::max<int64_t>(fused_nr_for(int(fmt), int(std::min<int64_t>(M, FUSED_MG))), (int64_t(32) << 10) / std::max<int64_t>(1, wstride));
  plinth::parallel_take((NB + grain - 1) / grain, [&](auto&& take) {
    alignas(64) float tile[TILE_FLOATS];
    for (int64_t item; (item = take()) >= 0;) {
      const int64_t c0 = item * grain, c1 = std::min<int64_t>(NB, c0 + grain);
      for (int64_t m0 = 0; m0 < M; m0 += FUSED_MG) {
        const int mr = int(std::min<int64_t>(FUSED_MG, M - m0));
        for (int64_t nb = c0; nb < c1;) {
          const int nr = int(std::min<int64_t>(c1 - nb, fused_nr_for(int(fmt), mr)));
          const uint8_t* wb = w + nb * wstride;
          const uint16_t* xr = xb + m0 * K;
          with_fused_format(fmt, [&](auto fmt_tag) {
            fused_group<FUSED_MG, decltype(fmt_tag)::value>(xr, mr, wb, wstride, nblk, nr, tile);
          });
          store_tile(tile, mr, nr * 16, nb * BLK, N, bptr, yp + m0 * N, N);
          nb += nr;
        }
      }
    }
  });
  return y;
#else
  (void)x; (void)packed; (void)fmt; (void)N; (void)K; (void)bias;
  TORCH_CHECK(false, "gguf_fused_linear: this build (", linear_kernel_path(), ") has no fused GGUF kernel: see gguf_fused_formats()");
#endif
}
