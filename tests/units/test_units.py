"""Page arithmetic and byte sizes (`radixkv.units`) against their definitions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.units import align_down, align_up, div_ceil, parse_bytes


@given(st.integers(0, 1 << 70), st.integers(1, 1 << 40))
def test_page_arithmetic_matches_its_definition(n, page):
    q = div_ceil(n, page)  # the fewest pages holding n
    assert (q - 1) * page < n <= q * page or n == q == 0
    if n < 1 << 52:  # (where a float still holds n exactly)
        assert q == math.ceil(n / page)
    assert align_down(n, page) % page == 0 and 0 <= n - align_down(n, page) < page
    assert align_up(n, page) % page == 0 and 0 <= align_up(n, page) - n < page


@pytest.mark.parametrize(
    ("text", "n"), [("384KiB", 384 * 1024), ("256MiB", 2**28), ("4GiB", 2**32),
                    ("1.5GB", 1_500_000_000), ("1000", 1000), ("64 B", 64)],
)  # fmt: skip
def test_byte_sizes_read_as_written(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["4x", "1b", "GiB", "-1KiB", "0", "1k"])
def test_unreadable_byte_sizes_are_refused(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)
