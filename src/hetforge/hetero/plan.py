"""Plan files: the Program ``hetforge compile --out FILE`` writes, checked against the model it is run with.

Before any weight is bound, the file's header is checked: its ``format`` must be one this hetforge reads and
its ``name`` must be the model given on the command line; either mismatch is one message naming both sides.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hetforge.errors import HetforgeError, UsageError


class PlanFileError(HetforgeError):
    """A plan file this hetforge cannot run with the given model (exit 1)."""


def read_header(path: str | Path) -> dict:
    """``format``, ``name``, ``soc`` and ``devices`` of a plan file (UsageError if it is not one)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"plan file '{path}' does not exist (write one with `hetforge compile MODEL --out {path}`)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"'{path}' is not a hetforge plan file (not JSON: {e})") from None
    if not isinstance(d, dict) or "format" not in d:
        raise UsageError(f"'{path}' is not a hetforge plan file (no 'format' field)")
    return {k: d.get(k) for k in ("format", "name", "soc", "devices")}


def _version(fmt: str) -> tuple[str, int] | None:
    m = re.fullmatch(r"(.+)/(\d+)", str(fmt))
    return (m.group(1), int(m.group(2))) if m else None


def check_header(path: str | Path, header: dict, model_name: str) -> None:
    """Refuse a plan of another format or another model, naming both."""
    from hetforge.ir.serialize import FORMAT

    ours, theirs = _version(FORMAT), _version(header["format"])
    if theirs is None or theirs[0] != ours[0]:
        raise PlanFileError(f"'{path}' has format {header['format']!r}, not a hetforge program ({FORMAT})")
    if theirs[1] != ours[1]:
        newer = "newer than" if theirs[1] > ours[1] else "older than"
        raise PlanFileError(f"plan '{path}' has format {header['format']}, {newer} the {FORMAT} this hetforge reads; "
                            f"recompile it with this hetforge (`hetforge compile {header.get('name')} --out {path}`)")
    if header.get("name") != model_name:
        raise PlanFileError(f"plan '{path}' was compiled for model '{header.get('name')}', not '{model_name}'; "
                            f"run it with {header.get('name')} or recompile it for {model_name}")


def load_plan(path: str | Path, model_name: str, module: torch.nn.Module):
    """The plan's :class:`~hetforge.ir.Program` with weights bound from ``module`` (after the header checks)."""
    from hetforge.ir import load_program

    header = read_header(path)
    check_header(path, header, model_name)
    return load_program(path, module)


def plan_inputs(program, loaded) -> tuple[torch.Tensor, ...]:
    """Deterministic inputs of the shapes the plan was compiled for (static shapes: [batch, seq])."""
    from hetforge.models.zoo import example_inputs

    shapes = [program.values[v].shape for v in program.inputs]
    if not shapes or len(shapes[0]) != 2:
        raise PlanFileError(f"plan '{program.name}' takes inputs {shapes}; expected token ids of shape [batch, seq]")
    batch, seq = shapes[0]
    return example_inputs(loaded, seq=seq, batch=batch)
