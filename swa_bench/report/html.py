"""report.html: one self-contained page (inline CSS and SVG, no script, no network).

Autoescape is on for everything from the results file; the only markup marked safe is the chart
SVG, which charts.figure_svg produces from matplotlib (whose text output is escaped) and vets.
A Content-Security-Policy of default-src 'none' makes the browser refuse any external load that
might still slip in."""

from __future__ import annotations

from functools import lru_cache

import jinja2
import yaml
from markupsafe import Markup

from swa_bench.report import charts, tables
from swa_bench.results import RunResults


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("swa_bench.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_printable,
    )


def _printable(value: object) -> object:
    """Every text the template prints, control characters written out (``tables.printable``);
    the vetted chart SVG (``Markup``) is left as it is."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return tables.printable(value)
    return value


def render_html(results: RunResults) -> str:
    rendered_charts = [
        charts.Chart(c.id, c.title, c.caption, Markup(c.svg)) for c in charts.all_charts(results)
    ]
    latency = [r for r in tables.latency_rows(results)
               if r.reference_ms != tables.MISSING or r.replay_ms != tables.MISSING]
    headline = tables.headline_rows(results)
    template = _environment().get_template("report.html.j2")
    return template.render(
        results=results,
        verdict=results.verdict(),
        verdict_line=tables.verdict_line(results),
        failures=tables.failure_rows(results),
        implausible=tables.implausible(results),
        headline=headline if any(r.speedup != tables.MISSING for r in headline) else [],
        charts=rendered_charts,
        checks=tables.check_rows(results),
        latency=latency,
        graphs=tables.graph_rows(results),
        advice=tables.advice_rows(results),
        approximation=tables.approximation_rows(results),
        task_table=tables.task_rows(results),
        held_out_table=tables.held_out_rows(results),
        task_note=tables.task_note(results),
        environment=tables.environment_rows(results),
        scenario_text=yaml.safe_dump(results.scenario, sort_keys=False, allow_unicode=True),
    )
