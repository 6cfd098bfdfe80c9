"""What each `infinigen` command does once its arguments are parsed (cli.py): generate, calibrate, bench speed /
accuracy, serve. Each returns the JSON-able result the CLI prints (serve: None, once shut down)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .config import DEFAULT_MODEL, InfiniGenConfig
from .methods import registry


class CLIError(Exception):
    """Bad input: reported as one line, exit status 2."""


class RunError(Exception):
    """A failure at run time that is not a bug (a busy port...): one line, exit status 1."""


def _method_options(args) -> dict:
    kind, value = getattr(args, "capacity", None) or (None, None)
    return {"alpha": args.alpha, "partial_ratio": args.partial_ratio, "budget": args.budget, "min_budget": args.min_budget,
            "min_saving": getattr(args, "min_saving", None), "calibration": args.calibration, "bits": args.quant_bits,
            "eviction": getattr(args, "eviction", None),
            "local_layers": args.local_layers, "layer_budget": args.layer_budget, "gqa_combine": args.gqa_combine,
            "speculate_from": args.speculate_from,
            "channel_rule": args.channel_rule, "skew": args.skew, "calibration_text": args.calibration_text,
            "partial_dtype": getattr(args, "partial_dtype", None), "kv_dtype": getattr(args, "kv_dtype", None),
            "capacity": value if kind == "fraction" else None, "capacity_bytes": value if kind == "bytes" else None,
            **dict(getattr(args, "option", None) or ())}


def _load(args, say: bool = True):
    """The model and tokenizer the arguments name; say: one line on stderr when loaded, with how its weights are held
    (after any one-time conversion's, before any calibration's)."""
    from .model.load import held_summary, load_model

    start = time.perf_counter()
    model, tok = load_model(args.model, args.device, args.dtype, getattr(args, "device_map", None),
                            weights=getattr(args, "weights", None), threads=getattr(args, "threads", None),
                            cuda_graph=not getattr(args, "no_cuda_graph", False))
    if say:
        print(f"infinigen: loaded {args.model or DEFAULT_MODEL} in {time.perf_counter() - start:.2f} s "
              f"({held_summary(model)})", file=sys.stderr, flush=True)
    return model, tok


def cmd_generate(args) -> dict:
    from .bench.report import bytes_read_per_step
    from .methods.base import cache_stats
    from .methods.registry import make_cache
    from .model.load import model_dtype
    from .runtime.generation import generate

    prompt = args.prompt_text  # read and checked by _check_inputs, before torch loads
    model, tok = _load(args)
    if args.chat:
        if not tok.chat_template:
            raise CLIError("--chat: this model's tokenizer has no chat template")
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    enc = tok([prompt] * args.batch, return_tensors="pt", padding=True)
    n = enc["input_ids"].shape[1]
    limit = model.config.max_positions or None
    if limit and n + args.max_new_tokens > limit:
        raise CLIError(f"prompt of {n} token{'s' if n != 1 else ''} + {args.max_new_tokens} new "
                       f"token{'s' if args.max_new_tokens != 1 else ''} exceeds the model's context of {limit}")
    device = next(model.parameters()).device
    cache = make_cache(args.method, model, tokenizer=tok, **_method_options(args))
    prefix = _prefix_store(args, model, cache)  # (bad input: one error line, no other before it)
    res = generate(model, enc["input_ids"].to(device), enc["attention_mask"].to(device), cache=cache,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, progress="generate", prefix=prefix)
    texts = [tok.decode(res.tokens[i, : res.lengths[i]], skip_special_tokens=True) for i in range(args.batch)]
    stats = cache_stats(cache)
    out = {
        "method": args.method,
        "model": args.model or DEFAULT_MODEL,
        "device": str(device),
        "dtype": model_dtype(model),
        "batch": args.batch,
        "prompt_tokens": n,
        "cached_tokens": res.cached_tokens,
        "new_tokens": int(res.tokens.shape[1]),
        "text": texts[0],
        "texts": texts,
        "prefill_s": round(res.prefill_s, 4),
        "decode_s": round(res.decode_s, 4),
        "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
        "fetched_fraction": round(stats.get("fetched_fraction", 1.0), 4),
        "bytes_read_per_step": bytes_read_per_step(model, cache, args.batch, n, res.decode_steps),
    }
    if "bytes_moved" in stats:
        out["bytes_moved"] = stats["bytes_moved"]
    return out


def _prefix_store(args, model, cache):
    """generate's prefix store on disk (--prefix-cache-dir), or None."""
    if args.prefix_cache_dir is None:
        return None
    from .runtime.prefix import PrefixStore

    if args.batch != 1:
        raise CLIError("--prefix-cache-dir serves one prompt (--batch 1)")
    try:  # memory: none beyond this command; the blocks live on disk
        return PrefixStore.for_cache(model, cache, 0, args.prefix_cache_dir, args.prefix_cache_disk_bytes)
    except ValueError as e:
        raise CLIError(f"--prefix-cache-dir: {e}") from None


def cmd_build_kernels(args) -> dict:
    """The CPU kernels compiled for this machine now (kernels.build), not at a user's first command."""
    from .model import kernels

    result = kernels.build()
    if args.json:
        print(result["line"], file=sys.stderr)
        return {k: v for k, v in result.items() if k != "line"}
    return result


def cmd_calibrate(args) -> dict:
    from .methods.infinigen import calibrate
    from .methods.infinigen.calibration import default_path

    model, tok = _load(args)
    cal = calibrate(model, tok, args.text_file, args.partial_ratio, args.channel_rule, args.skew, args.tokens,
                    recall=True)
    config = InfiniGenConfig(partial_ratio=args.partial_ratio, channel_rule=args.channel_rule, skew=args.skew,
                             calibration_text=args.text_file)
    path = default_path(model, config, tok)
    if args.out:
        path = Path(args.out) / path.name
    cal.save(path)
    return {"model": args.model or DEFAULT_MODEL, "path": str(path), **cal.meta,
            "partial_channels": int(cal.channels.shape[-1])}


def _methods(args) -> list[str]:
    methods = [m for m in args.methods.split(",") if m]
    known = registry.names()
    unknown = [m for m in methods if m not in known]
    if unknown or not methods:
        raise CLIError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    for m in methods:  # an installed method's module imported now: a broken one is one line, before any model
        try:
            registry.method(m)
        except ValueError as e:
            raise CLIError(str(e)) from None
    return methods


def cmd_bench_accuracy(args) -> dict:
    from .bench.accuracy import NEEDS_TEXT, TASKS, run_accuracy

    from .bench.ruler import TASKS as RULER

    methods = _methods(args)
    tasks = list(dict.fromkeys(x for t in args.tasks.split(",") if t for x in (RULER if t == "ruler" else [t])))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise CLIError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    if NEEDS_TEXT & set(tasks):
        if args.data is None:
            raise CLIError(f"tasks {', '.join(sorted(NEEDS_TEXT & set(tasks)))} need text: pass --data DIR, a "
                           "folder with wikitext-2/test.txt and pg19/*.txt (WikiText-2's test split, PG-19 books), or any text file")
        if not Path(args.data).exists():
            raise CLIError(f"--data path not found: {args.data}")
    lmeval = None
    if "lmeval" in tasks:
        if not args.lmeval_tasks:
            raise CLIError("the lmeval task needs --lmeval-tasks (and --lmeval-include DIR for local task YAMLs)")
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise CLIError("the lmeval task needs lm-evaluation-harness: pip install 'infinigen-kv[lmeval]'") from None
        lmeval = {"tasks": args.lmeval_tasks.split(","), "include_path": args.lmeval_include, "limit": args.lmeval_limit}
    if args.resume and not args.out:
        raise CLIError("--resume needs --out (the directory of the run to go on from)")
    if args.prefix >= args.window:
        raise CLIError(f"--prefix ({args.prefix}) must be smaller than --window ({args.window})")
    model, tok = _load(args, say=False)
    options = {k: v for k, v in _method_options(args).items() if k != "budget"}
    return run_accuracy(model, tok, methods, tasks, args.budget, args.samples, args.seed, options,
                        lengths=args.lengths, data=args.data, window=args.window, prefix=args.prefix,
                        new_tokens=args.new_tokens, out=args.out, model_name=args.model, lmeval=lmeval,
                        windows=args.windows, resume=args.resume, batch=args.batch)


def cmd_bench_speed(args) -> dict:
    from .bench.speed import machine_info, run_speed
    from .model.load import resolve_device

    methods = _methods(args)
    if args.data is not None and not Path(args.data).exists():
        raise CLIError(f"--data path not found: {args.data}")
    machine = machine_info(resolve_device(args.device))  # before the model: its probe buffer is not in the peak RSS
    model, tok = _load(args, say=False)
    return run_speed(model, tok, methods, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                     _method_options(args), data=args.data, out=args.out, model_name=args.model, machine=machine)


def cmd_bench_busy(args) -> dict:
    from .bench.busy import BusyError, run_busy

    try:
        return run_busy(args.shapes, _methods(args), args.settings, args.competitors, args.new_tokens, args.repeats,
                        model=args.model, prompt_file=args.generate, out=args.out)
    except BusyError as e:
        raise RunError(str(e)) from None


def cmd_serve(args) -> None:
    try:
        from .serve import Engine, listen, run_server
    except ModuleNotFoundError as e:  # the core install has no server
        raise RunError(f"serve needs the server's packages ({e.name} is missing): pip install 'infinigen-kv[serve]'") from None

    try:  # the port first: a busy one fails now, not after the model has loaded
        sock = listen(args.host, args.port)
    except OSError as e:
        raise RunError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (is another server "
                           "running there? pick another --port)") from None
    from .model.source import served_ids

    model_id, aliases = served_ids(args.model, args.served_model_name)
    engine_args = dict(max_batch=args.max_batch, queue_size=args.queue_size, batching=args.batching,
                       prefill_chunk=args.prefill_chunk, max_pool_bytes=args.max_pool_bytes,
                       prefix_cache_bytes=args.prefix_cache_bytes, prefix_cache_dir=args.prefix_cache_dir,
                       prefix_cache_disk_bytes=args.prefix_cache_disk_bytes)
    options = {k: v for k, v in _method_options(args).items() if v is not None}
    if args.replicas is not None:  # Ray Serve: its proxy listens on the port
        sock.close()
        _serve_ray(args, model_id, aliases, options, engine_args)
        return
    try:
        engine = Engine.on_one_thread(lambda: _load(args), args.method, options, **engine_args)
    except BaseException:
        sock.close()
        raise
    print(f"infinigen: serving {model_id} with {args.method} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    run_server(engine, model_id, args.host, args.port, args.api_key, args.max_body_bytes, args.max_tokens_limit,
               args.grace_period, sock, aliases)


def _serve_ray(args, model_id: str, aliases: tuple, options: dict, engine_args: dict) -> None:
    from .serve import ray_app

    try:
        ray_app.import_serve()
    except RuntimeError as e:
        raise RunError(str(e)) from None
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    app = ray_app.application(
        args.replicas, {"name": args.model, "device": args.device, "dtype": args.dtype, "device_map": args.device_map,
                        "weights": args.weights, "cuda_graph": not args.no_cuda_graph},
        args.method, options, engine_args,
        {"model_id": model_id, "aliases": aliases, "api_key": args.api_key, "max_body_bytes": args.max_body_bytes,
         "max_tokens_limit": args.max_tokens_limit},
        gpus=1 if cuda else 0, grace_s=args.grace_period, threads=args.threads)
    print(f"infinigen: serving {model_id} with {args.method} on http://{args.host}:{args.port}/v1 "
          f"({args.replicas} Ray Serve replicas)", file=sys.stderr)
    ray_app.run(app, args.host, args.port, args.ray_address)


def _summary(result: dict) -> str:
    if "kernels" in result and "line" in result:
        return result["line"]
    if result.get("benchmark") == "busy":
        from .bench.busy import markdown_table

        return markdown_table(result)
    if "rows" in result and "machine" in result:
        from .bench.speed import markdown_table

        return markdown_table(result)
    if "rows" in result:
        from .bench.accuracy_report import markdown_table

        return markdown_table(result)
    if "text" in result:
        cached = f" ({result['cached_tokens']} from the prefix cache)" if result.get("cached_tokens") else ""
        n = result["prompt_tokens"]
        return (f"{result['text']}\n\n[{result['method']}] {n} prompt token{'s' if n != 1 else ''}{cached}, "
                f"{result['new_tokens']} new; prefill {result['prefill_s']:.2f}s, decode "
                f"{result['decode_tokens_per_s']:.1f} tok/s, fetched fraction {result['fetched_fraction']:.3f}")
    return "\n".join(f"{k}: {v}" for k, v in result.items())
