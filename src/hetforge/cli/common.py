"""Shared CLI pieces: the Typer app, the console, JSON output and error → exit-code mapping.

Each command module in ``hetforge.cli.commands`` registers its commands on ``app``; ``main`` imports
them all, so adding a command is adding one file.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click
import typer
import typer.rich_utils
from rich.console import Console
from rich.markup import escape

from hetforge.errors import HetforgeError
from hetforge.files import json_safe

app = typer.Typer(
    name="hetforge",
    help="hetforge: a transparent compiler and runtime that runs LLMs across the CPU, GPU and NPU of one device.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _one_line_click_error(e: click.ClickException) -> None:
    """Typer/click's own usage errors (a bad option value, a missing argument) as one line, like hetforge's."""
    if e.__class__.__name__ == "NoArgsIsHelpError":  # help was printed instead
        return
    ctx = getattr(e, "ctx", None)
    hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    msg = " ".join(e.format_message().split())
    err_console.print(f"[bold red]error:[/] {escape(msg)}{escape(hint)}", highlight=False, soft_wrap=True)


# typer prints click errors through this function (a usage line, a hint line and a boxed message): one line instead
typer.rich_utils.rich_format_error = _one_line_click_error


def emit_json(obj: Any) -> None:
    """Print one JSON document to stdout (nothing else goes to stdout with --json)."""
    sys.stdout.write(json.dumps(json_safe(obj), indent=2, default=str) + "\n")
    sys.stdout.flush()


def handles_errors(fn: Callable) -> Callable:
    """Turn a HetforgeError into one readable line on stderr and its exit code (1, or 2 for usage)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HetforgeError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper
