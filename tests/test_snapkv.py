"""snapkv (methods/snapkv.py): exact at budget 1.0 on every architecture and a left-padded batch; at a binding budget
each (sequence, KV head) keeps the prompt's observation window and the entries its queries vote for most (softmax
over the prompt, summed over the window and the group's heads, average-pooled), never padding."""

import pytest
import torch

import infinigen_kv as ig
from conftest import KINDS, left_padded_batch
from test_exactness import step_logits


@pytest.mark.parametrize("kind", KINDS)
def test_snapkv_is_exact_at_full_budget(tiny_models, kind):
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    got = step_logits(model, ig.make_cache("snapkv", model, budget=1.0), ids, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_snapkv_keeps_the_window_and_its_votes(tiny_models):
    """One prompt of 120 tokens, budget 0.25 (30 entries), window 8, kernel 3: after the prefill each (KV head) of a
    layer keeps the window and the 22 entries of the highest pooled votes, recomputed here from the layer's queries
    and keys."""
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(2))
    cache = ig.make_cache("snapkv", model, budget=0.25, min_budget=0, window=8, kernel=3)
    captured = {}
    layer = cache.layers[2]
    real = type(layer).prefill_column_sums

    def spy(self, query, key, mask, scaling, backend=None):
        captured[self.layer_idx] = (query.clone(), key.clone(), scaling)
        return real(self, query, key, mask, scaling, backend)

    type(layer).prefill_column_sums = spy
    try:
        with torch.inference_mode():
            out = model(ids, past_key_values=cache)
            model(out.logits[:, -1:].argmax(-1), past_key_values=cache, position_ids=torch.tensor([[120]]))
    finally:
        type(layer).prefill_column_sums = real
    q, k, scaling = captured[2]
    G, r = k.shape[1], q.shape[1] // k.shape[1]
    s = (q[0, :, -8:] * scaling).view(G, r, 8, -1) @ k[0].float().transpose(-1, -2).unsqueeze(1)  # (G, r, 8, 120)
    future = torch.ones(8, 8, dtype=torch.bool).triu_(1)
    s[..., -8:] = s[..., -8:].masked_fill(future, float("-inf"))
    votes = torch.softmax(s, -1).sum((1, 2))  # (G, 120)
    votes = torch.nn.functional.avg_pool1d(votes[:, None], 3, 1, 1, count_include_pad=False)[:, 0]
    ours = real(layer, q, k, None, scaling)[0]  # (G, 120): the layer's own vote
    torch.testing.assert_close(ours, votes, atol=1e-5, rtol=1e-4)
    kept = layer.pos.valid()[0, :, : int(layer.kept[0]), 0]  # (G, kept) positions
    assert kept.shape[-1] == 31  # ceil(0.25 x 121): the decode token joined
    for g in range(G):
        prompt = set(int(p) for p in kept[g] if p < 120)
        assert set(range(112, 120)) <= prompt  # the window
        voted = ours[g, :112].topk(22).indices.tolist()
        assert prompt == set(range(112, 120)) | set(voted)
