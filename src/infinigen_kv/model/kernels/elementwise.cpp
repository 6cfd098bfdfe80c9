// A decode step's row-wise ops with PyTorch's bits: RMSNorm, RoPE in place, silu(gate) * up.

#include "common.h"
#include "kernels.h"

// x (R, D) float32, w (D) float32 -> x / sqrt(mean(x^2) + eps) * w, per row (Llama's RMSNorm in one call; the
// sum in eight lanes then in order, the same bits for a row whatever the rows beside it)
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_cpu_contig(x, "x");
  check_cpu_contig(w, "w");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "x and w must be float32");
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(w.numel() == D, "w must have x's last size");
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* xr = xp + i * D;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t t = 0;
      for (; t + 8 <= D; t += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xr[t + j] * xr[t + j];
      float ss = 0.f;
      for (int j = 0; j < 8; ++j) ss += acc[j];
      for (; t < D; ++t) ss += xr[t] * xr[t];
      const float inv = 1.f / std::sqrt(ss / float(D) + float(eps));
      float* yr = yp + i * D;
      for (int64_t c = 0; c < D; ++c) yr[c] = xr[c] * inv * wp[c];
    }
  });
  return y;
}

// x (R, N d) float32: heads [0, heads) of each row rotated in place with cos, sin (R, d):
//   x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
// rounded as transformers' apply_rotary_pos_emb rounds it: each product, then their sum (no fused multiply-add:
// the products go through volatile memory, which the compiler cannot contract).
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads) {
  check_cpu_contig(x, "x");
  check_cpu_contig(cos, "cos");
  check_cpu_contig(sin, "sin");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "x, cos and sin must be float32");
  const int64_t d = cos.size(-1), R = cos.numel() / std::max<int64_t>(d, 1), half = d / 2;
  TORCH_CHECK(sin.numel() == cos.numel() && d % 2 == 0 && R > 0 && x.numel() % R == 0, "bad shapes");
  const int64_t row = x.numel() / R;
  TORCH_CHECK(heads >= 0 && heads * d <= row, "heads out of range");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  std::vector<float> old(d);
  for (int64_t b = 0; b < R; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = xp + b * row + h * d;
      const float *c = cp + b * d, *s = sp + b * d;
      std::memcpy(old.data(), xh, d * sizeof(float));
      for (int64_t i = 0; i < d; ++i) {
        volatile float a = old[i] * c[i];
        volatile float t = (i < half ? -old[i + half] : old[i - half]) * s[i];
        xh[i] = a + t;
      }
    }
}

#ifdef IG_AVX2
extern "C" __m256 Sleef_expf8_u10(__m256);  // libtorch_cpu's: the exp of PyTorch's vectorized CPU kernels
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

// gu (R, 2F) float32 -> silu(gu[:, :F]) * gu[:, F:] (R, F), as F.silu(gate) * up computes it for a contiguous gate
// (R, F) (the model's gate_proj output): x / (1 + exp(-x)) over the R F values in order, 2 vectors of `lanes`
// at a time through the exp PyTorch's kernels of that width call (lanes: 8 AVX2, 16 AVX-512, as PyTorch's CPU
// capability; else expf throughout), the tail through expf; then the product.
at::Tensor silu_mul(at::Tensor gu, int64_t lanes) {
  check_cpu_contig(gu, "gu");
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be (R, 2F) float32");
  const int64_t R = gu.size(0), F = gu.size(1) / 2, n = R * F;
  auto y = at::empty({R, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < R; ++b) std::memcpy(yp + b * F, gp + b * 2 * F, F * sizeof(float));  // the gate, (R, F)
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (lanes == 16) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (const int64_t nv = n - n % 32; i < nv; i += 16) {
      const __m512 x = _mm512_loadu_ps(yp + i);
      const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(x, _mm512_set1_ps(-0.f)));
      _mm512_storeu_ps(yp + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
    }
  }
#endif
#ifdef IG_AVX2
  if (lanes == 8) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (const int64_t nv = n - n % 16; i < nv; i += 8) {
      const __m256 x = _mm256_loadu_ps(yp + i);
      _mm256_storeu_ps(yp + i, _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(x, sign)))));
    }
  }
#endif
  for (; i < n; ++i) yp[i] = yp[i] / (1.f + std::exp(-yp[i]));
  for (int64_t b = 0; b < R; ++b) {
    float* o = yp + b * F;
    const float* u = gp + b * 2 * F + F;
    for (int64_t c = 0; c < F; ++c) o[c] = o[c] * u[c];
  }
  return y;
}
