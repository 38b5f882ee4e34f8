"""Task accuracy under a replay policy: what bounded replay does to what a model has learned.

Prompts come from ``swa_bench.tasks.data`` (held-out text, seeded): associative recall with the
fact at a controlled distance from the last token (global KV), copying a pattern inside the last
window (window KV), and plain held-out text whose continuation is decoded teacher-forced (the
decode steps read the window rings the prefill left, where bounded replay's error lives). Every
prompt runs through the engine of the policy as a serving engine would run it: up to
``max_requests`` cold prompts side by side, prefilled in one step or, under ``chunk_size``, in
chunks of that many tokens (``chunked_prompt.prefill_in_chunks``: chunk ``i`` of each prompt in
step ``i``, the caches carried), then decode steps. Chunked, each chunk keeps the rows its
policy gives it (bounded: its own last W; final_window: its rows inside the prompt's final
window, none before it), and a later chunk's decoder layers read only rows earlier chunks kept.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swa_bench.engine.chunked_prompt import prefill_in_chunks
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import decode_requests
from swa_bench.kernels.config import KernelSettings
from swa_bench.model.model import Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.results import CheckResult, HeldOutLoss, TaskCell, TaskResults
from swa_bench.tasks import data


@dataclass(frozen=True)
class TaskSettings:
    prompt_lens: tuple[int, ...]
    distances: tuple[int, ...]
    prompts: int
    continuation: int
    seed: int = 0
    # Every prompt (recall, copy, held-out text) prefilled in chunks of this many tokens, the
    # last shorter; None: one prefill step. Part of the settings, so of the key the runner caches
    # the full prefill's run under: a policy is graded against the full prefill in the same chunks.
    chunk_size: int | None = None

    def recall_distances(self, prompt_len: int) -> list[int]:
        return [d for d in self.distances if 4 <= d <= prompt_len - 1]


@dataclass(frozen=True)
class TaskRun:
    """A policy's results and every prompt's argmax (to compare policies prompt by prompt)."""

    results: TaskResults
    predictions: dict[tuple[str, int, int], tuple[int, ...]]


def _generator(*key) -> torch.Generator:
    """A generator per cell, seeded from its key (the same in every process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _prompt_sets(settings: TaskSettings, window: int):
    """Every cell's prompts, the same for every policy: one generator per cell."""
    for length in settings.prompt_lens:
        cells = [("recall", d) for d in settings.recall_distances(length)]
        cells.append(("copy", min(window - 1, length - 1)))
        for task, distance in cells:
            g = _generator(settings.seed, task, length, distance)
            if task == "recall":
                prompts = [data.recall_prompt(length, distance, g) for _ in range(settings.prompts)]
            else:
                prompts = [data.copy_prompt(length, g, window=window)
                           for _ in range(settings.prompts)]
            yield (task, length, distance), prompts


def _batches(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def prefill_logits(engine: Engine, sequences: Sequence[Sequence[int]],
                   chunk_size: int | None = None) -> torch.Tensor:
    """Last-token logits of cold prefills of prompts of one length, ``max_requests`` side by
    side, each batch in one step or in chunks of ``chunk_size`` (its last chunk's logits)."""
    out = []
    for part in _batches(sequences, engine.args.max_requests):
        out.append(prefill_in_chunks(engine, part, chunk_size).logits.float().cpu())
    return torch.cat(out)


def _held_out(engine: Engine, length: int, settings: TaskSettings) -> HeldOutLoss:
    g = _generator(settings.seed, "text", length)
    text = [data.text_window(data.corpus("held_out"), length + settings.continuation + 1,
                             g).tolist()
            for _ in range(settings.prompts)]
    losses, first = [], []
    for part in _batches(text, engine.args.max_requests):
        requests = [RequestSpec(length) for _ in part]  # the decode rows follow whole prompts
        logits = prefill_in_chunks(engine, [s[:length] for s in part],
                                   settings.chunk_size).logits.float()
        step_losses = []
        for k in range(settings.continuation + 1):
            target = torch.tensor([s[length + k] for s in part], device=logits.device)
            step_losses.append(F.cross_entropy(logits, target, reduction="none").cpu())
            if k == settings.continuation:
                break
            logits = engine.step(decode_requests(requests, k),
                                 [[s[length + k]] for s in part]).logits.float()
        first.append(step_losses[0])
        losses.append(torch.stack(step_losses))
    return HeldOutLoss(prompt_len=length, prompts=len(text), continuation=settings.continuation,
                       loss=float(torch.cat(losses, dim=1).mean()),
                       prefill_loss=float(torch.cat(first).mean()))


def run_tasks(model: Transformer, policy: str, settings: TaskSettings, *, model_name: str,
              kernels: KernelSettings, reference: TaskRun | None = None,
              halo_align: int = 1) -> TaskRun:
    """Every task cell and the held-out loss under ``policy`` (eager engine on ``kernels``), the
    prompts in ``settings.chunk_size`` chunks. ``reference`` (the full prefill's run, in the same
    chunks) gives each cell's agreement; without it a run is its own reference."""
    if reference is not None and reference.results.chunk_size != settings.chunk_size:
        raise ValueError(f"the reference ran chunks of {reference.results.chunk_size}, this run "
                         f"{settings.chunk_size}: agreement would measure the chunking, not the "
                         "policy")
    engine = Engine(model, EngineConfig.for_model(model.args, policy=policy,
                                                  halo_align=halo_align, kernels=kernels))
    cells, predictions = [], {}
    for key, prompts in _prompt_sets(settings, model.args.window):
        logits = prefill_logits(engine, [p.tokens for p in prompts], settings.chunk_size)
        answers = torch.tensor([p.answer for p in prompts])
        guess = logits.argmax(-1)
        predictions[key] = tuple(guess.tolist())
        ref = reference.predictions[key] if reference is not None else predictions[key]
        task, length, distance = key
        cells.append(TaskCell(
            task=task, prompt_len=length, distance=distance, prompts=len(prompts),
            accuracy=float((guess == answers).double().mean()),
            answer_loss=float(F.cross_entropy(logits, answers)),
            agreement=sum(a == b for a, b in zip(predictions[key], ref, strict=True))
            / len(prompts)))
    held_out = [_held_out(engine, length, settings) for length in settings.prompt_lens]
    return TaskRun(TaskResults(policy=policy, model=model_name, chunk_size=settings.chunk_size,
                               cells=cells, held_out=held_out), predictions)


def agreement_check(run: TaskResults, *, must_agree: bool) -> CheckResult:
    """Prompt-by-prompt agreement with the full prefill: pass/fail where the policy is exact
    (halo, full), a figure otherwise."""
    total = sum(c.prompts for c in run.cells)
    agree = sum(round(c.agreement * c.prompts) for c in run.cells)
    worst = min(run.cells, key=lambda c: c.agreement)
    message = (f"{agree}/{total} task prompts give the full prefill's answer token; lowest "
               f"{worst.agreement:.2f} ({worst.task}, {worst.prompt_len} tokens, distance "
               f"{worst.distance})")
    return CheckResult(id="tasks", name=f"task answers under {run.policy} vs full prefill",
                       passed=agree == total or not must_agree,
                       mode="bound" if must_agree else "info", message=message)
