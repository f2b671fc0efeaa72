"""A real headless browser for the report tests: Debian's ``chromium`` driven by Playwright.

:func:`chromium_path` finds the browser (``HETFORGE_CHROMIUM``, then ``chromium`` / ``chromium-browser`` /
``google-chrome`` on PATH) and, when there is none and we are root on a Debian-like system (CI runs ``make test``
as root), installs it with ``apt-get install -y chromium`` once. Playwright is only the driver (the ``playwright``
pip package, in the ``dev`` extra): it launches this system browser, so no Playwright browser download is needed.
Missing browser → the test fails with how to fix it; it is skipped only when ``HETFORGE_SKIP_BROWSER=1`` says so.

Run by hand: ``python tests/report_browser.py report.html`` opens a report and prints what the test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HOW = ("install Debian's chromium (`sudo apt-get install -y chromium`) or set HETFORGE_CHROMIUM to a Chrome/Chromium "
       "binary; HETFORGE_SKIP_BROWSER=1 skips the browser tests explicitly")


def _find() -> str | None:
    env = os.environ.get("HETFORGE_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for n in NAMES:
        p = shutil.which(n)
        if p:
            return p
    return None


def chromium_path(install: bool = True) -> str:
    """The browser binary; installs Debian's chromium with apt-get when missing and allowed (root + apt-get)."""
    p = _find()
    if p is not None:
        return p
    if install and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                                    "chromium"]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-400:]}; {HOW}")
        p = _find()
        if p is not None:
            return p
    raise RuntimeError(f"no Chromium found; {HOW}")


@dataclass
class PageCheck:
    """What the browser saw: console errors, per-section render flags, timings, the screenshot."""

    errors: list[str] = field(default_factory=list)
    sections: dict[str, dict] = field(default_factory=dict)
    load_ms: float = 0.0  # navigation start → the page's scripts finished (data-ready), measured
    script_ms: float = 0.0  # the page's own measure: its render code, start to end
    phases: dict = field(default_factory=dict)  # ms per render phase (tables, plotly_load, each chart)
    search: dict = field(default_factory=dict)
    screenshot: Path | None = None
    ready: str = ""
    requests: list[str] = field(default_factory=list)  # anything fetched that is not the file itself or data:


def open_report(html: Path, screenshot: Path | None = None, search: str | None = None,
                timeout_s: float = 60.0) -> PageCheck:
    """Open ``html`` from disk (file://, no server) in headless Chromium and report what rendered."""
    from playwright.sync_api import sync_playwright

    out = PageCheck()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: out.errors.append(f"console.{m.type}: {m.text}") if m.type == "error"
                    else None)
            page.on("pageerror", lambda e: out.errors.append(f"pageerror: {e}"))
            page.on("requestfailed", lambda r: out.errors.append(f"request failed: {r.url}"))
            page.on("request", lambda r: out.requests.append(r.url)
                    if not r.url.startswith(("data:", "blob:")) and r.url != Path(html).resolve().as_uri() else None)
            t0 = time.perf_counter()
            page.goto(Path(html).resolve().as_uri())
            page.wait_for_function("document.body.dataset.ready !== undefined", timeout=timeout_s * 1e3)
            out.load_ms = 1e3 * (time.perf_counter() - t0)
            out.ready = page.evaluate("document.body.dataset.ready")
            out.script_ms = float(page.evaluate("window.hetforgeRenderMs || 0"))
            out.phases = page.evaluate("window.hetforgePhases || {}")
            out.sections = page.evaluate("""() => Object.fromEntries(
                [...document.querySelectorAll('section[data-section]')].map(s => [s.id, {
                                  rendered: s.dataset.rendered || '', items: +(s.dataset.items || 0),
                                  charts: s.querySelectorAll('.js-plotly-plot .main-svg').length,
                                  rows: s.querySelectorAll('tbody tr').length,
                                  text: s.innerText.slice(0, 400)}]))""")
            out.sections["failure"] = page.evaluate(
                "(() => { const s = document.getElementById('failure'); "
                "return {hidden: s.hidden, text: s.innerText}; })()")
            if search is not None:
                page.fill("#node-search", search)
                page.wait_for_timeout(100)
                out.search = page.evaluate("""() => ({
                    shown: [...document.querySelectorAll('#node-table tbody tr')].filter(r => !r.hidden)
                        .map(r => r.dataset.node),
                    count: document.getElementById('node-count').textContent})""")
                if out.search["shown"]:
                    page.click(f"#node-table tbody tr[data-node='{out.search['shown'][0]}']")
                    page.wait_for_timeout(100)
                    out.search["detail"] = page.inner_text("#node-detail")
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
                out.screenshot = screenshot
        finally:
            browser.close()
    return out


if __name__ == "__main__":
    res = open_report(Path(sys.argv[1]), Path(sys.argv[1]).with_suffix(".png"),
                      sys.argv[2] if len(sys.argv) > 2 else None)
    print(f"load {res.load_ms:.0f} ms (measured), scripts {res.script_ms:.0f} ms {res.phases}, ready={res.ready}")
    for k, v in res.sections.items():
        print(k, {a: b for a, b in v.items() if a != "text"})
    print("errors:", res.errors)
    print("search:", {k: v for k, v in res.search.items() if k != "detail"})
    print("screenshot:", res.screenshot)
