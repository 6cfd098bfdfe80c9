// partial_query: the partial query of a decode step from only the q_proj rows its partial channels need, RoPE
// applied.

#include "kernels.h"
#include "rows_dot.h"

namespace {

// partial_query: the partial query of a RoPE model with unskewed channels, from only the q_proj rows it
// needs: per KV head g, the channels S_g = P_g and their rotate-half partners (c +- d/2). For query head h
// (group g = h / r): y[c] = x . W[h d + c] (+ bias) for c in S_g, then after RoPE
//   q[c] = y[c] cos[c] + (c < d/2 ? -y[c + d/2] : y[c - d/2]) sin[c]   for c in P_g.

template <typename W>
void partial_query_impl(const float* x, const W* wp, const float* bias, const int64_t* S, int64_t c,
                        const int64_t* P, int64_t p, const float* cos, const float* sin, int64_t B, int64_t G,
                        int64_t r, int64_t d, int64_t D, bool gathered, float* out) {
  const int64_t H = G * r, half = d / 2;
  constexpr bool I8 = std::is_same_v<W, int8_t>;
  std::optional<QuantizedX8> qx;
  if constexpr (I8) qx.emplace(x, B, D);
  std::vector<uint16_t> xb;  // bfloat16 weights: x rounded to bfloat16, bfloat16 products (a query that only ranks)
#ifdef IG_BF16_DOTS
  if constexpr (std::is_same_v<W, uint16_t>) {
    xb.resize(B * D);
    bf16dots::round_any(x, B * D, xb.data());
  }
#endif
  std::vector<float> y(B * H * d, 0.f);  // (B, H, d): the needed channels of each head's query
  at::parallel_for(0, H * c, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / c, ch = S[(h / r) * c + i % c];
      const W* w = wp + (gathered ? i : h * d + ch) * (I8 ? kv_width(D) : D);  // gathered: row h c + t holds q_proj row h d + S[g, t]
      float* yo = y.data() + h * d + ch;  // row b at yo + b * H * d
      int64_t b = 0;
      if constexpr (I8) {
        for (; b + 4 <= B; b += 4)
          rows_dot_q8<4>(w, qx->q.data() + b * qx->pad, qx->s.data() + b * qx->ng, qx->isum.data() + b * qx->ng, D,
                         qx->pad, yo + b * H * d, H * d);
        for (; b < B; ++b)
          rows_dot_q8<1>(w, qx->q.data() + b * qx->pad, qx->s.data() + b * qx->ng, qx->isum.data() + b * qx->ng, D,
                         qx->pad, yo + b * H * d, H * d);
      } else if (!xb.empty()) {
#ifdef IG_BF16_DOTS
        const uint16_t* wb = reinterpret_cast<const uint16_t*>(w);
        for (; b + 4 <= B; b += 4) bf16dots::rows_dot<4>(wb, xb.data() + b * D, D, yo + b * H * d, H * d);
        for (; b < B; ++b) bf16dots::rows_dot<1>(wb, xb.data() + b * D, D, yo + b * H * d, H * d);
#endif
      } else {
        for (; b + 4 <= B; b += 4) rows_dot<4>(w, x + b * D, D, yo + b * H * d, H * d);
        for (; b < B; ++b) rows_dot<1>(w, x + b * D, D, yo + b * H * d, H * d);
      }
      if (bias)
        for (int64_t j = 0; j < B; ++j) yo[j * H * d] += bias[h * d + ch];
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const float* yh = y.data() + (b * H + h) * d;
      const int64_t* Pg = P + (h / r) * p;
      float* o = out + (b * H + h) * p;  // (B, G, r, p) == (B, H, p)
      for (int64_t t = 0; t < p; ++t) {
        const int64_t ch = Pg[t];
        if (!cos) {
          o[t] = yh[ch];
          continue;
        }
        const float partner = ch < half ? -yh[ch + half] : yh[ch - half];
        o[t] = yh[ch] * cos[b * d + ch] + partner * sin[b * d + ch];
      }
    }
}

}  // namespace

// x (B, D) float32; W (H d, D) q_proj weight, float32 or bfloat16, or with d_head > 0 only the rows needed (H c, D),
// row h c + t = q_proj row h d_head + S[g, t] (contiguous: read at the bandwidth, where the rows scattered through
// q_proj are not); bias (H d) or None; S (G, c) channels to compute per KV head (P and their RoPE partners;
// repeats allowed); P (G, p) partial channels; cos, sin (B, d) float32 or None (no RoPE: S = P).
// Returns the partial query (B, G, r, p) float32.
at::Tensor partial_query(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, at::Tensor S, at::Tensor P,
                         c10::optional<at::Tensor> cos, c10::optional<at::Tensor> sin, int64_t r, int64_t d_head) {
  for (auto* t : {&x, &W, &S, &P}) check_cpu_contig(*t, "partial_query input");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const bool i8 = W.scalar_type() == at::kChar;
  TORCH_CHECK(W.scalar_type() == at::kFloat || W.scalar_type() == at::kBFloat16 || i8,
              "W must be float32, bfloat16 or int8 rows");
  TORCH_CHECK(S.scalar_type() == at::kLong && P.scalar_type() == at::kLong, "S and P must be int64");
  const int64_t B = x.size(0), D = x.size(1), G = S.size(0), c = S.size(1), p = P.size(1), H = G * r;
  const bool gathered = d_head > 0;
  TORCH_CHECK((!gathered || W.size(0) == H * c) && W.size(0) % H == 0 && W.size(1) == (i8 ? kv_width(D) : D) &&
              P.size(0) == G, "bad shapes");
  const int64_t d = gathered ? d_head : W.size(0) / H;
  for (auto* t : {&S, &P})
    for (int64_t i = 0; i < t->numel(); ++i) {
      const int64_t ch = t->data_ptr<int64_t>()[i];
      TORCH_CHECK(ch >= 0 && ch < d, "channel ", ch, " out of range [0, ", d, ")");
    }
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_cpu_contig(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == H * d, "bias must be float32 (H d)");
    bp = bias->data_ptr<float>();
  }
  const float *cp = nullptr, *sp = nullptr;
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together");
  if (cos.has_value()) {
    check_cpu_contig(*cos, "cos");
    check_cpu_contig(*sin, "sin");
    TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->numel() == B * d &&
                sin->numel() == B * d, "cos, sin must be float32 (B, d)");
    cp = cos->data_ptr<float>();
    sp = sin->data_ptr<float>();
  }
  auto out = at::empty({B, G, r, p}, x.options());
  if (W.scalar_type() == at::kFloat)
    partial_query_impl(x.data_ptr<float>(), W.data_ptr<float>(), bp, S.data_ptr<int64_t>(), c, P.data_ptr<int64_t>(),
                       p, cp, sp, B, G, r, d, D, gathered, out.data_ptr<float>());
  else if (i8)
    partial_query_impl(x.data_ptr<float>(), W.data_ptr<int8_t>(), bp, S.data_ptr<int64_t>(), c,
                       P.data_ptr<int64_t>(), p, cp, sp, B, G, r, d, D, gathered, out.data_ptr<float>());
  else
    partial_query_impl(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(W.data_ptr()), bp,
                       S.data_ptr<int64_t>(), c, P.data_ptr<int64_t>(), p, cp, sp, B, G, r, d, D, gathered,
                       out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------------------------------------------
