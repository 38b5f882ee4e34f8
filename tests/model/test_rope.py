"""RoPE against DeepSeek-V4.1 inference/model.py restated here: `precompute_freqs_cis` pair by
pair in float64 (YaRN's ramp included, at a setting where it is partial), `apply_rotary_emb` as a
complex product through ``torch.polar`` / ``view_as_complex``; each layer's table chosen as
`Attention.__init__` chooses it; the attention output turned back at the query's position before
the output projection, as `Attention.forward` does."""

from __future__ import annotations

import math

import pytest
import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model import latent_attention
from swa_bench.model.args import PRESETS, ModelArgs
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.rope import RopeSpec, apply_rope, rope_table

# rope_dim 64 at theta 10000 over a 4096-position training context: YaRN keeps pairs 0..10,
# divides pairs 23.. by the factor and ramps the twelve in between.
PARTIAL = RopeSpec(64, 10000.0, 512, original_seq_len=4096, factor=16.0, beta_fast=32,
                   beta_slow=1)


def reference_ramp(spec: RopeSpec) -> list[float]:
    """YaRN's weight of ``freq / factor`` per pair (0: the frequency kept, 1: divided)."""
    dim, base = spec.dim, spec.theta
    if spec.original_seq_len <= 0:
        return [0.0] * (dim // 2)

    def corrected(rotations):
        turns = spec.original_seq_len / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(corrected(spec.beta_fast)), 0)
    high = min(math.ceil(corrected(spec.beta_slow)), dim - 1)
    return [min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0) for i in range(dim // 2)]


def reference_freqs(spec: RopeSpec) -> torch.Tensor:
    """float64 ``[dim // 2]``: ``base ** (-2i / dim)``, blended with ``/ factor`` by the ramp."""
    out = []
    for i, ramp in enumerate(reference_ramp(spec)):
        freq = 1.0 / spec.theta ** (2 * i / spec.dim)
        out.append(freq / spec.factor * ramp + freq * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def reference_rotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec,
                     inverse: bool = False) -> torch.Tensor:
    """``x``'s last ``dim`` features as complex numbers of adjacent pairs, times
    ``e^{i p freq}`` (its conjugate for ``inverse``), in float64."""
    angles = torch.outer(torch.arange(spec.length, dtype=torch.float64), reference_freqs(spec))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    if inverse:
        freqs_cis = freqs_cis.conj()
    y = x.double().clone()
    z = torch.view_as_complex(y[..., -spec.dim:].contiguous().unflatten(-1, (-1, 2)))
    f = freqs_cis[positions].view(x.shape[0], *([1] * (x.dim() - 2)), spec.dim // 2)
    y[..., -spec.dim:] = torch.view_as_real(z * f).flatten(-2)
    return y


@pytest.mark.parametrize("spec", [RopeSpec(8, 10000.0, 64), PARTIAL,
                                  RopeSpec.for_layer(PRESETS["sparse-tiny"], 2),
                                  RopeSpec.for_layer(PRESETS["v41-flash"], 20)])
def test_frequencies_and_tables_follow_the_reference(spec):
    torch.testing.assert_close(spec.frequencies().double(), reference_freqs(spec), rtol=1e-6,
                               atol=0)
    cos, sin = rope_table(torch.device("cpu"), spec)
    assert cos.dtype == torch.float32 and cos.shape == (spec.length, spec.dim // 2)
    rows = torch.arange(0, spec.length, max(1, spec.length // 64))
    angles = torch.outer(rows.double(), reference_freqs(spec))
    # fp32 angles, as the reference's: within a few ulps of the position
    tol = 4 * spec.length * 2.0**-24
    torch.testing.assert_close(cos[rows].double(), angles.cos(), rtol=0, atol=tol)
    torch.testing.assert_close(sin[rows].double(), angles.sin(), rtol=0, atol=tol)


def test_the_partial_setting_exercises_every_part_of_the_ramp():
    ramp = reference_ramp(PARTIAL)
    assert ramp[0] == 0 and ramp[-1] == 1
    assert sum(0 < r < 1 for r in ramp) >= 8
    flash = reference_ramp(RopeSpec.for_layer(PRESETS["v41-flash"], 20))
    assert flash[0] == 0 and flash[-1] == 1 and any(0 < r < 1 for r in flash)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(9, 3, 80), (6, 64), (4, 2, 64)])
def test_rotation_is_the_complex_product_of_adjacent_pairs(shape, inverse):
    """Interleaved pairs, not rotate-half; the features before the rotated ones untouched;
    ``inplace`` writes into its input."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=gen)
    positions = torch.randint(0, PARTIAL.length, (shape[0],), generator=gen)
    got = apply_rope(x, positions, PARTIAL, inverse=inverse)
    torch.testing.assert_close(got.double(), reference_rotate(x, positions, PARTIAL, inverse),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(got[..., :-PARTIAL.dim], x[..., :-PARTIAL.dim])
    fresh = x.clone()
    assert apply_rope(fresh, positions, PARTIAL, inverse=inverse, inplace=True) is fresh
    assert torch.equal(fresh, got)


def test_the_inverse_undoes_the_rotation_and_keeps_relative_positions():
    """Turned back at its own position a row is itself again; turned at p and back at q it is
    the row turned at p - q (what the output heads carry: the keys' rotations relative to the
    query)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, 64, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, PARTIAL.length, (12,), generator=gen)
    back = apply_rope(apply_rope(x, positions, PARTIAL), positions, PARTIAL, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)
    later = positions.clamp_max(PARTIAL.length - 50) + 50
    relative = apply_rope(apply_rope(x, later, PARTIAL), positions, PARTIAL, inverse=True)
    torch.testing.assert_close(relative, apply_rope(x, later - positions, PARTIAL), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("preset", ["sparse-tiny", "v41-flash", "v41-mini"])
def test_each_layer_gets_its_reference_table(preset):
    """Window-only layers (ratio 0 in the reference) and draft layers past the backbone: rope_theta
    without YaRN; every layer with global or compressed KV: compress_rope_theta with YaRN."""
    args = PRESETS[preset]
    for layer in range(args.n_layers + 3):
        spec = RopeSpec.for_layer(args, layer)
        assert (spec.dim, spec.length) == (args.rope_dim, args.max_seq_len)
        if layer < args.kv_sources[0] or layer >= args.n_layers:
            assert (spec.theta, spec.original_seq_len) == (args.rope_theta, 0)
        else:
            assert (spec.theta, spec.original_seq_len, spec.factor, spec.beta_fast,
                    spec.beta_slow) == (args.compress_rope_theta, args.original_seq_len,
                                        args.rope_factor, args.beta_fast, args.beta_slow)
    window, compressed = (rope_table(torch.device("cpu"), RopeSpec.for_layer(args, layer))
                          for layer in (0, args.kv_sources[0]))
    assert not torch.allclose(window[1], compressed[1])


def test_v41_flash_presets_carry_the_released_values():
    for name in ("v41-flash", "v41-flash-shape"):
        a = PRESETS[name]
        assert (a.rope_dim, a.rope_theta, a.compress_rope_theta, a.original_seq_len,
                a.rope_factor, a.beta_fast, a.beta_slow) == (64, 10000, 160000, 65536, 16, 32, 1)
    assert PRESETS["sparse-tiny"].original_seq_len > 0


def test_layers_rotate_their_query_and_latent_with_their_own_table():
    """The query (``project_q``) and the K=V latent (``rope``) of a window-only and of a
    compressed layer, against the oracle at that layer's reference setting."""
    args = PRESETS["sparse-tiny"]
    model, _ = build_model(args, seed=0)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, args.max_seq_len, (7,), generator=gen)
    for layer in (0, 2, 6):
        attn = model.layers[layer].attn
        assert attn.rope_spec == RopeSpec.for_layer(args, layer)
        q_latent = torch.randn(7, args.q_lora_rank, generator=gen)
        with torch.no_grad():
            q = attn.project_q(q_latent, positions)
            plain = attn.wq_b(q_latent).view(7, args.n_heads, args.head_dim)
        want = reference_rotate(plain, positions, RopeSpec.for_layer(args, layer))
        torch.testing.assert_close(q.double(), want, rtol=1e-4, atol=1e-4)
        latent = torch.randn(7, args.head_dim, generator=gen)
        torch.testing.assert_close(attn.rope(latent, positions).double(),
                                   reference_rotate(latent, positions, attn.rope_spec),
                                   rtol=1e-4, atol=1e-4)


def test_the_attention_output_is_turned_back_before_the_output_projection(monkeypatch):
    """In an engine step (prefill and decode rows), what every layer projects out is attend's
    output turned back at each query row's position by the layer's table."""
    args = PRESETS["sparse-tiny"]
    model, _ = build_model(args, seed=0)
    seen: list = []
    real_attend = latent_attention.attend

    def attend(q, kv, meta, cache, layer, *rest, **kw):
        out = real_attend(q, kv, meta, cache, layer, *rest, **kw)
        seen.append(("attend", layer, out.clone(), meta.positions.clone()))
        return out

    def project_out(self, o):
        seen.append(("out", self.layer, o.clone(), None))
        return real_project_out(self, o)

    real_project_out = latent_attention.Attention.project_out
    monkeypatch.setattr(latent_attention, "attend", attend)
    monkeypatch.setattr(latent_attention.Attention, "project_out", project_out)
    requests = [RequestSpec(prompt_len=20), RequestSpec(prompt_len=9, decode=True)]
    inputs = StepInputs.seeded(requests, args.vocab_size, 0)
    engine = Engine(model, EngineConfig.for_model(args, policy="full"))
    inputs.fill_context(engine)
    seen.clear()
    engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
    pairs = list(zip(seen[::2], seen[1::2], strict=True))
    assert len(pairs) == args.n_layers
    for (kind, layer, o, positions), (kind_out, layer_out, projected, _) in pairs:
        assert (kind, kind_out, layer) == ("attend", "out", layer_out)
        spec = RopeSpec.for_layer(args, layer)
        rows = positions.shape[0]
        want = reference_rotate(o, positions, spec, inverse=True)
        torch.testing.assert_close(projected[:rows].double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("field", "value"), [("rope_theta", 1.0), ("compress_rope_theta", 0.0),
                                              ("original_seq_len", -1), ("rope_factor", 0.0),
                                              ("beta_slow", 0), ("beta_slow", 64)])
def test_rope_arguments_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        ModelArgs(**{field: value})
