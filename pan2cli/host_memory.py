"""The host memory a run may page-lock: `/proc/meminfo`'s `MemAvailable`, within the cgroup's limit (torch-free).

`MemAvailable` is the kernel's estimate of what can be allocated without swapping: free memory plus the page
cache and slab it can reclaim. Page-locking that much evicts the page cache: a checkpoint read a moment ago
is then read from disk again next time. Files in tmpfs (`/dev/shm`, counted as `Shmem`) are not page cache
that can be reclaimed: they stay in memory and are not available. In a container `/proc/meminfo` shows the
host's memory; the cgroup's `memory.max` (v2) or `memory.limit_in_bytes` (v1) bounds what this process gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
_NO_LIMIT = 2**60  # cgroup v1 reports "no limit" as a huge number


@dataclass(frozen=True)
class HostMemory:
    """What the host has (bytes).

    Attributes:
        available: what a run may take: `MemAvailable`, or the cgroup's room where smaller.
        mem_available: `MemAvailable`.
        page_cache: reclaimable page cache (`Cached` less `Shmem`), counted in `MemAvailable`.
        shmem: tmpfs and shared memory (`Shmem`: `/dev/shm` files), not available.
        cgroup_room: the cgroup's limit less its usage plus its page cache, or None without a limit.
    """

    available: int
    mem_available: int
    page_cache: int
    shmem: int
    cgroup_room: int | None = None

    def describe(self) -> str:
        """The available memory in words, with what it counts and what it does not (for an error message)."""
        text = f"{self.available / GIB:.1f} GiB available"
        if self.cgroup_room is not None and self.cgroup_room < self.mem_available:
            text += f" (its cgroup's limit; MemAvailable {self.mem_available / GIB:.1f} GiB)"
        else:
            text += f" (MemAvailable, counting {self.page_cache / GIB:.1f} GiB of page cache that page-locking evicts)"
        if self.shmem >= GIB:
            text += f"; {self.shmem / GIB:.1f} GiB held by tmpfs files (/dev/shm) are not available"
        return text


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room(root: Path) -> int | None:
    """The cgroup's limit less what it uses, plus its reclaimable page cache; None without a limit."""
    for limit_name, usage_name, file_keys in (
        ("memory.max", "memory.current", ("active_file", "inactive_file")),  # v2
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            ("total_active_file", "total_inactive_file"),
        ),
    ):
        limit, usage = _read_int(root / limit_name), _read_int(root / usage_name)
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        stat_path = (root / usage_name).parent / "memory.stat"
        cache = 0
        try:
            for line in stat_path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key in file_keys and value.strip().isdigit():
                    cache += int(value)
        except OSError:
            pass
        return max(0, limit - usage + cache)
    return None


def read_host_memory(
    meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup"
) -> HostMemory | None:
    """The host's memory (`HostMemory`), or None where `meminfo` cannot be read (not Linux)."""
    try:
        info = _meminfo(Path(meminfo))
    except OSError:
        return None
    if "MemAvailable" not in info:
        return None
    shmem = info.get("Shmem", 0)
    page_cache = max(0, info.get("Cached", 0) - shmem)
    room = _cgroup_room(Path(cgroup))
    available = info["MemAvailable"] if room is None else min(info["MemAvailable"], room)
    return HostMemory(available, info["MemAvailable"], page_cache, shmem, room)
