// H2O's prefill scores in float32 products (AVX2 + FMA): the attention probabilities of a prompt chunk's queries
// summed per key, where the CPU has no bfloat16 products (prefill.cpp's prefill_column_sums serves those).
//
// out[g][j] = sum over the chunk's queries t and the r query heads of KV head g of softmax_j(q . k_j scale), causal:
// the chunk holds the last Tq of S positions, so query t sees keys j <= S - Tq + t. The probabilities are never
// written out (PyTorch's path materializes a (rows, S) block of scores, then of probabilities, for every chunk of
// queries: 5-6x the chunk's attention itself at 16k keys). Per work item (KV head g, tile of QT positions: QT r
// rows) two passes over blocks of KB keys: the scores of a block in registers tiles of RM rows x 16 keys, then
// (pass 0) each row's running max and sum of exponentials, (pass 1) the same scores' probabilities added into the
// work item's column sums, 8 keys at a time over all its rows. The items' sums are added at the end. The scores
// are taken in base 2 (the queries scaled by scale log2 e once): exp2 of a difference, no multiply per score.
//
// Shapes: q (Tq, H, d) float32 rows (any strides on the first two), k (G, S, d) float32 or bfloat16 contiguous,
// S >= Tq, H = G r. -> (G, S) float32.

#include "common.h"
#include "kernels.h"

namespace {

#ifdef IG_AVX2

constexpr int64_t KB = 256;  // keys per block: a work item's block of scores (QT r x KB float32) stays in L2
constexpr int64_t KW = 16;   // keys per micro tile and per packed block (two vectors)
constexpr int64_t QT = 16;   // query positions per work item
constexpr int RM = 6;        // rows per micro tile: 6 x 2 accumulators in registers

// 2^x for x <= 0, 8 lanes: an integer power (exponent bits) times a degree-5 polynomial of the fraction on
// [-0.5, 0.5] (relative error ~2e-7); x below -126 gives 0
inline __m256 exp2_neg8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, fi);
  __m256 p = _mm256_set1_ps(1.3333558e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180375e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// lanes j .. j + 7 below n, as an all-ones mask
inline __m256 below(int64_t j, int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t left = std::clamp<int64_t>(n - j, 0, 8);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), iota));
}

// s[r][0, 16) = q[r] . k for RM rows q (row stride d) against a packed block of 16 keys kp (d x 16)
inline void scores_tile(const float* q, int64_t d, const float* kp, float* s, int64_t lds) {
  __m256 acc[RM][2];
  for (int r = 0; r < RM; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 k0 = _mm256_loadu_ps(kp + c * KW), k1 = _mm256_loadu_ps(kp + c * KW + 8);
    for (int r = 0; r < RM; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * d + c);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < RM; ++r) {
    _mm256_storeu_ps(s + r * lds, acc[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, acc[r][1]);
  }
}

// K (G, S, d) -> (G, Sp / 16, d, 16) float32: each block of 16 keys channel by channel; zeros past S
template <typename T>
void pack_keys(const T* k, int64_t G, int64_t S, int64_t Sp, int64_t d, float* kp) {
  const int64_t nb = Sp / KW;
  at::parallel_for(0, G * nb, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / nb, b = i % nb;
      float* kb = kp + i * d * KW;
      for (int64_t jj = 0; jj < KW; ++jj) {
        const int64_t j = b * KW + jj;
        const T* kr = k + (g * S + std::min(j, S - 1)) * d;
        for (int64_t c = 0; c < d; ++c) kb[c * KW + jj] = j < S ? load(kr, c) : 0.f;
      }
    }
  });
}

template <typename T>
at::Tensor column_sums_impl(const at::Tensor& q, const at::Tensor& k, double scale) {
  const int64_t Tq = q.size(0), H = q.size(1), d = q.size(2), G = k.size(0), S = k.size(1), r = H / G;
  const int64_t Sp = (S + KB - 1) / KB * KB, past = S - Tq, tiles = (Tq + QT - 1) / QT;
  const float log2_scale = float(scale * 1.4426950408889634);
  std::vector<float> kp(G * Sp * d);
  pack_keys<T>(k.data_ptr<T>(), G, S, Sp, d, kp.data());
  std::vector<float> part(G * tiles * Sp, 0.f);  // (G, tiles, Sp): each work item's column sums
  const float* qd = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  at::parallel_for(0, G * tiles, 1, [&](int64_t w0, int64_t w1) {
    const int64_t Mp = (QT * r + RM - 1) / RM * RM;
    std::vector<float> qp(Mp * d), s(Mp * KB), m(Mp), l(Mp), inv(Mp);
    std::vector<int64_t> lim(Mp);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / tiles, t0 = (w % tiles) * QT, t1 = std::min(Tq, t0 + QT), M = (t1 - t0) * r;
      const int64_t Mr = (M + RM - 1) / RM * RM;
      for (int64_t i = 0; i < Mr; ++i) {  // row i: position t0 + i / r, head g r + i % r (zeros past M)
        const float* qr = qd + (t0 + i / r) * qs0 + (g * r + i % r) * qs1;
        for (int64_t c = 0; c < d; ++c) qp[i * d + c] = i < M ? qr[c] * log2_scale : 0.f;
        lim[i] = i < M ? past + t0 + i / r + 1 : 0;  // the keys row i sees
      }
      std::fill(m.begin(), m.end(), NEG_INF);
      std::fill(l.begin(), l.end(), 0.f);
      float* col = part.data() + w * Sp;
      const int64_t kmax = past + t1;
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t k0 = 0; k0 < kmax; k0 += KB) {
          const int64_t nk = std::min(KB, (kmax - k0 + KW - 1) / KW * KW);
          const float* kb = kp.data() + (g * Sp + k0) * d;
          for (int64_t i = 0; i < Mr; i += RM)
            for (int64_t j = 0; j < nk; j += KW) scores_tile(&qp[i * d], d, kb + j * d, &s[i * KB + j], KB);
          if (pass == 0) {  // each row's running max and sum of exponentials
            for (int64_t i = 0; i < M; ++i) {
              const int64_t n = std::min(nk, lim[i] - k0);
              if (n <= 0) continue;
              const float* si = &s[i * KB];
              __m256 vmax = _mm256_set1_ps(NEG_INF);
              for (int64_t j = 0; j < n; j += 8)
                vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), _mm256_loadu_ps(si + j),
                                                            below(j, n)));
              const float mn = std::max(m[i], hmax(vmax));
              const __m256 vm = _mm256_set1_ps(mn);
              __m256 sum = _mm256_setzero_ps();
              for (int64_t j = 0; j < n; j += 8)
                sum = _mm256_add_ps(sum, _mm256_and_ps(below(j, n), exp2_neg8(_mm256_sub_ps(_mm256_loadu_ps(si + j),
                                                                                             vm))));
              l[i] = l[i] * (m[i] == NEG_INF ? 0.f : std::exp2(m[i] - mn)) + hsum(sum);
              m[i] = mn;
            }
          } else {  // the rows' probabilities summed into the item's column sums, 8 keys at a time
            for (int64_t j = 0; j < nk; j += 8) {
              __m256 acc = _mm256_loadu_ps(col + k0 + j);
              for (int64_t i = 0; i < M; ++i) {
                const int64_t n = lim[i] - k0;
                if (n <= j) continue;
                __m256 p = _mm256_mul_ps(exp2_neg8(_mm256_sub_ps(_mm256_loadu_ps(&s[i * KB + j]),
                                                                 _mm256_set1_ps(m[i]))), _mm256_set1_ps(inv[i]));
                if (n < j + 8) p = _mm256_and_ps(p, below(j, n));
                acc = _mm256_add_ps(acc, p);
              }
              _mm256_storeu_ps(col + k0 + j, acc);
            }
          }
        }
        for (int64_t i = 0; i < M; ++i) inv[i] = 1.f / l[i];
      }
    }
  });
  auto out = at::empty({G, S}, q.options().dtype(at::kFloat));
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

// q (Tq, H, d) float32, k (G, S, d) float32 or bfloat16 contiguous -> (G, S) float32 column sums (column_sums_impl).
at::Tensor column_sums(const at::Tensor& q, const at::Tensor& k, double scale) {
#ifdef IG_AVX2
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && k.is_contiguous(),
              "column_sums: q (Tq, H, d) float32 rows, k (G, S, d) contiguous");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(0) == 0 && k.size(1) >= q.size(0) && q.size(0) > 0,
              "column_sums: shapes");
  if (k.scalar_type() == at::kBFloat16) return column_sums_impl<at::BFloat16>(q, k, scale);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "column_sums: k float32 or bfloat16");
  return column_sums_impl<float>(q, k, scale);
#else
  TORCH_CHECK(false, "column_sums: built without AVX2 and FMA");
  return q;
#endif
}
