"""``python -m swa_bench.train``: trains the shipped small model and writes its checkpoint and card.

    python -m swa_bench.train --device cuda --out swa_bench/checkpoints/v41-mini.safetensors

prints the loss every 50 steps, then the held-out loss and task accuracy under a full prefill,
and writes the checkpoint (safetensors, the training settings in its metadata) and a card
(``<out>.md``) beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from swa_bench.model.weights import save_weights
from swa_bench.train.card import card_text
from swa_bench.train.loop import TrainConfig, evaluate, train


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr and exit 2 (no usage block, nothing written)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def length_warmup(text: str) -> tuple[tuple[int, int], ...]:
    """``64:1500,128:1000`` -> ((64, 1500), (128, 1000)); ``none`` -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple((int(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not LENGTH:STEPS[,LENGTH:STEPS...] or none") from None


def main(argv: list[str] | None = None) -> int:
    default = TrainConfig()
    p = _Parser(prog="python -m swa_bench.train", description=__doc__,
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
                   help="checkpoint to write (default: none, figures only)")
    a = p.parse_args(argv)
    for name in ("steps", "batch", "max_facts", "eval_prompts"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    cfg = dataclasses.replace(default, seed=a.seed, steps=a.steps, batch=a.batch,
                              seq_len=a.seq_len, lr=a.lr, max_facts=a.max_facts,
                              length_warmup=a.length_warmup, device=a.device, graph=a.graph)
    if problems := cfg.problems():
        p.error(problems[0])
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    model, history = train(cfg)
    seconds = time.perf_counter() - start
    distances = tuple(d for d in (8, 32, 128, 240) if d < cfg.seq_len - 4)
    figures = evaluate(model, prompts=a.eval_prompts, length=cfg.seq_len, distances=distances)
    print(f"trained {cfg.steps} steps in {seconds:.1f}s on {cfg.device}")
    print(f"full prefill, prompts of {cfg.seq_len}: {figures.line()}")
    if a.out is not None:
        meta = {"train_config": json.dumps(dataclasses.asdict(cfg)),
                "figures": json.dumps(dataclasses.asdict(figures)),
                "train_seconds": f"{seconds:.1f}"}
        save_weights(model, a.out, meta)
        a.out.with_suffix(".md").write_text(card_text(cfg, figures, history, seconds, a.out))
        print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.1f} MB) and its card")
    return 0


if __name__ == "__main__":
    sys.exit(main())
