"""`infinigen bench accuracy`: every method on the same tasks, through the real decode path.

Tasks (deterministic for a seed):
- `ppl`: decode-mode perplexity: windows of W tokens of a text, the first P prefilled with full attention,
  the rest teacher-forced one token per step through the cache under test.
- `passkey`, `niah`, `vt`: generated retrieval tasks (tasks.py), greedy, scored by `tasks.score`.
- RULER's synthetic suite (ruler.py: niah_single_1 ... ruler_fwe; `ruler` names them all), greedy, scored
  by RULER's string_match_all; with two or more of them, a `ruler-mean-<length>` row per method and budget.
- `agreement`: greedy continuation of a long text prompt; share of tokens equal to the full cache's output
  up to the first divergence (`agreement_prefix`) and overall (`agreement_overall`).
- `short`: the built-in short prompts (tasks.SHORT_PROMPTS: chat and completion, 5-200 tokens), 64 greedy
  tokens each (fewer if --new-tokens is smaller; up to the first EOS); share of outputs identical to the full cache's
  (`identical`) and tokens equal before the first divergence (`prefix_tokens`). Needs no data.
- `lmeval`: lm-evaluation-harness tasks (`lmeval.py`), for users with the datasets locally; not in the
  default list.
Methods that do not depend on the budget (full, quant) run once (budget null). A generated task's prompt is
prefilled once for every method but quant (TeeCache), once for quant; each method and budget decodes from a fork of that prefill. Its per-sample results go to
OUT/samples.jsonl as they come, and `--resume` goes on from them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from ..config import DEFAULT_MODEL
from ..methods.base import Rebatch, cache_stats
from ..methods.registry import REFERENCE, make_cache
from ..methods.registry import method as traits
from ..runtime.generation import generate, prefill
from .tee import TeeCache
from . import ruler
from . import tasks as task_lib
from .accuracy_report import write_reports

TASKS = ("ppl", "passkey", "niah", "vt", "agreement", "short", "lmeval", *ruler.TASKS)
DEFAULT_TASKS = ("ppl", "passkey", "niah", "vt", "agreement")
NEEDS_TEXT = {"ppl", "agreement", *ruler.NEEDS_ESSAY}


class DataError(ValueError):
    """A task needs text that --data does not provide."""


def load_text(data: str | None) -> str:
    """The evaluation text: a file, or a directory (its wikitext-2/test.txt if present, else all *.txt)."""
    if data is None:
        raise DataError("tasks ppl and agreement need text: pass --data DIR with wikitext-2/test.txt inside (or any text file)")
    path = Path(data)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    if not path.is_dir():
        raise DataError(f"--data path not found: {data}")
    wiki = path / "wikitext-2" / "test.txt"
    files = [wiki] if wiki.is_file() else sorted(path.rglob("*.txt"))
    if not files:
        raise DataError(f"no .txt file under {data}")
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def load_essay(data: str | None) -> str:
    """Prose for RULER's essay haystacks: a file, or a directory's pg19/*.txt (books) if it has them, else
    its other text."""
    if data is None:
        raise DataError(f"RULER's essay haystacks ({', '.join(sorted(ruler.NEEDS_ESSAY))}) need text: pass --data "
                        "DIR with pg19/*.txt (PG-19 books) inside, or any text file")
    path = Path(data)
    books = sorted((path / "pg19").glob("*.txt")) if path.is_dir() else []
    if books:
        return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in books)
    return load_text(data)


def _cache(model, method, budget, options):
    return make_cache(method, model, **{k: v for k, v in {**options, "budget": budget}.items() if v is not None})


def _fetched(cache) -> float:
    return cache_stats(cache).get("fetched_fraction", 1.0)


@torch.inference_mode()
def run_ppl(model, ids: torch.Tensor, method, budget, options, window: int, prefix: int, samples: int, batch: int = 4):
    """Perplexity over `samples` windows of `window` tokens of ids (1-D), prefix prefilled."""
    device = next(model.parameters()).device
    if ids.numel() < samples * window:
        raise DataError(f"ppl: the text has {ids.numel()} tokens, {samples} windows of {window} need more")
    windows = ids[: samples * window].view(samples, window).to(device)
    nll, count, fetched = 0.0, 0, []
    for i in range(0, samples, batch):
        x = windows[i : i + batch]
        cache = _cache(model, method, budget, options)
        logits = model(input_ids=x[:, :prefix], past_key_values=cache, logits_to_keep=1).logits[:, -1]
        nll += torch.nn.functional.cross_entropy(logits.float(), x[:, prefix], reduction="sum").item()
        for t in range(prefix, window - 1):
            logits = model(input_ids=x[:, t : t + 1], past_key_values=cache).logits[:, -1]
            nll += torch.nn.functional.cross_entropy(logits.float(), x[:, t + 1], reduction="sum").item()
        count += x.shape[0] * (window - prefix)
        fetched.append(_fetched(cache))
        print(f"  ppl {method} budget {budget}: windows {i + x.shape[0]}/{samples}", file=sys.stderr, flush=True)
    return math.exp(nll / count), sum(fetched) / len(fetched)


GENERATED = ("passkey", "niah", "vt", *ruler.TASKS)


def make_prompt(tokenizer, task, length, seed, essay=None):
    """(prompt, answers, tokens to generate, scorer: output -> score) of a generated task."""
    if task in ruler.TASKS:
        s = ruler.generate(task, tokenizer, length, seed, essay)
        return s.prompt, s.answers, ruler.MAX_NEW[task], lambda out: ruler.score(out, s.answers)
    s = task_lib.GENERATORS[task](tokenizer, length, seed=seed)
    return s.prompt, [s.answer], 24 if task == "vt" else 10, lambda out: task_lib.score(task, out, s.answer)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class SampleLog:
    """Per-sample results, a JSON line each in OUT/samples.jsonl after a header line with the run's settings:
    a run that stops (a long RULER table is hours of CPU) goes on where it stopped with --resume."""

    def __init__(self, path: Path | None, header: dict, resume: bool = False):
        self.path, self.done = path, {}
        self.total, self.got, self.started = 0, 0, time.perf_counter()  # this run's results: expected, come
        if path is None:
            return
        if resume and path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            if lines and self.settings(json.loads(lines[0])) != self.settings(header):
                raise DataError(f"--resume: {path} holds results of other settings ({lines[0][:200]}); "
                                "rerun without --resume to start over, or with the same settings")
            for line in lines[1:]:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut short when the run stopped
                    continue
                self.done[self.key(r)] = r
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:  # header, then what is kept
            f.write(json.dumps(header) + "\n")
            for r in self.done.values():
                f.write(json.dumps(r) + "\n")

    @staticmethod
    def settings(header: dict) -> dict:
        """What must match to resume: the header less its unset options (a knob added since reads as unset; so does
        min_budget 0, the bench's default, which runs made before the knob had)."""
        unset = lambda k, v: v is None or (k == "min_budget" and v == 0)
        return {**header, "options": {k: v for k, v in (header.get("options") or {}).items() if not unset(k, v)}}

    @staticmethod
    def key(r: dict) -> tuple:
        return r["task"], r["length"], r["seed"], r["method"], r["budget"]

    def expect(self, total: int) -> None:
        """`total` results to come in this run (the progress lines count them)."""
        self.total, self.got, self.started = total, 0, time.perf_counter()

    def progress(self) -> str:
        """[done/total, elapsed, ~left] of this run's results, after the latest."""
        if not self.total:
            return ""
        spent = time.perf_counter() - self.started
        left = spent / self.got * (self.total - self.got) if self.got else 0.0
        return f"[{self.got}/{self.total}, {_clock(spent)}, ~{_clock(left)} left]"

    def add(self, r: dict) -> None:
        self.got += 1
        self.done[self.key(r)] = r
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")


def _groups(methods) -> list[list[str]]:
    """Methods that can share a prefill (TeeCache: those whose prefill attends over the prompt itself), then
    each other one alone (quant attends over its dequantized entries)."""
    shared = [m for m in methods if traits(m).shares_prefill]
    return ([shared] if shared else []) + [[m] for m in methods if not traits(m).shares_prefill]


def run_generated(model, tokenizer, tasks, methods, budgets, options, lengths, samples, seed, essay, log, batch=4):
    """Every generated task's `samples` prompts per length, scored per method and budget into `log`.

    `batch` prompts at a time: each is prefilled alone, once for all the methods that can share it
    (TeeCache); then, per method and budget, forks of their prefilled caches (the budget acts only in
    decode; the last budget takes the caches themselves) join one batch that decodes together (a row's
    tokens do not depend on its batch: tests/test_batching.py). Sample-major: a run cut short has every
    task at about the same count."""
    log.expect(sum((task, length, s, m, b) not in log.done for s in range(seed, seed + samples) for length in lengths
                   for task in tasks for m in methods for b in (budgets if traits(m).takes_budget else [None])))
    for start in range(0, samples, batch):
        seeds = range(seed + start, seed + min(samples, start + batch))
        for length in lengths:
            for task in tasks:
                todo = {(m, b): [s for s in seeds if (task, length, s, m, b) not in log.done]
                        for m in methods for b in (budgets if traits(m).takes_budget else [None])}
                needed = sorted({s for got in todo.values() for s in got})
                prompts = {s: make_prompt(tokenizer, task, length, s, essay) for s in needed}
                for group in _groups([m for m in methods if any(todo[k] for k in todo if k[0] == m)]):
                    wanted = sorted({s for (m, _), got in todo.items() if m in group for s in got})
                    rows = _prefill_rows(model, tokenizer, group, {s: prompts[s] for s in wanted}, options)
                    for method in group:
                        runs = [b for b in (budgets if traits(method).takes_budget else [None]) if todo[(method, b)]]
                        for j, budget in enumerate(runs):
                            got = todo[(method, budget)]
                            caches = [_for_budget(rows[s][1][method], budget, last=j == len(runs) - 1) for s in got]
                            outs, fetched = _decode_rows(model, [rows[s][0] for s in got], caches,
                                                         [rows[s][2] for s in got], prompts[got[0]][2])
                            for s, out in zip(got, outs):
                                _record(log, tokenizer, prompts[s], out, task=task, length=length, seed=s,
                                        method=method, budget=budget, fetched_fraction=fetched)
                        for s in wanted:  # its last use: its memory goes now (at 8k, 4 prompts' caches are 1.5 GB)
                            rows[s][1].pop(method, None)


def _prefill_rows(model, tokenizer, group, prompts, options) -> dict:
    """seed -> (ids (1, n), {method: its cache, prefilled}, last logits (1, V)): one prefill per prompt for
    every method of the group."""
    device = next(model.parameters()).device
    rows = {}
    for s, (prompt, _, max_new, _) in prompts.items():
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        caches = {m: _cache(model, m, None, options) for m in group}
        into = next(iter(caches.values())) if len(caches) == 1 else TeeCache(list(caches.values()))
        rows[s] = ids, caches, prefill(model, ids, None, into, max_new)
    return rows


def _record(log, tokenizer, prompt, tokens, **fields) -> None:
    """One sample's result into the log (and a line on stderr)."""
    out = tokenizer.decode(tokens, skip_special_tokens=True)
    answers, scorer = prompt[1], prompt[3]
    log.add({**fields, "score": scorer(out), "output": out})
    print(f"  {log.progress()} {fields['task']}-{fields['length']} {fields['method']} budget {fields['budget']} "
          f"seed {fields['seed']}: {out.strip()[:30]!r} (answer {' '.join(answers)[:40]})", file=sys.stderr, flush=True)


def _for_budget(cache, budget, last: bool):
    """A prefilled cache to decode under `budget`: a fork of it, or itself for its last use."""
    if not last:
        return cache.fork(budget=budget)
    if budget is not None:
        cache.set_budget(budget)
    return cache


def _decode_rows(model, ids, caches, logits, max_new):
    """Greedy decode of prefilled caches (one row each; ids (1, n_i), logits (1, V)): joined into one batch
    (left-padded) where the method can join, else one by one. -> (generated ids per row, fetched share)."""
    if len(caches) > 1 and all(isinstance(c, Rebatch) and not c.limited for c in caches):
        batch = caches[0]  # (a pool with a capacity cannot join)
        for c in caches[1:]:
            batch.join(c, room=max_new)
        n = max(x.shape[1] for x in ids)
        mask = torch.stack([torch.arange(n) >= n - x.shape[1] for x in ids]).long().to(ids[0].device)  # (B, n)
        r = generate(model, torch.zeros_like(mask), mask, cache=batch, max_new_tokens=max_new,
                     prefilled=torch.cat(logits))
        return [r.tokens[i, : r.lengths[i]] for i in range(len(ids))], _fetched(batch)
    outs, fetched = [], []
    for x, cache, lg in zip(ids, caches, logits):
        r = generate(model, x, cache=cache, max_new_tokens=max_new, prefilled=lg)
        outs.append(r.tokens[0, : r.lengths[0]])
        fetched.append(_fetched(cache))
    return outs, sum(fetched) / len(fetched)


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(share before the first divergence, share overall) of tokens (n,) equal to reference (n,)."""
    same = tokens == reference
    first = int((~same).nonzero()[0]) if (~same).any() else same.numel()
    return first / same.numel(), same.float().mean().item()


def run_agreement(model, ids: torch.Tensor, method, budget, options, length, samples, new_tokens, references,
                  batch: int = 4):
    """Greedy agreement with the full cache over `samples` prompts of `length` tokens spread over the text,
    decoded `batch` at a time (equal lengths: no padding)."""
    device = next(model.parameters()).device
    starts = [(i + 1) * 7919 % max(1, ids.numel() - length) for i in range(samples)]
    prefix = overall = 0.0
    fetched = []
    for b in range(0, samples, batch):
        x = torch.stack([ids[s : s + length] for s in starts[b : b + batch]]).to(device)  # (b, length)
        key = (length, b)
        if key not in references:
            ref = generate(model, x, cache=make_cache(REFERENCE, model), max_new_tokens=new_tokens, stop_at_eos=False)
            references[key] = ref.tokens
        cache = _cache(model, method, budget, options)
        out = generate(model, x, cache=cache, max_new_tokens=new_tokens, stop_at_eos=False).tokens
        for i in range(x.shape[0]):
            p, o = agreement(out[i], references[key][i])
            prefix += p
            overall += o
            print(f"  agreement-{length} {method} budget {budget} sample {b + i}: prefix {p:.2f} overall {o:.2f}",
                  file=sys.stderr, flush=True)
        fetched.append(_fetched(cache))
    return prefix / samples, overall / samples, sum(fetched) / len(fetched)


def short_prompts(tokenizer) -> list[list[int]]:
    """The token ids of tasks.SHORT_PROMPTS: chat messages through the model's chat template."""
    out = []
    for kind, text in task_lib.SHORT_PROMPTS:
        if kind == "chat" and getattr(tokenizer, "chat_template", None):
            out.append(list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                         add_generation_prompt=True, return_dict=True)["input_ids"]))
        else:
            out.append(tokenizer(text)["input_ids"])
    return out


def run_short(model, prompts, method, budget, options, new_tokens, references):
    """Greedy outputs of the short prompts (one at a time, to the first EOS) against the full cache's:
    (share identical, mean tokens equal before the first divergence, fetched share)."""
    device = next(model.parameters()).device
    same = prefix = 0
    fetched = []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=device)
        if i not in references:
            r = generate(model, x, cache=make_cache(REFERENCE, model), max_new_tokens=new_tokens)
            references[i] = r.tokens[0, : r.lengths[0]].tolist()
        cache = _cache(model, method, budget, options)
        r = generate(model, x, cache=cache, max_new_tokens=new_tokens)
        got, ref = r.tokens[0, : r.lengths[0]].tolist(), references[i]
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        same += got == ref
        prefix += first
        fetched.append(_fetched(cache))
        print(f"  short {method} budget {budget} prompt {i} ({len(ids)} tokens): {'identical' if got == ref else f'diverges at {first}'}",
              file=sys.stderr, flush=True)
    n = len(prompts)
    return same / n, prefix / n, sum(fetched) / n


def run_accuracy(model, tokenizer, methods, tasks, budgets, samples, seed, options, lengths=(4000,), data=None,
                 window=4096, prefix=1024, new_tokens=256, out=None, model_name=None, lmeval=None,
                 windows=None, resume=False, batch=4) -> dict:
    """samples: prompts per generated task and length (and ppl windows unless `windows` is given).
    lmeval: {"tasks": [...], "include_path": dir or None, "limit": n or None} for the lmeval task.
    resume: reuse the per-sample results of generated tasks in out/samples.jsonl (same settings).
    batch: prompts of a generated task decoded together (the same tokens as alone, less time)."""
    if {"ppl", "agreement"} & set(tasks):
        text_ids = tokenizer(load_text(data), return_tensors="pt")["input_ids"][0]
    essay = load_essay(data) if ruler.NEEDS_ESSAY & set(tasks) else None
    header = json.loads(json.dumps({"model": model_name or DEFAULT_MODEL, "options": options,
                                    "data": data}, default=str))  # as it reads back from the file
    log = SampleLog(Path(out) / "samples.jsonl" if out else None, header, resume)
    # budgets as named: a sweep compares them, so no floor unless one is given (`infinigen bench accuracy --min-budget`)
    options = {**options, "tokenizer": tokenizer, "min_budget": options.get("min_budget") or 0}
    rows, references = [], {}
    generated = [t for t in tasks if t in GENERATED]
    if generated:
        run_generated(model, tokenizer, generated, methods, budgets, options, lengths, samples, seed, essay, log,
                      batch)

    def row(task, method, budget, metric, value, n, fetched):
        rows.append({"task": task, "method": method, "budget": budget, "metric": metric,
                     "value": round(value, 4), "n": n, "fetched_fraction": round(fetched, 4)})

    for task in tasks:
        for method in methods:
            for budget in (budgets if traits(method).takes_budget else [None]):
                if task == "ppl":
                    ppl, f = run_ppl(model, text_ids, method, budget, options, window, prefix, windows or samples)
                    row("ppl", method, budget, "perplexity", ppl, windows or samples, f)
                    continue
                if task == "lmeval":
                    from .lmeval import run_lmeval

                    opts = {k: v for k, v in {**options, "budget": budget}.items() if v is not None}
                    for r in run_lmeval(model, tokenizer, method, opts, lmeval["tasks"], lmeval.get("include_path"),
                                        lmeval.get("limit")):
                        row(r["task"], method, budget, r["metric"], r["value"], r["n"], r["fetched_fraction"])
                    continue
                if task == "short":
                    prompts = references.setdefault("short-ids", short_prompts(tokenizer))
                    ident, first, f = run_short(model, prompts, method, budget, options, min(new_tokens, 64),
                                                references.setdefault("short", {}))
                    row("short", method, budget, "identical", ident, len(prompts), f)
                    row("short", method, budget, "prefix_tokens", first, len(prompts), f)
                    continue
                for length in lengths:
                    if task == "agreement":
                        p, o, f = run_agreement(model, text_ids, method, budget, options, length, samples,
                                                new_tokens, references)
                        row(f"agreement-{length}", method, budget, "agreement_prefix", p, samples, f)
                        row(f"agreement-{length}", method, budget, "agreement_overall", o, samples, f)
                    elif task in GENERATED:
                        got = [log.done[(task, length, seed + i, method, budget)] for i in range(samples)]
                        metric = "score" if task == "vt" or task in ruler.TASKS else "accuracy"
                        row(f"{task}-{length}", method, budget, metric, sum(r["score"] for r in got) / samples,
                            samples, sum(r["fetched_fraction"] for r in got) / samples)
    suite = [t for t in tasks if t in ruler.TASKS]
    if len(suite) > 1:  # RULER's summary: the mean over its tasks, per method, budget and length
        for length in lengths:
            names = {f"{t}-{length}" for t in suite}
            for key in dict.fromkeys((r["method"], r["budget"]) for r in rows if r["task"] in names):
                got = [r for r in rows if r["task"] in names and (r["method"], r["budget"]) == key]
                row(f"ruler-mean-{length}", *key, "score", sum(r["value"] for r in got) / len(got), samples,
                    sum(r["fetched_fraction"] for r in got) / len(got))
    result = {"model": model_name or DEFAULT_MODEL, "torch": torch.__version__, "rows": rows}
    if out:
        write_reports(result, Path(out))
    return result
