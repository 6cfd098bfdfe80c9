// Attention of a prompt chunk over a long past on CPU, in bfloat16 dot products (AVX-512 BF16).
//
// A chunk of Tq queries (the last Tq of S positions) attends causally over the S keys of its row: query t sees
// keys j <= S - Tq + t. Over a long past this is most of a prefill's arithmetic (a 512-token chunk of the 0.5B over
// 16k keys: 29 GFLOP a layer), and PyTorch's CPU attention runs it in float32 at about half that precision's peak.
// Here the products are vdpbf16ps (two bfloat16 products summed into each float32 lane: twice float32's FMA rate),
// flash-attention style: the K and V rows packed once into channel pairs, then per (KV head, tile of query
// positions) key blocks of KB scored, soft-maxed online in float32 and multiplied into the float32 output. The r
// query heads of a KV head share each K/V load (their rows interleaved with the positions). The rounding is
// bfloat16's for the query and the probabilities (the K/V rows are stored in bfloat16 already), as PyTorch's
// bfloat16 attention: a relative error of ~2^-9 per product, summed in float32.
//
// Shapes: q (Tq, H, d) rows (any strides on the first two), k, v (G, S, d) float32 or bfloat16; H = G r; d a
// multiple of 64. -> (Tq, H, d) float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "attend512.h"
#define PREFILL_NATIVE 1
#else
#define PREFILL_NATIVE 0
#endif

namespace {

#if PREFILL_NATIVE

constexpr int64_t KB = 256;  // keys per block (a multiple of 32): a tile's scores (rows x KB float32) stay in L2
constexpr int64_t QT = 32;   // query positions per work item
constexpr int64_t RM = 6;    // rows per micro tile: 6 x 2 score vectors, or 6 x 4 output vectors, in registers

inline uint32_t bf16_bits(float x) {  // round to nearest even (finite x)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
inline uint32_t bits_of(float x) { return bf16_bits(x); }
inline uint32_t bits_of(at::BFloat16 x) { return x.x; }
inline uint32_t pair(uint32_t lo, uint32_t hi) { return lo | (hi << 16); }

using attend512::exp16;  // 16 lanes of exp(x), x <= 0

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// s[r][0, 32) = q[r] . k for RM rows of query pairs q (row stride d2) against a 32-key block kp (d2 x 32 pairs)
inline void scores_tile(const uint32_t* q, int64_t d2, const uint32_t* kp, float* s, int64_t lds) {
  __m512 acc[RM][2];
  for (int r = 0; r < RM; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d2; ++c) {
    __m512bh k0 = as_bh(_mm512_loadu_si512(kp + c * 32)), k1 = as_bh(_mm512_loadu_si512(kp + c * 32 + 16));
    for (int r = 0; r < RM; ++r) {
      __m512bh qb = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * d2 + c])));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  for (int r = 0; r < RM; ++r) {
    _mm512_storeu_ps(s + r * lds, acc[r][0]);
    _mm512_storeu_ps(s + r * lds + 16, acc[r][1]);
  }
}

// o[r][c0, c0 + 64) += sum_j p[r][j] v[j][c0, c0 + 64) for RM rows of probability pairs p (row stride ldp) over n2
// key pairs of vp (n2 x d pairs)
inline void values_tile(const uint32_t* p, int64_t ldp, const uint32_t* vp, int64_t d, int64_t c0, int64_t n2,
                        float* o) {
  __m512 acc[RM][4];
  for (int r = 0; r < RM; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_loadu_ps(o + r * d + c0 + 16 * x);
  for (int64_t j = 0; j < n2; ++j) {
    const uint32_t* row = vp + j * d + c0;
    __m512bh v[4];
    for (int x = 0; x < 4; ++x) v[x] = as_bh(_mm512_loadu_si512(row + 16 * x));
    for (int r = 0; r < RM; ++r) {
      __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * ldp + j])));
      for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pb, v[x]);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int x = 0; x < 4; ++x) _mm512_storeu_ps(o + r * d + c0 + 16 * x, acc[r][x]);
}

// K (G, S, d) -> (G, Sp / 32, d / 2, 32) channel pairs of 32-key blocks; V -> (G, Sp / 2, d) key pairs (v may be
// null); zeros past S
template <typename T>
void pack_kv(const T* k, const T* v, int64_t G, int64_t S, int64_t Sp, int64_t d, uint32_t* kp, uint32_t* vp) {
  const int64_t d2 = d / 2, nb = Sp / 32;
  at::parallel_for(0, G * nb, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / nb, b = i % nb;
      uint32_t* kb = kp + (g * nb + b) * d2 * 32;
      uint32_t* vb = vp + (g * Sp + b * 32) / 2 * d;
      for (int64_t jj = 0; jj < 32; ++jj) {
        const int64_t j = b * 32 + jj;
        const T* kr = k + (g * S + std::min(j, S - 1)) * d;
        for (int64_t c = 0; c < d2; ++c)
          kb[c * 32 + jj] = j < S ? pair(bits_of(kr[2 * c]), bits_of(kr[2 * c + 1])) : 0u;
      }
      for (int64_t jj = 0; v && jj < 32; jj += 2) {  // (no V: the keys alone, column_sums)
        const int64_t j = b * 32 + jj;
        const T* v0 = v + (g * S + std::min(j, S - 1)) * d;
        const T* v1 = v + (g * S + std::min(j + 1, S - 1)) * d;
        for (int64_t c = 0; c < d; ++c)
          vb[jj / 2 * d + c] = pair(j < S ? bits_of(v0[c]) : 0u, j + 1 < S ? bits_of(v1[c]) : 0u);
      }
    }
  });
}

// A tile's rows (queries of QT positions x r heads of KV head g) as bfloat16 pairs into qp (zeros past its M rows),
// with each row's number of visible keys (causal) in lim
inline int64_t tile_rows(const float* qd, int64_t qs0, int64_t qs1, int64_t g, int64_t r, int64_t d2, int64_t past,
                         int64_t t0, int64_t t1, uint32_t* qp, int64_t* lim) {
  const int64_t M = (t1 - t0) * r, Mr = (M + RM - 1) / RM * RM;
  for (int64_t i = 0; i < Mr; ++i) {  // row i: position t0 + i / r, head g r + i % r
    const bool real = i < M;
    const float* qr = qd + (t0 + i / r) * qs0 + (g * r + i % r) * qs1;
    for (int64_t c = 0; c < d2; ++c) qp[i * d2 + c] = real ? pair(bf16_bits(qr[2 * c]), bf16_bits(qr[2 * c + 1])) : 0u;
    lim[i] = real ? past + t0 + i / r + 1 : 0;
  }
  return Mr;
}

inline __mmask16 first_n(int64_t j, int64_t n) {  // lanes j .. j + 15 below n
  return j + 16 <= n ? __mmask16(0xffff) : j >= n ? __mmask16(0) : __mmask16((1u << (n - j)) - 1);
}

// One row's block of scores s[0, n32) (n valid, the rest masked) -> probabilities in bfloat16 into p (n32 / 2 pairs
// of consecutive keys), the row's running max m and sum l updated; returns the factor its output so far is rescaled
// by.
inline float softmax_block(float* s, int64_t n, int64_t n32, float scale, float& m, float& l, uint32_t* p) {
  const float NEG = -std::numeric_limits<float>::infinity();
  __m512 vmax = _mm512_set1_ps(NEG);
  for (int64_t j = 0; j < n32; j += 16) {
    __mmask16 valid = j + 16 <= n ? __mmask16(0xffff) : j >= n ? __mmask16(0) : __mmask16((1u << (n - j)) - 1);
    __m512 x = _mm512_mask_blend_ps(valid, _mm512_set1_ps(NEG), _mm512_mul_ps(_mm512_loadu_ps(s + j),
                                                                              _mm512_set1_ps(scale)));
    _mm512_storeu_ps(s + j, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float corr = m == NEG ? 0.f : std::exp(m - m_new);
  __m512 vsum = _mm512_setzero_ps(), mx = _mm512_set1_ps(m_new);
  for (int64_t j = 0; j < n32; j += 16) {
    __mmask16 valid = j + 16 <= n ? __mmask16(0xffff) : j >= n ? __mmask16(0) : __mmask16((1u << (n - j)) - 1);
    __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx)));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j / 2), (__m256i)_mm512_cvtneps_pbh(e));  // pairs j, j + 1
  }
  l = l * corr + _mm512_reduce_add_ps(vsum);
  m = m_new;
  return corr;
}

template <typename T>
at::Tensor attend_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_) {
  const int64_t Tq = q.size(0), H = q.size(1), d = q.size(2), G = k.size(0), S = k.size(1), r = H / G;
  const int64_t d2 = d / 2, Sp = (S + KB - 1) / KB * KB, past = S - Tq, tiles = (Tq + QT - 1) / QT;
  const float scale = float(scale_);
  std::vector<uint32_t> kp(G * Sp * d2), vp(G * Sp / 2 * d);
  pack_kv(k.data_ptr<T>(), v.data_ptr<T>(), G, S, Sp, d, kp.data(), vp.data());
  auto out = at::empty({Tq, H, d}, q.options().dtype(at::kFloat));
  const float* qd = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  float* od = out.data_ptr<float>();
  at::parallel_for(0, G * tiles, 1, [&](int64_t w0, int64_t w1) {
    const int64_t Mp = (QT * r + RM - 1) / RM * RM;
    std::vector<uint32_t> qp(Mp * d2), pp(Mp * KB / 2);
    std::vector<float> s(Mp * KB), o(Mp * d), m(Mp), l(Mp);
    std::vector<int64_t> lim(Mp);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / tiles, t0 = (w % tiles) * QT, t1 = std::min(Tq, t0 + QT), M = (t1 - t0) * r;
      const int64_t Mr = tile_rows(qd, qs0, qs1, g, r, d2, past, t0, t1, qp.data(), lim.data());
      std::fill(m.begin(), m.begin() + Mr, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + Mr, 0.f);
      std::fill(o.begin(), o.begin() + Mr * d, 0.f);
      const int64_t kmax = past + t1;
      for (int64_t k0 = 0; k0 < kmax; k0 += KB) {
        const int64_t n32 = std::min(KB, (kmax - k0 + 31) / 32 * 32);
        const uint32_t* kb = kp.data() + (g * Sp + k0) / 32 * d2 * 32;
        for (int64_t i = 0; i < Mr; i += RM)
          for (int64_t j = 0; j < n32; j += 32) scores_tile(&qp[i * d2], d2, kb + j * d2, &s[i * KB + j], KB);
        for (int64_t i = 0; i < Mr; ++i) {
          const int64_t n = std::max<int64_t>(0, std::min(n32, lim[i] - k0));
          const float corr = n > 0 ? softmax_block(&s[i * KB], n, n32, scale, m[i], l[i], &pp[i * KB / 2]) : 1.f;
          if (n == 0) std::fill(&pp[i * KB / 2], &pp[i * KB / 2] + n32 / 2, 0u);
          if (corr != 1.f)
            for (int64_t c = 0; c < d; ++c) o[i * d + c] *= corr;
        }
        const uint32_t* vb = vp.data() + (g * Sp + k0) / 2 * d;
        for (int64_t i = 0; i < Mr; i += RM)
          for (int64_t c0 = 0; c0 < d; c0 += 64) values_tile(&pp[i * KB / 2], KB / 2, vb, d, c0, n32 / 2, &o[i * d]);
      }
      for (int64_t i = 0; i < M; ++i) {
        float* dst = od + ((t0 + i / r) * H + g * r + i % r) * d;
        const float inv = 1.f / l[i];
        for (int64_t c = 0; c < d; ++c) dst[c] = o[i * d + c] * inv;
      }
    }
  });
  return out;
}

// Column sums of a chunk's attention probabilities: out[g][j] = the sum over the chunk's queries t and the r query
// heads of KV head g of softmax_j(q . k_j scale) (causal, as prefill_attend: t sees keys j <= S - Tq + t), in the
// same bfloat16 products. Two passes per tile of queries: each row's max and sum of exponentials, then the scores
// again, their probabilities added into the tile's own column sums; the tiles' sums added at the end.
template <typename T>
at::Tensor column_sums_impl(const at::Tensor& q, const at::Tensor& k, double scale_) {
  const int64_t Tq = q.size(0), H = q.size(1), d = q.size(2), G = k.size(0), S = k.size(1), r = H / G;
  const int64_t d2 = d / 2, Sp = (S + KB - 1) / KB * KB, past = S - Tq, tiles = (Tq + QT - 1) / QT;
  const float scale = float(scale_), NEG = -std::numeric_limits<float>::infinity();
  std::vector<uint32_t> kp(G * Sp * d2);
  pack_kv<T>(k.data_ptr<T>(), nullptr, G, S, Sp, d, kp.data(), nullptr);
  std::vector<float> part(G * tiles * Sp, 0.f);  // (G, tiles, Sp): each work item's column sums
  const float* qd = q.data_ptr<float>();
  at::parallel_for(0, G * tiles, 1, [&](int64_t w0, int64_t w1) {
    const int64_t Mp = (QT * r + RM - 1) / RM * RM;
    std::vector<uint32_t> qp(Mp * d2);
    std::vector<float> s(Mp * KB), m(Mp), l(Mp), inv(Mp);
    std::vector<int64_t> lim(Mp);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / tiles, t0 = (w % tiles) * QT, t1 = std::min(Tq, t0 + QT), M = (t1 - t0) * r;
      const int64_t Mr = tile_rows(qd, q.stride(0), q.stride(1), g, r, d2, past, t0, t1, qp.data(), lim.data());
      float* col = part.data() + w * Sp;
      const int64_t kmax = past + t1;
      std::fill(m.begin(), m.end(), NEG);
      std::fill(l.begin(), l.end(), 0.f);
      const __m512 vs = _mm512_set1_ps(scale);
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t k0 = 0; k0 < kmax; k0 += KB) {
          const int64_t n32 = std::min(KB, (kmax - k0 + 31) / 32 * 32);
          const uint32_t* kb = kp.data() + (g * Sp + k0) / 32 * d2 * 32;
          for (int64_t i = 0; i < Mr; i += RM)
            for (int64_t j = 0; j < n32; j += 32) scores_tile(&qp[i * d2], d2, kb + j * d2, &s[i * KB + j], KB);
          if (pass == 0) {  // each row's running max and sum of exponentials
            for (int64_t i = 0; i < M; ++i) {
              const int64_t n = std::min(n32, lim[i] - k0);
              if (n <= 0) continue;
              const float* si = &s[i * KB];
              __m512 vmax = _mm512_set1_ps(NEG);
              for (int64_t j = 0; j < n; j += 16)
                vmax = _mm512_mask_max_ps(vmax, first_n(j, n), vmax, _mm512_mul_ps(_mm512_loadu_ps(si + j), vs));
              const float mn = std::max(m[i], _mm512_reduce_max_ps(vmax));
              __m512 sum = _mm512_setzero_ps();
              for (int64_t j = 0; j < n; j += 16) {
                const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(si + j), vs, _mm512_set1_ps(mn)));
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(first_n(j, n), e));
              }
              l[i] = l[i] * (m[i] == NEG ? 0.f : std::exp(m[i] - mn)) + _mm512_reduce_add_ps(sum);
              m[i] = mn;
            }
          } else {  // the rows' probabilities summed into the tile's column sums, 16 keys at a time
            for (int64_t j = 0; j < n32; j += 16) {
              __m512 acc = _mm512_loadu_ps(col + k0 + j);
              for (int64_t i = 0; i < M; ++i) {
                const __mmask16 valid = first_n(j, lim[i] - k0);
                if (!valid) continue;
                const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(&s[i * KB + j]), vs, _mm512_set1_ps(m[i])));
                acc = _mm512_mask3_fmadd_ps(e, _mm512_set1_ps(inv[i]), acc, valid);
              }
              _mm512_storeu_ps(col + k0 + j, acc);
            }
          }
        }
        for (int64_t i = 0; i < M; ++i) inv[i] = 1.f / l[i];
      }
    }
  });
  auto out = at::zeros({G, S}, q.options().dtype(at::kFloat));
  float* od = out.data_ptr<float>();
  at::parallel_for(0, G * S, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / S, j = i % S;
      float total = 0.f;
      for (int64_t t = 0; t < tiles; ++t) total += part[(g * tiles + t) * Sp + j];
      od[i] = total;
    }
  });
  return out;
}

#endif

}  // namespace

// Whether this build multiplies bfloat16 pairs (AVX-512 BF16 at compile time: the build is for the machine it runs
// on): prefill_attend, and attend's products over long bfloat16 rows (bf16_dots.h, the same condition).
bool bf16_dots_native() { return PREFILL_NATIVE; }

// q (Tq, H, d) float32, k / v (G, S, d) float32 or bfloat16 contiguous, S >= Tq, H a multiple of G, d of 64.
at::Tensor prefill_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#if PREFILL_NATIVE
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "prefill_attend: q (Tq, H, d) float32 rows");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == v.scalar_type() && k.sizes() == v.sizes(),
              "prefill_attend: k, v (G, S, d) contiguous, one dtype");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 64 == 0 && q.size(1) % k.size(0) == 0 && k.size(1) >= q.size(0),
              "prefill_attend: shapes");
  if (k.scalar_type() == at::kBFloat16) return attend_impl<at::BFloat16>(q, k, v, scale);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "prefill_attend: k, v float32 or bfloat16");
  return attend_impl<float>(q, k, v, scale);
#else
  TORCH_CHECK(false, "prefill_attend: built without AVX-512 BF16");
  return q;
#endif
}

// q (Tq, H, d) float32, k (G, S, d) float32 or bfloat16 contiguous -> (G, S) float32 column sums (column_sums_impl).
at::Tensor prefill_column_sums(const at::Tensor& q, const at::Tensor& k, double scale) {
#if PREFILL_NATIVE
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && k.is_contiguous(),
              "prefill_column_sums: q (Tq, H, d) float32 rows, k (G, S, d) contiguous");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 64 == 0 && q.size(1) % k.size(0) == 0 && k.size(1) >= q.size(0),
              "prefill_column_sums: shapes");
  if (k.scalar_type() == at::kBFloat16) return column_sums_impl<at::BFloat16>(q, k, scale);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "prefill_column_sums: k float32 or bfloat16");
  return column_sums_impl<float>(q, k, scale);
#else
  TORCH_CHECK(false, "prefill_column_sums: built without AVX-512 BF16");
  return q;
#endif
}
