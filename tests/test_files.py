"""hetforge.files: atomic output files (unique temp names, cleanup, umask modes) and one-line path errors."""

import os
import stat
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from hetforge.errors import HetforgeError, UsageError
from hetforge.files import atomic_path, check_input_file, check_output, save_figure, write_json, write_text
from hetforge.trace import Trace


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_write_text_mode_follows_the_umask(tmp_path, umask022):
    p = write_text(tmp_path / "a.txt", "hello")
    assert p.read_text() == "hello" and _mode(p) == 0o644
    os.umask(0o077)
    q = write_text(tmp_path / "b.txt", "x")
    assert _mode(q) == 0o600


def test_trace_and_json_are_written_0644_like_text(tmp_path, umask022):
    t = Trace("t")
    t.span("measured", "cpu", "op", 0.0, 1e-3, "measured")
    assert _mode(t.write(tmp_path / "trace.json")) == 0o644
    assert _mode(write_json(tmp_path / "plan.json", {"a": 1})) == 0o644


def test_failure_inside_the_block_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_path(target) as tmp:
                tmp.write_text("half")
                raise exc
        assert target.read_text() == "old"
        assert _leftovers(tmp_path, {"out.txt"}) == []


def test_unserializable_json_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        write_json(tmp_path / "x.json", {"a": object()})
    assert list(tmp_path.iterdir()) == []


def test_check_output_names_each_mistake_in_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [
        (tmp_path, "is a folder"),
        (tmp_path / "file" / "x.txt", "is a file, not a folder"),
        (tmp_path / "file" / "deeper" / "x.txt", "is a file, not a folder"),
        (tmp_path / "missing" / "x.txt", "does not exist"),
    ]
    for path, msg in cases:
        with pytest.raises(UsageError, match=msg) as e:
            check_output(path, "--out")
        assert "\n" not in str(e.value) and "--out" in str(e.value)
    with pytest.raises(UsageError, match=r"must end in \.png or \.svg"):
        check_output(tmp_path / "front", "--plot", (".png", ".svg"))
    assert _leftovers(tmp_path, {"file"}) == []


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux sysfs (a folder even root cannot write)")
def test_unwritable_folder_is_a_usage_error_even_for_root():
    try:
        os.close(os.open("/sys/hetforge-probe", os.O_CREAT | os.O_WRONLY))
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    with pytest.raises(UsageError, match="not writable"):
        check_output("/sys/x.txt", "--out")
    with pytest.raises(UsageError, match="not writable"):
        write_text("/sys/x.txt", "x", "--out")


def test_check_input_file_tells_folder_from_missing(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a folder, not a file"):
        check_input_file(tmp_path, "plan file")
    with pytest.raises(UsageError, match="does not exist"):
        check_input_file(tmp_path / "nope.json", "plan file")
    with pytest.raises(UsageError, match="'.*f' is a file, not a folder"):
        check_input_file(tmp_path / "f" / "x.json", "plan file")
    assert check_input_file(tmp_path / "f", "plan file") == tmp_path / "f"


def test_save_figure_writes_the_named_format_and_refuses_no_extension(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    p = save_figure(fig, tmp_path / "f.svg")
    assert p == tmp_path / "f.svg" and p.read_text().lstrip().startswith("<?xml")
    with pytest.raises(UsageError, match="must end in"):
        save_figure(fig, tmp_path / "X")
    plt.close(fig)
    assert _leftovers(tmp_path, {"f.svg"}) == []


def _hammer(args: tuple[str, int]) -> int:
    path, who = args
    for i in range(40):
        write_text(path, f"{who}:{i}\n" * 2000)
    return who


def test_concurrent_writers_to_one_file_never_collide(tmp_path):
    target = tmp_path / "same.txt"
    with ProcessPoolExecutor(6) as ex:
        assert sorted(ex.map(_hammer, [(str(target), w) for w in range(6)])) == list(range(6))
    lines = target.read_text().splitlines()
    assert len(lines) == 2000 and len(set(lines)) == 1  # one writer's whole file, never a mix
    assert _leftovers(tmp_path, {"same.txt"}) == []


def test_disk_errors_other_than_permissions_are_failures_not_usage(tmp_path, monkeypatch):
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(HetforgeError, match="No space left") as e:
        with atomic_path(tmp_path / "x.txt"):
            monkeypatch.setattr(os, "replace", full)
    assert not isinstance(e.value, UsageError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_concurrent_capture_dump_same_file(tmp_path):
    """Three real `hetforge capture --dump same.txt` processes at once all succeed (no shared temp name)."""
    exe = Path(sys.executable).with_name("hetforge")
    target = tmp_path / "same.txt"
    procs = [subprocess.Popen([str(exe), "capture", "gpt2-tiny", "--seq", "4", "--dump", str(target), "--json"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errs = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _ in errs), errs
    assert "GraphModule" in target.read_text()
    assert _leftovers(tmp_path, {"same.txt"}) == []


def test_compile_out_and_text_are_0644_and_leave_no_temp(tmp_path, umask022):
    from typer.testing import CliRunner

    from hetforge.cli.common import app
    from hetforge.cli.main import _load_commands

    _load_commands()
    r = CliRunner().invoke(app, ["compile", "llama-tiny", "--seq", "4", "--out", str(tmp_path / "p.json"),
                                 "--text", str(tmp_path / "p.txt"), "--json"])
    assert r.exit_code == 0, r.output
    assert _mode(tmp_path / "p.json") == 0o644 and _mode(tmp_path / "p.txt") == 0o644
    assert _leftovers(tmp_path, {"p.json", "p.txt"}) == []
