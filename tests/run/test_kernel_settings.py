"""Which kernels ran is part of a run's results: the same tiny case under two kernel settings
records each in results.json, and ``compare`` of the two runs never calls them unchanged."""

from __future__ import annotations

import io

from rich.console import Console

from swa_bench.compare import compare_runs
from swa_bench.results import load_results
from swa_bench.run.commands import run_scenarios
from swa_bench.run.compare import compare_command

# Three layers and one stream: the interpreter takes about 2 s a forward of this model, 40 s of
# the tiny preset's eight layers and four mHC streams.
SCENARIO = """\
name: kernel-settings
device: cpu
model: {{preset: tiny, overrides: {{n_layers: 3, kv_sources: [1], hc_mult: 1}}}}
workload:
  requests:
    - {{prompt_len: 12}}
{kernels}
checks:
  e1: {{enabled: false}}
  e2: {{enabled: false}}
  e3: {{enabled: false}}
  e4: {{enabled: false}}
timing: {{warmup: 0, iters: 2, breakdown: false}}
"""


def test_two_kernel_settings_are_recorded_and_refused_by_compare(tmp_path, monkeypatch,
                                                                 interpreter):
    """The environment is only the default: with ``SWA_BENCH_KERNELS=torch`` a scenario without
    a ``kernels:`` section runs the PyTorch path, one that names triton and a tile runs those
    (E5, bitwise, passes on each). Compare fails on the pair unless asked for an A/B."""
    monkeypatch.setenv("SWA_BENCH_KERNELS", "torch")
    runs = {}
    settings = {"torch": "", "triton": 'kernels: {backend: triton, tile: "16,0,4,1"}'}
    for name, kernels in settings.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(SCENARIO.format(kernels=kernels))
        runs[name] = tmp_path / name
        assert run_scenarios([path], out=runs[name], console=Console(file=io.StringIO())) == 0
    recorded = {name: [c.kernels.model_dump() for c in load_results(out).cases]
                for name, out in runs.items()}
    assert recorded == {
        "torch": [{"backend": "torch", "tile": "-", "launch": "-", "interpret": False,
                   "quantised_gemm": "-"}],
        "triton": [{"backend": "triton", "tile": "16,0,4,1", "launch": "direct",
                    "interpret": True, "quantised_gemm": "-"}],
    }
    comparison = compare_runs(load_results(runs["torch"]), load_results(runs["triton"]))
    (row,) = comparison.rows
    assert row.status == "incomparable" and comparison.failed
    assert row.reasons[0].startswith("kernels differ (backend torch -> triton, tile - -> "
                                     "16,0,4,1, launch - -> direct, interpret False -> True)")
    quiet = Console(file=io.StringIO())
    assert compare_command(runs["torch"], runs["triton"], console=quiet, gate_timing=False) == 1
    # As an A/B: compared, the kernels and the FLOPs they count (the kernel's formula is not the
    # PyTorch path's) warned about, timing (too few samples here) reported.
    ab = compare_runs(load_results(runs["torch"]), load_results(runs["triton"]),
                      allow_config_change=True)
    (row,) = ab.rows
    assert row.status == "warning" and not ab.failed
    assert any(r.startswith("A/B: kernels differ (backend torch -> triton") for r in row.reasons)
    assert any(r.startswith("flops.replay ") and r.endswith("[other kernels]")
               for r in row.reasons)
    assert compare_command(runs["torch"], runs["triton"], console=quiet, gate_timing=False,
                           allow_config_change=True) == 0
