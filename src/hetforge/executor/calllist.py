"""Runs of native kernel calls in generated code, each made one ``hf_run_calls`` call (:class:`native.CallList`).

A decode step's code is mostly native calls whose arguments are literals baked in at build time (arena slices and
weights never move), with register bindings between them (``r5 = _b5``, ``r4 = None``). Each call from Python costs
about a microsecond of ctypes argument conversion plus the interpreter's statements; a step of a 12-layer model makes
~150 of them. Here such a run of two calls or more becomes one call of a :class:`~hetforge.kernels.native.CallList`
that runs them in C, in the same order, on the same threads; the bindings follow it unchanged (they only name tensors,
and no call in the run reads a register). Anything else (an ATen op, a pointer read per call, a fresh tensor) ends a
run. Each kernel's status is checked as before: a failing call raises its own error, and no later call of its run
runs.
"""

from __future__ import annotations

import ast
import ctypes
import re
from typing import Any

import torch

from hetforge.kernels import native

_CHECKS = (native.check_rc, native.check_q4_rc, native.check_few_rc)
_KERNEL = re.compile(r"\b_(nk|mg)\d+[.(]")  # a line that may call a kernel (the executor's const names)
# a statement that only names tensors (``r1 = _b1``, ``r1 = r2 = None``, ``r1, r2 = _s1, _s2``): runs nothing
_BINDING = re.compile(r"^(r\d+(, r\d+)* = )+(None|\w+(, \w+)*)$")


def _literal(node: ast.expr, nt_name: str) -> Any:
    """The value of a literal argument (int, float, None; the thread-count call as :data:`native.NT`), or raise."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == nt_name \
            and not node.args and not node.keywords:
        return native.NT
    value = ast.literal_eval(node)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    raise ValueError(f"not a literal argument: {ast.unparse(node)}")


def _kernel_call(stmt: ast.stmt, g: dict[str, Any], table: dict[str, int], nt_name: str) \
        -> tuple[str, list[Any], Any] | None:
    """``(kernel, arguments, check)`` when ``stmt`` is one native call with literal arguments (bare, under a status
    check, or a :class:`native.MultiArgs` group's ``.call``), else None."""
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return None
    call, check = stmt.value, None
    if isinstance(call.func, ast.Name) and g.get(call.func.id) in _CHECKS and len(call.args) == 2 \
            and isinstance(call.args[0], ast.Call) and not call.keywords:
        check, call = g[call.func.id], call.args[0]
    if call.keywords:
        return None
    try:
        args = [_literal(a, nt_name) for a in call.args]
    except ValueError:
        return None
    f = call.func
    if check is None and isinstance(f, ast.Attribute) and f.attr == "call" and isinstance(f.value, ast.Name) \
            and isinstance(g.get(f.value.id), native.MultiArgs) and len(args) == 3:
        return "hf_gemv_nk_multi", g[f.value.id].args(*args), native.check_multi_rc
    if not isinstance(f, ast.Name):
        return None
    fn = g.get(f.id)
    name = getattr(fn, "__name__", None)
    if not isinstance(fn, ctypes._CFuncPtr) or name not in table or len(args) != len(native.SIGNATURES[name]):
        return None
    return name, args, check


def batch_native_calls(lines: list[str], g: dict[str, Any], hint: str = "cl") -> tuple[list[str], int, int]:
    """``lines`` (generated statements, ``; ``-joined per line, no blocks) with every run of two native calls or more
    made one :class:`native.CallList` call, the list bound in ``g``; also returns (lists made, calls they run)."""
    table = native.call_table()
    if not table:
        return lines, 0, 0
    nt_name = next((k for k, v in g.items() if v is torch.get_num_threads), None)
    if nt_name is None:
        return lines, 0, 0
    stmts: list[tuple[str, str]] = []  # (kind: call | bind | other, text); only lines naming a kernel are parsed
    calls: dict[int, tuple[str, list[Any], Any]] = {}
    for line in lines:
        if not _KERNEL.search(line):
            stmts.append(("bind" if _BINDING.match(line) else "other", line))
            continue
        try:
            pieces = [(text, ast.parse(text).body) for text in line.split("; ")]
        except SyntaxError:  # "; " inside a statement: the line stays whole, as one statement
            stmts.append(("other", line))
            continue
        for text, body in pieces:
            got = _kernel_call(body[0], g, table, nt_name) if len(body) == 1 else None
            if got is not None:
                calls[len(stmts)] = got
                stmts.append(("call", text))
            else:
                stmts.append(("bind" if _BINDING.match(text) else "other", text))
    out: list[str] = []
    run: list[tuple[str, list[Any], Any]] = []
    held: list[tuple[bool, str]] = []  # the run's statements in order: (is a native call, its text)
    lists = batched = 0

    def close() -> None:
        nonlocal lists, batched
        if len(run) >= 2:
            name = f"_{hint}{len(g)}"
            g[name] = native.CallList(list(run))
            out.append("; ".join([f"{name}.run({nt_name}())", *(t for call, t in held if not call)]))
            lists += 1
            batched += len(run)
        elif held:
            out.append("; ".join(t for _, t in held))
        run.clear()
        held.clear()

    for k, (kind, text) in enumerate(stmts):
        if kind == "call":
            run.append(calls[k])
            held.append((True, text))
        elif run and kind == "bind":
            held.append((False, text))
        else:
            close()
            out.append(text)
    close()
    return out, lists, batched
