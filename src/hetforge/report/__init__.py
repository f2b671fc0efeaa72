"""One self-contained HTML report that explains a compilation (``hetforge report``) or a generation
(``hetforge run --report``): summary, passes, placement with every node's "why here", the Pareto front of stage
plans, the roofline, the memory arenas, the device timeline, per-token figures, and the commands to reproduce.

The report sits at the top of the pipeline (like the CLI): it imports the stages, nothing imports it.
:mod:`.build` runs the compiler stage by stage (so a failure names its stage), :mod:`.collect` turns the stage
results into JSON-ready sections, :mod:`.generation` does the same for a generation's ledger, and :mod:`.html`
renders the page (Jinja2 template, Plotly inlined) and writes it atomically.
"""

from __future__ import annotations

from hetforge.report.build import compile_report_data
from hetforge.report.generation import generation_report_data
from hetforge.report.html import render_html, write_report

__all__ = ["compile_report_data", "generation_report_data", "render_html", "write_report"]
