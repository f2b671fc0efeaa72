"""What the bench scripts share: raw JSON in, Markdown page out (never figures transcribed by hand).

Each script imports this beside itself (``python bench/x.py`` puts ``bench/`` on the path)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def page_from_json(json_path: str, md_path: str, render: Callable[[dict], str]) -> None:
    """``--from-json``: the page of an earlier run's JSON, written to ``md_path`` (or printed)."""
    md = render(json.loads(Path(json_path).read_text()))
    Path(md_path).write_text(md) if md_path else print(md)


def write_result(result: dict[str, Any], out: str, md_path: str, render: Callable[[dict], str]) -> None:
    """The raw JSON to ``out`` and the page generated from it to ``md_path``; the page is printed when neither
    file is given."""
    if out:
        Path(out).write_text(json.dumps(result, indent=1, default=float) + "\n")
    md = render(result)
    if md_path:
        Path(md_path).write_text(md)
    elif not out:
        print(md)
