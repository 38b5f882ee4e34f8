"""Two gloo processes: DP route agreement (and a rank that breaks it), TP=2 / EP=2 against the
one-rank model, graph replay with the collectives inside against eager.

One spawn runs every scenario of the module (a process start costs seconds on CPU); each rank
writes its check results to a file the test reads.
"""

import contextlib
import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swa_bench.checks.equivalence import check_e3
from swa_bench.checks.parallel import check_dp, check_tp
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import AgreedRoute
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.parallel import agreement
from swa_bench.parallel.collectives import CollectiveFailure, enter
from swa_bench.parallel.layout import ParallelLayout
from swa_bench.parallel.sharded import build_sharded_model

SIZES = (8, 16, 64)
# Rank 0 trims (a 40-token prefill, W = 8); rank 1 has nothing to trim.
DP_BATCHES = [
    [RequestSpec(prompt_len=40), RequestSpec(prompt_len=24, decode=True)],
    [RequestSpec(prompt_len=6), RequestSpec(prompt_len=7)],
]
TP_BATCH = [
    RequestSpec(prompt_len=40),
    RequestSpec(prompt_len=24, decode=True),
    RequestSpec(prompt_len=7),
]
TP_CASES = [("tiny", 1, "piecewise"), ("sparse-tiny", 2, "piecewise"), ("sparse-tiny", 2, "full")]


def _summary(check):
    return {"id": check.id, "passed": check.passed, "mode": check.mode, "message": check.message}


def _dp(rank):
    args = PRESETS["tiny"]
    model, _ = build_model(args, seed=0)
    inputs = StepInputs.seeded(DP_BATCHES[rank], args.vocab_size, rank)
    out = {}
    for mode in ("eager", "piecewise"):
        config = EngineConfig.for_model(args, graph_mode=mode, capture_sizes=SIZES)
        out[mode] = [_summary(c) for c in check_dp(model, inputs, config, dist.group.WORLD)]
    config = EngineConfig.for_model(args, capture_sizes=SIZES)
    out["fault"] = [
        _summary(c) for c in check_dp(model, inputs, config, dist.group.WORLD, disagree=rank == 1)
    ]
    # PIECEWISE: the ranks' padded sizes differ (64 and 16), so SUM changes the agreed one.
    piecewise = EngineConfig.for_model(args, graph_mode="piecewise", capture_sizes=SIZES)
    faults = (("skips_all_reduce", lambda: _skip_all_reduce(rank == 1)),
              ("wrong_operator", _sum_reduce))
    for name, fault in faults:
        group = dist.new_group([0, 1])  # a group of its own: the fault leaves it failed
        start = time.monotonic()
        with fault():
            checks = check_dp(model, inputs, piecewise, group, deadline_s=DEADLINE_S)
        out[name] = {"checks": [_summary(c) for c in checks], "seconds": time.monotonic() - start}
    group = dist.new_group([0, 1])
    if rank == 0:  # rank 1 never comes to it
        start = time.monotonic()
        try:
            enter("lonely", group, deadline_s=DEADLINE_S)
        except CollectiveFailure as err:
            out["never_comes"] = {"error": str(err), "seconds": time.monotonic() - start}
    return out


DEADLINE_S = 5.0


@contextlib.contextmanager
def _skip_all_reduce(faulty):
    """On the faulty rank, the agreement returns the rank's own route without its all-reduce."""
    real = agreement.DataParallelAgreement.__call__
    if faulty:
        agreement.DataParallelAgreement.__call__ = (
            lambda self, plan: AgreedRoute(plan.replays, plan.graph_size, self.group.size()))
    try:
        yield
    finally:
        agreement.DataParallelAgreement.__call__ = real


@contextlib.contextmanager
def _sum_reduce():
    """The agreement's all-reduce with SUM for MAX, on every rank (on one rank of two, gloo may
    reduce on the other: the agreed route then comes out right)."""
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return real(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def _tp(rank):
    out = {}
    for preset, ep, mode in TP_CASES:
        args = PRESETS[preset]
        layout = ParallelLayout(tp=2, ep=ep)
        sharded, _ = build_sharded_model(args, layout, rank, dist.group.WORLD, seed=0)
        one_rank, _ = build_model(args, seed=0)
        inputs = StepInputs.seeded(TP_BATCH, args.vocab_size, 0)
        config = EngineConfig.for_model(args, graph_mode=mode, capture_sizes=SIZES)
        checks = [check_tp(sharded, one_rank, inputs, config)]
        if mode != "eager":
            checks.append(check_e3(sharded, inputs, config))
        out[f"{preset}/ep{ep}/{mode}"] = [_summary(c) for c in checks]
    return out


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {"dp": _dp(rank), "tp": _tp(rank)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _by_id(checks):
    return {c["id"]: c for c in checks}


@pytest.mark.parametrize("mode", ["eager", "piecewise"])
def test_dp_ranks_agree_and_match_their_requests_alone(ranks, mode):
    for rank in ranks:
        checks = _by_id(rank["dp"][mode])
        assert all(c["passed"] for c in checks.values()), checks
        # The rank with nothing to trim replays too, at the trimming rank's padded size.
        route = "rank 0: replay at {0}, rank 1: replay at {0}".format(
            "eager" if mode == "eager" else 64
        )
        assert route in checks["DP.route"]["message"]
    assert _by_id(ranks[0]["dp"]["piecewise"])["DP.graph"]["mode"] == "bitwise"


def test_a_disagreeing_rank_is_caught(ranks):
    for rank in ranks:
        route = _by_id(rank["dp"]["fault"])["DP.route"]
        assert not route["passed"]
        assert "rank 0: replay at eager, rank 1: whole batch at eager" in route["message"]


def test_a_rank_skipping_the_all_reduce_fails_the_check_in_bounded_time(ranks):
    """Without the watchdog rank 0 waits in the all-reduce forever: here both ranks fail DP.route
    within a minute (the deadline and a poll), naming rank 1 and the collective."""
    for rank in ranks:
        run = rank["dp"]["skips_all_reduce"]
        assert run["seconds"] < 60, run
        (route,) = run["checks"]
        assert route["id"] == "DP.route" and not route["passed"]
        assert "watched collective #2 of the group [0, 1] differs between ranks (rank 0: DP " \
            "agreement all_reduce(MAX); rank 1: DP route report all_gather)" in route["message"]


def test_a_rank_that_never_comes_is_named_at_the_deadline(ranks):
    lonely = ranks[0]["dp"]["never_comes"]
    assert lonely["seconds"] < DEADLINE_S + 5, lonely
    assert lonely["error"] == ("rank 0: lonely (watched collective #1 of the group [0, 1]) timed "
                               "out after 5 s: rank 1 never reached it"), lonely


def test_a_rank_reducing_with_another_operator_fails_the_check(ranks):
    for rank in ranks:
        (route,) = rank["dp"]["wrong_operator"]["checks"]
        assert not route["passed"]
        assert "gave (replays, size) = (2, 80), not the max (1, 64)" in route["message"]
        assert "not a MAX reduction" in route["message"], route["message"]


@pytest.mark.parametrize("case", [f"{p}/ep{e}/{m}" for p, e, m in TP_CASES])
def test_tp_shards_equal_one_rank_and_graphs_equal_eager(ranks, case):
    for rank in ranks:
        checks = _by_id(rank["tp"][case])
        assert checks["TP.one_rank"]["passed"], checks["TP.one_rank"]["message"]
        if "E3" in checks:
            assert checks["E3"]["passed"] and checks["E3"]["mode"] == "bitwise", checks["E3"]
