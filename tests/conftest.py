import contextlib
import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run in its interpreter here: read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infinigen_kv.testing import KINDS, left_padded_batch, on_fake_cuda, tiny_hf, tiny_model  # noqa: E402, F401
from infinigen_kv.model import kernels as _kernels  # noqa: E402

KERNELS_BUILT_AT_START = _kernels.is_built()  # read before any test could build them: the install's doing


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Calibrations and converted models of the tests go to a temporary cache, except the default
    model's conversion, which is reused from the user cache when it is there (it takes ~20 s)."""
    os.environ.setdefault("INFINIGEN_TEST_USER_CACHE", os.environ.get("INFINIGEN_CACHE_DIR", ""))
    os.environ["INFINIGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("infinigen-cache"))
    yield


ALL_THREADS = torch.get_num_threads()  # the count the suite started with


@pytest.fixture(autouse=True)
def _fixed_threads():
    """Tests compare runs bit for bit: the thread tuner stays off (PyTorch's own ops, unlike the kernels, may
    differ in the last bit between thread counts), and every test starts on all cores."""
    from infinigen_kv.runtime import threads

    threads.TUNER.enabled = False
    torch.set_num_threads(ALL_THREADS)
    yield
    torch.set_num_threads(ALL_THREADS)  # a test's --threads N does not outlive it
    threads.TUNER.enabled = True


@contextlib.contextmanager
def triton_module(name: str, monkeypatch):
    """(the Triton kernel module `name` imported anew, the device its kernels run on): on a GPU the kernels
    themselves; here in Triton's interpreter (TRITON_INTERPRET, read when a kernel is decorated). Dropped after."""
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1" if dev == "cpu" else "0")
    sys.modules.pop(name, None)
    try:
        yield importlib.import_module(name), dev
    finally:
        sys.modules.pop(name, None)


@pytest.fixture
def float32_products(monkeypatch):
    """`float32_products(*models)`: those models' backends with prompt chunks and decode rows multiplied in float32
    on every CPU (not in bfloat16 where it is native), for tests that compare held weights against float32 ones bit
    for bit; their own backends back after the test."""
    return lambda *models: use_float32_products(monkeypatch, *models)


def use_float32_products(monkeypatch, *models):
    """float32_products inside a test (monkeypatch.undo() gives the models their backends back)."""
    import dataclasses

    for model in models:
        monkeypatch.setattr(model, "backend", dataclasses.replace(model.backend, bf16_products=False,
                                                                  int_prefill=False))


@pytest.fixture(scope="session")
def tiny_models():
    return {k: tiny_model(k) for k in KINDS}


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold. The pass key is 12345. Remember it. ") * 4


def save_tiny(path, kind="llama-gqa", eos_never_greedy=False):
    """A tiny random model + a small byte-level BPE tokenizer, saved as a local checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=250, special_tokens=["<pad>", "<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    model = tiny_hf(kind)
    model.config.vocab_size = 256
    if eos_never_greedy:  # EOS's row the mean of the others: its logit their mean, below their largest whatever
        with torch.no_grad():  # the hidden state (a method dropping entries moves it): long greedy outputs
            w, eos = model.lm_head.weight, model.config.eos_token_id
            w[eos] = torch.cat([w[:eos], w[eos + 1:]]).mean(0)
    model.save_pretrained(path)
    return str(path)


def row_zero_selections(model, ids, mask, new_tokens=16, **cache_kwargs):
    """Greedy InfiniGen generation of a (left-padded) batch: (row 0's tokens, row 0's 5 largest logprobs per
    step (exact floats), row 0's chosen token positions per prefetch, as lists per KV head, counted from its
    first real token)."""
    import infinigen_kv as ig
    from infinigen_kv.methods.infinigen.cache import InfiniGenCache

    pad, seen = int((mask[0] == 0).sum()), []
    real = InfiniGenCache.prefetch

    def spy(self, target, fetch):
        idx, got = fetch.idx[0], fetch.count[0] if fetch.count is not None else None
        seen.append([sorted((idx[g, : int(got[g])] if got is not None else idx[g][fetch.real[0, g]]) .tolist())
                     for g in range(idx.shape[0])])
        seen[-1] = [[i - pad for i in g] for g in seen[-1]]
        return real(self, target, fetch)

    InfiniGenCache.prefetch = spy
    try:  # the budget's fraction as named (short test prompts are under the default floor: nothing selected)
        cache = ig.make_cache("infinigen", model, **{"min_budget": 0, **cache_kwargs})
        top = []
        out = ig.generate(model, ids, mask, cache=cache, max_new_tokens=new_tokens, stop_at_eos=False, logprobs=5,
                          on_step=lambda i, new, lp: top.append(lp[1][0].tolist()))
    finally:
        InfiniGenCache.prefetch = real
    return out.tokens[0].tolist(), top, seen


def same_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors; held bytes (int8 and int5 tiles, marked float8: some of them NaN as floats) byte for byte."""
    if a.element_size() == 1:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)
