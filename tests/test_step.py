"""The decode step of our model (transformer.Transformer.decode): every method and architecture decodes through it,
alone and in a left-padded batch, its kernel ops giving the PyTorch ops' bits where they replace them; a step's
products reach the layers as values."""

import dataclasses

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model import backend, ops
from infinigen_kv.testing import tiny_hf
from infinigen_kv.model.weights import from_hf
from conftest import KINDS, left_padded_batch, tiny_model

METHODS = {"full": {}, "infinigen": {"budget": 0.3, "min_budget": 0}, "offload": {}, "h2o": {"budget": 0.5},
           "streaming": {"budget": 0.5}, "quant": {}}


def run(model, ids, mask, method, steps=8):
    cache = ig.make_cache(method, model, **METHODS[method])
    lps = []
    out = ig.generate(model, ids, mask, cache=cache, max_new_tokens=steps, stop_at_eos=False, logprobs=3,
                      on_step=lambda i, new, lp: lps.append(lp[1].clone()))
    return out.tokens, torch.stack(lps)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_decodes_alike_alone_and_in_a_padded_batch(kind):
    """Each row of a left-padded batch gets the tokens and log-probabilities it gets alone, every method."""
    model = tiny_model(kind, weights="bfloat16")
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    for method in METHODS:
        tokens, lps = run(model, ids, mask, method)
        alone, alone_lps = run(model, ids[2:, -21:], mask[2:, -21:], method)
        assert torch.equal(tokens[2:], alone), (kind, method)
        torch.testing.assert_close(lps[:, 2:], alone_lps, atol=1e-5, rtol=1e-5)


def test_the_silu_kernel_gives_pytorchs_bits(monkeypatch):
    """Where the silu_mul kernel would not give F.silu's bits (another vector width), PyTorch's ops serve: the same."""
    model = tiny_model("llama-gqa", weights="bfloat16")
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    ref = run(model, ids, mask, "infinigen")
    model.backend = dataclasses.replace(model.backend, silu_lanes=None)
    tokens, lps = run(model, ids, mask, "infinigen")
    assert torch.equal(tokens, ref[0]) and torch.equal(lps, ref[1])


def test_the_silu_kernel_takes_a_transposed_gate_up():
    """A GEMM of a few rows may return its output with transposed strides: the decode MLP hands silu_mul a
    contiguous copy (the kernel refuses any other) and gets the same values."""
    model = tiny_model("llama-gqa")
    mlp = model.layers[0].mlp
    h = torch.randn(2, 1, model.args.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        b = model.backend
        ref = mlp.forward(h, False, b, None)
        w1 = mlp.w1.forward
        mlp.w1.forward = lambda *a: w1(*a).transpose(0, 2).contiguous().transpose(0, 2)  # strides (1, 2F, 2)
        assert not mlp.w1.forward(h, False, b).is_contiguous()
        got = mlp.forward(h, False, b, None)
    assert torch.equal(got, ref)


def test_q_k_v_and_gate_up_are_one_weight_each():
    """Merged at load (weights.STACKED): one matrix a layer for q, k, v (with Qwen2's biases) and one for gate, up;
    q_proj and k_proj are views of its rows."""
    model = tiny_model("qwen2")
    a = model.layers[0].attn
    H, G, d = a.n_heads, a.n_kv_heads, a.head_dim
    assert a.wqkv.weight.shape[0] == (H + 2 * G) * d and a.wqkv.bias is not None
    assert a.k_proj.weight.data_ptr() == a.wqkv.weight[H * d :].data_ptr()
    assert model.layers[0].mlp.w1.weight.shape[0] == 2 * model.args.intermediate


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "gemma3", "opt"])
def test_a_bfloat16_model_decodes_every_method(kind):
    """The PyTorch path (what a GPU runs), in bfloat16: InfiniGen at budget 1.0 gives the full cache's tokens."""
    model = from_hf(tiny_hf(kind).to(torch.bfloat16))
    assert model.dtype == torch.bfloat16 and model.weights is None
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    full, _ = run(model, ids, mask, "full")
    cache = ig.make_cache("infinigen", model, budget=1.0, alpha=1e9, min_budget=0)
    got = ig.generate(model, ids, mask, cache=cache, max_new_tokens=8, stop_at_eos=False).tokens
    assert torch.equal(got, full)
    run(model, ids, mask, "h2o")


def test_the_working_set_reaches_attention_as_a_value():
    """A layer's view (model/kv.py) is what attention reads and a selection's fetch is handed to the layer's view:
    after decode steps of every method no layer holds a working set, its mask, its chosen rows, a key offset or a
    pending fetch for another module to find, and no module of the model carries state of ours."""
    model = tiny_model("llama-gqa", weights="bfloat16")
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    for method in METHODS:
        cache = ig.make_cache(method, model, **METHODS[method])
        ig.generate(model, ids, mask, cache=cache, max_new_tokens=4, stop_at_eos=False)
        for layer in cache.layers:
            left = {"working", "work_mask", "fused", "kv_offset", "selection", "new_slot", "pending"} & set(dir(layer))
            assert not left, (method, left)
        assert "keep_mask" not in dir(cache), method
    after = {name: set(vars(m)) for name, m in model.named_modules()}
    assert all(after[n] == before[n] for n in before), "a module gained attributes while decoding"


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gemma3", "opt"])
def test_int8_weights_stay_exact(kind):
    """--weights int8 (tiles): InfiniGen at budget 1.0 gives the full cache's logits."""
    from test_exactness import EXACT, step_logits

    from infinigen_kv.model import int8_tiles

    model = tiny_model(kind, weights="int8")
    assert model.layers[0].attn.wqkv.weight.dtype == int8_tiles.DTYPE
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    full = step_logits(model, ig.make_cache("full", model), ids, mask)
    torch.testing.assert_close(step_logits(model, ig.make_cache("infinigen", model, **EXACT), ids, mask), full,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_a_prefill_reads_the_lm_head_as_held(weights, monkeypatch):
    """A prefill's LM head over one position a sequence goes through the kernel, which reads the bfloat16 or int8
    rows as they lie: the head's weight is never converted for the BLAS (a float32 copy of a whole vocabulary per
    prompt); the other linears are, unless int8 rows take integer products (int_prefill: none converted)."""
    import dataclasses

    from infinigen_kv.runtime.generation import prefill

    model = tiny_model("llama-gqa", weights=weights)
    model.backend = dataclasses.replace(model.backend, int_prefill=False)
    converted = []
    real = ops.converted_linear
    monkeypatch.setattr(ops, "converted_linear", lambda x, w, b, *a: converted.append(w) or real(x, w, b, *a))
    bf16 = ops.bf16_linear  # (bfloat16 products, where the CPU has them: the weight in bfloat16 for the BLAS)
    monkeypatch.setattr(ops, "bf16_linear", lambda x, w, b: converted.append(w) or bf16(x, w, b))
    ids, mask = left_padded_batch(lengths=(20, 13))
    prefill(model, ids, mask, ig.make_cache("full", model), 2)
    assert converted and not any(w is model.lm_head for w in converted)
    converted.clear()
    model.backend = dataclasses.replace(model.backend, int_prefill=True)
    prefill(model, ids, mask, ig.make_cache("full", model), 2)
    assert bool(converted) == (weights == "bfloat16") and not any(w is model.lm_head for w in converted)
