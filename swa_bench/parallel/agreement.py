"""Data-parallel route agreement (vLLM's later model runner, SPEC section 6).

DP ranks run their own requests, yet a step must take one route on every rank: engines that share
expert all-to-alls or graph shapes across ranks need the same layers on the same padded shape. So
each rank plans its step alone, the ranks all-reduce (max) two numbers, whether the rank replays
and its padded size, and every rank re-plans under the result (``dispatch.plan_step(agreed=)``).
A rank with nothing to trim then gathers, runs and scatters all of its rows.

``route_agreement`` verifies it after the fact: it all-gathers each rank's plan and names the
ranks that differ. The ``disagree`` hook makes a rank ignore the agreement (it still takes part
in the all-reduce, so the job does not hang): the check must catch it.

Both collectives are watched (``collectives.enter``): a rank that skips the all-reduce, or fails
before it, makes the others fail within the deadline naming it, not hang; and each rank posts the
two numbers it reduces on the way in, so its all-reduce's result is checked against the max of
what every rank posted (a reduction with another operator fails, naming the rank it gave).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from swa_bench.engine.dispatch import AgreedRoute, StepPlan
from swa_bench.parallel.collectives import DEFAULT_DEADLINE_S, enter, report_failure

EAGER = 1 << 62  # the padded size a rank running eagerly reports: the max makes everyone eager
AGREEMENT = "DP agreement all_reduce(MAX)"
ROUTE_REPORT = "DP route report all_gather"


@dataclass
class DataParallelAgreement:
    """``Engine(agree=...)``: this rank's plan -> the route the DP group agreed."""

    group: dist.ProcessGroup
    disagree: bool = False  # test hook: keep this rank's own decision
    # How long a rank waits for the others at the all-reduce before failing, naming them.
    deadline_s: float = DEFAULT_DEADLINE_S

    def __call__(self, plan: StepPlan) -> AgreedRoute:
        size = EAGER if plan.graph_size is None else plan.graph_size
        entry = enter(AGREEMENT, self.group, (int(plan.replays), size), self.deadline_s)
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        mine = torch.tensor([int(plan.replays), size], dtype=torch.int64, device=device)
        agreed = mine.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        got = tuple(int(v) for v in agreed.tolist())
        want = tuple(max(column) for column in zip(*entry.posted, strict=True))
        if got != want:
            raise report_failure(self.group, (
                f"rank {dist.get_rank()}: {entry.describe()} gave (replays, size) = {got}, not "
                f"the max {want} of what the ranks posted {entry.posted}: not a MAX reduction"))
        replays, size = (int(v) for v in (mine if self.disagree else agreed).tolist())
        return AgreedRoute(bool(replays), None if size == EAGER else size, self.group.size())


@dataclass(frozen=True)
class RouteReport:
    """Every DP rank's route of one step, as each rank ran it."""

    routes: list[tuple[bool, int | None]]  # (replays, graph size) per rank
    reasons: list[str]

    @property
    def agreed(self) -> bool:
        return len(set(self.routes)) == 1

    def describe(self) -> str:
        per_rank = ", ".join(
            f"rank {i}: {'replay' if r else 'whole batch'} at {'eager' if s is None else s}"
            for i, (r, s) in enumerate(self.routes)
        )
        return ("routes agree: " if self.agreed else "routes DISAGREE: ") + per_rank


def route_agreement(plan: StepPlan, group: dist.ProcessGroup,
                    deadline_s: float = DEFAULT_DEADLINE_S) -> RouteReport:
    """All-gathers the plan each rank ran (a collective: every rank calls it, watched)."""
    enter(ROUTE_REPORT, group, deadline_s=deadline_s)
    gathered: list = [None] * group.size()
    dist.all_gather_object(gathered, (plan.replays, plan.graph_size, plan.reason), group=group)
    return RouteReport([(r, s) for r, s, _ in gathered], [why for _, _, why in gathered])
