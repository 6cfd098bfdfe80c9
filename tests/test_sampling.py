"""The shared sampler (sampling.py): each knob does what OpenAI/vLLM clients expect, per row, and a row's draws
do not depend on its batch-mates."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.runtime.sampling import Sampler, SamplingParams

V = 50


def logits_of(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def one(params, logits, prompt=None):
    return Sampler.for_batch("cpu", logits.shape[-1], [params], [prompt] if prompt is not None else None)


def test_logit_bias_moves_the_greedy_choice_and_bans_tokens():
    x = torch.zeros(1, V)
    x[0, 3] = 5.0
    assert one(SamplingParams(), x)(x).item() == 3
    assert one(SamplingParams(logit_bias={7: 10.0}), x)(x).item() == 7
    assert one(SamplingParams(logit_bias={3: -100.0}), x)(x).item() != 3


def test_presence_and_frequency_penalties_count_generated_tokens():
    x = torch.zeros(1, V)
    x[0, 3], x[0, 4] = 5.0, 4.0
    s = one(SamplingParams(presence_penalty=2.0), x)
    assert s(x).item() == 3
    s.observe(torch.tensor([3]))
    assert s(x).item() == 4  # 5 - 2 < 4
    f = one(SamplingParams(frequency_penalty=0.6), x)
    f.observe(torch.tensor([3]))
    assert f(x).item() == 3  # 5 - 0.6 > 4
    f.observe(torch.tensor([3]))
    assert f(x).item() == 4  # 5 - 1.2 < 4
    neg = one(SamplingParams(presence_penalty=-2.0), x)  # negative: repeat more
    neg.observe(torch.tensor([4]))
    assert neg(x).item() == 4


def test_repetition_penalty_covers_the_prompt_and_both_signs():
    x = torch.zeros(1, V)
    x[0, 3], x[0, 4] = 6.0, 4.0
    assert one(SamplingParams(repetition_penalty=2.0), x, prompt=[3])(x).item() == 4  # 6 / 2 < 4
    assert one(SamplingParams(repetition_penalty=2.0), x, prompt=[9])(x).item() == 3
    y = torch.full((1, V), -10.0)
    y[0, 5], y[0, 6] = -1.0, -1.5
    assert one(SamplingParams(repetition_penalty=2.0), y, prompt=[5])(y).item() == 6  # -1 x 2 < -1.5


def test_top_k_and_min_p_truncate_the_distribution():
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    best = int(x.argmax())
    for seed in range(20):
        assert one(SamplingParams(temperature=1.5, top_k=1, seed=seed), x)(x).item() == best
        assert one(SamplingParams(temperature=1.5, min_p=1.0, seed=seed), x)(x).item() == best
    top3 = set(x[0].topk(3).indices.tolist())
    got = {one(SamplingParams(temperature=2.0, top_k=3, seed=s), x)(x).item() for s in range(60)}
    assert got <= top3 and len(got) > 1
    y = x * 0.3  # flatter: several tokens within min_p of the best
    probs = torch.softmax(y[0], -1)
    kept = set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    got = {one(SamplingParams(temperature=1.0, min_p=0.5, seed=s), y)(y).item() for s in range(80)}
    assert got <= kept and len(got) > 1


def test_a_row_draws_the_same_alone_or_beside_other_knobs():
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    a = SamplingParams(temperature=1.0, top_k=5, presence_penalty=1.0, logit_bias={2: 3.0}, seed=11)
    others = [SamplingParams(), SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, seed=5)]
    alone = Sampler.for_batch("cpu", V, [a])
    batch = Sampler.for_batch("cpu", V, [others[0], a, others[1]], [[1], [2, 3], [4]])
    for _ in range(10):
        ia, ib = alone(x[1:2]), batch(x)
        assert ia.item() == ib[1].item()
        alone.observe(ia)
        batch.observe(ib)
    batch.retain([1, 2])  # a row leaving keeps the others' state
    assert alone(x[1:2]).item() == batch(x[1:])[0].item()


def test_bad_knobs_are_refused():
    for bad in ({"top_p": 0.0}, {"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"temperature": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(TypeError, match="unknown sampling knob"):
        from infinigen_kv.runtime.sampling import params_list

        params_list(1, top_q=3)


def test_generate_takes_the_knobs(tiny_models):
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    eos = int(ig.generate(model, ids[:1], cache=ig.make_cache("full", model), max_new_tokens=1).tokens[0, 0])
    # the first greedy token as EOS: a plain run stops there, ignore_eos runs to the end
    r = ig.generate(model, ids[:1], cache=ig.make_cache("full", model), max_new_tokens=6, eos_token_id=eos)
    assert r.lengths == [1] and r.tokens.shape[1] == 1
    r = ig.generate(model, ids[:1], cache=ig.make_cache("full", model), max_new_tokens=6, eos_token_id=eos,
                    ignore_eos=True)
    assert r.lengths == [6] and r.tokens.shape[1] == 6
    banned = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=5,
                         logit_bias={eos: -100.0}).tokens
    assert not (banned == eos).any()
    plain = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=8).tokens
    forced = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=8,
                         logit_bias=[{}, {7: 100.0}]).tokens  # per row: the second always says 7
    assert torch.equal(forced[0], plain[0]) and (forced[1] == 7).all()
    rep = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=8, frequency_penalty=2.0,
                      presence_penalty=2.0).tokens
    assert all(len(set(row.tolist())) >= len(set(p.tolist())) for row, p in zip(rep, plain))
