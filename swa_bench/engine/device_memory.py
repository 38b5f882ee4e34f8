"""How much memory this process may still take on a device: the figure a memory pre-check
compares a problem's need with (``swa-bench kernels --tokens``, the trainer's step).

On the CPU the machine's available memory is not enough: a cgroup limit or this process's own
address-space or data limit (``ulimit -v``, a test's ``RLIMIT_AS``) kills a run the machine's
figure says fits, so the least of them counts.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch


def free_bytes(device: torch.device) -> int | None:
    """Memory a training step may take on ``device`` (None: unknown). For the CPU, the least of
    the machine's available memory, the cgroup's limit less its use, and this process's own
    address-space and data limits less what it maps: a limit the machine's figure ignores is
    what kills a run."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    status = _proc_fields("/proc/self/status")
    room = [_proc_fields("/proc/meminfo").get("MemAvailable")]
    for limit, used in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and used in status:
            room.append(max(0, soft - status[used]))
    room.append(_cgroup_room())
    known = [r for r in room if r is not None]
    return min(known) if known else None


def _proc_fields(path: str) -> dict[str, int]:
    """``Name: 123 kB`` lines of a /proc file, in bytes ({} where there is none)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return fields


def _cgroup_room() -> int | None:
    """The cgroup v2 memory limit less its current use, for this process's cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            line = next((line for line in f if line.startswith("0::")), None)
        if line is None:
            return None
        folder = Path("/sys/fs/cgroup") / line[3:].strip().lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text()))
    except (OSError, ValueError):
        return None
