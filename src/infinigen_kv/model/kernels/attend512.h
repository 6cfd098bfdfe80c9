// A decode query's attention over bfloat16 K/V rows with AVX-512 float32 products, for cpu.cpp's attend.
//
// The r query heads of a KV head each score and weigh every row (r = 7 on Qwen2.5), so the work a row is r times
// its bytes. A row's 32 bfloat16 channels widen to two float32 vectors with one shift and one mask (the even
// channels, the odd ones) once for all r heads; the products are then float32 FMAs, two a cycle, where
// vdpbf16ps manages one a two cycles on the Xeons measured (its 32 products an instruction do not make up for it),
// and nothing is rounded: the query and the probabilities multiply as they are.
//
// Scores: 16 tokens of a block widened into a scratch once, then each head's 16 dot products reduced together
// (hsum16: no horizontal sum a token), the query's channels in the scratch's (even, odd) order. Values: a token's row
// widened once for up to 4 heads, each weighing it by its probability (a broadcast operand); the (even, odd) sums put
// back in channel order once a block. Softmax: 16 lanes of exp_neg's polynomial.
//
// Over the whole past the rows stream from memory: the rows two blocks of 16 ahead are prefetched, spread over the
// heads' products (the core keeps more lines in flight than its out-of-order window alone would).

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

// head h of r's share of `bytes` from ka and from va (none when ka is null): lines asked for ahead of their use, a few
// between each head's products rather than all at once (a burst stalls on the core's outstanding misses)
inline void prefetch_share(const char* ka, const char* va, int64_t bytes, int64_t h, int64_t r) {
  if (!ka) return;
  const int64_t share = (bytes / 64 + r - 1) / r * 64;
  for (int64_t o = h * share; o < std::min(bytes, (h + 1) * share); o += 64) {
    _mm_prefetch(ka + o, _MM_HINT_T0);
    _mm_prefetch(va + o, _MM_HINT_T0);
  }
}

// s[h ld + j] = scale q_h . K[blk[j]] for 16 tokens j and every head h of qp (r, D) in widen's order; kf: scratch
// of 16 D floats. ahead (or null): `bytes` of K and of V from ka, va to prefetch, a share after each head.
template <int D>
inline void scores16(const float* qp, int64_t r, const uint16_t* K, int64_t rw, const int64_t* blk, float scale,
                     float* s, int64_t ld, float* kf, const char* ka, const char* va, int64_t bytes) {
  const bool scratch = r > 2;  // (one or two heads widen each row as they read it)
  if (scratch)
    for (int j = 0; j < 16; ++j) {
      const uint16_t* k = K + blk[j] * rw;
      for (int c = 0; c < D; c += 32) {
        __m512 e, o;
        widen(k + c, e, o);
        _mm512_storeu_ps(kf + j * D + c, e);
        _mm512_storeu_ps(kf + j * D + c + 16, o);
      }
    }
  for (int64_t h = 0; h < r; ++h) {
    __m512 qv[D / 16];
    for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(qp + h * D + 16 * c);
    prefetch_share(ka, va, bytes, h, r);
    __m512 acc[16];
    if (scratch)
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + j * D));
        for (int c = 1; c < D / 16; ++c) acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kf + j * D + 16 * c), acc[j]);
      }
    else
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

// A[h D + c0 + (0, 64)] += sum_j p[h ld + j] V[blk[j]][c0 + (0, 64)] for HN heads
template <int D, int HN>
inline void values_heads(const float* p, int64_t ld, int64_t nb, const uint16_t* V, int64_t rw, const int64_t* blk,
                         int64_t c0, float* A) {
  __m512 acc[HN][4];  // [h][2x]: channels c0 + 32x + even; [h][2x + 1]: the odd ones
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < 4; ++x) acc[h][x] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    const uint16_t* v = V + blk[j] * rw + c0;
    __m512 w[4];
    widen(v, w[0], w[1]);
    widen(v + 32, w[2], w[3]);
    for (int h = 0; h < HN; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * ld + j]);
      for (int x = 0; x < 4; ++x) acc[h][x] = _mm512_fmadd_ps(ph, w[x], acc[h][x]);
    }
  }
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < 2; ++x) {  // (even, odd) -> channels c0 + 32x + (0, 16) and + (16, 32)
      float* a = A + h * D + c0 + 32 * x;
      const __m512 e = acc[h][2 * x], o = acc[h][2 * x + 1];
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(e, lo, o)));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_permutex2var_ps(e, hi, o)));
    }
}

// A[h D + c] += sum_j p[h ld + j] V[blk[j]][c] for nb tokens and the r heads, in fours
template <int D>
inline void values(const float* p, int64_t ld, int64_t r, int64_t nb, const uint16_t* V, int64_t rw,
                   const int64_t* blk, float* A) {
  for (int64_t h0 = 0; h0 < r; h0 += 4)
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      const float* ph = p + h0 * ld;
      float* a = A + h0 * D;
      switch (r - h0 < 4 ? r - h0 : 4) {
        case 1: values_heads<D, 1>(ph, ld, nb, V, rw, blk, c0, a); break;
        case 2: values_heads<D, 2>(ph, ld, nb, V, rw, blk, c0, a); break;
        case 3: values_heads<D, 3>(ph, ld, nb, V, rw, blk, c0, a); break;
        default: values_heads<D, 4>(ph, ld, nb, V, rw, blk, c0, a); break;
      }
    }
}

// 16 lanes of exp(x) for x <= 0: exp_neg's polynomial (cpu.cpp)
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
