"""Capture time of gpt2 and llama-110m, strict vs non-strict torch.export, in one run.

Usage: python bench/capture.py [--repeats N] [--models gpt2 llama-110m]
Interleaves modes per repeat so machine drift hits both alike; prints a markdown table (measured).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m"])
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name in args.models:
        loaded = load_model(name)
        inputs = example_inputs(loaded, seq=args.seq)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for strict in (False, True):
                cg = capture(loaded.logits_module(), inputs, strict=strict, name=name)
                times[strict].append(cg.seconds)
        ns, st = statistics.median(times[False]), statistics.median(times[True])
        rows.append((name, ns, min(times[False]), st, min(times[True]), st / ns))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {time.strftime('%Y-%m-%d')}")
    print("| model | non-strict s (median / min) | strict s (median / min) | strict ÷ non-strict |")
    print("|---|---|---|---|")
    for name, ns, nsm, st, stm, r in rows:
        print(f"| {name} | {ns:.2f} / {nsm:.2f} | {st:.2f} / {stm:.2f} | {r:.2f}× |")


if __name__ == "__main__":
    main()
