// The CPU kernels' entry points, as bindings.cpp exposes them (one source file each; shapes in their comments
// there). prefill.cpp's entry points are the prompt chunk's attention.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

// speculate.cpp
std::tuple<at::Tensor, at::Tensor, int64_t> speculate(at::Tensor q, at::Tensor kp, int64_t n,
                                                      c10::optional<at::Tensor> keep, c10::optional<at::Tensor> caps,
                                                      double scale, double alpha, int64_t k, bool mean);
// attend.cpp
at::Tensor attend(at::Tensor q, at::Tensor K, at::Tensor V, c10::optional<at::Tensor> idx,
                  c10::optional<at::Tensor> count, c10::optional<at::Tensor> new_rows, int64_t new_row,
                  c10::optional<at::Tensor> keep, int64_t n, double scale, at::ScalarType out_dtype,
                  int64_t pairs_upto);
// kv_rows.cpp
at::Tensor quantize_rows(at::Tensor x);
at::Tensor quantize_kv_rows(at::Tensor x);
at::Tensor dequantize_kv_rows(at::Tensor rows, int64_t d);
void store_token(at::Tensor K, at::Tensor V, at::Tensor P, at::Tensor k, at::Tensor v, at::Tensor channels,
                 int64_t at);
// linear.cpp
at::Tensor linear(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> residual,
                  bool bf16);
// dequantize.cpp
at::Tensor dequantize_q4_rows(at::Tensor rows, int64_t n, bool bf16);
at::Tensor dequantize_q5_tiles(at::Tensor rows, int64_t n, bool bf16);
at::Tensor dequantize_q8_tiles(at::Tensor rows, int64_t n, bool bf16);
at::Tensor dequantize_q6_tiles(at::Tensor rows, int64_t n, bool bf16);
// partial_query.cpp
at::Tensor partial_query(at::Tensor x, at::Tensor W, c10::optional<at::Tensor> bias, at::Tensor S, at::Tensor P,
                         c10::optional<at::Tensor> cos, c10::optional<at::Tensor> sin, int64_t r, int64_t d_head);
// elementwise.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads);
at::Tensor silu_mul(at::Tensor gu, int64_t lanes);
// column_sums.cpp
at::Tensor column_sums(const at::Tensor& q, const at::Tensor& k, double scale);
// prefill.cpp
bool bf16_dots_native();
at::Tensor prefill_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
at::Tensor prefill_column_sums(const at::Tensor& q, const at::Tensor& k, double scale);
