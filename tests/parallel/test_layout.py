"""Layout rules and the agreed plan: pure functions, against hand-worked expectations."""

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import AgreedRoute, plan_step
from swa_bench.model.args import PRESETS
from swa_bench.model.requests import RequestSpec
from swa_bench.parallel.layout import ParallelLayout, layout_problems


def test_layouts_that_shard_the_presets():
    assert layout_problems(ParallelLayout(tp=2, ep=2), PRESETS["v41-flash"]) == []
    assert layout_problems(ParallelLayout(dp=2), PRESETS["tiny"]) == []
    assert layout_problems(ParallelLayout(tp=2, ep=1), PRESETS["sparse-tiny"]) == []


def test_layouts_that_do_not():
    tiny = PRESETS["tiny"]  # 4 heads, 2 output groups, 4 experts of width 32
    assert {f for f, _ in layout_problems(ParallelLayout(tp=3), tiny)} == {"tp"}
    assert "4 attention heads" in layout_problems(ParallelLayout(tp=3), tiny)[0][1]
    assert "output groups" in layout_problems(ParallelLayout(tp=4), tiny)[0][1]
    assert layout_problems(ParallelLayout(tp=2, ep=3), tiny)[0][0] == "ep"
    five = tiny.replace(n_routed_experts=5)
    assert "5 routed experts" in layout_problems(ParallelLayout(tp=2, ep=2), five)[0][1]
    narrow = tiny.replace(moe_inter_dim=33, n_shared_experts=0)
    assert "moe_inter_dim=33" in layout_problems(ParallelLayout(tp=2, ep=1), narrow)[0][1]
    assert layout_problems(ParallelLayout(tp=2, ep=2), narrow) == []  # whole experts split


def test_a_rank_with_nothing_to_trim_follows_the_agreement():
    args = PRESETS["tiny"]  # W = 8
    config = EngineConfig.for_model(args, graph_mode="piecewise", capture_sizes=(8, 16, 64))
    short = [RequestSpec(prompt_len=6), RequestSpec(prompt_len=24, decode=True)]
    alone = plan_step(short, config, args)
    assert (alone.replays, alone.graph_size) == (False, 8)  # 7 tokens pad to 8 < threshold 9
    agreed = plan_step(short, config, args, agreed=AgreedRoute(True, 64, 2))
    assert (agreed.replays, agreed.graph_size, agreed.kept_lens) == (True, 64, (6, 1))
    assert agreed.agreed == AgreedRoute(True, 64, 2) and "DP agreement of 2" in agreed.reason
    whole = plan_step(short, config, args, agreed=AgreedRoute(False, None, 2))
    assert (whole.replays, whole.graph_size, whole.kept_lens) == (False, None, (6, 1))
