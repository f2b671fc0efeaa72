"""The layout's rules, checked on the real import graph: imports point down the pipeline, and no cycles.

The layer order lives in ``.importlinter`` (run by hand with ``lint-imports``); docs/architecture.md draws it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", ".importlinter", "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=env)


def test_import_contracts_are_kept():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_the_contract_check_fails_on_a_backward_import(tmp_path):
    """The same tool, on a two-layer package whose lower layer imports the upper one, reports it broken."""
    pkg = tmp_path / "pipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime.py").write_text("from pipe import frontend\n")
    (pkg / "frontend.py").write_text("def capture():\n    from pipe import runtime  # backward\n    return runtime\n")
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = pipe
        [importlinter:contract:layers]
        name = down the pipeline
        type = layers
        layers =
            pipe.runtime
            pipe.frontend
        """))
    r = _lint(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1, r.stdout
    assert "pipe.frontend -> pipe.runtime" in r.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), i.e. import cycles."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in adj:
        if m not in index:
            visit(m)
    return found


def test_no_module_imports_itself_through_others():
    """Module-level cycles (inside one package too, which the layer contract does not see); function-level
    imports count: a cycle dodged by importing inside a function is still a cycle."""
    assert _cycles(grimp.build_graph("hetforge", cache_dir=None)) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "loop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loop import b\n")
    (pkg / "b.py").write_text("def f():\n    from loop import a\n    return a\n")
    (pkg / "c.py").write_text("from loop import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("loop", cache_dir=None)) == [["loop.a", "loop.b"]]
