"""What the tests, `scripts/gpu_check.py` and the tools under `scripts/dev/` build on: tiny random models of every
supported architecture (made in-process, no download), left-padded batches of random prompts, a plan of sequences
joining and leaving a running batch (`run_plan`), and the CUDA transfer run on CPU with stand-ins for torch.cuda
(the same code in the same order, the copies done at once)."""

from __future__ import annotations

import contextlib

import torch


def tiny_model(kind: str, seed: int = 0, weights: str | None = None, backend=None):
    """Our model (transformer.Transformer) of `tiny_hf(kind, seed)`: the same weights; weights "bfloat16" or "int8"
    hold them so (float32 compute); backend: what runs it (model/backend.py; None: the machine's, built at its
    first forward)."""
    from infinigen_kv.model.weights import from_hf

    model = from_hf(tiny_hf(kind, seed), weights)
    if backend is not None:
        model.backend = backend
    return model


def tiny_hf(kind: str, seed: int = 0):
    """Tiny random transformers models of each supported architecture (built in-process, no download): the
    reference our models are compared with."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama-mha":
        cfg = LlamaConfig(intermediate_size=128, num_key_value_heads=4, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama-gqa":
        cfg = LlamaConfig(intermediate_size=128, num_key_value_heads=2, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":  # a sliding window wider than any test sequence: same as full attention
        cfg = MistralConfig(intermediate_size=128, num_key_value_heads=2, sliding_window=4096, **common)
        model = MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(intermediate_size=128, num_key_value_heads=2, **common)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "llama31":  # Llama 3.1's RoPE scaling (rope_type "llama3": low frequencies stretched)
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
        cfg = LlamaConfig(intermediate_size=128, num_key_value_heads=2, rope_parameters=rope, **common)
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen3":  # QK-norm: per-head RMSNorm of q and k before RoPE
        cfg = Qwen3Config(intermediate_size=128, num_key_value_heads=2, head_dim=16, **common)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves the norm weights at one: make them matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 2.0)
    elif kind == "gemma3":  # local (window 16) and global layers, a RoPE base per type, QK-norm, own q scale
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        cfg = Gemma3TextConfig(intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=16,
                               layer_types=types, rope_parameters=rope, query_pre_attn_scalar=24, **common)
        model = Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves the (1 + w) norm weights at one: make them matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(-0.5, 1.0)
    elif kind == "opt":
        cfg = OPTConfig(ffn_dim=128, word_embed_proj_dim=64, **common)
        model = OPTForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "sdpa"
    return model.eval()


KINDS = ["llama-mha", "llama-gqa", "llama31", "mistral", "qwen2", "qwen3", "gemma3", "opt"]


def left_padded_batch(vocab: int = 256, lengths=(48, 40, 31), seed: int = 1):
    """(input_ids, attention_mask) of len(lengths) random prompts, left-padded with pad id 0."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, L in enumerate(lengths):
        ids[i, n - L:] = torch.randint(3, vocab, (L,), generator=g)
        mask[i, n - L:] = 1
    return ids, mask


def prompt(n, seed):
    """n random token ids (3..255) of a seed."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_plan(model, method, options, plan, chunk=16, temperature=0.0):
    """plan: {name: (step it arrives, prompt ids, max tokens, seed)}. Greedy (or seeded sampling) decode with
    rows joining at their step and leaving when done; -> {name: generated ids}."""
    import infinigen_kv as ig
    from infinigen_kv.runtime.batching import Prefill, RunningBatch
    from infinigen_kv.runtime.sampling import SamplingParams

    batch, rows, out, step = RunningBatch(model), [], {k: [] for k in plan}, 0
    while step == 0 or rows or any(s >= step for s, *_ in plan.values()):
        for name, (start, ids, max_tokens, seed) in plan.items():
            if start == step:
                p = Prefill(model, ig.make_cache(method, model, **options), ids, chunk=chunk)
                while not p.step():
                    pass
                batch.join(p, SamplingParams(temperature=temperature, seed=seed), max_tokens)
                rows.append(name)
        if rows:
            ids, _ = batch.sample()
            for name, t in zip(rows, ids.tolist()):
                out[name].append(t)
            live = [i for i, name in enumerate(rows) if len(out[name]) < plan[name][2]]
            order = batch.retain(live)
            assert sorted(order) == live
            rows = [rows[i] for i in order]
            if rows:
                batch.forward(ids[order])
        step += 1
    return out


class FakeEvent:
    """torch.cuda.Event on CPU: records where it was recorded; synchronize/query are immediate."""

    def __init__(self, log=None, *args, **kwargs):
        self.log, self.stream = log, None
        if log is not None:
            log.append("made")

    def record(self, stream=None):
        self.stream = stream

    def synchronize(self):
        pass

    def query(self):
        return True


class FakeStream:
    def __init__(self, device=None):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class FakeCuda:
    """The torch.cuda names CudaTransfer uses (Stream, Event, stream, current_stream), on CPU: the transfer's
    own code runs in its own order, with the copies done at once. `events` logs every Event made."""

    def __init__(self):
        self.events, self.main = [], FakeStream()

    def Event(self, *args, **kwargs):  # noqa: N802 (torch.cuda's name)
        return FakeEvent(self.events)

    def Stream(self, device=None):  # noqa: N802
        return FakeStream(device)

    def current_stream(self, device=None):
        return self.main

    def stream(self, stream):
        return contextlib.nullcontext()


def on_fake_cuda(cache, uva: bool = True):
    """Make `cache` (not yet run) move its rows with CudaTransfer on CPU stand-ins: returns the transfer. uva: the
    side stream gathers from the pool's device view (the default on a GPU that allows it), else the worker."""
    from infinigen_kv.methods.infinigen.cuda_transfer import CudaTransfer

    transfer = CudaTransfer("cpu", cuda=FakeCuda(), pin=False, uva=uva)
    cache.transfers.by_device = {torch.device("cpu"): transfer}
    cache.transfer = transfer
    return transfer


def random_model(config: dict, dtype=torch.float32, device="cpu", seed: int = 0):
    """Our model of a config.json dict with random weights, made where it runs (no transformers model first: an 8B
    shape is made on the GPU at once): weights ~ N(0, 0.02), norms 1, biases 0."""
    from infinigen_kv.model.hparams import from_config
    from infinigen_kv.model.transformer import Transformer

    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(from_config(config), None, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name and p.dim() == 1:
                p.fill_(0.0 if model.args.norm == "rms1p" else 1.0)
            else:
                p.normal_(0, 0.02)
    return model.eval()
