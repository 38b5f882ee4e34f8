"""A scenario on several processes: ``torchrun --nproc-per-node N -m swa_bench.run.parallel
SCENARIO [--out DIR]`` (N = dp x tp of the scenario's ``parallel`` layout).

Every rank builds the model (its TP/EP shard when tp > 1) and runs every case: E1-E5 on its own
batch (a DP rank's batch is the case's requests dealt round-robin over the DP ranks), the checks
across ranks (``checks.parallel``), and timing with the DP ranks agreeing each step's route.
Rank 0 gathers every rank's results into one results.json (and the reports): rank 0's figures,
every rank's checks (ids suffixed ``@rN`` beyond rank 0), each rank's route and time under
``parallel``. The results are started, finished and summarised by the functions ``swa-bench run``
uses (``commands.new_results``, ``commands.finish``); only the per-rank table is this entry's.
The arguments stay argparse's: torchrun starts a module, not the CLI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from swa_bench.bench.environment import capture_environment
from swa_bench.checks.parallel import check_dp, check_tp
from swa_bench.engine.config import kernel_settings_from_environment
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.model import Transformer, build_model
from swa_bench.parallel.agreement import DataParallelAgreement
from swa_bench.parallel.collectives import ParallelGroups, init_from_env, make_groups
from swa_bench.parallel.sharded import build_sharded_model
from swa_bench.results import CaseResult, CheckResult, ParallelResult, RankResult
from swa_bench.run.cases import DTYPES, CaseRunner
from swa_bench.run.commands import finish, load, new_results, ready
from swa_bench.scenario import Case, Scenario, ScenarioError


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m swa_bench.run.parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="run folder (rank 0 writes it)")
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
    args = parser.parse_args(argv)
    try:
        kernel_settings_from_environment()  # a malformed SWA_BENCH_* default: refused up front
    except ValueError as err:
        print(f"environment: {err}", file=sys.stderr)
        return 2
    try:
        item = ready(load(args.scenario), args.select)
    except ScenarioError as err:
        print(err, file=sys.stderr)
        return 2
    scenario, cases = item.scenario, item.cases
    device = init_from_env()
    try:
        groups = make_groups(scenario.parallel.layout())
    except ValueError as err:
        print(f"{args.scenario}: parallel: {err}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    runner = ParallelCaseRunner(
        scenario, groups, device, disagree=args.disagree_rank == groups.rank
    )
    environment = capture_environment(scenario.timing.threads)
    environment["world_size"] = dist.get_world_size()
    results = new_results(args.scenario, scenario, environment)
    merged = []
    for case in cases:
        result = runner.run_case(case, timing=not args.no_timing)
        share = rank_result(groups, result, runner.inputs(case, runner.model(case)))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (result, share))
        merged.append(merge(gathered, groups))
    code = 0 if all(c.outcome() == "pass" for c in merged) else 1
    if groups.rank == 0:
        out = args.out or Path("reports") / f"{scenario.name}-parallel"
        out.mkdir(parents=True, exist_ok=True)
        results.cases = merged
        finish(results, scenario, out, Console())
        print_table(merged)
    dist.destroy_process_group()
    return code


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
