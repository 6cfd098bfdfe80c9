"""What a GGUF's metadata and tensor table say about its model: the config (in a checkpoint's config.json names, so
hparams.from_config reads it as it reads any checkpoint), each tensor's checkpoint name and fix-up, and how each
of our weights is held at the file's precision (`plan`).

Facts of llama.cpp's converter that a GGUF does not state (they are undone here): Llama's q and k rows are permuted
for its interleaved RoPE (Qwen2, Qwen3 and Gemma 3 use the rotate-half form as written); Gemma's norm weights are
stored as 1 + w; Gemma 3's local layers use RoPE base 10,000 and every sixth layer is global; its query scale is
1 / sqrt(head size), 1 / sqrt(hidden / heads) for the 62-layer 27B; Llama 3.1's RoPE scaling is a tensor of
frequency factors (rope_freqs), read back into its four numbers.
"""

from __future__ import annotations

import math

from . import gguf_blocks, int6_tiles
from .gguf import GGUF
from .hparams import UnsupportedModelError

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "mistral": "mistral"}
LAYER_NAMES = {  # blk.N.<name> -> model.layers.N.<checkpoint name>
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
IGNORED = ("rope_freqs.weight",)  # read into the config (Llama 3.1's RoPE scaling), not a weight


def model_type(g: GGUF) -> str:
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}: infinigen-kv reads "
                                    f"{', '.join(sorted(ARCHITECTURES))} GGUFs")
    return ARCHITECTURES[arch]


def config(g: GGUF) -> dict:
    """The model's config as a checkpoint's config.json would give it (transformers' names)."""
    mt = model_type(g)
    a = g.arch
    tokens = g.get("tokenizer.ggml.tokens") or []
    embed = g.tensors.get("token_embd.weight")
    D, H, L = int(a("embedding_length")), int(a("attention.head_count")), int(a("block_count"))
    G = a("attention.head_count_kv", H)
    G = max(G) if isinstance(G, list) else int(G)
    d = int(a("attention.key_length") or a("rope.dimension_count") or D // H)
    c = {
        "model_type": mt, "architectures": [mt], "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H,
        "num_key_value_heads": G, "head_dim": d, "intermediate_size": int(a("feed_forward_length")),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(a("context_length", 0)), "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": int(a("vocab_size") or (embed.shape[0] if embed is not None else len(tokens))),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "bos_token_id": g.get("tokenizer.ggml.bos_token_id"), "eos_token_id": g.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = _rope_scaling(g, d)
    if scaling is not None:
        c["rope_scaling"] = scaling
    if mt == "gemma3_text":
        c.update(hidden_activation="gelu_pytorch_tanh", sliding_window=int(a("attention.sliding_window", 512)),
                 sliding_window_pattern=6, rope_local_base_freq=float(a("rope.freq_base_swa", 10000.0)),
                 query_pre_attn_scalar=D // H if L == 62 else d,
                 final_logit_softcapping=a("final_logit_softcapping"), attn_logit_softcapping=None)
    if mt == "mistral" and a("attention.sliding_window"):
        c["sliding_window"] = int(a("attention.sliding_window"))
    return c


def eos_ids(g: GGUF) -> list[int] | int | None:
    """The ids that end a generation: the file's end-of-sequence token and its end-of-turn one where it names one."""
    ids = [g.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids = list(dict.fromkeys(i for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def _rope_scaling(g: GGUF, head_dim: int) -> dict | None:
    a = g.arch
    kind = a("rope.scaling.type")
    if kind in (None, "none") and "rope_freqs.weight" not in g.tensors:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if "rope_freqs.weight" in g.tensors:
        return _llama3_scaling(g, head_dim)
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (linear and Llama 3's are)")


def _llama3_scaling(g: GGUF, head_dim: int) -> dict:
    """Llama 3.1's RoPE scaling from its frequency factors: the factor is their largest, and the low/high frequency
    factors and original context are Llama 3.1's (1, 4, 8192), checked against the factors the file holds."""
    import torch

    t = g.tensors["rope_freqs.weight"]
    factors = torch.frombuffer(bytearray(g.read(t)), dtype=torch.float32)
    theta = float(g.arch("rope.freq_base", 10000.0))
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    low, high = 8192 / scaling["low_freq_factor"], 8192 / scaling["high_freq_factor"]
    smooth = (8192 / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
    want = torch.where(wavelen < high, 1.0, torch.where(wavelen > low, scaling["factor"],
                                                          1.0 / ((1 - smooth) / scaling["factor"] + smooth)))
    if not torch.allclose(want.float(), factors, rtol=1e-3):
        raise UnsupportedModelError("this GGUF's RoPE frequency factors are not Llama 3's scaling: not supported")
    return scaling


def names(g: GGUF) -> dict:
    """{GGUF tensor name: (checkpoint name, fix-up)}: fix-up None, ("permute", heads) or "norm_minus_one"."""
    mt = model_type(g)
    H = int(g.arch("attention.head_count"))
    G = g.arch("attention.head_count_kv", H)
    G = max(G) if isinstance(G, list) else int(G)
    gemma = mt == "gemma3_text"
    out = {}
    for name in g.tensors:
        if name in IGNORED:
            continue
        if name in TOP_NAMES:
            theirs = TOP_NAMES[name]
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            module, _, leaf = rest.rpartition(".")
            ours = (GEMMA_LAYER_NAMES.get(module) if gemma else None) or LAYER_NAMES.get(module)
            if ours is None:
                raise UnsupportedModelError(f"GGUF tensor {name} has no place in a {mt} model")
            theirs = f"model.layers.{i}.{ours}.{leaf}"
        else:
            raise UnsupportedModelError(f"GGUF tensor {name} has no place in a {mt} model")
        fix = None
        if mt in ("llama", "mistral") and (".attn_q." in name or ".attn_k." in name):
            fix = ("permute", H if ".attn_q." in name else G)
        elif gemma and name.endswith("norm.weight"):
            fix = "norm_minus_one"
        out[name] = (theirs, fix)
    return out


def unpermute(rows, heads: int):
    """Llama's q / k rows as llama.cpp's converter permuted them (for its interleaved RoPE) back into the checkpoint's
    order: within each head, rows (2, d / 2) transposed. rows: (heads d, ...) of any dtype (quantized rows move as
    they are)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def plan(params: dict, parts: dict, weights: str | None) -> dict:
    """{our weight's name: its form} for the model's 2-D weights `params` ({name: (rows, columns)}), whose checkpoint
    tensors `parts` ({name: [(row offset, rows, GGML type)]}) fill them. weights None: the file's precision (each
    tensor's natural form; a merged weight takes the form of most bits among its parts; int5 only in whole tiles);
    otherwise that form for every layer weight. The embedding (and a tied LM head) is held as int8 rows where the
    file quantizes it (its rows are looked up one at a time; int8 holds Q8_0 and Q4_0 / Q5_0 exactly), else in
    bfloat16. Q6_K is held as int6 tiles where a weight is Q6_K alone in whole tiles of whole super-blocks, else as
    int8 rows."""
    out = {}
    for name, (rows, cols) in params.items():
        kinds = [k for _, _, k in parts.get(name, [])]
        natural = max((gguf_blocks.natural(k) for k in kinds), key=gguf_blocks.FORMS.index, default="bfloat16")
        form = natural if weights is None else weights
        if name == "embed" and weights is None:
            form = "bfloat16" if natural == "bfloat16" else "int8"
        elif name in ("embed", "lm_head") and weights in ("int4", "int5"):
            form = "int8"  # (an LM head at more bits than the layers, as llama.cpp's Q4_K_M keeps it)
        ps = parts.get(name, [])
        if form in ("int5", "int6") and (rows % 16 or any(start % 16 or n % 16 for start, n, _ in ps)):
            form = "int8"  # (int5 and int6 rows are whole tiles of 16)
        if form == "int6" and (name == "embed" or cols is None or not int6_tiles.fits(rows, cols)
                               or any(k != gguf_blocks.Q6_K for k in kinds)):
            form = "int8"  # (int6 tiles hold Q6_K's blocks alone, in whole super-blocks)
        out[name] = form
    return out
