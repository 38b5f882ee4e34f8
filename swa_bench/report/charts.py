"""Inline SVG charts for report.html, drawn with matplotlib's SVG backend (no pyplot state).

Text is kept as SVG <text> (svg.fonttype "none") so the charts stay small; matplotlib escapes it.
Labels that come from a results file are additionally stripped of mathtext `$` so a label cannot
make matplotlib's parser raise. The XML prolog and metadata (with its dated, external-namespace
RDF) are dropped so the markup is a bare, reproducible <svg> element with no external references.
Several inline SVGs share one document's id namespace, so every id (and every reference to it) is
prefixed with the chart's name."""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator, ScalarFormatter

from swa_bench.replay.row_selection import POLICIES
from swa_bench.report.tables import POLICY_ORDER, prompting, task_cases
from swa_bench.results import CaseResult, RunResults

_MARKERS = {"bounded": "o", "halo": "s", "full": "^"}
_STYLES = {"bounded": "-", "halo": "--", "full": ":"}

# One colour per graph mode and policy, fixed, so a series keeps its colour in every report
# (whichever modes a run swept): a hue family per mode, a shade per policy, in POLICIES' order.
_MODE_SHADES = {
    "eager": ("#08306b", "#2171b5", "#6baed6", "#4a1486", "#9e9ac8"),
    "piecewise": ("#7f2704", "#d94801", "#fd8d3c", "#99000d", "#ef6548"),
    "full": ("#00441b", "#238b45", "#74c476", "#525252", "#a1d99b"),
}
SERIES_COLORS: dict[tuple[str, str], str] = {
    (mode, policy): shades[n] for mode, shades in _MODE_SHADES.items()
    for n, policy in enumerate(POLICIES)}
_UNKNOWN_COLOR = "#7f7f7f"


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    caption: str
    svg: str
    # The drawn figure, for tests that measure its layout (legend against axes); not rendered.
    figure: Figure | None = field(default=None, repr=False, compare=False)


def safe_label(text: object) -> str:
    return str(text).replace("$", "＄").replace("\n", " ")[:80]


def series_color(mode: str, policy: str) -> str:
    """The fixed colour of a graph mode and policy (grey for a name the map does not know)."""
    return SERIES_COLORS.get((mode, policy), _UNKNOWN_COLOR)


def mode_color(mode: str) -> str:
    """A graph mode's own colour (its bounded shade), for marks that belong to the whole mode."""
    return series_color(mode, "bounded")


def _outside_legend(fig: Figure, ax: Axes, ncols: int = 2) -> None:
    """The legend below the axes, never on them: constrained layout makes room for an
    ``outside`` figure legend, so no line or point is hidden behind the legend box."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", fontsize=7,
                   ncols=min(ncols, len(handles)), frameon=False)


def _new_figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(7.5, 4.2), dpi=100, layout="constrained")
    return fig, fig.add_subplot(1, 1, 1)


_PROLOG = re.compile(r"^.*?(?=<svg\b)", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')
_ID_REF = re.compile(r'(\bid="|url\(#|href="#)([^"\)]+)')


def figure_svg(fig: Figure, salt: str) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    svg = _XMLNS.sub("", _METADATA.sub("", _PROLOG.sub("", buffer.getvalue(), count=1)))
    svg = _ID_REF.sub(lambda m: f"{m.group(1)}{salt}-{m.group(2)}", svg)
    if re.search(r"<script|<foreignObject|<[^>]*\son[a-z]+\s*=", svg, re.I):
        raise ValueError("refusing to inline an SVG with active content")
    return svg.strip()


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _plottable(prompt_len: int, value: float | None) -> bool:
    return prompt_len > 0 and _finite(value)


def _timed(cases: Iterable[CaseResult]) -> list[CaseResult]:
    """Cases with both medians finite and positive: the only ones a latency or ratio can be drawn
    for (a log axis or a division would choke on the rest)."""
    return [c for c in cases if c.timing and c.timing.reference and c.timing.replay
            and all(_finite(s.median_ms) and s.median_ms > 0
                    for s in (c.timing.reference, c.timing.replay))]


@dataclass(frozen=True)
class _Series:
    """The cases of one graph mode and policy, in token order: one line family of a chart over
    tokens, in the mode's colour and the policy's marker and line style."""

    name: str  # "mode/policy", the legend's prefix
    policy: str
    color: str
    cases: list[CaseResult]


def _modes(cases: Iterable[CaseResult]) -> list[str]:
    return sorted({c.graph_mode for c in cases})


def _series(cases: list[CaseResult]) -> list[_Series]:
    groups: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for case in sorted(cases, key=lambda c: (c.graph_mode, c.policy, c.tokens, c.index)):
        groups[(case.graph_mode, case.policy)].append(case)
    return [_Series(f"{mode}/{policy}", policy, series_color(mode, policy), group)
            for (mode, policy), group in groups.items()]


def _plain_log(axis) -> None:
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_locator(NullLocator())


def _token_axis(ax, cases: list[CaseResult]) -> None:
    tokens = sorted({c.tokens for c in cases if c.tokens > 0})
    if tokens and tokens[-1] >= 8 * tokens[0]:
        ax.set_xscale("log", base=2)
        _plain_log(ax.xaxis)
        if len(tokens) <= 12:
            ax.set_xticks(tokens)
    ax.set_xlabel("tokens in the step")
    ax.grid(True, which="major", alpha=0.3)


def _token_chart(fig: Figure, ax: Axes, cases: list[CaseResult], ylabel: str, chart_id: str,
                 title: str, caption: str) -> Chart:
    """A chart over tokens, finished: the token axis, the y label, the legend, the SVG."""
    _token_axis(ax, cases)
    ax.set_ylabel(ylabel)
    _outside_legend(fig, ax, ncols=3)
    return Chart(chart_id, title, caption, figure_svg(fig, chart_id), fig)


def latency_chart(results: RunResults) -> Chart | None:
    cases = _timed(results.cases)
    if not cases:
        return None
    fig, ax = _new_figure()
    for series in _series(cases):
        x = [c.tokens for c in series.cases]
        for path, alpha, style in (("reference", 0.45, ":"),
                                   ("replay", 1.0, _STYLES.get(series.policy, "-"))):
            stats = [getattr(c.timing, path) for c in series.cases]
            median = [s.median_ms for s in stats]
            err = [[max(0.0, s.median_ms - s.p10_ms) for s in stats],
                   [max(0.0, s.p90_ms - s.median_ms) for s in stats]]
            ax.errorbar(x, median, yerr=err, color=series.color, alpha=alpha, linestyle=style,
                        marker=_MARKERS.get(series.policy, "o"), markersize=4, capsize=2,
                        label=safe_label(f"{series.name} {path}"))
    if max(c.timing.reference.median_ms for c in cases) >= 8 * min(
            c.timing.replay.median_ms for c in cases):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        _plain_log(ax.yaxis)
    return _token_chart(fig, ax, cases, "median latency (ms), p10–p90 bars", "latency",
                        "Latency vs tokens", "Median step latency per graph mode and policy; "
                        "dotted: the full reference path.")


def speedup_chart(results: RunResults) -> Chart | None:
    cases = [c for c in results.cases if _finite(c.speedup) or _finite(c.ideal_speedup)]
    if not cases:
        return None
    fig, ax = _new_figure()
    for series in _series(cases):
        measured = [(c.tokens, c.speedup) for c in series.cases if _finite(c.speedup)]
        ideal = [(c.tokens, c.ideal_speedup) for c in series.cases if _finite(c.ideal_speedup)]
        if measured:
            ax.plot(*zip(*measured, strict=True), color=series.color,
                    marker=_MARKERS.get(series.policy, "o"),
                    linestyle=_STYLES.get(series.policy, "-"),
                    label=safe_label(f"{series.name} measured"))
        if ideal:
            ax.plot(*zip(*ideal, strict=True), color=series.color, alpha=0.4, linestyle=":",
                    marker="x", label=safe_label(f"{series.name} ideal (FLOPs)"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    return _token_chart(fig, ax, cases, "speedup over the reference (x)", "speedup",
                        "Measured vs ideal speedup",
                        "Measured speedup against FLOPs(reference) / FLOPs(replay); the gap is "
                        "overhead (gather/scatter, graph breaks) and work that still covers every "
                        "token.")


def break_even_chart(results: RunResults) -> Chart | None:
    cases = _timed(results.cases)
    if not cases:
        return None
    fig, ax = _new_figure()
    for series in _series(cases):
        ratio = [c.timing.replay.median_ms / c.timing.reference.median_ms for c in series.cases]
        ax.plot([c.tokens for c in series.cases], ratio, color=series.color,
                marker=_MARKERS.get(series.policy, "o"),
                linestyle=_STYLES.get(series.policy, "-"), label=safe_label(series.name))
    modes = _modes(cases)
    for advice in results.threshold_advice:
        if advice.recommended_trim_threshold is not None and advice.graph_mode in modes:
            ax.axvline(advice.recommended_trim_threshold, color=mode_color(advice.graph_mode),
                       alpha=0.35, linewidth=1)
    ax.axhline(1.0, color="black", linewidth=1.0, label="break-even")
    return _token_chart(fig, ax, cases, "replay / reference latency", "break-even",
                        "Break-even per graph mode", "Below 1.0 replay is faster; faint vertical "
                        "lines mark the advised trim_threshold.")


def _shaded(cases: list[CaseResult]) -> list[tuple[CaseResult, float]]:
    """Each case with an opacity: the cases of one mode and policy share its colour, fainter
    for fewer tokens, so a chart with a line per case keeps the fixed colour map."""
    groups: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for case in cases:
        groups[(case.graph_mode, case.policy)].append(case)
    shade = {}
    for group in groups.values():
        ranked = sorted(group, key=lambda c: (c.tokens, c.index))
        for rank, case in enumerate(ranked):
            shade[case.index] = 1.0 if len(ranked) == 1 else 0.4 + 0.6 * rank / (len(ranked) - 1)
    return [(case, shade[case.index]) for case in cases]


def approximation_chart(results: RunResults) -> Chart | None:
    cases = [c for c in results.cases if c.approximation and c.approximation.window_kv_rel_error]
    if not cases:
        return None
    fig, ax = _new_figure()
    values = [v for c in cases for v in c.approximation.window_kv_rel_error if math.isfinite(v)]
    for case, shade in _shaded(cases):
        errors = [v if math.isfinite(v) else math.nan
                  for v in case.approximation.window_kv_rel_error]
        ax.plot(range(1, len(errors) + 1), errors,
                color=series_color(case.graph_mode, case.policy), alpha=shade,
                marker=_MARKERS.get(case.policy, "o"), linestyle=_STYLES.get(case.policy, "-"),
                label=safe_label(case.label))
    if all(v > 0 for v in values):
        ax.set_yscale("log")
    elif any(v > 0 for v in values):
        ax.set_yscale("symlog", linthresh=min(v for v in values if v > 0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder layer after S (depth)")
    ax.set_ylabel("window-KV relative error")
    ax.grid(True, alpha=0.3)
    _outside_legend(fig, ax, ncols=3)
    return Chart("approximation", "Approximation error vs decoder depth",
                 "Relative error of each decoder layer's window KV against a full prefill; "
                 "bounded replay's error compounds with depth, halo replay stays at rounding.",
                 figure_svg(fig, "approximation"), fig)


def task_chart(results: RunResults) -> Chart | None:
    """Accuracy vs prompt length per policy, a panel per task and fact distance, and the
    held-out loss panel. Only points a log-2 length axis can place are drawn (a prompt of
    at least one token, a finite value); with none, no chart."""
    cases = task_cases(results)
    if not any(_plottable(c.prompt_len, c.accuracy) for case in cases for c in case.tasks.cells) \
            and not any(_plottable(h.prompt_len, h.loss) for case in cases
                        for h in case.tasks.held_out):
        return None
    groups = sorted({(c.task, c.distance) for case in cases for c in case.tasks.cells
                     if c.task == "recall"})
    groups.append(("copy", -1))
    panels = len(groups) + 1
    cols = min(3, panels)
    rows = -(-panels // cols)
    fig = Figure(figsize=(3.4 * cols, 2.8 * rows), dpi=100, layout="constrained")
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(panels)]
    for case in cases:
        style = dict(color=series_color(case.graph_mode, case.policy),
                     marker=_MARKERS.get(case.policy, "x"),
                     linestyle=_STYLES.get(case.policy, "-."), label=safe_label(case.policy))
        if case.tasks.chunk_size is not None:  # prompts in chunks: the policy's colour, hollow
            style.update(markerfacecolor="none", alpha=0.7,
                         label=safe_label(f"{case.policy}, {prompting(case.tasks.chunk_size)}"))
        for ax, (task, distance) in zip(axes, groups, strict=False):
            cells = sorted((c.prompt_len, c.accuracy) for c in case.tasks.cells
                           if c.task == task and (task == "copy" or c.distance == distance)
                           and _plottable(c.prompt_len, c.accuracy))
            if cells:
                ax.plot([x for x, _ in cells], [y for _, y in cells], **style)
        held = sorted((h.prompt_len, h.loss) for h in case.tasks.held_out
                      if _plottable(h.prompt_len, h.loss))
        if held:
            axes[-1].plot([x for x, _ in held], [y for _, y in held], **style)
    for ax, (task, distance) in zip(axes, groups, strict=False):
        ax.set_title(f"recall, fact {distance} back" if task == "recall" else "copy in window",
                     fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("accuracy", fontsize=8)
    axes[-1].set_title("held-out loss after the prefill", fontsize=9)
    axes[-1].set_ylabel("nats/byte", fontsize=8)
    for ax in axes:
        if ax.has_data():  # an empty panel has no positive limits to log-scale
            ax.set_xscale("log", base=2)
            _plain_log(ax.xaxis)
        ax.set_xlabel("prompt tokens", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    _outside_legend(fig, next(ax for ax in axes if ax.has_data()),
                    ncols=min(len(cases), len(POLICY_ORDER)))
    return Chart("tasks", "Task accuracy vs prompt length, per policy",
                 "Trained model: last-token answer accuracy by prompt length (a panel per fact "
                 "distance for recall, which reads the global KV; copy reads the window KV), "
                 "and the teacher-forced held-out loss of the prefill's last token and the "
                 "decode steps after it, per replay policy; hollow markers: prompts "
                 "prefilled in chunks (checks.tasks.chunk_size).",
                 figure_svg(fig, "tasks"), fig)


def all_charts(results: RunResults) -> list[Chart]:
    charts = (latency_chart(results), speedup_chart(results), break_even_chart(results),
              approximation_chart(results), task_chart(results))
    return [chart for chart in charts if chart is not None]
