"""What this machine can hold: memory available to a new allocation, checked before a
model's weights or an engine's pools are allocated, so that a size nobody can have (a
config's ``vocab_size`` of 2e9, ``max_checkpoints`` 1e9) is refused with one line naming
it instead of growing the process until the allocator or the kernel stops it.

Owns: that check. Must not touch: what is allocated (the loader does).
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def available_bytes(device: Any = "cpu") -> int | None:
    """Bytes a new allocation on ``device`` can take now: free GPU memory, or the host's
    ``MemAvailable``; None when the platform does not say."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "meta":
        return None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
