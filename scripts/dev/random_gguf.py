"""A GGUF of a bigger Qwen2 shape with random float16 weights and a template GGUF's tokenizer: for speed and memory
comparisons where no bigger checkpoint is at hand (a step's time and bytes depend on the shape, not the values).
llama.cpp's `llama-quantize` makes its Q4_K_M / Q8_0 copies; our engine loads any of them like a real GGUF.

    python scripts/dev/random_gguf.py --template qwen2.5-0.5b.gguf --out qwen2.5-1.5b-shape-f16.gguf   # 1.5B shape
    llama-quantize qwen2.5-1.5b-shape-f16.gguf qwen2.5-1.5b-shape-q4_k_m.gguf Q4_K_M
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", required=True, help="a qwen2 GGUF: its metadata and tokenizer are kept")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=28)  # Qwen2.5-1.5B's shape by default
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    reader = GGUFReader(args.template)
    arch = reader.fields["general.architecture"].contents()
    if arch != "qwen2":
        raise SystemExit(f"--template: a qwen2 GGUF, not {arch}")
    shape = dict(zip(SHAPE_KEYS, (args.layers, args.hidden, args.ffn, args.heads, args.kv_heads)))
    writer = GGUFWriter(args.out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own
        name = key.removeprefix(f"{arch}.")
        if name in shape:
            writer.add_key_value(key, shape[name], GGUFValueType.UINT32)
        elif key == "general.file_type":
            writer.add_key_value(key, 1, GGUFValueType.UINT32)  # mostly float16
        elif key == "general.name":
            name = f"random weights, {args.layers} x {args.hidden} qwen2 shape"
            writer.add_key_value(key, name, GGUFValueType.STRING)
        elif field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])

    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    d = args.hidden // args.heads
    rng = np.random.default_rng(args.seed)

    def linear(rows, cols):  # (out, in), the scale of a trained layer's weights
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def vector(n, value=None):
        return np.full(n, value, np.float32) if value is not None else rng.standard_normal(n, dtype=np.float32) * 0.02

    H, kv, F = args.hidden, args.kv_heads * d, args.ffn
    writer.add_tensor("token_embd.weight", linear(vocab, H))
    writer.add_tensor("output.weight", linear(vocab, H))
    writer.add_tensor("output_norm.weight", vector(H, 1.0))
    for i in range(args.layers):
        b = f"blk.{i}."
        for name, t in (("attn_norm.weight", vector(H, 1.0)), ("ffn_norm.weight", vector(H, 1.0)),
                        ("attn_q.weight", linear(H, H)), ("attn_q.bias", vector(H)),
                        ("attn_k.weight", linear(kv, H)), ("attn_k.bias", vector(kv)),
                        ("attn_v.weight", linear(kv, H)), ("attn_v.bias", vector(kv)),
                        ("attn_output.weight", linear(H, H)), ("ffn_gate.weight", linear(F, H)),
                        ("ffn_up.weight", linear(F, H)), ("ffn_down.weight", linear(H, F))):
            writer.add_tensor(b + name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {args.layers} layers x {H}, ffn {F}, {args.heads} / {args.kv_heads} heads, vocab {vocab}")


if __name__ == "__main__":
    main()
