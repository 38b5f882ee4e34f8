"""``python -m swa_bench.train``: trains the shipped small model and writes its checkpoint and card.

    python -m swa_bench.train --device cuda --out swa_bench/checkpoints/v41-mini.safetensors

prints the loss every 50 steps, then the held-out loss and task accuracy under a full prefill,
and writes the checkpoint (safetensors, matrices in bf16, the training settings in its metadata)
and a card (``<out>.md``) beside it. The figures are measured after rounding the weights to what
is stored, so they are the shipped file's.

Everything that could fail is checked before the first step (one line on stderr, exit 2, nothing
written): every option's range, the device (known to torch and present), the step's memory
against what the device and this process's limits leave free, and both output files
(``outputs.claim``: an existing checkpoint or card is replaced only with ``--overwrite``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from swa_bench.engine.device_memory import free_bytes
from swa_bench.model.weights import round_for_storage, save_weights
from swa_bench.train.card import card_path, card_text
from swa_bench.train.loop import TrainConfig, evaluate, train
from swa_bench.train.outputs import OutputError, claim, publish
from swa_bench.train.parser import OneLineParser

MAX_EVAL_PROMPTS = 10_000  # per measure; the figures are shares printed to two decimals


def length_warmup(text: str) -> tuple[tuple[int, int], ...]:
    """``64:1500,128:1000`` -> ((64, 1500), (128, 1000)); ``none`` -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple((int(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not LENGTH:STEPS[,LENGTH:STEPS...] or none") from None


def device_problem(text: str) -> str | None:
    """Why ``text`` names no device this process can train on (None: it can)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return f"{text!r} is not a torch device (cpu, cuda, cuda:N, mps, ...)"
    if device.type == "cpu":
        return None if device.index in (None, 0) else f"{text!r}: the CPU is cpu or cpu:0"
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        return f"{text!r}: no {device.type} device is present here"
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"{text!r}: this machine has {count} {device.type} device(s), 0 to {count - 1}"
    return None


def _size(n: float) -> str:
    units = ["B", "KB", "MB", "GB", "TB"]
    while n >= 1000 and len(units) > 1:
        n, units = n / 1000, units[1:]
    return f"{n:.1f} {units[0]}"


def main(argv: list[str] | None = None) -> int:
    default = TrainConfig()
    p = OneLineParser(prog="python -m swa_bench.train", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=default.seed)
    p.add_argument("--steps", type=int, default=default.steps)
    p.add_argument("--batch", type=int, default=default.batch)
    p.add_argument("--seq-len", type=int, default=default.seq_len)
    p.add_argument("--lr", type=float, default=default.lr)
    p.add_argument("--max-facts", type=int, default=default.max_facts,
                   help="facts (and as many queries) written into a training sequence, at most")
    p.add_argument("--length-warmup", type=length_warmup,
                   default=default.length_warmup, metavar="LENGTH:STEPS,...",
                   help="shorter prompt lengths trained first, with their step counts "
                        "(part of --steps); 'none' trains every step at --seq-len")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=default.graph,
                   help="capture the training step as a CUDA graph (CUDA only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint to write (default: none, figures only); its card is "
                        "<out>.md beside it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint or card already at --out (default: refuse)")
    a = p.parse_args(argv)
    cfg = dataclasses.replace(default, seed=a.seed, steps=a.steps, batch=a.batch,
                              seq_len=a.seq_len, lr=a.lr, max_facts=a.max_facts,
                              length_warmup=a.length_warmup, device=a.device, graph=a.graph)
    if problems := cfg.problems():
        field, message = problems[0]
        p.error(f"--{field.replace('_', '-')}: {message}")
    if not 1 <= a.eval_prompts <= MAX_EVAL_PROMPTS:
        p.error(f"--eval-prompts: {a.eval_prompts} must lie in [1, {MAX_EVAL_PROMPTS}]")
    if problem := device_problem(a.device):
        p.error(f"--device: {problem}")
    try:
        outputs = None if a.out is None else claim(a.out, overwrite=a.overwrite)
    except OutputError as err:
        p.error(f"--out: {err}")
    need, free = cfg.step_bytes(), free_bytes(torch.device(a.device))
    if free is not None and need > free:
        p.error(f"--batch {cfg.batch} x --seq-len {cfg.seq_len}: a training step needs "
                f"{_size(need)}, {a.device} has {_size(free)} free")
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    try:
        model, history = train(cfg)
    except KeyboardInterrupt:
        sys.stderr.write(f"{p.prog}: interrupted; nothing written\n")
        return 130
    seconds = time.perf_counter() - start
    round_for_storage(model)  # the figures are the stored checkpoint's
    distances = tuple(d for d in (8, 32, 128, 240) if d < cfg.seq_len - 4)
    figures = evaluate(model, prompts=a.eval_prompts, length=cfg.seq_len, distances=distances)
    print(f"trained {cfg.steps} steps in {seconds:.1f}s on {cfg.device}")
    print(f"full prefill, prompts of {cfg.seq_len}: {figures.line()}")
    if outputs is not None:
        meta = {"train_config": json.dumps(dataclasses.asdict(cfg)),
                "figures": json.dumps(dataclasses.asdict(figures)),
                "train_seconds": f"{seconds:.1f}"}
        try:
            outputs = claim(a.out, overwrite=a.overwrite)  # again: minutes have passed
            publish(outputs.checkpoint, lambda tmp: save_weights(model, tmp, meta, compact=True),
                    overwrite=outputs.overwrite)
            text = card_text(cfg, figures, history, seconds, a.out, a.eval_prompts)
            publish(outputs.card, lambda tmp: tmp.write_text(text, encoding="utf-8"),
                    overwrite=outputs.overwrite)
        except OutputError as err:
            p.error(f"--out: {err}")
        size = os.stat(outputs.checkpoint).st_size
        print(f"wrote {a.out} ({size / 1e6:.1f} MB) and its card {card_path(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
