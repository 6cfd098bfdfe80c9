"""A GGUF converted once into a safetensors checkpoint, tensor by tensor.

transformers' GGUF path dequantizes every tensor into one dict in float32 before the model sees it: a 7B file
would need ~28 GB at once. Here each tensor is dequantized, mapped to its transformers name (transformers' own
name map and per-architecture fix-ups: Llama's q/k permutation, Gemma's norm offsets) and written in shards of
at most SHARD_BYTES, so a conversion holds about two shards and one tensor. The values are the GGUF's, in float32 (a
float32 model gets exactly them; load_model's bfloat16 weights round them once, when loading).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

SHARD_BYTES = 1 << 29  # a shard is held twice while written (safetensors copies each tensor to bytes)


def convert(path: Path, out: Path) -> None:
    """Write the checkpoint of GGUF `path` (config, tokenizer, weights) to the directory `out`, atomically: a failure
    leaves nothing behind."""
    print(f"converting {path.name} to a safetensors checkpoint in {out.parent} (once) ...", file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(path, out, tmp)
    except BaseException:  # nothing half-written left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert(path: Path, out: Path, tmp: Path) -> None:
    """convert's work, written into `tmp` and then moved to `out`."""
    import gguf
    import numpy as np
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with one_reader():
        reader = gguf.GGUFReader(str(path))  # (shared with transformers' calls)
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
    with torch.device("meta"):  # the skeleton names the tensors; it holds no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures, config.dtype = [type(skeleton).__name__], torch.float32
    config.save_pretrained(str(tmp))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    shards, shard, size, total = [], {}, 0, 0
    for tensor in reader.tensors:
        done = processor.process(weights=gguf.dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                 tensor_key_mapping=names, parsed_parameters={})
        if done.name not in names:
            continue
        t = torch.from_numpy(np.array(done.weights, dtype=np.float32))  # (a copy: the reader's arrays are read-only)
        shard[names[done.name]] = t
        size += t.numel() * 4
        if size >= SHARD_BYTES:
            shards.append(_write(save_file, tmp, shard, len(shards)))
            total, shard, size = total + size, {}, 0
    if shard or not shards:
        shards.append(_write(save_file, tmp, shard, len(shards)))
        total += size
    if len(shards) == 1:
        os.replace(tmp / shards[0][0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, keys in shards for k in keys}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _write(save_file, where: Path, shard: dict, i: int) -> tuple[str, list[str]]:
    name = f"model-{i + 1:05d}.safetensors"
    save_file(shard, str(where / name), metadata={"format": "pt"})
    return name, list(shard)


@contextmanager
def one_reader():
    """transformers parses a GGUF's metadata anew for the tokenizer, the config and the weights: ~25 s each for
    Gemma 3's 262k-token vocabulary (numpy slicing per token). During a conversion they share one reader per
    file (gguf.GGUFReader, which transformers imports at each call; the reader is only read from)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real, readers = gguf.GGUFReader, {}

    def shared(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real
