"""The caches a DeepSeek-V4.1-style stack keeps between steps.

* every layer owns a window ring of W slots per request (slot = position mod W);
* every KV source keeps its compressor's output (``model.compressor``), one row per group of its
  ratio's positions, RoPE'd at the group's first position: S's (ratio 1, a row per position) is
  the global KV the decoder reads, the others' the compressed KV of the encoder; with sparse
  attention its index keys, one per group as well;
* a source above ratio 1 keeps the fp32 ``(kv, score)`` of each request's incomplete last group,
  a ring of ``ratio`` slots per request (slot = position mod ratio), until the group completes.

Every one is a flat ``[rows + 1, ...]`` tensor whose last row is the trash slot (see batch.py):
request slot ``c``'s group ``j`` is row ``c * groups(s) + j``.

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
        self.ring = [
            torch.zeros(ring_rows, args.head_dim, device=device, dtype=dtype)
            for _ in range(args.n_layers)
        ]
        self.compressed = {
            s: torch.zeros(self.rows(s), args.head_dim, device=device, dtype=dtype)
            for s in args.kv_sources
        }
        self.index_keys = {
            s: torch.zeros(self.rows(s), args.index_head_dim, device=device, dtype=dtype)
            for s in (args.kv_sources if args.sparse else [])
        }
        self.group_state = {
            s: torch.zeros(args.max_requests * self.ratio(s) + 1, 2, args.head_dim,
                           device=device, dtype=torch.float32)
            for s in args.kv_sources if self.ratio(s) > 1
        }
        # Engram's token history and the DSpark draft layers' rings (empty when off).
        global_rows = args.max_requests * args.max_seq_len + 1
        # Engram's token history and the DSpark draft layers' rings (empty when off).
        self.engram_tokens = torch.zeros(global_rows if args.engram_layers else 1,
                                         device=device, dtype=torch.long)
        self.draft_ring = [
            torch.zeros(ring_rows, args.head_dim, device=device, dtype=dtype)
            for _ in range(args.dspark_layers)
        ]

    def ratio(self, source: int) -> int:
        return self.args.compress_ratio_for(source)

    def groups(self, source: int) -> int:
        """Compressed rows per request slot: ``ceil(max_seq_len / ratio)``."""
        return -(-self.args.max_seq_len // self.ratio(source))

    def rows(self, source: int) -> int:
        return self.args.max_requests * self.groups(source) + 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every cache by name, without the trash rows: the state a step leaves behind."""
        out = {f"ring.{i}": t[:-1] for i, t in enumerate(self.ring)}
        out.update({f"compressed.{s}": t[:-1] for s, t in self.compressed.items()})
        out.update({f"index_keys.{s}": t[:-1] for s, t in self.index_keys.items()})
        out.update({f"group_state.{s}": t[:-1] for s, t in self.group_state.items()})
        if self.args.engram_layers:
            out["engram_tokens"] = self.engram_tokens[:-1]
        out.update({f"draft_ring.{j}": t[:-1] for j, t in enumerate(self.draft_ring)})
        return out

    def _raw(self) -> list[torch.Tensor]:
        return [*self.ring, *self.compressed.values(), *self.index_keys.values(),
                *self.group_state.values(), self.engram_tokens, *self.draft_ring]

    def ring_window(self, layer: int, cache_index: int) -> torch.Tensor:
        """The request's W ring slots of ``layer`` (slot = position mod W)."""
        w = self.args.window
        return self.ring[layer][cache_index * w : (cache_index + 1) * w]

    def compressed_rows(self, source: int, cache_index: int, n: int) -> torch.Tensor:
        """Groups ``[0, n)`` of a KV source's compressed KV for one request."""
        base = cache_index * self.groups(source)
        return self.compressed[source][base : base + n]

    def draft_ring_window(self, stage: int, cache_index: int) -> torch.Tensor:
        """The request's W ring slots of DSpark draft layer ``stage``."""
        w = self.args.window
        return self.draft_ring[stage][cache_index * w : (cache_index + 1) * w]

    def index_key_rows(self, source: int, cache_index: int, n: int) -> torch.Tensor:
        """Groups ``[0, n)`` of a KV source's index keys for one request."""
        base = cache_index * self.groups(source)
        return self.index_keys[source][base : base + n]

    def copy_from(self, other: KVCache) -> None:
        for mine, theirs in zip(self._raw(), other._raw(), strict=True):
            mine.copy_(theirs)
