"""The environment a result was measured in, recorded beside every result so runs can be compared.

Capturing never raises: a missing GPU, driver tool or git checkout is recorded as ``None``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

_TOOL_TIMEOUT_S = 10.0


def _run_tool(args: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a helper tool, or None when it is missing, fails or hangs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=_TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(path: Path) -> tuple[str | None, bool | None]:
    """(HEAD sha, whether tracked files differ from HEAD) of the checkout containing ``path``.

    Untracked files do not make the tree dirty (as ``git describe --dirty``). (None, None) when
    ``path`` is not in a git checkout with a commit, or git is missing.
    """
    sha = _run_tool(["git", "rev-parse", "--verify", "HEAD"], cwd=path)
    if sha is None:
        return None, None
    status = _run_tool(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path)
    return sha.strip(), (None if status is None else bool(status.strip()))


SOURCE_SUFFIXES = (".py", ".j2")


def source_digest(root: Path) -> str:
    """``sha256:<hex>`` of the package's source below ``root``: every ``.py`` and template file
    by its path relative to ``root`` and its bytes, in path order. It names the code that ran
    where git cannot: a copy whose git metadata is stale (the GPU machine's copy of the working
    tree kept the first call's HEAD all session) or absent (an installed wheel)."""
    digest = hashlib.sha256()
    files = sorted(f for f in root.rglob("*")
                   if f.suffix in SOURCE_SUFFIXES and f.is_file() and "__pycache__" not in f.parts)
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def nvidia_driver() -> str | None:
    out = _run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if not out or not out.strip():
        return None
    return out.strip().splitlines()[0].strip()


def _gpu_name() -> str | None:
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError):
        return None


def capture_environment(threads: int | None = None) -> dict[str, Any]:
    """torch, CUDA, GPU, driver, Python, host, the swa_bench checkout's git sha and dirtiness,
    and the digest of the package's source (``source_digest``).

    ``threads`` is the CPU thread count the measurement runs with; ``default_threads()`` (what
    the timing loop takes) when None.
    """
    import swa_bench
    from swa_bench.bench.timing import cpu_clock_name, default_threads

    package = Path(swa_bench.__file__).resolve().parent
    git_sha, git_dirty = git_state(package)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": _gpu_name(),
        "driver": nvidia_driver(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else default_threads(),
        "cpu_timer": cpu_clock_name(threads if threads is not None else default_threads()),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "git_sha": git_sha,
        "git_dirty": git_dirty,
        "source_sha256": source_digest(package),
    }


def scenario_hash(text: str) -> str:
    """``sha256:<hex>`` of the scenario file's text, so a result names exactly what it ran."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
