#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// bf16 <-> fp32 by bit shifts (round-to-nearest-even on the way back)
static inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <typename T> struct Elem;
template <> struct Elem<float> {
  static inline float load(const float* p) { return *p; }
  static inline void store(float* p, float v) { *p = v; }
};
template <> struct Elem<uint16_t> {
  static inline float load(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline void store(uint16_t* p, float v) { *p = f32_to_bf16(v); }
};

// One pass over the context per (sequence, kv head): scores for all G query
// heads of the group, softmax, then the weighted sum of V. K and V are read
// once each, straight from the pages.
template <typename T>
static void decode_kernel(const T* q, const T* kp, const T* vp, const int32_t* tables, const int32_t* lens, T* out,
                          int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t N, int64_t ps,
                          int64_t max_pages, float scale, int64_t window) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores, acc(G * Dv), krow(D), vrow(Dv);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const int64_t L = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = Elem<T>::load(q + (b * Hq + h * G + g) * D + d) * scale;
      scores.assign(G * n, 0.f);
      const int32_t* table = tables + b * max_pages;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const T* k = kp + ((h * N + table[pos / ps]) * ps + pos % ps) * D;
        for (int64_t d = 0; d < D; ++d) krow[d] = Elem<T>::load(k + d);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * krow[d];
          scores[g * n + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const T* v = vp + ((h * N + table[pos / ps]) * ps + pos % ps) * Dv;
        for (int64_t d = 0; d < Dv; ++d) vrow[d] = Elem<T>::load(v + d);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * Dv;
          for (int64_t d = 0; d < Dv; ++d) a[d] += p * vrow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < Dv; ++d) Elem<T>::store(out + (b * Hq + h * G + g) * Dv + d, acc[g * Dv + d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_pages.is_contiguous() && v_pages.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pages.size(0), N = k_pages.size(1), ps = k_pages.size(2), Dv = v_pages.size(3);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty({B, Hq, Dv}, q.options());
  if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()),
                            reinterpret_cast<const uint16_t*>(k_pages.data_ptr()),
                            reinterpret_cast<const uint16_t*>(v_pages.data_ptr()), tables.data_ptr<int32_t>(),
                            lens.data_ptr<int32_t>(), reinterpret_cast<uint16_t*>(out.data_ptr()), B, Hq, Hkv, D, Dv,
                            N, ps, tables.size(1), (float)scale, window);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "bfloat16 or float32 only");
    decode_kernel<float>(q.data_ptr<float>(), k_pages.data_ptr<float>(), v_pages.data_ptr<float>(),
                         tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, Hq, Hkv, D,
                         Dv, N, ps, tables.size(1), (float)scale, window);
  }
  return out;
}
