"""What the bench scripts share: raw JSON in, Markdown page out (never figures transcribed by hand).

Each script imports this beside itself (``python bench/x.py`` puts ``bench/`` on the path)."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def page_from_json(json_path: str | Path, md_path: str | Path | None, render: Callable[[dict], str]) -> None:
    """``--from-json``: the page of an earlier run's JSON, written to ``md_path`` (or printed)."""
    md = render(json.loads(Path(json_path).read_text()))
    Path(md_path).write_text(md) if md_path else print(md)


def write_result(result: dict[str, Any], out: str | Path | None, md_path: str | Path | None,
                 render: Callable[[dict], str]) -> None:
    """The raw JSON to ``out`` (atomically) and the page generated from it to ``md_path``; the page is printed
    when neither file is given."""
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float) + "\n")
        tmp.replace(out)
    md = render(result)
    if md_path:
        Path(md_path).write_text(md)
    elif not out:
        print(md)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def run_meta(script: str, argv: list[str] | None = None) -> dict[str, Any]:
    """What a result's JSON records about its run, taken before it starts: the command line, the host (CPU model,
    cores, ISA flags), torch version, UTC date and the load average (1/5/15 min). :func:`end_meta` adds the load
    average after."""
    import torch

    from hetforge.hardware.isa import host_record

    args = sys.argv[1:] if argv is None else argv
    return {"command": shlex.join(["python", script, *args]), "host": host_record(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loadavg_before": _load()}


def end_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the load average at the end of the run."""
    meta["loadavg_after"] = _load()
    return meta


def meta_lines(meta: dict[str, Any]) -> list[str]:
    """The page's run paragraph: command, machine, torch, date, load average — all from the JSON."""
    h = meta["host"]
    isa = ", ".join(h["isa"]) or "none recorded"
    fmt = ", ".join
    return [f"Command: `{meta['command']}`", "",
            f"Run {meta['date']} on {h['cpu']} ({h['machine']}, {h['cores']} cores; ISA: {isa}), torch "
            f"{meta['torch']}, {meta['threads']} torch thread(s). Load average (1/5/15 min) "
            f"{fmt(f'{x:.2f}' for x in meta['loadavg_before'])} before, "
            f"{fmt(f'{x:.2f}' for x in meta['loadavg_after'])} after.{load_note(meta)}"]


def load_note(meta: dict[str, Any]) -> str:
    """A warning when the 1-min load average exceeded the core count at either end of the run (else empty)."""
    peak = max([*meta["loadavg_before"][:1], *meta["loadavg_after"][:1]], default=0.0)
    cores = meta["host"]["cores"] or 1
    if peak <= cores:
        return ""
    return (f" **The machine was loaded** (1-min load average up to {peak:.2f} on {cores} cores, other jobs running): "
            "wall times are noisy upper bounds, and ratios between variants measured in the same round are the "
            "figures to read.")


def add_page_args(ap) -> None:
    """``--out JSON``, ``--md PAGE`` and ``--from-json``: the options every bench that writes a page takes."""
    ap.add_argument("--out", type=Path, default=None, help="raw JSON of the run")
    ap.add_argument("--md", type=Path, default=None, help="the page generated from the JSON")
    ap.add_argument("--from-json", action="store_true", help="only regenerate --md from --out")


def int_list(ap, value: str, option: str) -> list[int]:
    """A comma-separated option's integers, sorted and without repeats; a bad one is ``ap.error`` (one line, exit 2)."""
    try:
        return sorted({int(t) for t in value.split(",") if t.strip()})
    except ValueError:
        ap.error(f"{option} takes comma-separated integers, got {value!r}")
        raise  # ap.error exits; this keeps type checkers content


def from_json_done(ap, args, render: Callable[[dict], str]) -> bool:
    """With ``--from-json``: write the page of ``--out`` (a missing file is one line and exit 2) and say True."""
    if not args.from_json:
        return False
    if args.out is None or not args.out.is_file():
        ap.error(f"--from-json reads --out, and {args.out or 'no --out'} is not a file")
    page_from_json(args.out, args.md, render)
    return True


def faster_through(ratios: dict[int, list[float]]) -> int | None:
    """The largest row count R such that every ratio (native ÷ the other kernel, one per shape) is below 1 at every
    count from the smallest up to R; None when the smallest already fails. The rule bench/bf16_rows.py's pages set
    (``native.AMX_ROWS_MAX``, ``native.BF16_PANEL_ROWS_MAX``) and bench/summary.py reports."""
    best = None
    for r in sorted(ratios):
        if not all(x < 1.0 for x in ratios[r]):
            break
        best = r
    return best


def ratio_means(rows: list[dict], dtype: str | None = None) -> dict[str, float]:
    """bench/prefetch.py's rows (of one ``dtype``, or all): per distance, the geometric mean over the shapes of the
    time ratio to no prefetch. The page and docs/benchmarks.md's row both read it from here."""
    mine = [r for r in rows if dtype is None or r["dtype"] == dtype]
    return {d: statistics.geometric_mean(r["ratio_to_none"][d] for r in mine) for d in mine[0]["ratio_to_none"]}
