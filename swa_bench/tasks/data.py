"""Training and evaluation data, generated from a seed: no downloads.

Text is the Python standard library's own source (present wherever Python is), byte-level: one
token per ASCII byte. Files are split into training and held-out text by a hash of their name.
Training reads the running Python's library; the held-out text is shipped
(``held_out.txt.gz``, made from Python 3.11.7's by ``python -m swa_bench.tasks.data``), because
the library differs between Python versions and a held-out figure (the trained model's card, the
test that reproduces it) must read the same bytes on every machine.
Bytes 0-3 and 128-255 never occur in that text and carry the synthetic tasks:

* **recall** (needs global KV): ``FACT key value`` placed far back, distractor facts with other
  keys elsewhere, and ``QUERY key`` at the end: the answer is the fact's value;
* **copy** (needs window KV): ``COPY`` and a random pattern of 2-6 symbols repeated inside the
  last window: the answer is the pattern's next symbol.
"""

from __future__ import annotations

import gzip
import sys
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

FACT, QUERY, COPY = 1, 2, 3
KEYS = range(128, 160)
VALUES = range(160, 224)
SYMBOLS = range(224, 256)
VOCAB = 256
TEXT_BYTES = 4 << 20  # training text read, in bytes (the held-out share is a tenth of that)
ANSWER_WEIGHT = 4.0  # training loss weight of a task's answer tokens
HELD_OUT_FILE = Path(__file__).with_name("held_out.txt.gz")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "turtledemo"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def is_held_out(path: Path) -> bool:
    """One file in ten, by a hash of its name: the split is the same on every machine."""
    return zlib.crc32(path.name.encode()) % 10 == 0


def ascii_text(data: bytes) -> bytes:
    """Printable ASCII, newlines and spaces; tabs become spaces, other bytes are dropped."""
    keep = bytes(range(32, 127)) + b"\n"
    return data.replace(b"\t", b" ").translate(None, bytes(set(range(256)) - set(keep)))


def stdlib_text(split: str) -> bytes:
    """The running Python's library text of ``split`` (``"train"`` or ``"held_out"``): its
    files in path order, printable ASCII, cut at the split's budget."""
    budget = TEXT_BYTES if split == "train" else TEXT_BYTES // 10
    chunks, size = [], 0
    for path in stdlib_files():
        if is_held_out(path) != (split == "held_out"):
            continue
        text = ascii_text(path.read_bytes())
        chunks.append(text)
        size += len(text)
        if size >= budget:
            break
    return b"".join(chunks)[:budget]


@cache
def corpus(split: str) -> torch.Tensor:
    """The split's text as one uint8 tensor: ``"train"`` from the running Python's library,
    ``"held_out"`` from the shipped file (the same bytes everywhere)."""
    if split == "held_out":
        raw = gzip.decompress(HELD_OUT_FILE.read_bytes())
    elif split == "train":
        raw = stdlib_text("train")
    else:
        raise ValueError(f"split {split!r}: train or held_out")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def text_window(text: torch.Tensor, length: int, g: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, text.numel() - length, (1,), generator=g))
    return text[start : start + length].clone()


def draw(values: range, n: int, g: torch.Generator) -> list[int]:
    """``n`` distinct members of ``values``."""
    return [values[i] for i in torch.randperm(len(values), generator=g)[:n].tolist()]


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    answer: int
    task: str  # "recall" or "copy"
    distance: int  # positions from the needed fact to the prompt's last token


def recall_prompt(length: int, distance: int, g: torch.Generator, *, split: str = "held_out",
                  distractors: int = 2) -> Prompt:
    """Held-out text of ``length`` tokens ending in ``QUERY key``; ``FACT key value`` starts
    ``distance`` positions before the last token, distractor facts elsewhere."""
    if not 4 <= distance <= length - 1:
        raise ValueError(f"distance {distance} must lie in [4, {length - 1}]")
    seq = text_window(corpus(split), length, g)
    keys = draw(KEYS, 1 + distractors, g)
    values = draw(VALUES, 1 + distractors, g)
    fact = length - 1 - distance
    taken = set(range(fact, fact + 3)) | {length - 2, length - 1}
    spots = [fact]
    for _ in range(distractors):
        free = [p for p in range(length - 4) if not taken & {p, p + 1, p + 2}]
        p = free[int(torch.randint(0, len(free), (1,), generator=g))]
        taken |= {p, p + 1, p + 2}
        spots.append(p)
    for p, k, v in zip(spots, keys, values, strict=True):
        seq[p : p + 3] = torch.tensor([FACT, k, v])
    seq[-2:] = torch.tensor([QUERY, keys[0]])
    return Prompt(tuple(seq.tolist()), values[0], "recall", distance)


def fact_values(tokens: Sequence[int]) -> set[int]:
    """The values of every ``FACT key value`` written in ``tokens``: a recall answer that is one
    of them was fetched from a fact, right or wrong key."""
    return {tokens[i + 2] for i in range(len(tokens) - 2) if tokens[i] == FACT}


def copy_prompt(length: int, g: torch.Generator, *, split: str = "held_out",
                window: int = 16) -> Prompt:
    """Held-out text ending in ``COPY`` and a repeated pattern that fits the last window. The
    prompt shows ``window - 2`` symbols, so the answer is the last symbol a training segment can
    hold (segments are shorter than the window): after ``window - 1`` symbols a segment always
    ended in training, and a trained model rightly predicts text there."""
    period = int(torch.randint(2, 7, (1,), generator=g))
    span = min(window - 2, length - 1)
    reps = torch.tensor(draw(SYMBOLS, period, g)).repeat(span // period + 1)
    seq = text_window(corpus(split), length, g)
    seq[length - span - 1] = COPY
    seq[length - span :] = reps[:span]
    return Prompt(tuple(seq.tolist()), int(reps[span]), "copy", span)


def training_batch(batch: int, length: int, window: int, g: torch.Generator, *,
                   max_facts: int):
    """``(tokens [B, T], loss weights [B, T - 1])`` of training text with tasks written in: a
    copy segment inside one window, 1 to ``max_facts`` facts and as many later queries of random
    facts. The weights put ``ANSWER_WEIGHT`` on the answers (a queried value, a pattern's
    repetitions)."""
    text = corpus("train")
    tokens = torch.empty(batch, length, dtype=torch.long)
    weights = torch.ones(batch, length - 1)
    for i in range(batch):
        seq, w = text_window(text, length, g), weights[i]
        period = int(torch.randint(2, max(3, min(7, window // 2)), (1,), generator=g))
        span = int(torch.randint(2 * period, max(window, 2 * period + 1), (1,), generator=g))
        start = int(torch.randint(0, length - span - 1, (1,), generator=g))
        pattern = torch.tensor(draw(SYMBOLS, period, g)).repeat(span // period + 1)[:span]
        seq[start] = COPY
        seq[start + 1 : start + 1 + span] = pattern
        w[start + period : start + span] = ANSWER_WEIGHT
        free = [p for p in range(0, length - 2, 3) if p + 3 <= start or p > start + span]
        n = int(torch.randint(1, min(max_facts, len(free) // 2) + 1, (1,), generator=g))
        slots = sorted(free[j] for j in torch.randperm(len(free), generator=g)[: 2 * n].tolist())
        keys, values = draw(KEYS, n, g), draw(VALUES, n, g)
        for p, k, v in zip(slots[:n], keys, values, strict=True):
            seq[p : p + 3] = torch.tensor([FACT, k, v])
        for q in slots[n:]:
            j = int(torch.randint(0, n, (1,), generator=g))
            seq[q : q + 3] = torch.tensor([QUERY, keys[j], values[j]])
            w[q + 1] = ANSWER_WEIGHT
        tokens[i] = seq
    return tokens, weights


def write_held_out() -> None:
    """Writes ``HELD_OUT_FILE`` from this Python's library (deterministic gzip: no time stamp)."""
    HELD_OUT_FILE.write_bytes(gzip.compress(stdlib_text("held_out"), compresslevel=9, mtime=0))


if __name__ == "__main__":
    write_held_out()
    print(f"wrote {HELD_OUT_FILE} from Python {sys.version.split()[0]}'s library")
