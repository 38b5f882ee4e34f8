"""Sharded sweeps (``swa-bench run --gpus N``): a scenario's cases spread over N worker processes,
one per GPU.

The cases still to run are dealt round-robin (worker k runs cases k, k + N, ...), so each worker
gets long and short cases alike. A worker sees one GPU (``CUDA_VISIBLE_DEVICES`` = its index; on
a CPU machine the N workers share the cores), runs its cases with a ``CaseRunner`` of its own and
rewrites ``.shards/shard-K.json`` atomically after every case. The parent folds the shard files
into results.json when the workers end, and again at the start of a ``--resume``, so a killed
sweep keeps every case any worker finished. Cases are independent: no process group is needed,
but a worker dies with its parent (``die_with_parent``), so a killed sweep leaves no orphan
writing into a folder nobody holds.
The shard files themselves (their format and who may merge them) belong to the run folder
(``folder.shard_results``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from swa_bench.bench.environment import scenario_hash
from swa_bench.bench.timing import num_threads
from swa_bench.results import CaseResult, write_text_atomic
from swa_bench.run.cases import CaseRunner, case_skeleton
from swa_bench.run.folder import SHARD_DIR, Shard, clear_shards, shard_results
from swa_bench.scenario import Case, load_cases


def worker_count(requested: int, cases: int, devices: int) -> int:
    """How many workers a ``--gpus`` sweep starts: never more than it has cases, nor (where GPUs
    are visible) more than GPUs, since two workers on one GPU time each other's kernels. Decided
    before any worker is started or dealt to: ``--gpus 1000000000`` costs nothing."""
    cap = min(requested, cases)
    return max(1, min(cap, devices) if devices else cap)


def deal(cases: Sequence[Case], workers: int) -> list[list[Case]]:
    """Round-robin: worker k gets cases k, k + workers, ... (at most one worker a case)."""
    return [list(cases[k::workers]) for k in range(min(workers, len(cases)))]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (Linux ``PR_SET_PDEATHSIG``); if it already
    died (this process's parent is no longer ``parent``), exit now. Elsewhere nothing: the
    parent's own exit path still terminates its workers."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def run_worker(
    scenario_path: str, max_cases: int | None, case_ids: list[str], shard_file: str, timing: bool,
    parent: int | None = None,
) -> None:
    """One worker: its cases, saved after each (runs in a spawned process, ``parent`` the
    sweep's pid: the worker dies with it)."""
    if parent is not None:
        die_with_parent(parent)
    scenario, cases = load_cases(Path(scenario_path), max_cases=max_cases)
    runner = CaseRunner(scenario)
    shard = Shard(scenario_name=scenario.name, scenario_hash=scenario_hash(scenario.source_text),
                  cases=[])
    wanted = set(case_ids)
    with num_threads(scenario.timing.threads):
        for case in cases:
            if case.case_id in wanted:
                shard.cases.append(runner.run_case(case, timing=timing))
                write_text_atomic(Path(shard_file), shard.model_dump_json())


def run_sharded(
    scenario_path: Path,
    max_cases: int | None,
    todo: Sequence[Case],
    run_dir: Path,
    workers: int,
    *,
    timing: bool,
    identity: tuple[str, str],
    on_progress: Callable[[int], None] = lambda done: None,
) -> list[CaseResult]:
    """Runs ``todo`` on ``workers`` processes; the results of every case a worker finished. A
    worker that died leaves its unfinished cases as errors naming its exit code. ``identity`` is
    the scenario's (name, source hash) that every shard file must carry."""
    visible = torch.cuda.device_count()
    shards = deal(todo, worker_count(workers, len(todo), visible))
    (run_dir / SHARD_DIR).mkdir(exist_ok=True)
    clear_shards(run_dir)
    context = multiprocessing.get_context("spawn")
    processes = []
    for k, shard in enumerate(shards):
        shard_file = run_dir / SHARD_DIR / f"shard-{k}.json"
        args = (str(scenario_path), max_cases, [c.case_id for c in shard], str(shard_file), timing,
                os.getpid())
        process = context.Process(target=run_worker, args=args, name=f"swa-bench-shard-{k}")
        previous = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(k % visible)
        try:
            process.start()
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous
        processes.append((process, shard))
    try:
        while any(p.is_alive() for p, _ in processes):
            time.sleep(0.5)
            on_progress(len(shard_results(run_dir, *identity)))
    except BaseException:
        for process, _ in processes:
            process.terminate()
        raise
    results = {c.case_id: c for c in shard_results(run_dir, *identity)}
    for process, shard in processes:
        process.join()
        for case in shard:
            if case.case_id not in results:
                results[case.case_id] = lost_case(case, process.exitcode)
    on_progress(len(results))
    return list(results.values())


def lost_case(case: Case, exitcode: int | None) -> CaseResult:
    return case_skeleton(case, "error", f"its worker process ended with exit code {exitcode}")
