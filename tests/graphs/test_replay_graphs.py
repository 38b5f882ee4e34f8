"""Replay graphs (issue 34): a PIECEWISE replay batch in a graph of its own equals the same padded
replay batch run eagerly, bit for bit, over changing row sets at every replay capture size, its
padded rows included, and its padded rows write no KV.

On the CPU stand-in everywhere and on real CUDA graphs where a GPU is present.
"""

import pytest
import torch

from swa_bench.checks import oracle
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.model import Transformer, build_model
from swa_bench.model.requests import RequestSpec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CAPTURE_SIZES = (16, 32)
TRIM_THRESHOLD = 16


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.shape == b.shape, f"{name}: {tuple(a.shape)} != {tuple(b.shape)}"
    same = a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} bytes differ"


def replay_steps(window: int) -> list[tuple[list[RequestSpec], list[int]]]:
    """Steps (with their cache indices, never slot 0) whose kept rows pad to every replay size of
    the tiny preset beside model graphs up to 32 (W = 8: sizes 8, 16, 24, 32), one size twice
    with other rows, inside a model graph and in eager steps; prefills of 2W keep W rows each."""
    w = window
    prefills = [RequestSpec(prompt_len=2 * w) for _ in range(3)]
    decode = RequestSpec(prompt_len=5, decode=True)
    return [
        (prefills[:1], [1]),  # 8 kept rows in a model graph of 16: no padding
        ([*prefills[:1], decode], [2, 1]),  # 9 -> 16
        ([*prefills[:2], decode], [3, 1, 2]),  # 17 -> 24
        ([*prefills[:3], decode], [3, 1, 2, 4]),  # 25 -> 32
        ([RequestSpec(prompt_len=40, cached_len=3), decode,
          RequestSpec(prompt_len=2, decode=True)], [2, 4, 3]),  # 10 -> 16 again
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_replay_graph_is_bitwise_the_padded_eager_replay_batch(tiny_args, device, monkeypatch):
    model, _ = build_model(tiny_args, seed=0, device=device)
    config = EngineConfig.for_model(tiny_args, graph_mode="piecewise", policy="bounded",
                                    trim_threshold=TRIM_THRESHOLD, capture_sizes=CAPTURE_SIZES)
    w = tiny_args.window
    assert config.replay_capture_sizes == tuple(
        oracle.replay_capture_size_table(w, max(CAPTURE_SIZES), tiny_args.max_requests))
    graph, eager = Engine(model, config), Engine(model)
    eager_outputs: list[tuple[torch.Tensor, ...]] = []
    real = Transformer.run_replay_layers

    def spy(self, kv_s, *inputs):
        out = real(self, kv_s, *inputs)
        eager_outputs.append(tuple(t.clone() for t in out))
        return out

    seen = []
    for i, (requests, slots) in enumerate(replay_steps(w)):
        load = StepInputs.seeded(requests, tiny_args.vocab_size, 200 + i, slots)
        load.fill_context(eager)
        graph.cache.copy_from(eager.cache)
        slot0 = {n: t.clone() for n, t in eager.cache.tensors().items()}
        out = graph.step(requests, load.step_tokens, slots)
        size = out.plan.replay_graph_size
        assert size is not None and out.replay_batch.run_graph is not None, out.plan.reason
        assert out.plan.reason.endswith(f"replay graph of {size} for {out.plan.num_kept} "
                                        "kept rows")
        seen.append(size)
        padded = tuple(t.clone() for t in graph.replay_graphs.graphs[size].outputs)
        monkeypatch.setattr(Transformer, "run_replay_layers", spy)
        ref = graph.eager_equivalent(requests, load.step_tokens, slots, on=eager)
        monkeypatch.setattr(Transformer, "run_replay_layers", real)
        assert ref.replay_batch.run_graph is None and ref.replay_batch.graph_size == size
        (eager_padded,) = [o for o in eager_outputs if o[0].shape[0] == size][-1:]
        for j, (a, b) in enumerate(zip(padded, eager_padded, strict=True)):
            assert_bitwise(a, b, f"step {i} replay output {j} (all {size} padded rows)")
        assert_bitwise(out.logits, ref.logits, f"step {i} logits")
        for j, (a, b) in enumerate(zip(out.streams, ref.streams, strict=True)):
            assert_bitwise(a, b, f"step {i} stream {j}")
        for name, t in graph.cache.tensors().items():
            assert_bitwise(t, eager.cache.tensors()[name], f"step {i} {name}")
        # Padded rows belong to the dummy request, whose cache index is slot 0: no step here uses
        # slot 0, so any write by a padded row would show there.
        checked = 0
        for name, t in graph.cache.tensors().items():
            if t.shape[0] % tiny_args.max_requests == 0:  # per-slot caches, trash rows aside
                per = t.shape[0] // tiny_args.max_requests
                assert_bitwise(t[:per], slot0[name][:per], f"step {i} {name} slot 0")
                checked += 1
        assert checked >= 3, "the window rings and the compressed caches are per slot"
    assert config.replay_capture_sizes == (8, 16, 24, 32)
    assert sorted(set(seen)) == list(config.replay_capture_sizes) and len(seen) > len(set(seen))
    assert set(graph.replay_graphs.graphs) == set(seen), "each size captured once"


def test_replay_batch_above_the_largest_size_runs_eagerly(tiny_args):
    model, _ = build_model(tiny_args, seed=0)
    config = EngineConfig.for_model(tiny_args, graph_mode="piecewise", policy="bounded",
                                    trim_threshold=TRIM_THRESHOLD, capture_sizes=CAPTURE_SIZES,
                                    replay_capture_sizes=[8, 16])
    requests = [RequestSpec(prompt_len=30), RequestSpec(prompt_len=20),
                RequestSpec(prompt_len=3)]  # 8 + 8 + 3 = 19 kept rows
    plan = Engine(model, config).plan(requests)
    assert plan.replays and plan.replay_graph_size is None
    assert "19 kept rows above the largest replay graph 16: eager" in plan.reason
    expected = oracle.expect_step(
        requests, policy="bounded", graph_mode="piecewise", window=tiny_args.window,
        decoder_layers=tiny_args.n_decoder_layers, max_logit_rows=tiny_args.max_requests,
        capture_sizes=CAPTURE_SIZES, trim_threshold=TRIM_THRESHOLD, replay_capture_sizes=[8, 16])
    assert expected.replay_graph_size is None


def test_replay_graphs_only_in_piecewise(tiny_args):
    for mode in ("eager", "full"):
        assert EngineConfig.for_model(tiny_args, graph_mode=mode).replay_capture_sizes == ()
    off = EngineConfig.for_model(tiny_args, graph_mode="piecewise", replay_graphs=False)
    assert off.replay_capture_sizes == ()
    piecewise = EngineConfig.for_model(tiny_args, graph_mode="piecewise")
    assert piecewise.reference(tiny_args).replay_capture_sizes == ()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.for_model(tiny_args, graph_mode="piecewise",
                               replay_capture_sizes=[8, 10**9])
