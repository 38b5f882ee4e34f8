"""Rank 0's merge of every rank's case result: other ranks' checks under their own ids, each
rank's share, and the check that every DP rank timed the same route."""

from swa_bench.parallel.collectives import ParallelGroups
from swa_bench.parallel.layout import ParallelLayout
from swa_bench.results import CaseResult, CheckResult, RankResult
from swa_bench.run.parallel import merge


def _case(passed: bool) -> CaseResult:
    return CaseResult(
        case_id="c",
        index=0,
        label="eager/bounded/T=54",
        params={},
        status="ok",
        graph_mode="eager",
        policy="bounded",
        trim_threshold=9,
        tokens=54,
        num_requests=4,
        batch="",
        checks=[CheckResult(id="E1", name="e1", passed=passed, mode="bitwise")],
    )


def _share(rank: int, route: str) -> RankResult:
    return RankResult(
        rank=rank, dp_rank=rank, tp_rank=0, num_requests=2, tokens=27, replay_route=route
    )


GROUPS = ParallelGroups(ParallelLayout(dp=2), rank=0, tp_group=None, dp_group=None)


def test_every_rank_is_kept_and_a_failure_anywhere_fails_the_case():
    merged = merge(
        [(_case(True), _share(0, "agreed: replay")), (_case(False), _share(1, "agreed: replay"))],
        GROUPS,
    )
    assert [c.id for c in merged.checks] == ["E1", "E1@r1", "DP.timed_route"]
    assert merged.checks[-1].passed
    assert merged.status == "failed" and merged.outcome() == "fail"
    assert [r.rank for r in merged.parallel.ranks] == [0, 1]


def test_ranks_that_timed_different_routes_fail():
    merged = merge(
        [(_case(True), _share(0, "replay batch")), (_case(True), _share(1, "whole batch"))], GROUPS
    )
    route = merged.checks[-1]
    assert route.id == "DP.timed_route" and not route.passed
    assert "rank 1: whole batch" in route.message
    assert merged.outcome() == "fail"
