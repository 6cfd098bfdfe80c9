"""Loading a local checkpoint on CPU: tensor by tensor into the model, its weights held once in bfloat16 or as int8
rows."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from infinigen_kv.model import int8_rows, int8_tiles, mapped
from infinigen_kv.model.weights import from_hf
from infinigen_kv.model.load import ModelLoadError, load_model, model_dtype
from infinigen_kv.runtime.prefix import model_fingerprint
from conftest import same_tensors, save_tiny


@pytest.mark.parametrize("kind,weights", [("qwen2", None), ("gemma3", None), ("llama-gqa", None), ("gemma3", "int8"),
                                          ("qwen2", "int8"), ("opt", None)])
def test_a_checkpoint_loads_tensor_by_tensor(tmp_path, kind, weights):
    """The streamed load gives what transformers' from_pretrained holds (then rounded as bf16-weights rounds, or
    quantized to int8 rows as --weights int8 does): the same parameters, a tied LM head still tied, float32 norms
    and biases, and the same logits."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / kind, kind=kind)
    model, _ = load_model(path, device="cpu", weights=weights)
    ref = from_hf(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), model.weights)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert same_tensors(got[k], want[k]), k
    assert (model.lm_head is model.embed) == model.config.tie_embeddings
    assert model.norm.weight.dtype == torch.float32
    ids = torch.randint(3, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)
    if weights == "int8":
        assert model_dtype(model) == "int8-weights" and model.layers[0].mlp.w2.weight.dtype == int8_tiles.DTYPE


def test_int8_rows_of_q8_0_values_are_those_values():
    """A GGUF's Q8_0 tensors (converted to their float values) load as they were: quantizing the values of int8 rows
    again gives the same rows (the scales are float16, the values were divided by them)."""
    rows = int8_rows.pack_kv(torch.randn(64, 96) * torch.logspace(-3, 2, 64).unsqueeze(1))
    assert torch.equal(int8_rows.pack_kv(int8_rows.unpacked_kv(rows, torch.float32)), rows)


def test_int8_weights_need_the_cpu():
    with pytest.raises(ModelLoadError, match="int8 weights run on CPU"):
        load_model(None, device="cpu", dtype="float32", weights="int8")


def test_a_checkpoint_of_other_names_is_refused_and_a_sharded_one_loads(tmp_path):
    """A checkpoint whose tensor names are not a supported layout's names a missing weight; a sharded one loads
    shard by shard."""
    path = save_tiny(tmp_path / "m")
    sd = load_file(f"{path}/model.safetensors")
    want, _ = load_model(path, device="cpu", dtype="float32")
    save_file({("x." + k): v for k, v in sd.items()}, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="has no tensor for"):
        load_model(path, device="cpu")
    names = sorted(sd)
    (tmp_path / "m" / "model.safetensors").unlink()
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for f, keys in halves.items():
        save_file({k: sd[k] for k in keys}, f"{path}/{f}", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_model(path, device="cpu", dtype="float32")
    assert torch.equal(model.norm.weight, sd["model.norm.weight"])
    assert all(same_tensors(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values()))


def _mapping_of(t: torch.Tensor) -> str | None:
    """The file whose mapping holds tensor t's first byte (/proc/self/maps), None for anonymous memory."""
    addr = t.data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_held_weights_are_read_from_a_file_mapping(tmp_path, weights, monkeypatch):
    """A model held in bfloat16 or int8 rows lies in a file mapping of its held, merged parameters (written once to the
    user cache at the first load, reused while the checkpoint is unchanged) with the values and logits an in-memory
    load gives; a changed checkpoint is another file; a cache that cannot be written keeps the weights in memory."""
    path = save_tiny(tmp_path / "m", kind="qwen2")
    model, _ = load_model(path, device="cpu", weights=weights)
    file = model.mapped_from and mapped.path_of(model.mapped_from)
    assert file and all(_mapping_of(p) == str(file) for p in model.parameters())
    held = {"bfloat16": torch.bfloat16, "int8": int8_tiles.DTYPE}[weights]  # (the tiny model's rows: whole groups)
    assert model.layers[0].attn.wqkv.weight.dtype == held
    assert model.embed.dtype == (torch.int8 if weights == "int8" and not model.args.tie_embeddings else held)
    written = file.stat().st_mtime_ns
    again, _ = load_model(path, device="cpu", weights=weights)  # the file reused, not rewritten
    assert _mapping_of(again.lm_head) == str(file) and file.stat().st_mtime_ns == written
    monkeypatch.setattr(mapped, "load", lambda *a: False)  # in memory: the same bits, the same logits
    ref, _ = load_model(path, device="cpu", weights=weights)
    assert ref.mapped_from is None and _mapping_of(ref.embed) is None
    assert all(same_tensors(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    ids = torch.randint(3, 256, (2, 12))
    assert torch.equal(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)
    monkeypatch.undo()
    os.utime(f"{path}/model.safetensors")  # the checkpoint changed in place: another file
    changed, _ = load_model(path, device="cpu", weights=weights)
    assert changed.mapped_from not in (None, model.mapped_from)
    # the prefix store's namespace follows the mapped file (not a sample of every page of it)
    assert model_fingerprint(again) == model_fingerprint(model) != model_fingerprint(changed)
    tied, _ = load_model(save_tiny(tmp_path / "g", kind="gemma3"), device="cpu", weights=weights)
    assert _mapping_of(tied.embed) == str(mapped.path_of(tied.mapped_from)) and tied.lm_head is tied.embed
    f32, _ = load_model(path, device="cpu", dtype="float32")  # float32 weights: read as the checkpoint has them
    assert f32.mapped_from is None
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "not-a-dir"))  # the cache cannot be written
    kept, _ = load_model(path, device="cpu", weights=weights)
    assert kept.mapped_from is None and _mapping_of(kept.embed) is None
    assert torch.equal(kept.embed, ref.embed)


def test_a_held_file_that_does_not_match_is_not_mapped(tmp_path):
    """A held file cut short, or written for other shapes, is read again from the checkpoint (and written anew)."""
    path = save_tiny(tmp_path / "m", kind="llama-gqa")
    model, _ = load_model(path, device="cpu", weights="bfloat16")
    file = mapped.path_of(model.mapped_from)
    data = file.read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    os.replace(tmp_path / "cut", file)  # (a new file: the model above still maps the old one)
    cut, _ = load_model(path, device="cpu", weights="bfloat16")
    assert cut.mapped_from == model.mapped_from and file.stat().st_size == len(data)
    assert all(same_tensors(a, b) for a, b in zip(model.state_dict().values(), cut.state_dict().values()))


def test_the_tokenizer_reads_as_transformers_does(tmp_path):
    """tokenizer.json through the tokenizers library and the chat template through jinja2: the ids, text, padded
    batches and chat prompts transformers' AutoTokenizer gives for the same files (left padding: ours)."""
    from transformers import AutoTokenizer

    from infinigen_kv.model.tokenizer import Tokenizer, TokenizerError

    path = save_tiny(tmp_path / "m")
    ours, ref = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    ref.padding_side = "left"
    for text in ("The quick brown fox", "  two spaces\nand a line", "pass key 12345"):
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == ref(text, add_special_tokens=special)[
                "input_ids"]
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids) and ours.decode(ids, True) == ref.decode(ids, skip_special_tokens=True)
    a, b = ours(["a b c d", "fox"], return_tensors="pt", padding=True), ref(["a b c d", "fox"], return_tensors="pt",
                                                                         padding=True)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    chat = [{"role": "user", "content": "Say hi"}]
    for gen in (True, False):
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == list(
        ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.pad_token_id,
                                                                         ref.bos_token_id)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
