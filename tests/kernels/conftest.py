"""Shared set-up of the kernel tests: small attention problems with the model's own metadata."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from swa_bench.engine.config import triton_interpreting
from swa_bench.kernels import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, RequestLayout, make_metadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ForwardContext, set_forward_context

# The Triton kernels as this process runs them: interpreted on CPU (tests/conftest.py switches the
# interpreter on), compiled on CUDA. The kernels' wrappers take it explicitly.
TRITON = Kernels("triton", interpret=triton_interpreting())


def on_kernels(kernels: Kernels) -> contextlib.AbstractContextManager[ForwardContext]:
    """A forward context that carries only ``kernels``: model parts run outside an engine (a
    block's mHC, an MoE, ``apply_rope``) read their kernels from it."""
    return set_forward_context(ForwardContext(None, None, None, kernels))


@dataclass
class Problem:
    args: ModelArgs
    cache: KVCache
    meta: AttentionMetadata
    q: torch.Tensor
    kv: torch.Tensor
    sink: torch.Tensor


def attention_problem(args: ModelArgs, requests: list[tuple[int, int]], *, pad: int = 0,
                      dtype=torch.float32, device="cpu", seed: int = 0) -> Problem:
    """``requests``: (cached positions, new rows) per request; caches filled with random rows.

    Key rows are the query rows (a plain prefill chunk); ``pad`` rows of the dummy request follow.
    """
    gen = torch.Generator().manual_seed(seed)
    layouts, cursor = [], 0
    for i, (cached, rows) in enumerate(requests):
        layouts.append(RequestLayout(cache_index=i, q_start=cursor, q_len=rows,
                                     q_first_pos=cached, kv_start=cursor, kv_len=rows,
                                     kv_first_pos=cached, window_start=max(0, cached - args.window),
                                     seq_len=cached + rows))
        cursor += rows
    meta = make_metadata(layouts, num_q_rows=cursor + pad, num_kv_rows=cursor + pad, args=args,
                         device=torch.device(device), num_request_slots=args.max_requests + 1)
    cache = KVCache(args, torch.device(device), dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for ring in cache.ring:
        ring.copy_(rand(*ring.shape))
    for latent in cache.compressed.values():
        latent.copy_(rand(*latent.shape))
    q = rand(cursor + pad, args.n_heads, args.head_dim)
    kv = rand(cursor + pad, args.head_dim)
    sink = torch.randn(args.n_heads, generator=gen).to(device)
    return Problem(args, cache, meta, q, kv, sink)
