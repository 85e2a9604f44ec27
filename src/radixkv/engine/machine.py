"""What this machine can hold: memory available to a new allocation, checked before a
model's weights or an engine's pools are allocated, so that a size nobody can have (a
config's ``vocab_size`` of 2e9, ``max_checkpoints`` 1e9) is refused with one line naming
it instead of growing the process until the allocator or the kernel stops it.

Owns: that check. Must not touch: what is allocated (`radixkv.engine.cache_memory`
and the loader do).
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def _read_int(path: str) -> int | None:
    """The integer a kernel file holds (None: absent, unreadable, or ``max``)."""
    try:
        with open(path, "rb") as f:
            text = f.read(64).split()
    except OSError:
        return None
    try:
        return int(text[0]) if text else None
    except ValueError:
        return None  # "max": no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_room() -> int | None:
    """What this process's memory cgroup still allows (its limit less its use; v2, then
    v1), or None when it sets no limit. A container's limit is often far below the
    host's ``MemAvailable``, and past it the kernel kills the process."""
    v2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")
    v1 = ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
          "/sys/fs/cgroup/memory/memory.usage_in_bytes")  # fmt: skip
    for limit_path, used_path in (v2, v1):
        limit = _read_int(limit_path)
        if limit is not None and limit < 1 << 60:  # (v1 says "no limit" as ~2^63)
            return max(0, limit - (_read_int(used_path) or 0))
    return None


def _address_room() -> int | None:
    """What the address-space limit (``ulimit -v``, RLIMIT_AS) leaves this process, or
    None when there is none: past it every allocation fails."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    size = 0
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmSize:"):
                    size = int(line.split()[1]) * 1024
    except OSError:
        pass
    return max(0, soft - size)


def available_bytes(device: Any = "cpu") -> int | None:
    """Bytes a new allocation on ``device`` can take now: free GPU memory, or on the
    host the least of ``MemAvailable``, the memory cgroup's room and the address-space
    limit's; None when the platform says none of them."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "meta":
        return None
    rooms = [r for r in (_meminfo_available(), _cgroup_room(), _address_room()) if r is not None]
    return min(rooms) if rooms else None


def check_fits(needs: dict[str, int], device: Any = "cpu") -> None:
    """Refuse allocations that together need more than ``device`` has available.

    Args:
        needs: what each part would take, in bytes, by what sets its size (a flag or a
            config field, as the error names it).

    Raises:
        ValueError: naming the parts and the bytes, largest first.
    """
    have = available_bytes(device)
    total = sum(needs.values())
    if have is None or total <= have:
        return
    parts = ", ".join(f"{what}: {n / GIB:,.2f} GiB" for what, n in
                      sorted(needs.items(), key=lambda kv: -kv[1]) if n)  # fmt: skip
    raise ValueError(
        f"needs {total / GIB:,.2f} GiB ({parts}), more than the "
        f"{have / GIB:,.2f} GiB available on {device}"
    )


__all__ = ["available_bytes", "check_fits"]
