"""The first processor's ``/proc/cpuinfo`` block, parsed in one place for every layer that needs it.

Why a module of its own at the bottom of the layers: the CPU's name and family (recorded with every benchmark),
its flags (checked before ``--precision bf16``) and the native kernels' per-CPU compile-time choices all come from
that block, and the kernels sit below ``hetforge.hardware``, so neither could import the other's parser."""

from __future__ import annotations

import functools
from pathlib import Path

PATH = Path("/proc/cpuinfo")


def parse(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` fields of cpuinfo ``text`` (the first value of a repeated key; the block
    ends at the first line without a colon once a field was read)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if not sep:
            if fields:
                break
            continue
        fields.setdefault(key.strip(), val.strip())
    return fields


@functools.cache
def _host() -> tuple[tuple[str, str], ...]:
    try:
        return tuple(parse(PATH.read_text()).items())
    except OSError:
        return ()


def fields(text: str | None = None) -> dict[str, str]:
    """The first-processor fields of cpuinfo ``text``, or of this host's (read once per process; each call a fresh
    dict, so a caller that edits its copy changes nothing for the others; empty where /proc/cpuinfo cannot be
    read)."""
    return parse(text) if text is not None else dict(_host())


def flag_text(f: dict[str, str]) -> str:
    """The CPU's feature flags as cpuinfo lists them: ``flags`` on x86, ``Features`` on ARM ("" where neither)."""
    return f.get("flags") or f.get("Features") or ""
