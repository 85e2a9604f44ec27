"""Reading a model folder's files, bounded: what a broken or hostile folder can make the
process read or allocate before it is refused.

* Only regular files are read (a symlink is followed to one): a FIFO would hang start-up,
  ``/dev/zero`` would be read until memory runs out. The file is opened without blocking
  and checked on its open descriptor, so it cannot be swapped between the check and the
  read.
* Each kind of file has a size cap (`CONFIG_BYTES`, `TOKENIZER_BYTES`,
  `HEADER_BYTES`), checked before reading.
* JSON nested too deeply, or not an object where one is expected, is refused.
* A safetensors file's header is read alone (8 bytes of length, then the JSON header)
  and checked: known dtypes, shapes of non-negative ints, each tensor's byte range
  exactly its shape's size, the ranges tiling the data, and the data exactly the rest of
  the file. The weights themselves are not read here.

Every refusal is a `FolderError` (a ``ValueError``) naming the file. Light on purpose (no
torch): a router resolves tokenizers through it.

Owns: reading a folder's files. Must not touch: what the files mean (the loader and the
tokenizers decide).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_BYTES = 1 << 20  # config.json, tokenizer_config.json: a real one is a few KB
TOKENIZER_BYTES = 256 << 20  # tokenizer.json: Gemma 3's is 33 MB
HEADER_BYTES = 100 << 20  # a safetensors header (the safetensors library's own cap)

# safetensors dtypes and their sizes in bytes
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
    "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class FolderError(ValueError):
    """A model folder's file cannot be used: one line naming the file and why."""


def read_bytes(path: str | Path, cap: int) -> bytes:
    """The contents of the regular file ``path`` (a symlink followed), at most ``cap``
    bytes.

    Raises:
        FileNotFoundError: there is no such file.
        FolderError: it is not a regular file, or holds more than ``cap`` bytes.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FolderError(f"{path}: cannot be opened ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FolderError(f"{path}: not a regular file ({_kind(info.st_mode)}); refused")
        if info.st_size > cap:
            raise FolderError(f"{path}: {info.st_size:,} bytes, more than the {cap:,} "
                              "such a file may hold")  # fmt: skip
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:  # it grew meanwhile
        raise FolderError(f"{path}: more than the {cap:,} bytes such a file may hold")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a plain file"


def read_json(path: str | Path, cap: int = CONFIG_BYTES) -> dict[str, Any]:
    """A JSON object from the regular file ``path`` (see `read_bytes`).

    Raises:
        FileNotFoundError: there is no such file.
        FolderError: not a regular file, over ``cap``, not JSON, nested too deeply, or
            not an object.
    """
    return parse_json(read_bytes(path, cap), path)


def parse_json(data: bytes, where: str | Path) -> dict[str, Any]:
    """``data`` as a JSON object; errors name ``where``."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise FolderError(f"{where}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FolderError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise FolderError(f"{where}: must be a JSON object, got {type(value).__name__}")
    return value


def regular_file(path: Path) -> Path:
    """``path`` if it is a regular file (a symlink followed to one).

    Raises:
        FolderError: it is something else (a FIFO, a device, a directory).
    """
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise FolderError(f"{path}: not a regular file ({_kind(mode)}); refused")
    return path


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header says."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def safetensors_index(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor the ``files`` hold, from their headers alone, each header checked
    against its file (see the module docstring).

    Raises:
        FolderError: a file that is not a safetensors file as its header says, or a
            tensor named in two files.
    """
    index: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in _header(path).items():
            if name in index:
                raise FolderError(f"{path}: tensor {name} is in {index[name].file.name} too")
            index[name] = info
    return index


def _header(path: Path) -> dict[str, TensorInfo]:
    regular_file(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FolderError(f"{path}: too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(HEADER_BYTES, size - 8):
            raise FolderError(f"{path}: a safetensors header of {n:,} bytes, in a file of "
                              f"{size:,}")  # fmt: skip
        header = parse_json(f.read(n), path)
    header.pop("__metadata__", None)
    out, ranges = {}, []
    for name, entry in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(entry, dict):
            raise FolderError(f"{where}: not a tensor entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise FolderError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            type(d) is int and 0 <= d < 1 << 40 for d in shape
        ):
            raise FolderError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int for x in offsets)):  # fmt: skip
            raise FolderError(f"{where}: data_offsets {offsets!r} are not two ints")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != nbytes or offsets[0] < 0:
            raise FolderError(f"{where}: its {offsets[1] - offsets[0]:,} bytes are not its "
                              f"shape's {nbytes:,}")  # fmt: skip
        ranges.append((offsets[0], offsets[1], name))
        out[name] = TensorInfo(path, dtype, tuple(shape), nbytes)
    at = 0
    for start, end, name in sorted(ranges):
        if start != at:
            raise FolderError(f"{path}: tensor {name}'s data does not follow the one before")
        at = end
    if at != size - 8 - n:
        raise FolderError(f"{path}: the tensors take {at:,} bytes, the file holds {size - 8 - n:,}")
    return out


def layer_count(index: dict[str, TensorInfo]) -> int:
    """How many decoder layers the weights hold (``...layers.N...`` names)."""
    found = [int(m.group(1)) for name in index if (m := _LAYER.search(name))]
    return max(found) + 1 if found else 0


__all__ = [
    "CONFIG_BYTES",
    "HEADER_BYTES",
    "TOKENIZER_BYTES",
    "FolderError",
    "TensorInfo",
    "layer_count",
    "parse_json",
    "read_bytes",
    "read_json",
    "regular_file",
    "safetensors_index",
]
