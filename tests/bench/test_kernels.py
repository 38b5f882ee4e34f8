"""``swa-bench kernels``: both paths timed on the same problems and credited the same FLOPs."""

import json

import pytest
from typer.testing import CliRunner

from swa_bench.cli import app
from swa_bench.engine.config import triton_interpreting
from swa_bench.kernels import mqa_attention_flops
from swa_bench.model.args import PRESETS
from swa_bench.model.key_sources import causal_key_total

RUNNER = CliRunner()


def test_kernels_command_reports_each_problem_and_path():
    result = RUNNER.invoke(app, ["kernels", "--tokens", "12", "-p", "dense", "-p", "sparse",
                                 "--iters", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    args = PRESETS["tiny"]
    h, d, w = args.n_heads, args.head_dim, args.window
    expected = {"dense": mqa_attention_flops(12, h, d, w, causal_key_total(0, 12, 1)),
                "sparse": mqa_attention_flops(12, h, d, w + 4 * w)}
    paths = {"torch", "triton"} if triton_interpreting() else {"torch"}
    seen = {(r["problem"], r["backend"]) for r in report["results"]}
    assert seen == {(p, b) for p in expected for b in paths}
    for r in report["results"]:
        assert r["flops"] == expected[r["problem"]]
        assert r["tflops"] == pytest.approx(r["flops"] / (r["median_ms"] * 1e-3) / 1e12)


@pytest.mark.parametrize("option", [["--problem", "flash"], ["--preset", "nope"],
                                    ["--dtype", "int8"], ["--tokens", "100000000000"]])
def test_kernels_command_refuses_bad_options_with_one_line(option):
    result = RUNNER.invoke(app, ["kernels", *option])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1


def test_resident_bytes_counts_what_a_prefill_allocates():
    """Against the tensors the problems' prefill really builds: caches, queries and keys (the
    estimate adds the outputs, one more query-sized tensor)."""
    import torch

    from swa_bench.bench.kernels import _prefill, resident_bytes

    args = PRESETS["tiny"].replace(max_requests=1, max_seq_len=64)
    _, cache, q, kv, _, _ = _prefill(args, 64, torch.device("cpu"), torch.float32)
    built = sum(t.numel() * t.element_size() for t in (*cache.tensors().values(), q, kv))
    assert resident_bytes(args, 64, torch.float32, ("window",)) == built + q.numel() * 4
