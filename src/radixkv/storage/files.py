"""`FileStore`: one file per page in a folder, for one machine and several processes.

Layout: ``root/ab/abcdef...`` (the last two hex digits of the key name the subfolder).
A write goes to a temporary file and is renamed into place, so a reader in another
process never sees half a page, and a write that fails (a full disk) removes its
temporary file.

Trust (anyone who can write into the folder, or a folder shared by mistake): the store
follows nothing it did not write. Subfolders and files are opened relative to the root's
descriptor with ``O_NOFOLLOW`` (the root itself may be the operator's link): a planted
symlink is never followed, a planted subfolder link is replaced by a real folder, and a
page name that is not a regular file (a link, a FIFO, a device, a folder) is a bad page:
counted by the tier, never read, and written over when the page is next computed. Opens
never block (``O_NONBLOCK``: a FIFO cannot hang the engine), and a read takes at most the
size the caller asked for (`get_into`: one page's) or ``max_value_bytes`` (`get`).

Size: the folder holds at most ``max_bytes`` of pages; by default (``None``) what it
holds at start plus half the free space of its disk then (`DISK_SHARE`), so an
unattended store never fills its disk (it reached 206 MB after 100 prompts, with no
end). When a write goes over, the least recently used pages (by modification time; a
read touches its page) are removed until it holds 90% of it (``stats.evicted_pages``,
``stats.evicted_bytes``). `describe` says the cap and where it came from.

Owns: the folder's files. Must not touch: the bytes of a page (`radixkv.storage.page`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from radixkv.storage.base import Parts, SoftStore

MAX_VALUE_BYTES = 256 << 20  # what `get` reads of one value, at most
PRUNE_TO = 0.9  # a folder over its cap is pruned to this share of it
DISK_SHARE = 0.5  # the default cap: what it holds plus this share of its disk's free space
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
# errors that concern one entry (a planted link or folder), not the store as a whole
_ENTRY_ERRORS = (errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENXIO)


class FileStore(SoftStore):
    """Pages as files under ``root`` (see the module docstring). A folder that cannot be
    created or written (at start or later) is soft, as a down Redis is: a warning naming
    the path, then misses until it works again.

    Args:
        root: the folder (created on first use, with its parents).
        retry_s: after a failure, the store is skipped this long.
        max_bytes: the most bytes of pages the folder holds (``None``: what it holds at
            start plus half the free space of its disk then).
        max_value_bytes: the most `get` reads of one value.
    """

    def __init__(
        self,
        root: str | Path,
        retry_s: float = 5.0,
        max_bytes: int | None = None,
        max_value_bytes: int = MAX_VALUE_BYTES,
    ) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        super().__init__(f"file store {root}", retry_s)
        self.root = Path(root)
        self.max_bytes, self.max_value_bytes = max_bytes, max_value_bytes
        self.cap_source = "--storage-max-bytes" if max_bytes is not None else "default"
        self._root_fd = -1
        self._dirs: dict[str, int] = {}  # subfolder -> its descriptor
        self.held_bytes = 0  # bytes of pages in the folder, as of the last scan and writes
        self._call("open", self._open, None)

    def __del__(self) -> None:
        for fd in [*self._dirs.values(), self._root_fd]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # --- the folder ---------------------------------------------------------------------
    def _open(self) -> None:
        if self._root_fd >= 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self._root_fd = os.open(self.root, _DIR)
        self.held_bytes = sum(size for *_, size in self._pages())
        if self.max_bytes is None:  # the default: it fits its disk
            free = shutil.disk_usage(self.root).free
            self.max_bytes = max(1, self.held_bytes + int(free * DISK_SHARE))

    def describe(self) -> str:
        """The store and its cap, one line (what ``radixkv serve`` prints at start)."""
        if self.max_bytes is None:
            return f"file store {self.root}: not opened yet (its cap is set when it opens)"
        why = ("what it holds plus half its disk's free space; --storage-max-bytes sets it"
               if self.cap_source == "default" else "--storage-max-bytes")  # fmt: skip
        return (f"file store {self.root}: {self.held_bytes / 2**20:,.1f} MiB held, at most "
                f"{self.max_bytes / 2**20:,.1f} MiB ({why})")  # fmt: skip

    @staticmethod
    def _name(key: bytes) -> tuple[str, str]:
        name = key.hex()
        return name[-2:], name

    def _dir(self, sub: str, create: bool) -> int | None:
        """The subfolder's descriptor (never through a link: a planted one is replaced
        by a real folder when ``create``); ``None`` when it does not exist."""
        fd = self._dirs.get(sub)
        if fd is not None:
            return fd
        for _ in range(3):  # open; or repair (unlink a link), create, open
            try:
                fd = os.open(sub, _DIR | os.O_NOFOLLOW, dir_fd=self._root_fd)
                self._dirs[sub] = fd
                return fd
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(sub, 0o755, dir_fd=self._root_fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not create:
                    return None  # a link or a file planted under a subfolder's name
                os.unlink(sub, dir_fd=self._root_fd)  # ours to repair: not followed
        return None

    def _regular(self, key: bytes) -> int | None:
        """The page file's size if it is a regular file; -1 if something else is there;
        ``None`` when nothing is."""
        sub, name = self._name(key)
        fd = self._dir(sub, create=False)
        if fd is None:
            return None
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else -1

    # --- the store ----------------------------------------------------------------------
    def exists_prefix(self, keys: list[bytes]) -> int:
        def run() -> int:
            self._open()
            n = 0
            while n < len(keys) and (self._regular(keys[n]) or -1) >= 0:
                n += 1
            return n

        return self._call("exists", run, 0)

    def exists(self, keys: list[bytes]) -> list[bool]:
        def run() -> list[bool]:
            self._open()
            return [(self._regular(k) or -1) >= 0 for k in keys]

        return self._call("exists", run, [False] * len(keys))

    def _read(self, key: bytes, limit: int | None) -> bytes | None:
        """A page file's bytes (``b""`` for something that is not a page: a link, a FIFO,
        a device, one over ``limit`` bytes); ``None`` when there is none."""
        sub, name = self._name(key)
        dfd = self._dir(sub, create=False)
        if dfd is None:
            return None
        try:
            fd = os.open(name, _READ, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in _ENTRY_ERRORS:
                return b""  # a planted link (ELOOP): not followed
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > (limit or self.max_value_bytes):
                return b""
            data = os.read(fd, st.st_size)
            if self.max_bytes is not None:
                os.utime(fd)  # read lately: the last to be pruned
            return data
        finally:
            os.close(fd)

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        def run() -> list[bytes | None]:
            self._open()
            return [self._read(k, None) for k in keys]

        return self._call("get", run, [None] * len(keys))

    def get_into(self, keys: list[bytes], parts: Parts) -> list[bool | None]:
        """Each page straight into the caller's buffers, read only when its size is one
        ``parts`` takes (a file of another size is never read)."""

        def run() -> list[bool | None]:
            self._open()
            out: list[bool | None] = []
            for i, k in enumerate(keys):
                size = self._regular(k)
                if size is None or size < 0:  # none, or not a page file
                    out.append(None if size is None else False)
                    continue
                where = parts(i, size)
                value = self._read(k, size) if where is not None else b""
                if value is None:  # removed meanwhile
                    out.append(None)
                elif where is None or len(value) != size:
                    out.append(False)
                else:
                    at = 0
                    for part in where:
                        part[:] = value[at : at + len(part)]
                        at += len(part)
                    out.append(True)
            return out

        return self._call("get", run, [None] * len(keys))

    def set(self, keys: list[bytes], values: list[bytes]) -> int:
        def run() -> int:
            self._open()
            done = 0
            for k, v in zip(keys, values, strict=True):
                try:
                    self._write(k, v)
                except OSError as e:
                    if e.errno not in _ENTRY_ERRORS:
                        self._fail("set", e)  # the folder or the disk: soft for a while
                        return done
                    self.stats.errors += 1  # one planted entry: skip it
                    continue
                done += 1
            if self.max_bytes is not None and self.held_bytes > self.max_bytes:
                self._prune()
            return done

        return self._call("set", run, 0)

    def _write(self, key: bytes, value: bytes) -> None:
        sub, name = self._name(key)
        dfd = self._dir(sub, create=True)
        if dfd is None:
            raise OSError(errno.ENOTDIR, f"subfolder {sub} is not usable")
        tmp = f".tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                     dir_fd=dfd)  # fmt: skip
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            old = self._regular(key) or 0
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link itself
            self.held_bytes += len(value) - max(old, 0)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)  # a full disk stays no fuller
            raise

    # --- the cap ------------------------------------------------------------------------
    def _pages(self) -> list[tuple[float, str, str, int]]:
        """Every page file: (modification time, subfolder, name, size)."""
        out = []
        for sub in os.listdir(self._root_fd):
            dfd = self._dir(sub, create=False) if len(sub) == 2 else None
            if dfd is None:
                continue
            for entry in os.scandir(dfd):
                if entry.name.startswith(".tmp-") or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                out.append((st.st_mtime, sub, entry.name, st.st_size))
        return out

    def _prune(self) -> None:
        """Remove the least recently used pages until the folder holds `PRUNE_TO` of
        its cap (the folder is scanned: other processes write to it too)."""
        assert self.max_bytes is not None
        pages = sorted(self._pages())
        held = sum(p[3] for p in pages)
        target = int(self.max_bytes * PRUNE_TO)
        for _, sub, name, size in pages:
            if held <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._dirs[sub])
            held -= size
            self.stats.evicted_pages += 1
            self.stats.evicted_bytes += size
        self.held_bytes = held
