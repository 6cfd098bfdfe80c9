"""A GGUF file as it lies: its metadata (key -> value) and its tensor table, parsed from the header in one pass;
a tensor's rows read with pread, a slice at a time, so reading a file holds no mapping of it.

The `gguf` package's GGUFReader parses the same header into numpy views of every field: 10-13 s for the 0.5B's and
Gemma 3's vocabularies here (151,936 and 262,144 strings, a numpy slice each), where this parser takes ~0.2 s
(docs/BENCHMARKS.md, "First use"). The package still names the block types and their sizes (gguf.constants) and
dequantizes the types we do not convert ourselves (gguf.quants).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# GGUF value types: uint8, int8, uint16, int16, uint32, int32, float32, bool, string, array, uint64, int64, float64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this package reads (its header is cut short or malformed)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: int  # the GGML block type (gguf.GGMLQuantizationType's value)
    shape: tuple  # as PyTorch names it: (rows, columns) for a matrix; a GGUF lists ne0 (the columns) first
    offset: int  # of its first byte in the file

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.kind).name

    @property
    def columns(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        n = 1
        for s in self.shape[:-1]:
            n *= s
        return n

    @property
    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.kind)]
        return self.columns // block * size

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


class GGUF:
    """metadata: {key: value} (arrays as lists); tensors: {name: Tensor}, in the file's order."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != MAGIC:
                raise GGUFError(f"{self.path} is not a GGUF model (a GGUF file starts with the bytes 'GGUF')")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version < 2:
                raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 and later are)")
            self.metadata, self.tensors = {}, {}
            buf = _Buffer(f, 24)
            for _ in range(n_kv):
                key = buf.string()
                self.metadata[key] = buf.value(buf.u32())
            infos = []
            for _ in range(n_tensors):
                name = buf.string()
                dims = [buf.u64() for _ in range(buf.u32())]
                kind, offset = buf.u32(), buf.u64()
                infos.append((name, tuple(reversed(dims)), kind, offset))
            align = int(self.metadata.get("general.alignment", 32))
            start = -(-buf.pos // align) * align
        for name, shape, kind, offset in infos:
            self.tensors[name] = Tensor(name, kind, shape, start + offset)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch(self, key: str, default=None):
        """The architecture's own key (`qwen2.block_count` for "block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def read(self, t: Tensor, start: int = 0, stop: int | None = None) -> bytes:
        """The bytes of rows [start, stop) of tensor t."""
        stop = t.rows if stop is None else stop
        n = (stop - start) * t.row_bytes
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), n, t.offset + start * t.row_bytes)
        if len(data) != n:
            raise GGUFError(f"{self.path} is cut short: tensor {t.name} runs past the end of the file")
        return data


class _Buffer:
    """The header, read ahead in chunks of the file: little-endian scalars, strings and arrays of them."""

    CHUNK = 1 << 22

    def __init__(self, f, pos: int):
        self.f, self.pos, self.base, self.data = f, pos, pos, b""
        self.size = os.fstat(f.fileno()).st_size

    def _need(self, n: int) -> int:
        """The offset of the next n bytes in self.data (read more where they are not there yet)."""
        if n < 0 or self.pos + n > self.size:  # a length no file this size holds: not a GGUF header
            raise GGUFError(f"{getattr(self.f, 'name', 'the file')} is cut short or is not a GGUF model (its header "
                            "names more bytes than the file has)")
        at = self.pos - self.base
        if at + n > len(self.data):
            self.f.seek(self.pos)
            self.data, self.base, at = self.f.read(max(n, self.CHUNK)), self.pos, 0
            if len(self.data) < n:
                raise GGUFError(f"{getattr(self.f, 'name', 'the file')} ends inside its GGUF header")
        return at

    def unpack(self, fmt: str, size: int):
        at = self._need(size)
        self.pos += size
        return struct.unpack_from(fmt, self.data, at)[0]

    def u32(self) -> int:
        return self.unpack("<I", 4)

    def u64(self) -> int:
        return self.unpack("<Q", 8)

    def string(self) -> str:
        n = self.u64()
        at = self._need(n)
        self.pos += n
        return self.data[at : at + n].decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, n = self.u32(), self.u64()
            if n > self.size - self.pos:
                self._need(n)  # (every item takes a byte at least)
            if inner == STRING:
                return [self.string() for _ in range(n)]
            if inner == ARRAY:
                return [self.value(ARRAY) for _ in range(n)]
            fmt = _SCALARS.get(inner)
            if fmt is None:
                raise GGUFError(f"unknown GGUF value type {inner}")
            size = struct.calcsize(fmt)
            at = self._need(n * size)
            self.pos += n * size
            return list(struct.unpack_from(f"<{n}{fmt[1]}", self.data, at))
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"unknown GGUF value type {kind}")
        return self.unpack(fmt, struct.calcsize(fmt))
