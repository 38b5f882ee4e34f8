"""The results of one run (results.json, schema_version 1), its atomic IO and the per-case CSV.

Every model forbids unknown keys, so a results file written by a newer schema fails loudly instead
of being half-read. Non-finite floats (a relative error against an exact zero is +inf) are written
as the strings "Infinity"/"NaN": the file stays strict JSON and still round-trips.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, ValidationError

SCHEMA_VERSION = 1
RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
TIMED_PATHS = ("reference", "replay")  # CaseTiming's two timed paths, in report order
# What a run folder holds: `run --overwrite` deletes these, compare and export never replace them.
RUN_OUTPUT_FILES = (RESULTS_JSON, RESULTS_CSV, "report.md", "report.html", "junit.xml",
                    "compare.md")

CaseStatus = Literal["ok", "failed", "error"]
Verdict = Literal["pass", "fail", "error"]
RunVerdict = Literal["pass", "fail", "error", "unverified"]


class ResultsError(ValueError):
    """A results file that is missing or invalid; `str()` is one line: `FILE: field: message`."""

    def __init__(self, file: str | Path, field: str | None, message: str) -> None:
        self.file = str(file)
        self.field = field
        self.message = " ".join(message.split())
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.field:
            return f"{self.file}: {self.field}: {self.message}"
        return f"{self.file}: {self.message}"


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
    cells: list[TaskCell] = []
    held_out: list[HeldOutLoss] = []


class KernelRecord(_Strict):
    """Which kernels a case ran (``swa_bench.kernels.Kernels.record``): two runs' cases
    measure the same thing only when these agree (``compare`` refuses them otherwise)."""

    backend: str  # torch or triton, resolved for the device
    tile: str  # the attention kernel's "block_n,block_dv,num_warps,num_stages", "auto"; "-": torch
    launch: str  # direct or triton; "-" on the PyTorch path
    interpret: bool  # Triton's interpreter ran the kernels (CPU tensors)


class CaseResult(_Strict):
    case_id: str
    index: int
    label: str
    params: dict[str, Any]
    status: CaseStatus  # failed: a check failed; error: the case raised
    error: str | None = None
    graph_mode: str
    policy: str
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
    mfu: dict[str, float] = {}  # achieved / the device's GEMM rate measured in this run
    ideal_speedup: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    peak_memory_bytes: dict[str, int] = {}
    deterministic: dict[str, int] = {}
    capture_seconds: float | None = None  # capturing the replay path's graphs, all sizes
    graph_pool_bytes: int | None = None  # device memory those graphs hold (CUDA only)
    approximation: Approximation | None = None
    parallel: ParallelResult | None = None  # layout and every rank's share (torchrun runs)
    tasks: TaskResults | None = None

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
    recommended_trim_threshold: int | None
    note: str = ""


class RunResults(_Strict):
    schema_version: Literal[1] = 1
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


# --- atomic IO ---------------------------------------------------------------------------------


def is_stream(path: str | Path) -> bool:
    """Whether `path` is an existing character device or FIFO (/dev/null, /dev/stdout, a named
    pipe): such a target is written in place, as renaming a file over it would replace the node."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _refuse_device(path: Path) -> None:
    """A block device or socket is neither a file to replace nor a stream to write into: writing
    a disk's device node would overwrite the disk."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise OSError(errno.EINVAL, "is a block device or socket, not a file", str(path))


@contextmanager
def atomic_writer(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path`, and move it over `path` only once fully written and synced.

    Readers see the old file or the new one, never a torn one, and a failure leaves `path` as it was
    and no temp file behind (os.replace is atomic within one directory). A symlink keeps pointing
    at the file it names, and a stream (`is_stream`) is written directly: nothing to tear there."""
    kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    if is_stream(path):
        with open(path, mode, **kwargs) as handle:
            yield handle
        return
    path = Path(os.path.realpath(path))
    _refuse_device(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> Path:
    with atomic_writer(path) as handle:
        handle.write(text)
    return Path(path)


def results_frame(results: RunResults) -> pd.DataFrame:
    """One row per case with the columns people sort and plot by; swept params as `param.<path>`."""
    rows = []
    for case in results.cases:
        timing = case.timing or CaseTiming()
        approx = case.approximation
        row: dict[str, Any] = {
            "case_id": case.case_id,
            "index": case.index,
            "label": case.label,
            "status": case.status,
            "graph_mode": case.graph_mode,
            "policy": case.policy,
            "trim_threshold": case.trim_threshold,
            "tokens": case.tokens,
            "num_requests": case.num_requests,
            "batch": case.batch,
            "checks_passed": sum(c.passed and c.mode != "info" for c in case.checks),
            "checks_failed": sum(not c.passed and c.mode != "info" for c in case.checks),
            "checks_info": sum(c.mode == "info" for c in case.checks),
            "failed_checks": " ".join(c.id for c in case.failed_checks()),
        }
        for path_name, stats in (("reference", timing.reference), ("replay", timing.replay)):
            row[f"{path_name}_median_ms"] = stats.median_ms if stats else None
            row[f"{path_name}_p10_ms"] = stats.p10_ms if stats else None
            row[f"{path_name}_p90_ms"] = stats.p90_ms if stats else None
            row[f"{path_name}_noisy"] = stats.noisy if stats else None
        row.update(
            speedup=case.speedup,
            ideal_speedup=case.ideal_speedup,
            efficiency=case.efficiency,
            flops_reference=case.flops.get("reference"),
            flops_replay=case.flops.get("replay"),
            peak_memory_reference=case.peak_memory_bytes.get("reference"),
            peak_memory_replay=case.peak_memory_bytes.get("replay"),
            logits_max_abs=approx.logits_max_abs if approx else None,
            kl=approx.kl if approx else None,
            top1_agreement=approx.top1_agreement if approx else None,
            greedy_agreement=approx.greedy_agreement if approx else None,
            error=case.error,
        )
        for name, value in sorted(case.params.items()):
            scalar = isinstance(value, (str, int, float, bool))
            row[f"param.{name}"] = value if scalar else json.dumps(value, sort_keys=True)
        rows.append(row)
    return pd.DataFrame(rows)


def save_results(run_dir: str | Path, results: RunResults) -> tuple[Path, Path]:
    """Write results.json and results.csv into `run_dir`, each atomically; returns both paths."""
    run_dir = Path(run_dir)
    json_path = write_text_atomic(run_dir / RESULTS_JSON, results.model_dump_json(indent=2) + "\n")
    csv_path = run_dir / RESULTS_CSV
    with atomic_writer(csv_path) as handle:
        results_frame(results).to_csv(handle, index=False)
    return json_path, csv_path


def timed_paths(results: RunResults) -> Iterator[tuple[int, CaseResult, str, TimingStats]]:
    """(case position, case, path, its timing) for every timed path of every case."""
    for index, case in enumerate(results.cases):
        for path in TIMED_PATHS:
            stats = getattr(case.timing, path, None)
            if stats is not None:
                yield index, case, path, stats


def refuse_run_output(path: str | Path, option: str, *, own: str | None = None) -> None:
    """Raise ResultsError when `path` (or what it links to) is an output file of a run folder (a
    folder holding a results.json): an export or a comparison written there would replace that
    run's results or reports. `own` is the one name the caller writes into run folders itself."""
    path = Path(path)
    for candidate in (path, path.resolve()):
        if (candidate.name in RUN_OUTPUT_FILES and candidate.name != own
                and (candidate.parent / RESULTS_JSON).is_file()):
            raise ResultsError(path, option, f"is the {candidate.name} of the run folder "
                               f"{candidate.parent}: refusing to replace a run's output "
                               "(write it elsewhere)")


def results_path(path_or_run_dir: str | Path) -> Path:
    path = Path(path_or_run_dir)
    return path / RESULTS_JSON if path.is_dir() else path


def load_results(path_or_run_dir: str | Path) -> RunResults:
    """Read a run's results.json (given the file or its run dir); raises ResultsError."""
    path = results_path(path_or_run_dir)
    if path.exists() and not path.is_file():  # a FIFO blocks the read, /dev/zero never ends
        raise ResultsError(path, None, "is not a regular file (a device, pipe or socket)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(path, None,
                           "no such file (expected a run dir or a results.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(path, None, f"cannot read: {exc}") from None
    if not text.strip():
        raise ResultsError(path, None, "empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(path, None, f"invalid JSON: {exc.msg} (line {exc.lineno})") from None
    except RecursionError:
        raise ResultsError(path, None, "invalid results: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ResultsError(path, None, f"top level must be an object, not {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version != SCHEMA_VERSION:  # True == 1 in Python
        raise ResultsError(path, "schema_version", f"unsupported version {version!r} "
                           f"(this swa-bench reads {SCHEMA_VERSION})")
    try:
        return RunResults.model_validate(data)
    except RecursionError:
        raise ResultsError(path, None, "invalid results: JSON nested too deeply") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        more = exc.error_count() - 1
        suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
        raise ResultsError(path, field, f"{first['msg']}{suffix}") from None
