#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <sys/mman.h>
#include <cstdlib>
#include <limits>
#include "/work/main/src/infinigen_kv/model/kernels/bf16_dots.h"
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
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
inline float max_of(const float* x, int64_t n) {
  int64_t t = 0; float m = NEG_INF;
  __m256 m8 = _mm256_loadu_ps(x);
  for (t = 8; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + t));
  alignas(32) float l[8]; _mm256_store_ps(l, m8);
  for (int j = 0; j < 8; ++j) m = std::max(m, l[j]);
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

int PFH = 3;
namespace f32k {
// 16 lanes of exp(x) for x <= 0, exp_neg's arithmetic
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
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127));
  e = _mm512_max_epi32(e, _mm512_setzero_si512());
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}
// a bfloat16 row's 32 channels as two float32 vectors: the even channels, the odd ones
inline void widen(const uint16_t* k, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(k);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u))));
}
// q (n floats, n % 32 == 0) -> each 32 channels' even ones, then their odd ones
inline void deinterleave(const float* q, int64_t n, float* out) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = _mm512_loadu_ps(q + i), b = _mm512_loadu_ps(q + i + 16);
    _mm512_storeu_ps(out + i, _mm512_permutex2var_ps(a, ev, b));
    _mm512_storeu_ps(out + i + 16, _mm512_permutex2var_ps(a, od, b));
  }
}
template <int D>
inline void scores16(const float* qp, int64_t r, const uint16_t* K, int64_t rw, const int64_t* blk, float scale,
                     float* s, int64_t ld, float* kf, const char* pk = nullptr, const char* pv = nullptr) {
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
    if (pk) {  // this head's share of the 2 x 16 D bytes ahead
      const int64_t bytes = 16 * D * 2, per = (bytes / 64 + r - 1) / r * 64;
      for (int64_t o = h * per; o < std::min(bytes, (h + 1) * per); o += 64) { if (PFH == 3) { __builtin_prefetch(pk + o, 0, 3); __builtin_prefetch(pv + o, 0, 3); } else if (PFH == 4) { __builtin_prefetch(pk + o, 0, 3); } else { __builtin_prefetch(pk + o, 0, 1); __builtin_prefetch(pv + o, 0, 1); } }
    }
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + j * D));
      for (int c = 1; c < D / 16; ++c) acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kf + j * D + 16 * c), acc[j]);
    }
    _mm512_storeu_ps(s + h * ld, _mm512_mul_ps(bf16dots::hsum16(acc), _mm512_set1_ps(scale)));
  }
}
template <int D, int HN>
inline void values_heads(const float* p, int64_t ld, int64_t nb, const uint16_t* V, int64_t rw, const int64_t* blk,
                         int64_t c0, float* A) {
  __m512 acc[HN][4];
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
    for (int x = 0; x < 2; ++x) {
      float* a = A + h * D + c0 + 32 * x;
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(acc[h][2 * x], lo, acc[h][2 * x + 1])));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_permutex2var_ps(acc[h][2 * x], hi, acc[h][2 * x + 1])));
    }
}
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
// softmax step of one head over nb scores: returns (l, corr) updates in place
inline void softmax(float* sh, int64_t nb, float& M, float& L, float* a, int64_t d) {
  __m512 m16 = _mm512_set1_ps(M);
  int64_t j = 0;
  for (; j + 16 <= nb; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(sh + j));
  if (j < nb) m16 = _mm512_max_ps(m16, _mm512_mask_loadu_ps(m16, __mmask16((1u << (nb - j)) - 1), sh + j));
  const float mnew = _mm512_reduce_max_ps(m16);
  if (mnew == NEG_INF) { for (int64_t i = 0; i < nb; ++i) sh[i] = 0.f; return; }
  const float corr = exp_neg(M - mnew);
  const __m512 mv = _mm512_set1_ps(mnew);
  __m512 l16 = _mm512_setzero_ps();
  for (j = 0; j + 16 <= nb; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), mv));
    _mm512_storeu_ps(sh + j, e);
    l16 = _mm512_add_ps(l16, e);
  }
  if (j < nb) {
    const __mmask16 mk = __mmask16((1u << (nb - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sh + j), mv)));
    _mm512_mask_storeu_ps(sh + j, mk, e);
    l16 = _mm512_add_ps(l16, e);
  }
  L = L * corr + _mm512_reduce_add_ps(l16);
  M = mnew;
  if (corr != 1.f) for (int64_t i = 0; i < d; ++i) a[i] *= corr;
}
}  // namespace f32k
constexpr int BLOCK = BLK, D = 64;
int NEW = 0, PF = 0;
int MODE = 0;  // bit0 skip scores, bit1 skip softmax, bit2 skip values
void item(const float* qr, const uint16_t* Kr, const uint16_t* Vr, int64_t t0, int64_t t1, int r, float* M, float* L, float* A,
          float* s, int64_t* blk, uint16_t* qb, uint16_t* pb, float* qp, float* kf) {
  const float scale = 0.125f;
  std::fill(M, M + r, NEG_INF); std::fill(L, L + r, 0.f); std::fill(A, A + r * D, 0.f);
  bf16dots::round_rows(qr, r * D, qb);
  f32k::deinterleave(qr, r * D, qp);
  for (int64_t tb = t0; tb < t1; tb += BLOCK) {
    const int64_t nb = std::min<int64_t>(BLOCK, t1 - tb);
    for (int64_t j = 0; j < nb; ++j) blk[j] = tb + j;
    if (PF == 9) { for (int64_t t = tb; t < tb + nb; ++t) { __builtin_prefetch(Vr + t * D, 0, 3); __builtin_prefetch(Vr + t * D + 32, 0, 3); }
      for (int64_t t = tb + BLOCK; t < std::min(t1, tb + 2 * BLOCK); ++t) { __builtin_prefetch(Kr + t * D, 0, 3); __builtin_prefetch(Kr + t * D + 32, 0, 3); } }
    if (PF == 8) { for (int64_t t = tb + BLOCK; t < tb + 2 * BLOCK; ++t) { __builtin_prefetch(Vr + t * D, 0, 3); __builtin_prefetch(Vr + t * D + 32, 0, 3); }
      for (int64_t t = tb + BLOCK; t < tb + 2 * BLOCK; ++t) { __builtin_prefetch(Kr + t * D, 0, 3); __builtin_prefetch(Kr + t * D + 32, 0, 3); } }
    if (PF && PF < 8) { const int64_t ahead = tb + PF * BLOCK;
      const char* kc = (const char*)(Kr + ahead * D); const char* vc = (const char*)(Vr + ahead * D);
      for (int64_t o = 0; o < BLOCK * D * 2; o += 64) { __builtin_prefetch(kc + o, 0, 2); __builtin_prefetch(vc + o, 0, 2); } }
    if (PF > 9) { const int64_t ahead = tb + (PF - 10) * BLOCK;
      const char* kc = (const char*)(Kr + ahead * D); const char* vc = (const char*)(Vr + ahead * D);
      for (int64_t o = 0; o < BLOCK * D * 2; o += 64) { _mm_prefetch(kc + o, _MM_HINT_T1); _mm_prefetch(vc + o, _MM_HINT_T1); } }
    if (NEW && !(MODE & 1))
      for (int64_t j0 = 0; j0 + 16 <= nb; j0 += 16) f32k::scores16<D>(qp, r, Kr, D, blk + j0, scale, s + j0, BLOCK, kf, PF >= 20 ? (const char*)(Kr + (blk[j0] + (PF - 20) * 16) * D) : nullptr, (const char*)(Vr + (blk[j0] + (PF - 20) * 16) * D));
    if (!NEW && !(MODE & 1))
      for (int64_t j0 = 0; j0 + 16 <= nb; j0 += 16)
        bf16dots::scores16<D>(qb, r, Kr, D, blk + j0, scale, s + j0, BLOCK);
    if (NEW && !(MODE & 2)) for (int64_t h = 0; h < r; ++h) f32k::softmax(s + h * BLOCK, nb, M[h], L[h], A + h * D, D);
    if (!NEW && !(MODE & 2))
    for (int64_t h = 0; h < r; ++h) {
      float* sh = s + h * BLOCK;
      const float mnew = std::max(M[h], max_of(sh, nb));
      const float corr = exp_neg(M[h] - mnew);
      float l = 0.f;
      for (int64_t j = 0; j < nb; ++j) { sh[j] = exp_neg(sh[j] - mnew); l += sh[j]; }
      L[h] = L[h] * corr + l; M[h] = mnew;
      if (corr != 1.f) { float* a = A + h * D; for (int64_t i = 0; i < D; ++i) a[i] *= corr; }
    }
    if (NEW && !(MODE & 4)) f32k::values<D>(s, BLOCK, r, nb, Vr, D, blk, A);
    if (!NEW && !(MODE & 4))
      bf16dots::values<D>(s, BLOCK, r, nb, Vr, D, blk, A, pb);
  }
}
int main(int argc, char** argv) {
  MODE = argc > 1 ? atoi(argv[1]) : 0; NEW = argc > 2 ? atoi(argv[2]) : 0; PF = argc > 5 ? atoi(argv[5]) : 0; PFH = argc > 6 ? atoi(argv[6]) : 3;
  const int r = 7; const int64_t n = 4096; const int rows = argc > 3 ? atoi(argv[3]) : 8, layers = argc > 4 ? atoi(argv[4]) : 24;
  const size_t NE = size_t(layers) * rows * n * D; const bool HP = getenv("HP") != nullptr;
  uint16_t* Kp = (uint16_t*)aligned_alloc(2 << 20, NE * 2); uint16_t* Vp = (uint16_t*)aligned_alloc(2 << 20, NE * 2);
  if (HP) { madvise(Kp, NE * 2, MADV_HUGEPAGE); madvise(Vp, NE * 2, MADV_HUGEPAGE); }
  struct Arr { uint16_t* p; size_t n; size_t size() const { return n; } uint16_t& operator[](size_t i) { return p[i]; } uint16_t* data() { return p; } };
  Arr K{Kp, NE}, V{Vp, NE};
  for (size_t i = 0; i < K.size(); ++i) { float f = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f; uint32_t b; memcpy(&b, &f, 4); K[i] = b >> 16; f = (float)((i * 40503u) % 997) / 997.f - 0.5f; memcpy(&b, &f, 4); V[i] = b >> 16; }
  std::vector<float> q(rows * r * D); for (size_t i = 0; i < q.size(); ++i) q[i] = ((i * 7919) % 101) / 101.f - 0.5f;
  std::vector<float> M(r), L(r), A(r * D), s(r * BLOCK); std::vector<int64_t> blk(BLOCK); std::vector<uint16_t> qb(r * D), pb(r * (BLOCK + 16)); std::vector<float> qp(r * D), kf(16 * D);
  double best = 1e9; float chk = 0;
  for (int rep = 0; rep < (rows * layers < 8 ? 200 : 20); ++rep) {
    auto t = std::chrono::steady_clock::now();
    for (int l = 0; l < layers; ++l) for (int row = 0; row < rows; ++row)
      for (int64_t t0 = 0; t0 < n; t0 += 512) {
        const size_t off = (size_t(l) * rows + row) * n * D;
        item(q.data() + row * r * D, K.data() + off, V.data() + off, t0, t0 + 512, r, M.data(), L.data(), A.data(), s.data(), blk.data(), qb.data(), pb.data(), qp.data(), kf.data());
        chk += A[3];
      }
    double ms = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() * 1e3;
    best = std::min(best, ms);
  }
  double th = double(layers) * rows * r * n;
  printf("new %d mode %d: %.2f ms one thread (%.2f ns per token-head) chk %g\n", NEW, MODE, best, best * 1e6 / th, chk);
}
