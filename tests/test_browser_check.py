"""tools/browser_check.py in a real browser (Debian's Chromium, driven by Playwright): it must fail a blank page, a
console error, an uncaught exception, a failed request and an image that did not render, and pass the trace report
(its plots laid out and loaded). CI installs Chromium (.ci/run) and runs the check on the built site itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("playwright")
pytest.importorskip("duckdb")
pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import browser_check  # noqa: E402
from moelens.traces import trace_report  # noqa: E402
from test_trace_analysis import hand  # noqa: E402,F401  (the hand-built trace)

if not Path(browser_check.CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {browser_check.CHROMIUM} (apt-get install chromium; .ci/run does)", allow_module_level=True)

TEXT = {10: "def", 11: " ", 12: "7"}
GOOD = "<html><body><h1>moelens</h1><p>A page with text on it, as every page of the site has.</p></body></html>"


@pytest.fixture(scope="module")
def page():
    with browser_check.browser_page() as page:
        yield page


def check(page, folder: Path, name: str, html: str) -> browser_check.PageCheck:
    (folder / name).write_text(html)
    with browser_check.served(folder) as root:
        return browser_check.check_page(page, f"{root}/{name}")


def test_a_page_with_text_passes(page, tmp_path):
    result = check(page, tmp_path, "good.html", GOOD)
    assert result.problems() == [] and result.colours >= browser_check.MIN_COLOURS


def test_a_blank_page_is_reported(page, tmp_path):
    result = check(page, tmp_path, "blank.html", "<html><body></body></html>")
    assert result.colours == 1
    assert result.problems() == [f"{result.url}: blank page (its screenshot has 1 distinct colours)"]


@pytest.mark.parametrize("script, expected", [
    ("console.error('boom')", "console error: boom"),
    ("notDefinedAnywhere()", "uncaught exception: notDefinedAnywhere is not defined"),
])
def test_script_errors_are_reported(page, tmp_path, script, expected):
    result = check(page, tmp_path, "bad.html", GOOD.replace("</body>", f"<script>{script}</script></body>"))
    assert [e.split(" (")[0] for e in result.errors] == [expected]


def test_a_missing_image_is_reported(page, tmp_path):
    result = check(page, tmp_path, "img.html", GOOD.replace("</p>", "</p><img src='plots/missing.png'>"))
    assert result.broken_images == ["plots/missing.png"]
    assert [e.split(":")[0] for e in result.errors] == ["console error"] and "404" in result.errors[0]


def test_the_trace_report_renders_its_plots(page, hand, tmp_path):
    out = trace_report(hand, tmp_path / "report.html", decode=lambda ids: "".join(TEXT[i] for i in ids))
    result = browser_check.check_report(out, page)
    assert result.problems() == []
    assert result.images == 2  # subset load and selectivity, each loaded and laid out
    (tmp_path / "report_files" / "selectivity.png").unlink()
    broken = browser_check.check_report(out, page)
    assert broken.broken_images == ["report_files/selectivity.png"]
