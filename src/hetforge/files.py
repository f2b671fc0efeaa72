"""Files the user names: input checks that say what is wrong, and atomic output files.

Every command that writes a file goes through :func:`atomic_path` (or :func:`write_text`, :func:`write_json`,
:func:`save_figure` built on it). The data goes to a temporary file with a unique name in the target folder,
created with mode ``0666 & ~umask`` (so plans, traces and plots get the same mode as any other file the user
writes), and is renamed onto the target only when complete; on any failure, including Ctrl-C, the temporary
file is removed. :func:`check_output` runs the same checks up front, so a command refuses a bad path before
it does any work. Each refusal is one line: a user mistake (missing folder, a folder where a file is expected,
a path under a regular file, an unwritable folder, a wrong extension) is a :class:`UsageError` (exit 2); a
failure the user did not cause (disk full) a :class:`HetforgeError` (exit 1).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hetforge.errors import HetforgeError, UsageError

_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOENT,
                errno.ENAMETOOLONG, errno.ELOOP}


def _label(what: str, path: Path) -> str:
    return f"{what} '{path}'" if what else f"'{path}'"


def _file_ancestor(path: Path) -> Path | None:
    """The first ancestor of ``path`` that exists but is not a folder (``a.txt`` in ``a.txt/b/c``), if any."""
    for anc in reversed(path.parents):
        if anc.exists() and not anc.is_dir():
            return anc
    return None


def check_output(path: str | Path, what: str = "", suffixes: tuple[str, ...] | None = None,
                 example: str = "out.txt", probe: bool = True) -> Path:
    """Refuse an output path that cannot be written (UsageError, one line), before any work is done.

    ``what`` names the option (``--out``); ``suffixes`` are the allowed extensions (lower case, with the dot);
    ``probe`` creates and removes an empty temporary file in the folder to be sure it can be written."""
    path = Path(path)
    label = _label(what, path)
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise UsageError(f"{label}: the file must end in {' or '.join(suffixes)}")
    if path.is_dir():
        raise UsageError(f"{label} is a folder; give a file name such as '{path / example}'")
    bad = _file_ancestor(path)
    if bad is not None:
        raise UsageError(f"{label}: '{bad}' is a file, not a folder")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{label}: folder '{parent}' does not exist")
    if path.exists() and not path.is_file():
        raise UsageError(f"{label} exists and is not a regular file; give another name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{label}: folder '{parent}' is not writable (permission denied)")
    if probe:  # os.access says yes to root even on a read-only or special filesystem: try for real
        tmp = _temp_name(path)
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except OSError as e:
            raise _os_error(e, path, what) from None
        tmp.unlink(missing_ok=True)
    return path


def check_output_dir(path: str | Path, what: str = "") -> Path:
    """A folder to write into (made later if missing): refuse a regular file there or above it, or an existing
    folder that cannot be written, before any work is done (UsageError, one line)."""
    path = Path(path)
    label = _label(what, path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{label} is a file, not a folder")
    bad = _file_ancestor(path)
    if bad is not None:
        raise UsageError(f"{label}: '{bad}' is a file, not a folder")
    if path.is_dir():
        check_output(path / "probe.txt", what)
    return path


def check_input_file(path: str | Path, what: str, hint: str = "") -> Path:
    """An input file that must exist and be a regular file; a folder or a missing file is a one-line UsageError."""
    path = Path(path)
    tail = f" ({hint})" if hint else ""
    if path.is_dir():
        raise UsageError(f"{what} '{path}' is a folder, not a file{tail}")
    if not path.exists():
        bad = _file_ancestor(path)
        if bad is not None:
            raise UsageError(f"{what} '{path}' does not exist: '{bad}' is a file, not a folder")
        raise UsageError(f"{what} '{path}' does not exist{tail}")
    if not path.is_file():
        raise UsageError(f"{what} '{path}' is not a regular file{tail}")
    return path


def _os_error(e: OSError, path: Path, what: str) -> HetforgeError:
    label = _label(what, path)
    reason = e.strerror or str(e)
    if e.errno in _USER_ERRNOS:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return UsageError(f"cannot write {label}: folder '{path.parent}' is not writable ({reason})")
        return UsageError(f"cannot write {label}: {reason}")
    return HetforgeError(f"cannot write {label}: {reason}")


def _temp_name(path: Path) -> Path:
    # the suffix is kept so writers that pick a format by extension (matplotlib) still work
    return path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: str | Path, what: str = "", suffixes: tuple[str, ...] | None = None) -> Iterator[Path]:
    """Yield a new, empty temporary file next to ``path``; on normal exit it is renamed onto ``path``.

    On any exception (including KeyboardInterrupt) the temporary file is removed and ``path`` is untouched;
    an ``OSError`` becomes a one-line :class:`HetforgeError` (a :class:`UsageError` when the user can fix it)."""
    path = check_output(path, what, suffixes, probe=False)
    tmp = _temp_name(path)
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies, as for any new file
        os.close(fd)
    except OSError as e:
        raise _os_error(e, path, what) from None
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _os_error(e, path, what) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | Path, data: bytes, what: str = "") -> Path:
    """Write ``data`` to ``path`` atomically."""
    path = Path(path)
    with atomic_path(path, what) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def write_text(path: str | Path, text: str, what: str = "") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"), what)


def read_json(path: Path, fail: Callable[[Exception], Exception]) -> Any:
    """The JSON document in ``path``; ``fail(error)`` is raised (without a traceback chain) when the file is not
    UTF-8 JSON, so each caller keeps its own one-line message and error type."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(e) from None


def json_safe(o: Any) -> Any:
    """``o`` with NaN/inf floats as strings and dict keys as strings, so ``json.dumps`` writes strict JSON."""
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return str(o)
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def write_json(path: str | Path, obj: Any, what: str = "", indent: int | None = None) -> Path:
    """Serialize ``obj`` first (a serialization error leaves nothing behind), then write it atomically."""
    return write_text(path, json.dumps(obj, indent=indent) + ("\n" if indent is not None else ""), what)


def save_figure(fig: Any, path: str | Path, what: str = "", suffixes: tuple[str, ...] = (".png", ".svg"),
                **kwargs: Any) -> Path:
    """``fig.savefig`` to ``path`` atomically; the extension must be one of ``suffixes`` (it picks the format)."""
    path = Path(path)
    with atomic_path(path, what, suffixes) as tmp:
        fig.savefig(tmp, format=path.suffix.lower().lstrip("."), **kwargs)
    return path
