"""The shipped gates scenario (issue 30): each case carries the gates its sweep sets into its
engine configuration and results, and its requests are the ones the engines would run (hand
count on the tiny preset, W = 8)."""

from __future__ import annotations

from pathlib import Path

import swa_bench
from swa_bench.model.requests import RequestSpec as R
from swa_bench.run.cases import case_skeleton
from swa_bench.scenario import expand_cases, load_scenario

GATES = Path(swa_bench.__file__).parent / "scenarios" / "gates.yaml"


def test_gates_scenario_cases():
    cases = expand_cases(load_scenario(GATES))
    gates = [(c.engine_config().kv_block_reuse, c.engine_config().lora,
              c.engine_config().prompt_embeds) for c in cases]
    assert gates == [(False, False, False)] * 3 + [(True, False, False)] * 2 + [
        (False, True, False), (False, False, True)]
    assert cases[5].engine_config().replay_capture_sizes == ()  # LoRA: no replay graphs
    assert cases[0].requests() == [
        R(24, decode=True, spec_decode_tokens=3), R(13, context_logits=True),
        R(10, prompt_logprobs=True), R(30, cached_len=4, recomputed_rows=8), R(20), R(40)]
    result = case_skeleton(cases[3], "ok")
    assert result.kv_block_reuse and not result.lora and not result.prompt_embeds
    assert result.prefix_hits == ["hit 12 of 30: recomputes [4, 12)",
                                  "hit 6 of 20: not adopted (<= W=8), from 0"]
