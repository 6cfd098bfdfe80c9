"""Selection: threshold, budget cap, per-(sequence, head) counts, padding, GQA combination."""

import pytest
import torch

from conftest import KINDS, row_zero_selections, tiny_model
import infinigen_kv as ig

from infinigen_kv.methods.infinigen.fetch import counted
from infinigen_kv.methods.infinigen.speculator import approx_scores, select


def rows(*vals):
    """Scores (B=len(vals), G=1, r=1, n) from plain lists."""
    return torch.tensor(vals, dtype=torch.float32)[:, None, None, :]


def chosen(idx, count):
    """Selected positions per (b, g) as sets: the first count of each row."""
    B, G, _ = idx.shape
    real = counted(count, idx.shape[-1])
    return [[set(idx[b, g][real[b, g]].tolist()) for g in range(G)] for b in range(B)]


def counts(idx, count):
    return count.tolist()


def test_threshold_keeps_tokens_within_alpha_of_max():
    s = rows([10.0, 9.5, 7.1, 6.9, 0.0, 9.0])
    idx, real = select(s, None, alpha=3.0, budget=1.0)
    assert chosen(idx, real) == [[{0, 1, 2, 5}]]  # 6.9 is just outside 10 - 3


def test_budget_caps_to_the_highest():
    s = rows([10.0, 9.9, 9.8, 9.7, 9.6, 9.5, 9.4, 9.3, 9.2, 9.1])
    idx, real = select(s, None, alpha=100.0, budget=0.3)
    assert counts(idx, real) == [[3]] and chosen(idx, real) == [[{0, 1, 2}]]
    idx, real = select(s, None, alpha=100.0, budget=1.0, max_num_kv=2)
    assert chosen(idx, real) == [[{0, 1}]]
    # the cap is ceil(budget x n), at least 1
    idx, real = select(s, None, alpha=100.0, budget=0.01)
    assert counts(idx, real) == [[1]]


def test_counts_are_per_sequence_and_head_and_padded():
    # B=2, G=2, r=1: four rows with different numbers of tokens within alpha
    s = torch.tensor([[[[5, 0, 0, 0, 0, 0]], [[5, 5, 5, 0, 0, 0]]],
                      [[[5, 5, 0, 0, 0, 0]], [[5, 5, 5, 5, 5, 0]]]], dtype=torch.float32)
    idx, real = select(s, None, alpha=1.0, budget=1.0)
    assert counts(idx, real) == [[1, 3], [2, 5]]
    assert idx.shape == (2, 2, 6)  # sized by the cap (known on the host), not by the counts (a sync)
    assert chosen(idx, real) == [[{0}, {0, 1, 2}], [{0, 1}, {0, 1, 2, 3, 4}]]
    # slots past a row's count hold real positions (finite pool rows, masked by the caller)
    assert ((idx >= 0) & (idx < 6)).all()


def test_padding_positions_never_selected():
    s = rows([100.0, 100.0, 1.0, 2.0, 3.0], [100.0, 5.0, 4.0, 3.0, 2.0])
    keep = torch.tensor([[False, False, True, True, True], [True] * 5])[:, None, :]
    idx, real = select(s, keep, alpha=1e9, budget=1.0)
    sel = chosen(idx, real)
    assert sel[0][0] == {2, 3, 4} and sel[1][0] == {0, 1, 2, 3, 4}
    # the budget counts valid tokens only: ceil(0.5 x 3) = 2 for the padded row
    idx, real = select(s, keep, alpha=1e9, budget=0.5)
    assert [c[0] for c in counts(idx, real)] == [2, 3]
    assert chosen(idx, real)[0][0] == {3, 4}


def test_gqa_heads_combined_relative_to_each_head_max():
    # one KV head shared by r=2 query heads: head 0 likes token 0, head 1 (lower scale) likes token 3
    s = torch.tensor([[[[10.0, 0.0, 0.0, 0.0], [1.0, 0.5, 0.0, 2.0]]]])
    idx, real = select(s, None, alpha=0.6, budget=1.0, combine="max")
    assert chosen(idx, real) == [[{0, 3}]]  # each head's favourite is kept despite the scale gap
    idx, real = select(s, None, alpha=0.6, budget=1.0, combine="mean")
    assert counts(idx, real)[0][0] >= 1


def test_approx_scores_shapes_and_scale():
    q = torch.randn(2, 3, 4, 5)
    k = torch.randn(2, 3, 7, 5)
    s = approx_scores(q, k, scale=0.5)
    assert s.shape == (2, 3, 4, 7)
    torch.testing.assert_close(s, torch.einsum("bgrp,bgnp->bgrn", q, k) * 0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_selection_does_not_depend_on_its_batch(kind):
    """A row's tokens and its chosen entries at every layer and step are the same alone and
    in a batch, padded or not (the prefill's BLAS path, SDPA's blocking over the padded length and the
    linear kernel's row blocks each made a row's last bits depend on its batch-mates)."""
    model = tiny_model(kind, weights="bfloat16")  # as load_model holds it on CPU: the decode's linear kernel
    g = torch.Generator().manual_seed(3)
    for n in (7, 40):  # a prompt short enough for the BLAS's small-matrix path, and a longer one (and than
        # gemma3's window: left-padded past it, a local layer's last query no longer sees the padding's edge)
        row = torch.randint(3, 256, (1, n), generator=g)
        alone = row_zero_selections(model, row, torch.ones_like(row))
        for other in (n + 25, max(n - 4, 1)):  # row 0 left-padded, then row 0 the longest
            width = max(n, other)
            ids = torch.zeros(2, width, dtype=torch.long)
            mask = torch.zeros(2, width, dtype=torch.long)
            ids[0, width - n:], mask[0, width - n:] = row[0], 1
            ids[1, width - other:] = torch.randint(3, 256, (other,), generator=g)
            mask[1, width - other:] = 1
            assert row_zero_selections(model, ids, mask) == alone, (kind, n, other)


def test_budget_caps_fractions_and_token_counts():
    from infinigen_kv.config import ConfigError, InfiniGenConfig
    from infinigen_kv.methods.budget import budget_caps

    assert [budget_caps(n, 0.1) for n in (1, 10, 11, 4000)] == [1, 1, 2, 400]
    assert [budget_caps(n, 256) for n in (1, 100, 256, 4000)] == [1, 100, 256, 256]
    assert budget_caps(torch.tensor([1, 11, 4000]), 0.1).tolist() == [1, 2, 400]
    assert budget_caps(torch.tensor([0, 100, 4000]), 256).tolist() == [1, 100, 256]
    assert budget_caps(30, 1) == 30 and budget_caps(30, 1.0) == 30  # 1 is the whole past, not one token
    for bad in (0, -3, 1.5, float("inf"), "x", "0.5", True):
        with pytest.raises(ConfigError):
            InfiniGenConfig(budget=bad)
    # the floor of a fraction: at least min(floor, past); a token count is not floored
    assert [budget_caps(n, 0.1, 1024) for n in (5, 1000, 4000, 20000)] == [5, 1000, 1024, 2000]
    assert budget_caps(torch.tensor([0, 5, 4000, 20000]), 0.1, 1024).tolist() == [1, 5, 1024, 2000]
    assert budget_caps(4000, 256, 1024) == 256
    assert InfiniGenConfig().min_budget == 1024 and InfiniGenConfig(min_budget=0).min_budget == 0
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ConfigError, match="min_budget"):
            InfiniGenConfig(min_budget=bad)


def test_a_cap_that_saves_no_bytes_attends_densely(tiny_models):
    """Past the floor's reach the step speculates; under it (the cap covers the past, or the fetched rows and
    the partial keys would read as much as the whole past) the layer attends all of its past, with no
    selection: the full cache's tokens and fetched fraction 1.0."""
    import infinigen_kv as ig
    from infinigen_kv.methods.infinigen.speculator import saves_bytes

    assert not saves_bytes(1000, 1000, 512, 64) and not saves_bytes(1100, 1024, 512, 64)
    assert saves_bytes(4000, 1024, 512, 64) and not saves_bytes(100, 1, 512, 512)
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(0))
    ref = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=12, stop_at_eos=False)
    dense = ig.make_cache("infinigen", model)  # the default floor (1024) covers this 72-token past
    calls = []
    speculate = dense.selection.speculate
    dense.selection.speculate = lambda *a, **k: calls.append(a[1]) or speculate(*a, **k)
    got = ig.generate(model, ids, cache=dense, max_new_tokens=12, stop_at_eos=False)
    assert torch.equal(got.tokens, ref.tokens) and dense.stats["fetched_fraction"] == 1.0
    assert calls == []  # a step whose past is under every layer's cap is known dense at layer 0: no layer speculates
    spec = ig.make_cache("infinigen", model, min_budget=16, min_saving=0.0)  # a floor under the past: it selects
    speculate = spec.selection.speculate
    spec.selection.speculate = lambda *a, **k: calls.append(a[1]) or speculate(*a, **k)
    ig.generate(model, ids, cache=spec, max_new_tokens=12, stop_at_eos=False)
    assert 16 / 72 <= spec.stats["fetched_fraction"] < 0.6 and len(calls) > 0


def test_the_saving_counts_a_fixed_cost_a_layer_and_a_row(tiny_models, monkeypatch):
    """layer_saving: the K/V bytes left unread, less the partial keys, the chosen rows twice, the partial query's
    weights (none when speculating at the layer's own query), LAYER_COST once and ROW_COST for each (sequence, KV
    head) row; and the query heads' arithmetic (head_cost each) over the rows left out, less the partial scores'."""
    import infinigen_kv as ig
    from infinigen_kv.methods.infinigen import speculator

    monkeypatch.setattr(speculator, "head_cost", lambda cache: 0.0)  # the bytes alone first
    cache = ig.make_cache("infinigen", tiny_models["llama-gqa"], min_budget=0, budget=0.1, speculate_from="previous")
    n, row, prow, rows = 1000, 256, 32, 6
    cap = speculator.fetch_cap(n, cache.budget_of(1), cache.config.max_num_kv, 0)
    kv = rows * (n * row - n * prow - speculator.SCATTERED * cap * row) - cache.pq.weight_bytes(1)
    got = speculator.layer_saving(cache, 1, rows, n, row, prow)
    assert got == kv - speculator.LAYER_COST - rows * speculator.ROW_COST
    monkeypatch.setattr(speculator, "ROW_COST", 0.0)
    assert speculator.layer_saving(cache, 1, rows, n, row, prow) == kv - speculator.LAYER_COST
    own = ig.make_cache("infinigen", tiny_models["llama-gqa"], min_budget=0, budget=0.1, speculate_from="own")
    assert speculator.layer_saving(own, 1, rows, n, row, prow) == kv + cache.pq.weight_bytes(1) - speculator.LAYER_COST
    monkeypatch.setattr(speculator, "head_cost", lambda cache: 50.0)
    r, ratio = cache.arch.group, cache.config.partial_ratio
    arithmetic = rows * r * 50.0 * (n * (1 - ratio / 2) - cap)
    assert speculator.layer_saving(cache, 1, rows, n, row, prow) == pytest.approx(kv - speculator.LAYER_COST
                                                                                    + arithmetic)


def test_the_head_cost_is_the_kernel_paths_constant():
    """head_cost: the backend's head_ns (its kernel path's constant, model/backend.py) scaled to the head size, as
    bytes at BYTES_PER_NS; 0 without the kernels. No timing enters it: a measurement written beside the kernels'
    build (45.56 ns, as a busy machine once kept) changes neither the backend nor the cost, and building the backend
    writes nothing there."""
    from types import SimpleNamespace

    from infinigen_kv.model import backend, kernels
    from infinigen_kv.methods.infinigen import speculator

    if kernels.library() is None:
        pytest.skip("no CPU kernels here")
    b = backend.build("cpu")
    assert b.head_ns == backend.PATHS[b.path].head_ns > 0
    cache = SimpleNamespace(arch=SimpleNamespace(head_dim=128), backend=b)
    assert speculator.head_cost(cache) == pytest.approx(b.head_ns * speculator.BYTES_PER_NS * 2)
    assert speculator.head_cost(SimpleNamespace(arch=cache.arch, backend=backend.reference())) == 0.0
    build_dir = kernels._build_root() / f"infinigen_cpu_{kernels._cpu_key()}"
    before = sorted(p.name for p in build_dir.iterdir())
    planted = build_dir / "attend_head_ns_t2"
    kept = planted.read_text() if planted.exists() else None
    try:
        planted.write_text("45.5600\n")
        assert backend.build("cpu") == b
    finally:
        planted.unlink() if kept is None else planted.write_text(kept)
    assert sorted(p.name for p in build_dir.iterdir()) == before


def test_a_step_whose_saving_is_a_small_share_of_its_bytes_attends_densely(tiny_models, monkeypatch):
    """Where the bytes a step would save are under min_saving of its bytes (weights + K/V: a short context on a model
    whose weights are most of the step) it attends densely, the full cache's tokens; min_saving 0 speculates there,
    as does min_budget 0 (no floor: a budget sweep, each budget as named). A speculating layer's fixed cost counts
    too: a tiny model's layers save a few kB at 70 tokens, under it."""
    import infinigen_kv as ig
    from infinigen_kv.config import ConfigError, InfiniGenConfig
    from infinigen_kv.methods.infinigen import speculator
    from infinigen_kv.methods.infinigen.partial import PartialQuery
    from infinigen_kv.methods.infinigen.speculator import speculation_pays

    assert speculation_pays(10, 100, 0.08) and not speculation_pays(7, 100, 0.08) and speculation_pays(0, 1, 0.0)
    for bad in (-0.1, 1.0, True):
        with pytest.raises(ConfigError, match="min_saving"):
            InfiniGenConfig(min_saving=bad)
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(0))
    ref = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=8, stop_at_eos=False)
    fractions = {}
    cache = ig.make_cache("infinigen", model, min_budget=16, min_saving=0.01)
    ig.generate(model, ids, cache=cache, max_new_tokens=8, stop_at_eos=False)
    assert cache.stats["fetched_fraction"] == 1.0  # the fixed cost of its layers: dense
    monkeypatch.setattr(speculator, "LAYER_COST", 0.0)  # the share of the K/V bytes alone: no fixed costs, no
    monkeypatch.setattr(speculator, "ROW_COST", 0.0)
    monkeypatch.setattr(PartialQuery, "weight_bytes", lambda self, layer: 0)  # partial query's weights
    for name, opts, weights in (("small weights", {}, None), ("large weights", {}, 10**12),
                                ("large weights, min_saving 0", {"min_saving": 0.0}, 10**12),
                                ("large weights, no floor", {"min_budget": 0}, 10**12)):
        cache = ig.make_cache("infinigen", model, **{"min_budget": 16, "min_saving": 0.01, **opts})
        assert 0 < cache.weight_bytes < 10**7
        if weights:
            cache.weight_bytes = weights  # as a model of 1 TB would read each step
        got = ig.generate(model, ids, cache=cache, max_new_tokens=8, stop_at_eos=False)
        fractions[name] = cache.stats["fetched_fraction"]
        if fractions[name] == 1.0:
            assert torch.equal(got.tokens, ref.tokens)
    assert fractions["large weights"] == 1.0
    assert all(f < 0.6 for name, f in fractions.items() if name != "large weights"), fractions


def test_infinigen_token_budget_caps_each_head_and_large_is_exact():
    """budget=5: at most 5 entries per (sequence, KV head, layer) and step, 5 exactly where alpha keeps more;
    a token budget beyond the context fetches everything and equals the full cache."""
    import infinigen_kv as ig
    from conftest import left_padded_batch
    from test_exactness import step_logits

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(lengths=(48, 40))
    _, _, chosen = row_zero_selections(model, ids, mask, new_tokens=6, budget=5, alpha=50.0)
    assert chosen and all(len(head) == 5 for step in chosen for head in step)

    with torch.inference_mode():
        full = step_logits(model, ig.make_cache("full", model), ids, mask)
        big = step_logits(model, ig.make_cache("infinigen", model, budget=10**6), ids, mask)
    torch.testing.assert_close(big, full)


def test_unpadded_decode_builds_no_keep():
    """With nothing padded transformers drops the decode mask, and speculation keeps its cheapest path: no
    keep tensor, one integer cap, fetch counts added on the host (not a keep read every step from the model's
    2-D mask, all ones)."""
    import infinigen_kv as ig

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(0))
    cache = ig.make_cache("infinigen", model)
    ig.generate(model, ids, torch.ones_like(ids), cache=cache, max_new_tokens=4, stop_at_eos=False)
    assert all(t is None for t in cache.counters.possible_t) and cache.counters.possible[2] > 0


def test_layer_scales_follow_the_misses_and_keep_the_mean():
    from infinigen_kv.methods.infinigen.speculator import layer_budgets, layer_scales

    recall = [None, 0.95, 0.80, 0.99, 0.90, None]  # dense layers (None) take no share
    s = layer_scales(recall)
    spec = [v for v in s if v is not None]
    assert s[0] is None and s[5] is None
    assert abs(sum(spec) / len(spec) - 1) < 1e-6 and all(0.5 - 1e-9 <= v <= 3 + 1e-9 for v in spec)
    assert s[2] == max(spec) and s[3] == min(spec) and s[4] > s[1]  # more misses, more budget
    assert layer_scales([None, 0.9, 0.9, 0.9]) == [None, 1.0, 1.0, 1.0]

    b = layer_budgets(0.1, s)
    assert b[0] == b[5] == 0.1 and abs(sum(b[1:5]) / 4 - 0.1) < 1e-6
    assert layer_budgets(1.0, s) == [1.0] * 6  # everything fetched: exact, as uniform
    capped = layer_budgets(0.6, s)  # a layer capped at 1.0 passes its excess to the others
    assert max(capped) == 1.0 and abs(sum(capped[1:5]) / 4 - 0.6) < 1e-6
    tokens = layer_budgets(256, s)  # token counts stay counts (> 1)
    assert all(v > 1 and v == int(v) for v in tokens) and tokens[2] > 256 > tokens[3]
    assert layer_budgets(0.1, None) is None


def test_layer_budget_recall_shares_the_fetch_by_layer():
    """layer_budget "recall": each speculated layer fetches its own share (from the calibration's recall),
    the total about the uniform budget's; at budget 1.0 it is still exact."""
    import infinigen_kv as ig
    from test_exactness import step_logits

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    cache = ig.make_cache("infinigen", model, budget=0.2, min_budget=0, alpha=50.0, layer_budget="recall")
    recall = cache.calibration.meta["recall"]
    assert recall[0] is None and all(0 < r <= 1 for r in recall[1:])
    budgets = cache._budgets
    assert len(set(round(b, 6) for b in budgets[1:])) > 1  # not uniform
    ig.generate(model, ids, cache=cache, max_new_tokens=6, stop_at_eos=False)
    share = cache.stats["fetched_fraction_per_layer"][1:]
    for got, want in zip(share, budgets[1:]):  # the cap binds at alpha 50: ceil(budget x past) per row
        assert want - 1e-6 <= got <= want + 0.01
    assert abs(sum(share) / len(share) - 0.2) < 0.01
    from infinigen_kv.methods.infinigen.speculator import layer_budgets

    twin = cache.fork(budget=0.4)  # a fork at another budget shares it out again, from the same recall
    assert twin._budgets == layer_budgets(0.4, cache.budget_scale) != budgets

    with torch.inference_mode():
        full = step_logits(model, ig.make_cache("full", model), ids, torch.ones_like(ids))
        every = step_logits(model, ig.make_cache("infinigen", model, budget=1.0, layer_budget="recall"), ids,
                            torch.ones_like(ids))
    torch.testing.assert_close(every, full)


def test_speculate_from_own_scores_each_layer_at_its_own_query():
    """speculate_from "own": each speculated layer chooses its rows at its own decode query (its skewed partial
    channels: no partial query projection), none at an earlier layer's input; "previous" (the paper's) chooses each
    one a layer ahead. At budget 1.0 both are exact."""
    import infinigen_kv as ig
    from infinigen_kv.methods.infinigen.partial import PartialQuery
    from test_exactness import step_logits

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 256, (2, 120), generator=torch.Generator().manual_seed(2))
    L = len(model.layers)
    for source in ("previous", "own"):
        cache = ig.make_cache("infinigen", model, budget=0.2, min_budget=0, speculate_from=source)
        at_input, at_query, projected = [], [], []
        before, after, partial = cache.before_attention, cache.after_query, cache.partial_query

        def spy_before(i, x, step):  # the layers chosen at layer i's input
            started = before(i, x, step)
            at_input.extend(n for n, _ in started)
            return started

        def spy_after(i, q, step):  # layer i chosen at its own query
            fetch = after(i, q, step)
            if fetch is not None:
                at_query.append(i)
            return fetch

        cache.before_attention, cache.after_query = spy_before, spy_after
        cache.partial_query = lambda layer, *a: (projected.append(layer), partial(layer, *a))[1]
        ig.generate(model, ids, cache=cache, max_new_tokens=3, stop_at_eos=False)
        steps = 2  # decode steps after the prefill's token
        if source == "own":
            assert at_input == [] and projected == [] and at_query == list(range(1, L)) * steps
        else:
            assert at_query == [] and sorted(at_input) == sorted(projected) == sorted(list(range(1, L)) * steps)
    with torch.inference_mode():
        full = step_logits(model, ig.make_cache("full", model), ids, torch.ones_like(ids))
        own = step_logits(model, ig.make_cache("infinigen", model, budget=1.0, speculate_from="own"), ids,
                          torch.ones_like(ids))
    torch.testing.assert_close(own, full)
    with pytest.raises(ig.ConfigError, match="speculate_from must be one of auto, previous, own"):
        ig.InfiniGenConfig(speculate_from="next")


def test_speculate_from_auto_is_own_on_cpu_and_previous_on_a_gpu():
    """The default, "auto": a layer's own query on CPU (no fetch to overlap there), the previous layer's input on a
    GPU (the fetch overlaps that layer's compute); an explicit choice is kept on either."""
    import infinigen_kv as ig
    from infinigen_kv.config import speculation_source

    assert ig.InfiniGenConfig().speculate_from == "auto"
    assert (speculation_source("auto", "cpu"), speculation_source("auto", "cuda")) == ("own", "previous")
    assert (speculation_source("previous", "cpu"), speculation_source("own", "cuda")) == ("previous", "own")
    model = tiny_model("llama-gqa")
    assert ig.make_cache("infinigen", model).speculate_from == "own"
    assert ig.make_cache("infinigen", model, speculate_from="previous").speculate_from == "previous"


def test_recall_diagnostic_per_head():
    """The recall diagnostic per layer and query head: the attention mass on the fetched rows (its mean over heads
    is the layer's figure) and the share of each head's true top-k fetched; None for a dense layer; a bigger
    budget recalls more."""
    import infinigen_kv as ig

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    H = model.args.n_heads
    means = []
    for budget in (0.6, 0.1):
        cache = ig.make_cache("infinigen", model, budget=budget, min_budget=0, alpha=50.0)
        cache.track_recall = True
        ig.generate(model, ids, cache=cache, max_new_tokens=4, stop_at_eos=False)
        s = cache.stats
        mass, topk = s["recall_per_head"], s["topk_recall_per_head"]
        assert mass[0] is None and topk[0] is None  # layer 0 attends densely
        for i in range(1, len(mass)):
            assert len(mass[i]) == len(topk[i]) == H
            assert abs(sum(mass[i]) / H - s["recall_per_layer"][i]) < 1e-5
            assert all(0 <= v <= 1 for v in topk[i]) and all(0 < v <= 1 + 1e-5 for v in mass[i])
        means.append([sum(t) / H for t in topk[1:]] + [sum(m) / H for m in mass[1:]])
    assert all(a > b for a, b in zip(*means))


def test_a_no_rope_models_partial_query_folds_its_own_weights():
    """Without RoPE (OPT) the partial query's weights are the calibration's partial channels folded into this model's
    own q_proj: a float32 model given the calibration of its bfloat16 copy (the same fingerprint) does not take that
    copy's stored fold, which rounded q_proj to bfloat16."""
    from infinigen_kv.methods.infinigen.calibration import partial_query_weights
    from infinigen_kv.methods.infinigen.partial import PartialQuery

    from infinigen_kv.methods.infinigen.calibration import Calibration
    from infinigen_kv.model.arch import get_arch

    bf16 = tiny_model("opt", weights="bfloat16")
    made = ig.make_cache("infinigen", bf16).calibration
    cal = Calibration(made.skew, made.channels, made.meta,  # as calibrated on the bfloat16 copy
                      *partial_query_weights(get_arch(bf16), made.skew, made.channels))
    arch = get_arch(tiny_model("opt"))
    want, _ = partial_query_weights(arch, cal.skew, cal.channels)
    assert not torch.equal(cal.pq_weight, want)
    got = PartialQuery(arch, cal, torch.float32).weight
    assert all(torch.equal(g, w) for g, w in zip(got, want))
