"""The stored page format: a header that names what the page is, a CRC, and with a
storage secret a MAC.

A value is ``header + payload [+ MAC]``: the header holds the format version, the model
identity (16 bytes), the page's own key hash (16 bytes), flags, the payload length and
its CRC-32; with a secret, a keyed BLAKE2b-256 MAC over header and payload follows. Every
read is checked (`PageCodec.check`): a value that fails is never used.

Owns: the bytes of a stored value. Must not touch: where values are stored
(`radixkv.storage.store`) or what a payload means (`radixkv.storage.tier`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import NamedTuple

MAGIC = b"RKV2"
FORMAT_VERSION = 2
KEY_HASH_BYTES = 16  # a page's chained hash (radixkv.tree.page_hash)
MAC_BYTES = 32  # keyed BLAKE2b-256 over the header and payload, with a storage secret
_FLAG_MAC = 1
# magic, version, fingerprint (16 bytes), key hash (16 bytes), flags, payload length, CRC-32
_HEADER = struct.Struct(">4sH16s16sBQI")


def layout_identity(identity: bytes, layout: str) -> bytes:
    """16 bytes for values of another payload layout under the model's ``identity``
    (the full-attention layers alone, the window layers' pages): pages of one layout
    are never read as another's, as a key and a header name them."""
    return hashlib.blake2b(identity + layout.encode(), digest_size=16,
                           person=b"rkv-layout").digest()  # fmt: skip


class ValueParts(NamedTuple):
    """How a stored value splits around its payload (`PageCodec.value_parts`)."""

    header: int  # bytes before the payload
    mac: int  # bytes of MAC after it (0: none)


class PageError(ValueError):
    """A stored value that must not be used; ``kind`` is ``corrupt`` (the header, length
    or CRC check failed: another format, model or key, truncated, flipped bits) or
    ``unauthenticated`` (a storage secret is set and the value's MAC is missing or
    wrong)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class PageCodec:
    """Wraps a page's payload in a checked header, and with a secret a MAC.

    Args:
        fingerprint: 16 bytes naming the model (`radixkv.storage.identity`).
        secret: a storage secret shared by the engines of one fleet: every page then
            carries a keyed BLAKE2b-256 MAC over its header and payload, and a page
            whose MAC fails (or that has none) is refused. Without one, anyone who can
            write to the store can change what the engines compute.
    """

    def __init__(self, fingerprint: bytes, secret: bytes | None = None) -> None:
        if len(fingerprint) != 16:
            raise ValueError("fingerprint must be 16 bytes")
        if secret is not None and not (isinstance(secret, bytes) and secret):
            raise ValueError("secret must be non-empty bytes")
        self.fingerprint = fingerprint
        self.secret = secret
        # the MAC key: a digest of the secret (any length), never the secret itself
        self._mac_key = (
            hashlib.blake2b(secret, digest_size=32, person=b"radixkv-page-mac").digest()
            if secret is not None
            else b""
        )

    def _mac(self, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(digest_size=MAC_BYTES, key=self._mac_key)
        h.update(header)
        h.update(payload)
        return h.digest()

    def encode(self, key_hash: bytes, payload: bytes) -> bytes:
        flags = _FLAG_MAC if self.secret is not None else 0
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, self.fingerprint, key_hash, flags, len(payload),
            zlib.crc32(payload),
        )  # fmt: skip
        if self.secret is None:
            return header + payload
        return header + payload + self._mac(header, payload)

    def decode(self, key_hash: bytes, value: bytes) -> memoryview:
        """The payload (a view, no copy).

        Raises:
            PageError: the value fails a check (see `PageError`)."""
        view = memoryview(value)
        if len(view) < _HEADER.size:
            raise PageError("corrupt")
        length = _HEADER.unpack_from(view)[5]
        end = _HEADER.size + length
        mac = view[end:]
        self.check(key_hash, view[: _HEADER.size], view[_HEADER.size : end], mac)
        return view[_HEADER.size : end]

    def value_parts(self, length: int, payload_len: int) -> ValueParts | None:
        """How a stored value of ``length`` bytes splits when its payload should be
        ``payload_len``: (header, MAC) sizes, or ``None`` when it cannot be such a page.
        A value with and one without a MAC both split (`check` says which may be used)."""
        if length == _HEADER.size + payload_len:
            return ValueParts(_HEADER.size, 0)
        if length == _HEADER.size + payload_len + MAC_BYTES:
            return ValueParts(_HEADER.size, MAC_BYTES)
        return None

    def check(
        self, key_hash: bytes, header: memoryview, payload: memoryview, mac: memoryview
    ) -> None:
        """Check a value given in its parts (a store may read them straight into
        separate buffers: `PageStore.get_into`).

        Raises:
            PageError: the value fails a check (see `PageError`)."""
        if len(header) != _HEADER.size:
            raise PageError("corrupt")
        magic, version, fp, kh, flags, length, crc = _HEADER.unpack_from(header)
        if (magic, version, fp, kh) != (MAGIC, FORMAT_VERSION, self.fingerprint, key_hash):
            raise PageError("corrupt")
        if len(payload) != length or len(mac) != (MAC_BYTES if flags & _FLAG_MAC else 0):
            raise PageError("corrupt")
        if zlib.crc32(payload) != crc:
            raise PageError("corrupt")
        if self.secret is not None and (
            not flags & _FLAG_MAC or not hmac.compare_digest(mac, self._mac(header, payload))
        ):
            raise PageError("unauthenticated")


__all__ = ["MAC_BYTES", "PageCodec", "PageError"]
