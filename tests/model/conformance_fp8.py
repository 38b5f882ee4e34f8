"""The fp8 conformance fixture (tests/fixtures/conformance/v41-tiny-fp8, CARD.md) read into
swa-bench's terms: its weights as stored by the release (fp8 e4m3 with UE8M0 block scales, routed
experts fp4 e2m1 packed two to a byte with UE8M0 scales per 32 along K, fp8 Engram tables with a
scale per 32 of a row) dequantised to their exact values, then renamed by conformance_mapping like
the fp32 fixture's; the envelope the reference recorded and the comparison it was measured with.

A dequantised value is code x 2^e: an e4m3 code has 4 significant bits and an e2m1 code 2, so
every one is exact in bf16 (and fp32); nothing here rounds. The decoding is restated from the
formats' definitions (OCP MX: e4m3fn, e2m1, e8m0), not taken from the reference's code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.model import conformance_mapping as cm

FIXTURE_FP8 = cm.FIXTURE.parent / "v41-tiny-fp8"
BLOCK = 32  # the release's scale block: 32x32 for fp8 weights, 32 along K for fp4, 32 of a row
# e2m1 by its 3 magnitude bits (OCP MX): subnormal 0, 0.5; then 1, 1.5, 2, 3, 4, 6; bit 3 the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TOLERANCE_MULTIPLE = 2.0  # the test tolerance: this times the reference's own envelope (CARD.md)


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 2^(byte - 127) (byte 255 is NaN: refused)."""
    b = scale.view(torch.uint8).long()
    assert (b < 255).all(), "a NaN (0xFF) UE8M0 scale"
    return torch.exp2((b - 127).double()).float()


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 ``[..., K / 2]`` -> fp32 ``[..., K]``: byte i holds element 2i in its low
    nibble and 2i + 1 in its high nibble; in a nibble bit 3 is the sign, bits 0-2 the magnitude."""
    b = packed.view(torch.uint8).long()
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    magnitude = torch.tensor(E2M1)[nibbles & 0x7]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


def expand(scale: torch.Tensor, rows: int, shape: torch.Size) -> torch.Tensor:
    """A scale per ``rows`` x BLOCK block, spread over a ``shape`` weight (edges cut)."""
    return scale.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]


def dequantise(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fixture's weights as fp32 values under the reference's parameter names (``x.scale``
    dropped): ``x.weight`` with a ``x.scale`` is code x scale, its scale one per 32x32 block (an fp8
    Linear), per row and 32 columns (an fp4 expert or an Engram table, whose scale has a row per
    weight row); every other tensor is cast (bf16 and fp32 parameters as the reference declares)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        owner = name.rpartition(".")[0]
        scale = stored.get(owner + ".scale")
        if scale is None:
            assert t.dtype in (torch.float32, torch.bfloat16), f"{name}: {t.dtype} with no scale"
            out[name] = t.float()
            continue
        if t.dtype == torch.float4_e2m1fn_x2:
            codes = e2m1_values(t)
        elif t.dtype == torch.float8_e4m3fn:
            codes = t.float()
        else:
            raise AssertionError(f"{name}: {t.dtype} has a scale but is not fp8 or fp4")
        s = e8m0_values(scale)
        rows = 1 if s.shape[0] == codes.shape[0] else BLOCK
        assert s.shape == (-(-codes.shape[0] // rows), -(-codes.shape[1] // BLOCK)), \
            f"{name}: scale {list(s.shape)} for a weight {list(codes.shape)}"
        out[name] = codes * expand(s, rows, codes.shape)
    return out


def load_fp8_fixture(path: Path = FIXTURE_FP8) -> cm.Fixture:
    """The fp8 fixture as a ``conformance_mapping.Fixture`` whose weights are the dequantised fp32
    values (so ``map_reference_weights`` and ``swa_bench_args`` apply unchanged)."""
    return cm.load_fixture(path, read_weights=lambda p: dequantise(load_file(str(p))))


def stored_weights(path: Path = FIXTURE_FP8) -> dict[str, torch.Tensor]:
    return load_file(str(path / "weights.safetensors"))


# ---- the comparison and the envelope -----------------------------------------------------------


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def comparison(logits: torch.Tensor, caches: dict[str, torch.Tensor],
               main_hidden: dict[str, torch.Tensor],
               expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """The numbers the fp8 test holds to the envelope (the reference measured its envelope with the
    same definitions, CARD.md): the prefill's and the decode steps' logits, max |difference| and
    rms; per stage the largest relative rms (rms of the difference / rms of the reference) over its
    caches; the same over the DSpark main_hidden of the prefill and the decode steps."""
    d = logits.float() - expected["logits"].float()
    out = {"prefill_logits_max": d[:, 0].abs().max().item(),
           "prefill_logits_rms": d[:, 0].pow(2).mean().sqrt().item(),
           "decode_logits_max": d[:, 1:].abs().max().item(),
           "decode_logits_rms": d[:, 1:].pow(2).mean().sqrt().item()}
    for stage in ("prefill", "final"):
        names = [k for k in expected if k.startswith((stage + ".layers.", stage + ".mtp."))]
        out[f"{stage}_caches_rel_rms"] = max(rel_rms(caches[k], expected[k]) for k in names)
    out["main_hidden_rel_rms"] = max(rel_rms(main_hidden[k], expected[k]) for k in main_hidden)
    return out


def envelope(path: Path = FIXTURE_FP8) -> dict[str, float]:
    """The reference's own envelope per comparison number: the largest over its recorded changes
    (the same run with its GEMMs, attention and norms summed in other valid orders, and with its
    fp32 GEMM results moved by one ulp; ``envelope_changes`` in the metadata names them)."""
    with safe_open(str(path / "expected.safetensors"), "pt") as f:
        names = f.metadata()["envelope_comparison"].split(",")
        table = f.get_tensor("envelope.comparison")
    assert table.shape[1] == len(names)
    return dict(zip(names, table.amax(dim=0).tolist(), strict=True))


def envelope_changes(path: Path = FIXTURE_FP8) -> list[str]:
    with safe_open(str(path / "expected.safetensors"), "pt") as f:
        return f.metadata()["envelope_changes"].split(",")


def tolerance(path: Path = FIXTURE_FP8) -> dict[str, float]:
    return {k: TOLERANCE_MULTIPLE * v for k, v in envelope(path).items()}
