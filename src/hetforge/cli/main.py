"""Entry point: imports every command module so each registers itself on the shared app."""

from __future__ import annotations

import importlib
import pkgutil

from hetforge.cli import commands
from hetforge.cli.common import app


def _load_commands() -> None:
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        importlib.import_module(f"{commands.__name__}.{info.name}")


def main() -> None:
    _load_commands()
    app()


if __name__ == "__main__":
    main()
