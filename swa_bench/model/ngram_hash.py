"""The n-gram hashing of DeepSeek-V4.1 Engram (inference/engram.py ``EngramLayout``,
``compute_hash_multipliers``, ``NgramHashState.forward``), as pure functions of integers.

A row's n-grams (sizes 2 .. max_ngram) are hashed ``n_heads`` ways each: the compressed ids at
look-back 0, 1, ... times one odd multiplier per look-back (numpy's PCG64 seeded ``10007 *
layer``), XORed one look-back at a time, modulo a prime of their own (searched upward from the
bucket vocabulary, never reused), plus the first table row of that prime's range.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


@functools.lru_cache(maxsize=16)
def bucket_primes(
    layers: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``[layer][n-gram size - 2][head]`` bucket moduli: for each layer and n-gram size, the next
    ``n_heads`` primes above ``vocab_size - 1`` that no earlier (layer, size, head) took."""
    seen: set[int] = set()
    out = []
    for _ in layers:
        per_size = []
        for _ in range(max_ngram - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_size.append(tuple(sizes))
        out.append(tuple(per_size))
    return tuple(out)


def table_rows(layers: Sequence[int], max_ngram: int, n_heads: int, vocab_size: int
               ) -> list[int]:
    """Each layer's table rows: the sum of its primes (reference ``engram_num_embeddings``)."""
    primes = bucket_primes(tuple(layers), max_ngram, n_heads, vocab_size)
    return [sum(sum(size) for size in layer) for layer in primes]


def hash_multipliers(layers: Sequence[int], max_ngram: int, token_vocab: int) -> torch.Tensor:
    """``[layers, max_ngram]`` int64: odd multipliers from numpy's PCG64 seeded ``10007 * layer``,
    below ``int64 max / token_vocab`` so that ``id * multiplier`` never overflows."""
    bound = max(1, (np.iinfo(np.int64).max // token_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,),
                                                          dtype=np.int64) * 2 + 1
            for layer in layers]
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class EngramLayout:
    """The hashing constants of every Engram layer (host tensors; ``to`` moves them once)."""

    primes: torch.Tensor  # [layers, max_ngram - 1, n_heads] int64
    offsets: torch.Tensor  # [layers, (max_ngram - 1) * n_heads]: each range's first table row
    multipliers: torch.Tensor  # [layers, max_ngram]
    pad_id: int  # the compressed id of ``engram_pad_id``: fills look-back before a request

    @property
    def max_ngram(self) -> int:
        return self.multipliers.shape[1]


@functools.lru_cache(maxsize=16)
def hash_layout(layers: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int,
                token_vocab: int, pad_id: int, device: torch.device) -> EngramLayout:
    """The constants on ``device``, made once per configuration (not inside a graph capture:
    its warm-up made them)."""
    primes = torch.tensor(bucket_primes(layers, max_ngram, n_heads, vocab_size),
                          dtype=torch.long)
    flat = primes.flatten(1)
    offsets = torch.cumsum(flat, dim=1) - flat
    return EngramLayout(primes.to(device), offsets.to(device),
                        hash_multipliers(layers, max_ngram, token_vocab).to(device),
                        pad_id % token_vocab)


def ngram_hash_ids(ngrams: torch.Tensor, layout: EngramLayout) -> torch.Tensor:
    """``ngrams [T, max_ngram]`` (compressed ids at look-back 0, 1, ...; pad id before the
    request) -> table rows ``[T, layers, (max_ngram - 1) * n_heads]``: the running XOR of the
    multiplied ids after look-back i is the (i + 1)-gram's hash, taken modulo each head's prime."""
    products = ngrams[:, None, :] * layout.multipliers  # [T, layers, max_ngram]
    rolling, hashes = products[..., 0], []
    for i in range(1, layout.max_ngram):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling[..., None] % layout.primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + layout.offsets


def sequence_ngrams(ids: torch.Tensor, pad_id: int, max_ngram: int) -> torch.Tensor:
    """``ids [B, T]`` of whole sequences from position 0 -> ``[B * T, max_ngram]`` look-backs."""
    cols = [ids]
    for shift in range(1, max_ngram):
        cols.append(torch.cat([ids.new_full((ids.shape[0], min(shift, ids.shape[1])), pad_id),
                               ids[:, :-shift]], dim=1)[:, : ids.shape[1]])
    return torch.stack(cols, dim=-1).flatten(0, 1)
