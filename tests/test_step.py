"""The decode step (model/step.py) computes what the model's forward computes, to the last bit, for every method and
architecture, alone and in a left-padded batch, through its kernel path and its PyTorch path; a cache not made here
decodes through the forward."""

import copy

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model import step
from infinigen_kv.model.load import fast_cpu_linears
from conftest import KINDS, left_padded_batch

SERVED = KINDS
METHODS = {"full": {}, "infinigen": {"budget": 0.3, "min_budget": 0}, "offload": {}, "h2o": {"budget": 0.5},
           "streaming": {"budget": 0.5}, "quant": {}}


def run(model, ids, mask, method, own: bool, monkeypatch):
    monkeypatch.setattr(step, "ENABLED", own)
    cache = ig.make_cache(method, model, **METHODS[method])
    lps = []
    out = ig.generate(model, ids, mask, cache=cache, max_new_tokens=8, stop_at_eos=False, logprobs=3,
                      on_step=lambda i, new, lp: lps.append(lp[1].clone()))
    return out.tokens, torch.stack(lps), step.supports(model, cache)


@pytest.mark.parametrize("kind", SERVED)
def test_own_step_equals_the_models_forward(tiny_models, kind, monkeypatch):
    model = copy.deepcopy(tiny_models[kind])
    fast_cpu_linears(model, weights="bfloat16")  # as load_model does on CPU
    for ids, mask in (left_padded_batch(lengths=(40, 33, 21)), left_padded_batch(lengths=(37,))):
        for method in METHODS:
            tokens, lps, used = run(model, ids, mask, method, True, monkeypatch)
            ref_tokens, ref_lps, _ = run(model, ids, mask, method, False, monkeypatch)
            assert used, (kind, method)
            assert torch.equal(tokens, ref_tokens) and torch.equal(lps, ref_lps), (kind, method, ids.shape)
    if model.config.model_type not in step.KERNEL_TYPES:
        return
    # q, k, v and gate, up went through one kernel call each, over views of one matrix (Qwen2: with its biases)
    layer, merged = model.model.layers[0], model._infinigen_merged[0]
    assert merged is not None and layer.self_attn.k_proj.weight.data_ptr() > merged[0][0].data_ptr()
    assert (merged[0][1] is not None) == (kind == "qwen2")


def test_own_step_without_the_silu_kernel(tiny_models, monkeypatch):
    """Where the silu_mul kernel would not give F.silu's bits (another vector width), PyTorch's ops serve: the same."""
    import dataclasses

    from infinigen_kv.model import backend

    model = copy.deepcopy(tiny_models["llama-gqa"])
    fast_cpu_linears(model, weights="bfloat16")
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    ref = run(model, ids, mask, "infinigen", False, monkeypatch)
    monkeypatch.setitem(backend._chosen, ("cpu", True), dataclasses.replace(backend.cpu(), silu_lanes=None))
    tokens, lps, used = run(model, ids, mask, "infinigen", True, monkeypatch)
    assert used and torch.equal(tokens, ref[0]) and torch.equal(lps, ref[1])


def test_an_mlp_with_biases_keeps_separate_calls(tiny_models):
    """The merged gate/up call has no bias: a layer whose gate or up projection has one is not merged."""
    model = copy.deepcopy(tiny_models["llama-gqa"])
    fast_cpu_linears(model, weights="bfloat16")
    up = model.model.layers[0].mlp.up_proj
    up.bias = torch.nn.Parameter(torch.randn(up.out_features))
    assert step._merge_layer(model.model.layers[0]) is None and step._merge_layer(model.model.layers[1]) is not None


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "gemma3", "opt"])
def test_the_step_in_the_models_dtype_with_its_own_linears(tiny_models, kind, monkeypatch):
    """The step's PyTorch path (what a GPU runs): the model's own linears, in bfloat16, every method as its forward."""
    model = copy.deepcopy(tiny_models[kind]).to(torch.bfloat16)
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    for method in ("full", "infinigen", "h2o"):
        tokens, lps, used = run(model, ids, mask, method, True, monkeypatch)
        ref_tokens, ref_lps, _ = run(model, ids, mask, method, False, monkeypatch)
        assert used and torch.equal(tokens, ref_tokens) and torch.equal(lps, ref_lps), (kind, method)


def test_a_foreign_cache_decodes_through_the_forward(tiny_models):
    model = copy.deepcopy(tiny_models["llama-gqa"])
    fast_cpu_linears(model)
    cache = ig.make_cache("hf-dynamic", model)
    assert not step.supports(model, cache) and step.forward_reason(model, cache) in step.FORWARD
    assert step.supports(model, ig.make_cache("full", model)) and step.forward_reason(model, cache) is not None


def test_the_working_set_reaches_attention_as_a_value(tiny_models, monkeypatch):
    """A layer's view (model/kv.py) is what attention reads and a selection's fetch is handed to the layer's view:
    after decode steps of every method no layer holds a working set, its mask, its chosen rows, a key offset or a
    pending fetch for another module to find."""
    model = copy.deepcopy(tiny_models["llama-gqa"])
    fast_cpu_linears(model, weights="bfloat16")
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    for method in METHODS:
        cache = ig.make_cache(method, model, **METHODS[method])
        ig.generate(model, ids, mask, cache=cache, max_new_tokens=4, stop_at_eos=False)
        for layer in cache.layers:
            left = {"working", "work_mask", "fused", "kv_offset", "selection", "new_slot", "pending"} & set(dir(layer))
            assert not left, (method, left)
        assert "keep_mask" not in dir(cache), method  # a prompt's valid positions reach each layer's view as a value


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gemma3", "opt"])
def test_int8_weights_step_equals_the_forward_and_stays_exact(tiny_models, kind, monkeypatch):
    """--weights int8: the step (the kernel path over merged int8 rows on Llama-layout models) gives the forward's
    tokens and log-probabilities to the last bit, and InfiniGen at budget 1.0 the full cache's logits."""
    from test_exactness import EXACT, step_logits

    model = copy.deepcopy(tiny_models[kind])
    fast_cpu_linears(model, weights="int8")
    ids, mask = left_padded_batch(lengths=(40, 33, 21))
    for method in ("full", "infinigen"):
        tokens, lps, used = run(model, ids, mask, method, True, monkeypatch)
        ref_tokens, ref_lps, _ = run(model, ids, mask, method, False, monkeypatch)
        assert used and torch.equal(tokens, ref_tokens) and torch.equal(lps, ref_lps), (kind, method)
    if kind in step.KERNEL_TYPES:
        assert model._infinigen_merged[0][0][0].dtype == torch.int8
    full = step_logits(model, ig.make_cache("full", model), ids, mask)
    torch.testing.assert_close(step_logits(model, ig.make_cache("infinigen", model, **EXACT), ids, mask), full,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_a_prefill_reads_the_lm_head_as_held(tiny_models, weights, monkeypatch):
    """A prefill's LM head over one position a sequence goes through the kernel, which reads the bfloat16 or int8
    rows as they lie: the head's weight is never converted for the BLAS (a float32 copy of a whole vocabulary per
    prompt); the other linears are, and the logits are the decode path's over the same rows."""
    from infinigen_kv.model import install
    from infinigen_kv.runtime.generation import prefill

    model = copy.deepcopy(tiny_models["llama-gqa"])
    fast_cpu_linears(model, weights=weights)
    converted, head_in = [], []
    real = install.linear
    monkeypatch.setattr(install, "linear", lambda x, w, b: converted.append(w) or real(x, w, b))
    model.lm_head.register_forward_hook(lambda m, args, out: head_in.append(args[0].clone()))
    ids, mask = left_padded_batch(lengths=(20, 13))
    logits = prefill(model, ids, mask, ig.make_cache("full", model), 2)
    assert converted and not any(w is model.lm_head.weight for w in converted)
    monkeypatch.undo()
    install._prefilling.set(False)  # the same rows as a decode step reads them (model/step.py)
    assert torch.equal(logits, install._small_batch_linear(model.lm_head, head_in[-1])[:, -1])
