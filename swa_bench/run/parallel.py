"""A scenario on several processes: ``python -m swa_bench.run.parallel SCENARIO [--out DIR]``
starts torchrun's launcher with the dp x tp ranks of the scenario's ``parallel`` layout on this
host (``torchrun --nproc-per-node N -m swa_bench.run.parallel ...`` runs the same ranks; only
torchrun's own failure report then follows a rank's one line).

Every rank builds the model (its TP/EP shard when tp > 1) and runs every case: E1-E5 on its own
batch (a DP rank's batch is the case's requests dealt round-robin over the DP ranks), the checks
across ranks (``checks.parallel``), and timing with the DP ranks agreeing each step's route.
Rank 0 gathers every rank's results into one results.json (and the reports): rank 0's figures,
every rank's checks (ids suffixed ``@rN`` beyond rank 0), each rank's route and time under
``parallel``. The results are started, finished and summarised by the functions ``swa-bench run``
uses (``commands.new_results``, ``commands.finish``); only the per-rank table is this entry's.

The run folder follows ``swa-bench run``'s rules (``run.folder``): bad input is refused before any
rank starts, rank 0 claims and locks the folder (default ``reports/<name>-<UTC time>``; another
run in it is refused without ``--resume`` or ``--overwrite``), results.json is saved after every
case, so a killed run resumes with nothing lost, and the ranks die with torchrun's agent.
The arguments stay argparse's: torchrun starts a module, not the CLI.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from swa_bench.bench.environment import capture_environment, scenario_hash
from swa_bench.checks.parallel import check_dp, check_tp
from swa_bench.engine.config import kernel_settings_from_environment
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.model import Transformer, build_model
from swa_bench.parallel.agreement import DataParallelAgreement
from swa_bench.parallel.collectives import ParallelGroups, init_from_env, make_groups
from swa_bench.parallel.sharded import build_sharded_model
from swa_bench.results import (
    RESULTS_JSON,
    CaseResult,
    CheckResult,
    ParallelResult,
    RankResult,
    ResultsError,
    RunResults,
    load_results,
    save_results,
)
from swa_bench.run.cases import DTYPES, CaseRunner
from swa_bench.run.commands import (
    LoadedScenario,
    finish,
    load,
    new_results,
    ready,
    refuse_other_kernels,
)
from swa_bench.run.errors import CommandError
from swa_bench.run.folder import (
    Interrupted,
    RunFolderError,
    check_target,
    claim,
    plan_run_dirs,
    utc_stamp,
)
from swa_bench.run.shards import die_with_parent
from swa_bench.scenario import Case, Scenario, ScenarioError

PROG = "python -m swa_bench.run.parallel"


class ParallelCaseRunner(CaseRunner):
    """``CaseRunner`` on one rank of a layout: the sharded model, this DP rank's batch, the
    checks across ranks, timing under the DP agreement."""

    def __init__(
        self,
        scenario: Scenario,
        groups: ParallelGroups,
        device: torch.device,
        *,
        disagree: bool = False,
    ) -> None:
        dp = groups.dp_group
        super().__init__(
            scenario, agree=None if dp is None else DataParallelAgreement(dp, disagree=disagree)
        )
        self.device, self.groups, self.disagree = device, groups, disagree

    def build_model(self, case: Case) -> Transformer:
        sc, g = case.scenario, self.groups
        if g.tp_group is None:
            return super().build_model(case)
        return build_sharded_model(
            case.model_args(),
            g.layout,
            g.rank,
            g.tp_group,
            seed=sc.seed,
            device=self.device,
            dtype=DTYPES[sc.dtype],
        )[0]

    def inputs(self, case: Case, model: Transformer) -> StepInputs:
        whole = super().inputs(case, model)
        dp, rank = self.groups.layout.dp, self.groups.dp_rank
        requests = whole.requests[rank::dp]
        return StepInputs.seeded(
            requests, model.args.vocab_size, case.scenario.seed + rank, whole.indices[rank::dp]
        )

    def run_checks(self, case, model, inputs):
        checks = super().run_checks(case, model, inputs)
        cfg = case.scenario.checks
        if not any(c.enabled for c in (cfg.e1, cfg.e2, cfg.e3, cfg.e4, cfg.e5)):
            return checks
        config, g = case.engine_config(), self.groups
        if g.dp_group is not None:
            checks += check_dp(model, inputs, config, g.dp_group, disagree=self.disagree)
        if g.tp_group is not None:
            one_rank, _ = build_model(
                case.model_args(),
                seed=case.scenario.seed,
                device=self.device,
                dtype=model.embed.weight.dtype,
            )
            checks.append(check_tp(model, one_rank, inputs, config))
        return checks


def rank_result(groups: ParallelGroups, result: CaseResult, inputs: StepInputs) -> RankResult:
    replay = result.timing.replay if result.timing is not None else None
    return RankResult(
        rank=groups.rank,
        dp_rank=groups.dp_rank,
        tp_rank=groups.tp_rank,
        num_requests=len(inputs.requests),
        tokens=inputs.num_tokens,
        replay_route=result.replay_route,
        replay_ms=None if replay is None else replay.median_ms,
        mfu_replay=result.mfu.get("replay"),
    )


def merge(per_rank: list[tuple[CaseResult, RankResult]], groups: ParallelGroups) -> CaseResult:
    """Rank 0's result with every other rank's checks and every rank's share."""
    merged = per_rank[0][0].model_copy(deep=True)
    for r, (result, _) in enumerate(per_rank[1:], start=1):
        merged.checks += [c.model_copy(update={"id": f"{c.id}@r{r}"}) for c in result.checks]
        if result.status != "ok" and merged.status == "ok":
            merged.status, merged.error = result.status, result.error
    layout = groups.layout
    routes = [share.replay_route for _, share in per_rank]
    if layout.dp > 1 and all(routes):
        merged.checks.append(
            CheckResult(
                id="DP.timed_route",
                name="every rank timed the same route",
                mode="bitwise",
                passed=len(set(routes)) == 1,
                message="; ".join(f"rank {r}: {route}" for r, route in enumerate(routes)),
            )
        )
    merged.parallel = ParallelResult(
        dp=layout.dp, tp=layout.tp, ep=layout.ep, ranks=[share for _, share in per_rank]
    )
    if any(not c.passed for c in merged.checks) and merged.status == "ok":
        merged.status = "failed"
    return merged


class _OneLineParser(argparse.ArgumentParser):
    """A usage error as one line and exit 2, like the CLI's (argparse prints the usage too)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: {' '.join(message.split())} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder (rank 0 writes it); default reports/<name>-<UTC time>")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out (or the newest one of this scenario)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in --out")
    parser.add_argument("--no-timing", action="store_true", help="the checks only")
    parser.add_argument(
        "--select", "-k", default=None, help="only the cases whose label or id contains this"
    )
    parser.add_argument(
        "--disagree-rank",
        type=int,
        default=None,
        help="test hook: this rank ignores the DP agreement (must be caught)",
    )
    return parser.parse_args(argv)


def validate(args: argparse.Namespace) -> LoadedScenario:
    """Every check that needs no process group, as ``swa-bench run`` makes them: the
    ``SWA_BENCH_*`` defaults, the flags, the scenario, --select, the --out path. Raises
    ``CommandError`` (one line, exit 2); the same on every rank, and in the launcher."""
    try:
        kernel_settings_from_environment()  # a malformed SWA_BENCH_* default: refused up front
    except ValueError as err:
        raise CommandError(f"environment: {err}") from None
    if args.resume and args.overwrite:
        raise CommandError(f"{PROG}: --resume and --overwrite contradict each other; pick one")
    try:
        item = ready(load(args.scenario), args.select)
        if args.out is not None:
            check_target(args.out)
    except (ScenarioError, RunFolderError) as err:
        raise CommandError(str(err)) from None
    return item


def _say(line: str) -> None:
    """Bad input is said once, by rank 0 (every rank finds it)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: this rank's part of the run. Started directly: the launcher."""
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        return launch(args, sys.argv[1:] if argv is None else argv)
    die_with_parent(os.getppid())  # a killed torchrun leaves no rank writing the folder
    try:
        item = validate(args)
    except CommandError as err:
        _say(str(err))
        return err.code
    scenario = item.scenario
    device = init_from_env()
    try:
        groups = make_groups(scenario.parallel.layout())
    except ValueError as err:
        _say(f"{args.scenario}: parallel: {err}")
        dist.destroy_process_group()
        return 2
    try:
        return run_ranks(args, item, groups, device)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, item: LoadedScenario, groups: ParallelGroups,
              device: torch.device) -> int:
    """Rank 0 claims (checks, locks, resumes) the run folder as ``swa-bench run`` does
    (``folder.claim``) and tells every rank the cases still to run; each finished case is
    gathered, merged and saved by rank 0 before the next starts."""
    scenario, rank0 = item.scenario, groups.rank == 0
    runner = ParallelCaseRunner(
        scenario, groups, device, disagree=args.disagree_rank == groups.rank
    )
    code: list = [None]
    try:
        with ExitStack() as stack:
            verdict: list = [None, []]  # (refusal line, ids of the cases already done)
            if rank0:
                try:
                    run_dir, results = claim_run(stack, args, item, runner)
                    verdict[1] = [c.case_id for c in results.cases]
                except (RunFolderError, ResultsError) as err:
                    verdict[0] = str(err)
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None:
                _say(verdict[0])
                return 2
            done = set(verdict[1])
            todo = [c for c in item.cases if c.case_id not in done]
            if rank0 and done:
                print(f"resuming {run_dir}: {len(done)} case(s) done, {len(todo)} to run")
            for case in todo:
                result = runner.run_case(case, timing=not args.no_timing)
                share = rank_result(groups, result, runner.inputs(case, runner.model(case)))
                gathered: list = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, (result, share))
                if rank0:
                    results.cases.append(merge(gathered, groups))
                    results.cases.sort(key=lambda c: c.index)
                    save_results(run_dir, results)
            if rank0:
                code[0] = 0 if all(c.outcome() == "pass" for c in results.cases) else 1
                finish(results, scenario, run_dir, Console())
                print_table(results.cases)
    except Interrupted as err:
        _say(str(err))
        return 130
    dist.broadcast_object_list(code, src=0)
    return code[0]


def claim_run(stack: ExitStack, args: argparse.Namespace, item: LoadedScenario,
              runner: CaseRunner) -> tuple[Path, RunResults]:
    """Rank 0's run folder, claimed and locked for the run (``stack``), and its results so far:
    with --resume the earlier run's finished cases (an errored case runs again), else none."""
    scenario, path = item.scenario, item.path
    run_dir = plan_run_dirs([scenario.name], [path], args.out, resume=args.resume,
                            stamp=utc_stamp())[0]
    again = [PROG, str(path), *(["-k", args.select] if args.select else []),
             "--out", str(run_dir), "--resume"]
    stack.enter_context(claim([run_dir], [scenario.name], [scenario_hash(scenario.source_text)],
                              resume=args.resume, overwrite=args.overwrite,
                              resume_command=shlex.join(again)))
    results = None
    if args.resume and (run_dir / RESULTS_JSON).exists():
        results = load_results(run_dir)
        results.cases = [c for c in results.cases if c.status != "error"]
        refuse_other_kernels(run_dir, results, item.cases, runner)
    if results is None:
        environment = capture_environment(scenario.timing.threads)
        environment["world_size"] = dist.get_world_size()
        results = new_results(path, scenario, environment)
    return run_dir, results


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """``python -m swa_bench.run.parallel SCENARIO``: the input checked here (one line, exit 2,
    no process started), then torchrun's launcher in this process with the scenario's dp x tp
    ranks on this host. A failed rank ends it with that rank's exit code and at most one line
    (the ranks' own lines stay; torchrun's failure report and traceback are not printed)."""
    try:
        item = validate(args)
    except CommandError as err:
        print(err, file=sys.stderr)
        return err.code
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    world = item.scenario.parallel.layout().world_size
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its banner
    logger = logging.getLogger("torch.distributed")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # torchrun's failure report: the one line below instead
    options = torchrun.parse_args(["--nproc-per-node", str(world), "--standalone",
                                   "-m", "swa_bench.run.parallel", *argv])
    try:
        torchrun.run(options)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        if code not in (1, 2, 130):  # 1: a check failed, 2 / 130: said by rank 0 already
            print(f"{PROG}: rank {rank} ended with exit code {failure.exitcode} (its output is "
                  "above)", file=sys.stderr)
        return code
    finally:
        logger.setLevel(level)
    return 0


def print_table(cases: list[CaseResult]) -> None:
    """Per case and rank: times, speedup, MFU per GPU (reference on rank 0, replay per rank)."""
    print(
        f"{'case':44} {'rank':>4} {'ref ms':>9} {'replay ms':>9} {'speedup':>7} "
        f"{'MFU ref':>7} {'MFU rep':>7}  checks  route"
    )
    for case in cases:
        failed = [c.id for c in case.checks if not c.passed]
        checks = "pass" if not failed else "FAIL " + " ".join(failed)
        if case.status == "error":
            checks = "ERROR " + (case.error or "").splitlines()[0][:60]
        for share in case.parallel.ranks:
            first = share.rank == 0
            ref = f"{case.timing.reference.median_ms:.2f}" if case.timing and first else ""
            speed = f"{case.speedup:.2f}x" if case.speedup and first else ""
            mfu_ref = case.mfu.get("reference") if first else None
            cells = [
                "" if share.replay_ms is None else f"{share.replay_ms:.2f}",
                "" if mfu_ref is None else f"{mfu_ref:.1%}",
                "" if share.mfu_replay is None else f"{share.mfu_replay:.1%}",
            ]
            print(
                f"{case.label[:44]:44} {share.rank:>4} {ref:>9} {cells[0]:>9} {speed:>7} "
                f"{cells[1]:>7} {cells[2]:>7}  {checks if first else '':6}  "
                f"{share.replay_route or ''}"
            )


if __name__ == "__main__":
    sys.exit(main())
