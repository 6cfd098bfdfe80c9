"""Static decode steps (model/static.py), what one CUDA graph a step replays, checked on CPU through the PyTorch path
a GPU runs: the same tokens as the eager step, the same ops on the same buffers at every step (a TorchDispatchMode
record of each op: name, shapes, arguments, the data pointers of tensors not made inside the step), no host read."""

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch, on_fake_cuda
from infinigen_kv.model import backend
from infinigen_kv.model.static import StaticDecoder, StaticError
from infinigen_kv.runtime.generation import prefill
from infinigen_kv.testing.steptrace import StepTrace, first_difference, held

NEW = 6


def static_run(model, method, ids, mask, trace=False, fake_cuda=False, **options):
    """Greedy tokens (B, NEW) through a StaticDecoder after a prefill, and each step's trace (the step itself).
    fake_cuda: the CUDA transfer on CPU stand-ins (infinigen_kv.testing.on_fake_cuda)."""
    cache = ig.make_cache(method, model, **options)
    if fake_cuda:
        on_fake_cuda(cache)
    tok = prefill(model, ids, mask, cache, NEW).argmax(-1)
    dec = StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True))
    tokens, traces = [tok], []
    for _ in range(NEW - 1):  # as generate: the last token is sampled, not decoded
        if not trace:
            tok = dec.step(tok).argmax(-1)
            tokens.append(tok)
            continue
        dec.refill(tok)  # the step's inputs, outside what is traced (outside a graph)
        t, before = StepTrace(), cache.before_attention
        cache.before_attention = lambda *a: (t.mark(), before(*a))[1]  # a mark where each layer begins
        with t:
            logits = dec.forward()
        del cache.before_attention
        dec.advance()
        traces.append(t)
        tok = logits.argmax(-1)
        tokens.append(tok)
    return torch.stack(tokens, 1), traces, cache


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "qwen3", "opt"])
def test_static_steps_give_the_eager_tokens(tiny_models, kind, monkeypatch):
    model = tiny_models[kind]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    eager = ig.generate(model, ids, mask, cache=ig.make_cache("full", model), max_new_tokens=NEW, stop_at_eos=False)
    tokens, traces, cache = static_run(model, "full", ids, mask, trace=True)
    assert torch.equal(tokens, eager.tokens)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # the host lengths followed the device writes
    for a, b in zip(traces[1:], traces[2:]):
        assert first_difference(a, b) is None
        assert a.host_reads == []


@pytest.mark.parametrize("kind,fake_cuda,source", [("llama-gqa", False, "previous"), ("qwen3", False, "previous"),
                                                   ("opt", False, "previous"), ("llama-gqa", True, "previous"),
                                                   ("qwen3", True, "previous"), ("llama-gqa", True, "own")])
@pytest.mark.parametrize("budget", [0.1, 1.0])
def test_static_infinigen_steps_choose_as_the_eager_ones(tiny_models, kind, fake_cuda, source, budget, monkeypatch):
    """InfiniGen in static steps (a fixed number of slots over the pool's capacity, which of them real in a mask the
    speculation writes; the new rows stored at the device column), on the direct transfer and on the CUDA one
    (gathered on its side stream into each layer's own working set), speculating from the previous layer's input or
    each layer's own: the eager steps' tokens and fetched shares, the same ops every step, and on the CUDA path at
    most 12 ops a speculated layer over full's."""
    model = tiny_models[kind]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    opts = dict(budget=budget, min_budget=0, speculate_from=source)
    eager_cache = ig.make_cache("infinigen", model, **opts)
    if fake_cuda:
        on_fake_cuda(eager_cache)
    eager = ig.generate(model, ids, mask, cache=eager_cache, max_new_tokens=NEW, stop_at_eos=False)
    tokens, traces, cache = static_run(model, "infinigen", ids, mask, trace=True, fake_cuda=fake_cuda, **opts)
    assert torch.equal(tokens, eager.tokens)
    frac = cache.stats["fetched_fraction_per_layer"]
    assert frac == pytest.approx(eager_cache.stats["fetched_fraction_per_layer"])
    assert (min(frac[1:]) < 0.5) == (budget < 1.0)
    for a, b in zip(traces[1:], traces[2:]):
        assert first_difference(a, b) is None and a.host_reads == []
    if fake_cuda and kind == "llama-gqa":  # a speculated layer's ops (layer 2), a ceiling that only comes down
        kernels_of = [y[1] - x[1] for x, y in zip(traces[-1].marks, traces[-1].marks[1:])]
        assert kernels_of[2] - kernels_of[0] <= 12, kernels_of  # over layer 0 (a device layer: full's ops)


@pytest.mark.parametrize("fake_cuda", [False, True])
def test_static_offload_steps(tiny_models, fake_cuda, monkeypatch):
    """Offload in static steps: each layer's whole pool, up to the reserved tokens, into the working set of its
    parity (the columns past the step's masked): the eager steps' tokens and fetched shares, the same ops every
    step."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(40, 33))
    eager_cache = ig.make_cache("offload", model)
    if fake_cuda:
        on_fake_cuda(eager_cache)
    eager = ig.generate(model, ids, mask, cache=eager_cache, max_new_tokens=NEW, stop_at_eos=False)
    tokens, traces, cache = static_run(model, "offload", ids, mask, trace=True, fake_cuda=fake_cuda)
    assert torch.equal(tokens, eager.tokens)
    assert cache.stats["fetched_fraction_per_layer"] == pytest.approx(eager_cache.stats["fetched_fraction_per_layer"])
    for a, b in zip(traces[1:], traces[2:]):
        assert first_difference(a, b) is None and a.host_reads == []


@pytest.mark.parametrize("method,fake_cuda,budget", [("full", False, None), ("infinigen", False, 1.0),
                                                    ("infinigen", True, 0.1)])
def test_static_steps_over_int8_rows(tiny_models, method, fake_cuda, budget, monkeypatch):
    """int8 K/V rows (kv_dtype="int8") in static steps: the new row quantized at the device column, the chosen rows
    gathered as stored (on the CUDA path as int8 into the working set) and read in the model's dtype: the eager
    steps' tokens, the same ops every step. (The direct path at budget 1.0: below it a static step attends over a
    fixed number of slots under a mask, the eager one over exactly the chosen rows, so their float32 sums differ in
    the last bit from the first speculated layer on; int8 rows can turn such a bit into a whole quantization step of
    the next layer's K/V, which moves near-tie selections of these random models.)"""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    opts = dict(kv_dtype="int8", **(dict(budget=budget, min_budget=0) if method == "infinigen" else {}))
    eager_cache = ig.make_cache(method, model, **opts)
    if fake_cuda:
        on_fake_cuda(eager_cache)
    eager = ig.generate(model, ids, mask, cache=eager_cache, max_new_tokens=NEW, stop_at_eos=False)
    tokens, traces, cache = static_run(model, method, ids, mask, trace=True, fake_cuda=fake_cuda, **opts)
    assert cache.layers[1].k.dtype == torch.int8
    assert torch.equal(tokens, eager.tokens)
    for a, b in zip(traces[1:], traces[2:]):
        assert first_difference(a, b) is None and a.host_reads == []


@pytest.mark.parametrize("method", ["full", "offload", "infinigen"])
def test_nothing_is_allocated_after_the_first_step(tiny_models, method, monkeypatch):
    """After its first step (a graph's warm-up), a static step keeps no memory it did not hold before: every tensor
    reachable from the cache and the decoder (buffers, working sets, masks, accumulators) is the same storage after
    each later step; a step's own tensors do not outlive it (in a CUDA graph they are the graph's memory)."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache(method, model, **({"budget": 0.2, "min_budget": 0} if method == "infinigen" else {}))
    if method != "full":
        on_fake_cuda(cache)
    tok = prefill(model, ids, mask, cache, NEW).argmax(-1)
    dec = StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True))
    tok = dec.step(tok).argmax(-1)
    after_first = held(cache, dec)
    for _ in range(3):
        tok = dec.step(tok).argmax(-1)
        assert held(cache, dec) == after_first


def test_static_steps_refuse_what_they_do_not_serve(tiny_models):
    ids, mask = left_padded_batch(lengths=(20, 12))
    model = tiny_models["llama-gqa"]
    for method, opts in (("h2o", {"budget": 0.5}), ("infinigen", {"capacity": 0.5}),
                         ("infinigen", {"worker": True}), ("infinigen", {"recall": True})):
        cache = ig.make_cache(method, model, **{k: v for k, v in opts.items() if k not in ("worker", "recall")})
        if opts.get("worker"):
            on_fake_cuda(cache, uva=False)  # the CUDA transfer's worker (host gathers): not static
        cache.track_recall = bool(opts.get("recall"))
        prefill(model, ids, mask, cache, 2)
        with pytest.raises(StaticError, match="does not decode in static steps"):
            StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True))
    gemma = tiny_models["gemma3"]
    cache = ig.make_cache("full", gemma)
    prefill(gemma, ids, mask, cache, 2)
    with pytest.raises(StaticError, match="sliding windows"):
        StaticDecoder(gemma, cache, mask, mask.long().sum(-1, keepdim=True))
    cache = ig.make_cache("full", model)
    tok = prefill(model, ids, mask, cache, 1).argmax(-1)
    dec = StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True))
    for _ in range(dec.capacity - ids.shape[1]):
        tok = dec.step(tok).argmax(-1)
    with pytest.raises(StaticError, match="reserve more"):
        dec.step(tok)


def test_generate_runs_static_steps_where_graphs_are_on(tiny_models, monkeypatch):
    """generate's decode loop through a StaticDecoder (on CUDA it replays a graph; here the same steps, eager):
    the eager loop's tokens, and the decoder ran every step."""
    from infinigen_kv.model import static

    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(30, 22))
    eager = ig.generate(model, ids, mask, cache=ig.make_cache("full", model), max_new_tokens=NEW, stop_at_eos=False)
    steps = []
    monkeypatch.setattr(static, "graphs_on", lambda model, device, flag=None: flag is not False)
    monkeypatch.setattr(static.StaticDecoder, "forward",
                        lambda self, f=static.StaticDecoder.forward: steps.append(1) or f(self))
    got = ig.generate(model, ids, mask, cache=ig.make_cache("full", model), max_new_tokens=NEW, stop_at_eos=False)
    assert torch.equal(got.tokens, eager.tokens) and len(steps) == NEW - 1
    ig.generate(model, ids, mask, cache=ig.make_cache("full", model), max_new_tokens=NEW, stop_at_eos=False,
                cuda_graph=False)
    assert len(steps) == NEW - 1  # turned off: the eager step


def test_a_new_budget_between_runs_of_static_steps(tiny_models, monkeypatch):
    """A cache decoded in static steps, its budget changed (cache.set_budget), decodes on in static steps: the old
    cap's per-slot accumulators are folded into the counts, and the fetched share covers both runs."""
    from infinigen_kv.model import static

    monkeypatch.setattr(static, "graphs_on", lambda model, device, flag=None: flag is not False)
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids = torch.randint(3, 200, (1, 300 + NEW), generator=torch.Generator().manual_seed(0))
    cache = ig.make_cache("infinigen", model, budget=0.4, min_budget=0)
    cache.reserve(300 + 2 * NEW)
    logits = prefill(model, ids[:, :300], None, cache)
    shares = []
    for budget in (0.4, 0.1):
        cache.set_budget(budget)
        n = cache.get_seq_length()
        ig.generate(model, ids[:, :n], cache=cache, max_new_tokens=NEW, stop_at_eos=False, prefilled=logits)
        shares.append(cache.stats["fetched_fraction"])
    assert cache.get_seq_length() == 300 + 2 * (NEW - 1)
    assert 0 < shares[1] < shares[0] < 1, shares  # the second run's steps fetched less


def test_a_capture_that_fails_decodes_eagerly(tiny_models):
    """A step that cannot be captured as a CUDA graph (here: no CUDA at all) warns once and decodes eagerly: the
    same tokens."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(30, 22))
    eager, _, _ = static_run(model, "full", ids, mask)
    cache = ig.make_cache("full", model)
    tok = prefill(model, ids, mask, cache, NEW).argmax(-1)
    dec = StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True), graph=True)
    tokens = [tok]
    with pytest.warns(UserWarning, match="CUDA graph capture failed"):
        tokens.append(dec.step(tok).argmax(-1))
    assert not dec.graph
    for _ in range(NEW - 2):
        tokens.append(dec.step(tokens[-1]).argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), eager)


def test_a_replayed_steps_counts(tiny_models, monkeypatch):
    """What a graph's owner does with the cache's counts (a replay runs no Python): back to where they were before
    the capture's warm-up, device accumulators in place, then one step's host counts added per replay."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache("infinigen", model, budget=0.2, min_budget=0)
    tok = prefill(model, ids, mask, cache, NEW).argmax(-1)
    dec = StaticDecoder(model, cache, mask, mask.long().sum(-1, keepdim=True))
    tok = dec.step(tok).argmax(-1)  # a first step: the device accumulators exist
    before = cache.bookkeeping()
    dec.refill(tok)
    dec.forward()  # the warm-up's counts
    after = cache.bookkeeping()
    accumulators = [t for t in cache.counters.fetched_fixed if t is not None]  # a static step's (real slots)
    assert after[0][0]["steps"] != before[0][0]["steps"] and accumulators
    cache.restore_bookkeeping(before)
    host, device = cache.counters.snapshot()
    assert host == before[0][0]
    assert all(torch.equal(t, was) for t, was in zip(cache.counters.fetched_fixed, before[0][1][2]) if t is not None)
    now = [t for t in cache.counters.fetched_fixed if t is not None]
    assert all(a is b for a, b in zip(now, accumulators))  # in place: the very tensors a graph adds to
    cache.replayed(before, after)
    assert cache.counters.snapshot()[0] == after[0][0]


def test_the_partial_channels_reach_the_device_at_prefill(tiny_models, monkeypatch):
    """The PyTorch path's partial query (a GPU's) has every layer's channels on the compute device once the prompt is
    in: a decode step copies nothing from the host (on a GPU such a copy waits for the device)."""
    from infinigen_kv.methods.infinigen.partial import PartialQuery

    made = []
    channels_on = PartialQuery.channels_on
    monkeypatch.setattr(PartialQuery, "channels_on",
                        lambda self, device: made.append(device) or channels_on(self, device))
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40))
    cache = ig.make_cache("infinigen", model, budget=0.2, min_budget=0)
    prefill(model, ids, mask, cache, 2)
    assert made and all(torch.device(d) == ids.device for d in made)
    first = channels_on(cache.pq, ids.device)
    ig.generate(model, ids, mask, cache=ig.make_cache("infinigen", model, budget=0.2, min_budget=0), max_new_tokens=3)
    assert channels_on(cache.pq, ids.device) is first  # made once, kept
