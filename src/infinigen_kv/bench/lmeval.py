"""lm-evaluation-harness adapter: any method's cache behind lm-eval's `LM` interface, through the real
decode path (the context is prefilled with full attention; every continuation token goes one step at a
time through the cache under test, as in decode-mode perplexity).

Needs `pip install lm_eval` (optional) and the task's data locally: point `include_path` at a directory of
task YAMLs whose `dataset_path`/`data_files` name local files (docs/cli.md, "lm-evaluation-harness tasks").
"""

from __future__ import annotations

import functools

import torch

from ..methods.base import cache_stats
from ..methods.registry import make_cache
from ..runtime.generation import generate


def _lm_base():
    try:
        from lm_eval.api.model import LM
    except ImportError as e:  # optional dependency
        raise ImportError("the lmeval task needs lm-evaluation-harness: pip install lm_eval") from e
    return LM


def make_lm(model, tokenizer, method: str, options: dict, max_gen_toks: int = 64):
    """An lm-eval `LM` that scores and generates with `method`'s cache."""

    class CacheLM(_lm_base()):
        def __init__(self):
            super().__init__()
            self.device_ = next(model.parameters()).device
            self.fetched = []

        def _cache(self):
            return make_cache(method, model, **{k: v for k, v in options.items() if v is not None})

        def _ids(self, text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        @torch.inference_mode()
        def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
            """log p(continuation | context) and whether greedy decoding would produce it."""
            if not context:
                context = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
            cache = self._cache()
            x = torch.tensor([context + continuation], device=self.device_)
            n = len(context)
            logits = model(input_ids=x[:, :n], past_key_values=cache, logits_to_keep=1).logits[:, -1]
            total, greedy = 0.0, True
            for i, tok in enumerate(continuation):
                logp = torch.log_softmax(logits.float(), dim=-1)[0]
                total += logp[tok].item()
                greedy &= int(logp.argmax()) == tok
                if i + 1 < len(continuation):
                    logits = model(input_ids=x[:, n + i : n + i + 1], past_key_values=cache).logits[:, -1]
            self.fetched.append(cache_stats(cache).get("fetched_fraction", 1.0))
            return total, greedy

        def loglikelihood(self, requests):
            out = []
            for req in requests:
                context, continuation = req.args
                out.append(self._score(self._ids(context), self._ids(continuation)))
            return out

        def loglikelihood_rolling(self, requests):
            return [self._score([], self._ids(req.args[0]))[0] for req in requests]

        def generate_until(self, requests):
            out = []
            for req in requests:
                context, kwargs = req.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else until
                ids = torch.tensor([self._ids(context)], device=self.device_)
                cache = self._cache()
                r = generate(model, ids, cache=cache, max_new_tokens=int(kwargs.get("max_gen_toks", max_gen_toks)),
                             temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0)
                text = tokenizer.decode(r.tokens[0, : r.lengths[0]], skip_special_tokens=True)
                for stop in until:
                    text = text.split(stop)[0]
                self.fetched.append(cache_stats(cache).get("fetched_fraction", 1.0))
                out.append(text)
            return out

    return CacheLM()


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None):
    """lm-eval's index of its tasks (and those under include_path): built once per run, not per method (it reads
    every task's YAML: 12-17 s on a 2-core machine)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def run_lmeval(model, tokenizer, method: str, options: dict, tasks: list[str], include_path: str | None = None,
               limit: int | None = None) -> list[dict]:
    """Rows {task, metric, value, n, fetched_fraction} of lm-eval's results for `tasks`."""
    _lm_base()
    from lm_eval import simple_evaluate

    lm = make_lm(model, tokenizer, method, options)
    res = simple_evaluate(model=lm, tasks=tasks, task_manager=_task_manager(include_path), limit=limit,
                          log_samples=False, bootstrap_iters=0)
    fetched = sum(lm.fetched) / len(lm.fetched) if lm.fetched else 1.0
    rows = []
    for task, metrics in res["results"].items():
        n = res.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            if "," not in key or "stderr" in key or not isinstance(value, (int, float)):
                continue  # metrics are "name,filter"; skip aliases, sample counts and stderrs
            rows.append({"task": f"lmeval:{task}", "metric": key.split(",")[0], "value": float(value), "n": n,
                         "fetched_fraction": fetched})
    return rows
