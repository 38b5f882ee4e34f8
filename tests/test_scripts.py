"""The H200 scripts still parse and still run against today's API: a script that breaks after an
API change is found here, not at the start of a device call (device time is 30 minutes a session).
Every shell script passes ``bash -n``, every Python script compiles, and the probes that have a
CPU dry run run it on a tiny model."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_compile(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("script, env, args, expect", [
    ("graph_probe_gpu.py", "GRAPH_PROBE_DRY", ["mem-64k"], "| replay |"),
    ("host_profile_gpu.py", "HOST_PROFILE_DRY", [], "| function (32 tokens"),
    ("fp8_gemm_gpu.py", "FP8_GEMM_DRY", ["tiles"], "| fp8 grouped 16x32,4,1 |"),
])
def test_probe_dry_runs(script, env, args, expect):
    """This checkout's package first on the path: an editable install elsewhere (another
    worktree's) must not be what the script runs against."""
    path = os.pathsep.join(p for p in (str(SCRIPTS.parent), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True,
                          text=True, env={**os.environ, env: "1", "PYTHONPATH": path},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout
