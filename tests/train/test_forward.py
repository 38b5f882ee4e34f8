"""The training forward is the full prefill: held to the engine's reference step at every
position (dense and sparse, with the selection binding), with gradients where training needs
them, and training from a seed is reproducible and lowers the loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from swa_bench.engine.engine import Engine
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.train.forward import train_forward
from swa_bench.train.loop import TrainConfig, train

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
def test_a_captured_training_step_trains_as_the_eager_step_does():
    """The CUDA-graph step (warm-up, capture, replays) and the eager step give the same weights
    after 8 steps, up to the optimiser's rounding (the capturable AdamW keeps its bias
    corrections on the device, in fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(preset="v41-mini", steps=8, batch=4, seq_len=64, warmup=2, device="cuda",
                      max_facts=6)
    quiet = lambda line: None  # noqa: E731
    graphed, g_hist = train(cfg, log=quiet)
    eager, e_hist = train(dataclasses.replace(cfg, graph=False), log=quiet)
    for (name, x), y in zip(graphed.state_dict().items(), eager.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)
    assert g_hist[-1]["loss"] == pytest.approx(e_hist[-1]["loss"], rel=1e-4)
