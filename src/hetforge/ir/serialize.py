"""Save a :class:`Program` to a JSON file and load it back, weights referenced rather than copied.

A weight is stored as its module path, shape, dtype and a CRC-32 of its bytes. ``load_program``
resolves each path against a module the caller supplies (the model, or the captured GraphModule) and
refuses a tensor whose shape, dtype or checksum differs, naming the path. Small tensors that exist
only inside the graph (lifted constants) travel inline, base64-encoded.

Round trip: ``str(load_program(save_program(p, f), model)) == str(p)`` (the tests check it).
"""

from __future__ import annotations

import base64
import json
import operator
import zlib
from pathlib import Path
from typing import Any

import torch

from hetforge.errors import HetforgeError, UsageError
from hetforge.ir.program import Instr, Program, Reg, Value, WeightRef, dtype_from_short, dtype_short

FORMAT = "hetforge-program/1"
INLINE_MAX_BYTES = 64 * 1024 * 1024  # buffers/constants above this are only referenced


class ProgramFileError(HetforgeError):
    """A saved program cannot be loaded or does not match the model it is bound to (exit code 1)."""


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
            try:
                import hetforge.ops.fused  # noqa: F401  (registers hetforge:: custom ops)
            except ImportError:
                pass
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
    raise ProgramFileError(f"unknown encoded argument {x!r}")


def program_to_dict(p: Program) -> dict[str, Any]:
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
        if w.inline is None and not w.param and t is not None and t.nbytes <= INLINE_MAX_BYTES:
            w.inline = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        d = {"value": vid, "path": w.path, "shape": list(w.shape), "dtype": dtype_short(w.dtype),
             "checksum": w.checksum, "param": w.param}
        if w.inline is not None:
            d["inline"] = base64.b64encode(w.inline).decode()
        weights.append(d)
    return {"format": FORMAT, "name": p.name, "soc": p.soc, "devices": p.devices, "values": values,
            "instrs": instrs, "inputs": p.inputs, "outputs": _enc(list(p.outputs)), "weights": weights,
            "attrs": _enc(p.attrs)}


def save_program(p: Program, path: str | Path, what: str = "") -> Path:
    """Write ``p`` as JSON, atomically (:func:`hetforge.files.write_text`: nothing half-written, mode per umask)."""
    from hetforge.files import check_output, write_text

    path = check_output(path, what, example="plan.json")
    return write_text(path, json.dumps(program_to_dict(p), indent=1), what)


def _lookup_tensor(module: torch.nn.Module, path: str) -> torch.Tensor | None:
    obj: Any = module
    for part in path.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj if isinstance(obj, torch.Tensor) else None


def program_from_dict(d: dict[str, Any], module: torch.nn.Module | None = None, check: bool = True) -> Program:
    if d.get("format") != FORMAT:
        raise ProgramFileError(f"not a hetforge program file (format {d.get('format')!r}, expected {FORMAT})")
    p = Program(d["name"], d["soc"], list(d["devices"]))
    for v in d["values"]:
        p.values[v["id"]] = Value(v["id"], tuple(v["shape"]), tuple(v["stride"]), dtype_from_short(v["dtype"]),
                                  v["kind"], v["device"], v["producer"], v["alias_of"], v["offset"], v["name"])
    for i in d["instrs"]:
        p.instrs.append(Instr(i["id"], i["op"], tuple(_dec(i["args"])), _dec(i["kwargs"]), tuple(i["outputs"]),
                              i["device"], i["kind"], _dec(i["attrs"]), resolve_op(i["op"])))
    p.inputs = list(d["inputs"])
    p.outputs = _dec(d["outputs"])
    p.attrs = _dec(d["attrs"])
    for w in d["weights"]:
        inline = base64.b64decode(w["inline"]) if "inline" in w else None
        ref = WeightRef(w["path"], tuple(w["shape"]), dtype_from_short(w["dtype"]), w["checksum"], inline,
                        bool(w.get("param", True)))
        p.weights[w["value"]] = ref
        p.tensors[w["value"]] = bind_weight(ref, module, check)
    return p


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


def load_program(path: str | Path, module: torch.nn.Module | None = None, check: bool = True) -> Program:
    """Read a program file and bind its weights against ``module``."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"program file '{path}' does not exist")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProgramFileError(f"'{path}' is not a program file: {e}") from None
    if not isinstance(d, dict):
        raise ProgramFileError(f"'{path}' is not a program file")
    return program_from_dict(d, module, check)
