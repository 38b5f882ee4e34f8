"""Checks across ranks: DP route agreement and the sharded model against one rank.

Every function here is a collective: each rank of the group calls it with its own inputs.

* ``check_dp``: the step planned under the DP agreement (``parallel.agreement``) took one route on
  every rank (DP.route, exact); this rank's logits and caches equal the same requests run alone on
  this rank (DP.alone, rounding envelope: a rank with nothing to trim ran the replay batch with
  all rows kept, GEMMs of another row order); in a graph mode the agreed graph step equals the
  eager forward of the same agreed plan and padded shape bitwise (DP.graph). Its collectives
  are watched: a rank that skips one or reduces wrongly fails DP.route within the deadline, the
  message naming the rank and the collective, instead of hanging the job.
* ``check_tp``: a TP/EP-sharded model's logits and caches equal the one-rank model's on the same
  requests (TP.one_rank, rounding envelope: partial sums reduced in another order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from swa_bench.checks.comparison import check_result, compare, envelope_tolerance
from swa_bench.checks.equivalence import check_precision
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.model import Transformer
from swa_bench.parallel.agreement import DataParallelAgreement, route_agreement
from swa_bench.parallel.collectives import DEFAULT_DEADLINE_S, CollectiveFailure, enter
from swa_bench.results import CheckResult


def _step(engine: Engine, inputs: StepInputs) -> StepOutput:
    inputs.fill_context(engine)
    return engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)


def _within_envelope(
    prefix: str, a: StepOutput, b: StepOutput, ea: Engine, eb: Engine, dtype: torch.dtype
) -> list:
    diags = [compare(f"{prefix}logits", a.logits, b.logits, envelope_tolerance(b.logits, dtype))]
    theirs = eb.cache.tensors()
    for name, t in ea.cache.tensors().items():
        diags.append(
            compare(
                f"{prefix}cache.{name}", t, theirs[name], envelope_tolerance(theirs[name], dtype)
            )
        )
    return diags


CHECK_DEADLINE_S = 120.0  # per collective once every rank has begun the DP checks


def check_dp(
    model: Transformer,
    inputs: StepInputs,
    config: EngineConfig,
    group: dist.ProcessGroup,
    *,
    disagree: bool = False,
    deadline_s: float = CHECK_DEADLINE_S,
) -> list[CheckResult]:
    """DP.route, DP.alone and DP.graph for this rank's ``inputs``; ``disagree`` is the test hook
    of a rank that ignores the agreement. The ranks first meet (within the process group's own
    timeout: each ran its own checks before, for as long as they take); from there each
    collective waits at most ``deadline_s`` for the others. A watched collective that fails
    ends the DP checks at once with a failed DP.route naming the rank and the collective."""
    try:
        enter("DP checks begin", group, deadline_s=DEFAULT_DEADLINE_S)
        return _check_dp(model, inputs, config, group, disagree, deadline_s)
    except CollectiveFailure as err:
        return [CheckResult(id="DP.route", name="DP ranks take one route", passed=False,
                            mode="bitwise", message=str(err))]


def _check_dp(model: Transformer, inputs: StepInputs, config: EngineConfig,
              group: dist.ProcessGroup, disagree: bool, deadline_s: float) -> list[CheckResult]:
    dtype = model.embed.weight.dtype
    with check_precision():
        agreeing = Engine(model, config, agree=DataParallelAgreement(group, disagree=disagree,
                                                                     deadline_s=deadline_s))
        out = _step(agreeing, inputs)
        report = route_agreement(out.plan, group, deadline_s)
        alone = Engine(model, config)
        ref = _step(alone, inputs)
        checks = [
            CheckResult(
                id="DP.route",
                name="DP ranks take one route",
                passed=report.agreed,
                mode="bitwise",
                message=report.describe(),
            ),
            check_result(
                "DP.alone",
                "DP rank == the same requests alone",
                _within_envelope("", out, ref, agreeing, alone, dtype),
                envelope_tolerance(ref.logits, dtype),
                f"this rank: {out.plan.reason}",
            ),
        ]
        if config.graph_mode == "eager":
            checks.append(
                CheckResult(
                    id="DP.graph",
                    name="DP graph replay == eager",
                    passed=True,
                    mode="info",
                    message="eager case: no graph to compare",
                )
            )
            return checks
        graph = Engine(model, config, agree=DataParallelAgreement(group, disagree=disagree,
                                                                  deadline_s=deadline_s))
        eager = Engine(model, EngineConfig.for_model(model.args, policy=config.policy,
                                                     halo_align=config.halo_align,
                                                     kernels=config.kernels))
        inputs.fill_context(eager)
        g = _step(graph, inputs)
        e = graph.eager_equivalent(
            inputs.requests, inputs.step_tokens, inputs.cache_indices, on=eager
        )
        diags = [compare("logits", g.logits, e.logits, None)]
        diags += [
            compare(f"stream{i}", a, b, None)
            for i, (a, b) in enumerate(zip(g.streams, e.streams, strict=True))
        ]
        theirs = eager.cache.tensors()
        diags += [
            compare(f"cache.{n}", t, theirs[n], None) for n, t in graph.cache.tensors().items()
        ]
        checks.append(
            check_result(
                "DP.graph",
                f"DP {config.graph_mode} replay == eager",
                diags,
                None,
                f"agreed padded size {g.plan.graph_size}",
            )
        )
    return checks


def check_tp(
    sharded: Transformer, one_rank: Transformer, inputs: StepInputs, config: EngineConfig
) -> CheckResult:
    """TP.one_rank: the sharded model's step vs the one-rank model's, same config and inputs."""
    dtype = sharded.embed.weight.dtype
    with check_precision():
        a_engine, b_engine = Engine(sharded, config), Engine(one_rank, config)
        a, b = _step(a_engine, inputs), _step(b_engine, inputs)
        diags = _within_envelope("", a, b, a_engine, b_engine, dtype)
    return check_result(
        "TP.one_rank",
        "sharded model == one rank",
        diags,
        envelope_tolerance(b.logits, dtype),
        a.plan.reason,
    )
