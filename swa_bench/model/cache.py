"""The caches a DeepSeek-V4.1-style stack keeps between steps.

* every layer owns a window ring of W slots per request (slot = position mod W);
* every KV-source layer keeps its latent for every position: S's is the full-resolution global KV
  the decoder reads, the others' are pooled into compressed KV for the encoder.

Both are flat ``[rows + 1, head_dim]`` tensors whose last row is the trash slot (see batch.py).

* Engram (``engram_layers``): every request's compressed token ids by position, the n-gram
  history a row's hashes read across chunks and decode steps (global-slot layout);
* DSpark (``dspark_layers``): each draft layer's window ring, seeded from the aux hidden states.
"""

from __future__ import annotations

import torch

from swa_bench.model.args import ModelArgs


class KVCache:
    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> None:
        self.args = args
        ring_rows = args.max_requests * args.window + 1
        global_rows = args.max_requests * args.max_seq_len + 1
        self.ring = [
            torch.zeros(ring_rows, args.head_dim, device=device, dtype=dtype)
            for _ in range(args.n_layers)
        ]
        self.latent = {
            s: torch.zeros(global_rows, args.head_dim, device=device, dtype=dtype)
            for s in args.kv_sources
        }
        # Every KV source's indexer keys for every position (sparse attention only).
        self.index_keys = {
            s: torch.zeros(global_rows, args.index_head_dim, device=device, dtype=dtype)
            for s in (args.kv_sources if args.sparse else [])
        }
        # Engram's token history and the DSpark draft layers' rings (empty when off).
        self.engram_tokens = torch.zeros(global_rows if args.engram_layers else 1,
                                         device=device, dtype=torch.long)
        self.draft_ring = [
            torch.zeros(ring_rows, args.head_dim, device=device, dtype=dtype)
            for _ in range(args.dspark_layers)
        ]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every cache by name, without the trash rows: the state a step leaves behind."""
        out = {f"ring.{i}": t[:-1] for i, t in enumerate(self.ring)}
        out.update({f"latent.{s}": t[:-1] for s, t in self.latent.items()})
        out.update({f"index_keys.{s}": t[:-1] for s, t in self.index_keys.items()})
        if self.args.engram_layers:
            out["engram_tokens"] = self.engram_tokens[:-1]
        out.update({f"draft_ring.{j}": t[:-1] for j, t in enumerate(self.draft_ring)})
        return out

    def _raw(self) -> list[torch.Tensor]:
        return [*self.ring, *self.latent.values(), *self.index_keys.values(),
                self.engram_tokens, *self.draft_ring]

    def ring_window(self, layer: int, cache_index: int) -> torch.Tensor:
        """The request's W ring slots of ``layer`` (slot = position mod W)."""
        w = self.args.window
        return self.ring[layer][cache_index * w : (cache_index + 1) * w]

    def draft_ring_window(self, stage: int, cache_index: int) -> torch.Tensor:
        """The request's W ring slots of DSpark draft layer ``stage``."""
        w = self.args.window
        return self.draft_ring[stage][cache_index * w : (cache_index + 1) * w]

    def latent_rows(self, source: int, cache_index: int, length: int) -> torch.Tensor:
        """Positions ``[0, length)`` of a KV source's latent for one request."""
        base = cache_index * self.args.max_seq_len
        return self.latent[source][base : base + length]

    def index_key_rows(self, source: int, cache_index: int, length: int) -> torch.Tensor:
        base = cache_index * self.args.max_seq_len
        return self.index_keys[source][base : base + length]

    def copy_from(self, other: KVCache) -> None:
        for mine, theirs in zip(self._raw(), other._raw(), strict=True):
            mine.copy_(theirs)
