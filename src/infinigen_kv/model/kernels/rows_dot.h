// A weight row's dot products with a few activation rows (a decode step's linears): float32 or bfloat16 rows in
// float32, int8 rows (q8_0 groups) by integer products with the activations quantized once a call (QuantizedX8).
// Shared by linear.cpp and partial_query.cpp.
#pragma once

#include "common.h"

namespace {

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
    // rows in parallel where there are many (a prompt chunk's): each row's bytes are the same either way
    at::parallel_for(0, R, R >= 64 ? 16 : R, [&](int64_t r0, int64_t r1) { for (int64_t r = r0; r < r1; ++r)
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
    });
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

}  // namespace
