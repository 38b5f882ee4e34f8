"""A step's inputs: its requests, their seeded token sequences, the context they start from.

Not to be confused with a scenario's ``workload`` section (``scenario.schema``), which describes
requests; this is one concrete step built from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swa_bench.engine.engine import Engine
from swa_bench.model.requests import RequestSpec
from swa_bench.tasks import data


@dataclass(frozen=True)
class StepInputs:
    requests: tuple[RequestSpec, ...]
    sequences: tuple[tuple[int, ...], ...]  # every request's tokens up to its seq_len
    # Each request's cache slot; None: its batch position. A serving engine's slots follow
    # admission order, not batch order, so checks also run with them permuted.
    cache_indices: tuple[int, ...] | None = None

    @classmethod
    def seeded(
        cls,
        requests: Sequence[RequestSpec],
        vocab: int,
        seed: int,
        cache_indices: Sequence[int] | None = None,
    ) -> StepInputs:
        g = torch.Generator().manual_seed(seed)
        seqs = tuple(
            tuple(torch.randint(0, vocab, (r.seq_len,), generator=g).tolist()) for r in requests
        )
        return cls(tuple(requests), seqs, None if cache_indices is None else tuple(cache_indices))

    @classmethod
    def held_out_text(
        cls, requests: Sequence[RequestSpec], seed: int,
        cache_indices: Sequence[int] | None = None,
    ) -> StepInputs:
        """Held-out text (``tasks.data``) instead of random tokens: what a trained byte-level
        model reads in distribution."""
        g = torch.Generator().manual_seed(seed)
        text = data.corpus("held_out")
        seqs = tuple(tuple(data.text_window(text, r.seq_len, g).tolist()) for r in requests)
        return cls(tuple(requests), seqs, None if cache_indices is None else tuple(cache_indices))

    @property
    def indices(self) -> list[int]:
        """Each request's cache index."""
        if self.cache_indices is None:
            return list(range(len(self.requests)))
        return list(self.cache_indices)

    @property
    def step_tokens(self) -> list[list[int]]:
        """Each request's tokens of this step."""
        return [
            list(s[r.context_len : r.seq_len])
            for r, s in zip(self.requests, self.sequences, strict=True)
        ]

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.requests)

    def fill_context(self, engine: Engine) -> None:
        """Runs every request's context (positions below ``filled_len``: its context, and a prefix
        hit its first rows recompute) as a reference prefill, so caches hold what earlier steps
        (a prefix hit, earlier chunks, a prompt) left."""
        for i, r, seq in zip(self.indices, self.requests, self.sequences, strict=True):
            if r.filled_len:
                warm = RequestSpec(prompt_len=r.filled_len)
                engine.reference_step([warm], [list(seq[: r.filled_len])], [i])

    def shape(self) -> str:
        """The batch's request kinds, lengths aside ("1 decode + 2 prefill"): cases of one shape
        at different lengths share a break-even point."""
        kinds: dict[str, int] = {}
        for r in self.requests:
            kind = "decode" if r.decode else ("prefill+ctx" if r.context_len else "prefill")
            kinds[kind] = kinds.get(kind, 0) + 1
        return " + ".join(f"{n} {k}" for k, n in sorted(kinds.items()))

    def describe(self) -> str:
        parts = []
        for r in self.requests:
            if r.decode:
                verify = f"+{r.spec_decode_tokens}spec" if r.spec_decode_tokens else ""
                parts.append(f"decode@{r.context_len}{verify}")
            elif r.context_len:
                parts.append(f"prefill {r.query_len}+{r.context_len}ctx")
            else:
                parts.append(f"prefill {r.query_len}")
        return ", ".join(parts)


def decode_requests(requests: Sequence[RequestSpec], step: int) -> list[RequestSpec]:
    """The decode rows that follow ``requests``' step, ``step`` steps later (0 = the first)."""
    return [RequestSpec(prompt_len=r.seq_len + step, decode=True) for r in requests]
