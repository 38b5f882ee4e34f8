"""Training the shipped small model, and its figures under a full prefill.

Reproducible from a seed: weights from ``init_weights(seed)``, batches from a generator seeded
with ``seed``; the held-out figures use their own fixed generator, so two runs are compared on
the same prompts. A step budget (not a time budget) makes the result independent of speed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from swa_bench.model.args import PRESETS, ModelArgs
from swa_bench.model.model import Transformer, build_model
from swa_bench.tasks import data
from swa_bench.train.forward import train_forward

EVAL_SEED = 1234
STEP_SEED_STRIDE = 1_000_003  # step i's batch generator is seeded with seed * this + i
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this
MAX_STEPS = 10**7  # about five days at the H200's 46 ms a step: more is a typo, not a run


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "v41-mini"
    seed: int = 0
    steps: int = 3400  # the shipped checkpoint (its card), on one H200
    batch: int = 32
    seq_len: int = 256
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    index_loss_weight: float = 1.0
    residual_init: float = 4.0  # mHC comb logits start at this times the identity
    max_facts: int = 16  # facts (and queries) written into each training sequence, at most
    length_warmup: tuple[tuple[int, int], ...] = ((64, 2000), (128, 1000))
    device: str = "cpu"
    graph: bool = True  # capture the step as a CUDA graph (on CUDA)

    @property
    def args(self) -> ModelArgs:
        return PRESETS[self.preset]

    def problems(self) -> list[tuple[str, str]]:
        """Every reason this configuration cannot train, as (field, message); none: it can.
        Checked before anything is built, so a bad value is one line, not a failure mid-run."""
        out: list[tuple[str, str]] = []
        if not 1 <= self.steps <= MAX_STEPS:
            out.append(("steps", f"{self.steps} must lie in [1, {MAX_STEPS}]"))
        if self.batch < 1:
            out.append(("batch", f"{self.batch} must be at least 1"))
        # a sequence's facts have distinct keys: more than the key alphabet cannot be drawn
        if not 1 <= self.max_facts <= len(data.KEYS):
            out.append(("max_facts", f"{self.max_facts} must lie in [1, {len(data.KEYS)}] "
                                     f"(a sequence's facts have distinct keys)"))
        if not (math.isfinite(self.lr) and self.lr > 0):
            out.append(("lr", f"{self.lr} must be finite and above 0"))
        top = (SEED_LIMIT - 1 - max(self.steps, 0)) // STEP_SEED_STRIDE
        if not 0 <= self.seed <= top:
            out.append(("seed", f"{self.seed} must lie in [0, {top}] (step i's batches are "
                                f"seeded with seed x {STEP_SEED_STRIDE} + i)"))
        shortest, warm = 4 * self.args.window, 0
        if not shortest <= self.seq_len <= self.args.max_seq_len:
            out.append(("seq_len", f"{self.seq_len} must lie in [{shortest}, "
                                   f"{self.args.max_seq_len}]"))
        previous = 0
        for length, steps in self.length_warmup:
            if not (max(previous, shortest - 1) < length < self.seq_len and steps >= 1):
                out.append(("length_warmup", f"phase {length}:{steps} needs {shortest} <= "
                                             f"length < seq_len {self.seq_len}, lengths rising, "
                                             f"steps >= 1"))
            previous, warm = length, warm + steps
        if warm >= self.steps:
            out.append(("length_warmup", f"its {warm} steps leave none of {self.steps} at "
                                         f"seq_len {self.seq_len}"))
        return out

    def step_bytes(self) -> int:
        """Memory one training step needs at the longest prompt, in bytes: the tensors saved for
        backward (counted by running ``train_forward`` on one sequence on the meta device, so
        nothing is allocated; times ``batch``), plus weights, gradients and AdamW's two moments.
        Within 3% of the CPU's measured peak rise at batch 4-16, T = 256 and 320."""
        saved: dict[int, torch.Tensor] = {}  # by identity: a tensor several ops save is held once

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved[id(t)] = t
            return t

        with torch.device("meta"):
            model = Transformer(self.args)
        model.train().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            train_forward(model, torch.zeros(1, self.seq_len, dtype=torch.long, device="meta"))
        per_sequence = sum(t.numel() * t.element_size() for t in saved.values())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return per_sequence * self.batch + 4 * weights


def seq_len_at(step: int, cfg: TrainConfig) -> int:
    """The prompt length trained at ``step``: the warm-up phases' shorter lengths in order, then
    ``seq_len``. Why: at 64 tokens the indexer's top-k keeps every compressed position, so the
    attention learns recall densely and the indexer learns (by its KL) to pick the facts; at
    256 tokens from the start, the untrained top-k hides the fact from most queries and CPU
    ablations and the first H200 run learned no recall. On CPU, 1000 steps at 64 tokens (batch
    16) alone gave recall 0.17-0.23 at 64 tokens and 0.16-0.22 at 256 (distances 8-240)."""
    for length, steps in cfg.length_warmup:
        if step < steps:
            return length
        step -= steps
    return cfg.seq_len


@dataclass
class Figures:
    """Held-out loss (nats per byte of text) and task accuracy under a full prefill."""

    held_out_loss: float
    recall: dict[int, float] = field(default_factory=dict)  # accuracy by fact distance
    copy: float = 0.0
    # by distance: share of recall answers that are the value of some fact in the prompt (the
    # right one or a distractor's): 1/64 x facts when guessing values, 1 when facts are found
    retrieved: dict[int, float] = field(default_factory=dict)

    def line(self) -> str:
        recall = ", ".join(f"d={d}: {a:.2f}" for d, a in self.recall.items())
        fetched = ", ".join(f"{a:.2f}" for a in self.retrieved.values())
        return (f"held-out loss {self.held_out_loss:.3f} nats/byte, recall {recall}, "
                f"copy {self.copy:.2f}, answers that are some fact's value {fetched}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    done = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


class StepBatches(torch.utils.data.Dataset):
    """Step ``i``'s batch, drawn from its own generator (seeded by the run's seed and ``i``): the
    stream is the same whichever worker draws which step."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def __len__(self) -> int:
        return self.cfg.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * STEP_SEED_STRIDE + i)
        return data.training_batch(cfg.batch, seq_len_at(i, cfg), cfg.args.window, g,
                                   max_facts=cfg.max_facts)


def batches(cfg: TrainConfig) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """The run's batches in step order. On CUDA, worker processes draw them ahead of the step:
    drawing a batch (Python, per sequence) takes longer than a replayed step."""
    data.corpus("train")  # read once here; forked workers inherit it
    on_cpu = torch.device(cfg.device).type == "cpu"
    workers = 0 if on_cpu else min(8, max(1, (os.cpu_count() or 2) - 2))
    return torch.utils.data.DataLoader(StepBatches(cfg), batch_size=None, shuffle=False,
                                       num_workers=workers,
                                       prefetch_factor=8 if workers else None,
                                       pin_memory=workers > 0)


class TrainStep:
    """Forward, loss, backward, gradient clip and AdamW on one batch.

    On CUDA the whole step is captured once as a CUDA graph and replayed: the model is small
    and an eager step is launch-bound (thousands of kernels), so replaying is most of the
    speed. Capture needs a step without host syncs (``train_forward`` has none), inputs at fixed
    addresses, and an optimiser whose learning rate is a device tensor (``capturable``). The
    first ``WARMUP`` steps run eagerly on a side stream, as capture asks. Replays run the same
    kernels on the same shapes as the eager step, so the two train the same model. A batch of a
    new length (the next warm-up phase) drops the graph and warms up and captures again.
    """

    WARMUP = 3

    def __init__(self, model: Transformer, cfg: TrainConfig) -> None:
        device = torch.device(cfg.device)
        self.model, self.cfg = model, cfg
        self.capture = cfg.graph and device.type == "cuda"
        capturable = device.type == "cuda"  # eager CUDA steps too: one optimiser, one rounding
        lr = torch.tensor(cfg.lr, device=device) if capturable else cfg.lr
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay, capturable=capturable,
                                     foreach=True if capturable else None)
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.weights = torch.zeros(0, 0, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0

    def _inputs_for(self, tokens: torch.Tensor) -> None:
        """Input buffers of ``tokens``' shape: kept while the shape holds (a graph reads them at
        fixed addresses), new with a fresh warm-up and capture when it changes."""
        if self.tokens.shape == tokens.shape:
            return
        self.graph, self.out, self.eager_steps = None, None, 0
        self.tokens = torch.zeros_like(tokens, device=self.tokens.device)
        self.weights = torch.zeros(tokens.shape[0], tokens.shape[1] - 1,
                                   device=self.tokens.device)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = train_forward(self.model, self.tokens)
        ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), self.tokens[:, 1:].flatten(),
                             reduction="none")
        loss = (ce * self.weights.flatten()).sum() / self.weights.sum()
        (loss + self.cfg.index_loss_weight * out.index_kl).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach(), out.index_kl.detach()

    def __call__(self, tokens: torch.Tensor, weights: torch.Tensor,
                 lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (weighted task loss, index KL), as device tensors (read them sparingly)."""
        self._inputs_for(tokens)
        self.tokens.copy_(tokens)
        self.weights.copy_(weights)
        for group in self.opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        if self.graph is not None:
            self.graph.replay()
            return self.out
        self.opt.zero_grad(set_to_none=True)
        if not self.capture:
            return self.run()
        if self.eager_steps < self.WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.run()
            torch.cuda.current_stream().wait_stream(side)
            self.eager_steps += 1
            return out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.run()
        graph.replay()
        self.graph = graph
        return self.out


@torch.no_grad()
def start_as_plain_residual(model: Transformer, diagonal: float) -> None:
    """mHC starts as a plain pre-norm residual, as mHC is initialised: every stream stays in place
    (comb logits ``diagonal * I`` before the row softmax and Sinkhorn: 0.95 of each of 4 streams
    at 4), each sublayer reads the streams' mean (pre gains 1/hc), adds its output to every
    stream (post gain 1), and the per-row projections ``hc_*_fn`` start at zero (their scales at
    one, so the projections learn). From the seeded dummy weights' random mixes, CPU ablations
    (T = 64, 1250 steps) learned no recall; from this start, 0.19-0.40."""
    hc = model.args.hc_mult
    if hc == 1:
        return
    for block in model.layers:
        for part in ("attn", "ffn"):
            fn, base = getattr(block, f"hc_{part}_fn"), getattr(block, f"hc_{part}_base")
            fn.zero_()
            getattr(block, f"hc_{part}_scale").fill_(1.0)
            base[:hc] = -math.log(hc - 1)  # sigmoid: 1 / hc
            base[hc : 2 * hc] = 0.0  # 2 sigmoid(0) = 1
            base[2 * hc :] = diagonal * torch.eye(hc, device=base.device).flatten()


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> tuple[Transformer, list[dict]]:
    """The trained model (eval mode, no gradients) and its loss history."""
    if problems := cfg.problems():
        raise ValueError("; ".join(f"{field}: {message}" for field, message in problems))
    torch.manual_seed(cfg.seed)
    model, _ = build_model(cfg.args, seed=cfg.seed, device=cfg.device)
    start_as_plain_residual(model, cfg.residual_init)
    model.train().requires_grad_(True)
    step = TrainStep(model, cfg)
    history, start = [], time.perf_counter()
    for i, (tokens, weights) in enumerate(batches(cfg)):
        loss, index_kl = step(tokens, weights, lr_at(i, cfg))
        if i % 50 == 0 or i == cfg.steps - 1:
            entry = {"step": i, "seq_len": tokens.shape[1], "loss": loss.item(),
                     "index_kl": index_kl.item(), "seconds": time.perf_counter() - start}
            history.append(entry)
            log(f"step {i:5d}  T {entry['seq_len']:4d}  loss {entry['loss']:.3f}  "
                f"index KL {entry['index_kl']:.3f}  {entry['seconds']:.1f}s")
    model.eval().requires_grad_(False)
    return model, history


def held_out_windows(prompts: int, length: int, g: torch.Generator) -> torch.Tensor:
    """``[prompts, length]`` windows of the shipped held-out text, drawn by ``g``."""
    return torch.stack([data.text_window(data.corpus("held_out"), length, g)
                        for _ in range(prompts)])


@torch.no_grad()
def held_out_loss(model: Transformer, text: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) of ``model``'s full prefill over ``text [B, T]``."""
    text = text.to(model.embed.weight.device)
    losses = []
    for chunk in text.split(16):
        logits = train_forward(model, chunk).logits
        losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten(),
                                      reduction="none"))
    return float(torch.cat(losses).mean())


@torch.no_grad()
def evaluate(model: Transformer, *, prompts: int = 64, length: int = 256,
             distances: tuple[int, ...] = (8, 32, 128, 240)) -> Figures:
    """Held-out figures of ``model`` under a full prefill (``train_forward`` computes exactly
    that): text loss over held-out windows of ``length``, recall accuracy by distance and
    copy accuracy over ``prompts`` held-out prompts each."""
    device = model.embed.weight.device
    g = torch.Generator().manual_seed(EVAL_SEED)
    figures = Figures(held_out_loss=held_out_loss(model, held_out_windows(prompts, length, g)))

    def answers(batch: list[data.Prompt]) -> list[int]:
        out = []
        for i in range(0, len(batch), 16):
            tokens = torch.tensor([p.tokens for p in batch[i : i + 16]], device=device)
            out += train_forward(model, tokens).logits[:, -1].argmax(-1).tolist()
        return out

    def share(hits) -> float:
        hits = list(hits)
        return sum(hits) / len(hits)

    for d in distances:
        batch = [data.recall_prompt(length, d, g) for _ in range(prompts)]
        guess = answers(batch)
        figures.recall[d] = share(a == p.answer for a, p in zip(guess, batch, strict=True))
        figures.retrieved[d] = share(a in data.fact_values(p.tokens)
                                     for a, p in zip(guess, batch, strict=True))
    window = model.args.window
    batch = [data.copy_prompt(length, g, window=window) for _ in range(prompts)]
    figures.copy = share(a == p.answer for a, p in zip(answers(batch), batch, strict=True))
    return figures
