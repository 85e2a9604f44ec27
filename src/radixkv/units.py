"""Small integer helpers shared by the layers (named, so page arithmetic reads as words).

Owns: page arithmetic and byte sizes as people write them. Must not touch: anything else."""

from __future__ import annotations

import re
from decimal import Decimal

MAX_BYTES = 1 << 60  # 1 EiB: no size past it is one a machine has
BYTE_UNITS = {
    "B": 1,
    "bytes": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_bytes(text: str) -> int:
    """A byte size written ``384KiB``, ``256MiB``, ``4GiB``, ``1.5GB`` or a plain count
    (bytes), rounded down.

    Raises:
        ValueError: unreadable text, an unknown unit (a lone ``b`` or ``k`` too), or
            less than one byte.
    """
    raw = text.strip().replace("_", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([A-Za-z]*)", raw)
    if not m or (m.group(2) and m.group(2) not in BYTE_UNITS):
        raise ValueError(f"a byte size like 384KiB, 256MiB, 4GiB or 1000000, got {text[:60]!r}")
    # exact decimal arithmetic: a float would overflow (400 nines) or round
    n = int(Decimal(m.group(1)) * BYTE_UNITS[m.group(2) or "B"])
    if n < 1:
        raise ValueError(f"a byte size of at least 1 byte, got {text!r}")
    if n > MAX_BYTES:
        raise ValueError(f"a byte size of at most 1EiB, got {text[:60]!r}")
    return n


def div_ceil(a: int, b: int) -> int:
    """``ceil(a / b)`` for a non-negative ``a`` and a positive ``b``."""
    return -(-a // b)


def align_down(n: int, page: int) -> int:
    """``n`` rounded down to a whole number of pages."""
    return n - n % page


def align_up(n: int, page: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return div_ceil(n, page) * page
