"""int5 weight rows (a GGUF's Q5 blocks held as they are, or --weights int5: model/int5_rows.py) and the kernel that
reads them; a model held so: tests/test_int4.py."""

import pytest
import torch

from infinigen_kv.model import int5_rows, kernels
from test_int4 import q8_groups

K = kernels.library()


def test_rows_hold_5_bit_groups():
    """A row: int4's low nibbles (16 bytes a group), 4 bytes of fifth bits a group, then float16 scales and
    minimums; the values read back within a group's step (d / 2), levels 0..31 from their bits; packing what was
    read back gives the same bytes; widths other than whole groups, and rows other than whole tiles, are refused."""
    torch.manual_seed(0)
    x = torch.randn(16, 96) * torch.rand(16, 1)
    x[2, :32] = 0.25  # a constant group: d = 0, every value its minimum
    rows = int5_rows.pack_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (16, int5_rows.width(96)) == (16, 48 + 12 + 12)
    held = int5_rows.tiled(rows)
    assert held.dtype == int5_rows.DTYPE and torch.equal(int5_rows.rows_of(held), rows)
    back = int5_rows.reference_unpacked(held)
    d = rows[:, 60:66].contiguous().view(torch.float16).float()  # (16, 3)
    step = d.repeat_interleave(32, -1)
    assert ((back - x).abs() <= step / 2 + 1e-3 * x.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(back[2, :32], torch.full((32,), 0.25))
    q = torch.randint(0, 32, (16, 64), dtype=torch.uint8)
    ones = torch.ones(16, 2, dtype=torch.float16)
    levels = int5_rows.reference_unpacked(int5_rows.tiled(int5_rows.from_levels(q, ones, 0 * ones)))
    assert torch.equal(levels, q.float())  # every level 0..31 read back from its nibble and fifth bit
    assert torch.equal(int5_rows.pack_rows(back), rows)
    with pytest.raises(ValueError, match="multiple of 32"):
        int5_rows.width(40)
    with pytest.raises(ValueError, match="whole tiles"):
        int5_rows.tiled(rows[:10])


def test_a_tiles_group_is_its_rows_nibbles_then_fifth_bits():
    """The held form, group by group: int4's four 64-byte chunks (row o's level bytes 4c..4c+3 at 64c + 4o), the 16
    rows' fifth-bit dwords (row o's at 256 + 4o), the 16 scales, the 16 minimums: 384 bytes."""
    torch.manual_seed(2)
    rows = int5_rows.pack_rows(torch.randn(32, 64))
    tile = int5_rows.tiled(rows).view(torch.uint8)[16:32].reshape(-1)  # the second tile
    n = 64
    for g in range(2):
        group = tile[384 * g : 384 * (g + 1)]
        for o in (0, 5, 15):
            row = rows[16 + o]
            for c in range(4):
                assert torch.equal(group[64 * c + 4 * o : 64 * c + 4 * o + 4], row[16 * g + 4 * c : 16 * g + 4 * c + 4])
            assert torch.equal(group[256 + 4 * o : 260 + 4 * o], row[n // 2 + 4 * g : n // 2 + 4 * g + 4])
            assert torch.equal(group[320 + 2 * o : 322 + 2 * o], row[n // 2 + 8 + 2 * g : n // 2 + 10 + 2 * g])
            assert torch.equal(group[352 + 2 * o : 354 + 2 * o], row[n // 2 + 12 + 2 * g : n // 2 + 14 + 2 * g])


@pytest.mark.skipif(K is None, reason="no CPU kernels")
def test_the_kernel_unpacks_tiles_as_pytorch_does():
    torch.manual_seed(1)
    held = int5_rows.pack(torch.randn(48, 896) * 3)
    for dtype in (torch.float32, torch.bfloat16):
        got = int5_rows.unpacked(held, dtype)
        assert got.dtype == dtype and torch.equal(got, int5_rows.reference_unpacked(held, dtype))


@pytest.mark.skipif(K is None, reason="no CPU kernels")
@pytest.mark.parametrize("inputs,out", [(576, 48), (64, 16), (896, 1152), (4864, 32)])
def test_int5_linear_kernel(inputs, out):
    """`linear` over int5 tiles: the product of the values held with the activations as int8 groups (the kernel's
    own rounding), a row's result whatever rows share the call, with a bias and a residual; a weight of rows other
    than whole tiles refused."""
    torch.manual_seed(9)
    W = torch.randn(out, inputs) * torch.rand(out, 1)
    W[3, :32] = 0  # a zero group
    held = int5_rows.pack(W)
    x = torch.randn(21, inputs) * 3  # blocks of 8 rows (a prompt chunk's), 4 and 1
    x[1, 32:64] = 0
    bias, res = torch.randn(out), torch.randn(21, out)
    y = K.linear(x, held, None, None)
    dense = int5_rows.unpacked(held)
    ref = torch.nn.functional.linear(q8_groups(x), dense)
    assert (y - ref).abs().max() <= 1e-5 * (x.abs() @ dense.abs().t()).max()
    for a, b in ((0, 1), (0, 2), (0, 4), (0, 5), (0, 8), (0, 13), (5, 19)):
        assert torch.equal(K.linear(x[a:b].contiguous(), held, None, None), y[a:b])
    assert torch.equal(K.linear(x, held, bias, res), res + (y + bias))
    with pytest.raises(RuntimeError, match="whole tiles"):
        K.linear(x, held[:out - 8], None, None)
