"""The K/V rows' storage (kv_dtype): every method that stores K/V keeps its rows in bfloat16 (half a float32 model's
bytes) or int8 (a row's values by its absmax, with its float32 scale) when asked, attention computed in float32 over
the rows as stored; at budget 1.0 each method equals the full cache at the same storage, on the CPU kernels and on the
PyTorch path a GPU runs. "auto" is bfloat16 for a float32 model on CPU and the model's dtype elsewhere."""

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch
from infinigen_kv.config import ConfigError
from infinigen_kv.model import backend
from test_exactness import EXACT, step_logits

METHODS = [("infinigen", EXACT), ("offload", {}), ("h2o", {"budget": 1.0}), ("streaming", {"budget": 1.0})]


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "gemma3", "opt"])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8])
def test_every_method_equals_full_at_the_same_storage(tiny_models, kind, kernel, storage, monkeypatch):
    model = tiny_models[kind]
    monkeypatch.setattr(model, "backend", backend.build("cpu", kernels=kernel))
    KV = {"kv_dtype": str(storage).removeprefix("torch.")}
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    full = ig.make_cache("full", model, **KV)
    ref = step_logits(model, full, ids, mask)
    assert full.layers[1].k.dtype == storage and full.layers[1].v.dtype == storage
    f32 = step_logits(model, ig.make_cache("full", model, kv_dtype="float32"), ids, mask)
    assert not torch.equal(ref, f32)  # rounded rows: other logits, close ones
    torch.testing.assert_close(ref, f32, atol=0.05, rtol=0.05)
    for method, options in METHODS:
        cache = ig.make_cache(method, model, **options, **KV)
        got = step_logits(model, cache, ids, mask)
        assert {layer.k.dtype for layer in cache.layers} == {storage}, method
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{method}: {m}")


def test_bfloat16_rows_take_half_the_bytes_and_are_the_cpu_default(tiny_models):
    model = tiny_models["llama-gqa"]
    d = model.config.head_dim
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    nbytes = {}
    for kv in ("auto", "float32", "bfloat16", "int8"):
        cache = ig.make_cache("infinigen", model, kv_dtype=kv)
        ig.generate(model, ids, mask, cache=cache, max_new_tokens=4, stop_at_eos=False)
        nbytes[kv] = sum(b.nbytes for layer in cache.layers for b in (layer.k, layer.v))
    assert nbytes["bfloat16"] * 2 == nbytes["float32"]
    assert nbytes["auto"] == nbytes["bfloat16"]  # a float32 model on CPU
    assert nbytes["int8"] * 4 * d == nbytes["float32"] * (d + 2)  # d = 16 values and one 2-byte scale a row


def test_auto_is_bfloat16_on_cpu_and_the_models_dtype_on_a_gpu():
    from infinigen_kv.model.kv import kv_storage

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # (a device object: no GPU needed)
    assert kv_storage("auto", torch.float32, cpu) == torch.bfloat16
    assert kv_storage("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert kv_storage("auto", torch.float16, gpu) == torch.float16
    assert kv_storage("auto", torch.float32, gpu) == torch.float32
    assert kv_storage("float32", torch.bfloat16, gpu) == torch.float32
    assert kv_storage("bfloat16", torch.float32, cpu) == torch.bfloat16


def test_the_storage_is_part_of_the_prefix_namespace(tiny_models):
    from infinigen_kv.runtime.prefix import cache_namespace

    model = tiny_models["llama-gqa"]
    spaces = {kv: cache_namespace(model, ig.make_cache("full", model, kv_dtype=kv), 16)
              for kv in ("auto", "float32", "bfloat16")}
    assert spaces["float32"] != spaces["bfloat16"]  # a block stored in one is a miss for the other, never converted
    assert spaces["auto"] == spaces["bfloat16"]  # the option as resolved: a float32 model on CPU


def test_a_bad_storage_is_refused(tiny_models):
    for method in ("full", "infinigen", "h2o"):
        with pytest.raises(ConfigError, match="kv_dtype must be one of auto, float32, bfloat16, int8"):
            ig.make_cache(method, tiny_models["llama-gqa"], kv_dtype="int4")
