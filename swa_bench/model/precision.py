"""The numerics a model runs in: ``ModelArgs.precision`` ("bf16" | "fp8") and, under fp8,
``ModelArgs.expert_precision`` ("w4a8" | "w4a16"), decided once in the arguments and read by the
layers through the functions here.

Under "fp8" the model computes what DeepSeek-V4.1's reference inference code computes with the
release's ``dtype "fp8"`` and ``expert_dtype "fp4"`` (inference/model.py at dba1be0a):

* the reference's fp8 ``Linear``\\ s (``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, the indexer's ``wq_b``,
  the shared expert, Engram's ``wkv``, DSpark's projections and ``main_proj``) hold e4m3 weights
  with one UE8M0 scale per 32 x 32 block, and ``linear()`` quantises their input per 32
  (``act_quant``) before ``fp8_gemm``; here the weights are quantised once at build
  (``quantise_weights``: the stored values, exact in bf16) and the input by ``linear_input``, so
  a bf16 GEMM with fp32 sums computes the fp8 GEMM's products exactly and differs from it only in
  the order of the fp32 sums (the kernel choice ``quantised_gemm: fp8`` runs them on fp8 tensor
  cores instead: ``fp8_linear``, ``kernels.fp8_gemm``);
* routed experts hold e2m1 weights with a UE8M0 scale per 32 along K; ``fp4_gemm`` reads fp8
  inputs per 32 ("w4a8"; ``expert_input``), or, as Hopper engines run them (vLLM's Marlin W4A16),
  bf16 inputs against the same weights ("w4a16");
* the window KV (and DSpark's main KV) is stored fp8 per 32 over the post-RoPE vector
  (``window_kv``), the compressed KV fp4 in groups of 16 with e4m3 scales (``compressed_kv``), the
  indexer's queries and keys fp4 per 32 with UE8M0 scales (``index_vectors``), each applied where
  the reference applies it, before any reader sees the values;
* Engram's tables fp8 with a UE8M0 scale per 32 of a row (a row narrower than 32, or not a
  multiple of it, as in the CPU miniatures, is one group);
* what the reference keeps wider stays so: the compressors' projections (fp32 above ratio 1,
  bf16 at ratio 1), ``wo_a``, the indexer's ``weights_proj`` and ``wk``, the gate (fp32), the
  head (fp32), mHC's ``hc_*_fn`` (fp32), the token embedding.

Every function is the identity under "bf16". Quantisation is row-local (a row's groups only), so
a row's values do not depend on the batch around it and E1 stays bitwise. On the Triton backend
the activations' and KV's quantisation is one fused launch (``kernels.group_quant``: the same bits
as ``kernels.quant``'s PyTorch functions, which the CPU path and training run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swa_bench.kernels import fp8_gemm, group_quant, quant
from swa_bench.model.derived import capturing, derived_from_weights
from swa_bench.model.forward_context import active_kernels

if TYPE_CHECKING:
    from swa_bench.kernels import Kernels
    from swa_bench.model.args import ModelArgs

# The reference's fp8 Linears, by parameter name (the last two parts): their weights are e4m3
# per 32x32 block, their inputs per 32.
# What computes the fp8/fp4 GEMMs (recorded with the kernels of each case): by default the model
# dtype's GEMMs of the stored values, the release's numerics at the cost of bf16; with the kernel
# choice ``quantised_gemm: fp8`` the fp8 Linears on fp8 tensor cores (``kernels.fp8_gemm``), the
# same products in another order of fp32 sums. The routed experts stay bf16 GEMMs of the stored
# values either way.
QUANTISED_GEMM = "bf16 GEMMs of the stored fp8/fp4 values"
FP8_GEMM = "fp8 GEMMs (fp8_gemm) of the fp8 Linears; bf16 GEMMs of the stored fp4 experts"

FP8_LINEARS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
               "attn.wq_index.weight", "moe.shared_w13.weight", "moe.shared_w2.weight",
               "engram.wkv.weight", "main_proj.weight")
FP4_EXPERTS = (".w13", ".w2")  # routed experts: e2m1 per 32 along K
ENGRAM_TABLES = ("engram.embed.weight",)
ENGRAM_GROUP = 32


def is_fp8(args: ModelArgs) -> bool:
    return args.precision == "fp8"


def quantised_gemm(args: ModelArgs, kernels: Kernels) -> str:
    """How this model's fp8/fp4 GEMMs run under ``kernels`` ("-": it has none)."""
    if not is_fp8(args):
        return "-"
    return FP8_GEMM if kernels.quantised_gemm == "fp8" else QUANTISED_GEMM


def runs_fp8_gemm(args: ModelArgs, x_in: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether an fp8 Linear on ``x_in`` with ``weights`` runs ``kernels.fp8_gemm``: precision
    fp8 and the engine's choice (``Kernels.fp8_linears``). The one place this is decided."""
    return is_fp8(args) and active_kernels().fp8_linears(x_in, *weights)


def fp8_matmul(args: ModelArgs, x_in: torch.Tensor, weight: Callable[[], torch.Tensor],
               owner: nn.Module, name: str, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``x_in @ weight()^T`` of one of the reference's fp8 Linears (``x_in``: ``linear_input``'s
    result; ``weight()`` the stored values, a function of the parameters ``sources`` alone, asked
    for only by the path that multiplies it). Where the engine chose the fp8 GEMM
    (``Kernels.fp8_linears``): ``kernels.fp8_gemm`` on the weight's e4m3 operand, encoded once
    and kept on ``owner`` as ``name`` until a source changes, and ``x_in``'s (``act_quant`` is
    idempotent: the same codes and scales as the unquantised input's). Else the model dtype's
    GEMM of the same values. Both multiply the same values exactly; only the order of the fp32
    sums differs, and neither depends on the batch. The encoding checks every value on the host,
    so it must happen in an eager step before a CUDA graph is captured (the warm-up does it); a
    capture that finds no operand is refused, not silently broken."""
    if not runs_fp8_gemm(args, x_in, *sources):
        return F.linear(x_in, weight())
    kernels = active_kernels()

    def encode() -> fp8_gemm.Fp8Operand:
        if capturing(x_in.device):
            raise RuntimeError(f"{type(owner).__name__}.{name}: the fp8 weight operand is encoded "
                               "in an eager step (with host checks), not inside a CUDA graph "
                               "capture: run one eager step first")
        return fp8_gemm.weight_operand(weight())

    operand = derived_from_weights(owner, name, sources, encode)
    return fp8_gemm.fp8_gemm(kernels, fp8_gemm.activation_operand(kernels, x_in), operand,
                             out_dtype=x_in.dtype)


def fp8_linear(args: ModelArgs, linear: nn.Linear, x_in: torch.Tensor) -> torch.Tensor:
    """``linear(x_in)`` for one of the reference's fp8 Linears (``fp8_matmul``); the module is
    called (its hooks see ``x_in``) unless the fp8 GEMM runs."""
    if runs_fp8_gemm(args, x_in, linear.weight):
        return fp8_matmul(args, x_in, lambda: linear.weight, linear, "_fp8_weight",
                          (linear.weight,))
    return linear(x_in)


def linear_input(args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """The input of one of the reference's fp8 Linears as ``fp8_gemm`` reads it."""
    return group_quant.quantise(active_kernels(), x, "e4m3") if is_fp8(args) else x


def expert_input(args: ModelArgs, x: torch.Tensor,
                 quantised: torch.Tensor | None = None) -> torch.Tensor:
    """A routed expert GEMM's input: fp8 per 32 under "w4a8" (``fp4_gemm``), as is under
    "w4a16". ``quantised``: ``linear_input(args, x)`` when the caller has it (reused)."""
    if not (is_fp8(args) and args.expert_precision == "w4a8"):
        return x
    return group_quant.quantise(active_kernels(), x, "e4m3") if quantised is None else quantised


def window_kv(args: ModelArgs, kv: torch.Tensor) -> torch.Tensor:
    """The window K=V latent as stored and read (post-RoPE): fp8 per 32."""
    return group_quant.quantise(active_kernels(), kv, "e4m3") if is_fp8(args) else kv


def compressed_kv(args: ModelArgs, kv: torch.Tensor) -> torch.Tensor:
    """A compressed KV group as stored and read (post-RoPE): fp4 per 16, e4m3 scales."""
    return group_quant.quantise(active_kernels(), kv, "e2m1-e4m3-scale") if is_fp8(args) else kv


def index_vectors(args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """The indexer's queries or keys (post-RoPE): fp4 per 32, UE8M0 scales."""
    return group_quant.quantise(active_kernels(), x, "e2m1") if is_fp8(args) else x


def weight_format(name: str) -> str | None:
    """How the release stores parameter ``name``: "fp8", "fp4", "fp8-table", or None (as is)."""
    if name.endswith(FP8_LINEARS):
        return "fp8"
    if name.endswith(ENGRAM_TABLES):
        return "fp8-table"
    if name.endswith(FP4_EXPERTS):
        return "fp4"
    return None


def _table_quant(w: torch.Tensor) -> torch.Tensor:
    width = w.shape[-1]
    return quant.act_quant(w, ENGRAM_GROUP if width % ENGRAM_GROUP == 0 else width)


@torch.no_grad()
def quantise_weights(model: nn.Module) -> None:
    """Every weight of ``model`` (a ``Transformer``: its ``args`` say the precision) that the
    release stores quantised, replaced in place by its stored values (a no-op under "bf16", and
    on weights already on their grid). Expert weights go an expert at a time:
    V4.1-Flash's hold 27 GB a layer in bf16, and the fp32 working copy is per expert."""
    if not is_fp8(model.args):
        return
    for name, p in model.named_parameters():
        fmt = weight_format(name)
        if fmt == "fp8":
            p.copy_(quant.fp8_weight_quant(p))
        elif fmt == "fp8-table":
            for r in range(0, p.shape[0], 1 << 16):
                p[r : r + (1 << 16)] = _table_quant(p[r : r + (1 << 16)])
        elif fmt == "fp4":
            for e in range(p.shape[0]):
                p[e] = quant.fp4_weight_quant(p[e])
