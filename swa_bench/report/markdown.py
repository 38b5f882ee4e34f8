"""report.md: GitHub-flavoured markdown, small enough for $GITHUB_STEP_SUMMARY.

Every cell goes through `md_cell`: `|` would split a table row, a newline would end it, and a raw
`<` would be read as HTML by GitHub's renderer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tabulate import tabulate

from swa_bench.report import tables
from swa_bench.results import RunResults

_MARKS = {"pass": "pass", "fail": "**FAIL**", "error": "**ERROR**", "info": "info"}


_ENTITY = re.compile(r"&(?=#?\w+;)")  # an & that GitHub would read as the start of an entity


def md_cell(value: object) -> str:
    """One line, ``|`` escaped, and only what GitHub would read as markup made inert: ``<`` (a
    tag) and ``&`` before ``name;`` (an entity). ``->`` and ``>=`` stay as written, so the raw
    file reads as the rendered one."""
    text = tables.one_line(str(value))
    return _ENTITY.sub("&amp;", text).replace("<", "&lt;").replace("|", "\\|")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[md_cell(value) for value in row] for row in rows]
    return tabulate(cells, headers=[md_cell(h) for h in headers], tablefmt="github",
                    disable_numparse=True)


def render_markdown(results: RunResults) -> str:
    verdict = results.verdict()
    icon = {"pass": "✅", "fail": "❌", "error": "⚠️", "unverified": "⚠️"}[verdict]
    out = [f"# swa-bench: {md_cell(results.scenario_name)}", "",
           f"{icon} **{md_cell(tables.verdict_line(results))}**", ""]
    implausible = tables.implausible(results)
    if implausible:
        out += [f"- ⚠️ {md_cell(line)}" for line in implausible] + [""]
    headline = tables.headline_rows(results)
    if any(r.speedup != tables.MISSING for r in headline):
        out += ["## Headline", "",
                md_table(["mode", "policy", "cases", "speedup (median)", "range", "of ideal",
                          "verdict"],
                         [(r.graph_mode, r.policy, r.cases, r.speedup, r.speedup_range,
                           r.efficiency, _MARKS[r.verdict]) for r in headline]),
                "", "Speedup over the cases that trimmed rows (n/a: none did); of ideal: the "
                "median speedup over the FLOP ratio.", ""]

    latency = [r for r in tables.latency_rows(results)
               if r.reference_ms != tables.MISSING or r.replay_ms != tables.MISSING]
    if latency:
        out += ["## Latency", "",
                md_table(["case", "tokens", "mode", "policy", "threshold", "reference ms",
                          "replay ms", "speedup", "FLOP ideal", "efficiency",
                          "roofline ideal", "of roofline", "TFLOP/s ref / replay (MFU)",
                          "checks"],
                         [(r.case, r.tokens, r.graph_mode, r.policy, r.trim_threshold,
                           r.reference_ms, r.replay_ms, r.speedup, r.ideal, r.efficiency,
                           r.roofline_ideal, r.roofline_efficiency, r.rates, r.checks)
                          for r in latency]),
                "", "Times are medians; FLOP ideal = FLOPs(reference) / FLOPs(replay); checks: "
                "passed/judged, +Ni info results (measured, not judged); "
                "efficiency = speedup / FLOP ideal; roofline ideal = the ratio of the paths' "
                "roofline times, each layer the longer of its FLOPs at the measured GEMM rate "
                "and its analytic bytes at the measured copy bandwidth (environment: "
                "copy_gbytes_per_s); of roofline = speedup / roofline ideal; "
                + tables.mfu_caption(results.cases), ""]

    graphs = tables.graph_rows(results)
    if graphs:
        out += ["## Graphs and memory", "",
                md_table(["case", "mode", "model graphs (replay engine)", "their MiB",
                          "replay graphs", "their MiB", "peak MiB ref / replay"],
                         [(r.case, r.graph_mode, r.model_graphs, r.model_graphs_mib,
                           r.replay_graphs, r.replay_graphs_mib, r.peak_mib) for r in graphs]),
                "", "MiB held: what capturing added to the device memory the allocator holds "
                "once its unused cache is released (graph pools, static and break buffers; CUDA "
                "only, – on CPU); replay graphs share the model graphs' pool; step in N: the timed "
                "step's padded size; peak MiB: each path's peak allocation over its timed loop.",
                ""]

    ttft = tables.ttft_rows(results)
    if ttft:
        out += ["## Time to first token (whole prompts in chunks)", "",
                md_table(["case", "prompt/chunk", "policy", "steps", "TTFT ref ms",
                          "TTFT replay ms", "speedup", "tok/s ref / replay",
                          "peak MiB ref / replay", "logits max abs", "KL(full ‖ replay)",
                          "top-1", "greedy agreement"],
                         [(r.case, r.prompt, r.policy, r.steps, r.reference_ms, r.replay_ms,
                           r.speedup, r.tokens_per_s, r.peak_mib, r.logits_max_abs, r.kl, r.top1,
                           r.greedy) for r in ttft]),
                "", "TTFT: the sum of the prompt's chunk steps and its first decode, median over "
                "repetitions of the whole prompt (+Nd: N decode rows beside each chunk); tok/s: "
                "the prompt's length over the median TTFT; peak MiB: each path's peak allocation "
                "over one whole untimed repetition of the prompt, above its level at the start; "
                "the approximation is the prompt's after its last chunk against the full prefill "
                "run in the same chunks.", "",
                "### Prompt steps", "",
                md_table(["case", "prompt/chunk", "step", "positions", "rows", "kept rows",
                          "reference ms", "replay ms", "replay route"],
                         tables.prompt_step_rows(results)), ""]

    advice = tables.advice_rows(results)
    if advice:
        out += ["## Trim threshold advice", "",
                md_table(["mode", "batch", "recommended trim_threshold", "note"], advice), ""]

    failures = tables.failure_rows(results)
    if failures:
        out += ["## Failures", "",
                md_table(["case", "check", "result", "detail"],
                         [(r.case, r.check, _MARKS[r.outcome], r.detail) for r in failures]), ""]

    checks = tables.check_rows(results)
    out += ["## Checks", ""]
    out += [md_table(["case", "check", "mode", "result", "worst diagnostic"],
                     [(r.case, r.check, r.mode, _MARKS[r.outcome], r.detail) for r in checks])
            if checks else "No checks were run.", ""]

    approximation = tables.approximation_rows(results)
    if approximation:
        out += ["## Approximation (replay vs full prefill, per policy)", "",
                md_table(["case", "logits max abs", "KL(full ‖ replay)", "top-1 agreement",
                          "greedy agreement", "worst window-KV rel error"],
                         [(r.case, r.logits_max_abs, r.kl, r.top1, r.greedy, r.worst_layer_error)
                          for r in approximation]), ""]

    policies, rows = tables.task_rows(results)
    if rows:
        note = tables.task_note(results)
        loss_policies, loss_rows = tables.held_out_rows(results)
        out += ["## Task accuracy (trained model)", "",
                md_table(["prompts", "task", "prompt tokens", "distance", *policies], rows), "",
                "Accuracy of the prefill's last-token answer; in brackets, the share of prompts "
                "whose answer equals the full prefill's. Prompts: prefilled whole (one step) or "
                "in chunks of N tokens, the caches carried (checks.tasks.chunk_size); each is "
                "graded against the full prefill prefilled alike. Distance: positions from the "
                "needed fact to the last token (copy: the pattern's span inside the window).", "",
                md_table(["prompts", "prompt tokens", *(f"{p} loss" for p in loss_policies)],
                         loss_rows),
                "", "Held-out loss: teacher-forced, nats per byte, over the prefill's last "
                "token (its last chunk's) and the decode steps after it.", ""]
        out += [f"- {line}" for line in note] + ([""] if note else [])

    out += ["## Environment", "", md_table(["key", "value"], tables.environment_rows(results)), ""]
    return tables.printable("\n".join(out))  # every line, not only the table cells
