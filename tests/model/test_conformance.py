"""Conformance: swa-bench's model against DeepSeek-V4.1's own inference code.

The fixture (tests/fixtures/conformance/v41-tiny, CARD.md) holds a tiny V4.1-structured model's
weights, a prompt of 2 x 37 tokens and 2W = 16 teacher-forced decode tokens, and what the
reference (inference/model.py of the V4.1-Flash release, revision dba1be0a, run in fp32 with its
quantisation steps replaced by identities) computed from them: the logits of the prefill's last
position and of every decode step, every cache after the prefill and after the last step, and
the DSpark aux hidden states. swa-bench's Engine runs the same two requests on its full-batch
path (``reference_step``: every layer on every row, which is what the reference computes; the
replay paths are held to it by E1-E5) with the weights mapped in (conformance_mapping), and
must agree within 1e-4 (max abs, fp32).

The seeded changes at the bottom each undo one mechanism in swa-bench (by its arguments, or by
monkeypatching one function) and require the same comparison to fail: the fixture resolves
every mechanism it covers: on the reference itself each of these moves the prefill's logits by
0.37 (candidates) to 2.5 (logit std 1), far above the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from swa_bench.engine.engine import Engine
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from tests.model import conformance_mapping as cm

TOL = 1e-4  # max abs difference, fp32 (issue 27)


@pytest.fixture(scope="module")
def reference() -> cm.Fixture:
    return cm.load_fixture()


@dataclass
class Run:
    logits: torch.Tensor  # [B, 1 + steps, vocab]
    caches: dict[str, torch.Tensor | str] = field(default_factory=dict)  # name -> tensor | error
    main_hidden: list[torch.Tensor | None] = field(default_factory=list)


def build(fixture: cm.Fixture, **changes) -> tuple[torch.nn.Module, cm.Loaded]:
    args = cm.swa_bench_args(fixture.config).args.replace(**changes)
    model, _ = build_model(args, seed=0, dtype=torch.float32)
    mapped = cm.map_reference_weights(fixture.weights, fixture.config)
    return model, cm.load_reference_weights(model, mapped)


def snapshot(cache, fixture: cm.Fixture, stage: str, seq_len: int) -> dict[str, torch.Tensor | str]:
    """swa-bench's caches under the reference's names (``stage.layers.i.window_kv_cache`` ...),
    each stacked over the requests; an error string where swa-bench has no such cache."""
    batch = fixture.prompt.shape[0]
    out: dict[str, torch.Tensor | str] = {}
    for name, want in fixture.expected.items():
        if not name.startswith(stage + "."):
            continue
        parts = name.split(".")
        if len(parts) < 4:  # main_hidden: not a cache
            continue
        kind, index, leaf = parts[1], int(parts[2]), ".".join(parts[3:])
        try:
            if kind == "mtp":
                rows = [cm.draft_ring(cache, index, b) for b in range(batch)]
            elif leaf == "window_kv_cache":
                rows = [cm.ring(cache, index, b) for b in range(batch)]
            elif leaf == "compress_kv_cache":
                rows = [cm.compressed(cache, index, b, want.shape[1]) for b in range(batch)]
            elif leaf == "indexer.k_cache":
                rows = [cm.index_keys(cache, index, b, want.shape[1]) for b in range(batch)]
            elif leaf.startswith("compressor."):
                tail = range(seq_len - want.shape[1], seq_len)
                pick = 0 if leaf.endswith("kv_state") else 1
                rows = [cm.group_state(cache, index, b, tail)[pick] for b in range(batch)]
            else:
                continue
            out[name] = torch.stack(rows).float().clone()
        except (AttributeError, KeyError, IndexError, TypeError) as err:
            out[name] = f"swa-bench has no such cache ({type(err).__name__}: {err})"
    return out


def run_engine(model: torch.nn.Module, fixture: cm.Fixture, steps: int) -> Run:
    """The prefill of both prompts in one step, then ``steps`` decode steps of the fixture's
    tokens, on the Engine's full-batch path; caches snapshotted after the prefill and the last."""
    engine = Engine(model)
    prompt, decode = fixture.prompt, fixture.decode_tokens
    batch, length = prompt.shape
    slots = list(range(batch))
    out = engine.reference_step([RequestSpec(prompt_len=length)] * batch, prompt.tolist(), slots)
    run = Run(logits=torch.empty(0))
    logits = [out.logits.float()]
    run.main_hidden.append(cm.main_hidden(out))
    run.caches.update(snapshot(engine.cache, fixture, "prefill", length))
    for k in range(steps):
        requests = [RequestSpec(prompt_len=length + k, decode=True)] * batch
        out = engine.reference_step(requests, [[t] for t in decode[:, k].tolist()], slots)
        logits.append(out.logits.float())
        run.main_hidden.append(cm.main_hidden(out))
    if steps == decode.shape[1]:
        run.caches.update(snapshot(engine.cache, fixture, "final", length + steps))
    run.logits = torch.stack(logits, dim=1)
    return run


@pytest.fixture(scope="module")
def conformance(reference) -> Run:
    model, _ = build(reference)
    return run_engine(model, reference, reference.decode_tokens.shape[1])


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {list(got.shape)} != reference {list(want.shape)}"
    return (got.float() - want.float()).abs().max().item()


# ---- the mapping -------------------------------------------------------------------------------


def test_reference_config_maps_onto_model_args(reference):
    mapping = cm.swa_bench_args(reference.config)
    assert not mapping.missing, f"ModelArgs lacks the reference's settings: {mapping.missing}"


def test_reference_weights_fill_every_parameter(reference):
    _, loaded = build(reference)
    assert not loaded.shape_errors, loaded.shape_errors
    assert not loaded.unfilled, f"{len(loaded.unfilled)} swa-bench parameters have no reference " \
                                f"weight: {loaded.unfilled[:12]}"
    assert not loaded.unused, f"{len(loaded.unused)} reference weights have no swa-bench " \
                              f"parameter: {loaded.unused[:12]}"


def test_fixture_is_the_stated_problem(reference):
    """The reference's own shape: 2 prompts of 37 tokens (not a multiple of 2, 4 or 8), 2W decode
    steps, logits std about 1 (so 1e-4 is a strict bound), the reference's config structure."""
    cfg, exp = reference.config, reference.expected
    assert reference.prompt.shape == (2, 37) and reference.decode_tokens.shape == (2, 2 * 8)
    assert exp["logits"].shape == (2, 17, cfg["vocab_size"])
    assert 0.5 < exp["logits"].std().item() < 2
    assert cfg["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert all(v.dtype == torch.float32 for v in reference.weights.values())


# ---- logits, caches, aux hidden states ---------------------------------------------------------


def test_prefill_logits_match_the_reference(reference, conformance):
    diff = max_diff(conformance.logits[:, 0], reference.expected["logits"][:, 0])
    assert diff < TOL, f"prefill logits differ from the reference by {diff:.3g}"


def test_decode_logits_match_the_reference(reference, conformance):
    per_step = (conformance.logits[:, 1:] - reference.expected["logits"][:, 1:]).abs().amax(
        dim=(0, 2))
    assert per_step.max().item() < TOL, \
        f"decode logits differ from the reference, per step: {per_step.tolist()}"


@pytest.mark.parametrize("stage", ["prefill", "final"])
def test_caches_match_the_reference(reference, conformance, stage):
    """Every layer's window ring, each KV source's compressed KV (valid groups) and the tail of
    its incomplete group, each index-key owner's keys and the draft layers' rings."""
    bad = []
    for name, want in reference.expected.items():
        if not name.startswith(stage + ".") or name.endswith("main_hidden"):
            continue
        got = conformance.caches.get(name, "not snapshotted")
        if isinstance(got, str):
            bad.append(f"{name}: {got}")
        elif (diff := max_diff(got, want)) >= TOL:
            bad.append(f"{name}: max diff {diff:.3g}")
    assert not bad, f"{len(bad)} caches differ from the reference: {bad}"


@pytest.mark.parametrize("dims", ["nope", "rope"])
def test_layer0_window_ring_matches_the_reference(reference, conformance, dims):
    """Where a failure starts: layer 0's ring is ``kv_norm(wkv(attn_norm(embed)))`` (its streams
    are copies of the embedding, so any positive pre-mix gives the same normed input; no Engram
    before layer 0): its first head_dim - rope_dim features need only the weight mapping, the
    engine's positions and ring slots (they pass before the layers conform); its last rope_dim
    features add the window-only layers' RoPE (interleaved pairs, rope_theta, no YaRN)."""
    rope = reference.config["rope_head_dim"]
    part = slice(None, -rope) if dims == "nope" else slice(-rope, None)
    for stage in ("prefill", "final"):
        got = conformance.caches[f"{stage}.layers.0.window_kv_cache"]
        want = reference.expected[f"{stage}.layers.0.window_kv_cache"]
        assert not isinstance(got, str), got
        diff = max_diff(got[..., part], want[..., part])
        assert diff < TOL, f"{stage}: layer 0's ring ({dims} features) differs by {diff:.3g}"


def test_engram_hash_ids_match_the_reference(reference):
    """Where an Engram failure starts: the table rows every fed position (prompt, then the 16
    decode tokens) looks up, by swa-bench's hashing of whole sequences (the engine's per-step
    hashing from the cache's token history is held to it by the Engram tests), bit for bit."""
    from swa_bench.model import engram
    from swa_bench.model.ngram_hash import ngram_hash_ids, sequence_ngrams

    args = cm.swa_bench_args(reference.config).args
    ids = torch.cat([reference.prompt, reference.decode_tokens], dim=1)
    layout = engram.engram_layout(args, ids.device)
    ngrams = sequence_ngrams(engram.compress_ids(ids, args), layout.pad_id,
                                    layout.max_ngram)
    want = reference.expected["engram_hash_ids"]
    assert torch.equal(ngram_hash_ids(ngrams, layout).view(want.shape), want)


def test_dspark_aux_hidden_states_match_the_reference(reference, conformance):
    """main_hidden: the mean over streams of each target layer's input, concatenated, of every
    prefill row and of each decode row."""
    assert all(h is not None for h in conformance.main_hidden), \
        "the engine's step output exposes no DSpark main_hidden"
    prefill = conformance.main_hidden[0].view(reference.expected["prefill.main_hidden"].shape)
    assert max_diff(prefill, reference.expected["prefill.main_hidden"]) < TOL
    decode = torch.stack([h.view(h.shape[0], -1) for h in conformance.main_hidden[1:]], dim=1)
    assert max_diff(decode, reference.expected["decode.main_hidden"]) < TOL


# ---- seeded changes: each one mechanism undone must fail the comparison ------------------------


def current_pre_mix(monkeypatch):
    """Each sublayer collapses the streams with the pre-mix of its own input (not the previous
    sublayer's): the reference's delayed pre-mix undone."""
    from swa_bench.model import model as model_module

    def forward(self, streams, pre_mix, kv=None):
        attn_mix = self.hc_mixes("attn", streams)
        streams = self.hc.post(self.attn(self.attn_input(streams, attn_mix.pre), kv), streams,
                               attn_mix)
        ffn_mix = self.hc_mixes("ffn", streams)
        streams = self.hc.post(self.moe(self.ffn_norm(self.hc.pre(streams, ffn_mix.pre))),
                               streams, ffn_mix)
        return streams, ffn_mix.pre

    monkeypatch.setattr(model_module.Block, "forward", forward)


def bias_in_routing_weights(monkeypatch):
    """The aux-free gate bias also weighs the chosen experts (the reference: selection only)."""
    from swa_bench.model import moe

    def route(logits, bias, top_k, route_scale):
        scores = F.softplus(logits.float()).sqrt() + bias.float()
        top = scores.topk(top_k, dim=-1)
        weights = top.values / (top.values.sum(dim=-1, keepdim=True) + 1e-20)
        return top.indices, weights * route_scale

    monkeypatch.setattr(moe, "route", route)


def mean_pooled_compressor(monkeypatch):
    """The compressor pools a group by its plain mean (the reference: a per-channel softmax)."""
    from swa_bench.model import compressor

    monkeypatch.setattr(compressor, "pool_groups", lambda kv, score: kv.mean(dim=-2))


def no_engram(monkeypatch):
    """The Engram layers' lookup skipped (the streams enter their blocks unchanged)."""
    from swa_bench.model import model as model_module

    monkeypatch.setattr(model_module, "engram_input", lambda engram, streams, hashes: streams)


def no_inverse_rope(monkeypatch):
    """The attention output keeps the keys' rotations (the reference turns it back at the
    query's position before ``wo_a``)."""
    from swa_bench.model.latent_attention import Attention

    real = Attention.rope

    def rope(self, x, positions, rope_dim=None, *, inverse=False, inplace=False):
        return x if inverse else real(self, x, positions, rope_dim, inplace=inplace)

    monkeypatch.setattr(Attention, "rope", rope)


SEEDED_ARGS = {
    "theta 10000 on the compressed layers": {"compress_rope_theta": 10000.0},
    "no YaRN": {"original_seq_len": 0},
    "no route scale": {"route_scale": 1.0},
    "no SwiGLU clamp": {"swiglu_limit": 0.0},
    "no candidates": {"candidate_topk_blocks": None},
    "one Sinkhorn iteration": {"hc_sinkhorn_iters": 1},
}
SEEDED_CODE = {
    "current pre-mix": current_pre_mix,
    "gate bias in the routing weights": bias_in_routing_weights,
    "mean-pooled compressor": mean_pooled_compressor,
    "no Engram": no_engram,
    "no inverse RoPE": no_inverse_rope,
}


@pytest.mark.parametrize("change", [*SEEDED_ARGS, *SEEDED_CODE])
def test_a_seeded_change_fails_the_comparison(reference, conformance, monkeypatch, change):
    """Meaningful once the unchanged model conforms (asserted first): the changed model's
    prefill logits must then differ from the reference by more than the tolerance."""
    base = max_diff(conformance.logits[:, 0], reference.expected["logits"][:, 0])
    assert base < TOL, f"the unchanged model does not conform yet (prefill {base:.3g})"
    if change in SEEDED_CODE:
        SEEDED_CODE[change](monkeypatch)
    model, _ = build(reference, **SEEDED_ARGS.get(change, {}))
    changed = max_diff(run_engine(model, reference, steps=0).logits[:, 0],
                       reference.expected["logits"][:, 0])
    assert changed > TOL, f"{change}: the comparison still passes ({changed:.3g})"
