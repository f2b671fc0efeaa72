"""Capture time of gpt2 and llama-110m, strict vs non-strict torch.export, in one run (measured).

Usage: python bench/capture.py [--repeats N] [--models gpt2 llama-110m] [--seq 128] [--out JSON] [--md PAGE]
       python bench/capture.py --from-json --out docs/bench/capture.json --md docs/bench/capture.md
Interleaves modes per repeat so machine drift hits both alike; the page is generated from the JSON alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from _pages import end_meta, meta_lines, page_from_json, run_meta, write_result

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model


def render(res: dict) -> str:
    """The page of one run's JSON."""
    m = res["meta"]
    lines = ["## Capture: strict vs non-strict `torch.export` (measured)", "", *meta_lines(m), "",
             f"{res['repeats']} repeats, modes interleaved per repeat, seq {res['seq']}; capture wall time "
             "(`CapturedGraph.seconds`), **measured**.", "",
             "| model | non-strict s (median / min) | strict s (median / min) | strict ÷ non-strict |",
             "|---|---|---|---|"]
    ratios = []
    for r in res["rows"]:
        ns, st = r["non_strict_s"], r["strict_s"]
        ratio = statistics.median(st) / statistics.median(ns)
        ratios.append(ratio)
        lines.append(f"| {r['model']} | {statistics.median(ns):.2f} / {min(ns):.2f} | {statistics.median(st):.2f} / "
                     f"{min(st):.2f} | {ratio:.2f}× |")
    lines += ["", f"Non-strict is hetforge's default: {min(ratios):.1f}–{max(ratios):.1f}× faster capture in this run "
              "(medians), with the same graph and the same fidelity (both match eager exactly on every zoo model "
              "in the tests).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="raw JSON of the run")
    ap.add_argument("--md", type=Path, default=None, help="the page generated from the JSON")
    ap.add_argument("--from-json", action="store_true", help="only regenerate --md from --out")
    a = ap.parse_args(argv)
    if a.from_json:
        if a.out is None or not a.out.is_file():
            ap.error(f"--from-json reads --out, and {a.out or 'no --out'} is not a file")
        page_from_json(a.out, a.md, render)
        return 0
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(2)
    meta = run_meta("bench/capture.py", argv)
    rows = []
    for name in a.models:
        loaded = load_model(name)
        inputs = example_inputs(loaded, seq=a.seq)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeats):
            for strict in (False, True):
                cg = capture(loaded.logits_module(), inputs, strict=strict, name=name)
                times[strict].append(cg.seconds)
        rows.append({"model": name, "non_strict_s": times[False], "strict_s": times[True]})
        print(json.dumps(rows[-1]), flush=True)
    res = {"meta": end_meta(meta), "repeats": a.repeats, "seq": a.seq, "rows": rows}
    write_result(res, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
