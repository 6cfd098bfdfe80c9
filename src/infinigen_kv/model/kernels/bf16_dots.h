// bfloat16 dot products (AVX-512 BF16) for the decode kernels: a decode query's attention over bfloat16 K/V
// rows, and a decode step's few rows times a weight held in bfloat16.
//
// vdpbf16ps multiplies 32 stored bfloat16 pairs into 16 float32 sums in one instruction, four times the float32 FMAs
// of widened bfloat16 values per instruction. The other operand (the query, the attention's probabilities, a linear's
// input rows) is rounded to bfloat16 for the products, as PyTorch's and llama.cpp's half-precision paths round it;
// sums and the softmax stay float32.
//
// Attention: the r query heads of a KV head each score and weigh every row (r = 7 on Qwen2.5: 7 x 128 multiply-adds a
// row of 64 channels). Here a row's scores are 16 tokens of one head at a time (their sums reduced together, no
// horizontal sum a token) and the values two tokens at a time (the pair interleaved once for up to 4 heads). Used for
// rows of LONG_ROWS tokens or more for up to the backend's attend_pairs_upto query heads a KV head (model/backend.py): where
// vdpbf16ps is slow (one a two cycles on the Xeons measured) attend512.h's float32 products of widened rows serve.
//
// Linears: from two rows on, float32 FMAs of widened weights are the decode step's bound (the 0.5B at B4: ~58 GFLOP/s,
// under half the weight stream's rate); in bfloat16 products the step reads its weights at the bandwidth.

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define IG_BF16_DOTS 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attend512.h"

namespace bf16dots {

constexpr int64_t LONG_ROWS = 64;  // a row's tokens from which its decode attention runs in bfloat16 products

inline __m512bh bh(__m512i x) { return (__m512bh)x; }

// x[0, n) float32 (n a multiple of 16) -> bfloat16 bits (round to nearest even)
inline void round_rows(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

// s[h ld + j] = scale q_h . K[blk[j]] for 16 tokens j and every head h of qb (r, D) bfloat16; K rows of stride rw;
// ahead: as attend512::scores16's
template <int D>
inline void scores16(const uint16_t* qb, int64_t r, const uint16_t* K, int64_t rw, const int64_t* blk, float scale,
                     float* s, int64_t ld, const attend512::Ahead& ahead) {
  for (int64_t h = 0; h < r; ++h) {
    __m512i qv[D / 32];
    for (int c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512(qb + h * D + 32 * c);
    attend512::prefetch_share<D>(ahead, h, r);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      const uint16_t* k = K + blk[j] * rw;
      acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), bh(qv[0]), bh(_mm512_loadu_si512(k)));
      for (int c = 1; c < D / 32; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], bh(qv[c]), bh(_mm512_loadu_si512(k + 32 * c)));
    }
    _mm512_storeu_ps(s + h * ld, _mm512_mul_ps(attend512::hsum16(acc), _mm512_set1_ps(scale)));
  }
}

// A[h D + c0 + (0, 64)] += sum_j P[h][j] V[blk[j]][c0 + (0, 64)] for HN heads, P as bfloat16 pairs (pb: row stride
// lp, two tokens a 32-bit word), the tokens two at a time: their rows' channels interleaved into pairs
// (unpacklo/hi: 128-bit lane L of the first holds channels 8L..8L+3, of the second 8L+4..8L+7), put back in order
// once at the end.
template <int D, int HN>
inline void values_heads(const uint16_t* pb, int64_t lp, int64_t nb, const uint16_t* V, int64_t rw,
                         const int64_t* blk, int64_t c0, float* A) {
  __m512 acc[HN][4];
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < 4; ++x) acc[h][x] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; j += 2) {
    const uint16_t* v0 = V + blk[j] * rw + c0;
    const uint16_t* v1 = j + 1 < nb ? V + blk[j + 1] * rw + c0 : v0;  // (an odd last token: its pair weighs 0)
    __m512i w[4];
    for (int x = 0; x < 2; ++x) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * x), b = _mm512_loadu_si512(v1 + 32 * x);
      w[2 * x] = _mm512_unpacklo_epi16(a, b);
      w[2 * x + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < HN; ++h) {
      uint32_t pair;
      std::memcpy(&pair, pb + h * lp + j, 4);
      const __m512bh p = bh(_mm512_set1_epi32(static_cast<int>(pair)));
      for (int x = 0; x < 4; ++x) acc[h][x] = _mm512_dpbf16_ps(acc[h][x], p, bh(w[x]));
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int x = 0; x < 2; ++x) {  // channels c0 + 32x + (0, 16) and + (16, 32) from the (lo, hi) pair
      const __m512 lo = acc[h][2 * x], hi = acc[h][2 * x + 1];
      const __m512 t = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 u = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
      float* a = A + h * D + c0 + 32 * x;
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(3, 1, 2, 0))));
      _mm512_storeu_ps(a + 16,
                       _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(3, 1, 2, 0))));
    }
}

// A[h D + c] += sum_j p[h ld + j] V[blk[j]][c] for nb tokens and every head; pb: scratch of r (ld + 16) bfloat16
template <int D>
inline void values(const float* p, int64_t ld, int64_t r, int64_t nb, const uint16_t* V, int64_t rw,
                   const int64_t* blk, float* A, uint16_t* pb) {
  const int64_t lp = ld + 16;
  for (int64_t h = 0; h < r; ++h)
    for (int64_t j = 0; j < nb; j += 16) {
      const __mmask16 in = j + 16 <= nb ? __mmask16(0xffff) : __mmask16((1u << (nb - j)) - 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + h * lp + j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, p + h * ld + j)));
    }
  for (int64_t h0 = 0; h0 < r; h0 += 4)
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      const uint16_t* ph = pb + h0 * lp;
      float* a = A + h0 * D;
      switch (r - h0 < 4 ? r - h0 : 4) {
        case 1: values_heads<D, 1>(ph, lp, nb, V, rw, blk, c0, a); break;
        case 2: values_heads<D, 2>(ph, lp, nb, V, rw, blk, c0, a); break;
        case 3: values_heads<D, 3>(ph, lp, nb, V, rw, blk, c0, a); break;
        default: values_heads<D, 4>(ph, lp, nb, V, rw, blk, c0, a); break;
      }
    }
}

// y[b ldy] = x[b] . w for the RB rows of xb (bfloat16, row stride in) and one bfloat16 weight row w (in): two chains
// of 32-channel products, the last (in % 32) channels by a masked load; the same arithmetic for every RB, so that a
// row's result does not depend on how many rows share the call
template <int RB>
inline void rows_dot(const uint16_t* __restrict w, const uint16_t* __restrict xb, int64_t in, float* y, int64_t ldy) {
  __m512 acc[RB][2];
  for (int b = 0; b < RB; ++b) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= in; i += 64) {
    const __m512i w0 = _mm512_loadu_si512(w + i), w1 = _mm512_loadu_si512(w + i + 32);
    for (int b = 0; b < RB; ++b) {
      acc[b][0] = _mm512_dpbf16_ps(acc[b][0], bh(_mm512_loadu_si512(xb + b * in + i)), bh(w0));
      acc[b][1] = _mm512_dpbf16_ps(acc[b][1], bh(_mm512_loadu_si512(xb + b * in + i + 32)), bh(w1));
    }
  }
  for (; i < in; i += 32) {
    const __mmask32 m = in - i >= 32 ? ~__mmask32(0) : __mmask32((1u << (in - i)) - 1);
    const __m512i wv = _mm512_maskz_loadu_epi16(m, w + i);
    for (int b = 0; b < RB; ++b)
      acc[b][0] = _mm512_dpbf16_ps(acc[b][0], bh(_mm512_maskz_loadu_epi16(m, xb + b * in + i)), bh(wv));
  }
  for (int b = 0; b < RB; ++b) y[b * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]));
}

// x (R, in) float32 -> bfloat16 bits (round to nearest even), any in
inline void round_any(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

}  // namespace bf16dots
#endif
