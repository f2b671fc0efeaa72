"""Kernel problems in the KernelBench format: a ``Model`` (the PyTorch reference), ``get_inputs()`` and
``get_init_inputs()``. A candidate solution is a Python file that defines ``ModelNew`` with the same
constructor arguments and forward signature.

The shipped set lives in ``hetforge/kforge/problems/``; any folder or file in the same format works.
Names are checked statically (AST) so a malformed file is reported without running it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from hetforge.errors import UsageError

SHIPPED_DIR = Path(__file__).parent / "problems"
REQUIRED = ("Model", "get_inputs", "get_init_inputs")


@dataclass(frozen=True)
class Problem:
    """One problem file: its name, path, source text and one-line description."""

    name: str
    path: Path
    source: str
    description: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @property
    def category(self) -> str:
        d = self.description
        return d[d.rfind("(") + 1: d.rfind(")")] if d.endswith(").") else "other"

    def load(self) -> ModuleType:
        """Import the problem file as a fresh module (the reference code is trusted: it is the user's spec)."""
        return load_module(self.path, f"kforge_problem_{self.name}")


def defined_names(source: str) -> set[str]:
    """Top-level classes, functions and assigned names of a module's source."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def read_problem(path: Path) -> Problem:
    """Read and validate one problem file; a missing name raises a UsageError naming it."""
    if not path.is_file():
        raise UsageError(f"problem file '{path}' does not exist")
    try:
        source = path.read_text()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError) as e:
        raise UsageError(f"problem file '{path}' is not valid Python: {e}") from None
    missing = [n for n in REQUIRED if n not in defined_names(source)]
    if missing:
        raise UsageError(f"problem file '{path}' lacks {', '.join(missing)} (the format needs Model, get_inputs and "
                         "get_init_inputs)")
    doc = (ast.get_docstring(tree) or path.stem).strip().splitlines()[0]
    return Problem(path.stem, path.resolve(), source, doc)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.py") if not p.name.startswith("_"))


def resolve(spec: str) -> list[Problem]:
    """Problems from a spec: ``all``, a shipped name, a comma-separated list of those, a folder or a file."""
    out: list[Problem] = []
    for part in [s.strip() for s in spec.split(",") if s.strip()]:
        p = Path(part)
        if part == "all":
            out += [read_problem(SHIPPED_DIR / f"{n}.py") for n in shipped_names()]
        elif p.is_dir():
            files = sorted(f for f in p.glob("*.py") if not f.name.startswith("_"))
            if not files:
                raise UsageError(f"problem folder '{p}' holds no .py files")
            out += [read_problem(f) for f in files]
        elif p.suffix == ".py" or p.exists():
            out.append(read_problem(p))
        elif (SHIPPED_DIR / f"{part}.py").is_file():
            out.append(read_problem(SHIPPED_DIR / f"{part}.py"))
        else:
            raise UsageError(f"unknown problem '{part}': not a file, a folder or a shipped name "
                             f"(see `hetforge kforge problems`)")
    if not out:
        raise UsageError("no problems given")
    seen: dict[str, Problem] = {}
    for pr in out:
        seen.setdefault(pr.name, pr)
    return list(seen.values())


def load_module(path: Path, name: str) -> ModuleType:
    """Import a Python file as a module under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import '{path}'")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
