"""measure_paths: what the timed loop holds."""

from swa_bench.bench import measure
from swa_bench.bench.measure import FlopCache, TimingSettings, measure_paths
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.requests import RequestSpec


def test_replay_graphs_are_captured_before_the_timed_loop(tiny_model, monkeypatch):
    """A replay graph is captured at its size's first use; with no warm-up the first timed
    sample would hold that capture unless measure_paths runs an untimed step first."""
    args = tiny_model.args
    config = EngineConfig.for_model(args, graph_mode="piecewise", trim_threshold=16,
                                    capture_sizes=(16, 32))
    reference, replay = Engine(tiny_model, config.reference(args)), Engine(tiny_model, config)
    inputs = StepInputs.seeded([RequestSpec(prompt_len=2 * args.window),
                                RequestSpec(prompt_len=5, decode=True)], args.vocab_size, 0)
    at_timing: list[list[int]] = []
    real = measure.time_interleaved

    def timing(*a, **kw):
        at_timing.append(sorted(replay.replay_graphs.graphs))
        return real(*a, **kw)

    monkeypatch.setattr(measure, "time_interleaved", timing)
    settings = TimingSettings(warmup=0, iters=1, l2_flush=False, threads=1, breakdown=False)
    m = measure_paths(reference, replay, inputs, settings, FlopCache())
    size = m.plans["replay"].replay_graph_size
    assert size == 16, m.plans["replay"].reason  # W + 1 kept rows
    assert at_timing == [sorted({size, max(config.replay_capture_sizes)})]
