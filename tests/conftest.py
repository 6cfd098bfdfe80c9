import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run in its interpreter here: read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    threads.set_threads(None)  # a test's --threads N does not outlive it
    threads.TUNER.enabled = True


def tiny_model(kind: str, seed: int = 0):
    """Tiny random models of each supported architecture (built in-process, no download)."""
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


@pytest.fixture(scope="session")
def tiny_models():
    return {k: tiny_model(k) for k in KINDS}


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
    model = tiny_model(kind)
    model.config.vocab_size = 256
    if eos_never_greedy:  # EOS logit 0 while the largest of the others is always > 0: long greedy outputs
        with torch.no_grad():
            model.lm_head.weight[model.config.eos_token_id] = 0.0
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
        import contextlib

        return contextlib.nullcontext()


def on_fake_cuda(cache, uva: bool = True):
    """Make `cache` (not yet run) move its rows with CudaTransfer on CPU stand-ins: returns the transfer. uva: the
    side stream gathers from the pool's device view (the default on a GPU that allows it), else the worker."""
    from infinigen_kv.methods.infinigen.cuda_transfer import CudaTransfer

    transfer = CudaTransfer("cpu", cuda=FakeCuda(), pin=False, uva=uva)
    cache.transfers.by_device = {torch.device("cpu"): transfer}
    cache.transfer = transfer
    return transfer
