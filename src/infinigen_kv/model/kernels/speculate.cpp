// speculate: approximate scores of every pooled token from the partial query and partial keys (float32,
// bfloat16, or int8 rows with a per-row scale scored by integer dot products), each head's logits relative
// to its maximum, the heads of a KV group combined, the tokens within alpha counted and capped, and the
// chosen slots written out. One read of the partial keys.
//
// Shapes: B sequences, G KV heads, r query heads per KV head, p partial channels, cap rows allocated per
// (sequence, head) in the pool, n valid rows.

#include "common.h"
#include "kernels.h"

namespace {

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
  // each head's logits relative to its max, the group's heads combined: one pass over the tokens, the heads'
  // terms in head order (the same bits on every path), the tokens within alpha counted on the way
  int32_t within32 = 0;  // int32 lanes: the counting pass vectorizes 8 wide
  int64_t t = 0;
  const float fr = float(r);
#ifdef IG_AVX2
  const __m256 lo = _mm256_set1_ps(-alpha), vr = _mm256_set1_ps(fr);
  __m256i cnt = _mm256_setzero_si256();
  for (; t + 8 <= n; t += 8) {
    __m256 v = _mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx[0]));
    if (mean) {
      v = _mm256_div_ps(v, vr);
      for (int64_t h = 1; h < r; ++h)
        v = _mm256_add_ps(v, _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(s + h * n + t), _mm256_set1_ps(mx[h])), vr));
    } else {  // max(x, v): v where equal, as std::max(v, x)
      for (int64_t h = 1; h < r; ++h)
        v = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + h * n + t), _mm256_set1_ps(mx[h])), v);
    }
    _mm256_storeu_ps(rel + t, v);
    cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(v, lo, _CMP_GT_OQ)));
  }
  alignas(32) int32_t c8[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c8), cnt);
  for (int j = 0; j < 8; ++j) within32 += c8[j];
#endif
  for (; t < n; ++t) {
    float v = s[t] - mx[0];
    if (mean) {
      v /= fr;
      for (int64_t h = 1; h < r; ++h) v += (s[h * n + t] - mx[h]) / fr;
    } else {
      for (int64_t h = 1; h < r; ++h) v = std::max(v, s[h * n + t] - mx[h]);
    }
    rel[t] = v;
    within32 += v > -alpha;
  }
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

#ifdef IG_VNNI512
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

template <typename V>
void grow(std::vector<V>& v, int64_t size) {
  if (int64_t(v.size()) < size) v.resize(size);
}

// One pass per (sequence, KV head): its scores (score(qs, row's keys, s)), then select_row. w: elements per stored row.
template <typename T, typename Score>
void speculate_rows(const float* q, const T* kp, int64_t w, const bool* keep, int64_t keep_heads, const int64_t* caps,
                    int64_t B, int64_t G, int64_t r, int64_t p, int64_t cap, int64_t n, float scale,
                    float alpha, int64_t k, bool mean, int64_t* idx_out, int64_t* count_out, Score score) {
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    // scratch kept by the thread between calls: a fresh (r, n) score buffer a layer is a page-faulting mmap
    thread_local std::vector<float> s, rel, cand, qs, mx;
    thread_local std::vector<uint32_t> bins;  // room for the vector stores past the last kept position
    thread_local std::vector<int32_t> hist;
    grow(s, r * n), grow(rel, n), grow(cand, n + 8), grow(qs, r * p), grow(mx, r), grow(bins, n + 8);
    grow(hist, 2 * (SELECT_BINS + 1));
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
