// The CPU kernels' Python module: one binding per kernel (kernels.h declares them; a source file each).

#include <torch/csrc/utils/pybind.h>  // (not torch/extension.h: its C++ frontend headers cost ~10 s of every build)

#include "bf16_dots.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("linear", &linear, "few-row linear layer, float32, bfloat16, int8-row or tiled weights, plus a residual",
          py::arg("x"), py::arg("W"), py::arg("bias") = py::none(), py::arg("residual") = py::none(),
          py::arg("bf16") = false);
  mod.def("rope_", &rope_, "rotate the first heads of decode rows in place (transformers' bits)");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of a merged gate-up output (PyTorch's bits)");
  mod.def("partial_query", &partial_query, "partial query from the q_proj rows it needs, RoPE applied",
          py::arg("x"), py::arg("W"), py::arg("bias"), py::arg("S"), py::arg("P"), py::arg("cos"), py::arg("sin"),
          py::arg("r"), py::arg("d_head") = 0);
  mod.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  mod.def("quantize_rows", &quantize_rows, "int8 partial key rows with their per-row scale");
  mod.def("quantize_kv_rows", &quantize_kv_rows, "int8 K/V rows: groups of 32 values, a float16 scale each");
  mod.def("dequantize_kv_rows", &dequantize_kv_rows, "int8 K/V rows' values in float32");
  mod.def("dequantize_q4_rows", &dequantize_q4_rows, "int4 weight rows' values in float32 or bfloat16");
  mod.def("dequantize_q5_tiles", &dequantize_q5_tiles, "int5 weight tiles' values in float32 or bfloat16");
  mod.def("dequantize_q8_tiles", &dequantize_q8_tiles, "int8 weight tiles' values in float32 or bfloat16");
  mod.def("dequantize_q6_tiles", &dequantize_q6_tiles, "int6 weight tiles' values in float32 or bfloat16");
  mod.def("store_token", &store_token, "a decode token's K, V and int8 partial key rows into a pool layer");
  mod.def("speculate", &speculate, "approximate scores -> relative -> combine -> count -> selection");
  mod.def("attend", &attend, "decode attention over chosen pool rows, gathered in place", py::arg("q"), py::arg("K"),
          py::arg("V"), py::arg("idx"), py::arg("count"), py::arg("new_rows"), py::arg("new_row"), py::arg("keep"),
          py::arg("n"), py::arg("scale"), py::arg("out_dtype"), py::arg("pairs_upto") = 0);
  mod.def("bf16_dots_native", &bf16_dots_native, "whether this build multiplies bfloat16 pairs (AVX-512 BF16)");
#ifdef IG_BF16_DOTS
  mod.attr("BF16_ATTEND_ROWS") = bf16dots::LONG_ROWS;  // rows from which bfloat16 pairs serve (attend_pairs_upto)
#else
  mod.attr("BF16_ATTEND_ROWS") = py::none();
#endif
  mod.def("prefill_attend", &prefill_attend, "a prompt chunk's causal attention over its past, bfloat16 products");
  mod.def("prefill_column_sums", &prefill_column_sums,
          "a prompt chunk's attention probabilities summed per key (H2O's scores), bfloat16 products");
  mod.def("column_sums", &column_sums, "the same column sums in float32 products (AVX2 and FMA)");
}
