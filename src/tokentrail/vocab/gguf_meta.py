"""The metadata of a GGUF file, read straight from its header.

A GGUF file (ggml's docs/gguf.md) starts with the magic ``GGUF``, a version (2 or 3), the
tensor count and the number of metadata key-values, then the key-values themselves: a
length-prefixed UTF-8 key, a value type, the value. A tokenizer lives there as arrays
(``tokenizer.ggml.tokens``, ``token_type``, ``scores``, ``merges``) that hold one entry per
token, 262,144 for Gemma.

`read_metadata` reads the keys asked for and steps over the others, straight from the
file through `mmap` (a model's tensors, which follow the header, are never read). It
exists because the `gguf` package's reader builds a NumPy view for every entry of every
array: 20 s for Gemma 4's vocabulary and 2.4 s for SmolLM2's on this machine, where
llama.cpp loads the same vocabulary in 0.9 s and 0.07 s; here the metadata takes 0.35 s
and 0.04 s, with the stdlib alone (``benchmarks/results/gguf-load.md``). The values are the
ones the `gguf` package reads (the tests hold them equal on every GGUF file they have):
strings as `str`, numbers as Python `int` / `float` / `bool`, arrays as lists. Files of
either byte order are read, as the `gguf` package reads them.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core import TokenizerLoadError

__all__ = ["read_metadata"]

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
#: Fixed-size value types: GGUF type -> (struct format, `array` typecode).
_FIXED = {
    0: ("B", "B"), 1: ("b", "b"), 2: ("H", "H"), 3: ("h", "h"), 4: ("I", "I"),
    5: ("i", "i"), 6: ("f", "f"), 7: ("?", "B"), 10: ("Q", "Q"), 11: ("q", "q"),
    12: ("d", "d"),
}  # fmt: skip


class _Truncated(Exception):
    """The header ends (or a length points) past the end of the file."""


class _Header:
    """A cursor over the header's bytes in one byte order."""

    def __init__(self, data: Any, order: str) -> None:
        self.data = data
        self.end = len(data)
        self.order = order
        self.pos = 0
        self._u32 = struct.Struct(order + "I")
        self._u64 = struct.Struct(order + "Q")

    def take(self, n: int) -> int:
        """The offset of the next `n` bytes, moving past them."""
        at = self.pos
        if n < 0 or at + n > self.end:
            raise _Truncated
        self.pos = at + n
        return at

    def u32(self) -> int:
        return int(self._u32.unpack_from(self.data, self.take(4))[0])

    def u64(self) -> int:
        return int(self._u64.unpack_from(self.data, self.take(8))[0])

    def raw_string(self) -> bytes:
        n = self.u64()
        at = self.take(n)
        return bytes(self.data[at : at + n])

    def strings(self, count: int, key: str | None) -> list[str] | None:
        """The next `count` strings, decoded (`key` names them in an error); None and
        stepped over where `key` is None."""
        if count > (self.end - self.pos) // 8:
            raise _Truncated  # (each takes 8 bytes at least: a corrupt count)
        unpack, data, end, pos = self._u64.unpack_from, self.data, self.end, self.pos
        out: list[str] = []
        for _ in range(count):
            if pos + 8 > end:
                raise _Truncated
            n = unpack(data, pos)[0]
            pos += 8
            if pos + n > end:
                raise _Truncated
            if key is not None:
                try:
                    out.append(str(data[pos : pos + n], "utf-8"))
                except UnicodeDecodeError as e:
                    raise TokenizerLoadError(f"GGUF key {key} is not valid UTF-8: {e}") from None
            pos += n
        self.pos = pos
        return out if key is not None else None

    def fixed(self, kind: int, count: int) -> list[Any]:
        fmt, code = _FIXED[kind]
        size = struct.calcsize(fmt)
        at = self.take(size * count)
        values = array(code)
        values.frombytes(self.data[at : at + size * count])
        if (self.order == "<") != (array("H", [1]).tobytes() == b"\x01\x00"):
            values.byteswap()
        return [bool(v) for v in values] if kind == 7 else values.tolist()


def _check_kind(kind: int, key: str) -> None:
    if kind not in _FIXED and kind not in (STRING, ARRAY):
        raise TokenizerLoadError(f"unknown GGUF value type {kind} for key {key!r}")


def _value(h: _Header, kind: int, key: str, keep: bool) -> Any:
    """The next value, of type `kind`; None where `keep` is false (stepped over)."""
    _check_kind(kind, key)
    if kind == STRING:
        raw = h.raw_string()
        return _text(raw, key) if keep else None
    if kind != ARRAY:
        got = h.fixed(kind, 1)
        return got[0] if keep else None
    inner, count = h.u32(), h.u64()
    _check_kind(inner, key)
    if inner == ARRAY:
        raise TokenizerLoadError(f"GGUF key {key!r} is an array of arrays, which no tokenizer has")
    if inner == STRING:
        return h.strings(count, key if keep else None)
    values = h.fixed(inner, count)
    return values if keep else None


def _text(raw: Any, key: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerLoadError(f"GGUF key {key} is not valid UTF-8: {e}") from e


def read_metadata(path: Path, want: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata key-values of GGUF file `path` whose key `want` accepts (see the
    module). `TokenizerLoadError` naming the file for one that cannot be read."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(memoryview(data), want, path)
    except TokenizerLoadError as e:
        if str(path) in str(e):
            raise
        raise TokenizerLoadError(f"{path}: {e}") from None
    except _Truncated:
        raise TokenizerLoadError(
            f"{path}: not a readable GGUF file: its header is truncated or corrupt"
        ) from None
    except (OSError, ValueError) as e:  # mmap of an empty file is a ValueError
        raise TokenizerLoadError(f"{path}: not a readable GGUF file: {e}") from None


def _read(data: memoryview, want: Callable[[str], bool], path: Path) -> dict[str, Any]:
    try:
        if bytes(data[:4]) != MAGIC:
            raise TokenizerLoadError(f"{path}: not a GGUF file (no GGUF magic bytes)")
        # The version is small: a file written in the other byte order shows it in the
        # high half of the word (as the gguf package tells the two apart).
        (version,) = struct.unpack_from("<I", data, 4)
        order = "<" if version & 0xFFFF else ">"
        h = _Header(data, order)
        h.take(4)
        version = h.u32()
        if version not in (2, 3):
            raise TokenizerLoadError(
                f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)"
            )
        h.u64()  # the tensor count
        meta: dict[str, Any] = {}
        for _ in range(h.u64()):
            key = _text(h.raw_string(), "(a key)")
            kind = h.u32()
            keep = want(key)
            value = _value(h, kind, key, keep)
            if keep:
                meta[key] = value
        return meta
    finally:
        data.release()
