"""Render report.html in headless Chromium: it must load with no console errors, paint a real page
(failures in red) and have the charts and tables in its DOM."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from swa_bench.report import write_reports
from swa_bench.results import save_results

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


def _chromium() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{CHROMIUM} is missing, and CI is set: the browser check must run in CI")
    found = shutil.which("chromium")
    if found is None:
        pytest.skip(f"{CHROMIUM} not installed")
    return found


def _browse(report: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [_chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, report.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if "Uncaught" in line or ("CONSOLE" in line and "error" in line.lower())]


@pytest.fixture
def report_html(tmp_path: Path, make_run) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_results(run_dir, make_run(scenario_name="<script>alert(1)</script>"))
    return next(p for p in write_reports(run_dir) if p.suffix == ".html")


def test_report_renders_in_chromium(report_html: Path, tmp_path: Path):
    shot = tmp_path / "report.png"
    done = _browse(report_html, tmp_path / "profile", f"--screenshot={shot}",
                   "--window-size=1400,3000")
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
    assert _console_errors(done.stderr) == []
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape == (3000, 1400, 3)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, "a blank or single-colour page"
    top = pixels[:1000]
    red = (top[..., 0] > 180) & (top[..., 1] < 80) & (top[..., 2] < 80)
    assert red.sum() > 200, "failing checks should stand out in red near the top"


def test_dom_has_charts_and_tables(report_html: Path, tmp_path: Path):
    done = _browse(report_html, tmp_path / "profile", "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert _console_errors(done.stderr) == []
    assert dom.count("<svg") == 4
    for chart in ("latency", "speedup", "break-even", "approximation"):
        assert f'id="chart-{chart}"' in dom
    for table in ("checks", "latency", "advice", "approximation", "environment"):
        assert f'<table id="{table}">' in dom
    assert 'id="failures"' in dom and "<script" not in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


def test_the_headline_box_is_inside_the_first_900_pixels(tmp_path: Path, make_run):
    """A 1400 x 900 window shows the headline: its box's colour (#ddf4ff) is on the screen."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_results(run_dir, make_run())
    report = next(p for p in write_reports(run_dir) if p.suffix == ".html")
    assert 'id="headline"' in report.read_text()
    shot = tmp_path / "top.png"
    done = _browse(report, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,900")
    assert done.returncode == 0, done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape == (900, 1400, 3)
    box = np.all(np.abs(pixels - np.array([0xdd, 0xf4, 0xff])) <= 2, axis=-1)
    assert box.sum() > 1400 * 40, "the headline's box is not in the first 900 px"
