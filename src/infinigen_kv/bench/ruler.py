"""RULER's synthetic tasks (Hsieh et al., 2024), generated locally from a seed and sized in tokens of the
model's tokenizer; scored as RULER scores them (`string_match_all`: the share of expected strings found in
the output, case-insensitive).

- niah_*: key-value needles in a haystack, asked by key. Haystacks: `noise` (one repeated passage),
  `essay` (real prose: the text the user passes), `needle` (nothing but distractor needles of the same
  shape). single_1/2/3: one needle (noise/numbers, essay/numbers, essay/UUIDs); multikey_1: three distractor
  keys in an essay; multikey_2/3: a needle haystack (numbers, then UUID keys and values); multivalue: four
  values of the asked key; multiquery: four keys asked at once.
- ruler_vt: variable tracking: one chain of 4 hops (VAR A = 12345, VAR B = VAR A, ...) in noise; every
  name of the chain is expected.
- ruler_cwe: common words: a numbered list where 10 words occur 30 times and the others 3 times.
- ruler_fwe: frequent words: coded words drawn from a Zipf law (alpha 2); the 3 most frequent are expected.
Words and coded words are pronounceable pseudo-words (no word list to download).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

NIAH = {  # task -> (haystack, key kind, value kind, keys in the text, values per key, keys asked)
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
TASKS = (*NIAH, "ruler_vt", "ruler_cwe", "ruler_fwe")
NEEDS_ESSAY = {t for t, spec in NIAH.items() if spec[0] == "essay"}
MAX_NEW = {**{t: 64 if NIAH[t][4] > 1 or NIAH[t][5] > 1 else 32 for t in NIAH},
           "ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50}  # tokens generated per answer


@dataclass
class RulerSample:
    prompt: str
    answers: list[str]  # every one is expected in the output


def score(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the share of answers found in the output (case-insensitive)."""
    out = output.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


def _word(rng: random.Random) -> str:
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3)))


def _words(rng: random.Random, n: int, avoid=()) -> list[str]:
    out, seen = [], set(avoid)
    while len(out) < n:
        if (w := _word(rng)) not in seen:
            seen.add(w)
            out.append(w)
    return out


def _item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{_word(rng)}-{_word(rng)}"


def _sized(tokenizer, length: int, build, most: int) -> str:
    """build(n) for the largest n in [1, most] whose prompt fits `length` tokens (binary search)."""
    count = lambda n: len(tokenizer(build(n), add_special_tokens=False)["input_ids"])  # noqa: E731
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= length else (lo, mid - 1)
    if lo == 1 and (least := count(1)) > length:
        raise ValueError(f"{length} tokens cannot hold this task's fixed text ({least} tokens): ask for more")
    return build(lo)


def _spread(units: list[str], inserts: list[str], rng: random.Random) -> str:
    """The haystack units with `inserts` placed, in order, at random depths."""
    cuts = sorted(rng.randrange(len(units) + 1) for _ in inserts)
    out, prev = [], 0
    for cut, text in zip(cuts, inserts):
        out += units[prev:cut] + [text]
        prev = cut
    return " ".join(out + units[prev:])


def niah(task: str, tokenizer, length: int, seed: int = 0, essay: str | None = None) -> RulerSample:
    haystack, key_kind, value_kind, n_keys, n_values, n_asked = NIAH[task]
    rng = random.Random(f"{task}-{seed}")
    keys = list(dict.fromkeys(_item(rng, key_kind) for _ in range(n_keys * 4)))[:n_keys]
    values = [[_item(rng, value_kind) for _ in range(n_values)] for _ in keys]
    needle = "One of the special magic {} for {} is: {}."
    needles = [needle.format(value_kind, k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = keys[:n_asked]
    query = asked[0] if n_asked == 1 else ", ".join(asked[:-1]) + f" and {asked[-1]}"
    head = (f"Some special magic {value_kind} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {value_kind} afterwards.\n")
    tail = (f"\nWhat are all the special magic {value_kind} for {query} mentioned in the provided text? The "
            f"special magic {value_kind} for {query} mentioned in the provided text are")
    if haystack == "noise":
        units, unit_tokens = [NOISE.strip()] * (length // 10 + 1), 30
    elif haystack == "essay":
        if not essay:
            raise ValueError(f"{task} needs real prose for its haystack: pass --data (a folder with pg19/*.txt, or a text file)")
        words = essay.split()
        units, unit_tokens = [words[i % len(words)] for i in range(length * 2)], 1
    else:  # distractor needles with other keys (and values) of the same kinds
        others = [k for k in dict.fromkeys(_item(rng, key_kind) for _ in range(length // 4)) if k not in keys]
        units = [needle.format(value_kind, k, _item(rng, value_kind)) for k in others]
        unit_tokens = 12
    depth = rng.random()  # the needles' placement: the same for every haystack size the search tries
    prompt = _sized(tokenizer, length, lambda n: head + _spread(units[:n], needles, random.Random(depth)) + tail,
                    min(len(units), length // unit_tokens * 2 + 8))
    return RulerSample(prompt, [v for k, vs in zip(keys, values) if k in asked for v in vs])


def variable_tracking(tokenizer, length: int, seed: int = 0, hops: int = 4) -> RulerSample:
    rng = random.Random(f"ruler_vt-{seed}")
    names = list(dict.fromkeys("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                               for _ in range(4 * hops)))[: hops + 1]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    tail = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
            f"According to the chain(s) of variable assignment in the text above, {hops + 1} variables are "
            f"assigned the value {value}, they are: ")
    units = [NOISE.strip()] * (length // 10 + 1)
    prompt = _sized(tokenizer, length, lambda n: head + _spread(units[:n], chain, random.Random(seed)) + tail,
                    len(units))
    return RulerSample(prompt, names)


def common_words(tokenizer, length: int, seed: int = 0, common: int = 10, freq_common: int = 30,
                 freq_rare: int = 3) -> RulerSample:
    rng = random.Random(f"ruler_cwe-{seed}")
    top = _words(rng, common)
    rare = _words(rng, length // 2, avoid=top)
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
    tail = (f"\nQuestion: What are the {common} most common words in the above list? Answer: The top {common} "
            f"words that appear most often in the list are:")

    def build(n, freq=freq_common):
        words = top * freq + rare[:n] * freq_rare
        random.Random(seed).shuffle(words)
        return head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)) + tail

    # short contexts cannot hold 10 words x 30: fewer repeats, still well above the rare words' count
    freq = next((f for f in (freq_common, 15, 8, 5) if len(tokenizer(build(1, f))["input_ids"]) <= length), 5)
    return RulerSample(_sized(tokenizer, length, lambda n: build(n, freq), len(rare)), top)


def frequent_words(tokenizer, length: int, seed: int = 0, alpha: float = 2.0, vocab: int = 2000) -> RulerSample:
    rng = random.Random(f"ruler_fwe-{seed}")
    coded = _words(rng, vocab)
    weights = [1 / (r + 1) ** alpha for r in range(vocab)]
    drawn = rng.choices(coded, weights, k=length)  # more than fits: the prompt takes a prefix
    head = "Read the following coded text and track the frequency of each coded word. Find the three most " \
           "frequently appeared coded words. "
    tail = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
            "three most frequently appeared words are:")
    prompt = _sized(tokenizer, length, lambda n: head + " .... ".join(drawn[:n]) + tail, len(drawn))
    n = prompt.count(" .... ") + 1
    counts: dict[str, int] = {}
    for w in drawn[:n]:
        counts[w] = counts.get(w, 0) + 1
    return RulerSample(prompt, sorted(counts, key=lambda w: -counts[w])[:3])


def generate(task: str, tokenizer, length: int, seed: int = 0, essay: str | None = None) -> RulerSample:
    """One deterministic sample of `task` (a name in TASKS) of at most `length` tokens."""
    if task in NIAH:
        return niah(task, tokenizer, length, seed, essay)
    return {"ruler_vt": variable_tracking, "ruler_cwe": common_words, "ruler_fwe": frequent_words}[task](
        tokenizer, length, seed)
