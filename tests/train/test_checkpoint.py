"""The shipped checkpoint is what its card says: it reproduces the card's held-out loss on this
CPU, stores its matrices in bf16 and the rest as trained, and fits the size the project ships.
Compact storage itself: what ``round_for_storage`` leaves in the model is what a compact file
loads back, bit for bit."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.weights import load_weights, resolve, round_for_storage, save_weights
from swa_bench.train.card import card_path
from swa_bench.train.loop import EVAL_SEED, held_out_loss, held_out_windows
from tests import invoke

SHIPPED = resolve("v41-mini")
MAX_SHIPPED_BYTES = 12_000_000  # issue 31: the trained model ships under 12 MB


def _card_figure(pattern: str) -> float:
    match = re.search(pattern, card_path(SHIPPED).read_text(encoding="utf-8"))
    assert match, f"the card has no {pattern!r}"
    return float(match.group(1))


@pytest.mark.slow
def test_the_shipped_checkpoint_reproduces_its_cards_held_out_loss():
    model, _ = build_model(build_args("v41-mini"))
    load_weights(model, SHIPPED)
    card = _card_figure(r"text loss\s+\*\*([0-9.]+) nats/byte\*\*")
    prompts, length = (int(_card_figure(r"held-out loss over\s+(\d+)\s+windows")),
                       int(_card_figure(r"windows of\s+(\d+)\s+bytes")))
    g = torch.Generator().manual_seed(EVAL_SEED)
    # 2e-5: fp32 sums over 32K bytes in another order on another CPU move the mean by about
    # 1e-6; the bf16 rounding moved it by 1.0e-4 (the fp32 file, 1.42922, fails)
    assert abs(held_out_loss(model, held_out_windows(prompts, length, g)) - card) <= 2e-5


def test_the_shipped_checkpoint_stores_matrices_in_bf16_and_fits_its_size():
    assert SHIPPED.stat().st_size < MAX_SHIPPED_BYTES
    with safe_open(str(SHIPPED), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    matrices = {n for n, s in shapes.items() if len(s) >= 2}
    kept = {n for n in matrices if n == "head.weight" or n.rsplit(".", 1)[-1].startswith("hc_")}
    assert kept and {dtypes[n] for n in matrices - kept} == {"BF16"}
    assert {dtypes[n] for n in set(shapes) - (matrices - kept)} == {"F32"}


def test_a_compact_checkpoint_loads_back_what_round_for_storage_left(tmp_path):
    model, _ = build_model(build_args("sparse-tiny"), seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    round_for_storage(model)
    save_weights(model, tmp_path / "w.safetensors", compact=True)
    other, _ = build_model(build_args("sparse-tiny"), seed=4)
    load_weights(other, tmp_path / "w.safetensors")
    moved = 0
    for name, p in model.state_dict().items():
        assert torch.equal(other.state_dict()[name].view(torch.int32), p.view(torch.int32)), name
        if p.dim() >= 2 and not (name == "head.weight" or ".hc_" in f".{name}"):
            assert torch.equal(p, p.bfloat16().float()), f"{name} is not on the bf16 grid"
            moved += not torch.equal(p, before[name])
        else:
            assert torch.equal(p, before[name]), f"{name} was rounded"
    assert moved > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["no-such.safetensors"], "checkpoint: no weights file"),
    (["v41-mini", "--prompts", "0"], "--prompts: 0 must lie in [1, 10000]"),
    (["v41-mini", "--length", "8"], "--length: 8 must lie in [64, "),
    (["v41-mini", "--out", "card.md"], "--out: card.md ends in .md"),
])
def test_evaluate_refuses_bad_input_in_one_line(tmp_path, argv, message):
    out = invoke.evaluator(tmp_path, *argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"python -m swa_bench.train.evaluate: {message}")
    assert out.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_evaluate_out_writes_the_checkpoint_as_shipped_with_its_own_figures(tmp_path):
    """``--out``: an fp32 checkpoint (seeded weights, off the bf16 grid) written with its matrices
    in bf16, its metadata kept, and figures that are the written file's own, to the bit."""
    model, _ = build_model(build_args("v41-mini"), seed=5)
    save_weights(model, tmp_path / "fp32.safetensors", {"train_config": "{}"})
    out = invoke.evaluator(tmp_path, "fp32.safetensors", "--prompts", "1", "--length", "64",
                           "--out", "shipped.safetensors")
    assert out.returncode == 0, out.stderr
    assert "fp32.safetensors as stored in shipped.safetensors" in out.stdout
    with safe_open(str(tmp_path / "shipped.safetensors"), "pt") as f:
        meta = f.metadata()
        assert f.get_slice("layers.0.attn.wkv.weight").get_dtype() == "BF16"
        assert f.get_slice("head.weight").get_dtype() == "F32"
    assert meta["train_config"] == "{}" and "model_args" in meta
    shipped, _ = build_model(build_args("v41-mini"))
    load_weights(shipped, tmp_path / "shipped.safetensors")
    g = torch.Generator().manual_seed(EVAL_SEED)
    assert held_out_loss(shipped, held_out_windows(1, 64, g)) == json.loads(
        meta["figures"])["held_out_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.safetensors",
                                                          "shipped.safetensors"]
