import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import swa_bench
from swa_bench.bench.environment import (
    capture_environment,
    git_state,
    scenario_hash,
    source_digest,
)

KEYS = {"torch", "cuda", "gpu", "driver", "python", "platform", "hostname", "cpu_count",
        "threads", "omp_num_threads", "cpu_timer", "git_sha", "git_dirty", "source_sha256"}
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=repo, check=True, capture_output=True, text=True,
    ).stdout.strip()


def test_capture_environment_keys_and_types():
    env = capture_environment(threads=3)
    assert set(env) == KEYS
    assert env["torch"] == torch.__version__
    assert env["threads"] == 3
    assert isinstance(env["python"], str) and isinstance(env["hostname"], str)
    assert env["gpu"] is None or isinstance(env["gpu"], str)
    if not torch.cuda.is_available():
        assert env["gpu"] is None


def test_capture_environment_defaults_threads_to_what_timing_uses(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert capture_environment()["threads"] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = capture_environment()
    assert env["threads"] == 3 and env["omp_num_threads"] == "3"


@needs_git
def test_capture_environment_git_matches_package_checkout():
    env = capture_environment()
    package_dir = Path(swa_bench.__file__).resolve().parent
    assert (env["git_sha"], env["git_dirty"]) == git_state(package_dir)
    if env["git_sha"] is not None:
        assert isinstance(env["git_sha"], str) and len(env["git_sha"]) == 40
        assert isinstance(env["git_dirty"], bool)
    else:
        assert env["git_dirty"] is None


@needs_git
def test_git_state_of_a_checkout(tmp_path):
    _git(tmp_path, "init", "-q")
    assert git_state(tmp_path) == (None, None)  # no commit yet
    (tmp_path / "scenario.yaml").write_text("a: 1\n")
    _git(tmp_path, "add", "scenario.yaml")
    _git(tmp_path, "commit", "-q", "-m", "init")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "untracked.txt").write_text("x")
    assert git_state(tmp_path) == (head, False)
    (tmp_path / "scenario.yaml").write_text("a: 2\n")
    assert git_state(tmp_path) == (head, True)


def test_git_state_outside_a_checkout(tmp_path):
    assert git_state(tmp_path / "missing") == (None, None)


def test_scenario_hash_stable_and_sensitive():
    text = "name: mixed\nwindow: 128\nrequests: [300, 100, 1]\n"
    first = scenario_hash(text)
    assert first == scenario_hash(str(text))
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    changed = text.replace("128", "127")
    assert scenario_hash(changed) != first
    assert scenario_hash(text + "\n") != first


def test_source_digest_names_the_code_by_content(tmp_path):
    """Stable, sensitive to a byte and to a file's name, blind to caches and data files; the
    environment records the package's own."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "sub" / "t.html.j2").write_text("<p>{{ x }}</p>\n")
    first = source_digest(pkg)
    assert first.startswith("sha256:") and len(first) == 7 + 64
    assert source_digest(pkg) == first
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0\1")
    (pkg / "notes.md").write_text("not code\n")
    assert source_digest(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    changed = source_digest(pkg)
    assert changed != first
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert source_digest(pkg) not in (first, changed)
    package_dir = Path(swa_bench.__file__).resolve().parent
    assert capture_environment()["source_sha256"] == source_digest(package_dir)
