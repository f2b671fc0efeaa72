"""hetforge against the systems users would pick instead, in one run on one machine (measured).

Usage: python bench/peers.py [--models gpt2 llama-110m mixtral-small] [--repeats 3] [--quick]
                             [--systems hetforge eager ...] [--out-dir docs/bench] [--json]
Thin wrapper over ``hetforge.benchmarks`` (the same code as ``hetforge bench peers``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from hetforge.benchmarks.harness import DEFAULT_MODELS, QUICK_MODELS, SuiteConfig, run_suite
from hetforge.benchmarks.report import rerender, write_report
from hetforge.benchmarks.systems import SYSTEMS
from hetforge.errors import UsageError
from hetforge.files import json_safe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--limit-s", type=float, default=None)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--render", type=Path, default=None, help="re-render a saved run's page, chart and JSON beside "
                    "it (same stem), comparisons recomputed: as `hetforge bench peers --from-json`")
    a = ap.parse_args()
    if a.render is not None:
        try:
            paths = rerender(a.render, "--render")
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(f"rendered {paths['markdown']} and {paths['chart']} from {a.render}")
        return
    models = a.models or (QUICK_MODELS if a.quick else DEFAULT_MODELS)
    cfg = SuiteConfig(models=list(models), systems=a.systems, repeats=1 if a.quick else a.repeats, quick=a.quick,
                      seq=a.seq, threads=a.threads, warm=not (a.no_warm or a.quick), timeout_s=a.timeout_s,
                      budget_s=a.budget_s, limit_s=a.limit_s, max_repeats={"mixtral-small": 1})
    command = "python bench/peers.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    res = run_suite(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True), command=command)
    paths = write_report(res, a.out_dir)
    if a.json:
        print(json.dumps(json_safe(res.to_dict()), indent=2, default=str))
    else:
        print(Path(paths["markdown"]).read_text())


if __name__ == "__main__":
    main()
