"""Trained weights in safetensors: saving a model's parameters and loading them into one.

A checkpoint stores every parameter by its ``state_dict`` name and, in its metadata, the model
arguments it was trained with, so a mismatch is reported as a field, not as a tensor shape.
Shipped checkpoints live in ``swa_bench/checkpoints`` and are named without a path or suffix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from swa_bench.model.args import ModelArgs
from swa_bench.model.model import Transformer

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded into the model: the message says why, in one line."""


def resolve(name: str, base: Path | None = None) -> Path:
    """A shipped checkpoint's file (``v41-mini``), else ``name`` as a path (relative to
    ``base``, the scenario's folder)."""
    shipped = CHECKPOINTS / f"{name}.safetensors"
    if "/" not in name and not name.endswith(".safetensors") and shipped.exists():
        return shipped
    path = Path(name).expanduser()
    return path if path.is_absolute() or base is None else base / path


def save_weights(model: Transformer, path: Path, metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {"model_args": json.dumps(dataclasses.asdict(model.args)), **(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise WeightsError(f"no weights file {str(path)!r}")
    try:
        return load_file(str(path)), read_metadata(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"{str(path)!r} is not a safetensors file ({err})") from None


def args_mismatch(args: ModelArgs, metadata: dict[str, str]) -> list[str]:
    """The model fields whose value differs from the checkpoint's (empty when none is stored)."""
    stored = json.loads(metadata.get("model_args", "{}"))
    mine = dataclasses.asdict(args)
    return [f"{k}={mine[k]!r} (checkpoint: {v!r})" for k, v in stored.items()
            if k in mine and mine[k] != v]


def check_weights(args: ModelArgs, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str], model: Transformer | None = None) -> None:
    """Raises ``WeightsError`` unless the checkpoint fits a model of ``args`` exactly."""
    differs = args_mismatch(args, metadata)
    if differs:
        raise WeightsError(f"checkpoint was trained for other model arguments: {differs[0]}")
    if model is None:
        with torch.device("meta"):
            model = Transformer(args)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing:
        raise WeightsError(f"checkpoint lacks {len(missing)} tensors (first: {missing[0]})")
    if extra:
        raise WeightsError(f"checkpoint has {len(extra)} tensors the model lacks "
                           f"(first: {extra[0]})")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise WeightsError(f"shape mismatch at {name}: checkpoint "
                               f"{list(tensors[name].shape)}, model {list(shape)}")


def load_weights(model: Transformer, path: Path) -> dict[str, str]:
    """Copies the checkpoint into ``model`` (its device and dtype); returns its metadata."""
    tensors, metadata = read_weights(path)
    check_weights(model.args, tensors, metadata, model)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(tensors[name])
    return metadata
