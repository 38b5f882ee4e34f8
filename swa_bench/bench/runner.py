"""``swa-bench run`` and ``swa-bench check``: expand a scenario, run every case, save as we go.

Each case runs its checks, then times the full path and the replay path in the case's graph mode.
Models are built once per (model, seed, dtype, device); engines (and their captured graphs) once
per configuration. results.json is rewritten atomically after every case, so an interrupted sweep
keeps what finished and ``--resume`` runs only the rest. A case that raises is recorded as an
error and the sweep goes on.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from swa_bench import checks
from swa_bench.bench.advice import BreakEven, recommend_trim_threshold
from swa_bench.bench.environment import capture_environment, scenario_hash
from swa_bench.bench.flops import count_flops, measure_peak_memory
from swa_bench.bench.timing import RegionTimer, time_fn
from swa_bench.engine import Engine, run_eager
from swa_bench.model.model import Transformer, build_model
from swa_bench.replay.replay_batch import build_replay_batch, step_kept_lens
from swa_bench.replay.row_selection import trims
from swa_bench.report.console import case_progress, print_checks, print_run_summary, report_checks
from swa_bench.results import (
    CaseResult,
    CaseTiming,
    CheckResult,
    ResultsError,
    RunResults,
    ThresholdAdvice,
    load_results,
    save_results,
)
from swa_bench.run_folder import claim_for
from swa_bench.scenario import Case, Scenario, ScenarioError, expand_cases, load_scenario
from swa_bench.workload import Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CaseRunner:
    """Shares models and engines across the cases of one scenario."""

    def __init__(self, scenario: Scenario) -> None:
        self.device = resolve_device(scenario)
        self.models: dict[str, Transformer] = {}
        self.engines: dict[tuple, Engine] = {}
        self.flop_counts: dict[tuple, int] = {}

    def model(self, case: Case) -> Transformer:
        sc = case.scenario
        key = json.dumps([sc.model.model_dump(), sc.seed, sc.dtype], sort_keys=True, default=str)
        if key not in self.models:
            self.models.clear()
            self.engines.clear()
            self.flop_counts.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.models[key], _ = build_model(
                case.model_args(), seed=sc.seed, device=self.device, dtype=DTYPES[sc.dtype]
            )
        return self.models[key]

    def engine(self, case: Case, model: Transformer, policy: str) -> Engine:
        sc = case.scenario
        key = (id(model), sc.graph_mode, policy, case.trim_threshold(),
               tuple(sc.resolved_capture_sizes()), sc.eager_trim_threshold, sc.halo_align)
        if key not in self.engines:
            config = key[:2] + key[3:]  # everything but the policy
            for other in [k for k in self.engines if k[1] != "eager" and k[:2] + k[3:] != config]:
                del self.engines[other]  # the graph pools of one configuration at a time
            if self.device.type == "cuda":
                gc.collect()  # whatever still holds a dropped graph, release its pool before reuse
                torch.cuda.empty_cache()
            self.engines[key] = Engine(
                model, graph_mode=sc.graph_mode, policy=policy,
                trim_threshold=case.trim_threshold(), eager_trim_threshold=sc.eager_trim_threshold,
                capture_sizes=sc.resolved_capture_sizes(), halo_align=sc.halo_align,
            )
        return self.engines[key]

    def run_checks(self, case: Case, model: Transformer, workload: Workload) -> list[CheckResult]:
        sc = case.scenario
        cfg = sc.checks
        dtype = DTYPES[sc.dtype]
        w = model.args.window
        out = []
        if cfg.e1.enabled:
            tol = checks.Tolerance.for_dtype(dtype, cfg.e1.rtol, cfg.e1.atol)
            out.append(checks.check_e1(model, workload, policy=sc.policy,
                                       halo_align=sc.halo_align, decode_steps=2 * w, tol=tol))
        if cfg.e2.enabled:
            tol = checks.Tolerance.for_dtype(dtype, cfg.e2.rtol, cfg.e2.atol)
            out.append(checks.check_e2(model, workload, halo_align=sc.halo_align, tol=tol))
        if cfg.e3.enabled:
            engine = None
            if sc.graph_mode != "eager":
                engine = self.engine(case, model, sc.policy)
            out.append(checks.check_e3(
                model, workload, graph_mode=sc.graph_mode, policy=sc.policy,
                trim_threshold=case.trim_threshold(), capture_sizes=sc.resolved_capture_sizes(),
                max_capture_size=sc.max_capture_size, halo_align=sc.halo_align, engine=engine,
            ))
        if cfg.e4.enabled:
            tol = checks.Tolerance.for_dtype(dtype, cfg.e4.rtol, cfg.e4.atol)
            out.append(checks.check_e4(model, workload, tol=tol))
        if cfg.e5.enabled:
            out.append(checks.check_e5(model, workload, policy=sc.policy, halo_align=sc.halo_align))
        return out

    def run_case(self, case: Case, *, timing: bool = True) -> CaseResult:
        sc = case.scenario
        result = CaseResult(
            case_id=case.case_id, index=case.index, label=case.label(), params=case.params,
            status="ok", graph_mode=sc.graph_mode, policy=sc.policy,
            trim_threshold=case.trim_threshold(), tokens=case.num_tokens(),
            num_requests=len(case.requests()), batch="",
        )
        try:
            model = self.model(case)
            workload = Workload.seeded(case.requests(), model.args.vocab_size, seed=sc.seed)
            result.batch = workload.describe()
            result.checks = self.run_checks(case, model, workload)
            if sc.checks.approximation.enabled:
                a = sc.checks.approximation
                result.approximation = checks.approximation(
                    model, workload, continuation_steps=sc.continuation_steps(),
                    halo_align=sc.halo_align,
                )
                result.checks.append(checks.check_bounds(
                    result.approximation, max_logits_abs_error=a.max_logits_abs_error,
                    min_top1_agreement=a.min_top1_agreement,
                    min_greedy_agreement=a.min_greedy_agreement,
                ))
            if timing and sc.timing.enabled:
                self.measure(case, model, workload, result)
        except Exception as err:  # recorded; the sweep goes on
            result.status = "error"
            result.error = f"{type(err).__name__}: {err}".strip()
            result.error += "\n" + "".join(traceback.format_exception(err)[-3:])
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return result
        if any(not c.passed for c in result.checks):
            result.status = "failed"
        return result

    def measure(self, case: Case, model: Transformer, workload: Workload, result: CaseResult):
        """Times the full path and the replay path in the case's graph mode, with the replay
        step's breakdown recorded in the same iterations; peak memory of each (on a GPU over the
        timed loop itself); FLOPs of each path, counted once per workload and policy."""
        sc, t = case.scenario, case.scenario.timing
        reference = self.engine(case, model, "full")
        replay = self.engine(case, model, sc.policy)
        for engine in (reference, replay):
            workload.fill_context(engine)
            engine.capture()

        timings, peaks, breakdown = {}, {}, {}
        for name, engine in (("reference", reference), ("replay", replay)):
            timer = RegionTimer(self.device) if name == "replay" and t.breakdown else None

            def step(engine=engine, timer=timer):
                engine.step(workload.requests, workload.step_tokens, timer=timer)

            def timed(step=step, name=name):
                timings[name] = time_fn(
                    step, device=self.device, warmup=t.warmup, iters=t.iters,
                    l2_flush=t.l2_flush, threads=t.threads,
                )

            if self.device.type == "cuda":
                peaks[name] = measure_peak_memory(timed, self.device)
            else:
                timed()
                peaks[name] = measure_peak_memory(step, self.device)
            if timer is not None:
                breakdown = timer.summary()
        result.timing = CaseTiming(reference=timings["reference"], replay=timings["replay"],
                                   breakdown_ms=breakdown)
        result.peak_memory_bytes = peaks
        result.flops = {
            "reference": self.flops(model, workload, reference, "full"),
            "replay": self.flops(model, workload, replay, sc.policy),
        }
        result.ideal_speedup = result.flops["reference"] / max(result.flops["replay"], 1)
        if sc.graph_mode == "full":
            result.ideal_speedup = 1.0  # FULL graphs keep the decoder on the whole batch
        result.speedup = timings["reference"].median_ms / timings["replay"].median_ms
        result.efficiency = result.speedup / result.ideal_speedup
        graphs = replay.graphs
        lens = step_kept_lens(replay.prepare(workload.requests, workload.step_tokens),
                              sc.policy, model.args, sc.halo_align)
        replays = sc.graph_mode != "full" and trims(workload.requests, lens)
        result.deterministic = {
            "kept_rows": sum(lens) if replays else workload.num_tokens,
            "flops_reference": result.flops["reference"],
            "flops_replay": result.flops["replay"],
            "graphs_captured": 0 if graphs is None else len(graphs.graphs),
            "graph_segments": 0 if graphs is None else graphs.stats.segments,
            "graph_breaks": 0 if graphs is None else graphs.stats.breaks,
        }
        if graphs is not None:
            result.deterministic["padded_tokens"] = replay.graph_size_for(workload.requests) or 0
            result.capture_seconds = graphs.stats.seconds
            on_cuda = self.device.type == "cuda"
            result.graph_pool_bytes = graphs.stats.pool_bytes if on_cuda else None

    def flops(self, model: Transformer, workload: Workload, engine: Engine, policy: str) -> int:
        """The path's arithmetic, counted on an eager run (graph replays hide their kernels);
        equal across graph modes except FULL, which never trims."""
        replays = policy != "full" and engine.graph_mode != "full"
        key = (id(model), workload, policy if replays else "full")
        if key not in self.flop_counts:
            self.flop_counts[key] = count_flops(
                lambda: _eager_path(engine, workload, policy if replays else None)
            )
        return self.flop_counts[key]


def _eager_path(engine: Engine, workload: Workload, policy: str | None):
    """The path's arithmetic, counted on an eager run (graph replays hide their kernels)."""
    step = engine.prepare(workload.requests, workload.step_tokens)
    replay_batch = None
    if policy not in (None, "full") and engine.graph_mode != "full":
        replay_batch = build_replay_batch(step, policy, engine.args, halo_align=engine.halo_align)
    engine.model.attach_cache(engine.cache)
    return run_eager(engine.model, step, replay_batch=replay_batch)


def resolve_device(scenario: Scenario) -> torch.device:
    """``auto`` takes the GPU when there is one; asking for ``cuda`` without one is bad input."""
    if scenario.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if scenario.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError(scenario.source_path, "device", "cuda requested but no GPU is visible")
    return torch.device(scenario.device)


def threshold_advice(cases: Sequence[CaseResult], window: int) -> list[ThresholdAdvice]:
    """Per graph mode, policy and batch shape (request kinds, lengths aside): the smallest token
    count from which replay beats the full path."""
    groups: dict[tuple[str, str, str], list[BreakEven]] = {}
    for case in cases:
        if case.timing is None or case.timing.reference is None or case.timing.replay is None:
            continue
        if case.policy == "full" or case.graph_mode == "full":
            continue  # FULL graphs keep the decoder on the whole batch: nothing to advise
        shape = _batch_shape(case.batch)
        groups.setdefault((case.graph_mode, case.policy, shape), []).append(BreakEven(
            case.tokens, case.timing.reference.median_ms, case.timing.replay.median_ms))
    advice = []
    for (mode, policy, shape), points in sorted(groups.items()):
        value = recommend_trim_threshold(points, window=window)
        tokens = sorted({p.tokens for p in points})
        note = f"{policy}; measured at {tokens} tokens"
        if value is None:
            note += "; replay never won"
        advice.append(ThresholdAdvice(graph_mode=mode, batch=shape,
                                      recommended_trim_threshold=value, note=note))
    return advice


def _batch_shape(batch: str) -> str:
    kinds: dict[str, int] = {}
    for part in batch.split(", "):
        kind = "decode" if part.startswith("decode") else (
            "prefill+ctx" if "ctx" in part else "prefill")
        kinds[kind] = kinds.get(kind, 0) + 1
    return " + ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def run_scenarios(
    paths: Sequence[Path], *, out: Path | None = None, resume: bool = False,
    baseline: Path | None = None, console: Console | None = None, timing: bool = True,
    select: str | None = None, overwrite: bool = False, max_cases: int | None = None,
) -> int:
    """Runs every scenario; exit code 0 when every check passes, 1 otherwise (2 is the CLI's).
    Every run folder is checked and locked before the first case (run_folder.claim_for)."""
    console = console or Console()
    scenarios = [load_scenario(p, max_cases=max_cases) for p in paths]
    code = 0
    extra = ["-k", select] if select else []
    with claim_for(paths, scenarios, out=out, resume=resume, overwrite=overwrite,
                   extra_args=extra) as run_dirs:
        for path, scenario, run_dir in zip(paths, scenarios, run_dirs, strict=True):
            results = run_one(path, scenario, run_dir, resume=resume, console=console,
                              timing=timing, select=select)
            if results.verdict() != "pass":
                code = 1
            if baseline is not None:
                from swa_bench.compare import compare_command

                if compare_command(baseline, run_dir, console=console) != 0:
                    code = 1
    return code


def run_one(
    path: Path, scenario: Scenario, run_dir: Path, *, resume: bool, console: Console,
    timing: bool = True, select: str | None = None,
) -> RunResults:
    from swa_bench.report import append_step_summary, write_reports

    runner = CaseRunner(scenario)
    cases = expand_cases(scenario)
    if select is not None:
        cases = [c for c in cases if select in c.label() or select in c.case_id]
        if not cases:
            raise ScenarioError(path, "--select", f"no case label or id contains {select!r}")
    digest = scenario_hash(scenario.source_text)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = None
    if resume and (run_dir / "results.json").exists():
        results = load_results(run_dir)
        if results.scenario_hash != digest:
            raise ResultsError(run_dir / "results.json", "scenario_hash",
                               f"the run was made from another version of {path}; start a new run")
    if results is None:
        results = RunResults(
            scenario_name=scenario.name, scenario_file=str(path), scenario_hash=digest,
            scenario=json.loads(scenario.model_dump_json()),
            environment=capture_environment(scenario.timing.threads),
            started_at=_now(),
        )
    done = {c.case_id for c in results.cases if c.status != "error"}
    results.cases = [c for c in results.cases if c.case_id in done]
    todo = [c for c in cases if c.case_id not in done]
    if done:
        console.print(f"resuming {run_dir}: {len(done)} case(s) done, {len(todo)} to run")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(scenario.name, total=len(todo))
        for case in todo:
            progress.update(task, description=f"{scenario.name}: {case.label()}")
            results.cases.append(runner.run_case(case, timing=timing))
            results.cases.sort(key=lambda c: c.index)
            save_results(run_dir, results)
            progress.advance(task)
    results.threshold_advice = threshold_advice(results.cases, scenario.model_args().window)
    results.finished_at = _now()
    save_results(run_dir, results)
    write_reports(run_dir)
    append_step_summary(run_dir)
    print_run_summary(console, results, run_dir)
    return results


def check_scenarios(paths: Sequence[Path], *, console: Console | None = None,
                    max_cases: int | None = None, as_json: bool = False) -> int:
    """Runs only the checks: a progress bar, then a pass/fail table and a summary line per
    scenario (or, with ``as_json``, one JSON document on stdout). Exit 1 unless all pass."""
    console = console or Console()
    checked = []
    for path in paths:
        scenario = load_scenario(path, max_cases=max_cases)
        runner = CaseRunner(scenario)
        cases = expand_cases(scenario)
        results = []
        with case_progress(console, scenario.name, len(cases)) as starting:
            for case in cases:
                starting(case.label())
                results.append(runner.run_case(case, timing=False))
        if not as_json:
            print_checks(console, scenario.name, results)
        checked.append((scenario.name, str(path), results))
    return report_checks(checked, as_json=as_json)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
