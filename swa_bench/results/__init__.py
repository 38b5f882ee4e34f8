"""A run's results: the schema (``schema``: results.json's models, pure), its files (``files``:
atomic writes, refusing reads) and its CSV frame (``frame``). Import from here: the names below
are the package's interface, wherever in it they live."""

from swa_bench.results.files import (
    RESULTS_CSV,
    RESULTS_JSON,
    RUN_OUTPUT_FILES,
    ResultsError,
    atomic_writer,
    is_stream,
    load_results,
    refuse_run_output,
    results_path,
    save_results,
    write_text_atomic,
)
from swa_bench.results.frame import results_frame
from swa_bench.results.schema import (
    SCHEMA_VERSION,
    TIMED_PATHS,
    Approximation,
    CaseResult,
    CaseStatus,
    CaseTiming,
    CheckResult,
    Diagnostic,
    HeldOutLoss,
    KernelRecord,
    MfuBasis,
    ParallelResult,
    PromptResult,
    PromptStep,
    RankResult,
    RunResults,
    RunVerdict,
    TaskCell,
    TaskResults,
    ThresholdAdvice,
    TimingStats,
    Verdict,
    overall_verdict,
    results_json_schema,
    tally,
    timed_paths,
)

__all__ = [
    "RESULTS_CSV", "RESULTS_JSON", "RUN_OUTPUT_FILES", "SCHEMA_VERSION", "TIMED_PATHS",
    "Approximation", "CaseResult", "CaseStatus", "CaseTiming", "CheckResult", "Diagnostic",
    "HeldOutLoss", "KernelRecord", "MfuBasis", "ParallelResult", "PromptResult", "PromptStep",
    "RankResult", "ResultsError", "RunResults",
    "RunVerdict",
    "TaskCell", "TaskResults", "ThresholdAdvice", "TimingStats", "Verdict", "atomic_writer",
    "is_stream", "load_results", "overall_verdict", "refuse_run_output", "results_frame",
    "results_json_schema", "results_path", "save_results", "tally", "timed_paths",
    "write_text_atomic",
]
