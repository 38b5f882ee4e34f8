"""The torchrun entry (``python -m swa_bench.run.parallel``) as a user meets it: bad input is one
line and exit 2 before any rank starts; a run folder is claimed like ``swa-bench run``'s, saved
after every case, survives a SIGKILL of the launcher (its ranks die with it) and resumes with
every finished case kept, byte for byte; a finished run is not replaced without --overwrite.

Two gloo ranks on CPU, the tiny preset, subprocesses (torchrun needs its own interpreter)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 3 * 1024**3  # as tests/test_hostile_input.py: bad input is refused within it
SCENARIO = """\
name: dp
device: cpu
model: {preset: tiny}
workload:
  requests:
    - {prompt_len: 12}
    - {prompt_len: 6}
parallel: {dp: 2}
sweep:
  grid:
    seed: [1, 2, 3, 4, 5]
checks: {e1: {}}
timing: {enabled: false}
"""


def entry(*args: str, cwd: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):  # not already inside a torchrun job
        environment.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "swa_bench.run.parallel", *args], cwd=cwd,
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def finished(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def assert_one_line_exit_2(outcome: tuple[int, str, str], *words: str) -> None:
    code, out, err = outcome
    assert code == 2, err + out
    assert "Traceback" not in err + out and "ChildFailedError" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "dp.yaml"
    path.write_text(SCENARIO)
    return path


def test_no_such_case_is_one_line_before_any_rank_starts(tmp_path, scenario):
    """``-k no-such-case`` used to exit 0 with an empty results.json (``swa-bench run -k``: 2)."""
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    proc = entry(str(scenario), "-k", "no-such-case", cwd=tmp_path, preexec_fn=limits)
    assert_one_line_exit_2(finished(proc, 60),
                           "--select: no case label or id contains 'no-such-case'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp.yaml"], "nothing is written"


@pytest.mark.parametrize(("args", "env", "words"), [
    (("--resume", "--overwrite"), {}, ["contradict"]),
    ((), {"SWA_BENCH_KERNELS": "cuda"}, ["environment: SWA_BENCH_KERNELS: "]),
    (("--out", "x" * 300), {}, ["--out: ", "longer than"]),
    (("--out", "dp.yaml"), {}, ["--out: is a file"]),
    (("--disagree-rank", "one"), {}, ["--disagree-rank: invalid int value: 'one'"]),
])
def test_bad_input_is_refused_by_the_launcher(tmp_path, scenario, monkeypatch, capsys, args,
                                             env, words):
    """The launcher's checks, in this process (each is bounded; the subprocess test above runs
    the real ``python -m``): nothing is started or written."""
    from swa_bench.run import parallel

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = parallel.main([str(scenario), *args])
    except SystemExit as exit_:  # argparse's usage errors leave this way
        code = exit_.code
    captured = capsys.readouterr()
    assert_one_line_exit_2((code, captured.out, captured.err), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp.yaml"], "nothing is written"


@pytest.mark.parametrize(("exitcode", "code", "lines"), [(1, 1, 0), (2, 2, 0), (-9, 137, 1),
                                                         (3, 3, 1)])
def test_a_failed_rank_ends_the_launcher_with_its_code_in_at_most_one_line(
        tmp_path, scenario, monkeypatch, capsys, exitcode, code, lines):
    """torchrun's ChildFailedError (a 40-line report and traceback) becomes the first failed
    rank's exit code (a signal: 128 + its number); 1 (a check failed) and 2 (bad input, said by
    rank 0) add no line, anything else one line naming the rank."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from swa_bench.run import parallel

    def fail(options):
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=exitcode, error_file="<N/A>")
        raise ChildFailedError("swa_bench.run.parallel", {1: failure})

    monkeypatch.setattr(torchrun, "run", fail)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher sets it: undone after
    assert parallel.main([str(scenario)]) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == lines and "Traceback" not in err, err
    if lines:
        assert f"rank 1 ended with exit code {exitcode}" in err


def _ranks(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (torchrun's agent starts the ranks itself)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _cases(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "results.json").read_text())["cases"]
    except (OSError, ValueError, KeyError):
        return []


@pytest.mark.slow
def test_a_killed_sweep_resumes_with_nothing_lost(tmp_path, scenario):
    """SIGKILL of the launcher once two of five cases are saved: its ranks die within 5 s (no
    orphan holds the lock), results.json holds the finished cases; ``--resume`` runs only the
    rest and keeps those cases as they were; a run without --resume or --overwrite is then
    refused in one line and leaves results.json as it was."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc (Linux)")
    out = tmp_path / "run"
    launcher = entry(str(scenario), "--out", str(out), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while len(_cases(out)) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no case saved in 180 s"
            time.sleep(0.2)
        ranks = _ranks(launcher.pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    finally:
        launcher.kill()
    kept = _cases(out)
    assert 2 <= len(kept) < 5, "killed mid-way"

    def living() -> list[int]:
        found = []
        for r in ranks:
            try:
                state = Path(f"/proc/{r}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone
                state = "Z" if not _ranks(r) else "?"
            if state != "Z" or _ranks(r):
                found.append(r)
        return found

    gone_by = time.monotonic() + 5
    while (alive := living()) and time.monotonic() < gone_by:
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert ranks and not alive, f"ranks {alive} outlived the killed launcher"

    code, stdout, stderr = finished(entry(str(scenario), "--out", str(out), "--resume",
                                          cwd=tmp_path))
    assert code == 0, stderr + stdout
    assert f"{len(kept)} case(s) done, {5 - len(kept)} to run" in stdout
    cases = _cases(out)
    assert [c["label"].rsplit("seed=", 1)[1] for c in cases] == ["1", "2", "3", "4", "5"]
    assert cases[:len(kept)] == kept, "the finished cases are kept as they were"
    assert all(len(c["parallel"]["ranks"]) == 2 for c in cases)

    before = (out / "results.json").read_bytes()
    assert_one_line_exit_2(finished(entry(str(scenario), "--out", str(out), cwd=tmp_path)),
                           "holds a run of 'dp' (5 cases)", "--resume")
    assert (out / "results.json").read_bytes() == before
