"""Render a report's data into one self-contained HTML file (Jinja2 template, data and scripts inline).

Plotly.js is its official *basic* partial bundle (``plotly.js-basic-dist-min`` from npm, MIT, shipped in
``report/assets/`` with its licence): scatter and bar traces, log axes, shapes and hover — all the page draws.
It is a quarter of the full bundle (1.2 MB instead of 4.8 MB), so the browser parses and evaluates a quarter of
the code before the first chart (that evaluation dominated the page's render time). It is inlined
gzip-compressed and base64-encoded and decompressed by the browser's ``DecompressionStream`` before the charts
are drawn, so the page needs no network and no server. To update it: download the same version's tarball from
the npm registry and replace ``plotly-basic.min.js``.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import gzip
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from hetforge.errors import HetforgeError

TEMPLATES = "hetforge.report"


PLOTLY_BUNDLE = "plotly-basic.min.js"


@functools.lru_cache(maxsize=1)
def plotly_gz_b64() -> tuple[str, str]:
    """(base64 of gzip(plotly-basic.min.js), plotly.js version) — compressed once per process."""
    js = resources.files(TEMPLATES).joinpath("assets", PLOTLY_BUNDLE).read_bytes()
    m = re.search(rb"plotly\.js \(basic - minified\) v([0-9][0-9.]*)", js[:400])
    if m is None:
        raise HetforgeError(f"report/assets/{PLOTLY_BUNDLE} is not the plotly.js basic bundle (no version header)")
    return base64.b64encode(gzip.compress(js, compresslevel=9, mtime=0)).decode("ascii"), m.group(1).decode()


def _template_text(name: str) -> str:
    return resources.files(TEMPLATES).joinpath("templates", name).read_text(encoding="utf-8")


def _json_for_script(data: Any) -> str:
    """JSON safe inside <script>: no '<' (so no '</script>' or '<!--'), NaN/inf as null."""
    text = json.dumps(data, default=_default, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _finite(o: Any) -> Any:
    if isinstance(o, float) and (o != o or o in (float("inf"), float("-inf"))):
        return None
    if isinstance(o, dict):
        return {str(k): _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def render_html(data: dict[str, Any], reproduce: list[str]) -> str:
    """The whole page as one string."""
    import jinja2
    from markupsafe import Markup

    try:
        from importlib.metadata import version

        ver = version("hetforge")
    except Exception:  # running from a source tree without metadata
        ver = "dev"
    b64, plotly_ver = plotly_gz_b64()
    doc = dict(data)
    doc.update({"reproduce": reproduce, "version": ver, "plotly": plotly_ver,
                "generated_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")})
    kind = doc.get("kind", "compile")
    what = "generation" if kind == "generation" else "compilation"
    title = f"hetforge {what} report: {doc.get('model')} on {doc.get('soc')} ({doc.get('strategy')})"
    if doc.get("failure"):
        title += f" — failed at {doc['failure']['stage']}"
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    tpl = env.from_string(_template_text("report.html.j2"))
    return tpl.render(title=title, kind=kind, version=ver, data_json=Markup(_json_for_script(_finite(doc))),
                      plotly_b64=Markup(b64), app_js=Markup(_template_text("report.js")))


def write_report(path: str | Path, data: dict[str, Any], reproduce: list[str], what: str = "--out") -> Path:
    """Render and write atomically (nothing half-written on any failure)."""
    from hetforge.files import write_text

    return write_text(path, render_html(data, reproduce), what)
