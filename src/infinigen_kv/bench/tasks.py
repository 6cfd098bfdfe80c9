"""Deterministic long-context tasks generated from a seed (no download): each returns a prompt and the
expected answer, sized in tokens of the given tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class Sample:
    prompt: str
    answer: str


def passkey(tokenizer, length: int = 4000, seed: int = 0, depth: float | None = None) -> Sample:
    """A 5-digit pass key at a random depth (or `depth` in [0, 1]) of ~`length` tokens of filler."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.random() if depth is None else depth
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    fixed = len(tokenizer(INTRO + needle + question)["input_ids"])
    per = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    reps = max(1, int((length - fixed) / per))
    before = int(reps * depth)
    prompt = INTRO + FILLER * before + needle + FILLER * (reps - before) + question
    return Sample(prompt, key)


def _fill(tokenizer, length: int, parts: list[str], question: str, rng: random.Random) -> str:
    """Spread `parts` at random depths of filler so that the prompt is ~`length` tokens (sized, then
    corrected once by the measured length)."""
    cut_seed = rng.random()

    def build(reps):
        cuts = sorted(random.Random(cut_seed).sample(range(reps + 1), len(parts)))
        out, prev = [INTRO], 0
        for cut, part in zip(cuts, parts):
            out.append(FILLER * (cut - prev) + part + " ")
            prev = cut
        out.append(FILLER * (reps - prev) + question)
        return "".join(out)

    per = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    reps = max(len(parts), int(length / per))
    over = len(tokenizer(build(reps))["input_ids"]) - length
    return build(max(len(parts), reps - round(over / per)))


KEYS = ("apple", "river", "candle", "marble", "falcon", "garden", "silver", "thunder", "copper", "meadow",
        "lantern", "harbor", "violet", "pepper", "canyon", "saddle")


def niah(tokenizer, length: int = 4000, seed: int = 0, needles: int = 2) -> Sample:
    """RULER-style multi-key needle in a haystack: several key-value needles, one key asked. Two needles by
    default: with four, SmolLM2-135M misses most even with the full cache (measured 1 of 3 at 2k tokens)."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, needles)
    values = [str(rng.randint(100000, 999999)) for _ in keys]
    parts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    asked = rng.randrange(needles)
    question = f"What is the special magic number for {keys[asked]}? The special magic number for {keys[asked]} is:"
    return Sample(_fill(tokenizer, length, parts, question, rng), values[asked])


def variable_tracking(tokenizer, length: int = 4000, seed: int = 0, hops: int = 2) -> Sample:
    """RULER-style variable tracking: a chain VAR A = 12345, VAR B = VAR A, ...; the answer is every
    variable of the chain (space-separated), asked by the value. Distractor chains hold other values."""
    rng = random.Random(seed)
    names = rng.sample([f"{a}{b}" for a in "ABCDEFGHJKLMNPQRSTUVWXYZ" for b in "ABCDEFGHJKLMNPQRSTUVWXYZ"],
                       2 * (hops + 1))
    value, other = rng.sample(range(10000, 99999), 2)
    chains = []
    for chain, val in ((names[: hops + 1], value), (names[hops + 1 :], other)):
        chains.append([f"VAR {chain[0]} = {val}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, hops + 1)])
    parts = [p for pair in zip(*chains) for p in pair]  # interleaved, each chain in order
    question = (f"Question: find all variables that are assigned the value {value} in the text above. Answer: "
                f"according to the chain of variable assignments, {hops + 1} variables are assigned the value "
                f"{value}, they are: VAR")
    return Sample(_fill(tokenizer, length, parts, question, rng), " ".join(names[: hops + 1]))


GENERATORS = {"passkey": passkey, "niah": niah, "vt": variable_tracking}


def score(task: str, output: str, answer: str) -> float:
    """Exact match for passkey/niah; for vt the share of the chain's variables named in the output."""
    if task == "vt":
        names = answer.split()
        return sum(n in output for n in names) / len(names)
    return float(answer in output)
