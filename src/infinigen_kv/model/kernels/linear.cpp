// linear: y (R, out) = x (R, in) W^T + bias (+ residual) for a decode step's few rows, W float32, bfloat16, int8
// rows, or int4, int5 or int8 tiles (weight_rows.h), read once at the memory's rate; a prompt chunk's rows on tiles.

#include "kernels.h"
#include "rows_dot.h"
#include "weight_rows.h"

namespace {

#ifndef Q4_AHEAD
#define Q4_AHEAD 1536
#endif
constexpr int64_t TILE_SPAN = 256 << 10;  // bytes of weight tiles a task's blocks of rows go over in turn (in L2)

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


// the lines of a tile's group (BYTES long) Q4_AHEAD bytes ahead of tg, asked for now
template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* tg) {
#ifdef IG_AVX2
  for (int k = 0; k < BYTES; k += 64) _mm_prefetch(reinterpret_cast<const char*>(tg + Q4_AHEAD + k), _MM_HINT_T0);
#endif
}

#ifdef IG_VNNI512
// 16 rows' integer dots with a group of 32 activations at xg: lv[c] holds the rows' values 4c..4c+3 (chunk order as a
// tile's: lv[0..3] the group's first 16, lv[4..7] its last), the activations broadcast four at a time straight from
// memory (a load, no register moves: a prompt chunk's rate); two chains, the first started at init
inline __m512i chunks_dot(const __m512i* lv, const int8_t* xg, __m512i init) {
  auto x4 = [xg](int c) { return _mm512_broadcastd_epi32(_mm_loadu_si32(xg + 4 * c)); };
  __m512i p0 = _mm512_dpbusd_epi32(init, lv[0], x4(0));
  __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[4], x4(4));
  for (int c = 1; c < 4; ++c) {
    p0 = _mm512_dpbusd_epi32(p0, lv[c], x4(c));
    p1 = _mm512_dpbusd_epi32(p1, lv[4 + c], x4(4 + c));
  }
  return _mm512_add_epi32(p0, p1);
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
    prefetch_ahead<TG>(tg);
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
#pragma GCC unroll 8  // (the accumulators stay in registers only unrolled)
    for (int b = 0; b < RB; ++b) {
      const __m512i p = chunks_dot(lv, xq + b * in + g * Q4_GROUP, _mm512_setzero_si512());
      const __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(xs[b * ng + g]));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[b]);
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
      if (h == 0) prefetch_ahead<TG>(tg);
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

// y[b * ldy + o] (o < 16) = x[b] . (row o of the int8 tile at t) for RB rows of int8 activations (row b's values at
// xq + b in, its groups' scales and integer sums at xs + b ng, xi + b ng). Per lane the group's exact integer dot,
// then acc = fma(float(dot), d sx, acc) group by group: the same bits on every path. 512-bit VNNI multiplies the
// values + 128 (w xor 0x80, unsigned) by the activations and takes 128 sum(xq) back out; AVX2 multiplies |w| by the
// activations signed as w (maddubs: a pair at most 2 x 128 x 127, no saturation), a chunk's pairs summed in int32.
template <int RB>
inline void tile_dot_q8(const uint8_t* __restrict t, const int8_t* __restrict xq, const float* __restrict xs,
                        const int32_t* __restrict xi, int64_t in, float* y, int64_t ldy) {
  const int64_t ng = in / KV_GROUP;
#ifdef IG_VNNI512
  __m512 acc[RB];
  for (int b = 0; b < RB; ++b) acc[b] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* tg = t + g * Q8_TILE_GROUP;
    prefetch_ahead<Q8_TILE_GROUP>(tg);
    __m512i lv[8];  // lv[c]: values 4c..4c+3 of the 16 rows (chunks_dot's order: the first 16, then the last)
    for (int c = 0; c < 8; ++c) lv[c] = _mm512_xor_si512(_mm512_loadu_si512(tg + 64 * c), flip);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 512)));
#pragma GCC unroll 8
    for (int b = 0; b < RB; ++b) {
      const __m512i p = chunks_dot(lv, xq + b * in + g * KV_GROUP, _mm512_set1_epi32(-128 * xi[b * ng + g]));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dv, _mm512_set1_ps(xs[b * ng + g])), acc[b]);
    }
  }
  for (int b = 0; b < RB; ++b) _mm512_storeu_ps(y + b * ldy, acc[b]);
#elif defined(IG_AVX2)
  for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: the 32-byte halves of each chunk
    __m256 acc[RB];
    for (int b = 0; b < RB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* tg = t + g * Q8_TILE_GROUP;
      if (h == 0) prefetch_ahead<Q8_TILE_GROUP>(tg);
      __m256i lv[8];
      for (int c = 0; c < 8; ++c) lv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 64 * c + 32 * h));
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + 512 + 16 * h)));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      for (int c = 0; c < 8; ++c) lv[c] = _mm256_xor_si256(lv[c], _mm256_set1_epi8(char(0x80)));
#else
      __m256i la[8];
      for (int c = 0; c < 8; ++c) la[c] = _mm256_abs_epi8(lv[c]);
      const __m256i ones = _mm256_set1_epi16(1);
#endif
      for (int b = 0; b < RB; ++b) {
        int32_t x4[8];
        std::memcpy(x4, xq + b * in + g * KV_GROUP, 32);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        __m256i p = _mm256_set1_epi32(-128 * xi[b * ng + g]);
        for (int c = 0; c < 8; ++c) p = _mm256_dpbusd_epi32(p, lv[c], _mm256_set1_epi32(x4[c]));
#elif defined(__AVXVNNI__)
        __m256i p = _mm256_set1_epi32(-128 * xi[b * ng + g]);
        for (int c = 0; c < 8; ++c) p = _mm256_dpbusd_avx_epi32(p, lv[c], _mm256_set1_epi32(x4[c]));
#else
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c)
          p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(la[c], _mm256_sign_epi8(_mm256_set1_epi32(x4[c]),
                                                                                                    lv[c])), ones));
#endif
        const __m256 sc = _mm256_mul_ps(dv, _mm256_set1_ps(xs[b * ng + g]));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[b]);
      }
    }
    for (int b = 0; b < RB; ++b) _mm256_storeu_ps(y + b * ldy + 8 * h, acc[b]);
  }
#else
  float acc[RB][Q4_TILE] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* tg = t + g * Q8_TILE_GROUP;
    for (int64_t o = 0; o < Q4_TILE; ++o) {
      const float d = half_at(reinterpret_cast<const int8_t*>(tg + 512 + 2 * o));
      for (int b = 0; b < RB; ++b) {
        const int8_t* xg = xq + b * in + g * KV_GROUP;
        int32_t dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) dot += int32_t(int8_t(tg[64 * c + 4 * o + j])) * xg[4 * c + j];
        acc[b][o] = std::fma(float(dot), d * xs[b * ng + g], acc[b][o]);
      }
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int64_t o = 0; o < Q4_TILE; ++o) y[b * ldy + o] = acc[b][o];
#endif
}

// y[b * ldy + o] (o < 16) = x[b] . (row o of the int6 tile at t) for RB rows of int8 activations (row b's values at
// xq + b in, its groups' scales at xs + b ng, the integer sums of its groups' values 0-15 and 16-31 at xl + b ng and
// xh + b ng). Per lane and group: the exact integer sc_lo sum((q - 32) x) over values 0-15 plus sc_hi's over 16-31
// (|total| < 2^24: exact in float32), then acc = fma(float(total), d sx, acc): the same bits on every path.
template <int RB>
inline void tile_dot_q6(const uint8_t* __restrict t, const int8_t* __restrict xq, const float* __restrict xs,
                        const int32_t* __restrict xl, const int32_t* __restrict xh, int64_t in, float* y,
                        int64_t ldy) {
  const int64_t ng = in / Q4_GROUP;
#ifdef IG_VNNI512
  __m512 acc[RB];
  for (int b = 0; b < RB; ++b) acc[b] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* sb = t + (g / 8) * Q6_BLOCK;
    const uint8_t* tg = sb + 32 + (g % 8) * Q6_GROUP;
    prefetch_ahead<Q6_GROUP>(tg);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512i h0 = _mm512_loadu_si512(tg + 256), h1 = _mm512_loadu_si512(tg + 320);
    __m512i lv[8];  // q[4c..4c+3] | their high bits << 4 (lv[c]), q[16+4c..] (lv[4 + c])
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(tg + 64 * c);
      const int sh = 4 - 2 * c;  // the high bits 2c, 2c + 1 of each byte to bits 4, 5
      const __m512i a = sh > 0 ? _mm512_slli_epi32(h0, sh) : sh < 0 ? _mm512_srli_epi32(h0, -sh) : h0;
      const __m512i b = sh > 0 ? _mm512_slli_epi32(h1, sh) : sh < 0 ? _mm512_srli_epi32(h1, -sh) : h1;
      lv[c] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), a, two, 0xF8);  // A | (B & C)
      lv[4 + c] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), b, two, 0xF8);
    }
    const __m512i slo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + 384)));
    const __m512i shi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + 400)));
#pragma GCC unroll 8
    for (int b = 0; b < RB; ++b) {
      const int8_t* xg = xq + b * in + g * Q4_GROUP;
      auto x4 = [xg](int c) { return _mm512_broadcastd_epi32(_mm_loadu_si32(xg + 4 * c)); };
      __m512i p0 = _mm512_set1_epi32(-32 * xl[b * ng + g]), p1 = _mm512_set1_epi32(-32 * xh[b * ng + g]);
      for (int c = 0; c < 4; ++c) {
        p0 = _mm512_dpbusd_epi32(p0, lv[c], x4(c));
        p1 = _mm512_dpbusd_epi32(p1, lv[4 + c], x4(4 + c));
      }
      const __m512i total = _mm512_add_epi32(_mm512_mullo_epi32(p0, slo), _mm512_mullo_epi32(p1, shi));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, _mm512_set1_ps(xs[b * ng + g])), acc[b]);
    }
  }
  for (int b = 0; b < RB; ++b) _mm512_storeu_ps(y + b * ldy, acc[b]);
#elif defined(IG_AVX2)
  for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: the 32-byte halves of each vector
    __m256 acc[RB];
    for (int b = 0; b < RB; ++b) acc[b] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* sb = t + (g / 8) * Q6_BLOCK;
      const uint8_t* tg = sb + 32 + (g % 8) * Q6_GROUP;
      if (h == 0) prefetch_ahead<Q6_GROUP>(tg);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 256 + 32 * h));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 320 + 32 * h));
      __m256i lv[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 64 * c + 32 * h));
        const int sh = 4 - 2 * c;
        const __m128i n = _mm_cvtsi32_si128(sh > 0 ? sh : -sh);
        const __m256i a = sh >= 0 ? _mm256_sll_epi32(h0, n) : _mm256_srl_epi32(h0, n);
        const __m256i b = sh >= 0 ? _mm256_sll_epi32(h1, n) : _mm256_srl_epi32(h1, n);
        lv[c] = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(a, two));
        lv[4 + c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(b, two));
      }
      const __m256i slo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tg + 384 + 8 * h)));
      const __m256i shi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tg + 400 + 8 * h)));
      for (int b = 0; b < RB; ++b) {
        int32_t x4[8];
        std::memcpy(x4, xq + b * in + g * Q4_GROUP, 32);
        __m256i p0 = _mm256_set1_epi32(-32 * xl[b * ng + g]), p1 = _mm256_set1_epi32(-32 * xh[b * ng + g]);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
        for (int c = 0; c < 4; ++c) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
          p0 = _mm256_dpbusd_epi32(p0, lv[c], _mm256_set1_epi32(x4[c]));
          p1 = _mm256_dpbusd_epi32(p1, lv[4 + c], _mm256_set1_epi32(x4[4 + c]));
#else
          p0 = _mm256_dpbusd_avx_epi32(p0, lv[c], _mm256_set1_epi32(x4[c]));
          p1 = _mm256_dpbusd_avx_epi32(p1, lv[4 + c], _mm256_set1_epi32(x4[4 + c]));
#endif
        }
#else  // a pair at most 2 x 63 x 127 = 16002: two chunks' pairs in int16 (32004), then int32
        const __m256i ones = _mm256_set1_epi16(1);
        for (int c = 0; c < 4; c += 2) {
          const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lv[c], _mm256_set1_epi32(x4[c])),
                                              _mm256_maddubs_epi16(lv[c + 1], _mm256_set1_epi32(x4[c + 1])));
          const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lv[4 + c], _mm256_set1_epi32(x4[4 + c])),
                                              _mm256_maddubs_epi16(lv[5 + c], _mm256_set1_epi32(x4[5 + c])));
          p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(s0, ones));
          p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(s1, ones));
        }
#endif
        const __m256i total = _mm256_add_epi32(_mm256_mullo_epi32(p0, slo), _mm256_mullo_epi32(p1, shi));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(xs[b * ng + g])),
                                 acc[b]);
      }
    }
    for (int b = 0; b < RB; ++b) _mm256_storeu_ps(y + b * ldy + 8 * h, acc[b]);
  }
#else
  float acc[RB][Q4_TILE] = {};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* sb = t + (g / 8) * Q6_BLOCK;
    const uint8_t* tg = sb + 32 + (g % 8) * Q6_GROUP;
    for (int64_t o = 0; o < Q4_TILE; ++o) {
      const float d = half_at(reinterpret_cast<const int8_t*>(sb + 2 * o));
      const int32_t slo = int8_t(tg[384 + o]), shi = int8_t(tg[400 + o]);
      for (int b = 0; b < RB; ++b) {
        const int8_t* xg = xq + b * in + g * Q4_GROUP;
        int32_t lo = 0, hi = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = tg[64 * c + 4 * o + j];
            const int32_t q0 = (byte & 0x0F) | ((tg[256 + 4 * o + j] >> (2 * c)) & 3) << 4;
            const int32_t q1 = (byte >> 4) | ((tg[320 + 4 * o + j] >> (2 * c)) & 3) << 4;
            lo += (q0 - 32) * xg[4 * c + j];
            hi += (q1 - 32) * xg[16 + 4 * c + j];
          }
        acc[b][o] = std::fma(float(lo * slo + hi * shi), d * xs[b * ng + g], acc[b][o]);
      }
    }
  }
  for (int b = 0; b < RB; ++b)
    for (int64_t o = 0; o < Q4_TILE; ++o) y[b * ldy + o] = acc[b][o];
#endif
}

// int5, int8 and int6 tiles' storage types in linear_impl (the tensors' bytes, float8_e5m2, float8_e4m3fn and
// float8_e5m2fnuz as PyTorch marks them)
struct int5_t {
  uint8_t byte;
};
struct int8t_t {
  int8_t byte;
};
struct int6t_t {
  uint8_t byte;
};

template <typename W>
void linear_impl(const float* x, const W* wp, const float* bias, const float* res, int64_t R, int64_t in, int64_t out,
                 float* y, bool bf16 = false) {
  constexpr bool I8T = std::is_same_v<W, int8t_t>, I8 = std::is_same_v<W, int8_t> || I8T,
                 I4 = std::is_same_v<W, uint8_t>, I5 = std::is_same_v<W, int5_t>, I6 = std::is_same_v<W, int6t_t>;
  const int64_t ldw = I8 ? kv_width(in) : I4 ? q4_width(in) : I5 ? q5_width(in) : I6 ? q6_width(in) : in;
  std::optional<QuantizedX8> qx8;  // int8, int6, int5 and int4 weights: the activations in int8
  if constexpr (I8 || I4 || I5 || I6) qx8.emplace(x, R, in);
  std::vector<int32_t> xlo, xhi;  // int6: the sums of each group's values 0-15 and 16-31
  if constexpr (I6) {
    xlo.resize(R * qx8->ng);
    xhi.resize(R * qx8->ng);
    for (int64_t i = 0; i < R * qx8->ng; ++i) {
      const int8_t* v = qx8->q.data() + (i / qx8->ng) * qx8->pad + (i % qx8->ng) * KV_GROUP;
      int32_t lo = 0;
      for (int j = 0; j < 16; ++j) lo += v[j];
      xlo[i] = lo;
      xhi[i] = qx8->isum[i] - lo;
    }
  }
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
    if constexpr (I8)  // (int8 tiles: their last out % 16 rows)
      rows_dot_q8<RB>(reinterpret_cast<const int8_t*>(w), qx8->q.data() + b * qx8->pad, qx8->s.data() + b * qx8->ng, qx8->isum.data() + b * qx8->ng, in,
                      qx8->pad, yo, out);
    else if constexpr (I4)
      rows_dot_q4<RB>(w, qx8->q.data() + b * qx8->pad, qx8->s.data() + b * qx8->ng, qx8->sum.data() + b * qx8->ng, in, yo,
                      out);
#ifdef IG_BF16_DOTS
    else if (std::is_same_v<W, uint16_t> && !xb.empty())
      bf16dots::rows_dot<RB>(reinterpret_cast<const uint16_t*>(w), xb.data() + b * in, in, yo, out);
#endif
    else if constexpr (!I5 && !I6)  // (int5 and int6 weights are whole tiles)
      rows_dot<RB>(w, x + b * in, in, yo, out);
  };
  auto in_blocks = [&](auto&& f, int64_t n) {  // f(rb, b) over n rows of x in blocks of rb = 4, then 2, then 1
    int64_t b = 0;
    for (; b + 4 <= n; b += 4) f(std::integral_constant<int, 4>{}, b);
    if (n - b >= 2) {
      f(std::integral_constant<int, 2>{}, b);
      b += 2;
    }
    if (b < n) f(std::integral_constant<int, 1>{}, b);
  };
  auto in_blocks8 = [&](auto&& f) {  // tiles: blocks of 8 rows first (a prompt chunk's), then in_blocks
    int64_t b = 0;
#ifdef IG_VNNI512  // (32 registers: a block's accumulators and the group's levels; AVX2's 16 hold 4 rows')
    for (; b + 8 <= R; b += 8) f(std::integral_constant<int, 8>{}, b);
#endif
    if (b < R) in_blocks([&](auto rb, int64_t c) { f(rb, b + c); }, R - b);
  };
  auto row = [&](int64_t o) {  // output o for every row of x, from weight row o
    in_blocks([&](auto rb, int64_t b) { rows(rb, wp + o * ldw, b, y + b * out + o); }, R);
  };
  auto finish = [&](int64_t o0, int64_t o1) {  // bias, then the residual
    for (int64_t o = o0; o < o1; ++o) {
      if (bias)
        for (int64_t j = 0; j < R; ++j) y[j * out + o] += bias[o];
      if (res)
        for (int64_t j = 0; j < R; ++j) y[j * out + o] = res[j * out + o] + y[j * out + o];
    }
  };
  // Tiles of 16 rows (int4, int5 and int8 tiles) in runs of TILE_SPAN bytes a task: each block of rows of x goes
  // over every tile of a run (its activations stay in L1 and its outputs in a few pages; a tile is read from L2 once
  // a block), then the weight rows after the last tile. dot(rb, tile, b, o0): rows b.. of x on the tile at `tile`.
  auto over_tiles = [&](auto&& dot) {
    const int64_t tile_bytes = Q4_TILE * ldw * int64_t(sizeof(W)), ntiles = out / Q4_TILE;
    const int64_t run = std::max<int64_t>(1, TILE_SPAN / tile_bytes);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(wp);
    at::parallel_for(0, ntiles + (out % Q4_TILE ? 1 : 0), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t r0 = t0; r0 < t1; r0 += run) {
        const int64_t r1 = std::min(t1, r0 + run), e = std::min(r1, ntiles);
        in_blocks8([&](auto rb, int64_t b) {
          for (int64_t t = r0; t < e; ++t) dot(rb, base + t * tile_bytes, b, t * Q4_TILE);
        });
        if (e < r1)  // a row of x at a time: its bits the same wherever it lies among the rows of a call
          for (int64_t o = ntiles * Q4_TILE; o < out; ++o)
            for (int64_t b = 0; b < R; ++b) rows(std::integral_constant<int, 1>{}, wp + o * ldw, b, y + b * out + o);
        finish(r0 * Q4_TILE, std::min(out, r1 * Q4_TILE));
      }
    });
  };
  auto qx = [&](int64_t b) { return qx8->q.data() + b * qx8->pad; };
  if constexpr (I6) {
    over_tiles([&](auto rb, const uint8_t* tl, int64_t b, int64_t o0) {
      tile_dot_q6<decltype(rb)::value>(tl, qx(b), qx8->s.data() + b * qx8->ng, xlo.data() + b * qx8->ng,
                                       xhi.data() + b * qx8->ng, in, y + b * out + o0, out);
    });
    return;
  }
  if constexpr (I8T) {
    over_tiles([&](auto rb, const uint8_t* tl, int64_t b, int64_t o0) {
      tile_dot_q8<decltype(rb)::value>(tl, qx(b), qx8->s.data() + b * qx8->ng, qx8->isum.data() + b * qx8->ng, in,
                                       y + b * out + o0, out);
    });
    return;
  }
  if constexpr (I4 || I5) {
    over_tiles([&](auto rb, const uint8_t* tl, int64_t b, int64_t o0) {
      tile_dot_q<decltype(rb)::value, I5 ? 5 : 4>(tl, qx(b), qx8->s.data() + b * qx8->ng, qx8->sum.data() + b * qx8->ng,
                                                in, y + b * out + o0, out);
    });
    return;
  }
  at::parallel_for(0, out, 16, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) row(o);
    finish(o0, o1);
  });
}

}  // namespace

// x (R, in) float32, W (out, in) float32 or bfloat16, or (out, kv_width(in)) int8 rows or int8 tiles
// (float8_e4m3fn), or (out, q4_width(in)) uint8 int4 rows, or (out, q5_width(in)) int5 tiles (float8_e5m2), bias (out)
// float32 or None -> (R, out) float32
// residual (R, out) float32 or None: returns residual + (x W^T + bias), as x + linear(...) rounds it
// bf16: a bfloat16 W multiplies x rounded to bfloat16 in bfloat16 products where the build has them (bf16_dots.h)
// Tiled weights give a row of x the same bits at any row count: a prompt chunk's rows and a decode step's alike.
at::Tensor linear(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> residual,
                  bool bf16) {
  check_cpu_contig(x, "x");
  check_cpu_contig(W, "W");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool i8 = W.scalar_type() == at::kChar, i4 = W.scalar_type() == at::kByte,
             i5 = W.scalar_type() == at::kFloat8_e5m2, i8t = W.scalar_type() == at::kFloat8_e4m3fn,
             i6 = W.scalar_type() == at::kFloat8_e5m2fnuz;
  TORCH_CHECK(W.scalar_type() == at::kFloat || W.scalar_type() == at::kBFloat16 || i8 || i4 || i5 || i8t || i6,
              "W must be float32, bfloat16, int8 rows or tiles, int6 or int5 tiles or int4 rows");
  const int64_t R = x.size(0), in = x.size(1), out = W.size(0);
  TORCH_CHECK(!(i4 || i5 || i8t) || in % Q4_GROUP == 0, "int4, int5 and int8 tiles need whole groups of 32");
  TORCH_CHECK(!(i5 || i6) || out % Q4_TILE == 0, "int5 and int6 rows are held in whole tiles of 16 rows");
  TORCH_CHECK(!i6 || in % 256 == 0, "int6 rows need whole super-blocks of 256");
  TORCH_CHECK(x.dim() == 2 && W.dim() == 2 &&
              W.size(1) == (i8 || i8t ? kv_width(in) : i4 ? q4_width(in) : i5 ? q5_width(in) : i6 ? q6_width(in) : in),
              "bad shapes");
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
  else if (i6)
    linear_impl(x.data_ptr<float>(), reinterpret_cast<const int6t_t*>(W.data_ptr()), bp, rp, R, in, out,
                y.data_ptr<float>());
  else if (i8t)
    linear_impl(x.data_ptr<float>(), reinterpret_cast<const int8t_t*>(W.data_ptr()), bp, rp, R, in, out,
                y.data_ptr<float>());
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
