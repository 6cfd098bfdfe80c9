// A decode query's attention over bfloat16 K/V rows with AVX-512 float32 products, for attend.cpp.
//
// The r query heads of a KV head each score and weigh every row (r = 7 on Qwen2.5), so the work a row is r times
// its bytes. A row's 32 bfloat16 channels widen to two float32 vectors with one shift and one mask (the even
// channels, the odd ones) once for all r heads; the products are then float32 FMAs, two a cycle, where
// vdpbf16ps manages one a two cycles on the Xeons measured (its 32 products an instruction do not make up for it),
// and nothing is rounded: the query and the probabilities multiply as they are.
//
// Scores: for three heads and more, 16 tokens of a block transposed and widened into a scratch once, a channel a
// vector (lane j: token j); each head's 16 dot products are then 16-lane FMAs of those vectors with the head's
// channels broadcast, no horizontal sum. For one or two heads each row is widened as it is read and a head's 16 dot
// products reduced together (hsum16). Values: a token's row widened once a pass for up to 4 heads over 64 channels
// or up to 8 over 32, each head weighing it by its probability (a broadcast operand); the (even, odd) sums put back
// in channel order once a block. Softmax: 16 lanes of exp_neg's polynomial.
//
// The rows stream from memory: the rows two groups of 16 ahead (the whole past's, or the chosen rows' positions) are
// prefetched, spread over the scores' products (the core keeps more lines in flight than its out-of-order window
// alone would).

#pragma once

#if defined(__AVX512F__)
#define IG_ATTEND512 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace attend512 {

// [sum of a[0]'s lanes, ..., sum of a[15]'s lanes]
inline __m512 hsum16(const __m512* a) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = a[2i], b = a[2i + 1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of a[4i .. 4i + 3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes 0, 1 of u[2i] and u[2i + 1] summed with lanes 2, 3
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 32 bfloat16 channels -> float32: the even channels, the odd ones (a bfloat16 is a float32's high half)
inline void widen(const uint16_t* x, __m512& even, __m512& odd) {
  const __m512i v = _mm512_loadu_si512(x);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// The K and V lines of 16 rows to ask for ahead of their use: rows[0, 16) their positions (null: none), rw elements a
// row. The whole past passes the 16 rows two groups ahead, chosen rows the positions of theirs: either way the lines
// are asked for a few between the products, not all at once (a burst stalls on the core's outstanding misses).
struct Ahead {
  const uint16_t* K = nullptr;
  const uint16_t* V = nullptr;
  int64_t rw = 0;
  const int64_t* rows = nullptr;
};

// line i < D / 2 of the 16 rows' K and of their V (D bfloat16 channels: D / 32 lines a row), asked for
template <int D>
inline void fetch_line(const Ahead& a, int64_t i) {
  constexpr int64_t LINES = D / 32;
  const int64_t o = a.rows[i / LINES] * a.rw + (i % LINES) * 32;
  _mm_prefetch(reinterpret_cast<const char*>(a.K + o), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.V + o), _MM_HINT_T0);
}

// x[i], i < 16 (16 rows of 16 dwords) -> x[i] = every row's dword i, lane j row j's
inline void transpose16(__m512i* x) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane l: rows 2k, 2k + 1's dwords 4l, 4l + 1 (t[2k]), 4l + 2, 4l + 3
    t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // x[4k + m], lane l: rows 4k .. 4k + 3's dword 4l + m
    x[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    x[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    x[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    x[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // the 4 x 4 128-bit lanes of x[m], x[4 + m], x[8 + m], x[12 + m] transposed
    const __m512i a = _mm512_shuffle_i32x4(x[m], x[4 + m], 0x88), b = _mm512_shuffle_i32x4(x[m], x[4 + m], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0x88);
    const __m512i e = _mm512_shuffle_i32x4(x[8 + m], x[12 + m], 0xdd);
    t[m] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(b, e, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(a, c, 0xdd);
    t[12 + m] = _mm512_shuffle_i32x4(b, e, 0xdd);
  }
  for (int i = 0; i < 16; ++i) x[i] = t[i];
}

// kt[16 c + j] = K[blk[j]][c] in float32, c < D: 16 rows a channel a vector
template <int D>
inline void widen_transposed(const uint16_t* K, int64_t rw, const int64_t* blk, float* kt) {
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  for (int c = 0; c < D; c += 32) {
    __m512i x[16];
    for (int j = 0; j < 16; ++j) x[j] = _mm512_loadu_si512(K + blk[j] * rw + c);
    transpose16(x);  // x[i]: channel c + 2i of the 16 rows in the low halves, c + 2i + 1 in the high ones
    for (int i = 0; i < 16; ++i) {
      _mm512_storeu_ps(kt + (c + 2 * i) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(x[i], 16)));
      _mm512_storeu_ps(kt + (c + 2 * i + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(x[i], high)));
    }
  }
}

// s[h ld + j] = scale q_h . K_j for the HN heads of q (HN, D) and the 16 rows of kt (widen_transposed's); two
// accumulators a head (even and odd channels: 2 HN FMA chains in flight). ahead: its lines asked for, one of K and
// of V every two channels (D / 2 lines: 16 bfloat16 rows of D)
template <int D, int HN>
inline void scores_heads(const float* q, const float* kt, float scale, float* s, int64_t ld, const Ahead& ahead) {
  __m512 acc[2][HN];
  for (int h = 0; h < HN; ++h) acc[0][h] = acc[1][h] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 2) {
    if (ahead.rows) fetch_line<D>(ahead, c / 2);
    const __m512 k0 = _mm512_loadu_ps(kt + c * 16), k1 = _mm512_loadu_ps(kt + (c + 1) * 16);
    for (int h = 0; h < HN; ++h) {
      acc[0][h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + c]), k0, acc[0][h]);
      acc[1][h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + c + 1]), k1, acc[1][h]);
    }
  }
  for (int h = 0; h < HN; ++h)
    _mm512_storeu_ps(s + h * ld, _mm512_mul_ps(_mm512_add_ps(acc[0][h], acc[1][h]), _mm512_set1_ps(scale)));
}

// s[h ld + j] = scale q_h . K[blk[j]] for 16 tokens j and every head h of q (r, D) in its own order, r > 2; kt:
// scratch of 16 D floats. ahead: the lines to ask for (during the first 8 heads' products).
template <int D>
inline void scores16_transposed(const float* q, int64_t r, const uint16_t* K, int64_t rw, const int64_t* blk,
                                float scale, float* s, int64_t ld, float* kt, Ahead ahead) {
  widen_transposed<D>(K, rw, blk, kt);
  for (int64_t h0 = 0; h0 < r; h0 += 8, ahead.rows = nullptr) {
    const float* qh = q + h0 * D;
    float* sh = s + h0 * ld;
    switch (r - h0 < 8 ? r - h0 : 8) {
      case 1: scores_heads<D, 1>(qh, kt, scale, sh, ld, ahead); break;
      case 2: scores_heads<D, 2>(qh, kt, scale, sh, ld, ahead); break;
      case 3: scores_heads<D, 3>(qh, kt, scale, sh, ld, ahead); break;
      case 4: scores_heads<D, 4>(qh, kt, scale, sh, ld, ahead); break;
      case 5: scores_heads<D, 5>(qh, kt, scale, sh, ld, ahead); break;
      case 6: scores_heads<D, 6>(qh, kt, scale, sh, ld, ahead); break;
      case 7: scores_heads<D, 7>(qh, kt, scale, sh, ld, ahead); break;
      default: scores_heads<D, 8>(qh, kt, scale, sh, ld, ahead); break;
    }
  }
}

// q (n floats, n a multiple of 32) in widen's order: each 32 channels' even ones, then their odd ones
inline void deinterleave(const float* q, int64_t n, float* out) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = _mm512_loadu_ps(q + i), b = _mm512_loadu_ps(q + i + 16);
    _mm512_storeu_ps(out + i, _mm512_permutex2var_ps(a, ev, b));
    _mm512_storeu_ps(out + i + 16, _mm512_permutex2var_ps(a, od, b));
  }
}

// head h of r's share of ahead's D / 2 lines, asked for before the head's products
template <int D>
inline void prefetch_share(const Ahead& ahead, int64_t h, int64_t r) {
  if (!ahead.rows) return;
  const int64_t share = (D / 2 + r - 1) / r;
  for (int64_t i = h * share; i < std::min<int64_t>(D / 2, (h + 1) * share); ++i) fetch_line<D>(ahead, i);
}

// s[h ld + j] = scale q_h . K[blk[j]] for 16 tokens j and the one or two heads h of qp (r, D) in widen's order, each
// row widened as it is read. ahead: the lines to ask for, a share before each head's products.
template <int D>
inline void scores16(const float* qp, int64_t r, const uint16_t* K, int64_t rw, const int64_t* blk, float scale,
                     float* s, int64_t ld, const Ahead& ahead) {
  for (int64_t h = 0; h < r; ++h) {
    __m512 qv[D / 16];
    for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(qp + h * D + 16 * c);
    prefetch_share<D>(ahead, h, r);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      const uint16_t* k = K + blk[j] * rw;
      acc[j] = _mm512_setzero_ps();
      for (int c = 0; c < D; c += 32) {
        __m512 e, o;
        widen(k + c, e, o);
        acc[j] = _mm512_fmadd_ps(qv[c / 16 + 1], o, _mm512_fmadd_ps(qv[c / 16], e, acc[j]));
      }
    }
    _mm512_storeu_ps(s + h * ld, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
  }
}

// A[h D + c0 + (0, 32 W)] += sum_j p[h ld + j] V[blk[j]][c0 + (0, 32 W)] for HN heads
template <int D, int HN, int W>
inline void values_heads(const float* p, int64_t ld, int64_t nb, const uint16_t* V, int64_t rw, const int64_t* blk,
                         int64_t c0, float* A) {
  __m512 acc[HN][2 * W];  // [h][2x]: channels c0 + 32x + even; [h][2x + 1]: the odd ones
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < 2 * W; ++x) acc[h][x] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    const uint16_t* v = V + blk[j] * rw + c0;
    __m512 w[2 * W];
    for (int x = 0; x < W; ++x) widen(v + 32 * x, w[2 * x], w[2 * x + 1]);
    for (int h = 0; h < HN; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * ld + j]);
      for (int x = 0; x < 2 * W; ++x) acc[h][x] = _mm512_fmadd_ps(ph, w[x], acc[h][x]);
    }
  }
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < W; ++x) {  // (even, odd) -> channels c0 + 32x + (0, 16) and + (16, 32)
      float* a = A + h * D + c0 + 32 * x;
      const __m512 e = acc[h][2 * x], o = acc[h][2 * x + 1];
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(e, lo, o)));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_permutex2var_ps(e, hi, o)));
    }
}

// A[h D + c] += sum_j p[h ld + j] V[blk[j]][c] for nb tokens and the r heads: up to 4 heads over 64 channels a
// pass, or 5 to 8 over 32 (each row widened once a pass: fewer passes for more heads, 16 accumulators either way)
template <int D>
inline void values(const float* p, int64_t ld, int64_t r, int64_t nb, const uint16_t* V, int64_t rw,
                   const int64_t* blk, float* A) {
  if (r > 4) {
    for (int64_t h0 = 0; h0 < r; h0 += 8)
      for (int64_t c0 = 0; c0 < D; c0 += 32) {
        const float* ph = p + h0 * ld;
        float* a = A + h0 * D;
        switch (r - h0 < 8 ? r - h0 : 8) {
          case 1: values_heads<D, 1, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 2: values_heads<D, 2, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 3: values_heads<D, 3, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 4: values_heads<D, 4, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 5: values_heads<D, 5, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 6: values_heads<D, 6, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          case 7: values_heads<D, 7, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
          default: values_heads<D, 8, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
        }
      }
    return;
  }
  for (int64_t c0 = 0; c0 < D; c0 += 64)
    switch (r) {
      case 1: values_heads<D, 1, 2>(p, ld, nb, V, rw, blk, c0, A); break;
      case 2: values_heads<D, 2, 2>(p, ld, nb, V, rw, blk, c0, A); break;
      case 3: values_heads<D, 3, 2>(p, ld, nb, V, rw, blk, c0, A); break;
      default: values_heads<D, 4, 2>(p, ld, nb, V, rw, blk, c0, A); break;
    }
}

// 16 lanes of exp(x) for x <= 0: exp_neg's polynomial (common.h)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180375e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_max_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)),
                                     _mm512_setzero_si512());
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// the larger of m and the most of s[0, n)
inline float max_of(const float* s, int64_t n, float m) {
  __m512 v = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += 16) v = _mm512_max_ps(v, _mm512_mask_loadu_ps(v, first(n - j), s + j));
  return _mm512_reduce_max_ps(v);
}

// s[j] = exp(s[j] - m) for j < n; their sum
inline float exp_sum(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 l = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 in = first(n - j);
    const __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + j), mv)));
    _mm512_mask_storeu_ps(s + j, in, e);
    l = _mm512_add_ps(l, e);
  }
  return _mm512_reduce_add_ps(l);
}

}  // namespace attend512
#endif
