"""Sharded sweeps: cases spread over worker processes, merged into one results.json; --resume
keeps what a worker finished before the sweep was cut short."""

import json
from pathlib import Path

import pytest
from rich.console import Console

from swa_bench.results import load_results
from swa_bench.run.commands import run_scenarios
from swa_bench.run.shards import SHARD_DIR, deal, run_worker, worker_count
from swa_bench.scenario import load_cases

SCENARIO = """\
name: shard-test
model: {preset: tiny}
workload:
  requests: [{prompt_len: 20}, {prompt_len: 4}]
capture_sizes: [8, 16, 32]
sweep:
  grid:
    graph_mode: [eager, piecewise, full]
checks: {e1: {enabled: false}, e2: {enabled: false}, e3: {enabled: false}, e4: {enabled: false},
         e5: {}}
timing: {enabled: false}
"""


def test_deal_is_round_robin():
    assert deal(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert deal(list("ab"), 4) == [["a"], ["b"]]
    assert deal(list("ab"), 10**9) == [["a"], ["b"]]  # no loop over a billion workers


def test_workers_are_capped_by_cases_and_gpus():
    assert worker_count(10**9, 8, 0) == 8  # CPU: processes share the cores, one a case at most
    assert worker_count(10**9, 8, 2) == 2  # never two workers timing on one GPU
    assert worker_count(4, 3, 8) == 3
    assert worker_count(2, 0, 0) == 1


def test_two_workers_resume_a_cut_sweep(tmp_path: Path):
    path = tmp_path / "shard.yaml"
    path.write_text(SCENARIO)
    _, cases = load_cases(path)
    run_dir = tmp_path / "run"
    (run_dir / SHARD_DIR).mkdir(parents=True)
    # A worker of an earlier sweep finished the first case before the sweep was killed.
    shard = run_dir / SHARD_DIR / "shard-0.json"
    run_worker(str(path), None, [cases[0].case_id], str(shard), False)
    saved = json.loads(shard.read_text())
    assert saved["scenario_name"] == "shard-test"  # what --resume checks before merging
    saved["cases"][0]["batch"] = "kept from the killed sweep"
    shard.write_text(json.dumps(saved))

    code = run_scenarios(
        [path], out=run_dir, resume=True, timing=False, gpus=2, console=Console(quiet=True)
    )

    results = load_results(run_dir)
    assert code == 0, [(c.label, c.outcome(), [k.message for k in c.checks]) for c in results.cases]
    assert [c.case_id for c in results.cases] == [c.case_id for c in cases]
    assert results.cases[0].batch == "kept from the killed sweep"
    assert all(c.outcome() == "pass" for c in results.cases)
    assert not list((run_dir / SHARD_DIR).glob("shard-*.json"))


def test_resume_saves_the_shards_cases_before_a_new_sweep_clears_them(tmp_path, monkeypatch):
    """A resumed sweep killed again must not lose what the first sweep's workers finished."""

    from swa_bench.run import commands
    from swa_bench.run.folder import Interrupted

    path = tmp_path / "shard.yaml"
    path.write_text(SCENARIO)
    _, cases = load_cases(path)
    run_dir = tmp_path / "run"
    (run_dir / SHARD_DIR).mkdir(parents=True)
    run_worker(str(path), None, [cases[0].case_id], str(run_dir / SHARD_DIR / "shard-0.json"),
               False)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "run_sharded", killed)
    with pytest.raises(Interrupted, match="kept 1 finished case in"):
        run_scenarios([path], out=run_dir, resume=True, timing=False, gpus=2,
                      console=Console(quiet=True))
    assert [c.case_id for c in load_results(run_dir).cases] == [cases[0].case_id]


def _children(pid: int) -> list[int]:
    """Live spawned workers (``spawn_main``) whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_workers_die_with_a_killed_parent(tmp_path: Path):
    """SIGKILL of a ``--gpus 2`` sweep's parent: no worker lives on (writing shards into a folder
    nobody holds) 5 s later."""
    import os
    import signal
    import subprocess
    import sys
    import time


    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc (Linux)")
    path = tmp_path / "slow.yaml"
    path.write_text(SCENARIO.replace("timing: {enabled: false}",
                                     "timing: {enabled: true, warmup: 1, iters: 20}")
                    .replace("graph_mode: [eager, piecewise, full]",
                             "graph_mode: [eager, piecewise, full]\n    seed: [0, 1, 2]"))
    run_dir = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-m", "swa_bench", "run", str(path), "--gpus", "2",
                               "--out", str(run_dir)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        # Killed mid-sweep: both workers running (each has saved a case), cases left to run.
        deadline = time.monotonic() + 180
        shards = [run_dir / SHARD_DIR / f"shard-{k}.json" for k in range(2)]
        while (not all(f.exists() for f in shards) and time.monotonic() < deadline
               and parent.poll() is None):
            time.sleep(0.2)
        workers = _children(parent.pid)
        assert len(workers) == 2, "the sweep's two workers were not both running"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "workers outlived their parent"
    finally:
        for w in _children(parent.pid):
            os.kill(w, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
