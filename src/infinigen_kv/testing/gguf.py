"""A transformers model written as llama.cpp's converter writes a GGUF (its tensor names, Llama's q/k rows permuted,
Gemma's norms as 1 + w, the block types asked for, a byte-level vocabulary): what the tests read back through our
GGUF loader and compare with the model itself."""

from __future__ import annotations

import numpy as np
import torch

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm"}


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's permutation of Llama's q / k rows (for its interleaved RoPE)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(model, path, types: dict | None = None, default: str = "F32") -> str:
    """Write transformers `model` as a GGUF at `path`. types: {GGUF tensor name's part ("attn_v", "ffn_down",
    "token_embd", "output", ...): GGML type name}; 2-D weights of other names take `default`; 1-D tensors F32."""
    import gguf
    from gguf.quants import quantize

    from ..model.gguf_tokenizer import _byte_alphabet

    c = model.config
    mt = c.model_type
    arch = ARCH[mt]
    w = gguf.GGUFWriter(str(path), arch)
    H, G = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", G)
    w.add_uint32(f"{arch}.attention.key_length", d)
    w.add_uint32(f"{arch}.attention.value_length", d)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = c.rope_parameters if isinstance(getattr(c, "rope_parameters", None), dict) else {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", 10000.0)
    w.add_float32(f"{arch}.rope.freq_base", float(theta))
    if mt == "gemma3_text":
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    letters = _byte_alphabet()
    tokens = [letters[b] for b in range(256)][: c.vocab_size]
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.bos_token_id", c.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", c.eos_token_id)
    w.add_uint32("tokenizer.ggml.padding_token_id", c.pad_token_id)
    types = types or {}
    for name, t in model.state_dict().items():
        gname = _name(name, mt)
        if gname is None or gname == "output.weight" and c.tie_word_embeddings:
            continue
        x = t.detach().float()
        if mt in ("llama", "mistral") and (".attn_q." in gname or ".attn_k." in gname) and x.dim() == 2:
            x = permute(x, H if ".attn_q." in gname else G)
        if mt == "gemma3_text" and gname.endswith("norm.weight"):
            x = x + 1.0
        kind = "F32" if x.dim() == 1 else types.get(gname.split(".")[-2] if gname.startswith("blk.") else
                                                    gname.split(".")[0], default)
        qtype = gguf.GGMLQuantizationType[kind]
        a = x.numpy().astype(np.float32)
        if kind == "F32":
            w.add_tensor(gname, a)
        elif kind == "F16":
            w.add_tensor(gname, a.astype(np.float16))
        elif kind == "Q6_K":  # (the gguf package dequantizes Q6_K but does not quantize it)
            w.add_tensor(gname, quantize_q6_k(a), raw_dtype=qtype)
        else:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _name(name: str, mt: str) -> str | None:
    if name in ("model.embed_tokens.weight",):
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if not name.startswith("model.layers."):
        return None
    _, _, i, rest = name.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    ours = (GEMMA.get(module) if mt == "gemma3_text" else None) or LAYER.get(module)
    return None if ours is None else f"blk.{i}.{ours}.{leaf}"


def hf_from_gguf(path, config_dir=None) -> "torch.nn.Module":
    """transformers' model of a GGUF in float32, its tensors named, fixed up (Llama's q/k order, Gemma's norms) and
    dequantized by transformers' and the gguf package's own code, from the bytes our header parse finds (tested
    against the gguf package's reader: tests/test_gguf.py); its config transformers' parse of the file, unless
    config_dir names a folder with the config.json to use. The reference our GGUF loader is compared with."""
    from pathlib import Path

    import gguf
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from ..model.gguf import GGUF

    path = Path(path)
    config = (AutoConfig.from_pretrained(str(config_dir)) if config_dir is not None else
              AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name))
    from transformers.initialization import no_init_weights

    with no_init_weights():  # (every weight comes from the file: no random init of ~270M values first)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = GGUF(path)
    processor = TENSOR_PROCESSORS.get(g.architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    state = {}
    for t in g.tensors.values():
        raw = np.frombuffer(g.read(t), dtype=np.uint8)
        values = dequantize(raw, gguf.GGMLQuantizationType(t.kind)).reshape(t.shape)
        done = processor.process(weights=values, name=t.name, tensor_key_mapping=names, parsed_parameters={})
        if done.name in names:
            state[names[done.name]] = torch.from_numpy(np.array(done.weights, dtype=np.float32))
    model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config._attn_implementation = "sdpa"
    return model.eval()


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows x (n, cols), cols a multiple of 256, as Q6_K blocks (n, cols / 256 * 210) uint8: per 16 values an int8
    scale, per 256 a float16 d, levels q in [0, 63] with value d sc (q - 32) (llama.cpp's layout; a plain rounding,
    not its search for the best scales)."""
    n, cols = x.shape
    b = x.reshape(-1, 16, 16).astype(np.float32)  # (blocks, 16 sub-blocks, 16)
    amax = np.abs(b).max(-1)  # (blocks, 16)
    scale = amax / 31
    d = (np.abs(scale).max(-1) / 127).astype(np.float16)  # (blocks,)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.round(scale / np.where(df > 0, df, 1)), 0).clip(-128, 127).astype(np.int8)
    step = df * sc.astype(np.float32)
    q = np.where(step[..., None] != 0, np.round(b / np.where(step[..., None] != 0, step[..., None], 1)), 0)
    q = (q + 32).clip(0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # (blocks, half, quarter, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], -1)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], -1)
    return out.reshape(n, -1)
