// attend: attention of a decode query over the chosen rows of the pool (or all of them), gathering each K/V row
// where it lies: online softmax in float32, no copy of the working set. Rows in float32, bfloat16, float16 or int8
// (q8_0 groups); bfloat16 rows in AVX-512 float32 products of the widened rows (attend512.h), or bfloat16 pair
// products where the CPU has AVX-512 BF16 (bf16_dots.h).
//
// Shapes: B sequences, G KV heads, r query heads per KV head, d head size, cap rows per (sequence, head).

#include "common.h"
#include "kernels.h"

namespace {

// Head sizes attend is compiled for: the real models' 64 and 128; others (Gemma 3's 256, tiny test models' 16) with
// the size at run time. Each size is 12 instantiations of attend_impl (4 row types x 3 output types): the largest
// share of the kernels' build.
template <typename F>
void dispatch_head(int64_t d, F&& f) {
  if (d == 64) f(std::integral_constant<int, 64>{});
  else if (d == 128) f(std::integral_constant<int, 128>{});
  else f(std::integral_constant<int, 0>{});
}

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
  // Each row's tokens are cut into chunks (flash-decoding: every thread has work) and merged in order: a whole
  // past into chunks of SPLIT counted from the row's first attendable token; chosen rows evenly into chunks of at
  // most SPLIT_ROWS (1,024 chosen + the new token: 5 x 208, not 512 + 512 + 1, so that 3 rows of a batch-1 step
  // share 2 threads 8:7, not 2:1). Either depends on the row's own tokens only: its result is the same bits
  // whatever else shares its batch (how many rows, how much left padding, how many chosen). The rows' chunks are
  // listed one after another and shared out as one list: heads that chose 5% and 30% of their rows keep both
  // threads busy, where a thread a head would wait on the longer.
  std::vector<int64_t> first(rows, 0);  // dense rows: the first position keep allows (left padding skipped)
  if (!idx && keep)
    for (int64_t row = 0; row < rows; ++row) {
      const bool* kb = keep + ((row / G) * keep_heads + (keep_heads > 1 ? row % G : 0)) * n;
      while (first[row] < n && !kb[first[row]]) ++first[row];
    }
  std::vector<int64_t> ntoks(rows), chunks(rows), start(rows + 1, 0);  // a row's tokens, chunk size, first item
  for (int64_t row = 0; row < rows; ++row) {
    ntoks[row] = (idx ? std::min(m, count ? count[row] : m) : n - first[row]) + (has_new ? 1 : 0);
    chunks[row] = idx ? even_chunk(ntoks[row], SPLIT_ROWS) : SPLIT;
    start[row + 1] = start[row] + (ntoks[row] > 0 ? (ntoks[row] + chunks[row] - 1) / chunks[row] : 1);
  }
  const int64_t items = start[rows];
  std::vector<int64_t> item_row(items);
  for (int64_t row = 0; row < rows; ++row) std::fill(item_row.begin() + start[row], item_row.begin() + start[row + 1], row);
  std::vector<float> part_m(items * r), part_l(items * r), part_acc(items * r * d);
#ifdef IG_ATTEND512
  constexpr bool WIDE = std::is_same_v<T, at::BFloat16> && D > 0 && D % 64 == 0;  // attend512.h's rows
#else
  constexpr bool WIDE = false;
#endif

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(r * BLOCK);
    std::vector<int64_t> blk(BLOCK);
    std::vector<char> mask(BLOCK);
    std::vector<float> ks(BLOCK * ng, 1.f), vs(BLOCK * ng, 1.f);  // int8 rows' group scales, token by token
#ifdef IG_ATTEND512
    std::vector<float> qp(WIDE ? r * D : 0), kf(WIDE ? 16 * D : 0);  // the query in widen's order; 16 rows transposed
    int64_t next[16];  // the positions of the rows whose lines are asked for during a group's scores
#endif
#ifdef IG_BF16_DOTS
    std::vector<uint16_t> qb(WIDE && pairs ? r * D : 0), pb(WIDE && pairs ? r * (BLOCK + 16) : 0);
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item_row[item], sp = item - start[row];
      const int64_t b = row / G, g = row % G;
      const int64_t f0 = first[row];
      const int64_t ntok = ntoks[row];
      const int64_t t0 = sp * chunks[row], t1 = std::min(ntok, t0 + chunks[row]);
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
      // chosen rows: the K and V lines of rows [from, to) asked for at once. attend512.h's rows ask for the first 32
      // here, then those two groups of 16 ahead during each group's scores; the others a block ahead.
      auto prefetch_rows = [&](int64_t from, int64_t to) {
        for (int64_t t = from; t < std::min(t1, to); ++t) {
          const int64_t pos = position(t);
          prefetch_row(Kr + pos * rw, rw);
          prefetch_row(Vr + pos * rw, rw);
        }
      };
      if (idx) prefetch_rows(t0, t0 + (WIDE ? 32 : BLOCK));
      for (int64_t tb = t0; tb < t1; tb += BLOCK) {
        const int64_t nb = std::min<int64_t>(BLOCK, t1 - tb);
        if (idx && !WIDE) prefetch_rows(tb + BLOCK, tb + 2 * BLOCK);
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
            // the 16 rows after the next 16 asked for while these are scored: the whole past's while they lie in it,
            // the item's chosen rows while it has them (its last repeated)
            const auto* Kb = reinterpret_cast<const uint16_t*>(Kr);
            attend512::Ahead ahead{Kb, reinterpret_cast<const uint16_t*>(Vr), rw, nullptr};
            if (!idx && blk[j0 + 15] + 33 <= n) {
              for (int j = 0; j < 16; ++j) next[j] = blk[j0 + 15] + 17 + j;
              ahead.rows = next;
            } else if (idx && tb + j0 + 32 < t1) {
              for (int j = 0; j < 16; ++j) next[j] = position(std::min(tb + j0 + 32 + j, t1 - 1));
              ahead.rows = next;
            }
#ifdef IG_BF16_DOTS
            if (dots) {
              bf16dots::scores16<D>(qb.data(), r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, ahead);
              continue;
            }
#endif
            if (r > 2)
              attend512::scores16_transposed<D>(qr, r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, kf.data(),
                                                ahead);
            else
              attend512::scores16<D>(qp.data(), r, Kb, rw, blk.data() + j0, scale, s.data() + j0, BLOCK, ahead);
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
      for (int64_t it = start[row]; it < start[row + 1]; ++it) mx = std::max(mx, part_m[it * r + h]);
      float l = 0.f;
      std::vector<float> acc(d, 0.f);
      for (int64_t it = start[row]; it < start[row + 1]; ++it) {
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

}  // namespace

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
      dispatch_head(d, [&](auto size) {
      attend_impl<T, O, decltype(size)::value>(q.data_ptr<float>(), reinterpret_cast<const T*>(K.data_ptr()),
                        reinterpret_cast<const T*>(V.data_ptr()), idx_p, m, count_p, new_p, new_row, keep_p,
                        keep_heads, n, B, G, r, d, cap, float(scale), r <= pairs_upto,
                        reinterpret_cast<O*>(out.data_ptr()));
      });
    });
  });
  return out;
}
