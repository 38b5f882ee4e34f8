"""The batch-invariant mode on the H200 (issue 29): which ops of a v41-flash step are row-invariant
with and without the mode, what the mode costs both paths, and E1/E2 bitwise against the full
batch in it (scripts/checks_gpu.py's checks with INVARIANT=1).

    python3 scripts/invariant_gpu.py [probe] [cost] [cost-64k] [checks-16k] [checks-64k] [e4]

probe: every GEMM, reduction and norm one 16K reference step calls (one per distinct op and
shape) re-run on its last M rows (M = 1, 8, 128, 896, 4099) against the same rows of the
whole call, without and with the mode; plus the routed experts' ``_grouped_mm`` with 2 rows an
expert against 43. cost (cost-64k): both paths' eager step time at 16K (64K), the fast
kernels and the mode.
checks-16k / checks-64k: E1 (bounded, 16 decode steps) and E2 (halo) in the mode, and the
kept-start fault (must fail). e4: E4 in the mode (bitwise; its prompt capped at 3W + 1).
PRECISION=fp8: the release's numerics; GRAPH_MODE=piecewise: the
checks on PIECEWISE engines (scripts/checks_gpu.py's configuration).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

# A CPU dry run: INVARIANT_DRY=1 (sparse-tiny, 40 tokens, Triton's interpreter: switched on
# before anything imports triton).
DRY = os.environ.get("INVARIANT_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from swa_bench.engine.config import EngineConfig  # noqa: E402
from swa_bench.engine.engine import Engine  # noqa: E402
from swa_bench.engine.step_inputs import StepInputs  # noqa: E402
from swa_bench.kernels.batch_invariant import TritonBatchInvariantOps  # noqa: E402
from swa_bench.model.args import build_args  # noqa: E402
from swa_bench.model.model import build_model  # noqa: E402
from swa_bench.model.requests import RequestSpec  # noqa: E402

aten = torch.ops.aten
PROBED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.bmm.out,
          aten.sum.dim_IntList, aten.mean.dim, aten.linear.default, aten._softmax.default,
          aten.amax.default, aten.topk.default}
ROWS = (1, 8, 128, 896, 4099)
TABLE = []
DEVICE = torch.device("cpu" if DRY else "cuda")


def the_mode() -> TritonBatchInvariantOps:
    return TritonBatchInvariantOps(DEVICE.type, interpret=DRY)


def empty_cache() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class Recorder(TorchDispatchMode):
    """The first call of each (op, shapes) of a step, its inputs cloned."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PROBED or "rms_norm" in str(func):
            op = aten.bmm.default if func is aten.bmm.out else func
            key = (str(op), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            if key not in self.calls:
                clone = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                self.calls[key] = (op, clone, {k: v for k, v in kwargs.items() if k != "out"})
        return func(*args, **kwargs)


def row_dim(func, args) -> int | None:
    """Which dim of the first tensor argument holds the rows (None: not probed by rows)."""
    name = str(func)
    if "bmm" in name:
        return 1
    if "addmm" in name:
        return None  # rows in args[1], the bias broadcast
    if name.startswith(("aten.sum", "aten.mean", "aten.amax", "aten._softmax")):
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if any(d % args[0].dim() == 0 for d in dims) or args[0].dim() < 2:
            return None  # the reduction runs across rows
    return 0


def sliced(func, args, m):
    dim = row_dim(func, args)
    first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    out = list(args)
    out[first] = args[first].narrow(dim, args[first].shape[dim] - m, m)
    return out


def probe(model, tokens):
    rec = Recorder()
    engine = Engine(model, EngineConfig.for_model(model.args, policy="full"))
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    inputs.fill_context(engine)
    with torch.inference_mode(), rec:
        engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
    del engine
    empty_cache()
    print(f"probe: {len(rec.calls)} distinct calls", flush=True)
    for (name, shapes), (func, args, kwargs) in rec.calls.items():
        if row_dim(func, args) is None:
            continue
        cells = []
        for mode in (None, the_mode()):
            bad = []
            with torch.inference_mode():
                ctx = mode if mode is not None else torch.no_grad()
                with ctx:
                    whole = func(*args, **kwargs)
                    whole = whole[0] if isinstance(whole, tuple) else whole
                    dim = row_dim(func, args)
                    for m in ROWS:
                        if m >= args[0].shape[dim]:
                            continue
                        part = func(*sliced(func, args, m), **kwargs)
                        part = part[0] if isinstance(part, tuple) else part
                        tail = whole.narrow(dim, whole.shape[dim] - m, m)
                        if not torch.equal(part, tail):
                            bad.append(m)
            cells.append("yes" if not bad else "rows " + ",".join(map(str, bad)) + " differ")
        line = f"| {name} | {shapes} | {cells[0]} | {cells[1]} |"
        TABLE.append(line)
        print(line, flush=True)
    grouped(model)


def grouped(model):
    """Routed experts' GEMM as the model calls it (weights [G, N, K] transposed): expert g's
    rows when every expert has 2 rows against 43 (64 of the 384 experts)."""
    a, experts = model.args, 64
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(experts, 2 * a.moe_inter_dim, a.dim, device=DEVICE, generator=gen,
                    dtype=torch.bfloat16).mul_(0.02).transpose(-2, -1)
    big = torch.randn(experts, 43, a.dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    small = big[:, :2].contiguous()
    ends = torch.arange(1, experts + 1, device=DEVICE, dtype=torch.int32)
    with torch.inference_mode():
        yb = torch._grouped_mm(big.view(-1, a.dim), w, offs=ends * 43).view(experts, 43, -1)
        ys = torch._grouped_mm(small.view(-1, a.dim), w, offs=ends * 2).view(experts, 2, -1)
    verdict = "yes" if torch.equal(yb[:, :2], ys) else "differ"
    line = (f"| _grouped_mm | {experts} experts x 2 rows vs x 43, K={a.dim} "
            f"N={2 * a.moe_inter_dim} | {verdict} | (not replaced) |")
    TABLE.append(line)
    print(line, flush=True)


def step_ms(engine, inputs, iters=3):
    inputs.fill_context(engine)
    run = lambda: engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)  # noqa: E731
    with torch.inference_mode():
        run()
        sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cost(model, tokens):
    inputs = StepInputs.seeded([RequestSpec(prompt_len=tokens)], model.args.vocab_size, 0)
    config = EngineConfig.for_model(model.args, policy="bounded")
    for name, cfg in (("reference", config.reference(model.args)), ("replay", config)):
        fast = step_ms(Engine(model, cfg), inputs)
        with the_mode():
            slow = step_ms(Engine(model, cfg), inputs)
        empty_cache()
        line = (f"| cost {tokens} | {name} | {fast:.1f} ms | {slow:.1f} ms | "
                f"+{100 * (slow / fast - 1):.0f}% |")
        TABLE.append(line)
        print(line, flush=True)


def main() -> int:
    plan = sys.argv[1:] or ["probe", "cost", "checks-16k"]
    precision = os.environ.get("PRECISION", "bf16")  # fp8: the release's numerics
    model, _ = build_model(build_args("sparse-tiny" if DRY else "v41-flash",
                                      {"precision": precision}), seed=0,
                           device=DEVICE, dtype=torch.bfloat16)
    small = 40 if DRY else 16384
    good = True
    for item in plan:
        t0 = time.time()
        if item == "probe":
            probe(model, small)
        elif item in ("cost", "cost-64k"):
            cost(model, small if item == "cost" else 4 * small)
        elif item.startswith("checks-"):
            import checks_gpu

            os.environ["INVARIANT"] = "1"
            size = item.removeprefix("checks-")
            tokens = {"16k": small, "64k": 4 * small}[size]
            mode = os.environ.get("GRAPH_MODE", "eager")
            label = f"flash-{precision}-{size} ({tokens} tokens, {mode}, invariant)"
            good &= checks_gpu.run(label, "E1", model, tokens, decode_steps=16)
            good &= checks_gpu.run(label, "E2", model, tokens)
            with checks_gpu.kept_start_off_by_one():
                good &= checks_gpu.run(label + " kept start +1", "E1", model, tokens,
                                       expect_pass=False, decode_steps=2)
            TABLE.extend(checks_gpu.ROWS)
            checks_gpu.ROWS.clear()
        elif item == "e4":  # the stretch: prefill == token-by-token decode, bitwise
            from swa_bench.checks.equivalence import check_e4
            from swa_bench.checks.tolerance import Tolerance
            from swa_bench.kernels.config import KernelSettings

            inputs = StepInputs.seeded([RequestSpec(prompt_len=small)], model.args.vocab_size, 0)
            r = check_e4(model, inputs, tol=Tolerance.for_dtype(torch.bfloat16),
                         kernels=KernelSettings(), invariant=True)
            line = (f"| E4 ({precision}, invariant) | {'PASS' if r.passed else 'FAIL'} | "
                    f"{time.time() - t0:.0f}s | {r.message[:300]} |")
            TABLE.append(line)
            print(line, flush=True)
            for d in r.diagnostics[:6]:
                print(f"    {d.tensor}: {d.mismatched}/{d.total} max abs {d.max_abs:.3g}")
        print(f"[{item}: {time.time() - t0:.0f} s]", flush=True)
    print("\n| op | shapes | row-invariant (fast) | in the mode |\n| --- | --- | --- | --- |")
    print("\n".join(TABLE))
    print("ALL AS EXPECTED" if good else "SOMETHING UNEXPECTED")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
