"""Find, read and validate SoC profiles: shipped ones, the calibrated host, or a user's file."""

from __future__ import annotations

import contextlib
import json
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from hetforge.errors import UsageError
from hetforge.files import check_input_file, write_text
from hetforge.hardware.profile import DeviceProfile, LinkProfile, SocProfile
from hetforge.hardware.schema import DeviceSpec, SocSpec, format_validation_error

HOST = "host"


def cache_dir() -> Path:
    """Per-user cache folder: ``$HETFORGE_CACHE`` or ``$XDG_CACHE_HOME/hetforge`` or ``~/.cache/hetforge``."""
    if os.environ.get("HETFORGE_CACHE"):
        return Path(os.environ["HETFORGE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetforge"


def host_profile_path() -> Path:
    """Where ``hetforge calibrate`` writes the host profile by default (``HETFORGE_HOST_PROFILE`` overrides)."""
    if os.environ.get("HETFORGE_HOST_PROFILE"):
        return Path(os.environ["HETFORGE_HOST_PROFILE"])
    return cache_dir() / "host.json"


def _shipped() -> dict[str, object]:
    root = resources.files("hetforge") / "profiles"
    out = {}
    for f in root.iterdir():
        if f.name.endswith(".json"):
            out[f.name[:-5]] = f
    return dict(sorted(out.items()))


def list_socs() -> list[str]:
    """Names of the shipped SoC profiles, plus ``host``."""
    return [*_shipped(), HOST]


def load_soc(name_or_path: str) -> SocProfile:
    """Load a shipped profile by name, ``host`` (calibrated, or the default), or a profile file by path."""
    shipped = _shipped()
    if name_or_path in shipped:
        return _load_text(shipped[name_or_path].read_text(), f"{name_or_path} (shipped)")
    if name_or_path == HOST:
        p = host_profile_path()
        if p.is_file():
            return load_file(p)
        if p.exists():  # a folder (or a device) where the profile file should be
            env = " (HETFORGE_HOST_PROFILE)" if os.environ.get("HETFORGE_HOST_PROFILE") else ""
            check_input_file(p, f"host profile{env}", "write one with `hetforge calibrate --out FILE`")
        from hetforge.hardware.host import default_host_spec

        return build(default_host_spec(), "host (built-in default, not calibrated)")
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists() or os.sep in name_or_path:
        check_input_file(p, "SoC profile file")
        return load_file(p)
    raise UsageError(f"unknown SoC '{name_or_path}'; known: {', '.join(list_socs())} (or a path to a profile .json)")


def load_file(path: Path) -> SocProfile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read SoC profile '{path}': {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"invalid SoC profile '{path}': not a text (UTF-8 JSON) file") from None
    prof = _load_text(text, str(path))
    return prof


@lru_cache(maxsize=64)
def _load_text(text: str, label: str) -> SocProfile:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"invalid SoC profile '{label}': not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        spec = SocSpec.model_validate(raw)
    except ValidationError as e:
        raise UsageError(format_validation_error(label, e)) from None
    return build(spec, label)


def _device(d: DeviceSpec) -> DeviceProfile:
    sources = {k: getattr(d, k).model_dump() for k in ("mem_bandwidth", "mem_capacity", "tdp_w", "idle_w",
                                                        "dispatch_s")}
    sources.update({f"peak_flops.{k}": v.model_dump() for k, v in d.peak_flops.items()})
    if d.unsupported_ops_source:
        sources["unsupported_ops"] = {"source": d.unsupported_ops_source}
    if d.efficiency_source:
        sources["efficiency"] = {"source": d.efficiency_source}
    if d.cache_bytes is not None:
        sources["cache_bytes"] = d.cache_bytes.model_dump()
    for k in ("compute_efficiency", "bandwidth_efficiency", "switch_overhead_us"):
        if getattr(d, k) is not None:
            sources[k] = getattr(d, k).model_dump()
    return DeviceProfile(
        name=d.name, kind=d.kind,
        peak_flops={k: v.value for k, v in d.peak_flops.items()},
        mem_bandwidth=d.mem_bandwidth.value, mem_capacity=int(d.mem_capacity.value),
        tdp_w=d.tdp_w.value, idle_w=d.idle_w.value, dispatch_s=d.dispatch_s.value,
        static_shapes=d.static_shapes,
        dtypes=frozenset(d.dtypes if d.dtypes is not None else d.peak_flops.keys()),
        unsupported_ops=frozenset(d.unsupported_ops), efficiency=dict(d.efficiency),
        overhead_s=dict(d.overhead_s), cache_bytes=d.cache_bytes.value if d.cache_bytes is not None else 0.0,
        t_ref_c=d.t_ref_c, thermal_sigma_c=d.thermal_sigma_c, cpq_threshold=d.cpq_threshold, sources=sources,
        compute_efficiency=d.compute_efficiency.value if d.compute_efficiency is not None else 1.0,
        bandwidth_efficiency=d.bandwidth_efficiency.value if d.bandwidth_efficiency is not None else 1.0,
        switch_overhead_us=d.switch_overhead_us.value if d.switch_overhead_us is not None else 0.0,
    )


def build(spec: SocSpec, label: str) -> SocProfile:
    """Turn a validated spec into a :class:`SocProfile` (devices ordered CPU first, then GPU, then NPU)."""
    order = {"cpu": 0, "gpu": 1, "npu": 2}
    devs = sorted((_device(d) for d in spec.devices), key=lambda d: order[d.kind])
    links = [LinkProfile(ln.a, ln.b, ln.bandwidth.value, ln.latency_s.value, ln.unified, ln.energy_per_byte_j.value)
             for ln in spec.links]
    return SocProfile(spec.name, devs, links, spec.description, spec.source, spec.calibrated, label,
                      spec=spec.model_dump(mode="json"))


def from_spec_dict(raw: dict, label: str) -> SocProfile:
    """A profile from an already-parsed profile document (the one a plan file embeds), validated."""
    try:
        return build(SocSpec.model_validate(raw), label)
    except ValidationError as e:
        raise UsageError(format_validation_error(label, e)) from None


def save_spec(spec: SocSpec, path: Path) -> Path:
    """Write a profile file atomically (temporary file + rename); creates the folder if needed."""
    path = Path(path)
    with contextlib.suppress(OSError):  # a folder that cannot be made is reported by write_text, in one line
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, spec.model_dump_json(indent=1, exclude_defaults=False) + "\n", "SoC profile")
    _load_text.cache_clear()
    return path
