"""CLI options shared by several commands are declared once (hetforge.cli.options): same help, one default."""

from __future__ import annotations

import typer.main

from hetforge.cli import options as opt
from hetforge.cli.common import app
from hetforge.cli.main import _load_commands
from hetforge.placement import OBJECTIVES, declared_strategies, list_strategies

_load_commands()

# options that mean something else in these commands (their own declarations, on purpose)
OWN_MEANING = {("hetero", "--strategy"), ("hetero", "--objective"),  # None: use --layout instead
               ("moe-residency", "--objective"),  # latency or energy of an expert group's device
               ("moe-residency", "--group-size"), ("moe-tiers", "--group-size"),  # experts per grouped call
               ("simulate-thermal", "--strategy")}  # cost-driven strategies only (greedy, pgsam): Φ re-placement


def _params(name: str) -> dict[str, list[tuple[str, object, str]]]:
    """command → (default, help) of every parameter whose flags include ``name``."""
    out: dict[str, list] = {}

    def walk(cmd, path: str) -> None:
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path}-{sub_name}" if path else sub_name)
        for p in getattr(cmd, "params", []):
            if name in p.opts:
                out.setdefault(path, []).append((p.default, p.help))

    walk(typer.main.get_command(app), "")
    return out


def test_shared_options_have_one_default_and_one_help():
    for flag, default, help_text in [("--strategy", opt.STRATEGY, opt.STRATEGY_HELP),
                                     ("--objective", opt.OBJECTIVE, opt.OBJECTIVE_HELP),
                                     ("--quantize", opt.QUANTIZE, opt.QUANTIZE_HELP),
                                     ("--group-size", opt.GROUP_SIZE, None), ("--attn", opt.ATTN, None),
                                     ("--json", False, None)]:
        seen = {cmd: ps for cmd, ps in _params(flag).items() if (cmd, flag) not in OWN_MEANING}
        assert len(seen) >= 2, (flag, seen)  # really shared
        for cmd, ps in seen.items():
            for d, h in ps:
                assert d == default, (flag, cmd, d)
                if help_text is not None:
                    assert h.startswith(help_text), (flag, cmd, h)
    assert {d for cmd, ps in _params("--strategy").items() if (cmd, "--strategy") not in OWN_MEANING
            for d, _ in ps} <= {opt.STRATEGY, None}


def test_help_lists_come_from_the_registries():
    assert declared_strategies() == list_strategies()  # read without importing == what registers on import
    for s in list_strategies():
        assert s in opt.STRATEGY_HELP
    assert all(o in opt.OBJECTIVE_HELP for o in OBJECTIVES)
