"""Save a :class:`Program` to a JSON file and load it back, weights referenced rather than copied.

A weight is stored as its module path, shape, dtype and a CRC-32 of its bytes. ``load_program``
resolves each path against a module the caller supplies (the model, or the captured GraphModule) and
refuses a tensor whose shape, dtype or checksum differs, naming the path. Small tensors that exist
only inside the graph (lifted constants) travel inline, base64-encoded.

Round trip: ``str(load_program(save_program(p, f), model)) == str(p)`` (the tests check it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import operator
import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hetforge.errors import HetforgeError, UsageError
from hetforge.files import check_output, read_json, write_text
from hetforge.ir.program import Instr, Program, Reg, Value, WeightRef, dtype_from_short, dtype_short

FORMAT = "hetforge-program/1"
INLINE_MAX_BYTES = 64 * 1024 * 1024  # buffers/constants above this are only referenced


class ProgramFileError(HetforgeError):
    """A saved program cannot be loaded or does not match the model it is bound to (exit code 1)."""


class MalformedProgramError(UsageError, ProgramFileError):
    """A program file that is JSON but not a well-formed program: a wrong field, a cut-off list (exit code 2)."""


# --- the file's shape, checked before anything is built from it ------------------------------------------------
_Id = Annotated[int, Field(strict=True, ge=0)]
_Dim = Annotated[int, Field(strict=True, ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _ValueSpec(_Model):
    id: _Id
    shape: list[_Dim]
    stride: list[Annotated[int, Field(strict=True)]]
    dtype: str
    kind: Literal["input", "weight", "temp", "output"]
    device: str
    producer: _Id | None
    alias_of: _Id | None
    offset: _Dim
    name: str


class _InstrSpec(_Model):
    id: _Id
    op: str
    args: list[Any]
    kwargs: dict[str, Any]
    outputs: list[_Id]
    device: str
    kind: Literal["kernel", "view", "inplace", "transfer"]
    attrs: dict[str, Any]


class _WeightSpec(_Model):
    value: _Id
    path: str
    shape: list[_Dim]
    dtype: str
    checksum: str
    param: bool = True
    inline: str | None = None


class _ProgramSpec(_Model):
    format: str
    name: str
    soc: str
    devices: list[str]
    values: list[_ValueSpec]
    instrs: list[_InstrSpec]
    inputs: list[_Id]
    outputs: list[Any]
    weights: list[_WeightSpec]
    attrs: dict[str, Any]
    soc_profile: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None


def _where(loc: tuple, d: dict[str, Any]) -> str:
    """``instrs[12].outputs[0]`` for a pydantic error location."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validate_program_dict(d: Any, label: str) -> None:
    """Refuse a JSON document that is not a well-formed program, naming the first bad field in one line."""
    if not isinstance(d, dict):
        raise MalformedProgramError(f"{label} is not a program file (a JSON {type(d).__name__}, not an object)")
    try:
        _ProgramSpec.model_validate(d)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        msg = "missing (required field)" if first.get("type") == "missing" else first["msg"]
        more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
        raise MalformedProgramError(f"{label} is malformed: field '{_where(first['loc'], d)}': {msg}{more}") \
            from None
    for i, v in enumerate(d["values"]):
        if len(v["shape"]) != len(v["stride"]):
            raise MalformedProgramError(f"{label} is malformed: values[{i}] has {len(v['shape'])} dims but "
                                        f"{len(v['stride'])} strides")
    for where, items in (("values", d["values"]), ("weights", d["weights"])):
        for i, v in enumerate(items):
            try:
                dtype_from_short(v["dtype"])
            except ValueError:
                raise MalformedProgramError(f"{label} is malformed: {where}[{i}].dtype '{v['dtype']}' is not a "
                                            "dtype this PyTorch knows") from None


def checksum(t: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes (contiguous, on the CPU)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def resolve_op(name: str) -> Any:
    """The callable for an op name written by lowering (``aten.add.Tensor``, ``getitem``...)."""
    if name == "transfer":
        return None
    if hasattr(operator, name) and "." not in name:
        return getattr(operator, name)
    parts = name.split(".")
    if len(parts) == 3:
        ns, op, overload = parts
        if ns == "hetforge":
            import hetforge.ops  # noqa: F401  (registers the hetforge:: custom ops)
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (AttributeError, RuntimeError):
            pass
    raise ProgramFileError(f"op '{name}' is not known to this PyTorch/hetforge installation")


def _enc(x: Any) -> Any:
    if isinstance(x, Reg):
        return {"r": x.id}
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else {"f": str(x)}
    if isinstance(x, torch.dtype):
        return {"dtype": dtype_short(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).replace("torch.", "")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).replace("torch.", "")}
    if isinstance(x, tuple):
        return {"tuple": [_enc(a) for a in x]}
    if isinstance(x, list):
        return [_enc(a) for a in x]
    if isinstance(x, dict):
        return {"dict": {k: _enc(v) for k, v in x.items()}}
    raise ProgramFileError(f"cannot serialize argument of type {type(x).__name__}: {x!r}")


def _dec(x: Any) -> Any:
    if isinstance(x, list):
        return [_dec(a) for a in x]
    if not isinstance(x, dict):
        return x
    if len(x) != 1:
        raise MalformedProgramError(f"unknown encoded argument {x!r}")
    (k, v), = x.items()
    if k == "r":
        return Reg(v)
    if k == "f":
        return float(v)
    if k == "dtype":
        return dtype_from_short(v)
    if k == "device":
        return torch.device(v)
    if k == "layout":
        return getattr(torch, v)
    if k == "memory_format":
        return getattr(torch, v)
    if k == "tuple":
        return tuple(_dec(a) for a in v)
    if k == "dict":
        return {kk: _dec(vv) for kk, vv in v.items()}
    raise MalformedProgramError(f"unknown encoded argument {x!r}")


def program_to_dict(p: Program, inline: bool = True) -> dict[str, Any]:
    """``p`` as a JSON-able dict. ``inline=False`` leaves the tensors the passes made out of the dict (no
    ``inline`` bytes): for a caller that stores them itself, as the compile cache does."""
    values = [
        {"id": v.id, "shape": list(v.shape), "stride": list(v.stride), "dtype": dtype_short(v.dtype), "kind": v.kind,
         "device": v.device, "producer": v.producer, "alias_of": v.alias_of, "offset": v.storage_offset,
         "name": v.name}
        for v in p.values.values()
    ]
    instrs = [
        {"id": i.id, "op": i.op, "args": _enc(list(i.args)), "kwargs": _enc(i.kwargs), "outputs": list(i.outputs),
         "device": i.device, "kind": i.kind, "attrs": _enc(i.attrs)}
        for i in p.instrs
    ]
    weights = []
    for vid, w in p.weights.items():
        t = p.tensors.get(vid)
        if not w.checksum and t is not None:
            w.checksum = checksum(t)
        if inline and w.inline is None and not w.param and t is not None and t.nbytes <= INLINE_MAX_BYTES:
            w.inline = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        d = {"value": vid, "path": w.path, "shape": list(w.shape), "dtype": dtype_short(w.dtype),
             "checksum": w.checksum, "param": w.param}
        if inline and w.inline is not None:
            d["inline"] = base64.b64encode(w.inline).decode()
        weights.append(d)
    d = {"format": FORMAT, "name": p.name, "soc": p.soc, "devices": p.devices, "values": values,
         "instrs": instrs, "inputs": p.inputs, "outputs": _enc(list(p.outputs)), "weights": weights,
         "attrs": _enc(p.attrs)}
    if p.soc_spec is not None:  # the whole profile the program was compiled for, so run-plan uses that one
        d["soc_profile"] = {"name": p.soc, "sha256": spec_digest(p.soc_spec), "spec": p.soc_spec}
    if p.memory is not None:  # arena offsets, re-checked against the instructions on load
        d["memory"] = p.memory
    return d


def save_program(p: Program, path: str | Path, what: str = "") -> Path:
    """Write ``p`` as JSON, atomically (:func:`hetforge.files.write_text`: nothing half-written, mode per umask)."""
    path = check_output(path, what, example="plan.json")
    return write_text(path, json.dumps(program_to_dict(p), indent=1), what)


def _lookup_tensor(module: torch.nn.Module, path: str) -> torch.Tensor | None:
    obj: Any = module
    for part in path.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj if isinstance(obj, torch.Tensor) else None


def program_from_dict(d: dict[str, Any], module: torch.nn.Module | None = None, check: bool = True,
                      label: str = "the program", verify: bool = True) -> Program:
    """Rebuild a Program from its JSON form (checked field by field first), weights bound against ``module``;
    ``verify`` runs the program verifier (:mod:`hetforge.ir.verify`, with any saved memory plan) on it."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        fmt = d.get("format") if isinstance(d, dict) else None
        raise ProgramFileError(f"not a hetforge program file (format {fmt!r}, expected {FORMAT})")
    validate_program_dict(d, label)
    try:
        p = _build_program(d)
    except MalformedProgramError as e:
        raise MalformedProgramError(f"{label} is malformed: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as e:
        raise MalformedProgramError(f"{label} is malformed: {type(e).__name__}: {e}") from None
    from hetforge.ir.verify import ProgramVerifyError, verify_program

    try:
        if verify:
            verify_program(p, stage="load")
    except ProgramVerifyError as e:
        raise MalformedProgramError(f"{label} is malformed: {e}") from None
    for vid, ref in p.weights.items():
        p.tensors[vid] = bind_weight(ref, module, check)
    return p


def _build_program(d: dict[str, Any]) -> Program:
    p = Program(d["name"], d["soc"], list(d["devices"]))
    for v in d["values"]:
        if v["id"] in p.values:
            raise ValueError(f"value %{v['id']} is declared twice")
        p.values[v["id"]] = Value(v["id"], tuple(v["shape"]), tuple(v["stride"]), dtype_from_short(v["dtype"]),
                                  v["kind"], v["device"], v["producer"], v["alias_of"], v["offset"], v["name"])
    for i in d["instrs"]:
        p.instrs.append(Instr(i["id"], i["op"], tuple(_dec(i["args"])), _dec(i["kwargs"]), tuple(i["outputs"]),
                              i["device"], i["kind"], _dec(i["attrs"]), resolve_op(i["op"])))
    p.inputs = list(d["inputs"])
    p.outputs = _dec(d["outputs"])
    p.attrs = _dec(d["attrs"])
    for w in d["weights"]:
        inline = base64.b64decode(w["inline"], validate=True) if w.get("inline") is not None else None
        ref = WeightRef(w["path"], tuple(w["shape"]), dtype_from_short(w["dtype"]), w["checksum"], inline,
                        bool(w.get("param", True)))
        if inline and len(inline) != math.prod(ref.shape) * torch.empty((), dtype=ref.dtype).element_size():
            raise ValueError(f"weight '{ref.path}' has {len(inline)} inline bytes, not {list(ref.shape)} of "
                             f"{dtype_short(ref.dtype)}")
        p.weights[w["value"]] = ref
    prof = d.get("soc_profile")
    if prof is not None:
        spec, digest = prof.get("spec"), prof.get("sha256")
        if not isinstance(spec, dict) or digest != spec_digest(spec):
            raise ValueError("its embedded SoC profile does not match its sha256 (edited or cut off)")
        p.soc_spec = spec
    if d.get("memory") is not None:
        p.memory = d["memory"]
    return p


def spec_digest(spec: dict[str, Any]) -> str:
    """sha256 of a SoC profile's canonical JSON (sorted keys): two profiles with equal figures match."""
    return "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def bind_weight(ref: WeightRef, module: torch.nn.Module | None, check: bool = True) -> torch.Tensor:
    """The tensor ``ref`` names: read from ``module`` (checked), else its inline copy."""
    t = _lookup_tensor(module, ref.path) if module is not None else None
    if t is None:
        if ref.inline is None:
            where = f"in {type(module).__name__}" if module is not None else "(no model given)"
            raise ProgramFileError(f"weight '{ref.path}' not found {where}; load the program against the model "
                                   "it was compiled from")
        if not ref.inline:
            return torch.empty(ref.shape, dtype=ref.dtype)
        return torch.frombuffer(bytearray(ref.inline), dtype=ref.dtype).reshape(ref.shape)
    if tuple(t.shape) != ref.shape or t.dtype != ref.dtype:
        raise ProgramFileError(f"weight '{ref.path}' is {dtype_short(t.dtype)}{list(t.shape)} in the model but "
                               f"{dtype_short(ref.dtype)}{list(ref.shape)} in the program")
    if check and checksum(t) != ref.checksum:
        raise ProgramFileError(f"weight '{ref.path}' has checksum {checksum(t)} in the model but {ref.checksum} in "
                               "the program (different weights)")
    return t.detach()


def load_program(path: str | Path, module: torch.nn.Module | None = None, check: bool = True,
                 verify: bool = True) -> Program:
    """Read a program file, check it (shape, then the program verifier) and bind its weights against ``module``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"program file '{path}' does not exist")
    d = read_json(path, lambda e: MalformedProgramError(f"'{path}' is not a program file: {e}"))
    if not isinstance(d, dict):
        raise MalformedProgramError(f"'{path}' is not a program file")
    return program_from_dict(d, module, check, label=f"program file '{path}'", verify=verify)
