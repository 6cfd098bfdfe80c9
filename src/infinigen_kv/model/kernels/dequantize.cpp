// The int4 rows', int5 tiles' and int8 tiles' values in float32 or bfloat16: a prompt chunk's weights for the
// BLAS, a slice at a time.

#include "common.h"
#include "kernels.h"
#include "weight_rows.h"

// int4 weights as held (..., q4_width(n)) uint8 (the leading dims' rows in tiles of 16, then rows: linear_impl's
// layout) -> their values (..., n) in float32 or bfloat16: level x scale + min per group of
// 32 (int4_rows.unpacked's bits: a 4-bit level times a float16 scale is exact in float32, so the one rounding is the
// sum's, fused or not; bfloat16 rounds that to nearest even, as PyTorch's .to). A prompt chunk's weights for the
// BLAS, a slice at a time: PyTorch's ops took 1.3x the bfloat16 weights' prefill in unpacking.
at::Tensor dequantize_q4_rows(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() >= 1 && n % Q4_GROUP == 0 && rows.size(-1) == q4_width(n),
              "bad int4 rows");
  const int64_t w = q4_width(n), R = rows.numel() / w, ng = n / Q4_GROUP;
  auto sizes = rows.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t tiled = R / Q4_TILE * Q4_TILE;  // rows in tiles (linear_impl's layout), then rows
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[Q4_GROUP];
    uint8_t b[Q4_GROUP / 2];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        float d, m;
        if (i < tiled) {
          const uint8_t* tg = tile + g * Q4_TILE_GROUP;
          for (int64_t c = 0; c < 4; ++c) std::memcpy(b + 4 * c, tg + 64 * c + 4 * o, 4);
          d = half_at(reinterpret_cast<const int8_t*>(tg + 256 + 2 * o));
          m = half_at(reinterpret_cast<const int8_t*>(tg + 288 + 2 * o));
        } else {
          const uint8_t* row = rp + i * w;
          std::memcpy(b, row + g * (Q4_GROUP / 2), Q4_GROUP / 2);
          d = half_at(reinterpret_cast<const int8_t*>(row + n / 2 + 2 * g));
          m = half_at(reinterpret_cast<const int8_t*>(row + n / 2 + 2 * (ng + g)));
        }
        for (int64_t j = 0; j < Q4_GROUP / 2; ++j) {
          v[j] = float(b[j] & 0x0F) * d + m;
          v[j + Q4_GROUP / 2] = float(b[j] >> 4) * d + m;
        }
        if (ob != nullptr) {
          for (int64_t j = 0; j < Q4_GROUP; ++j) ob[i * n + g * Q4_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + Q4_GROUP, of + i * n + g * Q4_GROUP);
        }
      }
    }
  });
  return out;
}

// int5 weights as held (R, q5_width(n)) float8_e5m2 (whole tiles of 16 rows: model/int5_rows.py) -> their values
// (R, n) in float32 or bfloat16: level x scale + min per group of 32 (int5_rows.reference_unpacked's bits: a 5-bit
// level times a float16 scale is exact in float32; the sum is the one rounding). A prompt chunk's weights for the
// BLAS, a slice at a time.
at::Tensor dequantize_q5_tiles(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kFloat8_e5m2 && rows.dim() >= 1 && n % Q4_GROUP == 0 &&
              rows.size(-1) == q5_width(n), "bad int5 rows");
  const int64_t w = q5_width(n), R = rows.numel() / w, ng = n / Q4_GROUP;
  TORCH_CHECK(R % Q4_TILE == 0, "int5 rows are held in whole tiles of 16 rows");
  auto sizes = rows.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = reinterpret_cast<const uint8_t*>(rows.data_ptr());
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[Q4_GROUP];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* tg = tile + g * Q5_TILE_GROUP;
        uint32_t hb;
        std::memcpy(&hb, tg + 256 + 4 * o, 4);
        const float d = half_at(reinterpret_cast<const int8_t*>(tg + 320 + 2 * o));
        const float m = half_at(reinterpret_cast<const int8_t*>(tg + 352 + 2 * o));
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = tg[64 * c + 4 * o + j];
            v[4 * c + j] = float((byte & 0x0F) | ((hb >> (8 * j + c)) & 1) << 4) * d + m;
            v[16 + 4 * c + j] = float((byte >> 4) | ((hb >> (8 * j + 4 + c)) & 1) << 4) * d + m;
          }
        if (ob != nullptr) {
          for (int64_t j = 0; j < Q4_GROUP; ++j) ob[i * n + g * Q4_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + Q4_GROUP, of + i * n + g * Q4_GROUP);
        }
      }
    }
  });
  return out;
}

// int8 weights as held (R, kv_width(n)) float8_e4m3fn (the rows in tiles of 16, then rows: model/int8_tiles.py),
// n a multiple of 32 -> their values (R, n) in float32 or bfloat16: value x scale (exact in float32), as
// int8_rows.unpacked_kv reads rows. A prompt chunk's weights for the BLAS, a slice at a time.
at::Tensor dequantize_q8_tiles(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kFloat8_e4m3fn && rows.dim() >= 1 && n % KV_GROUP == 0 &&
              rows.size(-1) == kv_width(n), "bad int8 tiles");
  const int64_t w = kv_width(n), R = rows.numel() / w, ng = n / KV_GROUP;
  auto sizes = rows.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = reinterpret_cast<const uint8_t*>(rows.data_ptr());
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const int64_t tiled = R / Q4_TILE * Q4_TILE;  // rows in tiles, then rows
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[KV_GROUP];
    int8_t q[KV_GROUP];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        float d;
        if (i < tiled) {
          const uint8_t* tg = tile + g * Q8_TILE_GROUP;
          for (int64_t c = 0; c < 8; ++c) std::memcpy(q + 4 * c, tg + 64 * c + 4 * o, 4);
          d = half_at(reinterpret_cast<const int8_t*>(tg + 512 + 2 * o));
        } else {
          const uint8_t* row = rp + i * w;
          std::memcpy(q, row + g * KV_GROUP, KV_GROUP);
          d = half_at(reinterpret_cast<const int8_t*>(row + n + 2 * g));
        }
        for (int64_t j = 0; j < KV_GROUP; ++j) v[j] = float(q[j]) * d;
        if (ob != nullptr) {
          for (int64_t j = 0; j < KV_GROUP; ++j) ob[i * n + g * KV_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + KV_GROUP, of + i * n + g * KV_GROUP);
        }
      }
    }
  });
  return out;
}

// int6 weights as held (R, q6_width(n)) float8_e5m2fnuz (whole tiles of 16 rows: model/int6_tiles.py) -> their values
// (R, n) in float32 or bfloat16: (d x sc) x (q - 32) per value, rounded once (int6_tiles.reference_unpacked's bits,
// llama.cpp's order). A prompt chunk's weights for the BLAS, a slice at a time.
at::Tensor dequantize_q6_tiles(at::Tensor rows, int64_t n, bool bf16) {
  check_cpu_contig(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kFloat8_e5m2fnuz && rows.dim() == 2 && n % 256 == 0 &&
              rows.size(-1) == q6_width(n), "bad int6 tiles");
  const int64_t w = q6_width(n), R = rows.size(0), ng = n / Q4_GROUP;
  TORCH_CHECK(R % Q4_TILE == 0, "int6 rows are held in whole tiles of 16 rows");
  auto out = at::empty({R, n}, rows.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* rp = reinterpret_cast<const uint8_t*>(rows.data_ptr());
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / w), [&](int64_t i0, int64_t i1) {
    float v[Q4_GROUP];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* tile = rp + (i - i % Q4_TILE) * w;
      const int64_t o = i % Q4_TILE;
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* sb = tile + (g / 8) * Q6_BLOCK;
        const uint8_t* tg = sb + 32 + (g % 8) * Q6_GROUP;
        const float d = half_at(reinterpret_cast<const int8_t*>(sb + 2 * o));
        const float dlo = d * float(int8_t(tg[384 + o])), dhi = d * float(int8_t(tg[400 + o]));
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = tg[64 * c + 4 * o + j];
            const int32_t q0 = (byte & 0x0F) | ((tg[256 + 4 * o + j] >> (2 * c)) & 3) << 4;
            const int32_t q1 = (byte >> 4) | ((tg[320 + 4 * o + j] >> (2 * c)) & 3) << 4;
            v[4 * c + j] = dlo * float(q0 - 32);
            v[16 + 4 * c + j] = dhi * float(q1 - 32);
          }
        if (ob != nullptr) {
          for (int64_t j = 0; j < Q4_GROUP; ++j) ob[i * n + g * Q4_GROUP + j] = at::BFloat16(v[j]);
        } else {
          std::copy(v, v + Q4_GROUP, of + i * n + g * Q4_GROUP);
        }
      }
    }
  });
  return out;
}
