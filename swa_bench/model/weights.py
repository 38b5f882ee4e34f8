"""Trained weights in safetensors: saving a model's parameters and loading them into one.

A checkpoint stores every parameter by its ``state_dict`` name and, in its metadata, the model
arguments it was trained with, so a mismatch is reported as a field, not as a tensor shape.
Shipped checkpoints live in ``swa_bench/checkpoints`` and are named without a path or suffix.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from swa_bench.model.args import ModelArgs
from swa_bench.model.model import Transformer, keeps_fp32
from swa_bench.model.precision import quantise_weights

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


# Shipped checkpoints store their matrices (parameters of two or more dims: projections,
# experts, embeddings, Engram tables) in bf16, as a bf16 model holds them, and the rest as
# trained: vectors (norms, biases, sinks: a few thousand numbers that set scales and choose
# experts) and what the reference keeps fp32 in any dtype (the head, mHC's; ``keeps_fp32``).
STORED_MATRIX_DTYPE = torch.bfloat16


def stored_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype a compact checkpoint stores parameter ``name`` in."""
    if t.dim() >= 2 and t.is_floating_point() and not keeps_fp32(name):
        return STORED_MATRIX_DTYPE
    return t.dtype


@torch.no_grad()
def round_for_storage(model: Transformer) -> None:
    """Rounds ``model``'s parameters in place to the values ``save_weights(..., compact=True)``
    stores (their dtype stays): figures measured after this are the stored checkpoint's."""
    for name, p in model.named_parameters():
        if (dtype := stored_dtype(name, p)) != p.dtype:
            p.copy_(p.to(dtype))


def save_weights(model: Transformer, path: Path, metadata: dict[str, str] | None = None, *,
                 compact: bool = False) -> None:
    """Every tensor of ``model``'s state by name, the model arguments in the metadata;
    ``compact``: matrices in ``STORED_MATRIX_DTYPE`` (call ``round_for_storage`` first to
    measure what is stored)."""
    tensors = {k: v.detach().to("cpu", stored_dtype(k, v) if compact else v.dtype).contiguous()
               for k, v in model.state_dict().items()}
    meta = {"model_args": json.dumps(dataclasses.asdict(model.args)), **(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names; the model loads floats only


@dataclass(frozen=True)
class Header:
    """A checkpoint's tensor names with their shapes and dtypes, and its metadata: all that
    validation needs, read without the tensors."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    metadata: dict[str, str]


_HEADERS: dict[tuple[str, int, int], Header] = {}


def read_header(path: Path) -> Header:
    """``path``'s header, read once per process while the file is unchanged (cached by path,
    mtime and size): a sweep of a thousand cases with trained weights reads it once."""
    try:
        st = path.stat()
    except OSError as err:
        raise WeightsError(f"no weights file {str(path)!r} ({err.strerror or err})") from None
    if not path.is_file():
        raise WeightsError(f"no weights file {str(path)!r}")
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _HEADERS:
        if len(_HEADERS) >= 16:  # a sweep over a few checkpoints: bounded all the same
            del _HEADERS[next(iter(_HEADERS))]
        _HEADERS[key] = _read_header(path)
    return _HEADERS[key]


def _read_header(path: Path) -> Header:
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return Header(shapes={k: tuple(v.get_shape()) for k, v in slices.items()},
                          dtypes={k: v.get_dtype() for k, v in slices.items()},
                          metadata=dict(f.metadata() or {}))
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"{str(path)!r} is not a safetensors file ({err})") from None


def read_metadata(path: Path) -> dict[str, str]:
    return dict(read_header(path).metadata)


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    header = read_header(path)
    try:
        return load_file(str(path)), dict(header.metadata)
    except (SafetensorError, OSError, ValueError) as err:
        raise WeightsError(f"{str(path)!r} is not a safetensors file ({err})") from None


def stored_args(metadata: dict[str, str]) -> dict:
    """The model arguments a checkpoint was trained with (empty when none is stored); a value
    that is not a JSON object is a ``WeightsError`` naming the metadata field."""
    text = metadata.get("model_args")
    if text is None:
        return {}
    try:
        stored = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        raise WeightsError(f"checkpoint metadata model_args: not JSON ({reason})") from None
    if not isinstance(stored, dict):
        raise WeightsError(f"checkpoint metadata model_args: must be a JSON object of model "
                           f"arguments, not {type(stored).__name__}")
    return stored


def args_mismatch(args: ModelArgs, metadata: dict[str, str]) -> list[str]:
    """The model fields whose value differs from the checkpoint's (empty when none is stored)."""
    mine = dataclasses.asdict(args)
    return [f"{k}={mine[k]!r} (checkpoint: {v!r})" for k, v in stored_args(metadata).items()
            if k in mine and mine[k] != v]


_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {}


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in a model of ``args`` (a meta-device model, built once per
    distinct arguments: a sweep's cases mostly share them)."""
    key = repr(dataclasses.asdict(args))
    if key not in _SHAPES:
        if len(_SHAPES) >= 16:
            del _SHAPES[next(iter(_SHAPES))]
        with torch.device("meta"):
            _SHAPES[key] = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    return _SHAPES[key]


def check_weights(args: ModelArgs, header: Header, model: Transformer | None = None) -> None:
    """Raises ``WeightsError`` unless the checkpoint fits a model of ``args`` exactly: its
    arguments, every tensor's name and shape, and a float dtype (an int8 tensor would be cast
    silently into nonsense)."""
    differs = args_mismatch(args, header.metadata)
    if differs:
        raise WeightsError(f"checkpoint was trained for other model arguments: {differs[0]}")
    want = (expected_shapes(args) if model is None
            else {k: tuple(v.shape) for k, v in model.state_dict().items()})
    missing = sorted(set(want) - set(header.shapes))
    extra = sorted(set(header.shapes) - set(want))
    if missing:
        raise WeightsError(f"checkpoint lacks {len(missing)} tensors (first: {missing[0]})")
    if extra:
        raise WeightsError(f"checkpoint has {len(extra)} tensors the model lacks "
                           f"(first: {extra[0]})")
    for name, shape in want.items():
        if header.shapes[name] != shape:
            raise WeightsError(f"shape mismatch at {name}: checkpoint "
                               f"{list(header.shapes[name])}, model {list(shape)}")
    for name, dtype in header.dtypes.items():
        if dtype not in FLOAT_DTYPES:
            raise WeightsError(f"tensor {name} is {dtype}; the model loads float weights only "
                               f"({', '.join(FLOAT_DTYPES)})")


def load_weights(model: Transformer, path: Path) -> dict[str, str]:
    """Copies the checkpoint into ``model`` (its device and dtype), quantised as the model's
    precision stores it (a bf16 checkpoint run in fp8); returns its metadata."""
    check_weights(model.args, read_header(path), model)
    tensors, metadata = read_weights(path)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(tensors[name])
    quantise_weights(model)
    return metadata
