// Helpers every CPU kernel shares: element loads and stores of each storage type, dot products, AVX2 lane sums,
// exp of non-positive values, the int8 row layouts (partial keys with a row scale; K/V rows in q8_0 groups), and the
// dispatch from a tensor's dtype or a size to a compiled instantiation. Internal to each translation unit that
// includes it (an anonymous namespace).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include "attend512.h"
#include "bf16_dots.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define IG_VNNI512 1
#endif

namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int BLOCK = 64;  // tokens scored together in attend
constexpr int64_t SPLIT = 512;  // tokens per work item of attend over a whole past (a multiple of BLOCK)
constexpr int64_t SPLIT_ROWS = 256;  // most chosen rows per work item, a row's rows cut evenly (attend_impl)

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16 bits: the high half of a float32
  uint32_t w = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline float load(const at::BFloat16* p, int64_t i) { return load(reinterpret_cast<const uint16_t*>(p), i); }
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const int8_t* p, int64_t i) { return float(p[i]); }  // an int8 row's value (its scale apart)

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(at::BFloat16* p, int64_t i, float x) { p[i] = at::BFloat16(x); }
inline void store(at::Half* p, int64_t i, float x) { p[i] = at::Half(x); }

// q . k over N channels (N > 0: known at compile time, fully unrolled and vectorized; N == 0: n at run time)
template <int N, typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t n) {
  const int64_t len = N > 0 ? N : n;
  float s = 0.f;
  for (int64_t i = 0; i < len; ++i) s += q[i] * load(k, i);
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#define IG_AVX2 1
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {  // 8 bfloat16 -> float32: the bits shifted into the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::BFloat16* w) { return load8(reinterpret_cast<const uint16_t*>(w)); }
inline __m256 load8(const int8_t* w) {  // 8 int8 values -> float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// the 8 sums of a[0..7]'s lanes, as one vector [sum a0, ..., sum a7]
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // s0123: lanes 0-3 the sums of a0..a3's low halves, lanes 4-7 of their high halves; likewise s4567
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
// the 4 sums of a[0..3]'s lanes [sum a0, ..., sum a3], each in hsum8's order: ((01 + 23) + (45 + 67))
inline __m128 hsum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
// the same for 8 vectors of int32 lanes: [sum a0, ..., sum a7] (exact)
inline __m256i hsum8_epi32(const __m256i* a) {
  const __m256i s0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i s4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20), _mm256_permute2x128_si256(s0123, s4567, 0x31));
}
// rows of N (compile-time) elements of T that the vector paths handle: float32, bfloat16 or int8, N a multiple of 8
template <typename T, int N>
constexpr bool SIMD_ROWS = N > 0 && N % 8 == 0 &&
                           (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, int8_t>);
#endif

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * int64_t(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 3);
}

// exp(x) for x <= 0 (softmax after the max is subtracted), vectorizable: 2^(x log2 e) split into an
// integer power (exponent bits) and a degree-5 polynomial on [-0.5, 0.5]; relative error ~2e-7.
// Very negative x (and -inf) give 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  float t = x * 1.4426950408889634f;
  float fi = std::nearbyint(t);
  float f = t - fi;
  float p = 1.3333558e-3f;
  p = p * f + 9.6180375e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t e = int32_t(fi) + 127;
  e = e < 1 ? 0 : e;
  uint32_t bits = uint32_t(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// max of x[0, n): four chains of eight lanes (a single running max is a chain of dependent compares, one per
// compare's latency, that the compiler does not vectorize without -ffinite-math-only)
inline float max_of(const float* x, int64_t n) {
  int64_t t = 0;
  float m = NEG_INF;
#ifdef IG_AVX2
  if (n >= 8) {
    __m256 a = _mm256_loadu_ps(x), b = a, c = a, d = a;
    for (t = 8; t + 32 <= n; t += 32) {
      a = _mm256_max_ps(a, _mm256_loadu_ps(x + t));
      b = _mm256_max_ps(b, _mm256_loadu_ps(x + t + 8));
      c = _mm256_max_ps(c, _mm256_loadu_ps(x + t + 16));
      d = _mm256_max_ps(d, _mm256_loadu_ps(x + t + 24));
    }
    for (; t + 8 <= n; t += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(x + t));
    alignas(32) float l[8];
    _mm256_store_ps(l, _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d)));
    for (int j = 0; j < 8; ++j) m = std::max(m, l[j]);
  }
#else
  float m8[8] = {NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF};
  for (; t + 8 <= n; t += 8)
    for (int j = 0; j < 8; ++j) m8[j] = m8[j] > x[t + j] ? m8[j] : x[t + j];
  for (int j = 0; j < 8; ++j) m = std::max(m, m8[j]);
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// int8 partial keys: a row is p int8 values, then its float32 scale (absmax / 127) in 4 bytes (w = p + 4), so
// that every row operation (append, join, fork, gather) moves a row with its scale. The query is quantized the
// same way per head; a score is (q8 . k8) x k scale x q scale. The integer dot products are exact on every path
// (in float32 too, under 2^24 for p <= 1024), so the vector and plain paths give the same bits.
inline float quantize_row(const float* x, int64_t p, int8_t* q) {
  float m = 0.f;
  for (int64_t i = 0; i < p; ++i) m = std::max(m, std::fabs(x[i]));
  const float sc = m / 127.f;
  for (int64_t i = 0; i < p; ++i) q[i] = sc > 0.f ? int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / sc)))) : 0;
  return sc;
}

// A stored int8 row of x (p values): the values, then the scale's 4 bytes (p + 4 in all)
inline void pack_row(const float* x, int64_t p, int8_t* row) {
  const float sc = quantize_row(x, p, row);
  std::memcpy(row + p, &sc, 4);
}

inline float row_scale(const int8_t* row, int64_t p) {
  float sc;
  std::memcpy(&sc, row + p, 4);
  return sc;
}

// int8 K/V rows (kv_dtype "int8"), llama.cpp's q8_0 in a row: d values quantized in groups of KV_GROUP (the last one
// may be shorter) by the group's absmax / 127, that scale rounded to float16 first (the values are divided by the
// scale they are read back with), then the groups' scales as float16, 2 bytes each: kv_width(d) = d + 2 ceil(d / 32)
// (68 bytes for d = 64, q8_0's).
constexpr int64_t KV_GROUP = 32;
inline int64_t kv_groups(int64_t d) { return (d + KV_GROUP - 1) / KV_GROUP; }
inline int64_t kv_width(int64_t d) { return d + 2 * kv_groups(d); }

inline void pack_kv_row(const float* x, int64_t d, int8_t* row) {
  for (int64_t g = 0; g < kv_groups(d); ++g) {
    const int64_t a = g * KV_GROUP, b = std::min(d, a + KV_GROUP);
    float m = 0.f;
    for (int64_t i = a; i < b; ++i) m = std::max(m, std::fabs(x[i]));
    const at::Half h(std::min(m / 127.f, 65504.f));
    const float sc = static_cast<float>(h);
    for (int64_t i = a; i < b; ++i)
      row[i] = sc > 0.f ? int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / sc)))) : 0;
    std::memcpy(row + d + 2 * g, &h, 2);
  }
}

// the float16 at p as float32 (exact): one instruction with F16C, else c10's conversion
inline float half_at(const int8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(IG_AVX2) && defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  at::Half h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
#endif
}

// the float32 scales of a K/V row's groups into sc[0, kv_groups(d))
inline void kv_scales(const int8_t* row, int64_t d, float* sc) {
  for (int64_t g = 0; g < kv_groups(d); ++g) sc[g] = half_at(row + d + 2 * g);
}

inline void check_cpu_contig(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Head sizes and partial widths compiled for fixed sizes (the common ones); others run with sizes at run time.
template <typename F>
void dispatch_size(int64_t n, F&& f) {
  switch (n) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: f(std::integral_constant<int, 0>{});
  }
}

template <typename F>
void dispatch_storage(at::ScalarType st, F&& f) {
  if (st == at::kFloat) f(float{});
  else if (st == at::kBFloat16) f(at::BFloat16{});
  else if (st == at::kHalf) f(at::Half{});
  else TORCH_CHECK(false, "unsupported storage dtype ", st);
}

// K/V rows: the float storage above, or int8 rows with their groups' scales (pack_kv_row)
template <typename F>
void dispatch_rows(at::ScalarType st, F&& f) {
  if (st == at::kChar) f(int8_t{});
  else dispatch_storage(st, f);
}

}  // namespace
