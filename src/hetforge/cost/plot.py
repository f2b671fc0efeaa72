"""Roofline plot: each device's roof ``min(π, β·AI)`` and every op as a point (AI, F / t_modeled)."""

from __future__ import annotations

import math
from pathlib import Path

from hetforge.cost.analyze import GraphCost
from hetforge.files import save_figure
from hetforge.hardware.profile import SocProfile


def roofline_plot(gc: GraphCost, soc: SocProfile, path: Path, title: str = "", what: str = "") -> Path:
    """Write a log-log roofline plot (PNG or SVG by suffix) atomically; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ais = [c.ai for n in gc.nodes for c in n.costs.values() if c.flops > 0 and math.isfinite(c.ai) and c.ai > 0]
    lo = min([*ais, 0.01]) / 2
    hi = max([*ais, 1000.0]) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for i, d in enumerate(soc.devices):
        col = colors[i % len(colors)]
        peak = d.peak("fp32")
        ax.plot(xs, [min(peak, d.mem_bandwidth * x) for x in xs], color=col, lw=2,
                label=f"{d.name} roof (π={peak / 1e12:.3g} TFLOP/s, β={d.mem_bandwidth / 1e9:.3g} GB/s)")
        pts = [(c.ai, c.flops / c.time_s) for n in gc.nodes for c in [n.costs[d.name]]
               if c.flops > 0 and c.time_s > 0 and math.isfinite(c.ai) and c.ai > 0]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, alpha=0.5, color=col,
                       label=f"{d.name} ops (modeled)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attained FLOP/s (modeled)")
    ax.set_title(title or f"roofline on {soc.name} (modeled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    try:
        return save_figure(fig, Path(path), what, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
