"""Scenario schema and loading: defaults, resolution, and one-line errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from swa_bench.checks.tolerance import DEFAULT_TOLERANCES
from swa_bench.engine.config import EngineConfig
from swa_bench.graphs.capture_sizes import default_capture_sizes
from swa_bench.kernels import KernelSettings, TileConfig
from swa_bench.model.args import PRESETS
from swa_bench.model.requests import RequestSpec
from swa_bench.scenario import (
    Scenario,
    ScenarioError,
    default_scenario_path,
    expand_cases,
    load_scenario,
    scenario_from_text,
)

MINIMAL = "name: minimal\nworkload:\n  requests:\n    - {prompt_len: 20}\n"


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimal_scenario_takes_documented_defaults():
    s = scenario_from_text(MINIMAL)
    assert (s.device, s.dtype, s.seed, s.policy, s.graph_mode) == (
        "auto", "float32", 0, "bounded", "eager")
    assert s.model.preset == "tiny" and s.model.overrides == {}
    assert s.checks.e1.enabled and s.checks.e5.enabled and not s.checks.approximation.enabled
    assert (s.timing.warmup, s.timing.iters, s.timing.threads) == (2, 10, None)
    assert s.sweep.is_empty


def test_resolution_follows_the_model_window():
    s = scenario_from_text(MINIMAL + "model: {preset: small, overrides: {window: 16}}\n")
    assert s.model_args().window == 16
    assert s.model_args().n_layers == PRESETS["small"].n_layers
    assert s.engine_config().trim_threshold == 17
    assert s.continuation_steps() == 32
    explicit = scenario_from_text(MINIMAL + "trim_threshold: 40\n"
                                  "checks: {approximation: {continuation_steps: 20}}\n")
    assert explicit.engine_config().trim_threshold == 40
    assert explicit.continuation_steps() == 20


def test_the_kernels_section_is_over_the_environments_default(monkeypatch):
    """Each key of ``kernels:`` replaces the environment's value of that setting alone; neither
    set: auto, the measured tiles, the direct launch. Sweepable like any field."""
    for variable in ("SWA_BENCH_KERNELS", "SWA_BENCH_MQA_TILE", "SWA_BENCH_TRITON_LAUNCH"):
        monkeypatch.delenv(variable, raising=False)
    assert scenario_from_text(MINIMAL).kernel_settings() == KernelSettings()
    monkeypatch.setenv("SWA_BENCH_KERNELS", "torch")
    monkeypatch.setenv("SWA_BENCH_MQA_TILE", "32,0,8,1")
    assert scenario_from_text(MINIMAL).kernel_settings() == KernelSettings(
        "torch", TileConfig(32, 0, 8, 1))
    chosen = scenario_from_text(MINIMAL + "kernels: {backend: triton, launch: triton}\n")
    assert chosen.kernel_settings() == KernelSettings("triton", TileConfig(32, 0, 8, 1), "triton")
    tiled = scenario_from_text(MINIMAL + 'kernels: {backend: auto, tile: "16,0,4,1"}\n')
    assert tiled.kernel_settings() == KernelSettings("auto", TileConfig(16, 0, 4, 1))
    swept = expand_cases(scenario_from_text(
        MINIMAL + "sweep: {grid: {kernels.backend: [torch, triton]}}\n", "s.yaml"))
    assert [c.scenario.kernel_settings().backend for c in swept] == ["torch", "triton"]
    assert [c.label() for c in swept] == ["eager/bounded/T=20/backend=torch",
                                          "eager/bounded/T=20/backend=triton"]


def test_default_capture_sizes_are_vllms_list():
    sizes = default_capture_sizes(512)
    assert sizes[:4] == [1, 2, 4, 8]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 512
    assert [s for s in sizes if s < 256] == [1, 2, 4, *range(8, 256, 8)]
    assert [s for s in sizes if s >= 256] == list(range(256, 513, 16))
    assert default_capture_sizes(100)[-1] == 96
    s = scenario_from_text(MINIMAL + "max_capture_size: 64\n")
    assert s.engine_config().capture_sizes == tuple(default_capture_sizes(64))
    s = scenario_from_text(MINIMAL + "capture_sizes: [16, 48]\nmax_capture_size: 8\n")
    assert s.engine_config().capture_sizes == (16, 48)


def test_a_minimal_scenario_resolves_the_engines_defaults():
    """The scenario leaves every engine default to ``EngineConfig.for_model``: a file that sets
    nothing gets exactly what a caller that sets nothing gets, and every field is set."""
    s = scenario_from_text(MINIMAL)
    config = s.engine_config()
    assert config == EngineConfig.for_model(s.model_args())
    assert config.trim_threshold == s.model_args().window + 1
    assert config.capture_sizes == tuple(default_capture_sizes(512))
    assert (config.policy, config.graph_mode, config.eager_trim_threshold, config.halo_align) == (
        s.policy, s.graph_mode, s.eager_trim_threshold, s.halo_align)


def test_the_engine_refuses_what_the_scenario_refuses():
    """One rule each for trim_threshold and capture sizes: the scenario names its field, the
    engine's config raises with the same words."""
    args = PRESETS["tiny"]
    with pytest.raises(ScenarioError, match="trim_threshold: must exceed the model window W=16"):
        load_scenario(Path(__file__).parent / "malformed" / "trim_threshold_le_window.yaml")
    w = args.window
    with pytest.raises(ValueError, match=f"trim_threshold: must exceed the model window W={w}"):
        EngineConfig.for_model(args, trim_threshold=w)
    assert EngineConfig.for_model(args, trim_threshold=w + 1).trim_threshold == w + 1
    for sizes, words in (((), "must not be empty"), ((16, 8), "must be strictly increasing"),
                         ((8, 8), "must be strictly increasing"), ((0, 8), "must be >= 1")):
        with pytest.raises(ValueError, match=f"capture_sizes: {words}"):
            EngineConfig.for_model(args, capture_sizes=sizes)
        if sizes and min(sizes) > 0:
            with pytest.raises(ScenarioError, match=f"capture_sizes: {words}"):
                scenario_from_text(MINIMAL + f"capture_sizes: {list(sizes)}\n")
    with pytest.raises(ValueError, match="capture_sizes: must be a tuple"):
        EngineConfig(policy="full", graph_mode="eager", trim_threshold=w + 1,
                     eager_trim_threshold=0, capture_sizes=[8], halo_align=1,
                     kernels=KernelSettings())


def test_tolerances_default_per_dtype_and_bitwise_checks_are_exact():
    s = scenario_from_text(MINIMAL + "dtype: bfloat16\nchecks: {e1: {rtol: 1e-3}}\n")
    assert s.tolerance("e1") == (1e-3, DEFAULT_TOLERANCES["bfloat16"][1])
    assert s.tolerance("e2") == DEFAULT_TOLERANCES["bfloat16"]
    assert s.tolerance("e3") == (0.0, 0.0)
    assert s.tolerance("e5") == (0.0, 0.0)


def test_exponent_floats_without_a_dot_are_numbers():
    s = scenario_from_text(MINIMAL + "checks: {e2: {atol: 1e-5, rtol: 2E-3}}\n")
    assert s.checks.e2.atol == pytest.approx(1e-5)
    assert s.checks.e2.rtol == pytest.approx(2e-3)


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_an_infinite_or_nan_tolerance_is_refused(value):
    """An infinite allowance passes any difference: refused up front, the field named."""
    with pytest.raises(ScenarioError, match="checks.e1.rtol: .*finite number"):
        scenario_from_text(MINIMAL + f"checks: {{e1: {{rtol: {value}}}}}\n")


def test_requests_are_explicit_repeated_then_generated_prefills_then_decodes():
    text = """
name: order
workload:
  requests:
    - {prompt_len: 20, repeat: 2, prompt_logprobs: true}
    - {prompt_len: 30, decode: true}
  generators:
    - {prefills: 2, prompt_len: 64, cached_len: 8, chunk_size: 16, decodes: 3}
    - {prefills: 0, prompt_len: 10, decodes: 1, decode_context: 40}
"""
    reqs = scenario_from_text(text).requests()
    assert reqs == [
        RequestSpec(20, prompt_logprobs=True), RequestSpec(20, prompt_logprobs=True),
        RequestSpec(30, decode=True),
        RequestSpec(64, cached_len=8, chunk_size=16), RequestSpec(64, cached_len=8, chunk_size=16),
        RequestSpec(64, decode=True), RequestSpec(64, decode=True), RequestSpec(64, decode=True),
        RequestSpec(40, decode=True),
    ]


def test_source_is_attached_but_not_dumped(tmp_path):
    path = write(tmp_path, MINIMAL)
    s = load_scenario(path)
    assert s.source_path == path and s.source_text == MINIMAL
    dumped = s.model_dump()
    assert "source_path" not in dumped and "source_text" not in dumped
    assert "_source_path" not in dumped
    with pytest.raises(ScenarioError, match="unknown key"):
        scenario_from_text(MINIMAL + "source_text: hi\n")


BAD = [
    # (extra YAML appended to MINIMAL, field named, words in the message)
    ("timing: {iterations: 5}\n", "timing.iterations", "unknown key"),
    ("seed: zero\n", "seed", "integer"),
    ("seed: 1.5\n", "seed", "integer"),
    ("timing: {l2_flush: 1}\n", "timing.l2_flush", "true or false"),
    ("seed: -1\n", "seed", ">= 0"),
    ("timing: {iters: 0}\n", "timing.iters", ">= 1"),
    ("device: gpu\n", "device", "'cuda'"),
    ("dtype: fp8\n", "dtype", "'bfloat16'"),
    ("graph_mode: cudagraph\n", "graph_mode", "'piecewise'"),
    ("halo_align: 0\n", "halo_align", ">= 1"),
    ("checks: {e3: {rtol: 0.1}}\n", "checks.e3.rtol", "bitwise"),
    ("checks: {e5: {atol: 0.0}}\n", "checks.e5.atol", "bitwise"),
    ("checks: {e6: {}}\n", "checks.e6", "unknown key"),
    ("checks: {approximation: {min_top1_agreement: 1.5}}\n",
     "checks.approximation.min_top1_agreement", "<= 1"),
    ("capture_sizes: [16, 8]\n", "capture_sizes", "strictly increasing"),
    ("capture_sizes: [8, 8]\n", "capture_sizes", "strictly increasing"),
    ("capture_sizes: []\n", "capture_sizes", "empty"),
    ("capture_sizes: [0, 8]\n", "capture_sizes.0", ">= 1"),
    ("model: {preset: huge}\n", "model.preset", "unknown preset"),
    ("model: {overrides: {windw: 4}}\n", "model.overrides.windw", "'window'"),
    ("model: {overrides: {window: 0}}\n", "model.overrides.window", ">= 1"),
    ("model: {overrides: {window: '8'}}\n", "model.overrides.window", "integer"),
    ("model: {overrides: {n_layers: 2}}\n", "model.overrides.kv_sources", "n_layers=2"),
    ("trim_threshold: 8\n", "trim_threshold", "W=8"),
    ("checks: {approximation: {continuation_steps: 7}}\n",
     "checks.approximation.continuation_steps", "W=8"),
    ("kernels: {backend: cuda}\n", "kernels.backend", "'triton'"),
    ("kernels: {tile: '64,0,8'}\n", "kernels.tile", "expected 4 integers"),
    ("kernels: {tile: '64,0,3,1'}\n", "kernels.tile", "num_warps must be"),
    ("kernels: {launch: fast}\n", "kernels.launch", "'direct'"),
    ("kernels: {precision: fp8}\n", "kernels.precision", "unknown key"),
    ("sweep: {grid: {policy: []}}\n", "sweep.grid.policy", "empty"),
    ("precision: int8\n", "precision", "'fp8'"),
    ("expert_precision: w4a4\n", "expert_precision", "'w4a16'"),
    ("checks: {batch_invariant: true}\ndevice: cuda\nkernels: {backend: torch}\n",
     "checks.batch_invariant", "runs on CUDA with the Triton kernels"),
    ("checks: {batch_invariant: true}\nkernels: {backend: triton}\n", "checks.batch_invariant",
     "runs on CPU with the PyTorch kernels"),
    ("precision: fp8\nmodel: {overrides: {q_lora_rank: 48}}\n", "precision",
     "fp8 cannot run this model: q_lora_rank must be a multiple of 32"),
    ("model: {overrides: {precision: fp8}}\n", "model.overrides.precision",
     "at the scenario's top level"),
    ("sweep: {zip: [{}]}\n", "sweep.zip[0]", "empty"),
]


@pytest.mark.parametrize(("extra", "field", "words"), BAD)
def test_bad_fields_are_named_in_one_line(tmp_path, extra, field, words):
    path = write(tmp_path, MINIMAL + extra)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    err = info.value
    assert err.field == field
    assert words in err.message
    assert str(err).startswith(f"{path}: {field}: ")
    assert "\n" not in str(err)
    # the offending key sits on the first appended line
    assert err.line == MINIMAL.count("\n") + 1


WORKLOAD_BAD = [
    ("workload: {}\n", "workload", "at least one request"),
    ("workload: {requests: [{prompt_len: 8, cached_len: 8}]}\n",
     "workload.requests.0.cached_len", "below prompt_len"),
    ("workload: {requests: [{prompt_len: 300}]}\n", "workload.requests.0.prompt_len",
     "max_seq_len=256"),
    ("workload: {requests: [{prompt_len: 256, decode: true}]}\n",
     "workload.requests.0.prompt_len", "257"),
    ("workload: {requests: [{prompt_len: 4, repeat: 17}]}\n", "workload", "max_requests=16"),
    ("workload: {generators: [{prefills: 10, prompt_len: 8, decodes: 7}]}\n", "workload",
     "17 requests"),
    ("workload: {generators: [{prompt_len: 8, cached_len: 9}]}\n",
     "workload.generators.0.cached_len", "below prompt_len"),
    ("workload: {generators: [{prefills: 0, prompt_len: 8, decodes: 1, decode_context: 256}]}\n",
     "workload.generators.0.decode_context", "max_seq_len"),
    ("workload: {requests: [{cached_len: 2}]}\n", "workload.requests.0.prompt_len", "required"),
    ("workload: {requests: {prompt_len: 8}}\n", "workload.requests", "a list"),
    ("workload: [1, 2]\n", "workload", "a mapping"),
]


@pytest.mark.parametrize(("text", "field", "words"), WORKLOAD_BAD)
def test_workload_rules_need_the_resolved_model(tmp_path, text, field, words):
    path = write(tmp_path, "name: w\n" + text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.field == field
    assert words in info.value.message


def test_decode_rows_may_sit_at_the_cache_end():
    text = "name: d\nworkload: {requests: [{prompt_len: 8, cached_len: 8, decode: true}]}\n"
    assert scenario_from_text(text).requests()[0].query_len == 1


@pytest.mark.parametrize(("text", "words", "line"), [
    ("", "empty scenario", None),
    ("# just a comment\n", "empty scenario", None),
    ("- name: a\n", "top level must be a mapping", 1),
    ("name: a\nworkload: {requests: [{prompt_len: 8}\n", "invalid YAML", 3),
    ("name: a\n\tworkload: 1\n", "invalid YAML", 2),
])
def test_file_level_errors_have_no_field(tmp_path, text, words, line):
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.field == ""
    assert words in info.value.message
    assert info.value.line == line
    assert str(info.value).startswith(f"{path}: ")


def test_duplicate_keys_are_not_silently_dropped(tmp_path):
    path = write(tmp_path, MINIMAL + "policy: halo\npolicy: bounded\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert (info.value.field, info.value.line) == ("policy", 6)


def test_missing_unreadable_and_directory_paths(tmp_path):
    for path, words in [(tmp_path / "nope.yaml", "no such file"), (tmp_path, "directory")]:
        with pytest.raises(ScenarioError, match=words):
            load_scenario(path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\n")
    with pytest.raises(ScenarioError, match="UTF-8"):
        load_scenario(binary)


def test_missing_required_key_points_at_its_parent_line(tmp_path):
    path = write(tmp_path, "name: x\nworkload:\n  requests:\n    - {cached_len: 1}\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert (info.value.field, info.value.line) == ("workload.requests.0.prompt_len", 4)


def test_error_string_format():
    assert str(ScenarioError("a.yaml", "x.y", "bad\nthing", 3)) == "a.yaml: x.y: bad thing (line 3)"
    assert str(ScenarioError("a.yaml", "", "no such file")) == "a.yaml: no such file"
    assert str(ScenarioError(None, "seed", "m")) == "<scenario>: seed: m"
    assert isinstance(ScenarioError("a", "b", "c"), ValueError)


def test_default_scenario_is_the_shipped_smoke():
    path = default_scenario_path()
    assert path.name == "smoke.yaml" and path.is_file()
    assert isinstance(load_scenario(path), Scenario)


PROMPT = "name: p\nworkload:\n  prompts:\n    - {length: 100, chunk_size: 48}\n"
PROMPTS_BAD = [
    ("workload: {prompts: [{length: 100, chunk_size: 0}]}\n",
     "workload.prompts.0.chunk_size", ">= 1"),
    ("workload: {prompts: [{length: 0, chunk_size: 8}]}\n", "workload.prompts.0.length", ">= 1"),
    ("workload: {prompts: [{length: 100}]}\n", "workload.prompts.0.chunk_size", "required"),
    ("workload: {prompts: [{length: 100, chunk_size: 8, chunk: 8}]}\n", "workload.prompts.0.chunk",
     "expected one of: length, chunk_size, decodes_beside, decode_context"),
    ("workload: {prompts: [{length: 100, chunk_size: 8, decodes_beside: -1}]}\n",
     "workload.prompts.0.decodes_beside", ">= 0"),
    # 240 tokens, the first decode and E1's 2W = 16 decode steps: 257 > 256
    ("workload: {prompts: [{length: 240, chunk_size: 64}]}\n", "workload.prompts.0.length",
     "max_seq_len=256"),
    ("workload: {prompts: [{length: 100, chunk_size: 8, decodes_beside: 1, "
     "decode_context: 230}]}\n", "workload.prompts.0.decode_context", "above max_seq_len=256"),
    ("workload: {prompts: [{length: 100, chunk_size: 8, decodes_beside: 16}]}\n",
     "workload.prompts.0.decodes_beside", "max_requests=16"),
    ("workload: {prompts: [{length: 100, chunk_size: 8}], requests: [{prompt_len: 8}]}\n",
     "workload.prompts", "not both"),
    ("workload: {prompts: [{length: 100, chunk_size: 8, decodes_beside: 1}], "
     "cache_order: [3]}\n", "workload.cache_order", "needs 2 distinct indices"),
    ("workload: {prompts: [{length: 100, chunk_size: 8}]}\nparallel: {dp: 2}\n",
     "workload.prompts", "one process"),
]


@pytest.mark.parametrize(("text", "field", "words"), PROMPTS_BAD)
def test_prompt_rules_are_named_in_one_line(tmp_path, text, field, words):
    path = write(tmp_path, "name: w\n" + text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.field == field
    assert words in info.value.message
    assert "\n" not in str(info.value)


def test_a_prompt_case_counts_its_prompts_and_labels_its_chunks(tmp_path):
    """Without E1's decode reserve, 240 tokens fit; the sweep's cases are told apart by chunk."""
    text = (PROMPT + "checks: {e1: {enabled: false}}\nsweep:\n  zip:\n"
            "    - {workload.prompts.0.length: [100, 240], "
            "workload.prompts.0.chunk_size: [48, 64]}\n")
    cases = expand_cases(load_scenario(write(tmp_path, text)))
    assert [c.num_tokens() for c in cases] == [100, 240]
    assert [c.num_requests() for c in cases] == [1, 1]
    assert [c.label() for c in cases] == ["eager/bounded/T=100/chunks=48",
                                          "eager/bounded/T=240/chunks=64"]
    assert cases[0].requests() == []
