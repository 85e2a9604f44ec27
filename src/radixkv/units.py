"""Small integer helpers shared by the layers (named, so page arithmetic reads as words).

Owns: page arithmetic. Must not touch: anything else."""

from __future__ import annotations


def div_ceil(a: int, b: int) -> int:
    """``ceil(a / b)`` for a non-negative ``a`` and a positive ``b``."""
    return -(-a // b)


def align_down(n: int, page: int) -> int:
    """``n`` rounded down to a whole number of pages."""
    return n - n % page


def align_up(n: int, page: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return div_ceil(n, page) * page
