"""Every rule of the seed's RadixKey, case by case, plus the zero-copy slicing guarantee."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.key import RadixKey, common_prefix_units


def naive_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def seed_match(a: RadixKey, b: RadixKey, page_size: int) -> int:
    """The seed's match rules, written out with a per-token loop."""
    matched_tokens = naive_match(list(a.token_ids), list(b.token_ids))
    if a.is_bigram:
        matched = max(0, min(matched_tokens - 1, len(a), len(b)))
        return matched // page_size * page_size if page_size > 1 else matched
    return matched_tokens // page_size * page_size


# --- construction -------------------------------------------------------------------------
def test_array_q_is_kept_without_copy():
    arr = array("q", [1, 2, 3])
    key = RadixKey(arr)
    assert key.token_ids is arr


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        array("i", [1, 2, 3]),
        np.array([1, 2, 3]),
        torch.tensor([1, 2, 3]),
        np.array([1, 2, 3], dtype=np.int32),
    ],
)
def test_any_int_sequence_converts_to_array_q(tokens):
    key = RadixKey(tokens)
    assert isinstance(key.token_ids, array) and key.token_ids.typecode == "q"
    assert list(key.token_ids) == [1, 2, 3]


@pytest.mark.parametrize(
    "bad", [[1.0, 2.0], [1, "a"], "abc", [None], np.array([1.5]), torch.tensor([1.0])]
)
def test_non_integers_raise_type_error(bad):
    with pytest.raises(TypeError, match="token_ids"):
        RadixKey(bad)


def test_out_of_int64_range_raises_value_error():
    with pytest.raises(ValueError, match="token_ids"):
        RadixKey([2**63])


def test_two_dimensional_input_raises_value_error():
    with pytest.raises(ValueError, match="1-D"):
        RadixKey(np.zeros((2, 2), dtype=np.int64))


# --- length and iteration -----------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_len_plain_and_bigram(n):
    assert len(RadixKey(list(range(n)))) == n
    assert len(RadixKey(list(range(n)), is_bigram=True)) == max(0, n - 1)


def test_iteration_yields_tokens_or_pairs():
    assert list(RadixKey([4, 5, 6])) == [4, 5, 6]
    assert list(RadixKey([4, 5, 6], is_bigram=True)) == [(4, 5), (5, 6)]
    assert list(RadixKey([4], is_bigram=True)) == []


# --- indexing and slicing -----------------------------------------------------------------
def test_int_index_returns_length_one_key():
    key = RadixKey([10, 11, 12], extra_key="ns")
    item = key[1]
    assert isinstance(item, RadixKey) and list(item) == [11] and item.extra_key == "ns"
    assert list(key[-1]) == [12]
    assert list(key[-3]) == [10]


@pytest.mark.parametrize("idx", [3, -4, 100])
def test_int_index_out_of_range(idx):
    with pytest.raises(IndexError):
        RadixKey([10, 11, 12])[idx]


def test_bigram_int_index_keeps_both_tokens():
    key = RadixKey([1, 2, 3, 4], is_bigram=True)
    item = key[1]
    assert list(item.token_ids) == [2, 3] and list(item) == [(2, 3)] and item.is_bigram
    with pytest.raises(IndexError):
        key[3]


def test_slice_step_must_be_one():
    with pytest.raises(ValueError, match="step"):
        RadixKey([1, 2, 3, 4])[::2]
    assert list(RadixKey([1, 2, 3])[::1]) == [1, 2, 3]


def test_slices_share_the_array_and_nest_correctly():
    arr = array("q", range(100))
    key = RadixKey(arr, extra_key="x")
    part = key[10:60][5:20][-5:]
    assert part._base is arr  # no token was copied
    assert list(part) == list(range(25, 30)) and part.extra_key == "x"
    assert list(key[50:10]) == [] and list(key[-3:]) == [97, 98, 99]


def test_bigram_slice_keeps_one_extra_raw_token():
    key = RadixKey([1, 2, 3, 4, 5], is_bigram=True)
    part = key[1:3]
    assert list(part.token_ids) == [2, 3, 4]
    assert list(part) == [(2, 3), (3, 4)] and len(part) == 2
    empty = key[2:2]
    assert len(empty) == 0 and list(empty.token_ids) == [] and empty.is_bigram


@given(
    st.lists(st.integers(0, 5), max_size=30),
    st.integers(-35, 35),
    st.integers(-35, 35),
    st.booleans(),
)
def test_slicing_agrees_with_list_slicing(tokens, start, stop, bigram):
    key = RadixKey(tokens, is_bigram=bigram)
    units = list(key)
    assert list(key[start:stop]) == units[start:stop]
    assert len(key[start:stop]) == len(units[start:stop])


# --- repr ---------------------------------------------------------------------------------
def test_repr_matches_the_seed():
    assert repr(RadixKey([1, 2, 3])) == "RadixKey( token_ids=[1, 2, 3], is_bigram=False)"
    long = RadixKey(list(range(12)), extra_key="a", is_bigram=True)
    assert repr(long) == (
        "RadixKey(, extra_key='a' token_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]..., is_bigram=True)"
    )
    assert repr(RadixKey(list(range(10)))).endswith("9], is_bigram=False)")


# --- page_aligned and bigram view ---------------------------------------------------------
def test_page_aligned():
    key = RadixKey(list(range(10)))
    assert key.page_aligned(1) is key
    assert list(key.page_aligned(4)) == list(range(8))
    assert len(key.page_aligned(16)) == 0
    big = RadixKey(list(range(10)), is_bigram=True)  # 9 pairs
    assert len(big.page_aligned(4)) == 8


def test_maybe_to_bigram_view_does_not_mutate_the_callers_key():
    key = RadixKey([1, 2, 3, 4])
    value = torch.tensor([7, 8, 9, 10])
    view, v = key.maybe_to_bigram_view(True, value)
    assert view.is_bigram and not key.is_bigram
    assert view._base is key._base
    assert list(view) == [(1, 2), (2, 3), (3, 4)] and v.tolist() == [7, 8, 9]
    same, v2 = key.maybe_to_bigram_view(False, value)
    assert same is key and v2 is value
    already, _ = view.maybe_to_bigram_view(True)
    assert already is view


# --- match --------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_match_diverging_at_every_position(page_size):
    base = list(range(1, 2001))
    a = RadixKey(base)
    for i in range(1, 2001):
        other = [*base[:i], -1, *base[i + 1 :]] if i < 2000 else [*base, 5]
        expected = (i // page_size) * page_size
        assert a.match(RadixKey(other), page_size) == expected, i
        assert RadixKey(other).match(a, page_size) == expected, i


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_bigram_match_diverging_at_every_position(page_size):
    base = list(range(1, 2001))
    a = RadixKey(base, is_bigram=True)
    for i in range(0, 2000, 7):
        b = RadixKey([*base[:i], -1, *base[i + 1 :]], is_bigram=True)
        assert a.match(b, page_size) == seed_match(a, b, page_size), i


@given(
    st.lists(st.integers(0, 2), max_size=40),
    st.lists(st.integers(0, 2), max_size=40),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
)
def test_match_agrees_with_the_seed_rules(a, b, page_size, bigram):
    ka, kb = RadixKey(a, is_bigram=bigram), RadixKey(b, is_bigram=bigram)
    assert ka.match(kb, page_size) == seed_match(ka, kb, page_size)


def test_match_on_sliced_views():
    key = RadixKey(list(range(100)))
    assert key[10:50].match(RadixKey([*list(range(10, 30)), 0])) == 20


def test_match_requires_same_extra_key():
    with pytest.raises(ValueError, match=r"'a'.*'b'"):
        RadixKey([1], extra_key="a").match(RadixKey([1], extra_key="b"))
    with pytest.raises(ValueError, match="None"):
        RadixKey([1]).match(RadixKey([1], extra_key="b"))


def test_common_prefix_units_random():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 300)
        a = [rng.randint(0, 1) for _ in range(n)]
        b = list(a)
        if n and rng.random() < 0.8:
            b[rng.randrange(n)] ^= 1
        ab, bb = array("q", a).tobytes(), array("q", b)
        assert common_prefix_units(ab, 0, bb.tobytes(), 8, n) == naive_match(a, b)
        assert common_prefix_units(ab, 0, memoryview(bb), 8, n) == naive_match(a, b)


# --- child_key ----------------------------------------------------------------------------
def test_child_key_forms():
    assert RadixKey([5, 6, 7]).child_key() == 5
    assert RadixKey([5, 6, 7]).child_key(2) == (5, 6)
    assert RadixKey([5, 6, 7], is_bigram=True).child_key() == (5, 6)
    assert RadixKey([5, 6, 7], is_bigram=True).child_key(2) == ((5, 6), (6, 7))
    assert RadixKey([5, 6, 7], extra_key="n").child_key() == ("n", 5)
    assert RadixKey([5, 6, 7])[1:].child_key() == 6


def test_unit_bytes_packs_tokens_and_pairs():
    assert RadixKey([1, 2, 3]).unit_bytes() == array("q", [1, 2, 3]).tobytes()
    assert RadixKey([1, 2, 3], is_bigram=True).unit_bytes() == array("q", [1, 2, 2, 3]).tobytes()
    assert RadixKey([1, 2, 3])[1:].unit_bytes(1) == array("q", [2]).tobytes()
    assert RadixKey([], is_bigram=True).unit_bytes() == b""
