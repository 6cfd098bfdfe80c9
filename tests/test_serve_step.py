"""The server decodes through the one decode step (transformer.Transformer.decode): greedy tokens through it, asked with the openai
client, equal `generate`'s for every method on every architecture's test model; its engine makes and runs every
tensor operation on one thread."""

import threading

import pytest
import torch

import infinigen_kv as ig
from conftest import save_tiny
from infinigen_kv.methods.registry import METHODS as REGISTRY
from infinigen_kv.model.transformer import Transformer
from infinigen_kv.model.load import ModelLoadError

openai = pytest.importorskip("openai")
fastapi = pytest.importorskip("fastapi")
MODEL = "tiny"
OPTIONS = {"infinigen": {"budget": 0.3, "min_budget": 0}, "h2o": {"budget": 0.5, "min_budget": 0},
           "streaming": {"budget": 0.5, "min_budget": 0}}
KINDS_ONE_EACH = ["llama-gqa", "mistral", "qwen2", "qwen3", "gemma3", "opt"]  # one test model per architecture


def served_text(engine, prompt: list[int], n: int) -> str:
    from fastapi.testclient import TestClient

    from infinigen_kv.serve.app import create_app

    with TestClient(create_app(engine, MODEL)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
    return out.choices[0].text


@pytest.mark.parametrize("kind", KINDS_ONE_EACH)
def test_served_tokens_equal_generates(tmp_path, kind, monkeypatch):
    from infinigen_kv.serve import Engine

    model, tok = ig.load_model(save_tiny(tmp_path / kind, kind, eos_never_greedy=True))
    prompt = torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    used = []
    real = Transformer.decode
    monkeypatch.setattr(Transformer, "decode", lambda *a, **k: used.append(1) or real(*a, **k))
    for method in [name for name, m in REGISTRY.items() if m.batches]:  # what the server serves
        options = OPTIONS.get(method, {})
        ref = ig.generate(model, torch.tensor([prompt]), cache=ig.make_cache(method, model, **options),
                          max_new_tokens=6, ignore_eos=True).tokens[0].tolist()
        engine = Engine(model, tok, method, options)
        try:
            used.clear()
            served = served_text(engine, prompt, 6)
        finally:
            engine.close()
        assert served == tok.decode(ref), (kind, method)
        assert used, (kind, method)  # the server's steps went through the decode step


def test_an_engine_on_one_thread_makes_and_runs_everything_there(tmp_path):
    from infinigen_kv.serve import Engine

    path, seen = save_tiny(tmp_path / "m"), []

    def load():
        seen.append(threading.current_thread())
        return ig.load_model(path)

    engine = Engine.on_one_thread(load, "full", None, max_batch=2)
    try:
        assert seen == [engine.thread] and engine.thread is not threading.main_thread() and engine.thread.is_alive()
    finally:
        engine.close()
    assert not engine.thread.is_alive()

    def broken():
        raise ModelLoadError("no such model")

    with pytest.raises(ModelLoadError, match="no such model"):  # the caller gets the load's error
        Engine.on_one_thread(broken, "full")
