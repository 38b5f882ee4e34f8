"""Task accuracy under a replay policy: what bounded replay does to what a model has learned.

Prompts come from ``swa_bench.tasks.data`` (held-out text, seeded): associative recall with the
fact at a controlled distance from the last token (global KV), copying a pattern inside the last
window (window KV), and plain held-out text whose continuation is decoded teacher-forced (the
decode steps read the window rings the prefill left, where bounded replay's error lives). Every
prompt runs through the engine of the policy as a serving engine would run it: one prefill
step of up to ``max_requests`` cold prompts, then decode steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def _prefill(engine: Engine, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """Last-token logits of cold prefills, ``max_requests`` prompts per step."""
    out = []
    for part in _batches(sequences, engine.args.max_requests):
        requests = [RequestSpec(len(s)) for s in part]
        out.append(engine.step(requests, [list(s) for s in part]).logits.float().cpu())
    return torch.cat(out)


def _held_out(engine: Engine, length: int, settings: TaskSettings) -> HeldOutLoss:
    g = _generator(settings.seed, "text", length)
    text = [data.text_window(data.corpus("held_out"), length + settings.continuation + 1,
                             g).tolist()
            for _ in range(settings.prompts)]
    losses, first = [], []
    for part in _batches(text, engine.args.max_requests):
        requests = [RequestSpec(length) for _ in part]
        logits = engine.step(requests, [s[:length] for s in part]).logits.float()
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
    """Every task cell and the held-out loss under ``policy`` (eager engine on ``kernels``).
    ``reference`` (the full prefill's run) gives each cell's agreement; without it a run is its
    own reference."""
    engine = Engine(model, EngineConfig.for_model(model.args, policy=policy,
                                                  halo_align=halo_align, kernels=kernels))
    cells, predictions = [], {}
    for key, prompts in _prompt_sets(settings, model.args.window):
        logits = _prefill(engine, [p.tokens for p in prompts])
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
    return TaskRun(TaskResults(policy=policy, model=model_name, cells=cells, held_out=held_out),
                   predictions)


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
