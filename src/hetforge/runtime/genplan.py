"""Generation plans: the placed prefill tiers and decode programs of one model for one SoC, in one file.

``hetforge compile MODEL --soc S --strategy X --generate --tiers 32,128 --cache 256 --out plan.hfp`` writes
one JSON document (format ``hetforge-genplan/1``) holding

* the model's name and a fingerprint of its weights (a plan for other weights is refused);
* the SoC profile itself (its JSON text when it came from a file or the shipped set) and a hash of it, so
  a plan made with ``--soc FILE.json`` runs without the file and a different profile of the same name is
  refused;
* the options that shape the programs (strategy, objective, quantization);
* per program (``prefill-T``, ``decode-S``): the placement (node → device) and the scheduled program's
  instruction list (op and device per instruction, in order) as compiled.

``hetforge run MODEL --plan plan.hfp`` captures each program again (torch.export is deterministic for a
static shape), applies the passes and quantization, and lowers with the *stored placement* instead of
running the strategy; the lowered and scheduled program must equal the stored instruction list, or the plan
is refused (it was made by another hetforge or for another graph). A request that needs a tier the plan
does not hold is refused naming what it holds and what is needed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from hetforge.errors import HetforgeError, UsageError
from hetforge.files import write_text

FORMAT = "hetforge-genplan/1"


class GenPlanError(UsageError):
    """A generation plan that does not fit the model or request it is used with (exit 2)."""


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of every parameter and buffer (names, shapes, dtypes, values)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def soc_hash(soc) -> str:
    """A hash of the profile's content (not of where it was read from)."""
    d = {k: v for k, v in soc.to_dict().items() if k != "path"}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _soc_text(soc) -> str | None:
    from hetforge.hardware.loader import _shipped

    shipped = _shipped()
    if soc.name in shipped:
        return shipped[soc.name].read_text()
    p = Path(soc.path) if soc.path else None
    if p is not None and p.is_file():
        return p.read_text()
    return None


def _instr_list(program) -> list[list[str]]:
    return [[i.op, i.device] for i in program.instrs]


def save_genplan(engine, prefill_tiers: list[int], cache_lengths: list[int], path: Path) -> dict[str, Any]:
    """Compile the named programs with ``engine`` and write them as a plan (atomically)."""
    ex = engine.executor
    if not hasattr(ex, "soc_profile"):
        raise UsageError("a generation plan needs the placed executor (executor 'backend')")
    for t in prefill_tiers:
        if t not in engine.programs.tiers:
            raise UsageError(f"--tiers: {t} is not a prompt tier of this model; allowed: "
                             f"{', '.join(map(str, engine.programs.tiers))}")
    for s in cache_lengths:
        if s not in engine.programs.tiers:
            raise UsageError(f"--cache: {s} is not a cache length of this model; allowed: "
                             f"{', '.join(map(str, engine.programs.tiers))}")
    programs: dict[str, Any] = {}
    if prefill_tiers and cache_lengths:  # the first decode program in a forked child while the prefill tiers are
        engine.programs.decode_ahead(cache_lengths[0])  # built here, as a cold request does (runtime.ahead)
    try:
        for kind, lengths in (("prefill", prefill_tiers), ("decode", cache_lengths)):
            for n in lengths:
                prog, _ = (engine.programs.prefill if kind == "prefill" else engine.programs.decode)(n)
                res = prog.placed.compiled
                programs[f"{kind}-{n}"] = {"assignment": dict(res.placement.assignment),
                                           "instructions": _instr_list(res.program),
                                           "partitions": len(prog.placed.partitions.partitions),
                                           "devices": res.program.count_by_device()}
    finally:
        engine.programs.cancel_ahead()  # a failed build leaves no child behind
    soc = ex.soc_profile
    doc = {"format": FORMAT, "model": engine.loaded.name, "weights": weights_fingerprint(engine.loaded.model),
           "soc": soc.name, "soc_hash": soc_hash(soc), "soc_text": _soc_text(soc), "strategy": ex.strategy,
           "objective": ex.objective, "quantize": ex.quantize, "group_size": ex.group_size, "programs": programs}
    write_text(path, json.dumps(doc), "--out")
    return doc


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"plan file '{path}' does not exist (write one with `hetforge compile MODEL --generate "
                         f"--out {path}`)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"'{path}' is not a hetforge plan file (not JSON: {e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        fmt = d.get("format") if isinstance(d, dict) else None
        hint = (" (a one-shot program: run it with `hetforge run-plan`)"
                if isinstance(fmt, str) and fmt.startswith("hetforge-program") else "")
        raise UsageError(f"'{path}' is not a generation plan (format {fmt!r}, expected {FORMAT}){hint}")
    need = {"model": str, "weights": str, "soc": str, "soc_hash": str, "strategy": str, "objective": str,
            "quantize": str, "group_size": int, "programs": dict}
    for k, typ in need.items():
        if not isinstance(d.get(k), typ):
            raise UsageError(f"plan '{path}': field '{k}' is missing or not a {typ.__name__}")
    for key, p in d["programs"].items():
        kind, _, n = key.partition("-")
        if kind not in ("prefill", "decode") or not n.isdigit() or not isinstance(p, dict) \
                or not isinstance(p.get("assignment"), dict) or not isinstance(p.get("instructions"), list):
            raise UsageError(f"plan '{path}': program entry '{key}' is malformed")
    return d


def read_genplan_header(path: Path) -> dict[str, Any]:
    """The plan's options, with its SoC profile rebuilt (from the embedded text, or by name) and checked."""
    from hetforge.hardware import load_soc
    from hetforge.hardware.loader import _load_text

    d = _read(Path(path))
    soc = _load_text(d["soc_text"], f"{d['soc']} (embedded in {path})") if d.get("soc_text") else load_soc(d["soc"])
    if soc_hash(soc) != d["soc_hash"]:
        raise GenPlanError(f"plan '{path}' was compiled for a different '{d['soc']}' profile than the one found "
                           f"now (hash {d['soc_hash']} vs {soc_hash(soc)}); recompile the plan")
    return {**d, "soc_profile": soc}


def load_genplan(path: Path, engine) -> None:
    """Check the plan against ``engine``'s model and make its programs come from the plan's placements."""
    d = _read(Path(path))
    name = engine.loaded.name
    if d["model"] != name:
        raise GenPlanError(f"plan '{path}' was compiled for model '{d['model']}', not '{name}'; run it with "
                           f"{d['model']} or recompile it for {name}")
    fp = weights_fingerprint(engine.loaded.model)
    if fp != d["weights"]:
        raise GenPlanError(f"plan '{path}' was compiled for other weights of '{name}' (fingerprint {d['weights']}, "
                           f"these are {fp}); recompile it")
    engine.programs.fixed = {tuple((k.split("-")[0], int(k.split("-")[1]))): v for k, v in d["programs"].items()}
    engine.programs.fixed_source = str(path)


def missing_message(fixed: dict, source: str, kind: str, length: int) -> str:
    held = {k: sorted(n for kk, n in fixed if kk == k) for k in ("prefill", "decode")}
    what = "prompt tier" if kind == "prefill" else "KV cache length"
    return (f"plan '{source}' holds prefill tiers {held['prefill'] or 'none'} and decode cache lengths "
            f"{held['decode'] or 'none'}; this request needs {kind} {what} {length}; recompile with "
            f"`--tiers`/`--cache` including it")


def check_rebuilt(entry: dict, program, source: str, label: str) -> None:
    """The re-lowered program must be the stored one, instruction by instruction."""
    got = _instr_list(program)
    want = [list(x) for x in entry["instructions"]]
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        raise HetforgeError(f"plan '{source}': program {label} compiled now differs from the stored one at "
                            f"instruction {k} ({got[k] if k < len(got) else 'end'} vs "
                            f"{want[k] if k < len(want) else 'end'}); recompile the plan with this hetforge")
