"""Checkpoints: a saved model loads back to the same function; a file that does not fit the model
is refused with one line that says why."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from swa_bench.engine.engine import Engine
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.weights import WeightsError, load_weights, resolve, save_weights

ARGS = build_args("sparse-tiny", {"max_seq_len": 64, "max_requests": 2})


def last_logits(model, tokens):
    return Engine(model).reference_step([RequestSpec(len(tokens))], [tokens]).logits


def test_saved_weights_load_into_a_differently_seeded_model(tmp_path):
    trained, _ = build_model(ARGS, seed=1)
    save_weights(trained, tmp_path / "m.safetensors", {"note": "x"})
    fresh, _ = build_model(ARGS, seed=2)
    tokens = list(range(3, 40))
    assert not torch.equal(last_logits(fresh, tokens), last_logits(trained, tokens))
    meta = load_weights(fresh, tmp_path / "m.safetensors")
    assert meta["note"] == "x"
    assert torch.equal(last_logits(fresh, tokens), last_logits(trained, tokens))


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    model, _ = build_model(ARGS, seed=0)
    with pytest.raises(WeightsError, match="no weights file"):
        load_weights(model, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        load_weights(model, tmp_path / "junk.safetensors")
    wide, _ = build_model(ARGS.replace(dim=32), seed=0)
    save_weights(wide, tmp_path / "wide.safetensors")
    with pytest.raises(WeightsError, match=r"other model arguments: dim=64 \(checkpoint: 32\)"):
        load_weights(model, tmp_path / "wide.safetensors")
    tensors = {k: v.clone() for k, v in model.state_dict().items()}  # no stored arguments
    tensors["head.weight"] = tensors["head.weight"][:, :10].contiguous()
    save_file(tensors, str(tmp_path / "bare.safetensors"))
    with pytest.raises(WeightsError, match="shape mismatch at head.weight"):
        load_weights(model, tmp_path / "bare.safetensors")
    del tensors["head.weight"]
    save_file(tensors, str(tmp_path / "short.safetensors"))
    with pytest.raises(WeightsError, match="lacks 1 tensors"):
        load_weights(model, tmp_path / "short.safetensors")


def test_names_resolve_to_shipped_checkpoints_or_paths(tmp_path):
    assert resolve("v41-mini").name == "v41-mini.safetensors" and resolve("v41-mini").is_file()
    assert resolve("mine.safetensors", tmp_path) == tmp_path / "mine.safetensors"
    assert resolve("/abs/x.safetensors", tmp_path).as_posix() == "/abs/x.safetensors"


def test_int8_tensors_and_malformed_metadata_are_refused(tmp_path):
    """What used to validate and fail later (or fail as a JSONDecodeError naming no field)."""
    model, _ = build_model(ARGS, seed=0)
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    save_file({**tensors, "head.weight": tensors["head.weight"].to(torch.int8)},
              str(tmp_path / "int8.safetensors"))
    with pytest.raises(WeightsError, match="tensor head.weight is I8; the model loads float"):
        load_weights(model, tmp_path / "int8.safetensors")
    for name, text, words in [("text", "{not json", "model_args: not JSON"),
                              ("list", "[1, 2]", "model_args: must be a JSON object .* not list")]:
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata={"model_args": text})
        with pytest.raises(WeightsError, match=f"checkpoint metadata {words}"):
            load_weights(model, tmp_path / f"{name}.safetensors")


def test_a_sweep_reads_the_checkpoint_header_once(tmp_path, monkeypatch):
    """Validation of every case of a sweep reads the header once while the file is unchanged,
    and again once it changes (cached by path, mtime and size)."""
    from swa_bench.model import weights
    from swa_bench.scenario import load_cases

    reads = []
    real = weights._read_header
    monkeypatch.setattr(weights, "_read_header", lambda path: reads.append(path) or real(path))
    monkeypatch.setattr(weights, "_HEADERS", {})
    model, _ = build_model(ARGS, seed=0)
    save_weights(model, tmp_path / "m.safetensors")
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\nmodel: {preset: sparse-tiny, weights: m.safetensors, overrides: "
                        "{max_seq_len: 64, max_requests: 2}}\nworkload: {requests: "
                        "[{prompt_len: 4}]}\nsweep:\n  grid:\n    seed: "
                        f"{list(range(40))}\n")
    assert len(load_cases(scenario)[1]) == 40
    assert len(reads) == 1
    load_cases(scenario)
    assert len(reads) == 1, "a second command in this process reuses the header"
    save_weights(model, tmp_path / "m.safetensors", {"note": "changed"})
    load_cases(scenario)
    assert len(reads) == 2, "a rewritten checkpoint is read again"
