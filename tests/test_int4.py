"""int4 weight rows (--weights int4: q4_1 groups of 32 in a row, model/int4_rows.py) and the kernel that reads them."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model import int4_rows, kernels
from infinigen_kv.model.load import load_model
from conftest import left_padded_batch, same_tensors, save_tiny, tiny_model
from test_exactness import step_logits

K = kernels.library()


def q8_groups(x: torch.Tensor) -> torch.Tensor:
    """x (R, in) as the kernel reads a decode step's activations: int8 values in groups of 32 by absmax / 127."""
    xg = x.view(x.shape[0], -1, 32)
    scale = xg.abs().amax(-1, keepdim=True) / 127
    return (torch.where(scale > 0, xg / scale, 0.0).round().clamp(-127, 127) * scale).view_as(x)


def test_rows_hold_q4_1_groups():
    """A row: 16 bytes of levels a group (q[j] low nibble, q[j + 16] high), then float16 scales, then minimums;
    the values read back within a group's step (d / 2), a group's minimum and maximum nearly exact; packing what was
    read back gives the same bytes; widths other than whole groups are refused by name."""
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.rand(5, 1)
    x[2, :32] = 0.25  # a constant group: d = 0, every value its minimum
    rows = int4_rows.pack_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, int4_rows.width(96)) == (5, 48 + 12)
    back = int4_rows.unpacked(rows)
    d = rows[:, 48:54].contiguous().view(torch.float16).float()  # (5, 3)
    m = rows[:, 54:].contiguous().view(torch.float16).float()
    step = d.repeat_interleave(32, -1)
    assert ((back - x).abs() <= step / 2 + 1e-3 * x.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(back[2, :32], torch.full((32,), 0.25))
    levels = torch.cat([rows[:, :48].view(5, 3, 16) & 15, rows[:, :48].view(5, 3, 16) >> 4], -1).float()
    assert torch.equal(back, (levels * d[..., None] + m[..., None]).view(5, 96))
    assert torch.equal(int4_rows.pack_rows(back), rows)
    assert int4_rows.dim(rows.shape[-1]) == 96
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_rows.width(40)


def test_held_rows_go_in_tiles_of_16():
    """The held form: the first 16 floor(R / 16) rows (over the leading dims) in tiles, group by group: four 64-byte
    chunks (chunk c, bytes 4o..4o+3: row o's level bytes 4c..4c+3), the 16 scales, the 16 minimums; the rest rows.
    rows_of undoes it; a merged weight's part is a view on whole tiles, a re-tiled copy otherwise."""
    torch.manual_seed(2)
    x = torch.randn(2, 19, 64)
    rows = int4_rows.pack_rows(x)
    held = int4_rows.pack(x)
    assert held.shape == rows.shape and torch.equal(int4_rows.rows_of(held), rows)
    flat, hflat = rows.view(38, 40), held.view(38, 40)
    assert torch.equal(hflat[32:], flat[32:])  # 38 rows: two tiles, then 6 rows
    tile = hflat[16:32].reshape(-1)  # the second tile: rows 16..31
    for g in range(2):
        group = tile[320 * g : 320 * (g + 1)]
        for o in (0, 5, 15):
            row = flat[16 + o]
            for c in range(4):
                assert torch.equal(group[64 * c + 4 * o : 64 * c + 4 * o + 4], row[16 * g + 4 * c : 16 * g + 4 * c + 4])
            assert torch.equal(group[256 + 2 * o : 258 + 2 * o], row[32 + 2 * g : 34 + 2 * g])
            assert torch.equal(group[288 + 2 * o : 290 + 2 * o], row[36 + 2 * g : 38 + 2 * g])
    w = int4_rows.pack(torch.randn(72, 64))  # a merged weight: parts of 32, 24 and 16 rows
    whole = int4_rows.part(w, 0, 32)
    assert whole.data_ptr() == w.data_ptr() and torch.equal(int4_rows.rows_of(whole), int4_rows.rows_of(w)[:32])
    for start, size in ((32, 24), (56, 16), (40, 32)):
        assert torch.equal(int4_rows.rows_of(int4_rows.part(w, start, size)), int4_rows.rows_of(w)[start : start + size])


def test_a_checkpoints_rows_fill_tiles_at_any_offset():
    """Loading writes a checkpoint's rows into a held weight at its part's offset, in slices: rows that start or end
    inside a tile rewrite that tile, the others' rows kept."""
    from infinigen_kv.model.weights import copy_rows

    torch.manual_seed(3)
    x = torch.randn(45, 64)
    dst = torch.zeros(45, int4_rows.width(64), dtype=torch.uint8)
    for start, stop in ((0, 5), (5, 21), (21, 40), (40, 45)):  # across tiles, inside one, into the last rows
        copy_rows(dst, start, x[start:stop])
    assert torch.equal(dst, int4_rows.pack(x))


@pytest.mark.skipif(K is None, reason="no CPU kernels")
def test_the_kernel_unpacks_rows_as_pytorch_does():
    """A prompt chunk's int4 weights unpacked by the kernel (float32 and bfloat16): PyTorch's bits, batched rows."""
    torch.manual_seed(1)
    rows = int4_rows.pack(torch.randn(3, 7, 896) * 3)
    for dtype in (torch.float32, torch.bfloat16):
        got = int4_rows.unpacked(rows, dtype)
        assert got.dtype == dtype and torch.equal(got, int4_rows.reference_unpacked(rows, dtype))


@pytest.mark.skipif(K is None, reason="no CPU kernels")
@pytest.mark.parametrize("inputs,out", [(576, 37), (64, 48), (896, 37), (96, 5)])
def test_int4_linear_kernel(inputs, out, monkeypatch):
    """`linear` over held int4 weights (tiles, then rows: 37 rows are two tiles and five rows, 48 three tiles, 5 no
    tile): the product of the values held with the activations as int8 groups (the kernel's own rounding), a row's
    result whatever rows share the call, with a bias and a residual."""
    torch.manual_seed(9)
    W = torch.randn(out, inputs) * torch.rand(out, 1)
    W[3, :32] = 0  # a zero group
    rows = int4_rows.pack(W)
    x = torch.randn(21, inputs) * 3  # blocks of 8 rows (a prompt chunk's), 4 and 1
    x[1, 32:64] = 0  # a zero group of activations
    bias, res = torch.randn(out), torch.randn(21, out)
    y = K.linear(x, rows, None, None)
    dense = int4_rows.unpacked(rows)
    ref = torch.nn.functional.linear(q8_groups(x), dense)
    assert (y - ref).abs().max() <= 1e-5 * (x.abs() @ dense.abs().t()).max()
    exact = torch.nn.functional.linear(x, dense)  # the activations' rounding: ~2^-8 of a group's largest value
    assert (y - exact).abs().max() <= 1e-2 * (x.abs() @ dense.abs().t()).max()
    for a, b in ((0, 1), (0, 2), (0, 4), (0, 5), (0, 8), (0, 13), (5, 19)):
        assert torch.equal(K.linear(x[a:b].contiguous(), rows, None, None), y[a:b])
    assert torch.equal(K.linear(x, rows, bias, res), res + (y + bias))


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["int4", "int5"])
def test_a_4_or_5_bit_model_decodes_what_its_values_compute(weights, float32_products):
    """--weights int4 / int5: the layers' linears as int4 / int5 rows, the embedding and LM head as int8 (as
    llama.cpp's Q4_K_M keeps its output layer at more bits); prefill and decode close to a float32 model of the
    values held (the decode activations rounded to int8 groups), every method exact at full budget against full."""
    from infinigen_kv.model.int5_rows import DTYPE as INT5
    from infinigen_kv.model.ops import dense

    held = tiny_model("qwen2", weights=weights)
    attn = held.layers[0].attn
    assert attn.wqkv.weight.dtype == held.layers[0].mlp.w2.weight.dtype == {"int4": torch.uint8, "int5": INT5}[weights]
    from infinigen_kv.model import int8_tiles

    assert held.embed.dtype in (torch.int8, int8_tiles.DTYPE) and held.lm_head.dtype == int8_tiles.DTYPE
    ref = tiny_model("qwen2")
    for p, q in zip(held.parameters(), ref.parameters()):
        q.copy_(dense(p, torch.float32))
    float32_products(held, ref)
    ids, mask = left_padded_batch(lengths=(30, 22))
    got = step_logits(held, ig.make_cache("full", held), ids, mask)
    want = step_logits(ref, ig.make_cache("full", ref), ids, mask)
    assert ((got - want).norm() / want.norm()) < 2e-2
    for method, options in (("infinigen", {"alpha": 1e9, "budget": 1.0}), ("offload", {})):
        assert torch.equal(step_logits(held, ig.make_cache(method, held, **options), ids, mask), got), method


@pytest.mark.skipif(K is None, reason="no CPU kernels")
@torch.inference_mode()
@pytest.mark.parametrize("weights", ["int4", "int5", "int8"])
def test_a_prompt_chunk_multiplies_tiles_in_integers(weights):
    """int_prefill: a prompt chunk's int4 / int5 tiles and int8 rows in the linear kernel's integer products (its
    activations in int8 groups, as a decode step's) rather than the GEMM on their values: logits close to the GEMM's
    and nearly every position's greedy token the same; each prompt's the same bits alone as beside another."""
    import dataclasses

    model = tiny_model("qwen2", weights=weights)
    ids = torch.randint(3, 256, (2, 70))
    model.backend = dataclasses.replace(model.backend, int_prefill=False)
    gemm = model(ids, use_cache=False).logits
    model.backend = dataclasses.replace(model.backend, int_prefill=True)
    ints = model(ids, use_cache=False).logits
    assert not torch.equal(ints, gemm)  # (the integer path ran)
    assert ((ints - gemm).norm() / gemm.norm()) < 2e-2
    assert (ints.argmax(-1) == gemm.argmax(-1)).float().mean() > 0.9
    assert torch.equal(model(ids[1:], use_cache=False).logits, ints[1:])


def test_int4_weights_load_and_map(tmp_path, monkeypatch):
    """load_model(weights="int4") from a checkpoint: the held file mapped at the next load, the same bits, and never a
    file held in another tile layout; on a device other than the CPU, or with a width not in whole groups, one clear
    error."""
    from infinigen_kv.model import mapped
    from infinigen_kv.model.load import ModelLoadError

    path = save_tiny(tmp_path / "m", kind="qwen2")
    model, _ = load_model(path, device="cpu", weights="int4")
    again, _ = load_model(path, device="cpu", weights="int4")
    assert again.mapped_from == model.mapped_from is not None
    files = sorted((tmp_path / "m").glob("*.safetensors"))
    key = mapped.key(files, model)
    monkeypatch.setattr(int4_rows, "TILE", 2 * int4_rows.TILE)
    assert mapped.key(files, model) != key
    monkeypatch.undo()
    assert all(same_tensors(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert model.layers[0].mlp.w1.weight.dtype == torch.uint8
    with pytest.raises(ModelLoadError, match="int4 weights run on CPU"):
        load_model(path, device="cpu", weights="int4", dtype="float32")


def test_a_q4_1_gguf_comes_back_as_it_was():
    """The default model's GGUF holds its layers in Q4_1: each tensor, dequantized (as the conversion writes it) and
    packed as int4 rows, is its GGUF blocks byte for byte (d, m, levels: moved into the row's order)."""
    gguf = pytest.importorskip("gguf")
    from infinigen_kv.model.load import default_gguf

    reader = gguf.GGUFReader(str(default_gguf()))
    q4_1 = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"][:6]
    assert q4_1
    for t in q4_1:
        x = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float()
        blocks = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(x.shape[0], -1, 20)  # (rows, groups, 20)
        want = torch.cat([blocks[..., 4:].flatten(1), blocks[..., :2].flatten(1), blocks[..., 2:4].flatten(1)], -1)
        assert torch.equal(int4_rows.pack_rows(x), want), t.name


def test_integer_prefill_is_a_fact_of_the_cpu(monkeypatch):
    """The backend multiplies a prompt chunk's quantized weights in integers where the CPU has 512-bit VNNI and no
    AMX (whose bfloat16 GEMM is oneDNN's best), never from a timing; INFINIGEN_INT_PREFILL=0 turns it off."""
    from infinigen_kv.model import backend

    for flags, want in (("avx2 avx512f avx512bw avx512_vnni avx512_bf16", True), ("avx2 avx512f avx512bw", False),
                        ("avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile", False), ("avx2 fma", False)):
        monkeypatch.setattr(kernels, "cpu_flags_line", lambda f=flags: f)
        assert backend.int_prefill_native() is want, flags
    monkeypatch.undo()
    b = backend.build("cpu")
    assert b.int_prefill == (b.kernels and backend.int_prefill_native())
    monkeypatch.setenv("INFINIGEN_INT_PREFILL", "0")
    assert not backend.build("cpu").int_prefill
