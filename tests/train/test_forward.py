"""The training forward is the full prefill: held to the engine's reference step at every
position (dense and sparse, with the selection binding), with gradients where training needs
them, and training from a seed is reproducible and lowers the loss."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from swa_bench.engine.engine import Engine
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.tasks import data
from swa_bench.train.forward import train_forward
from swa_bench.train.loop import StepBatches, TrainConfig, TrainStep, train

CONFIGS = {
    "dense": build_args("tiny", {"max_seq_len": 64}),
    "sparse": build_args("sparse-tiny", {"max_seq_len": 64}),
    "mini, top-k binding": build_args("v41-mini", {"index_topk": 6, "max_seq_len": 64}),
}


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits from the engine's full prefill (its final streams)."""
    b, t = tokens.shape
    out = Engine(model).reference_step([RequestSpec(t)] * b, tokens.tolist())
    picked = torch.stack(out.streams, dim=1).float()
    w = torch.softmax(model.head_hc.float(), 0)
    return model.head(model.norm((picked * w[None, :, None]).sum(1))).float().view(b, t, -1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_train_forward_is_the_full_prefill(name):
    model, _ = build_model(CONFIGS[name], seed=3)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = train_forward(model, tokens)
    torch.testing.assert_close(mine.logits, reference_logits(model, tokens), rtol=1e-4,
                               atol=1e-4)
    assert float(mine.index_kl) >= 0.0


def test_gradients_reach_every_parameter_and_the_indexer_only_through_its_loss():
    model, _ = build_model(CONFIGS["sparse"], seed=0)
    model.requires_grad_(True)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    out = train_forward(model, tokens)
    F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    indexer = ("wq_index", "w_index", "wk_index", "index_norm")
    for name, p in model.named_parameters():
        if any(part in name for part in indexer):
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)
    train_forward(model, tokens).index_kl.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is not None and grads[n].any() for n in grads
               if any(part in n for part in indexer))
    assert all(grads[n] is None or not grads[n].any() for n in grads
               if not any(part in n for part in indexer))


def test_training_is_reproducible_and_lowers_the_loss():
    cfg = TrainConfig(preset="sparse-tiny", steps=20, batch=4, seq_len=32, lr=3e-3, warmup=5)
    quiet = lambda line: None  # noqa: E731
    a, history = train(cfg, log=quiet)
    b, _ = train(dataclasses.replace(cfg, steps=2), log=quiet)
    c, _ = train(dataclasses.replace(cfg, steps=2), log=quiet)
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(),
                                                 c.state_dict().values(), strict=True))
    assert history[-1]["loss"] < 0.9 * history[0]["loss"]



@pytest.mark.cuda
def test_a_replayed_training_step_is_the_eager_step():
    """After the warm-up and the capture, a replay reads the new batch and the current weights
    (its loss is the eager step's) and moves the weights as the eager step does from the same
    weights and optimiser state, up to the backward's atomic-add rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(preset="v41-mini", batch=4, seq_len=64, device="cuda", max_facts=6)
    g = torch.Generator().manual_seed(0)
    batches = [data.training_batch(4, 64, cfg.args.window, g, max_facts=6) for _ in range(5)]
    model, _ = build_model(cfg.args, seed=0, device="cuda")
    model.train().requires_grad_(True)
    step = TrainStep(model, cfg)
    for tokens, weights in batches[:4]:  # three eager warm-up steps, then the capture
        step(tokens, weights, 1e-3)
    assert step.graph is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(step.opt.state_dict())
    graphed_loss = step(*batches[4], 2e-3)[0].item()

    twin, _ = build_model(cfg.args, seed=0, device="cuda")
    twin.load_state_dict(before)
    twin.train().requires_grad_(True)
    eager = TrainStep(twin, dataclasses.replace(cfg, graph=False))
    eager.opt.load_state_dict(state)
    eager_loss = eager(*batches[4], 2e-3)[0].item()
    assert graphed_loss == pytest.approx(eager_loss, rel=1e-6)
    moved = 0
    for (name, x), y in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        mine, theirs = x - before[name], y - before[name]
        scale = float(theirs.abs().max())
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-3 * scale + 1e-9, msg=name)
        moved += scale > 0
    assert moved > 0.9 * len(before)


def test_step_batches_do_not_depend_on_which_worker_draws_them():
    cfg = TrainConfig(preset="v41-mini", steps=5, batch=2, seq_len=64)
    alone = [StepBatches(cfg)[i] for i in range(5)]
    loader = torch.utils.data.DataLoader(StepBatches(cfg), batch_size=None, num_workers=2)
    for (tokens, weights), (t, w) in zip(alone, loader, strict=True):
        assert torch.equal(tokens, t) and torch.equal(weights, w)
    assert not torch.equal(alone[0][0], alone[1][0])
