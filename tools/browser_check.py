"""Opens the built documentation site and a `moelens trace-report` page in headless Chromium and fails, naming the
page, on a console error, an uncaught exception, a request that failed, a blank page (its screenshot all one
colour) or an image that did not render. CI runs it after building the site (.ci/run):

    python tools/browser_check.py site                      # every page of the built site
    python tools/browser_check.py --report report.html      # a trace report: its plots must be visible

Chromium is Debian's package (`apt-get install chromium`: /usr/bin/chromium, or set CHROMIUM); Playwright drives
it (the `test` extra) and downloads no browser of its own.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from playwright.sync_api import Page, sync_playwright

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1200, "height": 900}
# a page whose screenshot has fewer distinct colours than this is blank (an empty page has one; the site's
# smallest page, text on a header bar, has hundreds from anti-aliasing)
MIN_COLOURS = 16


@dataclass
class PageCheck:
    """What one page did in the browser: its console errors, uncaught exceptions, failed requests, distinct
    colours in its screenshot and the images that did not render."""

    url: str
    errors: list[str] = field(default_factory=list)
    colours: int = 0
    broken_images: list[str] = field(default_factory=list)
    images: int = 0

    def problems(self, min_colours: int = MIN_COLOURS) -> list[str]:
        out = [f"{self.url}: {e}" for e in self.errors]
        if self.colours < min_colours:
            out.append(f"{self.url}: blank page (its screenshot has {self.colours} distinct colours)")
        out += [f"{self.url}: image not rendered: {src}" for src in self.broken_images]
        return out


def screenshot_colours(png: bytes) -> int:
    """Distinct colours of a PNG screenshot (a blank page has one)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return len(image.getcolors(maxcolors=1 << 24) or ())


# per image: not loaded, zero-sized, hidden, or outside the page's layout
BROKEN_IMAGES = """() => Array.from(document.images).filter(img => {
    const box = img.getBoundingClientRect();
    const style = getComputedStyle(img);
    return !img.complete || img.naturalWidth === 0 || box.width === 0 || box.height === 0
        || style.visibility === 'hidden' || style.display === 'none';
}).map(img => img.getAttribute('src'))"""


def check_page(page: Page, url: str) -> PageCheck:
    """Load url in page and record what went wrong (listeners are attached for this load only)."""
    result = PageCheck(url)

    def on_console(message) -> None:
        # the browser asks for /favicon.ico on its own: its 404 is not the page's
        if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
            result.errors.append(f"console error: {message.text} ({message.location.get('url')})")

    def on_request_failed(request) -> None:
        result.errors.append(f"request failed: {request.url} ({request.failure})")

    def on_page_error(error) -> None:
        result.errors.append(f"uncaught exception: {error}")

    page.on("console", on_console)
    page.on("pageerror", on_page_error)
    page.on("requestfailed", on_request_failed)
    try:
        response = page.goto(url, wait_until="networkidle")
        if response is not None and not response.ok:
            result.errors.append(f"HTTP {response.status}")
        result.colours = screenshot_colours(page.screenshot(full_page=False))
        result.images = page.evaluate("() => document.images.length")
        result.broken_images = page.evaluate(BROKEN_IMAGES)
    finally:
        page.remove_listener("console", on_console)
        page.remove_listener("pageerror", on_page_error)
        page.remove_listener("requestfailed", on_request_failed)
    return result


@contextmanager
def served(folder: Path) -> Iterator[str]:
    """folder over HTTP on a free local port (a site's search and scripts need http://, not file://)."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


@contextmanager
def browser_page() -> Iterator[Page]:
    if not Path(CHROMIUM).is_file():
        raise FileNotFoundError(f"no Chromium at {CHROMIUM}: apt-get install chromium, or set CHROMIUM to its path")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport=VIEWPORT)
        finally:
            browser.close()


def site_pages(site: Path) -> list[str]:
    """Every page of a built mkdocs site, as paths below its root (404.html is not a page one navigates to)."""
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    if not pages:
        raise FileNotFoundError(f"{site}: no HTML pages (build the site first: mkdocs build)")
    return pages


def check_site(site: Path, page: Page) -> list[PageCheck]:
    with served(site) as root:
        return [check_page(page, f"{root}/{path}") for path in site_pages(site)]


def check_report(report: Path, page: Page) -> PageCheck:
    """A trace report (its plots in the folder beside it): every plot loaded and laid out."""
    with served(report.parent) as root:
        return check_page(page, f"{root}/{report.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", type=Path, help="a built mkdocs site folder")
    parser.add_argument("--report", type=Path, help="a moelens trace-report HTML file")
    args = parser.parse_args(argv)
    if args.site is None and args.report is None:
        parser.error("give a site folder, --report, or both")
    with browser_page() as page:
        checks = check_site(args.site, page) if args.site else []
        if args.report:
            report = check_report(args.report, page)
            if report.images == 0:
                report.errors.append("the report has no plots")
            checks.append(report)
    problems = [p for check in checks for p in check.problems()]
    for check in checks:
        print(f"{check.url}: {check.colours} colours, {check.images} images")
    print(f"{len(checks)} pages opened in {CHROMIUM}; {len(problems)} problems")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
