"""The checks of a whole chunked prompt on the tiny preset (W = 8, H = 29): the approximation
after the last chunk is exactly zero under full and not under bounded; a halo run's end state
equals the full prefill's within the envelope and a bounded run's does not (so the comparison
can fail); E1 passes at every chunk of final_window's carried run."""

import pytest

from swa_bench.checks import prompts
from swa_bench.engine.chunked_prompt import ChunkedPrompt
from swa_bench.engine.config import EngineConfig
from swa_bench.kernels.config import KernelSettings

KERNELS = KernelSettings()
K = 8  # = W: the continuation's minimum



pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def prompt(tiny_args):
    # chunks of 48, 48 and 4: each > H (halo trims), the last < W; one decode row beside them
    return ChunkedPrompt.build(100, 48, vocab=tiny_args.vocab_size, seed=2, decodes_beside=1,
                               decode_context=30)


def run(model, prompt, policy):
    return prompts.run_chunked(model, prompt, policy=policy, halo_align=1, kernels=KERNELS)


def test_the_approximation_is_zero_under_full_and_not_under_bounded(tiny_model, prompt):
    full, _ = prompts.prompt_approximation(run(tiny_model, prompt, "full"), prompt,
                                           policy="full", halo_align=1, continuation_steps=K)
    assert (full.logits_max_abs, full.kl, full.top1_agreement, full.greedy_agreement) == (
        0.0, 0.0, 1.0, 1.0)
    assert full.window_kv_rel_error == [0.0] * 4
    assert full.continuation_steps == K
    bounded, first_kv = prompts.prompt_approximation(
        run(tiny_model, prompt, "bounded"), prompt, policy="bounded", halo_align=1,
        continuation_steps=K)
    assert bounded.logits_max_abs > 1e-4 and bounded.kl > 0
    # the error starts after layer S + 1, whose window KV is exact (SPEC section 2)
    assert first_kv.passed, first_kv.message
    assert bounded.window_kv_rel_error[-1] > bounded.window_kv_rel_error[0]


def test_halo_ends_where_the_full_prefill_does_and_bounded_does_not(tiny_model, prompt):
    halo = prompts.check_halo_end_state(run(tiny_model, prompt, "halo"), prompt)
    assert halo.id == "E2" and halo.passed, halo.message
    assert "after 3 chunks of 48" in halo.message
    # judged against each tensor's rounding envelope, not bit for bit: its record says so
    assert halo.mode == "tolerance" and "bitwise" not in halo.message
    bounded = prompts.check_halo_end_state(run(tiny_model, prompt, "bounded"), prompt)
    assert not bounded.passed
    assert any(d.tensor.startswith("full_prefill:ring.") for d in bounded.diagnostics
               if d.mismatched)


def test_e1_passes_at_every_chunk_of_a_carried_final_window_run(tiny_model, prompt):
    config = EngineConfig.for_model(tiny_model.args, policy="final_window", kernels=KERNELS)
    results = prompts.check_prompt_e1(tiny_model, prompt, config)
    assert [r.id for r in results] == ["E1"] * 3
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]
    assert [r.message.split(":")[0] for r in results] == [
        "chunk [0, 48) after 0 carried steps", "chunk [48, 96) after 1 carried steps",
        "chunk [96, 100) after 2 carried steps"]
    # the final window [92, 100): the middle chunk keeps its 4 rows in it (TensorRT-LLM)
    assert ", 1 kept rows" in results[0].message  # the decode row beside it alone
    assert ", 5 kept rows" in results[1].message  # its 4 rows in the window + the decode row
