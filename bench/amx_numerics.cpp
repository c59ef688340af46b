// What TDPBF16PS (AMX) computes, checked bit for bit against a model on
// vector registers. The model: for each C element and each 32-k tile, the
// even-k products summed in k order in fp32 from zero (E, every add rounded
// to nearest even), the odd-k products likewise (O), then C + (E + O). E and
// O are two vdpbf16ps chains with the other half of each pair zeroed (one
// product a step, the same rounding and DAZ/FTZ).
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 -mamx-tile -mamx-bf16 bench/amx_numerics.cpp -o /tmp/amx_numerics
//   /tmp/amx_numerics 0 8 40 70     # exponent spreads: values N(0,1) * 2^U(-s, s)
//
// Measured 2026-12-06 on an Intel Xeon (Sapphire Rapids class): 0 of 320,000
// outputs differ for each spread (K = 576, 18 tiles), while a single
// vdpbf16ps chain over the pairs (the streaming kernel's order) differs in
// most. So AMX's bits can be reproduced without tiles; a linear kernel built
// on it for 1-2 rows ran 1.4-2x slower than the tiles themselves (two
// vdpbf16ps per pair line), so cpukernels does not use it.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::puts("this CPU or kernel grants no AMX tiles");
    return 0;
  }
  TileConfig cfg;
  cfg.rows[0] = 1, cfg.colsb[0] = 64;  // C: 1 row x 16 fp32
  cfg.rows[1] = 1, cfg.colsb[1] = 64;  // A: 1 row x 32 bf16
  cfg.rows[2] = 16, cfg.colsb[2] = 64; // B: 16 pair lines x 16 outputs
  _tile_loadconfig(&cfg);
  constexpr int TILES = 18, K2 = 16 * TILES;
  alignas(64) static uint16_t x[2 * K2], w[K2 * 32];
  alignas(64) float amx[16], model[16], chain[16];
  for (int a = 1; a < (argc > 1 ? argc : 2); ++a) {
    const int spread = argc > 1 ? std::atoi(argv[a]) : 8;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0, 1);
    std::uniform_int_distribution<int> exponent(-spread, spread);
    auto bf16 = [&]() {  // rounded to nearest even
      const float f = normal(rng) * std::ldexp(1.0f, exponent(rng));
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    };
    long total = 0, model_differs = 0, chain_differs = 0;
    for (int trial = 0; trial < 20000; ++trial) {
      for (auto& v : x) v = bf16();
      for (auto& v : w) v = bf16();
      _tile_zero(0);
      for (int t = 0; t < TILES; ++t) {
        _tile_loadd(1, x + 32 * t, 64);
        _tile_loadd(2, w + 512 * t, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, amx, 64);
      __m512 acc = _mm512_setzero_ps(), one = _mm512_setzero_ps();
      for (int t = 0; t < TILES; ++t) {
        __m512 e = _mm512_setzero_ps(), o = _mm512_setzero_ps();
        for (int kk = 16 * t; kk < 16 * t + 16; ++kk) {
          int32_t pair;
          std::memcpy(&pair, x + 2 * kk, 4);
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + 32 * kk);
          e = _mm512_dpbf16_ps(e, (__m512bh)_mm512_set1_epi32(pair & 0xffff), wv);
          o = _mm512_dpbf16_ps(o, (__m512bh)_mm512_set1_epi32(pair & int32_t(0xffff0000u)), wv);
          one = _mm512_dpbf16_ps(one, (__m512bh)_mm512_set1_epi32(pair), wv);
        }
        acc = _mm512_add_ps(acc, _mm512_add_ps(e, o));
      }
      _mm512_storeu_ps(model, acc);
      _mm512_storeu_ps(chain, one);
      for (int n = 0; n < 16; ++n, ++total) {
        model_differs += std::memcmp(amx + n, model + n, 4) != 0;
        chain_differs += std::memcmp(amx + n, chain + n, 4) != 0;
      }
    }
    std::printf("spread 2^+-%d: of %ld outputs, the model differs in %ld, one vdpbf16ps chain in %ld\n", spread, total,
                model_differs, chain_differs);
  }
  _tile_release();
  return 0;
}
