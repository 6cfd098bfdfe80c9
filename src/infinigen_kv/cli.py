"""`infinigen` command line: generate, calibrate, bench speed/accuracy, serve.

Progress goes to stderr; `--json` prints one JSON document on stdout. Bad input exits non-zero with one
line on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from pathlib import Path

from . import __version__
from .config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET, LAYER_BUDGETS, LOCAL_LAYERS, METHOD_NAMES, InfiniGenConfig


class CLIError(Exception):
    """Bad input: reported as one line, exit status 2."""


class RunError(Exception):
    """A failure at run time that is not a bug (a busy port...): one line, exit status 1."""


class Help(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                or "default" in text):
            return text
        if isinstance(default, list):
            default = ",".join(map(str, default))
        return f"{text} (default: {default})".replace("%", "%%").strip()


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump), exit status 2; and a value that
    starts with a minus and a digit ("-1MiB") is a (bad) value, not a missing one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # no option of ours starts with a digit

    def error(self, message):
        self.exit(2, f"infinigen: error: {message} (see {self.prog} --help)\n")


def _number(name, ok, expected):
    """A parser of floats for which ok(v) holds; otherwise one line saying `expected`."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{name} must be {expected}, got {text}")
        return v
    return parse


def _fraction(name):
    return _number(name, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return v


UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes(text) -> int | None:
    """A size with a unit (512MiB, 2GB) or a plain number of bytes; None when it is not one."""
    t = text.strip().lower()
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if t.endswith(u)), None)
    try:
        n = int(float(t[: -len(unit)]) * UNITS[unit]) if unit is not None else int(t)
    except (ValueError, OverflowError):
        return None
    return n if n >= 1 else None


def _size(text):
    n = _bytes(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MB or a number of bytes, got {text!r}")
    return n


def _capacity(text):
    """A fraction of the tokens seen in (0, 1], or a byte limit with a unit (e.g. 512MiB, 2GB)."""
    t = text.strip().lower()
    if any(t.endswith(u) for u in UNITS):
        if (n := _bytes(t)) is not None:
            return ("bytes", n)
    else:
        try:
            v = float(t)
            if 0.0 < v <= 1.0:
                return ("fraction", v)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"capacity must be a fraction in (0, 1] or a size like 512MiB, got {text!r}")


def _device(text):
    """cpu, cuda or cuda:N (checked here: a bad name was a traceback from deep inside torch)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"device must be cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


_temperature = _number("temperature", lambda v: 0.0 <= v <= 2.0, "in [0, 2] (0 = greedy)")  # as the server takes it
_seconds = _number("grace-period", lambda v: 0.0 <= v < float("inf"), ">= 0")


def _port(text):
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {text}")
    return v


def _non_negative_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text}")
    return v


def _int_list(text):
    return [_positive_int(t) for t in text.split(",") if t]


def _add_model_args(p):
    p.add_argument("--model", default=None, help="hub id, checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16, or bf16-weights (CPU: float32 compute and KV, bfloat16 linear "
                   "weights) (default: bf16-weights on CPU, bf16/fp16 on CUDA)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads, fixed (default: all cores, fewer while measured faster on a busy machine; "
                   "see the README, 'CPU decode path')")
    p.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto: layers spread over GPUs (default: none, one device)")


def _budget(text):
    """A fraction of the past in (0, 1] (0.1), or a token count, an integer > 1 (1024)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a number, got {text!r}") from None
    if 0.0 < v <= 1.0:
        return v
    if v > 1 and v == int(v):
        return int(v)
    raise argparse.ArgumentTypeError(f"budget must be a fraction in (0, 1] or a token count (an integer > 1), got {text}")


def _budget_list(text):
    return [_budget(t) for t in text.split(",") if t]


def _add_method_args(p, single_method=True, budget_list=False, serving=False):
    """serving: the server's subset (every method but hf-dynamic; no --capacity: --max-pool-bytes bounds it)."""
    if single_method:
        names = [m for m in METHOD_NAMES if not serving or not m.startswith("hf-")]
        p.add_argument("--method", default="infinigen", choices=names, help="KV-cache method (default: infinigen)")
    else:
        p.add_argument("--methods", default="full,infinigen", help="comma-separated methods")
    p.add_argument("--alpha", type=float, default=None, help="InfiniGen threshold: fetch tokens within alpha of the max score (default: %s)" % InfiniGenConfig.alpha)
    p.add_argument("--partial-ratio", type=_fraction("partial-ratio"), default=None, help="share of head channels used for speculation (default: %s)" % InfiniGenConfig.partial_ratio)
    if budget_list:
        p.add_argument("--budget", type=_budget_list, default=[DEFAULT_BUDGET],
                       help=f"budgets: fractions of the past and/or token counts, e.g. 0.05,0.1,256,1024 (default {DEFAULT_BUDGET})")
    else:
        p.add_argument("--budget", type=_budget, default=None,
                       help=f"cap on fetched (infinigen) or kept (h2o, streaming) tokens per sequence, KV head and layer: a "
                       f"fraction of the past in (0, 1], or a token count like 1024 (default: {DEFAULT_BUDGET})")
    if budget_list:  # a sweep compares budgets as named: no floor unless asked
        p.add_argument("--min-budget", type=_non_negative_int, default=0, metavar="TOKENS",
                       help="floor of the fractional budgets in tokens, as in generate (default: 0, each budget as named)")
    else:
        p.add_argument("--min-budget", type=_non_negative_int, default=None, metavar="TOKENS",
                       help="floor of a fractional budget in tokens: at least this many entries, or the whole past "
                       "when shorter, which is then attended densely; 0 = no floor (default: %d)" % DEFAULT_MIN_BUDGET)
    p.add_argument("--calibration", default=None, help="calibration file to use (default: per-model cache, calibrating on first use)")
    p.add_argument("--quant-bits", type=int, choices=[4, 8], default=None, help="bits of the quant method (default: 4)")
    if not serving:
        p.add_argument("--capacity", type=_capacity, default=None,
                       help="InfiniGen pool limit per layer and sequence: a fraction of the tokens seen, or bytes "
                       "(512MiB) (default: none, the pool holds every token)")
        p.add_argument("--eviction", choices=["fifo", "lru", "counter"], default=None,
                       help="what a full pool evicts (default: counter)")
    p.add_argument("--local-layers", choices=list(LOCAL_LAYERS), default=None,
                   help="InfiniGen on the sliding-window layers of a model that also has global ones (Gemma 3): "
                   "attend each one's whole window, or select within it (default: %s)" % InfiniGenConfig.local_layers)
    p.add_argument("--layer-budget", choices=list(LAYER_BUDGETS), default=None,
                   help="InfiniGen: the same budget for every layer, or more for the layers whose speculation recalls "
                   "least on the calibration text (measured once per model), the mean unchanged (default: %s)"
                   % InfiniGenConfig.layer_budget)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="infinigen", description="InfiniGen KV-cache management for transformers models",
                    formatter_class=Help)
    parser.add_argument("--version", action="version", version=f"infinigen-kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=functools.partial(Parser, formatter_class=Help))

    g = sub.add_parser("generate", help="generate text with a KV-cache method")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (this or --prompt-file)")
    src.add_argument("--prompt-file", help="file holding the prompt")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate")
    _add_method_args(g)
    g.add_argument("--batch", type=_positive_int, default=1, help="run the prompt as a batch of N copies")
    g.add_argument("--temperature", type=_temperature, default=0.0, help="in [0, 2]; 0 = greedy (default)")
    g.add_argument("--top-p", type=_fraction("top-p"), default=1.0, help="nucleus sampling: smallest set of tokens reaching this probability")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON document on stdout")

    c = sub.add_parser("calibrate", help="calibrate a model (skewing matrices, partial channels) and cache it")
    _add_model_args(c)
    c.add_argument("--text-file", default=None, help="calibration text (default: text the model generates itself)")
    c.add_argument("--out", default=None, help="directory to write the calibration file to (default: the user cache)")
    c.add_argument("--partial-ratio", type=_fraction("partial-ratio"), default=InfiniGenConfig.partial_ratio,
                   help="share of head channels kept as partial query/key channels")
    c.add_argument("--skew", choices=["auto", "svd", "none"], default="auto",
                   help="skewing: svd, none, or auto (svd where it helps the speculation)")
    c.add_argument("--channel-rule", choices=["q", "qk"], default="qk",
                   help="rank partial channels by |q| (paper) or |q|*|k|")
    c.add_argument("--tokens", type=_positive_int, default=4096, help="calibration tokens")
    c.add_argument("--json", action="store_true", help="print one JSON document on stdout")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=functools.partial(Parser, formatter_class=Help))
    s = bsub.add_parser("speed", help="decode speed of every method, in one process, interleaved")
    _add_model_args(s)
    _add_method_args(s, single_method=False)
    s.set_defaults(methods="full,infinigen,offload,h2o,streaming,quant,hf-dynamic")
    s.add_argument("--batch", type=_int_list, default=[4], help="batch sizes, e.g. 1,4,8")
    s.add_argument("--prompt-len", type=_int_list, default=[4096], help="prompt lengths, e.g. 1024,4096")
    s.add_argument("--new-tokens", type=_positive_int, default=32, help="decode steps timed per run")
    s.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median)")
    s.add_argument("--data", default=None, help="text file or directory for the prompts (default: built-in filler)")
    s.add_argument("--out", default=None, help="directory for JSON and markdown results (default: none, stdout only)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")

    a = bsub.add_parser("accuracy", help="accuracy of every method through the real decode path")
    _add_model_args(a)
    _add_method_args(a, single_method=False, budget_list=True)
    a.add_argument("--tasks", default="ppl,passkey,niah,vt,agreement",
                   help="comma-separated tasks: ppl, passkey, niah, vt, agreement (default), short (short prompts against "
                   "the full cache, no data needed), lmeval; RULER's "
                   "niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, ruler_vt, ruler_cwe, "
                   "ruler_fwe, or ruler for all of them")
    a.add_argument("--lengths", type=_int_list, default=[4000], help="prompt lengths in tokens, e.g. 2000,4000,6000")
    a.add_argument("--samples", type=_positive_int, default=10, help="prompts (ppl: windows) per task, length and method")
    a.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    a.add_argument("--data", default=None, help="text for ppl and agreement: a directory such as ../shared/data, or a file (default: none; "
                   "those tasks then ask for it)")
    a.add_argument("--window", type=_positive_int, default=4096, help="ppl window W (tokens)")
    a.add_argument("--prefix", type=_positive_int, default=1024, help="ppl prefix P prefilled with full attention")
    a.add_argument("--windows", type=_positive_int, default=None, help="ppl windows (default: --samples)")
    a.add_argument("--new-tokens", type=_positive_int, default=256, help="agreement: greedy tokens generated (short: at most 64)")
    a.add_argument("--batch", type=_positive_int, default=4, help="prompts of a generated task decoded together (the "
                   "same tokens as one by one; memory: batch x methods prefilled caches)")
    a.add_argument("--lmeval-tasks", default=None, help="lmeval task: comma-separated lm-eval task names (default: none)")
    a.add_argument("--lmeval-include", default=None, help="lmeval task: directory of task YAMLs (local data) (default: lm-eval's own)")
    a.add_argument("--lmeval-limit", type=_positive_int, default=None, help="lmeval task: documents per task (default: all)")
    a.add_argument("--out", default=None, help="directory for JSON and markdown results (default: none, stdout only)")
    a.add_argument("--resume", action="store_true", help="go on from the per-sample results a run with the same "
                   "settings left in --out (samples.jsonl); without it a run starts over")
    a.add_argument("--json", action="store_true", help="print one JSON document on stdout")

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, streaming)")
    _add_model_args(v)
    _add_method_args(v, serving=True)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=_port, default=8000, help="port to listen on")
    v.add_argument("--served-model-name", default=None, help="model id clients send (default: --model or "
                   "SmolLM2-135M-Instruct)")
    v.add_argument("--api-key", default=os.environ.get("INFINIGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $INFINIGEN_API_KEY; none = open)")
    v.add_argument("--max-batch", type=_positive_int, default=8, help="rows of the running batch at most")
    v.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="continuous: requests join and leave the running batch at every step; static: a batch "
                   "forms when none runs and runs to its end (for comparison)")
    v.add_argument("--prefill-chunk", type=_positive_int, default=512,
                   help="prompt tokens prefilled between two decode steps of the running batch")
    v.add_argument("--max-pool-bytes", type=_size, default=None, metavar="SIZE",
                   help="KV cache the running requests may hold, e.g. 4GiB: a request starts only when the batch "
                   "with it fits, one that never can is a 400 (default: half the memory free at start: host RAM, "
                   "or GPU memory for methods that keep the cache there)")
    v.add_argument("--queue-size", type=_positive_int, default=64, help="waiting requests before 503")
    v.add_argument("--max-tokens-limit", type=_positive_int, default=2048, help="largest max_tokens accepted")
    v.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20, help="largest request body (413 above)")
    v.add_argument("--replicas", type=_positive_int, default=None,
                   help="serve N replicas on Ray Serve behind its HTTP proxy (needs the ray extra; default: "
                   "the plain single-process server)")
    v.add_argument("--ray-address", default=None, help="with --replicas: a running Ray cluster to join, e.g. auto "
                   "(default: start Ray on this machine)")
    v.add_argument("--grace-period", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: time given to requests in flight before they end with an error event")
    return parser


def _method_options(args) -> dict:
    kind, value = getattr(args, "capacity", None) or (None, None)
    return {"alpha": args.alpha, "partial_ratio": args.partial_ratio, "budget": args.budget, "min_budget": args.min_budget,
            "calibration": args.calibration, "bits": args.quant_bits, "eviction": getattr(args, "eviction", None),
            "local_layers": args.local_layers, "layer_budget": args.layer_budget,
            "capacity": value if kind == "fraction" else None, "capacity_bytes": value if kind == "bytes" else None}


def _load(args):
    from .models import load_model
    from .threads import set_threads

    set_threads(getattr(args, "threads", None))

    return load_model(args.model, args.device, args.dtype, getattr(args, "device_map", None))


def cmd_generate(args) -> dict:
    from .baselines import make_cache
    from .generation import generate
    from .models import model_dtype
    from .report import bytes_read_per_step

    prompt = args.prompt_text  # read and checked by _check_inputs, before torch loads
    model, tok = _load(args)
    if args.chat:
        if not tok.chat_template:
            raise CLIError("--chat: this model's tokenizer has no chat template")
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    enc = tok([prompt] * args.batch, return_tensors="pt", padding=True)
    n = enc["input_ids"].shape[1]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and n + args.max_new_tokens > limit:
        raise CLIError(f"prompt of {n} tokens + {args.max_new_tokens} new tokens exceeds the model's context of {limit}")
    device = next(model.parameters()).device
    cache = make_cache(args.method, model, tokenizer=tok, **_method_options(args))
    res = generate(model, enc["input_ids"].to(device), enc["attention_mask"].to(device), cache=cache,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, progress="generate")
    texts = [tok.decode(res.tokens[i, : res.lengths[i]], skip_special_tokens=True) for i in range(args.batch)]
    stats = getattr(cache, "stats", {})
    out = {
        "method": args.method,
        "model": args.model or "SmolLM2-135M-Instruct",
        "device": str(device),
        "dtype": model_dtype(model),
        "batch": args.batch,
        "prompt_tokens": n,
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


def cmd_calibrate(args) -> dict:
    from .calibrate import calibrate, default_path

    model, tok = _load(args)
    cal = calibrate(model, tok, args.text_file, args.partial_ratio, args.channel_rule, args.skew, args.tokens,
                    recall=True)
    config = InfiniGenConfig(partial_ratio=args.partial_ratio, channel_rule=args.channel_rule, skew=args.skew,
                             calibration_text=args.text_file)
    path = default_path(model, config)
    if args.out:
        path = Path(args.out) / path.name
    cal.save(path)
    return {"model": args.model or "SmolLM2-135M-Instruct", "path": str(path), **cal.meta,
            "partial_channels": int(cal.channels.shape[-1])}


def _methods(args) -> list[str]:
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown or not methods:
        raise CLIError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHOD_NAMES)}")
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
            raise CLIError(f"tasks {', '.join(sorted(NEEDS_TEXT & set(tasks)))} need text: pass --data ../shared/data "
                           "(WikiText-2 test, PG-19 excerpt) or any text file")
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
    model, tok = _load(args)
    options = {k: v for k, v in _method_options(args).items() if k != "budget"}
    return run_accuracy(model, tok, methods, tasks, args.budget, args.samples, args.seed, options,
                        lengths=args.lengths, data=args.data, window=args.window, prefix=args.prefix,
                        new_tokens=args.new_tokens, out=args.out, model_name=args.model, lmeval=lmeval,
                        windows=args.windows, resume=args.resume, batch=args.batch)


def cmd_bench_speed(args) -> dict:
    from .bench.speed import run_speed

    methods = _methods(args)
    if args.data is not None and not Path(args.data).exists():
        raise CLIError(f"--data path not found: {args.data}")
    model, tok = _load(args)
    return run_speed(model, tok, methods, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                     _method_options(args), data=args.data, out=args.out, model_name=args.model)


def cmd_serve(args) -> None:
    from .serve import Engine, listen, run_server

    try:  # the port first: a busy one fails now, not after the model has loaded
        sock = listen(args.host, args.port)
    except OSError as e:
        raise RunError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (is another server "
                           "running there? pick another --port)") from None
    model_id = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    engine_args = dict(max_batch=args.max_batch, queue_size=args.queue_size, batching=args.batching,
                       prefill_chunk=args.prefill_chunk, max_pool_bytes=args.max_pool_bytes)
    options = {k: v for k, v in _method_options(args).items() if v is not None}
    if args.replicas is not None:  # Ray Serve: its proxy listens on the port
        sock.close()
        _serve_ray(args, model_id, options, engine_args)
        return
    try:
        model, tok = _load(args)
        engine = Engine(model, tok, args.method, options, **engine_args)
    except BaseException:
        sock.close()
        raise
    print(f"infinigen: serving {model_id} with {args.method} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    run_server(engine, model_id, args.host, args.port, args.api_key, args.max_body_bytes, args.max_tokens_limit,
               args.grace_period, sock)


def _serve_ray(args, model_id: str, options: dict, engine_args: dict) -> None:
    from .serve import ray_app

    try:
        ray_app.import_serve()
    except RuntimeError as e:
        raise RunError(str(e)) from None
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    app = ray_app.application(
        args.replicas, {"name": args.model, "device": args.device, "dtype": args.dtype, "device_map": args.device_map},
        args.method, options, engine_args,
        {"model_id": model_id, "api_key": args.api_key, "max_body_bytes": args.max_body_bytes,
         "max_tokens_limit": args.max_tokens_limit},
        gpus=1 if cuda else 0, grace_s=args.grace_period, threads=args.threads)
    print(f"infinigen: serving {model_id} with {args.method} on http://{args.host}:{args.port}/v1 "
          f"({args.replicas} Ray Serve replicas)", file=sys.stderr)
    ray_app.run(app, args.host, args.port, args.ray_address)


def _summary(result: dict) -> str:
    if "rows" in result and "machine" in result:
        from .bench.speed import markdown_table

        return markdown_table(result)
    if "rows" in result:
        from .bench.accuracy import markdown_table

        return markdown_table(result)
    if "text" in result:
        return (f"{result['text']}\n\n[{result['method']}] {result['prompt_tokens']} prompt tokens, "
                f"{result['new_tokens']} new; prefill {result['prefill_s']:.2f}s, decode "
                f"{result['decode_tokens_per_s']:.1f} tok/s, fetched fraction {result['fetched_fraction']:.3f}")
    return "\n".join(f"{k}: {v}" for k, v in result.items())


def _check_inputs(args) -> None:
    """What can be checked without torch, checked first: a missing or empty prompt file is one line at once,
    not after the model has loaded."""
    if args.command == "generate":
        if args.prompt_file is not None:
            path = Path(args.prompt_file)
            if not path.is_file():
                raise CLIError(f"prompt file not found: {args.prompt_file}")
            args.prompt_text = path.read_text(encoding="utf-8", errors="replace")
        else:
            args.prompt_text = args.prompt
        if not args.prompt_text.strip():
            raise CLIError("the prompt is empty")
    if args.command == "calibrate" and args.text_file is not None and not Path(args.text_file).is_file():
        raise CLIError(f"calibration text file not found: {args.text_file}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_inputs(args)
    except CLIError as e:
        print(f"infinigen: error: {e}", file=sys.stderr)
        return 2
    handlers = {"generate": cmd_generate, "calibrate": cmd_calibrate, "serve": cmd_serve}
    if args.command == "bench":
        handler = cmd_bench_speed if args.bench == "speed" else cmd_bench_accuracy
    else:
        handler = handlers[args.command]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # weight-loading bars; ours (calibration, decode) stay
    try:
        result = handler(args)
    except CLIError as e:
        print(f"infinigen: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RunError) as e:  # ModelLoadError, UnsupportedModelError, ConfigError, ...
        print(f"infinigen: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infinigen: error: interrupted", file=sys.stderr)
        return 130
    if result is None:  # serve: ran until shut down
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
