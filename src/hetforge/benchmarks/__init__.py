"""Benchmarks against the systems users would pick instead of hetforge (see docs/arch/bench.md).

``run_suite(SuiteConfig(...))`` runs the peer suite and returns a ``SuiteResult``;
``write_report(result, out_dir)`` writes the markdown table, the PNG chart and the raw JSON.
"""

from hetforge.benchmarks.harness import Row, Stat, SuiteConfig, SuiteResult, run_suite
from hetforge.benchmarks.report import write_report
from hetforge.benchmarks.systems import SYSTEMS, System

__all__ = ["SYSTEMS", "Row", "Stat", "SuiteConfig", "SuiteResult", "System", "run_suite", "write_report"]
