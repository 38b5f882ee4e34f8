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
from swa_bench.train.loop import StepBatches, TrainConfig, TrainStep, seq_len_at, train

CONFIGS = {
    "dense": build_args("tiny", {"max_seq_len": 64}),
    "sparse": build_args("sparse-tiny", {"max_seq_len": 64}),
    "mini, top-k binding": build_args("v41-mini", {"index_topk": 6, "max_seq_len": 64}),
}


def reference_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits from the engine's full prefill (its final streams)."""
    b, t = tokens.shape
    out = Engine(model).reference_step([RequestSpec(t)] * b, tokens.tolist())
    collapsed = model.hc.pre(out.streams, out.pre_mix)  # with the final pre-mix
    return F.linear(model.norm(collapsed).float(), model.head.weight.float()).view(b, t, -1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_train_forward_is_the_full_prefill(name):
    model, _ = build_model(CONFIGS[name], seed=3)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = train_forward(model, tokens)
    torch.testing.assert_close(mine.logits, reference_logits(model, tokens), rtol=1e-4,
                               atol=1e-4)
    assert float(mine.index_kl) >= 0.0


def test_candidates_at_s_restrict_the_later_source():
    """sparse-tiny's candidates (4 blocks of 2) bind at 40 tokens: the training forward with
    them is the engine's prefill (above), and differs from the same weights without them."""
    args = CONFIGS["sparse"]
    assert args.candidates and [i for i in args.index_source_list() if i > args.last_kv_source]
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        on = train_forward(build_model(args, seed=3)[0], tokens).logits
        off_model, _ = build_model(args.replace(candidate_topk_blocks=None), seed=3)
        off = train_forward(off_model, tokens).logits
    assert (on - off).abs().max() > 1e-3
    torch.testing.assert_close(off, reference_logits(off_model, tokens), rtol=1e-4, atol=1e-4)


def test_gradients_reach_every_parameter_and_the_indexer_only_through_its_loss():
    model, _ = build_model(CONFIGS["sparse"], seed=0)
    model.requires_grad_(True)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    out = train_forward(model, tokens)
    F.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    indexer = ("wq_index", "w_index", "wk_index", "index_norm")
    for name, p in model.named_parameters():
        if any(part in name for part in indexer) or name.startswith("dspark."):  # not trained
            assert p.grad is None or not p.grad.any(), name
        elif name.endswith("moe.gate.bias"):  # it only chooses the experts: no gradient
            assert p.grad is None, name
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
    cfg = TrainConfig(preset="sparse-tiny", steps=30, batch=4, seq_len=32, lr=3e-3, warmup=5,
                      length_warmup=())
    quiet = lambda line: None  # noqa: E731
    a, history = train(cfg, log=quiet)
    b, _ = train(dataclasses.replace(cfg, steps=2), log=quiet)
    c, _ = train(dataclasses.replace(cfg, steps=2), log=quiet)
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(),
                                                 c.state_dict().values(), strict=True))
    assert history[-1]["loss"] < 0.9 * history[0]["loss"]



def assert_replay_is_the_eager_step(step: TrainStep, batch, cfg: TrainConfig) -> None:
    """``step`` holds a captured graph: its next (replayed) step reads ``batch`` and the current
    weights (its loss is the eager step's) and moves the weights as an eager step does from the
    same weights and optimiser state, up to the backward's atomic-add rounding."""
    assert step.graph is not None
    model = step.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(step.opt.state_dict())
    graphed_loss = step(*batch, 2e-3)[0].item()

    twin, _ = build_model(cfg.args, seed=0, device="cuda")
    twin.load_state_dict(before)
    twin.train().requires_grad_(True)
    eager = TrainStep(twin, dataclasses.replace(cfg, graph=False))
    eager.opt.load_state_dict(state)
    eager_loss = eager(*batch, 2e-3)[0].item()
    assert graphed_loss == pytest.approx(eager_loss, rel=1e-6)
    moved = 0
    for (name, x), y in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        mine, theirs = x - before[name], y - before[name]
        scale = float(theirs.abs().max())
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-3 * scale + 1e-9, msg=name)
        moved += scale > 0
    # The draft layers (DSpark: their rings are seeded, their weights not trained) and the MoE
    # gate's bias (it only chooses experts: no gradient) stay; nearly every other weight moves.
    trained = [n for n in before if not n.startswith("dspark.") and not n.endswith("gate.bias")]
    assert moved > 0.9 * len(trained)


def cuda_step(seq_len: int, *lengths: int):
    """A graphed training step of v41-mini on CUDA (TF32 off), and five batches per length."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TrainConfig(preset="v41-mini", batch=4, seq_len=seq_len, device="cuda", max_facts=6)
    g = torch.Generator().manual_seed(0)
    batches = [[data.training_batch(4, n, cfg.args.window, g, max_facts=6) for _ in range(5)]
               for n in lengths]
    model, _ = build_model(cfg.args, seed=0, device="cuda")
    model.train().requires_grad_(True)
    return cfg, TrainStep(model, cfg), batches


@pytest.mark.cuda
def test_a_replayed_training_step_is_the_eager_step():
    cfg, step, (batches,) = cuda_step(64, 64)
    for tokens, weights in batches[:4]:  # three eager warm-up steps, then the capture
        step(tokens, weights, 1e-3)
    assert_replay_is_the_eager_step(step, batches[4], cfg)


@pytest.mark.cuda
def test_a_new_length_is_captured_again_and_its_replay_is_the_eager_step():
    cfg, step, (short, long) = cuda_step(128, 64, 128)
    for tokens, weights in short:
        step(tokens, weights, 1e-3)
    first = step.graph
    for tokens, weights in long[:4]:
        step(tokens, weights, 1e-3)
    assert step.graph is not None and step.graph is not first
    assert step.tokens.shape == (4, 128)
    assert_replay_is_the_eager_step(step, long[4], cfg)


def test_step_batches_do_not_depend_on_which_worker_draws_them():
    cfg = TrainConfig(preset="v41-mini", steps=5, batch=2, seq_len=64, length_warmup=())
    alone = [StepBatches(cfg)[i] for i in range(5)]
    loader = torch.utils.data.DataLoader(StepBatches(cfg), batch_size=None, num_workers=2)
    for (tokens, weights), (t, w) in zip(alone, loader, strict=True):
        assert torch.equal(tokens, t) and torch.equal(weights, w)
    assert not torch.equal(alone[0][0], alone[1][0])


def test_the_length_warm_up_trains_its_phases_in_order_then_seq_len():
    cfg = TrainConfig(preset="v41-mini", steps=10, batch=2, seq_len=256,
                      length_warmup=((64, 3), (128, 2)))
    assert cfg.problems() == []
    lengths = [seq_len_at(i, cfg) for i in range(cfg.steps)]
    assert lengths == [64] * 3 + [128] * 2 + [256] * 5
    batches = StepBatches(cfg)
    assert [batches[i][0].shape[1] for i in (0, 2, 3, 4, 5, 9)] == [64, 64, 128, 128, 256, 256]
    assert batches[3][1].shape == (2, 127)


@pytest.mark.parametrize(("warmup", "steps", "message"), [
    (((128, 3), (64, 2)), 10, "lengths rising"),
    (((256, 3),), 10, "< seq_len 256"),
    (((32, 3),), 10, "64 <= length"),
    (((64, 0),), 10, "steps >= 1"),
    (((64, 6), (128, 4)), 10, "leave none of 10"),
])
def test_a_bad_length_warm_up_is_refused_before_training(warmup, steps, message):
    cfg = TrainConfig(preset="v41-mini", steps=steps, batch=2, seq_len=256, length_warmup=warmup)
    assert any(message in line for _, line in cfg.problems())
    with pytest.raises(ValueError, match=message):
        train(cfg, log=lambda line: None)


def test_a_step_of_a_new_length_gets_new_inputs_and_trains_on():
    """Across a phase change the step takes the new length (fresh input buffers) and the same
    optimiser goes on: the result equals a run that starts at the new length from the weights
    and optimiser state the first phase left."""
    cfg = TrainConfig(preset="sparse-tiny", steps=4, batch=2, seq_len=48, lr=3e-3, warmup=1,
                      length_warmup=((32, 2),))
    g = torch.Generator().manual_seed(0)
    short = [data.training_batch(2, 32, cfg.args.window, g, max_facts=3) for _ in range(2)]
    long = data.training_batch(2, 48, cfg.args.window, g, max_facts=3)
    model, _ = build_model(cfg.args, seed=0)
    model.train().requires_grad_(True)
    step = TrainStep(model, cfg)
    for tokens, weights in short:
        step(tokens, weights, 1e-3)
    before = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(step.opt.state_dict())
    loss = step(*long, 1e-3)[0]
    assert step.tokens.shape == (2, 48) and step.weights.shape == (2, 47)

    twin, _ = build_model(cfg.args, seed=0)
    twin.load_state_dict(before)
    twin.train().requires_grad_(True)
    fresh = TrainStep(twin, cfg)
    fresh.opt.load_state_dict(state)
    assert torch.equal(loss, fresh(*long, 1e-3)[0])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 twin.state_dict().values(), strict=True))
