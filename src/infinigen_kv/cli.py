"""`infinigen` command line: generate, calibrate, bench speed/accuracy/busy, serve.

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
from .argtypes import (_budget, _budget_list, _capacity, _choices, _device, _fraction, _int_list, _method_option,
                       _non_negative_int, _number, _port, _positive_int, _seconds, _shape_list, _size, _size_or_off,
                       _temperature, _text_file)
from .config import (DEFAULT_BUDGET, DEFAULT_METHOD, DEFAULT_MIN_BUDGET, DEFAULT_MODEL, KV_DTYPES, LAYER_BUDGETS, LOCAL_LAYERS,
                     PARTIAL_DTYPES, SPECULATE_FROM, InfiniGenConfig)
from .commands import _method_options  # noqa: F401 (tests and scripts import it from here)
from .commands import (CLIError, RunError, _summary, cmd_bench_accuracy, cmd_bench_busy, cmd_bench_speed,
                       cmd_build_kernels, cmd_calibrate, cmd_generate, cmd_serve)
from .methods import registry


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

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but options no parser knows are named with the command's own help (`infinigen serve
        --help`), not the top level's."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = " ".join(c for c in (getattr(parsed, "command", None), getattr(parsed, "bench", None)) if c)
            self.exit(2, f"infinigen: error: unrecognized arguments: {' '.join(extra)} "
                         f"(see {self.prog}{' ' + command if command else ''} --help)\n")
        return parsed


def _add_model_args(p):
    p.add_argument("--model", default=None, help=f"hub id, checkpoint directory or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16, or bf16-weights (CPU: float32 compute and "
                   "KV, bfloat16 linear weights) (default: on CPU float32 compute with the weights held as --weights "
                   "says, on CUDA bf16/fp16)")
    p.add_argument("--weights", choices=["auto", "bfloat16", "int8", "int5", "int4"], default=None,
                   help="CPU: how the linear and embedding weights are held: auto (a GGUF at its own precision, tensor "
                   "by tensor: Q4 blocks as int4 rows, Q5 as int5 rows, Q6_K and Q8_0 as int8 rows, F16/BF16/F32 as "
                   "bfloat16; a checkpoint directory in bfloat16), bfloat16, int8 rows (llama.cpp's q8_0: 32 values a "
                   "float16 scale), int5 rows (32 values a float16 scale and minimum, 6 bits a weight) or int4 rows "
                   "(q4_1, 5 bits a weight); int5 and int4 keep the embedding and LM head as int8 rows (default: auto)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads, fixed (default: all cores; decode steps on fewer while other work keeps them busy)")
    p.add_argument("--device-map", default=None, help="auto: the layers placed across the GPUs, layer by layer (default: none, one device)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="CUDA: decode eagerly, not as one replayed CUDA graph a step")


def _add_method_args(p, single_method=True, budget_list=False, serving=False):
    """serving: the server's subset (every method; no --capacity: --max-pool-bytes bounds it)."""
    if single_method:
        p.add_argument("--method", default=DEFAULT_METHOD, choices=registry.names(serving),
                       help=f"KV-cache method: built in or installed (default: {DEFAULT_METHOD})")
    else:
        p.add_argument("--methods", default="full,infinigen", help="comma-separated methods")
    p.add_argument("--alpha", type=_number("alpha", lambda v: v > 0, "> 0"), default=None, help="InfiniGen threshold: fetch tokens within alpha of the max score (default: %s)" % InfiniGenConfig.alpha)
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
    p.add_argument("--min-saving", type=_number("--min-saving", lambda v: 0.0 <= v < 1.0, "in [0, 1)"), default=None,
                   metavar="SHARE", help="InfiniGen on CPU: speculate only where it saves this share of a decode step's "
                   "bytes (weights + K/V), else attend densely; 0 = wherever it saves any (default: %s)"
                   % InfiniGenConfig.min_saving)
    p.add_argument("--calibration", default=None, help="calibration file to use (default: per-model cache, calibrating on first use)")
    p.add_argument("--gqa-combine", choices=["max", "mean"], default=None,
                   help="InfiniGen: how the query heads of a KV group vote for tokens (default: %s)" % InfiniGenConfig.gqa_combine)
    p.add_argument("--speculate-from", choices=list(SPECULATE_FROM), default=None,
                   help="InfiniGen: speculate each layer's fetch at the previous layer's input (the paper: the fetch "
                   "overlaps its compute on a GPU), at its own (its exact query; on CPU nothing overlaps), or auto: "
                   "own on CPU, previous on a GPU (default: %s)" % InfiniGenConfig.speculate_from)
    p.add_argument("--channel-rule", choices=["q", "qk"], default=None,
                   help="InfiniGen calibration: rank partial channels by |q| (paper) or |q|*|k| (default: %s)"
                   % InfiniGenConfig.channel_rule)
    p.add_argument("--skew", choices=["auto", "svd", "none"], default=None,
                   help="InfiniGen calibration: skewing matrices (svd), raw channels (none), or auto (default: %s)"
                   % InfiniGenConfig.skew)
    p.add_argument("--calibration-text", type=_text_file, default=None, metavar="FILE",
                   help="InfiniGen calibration: a text file to calibrate on (default: the package's own ~2,000-token "
                   "text of prose, code, dialogue and numbers)")
    p.add_argument("--quant-bits", type=int, choices=[4, 8], default=None, help="bits of the quant method (default: 4)")
    p.add_argument("--option", action="append", type=_method_option, default=None, metavar="KEY=VALUE",
                   help="a method's own option, repeatable, given to the methods that take it: quest page_size=16, "
                   "dense_layers=2; snapkv window=32, kernel=5; shadowkv chunk=8, rank=160, local=32, outliers=0.156, "
                   "dense_layers=0; h2o recent_ratio=0.5; streaming sink_tokens=4; an installed method's keywords")
    if not serving:
        p.add_argument("--capacity", type=_capacity, default=None,
                       help="InfiniGen pool limit per layer and sequence: a fraction of the tokens seen, or bytes "
                       "(512MiB) (default: none, the pool holds every token)")
        p.add_argument("--eviction", choices=["fifo", "lru", "counter"], default=None,
                       help="what a full pool evicts (default: counter)")
    p.add_argument("--local-layers", choices=list(LOCAL_LAYERS), default=None,
                   help="InfiniGen on the sliding-window layers of a model that also has global ones (Gemma 3): "
                   "attend each one's whole window, or select within it (default: %s)" % InfiniGenConfig.local_layers)
    p.add_argument("--partial-dtype", choices=list(PARTIAL_DTYPES), default=None,
                   help="InfiniGen's partial key cache: auto (int8 on CPU with the kernels, bfloat16 on a GPU), int8 rows with a "
                   "per-row scale scored by integer dot products, bfloat16, float32, or the model's dtype (default: %s)"
                   % InfiniGenConfig.partial_dtype)
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default=None,
                   help="storage of the K/V rows of every method that keeps them: auto (bfloat16 for a float32 model on CPU, "
                   "the model's dtype on a GPU), float32, bfloat16 (half a float32 model's bytes per token; attention "
                   "computed in float32), or int8 (llama.cpp's q8_0: groups of 32 values, a float16 scale each; 0.53x "
                   "bfloat16's bytes) (default: auto)")
    p.add_argument("--layer-budget", choices=list(LAYER_BUDGETS), default=None,
                   help="InfiniGen: the same budget for every layer, or more for the layers whose speculation recalls "
                   "least on the calibration text (measured once per model), the mean unchanged (default: %s)"
                   % InfiniGenConfig.layer_budget)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="infinigen", description="InfiniGen: LLM inference with the KV cache in host memory and only "
                    "the entries that matter fetched each step; GGUF and safetensors models, CPU and CUDA",
                    formatter_class=Help)
    parser.add_argument("--version", action="version", version=f"infinigen-kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=functools.partial(Parser, formatter_class=Help))

    _add_generate(sub)
    _add_calibrate(sub)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=functools.partial(Parser, formatter_class=Help))
    _add_speed(bsub)
    _add_accuracy(bsub)
    _add_busy(bsub)
    _add_serve(sub)
    k = sub.add_parser("build-kernels", help="compile the CPU kernels for this machine (the install runs it; once "
                       "per machine and version)")
    k.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return parser


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text with a KV-cache method")
    _add_model_args(g)
    g.add_argument("--prompt", help="prompt text; after --prompt-file's text when both are given (a question about a "
                   "document)")
    g.add_argument("--prompt-file", help="file holding the prompt (or the document --prompt asks about)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate")
    _add_method_args(g)
    g.add_argument("--batch", type=_positive_int, default=1, help="run the prompt as a batch of N copies")
    g.add_argument("--temperature", type=_temperature, default=0.0, help="in [0, 2]; 0 = greedy (default)")
    g.add_argument("--top-p", type=_fraction("top-p"), default=1.0, help="nucleus sampling: smallest set of tokens reaching this probability")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message through the model's chat template: for instruct and chat "
                   "models (the default SmolLM2-135M-Instruct, Gemma 3 270M), which answer a message; without it the "
                   "text is continued as written, as a base model would (benchmarks, a document's next words)")
    _add_prefix_args(g, serving=False)
    g.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="calibrate a model (skewing matrices, partial channels) and cache it")
    _add_model_args(c)
    c.add_argument("--text-file", default=None, help="calibration text (default: the package's own text)")
    c.add_argument("--out", default=None, help="directory to write the calibration file to (default: the user cache)")
    c.add_argument("--partial-ratio", type=_fraction("partial-ratio"), default=InfiniGenConfig.partial_ratio,
                   help="share of head channels kept as partial query/key channels")
    c.add_argument("--skew", choices=["auto", "svd", "none"], default="auto",
                   help="skewing: svd, none, or auto (svd where it helps the speculation)")
    c.add_argument("--channel-rule", choices=["q", "qk"], default="qk",
                   help="rank partial channels by |q| (paper) or |q|*|k|")
    c.add_argument("--tokens", type=_positive_int, default=4096, help="calibration tokens")
    c.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_speed(bsub) -> None:
    s = bsub.add_parser("speed", help="decode speed of every method, in one process, interleaved")
    _add_model_args(s)
    _add_method_args(s, single_method=False)
    s.set_defaults(methods="full,infinigen,offload,h2o,streaming,quant")
    s.add_argument("--batch", type=_int_list, default=[4], help="batch sizes, e.g. 1,4,8")
    s.add_argument("--prompt-len", type=_int_list, default=[4096], help="prompt lengths, e.g. 1024,4096")
    s.add_argument("--new-tokens", type=_positive_int, default=32, help="decode steps timed per run")
    s.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per method (median)")
    s.add_argument("--data", default=None, help="text file or directory for the prompts (default: built-in filler)")
    s.add_argument("--out", default=None, help="directory for JSON and markdown results (default: none, stdout only)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_busy(bsub) -> None:
    from .bench.busy import COMPETITORS, SETTINGS

    s = bsub.add_parser("busy", help="speed alone and beside processes that keep every core busy, each run a fresh "
                        "process (bench speed, or generate on --generate's prompt)")
    s.add_argument("--model", default=None, help=f"hub id, checkpoint directory or .gguf file (default: {DEFAULT_MODEL})")
    s.add_argument("--methods", default="full,infinigen", help="comma-separated methods")
    s.add_argument("--shapes", type=_shape_list, default="1x1024,4x4096", help="batch x prompt tokens, e.g. 1x1024,4x4096")
    s.add_argument("--competitors", type=_choices(COMPETITORS), default=",".join(COMPETITORS),
                   help=f"from {', '.join(COMPETITORS)}: none (alone), another PyTorch process multiplying matrices, "
                   "one Python busy loop per core (default: all three)")
    s.add_argument("--settings", type=_choices(SETTINGS), default="default,fixed,threads1",
                   help=f"from {', '.join(SETTINGS)}: threads from the load (the default), --threads 1, every core "
                   "fixed, that with OMP_WAIT_POLICY=PASSIVE, the PyTorch path")
    s.add_argument("--generate", type=_text_file, default=None, metavar="PROMPT.txt",
                   help="run `infinigen generate` on this prompt file (prefill and decode speeds) instead of bench speed")
    s.add_argument("--new-tokens", type=_positive_int, default=32, help="decode steps per run")
    s.add_argument("--repeats", type=_positive_int, default=3, help="bench speed's timed runs per method (median)")
    s.add_argument("--out", default=None, help="directory for busy.json and busy.md (default: none, stdout only)")
    s.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_accuracy(bsub) -> None:
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
    a.add_argument("--data", default=None, help="text for ppl and agreement: a directory with wikitext-2/ (and pg19/ for RULER), or a file (default: none; "
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


def _add_prefix_args(p, serving: bool) -> None:
    """The prefix cache (runtime/prefix.py): prompts' KV blocks kept across requests and reused instead of prefilled.
    Methods whose kept entries depend on the whole prompt (h2o, streaming) and pools with a capacity do not reuse."""
    if serving:
        p.add_argument("--prefix-cache-bytes", type=_size_or_off, default=None, metavar="SIZE",
                       help="host memory for prompts' KV blocks kept across requests (exact reuse of a shared "
                       "prefix: chats, system prompts, documents), e.g. 2GiB; 0 turns it off. It shares "
                       "--max-pool-bytes with the running requests and gives memory back when they need it (default: "
                       "all of that budget). Not for h2o or streaming (their kept entries depend on the whole prompt)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep the blocks on disk under DIR: they survive restarts and " + (
                       "may be shared by several servers on one machine" if serving else
                       "the next command with the same prompt start (a long file, several questions) prefills "
                       "only the rest") + " (default: none)")
    p.add_argument("--prefix-cache-disk-bytes", type=_size, default=None, metavar="SIZE",
                   help="limit of DIR, least recently used blocks removed above it (default: no limit)")


def _add_serve(sub) -> None:
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, streaming)")
    _add_model_args(v)
    _add_method_args(v, serving=True)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    v.add_argument("--port", type=_port, default=8000, help="port to listen on")
    v.add_argument("--served-model-name", default=None, help="model id the server answers with (default: the "
                   f"model's short name: a .gguf file's stem, a checkpoint directory's name, a hub id, {DEFAULT_MODEL} "
                   "for the default model; requests may also name the --model given)")
    v.add_argument("--api-key", default=os.environ.get("INFINIGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $INFINIGEN_API_KEY; none = open)")
    v.add_argument("--max-batch", type=_positive_int, default=8, help="rows of the running batch at most")
    v.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="continuous: requests join and leave the running batch at every step; static: a batch "
                   "forms when none runs and runs to its end (for comparison)")
    v.add_argument("--prefill-chunk", type=_positive_int, default=256,
                   help="prompt tokens prefilled between two decode steps of the running batch; also the prefix "
                   "cache's block (reuse is exact because every prompt is prefilled in these blocks)")
    v.add_argument("--max-pool-bytes", type=_size, default=None, metavar="SIZE",
                   help="KV cache the running requests may hold, e.g. 4GiB: a request starts only when the batch "
                   "with it fits, one that never can is a 400 (default: half the memory free at start: host RAM, "
                   "or GPU memory for methods that keep the cache there)")
    _add_prefix_args(v, serving=True)
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


def _check_inputs(args) -> None:
    """What can be checked without torch, checked first: a missing or empty prompt file, a model path that does not
    exist or is no model, are one line at once, not after torch has loaded."""
    from .model.source import path_error

    error = path_error(getattr(args, "model", None))
    if error is not None:
        raise CLIError(error)
    if args.command == "generate":
        if args.prompt is None and args.prompt_file is None:
            raise CLIError("give the prompt: --prompt TEXT, --prompt-file FILE, or both (the file, then the text)")
        args.prompt_text = args.prompt
        if args.prompt_file is not None:
            path = Path(args.prompt_file)
            if not path.is_file():
                raise CLIError(f"prompt file not found: {args.prompt_file}")
            text = path.read_text(encoding="utf-8", errors="replace")
            # a document and a question about it: the file's text, a blank line, the question (one user message with
            # --chat)
            args.prompt_text = text if args.prompt is None else f"{text.rstrip(chr(10))}\n\n{args.prompt}"
        if not args.prompt_text.strip():
            raise CLIError("the prompt is empty")
    if args.command == "calibrate" and args.text_file is not None and not Path(args.text_file).is_file():
        raise CLIError(f"calibration text file not found: {args.text_file}")
    if getattr(args, "option", None):
        one = vars(args).get("method")  # (generate, serve: one method; bench: --methods)
        methods = [one] if one is not None else [m for m in args.methods.split(",") if m]
        try:
            for key, _ in args.option:
                if not any(registry.method(m).takes(key) for m in methods):
                    raise CLIError(f"--option {key}: no method of {', '.join(methods)} takes it")
        except ValueError as e:  # an unknown or broken method: named by the command, as without options
            raise CLIError(str(e)) from None

def _quiet_transformers() -> None:
    """Where a command brings transformers in (a checkpoint without tokenizer.json, lm-eval), its warnings and loading
    bars stay off; it is never imported for this."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")



def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_inputs(args)
    except CLIError as e:
        print(f"infinigen: error: {e}", file=sys.stderr)
        return 2
    handlers = {"generate": cmd_generate, "calibrate": cmd_calibrate, "serve": cmd_serve,
                "build-kernels": cmd_build_kernels}
    if args.command == "bench":
        handler = {"speed": cmd_bench_speed, "accuracy": cmd_bench_accuracy, "busy": cmd_bench_busy}[args.bench]
    else:
        handler = handlers[args.command]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_transformers()
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

