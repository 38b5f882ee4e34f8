"""The results of one run as data: results.json's models (schema_version 4) and their tallies.

Every model forbids unknown keys, so a results file written by a newer schema fails loudly instead
of being half-read. Non-finite floats (a relative error against an exact zero is +inf) are written
as the strings "Infinity"/"NaN": the file stays strict JSON and still round-trips. Pure: no file
is read or written here (``results.files``), nor any frame built (``results.frame``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 4
# Version 3 is version 4 without each case's ``prompts`` (read as []: a step case).
# Version 2 is version 3 without the tool's version and the advice's ``decided`` (read as None
# and True); version 1 is version 2 without each case's ``kernels`` (read as None: not recorded).
READABLE_VERSIONS = (1, 2, 3, 4)
TIMED_PATHS = ("reference", "replay")  # CaseTiming's two timed paths, in report order

CaseStatus = Literal["ok", "failed", "error"]
Verdict = Literal["pass", "fail", "error"]
RunVerdict = Literal["pass", "fail", "error", "unverified"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


class Diagnostic(_Strict):
    """One compared tensor: how many elements differ and where the worst one is."""

    tensor: str
    mismatched: int
    total: int
    share: float
    max_abs: float
    max_rel: float
    worst_index: list[int]


class CheckResult(_Strict):
    id: str  # "E1".."E5", "approximation"
    name: str
    passed: bool
    mode: Literal["bitwise", "tolerance", "bound", "info"]
    rtol: float | None = None
    atol: float | None = None
    message: str = ""
    diagnostics: list[Diagnostic] = []

    def worst_diagnostic(self) -> Diagnostic | None:
        """The tensor with the largest mismatched share (then the largest max-abs error)."""
        if not self.diagnostics:
            return None
        return max(self.diagnostics, key=lambda d: (d.share, d.mismatched, d.max_abs))


class TimingStats(_Strict):
    samples_ms: list[float]
    median_ms: float
    p10_ms: float
    p90_ms: float
    iqr_over_median: float
    noisy: bool


class CaseTiming(_Strict):
    reference: TimingStats | None = None
    replay: TimingStats | None = None
    breakdown_ms: dict[str, float] = {}


class Approximation(_Strict):
    logits_max_abs: float
    kl: float
    top1_agreement: float
    window_kv_rel_error: list[float]  # per decoder layer, in depth order
    greedy_agreement: float
    continuation_steps: int


class PromptStep(_Strict):
    """One step of a chunked prompt: its chunk, the rows the timed replay step kept, the route
    it took, and each path's time (every sample: one per repetition of the whole prompt)."""

    index: int
    cached_len: int
    query_len: int
    tokens: int  # the step's rows: the chunk and the decode rows beside it
    kept_rows: int | None = None  # the timed replay step's plan; None: not timed
    replay_route: str | None = None
    reference: TimingStats | None = None
    replay: TimingStats | None = None


class PromptResult(_Strict):
    """A whole prompt prefilled in chunks (``workload.prompts``). ``ttft``: per repetition the
    sum of its chunk steps and the first decode (the samples add up sample by sample);
    ``tokens_per_s``: the prompt's length over the median TTFT; ``peak_memory_bytes``: each
    path's peak over one whole prompt (its chunks and first decode); ``approximation``: the
    replay after the last chunk against the full prefill run in the same chunks."""

    length: int
    chunk_size: int
    decodes_beside: int
    steps: list[PromptStep]
    first_decode: CaseTiming | None = None
    ttft: CaseTiming | None = None
    tokens_per_s: dict[str, float] = {}
    peak_memory_bytes: dict[str, int] = {}
    speedup: float | None = None  # TTFT reference / replay, medians
    approximation: Approximation | None = None


class RankResult(_Strict):
    """One rank's share of a parallel case: its batch and the route its timed replay step took."""

    rank: int
    dp_rank: int
    tp_rank: int
    num_requests: int
    tokens: int
    replay_route: str | None = None
    replay_ms: float | None = None
    mfu_replay: float | None = None


class ParallelResult(_Strict):
    dp: int
    tp: int
    ep: int
    ranks: list[RankResult] = []


class TaskCell(_Strict):
    """One task at one prompt length (and fact distance) under one policy."""

    task: str  # "recall" (needs global KV) or "copy" (needs window KV)
    prompt_len: int
    distance: int  # positions from the needed fact to the prompt's last token
    prompts: int
    accuracy: float  # the prefill's last-token argmax is the answer
    answer_loss: float  # mean cross-entropy of the answer, nats
    agreement: float  # share of prompts whose argmax equals the full prefill's


class HeldOutLoss(_Strict):
    """Teacher-forced loss on held-out text: the prefill's last token and ``continuation``
    decode steps after it (they read the window rings the prefill left)."""

    prompt_len: int
    prompts: int
    continuation: int
    loss: float  # nats per byte
    prefill_loss: float  # the prefill's last-token prediction alone


class TaskResults(_Strict):
    policy: str
    model: str  # the weights: a checkpoint's name, or "seeded" for dummy weights
    # Every task prompt prefilled in chunks of this many tokens (checks.tasks.chunk_size; each
    # cell's agreement is against the full prefill in the same chunks); None: each prompt in one
    # prefill step, as every results file written before the setting was.
    chunk_size: int | None = None
    cells: list[TaskCell] = []
    held_out: list[HeldOutLoss] = []


class KernelRecord(_Strict):
    """Which kernels a case ran (``swa_bench.kernels.Kernels.record``): two runs' cases
    measure the same thing only when these agree (``compare`` refuses them otherwise)."""

    backend: str  # torch or triton, resolved for the device
    tile: str  # the attention kernel's "block_n,block_dv,num_warps,num_stages", "auto"; "-": torch
    launch: str  # direct or triton; "-" on the PyTorch path
    interpret: bool  # Triton's interpreter ran the kernels (CPU tensors)
    # How the fp8/fp4 GEMMs ran under precision fp8 (``model.precision.QUANTISED_GEMM``, or
    # ``FP8_GEMM`` with the kernel choice quantised_gemm fp8); "-": none (bf16), or an older
    # results file.
    quantised_gemm: str = "-"


class MfuBasis(_Strict):
    """What a case's MFU was measured against (issue 28), so a reader can recompute it: for each
    path, ``mfu = (fp8_flops / fp8_tflops + dtype_flops / dtype_tflops) / 1e12 / (median_ms /
    1e3)``, the time its FLOPs would take at the measured peaks over its median; without fp8
    FLOPs, achieved TFLOP/s over the dtype's rate. Absent (None) in results written before."""

    dtype: str  # the model dtype, whose measured GEMM rate ``dtype_flops`` are against
    dtype_tflops: float
    # The measured fp8 GEMM rate (environment.gemm_tflops["fp8"]); None: no path ran fp8 GEMMs,
    # or the device has none (a CPU), where every FLOP is counted at the dtype's rate.
    fp8_tflops: float | None = None
    fp8_flops: dict[str, int] = {}  # per path: counted at the fp8 rate (0 without one)
    dtype_flops: dict[str, int] = {}  # per path: at the dtype rate; fp8 + dtype = ``flops``
    # Per path: the analytic FLOPs of the fp8 Linears that ran on fp8 GEMMs (precision fp8,
    # quantised_gemm fp8; flop_model.precision_split), whatever rate they were counted at.
    fp8_gemm_flops: dict[str, int] = {}
    note: str = ""  # how the split was read, in a line


class CaseResult(_Strict):
    case_id: str
    index: int
    label: str
    params: dict[str, Any]
    status: CaseStatus  # failed: a check failed; error: the case raised
    error: str | None = None
    graph_mode: str
    policy: str
    # The numerics it ran in (model/precision.py); expert_precision only under fp8.
    precision: str = "bf16"
    expert_precision: str | None = None
    # Whether its E1/E2 ran in the batch-invariant mode (full-batch halves bitwise).
    batch_invariant: bool = False
    trim_threshold: int
    tokens: int
    num_requests: int
    batch: str
    batch_shape: str = ""  # request kinds, lengths aside: cases of one shape share a break-even
    replay_route: str | None = None  # why the timed replay step ran as it did (its step plan)
    # The kernels it ran; None where unknown (they did not resolve, or an older results file).
    kernels: KernelRecord | None = None
    checks: list[CheckResult] = []
    timing: CaseTiming | None = None
    flops: dict[str, int] = {}
    achieved_tflops: dict[str, float] = {}  # each path's FLOPs over its median time
    mfu: dict[str, float] = {}  # the share of each path's time its FLOPs take at the peaks
    mfu_basis: MfuBasis | None = None  # the peaks and FLOP split it was measured against
    ideal_speedup: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    # The roofline ideal beside the FLOP ideal (issue 28): each path's analytic bytes
    # (bench/byte_model), its roofline time (per layer the longer of its FLOPs at the measured
    # GEMM rate and its bytes at the measured copy bandwidth, summed), their ratio and the
    # speedup over it. None / empty in results written before.
    reference_bytes: int | None = None
    replay_bytes: int | None = None
    roofline_ms: dict[str, float] = {}
    roofline_ideal_speedup: float | None = None
    roofline_efficiency: float | None = None
    peak_memory_bytes: dict[str, int] = {}
    deterministic: dict[str, int] = {}
    capture_seconds: float | None = None  # capturing the replay path's graphs, all sizes
    graph_pool_bytes: int | None = None  # device memory those graphs hold (CUDA only)
    # The replay path's replay graphs (PIECEWISE, issue 34): the sizes captured by the end of the
    # timing, their capture time and the device memory they added to the pool (CUDA only).
    replay_capture_sizes: list[int] = []  # the configured sizes (empty: replay graphs off)
    replay_graph_sizes: list[int] = []
    replay_capture_seconds: float | None = None
    replay_graph_pool_bytes: int | None = None
    approximation: Approximation | None = None
    parallel: ParallelResult | None = None  # layout and every rank's share (torchrun runs)
    tasks: TaskResults | None = None
    prompts: list[PromptResult] = []  # a prompt case's prompts (its timing is theirs, per step)
    # The engine gates the case ran under (issue 30, README "Engine gates"): its configuration's
    # and how each prefix hit of its workload was served (vLLM: recomputed, or not adopted).
    kv_block_reuse: bool = False
    lora: bool = False
    prompt_embeds: bool = False
    prefix_hits: list[str] = []

    def outcome(self) -> Verdict:
        """pass/fail/error of this case; a failed check fails the case whatever `status` says."""
        if self.status == "error":
            return "error"
        if self.status == "failed" or self.failed_checks():
            return "fail"
        return "pass"

    def failed_checks(self) -> list[CheckResult]:
        """Judged checks that failed (an info result is never a failure, nor a pass)."""
        return [c for c in self.checks if not c.passed and c.mode != "info"]


class ThresholdAdvice(_Strict):
    graph_mode: str
    batch: str
    recommended_trim_threshold: int | None  # None and decided: never trim
    note: str = ""
    decided: bool = True  # False: not enough evidence for any threshold (the note says why)


class RunResults(_Strict):
    schema_version: Literal[1, 2, 3, 4] = SCHEMA_VERSION
    swa_bench_version: str | None = None  # the tool that wrote the file; None: not recorded
    scenario_name: str
    scenario_file: str | None
    scenario_hash: str
    scenario: dict[str, Any]
    environment: dict[str, Any]
    started_at: str
    finished_at: str | None = None
    cases: list[CaseResult] = []
    threshold_advice: list[ThresholdAdvice] = []

    def verdict(self) -> RunVerdict:
        return overall_verdict(self.cases)

    def counts(self) -> dict[str, int]:
        return tally(self.cases)


def tally(cases: Sequence[CaseResult]) -> dict[str, int]:
    """Case outcomes and check tallies, for verdict lines; info results are neither passes nor
    failures (``checks_passed + checks_failed + checks_info == checks``)."""
    outcomes = [case.outcome() for case in cases]
    checks = [check for case in cases for check in case.checks]
    return {
        "cases": len(cases),
        "passed": outcomes.count("pass"),
        "failed": outcomes.count("fail"),
        "errors": outcomes.count("error"),
        "checks": len(checks),
        "checks_passed": sum(c.passed and c.mode != "info" for c in checks),
        "checks_failed": sum(not c.passed and c.mode != "info" for c in checks),
        "checks_info": sum(c.mode == "info" for c in checks),
    }


def overall_verdict(cases: Sequence[CaseResult]) -> RunVerdict:
    """error if any case raised (or nothing was run: an empty run verifies nothing), else fail
    if any check failed, else unverified when no pass/fail check ran (info results measure, they
    do not verify: "0 of 0 passed" is not a pass), else pass."""
    outcomes = {case.outcome() for case in cases}
    if not cases or "error" in outcomes:
        return "error"
    if "fail" in outcomes:
        return "fail"
    counts = tally(cases)
    return "pass" if counts["checks"] > counts["checks_info"] else "unverified"


def results_json_schema() -> dict[str, Any]:
    return RunResults.model_json_schema()


def timed_paths(results: RunResults) -> Iterator[tuple[int, CaseResult, str, TimingStats]]:
    """(case position, case, path, its timing) for every timed path of every case."""
    for index, case in enumerate(results.cases):
        for path in TIMED_PATHS:
            stats = getattr(case.timing, path, None)
            if stats is not None:
                yield index, case, path, stats
