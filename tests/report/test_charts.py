"""Chart layout and colours: no legend box on its axes, one fixed colour per mode and policy."""

import re

from matplotlib.backends.backend_agg import FigureCanvasAgg

from swa_bench.report.charts import SERIES_COLORS, all_charts, series_color
from tests.report.synthetic import synthetic_run

NINE = dict(graph_modes=("eager", "piecewise", "full"), policies=("bounded", "halo", "full"),
            error=False)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_no_legend_box_overlaps_its_axes():
    charts = all_charts(synthetic_run(**NINE))
    assert {c.id for c in charts} >= {"latency", "speedup", "break-even", "approximation"}
    for chart in charts:
        fig = chart.figure
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        assert legends, chart.id
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), \
                f"{chart.id}: the legend is cut off by the figure's edge"
            for ax in fig.axes:
                assert not _overlaps(box, ax.get_window_extent(renderer)), \
                    f"{chart.id}: the legend covers an axes"


def test_nine_series_get_nine_colours_stable_across_runs():
    colors = {series_color(m, p) for m in NINE["graph_modes"] for p in NINE["policies"]}
    assert len(colors) == 9
    assert len(set(SERIES_COLORS.values())) == len(SERIES_COLORS)
    # eager/bounded is drawn in the same colour whether or not other modes were swept
    alone = synthetic_run(graph_modes=("eager",), policies=("bounded",), error=False)
    both = synthetic_run(**NINE)
    for results in (alone, both):
        (speedup,) = [c for c in all_charts(results) if c.id == "speedup"]
        assert series_color("eager", "bounded") in re.findall(r"#[0-9a-f]{6}", speedup.svg)
    (speedup,) = [c for c in all_charts(both) if c.id == "speedup"]
    used = set(re.findall(r"#[0-9a-f]{6}", speedup.svg))
    assert colors <= used
