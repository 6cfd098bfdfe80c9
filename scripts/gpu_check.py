"""The GPU check: every step that needs a GPU, in one process, results under --out (scripts/gpu_check.sh runs it).

Steps (each one's result goes to check.json; a step that fails is recorded and the next one runs):
  tests      the CUDA tests and the device-path tests (pytest)
  exact      budget 1.0 equals the full cache: tiny Llama / Qwen2 / Qwen3 / OPT / Gemma 3, fp32 and bf16, batch 1
             and a left-padded batch
  race       artificial delays on the worker, the side stream and the compute stream: tokens must not change
  syncs      host syncs per decode step (torch.cuda.set_sync_debug_mode), by call site
  batching   sequences joining and leaving a running batch (chunked prefill) decode as they do alone
  gather     infinigen 0.1's step (the same model, the last context) for each share of the SMs the row gather's
             programs may take
  speed      decode speed on a Llama-3.1-8B-shaped model with random bf16 weights: full, offload, infinigen at
             budget 0.1 / 0.05; H2D bytes per step, H2D bandwidth, peak device
             memory, the share of the transfer hidden behind compute
  profile    where a step's time goes (torch.profiler) at --profile-at, a trace per infinigen row
  memory     device memory by part at --memory-at (B4 x 32k): full, infinigen 0.1 with bfloat16 / float32 partial
             keys and without the prompt's device mirrors; the prefill's and the decode's peaks
  long       the 8B shape at --long-context (128k) for each batch, filled without a full prefill: full, offload,
             infinigen 0.1 / 0.05; the decode's device peak, the pinned host pool; graph tokens = eager at B1
  serve      `infinigen serve` (full, infinigen) on a Llama of 1B's shape with random weights: --serve-clients
             clients at once with --serve-prompt-token prompts; throughput and time to first token

--dry-run (or DEVICE=cpu) runs every step on CPU at tiny sizes through the same code (the device path's transfer on
CPU stand-ins), so that the script itself is tested without a GPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

import infinigen_kv as ig
from infinigen_kv.methods.infinigen.cache import InfiniGenCache
from infinigen_kv.runtime.generation import generate, prefill

ROOT = Path(__file__).resolve().parent.parent


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Check:
    def __init__(self, device: torch.device, dry: bool, out: Path):
        self.device, self.dry, self.out = device, dry, out
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # calibration, raw traces: not sent back
        self.fake = None  # dry run: CudaTransfer on CPU stand-ins
        self.big = None  # (Llama-3.1-8B-shaped model, calibration file): big()

    def cache(self, method, model, **options):
        """A cache of `method` whose transfers are CudaTransfer's, also on a dry run."""
        cache = ig.make_cache(method, model, **options)
        if self.dry and isinstance(cache, InfiniGenCache):
            from infinigen_kv.testing import on_fake_cuda

            on_fake_cuda(cache, os.environ.get("INFINIGEN_CUDA_FETCH", "uva") != "worker")
        return cache

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def step_tests(c: Check) -> dict:
    # the CPU tests that stand for the GPU's step (static steps, the op trace, the row store under Triton's
    # interpreter) run there too: the GPU machine's torch and Triton
    files = ["tests/test_device_path.py"] + ([] if c.dry else [
        "tests/test_cuda.py", "tests/test_static.py", "tests/test_step_trace.py", "tests/test_store_row.py",
        "tests/test_decode_attention.py", "tests/test_gather_rows.py"])
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if c.dry:
        args += ["-k", "exact_at_full_budget and llama"]  # the script's own test: one quick case
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    (c.out / "tests.log").write_text(r.stdout + r.stderr)
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    return {"ok": r.returncode == 0, "summary": tail}


def tiny(kind: str, c: Check, dtype):
    """A tiny model computing in dtype on the GPU; a dry run's bfloat16 is the CPU's form of it, bfloat16 weights
    with float32 compute (CPU attention in bfloat16 takes other code in eager and static steps: near ties flip)."""
    from infinigen_kv.testing import tiny_model

    if c.dry and dtype == torch.bfloat16:
        return tiny_model(kind, weights="bfloat16")
    return tiny_model(kind).to(c.device, dtype)


def step_exact(c: Check) -> dict:
    from infinigen_kv.testing import left_padded_batch

    rows, ok = [], True
    kinds = ["llama-gqa", "qwen2"] if c.dry else ["llama-mha", "llama-gqa", "qwen2", "qwen3", "opt", "gemma3"]
    dtypes = [torch.float32, torch.bfloat16]
    for kind in kinds:
        for dtype in dtypes:
            model = tiny(kind, c, dtype)
            for lengths in ((64,), (64, 50, 33)):
                ids, mask = (t.to(c.device) for t in left_padded_batch(lengths=lengths))
                kw = dict(max_new_tokens=16, stop_at_eos=False)
                ref = generate(model, ids, mask, cache=ig.make_cache("full", model), **kw).tokens
                got = {}
                for name, method, opts in (("infinigen", "infinigen", dict(alpha=1e9, budget=1.0)),
                                           ("infinigen-worker", "infinigen", dict(alpha=1e9, budget=1.0)),
                                           ("offload", "offload", {})):
                    os.environ["INFINIGEN_CUDA_FETCH"] = "worker" if name.endswith("worker") else "uva"
                    got[name] = generate(model, ids, mask, cache=c.cache(method, model, **opts), **kw).tokens
                os.environ.pop("INFINIGEN_CUDA_FETCH")
                same = {m: round(float((t == ref).float().mean()), 4) for m, t in got.items()}
                if dtype == dtypes[-1]:  # int8 rows, against full over int8 rows (the same stored values)
                    ref8 = generate(model, ids, mask, cache=ig.make_cache("full", model, kv_dtype="int8"), **kw).tokens
                    for name, method, opts in (("infinigen-int8", "infinigen", dict(alpha=1e9, budget=1.0)),
                                               ("offload-int8", "offload", {})):
                        t = generate(model, ids, mask, cache=c.cache(method, model, kv_dtype="int8", **opts), **kw)
                        same[name] = round(float((t.tokens == ref8).float().mean()), 4)
                exact = all(v == 1.0 for v in same.values())
                # bf16: the working set [new token, fetched rows] sums in another order than the full cache's
                # rows: a near-tie may flip (reported, not failed); float32 must be exact
                ok &= exact or dtype != torch.float32
                rows.append({"kind": kind, "dtype": str(dtype).split(".")[-1], "batch": len(lengths),
                             "tokens_equal_to_full": same})
                log(f"  exact {kind} {dtype} B={len(lengths)}: {same}")
    return {"ok": ok, "rows": rows}


def step_race(c: Check) -> dict:
    """Delays where a missing wait would show: the worker sleeps before gathering, the side stream spins before
    its copy, the compute stream spins before reading a slot. Tokens must equal an undelayed run."""
    from infinigen_kv.testing import left_padded_batch
    from infinigen_kv.methods.infinigen import cuda_transfer as tr

    model = tiny("llama-gqa", c, torch.float32)
    ids, mask = (t.to(c.device) for t in left_padded_batch(lengths=(300, 260, 200)))
    opts = dict(budget=0.2, min_budget=0)
    kw = dict(max_new_tokens=24, stop_at_eos=False)
    ref = generate(model, ids, mask, cache=c.cache("infinigen", model, **opts), **kw).tokens
    rnd = random.Random(0)
    spin = (lambda: torch.cuda._sleep(rnd.randint(0, 200_000))) if c.device.type == "cuda" else (lambda: None)
    gather, view_gather, fetch = tr.CudaTransfer._gather_copy, tr.CudaTransfer._prefetch_view, tr.CudaTransfer.fetch

    def slow(original):
        def run(self, *a):
            time.sleep(rnd.random() * 0.003)
            with (torch.cuda.stream(self.stream) if c.device.type == "cuda" else _null()):
                spin()  # the side stream late
            return original(self, *a)
        return run

    def slow_fetch(self, *a, **k):
        spin()
        return fetch(self, *a, **k)

    full = generate(model, ids, mask, cache=ig.make_cache("full", model), **kw).tokens
    same, runs = {}, 4 if not c.dry else 1
    try:
        tr.CudaTransfer._gather_copy, tr.CudaTransfer._prefetch_view = slow(gather), slow(view_gather)
        tr.CudaTransfer.fetch = slow_fetch
        for mode in ("uva", "worker"):
            os.environ["INFINIGEN_CUDA_FETCH"] = mode
            for _ in range(runs):
                for method in ("infinigen", "offload"):
                    cache = c.cache(method, model, **(opts if method == "infinigen" else {}))
                    got = generate(model, ids, mask, cache=cache, **kw).tokens
                    key = f"{method}-{mode}"
                    same[key] = same.get(key, True) and bool(torch.equal(got, ref if method == "infinigen" else full))
    finally:
        tr.CudaTransfer._gather_copy, tr.CudaTransfer._prefetch_view = gather, view_gather
        tr.CudaTransfer.fetch = fetch
        os.environ.pop("INFINIGEN_CUDA_FETCH", None)
    return {"ok": all(same.values()), "runs": runs, "same_tokens": same}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def step_syncs(c: Check) -> dict:
    """Host syncs of the decode steps by call site, per step (B = 1 unpadded, and a left-padded batch)."""
    from infinigen_kv.testing import left_padded_batch

    model = tiny("llama-gqa", c, torch.float32)
    result, ok = {}, True
    for lengths in ((400,), (400, 300)):
        ids, mask = (t.to(c.device) for t in left_padded_batch(lengths=lengths))
        new = 9
        generate(model, ids, mask, cache=c.cache("infinigen", model, budget=0.2, min_budget=0), max_new_tokens=3)
        sites = collections.Counter()

        def on_step(i, *_):
            if c.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn" if i < new - 1 else 0)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(model, ids, mask, cache=c.cache("infinigen", model, budget=0.2, min_budget=0),
                     max_new_tokens=new, stop_at_eos=False, on_step=on_step)
        if c.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message):
                sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
        steps = new - 1
        ours = sum(n for s, n in sites.items() if not s.startswith(("masking_utils", "generation.py")))
        per_step = {s: round(n / steps, 2) for s, n in sites.most_common()}
        result[f"B{len(lengths)}"] = {"syncs_per_step": round(sum(sites.values()) / steps, 2),
                                      "ours_per_step": round(ours / steps, 2), "sites": per_step}
        ok &= ours == 0
        log(f"  syncs B={len(lengths)}: {per_step}")
    return {"ok": ok, **result}


def step_batching(c: Check) -> dict:
    import infinigen_kv.testing as tb

    models = {k: tiny(k, c, torch.float32) for k in (["llama-gqa"] if c.dry else ["llama-gqa", "qwen2", "gemma3"])}
    ok, rows = True, []
    for kind, model in models.items():
        for name, method, options in [("full", "full", {}), ("infinigen-1.0", "infinigen", {"budget": 1.0}),
                                      ("infinigen", "infinigen", {}), ("offload", "offload", {})]:
            a = {"a": (0, tb.prompt(40, 1), 14, None)}
            plan = {**a, "long": (3, tb.prompt(70, 2), 6, None), "short": (5, tb.prompt(9, 3), 12, None),
                    "first": (0, tb.prompt(25, 4), 2, None)}
            alone, shared = tb.run_plan(model, method, options, a), tb.run_plan(model, method, options, plan)
            rows.append({"kind": kind, "method": name, "same_as_alone": shared["a"] == alone["a"]})
            ok &= shared["a"] == alone["a"]
    return {"ok": ok, "rows": rows}


def big_model(c: Check):
    """Llama-3.1-8B's shape with random bf16 weights (a dry run: a small Llama)."""
    from infinigen_kv.testing import random_model

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=4096) if c.dry else dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072)
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_parameters": rope, **shape}
    return random_model(config, torch.float32 if c.dry else torch.bfloat16, c.device)


def big(c: Check):
    """(the Llama-3.1-8B-shaped model, its calibration file), made once for every step that uses them."""
    if c.big is None:
        model = big_model(c)
        cal_path = c.work / "calibration.safetensors"
        ig.calibrate(model, tokens=256 if c.dry else 1024).save(cal_path)
        c.big = (model, cal_path)
    return c.big


def step_speed(c: Check, contexts, batches, new_tokens: int, only=None) -> dict:
    from infinigen_kv.bench.speed import device_bandwidth, h2d_bandwidth

    model, cal_path = big(c)
    h2d = h2d_bandwidth(c.device) if c.device.type == "cuda" else None
    d2d = device_bandwidth(c.device) if c.device.type == "cuda" else None
    embed = model.embed
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - (
        0 if embed is model.lm_head else embed.numel() * embed.element_size())
    eager = {"cuda_graph": False}  # each method's eager step beside its graph
    methods = [("full", "full", {}), ("full-eager", "full", eager), ("offload", "offload", {}),
               ("offload-eager", "offload", eager),
               ("infinigen-0.1", "infinigen", {"budget": 0.1}),
               ("infinigen-0.1-eager", "infinigen", {"budget": 0.1, **eager}),
               ("infinigen-0.05", "infinigen", {"budget": 0.05}),
               ("infinigen-0.1-worker", "infinigen", {"budget": 0.1}),
               ("offload-int8", "offload", {"kv_dtype": "int8"}),  # int8 rows cross PCIe, dequantized on the device
               ("infinigen-0.1-int8", "infinigen", {"budget": 0.1, "kv_dtype": "int8"})]
    methods = [m for m in methods if not only or m[0] in only]
    rows, kv_row = [], None
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(10, model.config.vocab_size, (1, 2048), generator=gen).to(c.device)
    for name, method, opts in methods:  # kernels, plans and pinned blocks made outside the timings
        opts = {**opts, "calibration": str(cal_path)} if method == "infinigen" else opts
        cache_opts = {k: v for k, v in opts.items() if k != "cuda_graph"}
        generate(model, warm, cache=c.cache(method, model, **cache_opts), max_new_tokens=4, stop_at_eos=False,
                 cuda_graph=opts.get("cuda_graph"))
    for B in batches:
        for n in contexts:
            ids = torch.randint(10, model.config.vocab_size, (B, n), generator=gen).to(c.device)
            mask = torch.ones_like(ids)
            full_step = None
            for name, method, opts in methods:
                row = {"method": name, "batch": B, "context": n}
                try:
                    if c.device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(c.device)
                    if method == "infinigen":
                        opts = {**opts, "calibration": str(cal_path)}
                    os.environ["INFINIGEN_CUDA_FETCH"] = "worker" if name.endswith("worker") else "uva"
                    graph = opts.get("cuda_graph")
                    cache = c.cache(method, model, **{k: v for k, v in opts.items() if k != "cuda_graph"})
                    timer = StepTimer(c.device.type == "cuda")
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        res = generate(model, ids, mask, cache=cache, max_new_tokens=new_tokens, stop_at_eos=False,
                                       on_step=timer, cuda_graph=graph)
                    if failed := capture_failures(caught):
                        row["capture_failed"] = failed
                    if hasattr(cache, "transfer"):
                        row["fetch"] = "uva" if getattr(cache.transfer, "uva", False) else "worker"
                    step = statistics.median(timer.steps_ms()) / 1e3  # CUDA events between steps
                    stats = getattr(cache, "stats", {})
                    row.update(decode_tok_s=round(B / step, 2), step_ms=round(step * 1e3, 2),
                               prefill_s=round(res.prefill_s, 2))
                    if kv_row is None:
                        kv_row = 2 * model.config.n_kv_heads * model.config.head_dim * next(
                            model.parameters()).element_size()
                    if stats.get("bytes_moved") is not None and method != "full":
                        row["h2d_mb_per_step"] = round(stats["bytes_moved"] / max(res.decode_steps, 1) / 1e6, 2)
                        row["fetched_fraction"] = round(stats.get("fetched_fraction", 1.0), 4)
                    if c.device.type == "cuda":
                        row["peak_gib"] = round(torch.cuda.max_memory_allocated(c.device) / 2**30, 2)
                    if name == "full":
                        full_step = step
                    if method == "full" and d2d:  # the bytes a step must read: weights (less the input
                        # embedding's table) and the whole K/V, at the device's copy bandwidth
                        kv = model.config.n_layers * B * n * kv_row
                        row["floor_ms"] = round((weights + kv) / d2d * 1e3, 2)
                        row["step_over_floor"] = round(step * 1e3 / row["floor_ms"], 2)
                    if h2d and row.get("h2d_mb_per_step") and full_step:
                        # transfer time at the measured H2D bandwidth; what the step took beyond the full cache's
                        # (all on the device) is the exposed part
                        xfer = row["h2d_mb_per_step"] * 1e6 / h2d
                        row["transfer_ms"] = round(xfer * 1e3, 2)
                        row["hidden_share"] = round(max(0.0, min(1.0, 1 - max(0.0, step - full_step) / xfer)), 3)
                    del cache
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of device memory"
                except Exception as e:  # a method failing is a result: the next one runs
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                os.environ.pop("INFINIGEN_CUDA_FETCH", None)
                rows.append(row)
                log(f"  speed {row}")
    ok = all("error" not in r or r["method"] == "full" for r in rows)
    return {"ok": ok, "h2d_gb_s": round(h2d / 1e9, 2) if h2d else None,
            "d2d_gb_s": round(d2d / 1e9, 1) if d2d else None, "rows": rows}


def capture_failures(caught) -> str | None:
    """The first 'CUDA graph capture failed' warning among those caught (the step then decoded eagerly), else None;
    every caught warning is logged."""
    for w in caught:
        log(f"  warning: {w.category.__name__}: {str(w.message)[:300]}")
    failed = [str(w.message) for w in caught if "graph capture failed" in str(w.message)]
    return failed[0][:300] if failed else None


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


class StepTimer:
    """on_step for generate: a mark before each decode step (a CUDA event on the current stream; the clock on a dry
    run), so a step's time is the device's time between two marks, not the host's guess around a loop."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, i, *_):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def steps_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def profile_rows(events, steps: int) -> dict:
    """Per step, from torch.profiler's key_averages: device time from the device's rows only (kernels, copies, sets:
    an aten op's row repeats the device time of the kernels it launched, so summing every row counts each twice),
    kernels run and launches made (every launch API, and graph launches)."""
    from torch.autograd import DeviceType

    device = [e for e in events if e.device_type != DeviceType.CPU]
    return {"device_ms_per_step": round(sum(e.self_device_time_total for e in device) / steps / 1e3, 2),
            "kernels_per_step": round(sum(e.count for e in device) / steps, 1),
            "launches_per_step": round(sum(e.count for e in events if e.key in LAUNCHES) / steps, 1),
            "top_device": [(e.key, round(e.self_device_time_total / steps / 1e3, 2))
                           for e in sorted(device, key=lambda e: -e.self_device_time_total)[:8]]}


def step_profile(c: Check, n: int, B: int, only=None) -> dict:
    """Where a decode step's time goes (torch.profiler over a few steps, after the capture): the step's time by CUDA
    events, device time from the kernel rows, kernels and launches per step, the top host and device rows, for full
    and infinigen, each replayed as a graph and eager. Each infinigen trace is exported (trace-*.json.gz, for
    chrome://tracing or Perfetto) and read for the share of the transfer's kernel time that runs beside other work."""
    from torch.profiler import ProfilerActivity, profile

    model, cal_path = big(c)
    ids = torch.randint(10, model.config.vocab_size, (B, n), generator=torch.Generator().manual_seed(0)).to(c.device)
    rows = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.device.type == "cuda" else [])
    ig01 = {"budget": 0.1, "calibration": str(cal_path)}
    for name, method, opts, graph in [("full", "full", {}, None), ("full-eager", "full", {}, False),
                                      ("infinigen-0.1", "infinigen", ig01, None),
                                      ("infinigen-0.1-eager", "infinigen", ig01, False),
                                      ("infinigen-0.1-int8", "infinigen", {**ig01, "kv_dtype": "int8"}, None)]:
        if only and name not in only:
            continue
        cache = c.cache(method, model, **opts)
        first, steps = 3, 4  # profile steps 3..6: the graph is captured at step 0
        state, timer = {}, StepTimer(c.device.type == "cuda")

        def on_step(i, *_):
            timer(i)
            if i == first:
                state["prof"] = profile(activities=acts)
                state["prof"].__enter__()
            if i == first + steps:
                c.sync()
                state["prof"].__exit__(None, None, None)

        generate(model, ids, cache=cache, max_new_tokens=first + steps + 1, stop_at_eos=False, on_step=on_step,
                 cuda_graph=graph)
        prof = state["prof"]
        events = prof.key_averages()
        top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
        rows[name] = {"step_ms": round(statistics.median(timer.steps_ms()[first:]), 2),
                      **profile_rows(events, steps),
                      "top_host": [(e.key, round(e.self_cpu_time_total / steps / 1e3, 2), e.count // steps)
                                   for e in top_cpu]}
        if method == "infinigen":
            raw = c.work / f"trace-{name}.json"
            prof.export_chrome_trace(str(raw))
            rows[name]["streams"] = stream_overlap(json.loads(raw.read_text()))
            with open(raw, "rb") as f, gzip.open(c.out / f"trace-{name}.json.gz", "wb") as g:
                g.write(f.read())
        r = rows[name]
        log(f"  profile {name}: {r['step_ms']} ms/step, device {r['device_ms_per_step']} ms, "
            f"{r['kernels_per_step']} kernels, {r['launches_per_step']} launches, streams {r.get('streams')}")
        for k, ms, cnt in rows[name]["top_host"]:
            log(f"     host {ms:8.2f} ms  x{cnt:5d}  {k[:90]}")
        for k, ms in rows[name]["top_device"]:
            log(f"     dev  {ms:8.2f} ms  {k[:90]}")
    return {"ok": True, "batch": B, "context": n, "rows": rows}


TRANSFER_KERNELS = ("vectorized_gather", "scatter_gather", "_gather", "indexSelect", "index_select")


def stream_overlap(trace: dict) -> dict:
    """From a chrome trace: the transfer's kernels (the gathers of fetched rows through the pool's device view; not
    topk's gatherTopK) against every other kernel: their time, and the share of it that overlaps other kernels
    (hidden behind compute). By name, not by stream: a CUDA graph's replay runs its branches on streams of its own."""
    transfer, other = [], []
    for e in trace.get("traceEvents", []):
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            span = (float(e["ts"]), float(e["ts"]) + e["dur"])
            name = e.get("name", "")
            moving = any(k in name for k in TRANSFER_KERNELS) and "topk" not in name.lower()
            (transfer if moving else other).append(span)
    if not transfer:
        return {"transfer_ms": 0.0}
    merged = []  # the other kernels' busy intervals, merged
    for a, b in sorted(other):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts, hidden = [x for x, _ in merged], 0.0
    for a, b in transfer:  # overlap with the merged intervals that start before the span ends
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(merged) and merged[i][0] < b:
            hidden += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
            i += 1
    total = sum(b - a for a, b in transfer)
    streams = {e.get("args", {}).get("stream") for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"}
    return {"transfer_ms": round(total / 1e3, 2), "hidden_share": round(hidden / total, 3), "streams": len(streams)}


def step_gather(c: Check, n: int, batches) -> dict:
    """The row gather's programs against the step: infinigen 0.1's step (graph) at B x n for each share of the SMs
    the gather's programs may take (gather_rows_triton.SM_SHARE; "all": a program per 16 rows), in one process."""
    from infinigen_kv.methods.infinigen import gather_rows_triton as gt

    model, cal_path = big(c)
    rows, default = [], gt.SM_SHARE
    try:
        for B in batches:
            ids = torch.randint(10, model.config.vocab_size, (B, n), generator=torch.Generator().manual_seed(0))
            for share in ("all", 1.0, 0.5, 0.25):
                gt.SM_SHARE = 1e9 if share == "all" else share
                gt._programs.cache_clear()
                timer = StepTimer(c.device.type == "cuda")
                generate(model, ids.to(c.device), cache=c.cache("infinigen", model, budget=0.1,
                                                                 calibration=str(cal_path)),
                         max_new_tokens=24, stop_at_eos=False, on_step=timer)
                rows.append({"batch": B, "context": n, "sm_share": share,
                             "step_ms": round(statistics.median(timer.steps_ms()[2:]), 2)})
                log(f"  gather {rows[-1]}")
    finally:
        gt.SM_SHARE = default
        gt._programs.cache_clear()
    return {"ok": True, "rows": rows}


GiB = 2**30


def device_parts(model, cache, device: torch.device) -> dict:
    """What a cache holds, by part, in GiB: the weights on the device (the input embedding's table included), the
    K/V on the device (a full cache's; InfiniGen's dense layers), the host pool's K/V, the partial keys, the device
    mirrors of a prompt's past, and the fetch buffers (the transfer's working sets and staging slots on the device)."""
    parts = collections.Counter()
    parts["weights"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == device.type)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        pooled = getattr(layer, "dense", True) is False
        for buf in (layer.k, layer.v):
            parts["host pool K/V" if pooled else "device K/V"] += buf.nbytes
        if getattr(layer, "partial", None) is not None:
            parts["partial keys"] += layer.partial.nbytes
        for buf in getattr(layer, "mirror", None) or ():
            parts["prompt mirrors"] += buf.nbytes
    for t in getattr(cache, "transfers", None) and cache.transfers.by_device.values() or ():
        for scratch in [*t.fixed, *t.ring.dev]:
            parts["fetch buffers"] += sum(b.numel() * b.element_size() for b in scratch.bufs.values())
    return {k: round(v / GiB, 3) for k, v in parts.items()}


class Peaks:
    """on_step for generate: the device's peak memory of the prefill (read at step 0), then of the decode steps."""

    def __init__(self, c: Check, timer=None):
        self.c, self.timer, self.prefill = c, timer, None

    def __call__(self, i, *a):
        if i == 0 and self.c.device.type == "cuda":
            self.prefill = torch.cuda.max_memory_allocated(self.c.device) / GiB
            torch.cuda.reset_peak_memory_stats(self.c.device)
        if self.timer is not None:
            self.timer(i, *a)

    def decode(self):
        return torch.cuda.max_memory_allocated(self.c.device) / GiB if self.c.device.type == "cuda" else None


def fresh(c: Check) -> None:
    """Nothing of the last cache left: its device memory back to the driver, its pinned pool to the OS."""
    import gc

    from infinigen_kv.methods.rows import release_pinned

    gc.collect()
    if c.device.type == "cuda":
        torch.cuda.synchronize(c.device)
        torch.cuda.empty_cache()
        release_pinned()
        torch.cuda.reset_peak_memory_stats(c.device)


def step_memory(c: Check, n: int, B: int, new_tokens: int) -> dict:
    """Device memory by part at B x n (a real prefill, then decode steps, graph on): full; infinigen 0.1 with its
    partial keys in bfloat16 (the default on a GPU) and in float32; and with no room for the prompt's device
    mirrors (each prefill chunk reads the past back from the pool). The prefill's peak and the decode's, the step's
    time, and the tokens of each against bfloat16 partial keys' (float32's: the same selection, rounded keys)."""
    from infinigen_kv.methods.infinigen import mirror

    model, cal_path = big(c)
    ids = torch.randint(10, model.config.vocab_size, (B, n), generator=torch.Generator().manual_seed(0)).to(c.device)
    ig01 = {"budget": 0.1, "calibration": str(cal_path)}
    rows, tokens = [], {}
    fits = mirror.fits
    for name, method, opts in [("full", "full", {}), ("infinigen-0.1", "infinigen", ig01),
                               ("infinigen-0.1-f32-partial", "infinigen", {**ig01, "partial_dtype": "float32"}),
                               ("infinigen-0.1-no-mirror", "infinigen", ig01)]:
        fresh(c)
        row = {"method": name, "batch": B, "context": n}
        try:
            if name.endswith("no-mirror"):
                mirror.fits = lambda device, nbytes: False
            cache = c.cache(method, model, **opts)
            timer = StepTimer(c.device.type == "cuda")
            peaks = Peaks(c, timer)
            with StaticSteps(c) as steps:
                res = generate(model, ids, cache=cache, max_new_tokens=new_tokens, stop_at_eos=False, on_step=peaks)
            tokens[name] = res.tokens
            row["static"] = steps.made > 0
            row.update(step_ms=round(statistics.median(timer.steps_ms()[1:]), 2), prefill_s=round(res.prefill_s, 2),
                       parts_gib=device_parts(model, cache, c.device))
            if peaks.prefill is not None:
                row.update(prefill_peak_gib=round(peaks.prefill, 2), decode_peak_gib=round(peaks.decode(), 2))
            if "infinigen-0.1" in tokens:
                row["tokens_equal_bf16_partial"] = round(float((res.tokens == tokens["infinigen-0.1"]).float().mean()), 4)
            row["fetched_fraction"] = round(cache.stats.get("fetched_fraction", 1.0), 4)
            del cache
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of device memory"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            mirror.fits = fits
        rows.append(row)
        log(f"  memory {row}")
    return {"ok": all("error" not in r for r in rows), "rows": rows}


class StaticSteps:
    """Within it: static.StaticDecoder's instances are counted (`made`: whether a run decoded in static steps, as its
    graph replays them) and, on a dry run, static steps serve on CPU as a GPU's graphs would."""

    def __init__(self, c: Check):
        from infinigen_kv.model import static

        self.static, self.dry, self.made = static, c.dry, 0

    def __enter__(self):
        s, counter = self.static, self
        self.saved = s.graphs_on, s.StaticDecoder.__init__
        if self.dry:
            s.graphs_on = lambda model, device, flag=None: flag is not False

        def init(decoder, *a, **k):
            counter.made += 1
            self.saved[1](decoder, *a, **k)

        s.StaticDecoder.__init__ = init
        return self

    def __exit__(self, *exc):
        self.static.graphs_on, self.static.StaticDecoder.__init__ = self.saved
        return False


def fill(cache, n: int) -> None:
    """Every layer's rows [n0, n) made copies of its first n0 (a prefill of n0 tokens): a context of n tokens
    without its prefill, for a step's speed and memory (which follow the sizes, not the values). The copies' partial
    keys are scaled by 1 + 2^-6 x noise (seeded by the layer: two fills are alike): exact copies would tie in every
    score, and the eager and the static selections may break ties apart (other rows, other sums: other tokens)."""
    if hasattr(cache, "settle"):
        cache.settle()  # the prompt's rows have landed in the pool
    for layer in cache.layers:
        bufs = layer.buffers() if hasattr(layer, "buffers") else layer.row_buffers()
        for buf in bufs:
            buf.reserve(n, room=False)
            n0 = done = buf.length
            while done < n:  # doubling: log2(n / n0) copies
                m = min(done, n - done)
                buf.data[:, :, done : done + m].copy_(buf.data[:, :, :m])
                done += m
            buf.length = n
            if buf is getattr(layer, "partial", None) and buf.dtype.is_floating_point:
                gen = torch.Generator(buf.data.device).manual_seed(layer.layer_idx)
                copies = buf.data[:, :, n0:n]
                copies.mul_(1 + 2**-6 * torch.randn(copies.shape, generator=gen, device=copies.device,
                                                     dtype=copies.dtype))
        if hasattr(layer, "seen"):
            layer.seen = n


def filled(c: Check, model, method: str, opts: dict, ids: torch.Tensor, first: int, n: int, room: int):
    """(a fresh cache of `method` holding n tokens per sequence of ids (B, >= first), room for `room` more: a real
    prefill of the first `first`, then `fill`; the prefill's last logits (B, V))."""
    fresh(c)
    cache = c.cache(method, model, **opts)
    cache.reserve(n + room)
    logits = prefill(model, ids[:, :first], cache=cache)
    fill(cache, n)
    c.sync()
    return cache, logits


def step_long(c: Check, n: int, batches, new_tokens: int, only=None) -> dict:
    """The 8B shape at B x n (n to the model's 128k), contexts filled without their prefill (a real prefill of
    FILL tokens, then `fill`): full, offload and infinigen at 0.1 and 0.05 with bfloat16 and int8 rows (one filled
    cache a row format, its budget changed), graph on; the device's peak in decode, the host pool; at B1 infinigen
    0.1's graph tokens against eager ones (each from its own fill)."""
    model, cal_path = big(c)
    first = 256 if c.dry else 4096
    V = model.config.vocab_size
    ig01 = {"budget": 0.1, "calibration": str(cal_path), **({"min_budget": 0} if c.dry else {})}  # (dry: caps differ)
    runs = [("full", "full", {}, (None,), ""), ("offload", "offload", {}, (None,), ""),
            ("infinigen", "infinigen", ig01, (0.1, 0.05), ""),
            ("infinigen", "infinigen", {**ig01, "kv_dtype": "int8"}, (0.1, 0.05), "-int8")]  # half the link's bytes
    rows, ok, graph = [], True, None
    for B in batches:
        ids = torch.randint(10, V, (B, n + new_tokens), generator=torch.Generator().manual_seed(0)).to(c.device)
        for name, method, opts, budgets, suffix in runs:
            names = [name if b is None else f"{name}-{b}{suffix}" for b in budgets]
            if only and not set(names) & set(only):
                continue
            row = {"method": name + suffix, "batch": B, "context": n}
            try:
                t0 = time.perf_counter()
                cache, logits = filled(c, model, method, opts, ids, first, n, len(budgets) * new_tokens)
                row["fill_s"] = round(time.perf_counter() - t0, 1)
                for i, budget in enumerate(budgets):
                    if budget is not None:
                        cache.set_budget(budget)
                    timer = StepTimer(c.device.type == "cuda")
                    peaks = Peaks(c, timer)
                    at = cache.get_seq_length()  # n, then n + new_tokens - 1 (a run's last token is not decoded)
                    with warnings.catch_warnings(record=True) as caught, StaticSteps(c) as steps:
                        warnings.simplefilter("always")
                        res = generate(model, ids[:, :at], cache=cache, max_new_tokens=new_tokens, stop_at_eos=False,
                                       on_step=peaks, prefilled=logits)
                    r = dict(row, method=names[i], static=steps.made > 0)
                    ok &= r["static"]
                    if failed := capture_failures(caught):
                        r["capture_failed"] = failed
                    step = statistics.median(timer.steps_ms()[1:])
                    r.update(step_ms=round(step, 2), decode_tok_s=round(B / step * 1e3, 2),
                             device_peak_gib=round(peaks.decode(), 2) if peaks.decode() is not None else None,
                             parts_gib=device_parts(model, cache, c.device))
                    if getattr(cache, "stats", {}).get("fetched_fraction") is not None and method != "full":
                        r["fetched_fraction"] = round(cache.stats["fetched_fraction"], 4)
                    if B == 1 and names[i] == "infinigen-0.1":
                        graph = res.tokens
                    rows.append(r)
                    log(f"  long {r}")
                del cache
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "error": "out of device memory"})
            except Exception as e:
                rows.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
                ok = False
                log(f"  long {rows[-1]}\n{traceback.format_exc()[-2000:]}")
    same = None
    if graph is not None:  # the same fill decoded eagerly
        ids = torch.randint(10, V, (1, n + new_tokens), generator=torch.Generator().manual_seed(0)).to(c.device)
        cache, logits = filled(c, model, "infinigen", ig01, ids, first, n, 2 * new_tokens)
        with StaticSteps(c) as steps:
            eager = generate(model, ids[:, :n], cache=cache, max_new_tokens=new_tokens, stop_at_eos=False,
                             prefilled=logits, cuda_graph=False).tokens
        same = not steps.made and bool(torch.equal(eager, graph))
        ok &= same
        del cache
        fresh(c)
    return {"ok": ok, "graph_tokens_equal_eager_b1": same, "rows": rows}


def serve_model(c: Check) -> Path:
    """A checkpoint the server loads: a Llama of Llama-3.2-1B's shape (16 layers, 32 / 8 heads of 64, 32k positions;
    a dry run: a tiny one) with random bf16 weights, and a small byte-level BPE tokenizer (its 512 ids the vocabulary),
    saved once under the work folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from infinigen_kv.bench.server import WORDS

    out = c.work / "serve-model"
    if (out / "config.json").is_file():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=4096) if c.dry else dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rope_theta=500000.0)
    cfg = LlamaConfig(vocab_size=len(fast), bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device(c.device):
        model = LlamaForCausalLM(cfg).to(torch.float32 if c.dry else torch.bfloat16).eval()
    model.save_pretrained(out)
    del model
    fresh(c)
    return out


def step_serve(c: Check, n: int, clients: int, new_tokens: int) -> dict:
    """`infinigen serve` on the device, one process per method (full, infinigen), continuous batching, graphs on:
    `clients` clients at once, each one streamed completion of an n-token prompt (random token ids) and new_tokens
    tokens; the throughput (completion tokens over the wall time) and the time to first token (p50, p99). Each
    server's log goes to serve-METHOD.log."""
    import socket
    import threading

    import requests

    from infinigen_kv.bench.server import quantiles, stop

    model_dir = serve_model(c)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(clients)]
    rows, ok = [], True
    for method in ("full", "infinigen"):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        log_path = c.out / f"serve-{method}.log"
        cmd = [sys.executable, "-m", "infinigen_kv.cli", "serve", "--model", str(model_dir), "--method", method,
               "--port", str(port), "--device", c.device.type, "--max-batch", str(clients),
               "--max-tokens-limit", str(new_tokens), "--prefix-cache-bytes", "0"]
        row = {"method": method, "clients": clients, "prompt_tokens": n, "new_tokens": new_tokens}
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env={**os.environ, "PYTHONWARNINGS": "ignore"})
            url = f"http://127.0.0.1:{port}"
            try:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < 300:
                    if proc.poll() is not None:
                        raise RuntimeError(f"the server exited ({proc.returncode}): see {log_path.name}")
                    try:
                        if requests.get(url + "/health", timeout=1).ok:
                            break
                    except requests.RequestException:
                        time.sleep(0.5)
                row["start_s"] = round(time.perf_counter() - t0, 1)
                model_id = requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
                results, errors = [None] * clients, []

                def client(i):
                    try:
                        results[i] = one_client(i)
                    except Exception as e:  # kept for the row: a client that fails says why
                        first = str(e).splitlines()[0][:200] if str(e) else ""
                        errors.append(f"client {i}: {type(e).__name__}: {first}")

                def one_client(i):
                    body = {"model": model_id, "prompt": prompts[i], "max_tokens": new_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
                    start, first, tokens = time.perf_counter(), None, 0
                    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if event.get("choices") and first is None:
                                first = time.perf_counter() - start
                            if event.get("usage"):
                                tokens = event["usage"]["completion_tokens"]
                    return first, tokens, time.perf_counter() - start

                threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
                t1 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t1
                done = [x for x in results if x is not None]
                p50, p99 = quantiles([x[0] for x in done if x[0] is not None])
                row.update(completed=len(done), wall_s=round(wall, 2),
                           tokens_per_s=round(sum(x[1] for x in done) / wall, 2), ttft_p50_s=p50, ttft_p99_s=p99)
                if errors:
                    row["client_errors"] = errors
                ok &= len(done) == clients and all(x[1] == new_tokens for x in done)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                ok = False
            finally:
                if proc.poll() is None:
                    stop(proc)
        if "error" in row or row.get("client_errors"):
            row["log_tail"] = log_path.read_text(errors="replace").splitlines()[-6:]
        rows.append(row)
        log(f"  serve {row}")
    return {"ok": ok, "rows": rows}


def step_graph(c: Check) -> dict:
    """Decode steps replayed as one CUDA graph a step (model/static.py) give the eager steps' tokens and fetched
    shares (full, offload, infinigen at 0.2; greedy, 24 new tokens; float32 and bf16, and int8 rows under bf16;
    unpadded and a left-padded batch)."""
    from infinigen_kv.testing import left_padded_batch

    from infinigen_kv.model import static

    graphs_on = static.graphs_on
    if c.dry:  # no graph on CPU: the static steps a graph would replay, against the eager ones
        static.graphs_on = lambda model, device, flag=None: flag is not False
    try:
        return _graph_rows(c, left_padded_batch)
    finally:
        static.graphs_on = graphs_on


def _graph_rows(c: Check, left_padded_batch) -> dict:
    rows, ok = [], True
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny("llama-gqa", c, dtype)
        int8 = [("offload", {"kv_dtype": "int8"}), ("infinigen", {"budget": 0.2, "min_budget": 0, "kv_dtype": "int8"})]
        for method, opts in [("full", {}), ("offload", {}), ("infinigen", {"budget": 0.2, "min_budget": 0})] + (
                int8 if dtype == torch.bfloat16 else []):
            for lengths in ((300,), (300, 210, 120)):
                ids, mask = (t.to(c.device) for t in left_padded_batch(lengths=lengths))
                out = {}
                failed = None
                for g in (True, False):
                    cache = c.cache(method, model, **opts)
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        res = generate(model, ids, mask, cache=cache, max_new_tokens=24, stop_at_eos=False,
                                       cuda_graph=g)
                    failed = failed or capture_failures(caught)
                    out[g] = (res.tokens, cache.stats.get("fetched_fraction"))
                same = bool(torch.equal(out[True][0], out[False][0]))
                frac = out[True][1] == out[False][1] or abs(out[True][1] - out[False][1]) < 1e-6
                rows.append({"method": method, "dtype": str(dtype), "kv": opts.get("kv_dtype", "auto"),
                             "batch": len(lengths), "same_tokens": same,
                             "same_fetched": frac, **({"capture_failed": failed} if failed else {})})
                ok &= same and frac and (c.dry or not failed)
    log(f"  graph: {rows}")
    return {"ok": ok, "rows": rows}


def step_trace(c: Check) -> dict:
    """The decode step's ops through the PyTorch path (scripts/dev/step_trace.py): kernels per step and per layer for
    full, offload and infinigen, eager and static (what a graph replays), the extra kernels of a speculated layer,
    host reads, two steps alike or not (static: they must be)."""
    from infinigen_kv.testing.steptrace import run, run_static

    model = tiny("llama-gqa", c, torch.float32)
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0)).to(c.device)
    rows = {m: run(model, m, ids, 0.1) for m in ("full", "offload", "infinigen")}
    rows |= {f"{m}-static": run_static(model, m, ids, 0.1) for m in ("full", "offload", "infinigen")}
    full = statistics.median(rows["full"]["per_layer"][2:])  # layers 2 and on (layer 1 also speculates itself)
    for m, r in rows.items():
        r["extra_per_layer"] = statistics.median(r["per_layer"][2:]) - full
        log(f"  trace {m}: {r['ops']} kernels/step, +{r['extra_per_layer']} a layer over full, "
            f"{r['host_reads']} host reads, two steps {'identical' if r['same'] is None else 'differ'}")
    ok = all(r["host_reads"] == 0 for r in rows.values()) and all(
        r["same"] is None for m, r in rows.items() if m.endswith("static"))
    return {"ok": ok, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step on CPU at tiny sizes (tests the script)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/gpu-check")
    ap.add_argument("--steps", default="graph,speed,profile,exact,syncs,race,batching,trace,tests")
    ap.add_argument("--contexts", default=None, help="speed: prompt lengths (default 16384,32768; dry: 256,512)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--methods", default=None, help="speed: these rows only (names as in its table)")
    ap.add_argument("--new-tokens", type=int, default=None, help="speed: decode steps timed (default 32; dry: 4)")
    ap.add_argument("--profile-at", default=None, help="profile: CONTEXTxBATCH (default the first context and batch)")
    ap.add_argument("--profile-methods", default=None, help="profile: these rows only (default: --methods)")
    ap.add_argument("--memory-at", default=None, help="memory: CONTEXTxBATCH (default 32768x4; dry: 256x2)")
    ap.add_argument("--long-context", type=int, default=None,
                    help="long: the context (default 130048: 128k's rows less the new tokens, so that a pinned "
                         "block of a power of two bytes holds them; dry: 512)")
    ap.add_argument("--long-batches", default=None, help="long: batch sizes (default: --batches)")
    ap.add_argument("--long-new-tokens", type=int, default=None, help="long: decode steps (default 12; dry: 4)")
    ap.add_argument("--serve-prompt", type=int, default=None, help="serve: prompt tokens (default 16384; dry: 256)")
    ap.add_argument("--serve-clients", type=int, default=8, help="serve: clients at once")
    ap.add_argument("--serve-new-tokens", type=int, default=None, help="serve: tokens a request (default 64; dry: 8)")
    args = ap.parse_args()
    dry = args.dry_run or os.environ.get("DEVICE") == "cpu"
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (use --dry-run to rehearse on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Check(device, dry, out)
    contexts = [int(x) for x in (args.contexts or ("256,512" if dry else "16384,32768")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    new_tokens = args.new_tokens or (4 if dry else 32)
    only = args.methods.split(",") if args.methods else None

    def shape(text, default):  # "CONTEXTxBATCH" -> (context, batch)
        n, b = (text or default).split("x")
        return int(n), int(b)

    profile_at = shape(args.profile_at, f"{contexts[0]}x{batches[0]}")
    memory_at = shape(args.memory_at, "256x2" if dry else "32768x4")
    long_n = args.long_context or (512 if dry else 130048)
    if dry:
        os.environ["INFINIGEN_KERNELS"] = "0"  # models' backends without the CPU kernels: the PyTorch code a GPU runs
    info = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "dry_run": dry}
    from infinigen_kv import __version__

    info["infinigen_kv"] = __version__
    report = {"machine": info, "steps": {}}
    steps = {"tests": lambda: step_tests(c), "exact": lambda: step_exact(c), "race": lambda: step_race(c),
             "syncs": lambda: step_syncs(c), "batching": lambda: step_batching(c),
             "speed": lambda: step_speed(c, contexts, batches, new_tokens, only),
             "profile": lambda: step_profile(c, *profile_at, args.profile_methods.split(",") if args.profile_methods
                                             else only), "trace": lambda: step_trace(c),
             "memory": lambda: step_memory(c, *memory_at, new_tokens),
             "serve": lambda: step_serve(c, args.serve_prompt or (256 if dry else 16384), args.serve_clients,
                                         args.serve_new_tokens or (8 if dry else 64)),
             "long": lambda: step_long(c, long_n, [int(x) for x in (args.long_batches or args.batches).split(",")],
                                       args.long_new_tokens or (4 if dry else 12), only),
             "graph": lambda: step_graph(c), "gather": lambda: step_gather(c, contexts[-1], batches)}
    for name in args.steps.split(","):
        t0 = time.perf_counter()
        log(f"gpu_check: {name} ...")
        try:
            with torch.inference_mode():
                r = steps[name]()
        except Exception as e:
            r = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        report["steps"][name] = r
        (out / "check.json").write_text(json.dumps(report, indent=1))
        log(f"gpu_check: {name} {'ok' if r['ok'] else 'FAILED'} ({r['seconds']} s)")
    from infinigen_kv.model.triton_kernel import triton_installed

    report["triton"] = triton_installed()  # (a kernel that fails raises: its step's error says which)
    (out / "check.json").write_text(json.dumps(report, indent=1))
    print(summary(report))
    return 0 if all(r["ok"] for r in report["steps"].values()) else 1


def summary(report: dict) -> str:
    lines = [f"# GPU check: {report['machine']['device']}, torch {report['machine']['torch']}, "
             f"{report['machine']['date']}", "", f"Triton installed (its kernels run; a failure is its step's error): {report.get('triton')}",
             ""]
    for name, r in report["steps"].items():
        extra = r.get("summary") or r.get("error", "")
        lines.append(f"- {name}: {'ok' if r['ok'] else 'FAILED'} ({r['seconds']} s) {extra}".rstrip())
    speed = report["steps"].get("speed", {})
    if speed.get("rows"):
        lines += ["", f"H2D bandwidth {speed.get('h2d_gb_s')} GB/s; device copy {speed.get('d2d_gb_s')} GB/s (read + "
                  "written)", "",
                  "| method | B | context | tok/s | step ms | H2D MB/step | transfer ms | hidden | peak GiB | floor ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in speed["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r['error']} | | | | | | |")
                continue
            lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r['decode_tok_s']} | {r['step_ms']} | "
                         f"{r.get('h2d_mb_per_step', '-')} | {r.get('transfer_ms', '-')} | "
                         f"{r.get('hidden_share', '-')} | {r.get('peak_gib', '-')} | {r.get('floor_ms', '-')} |")
        lines += [f"- {r['method']} B{r['batch']} x {r['context']}: graph capture failed, decoded eagerly "
                  f"({r['capture_failed']})" for r in speed["rows"] if r.get("capture_failed")]
    profile = report["steps"].get("profile", {})
    if profile.get("rows"):
        lines += ["", f"Profile at B{profile['batch']} x {profile['context']}:", "",
                  "| method | step ms | device ms | kernels | launches | transfer kernels ms | hidden |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in profile["rows"].items():
            st = r.get("streams") or {}
            lines.append(f"| {name} | {r['step_ms']} | {r['device_ms_per_step']} | {r['kernels_per_step']} | "
                         f"{r['launches_per_step']} | {st.get('transfer_ms', '-')} | {st.get('hidden_share', '-')} |")
    memory = report["steps"].get("memory", {})
    if memory.get("rows"):
        names = sorted({k for r in memory["rows"] for k in r.get("parts_gib", {})})
        lines += ["", "Device memory (GiB) by part:", "",
                  "| method | B | context | prefill peak | decode peak | step ms | prefill s | " + " | ".join(names) + " |",
                  "|---|---|---|---|---|---|---|" + "---|" * len(names)]
        for r in memory["rows"]:
            parts = r.get("parts_gib", {})
            lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r.get('prefill_peak_gib', '-')} | "
                         f"{r.get('decode_peak_gib', '-')} | {r.get('step_ms', r.get('error', '-'))} | "
                         f"{r.get('prefill_s', '-')} | " + " | ".join(str(parts.get(k, 0)) for k in names) + " |")
    long = report["steps"].get("long", {})
    if long.get("rows"):
        lines += ["", f"Long contexts, filled (graph tokens = eager at B1: {long.get('graph_tokens_equal_eager_b1')}):",
                  "", "| method | B | context | step ms | tok/s | device peak GiB | host pool GiB | fetched | fill s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in long["rows"]:
            parts = r.get("parts_gib", {})
            lines.append(f"| {r['method']} | {r['batch']} | {r['context']} | {r.get('step_ms', r.get('error', '-'))} | "
                         f"{r.get('decode_tok_s', '-')} | {r.get('device_peak_gib', '-')} | "
                         f"{parts.get('host pool K/V', '-')} | {r.get('fetched_fraction', '-')} | {r.get('fill_s', '-')} |")
    serve = report["steps"].get("serve", {})
    if serve.get("rows"):
        lines += ["", "The server (continuous batching), clients at once:", "",
                  "| method | clients | prompt | new | tok/s | TTFT p50 s | TTFT p99 s | wall s | start s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in serve["rows"]:
            lines.append(f"| {r['method']} | {r['clients']} | {r['prompt_tokens']} | {r['new_tokens']} | "
                         f"{r.get('tokens_per_s', r.get('error', '-'))} | {r.get('ttft_p50_s', '-')} | "
                         f"{r.get('ttft_p99_s', '-')} | {r.get('wall_s', '-')} | {r.get('start_s', '-')} |")
    syncs = report["steps"].get("syncs", {})
    for key in ("B1", "B2"):
        if key in syncs:
            lines.append(f"\nsyncs per decode step, {key}: {syncs[key]['syncs_per_step']} "
                         f"(ours {syncs[key]['ours_per_step']}): {syncs[key]['sites']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
