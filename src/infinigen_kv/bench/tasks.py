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


# Short prompts as a new user sends them (5-200 tokens): ("chat", message) goes through the model's chat template,
# ("text", prefix) is continued as it is. The `short` task compares each method's 64 greedy tokens with the full
# cache's: a budget must not starve a short past (docs/BENCHMARKS.md, "The budget floor").
SHORT_PROMPTS = [
    ("text", "Once upon a time"),
    ("text", "The capital of France is"),
    ("chat", "Say hi"),
    ("chat", "What is 12 times 7?"),
    ("text", "def fibonacci(n):"),
    ("chat", "Write a haiku about the sea."),
    ("text", "The three primary colors are"),
    ("chat", "Give me three tips for sleeping better."),
    ("text", "In 1969, the Apollo 11 mission"),
    ("chat", "Explain what a hash table is in two sentences."),
    ("text", "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
             "synthesize foods from carbon dioxide and water. In plants, it generally involves"),
    ("chat", "Translate to French: The weather is nice today and we are going to the park."),
    ("text", "Dear hiring manager,\n\nI am writing to apply for the position of software engineer at your company. "
             "Over the past five years I have"),
    ("chat", "My tomato plants have yellow leaves at the bottom. What could be wrong, and what should I do?"),
    ("text", "The following is a recipe for a simple tomato soup.\n\nIngredients:\n- 6 ripe tomatoes\n- 1 onion\n"
             "- 2 cloves of garlic\n- 2 cups of vegetable stock\n- salt and pepper\n\nInstructions:\n1."),
    ("chat", "I have a list of numbers in Python and I want to keep only the even ones. Show me two ways to do it, "
             "one with a loop and one with a list comprehension."),
    ("text", "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius.\n\nQ: What is the largest "
             "planet in the solar system?\nA: Jupiter.\n\nQ: Who wrote the play Romeo and Juliet?\nA:"),
    ("chat", "Summarize this in one sentence: The city council met on Tuesday to discuss the new bike lanes. "
             "Several residents spoke in favor, saying the lanes would make commuting safer, while shop owners "
             "worried about losing parking spaces in front of their stores. The council agreed to run a six-month "
             "trial on two streets before deciding."),
    ("text", "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a "
             "goldsmith from Mainz, developed a system of movable metal type. Before his invention, books in Europe "
             "were copied by hand, usually by monks, and a single volume could take months to finish. Gutenberg's "
             "press combined several existing technologies: the screw press used for making wine and olive oil, "
             "oil-based inks, and a new alloy of lead, tin and antimony that could be cast into precise letters. "
             "The result was a machine that could"),
    ("chat", "You are a helpful assistant for a small bakery. A customer writes: 'Hello! I would like to order a "
             "birthday cake for my daughter, who is turning seven next Saturday. She loves strawberries and the "
             "color purple, but she is allergic to nuts. We expect about fifteen children at the party. Could you "
             "suggest a cake, tell me roughly how big it should be, and let me know how far in advance I need to "
             "order?' Write a friendly reply."),
    ("text", "Chapter 1\n\nThe train pulled into the station just after midnight. Clara gathered her coat and her "
             "single battered suitcase and stepped onto the empty platform. A thin fog hung over the tracks, and the "
             "only light came from a lamp above the ticket office, where an old man sat reading a newspaper. She had "
             "not been back to the village in twelve years, not since the summer her brother disappeared. Nothing "
             "seemed to have changed: the same peeling paint on the benches, the same clock that ran four minutes "
             "slow, the same smell of coal smoke and wet stone. She walked toward the exit, and as she passed the "
             "ticket office the old man looked up and said"),
    ("chat", "I am preparing for a job interview for a data analyst position. The job description mentions SQL, "
             "Python, dashboards in Tableau, and communicating results to non-technical managers. I have used SQL "
             "and Python at university but never Tableau, and I get nervous when presenting. Can you give me a "
             "short study plan for the next two weeks and three example questions they might ask, with tips on how "
             "to answer each?"),
]
