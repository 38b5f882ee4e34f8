"""``python -m swa_bench.train.evaluate CHECKPOINT``: a trained checkpoint's held-out figures
under a full prefill, the ones its card reports (``loop.evaluate``: the shipped held-out text,
recall by distance, copy), on this machine's CPU.

    python -m swa_bench.train.evaluate v41-mini
    python -m swa_bench.train.evaluate trained.safetensors --out v41-mini.safetensors

``--out`` writes the checkpoint as shipped ones are stored (matrices in bf16:
``weights.round_for_storage``), its training metadata kept and its figures re-measured on the
stored weights; the card beside it is not rewritten (its training history is not in the file),
so the figures line printed is what to put there. Bad arguments are one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from swa_bench.model.args import ModelArgs
from swa_bench.model.model import build_model
from swa_bench.model.weights import (
    WeightsError,
    load_weights,
    read_header,
    resolve,
    round_for_storage,
    save_weights,
    stored_args,
)
from swa_bench.train.loop import evaluate
from swa_bench.train.outputs import OutputError, claim, publish
from swa_bench.train.parser import OneLineParser

DISTANCES = (8, 32, 128, 240)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m swa_bench.train.evaluate", description=__doc__)
    p.add_argument("checkpoint", help="a shipped checkpoint's name (v41-mini) or a path")
    p.add_argument("--prompts", type=int, default=128, help="prompts per measure")
    p.add_argument("--length", type=int, default=256, help="prompt length in tokens")
    p.add_argument("--out", type=Path, default=None,
                   help="write the checkpoint as shipped (matrices bf16) with its figures")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a file already at --out (default: refuse)")
    a = p.parse_args(argv)
    path = resolve(a.checkpoint)
    try:
        metadata = read_header(path).metadata
        if not stored_args(metadata):
            raise WeightsError("its metadata has no model_args")
        args = ModelArgs(**stored_args(metadata))
        model, _ = build_model(args)
        load_weights(model, path)
    except (WeightsError, TypeError) as err:
        p.error(f"checkpoint: {err}")
    if not 1 <= a.prompts <= 10_000:
        p.error(f"--prompts: {a.prompts} must lie in [1, 10000]")
    if not 4 * args.window <= a.length <= args.max_seq_len:
        p.error(f"--length: {a.length} must lie in [{4 * args.window}, {args.max_seq_len}]")
    try:
        outputs = None if a.out is None else claim(a.out, overwrite=a.overwrite)
    except OutputError as err:
        p.error(f"--out: {err}")
    if outputs is not None:
        round_for_storage(model)
    figures = evaluate(model, prompts=a.prompts, length=a.length,
                       distances=tuple(d for d in DISTANCES if d < a.length - 4))
    measured = path.name if outputs is None else f"{path.name} as stored in {a.out.name}"
    print(f"{measured}, full prefill, prompts of {a.length}: {figures.line()}")
    if outputs is not None:
        meta = {**metadata, "figures": json.dumps(dataclasses.asdict(figures))}
        meta.pop("model_args", None)  # save_weights writes the model's own
        try:
            publish(outputs.checkpoint, lambda tmp: save_weights(model, tmp, meta, compact=True),
                    overwrite=outputs.overwrite)
        except OutputError as err:
            p.error(f"--out: {err}")
        print(f"wrote {a.out} ({outputs.checkpoint.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
