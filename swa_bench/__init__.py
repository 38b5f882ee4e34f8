"""swa-bench: benchmark and verify decoder-side SWA bounded replay (``swa_bench.cli``).

Importing the package imports nothing heavy: ``swa-bench --version`` answers from here, without
torch (``__main__.main``)."""

from __future__ import annotations


def tool_version() -> str:
    """The installed distribution's version; "unknown" when swa-bench runs uninstalled (from a
    source tree on PYTHONPATH). Recorded in every results.json."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swa-bench")
    except PackageNotFoundError:
        return "unknown"
