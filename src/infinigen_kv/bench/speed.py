"""`infinigen bench speed`: decode throughput of every method in one process, interleaved, after a warm-up,
as medians over repeats (ratios of speeds are only quoted when measured this way)."""

from __future__ import annotations

import sys
import statistics
import time
from pathlib import Path

import torch

from .. import __version__

from ..config import DEFAULT_MODEL
from ..methods.base import cache_stats
from ..methods.registry import REFERENCE, make_cache
from ..model.load import model_dtype
from ..runtime.generation import generate
from .report import bytes_read_per_step
from . import cpu_name, save_plot, write_tables
from .tasks import passkey


def memory_bandwidth(device: torch.device, mbytes: int | None = None, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` reductions over a buffer far larger than caches (256 MB on
    CPU, ~4x a large L3; 512 MB on a GPU). `bench speed` measures it before loading the model, so that the buffer
    (freed) is not part of the peak memory it reports."""
    mbytes = mbytes or (512 if device.type == "cuda" else 256)
    x = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def _best_copy_s(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """The fastest of `repeats` copies src -> dst on the GPU, in seconds (CUDA events)."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def h2d_bandwidth(device: torch.device, mbytes: int = 256, repeats: int = 5) -> float:
    """Host-to-device bandwidth in bytes/s from pinned memory: the best of `repeats` copies."""
    src = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, pin_memory=True)
    return src.nbytes / _best_copy_s(torch.empty_like(src, device=device), src, repeats)


def device_bandwidth(device: torch.device, mbytes: int = 2048, repeats: int = 5) -> float:
    """The device memory's bandwidth in bytes/s, bytes read and written counted: the best of `repeats` copies."""
    src = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    return 2 * src.nbytes / _best_copy_s(torch.empty_like(src), src, repeats)


def machine_info(device: torch.device) -> dict:
    info = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "infinigen_kv": __version__,
        "device": str(device),
        "read_bandwidth_gb_s": round(memory_bandwidth(device) / 1e9, 2),
        "date": time.strftime("%Y-%m-%d"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["h2d_bandwidth_gb_s"] = round(h2d_bandwidth(device) / 1e9, 2)
    return info


def prompts(tokenizer, batch: int, length: int, data: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `batch` prompts of exactly `length` tokens: slices of the data text
    when given, else passkey filler prompts (different seeds per row)."""
    rows = []
    if data is not None:
        path = Path(data)
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        ids = torch.cat([tokenizer(f.read_text(encoding="utf-8", errors="replace"), return_tensors="pt")["input_ids"][0]
                         for f in files])
        if ids.numel() < batch * length:
            ids = ids.repeat(-(-batch * length // ids.numel()))
        rows = [ids[i * length : (i + 1) * length] for i in range(batch)]
    else:
        for i in range(batch):
            ids = tokenizer(passkey(tokenizer, length + 64, seed=i).prompt, return_tensors="pt")["input_ids"][0]
            rows.append(ids[-length:])
    ids = torch.stack(rows)
    return ids, torch.ones_like(ids)


def run_once(model, method, ids, mask, new_tokens, options, label=None):
    """One timed run; label: the run's name in the prefill's progress on stderr (a long prompt's prefill takes
    minutes: tokens done, tokens/s, time left)."""
    cache = make_cache(method, model, **options)
    res = generate(model, ids, mask, cache=cache, max_new_tokens=new_tokens, stop_at_eos=False, progress=label)
    stats = cache_stats(cache)
    return res, stats, bytes_read_per_step(model, cache, ids.shape[0], ids.shape[1], res.decode_steps)


def run_speed(model, tokenizer, methods, batches, prompt_lens, new_tokens, repeats, options,
              data=None, out=None, model_name=None, machine=None) -> dict:
    """`machine`: machine_info(device), measured before the model loaded (so that the bandwidth probe's buffer is
    not part of the process's peak memory), or measured here."""
    device = next(model.parameters()).device
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("tokenizer", tokenizer)
    machine = machine or machine_info(device)
    # Warm-up (also calibrates on first use, outside the timings).
    wids, wmask = prompts(tokenizer, 1, 128, data)
    for method in methods:
        run_once(model, method, wids.to(device), wmask.to(device), 4, options)
    rows = []
    for B in batches:
        for n in prompt_lens:
            ids, mask = prompts(tokenizer, B, n, data)
            ids, mask = ids.to(device), mask.to(device)
            runs = {m: [] for m in methods}
            for rep in range(repeats):
                for method in methods:  # interleaved: drift of a noisy machine hits every method alike
                    runs[method].append(run_once(model, method, ids, mask, new_tokens, options,
                                                 f"bench speed {method} B{B} x {n}"))
                    r = runs[method][-1][0]
                    print(f"  B={B} n={n} {method} rep {rep}: {r.decode_tokens_per_s:.2f} tok/s", flush=True,
                          file=sys.stderr)
            for method in methods:
                rows.append(summarize(method, B, n, new_tokens, runs[method], machine))
    result = {"model": model_name or DEFAULT_MODEL, "dtype": model_dtype(model), "machine": machine, "options": {
        k: v for k, v in options.items() if k != "tokenizer"}, "rows": rows}
    if out:
        write_reports(result, Path(out))
    return result


def summarize(method, batch, prompt_len, new_tokens, runs, machine) -> dict:
    """One row from the repeats of one method: medians, and the step time against the bytes floor (the
    bytes one step must read over the measured read bandwidth; on CUDA also the bytes moved host to
    device over the measured H2D bandwidth)."""
    res = [r for r, _, _ in runs]
    stats, read = runs[-1][1], runs[-1][2]
    tps = statistics.median(r.decode_tokens_per_s for r in res)
    step_s = batch / tps if tps > 0 else float("inf")  # every sequence advances one token per step
    floor_s = read / (machine["read_bandwidth_gb_s"] * 1e9)
    row = {
        "method": method, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "decode_tokens_per_s": round(tps, 3),
        "prefill_s": round(statistics.median(r.prefill_s for r in res), 4),
        "fetched_fraction": round(stats.get("fetched_fraction", 1.0), 4),
        "bytes_read_per_step": read,
        "pool_bytes": stats.get("pool_bytes"),  # the cache's K/V memory at the end of the run
        "step_s": round(step_s, 5),
        "floor_s": round(floor_s, 5),
        "step_over_floor": round(step_s / floor_s, 3) if floor_s > 0 else None,
        "repeats": len(runs),
    }
    steps = max(res[-1].decode_steps, 1)
    if "h2d_bandwidth_gb_s" in machine and stats.get("bytes_moved"):
        row["bytes_moved_per_step"] = stats["bytes_moved"] // steps
        row["h2d_floor_s"] = round(row["bytes_moved_per_step"] / (machine["h2d_bandwidth_gb_s"] * 1e9), 5)
    return row


def write_reports(result: dict, out: Path) -> list[Path]:
    """speed.json, speed.md and one PNG per batch size: decode tokens/s vs prompt length, a line per method."""
    written, plt = write_tables(result, out, "speed", markdown_table(result))
    if plt is None:
        return written
    for B in dict.fromkeys(r["batch"] for r in result["rows"]):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for method in dict.fromkeys(r["method"] for r in result["rows"]):
            pts = sorted((r["prompt_len"], r["decode_tokens_per_s"]) for r in result["rows"]
                         if r["batch"] == B and r["method"] == method)
            ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {B}, {result['machine']['device']}")
        written.append(save_plot(plt, fig, ax, out / f"speed-batch{B}.png"))
    return written


def markdown_table(result: dict) -> str:
    """Rows with each method's speed-up over `full` at the same (batch, prompt length)."""
    base = {(r["batch"], r["prompt_len"]): r["decode_tokens_per_s"] for r in result["rows"] if r["method"] == REFERENCE}
    lines = ["| method | batch | prompt | decode tok/s | vs full | prefill s | fetched | MB read/step | step / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ref = base.get((r["batch"], r["prompt_len"]))
        ratio = f"{r['decode_tokens_per_s'] / ref:.2f}x" if ref else "-"
        floor = f"{r['step_over_floor']:.2f}" if r.get("step_over_floor") else "-"
        lines.append(f"| {r['method']} | {r['batch']} | {r['prompt_len']} | {r['decode_tokens_per_s']:.2f} | {ratio} | "
                     f"{r['prefill_s']:.2f} | {r['fetched_fraction']:.3f} | {r['bytes_read_per_step'] / 1e6:.0f} | "
                     f"{floor} |")
    return "\n".join(lines)
