"""The command line's value types: each turns one option's text into its value, or says in one line what it expected
(argparse prints that line and exits 2; cli.py)."""

from __future__ import annotations

import argparse
import re


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


def _size_or_off(text):
    """A size, or 0 (off)."""
    return 0 if text.strip() == "0" else _size(text)


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


def _shape_list(text):
    """Shapes "BxN" (batch x prompt tokens), comma-separated: [(B, N), ...]."""
    shapes = []
    for t in filter(None, text.split(",")):
        b, sep, n = t.lower().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"a shape is batch x prompt tokens, e.g. 4x4096, not {t!r}")
        shapes.append((_positive_int(b), _positive_int(n)))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def _choices(names):
    """A comma-separated list of names, each one of `names`."""
    def parse(text):
        got = [t for t in text.split(",") if t]
        bad = [t for t in got if t not in names]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else 'nothing'} is not one of {', '.join(names)}")
        return got
    return parse


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


def _text_file(text):
    """A readable file, named as given."""
    from pathlib import Path

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def _method_option(text: str) -> tuple:
    """KEY=VALUE -> (key, value): an integer, a number, true/false, or the text as it is."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (page_size=16), got {text!r}")
    for kind in (int, float):
        try:
            return key.strip(), kind(value)
        except ValueError:
            pass
    return key.strip(), {"true": True, "false": False}.get(value.lower(), value)
