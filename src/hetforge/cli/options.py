"""CLI options that several commands take, declared once: name, help and one default each.

A command declares ``strategy: Strategy = STRATEGY`` and gets the same ``--strategy`` as every other command.
Help lists are generated from the registries they name (placement strategies read from the placement package's
source without importing the cost model, objectives, quantization schemes), never typed by hand.

Defaults, one per option:

* ``--strategy rules``: the heterogeneous dispatch rules — what ``hetforge run`` (generation) and
  ``hetforge explain`` already used; ``compile`` and ``run-graph`` (which used ``support``) now compile what
  ``run`` runs. ``support`` stays one ``--strategy`` away.
* ``--objective energy``: the default of ``compile``, ``run-graph`` and ``run`` (the edge device's budget);
  ``explain`` and ``pareto`` (which used ``balanced``) follow it.
* ``--w8-act``: unset (``$HETFORGE_W8_ACT``, else ``q8``); set, it is exported as ``HETFORGE_W8_ACT`` so the
  processes a command starts (``bench peers`` systems) and the compile cache key see it. ``--w4-act`` the same
  for w4 (``$HETFORGE_W4_ACT``).
* ``--quantize none``, ``--group-size 128``, ``--attn sdpa``, ``--passes/--no-passes`` on, ``--json`` off: these
  never differed. ``--soc`` and ``--seq`` share their help; their defaults stay per command because they mean
  different things there (``--soc`` is required where a profile must be named; ``--seq`` is a prefill length
  in ``bench`` and ``moe``, an example length elsewhere).
"""

from __future__ import annotations

from typing import Annotated

import typer

from hetforge.placement import OBJECTIVES, declared_strategies
from hetforge.quant.schemes import SCHEMES

STRATEGY = "rules"
OBJECTIVE = "energy"
QUANTIZE = "none"
GROUP_SIZE = 128
ATTN = "sdpa"


def _or(items: list[str] | tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


STRATEGY_HELP = f"placement strategy: {_or(declared_strategies())}"
OBJECTIVE_HELP = f"what the strategy minimises: {_or(OBJECTIVES)} (not for support)"
QUANTIZE_HELP = f"weight quantization of every linear before placement: {_or(SCHEMES)}"
SOC_HELP = "SoC profile: a shipped name (see `hetforge socs`), host (this machine), or a profile file"

Strategy = Annotated[str, typer.Option("--strategy", help=STRATEGY_HELP)]
# generation (``hetforge run``) also takes single:DEVICE
GenerationStrategy = Annotated[str, typer.Option("--strategy", help=STRATEGY_HELP + "; single:DEVICE puts "
                                                 "everything on DEVICE (single alone: on the CPU)")]
Objective = Annotated[str, typer.Option("--objective", help=OBJECTIVE_HELP)]
Soc = Annotated[str, typer.Option("--soc", help=SOC_HELP)]
Quantize = Annotated[str, typer.Option("--quantize", help=QUANTIZE_HELP)]
W8_ACT_HELP = ("--quantize w8: how the int8 products take their activation, prefill and decode alike: q8 (quantized "
               "per block of 32 as llama.cpp's Q8_0, int8·int8 sums; the default) or weight-only (fp32 activation); "
               "default: $HETFORGE_W8_ACT, else q8")
W8Act = Annotated[str | None, typer.Option("--w8-act", help=W8_ACT_HELP)]
W4_ACT_HELP = ("--quantize w4: how the int4 products take their activation, prefill and decode alike: q8 (quantized "
               "per block of 32 as llama.cpp's Q8_0, int4·int8 sums on hetforge's VNNI kernels; the default) or "
               "weight-only (fp32 activation, ATen's int4 kernel / dequantize + float GEMM); default: "
               "$HETFORGE_W4_ACT, else q8")
W4Act = Annotated[str | None, typer.Option("--w4-act", help=W4_ACT_HELP)]
GroupSize = Annotated[int, typer.Option("--group-size", help="int4 (w4) quantization group size: 32, 64, 128 or 256")]
Attn = Annotated[str, typer.Option("--attn", help="attention implementation: eager or sdpa")]
Passes = Annotated[bool, typer.Option("--passes/--no-passes", help="run the middle-end passes before placement")]
Seq = Annotated[int, typer.Option("--seq", help="sequence length of the (static) example input")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON document and nothing else on stdout")]
