// K/V and partial-key rows as the pool stores them: int8 rows quantized and read back, and a decode token's K, V
// and partial key appended to a pool layer in one call.

#include "common.h"
#include "kernels.h"

// x (..., p) float32 -> (..., p + 4) int8 rows: p values quantized by the row's absmax / 127, then that scale's bytes
at::Tensor quantize_rows(at::Tensor x) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32");
  const int64_t p = x.size(-1), R = x.numel() / std::max<int64_t>(p, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = p + 4;
  auto out = at::empty(sizes, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  auto* op = reinterpret_cast<int8_t*>(out.data_ptr());
  at::parallel_for(0, R, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) pack_row(xp + i * p, p, op + i * (p + 4));
  });
  return out;
}

// x (..., d) float32 -> (..., kv_width(d)) int8 K/V rows (pack_kv_row)
at::Tensor quantize_kv_rows(at::Tensor x) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32");
  const int64_t d = x.size(-1), R = x.numel() / std::max<int64_t>(d, 1), w = kv_width(d);
  auto sizes = x.sizes().vec();
  sizes.back() = w;
  auto out = at::empty(sizes, x.options().dtype(at::kChar));
  const float* xp = x.data_ptr<float>();
  auto* op = reinterpret_cast<int8_t*>(out.data_ptr());
  at::parallel_for(0, R, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) pack_kv_row(xp + i * d, d, op + i * w);
  });
  return out;
}

// int8 rows (..., kv_width(d)) -> their values (..., d) float32, value x its group's scale (unpacked_kv's bits)
at::Tensor dequantize_kv_rows(at::Tensor rows, int64_t d) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kChar && rows.dim() >= 1 && rows.size(-1) == kv_width(d), "bad int8 rows");
  const int64_t w = kv_width(d), R = rows.numel() / w, ng = kv_groups(d);
  auto sizes = rows.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, rows.options().dtype(at::kFloat));
  const int8_t* rp = rows.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(ng);
    for (int64_t i = i0; i < i1; ++i) {
      const int8_t* row = rp + i * w;
      float* o = op + i * d;
      kv_scales(row, d, sc.data());
      int64_t g = 0;
      for (; (g + 1) * KV_GROUP <= d; ++g)  // whole groups: a fixed trip count the compiler vectorizes (4x faster)
        for (int64_t j = 0; j < KV_GROUP; ++j) o[g * KV_GROUP + j] = float(row[g * KV_GROUP + j]) * sc[g];
      for (int64_t j = g * KV_GROUP; j < d; ++j) o[j] = float(row[j]) * sc[g];  // a shorter last group
    }
  });
  return out;
}

// A decode token into an InfiniGen pool layer at slot `at`: k, v (B, G, 1, d) float32 (rows of d contiguous, any
// strides above: views of the step's merged q k v output) into K, V (B, G, cap, d) (float32 or bfloat16: the pool's
// kv_dtype; or (B, G, cap, kv_width(d)) int8 rows, pack_kv_row), and the int8 row of k's partial channels (G, p) into
// P (B, G, cap, p + 4) (pack_row: quantize_rows' bits). The three appends of a layer's step in one call, where they
// were ~8 PyTorch ops (a channel gather, quantize_rows, three copies).
void store_token(at::Tensor K, at::Tensor V, at::Tensor P, at::Tensor k, at::Tensor v, at::Tensor channels, int64_t at) {
  for (auto* t : {&K, &V, &P, &channels}) check_cpu_contig(*t, "store_token buffer");
  const bool i8 = K.scalar_type() == at::kChar;
  TORCH_CHECK((K.scalar_type() == at::kFloat || K.scalar_type() == at::kBFloat16 || i8) && V.scalar_type() == K.scalar_type() &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && P.scalar_type() == at::kChar &&
              channels.scalar_type() == at::kLong,
              "store_token: float32, bfloat16 or int8 K, V; float32 k, v; int8 P; int64 channels");
  const int64_t B = K.size(0), G = K.size(1), cap = K.size(2), d = k.size(3), p = channels.size(1);
  const int64_t rw = i8 ? kv_width(d) : d;  // elements a stored row takes
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == B && k.size(1) == G && k.size(2) == 1 && K.size(3) == rw &&
              v.sizes() == k.sizes() && V.sizes() == K.sizes() && k.stride(3) == 1 && v.stride(3) == 1 &&
              P.size(0) == B && P.size(1) == G && P.size(2) == cap && P.size(3) == p + 4 && channels.size(0) == G &&
              at >= 0 && at < cap, "store_token: bad shapes");
  const int64_t* ch = channels.data_ptr<int64_t>();
  for (int64_t i = 0; i < G * p; ++i) TORCH_CHECK(ch[i] >= 0 && ch[i] < d, "channel out of range");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  auto* Pp = reinterpret_cast<int8_t*>(P.data_ptr());
  std::vector<float> part(p);
  dispatch_rows(K.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T *Kp = reinterpret_cast<T*>(K.data_ptr()), *Vp = reinterpret_cast<T*>(V.data_ptr());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < G; ++g) {
        const float* kr = kp + b * k.stride(0) + g * k.stride(1);
        const float* vr = vp + b * v.stride(0) + g * v.stride(1);
        const int64_t row = (b * G + g) * cap + at;
        if constexpr (std::is_same_v<T, int8_t>) {
          pack_kv_row(kr, d, Kp + row * rw);
          pack_kv_row(vr, d, Vp + row * rw);
        } else {
          for (int64_t t = 0; t < d; ++t) {
            store(Kp + row * rw, t, kr[t]);
            store(Vp + row * rw, t, vr[t]);
          }
        }
        for (int64_t t = 0; t < p; ++t) part[t] = kr[ch[g * p + t]];
        pack_row(part.data(), p, Pp + row * (p + 4));
      }
  });
}
