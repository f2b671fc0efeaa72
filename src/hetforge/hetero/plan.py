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
from hetforge.files import check_input_file


class PlanFileError(HetforgeError):
    """A plan file this hetforge cannot run with the given model (exit 1)."""


def read_header(path: str | Path) -> dict:
    """``format``, ``name``, ``soc``, ``devices`` and ``soc_profile`` of a plan file (UsageError if it is not
    one). A file in this hetforge's format is checked field by field here, before any model is built."""
    from hetforge.ir.serialize import FORMAT, validate_program_dict

    path = check_input_file(path, "plan file", f"write one with `hetforge compile MODEL --out {path}`")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"'{path}' is not a hetforge plan file (not JSON: {e})") from None
    if not isinstance(d, dict) or "format" not in d:
        raise UsageError(f"'{path}' is not a hetforge plan file (no 'format' field)")
    if d.get("format") == FORMAT:
        validate_program_dict(d, f"plan file '{path}'")
    return {k: d.get(k) for k in ("format", "name", "soc", "devices", "soc_profile")}


def plan_soc(path: str | Path, header: dict, soc: str | None = None):
    """The SoC profile to run a plan on: the one embedded in the plan (checked against its sha256). ``soc``
    (a ``--soc`` given by the user) must be the same profile, or the run is refused; a plan from before
    profiles were embedded is looked up by ``soc`` or, failing that, by its stored name."""
    from hetforge.hardware import load_soc
    from hetforge.hardware.loader import from_spec_dict
    from hetforge.ir.serialize import spec_digest

    emb = header.get("soc_profile")
    if emb is None:
        return load_soc(soc if soc is not None else str(header.get("soc")))
    spec = emb.get("spec") if isinstance(emb, dict) else None
    if not isinstance(spec, dict) or emb.get("sha256") != spec_digest(spec):
        raise UsageError(f"plan file '{path}' is malformed: its embedded SoC profile does not match its sha256")
    prof = from_spec_dict(spec, f"{header.get('soc')} (embedded in plan '{path}')")
    if soc is not None:
        given = load_soc(soc)
        if given.spec is None or spec_digest(given.spec) != emb["sha256"]:
            got = spec_digest(given.spec)[:19] if given.spec is not None else "unknown"
            raise UsageError(f"plan '{path}' was compiled for SoC profile '{prof.name}' ({emb['sha256'][:19]}…) but "
                             f"--soc {soc} is a different profile ({got}…); drop --soc to use the plan's own, or "
                             f"recompile with `hetforge compile {header.get('name')} --soc {soc} --out {path}`")
    return prof


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
