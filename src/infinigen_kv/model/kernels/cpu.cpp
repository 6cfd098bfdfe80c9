// CPU kernels of the decode step, one pass over the bytes each needs.
//
// speculate: approximate scores of every pooled token from the partial query and partial keys (float32,
//   bfloat16, or int8 rows with a per-row scale scored by integer dot products), each head's logits relative
//   to its maximum, the heads of a KV group combined, the tokens within alpha counted and capped, and the
//   chosen slots written out. One read of the partial keys.
// attend: attention of a decode query over the chosen rows of the pool (or all of them), gathering
//   each K/V row where it lies: online softmax in float32, no copy of the working set.
//
// Shapes: B sequences, G KV heads, r query heads per KV head, p partial channels, d head size,
// cap rows allocated per (sequence, head) in the pool, n valid rows.
// Storage may be float32, bfloat16, float16 or int8 rows (q8_0 groups); arithmetic is float32 (attention over
// bfloat16 rows: AVX-512 float32 products of the widened rows, attend512.h), but for bfloat16 products of a decode
// step's rows and bfloat16 weights where the CPU has AVX-512 BF16 (bf16_dots.h).

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // (not torch/extension.h: its C++ frontend headers cost ~10 s of every build)
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

// max of x[0, n): eight independent lanes (a single running max is a chain of dependent compares that the
// compiler does not vectorize without -ffinite-math-only)
inline float max_of(const float* x, int64_t n) {
  int64_t t = 0;
  float m = NEG_INF;
#ifdef IG_AVX2
  if (n >= 8) {
    __m256 m8 = _mm256_loadu_ps(x);
    for (t = 8; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + t));
    alignas(32) float l[8];
    _mm256_store_ps(l, m8);
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

// ---------------------------------------------------------------------------------------------------
// speculate

constexpr int SELECT_BINS = 1024;  // histogram bins over (-alpha, 0] where the cap binds

#ifdef IG_AVX2
// For each 8-bit mask, the indices of its set bits, first to last (then zeros): a vector permutation that packs
// the lanes a comparison kept to the front (AVX2 has no compress instruction).
struct PackLanes {
  alignas(32) int32_t lanes[256][8];
  PackLanes() {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int i = 0; i < 8; ++i)
        if (m >> i & 1) lanes[m][j++] = i;
      for (; j < 8; ++j) lanes[m][j] = 0;
    }
  }
};
const PackLanes PACK;
#endif

// The positions t in [0, n) with x[t] > thr (x[t] >= thr if ge), in order, into out (room for n + 8); their count.
int64_t positions_above(const float* x, int64_t n, float thr, bool ge, uint32_t* out) {
  int64_t j = 0, t = 0;
#ifdef IG_AVX2
  const __m256 tv = _mm256_set1_ps(thr);
  for (; t + 8 <= n; t += 8) {
    const __m256 v = _mm256_loadu_ps(x + t);
    const int m = _mm256_movemask_ps(ge ? _mm256_cmp_ps(v, tv, _CMP_GE_OQ) : _mm256_cmp_ps(v, tv, _CMP_GT_OQ));
    const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(PACK.lanes[m]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_add_epi32(lanes, _mm256_set1_epi32(int32_t(t))));
    j += __builtin_popcount(m);
  }
#endif
  for (; t < n; ++t) {  // branchless: every position written, kept when above (j <= t)
    out[j] = uint32_t(t);
    j += ge ? x[t] >= thr : x[t] > thr;
  }
  return j;
}

// The values x[t] with bins[t] == b, in order, into out (room for n + 8); their count.
int64_t values_in_bin(const float* x, const uint32_t* bins, int64_t n, uint32_t b, float* out) {
  int64_t j = 0, t = 0;
#ifdef IG_AVX2
  const __m256i bv = _mm256_set1_epi32(int32_t(b));
  for (; t + 8 <= n; t += 8) {
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bins + t)), bv);
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(eq));
    const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(PACK.lanes[m]));
    _mm256_storeu_ps(out + j, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + t), lanes));
    j += __builtin_popcount(m);
  }
#endif
  for (; t < n; ++t) {
    out[j] = x[t];
    j += bins[t] == b;
  }
  return j;
}

// The bins of rel[0, n): within alpha (x > -alpha, so -x in [0, alpha)) bin min(-x SELECT_BINS / alpha, SELECT_BINS - 1),
// a monotone function of the value; SELECT_BINS for the others (NaN, -inf), which are not counted. Their histogram
// into hist[0, SELECT_BINS) (scratch: 2 (SELECT_BINS + 1)). Without branches (whether a token is within alpha is
// data, unpredictable): the bins 8 at a time, then the counts in two interleaved histograms, so that equal bins in
// a row do not wait on each other's increment.
void bin_values(const float* rel, int64_t n, float alpha, uint32_t* bins, int32_t* hist) {
  const float to_bin = float(SELECT_BINS) / alpha;
  int64_t t = 0;
#ifdef IG_AVX2
  const __m256 lo = _mm256_set1_ps(-alpha), sc = _mm256_set1_ps(to_bin), top = _mm256_set1_ps(float(SELECT_BINS - 1));
  const __m256i none = _mm256_set1_epi32(SELECT_BINS);
  for (; t + 8 <= n; t += 8) {
    const __m256 x = _mm256_loadu_ps(rel + t);
    const __m256 within = _mm256_cmp_ps(x, lo, _CMP_GT_OQ);
    const __m256 v = _mm256_min_ps(_mm256_mul_ps(_mm256_and_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), within), sc), top);
    const __m256i bin = _mm256_blendv_epi8(none, _mm256_cvttps_epi32(v), _mm256_castps_si256(within));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bins + t), bin);
  }
#endif
  for (; t < n; ++t) {
    const float x = rel[t];
    const bool within = x > -alpha;
    bins[t] = within ? uint32_t(std::min(-x * to_bin, float(SELECT_BINS - 1))) : uint32_t(SELECT_BINS);
  }
  int32_t* h0 = hist;
  int32_t* h1 = hist + SELECT_BINS + 1;
  std::fill(h0, h0 + 2 * (SELECT_BINS + 1), 0);
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    ++h0[bins[i]];
    ++h1[bins[i + 1]];
  }
  if (i < n) ++h0[bins[i]];
  for (int b = 0; b < SELECT_BINS; ++b) h0[b] += h1[b];
}

// scores s (r, n) of one (sequence, KV head) -> its chosen slots: each head's logits relative to its
// max (masked by kb), the group's heads combined, the tokens within alpha counted and capped at min(k, cap_row),
// the chosen slots written to out[0, c) in position order (slots [c, k) repeat out[0]); returns c.
// rel (n), bins (n + 8), hist (2 (SELECT_BINS + 1)) and cand (n + 8) are scratch.
int64_t select_row(float* s, int64_t r, int64_t n, const bool* kb, float alpha, int64_t k, int64_t cap_row,
                   bool mean, float* rel, uint32_t* bins, int32_t* hist, float* cand, float* mx, int64_t* out) {
  for (int64_t h = 0; h < r; ++h) {
    float* sh = s + h * n;
    if (kb)
      for (int64_t t = 0; t < n; ++t) sh[t] = kb[t] ? sh[t] : NEG_INF;
    mx[h] = max_of(sh, n);
  }
  // each head's logits relative to its max, the group's heads combined
  const float m0 = mx[0];
  if (mean) {
    for (int64_t t = 0; t < n; ++t) rel[t] = (s[t] - m0) / float(r);
    for (int64_t h = 1; h < r; ++h)
      for (int64_t t = 0; t < n; ++t) rel[t] += (s[h * n + t] - mx[h]) / float(r);
  } else {
    for (int64_t t = 0; t < n; ++t) rel[t] = s[t] - m0;
    for (int64_t h = 1; h < r; ++h) {
      const float* sh = s + h * n;
      const float m = mx[h];
      for (int64_t t = 0; t < n; ++t) rel[t] = std::max(rel[t], sh[t] - m);
    }
  }
  int32_t within32 = 0;  // int32 lanes: the counting pass vectorizes 8 wide
  for (int64_t t = 0; t < n; ++t) within32 += rel[t] > -alpha;
  const int64_t within = within32;
  int64_t c = std::min(within, k);
  if (cap_row >= 0) c = std::min(c, cap_row);
  if (c <= 0) {  // keep at least the row's best token
    c = 1;
    out[0] = std::max_element(rel, rel + n) - rel;
  } else if (c == within) {  // the cap does not bind: every token within alpha, in position order
    positions_above(rel, n, -alpha, false, bins);
    std::copy(bins, bins + c, out);
  } else {  // the cap binds: the c highest (ties: the oldest). A histogram of the values within alpha finds the
    // bin holding the c-th highest, whose few values give it exactly; then one pass in position order.
    // A bin is a monotone function of the value (equal values share one, a better bin holds higher values).
    bin_values(rel, n, alpha, bins, hist);
    int64_t above = 0;  // values in bins better than b
    uint32_t b = 0;
    while (above + hist[b] < c) above += hist[b++];
    const int64_t m = values_in_bin(rel, bins, n, b, cand);
    const int64_t need = c - above;  // the need-th highest of bin b is the c-th highest of the row
    std::nth_element(cand, cand + (need - 1), cand + m, std::greater<float>());
    const float v = cand[need - 1];
    int64_t at_least = above;  // values >= v
    for (int64_t i = 0; i < m; ++i) at_least += cand[i] >= v;
    if (at_least == c) {  // no tie at v to break: the values >= v
      positions_above(rel, n, v, true, bins);
    } else {  // more values equal v than fit: those above v and the oldest of those equal, in position order
      int64_t ties = c - (at_least - std::count(cand, cand + m, v)), j = 0;
      for (int64_t t = 0; t < n; ++t) {
        const float x = rel[t];
        const bool tie = x == v && ties > 0;
        bins[j] = uint32_t(t);
        j += x > v || tie;
        ties -= tie;
      }
    }
    std::copy(bins, bins + c, out);
  }
  for (int64_t j = c; j < k; ++j) out[j] = out[0];  // unused slots: a real row, masked by count
  return c;
}

// Scores s (r, n) of one row's partial keys kr (n rows of p) against its r scaled query heads qs (r, p):
// float32 / bfloat16 / float16 storage, float32 arithmetic.
template <typename T, int P>
void score_rows(const float* qs, const T* kr, int64_t r, int64_t p, int64_t n, float* s) {
  int64_t t0 = 0;
#ifdef IG_AVX2
  if constexpr (SIMD_ROWS<T, P>) {
    // 4 tokens at a time: each chunk of 8 channels of their rows loaded (and converted from bfloat16) once for up
    // to 3 heads of the group (12 accumulators), per head and token one vector of partial sums, reduced 4 at a
    // time (no per-token horizontal sum)
    auto heads = [&](auto nh_tag, const T* kt, int64_t h0, int64_t at, int64_t cnt) {
      constexpr int NH = decltype(nh_tag)::value;
      __m256 acc[NH][4];
      for (int c = 0; c < P; c += 8) {
        __m256 k[4];
        for (int j = 0; j < 4; ++j) k[j] = load8(kt + j * p + c);
        for (int h = 0; h < NH; ++h) {
          const __m256 qv = _mm256_loadu_ps(qs + (h0 + h) * p + c);
          for (int j = 0; j < 4; ++j) acc[h][j] = c == 0 ? _mm256_mul_ps(qv, k[j]) : _mm256_fmadd_ps(qv, k[j], acc[h][j]);
        }
      }
      for (int h = 0; h < NH; ++h) {
        alignas(16) float v[4];
        _mm_store_ps(v, hsum4(acc[h]));
        std::copy(v, v + cnt, s + (h0 + h) * n + at);
      }
    };
    auto block4 = [&](const T* kt, int64_t at, int64_t cnt) {
      int64_t h0 = 0;
      for (; h0 + 3 <= r; h0 += 3) heads(std::integral_constant<int, 3>{}, kt, h0, at, cnt);
      if (r - h0 == 2) heads(std::integral_constant<int, 2>{}, kt, h0, at, cnt);
      if (r - h0 == 1) heads(std::integral_constant<int, 1>{}, kt, h0, at, cnt);
    };
    for (; t0 + 4 <= n; t0 += 4) {
      prefetch_row(kr + (t0 + 32) * p, 4 * p);  // eight blocks ahead
      block4(kr + t0 * p, t0, 4);
    }
    if (t0 < n) {  // the last n % 4 tokens through the same arithmetic (zero rows after them), so that a
      // token's score does not depend on where it falls in the blocks (left padding shifts it)
      T tail[4 * P];
      std::memset(static_cast<void*>(tail), 0, sizeof(tail));
      std::memcpy(static_cast<void*>(tail), kr + t0 * p, (n - t0) * p * sizeof(T));
      block4(tail, t0, n - t0);
      t0 = n;
    }
  }
#endif
  for (int64_t t = t0; t < n; ++t) {
    const T* kt = kr + t * p;
    for (int64_t h = 0; h < r; ++h) s[h * n + t] = dot<P>(qs + h * p, kt, p);
  }
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define IG_VNNI512 1
// 16 tokens' 32-byte chunks (rows of stride w bytes from kt, at byte offset c0) as 8 vectors of 4-byte groups: T[c]
// lane j = bytes 4c..4c+3 of token j's chunk, each byte + 128 (unsigned, for dpbusd), tokens in order
inline void transpose16x8(const int8_t* kt, int64_t w, int64_t c0, __m512i* T) {
  __m512i z[8];  // z[i]: 128-bit lanes (a 0-3, b 0-3, a 4-7, b 4-7) of rows a, b (dwords): (i, i + 4), (8 + i, 12 + i)
  for (int i = 0; i < 8; ++i) {
    const int64_t a = i < 4 ? i : 4 + i, b = a + 4;
    const __m256i ra = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + a * w + c0));
    const __m256i rb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + b * w + c0));
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1);
    z[i] = _mm512_shuffle_i32x4(ab, ab, _MM_SHUFFLE(3, 1, 2, 0));
  }
  __m512i t[8], u[8];
  for (int g = 0; g < 2; ++g)  // per 128-bit lane, the 4 x 4 dword transpose of z[4g .. 4g + 3]
    for (int i = 0; i < 2; ++i) {
      t[4 * g + 2 * i] = _mm512_unpacklo_epi32(z[4 * g + 2 * i], z[4 * g + 2 * i + 1]);
      t[4 * g + 2 * i + 1] = _mm512_unpackhi_epi32(z[4 * g + 2 * i], z[4 * g + 2 * i + 1]);
    }
  for (int g = 0; g < 2; ++g) {  // u[4g + c'] lane L: dword c' (lanes 0, 1) or 4 + c' (lanes 2, 3) of 4 rows
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int c = 0; c < 4; ++c) {  // rows 0-7 from u[c], rows 8-15 from u[4 + c]
    T[c] = _mm512_xor_si512(_mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0)), flip);
    T[4 + c] = _mm512_xor_si512(_mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2)), flip);
  }
}
#endif

template <int P>
void score_rows_i8(const float* qs, const int8_t* kr, int64_t r, int64_t p, int64_t n, float* s) {
  const int64_t w = p + 4;
  std::vector<int8_t> q8(r * p);
  std::vector<float> sq(r);
  for (int64_t h = 0; h < r; ++h) sq[h] = quantize_row(qs + h * p, p, q8.data() + h * p);
  int64_t t0 = 0;
#ifdef IG_VNNI512
  if constexpr (P > 0 && P % 32 == 0) {
    // 16 tokens at a time, their rows transposed once into 4-byte groups for all r heads: per head P / 4 dpbusd of
    // a group of its query (broadcast) with 16 tokens' same group, no horizontal sum. dpbusd multiplies unsigned by
    // signed bytes: the keys + 128 times the query, less 128 x the query's sum: the same integers as below.
    std::vector<int32_t> qg(r * (P / 4)), corr(r);
    for (int64_t h = 0; h < r; ++h) {
      std::memcpy(qg.data() + h * (P / 4), q8.data() + h * p, P);
      int32_t total = 0;
      for (int64_t i = 0; i < P; ++i) total += q8[h * p + i];
      corr[h] = 128 * total;
    }
    alignas(64) float sc[16];
    __m512i T[P / 4];
    for (; t0 + 16 <= n; t0 += 16) {
      const int8_t* kt = kr + t0 * w;
      prefetch_row(kt + 32 * w, 16 * w);  // two blocks ahead
      for (int c = 0; c < P / 32; ++c) transpose16x8(kt, w, 32 * c, T + 8 * c);
      for (int j = 0; j < 16; ++j) sc[j] = row_scale(kt + j * w, P);
      const __m512 skv = _mm512_load_ps(sc);
      for (int64_t h = 0; h < r; ++h) {
        const int32_t* qh = qg.data() + h * (P / 4);
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), T[0], _mm512_set1_epi32(qh[0]));
        for (int c = 1; c < P / 4; ++c) acc = _mm512_dpbusd_epi32(acc, T[c], _mm512_set1_epi32(qh[c]));
        const __m512i dot = _mm512_sub_epi32(acc, _mm512_set1_epi32(corr[h]));
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), skv);
        _mm512_storeu_ps(s + h * n + t0, _mm512_mul_ps(v, _mm512_set1_ps(sq[h])));
      }
    }
  }
#endif
#ifdef IG_AVX2
  if constexpr (P > 0 && P % 32 == 0) {
    constexpr int C = P / 32;  // 32-byte chunks of a row
    std::vector<__m256i> qa(r * C), qv(r * C);  // per head: |q8| and q8, in chunks
    for (int64_t i = 0; i < r * C; ++i) {
      qv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8.data() + i * 32));
      qa[i] = _mm256_abs_epi8(qv[i]);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    // 8 tokens at a time: |q| x (k with q's sign) in unsigned x signed byte products summed in pairs (maddubs; at
    // most 2 x 127 x 127, no saturation), then in fours (madd), converted to float (exact) and reduced as the
    // float path does
    auto block8 = [&](const int8_t* kt, int64_t at, int64_t cnt) {
      alignas(32) float sc[8];
      for (int j = 0; j < 8; ++j) sc[j] = row_scale(kt + j * w, P);
      const __m256 skv = _mm256_load_ps(sc);
      for (int64_t h = 0; h < r; ++h) {
        __m256i acc[8];
        for (int j = 0; j < 8; ++j) {
          __m256i sum = _mm256_setzero_si256();
          for (int c = 0; c < C; ++c) {
            const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + j * w + c * 32));
            const __m256i prod = _mm256_maddubs_epi16(qa[h * C + c], _mm256_sign_epi8(k, qv[h * C + c]));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(prod, ones));
          }
          acc[j] = sum;
        }
        const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hsum8_epi32(acc)), skv), _mm256_set1_ps(sq[h]));
        if (cnt == 8) {
          _mm256_storeu_ps(s + h * n + at, v);
        } else {
          alignas(32) float o[8];
          _mm256_store_ps(o, v);
          std::copy(o, o + cnt, s + h * n + at);
        }
      }
    };
    for (; t0 + 8 <= n; t0 += 8) {
      prefetch_row(kr + (t0 + 32) * w, 8 * w);  // four blocks ahead
      block8(kr + t0 * w, t0, 8);
    }
    if (t0 < n) {  // the last n % 8 tokens (zero rows after them; exact, so only for the loads' sake)
      int8_t tail[8 * (P + 4)];
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, kr + t0 * w, (n - t0) * w);
      block8(tail, t0, n - t0);
      t0 = n;
    }
  }
#endif
  for (int64_t t = t0; t < n; ++t) {
    const int8_t* kt = kr + t * w;
    const float sk = row_scale(kt, p);
    for (int64_t h = 0; h < r; ++h) {
      const int8_t* qh = q8.data() + h * p;
      int32_t dot = 0;
      for (int64_t i = 0; i < p; ++i) dot += int32_t(qh[i]) * int32_t(kt[i]);
      s[h * n + t] = float(dot) * sk * sq[h];
    }
  }
}

// One pass per (sequence, KV head): its scores (score(qs, row's keys, s)), then select_row. w: elements per stored row.
template <typename T, typename Score>
void speculate_rows(const float* q, const T* kp, int64_t w, const bool* keep, int64_t keep_heads, const int64_t* caps,
                    int64_t B, int64_t G, int64_t r, int64_t p, int64_t cap, int64_t n, float scale,
                    float alpha, int64_t k, bool mean, int64_t* idx_out, int64_t* count_out, Score score) {
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(r * n), rel(n), cand(n + 8), qs(r * p), mx(r);
    std::vector<uint32_t> bins(n + 8);  // room for the vector stores past the last kept position
    std::vector<int32_t> hist(2 * (SELECT_BINS + 1));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / G, g = row % G;
      for (int64_t i = 0; i < r * p; ++i) qs[i] = q[row * r * p + i] * scale;
      score(qs.data(), kp + row * cap * w, s.data());  // one read of each token's row for all r heads of the group
      const bool* kb = keep ? keep + (b * keep_heads + (keep_heads > 1 ? g : 0)) * n : nullptr;
      count_out[row] = select_row(s.data(), r, n, kb, alpha, k, caps ? caps[row] : -1, mean, rel.data(), bins.data(),
                                  hist.data(), cand.data(), mx.data(), idx_out + row * k);
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// attend

// Tokens per chunk when `ntok` are cut into the fewest chunks of at most `most` of near-equal size, a multiple of 8
// (the vector width of the scores) up to the last.
inline int64_t even_chunk(int64_t ntok, int64_t most) {
  const int64_t chunks = std::max<int64_t>(1, (ntok + most - 1) / most);
  return ((ntok + chunks - 1) / chunks + 7) / 8 * 8;
}

template <typename T, typename O, int D>
void attend_impl(const float* q, const T* K, const T* V, const int64_t* idx, int64_t m, const int64_t* count,
                 const int64_t* new_rows, int64_t new_row, const bool* keep, int64_t keep_heads, int64_t n,
                 int64_t B, int64_t G, int64_t r, int64_t d, int64_t cap, float scale, bool pairs, O* out) {
  // Rows of (b, g): the new token's row first (when new_row >= 0 or new_rows), then idx[:count] (or 0..n-1).
  // int8 rows (I8): d values and their groups' float16 scales (rw = kv_width(d) elements a row): each group of 8
  // loaded values is multiplied by its scale, k's before the dot product, v's folded into the weight.
  constexpr bool I8 = std::is_same_v<T, int8_t>;
  const int64_t rw = I8 ? kv_width(d) : d, ng = I8 ? kv_groups(d) : 1;
  const int64_t rows = B * G;
  const bool has_new = new_rows != nullptr || new_row >= 0;
  const int64_t max_tokens = (idx ? m : n) + (has_new ? 1 : 0);
  // Each row's tokens are cut into chunks (flash-decoding: every thread has work) and merged in order: a whole
  // past into chunks of SPLIT counted from the row's first attendable token; chosen rows evenly into chunks of at
  // most SPLIT_ROWS (1,024 chosen + the new token: 5 x 208, not 512 + 512 + 1, so that 3 rows of a batch-1 step
  // share 2 threads 8:7, not 2:1). Either depends on the row's own tokens only: its result is the same bits
  // whatever else shares its batch (how many rows, how much left padding, how many chosen).
  const int64_t splits = std::max<int64_t>(1, (max_tokens + (idx ? SPLIT_ROWS : SPLIT) - 1) / (idx ? SPLIT_ROWS : SPLIT));
  const int64_t items = rows * splits;
  std::vector<int64_t> first(rows, 0);  // dense rows: the first position keep allows (left padding skipped)
  if (!idx && keep)
    for (int64_t row = 0; row < rows; ++row) {
      const bool* kb = keep + ((row / G) * keep_heads + (keep_heads > 1 ? row % G : 0)) * n;
      while (first[row] < n && !kb[first[row]]) ++first[row];
    }
  std::vector<float> part_m(items * r), part_l(items * r), part_acc(items * r * d);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(r * BLOCK);
    std::vector<int64_t> blk(BLOCK);
    std::vector<char> mask(BLOCK);
    std::vector<float> ks(BLOCK * ng, 1.f), vs(BLOCK * ng, 1.f);  // int8 rows' group scales, token by token
#ifdef IG_ATTEND512
    constexpr bool WIDE = std::is_same_v<T, at::BFloat16> && D > 0 && D % 64 == 0;  // attend512.h's rows
    std::vector<float> qp(WIDE ? r * D : 0), kf(WIDE ? 16 * D : 0);  // the query in widen's order; 16 rows transposed
#endif
#ifdef IG_BF16_DOTS
    std::vector<uint16_t> qb(WIDE && pairs ? r * D : 0), pb(WIDE && pairs ? r * (BLOCK + 16) : 0);
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / splits, sp = item % splits;
      const int64_t b = row / G, g = row % G;
      const int64_t f0 = first[row];
      const int64_t ntok = (idx ? std::min(m, count ? count[row] : m) : n - f0) + (has_new ? 1 : 0);
      const int64_t chunk = idx ? even_chunk(ntok, SPLIT_ROWS) : SPLIT;
      const int64_t t0 = sp * chunk, t1 = std::min(ntok, t0 + chunk);
      const float* qr = q + row * r * d;
      const T* Kr = K + row * cap * rw;
      const T* Vr = V + row * cap * rw;
      const bool* kb = keep ? keep + (b * keep_heads + (keep_heads > 1 ? g : 0)) * n : nullptr;
      float* M = part_m.data() + item * r;
      float* L = part_l.data() + item * r;
      float* A = part_acc.data() + item * r * d;
      std::fill(M, M + r, NEG_INF);
      std::fill(L, L + r, 0.f);
      std::fill(A, A + r * d, 0.f);
#ifdef IG_BF16_DOTS
      const bool dots = WIDE && pairs && ntok >= bf16dots::LONG_ROWS;  // the row's own length: batch-invariant
      if (dots) bf16dots::round_rows(qr, r * d, qb.data());
#else
      constexpr bool dots = false;
#endif
#ifdef IG_ATTEND512
      if constexpr (WIDE)
        if (!dots && r <= 2) attend512::deinterleave(qr, r * D, qp.data());
#endif
      auto position = [&](int64_t t) {  // the pool row of the item's t-th token
        if (has_new && t == 0) return new_rows ? new_rows[row] : new_row;
        const int64_t u = has_new ? t - 1 : t;
        return idx ? idx[row * m + u] : f0 + u;
      };
      // scattered rows: all of a block's K and V lines asked for at once (memory-level parallelism), the next
      // block's while this one is computed
      auto prefetch_block = [&](int64_t from) {
        for (int64_t t = from; t < std::min(t1, from + BLOCK); ++t) {
          const int64_t pos = position(t);
          prefetch_row(Kr + pos * rw, rw);
          prefetch_row(Vr + pos * rw, rw);
        }
      };
      if (idx) prefetch_block(t0);
      for (int64_t tb = t0; tb < t1; tb += BLOCK) {
        const int64_t nb = std::min<int64_t>(BLOCK, t1 - tb);
        if (idx) prefetch_block(tb + BLOCK);
        if (!idx && !has_new)  // the whole past, rows in order
          for (int64_t j = 0; j < nb; ++j) {
            blk[j] = f0 + tb + j;
            mask[j] = !kb || kb[f0 + tb + j];
          }
        else
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t pos = position(tb + j);
            blk[j] = pos;
            mask[j] = (has_new && tb + j == 0) || idx || !kb || kb[pos];  // (the new row may lie past keep)
          }
        if constexpr (I8)
          for (int64_t j = 0; j < nb; ++j) {
            kv_scales(Kr + blk[j] * rw, d, ks.data() + j * ng);
            kv_scales(Vr + blk[j] * rw, d, vs.data() + j * ng);
          }
        int64_t j0 = 0;
#ifdef IG_ATTEND512
        if constexpr (WIDE)
          for (; j0 + 16 <= nb; j0 += 16) {
            // the whole past: the 16 rows after the next 16 asked for while these are scored (chosen rows: their
            // blocks are asked for a block ahead)
            const int64_t ahead = blk[j0 + 15] + 17;
            const bool pre = !idx && ahead + 16 <= n;
            const auto* ka = pre ? reinterpret_cast<const char*>(Kr + ahead * rw) : nullptr;
            const auto* va = pre ? reinterpret_cast<const char*>(Vr + ahead * rw) : nullptr;
            const auto* Kb = reinterpret_cast<const uint16_t*>(Kr);
#ifdef IG_BF16_DOTS
            if (dots) {
              bf16dots::scores16<D>(qb.data(), r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, ka, va,
                                    16 * rw * 2);
              continue;
            }
#endif
            if (r > 2)
              attend512::scores16_transposed<D>(qr, r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, kf.data(),
                                                ka, va);
            else
              attend512::scores16<D>(qp.data(), r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, ka, va,
                                     16 * rw * 2);
          }
#endif
#ifdef IG_AVX2
        if constexpr (SIMD_ROWS<T, D>) {  // 8 tokens at a time per head: no per-token horizontal sum
          for (; j0 + 8 <= nb; j0 += 8)
            for (int64_t h = 0; h < r; ++h) {
              const float* qh = qr + h * D;
              __m256 acc[8];
              // K's 8 values at channel c of token j (int8: times their group's scale)
              auto kload = [&](int j, int c) {
                const __m256 k = load8(Kr + blk[j0 + j] * rw + c);
                if constexpr (I8) return _mm256_mul_ps(k, _mm256_set1_ps(ks[(j0 + j) * ng + c / KV_GROUP]));
                else return k;
              };
              for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), kload(j, 0));
              for (int c = 8; c < D; c += 8)
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), kload(j, c), acc[j]);
              _mm256_storeu_ps(s.data() + h * BLOCK + j0, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
            }
          for (int64_t j = 0; j < j0; ++j)
            if (!mask[j])
              for (int64_t h = 0; h < r; ++h) s[h * BLOCK + j] = NEG_INF;
        }
#endif
        for (int64_t j = j0; j < nb; ++j) {
          const T* kt = Kr + blk[j] * rw;
          for (int64_t h = 0; h < r; ++h) {
            float dt;
            if constexpr (I8) {
              dt = 0.f;
              for (int64_t i = 0; i < d; ++i) dt += qr[h * d + i] * (load(kt, i) * ks[j * ng + i / KV_GROUP]);
            } else {
              dt = dot<D>(qr + h * d, kt, d);
            }
            s[h * BLOCK + j] = mask[j] ? dt * scale : NEG_INF;
          }
        }
        for (int64_t h = 0; h < r; ++h) {
          float* sh = s.data() + h * BLOCK;
#ifdef IG_ATTEND512
          const float mnew = attend512::max_of(sh, nb, M[h]);
#else
          const float mnew = std::max(M[h], max_of(sh, nb));
#endif
          if (mnew == NEG_INF) {  // nothing attendable yet
            for (int64_t j = 0; j < nb; ++j) sh[j] = 0.f;
            continue;
          }
          const float corr = exp_neg(M[h] - mnew);
#ifdef IG_ATTEND512
          const float l = attend512::exp_sum(sh, nb, mnew);
#else
          float l = 0.f;
          for (int64_t j = 0; j < nb; ++j) {
            sh[j] = exp_neg(sh[j] - mnew);
            l += sh[j];
          }
#endif
          L[h] = L[h] * corr + l;
          M[h] = mnew;
          if (corr != 1.f) {
            float* a = A + h * d;
            for (int64_t i = 0; i < d; ++i) a[i] *= corr;
          }
        }
#ifdef IG_BF16_DOTS
        if constexpr (WIDE)
          if (dots) {
            bf16dots::values<D>(s.data(), BLOCK, r, nb, reinterpret_cast<const uint16_t*>(Vr), rw, blk.data(), A,
                                pb.data());
            continue;
          }
#endif
#ifdef IG_ATTEND512
        if constexpr (WIDE) {
          attend512::values<D>(s.data(), BLOCK, r, nb, reinterpret_cast<const uint16_t*>(Vr), rw, blk.data(), A);
          continue;
        }
#endif
#ifdef IG_AVX2
        if constexpr (SIMD_ROWS<T, D>) {  // per head, up to 64 output channels held in registers over the block
          constexpr int C = D / 8 < 8 ? D / 8 : 8;
          for (int64_t h = 0; h < r; ++h)
            for (int i0 = 0; i0 < D; i0 += 8 * C) {
              float* a = A + h * D + i0;
              __m256 acc[C];
              for (int u = 0; u < C; ++u) acc[u] = _mm256_loadu_ps(a + 8 * u);
              for (int64_t j = 0; j < nb; ++j) {
                const float p = s[h * BLOCK + j];
                const T* vt = Vr + blk[j] * rw + i0;
                for (int u = 0; u < C; ++u) {
                  const float w = I8 ? p * vs[j * ng + (i0 + 8 * u) / KV_GROUP] : p;
                  acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(w), load8(vt + 8 * u), acc[u]);
                }
              }
              for (int u = 0; u < C; ++u) _mm256_storeu_ps(a + 8 * u, acc[u]);
            }
          continue;
        }
#endif
        for (int64_t j = 0; j < nb; ++j) {
          const T* vt = Vr + blk[j] * rw;
          for (int64_t h = 0; h < r; ++h) {
            const float w = s[h * BLOCK + j];
            float* a = A + h * d;
            for (int64_t i = 0; i < (D > 0 ? D : d); ++i) a[i] += (I8 ? w * vs[j * ng + i / KV_GROUP] : w) * load(vt, i);
          }
        }
      }
    }
  });

  // merge the splits of each row
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t h = 0; h < r; ++h) {
      float mx = NEG_INF;
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, part_m[(row * splits + sp) * r + h]);
      float l = 0.f;
      std::vector<float> acc(d, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t it = row * splits + sp;
        const float mi = part_m[it * r + h];
        if (mi == NEG_INF) continue;
        const float w = exp_neg(mi - mx);
        l += w * part_l[it * r + h];
        const float* a = part_acc.data() + (it * r + h) * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * a[i];
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      O* o = out + (row * r + h) * d;
      for (int64_t i = 0; i < d; ++i) store(o, i, acc[i] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// linear: y (R, out) = x (R, in) W^T + bias for a few rows R (a decode step), W float32, bfloat16 or int8 rows.
// A decode step's linears are bound by reading W: each weight row is streamed from memory once for all R
// rows (blocks of up to 4 rows share each load; further blocks find the row in L1). The CPU BLAS reaches
// 10-20 GB/s on these shapes with cold weights; this loop runs near the machine's read bandwidth.

// int8 weights: a weight row is a K/V row's q8_0 layout (kv_width(in) bytes: in values in groups of 32, then the
// groups' float16 scales), read by integer products. The activations are made int8 once per call (QuantizedX8, as
// llama.cpp's q8_0 x q8_0): each row's groups of 32 by their absmax / 127, with each group's integer sum. A group's
// 32 products are summed exactly in int32, converted to float once, times the weight's and the activation's scales;
// eight groups' sums are reduced into one vector and scaled at once. The integers are the same on every path:
// VNNI-512 multiplies the weights + 128 (unsigned) by the activations with dpbusd, two groups an instruction, and takes
// 128 x the activations' sum back out; AVX2 multiplies |w| by the activations signed as w (maddubs: a pair at most
// 2 x 128 x 127, no saturation). Every row of a call the same way.
struct QuantizedX8 {
  int64_t ng, pad;  // groups a row, values a row padded to whole groups (zeros)
  std::vector<int8_t> q;  // (R, pad)
  std::vector<float> s, sum;  // (R, ng): a group's scale, and its values' sum as quantized (scale x isum)
  std::vector<int32_t> isum;  // (R, ng): the sum of a group's int8 values
  QuantizedX8(const float* x, int64_t R, int64_t in)
      : ng(kv_groups(in)), pad(kv_groups(in) * KV_GROUP), q(R * pad, 0), s(R * ng), sum(R * ng), isum(R * ng) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < ng; ++g) {
        const float* xg = x + r * in + g * KV_GROUP;
        const int64_t len = std::min(KV_GROUP, in - g * KV_GROUP);
        int8_t* qg = q.data() + r * pad + g * KV_GROUP;
        int32_t total = 0;
        float m = 0.f;
#ifdef IG_AVX2  // the scalar loop's arithmetic, 8 lanes at a time (cvtps rounds to nearest even, as nearbyint)
        if (len == KV_GROUP) {
          __m256 v[4], a = _mm256_setzero_ps();
          const __m256 sign = _mm256_set1_ps(-0.f);
          for (int k = 0; k < 4; ++k) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[k] = _mm256_loadu_ps(xg + 8 * k)));
          __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
          h = _mm_max_ps(h, _mm_movehl_ps(h, h));
          m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
          const float inv = m > 0.f ? 127.f / m : 0.f;
          const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
          __m256i n[4], t = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            n[k] = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_mul_ps(v[k], vi))));
            t = _mm256_add_epi32(t, n[k]);
          }
          const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg),
                              _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
          __m128i ts = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
          ts = _mm_add_epi32(ts, _mm_shuffle_epi32(ts, _MM_SHUFFLE(1, 0, 3, 2)));
          total = _mm_cvtsi128_si32(_mm_add_epi32(ts, _mm_shuffle_epi32(ts, _MM_SHUFFLE(2, 3, 0, 1))));
        } else
#endif
        {
          for (int64_t i = 0; i < len; ++i) m = std::max(m, std::fabs(xg[i]));
          const float inv = m > 0.f ? 127.f / m : 0.f;
          for (int64_t i = 0; i < len; ++i) {
            qg[i] = int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(xg[i] * inv))));
            total += qg[i];
          }
        }
        const float sc = m / 127.f;
        s[r * ng + g] = sc;
        isum[r * ng + g] = total;
        sum[r * ng + g] = sc * float(total);
      }
  }
};

#ifdef IG_AVX2
// 8 int32 lanes of sums of u[i] s[i] (u unsigned bytes, s signed), each lane four neighbouring products
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#ifdef IG_VNNI512
// Lane spreads of eight groups' scales (a __m256 of them, cast to __m512) for the k-th 512-bit product of two groups
// (lanes 0-7 group 2k's sums, 8-15 group 2k + 1's): 8 lanes of group 2k's scale, then 8 of group 2k + 1's. A row's
// products scaled lane by lane this way are summed across lanes once a row, not every eight groups.
inline __m512 pair_scales(__m512 sc, int k) {
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * k)), sc);
}
// [sum of group 0's lanes, ..., group 7's] (exact) from z[k]: lanes 0-7 group 2k's, lanes 8-15 group 2k + 1's
inline __m256i group_sums8(const __m512i* z) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi64(z[0], z[1]), _mm512_unpackhi_epi64(z[0], z[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi64(z[2], z[3]), _mm512_unpackhi_epi64(z[2], z[3]));
  const __m512i u = _mm512_unpacklo_epi32(s01, s23), v = _mm512_unpackhi_epi32(s01, s23);
  // per 128-bit lane: the sums of that lane's four dwords of z[0], z[2], z[1], z[3]
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(u, v), _mm512_unpackhi_epi64(u, v));
  const __m512i first = _mm512_setr_epi32(0, 8, 2, 10, 1, 9, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);  // a group's first lane
  const __m512i second = _mm512_setr_epi32(4, 12, 6, 14, 5, 13, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0);  // and its second
  return _mm512_castsi512_si256(
      _mm512_add_epi32(_mm512_permutexvar_epi32(first, t), _mm512_permutexvar_epi32(second, t)));
}
#endif

#ifndef Q8_AHEAD
#define Q8_AHEAD 2048  // bytes of the weight rows read ahead of the products (a call's rows lie one after another)
#endif

// y[b * ldy] = x[b] . w for RB rows of int8 activations (row b's values at xq + b pad, its groups' scales and integer
// sums at xs + b ng, xi + b ng)
template <int RB>
inline void rows_dot_q8(const int8_t* __restrict w, const int8_t* __restrict xq, const float* __restrict xs,
                        const int32_t* __restrict xi, int64_t in, int64_t pad, float* y, int64_t ldy) {
  const int64_t ng = kv_groups(in);
  float sum[RB] = {};
#ifdef IG_AVX2
  __m256 acc[RB][2];  // two chains a row: groups eight at a time, then one at a time
  for (int b = 0; b < RB; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; (g + 8) * KV_GROUP <= in; g += 8) {  // eight whole groups: their dot products as one vector, scaled at once
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + in + 2 * g)));
    const int8_t* wg = w + g * KV_GROUP;
    for (int k = 0; k < 4; ++k)  // the weights read ahead
      _mm_prefetch(reinterpret_cast<const char*>(wg + Q8_AHEAD + 64 * k), _MM_HINT_T0);
#ifdef IG_VNNI512  // two groups a product: the weights + 128 as unsigned bytes (w xor 0x80)
    __m512i wv[4];
    for (int k = 0; k < 4; ++k)
      wv[k] = _mm512_xor_si512(_mm512_loadu_si512(wg + 2 * k * KV_GROUP), _mm512_set1_epi8(char(0x80)));
#else  // a group a product: |w|, and the activations signed as w (sign_epi8)
    __m256i wv[8];
    for (int k = 0; k < 8; ++k) wv[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + k * KV_GROUP));
    __m256i wa[8];
    for (int k = 0; k < 8; ++k) wa[k] = _mm256_abs_epi8(wv[k]);
#endif
    for (int b = 0; b < RB; ++b) {
      const int8_t* xg = xq + b * pad + g * KV_GROUP;
#ifdef IG_VNNI512
      __m512i p[4];
      for (int k = 0; k < 4; ++k)
        p[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[k], _mm512_loadu_si512(xg + 2 * k * KV_GROUP));
      const __m256i bias = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + b * ng + g)), 7);
      const __m256i isums = _mm256_sub_epi32(group_sums8(p), bias);  // the 8 groups' sums of w xq
#else
      __m256i p[8];
      for (int k = 0; k < 8; ++k)
        p[k] = dot_u8s8(wa[k], _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + k * KV_GROUP)),
                                                wv[k]));
      const __m256i isums = hsum8_epi32(p);  // the 8 groups' sums of w xq
#endif
      acc[b][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isums), _mm256_mul_ps(ws, _mm256_loadu_ps(xs + b * ng + g)),
                                  acc[b][0]);
    }
  }
  for (; g < ng; ++g) {
    const int8_t* wg = w + g * KV_GROUP;
    alignas(32) int8_t tail[KV_GROUP];
    if ((g + 1) * KV_GROUP > in) {  // a last, shorter group: its values, zeros after (the row's scales follow)
      std::memset(tail, 0, KV_GROUP);
      std::memcpy(tail, wg, in - g * KV_GROUP);
      wg = tail;
    }
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg)), wa = _mm256_abs_epi8(wv);
    const float ws = half_at(w + in + 2 * g);
    for (int b = 0; b < RB; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * pad + g * KV_GROUP));
      const __m256i p = dot_u8s8(wa, _mm256_sign_epi8(xv, wv));
      acc[b][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ws * xs[b * ng + g]), acc[b][g & 1]);
    }
  }
  for (int b = 0; b < RB; ++b) sum[b] = hsum(_mm256_add_ps(acc[b][0], acc[b][1]));
#else
  for (int64_t g = 0; g < ng; ++g) {
    const float ws = half_at(w + in + 2 * g);
    for (int b = 0; b < RB; ++b) {
      int32_t dot = 0;
      for (int64_t i = g * KV_GROUP; i < std::min(in, (g + 1) * KV_GROUP); ++i) dot += int32_t(w[i]) * xq[b * pad + i];
      sum[b] += float(dot) * (ws * xs[b * ng + g]);
    }
  }
#endif
  for (int b = 0; b < RB; ++b) y[b * ldy] = sum[b];
}

// y[b * ldy] = x[b] . w for the RB rows of x starting at x (row stride in)
template <int RB, typename W>
inline void rows_dot(const W* __restrict w, const float* __restrict x, int64_t in, float* y, int64_t ldy) {
  int64_t i = 0;
  float sum[RB] = {};
#ifdef IG_AVX2
  static_assert(RB <= 4, "2 x RB accumulators must fit the 16 registers");
  constexpr int U = 2;  // independent chains per row, the same for every RB: a row's sum does not depend on RB
  __m256 acc[RB][U];
  for (int b = 0; b < RB; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = _mm256_setzero_ps();
  for (; i + 8 * U <= in; i += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 wv = load8(w + i + 8 * u);
      for (int b = 0; b < RB; ++b) acc[b][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * in + i + 8 * u), acc[b][u]);
    }
  }
  for (int b = 0; b < RB; ++b) {
    __m256 a = acc[b][0];
    for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[b][u]);
    sum[b] = hsum(a);
  }
#endif
  for (; i < in; ++i) {
    const float wi = load(w, i);
    for (int b = 0; b < RB; ++b) sum[b] += wi * x[b * in + i];
  }
  for (int b = 0; b < RB; ++b) y[b * ldy] = sum[b];
}

// ---------------------------------------------------------------------------------------------------
// int4 rows (weights "int4", model/int4_rows.py): q4_1 groups of 32 laid out as a row: in / 2 bytes of levels (group
// g's 16 bytes: byte j = q[j] | q[j + 16] << 4), then the groups' float16 scales d, then their float16 minimums m; a
// weight is d q + m with q in [0, 15]. Decode products: the activations quantized once a call to int8 in groups of
// 32 (scale sx = absmax / 127, as llama.cpp's q8_1), with each group's sum sx sum(xq); a group's dot product is then
// d sx sum(q xq) + m sx sum(xq). The 32 products u8 x s8 are summed exactly in int32: VNNI's dpbusd where the CPU
// has it, else maddubs (pairs at most 2 x 15 x 127: no saturation) and madd, the same integers either way.
constexpr int64_t Q4_GROUP = 32;
#ifndef Q4_AHEAD
#define Q4_AHEAD 1536
#endif
inline int64_t q4_width(int64_t in) { return in / 2 + 4 * (in / Q4_GROUP); }

#ifdef IG_AVX2
// a group's 32 levels from its 16 bytes, in order: q[0..15] (low nibbles), q[16..31] (high nibbles)
inline __m256i q4_levels(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}
#endif

#ifdef IG_VNNI512
// Two groups' levels from their 32 bytes, as one vector laid out as their activations are: 128-bit lanes (q[0..15],
// q[16..31]) of the first group, then of the second
inline __m512i q4_levels2(const uint8_t* p) {
  const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // a b a b
  const __m512i s = _mm512_shuffle_i32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0));  // a a b b
  return _mm512_and_si512(_mm512_mask_srli_epi16(s, 0xFF00FF00u, s, 4), _mm512_set1_epi8(0x0F));  // high nibbles in 1, 3
}
#endif

// y[b * ldy] = x[b] . w for RB rows of quantized activations (row b's values at xq + b in, its groups' scales and sums
// at xs + b ng, xsum + b ng)
template <int RB>
inline void rows_dot_q4(const uint8_t* __restrict w, const int8_t* __restrict xq, const float* __restrict xs,
                        const float* __restrict xsum, int64_t in, float* y, int64_t ldy) {
  const int64_t ng = in / Q4_GROUP;
  const int8_t* d = reinterpret_cast<const int8_t*>(w + in / 2);
  const int8_t* m = d + 2 * ng;
  float sum[RB] = {}, mins[RB] = {};
#ifdef IG_AVX2
  // the next row's scales and minimums, read from its first group on, while its levels stream in order behind them
  for (int64_t i = 0; i < 4 * ng; i += 64) _mm_prefetch(reinterpret_cast<const char*>(d + q4_width(in) + i), _MM_HINT_T0);
  __m256 acc[RB], accm[RB];
  for (int b = 0; b < RB; ++b) acc[b] = accm[b] = _mm256_setzero_ps();
#ifdef IG_VNNI512
  __m512 acc16[RB];  // lane by lane: pair_scales
  for (int b = 0; b < RB; ++b) acc16[b] = _mm512_setzero_ps();
#endif
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) {  // eight groups: their integer dot products scaled by their groups' scales
    _mm_prefetch(reinterpret_cast<const char*>(w + g * (Q4_GROUP / 2) + Q4_AHEAD), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + g * (Q4_GROUP / 2) + Q4_AHEAD + 64), _MM_HINT_T0);
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 2 * g)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 2 * g)));
#ifdef IG_VNNI512  // two groups a 512-bit product: half the instructions, the same integer sums
    __m512i wv[4];
    for (int k = 0; k < 4; ++k) wv[k] = q4_levels2(w + (g + 2 * k) * (Q4_GROUP / 2));
#else
    __m256i wv[8];
    for (int k = 0; k < 8; ++k) wv[k] = q4_levels(w + (g + k) * (Q4_GROUP / 2));
#endif
    for (int b = 0; b < RB; ++b) {
#ifdef IG_VNNI512
      const int8_t* xg = xq + b * in + g * Q4_GROUP;
      const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_loadu_ps(xs + b * ng + g)));
      for (int k = 0; k < 4; ++k) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[k], _mm512_loadu_si512(xg + 2 * k * Q4_GROUP));
        acc16[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_scales(sc, k), acc16[b]);
      }
#else
      const __m256i* xg = reinterpret_cast<const __m256i*>(xq + b * in + g * Q4_GROUP);
      __m256i p[8];
      for (int k = 0; k < 8; ++k) p[k] = dot_u8s8(wv[k], _mm256_loadu_si256(xg + k));
      const __m256 dots = _mm256_cvtepi32_ps(hsum8_epi32(p));  // the 8 groups' sums of q xq
      acc[b] = _mm256_fmadd_ps(dots, _mm256_mul_ps(dv, _mm256_loadu_ps(xs + b * ng + g)), acc[b]);
#endif
      accm[b] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + b * ng + g), accm[b]);
    }
  }
  for (; g < ng; ++g) {  // the last groups one at a time
    const __m256i wv = q4_levels(w + g * (Q4_GROUP / 2));
    const float dg = half_at(d + 2 * g), mg = half_at(m + 2 * g);
    for (int b = 0; b < RB; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * in + g * Q4_GROUP));
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wv, xv)), _mm256_set1_ps(dg * xs[b * ng + g]), acc[b]);
      mins[b] += mg * xsum[b * ng + g];
    }
  }
#ifdef IG_VNNI512
  for (int b = 0; b < RB; ++b)
    acc[b] = _mm256_add_ps(acc[b],
                           _mm256_add_ps(_mm512_castps512_ps256(acc16[b]), _mm512_extractf32x8_ps(acc16[b], 1)));
#endif
  for (int b = 0; b < RB; ++b) sum[b] = hsum(acc[b]) + hsum(accm[b]) + mins[b];
#else
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * (Q4_GROUP / 2);
    const float dg = half_at(d + 2 * g), mg = half_at(m + 2 * g);
    for (int b = 0; b < RB; ++b) {
      const int8_t* xg = xq + b * in + g * Q4_GROUP;
      int32_t dot = 0;
      for (int64_t j = 0; j < Q4_GROUP / 2; ++j)
        dot += int32_t(wg[j] & 0x0F) * xg[j] + int32_t(wg[j] >> 4) * xg[j + Q4_GROUP / 2];
      sum[b] += float(dot) * (dg * xs[b * ng + g]);
      mins[b] += mg * xsum[b * ng + g];
    }
  }
  for (int b = 0; b < RB; ++b) sum[b] += mins[b];
#endif
  for (int b = 0; b < RB; ++b) y[b * ldy] = sum[b];
}

// int4 tiles: the held form keeps its first 16 floor(out / 16) rows as tiles of 16 rows (model/int4_rows.py), the rest
// as rows. A tile's group g (of ng) takes 320 bytes: four 64-byte chunks (chunk c: bytes 4o..4o+3 hold row o's levels
// q[4c..4c+3] in their low nibbles and q[16+4c..16+4c+3] in their high ones), then the 16 rows' float16 scales d, then
// their minimums m. A 512-bit dpbusd of a chunk's nibbles with four activations broadcast is then one step of 16 rows'
// dot products, lane by lane: no lanes summed across, each group's scale one vector of 16 rows, the levels unpacked
// once for every row of x (in rows, each (row, group) paid a conversion, a permute and a multiply-add).
// int5 tiles (model/int5_rows.py): the same chunks of low nibbles, then 64 bytes of fifth bits (row o's dword at 4o:
// q[4c+j]'s bit at bit c of byte j, q[16+4c+j]'s at bit 4+c), then the scales and minimums: 384 bytes a group. Chunk
// c's fifth bits are that dword shifted by 4 - c (low nibbles) or c (high ones) and masked with 0x10 a byte.
constexpr int64_t Q4_TILE = 16, Q4_TILE_GROUP = 320, Q5_TILE_GROUP = 384;
template <int BITS>
constexpr int64_t tile_group_bytes() { return BITS == 5 ? Q5_TILE_GROUP : Q4_TILE_GROUP; }
template <int BITS>
constexpr int64_t tile_scales_at() { return BITS == 5 ? 320 : 256; }  // a group's scales; its minimums 32 bytes on
inline int64_t q5_width(int64_t in) { return in * 3 / 4; }

#ifdef IG_AVX2
// the lines of a tile's group Q4_AHEAD bytes ahead of tg, asked for now
template <int BITS = 4>
inline void prefetch_tile_group(const uint8_t* tg) {
  for (int k = 0; k < tile_group_bytes<BITS>(); k += 64)
    _mm_prefetch(reinterpret_cast<const char*>(tg + Q4_AHEAD + k), _MM_HINT_T0);
}
#endif

// y[b * ldy + o] (o < 16) = x[b] . (row o of the tile at t) for RB rows of quantized activations (row b's values at
// xq + b in, its groups' scales and sums at xs + b ng, xsum + b ng). Per lane: the group's exact integer dot, then
// acc = fma(float(dot), d sx, acc) and accm = fma(m, xsum, accm) group by group, y = acc + accm: the same bits on every
// path (512-bit, 256-bit, scalar). BITS 4: int4 tiles; 5: int5 tiles (the fifth bits ORed into the levels).
template <int RB, int BITS = 4>
inline void tile_dot_q(const uint8_t* __restrict t, const int8_t* __restrict xq, const float* __restrict xs,
                       const float* __restrict xsum, int64_t in, float* y, int64_t ldy) {
  const int64_t ng = in / Q4_GROUP;
  constexpr int64_t TG = tile_group_bytes<BITS>(), SC = tile_scales_at<BITS>();
#ifdef IG_VNNI512
  __m512 acc[RB], accm[RB];
  for (int b = 0; b < RB; ++b) acc[b] = accm[b] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* tg = t + g * TG;
    prefetch_tile_group<BITS>(tg);
    __m512i lv[8];  // lv[c]: q[4c..4c+3] of the 16 rows, lv[4 + c]: q[16+4c..16+4c+3]
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(tg + 64 * c);
      lv[c] = _mm512_and_si512(v, low);
      lv[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (BITS == 5) {
      const __m512i h = _mm512_loadu_si512(tg + 256), five = _mm512_set1_epi8(0x10);
      // lv | (shifted & 0x10): ternary logic A | (B & C)
      lv[0] = _mm512_ternarylogic_epi32(lv[0], _mm512_slli_epi32(h, 4), five, 0xF8);
      lv[1] = _mm512_ternarylogic_epi32(lv[1], _mm512_slli_epi32(h, 3), five, 0xF8);
      lv[2] = _mm512_ternarylogic_epi32(lv[2], _mm512_slli_epi32(h, 2), five, 0xF8);
      lv[3] = _mm512_ternarylogic_epi32(lv[3], _mm512_slli_epi32(h, 1), five, 0xF8);
      lv[4] = _mm512_ternarylogic_epi32(lv[4], h, five, 0xF8);
      lv[5] = _mm512_ternarylogic_epi32(lv[5], _mm512_srli_epi32(h, 1), five, 0xF8);
      lv[6] = _mm512_ternarylogic_epi32(lv[6], _mm512_srli_epi32(h, 2), five, 0xF8);
      lv[7] = _mm512_ternarylogic_epi32(lv[7], _mm512_srli_epi32(h, 3), five, 0xF8);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + SC)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + SC + 32)));
    for (int b = 0; b < RB; ++b) {
      const int8_t* xg = xq + b * in + g * Q4_GROUP;
      int32_t x4[8];
      std::memcpy(x4, xg, 32);
      __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[0], _mm512_set1_epi32(x4[0]));
      __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[4], _mm512_set1_epi32(x4[4]));
      for (int c = 1; c < 4; ++c) {
        p0 = _mm512_dpbusd_epi32(p0, lv[c], _mm512_set1_epi32(x4[c]));
        p1 = _mm512_dpbusd_epi32(p1, lv[4 + c], _mm512_set1_epi32(x4[4 + c]));
      }
      const __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(xs[b * ng + g]));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(p0, p1)), sc, acc[b]);
      accm[b] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[b * ng + g]), accm[b]);
    }
  }
  for (int b = 0; b < RB; ++b) _mm512_storeu_ps(y + b * ldy, _mm512_add_ps(acc[b], accm[b]));
#elif defined(IG_AVX2)
  for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: the 32-byte halves of each chunk
    __m256 acc[RB], accm[RB];
    for (int b = 0; b < RB; ++b) acc[b] = accm[b] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* tg = t + g * TG;
      if (h == 0) prefetch_tile_group<BITS>(tg);
      __m256i lv[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 64 * c + 32 * h));
        lv[c] = _mm256_and_si256(v, low);
        lv[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      if constexpr (BITS == 5) {
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 256 + 32 * h));
        const __m256i five = _mm256_set1_epi8(0x10);
        for (int c = 0; c < 4; ++c) {  // (shift counts as registers: the loop is unrolled either way)
          lv[c] = _mm256_or_si256(lv[c], _mm256_and_si256(_mm256_sll_epi32(hb, _mm_cvtsi32_si128(4 - c)), five));
          lv[4 + c] = _mm256_or_si256(lv[4 + c], _mm256_and_si256(_mm256_srl_epi32(hb, _mm_cvtsi32_si128(c)), five));
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + SC + 16 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + SC + 32 + 16 * h)));
      for (int b = 0; b < RB; ++b) {
        int32_t x4[8];
        std::memcpy(x4, xq + b * in + g * Q4_GROUP, 32);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) p = _mm256_dpbusd_epi32(p, lv[c], _mm256_set1_epi32(x4[c]));
#elif defined(__AVXVNNI__)
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) p = _mm256_dpbusd_avx_epi32(p, lv[c], _mm256_set1_epi32(x4[c]));
#else  // pairs of u8 x s8 products summed in int16: at most 8 x 2 x 31 x 127 = 62992 for int5: pairs summed in int32
        __m256i p = _mm256_setzero_si256();
        const __m256i ones = _mm256_set1_epi16(1);
        if constexpr (BITS == 4) {  // at most 8 x 2 x 15 x 127 = 30480: exact in int16
          __m256i s = _mm256_maddubs_epi16(lv[0], _mm256_set1_epi32(x4[0]));
          for (int c = 1; c < 8; ++c) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lv[c], _mm256_set1_epi32(x4[c])));
          p = _mm256_madd_epi16(s, ones);
        } else {  // a pair at most 2 x 31 x 127 = 7874: four chunks' pairs in int16 (31496), then int32
          for (int c0 = 0; c0 < 8; c0 += 4) {
            __m256i s = _mm256_maddubs_epi16(lv[c0], _mm256_set1_epi32(x4[c0]));
            for (int c = c0 + 1; c < c0 + 4; ++c)
              s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lv[c], _mm256_set1_epi32(x4[c])));
            p = _mm256_add_epi32(p, _mm256_madd_epi16(s, ones));
          }
        }
#endif
        const __m256 sc = _mm256_mul_ps(dv, _mm256_set1_ps(xs[b * ng + g]));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[b]);
        accm[b] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[b * ng + g]), accm[b]);
      }
    }
    for (int b = 0; b < RB; ++b) _mm256_storeu_ps(y + b * ldy + 8 * h, _mm256_add_ps(acc[b], accm[b]));
  }
#else
  float acc[RB][Q4_TILE] = {}, accm[RB][Q4_TILE] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* tg = t + g * TG;
    for (int64_t o = 0; o < Q4_TILE; ++o) {
      const float d = half_at(reinterpret_cast<const int8_t*>(tg + SC + 2 * o));
      const float m = half_at(reinterpret_cast<const int8_t*>(tg + SC + 32 + 2 * o));
      uint32_t hb = 0;
      if constexpr (BITS == 5) std::memcpy(&hb, tg + 256 + 4 * o, 4);
      for (int b = 0; b < RB; ++b) {
        const int8_t* xg = xq + b * in + g * Q4_GROUP;
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = tg[64 * c + 4 * o + j];
            const int32_t lo = (byte & 0x0F) | int32_t((hb >> (8 * j + c)) & 1) << 4;
            const int32_t hi = (byte >> 4) | int32_t((hb >> (8 * j + 4 + c)) & 1) << 4;
            dot += lo * xg[4 * c + j] + hi * xg[16 + 4 * c + j];
          }
        acc[b][o] = std::fma(float(dot), d * xs[b * ng + g], acc[b][o]);
        accm[b][o] = std::fma(m, xsum[b * ng + g], accm[b][o]);
      }
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int64_t o = 0; o < Q4_TILE; ++o) y[b * ldy + o] = acc[b][o] + accm[b][o];
#endif
}

// int5 rows' storage type in linear_impl (the tensor's bytes, float8_e5m2 as PyTorch marks them)
struct int5_t {
  uint8_t byte;
};

template <typename W>
void linear_impl(const float* x, const W* wp, const float* bias, const float* res, int64_t R, int64_t in, int64_t out,
                 float* y, bool bf16 = false) {
  constexpr bool I8 = std::is_same_v<W, int8_t>, I4 = std::is_same_v<W, uint8_t>, I5 = std::is_same_v<W, int5_t>;
  const int64_t ldw = I8 ? kv_width(in) : I4 ? q4_width(in) : I5 ? q5_width(in) : in;  // a weight row's elements
  std::optional<QuantizedX8> qx8;  // int8, int5 and int4 weights: the activations in int8
  if constexpr (I8 || I4 || I5) qx8.emplace(x, R, in);
  std::vector<uint16_t> xb;  // bf16: bfloat16 weights times x rounded to bfloat16, in bfloat16 products
#ifdef IG_BF16_DOTS
  if constexpr (std::is_same_v<W, uint16_t>)
    if (bf16) {
      xb.resize(R * in);
      bf16dots::round_any(x, R * in, xb.data());
    }
#endif
  // blocks of 4, 2, 1 rows do the same arithmetic per row (two chains each): a row's result does not depend on
  // how many rows share the call (an 8-row block, one chain per row, did)
  auto rows = [&](auto rb, const W* w, int64_t b, float* yo) {
    constexpr int RB = decltype(rb)::value;
    if constexpr (I8)
      rows_dot_q8<RB>(w, qx8->q.data() + b * qx8->pad, qx8->s.data() + b * qx8->ng, qx8->isum.data() + b * qx8->ng, in,
                      qx8->pad, yo, out);
    else if constexpr (I4)
      rows_dot_q4<RB>(w, qx8->q.data() + b * qx8->pad, qx8->s.data() + b * qx8->ng, qx8->sum.data() + b * qx8->ng, in, yo,
                      out);
#ifdef IG_BF16_DOTS
    else if (std::is_same_v<W, uint16_t> && !xb.empty())
      bf16dots::rows_dot<RB>(reinterpret_cast<const uint16_t*>(w), xb.data() + b * in, in, yo, out);
#endif
    else if constexpr (!I5)  // (int5 weights are whole tiles)
      rows_dot<RB>(w, x + b * in, in, yo, out);
  };
  auto in_blocks = [&](auto&& f) {  // f(rb, b) over the rows of x in blocks of rb = 4, then 2, then 1
    int64_t b = 0;
    for (; b + 4 <= R; b += 4) f(std::integral_constant<int, 4>{}, b);
    if (R - b >= 2) {
      f(std::integral_constant<int, 2>{}, b);
      b += 2;
    }
    if (b < R) f(std::integral_constant<int, 1>{}, b);
  };
  auto row = [&](int64_t o) {  // output o for every row of x, from weight row o
    in_blocks([&](auto rb, int64_t b) { rows(rb, wp + o * ldw, b, y + b * out + o); });
  };
  auto finish = [&](int64_t o0, int64_t o1) {  // bias, then the residual
    for (int64_t o = o0; o < o1; ++o) {
      if (bias)
        for (int64_t j = 0; j < R; ++j) y[j * out + o] += bias[o];
      if (res)
        for (int64_t j = 0; j < R; ++j) y[j * out + o] = res[j * out + o] + y[j * out + o];
    }
  };
  if constexpr (I4 || I5) {  // tiles of 16 rows, then the rows after the last tile (one more task; int4 only)
    const int64_t tiles = out / Q4_TILE;
    at::parallel_for(0, tiles + (out % Q4_TILE ? 1 : 0), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o0 = t * Q4_TILE, o1 = std::min(out, o0 + Q4_TILE);
        if (t == tiles) {
          for (int64_t o = o0; o < o1; ++o) row(o);
        } else {
          in_blocks([&](auto rb, int64_t b) {
            tile_dot_q<decltype(rb)::value, I5 ? 5 : 4>(reinterpret_cast<const uint8_t*>(wp + o0 * ldw),
                                                      qx8->q.data() + b * qx8->pad, qx8->s.data() + b * qx8->ng,
                                                      qx8->sum.data() + b * qx8->ng, in, y + b * out + o0, out);
          });
        }
        finish(o0, o1);
      }
    });
    return;
  }
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) row(o);
    finish(o0, o1);
  });
}

// ---------------------------------------------------------------------------------------------------
// partial_query: the partial query of a RoPE model with unskewed channels, from only the q_proj rows it
// needs: per KV head g, the channels S_g = P_g and their rotate-half partners (c +- d/2). For query head h
// (group g = h / r): y[c] = x . W[h d + c] (+ bias) for c in S_g, then after RoPE
//   q[c] = y[c] cos[c] + (c < d/2 ? -y[c + d/2] : y[c - d/2]) sin[c]   for c in P_g.

template <typename W>
void partial_query_impl(const float* x, const W* wp, const float* bias, const int64_t* S, int64_t c,
                        const int64_t* P, int64_t p, const float* cos, const float* sin, int64_t B, int64_t G,
                        int64_t r, int64_t d, int64_t D, bool gathered, float* out) {
  const int64_t H = G * r, half = d / 2;
  constexpr bool I8 = std::is_same_v<W, int8_t>;
  std::optional<QuantizedX8> qx;
  if constexpr (I8) qx.emplace(x, B, D);
  std::vector<uint16_t> xb;  // bfloat16 weights: x rounded to bfloat16, bfloat16 products (a query that only ranks)
#ifdef IG_BF16_DOTS
  if constexpr (std::is_same_v<W, uint16_t>) {
    xb.resize(B * D);
    bf16dots::round_any(x, B * D, xb.data());
  }
#endif
  std::vector<float> y(B * H * d, 0.f);  // (B, H, d): the needed channels of each head's query
  at::parallel_for(0, H * c, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / c, ch = S[(h / r) * c + i % c];
      const W* w = wp + (gathered ? i : h * d + ch) * (I8 ? kv_width(D) : D);  // gathered: row h c + t holds q_proj row h d + S[g, t]
      float* yo = y.data() + h * d + ch;  // row b at yo + b * H * d
      int64_t b = 0;
      if constexpr (I8) {
        for (; b + 4 <= B; b += 4)
          rows_dot_q8<4>(w, qx->q.data() + b * qx->pad, qx->s.data() + b * qx->ng, qx->isum.data() + b * qx->ng, D,
                         qx->pad, yo + b * H * d, H * d);
        for (; b < B; ++b)
          rows_dot_q8<1>(w, qx->q.data() + b * qx->pad, qx->s.data() + b * qx->ng, qx->isum.data() + b * qx->ng, D,
                         qx->pad, yo + b * H * d, H * d);
      } else if (!xb.empty()) {
#ifdef IG_BF16_DOTS
        const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
        for (; b + 4 <= B; b += 4) bf16dots::rows_dot<4>(wb, xb.data() + b * D, D, yo + b * H * d, H * d);
        for (; b < B; ++b) bf16dots::rows_dot<1>(wb, xb.data() + b * D, D, yo + b * H * d, H * d);
#endif
      } else {
        for (; b + 4 <= B; b += 4) rows_dot<4>(w, x + b * D, D, yo + b * H * d, H * d);
        for (; b < B; ++b) rows_dot<1>(w, x + b * D, D, yo + b * H * d, H * d);
      }
      if (bias)
        for (int64_t j = 0; j < B; ++j) yo[j * H * d] += bias[h * d + ch];
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* yh = y.data() + (b * H + h) * d;
      const int64_t* Pg = P + (h / r) * p;
      float* o = out + (b * H + h) * p;  // (B, G, r, p) == (B, H, p)
      for (int64_t t = 0; t < p; ++t) {
        const int64_t ch = Pg[t];
        if (!cos) {
          o[t] = yh[ch];
          continue;
        }
        const float partner = ch < half ? -yh[ch + half] : yh[ch - half];
        o[t] = yh[ch] * cos[b * d + ch] + partner * sin[b * d + ch];
      }
    }
}

void check_cpu_contig(const at::Tensor& t, const char* name) {
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

// q (B, G, r, p) float32; kp (B, G, cap, p) partial keys, or (B, G, cap, p + 4) int8 rows (score_rows_i8); keep (B, 1 or G, n) bool or None; caps (B, G) int64 or None.
// Returns idx (B, G, k) int64 (slots [count, k) repeat slot 0), count (B, G) int64 and the sum of count (the host's
// tally of what a step fetched, without a tensor op a layer).
std::tuple<at::Tensor, at::Tensor, int64_t> speculate(at::Tensor q, at::Tensor kp, int64_t n, c10::optional<at::Tensor> keep,
                                  c10::optional<at::Tensor> caps, double scale, double alpha, int64_t k,
                                  bool mean) {
  check_cpu_contig(q, "q");
  check_cpu_contig(kp, "kp");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  const int64_t B = q.size(0), G = q.size(1), r = q.size(2), p = q.size(3), cap = kp.size(2);
  TORCH_CHECK(kp.size(0) == B && kp.size(1) == G && kp.size(3) == p + (kp.scalar_type() == at::kChar ? 4 : 0) &&
              n <= cap && k >= 1, "bad shapes");
  const bool* keep_p = nullptr;
  int64_t keep_heads = 1;
  if (keep.has_value()) {
    check_cpu_contig(*keep, "keep");
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->size(0) == B && keep->size(2) == n, "bad keep");
    keep_p = keep->data_ptr<bool>();
    keep_heads = keep->size(1);
  }
  const int64_t* caps_p = nullptr;
  if (caps.has_value()) {
    check_cpu_contig(*caps, "caps");
    caps_p = caps->data_ptr<int64_t>();
  }
  auto idx = at::empty({B, G, k}, q.options().dtype(at::kLong));
  auto count = at::empty({B, G}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  int64_t* cp = count.data_ptr<int64_t>();
  if (kp.scalar_type() == at::kChar) {  // int8 rows: p values and their scale
    const auto* kr = reinterpret_cast<const int8_t*>(kp.data_ptr());
    dispatch_size(p, [&](auto size) {
      constexpr int P = decltype(size)::value;
      speculate_rows(qp, kr, p + 4, keep_p, keep_heads, caps_p, B, G, r, p, cap, n, float(scale), float(alpha), k,
                     mean, ip, cp, [&](const float* qs, const int8_t* rows, float* s) { score_rows_i8<P>(qs, rows, r, p, n, s); });
    });
    return {idx, count, std::accumulate(cp, cp + B * G, int64_t(0))};
  }
  dispatch_storage(kp.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto* kr = reinterpret_cast<const T*>(kp.data_ptr());
    dispatch_size(p, [&](auto size) {
      constexpr int P = decltype(size)::value;
      speculate_rows(qp, kr, p, keep_p, keep_heads, caps_p, B, G, r, p, cap, n, float(scale), float(alpha), k, mean,
                     ip, cp, [&](const float* qs, const T* rows, float* s) { score_rows<T, P>(qs, rows, r, p, n, s); });
    });
  });
  return {idx, count, std::accumulate(cp, cp + B * G, int64_t(0))};
}

// q (B, G, r, d) float32; K, V (B, G, cap, d) pool storage, or (B, G, cap, kv_width(d)) int8 rows; idx (B, G, m)
// slots or None (slots 0..n-1, masked by keep (B, 1 or G, n)); count (B, G) or None (all m); the new token's slot
// first: new_rows (B, G) or new_row (>= 0; -1 for none). pairs_upto: long bfloat16 rows are multiplied in bfloat16
// pairs (bf16_dots.h) for up to this many query heads a KV head, else in float32 products of the rows widened once for
// all r heads (attend512.h): the backend's constant for the machine's kernel path (model/backend.py). Returns
// (B, G, r, d) in out_dtype.
at::Tensor attend(at::Tensor q, at::Tensor K, at::Tensor V, c10::optional<at::Tensor> idx,
                  c10::optional<at::Tensor> count, c10::optional<at::Tensor> new_rows, int64_t new_row,
                  c10::optional<at::Tensor> keep, int64_t n, double scale, at::ScalarType out_dtype,
                  int64_t pairs_upto) {
#ifndef IG_BF16_DOTS
  pairs_upto = 0;  // this build has no bfloat16 products (AVX-512 BF16)
#endif
  check_cpu_contig(q, "q");
  check_cpu_contig(K, "K");
  check_cpu_contig(V, "V");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32");
  TORCH_CHECK(K.scalar_type() == V.scalar_type() && K.sizes() == V.sizes(), "K and V differ");
  const int64_t B = q.size(0), G = q.size(1), r = q.size(2), d = q.size(3), cap = K.size(2);
  const bool i8 = K.scalar_type() == at::kChar;  // int8 rows: d values, then their groups' scales (pack_kv_row)
  TORCH_CHECK(K.size(0) == B && K.size(1) == G && K.size(3) == (i8 ? kv_width(d) : d), "bad shapes");
  const int64_t* idx_p = nullptr;
  int64_t m = 0;
  if (idx.has_value()) {
    check_cpu_contig(*idx, "idx");
    idx_p = idx->data_ptr<int64_t>();
    m = idx->size(2);
  } else {
    TORCH_CHECK(n <= cap, "n exceeds the pool");
  }
  const int64_t* count_p = nullptr;
  if (count.has_value()) {
    check_cpu_contig(*count, "count");
    count_p = count->data_ptr<int64_t>();
  }
  const int64_t* new_p = nullptr;
  if (new_rows.has_value()) {
    check_cpu_contig(*new_rows, "new_rows");
    new_p = new_rows->data_ptr<int64_t>();
  }
  const bool* keep_p = nullptr;
  int64_t keep_heads = 1;
  if (keep.has_value()) {
    check_cpu_contig(*keep, "keep");
    TORCH_CHECK(keep->scalar_type() == at::kBool && keep->size(2) == n, "bad keep");
    keep_p = keep->data_ptr<bool>();
    keep_heads = keep->size(1);
  }
  auto out = at::empty({B, G, r, d}, q.options().dtype(out_dtype));
  dispatch_rows(K.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_storage(out_dtype, [&](auto otag) {
      using O = decltype(otag);
      dispatch_size(d, [&](auto size) {
      attend_impl<T, O, decltype(size)::value>(q.data_ptr<float>(), reinterpret_cast<const T*>(K.data_ptr()),
                        reinterpret_cast<const T*>(V.data_ptr()), idx_p, m, count_p, new_p, new_row, keep_p,
                        keep_heads, n, B, G, r, d, cap, float(scale), r <= pairs_upto,
                        reinterpret_cast<O*>(out.data_ptr()));
      });
    });
  });
  return out;
}

// x (..., p) float32 -> (..., p + 4) int8 rows: p values quantized by the row's absmax / 127, then that scale's bytes
at::Tensor quantize_rows(at::Tensor x) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32");
  const int64_t p = x.size(-1), R = x.numel() / std::max<int64_t>(p, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = p + 4;
  auto out = at::empty(sizes, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  auto* op = reinterpret_cast<int8_t*>(out.data_ptr());
  at::parallel_for(0, R, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) pack_row(xp + i * p, p, op + i * (p + 4));
  });
  return out;
}

// x (..., d) float32 -> (..., kv_width(d)) int8 K/V rows (pack_kv_row)
at::Tensor quantize_kv_rows(at::Tensor x) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32");
  const int64_t d = x.size(-1), R = x.numel() / std::max<int64_t>(d, 1), w = kv_width(d);
  auto sizes = x.sizes().vec();
  sizes.back() = w;
  auto out = at::empty(sizes, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  auto* op = reinterpret_cast<int8_t*>(out.data_ptr());
  at::parallel_for(0, R, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) pack_kv_row(xp + i * d, d, op + i * w);
  });
  return out;
}

// int8 rows (..., kv_width(d)) -> their values (..., d) float32, value x its group's scale (unpacked_kv's bits)
at::Tensor dequantize_kv_rows(at::Tensor rows, int64_t d) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kChar && rows.dim() >= 1 && rows.size(-1) == kv_width(d), "bad int8 rows");
  const int64_t w = kv_width(d), R = rows.numel() / w, ng = kv_groups(d);
  auto sizes = rows.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, rows.options().dtype(at::kFloat));
  const int8_t* rp = rows.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(ng);
    for (int64_t i = i0; i < i1; ++i) {
      const int8_t* row = rp + i * w;
      float* o = op + i * d;
      kv_scales(row, d, sc.data());
      int64_t g = 0;
      for (; (g + 1) * KV_GROUP <= d; ++g)  // whole groups: a fixed trip count the compiler vectorizes (4x faster)
        for (int64_t j = 0; j < KV_GROUP; ++j) o[g * KV_GROUP + j] = float(row[g * KV_GROUP + j]) * sc[g];
      for (int64_t j = g * KV_GROUP; j < d; ++j) o[j] = float(row[j]) * sc[g];  // a shorter last group
    }
  });
  return out;
}

// int4 weights as held (..., q4_width(n)) uint8 (the leading dims' rows in tiles of 16, then rows: linear_impl's
// layout) -> their values (..., n) in float32 or bfloat16: level x scale + min per group of
// 32 (int4_rows.unpacked's bits: a 4-bit level times a float16 scale is exact in float32, so the one rounding is the
// sum's, fused or not; bfloat16 rounds that to nearest even, as PyTorch's .to). A prompt chunk's weights for the
// BLAS, a slice at a time: PyTorch's ops took 1.3x the bfloat16 weights' prefill in unpacking.
at::Tensor dequantize_q4_rows(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() >= 1 && n % Q4_GROUP == 0 && rows.size(-1) == q4_width(n),
              "bad int4 rows");
  const int64_t w = q4_width(n), R = rows.numel() / w, ng = n / Q4_GROUP;
  auto sizes = rows.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t tiled = R / Q4_TILE * Q4_TILE;  // rows in tiles (linear_impl's layout), then rows
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[Q4_GROUP];
    uint8_t b[Q4_GROUP / 2];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        float d, m;
        if (i < tiled) {
          const uint8_t* tg = tile + g * Q4_TILE_GROUP;
          for (int64_t c = 0; c < 4; ++c) std::memcpy(b + 4 * c, tg + 64 * c + 4 * o, 4);
          d = half_at(reinterpret_cast<const int8_t*>(tg + 256 + 2 * o));
          m = half_at(reinterpret_cast<const int8_t*>(tg + 288 + 2 * o));
        } else {
          const uint8_t* row = rp + i * w;
          std::memcpy(b, row + g * (Q4_GROUP / 2), Q4_GROUP / 2);
          d = half_at(reinterpret_cast<const int8_t*>(row + n / 2 + 2 * g));
          m = half_at(reinterpret_cast<const int8_t*>(row + n / 2 + 2 * (ng + g)));
        }
        for (int64_t j = 0; j < Q4_GROUP / 2; ++j) {
          v[j] = float(b[j] & 0x0F) * d + m;
          v[j + Q4_GROUP / 2] = float(b[j] >> 4) * d + m;
        }
        if (ob != nullptr) {
          for (int64_t j = 0; j < Q4_GROUP; ++j) ob[i * n + g * Q4_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + Q4_GROUP, of + i * n + g * Q4_GROUP);
        }
      }
    }
  });
  return out;
}

// int5 weights as held (R, q5_width(n)) float8_e5m2 (whole tiles of 16 rows: model/int5_rows.py) -> their values
// (R, n) in float32 or bfloat16: level x scale + min per group of 32 (int5_rows.reference_unpacked's bits: a 5-bit
// level times a float16 scale is exact in float32; the sum is the one rounding). A prompt chunk's weights for the
// BLAS, a slice at a time.
at::Tensor dequantize_q5_tiles(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kFloat8_e5m2 && rows.dim() >= 1 && n % Q4_GROUP == 0 &&
              rows.size(-1) == q5_width(n), "bad int5 rows");
  const int64_t w = q5_width(n), R = rows.numel() / w, ng = n / Q4_GROUP;
  TORCH_CHECK(R % Q4_TILE == 0, "int5 rows are held in whole tiles of 16 rows");
  auto sizes = rows.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = reinterpret_cast<const uint8_t*>(rows.data_ptr());
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[Q4_GROUP];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* tg = tile + g * Q5_TILE_GROUP;
        uint32_t hb;
        std::memcpy(&hb, tg + 256 + 4 * o, 4);
        const float d = half_at(reinterpret_cast<const int8_t*>(tg + 320 + 2 * o));
        const float m = half_at(reinterpret_cast<const int8_t*>(tg + 352 + 2 * o));
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = tg[64 * c + 4 * o + j];
            v[4 * c + j] = float((byte & 0x0F) | ((hb >> (8 * j + c)) & 1) << 4) * d + m;
            v[16 + 4 * c + j] = float((byte >> 4) | ((hb >> (8 * j + 4 + c)) & 1) << 4) * d + m;
          }
        if (ob != nullptr) {
          for (int64_t j = 0; j < Q4_GROUP; ++j) ob[i * n + g * Q4_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + Q4_GROUP, of + i * n + g * Q4_GROUP);
        }
      }
    }
  });
  return out;
}

// A decode token into an InfiniGen pool layer at slot `at`: k, v (B, G, 1, d) float32 (rows of d contiguous, any
// strides above: views of the step's merged q k v output) into K, V (B, G, cap, d) (float32 or bfloat16: the pool's
// kv_dtype; or (B, G, cap, kv_width(d)) int8 rows, pack_kv_row), and the int8 row of k's partial channels (G, p) into
// P (B, G, cap, p + 4) (pack_row: quantize_rows' bits). The three appends of a layer's step in one call, where they
// were ~8 PyTorch ops (a channel gather, quantize_rows, three copies).
void store_token(at::Tensor K, at::Tensor V, at::Tensor P, at::Tensor k, at::Tensor v, at::Tensor channels, int64_t at) {
  for (auto* t : {&K, &V, &P, &channels}) check_cpu_contig(*t, "store_token buffer");
  const bool i8 = K.scalar_type() == at::kChar;
  TORCH_CHECK((K.scalar_type() == at::kFloat || K.scalar_type() == at::kBFloat16 || i8) && V.scalar_type() == K.scalar_type() &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && P.scalar_type() == at::kChar &&
              channels.scalar_type() == at::kLong,
              "store_token: float32, bfloat16 or int8 K, V; float32 k, v; int8 P; int64 channels");
  const int64_t B = K.size(0), G = K.size(1), cap = K.size(2), d = k.size(3), p = channels.size(1);
  const int64_t rw = i8 ? kv_width(d) : d;  // elements a stored row takes
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == B && k.size(1) == G && k.size(2) == 1 && K.size(3) == rw &&
              v.sizes() == k.sizes() && V.sizes() == K.sizes() && k.stride(3) == 1 && v.stride(3) == 1 &&
              P.size(0) == B && P.size(1) == G && P.size(2) == cap && P.size(3) == p + 4 && channels.size(0) == G &&
              at >= 0 && at < cap, "store_token: bad shapes");
  const int64_t* ch = channels.data_ptr<int64_t>();
  for (int64_t i = 0; i < G * p; ++i) TORCH_CHECK(ch[i] >= 0 && ch[i] < d, "channel out of range");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  auto* Pp = reinterpret_cast<int8_t*>(P.data_ptr());
  std::vector<float> part(p);
  dispatch_rows(K.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T *Kp = reinterpret_cast<T*>(K.data_ptr()), *Vp = reinterpret_cast<T*>(V.data_ptr());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < G; ++g) {
        const float* kr = kp + b * k.stride(0) + g * k.stride(1);
        const float* vr = vp + b * v.stride(0) + g * v.stride(1);
        const int64_t row = (b * G + g) * cap + at;
        if constexpr (std::is_same_v<T, int8_t>) {
          pack_kv_row(kr, d, Kp + row * rw);
          pack_kv_row(vr, d, Vp + row * rw);
        } else {
          for (int64_t t = 0; t < d; ++t) {
            store(Kp + row * rw, t, kr[t]);
            store(Vp + row * rw, t, vr[t]);
          }
        }
        for (int64_t t = 0; t < p; ++t) part[t] = kr[ch[g * p + t]];
        pack_row(part.data(), p, Pp + row * (p + 4));
      }
  });
}

// x (R, D) float32, w (D) float32 -> x / sqrt(mean(x^2) + eps) * w, per row (Llama's RMSNorm in one call; the
// sum in eight lanes then in order, the same bits for a row whatever the rows beside it)
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "x and w must be float32");
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(w.numel() == D, "w must have x's last size");
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* xr = xp + i * D;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t t = 0;
      for (; t + 8 <= D; t += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xr[t + j] * xr[t + j];
      float ss = 0.f;
      for (int j = 0; j < 8; ++j) ss += acc[j];
      for (; t < D; ++t) ss += xr[t] * xr[t];
      const float inv = 1.f / std::sqrt(ss / float(D) + float(eps));
      float* yr = yp + i * D;
      for (int64_t c = 0; c < D; ++c) yr[c] = xr[c] * inv * wp[c];
    }
  });
  return y;
}

// x (R, in) float32, W (out, in) float32 or bfloat16, or (out, kv_width(in)) int8 rows, or (out, q4_width(in)) uint8
// int4 rows, bias (out) float32 or None -> (R, out) float32
// residual (R, out) float32 or None: returns residual + (x W^T + bias), as x + linear(...) rounds it
// bf16: a bfloat16 W multiplies x rounded to bfloat16 in bfloat16 products where the build has them (bf16_dots.h)
at::Tensor linear(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> residual,
                  bool bf16) {
  check_cpu_contig(x, "x");
  check_cpu_contig(W, "W");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool i8 = W.scalar_type() == at::kChar, i4 = W.scalar_type() == at::kByte,
             i5 = W.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(W.scalar_type() == at::kFloat || W.scalar_type() == at::kBFloat16 || i8 || i4 || i5,
              "W must be float32, bfloat16, int8 rows, int5 tiles or int4 rows");
  const int64_t R = x.size(0), in = x.size(1), out = W.size(0);
  TORCH_CHECK(!(i4 || i5) || in % Q4_GROUP == 0, "int4 and int5 rows need whole groups of 32");
  TORCH_CHECK(!i5 || out % Q4_TILE == 0, "int5 rows are held in whole tiles of 16 rows");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 &&
              W.size(1) == (i8 ? kv_width(in) : i4 ? q4_width(in) : i5 ? q5_width(in) : in), "bad shapes");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_cpu_contig(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out, "bias must be float32 (out)");
    bp = bias->data_ptr<float>();
  }
  const float* rp = nullptr;
  if (residual.has_value()) {
    check_cpu_contig(*residual, "residual");
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == R * out, "residual must be (R, out) float32");
    rp = residual->data_ptr<float>();
  }
  auto y = at::empty({R, out}, x.options());
  if (W.scalar_type() == at::kFloat)
    linear_impl(x.data_ptr<float>(), W.data_ptr<float>(), bp, rp, R, in, out, y.data_ptr<float>());
  else if (i8)
    linear_impl(x.data_ptr<float>(), W.data_ptr<int8_t>(), bp, rp, R, in, out, y.data_ptr<float>());
  else if (i4)
    linear_impl(x.data_ptr<float>(), W.data_ptr<uint8_t>(), bp, rp, R, in, out, y.data_ptr<float>());
  else if (i5)
    linear_impl(x.data_ptr<float>(), reinterpret_cast<const int5_t*>(W.data_ptr()), bp, rp, R, in, out,
                y.data_ptr<float>());
  else
    linear_impl(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(W.data_ptr()), bp, rp, R, in, out,
                y.data_ptr<float>(), bf16);
  return y;
}

// x (B, D) float32; W (H d, D) q_proj weight, float32 or bfloat16, or with d_head > 0 only the rows needed (H c, D),
// row h c + t = q_proj row h d_head + S[g, t] (contiguous: read at the bandwidth, where the rows scattered through
// q_proj are not); bias (H d) or None; S (G, c) channels to compute per KV head (P and their RoPE partners;
// repeats allowed); P (G, p) partial channels; cos, sin (B, d) float32 or None (no RoPE: S = P).
// Returns the partial query (B, G, r, p) float32.
at::Tensor partial_query(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, at::Tensor S, at::Tensor P,
                         c10::optional<at::Tensor> cos, c10::optional<at::Tensor> sin, int64_t r, int64_t d_head) {
  for (auto* t : {&x, &W, &S, &P}) check_cpu_contig(*t, "partial_query input");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool i8 = W.scalar_type() == at::kChar;
  TORCH_CHECK(W.scalar_type() == at::kFloat || W.scalar_type() == at::kBFloat16 || i8,
              "W must be float32, bfloat16 or int8 rows");
  TORCH_CHECK(S.scalar_type() == at::kLong && P.scalar_type() == at::kLong, "S and P must be int64");
  const int64_t B = x.size(0), D = x.size(1), G = S.size(0), c = S.size(1), p = P.size(1), H = G * r;
  const bool gathered = d_head > 0;
  TORCH_CHECK((!gathered || W.size(0) == H * c) && W.size(0) % H == 0 && W.size(1) == (i8 ? kv_width(D) : D) &&
              P.size(0) == G, "bad shapes");
  const int64_t d = gathered ? d_head : W.size(0) / H;
  for (auto* t : {&S, &P})
    for (int64_t i = 0; i < t->numel(); ++i) {
      const int64_t ch = t->data_ptr<int64_t>()[i];
      TORCH_CHECK(ch >= 0 && ch < d, "channel ", ch, " out of range [0, ", d, ")");
    }
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_cpu_contig(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == H * d, "bias must be float32 (H d)");
    bp = bias->data_ptr<float>();
  }
  const float *cp = nullptr, *sp = nullptr;
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together");
  if (cos.has_value()) {
    check_cpu_contig(*cos, "cos");
    check_cpu_contig(*sin, "sin");
    TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->numel() == B * d &&
                sin->numel() == B * d, "cos, sin must be float32 (B, d)");
    cp = cos->data_ptr<float>();
    sp = sin->data_ptr<float>();
  }
  auto out = at::empty({B, G, r, p}, x.options());
  if (W.scalar_type() == at::kFloat)
    partial_query_impl(x.data_ptr<float>(), W.data_ptr<float>(), bp, S.data_ptr<int64_t>(), c, P.data_ptr<int64_t>(),
                       p, cp, sp, B, G, r, d, D, gathered, out.data_ptr<float>());
  else if (i8)
    partial_query_impl(x.data_ptr<float>(), W.data_ptr<int8_t>(), bp, S.data_ptr<int64_t>(), c,
                       P.data_ptr<int64_t>(), p, cp, sp, B, G, r, d, D, gathered, out.data_ptr<float>());
  else
    partial_query_impl(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(W.data_ptr()), bp,
                       S.data_ptr<int64_t>(), c, P.data_ptr<int64_t>(), p, cp, sp, B, G, r, d, D, gathered,
                       out.data_ptr<float>());
  return out;
}


// ---------------------------------------------------------------------------------------------------
// rope_ and silu_mul: the small elementwise steps of a decode layer, each one call instead of ~6 PyTorch ops,
// with PyTorch's bits (the own step equals the model's forward to the bit).

// x (R, N d) float32: heads [0, heads) of each row rotated in place with cos, sin (R, d):
//   x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
// rounded as transformers' apply_rotary_pos_emb rounds it: each product, then their sum (no fused multiply-add:
// the products go through volatile memory, which the compiler cannot contract).
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads) {
  check_cpu_contig(x, "x");
  check_cpu_contig(cos, "cos");
  check_cpu_contig(sin, "sin");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "x, cos and sin must be float32");
  const int64_t d = cos.size(-1), R = cos.numel() / std::max<int64_t>(d, 1), half = d / 2;
  TORCH_CHECK(sin.numel() == cos.numel() && d % 2 == 0 && R > 0 && x.numel() % R == 0, "bad shapes");
  const int64_t row = x.numel() / R;
  TORCH_CHECK(heads >= 0 && heads * d <= row, "heads out of range");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  std::vector<float> old(d);
  for (int64_t b = 0; b < R; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = xp + b * row + h * d;
      const float *c = cp + b * d, *s = sp + b * d;
      std::memcpy(old.data(), xh, d * sizeof(float));
      for (int64_t i = 0; i < d; ++i) {
        volatile float a = old[i] * c[i];
        volatile float t = (i < half ? -old[i + half] : old[i - half]) * s[i];
        xh[i] = a + t;
      }
    }
}

#ifdef IG_AVX2
extern "C" __m256 Sleef_expf8_u10(__m256);  // libtorch_cpu's: the exp of PyTorch's vectorized CPU kernels
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

// gu (R, 2F) float32 -> silu(gu[:, :F]) * gu[:, F:] (R, F), as F.silu(gate) * up computes it for a contiguous gate
// (R, F) (the model's gate_proj output): x / (1 + exp(-x)) over the R F values in order, 2 vectors of `lanes`
// at a time through the exp PyTorch's kernels of that width call (lanes: 8 AVX2, 16 AVX-512, as PyTorch's CPU
// capability; else expf throughout), the tail through expf; then the product.
at::Tensor silu_mul(at::Tensor gu, int64_t lanes) {
  check_cpu_contig(gu, "gu");
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be (R, 2F) float32");
  const int64_t R = gu.size(0), F = gu.size(1) / 2, n = R * F;
  auto y = at::empty({R, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < R; ++b) std::memcpy(yp + b * F, gp + b * 2 * F, F * sizeof(float));  // the gate, (R, F)
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (lanes == 16) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (const int64_t nv = n - n % 32; i < nv; i += 16) {
      const __m512 x = _mm512_loadu_ps(yp + i);
      const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(x, _mm512_set1_ps(-0.f)));
      _mm512_storeu_ps(yp + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
    }
  }
#endif
#ifdef IG_AVX2
  if (lanes == 8) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (const int64_t nv = n - n % 16; i < nv; i += 8) {
      const __m256 x = _mm256_loadu_ps(yp + i);
      _mm256_storeu_ps(yp + i, _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign)))));
    }
  }
#endif
  for (; i < n; ++i) yp[i] = yp[i] / (1.f + std::exp(-yp[i]));
  for (int64_t b = 0; b < R; ++b) {
    float* o = yp + b * F;
    const float* u = gp + b * 2 * F + F;
    for (int64_t c = 0; c < F; ++c) o[c] = o[c] * u[c];
  }
  return y;
}

bool bf16_dots_native();  // prefill.cpp
at::Tensor prefill_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
at::Tensor prefill_column_sums(const at::Tensor& q, const at::Tensor& k, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("linear", &linear, "few-row linear layer, float32, bfloat16, int8-row, int5-tile or int4-row weights, plus a residual",
          py::arg("x"), py::arg("W"), py::arg("bias") = py::none(), py::arg("residual") = py::none(),
          py::arg("bf16") = false);
  mod.def("rope_", &rope_, "rotate the first heads of decode rows in place (transformers' bits)");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of a merged gate-up output (PyTorch's bits)");
  mod.def("partial_query", &partial_query, "partial query from the q_proj rows it needs, RoPE applied",
          py::arg("x"), py::arg("W"), py::arg("bias"), py::arg("S"), py::arg("P"), py::arg("cos"), py::arg("sin"),
          py::arg("r"), py::arg("d_head") = 0);
  mod.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  mod.def("quantize_rows", &quantize_rows, "int8 partial key rows with their per-row scale");
  mod.def("quantize_kv_rows", &quantize_kv_rows, "int8 K/V rows: groups of 32 values, a float16 scale each");
  mod.def("dequantize_kv_rows", &dequantize_kv_rows, "int8 K/V rows' values in float32");
  mod.def("dequantize_q4_rows", &dequantize_q4_rows, "int4 weight rows' values in float32 or bfloat16");
  mod.def("dequantize_q5_tiles", &dequantize_q5_tiles, "int5 weight tiles' values in float32 or bfloat16");
  mod.def("store_token", &store_token, "a decode token's K, V and int8 partial key rows into a pool layer");
  mod.def("speculate", &speculate, "approximate scores -> relative -> combine -> count -> selection");
  mod.def("attend", &attend, "decode attention over chosen pool rows, gathered in place", py::arg("q"), py::arg("K"),
          py::arg("V"), py::arg("idx"), py::arg("count"), py::arg("new_rows"), py::arg("new_row"), py::arg("keep"),
          py::arg("n"), py::arg("scale"), py::arg("out_dtype"), py::arg("pairs_upto") = 0);
  mod.def("bf16_dots_native", &bf16_dots_native, "whether this build multiplies bfloat16 pairs (AVX-512 BF16)");
#ifdef IG_BF16_DOTS
  mod.attr("BF16_ATTEND_ROWS") = bf16dots::LONG_ROWS;  // rows from which bfloat16 pairs serve (attend_pairs_upto)
#else
  mod.attr("BF16_ATTEND_ROWS") = py::none();
#endif
  mod.def("prefill_attend", &prefill_attend, "a prompt chunk's causal attention over its past, bfloat16 products");
  mod.def("prefill_column_sums", &prefill_column_sums,
          "a prompt chunk's attention probabilities summed per key (H2O's scores), bfloat16 products");
}
