"""Shared test helpers: random tokens and cache set-up through the reference path."""

from __future__ import annotations

import torch

from swa_bench.engine import Engine
from swa_bench.model.requests import RequestSpec


def tokens_for(requests, vocab: int, seed: int = 0) -> list[list[int]]:
    """Each request's whole token sequence (prompt plus one decode token), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (r.seq_len,), generator=g).tolist() for r in requests]


def step_tokens(requests, sequences) -> list[list[int]]:
    return [seq[r.context_len : r.seq_len] for r, seq in zip(requests, sequences, strict=True)]


def fill_context(engine: Engine, requests, sequences) -> None:
    """Runs each request's context (positions below context_len) as one reference prefill."""
    for i, (r, seq) in enumerate(zip(requests, sequences, strict=True)):
        if r.context_len:
            warm = RequestSpec(prompt_len=r.context_len)
            engine.reference_step([warm], [seq[: r.context_len]], [i])
