"""E3: PIECEWISE and FULL graph replays are bitwise equal to eager at the same padded shape.

Runs on the CPU stand-in everywhere and on real CUDA graphs where a GPU is present.
"""

import pytest
import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.graphs.breakable import BreakBuffers, SegmentedCapture
from swa_bench.graphs.standin import CaptureError, TapeSegment
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CAPTURE_SIZES = [8, 16, 32, 64]
TRIM_THRESHOLD = 32


def steps(window: int) -> list[list[RequestSpec]]:
    """Five successive steps whose rows, lengths and kept rows change (sizes below and above the
    trim threshold), then one above the largest capture size."""
    return [
        [RequestSpec(prompt_len=5)],
        [RequestSpec(prompt_len=3 * window), RequestSpec(prompt_len=9, decode=True)],
        [RequestSpec(prompt_len=50), RequestSpec(prompt_len=window - 1)],
        [RequestSpec(prompt_len=20, cached_len=10), RequestSpec(prompt_len=12, decode=True)],
        [RequestSpec(prompt_len=40, cached_len=3), RequestSpec(prompt_len=window + 1)],
        [RequestSpec(prompt_len=70)],
    ]


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.shape == b.shape, name
    same = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} elements differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graph_replay_is_bitwise_eager(tiny_args, device, mode):
    model, _ = build_model(tiny_args, seed=0, device=device)
    config = EngineConfig.for_model(
        tiny_args,
        graph_mode=mode,
        policy="bounded",
        trim_threshold=TRIM_THRESHOLD,
        capture_sizes=tuple(CAPTURE_SIZES),
    )
    graph = Engine(model, config)
    graph.capture()
    eager = Engine(model)
    seen_sizes = []
    for i, requests in enumerate(steps(tiny_args.window)):
        load = StepInputs.seeded(requests, tiny_args.vocab_size, 100 + i)
        load.fill_context(eager)
        graph.cache.copy_from(eager.cache)
        tokens = load.step_tokens
        out = graph.step(requests, tokens)
        ref = graph.eager_equivalent(requests, tokens, on=eager)
        logits, streams = ref.logits, ref.streams
        size = graph.plan(requests).graph_size
        seen_sizes.append(size)
        assert out.plan.graph_size == size
        assert_bitwise(out.logits, logits, f"step {i} logits")
        for j, (a, b) in enumerate(zip(out.streams, streams, strict=True)):
            assert_bitwise(a, b, f"step {i} stream {j}")
        for name, t in graph.cache.tensors().items():
            assert_bitwise(t, eager.cache.tensors()[name], f"step {i} {name}")
    assert seen_sizes[-1] is None, "the last step exceeds the largest capture size: eager"
    assert any(s is not None and s >= TRIM_THRESHOLD for s in seen_sizes)
    assert any(s is not None and s < TRIM_THRESHOLD for s in seen_sizes)
    assert len(graph.graphs.graphs) == len(CAPTURE_SIZES), "no re-capture"


@pytest.mark.parametrize("device", DEVICES)
def test_piecewise_breaks_at_attention_and_replay_layers(tiny_args, device):
    model, _ = build_model(tiny_args, seed=0, device=device)
    engine = Engine(
        model, EngineConfig.for_model(tiny_args, graph_mode="piecewise", trim_threshold=16,
                                      capture_sizes=(8, 16))
    )
    engine.capture()
    n = tiny_args.n_layers
    small, large = engine.graphs.graphs[8], engine.graphs.graphs[16]
    assert small.num_breaks == n, "below the threshold: one break per attention"
    # Above it: attention breaks before S, then one break for all the replay layers.
    assert large.num_breaks == tiny_args.last_kv_source + 1
    full = Engine(model, EngineConfig.for_model(tiny_args, graph_mode="full", capture_sizes=(8,)))
    full.capture()
    assert full.graphs.graphs[8].num_breaks == 0 and full.graphs.graphs[8].num_segments == 1


@pytest.mark.parametrize("device", DEVICES)
def test_break_buffers_keep_their_address(tiny_args, device):
    model, _ = build_model(tiny_args, seed=0, device=device)
    engine = Engine(
        model, EngineConfig.for_model(tiny_args, graph_mode="piecewise", trim_threshold=16,
                                      capture_sizes=(8, 16, 32))
    )
    engine.capture()
    buffers = engine.graphs.buffers.buffers
    ptrs = {key: buf.data_ptr() for key, buf in buffers.items()}
    assert buffers[("attention", 0)].shape[0] == 32, "sized for the largest capture"
    for graph in engine.graphs.graphs.values():
        for piece in graph.pieces:
            for out in getattr(piece, "outputs", ()):
                assert any(out.data_ptr() == p for p in ptrs.values())
    requests = [RequestSpec(prompt_len=20)]
    load = StepInputs.seeded(requests, tiny_args.vocab_size, 0)
    for _ in range(2):
        engine.step(requests, load.step_tokens)
        assert {k: b.data_ptr() for k, b in buffers.items()} == ptrs


def test_standin_freezes_python_state_at_capture():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = 1.0

        def forward(self, x):
            return x * self.scale

    module, x = Scaled(), torch.randn(4)
    capture = SegmentedCapture(TapeSegment, BreakBuffers(), breaks=True)
    out = capture.capture(lambda: module(x))
    module.scale = 2.0
    x.copy_(torch.randn(4))
    capture.run()
    torch.testing.assert_close(out, x * 1.0, rtol=0, atol=0)
    assert not torch.equal(out, module(x))


def test_standin_refuses_a_host_sync():
    x = torch.randn(4)
    capture = SegmentedCapture(TapeSegment, BreakBuffers(), breaks=True)
    with pytest.raises(CaptureError, match="host"):
        capture.capture(lambda: x * x.sum().item())
