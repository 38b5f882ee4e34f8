"""Conformance in the precision the release ships: swa-bench's fp8 model against DeepSeek-V4.1's
own inference code run with its quantisation on.

The fixture (tests/fixtures/conformance/v41-tiny-fp8, CARD.md) is the fp32 fixture's problem (the
same tiny V4.1 config but 32-wide index and Engram heads, the same seeded draws, prompt and 16
teacher-forced decode steps) with weights stored as the release stores them (fp8 e4m3 / 32x32
UE8M0 blocks, fp4 e2m1 experts / UE8M0 per 32 along K, fp8 Engram tables) and what the reference
computed with its fp8 activation quantisation, fp8 window KV, fp4 compressed KV and indexer q/k,
bf16 attention probabilities and bf16 activations. swa-bench's model, built from the dequantised
weights (exact in bf16) with ``precision="fp8"``, runs the same steps on the Engine's full-batch
path (test_conformance.run_engine) and must agree within TOLERANCE_MULTIPLE times the reference's
own envelope: how far the reference itself moves when its GEMMs, attention and norms sum in other
valid orders or its fp32 GEMM results move by one ulp (CARD.md: a flipped fp8 / fp4 rounding
cascades, so the envelope is measured on rms as well as max numbers).

Found by this fixture: the torch attention's bf16 scores and bf16 products with the values were
not the reference's (fp32 scores, bf16 probabilities in blocks of 64, fp32 sums): decode logits
rms 0.376 against the tolerance 0.198, now 0.101 (``model.attention.gathered_attention``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from swa_bench.model.args import MODEL_FIELDS
from swa_bench.model.model import build_model
from tests.model import conformance_fp8 as c8
from tests.model import conformance_mapping as cm
from tests.model.test_conformance import run_engine

FP32_TOL = 1e-4  # test_conformance's bound for the fp32 numerics


@pytest.fixture(scope="module")
def reference() -> cm.Fixture:
    return c8.load_fp8_fixture()


@pytest.fixture(scope="module")
def stored() -> dict[str, torch.Tensor]:
    return c8.stored_weights()


@dataclass
class Built:
    model: torch.nn.Module
    loaded: cm.Loaded
    requantised: list[str] = field(default_factory=list)  # weights quantise_weights moved


def build(fixture: cm.Fixture, dtype=torch.bfloat16, **changes) -> Built:
    """swa-bench's model from the fixture's dequantised weights; with ``precision`` among the
    changes, its weights are QDQ'd by swa_bench.model.precision.quantise_weights after loading (on
    the release's grid already, so every one must come back unchanged)."""
    args = cm.swa_bench_args(fixture.config).args.replace(**changes)
    model, _ = build_model(args, seed=0, dtype=dtype)
    mapped = cm.map_reference_weights(fixture.weights, fixture.config)
    loaded = cm.load_reference_weights(model, mapped)
    moved = []
    if "precision" in changes:
        from swa_bench.model import precision

        before = {k: v.clone() for k, v in model.state_dict().items()}
        precision.quantise_weights(model)
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    return Built(model, loaded, moved)


def fp8_changes() -> dict:
    return {"precision": "fp8", "expert_precision": "w4a8"}


def compare(run, fixture: cm.Fixture) -> dict[str, float]:
    exp = fixture.expected
    caches = dict(run.caches)
    bad = {k: v for k, v in caches.items() if isinstance(v, str)}
    assert not bad, f"swa-bench has no such caches: {bad}"
    prefill = run.main_hidden[0].view(exp["prefill.main_hidden"].shape)
    decode = torch.stack([h.view(h.shape[0], -1) for h in run.main_hidden[1:]], dim=1)
    return c8.comparison(run.logits, caches,
                         {"prefill.main_hidden": prefill, "decode.main_hidden": decode}, exp)


@pytest.fixture(scope="module")
def fp8_run(reference):
    built = build(reference, **fp8_changes())
    return built, run_engine(built.model, reference, reference.decode_tokens.shape[1])


# ---- the fixture: formats, config, dequantisation ----------------------------------------------


def test_config_is_the_fp32_fixtures_with_32_wide_heads(reference):
    """The fp32 fixture's problem in the release's storage: dtype fp8, fp4 experts, and the index
    and Engram heads 32 wide (the reference's fp4 index q/k groups and Engram row scales are 32)."""
    fp32 = json.loads((cm.FIXTURE / "config.json").read_text())
    diff = {k: (fp32[k], v) for k, v in reference.config.items() if fp32.get(k) != v}
    assert diff == {"dtype": ("bf16", "fp8"), "expert_dtype": (None, "fp4"),
                    "index_head_dim": (16, 32), "engram_head_dim": (16, 32)}


def declared_format(name: str) -> str:
    """The storage the reference declares for a parameter (model.py: Linear's default dtype is
    fp8 under ModelArgs.dtype fp8; routed experts fp4; the rest as each constructor names it)."""
    parts = name.split(".")
    leaf = ".".join(p for p in parts if not p.isdigit())
    if ".ffn.experts." in name:
        return "fp4"
    if leaf.endswith("engram.embed.weight"):
        return "fp8-rows"
    fp8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
           "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
           "shared_experts.w3.weight", "engram.wkv.weight", "main_proj.weight")
    if leaf.endswith(fp8):
        return "fp8"
    fp32 = ("head.weight", "attn_sink", "gate.bias", "confidence_head.proj.weight")
    if leaf.endswith(fp32) or ".hc_" in "." + leaf or (
            "compressor.w" in leaf and int(parts[1]) in (2, 4)):  # the ratio-2 compressors
        return "fp32"
    return "bf16"


def test_weights_are_stored_in_the_release_formats(stored):
    """Every weight in the dtype the reference declares; an fp8 weight's scale one UE8M0 per 32x32
    block, an fp4 weight packed two to a byte with one per 32 along K, an Engram table one per 32
    of a row. The scale rule 2^ceil(log2(amax / top)) puts each block's largest |value| / scale in
    (top / 2, top]: after rounding its largest code is in [224, 448] (e4m3) or one of 3, 4, 6
    (e2m1: (3, 6] rounds to those)."""
    problems = []
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        want = declared_format(name)
        dtype = {"fp8": torch.float8_e4m3fn, "fp8-rows": torch.float8_e4m3fn,
                 "fp4": torch.float4_e2m1fn_x2, "fp32": torch.float32, "bf16": torch.bfloat16}[want]
        scale = stored.get(name.rpartition(".")[0] + ".scale")
        if t.dtype != dtype or (scale is None) != (want in ("fp32", "bf16")):
            problems.append(f"{name}: {t.dtype}, scale {scale is not None} (declared {want})")
            continue
        if scale is None:
            continue
        if scale.dtype != torch.float8_e8m0fnu:
            problems.append(f"{name}: scale {scale.dtype}")
            continue
        n = t.shape[0]
        k = t.shape[1] * (2 if want == "fp4" else 1)
        rows = 32 if want == "fp8" else 1
        if tuple(scale.shape) != (-(-n // rows), -(-k // 32)):
            problems.append(f"{name}: scale {list(scale.shape)} for [{n}, {k}] in {rows}x32")
            continue
        codes = c8.e2m1_values(t) if want == "fp4" else t.float()
        padded = torch.zeros(scale.shape[0] * rows, scale.shape[1] * 32)
        padded[:n, :k] = codes.abs()
        top = padded.view(scale.shape[0], rows, scale.shape[1], 32).amax(dim=(1, 3))
        if want == "fp4":
            ok = torch.isin(top, torch.tensor([3.0, 4.0, 6.0]))
        else:
            ok = (top >= 224) & (top <= 448)
        if not ok.all():
            off = sorted(set(top[~ok].tolist()))[:4]
            problems.append(f"{name}: block maxima {off} off the rule")
    assert not problems, f"{len(problems)} weights off the release's formats: {problems[:8]}"


def test_dequantise_by_hand():
    """e4m3 codes 1.5 and -448 under 2^-7 (byte 120). e2m1 bytes 0x2A (low nibble 0xA: sign,
    magnitude code 2 = 1.0, so element 0 is -1.0; high nibble 0x2: element 1 is 1.0) and 0x7F
    (0xF: -6.0, 0x7: 6.0) under 2 (byte 128)."""
    fp8 = {"w.weight": torch.tensor([[1.5, -448.0] + [0.0] * 30]).to(torch.float8_e4m3fn),
           "w.scale": torch.tensor([[120]], dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    got = c8.dequantise(fp8)["w.weight"]
    assert got[0, :2].tolist() == [1.5 / 128, -448.0 / 128] and not got[0, 2:].any()
    packed = torch.tensor([[0x2A, 0x7F] + [0] * 14], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    two = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = c8.dequantise({"e.weight": packed, "e.scale": two})["e.weight"]
    assert got.shape == (1, 32) and got[0, :4].tolist() == [-2.0, 2.0, -12.0, 12.0]
    assert not got[0, 4:].any()


def test_dequantised_weights_are_exact_in_bf16(reference):
    inexact = [k for k, v in reference.weights.items() if not torch.equal(v.bfloat16().float(), v)]
    assert not inexact, inexact[:8]


def test_reference_weights_fill_every_parameter(reference):
    assert not cm.swa_bench_args(reference.config).missing
    loaded = build(reference).loaded
    assert not loaded.shape_errors, loaded.shape_errors
    assert not loaded.unfilled, loaded.unfilled[:12]
    assert not loaded.unused, loaded.unused[:12]


def test_dequantised_weights_in_fp32_give_the_references_fp32_run(reference):
    """Where a failure starts: the reference also ran its fp32 numerics (the fp32 fixture's P1-P4)
    on the dequantised weights (``fp32_numerics.logits``); swa-bench's fp32 model, which
    test_conformance holds to that numerics, must reproduce it from this module's dequantisation
    and mapping (a misread code, nibble order or scale block moves it by far more than 1e-4)."""
    model = build(reference, dtype=torch.float32).model
    run = run_engine(model, reference, reference.decode_tokens.shape[1])
    want = reference.expected["fp32_numerics.logits"]
    assert (run.logits - want).abs().max().item() < FP32_TOL


# ---- the envelope and the tolerance ------------------------------------------------------------


def test_the_envelope_was_measured(reference):
    """Recorded, not guessed: the reference re-run under each change (CARD.md), the GEMM orders,
    float64 sums and fp32-ulp moves among them; every number finite, and some change moved it."""
    changes = c8.envelope_changes()
    assert {"reverse_k", "one_pass", "fp64_gemm", "fp64_linear"} <= set(changes)
    table = reference.expected["envelope.comparison"]
    assert table.shape[0] == len(changes) and torch.isfinite(table).all()
    assert all(v > 0 for v in c8.envelope().values())


def test_the_tolerance_rejects_the_unquantised_numerics(reference):
    """The comparison resolves the release's numerics: the reference's own fp32 run on the same
    dequantised weights (no activation, KV or attention quantisation) fails every logits number."""
    exp = reference.expected
    d = exp["fp32_numerics.logits"] - exp["logits"]
    got = {"prefill_logits_max": d[:, 0].abs().max().item(),
           "prefill_logits_rms": d[:, 0].pow(2).mean().sqrt().item(),
           "decode_logits_max": d[:, 1:].abs().max().item(),
           "decode_logits_rms": d[:, 1:].pow(2).mean().sqrt().item()}
    tol = c8.tolerance()
    passing = {k: (v, tol[k]) for k, v in got.items() if v <= tol[k]}
    assert not passing, f"the unquantised numerics pass: {passing}"


# ---- swa-bench in fp8 against the reference ----------------------------------------------------


def test_precision_is_a_model_setting():
    assert {"precision", "expert_precision"} <= set(MODEL_FIELDS)


def test_quantise_weights_leaves_release_weights_unchanged(fp8_run):
    built, _ = fp8_run
    assert not built.requantised, f"quantise_weights moved {len(built.requantised)} release " \
                                  f"weights: {built.requantised[:8]}"


@pytest.mark.parametrize("number", ["prefill_logits_max", "prefill_logits_rms", "decode_logits_max",
                                    "decode_logits_rms"])
def test_logits_match_the_reference_within_its_envelope(reference, fp8_run, number):
    got = compare(fp8_run[1], reference)[number]
    tol = c8.tolerance()[number]
    assert got <= tol, f"{number} {got:.3g} > {c8.TOLERANCE_MULTIPLE} x envelope = {tol:.3g}"


@pytest.mark.parametrize("number", ["prefill_caches_rel_rms", "final_caches_rel_rms",
                                    "main_hidden_rel_rms"])
def test_caches_match_the_reference_within_its_envelope(reference, fp8_run, number):
    got = compare(fp8_run[1], reference)[number]
    tol = c8.tolerance()[number]
    assert got <= tol, f"{number} {got:.3g} > {c8.TOLERANCE_MULTIPLE} x envelope = {tol:.3g}"


def test_bf16_numerics_fail_the_comparison(reference):
    """A seeded change that runs today: swa-bench without the release's activation quantisation
    (precision bf16 where the field exists; today's model otherwise), bf16 activations and the same
    dequantised weights, must fail the decode logits comparison."""
    changes = {"precision": "bf16"} if "precision" in MODEL_FIELDS else {}
    built = build(reference, **changes)
    run = run_engine(built.model, reference, reference.decode_tokens.shape[1])
    d = run.logits - reference.expected["logits"]
    rms = d[:, 1:].pow(2).mean().sqrt().item()
    tol = c8.tolerance()["decode_logits_rms"]
    assert rms > tol, f"bf16 numerics pass the fp8 comparison (decode rms {rms:.3g} <= {tol:.3g})"
