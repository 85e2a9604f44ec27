"""`RadixKey`: a token sequence used as a radix-tree key.

The behaviour follows the seed specification (SGLang's ``RadixKey``) rule for rule, with
one deliberate improvement: a key is an *offset/length view* over an ``array('q')``, so
slicing is O(1) and never copies tokens. (CPython's ``array`` slice copies, which makes a
walk down a deep tree quadratic in the key length.)

Invariants of a view: ``0 <= _start <= _stop <= len(_base)``; the raw tokens of the key
are ``_base[_start:_stop]``. With ``is_bigram`` the logical units are the overlapping
pairs of raw tokens, so ``len(key) == max(0, raw_len - 1)``.

The module also holds the byte-level helpers the tree walks with: tokens packed as
native int64 bytes compare with one ``memcmp`` (``bytes.startswith(buf, offset)``),
about ten times faster than comparing ``memoryview`` items one by one.

Owns: keys and their validation. Must not touch: the tree.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

TOKEN_BYTES = 8  # int64 tokens and slot indices
_INT64_MAX = 2**63 - 1
# Iterable but unordered (or keyed): a key made of one would depend on hash order.
_NOT_SEQUENCES = (str, bytes, bytearray, set, frozenset, dict, Mapping)


def to_token_array(token_ids: Any, name: str = "token_ids") -> array:
    """Convert any sequence of ints to ``array('q')`` (no copy for an ``array('q')``).

    ``name`` is the argument named in error messages.

    Raises:
        TypeError: an element is not an integer (floats, strings, None, ...).
        ValueError: a token does not fit in int64.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids
    if isinstance(token_ids, _NOT_SEQUENCES) or not hasattr(token_ids, "__iter__"):
        raise TypeError(
            f"{name} must be an ordered sequence of ints, got {type(token_ids).__name__}"
        )
    if isinstance(token_ids, np.ndarray) or _is_tensor(token_ids):
        arr = np.asarray(token_ids.cpu() if _is_tensor(token_ids) else token_ids)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
        if arr.size and not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        if arr.size and arr.dtype == np.uint64 and int(arr.max()) > _INT64_MAX:
            # astype would wrap 2**63 + 5 to a negative token that matches another's
            raise ValueError(f"{name} must fit in int64, got {int(arr.max())}")
        out = array("q")
        out.frombytes(arr.astype(np.int64, copy=False).tobytes())
        return out
    try:
        return array("q", token_ids)
    except TypeError as e:
        raise TypeError(f"{name} must be a sequence of ints: {e}") from None
    except OverflowError as e:
        raise ValueError(f"{name} must fit in int64: {e}") from None


def as_bool(value: Any, name: str) -> bool:
    """``value`` as a bool, refusing anything but ``bool`` and numpy's ``bool_``: the string
    ``"no"`` is truthy, so taking truthiness would turn a feature on by mistake."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def as_count(value: Any, name: str) -> int:
    """``value`` as a non-negative int (Python or numpy integer; not a bool or a float)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_namespace(extra_key: Any, name: str = "extra_key") -> None:
    """Raise ``TypeError`` unless ``extra_key`` can name a namespace: it is a dict key in
    the tree, so it must be hashable (a list is not)."""
    try:
        hash(extra_key)
    except TypeError:
        raise TypeError(
            f"{name} must be hashable (str, int, tuple, ...), got {type(extra_key).__name__}"
        ) from None


def _is_tensor(x: Any) -> bool:
    # Avoid importing torch here: the key layer stays light.
    return type(x).__module__.startswith("torch") and hasattr(x, "cpu")


def common_prefix_units(a: bytes, a_start: int, b: Any, width: int, limit: int) -> int:
    """Number of leading equal units of ``a[a_start:]`` and ``b`` (at most ``limit``).

    Both hold fixed-width units of ``width`` bytes. Gallops in doubling windows, then
    binary-searches the first differing window, so the cost is O(m log m) byte compares
    for a match of m units, each compare a single ``memcmp``.

    Args:
        a: bytes to search in (``bytes.startswith`` needs a real ``bytes``).
        a_start: byte offset into ``a`` (a multiple of ``width``).
        b: any bytes-like object holding the other units.
        width: bytes per unit (8 for tokens, 16 for bigram pairs).
        limit: compare at most this many units; both sides must have that many.

    Returns:
        m in [0, limit] such that the first m units are equal and, if m < limit,
        unit m differs.
    """
    mb = memoryview(b)
    if mb.format != "B":
        mb = mb.cast("B")  # slice by bytes, not by items
    lo, step = 0, 1
    while lo < limit:
        hi = lo + step if lo + step < limit else limit
        if a.startswith(mb[lo * width : hi * width], a_start + lo * width):
            lo = hi
            step <<= 1
            continue
        while hi - lo > 1:  # invariant: [0, lo) equal, first difference in [lo, hi)
            mid = (lo + hi) >> 1
            if a.startswith(mb[lo * width : mid * width], a_start + lo * width):
                lo = mid
            else:
                hi = mid
        return lo
    return lo


class RadixKey:
    """A token sequence used as a radix-tree key.

    ``is_bigram=True`` creates a bigram view over the raw tokens: for raw tokens
    ``[a, b, c]`` the logical length is 2 and iteration yields ``(a, b), (b, c)``
    (EAGLE speculative decoding keys its cache this way).

    ``extra_key`` is a namespace tag (a LoRA id, a tenant, a cache salt): keys with
    different ``extra_key`` never share tree nodes.

    Slicing returns a new view sharing the same ``array`` in O(1). ``token_ids`` returns
    the raw tokens as an ``array('q')``: the original array object itself when the view
    covers it whole, else a copy of the window (use :meth:`raw_view` for a zero-copy
    ``memoryview``).
    """

    __slots__ = ("_base", "_start", "_stop", "extra_key", "is_bigram")

    def __init__(
        self,
        token_ids: Iterable[int],
        extra_key: str | None = None,
        is_bigram: bool = False,
    ) -> None:
        base = to_token_array(token_ids)
        if extra_key is not None:
            check_namespace(extra_key)
        self._base = base
        self._start = 0
        self._stop = len(base)
        self.extra_key = extra_key
        self.is_bigram = as_bool(is_bigram, "is_bigram")

    @classmethod
    def view_of(
        cls, base: array, start: int, stop: int, extra_key: str | None, is_bigram: bool
    ) -> RadixKey:
        key = cls.__new__(cls)
        key._base = base
        key._start = start
        key._stop = stop
        key.extra_key = extra_key
        key.is_bigram = is_bigram
        return key

    # --- raw tokens --------------------------------------------------------------------
    @property
    def token_ids(self) -> array:
        """The raw tokens as ``array('q')`` (O(1) for an unsliced key, else a copy)."""
        if self._start == 0 and self._stop == len(self._base):
            return self._base
        out = array("q")
        out.frombytes(self.raw_view().cast("B"))
        return out

    def raw_view(self) -> memoryview:
        """Zero-copy ``memoryview`` (format ``'q'``) of the raw tokens."""
        return memoryview(self._base)[self._start : self._stop]

    def raw_len(self) -> int:
        """Number of raw tokens (one more than ``len(self)`` for a non-empty bigram key)."""
        return self._stop - self._start

    def tolist(self) -> list:
        """The logical units as a list: ints, or ``(a, b)`` pairs for a bigram key."""
        return list(self)

    # --- sequence protocol -------------------------------------------------------------
    def __len__(self) -> int:
        n = self._stop - self._start
        if self.is_bigram:
            return n - 1 if n > 0 else 0
        return n

    def __iter__(self) -> Iterator:
        t = self.raw_view()
        if self.is_bigram:
            for i in range(len(t) - 1):
                yield (t[i], t[i + 1])
        else:
            yield from t

    def __getitem__(self, idx: int | slice) -> RadixKey:
        """Slice the key in O(1), returning a view sharing the underlying array.

        An int index returns a key of length 1 (as the seed does). Negative ints count
        from the end; an int out of range raises ``IndexError``; a slice step other than
        1 raises ``ValueError``. A bigram slice keeps one extra raw token so its pairs are
        complete.
        """
        if isinstance(idx, bool) or not isinstance(idx, (int, slice)):
            if hasattr(idx, "__index__") and not isinstance(idx, bool):
                idx = idx.__index__()
            else:
                raise TypeError(f"RadixKey indices must be int or slice, not {type(idx).__name__}")
        if isinstance(idx, int):
            if idx < 0:
                idx += len(self)
            if idx < 0 or idx >= len(self):
                raise IndexError(f"RadixKey index out of range: {idx}")
            idx = slice(idx, idx + 1)
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("RadixKey slice step must be 1")
        if stop < start:
            stop = start
        s = self._start
        if self.is_bigram:
            if stop > start:
                return RadixKey.view_of(self._base, s + start, s + stop + 1, self.extra_key, True)
            return RadixKey.view_of(self._base, s + start, s + start, self.extra_key, True)
        return RadixKey.view_of(self._base, s + start, s + stop, self.extra_key, False)

    def __repr__(self) -> str:
        t = self.raw_view()
        preview = t[:10].tolist()
        extra = f", extra_key={self.extra_key!r}" if self.extra_key else ""
        return (
            f"RadixKey({extra} "
            f"token_ids={preview}{'...' if len(t) > 10 else ''}, "
            f"is_bigram={self.is_bigram})"
        )

    # --- seed operations ---------------------------------------------------------------
    def page_aligned(self, page_size: int) -> RadixKey:
        """Truncate to the largest multiple of ``page_size`` <= the current length."""
        if page_size == 1:
            return self
        aligned_len = len(self) // page_size * page_size
        return self[:aligned_len]

    def maybe_to_bigram_view(self, is_eagle: bool, value: Any = None) -> tuple[RadixKey, Any]:
        """Return a bigram view in O(1) if ``is_eagle`` (the caller's key is not mutated).

        ``value``, when given, is truncated to the bigram length. Returns ``(key, value)``.
        """
        if is_eagle and not self.is_bigram:
            key = RadixKey.view_of(self._base, self._start, self._stop, self.extra_key, True)
            if value is not None:
                value = value[: len(key)]
            return key, value
        return self, value

    def _check_compatible(self, other: RadixKey) -> None:
        if self.extra_key != other.extra_key:
            raise ValueError(
                "RadixKey operations require matching extra_key, but got "
                f"self.extra_key={self.extra_key!r} != other.extra_key={other.extra_key!r}"
            )

    def match(self, other: RadixKey, page_size: int = 1) -> int:
        """Length of the shared prefix of ``self`` and ``other`` in logical units.

        Raw tokens are compared by galloping then binary search over ``memcmp`` windows.
        For bigram keys the raw match loses one token (a pair needs both tokens); the
        result is floored to whole pages when ``page_size > 1``.

        Raises:
            ValueError: the keys' ``extra_key`` differ.
        """
        self._check_compatible(other)
        n = min(self.raw_len(), other.raw_len())
        a = self.raw_view()[:n].tobytes()
        matched_tokens = common_prefix_units(a, 0, other.raw_view()[:n], TOKEN_BYTES, n)
        if self.is_bigram:
            matched = max(0, min(matched_tokens - 1, len(self), len(other)))
            return (matched // page_size) * page_size if page_size > 1 else matched
        if page_size == 1:
            return matched_tokens
        return (matched_tokens // page_size) * page_size

    def child_key(self, page_size: int = 1) -> Any:
        """Hashable dict key for the first ``page_size`` logical units, namespaced by
        ``extra_key``: a token (or pair) for page size 1, else a tuple of them."""
        t = self.raw_view()
        if self.is_bigram:
            if page_size == 1:
                plain: Any = (t[0], t[1])
            else:
                plain = tuple((t[j], t[j + 1]) for j in range(page_size))
        else:
            plain = t[0] if page_size == 1 else tuple(t[:page_size].tolist())
        return plain if self.extra_key is None else (self.extra_key, plain)

    # --- packing for the tree ----------------------------------------------------------
    def unit_bytes(self, num_units: int | None = None) -> bytes:
        """The first ``num_units`` logical units packed as bytes: 8 bytes (int64) per
        token, or 16 bytes (two int64) per bigram pair. O(n) ``memcpy``."""
        n = len(self) if num_units is None else num_units
        if not self.is_bigram:
            return memoryview(self._base)[self._start : self._start + n].tobytes()
        if n == 0:
            return b""
        raw = np.frombuffer(self._base, dtype=np.int64)[self._start : self._start + n + 1]
        return np.stack((raw[:-1], raw[1:]), axis=1).tobytes()
