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
