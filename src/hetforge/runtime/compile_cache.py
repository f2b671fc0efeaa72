"""The compile cache on disk: the runtime's compiled prefill/decode programs, reused by the next process.

A cold program costs a ``torch.export`` capture, the passes, quantization, placement, lowering, scheduling
and memory planning. Their product — the scheduled, memory-planned :class:`~hetforge.ir.Program` — is
saved here (its JSON form from :mod:`hetforge.ir.serialize`, model parameters referenced by path, tensors
the passes made stored next to it), and the next process that asks for the same program binds it to the
model's weights and builds its executor from it, skipping every step above.

**Key** (sha256 of a JSON document): the format, hetforge's version and a digest of its source files, the
torch version, the model's config, a fingerprint of every weight (CRC-32 of the bytes, names, shapes and
dtypes: any change of any weight gives another key), the executor's options (SoC profile hash, strategy,
objective, quantization, group size, backends, policy, passes on/off), the program (kind and length) and
the GEMM policy (``HETFORGE_GEMM``), and the CPU (model, ISA flags, threads: the entry carries the kernel choices
measured on it).

**Entries** are two files, ``KEY.json`` (header with the key document and the sha256 of the body, then the
body: the program, its weights, and — when every partition runs on hetforge's CPU executor — the partitions
as built: each one's lowered program with its kernel choices and memory plan, so a hit generates the executor
straight from them) and ``KEY.pt`` (tensors the passes made: fused or quantized weights). A
missing, cut-off or edited entry (sha256), one whose key document differs from the one asked for (stale),
whose weights no longer fit, whose memory plan differs from the one this hetforge makes, or whose program
fails the program verifier (run when the whole program is rebuilt: always without built partitions, on first
use with them), is detected, reported in the program's notes, deleted and rebuilt — never used.

**Where**: ``$HETFORGE_COMPILE_CACHE_DIR``, else ``programs/`` in hetforge's cache folder (``$HETFORGE_CACHE``,
else ``$XDG_CACHE_HOME/hetforge``, else ``~/.cache/hetforge``). ``HETFORGE_COMPILE_CACHE=0`` turns it off.

**Size**: at most ``$HETFORGE_COMPILE_CACHE_MAX_GB`` (default :data:`MAX_GB_DEFAULT`) of entries; after each store
the least recently used entries (a hit refreshes an entry's time) are deleted until the folder fits, never the
entry just written, and so are stale leftovers of stores that died (temp files, a tensor file without its entry);
a store that fails removes its own. Every model, weight change, option and program length is its own entry, so
without a bound the folder only grows.
A folder that cannot be written does not stop compilation: one warning on stderr, and programs are compiled
as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hetforge.backends.partition import Partition, PartitionedGraph
from hetforge.compile import row_prune_enabled
from hetforge.kernels import onednn

FORMAT = "hetforge-cache/2"
MAX_GB_DEFAULT = 4.0
MAX_GB_ENV = "HETFORGE_COMPILE_CACHE_MAX_GB"
KEYED = "keyed"  # the checksum field of a parameter in an entry: the key's weight fingerprint covers it
_warned: set[str] = set()
_fingerprints: dict[int, tuple[tuple, str]] = {}
_source_digest: list[str] = []
_cpu: list[list] = []


def warn_once(msg: str) -> None:
    """One line on stderr, once per process per message."""
    if msg not in _warned:
        _warned.add(msg)
        print(f"warning: {msg}", file=sys.stderr)


def cache_state(notes: list[str]) -> str | None:
    """What the compile cache did for a program, from its notes: ``hit``, ``stored``, ``rebuilt`` (a corrupt or
    stale entry deleted and compiled again; ``rebuilt, stored`` when the new one was stored) or None (not used)."""
    got = [n for n in notes if n.startswith("compile cache: ")]
    # a hit on the entry a forked child just built for this request: compiled now, and stored
    child = any(n.startswith("built and stored in the compile cache by a forked child") for n in notes)
    if not child and any(n.startswith("compile cache: hit") for n in got):
        return "hit"
    bad = any(n.endswith(": deleted, rebuilt") for n in got)
    stored = child or any(n.startswith("compile cache: stored") for n in got)
    return ("rebuilt, stored" if stored else "rebuilt") if bad else "stored" if stored else None


def enabled() -> bool:
    return os.environ.get("HETFORGE_COMPILE_CACHE", "1").strip().lower() not in ("0", "off", "no", "false")


def max_bytes() -> int:
    """The folder's size bound (``$HETFORGE_COMPILE_CACHE_MAX_GB``, default :data:`MAX_GB_DEFAULT`); a value that is
    not a positive number is a usage error naming the variable."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    if not raw:
        return int(MAX_GB_DEFAULT * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = float("nan")
    if not gb > 0 or gb == float("inf"):
        from hetforge.errors import UsageError

        raise UsageError(f"{MAX_GB_ENV}={raw!r}: the compile cache's size bound must be a positive number of GB")
    return int(gb * 2**30)


STALE_S = 3600.0  # a temp file, or a tensor file without its entry, this old was left by a store that died


def _remove_leftovers(d: Path) -> None:
    """Delete what stores that died (killed, out of memory) left: ``.KEY.*.PID.tmp`` files and ``KEY.pt`` files
    without their ``KEY.json`` (the size bound counts entries by their JSON, so these would never go). Only files
    older than :data:`STALE_S`: a store in progress writes its two files within seconds."""
    old = time.time() - STALE_S
    try:
        for p in [*d.glob(".*.tmp"), *(t for t in d.glob("*.pt") if not t.with_suffix(".json").exists())]:
            try:
                if p.stat().st_mtime < old:
                    p.unlink()
            except OSError:
                continue
    except OSError:
        return


def evict(keep: str | None = None) -> list[str]:
    """Delete the least recently used entries until the folder is within :func:`max_bytes` (``keep``'s entry is
    never deleted), and stale leftovers of stores that died (:func:`_remove_leftovers`); returns the deleted
    keys."""
    limit = max_bytes()
    d = cache_dir()
    _remove_leftovers(d)
    entries = []
    try:
        for j in d.glob("*.json"):
            key = j.stem
            try:
                st = j.stat()
                size = st.st_size + (d / f"{key}.pt").stat().st_size if (d / f"{key}.pt").exists() else st.st_size
            except OSError:
                continue
            entries.append((st.st_mtime, key, size))
    except OSError:
        return []
    total = sum(e[2] for e in entries)
    gone: list[str] = []
    for _, key, size in sorted(entries):
        if total <= limit:
            break
        if key == keep:
            continue
        _drop(key)
        total -= size
        gone.append(key)
    return gone


def cache_dir() -> Path:
    env = os.environ.get("HETFORGE_COMPILE_CACHE_DIR")
    if env:
        return Path(env)
    from hetforge.hardware.loader import cache_dir as hetforge_cache

    return hetforge_cache() / "programs"


def source_digest() -> str:
    """sha256 of hetforge's own source files (a development checkout changes without a version bump)."""
    if not _source_digest:
        root = Path(__file__).resolve().parents[1]  # the hetforge package (this file is in hetforge/runtime/)
        files = []
        for folder, dirs, names in os.walk(root):  # os.walk, skipping bytecode folders: ~10x faster than rglob
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            files += [Path(folder) / n for n in names if n.endswith((".py", ".c"))]
        h = hashlib.sha256()
        for p in sorted(files):
            if p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
        _source_digest.append(h.hexdigest()[:16])
    return _source_digest[0]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A fingerprint of every parameter and buffer: names, shapes, dtypes and a CRC-32 of the bytes (in a thread
    pool: zlib releases the GIL; a tensor shared by two names, e.g. tied embeddings, is read once). Remembered per
    model object while no tensor is modified in place. A zoo model whose seeded weights are untouched since
    loading is identified by its recipe instead (:func:`hetforge.models.zoo.weights_recipe`: name, seed, dtype,
    torch and transformers versions; the same recipe makes the same bytes), without reading ~0.5 GB."""
    from hetforge.models.zoo import weights_recipe

    items = sorted(model.state_dict(keep_vars=True).items())
    versions = tuple((n, t._version, t.data_ptr()) for n, t in items)
    got = _fingerprints.get(id(model))
    if got is not None and got[0] == versions:
        return got[1]
    h = hashlib.sha256()
    recipe = weights_recipe(model, versions)
    if recipe is not None:
        h.update(f"recipe:{recipe};".encode())
        for n, t in items:
            h.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
    else:
        uniq = {(t.data_ptr(), t.numel(), t.dtype, tuple(t.stride())): t for _, t in items}
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            crcs = dict(zip(uniq, pool.map(_crc, uniq.values()), strict=True))
        for n, t in items:
            h.update(f"{n}:{tuple(t.shape)}:{t.dtype}:{crcs[(t.data_ptr(), t.numel(), t.dtype, tuple(t.stride()))]};"
                     .encode())
    fp = h.hexdigest()[:32]
    _fingerprints[id(model)] = (versions, fp)
    return fp


def _config_text(model: torch.nn.Module) -> str:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        return cfg.to_json_string(use_diff=False)
    return type(model).__qualname__


def executor_options(executor: Any) -> dict[str, Any] | None:
    """The options of a placed executor that shape its programs (None for executors the cache does not hold)."""
    from hetforge.runtime.executors import PlacedExecutor

    if type(executor) is not PlacedExecutor:  # a subclass (e.g. MoE residency) builds programs its own way
        return None
    from hetforge.runtime.genplan import soc_hash

    # the profile terms soc_hash (the profile's JSON form) leaves out but the cost model reads: a situated
    # profile (hardware.situation: a device's temperature, so Φ(T)) places differently and must not share a key
    terms = ("compute_efficiency", "bandwidth_efficiency", "switch_overhead_us", "t_ref_c", "thermal_sigma_c",
             "cpq_threshold", "temp_c")
    return {"soc": executor.soc_profile.name, "soc_hash": soc_hash(executor.soc_profile),
            "device_terms": {d.name: {t: getattr(d, t) for t in terms} for d in executor.soc_profile.devices},
            "strategy": executor.strategy, "objective": executor.objective, "quantize": executor.quantize,
            "group_size": executor.group_size, "backends": dict(sorted(executor.backends.items())),
            "policy": executor.policy}


def key_document(model: torch.nn.Module, options: dict[str, Any], optimize: bool, kind: str,
                 length: int, module: torch.nn.Module | None = None, inputs: tuple = ()) -> dict[str, Any]:
    """What a cache entry is keyed by: everything that shapes the program, including the wrapper module that
    was captured and its example inputs' shapes and dtypes (a batched decode and a batch-1 decode of the same
    cache length are different programs)."""
    import hetforge

    return {"format": FORMAT, "hetforge": hetforge.__version__, "source": source_digest(),
            "torch": torch.__version__, "config": _config_text(model), "weights": weights_fingerprint(model),
            "options": options, "passes": bool(optimize), "program": [kind, int(length)],
            "module": type(module).__qualname__ if module is not None else None,
            "inputs": [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in inputs],
            "gemm": os.environ.get("HETFORGE_GEMM", "auto"), "cpu": _cpu_key(), "w8_act": _w8_act(options),
            "w4_act": _w4_act(options), "row_prune": row_prune_enabled()}


def _w8_act(options: dict[str, Any]) -> str | None:
    """The w8 activation mode (``--w8-act``) of a w8 program (it decides the kernels and the numerics), else None."""
    if options.get("quantize") != "w8":
        return None
    from hetforge.kernels import native

    return native.w8_act_mode()


def _w4_act(options: dict[str, Any]) -> str | None:
    """The w4 activation mode (``--w4-act``) of a w4 program (it decides the kernels and the numerics), else None."""
    if options.get("quantize") != "w4":
        return None
    from hetforge.kernels import native

    return native.w4_act_mode()


def _cpu_key() -> list:
    """The CPU the entry's measured kernel choices (oneDNN or ATen per GEMM shape) and seeded weights were made
    on: model, ISA flags and thread count (a cache folder shared between machines must not carry them over)."""
    if not _cpu:
        from hetforge.hardware.isa import host_record

        r = host_record()
        _cpu.append([r["cpu"], r["machine"], r["isa"]])
    return [*_cpu[0], onednn.threads()]  # the pinned count in a child building for its parent (runtime.ahead)


def holds(programs: Any) -> bool:
    """Whether the cache serves ``programs`` (a ``ProgramCache``): the cache is on, that engine uses it, and its
    executor's programs can be stored."""
    return enabled() and getattr(programs, "disk_cache", True) and executor_options(programs.executor) is not None


def _keyed(programs: Any, kind: str, length: int, module: torch.nn.Module, inputs: tuple) -> tuple[dict, str]:
    doc = key_document(programs.model, executor_options(programs.executor), programs.optimize, kind, length, module,
                       inputs)
    return doc, key_of(doc)


def entry_exists(programs: Any, kind: str, length: int, module: torch.nn.Module, inputs: tuple) -> bool:
    """Whether the cache folder holds an entry under this program's key (not checked: :func:`load` does that)."""
    return holds(programs) and _paths(_keyed(programs, kind, length, module, inputs)[1])[0].exists()


def key_of(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:40]


class CacheEntryError(Exception):
    """An entry that must not be used (the message says why)."""


@dataclass
class _Nodes:
    nodes: list


@dataclass
class _Graph:
    graph: _Nodes


@dataclass
class _QuantNote:
    line: str

    def summary_line(self) -> str:
        return self.line


class CachedResult:
    """What :meth:`~hetforge.runtime.executors.PlacedExecutor.build_program` reads from a compile result,
    rebuilt from a cache entry (the graph itself is not kept: only its node count). ``program`` and ``memory``
    (the whole scheduled program, bound and re-planned) are made on first use when the entry holds the built
    partitions (a hit builds the executor from those and never needs them); ``cached_summary`` is what the
    executor's notes read instead."""

    def __init__(self, program: Any, memory: Any, placement: Any, gm: Any, make: Any = None,
                 cached_summary: tuple | None = None):
        self._program, self._memory, self._make = program, memory, make
        self.placement, self.gm = placement, gm
        self.seconds: dict[str, float] = {}
        self.optimized: Any = None
        self.extra: dict[str, Any] = {}
        self.partition_costs: list | None = None  # modeled, as computed when the entry was made
        self.cached_summary = cached_summary

    def _materialize(self) -> None:
        if self._program is None:
            self._program, self._memory = self._make()

    @property
    def program(self) -> Any:
        self._materialize()
        return self._program

    @property
    def memory(self) -> Any:
        self._materialize()
        return self._memory


def _paths(key: str) -> tuple[Path, Path]:
    d = cache_dir()
    return d / f"{key}.json", d / f"{key}.pt"


def _drop(key: str) -> None:
    for p in _paths(key):
        try:
            p.unlink()
        except OSError:
            pass


def _built_section(placed: Any) -> dict[str, Any] | None:
    """What a hit needs to build the executor without partitioning and lowering again: the partitions' wiring
    and, per partition, its lowered program with the kernels chosen for it (weights by path: the scheduled
    program's weights) and its memory plan's offsets. None when a partition is not on hetforge's CPU executor
    (another backend compiles from the partition's graph: the hit rebuilds that from the program)."""
    from hetforge.ir.serialize import ProgramFileError, _enc, program_to_dict

    top = placed.compiled.program
    paths = {w.path for w in top.weights.values()}
    parts = []
    for part, comp in zip(placed.partitions.partitions, placed.exe.compiled, strict=True):
        exe = getattr(comp, "executable", None)
        if exe is None or any(w.path not in paths for w in exe.program.weights.values()):
            return None
        try:  # no tensors: weights by path only (no checksums, nothing inline)
            pd = program_to_dict(replace(exe.program, tensors={}))
        except ProgramFileError:
            return None
        parts.append({"index": part.index, "device": part.device, "nodes": list(part.nodes),
                      "inputs": list(part.inputs), "outputs": list(part.outputs), "weights": list(part.weights),
                      "program": pd, "offsets": {str(k): v for k, v in exe.plan.offsets.items()}})
    pg = placed.partitions
    return {"partitions": parts, "graph_inputs": list(pg.graph_inputs), "output_args": _enc(pg.output_args),
            "out_spec": top.attrs.get("out_spec"), "fixups": list(pg.fixups),
            "summary": [len(top.instrs), top.count_by_device(), placed.compiled.memory.to_dict()]}


def program_payload(p: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Scheduled program ``p`` as an entry holds it: its dict (:func:`~hetforge.ir.serialize.program_to_dict`;
    the model's parameters by path, neither inlined nor checksummed again) and the tensors the passes made (by
    value id). :func:`bind_program` makes the program again from them and a module's weights."""
    from hetforge.ir.serialize import program_to_dict

    saved = {vid: w.checksum for vid, w in p.weights.items()}
    for w in p.weights.values():
        if w.param and not w.checksum:  # the key's weight fingerprint already covers every parameter: a CRC of
            w.checksum = KEYED  # each one again here cost ~10% of a cold compile (gpt2) and was never read
    try:
        pd = program_to_dict(p, inline=False)  # the entry stores those tensors in KEY.pt, not as base64 text
    finally:
        for vid, w in p.weights.items():
            w.checksum = saved[vid]
    extra: dict[str, torch.Tensor] = {}
    for w in pd["weights"]:
        if not w["param"]:
            extra[str(w["value"])] = p.tensors[w["value"]].detach().contiguous().cpu()
    return pd, extra


def bind_program(pd: dict[str, Any], extra: dict[str, torch.Tensor], module: torch.nn.Module) -> tuple[Any, Any]:
    """The scheduled program and its memory plan from :func:`program_payload`'s parts, bound to ``module``'s own
    weights (no copy) and checked (shape, verifier, memory plan) as a cache hit is; raises
    :class:`CacheEntryError` when they do not fit ``module``."""
    weights = pd["weights"]
    return _program_of(pd, weights, _bound_weights(weights, extra, module))


def store(key: str, doc: dict[str, Any], res: Any, notes: list[str], nodes: int, costs: list | None = None,
          placed: Any = None) -> bool:
    """Write one entry for compile result ``res`` (and its built partitions ``placed``, when given) atomically;
    False (and one warning) when the folder cannot be written."""
    pd, extra = program_payload(res.program)
    placement = res.placement
    quant = res.extra.get("quantize") if isinstance(res.extra, dict) else None
    meta = {"assignment": dict(placement.assignment), "strategy": placement.strategy,
            "objective": placement.objective, "nodes": nodes, "notes": notes,
            "gemm_choices": onednn.measured_choices(),
            "partition_costs": [[c.time_s, c.energy_j, list(c.unknown_ops)] for c in (costs or [])],
            "quantize": quant.report.summary_line() if quant is not None else None,
            "passes": ({"nodes_before": res.optimized.nodes_before, "nodes_after": res.optimized.nodes_after,
                        "fused": dict(res.optimized.fused)} if res.optimized is not None else None),
            "built": _built_section(placed) if placed is not None else None}
    # the whole program as a JSON string inside the body: parsed only when something asks for it (a hit with
    # built partitions never does); its weights beside it, read by every hit
    body = json.dumps({"program": json.dumps(pd, sort_keys=True), "weights": pd["weights"], "meta": meta},
                      sort_keys=True)
    header = {"format": FORMAT, "key": doc, "sha256": hashlib.sha256(body.encode()).hexdigest()}
    jpath, tpath = _paths(key)
    tmp_t = tpath.with_name(f".{tpath.name}.{os.getpid()}.tmp")
    tmp_j = jpath.with_name(f".{jpath.name}.{os.getpid()}.tmp")
    try:
        jpath.parent.mkdir(parents=True, exist_ok=True)
        torch.save(extra, tmp_t)
        os.replace(tmp_t, tpath)
        tmp_j.write_text(json.dumps(header, sort_keys=True) + "\n" + body)
        os.replace(tmp_j, jpath)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's writer on a full disk
        for left in (tmp_t, tmp_j) if jpath.exists() else (tmp_t, tmp_j, tpath):  # nothing half-written stays
            try:
                left.unlink(missing_ok=True)
            except OSError:
                pass
        why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        warn_once(f"compile cache folder '{jpath.parent}' is not writable ({why}); compiling without "
                  "the cache (set HETFORGE_COMPILE_CACHE_DIR to a writable folder, or HETFORGE_COMPILE_CACHE=0)")
        return False
    evict(keep=key)
    return True


def load(key: str, doc: dict[str, Any], module: torch.nn.Module,
         executor: Any = None, step: Any = None) -> tuple[CachedResult, dict[str, Any]] | None:
    """The entry for ``key`` as a :class:`CachedResult` (program bound to ``module``'s weights, memory plan
    re-made and checked against the stored one) and its meta; None when there is none. With ``executor`` (a
    placed executor) and an entry that holds built partitions, ``res.extra["built"]`` carries them rebuilt for
    it (see :func:`_built`; bound to ``step``, a :class:`~hetforge.runtime.executors.StepBinding`). Raises
    :class:`CacheEntryError` for a corrupt or stale entry (after deleting it)."""
    jpath, tpath = _paths(key)
    try:
        text = jpath.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        _drop(key)
        raise CacheEntryError(f"unreadable ({e})") from None
    try:
        os.utime(jpath)  # used now: the size bound deletes the least recently used entries first
    except OSError:
        pass  # a read-only cache still serves hits
    try:
        return _load(text, tpath, doc, module, executor, step)
    except CacheEntryError:
        _drop(key)
        raise
    except Exception as e:  # anything a damaged entry can raise while being rebuilt: never use it
        _drop(key)
        raise CacheEntryError(f"corrupt ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _load(text: str, tpath: Path, doc: dict[str, Any], module: torch.nn.Module,
          executor: Any = None, step: Any = None) -> tuple[CachedResult, dict]:
    from hetforge.placement import Placement

    head, sep, body = text.partition("\n")
    if not sep:
        raise CacheEntryError("corrupt (cut off)")
    try:
        header = json.loads(head)
    except json.JSONDecodeError:
        raise CacheEntryError("corrupt (header is not JSON)") from None
    if header.get("format") != FORMAT:
        raise CacheEntryError(f"stale (format {header.get('format')!r}, this hetforge writes {FORMAT})")
    if header.get("key") != doc:
        raise CacheEntryError("stale (made for other weights, options or another hetforge)")
    if hashlib.sha256(body.encode()).hexdigest() != header.get("sha256"):
        raise CacheEntryError("corrupt (content does not match its sha256)")
    d = json.loads(body)
    text, weights, meta = d["program"], d["weights"], d["meta"]
    extra = torch.load(tpath, weights_only=True, mmap=True) if any(not w["param"] for w in weights) else {}
    tensors = _bound_weights(weights, extra, module)
    onednn.seed_choices(meta.get("gemm_choices") or [])  # the kernel choices measured when it was compiled
    placement = Placement(meta["strategy"], dict(meta["assignment"]), objective=meta["objective"])
    gm = _Graph(_Nodes([None] * int(meta["nodes"])))
    built = meta.get("built")
    fast = built is not None and executor is not None and _builds_here(built, executor)
    if fast:
        res = CachedResult(None, None, placement, gm, lambda: _program(text, weights, tensors),
                           (int(built["summary"][0]), dict(built["summary"][1]), built["summary"][2]))
    else:
        res = CachedResult(*_program(text, weights, tensors), placement, gm)
    if meta.get("partition_costs"):
        from hetforge.hetero.runner import PartitionCost

        res.partition_costs = [PartitionCost(float(t), float(e), list(u)) for t, e, u in meta["partition_costs"]]
    if meta.get("quantize"):
        res.extra["quantize"] = type("Q", (), {"report": _QuantNote(meta["quantize"])})()
    if fast:
        res.extra["built"] = _built(built, weights, tensors, executor, res, step)
    return res, meta


def _bound_weights(weights: list[dict[str, Any]], extra: dict[str, torch.Tensor], module: torch.nn.Module) \
        -> dict[int, torch.Tensor]:
    """Value id → tensor for every weight of the stored program: the model's own (no copy) or a tensor the
    passes made (from ``KEY.pt``, checked against its CRC); a missing or reshaped one makes the entry stale."""
    from hetforge.ir.program import dtype_from_short
    from hetforge.ir.serialize import _lookup_tensor, checksum

    out: dict[int, torch.Tensor] = {}
    made: list[int] = []  # value ids of the tensors the passes made that no twin replaced
    for w in weights:
        t = _lookup_tensor(module, w["path"]) if w["param"] else extra.get(str(w["value"]))
        if t is None or list(t.shape) != w["shape"] or t.dtype != dtype_from_short(w["dtype"]):
            raise CacheEntryError(f"stale (weight '{w['path']}' missing or of another shape)")
        if not w["param"] and checksum(t) != w["checksum"]:  # tensors the passes made (small): garbled in KEY.pt
            raise CacheEntryError(f"corrupt (tensor '{w['path']}' does not match its checksum)")
        twin = None if w["param"] else _twin(t)
        out[int(w["value"])] = twin if twin is not None else t.detach()
        if not w["param"] and twin is None:
            made.append(int(w["value"]))
    if len(made) < sum(not w["param"] for w in weights):
        # some were replaced by their twins: KEY.pt is one file mapping, which any tensor left from it would keep
        # mapped whole (its pages resident), so the ones kept are copied out of it
        for vid in made:
            out[vid] = out[vid].clone()
    for vid in made:
        _remember(out[vid])
    return out


TWIN_MIN_BYTES = 1 << 16  # smaller tensors the passes made are not worth a comparison
_BOUND: dict[tuple, list[weakref.ref]] = {}  # (dtype, shape, strides) → tensors bound from entries, weakly held


def _twin(t: torch.Tensor) -> torch.Tensor | None:
    """An equal tensor this process already holds, or None: one an earlier entry bound (:func:`_remember`) or a
    weight this process quantized (``quant.rewrite.shared_tensors``). Why: each entry stores its own copy of the
    tensors the passes made (a w8 program's int8 weights), so a decode program from a forked child, or a
    prefill and a decode program from two entries, would otherwise each hold every weight again. Programs only
    read these constants, so sharing one is safe; equal bytes are checked, not assumed (``torch.equal`` returns
    at the first differing byte, so a wrong candidate costs little)."""
    if t.nbytes < TWIN_MIN_BYTES:
        return None
    from hetforge.quant.rewrite import shared_tensors

    key = (t.dtype, tuple(t.shape), t.stride())
    held = [r() for r in _BOUND.get(key, [])]
    for c in [c for c in held if c is not None] + [q for q in shared_tensors()
                                                   if (q.dtype, tuple(q.shape), q.stride()) == key]:
        if torch.equal(c, t):
            return c
    return None


def _remember(t: torch.Tensor) -> None:
    """Offer ``t`` (bound from an entry) as a twin to later entries, weakly held."""
    if t.nbytes >= TWIN_MIN_BYTES:
        key = (t.dtype, tuple(t.shape), t.stride())
        _BOUND[key] = [r for r in _BOUND.get(key, []) if r() is not None] + [weakref.ref(t)]


def _program(text: str, weights: list[dict[str, Any]], tensors: dict[int, torch.Tensor]) -> tuple[Any, Any]:
    """The whole scheduled program of an entry (its JSON text), checked (shape, verifier, memory plan) and bound."""
    return _program_of(json.loads(text), weights, tensors)


def _program_of(pd: dict[str, Any], weights: list[dict[str, Any]], tensors: dict[int, torch.Tensor]) \
        -> tuple[Any, Any]:
    """:func:`_program` on the parsed program dict."""
    from hetforge.ir.serialize import _build_program, validate_program_dict
    from hetforge.ir.verify import verify_program
    from hetforge.memplan import plan_memory

    validate_program_dict(pd, "the cached program")
    if pd["weights"] != weights:
        raise CacheEntryError("corrupt (the program's weights differ from the entry's)")
    p = _build_program(pd)
    for vid in p.weights:
        p.tensors[vid] = tensors[vid]
    verify_program(p, "schedule")
    mem = plan_memory(p)
    stored = {int(k): v for k, v in p.memory["offsets"].items()}
    if mem.offsets != stored:
        raise CacheEntryError("stale (its memory plan differs from the one this hetforge makes)")
    return p, mem


def _builds_here(built: dict[str, Any], executor: Any) -> bool:
    """Whether every stored partition's device is bound here to hetforge's CPU executor (what stored them)."""
    from hetforge.backends.torch_cpu import TorchCpuBackend

    for part in built["partitions"]:
        b = executor.bindings.get(part["device"])
        if b is None or type(b.backend) is not TorchCpuBackend or b.backend.engine != "executor":
            return False
    return True


class _CachedPartition(Partition):
    """A partition rebuilt from a cache entry: its GraphModule is made from the whole program on first use
    (the CPU executor runs the stored lowered program and never reads it; failover or a report may)."""

    def __init__(self, index: int, device: str, nodes: list[str], inputs: list[str], outputs: list[str],
                 weights: list[str], res: CachedResult, graphs: dict[str, Any]):
        self.index, self.device, self.nodes = index, device, nodes
        self.inputs, self.outputs, self.weights = inputs, outputs, weights
        self._res, self._graphs = res, graphs

    @property
    def gm(self) -> Any:  # type: ignore[override]
        if "pg" not in self._graphs:
            from hetforge.hetero.program import partition_program

            self._graphs["pg"] = partition_program(self._res.program)
        return self._graphs["pg"].partitions[self.index].gm


def _built(built: dict[str, Any], weights: list[dict], tensors: dict[int, torch.Tensor], executor: Any,
           res: CachedResult, step: Any = None) -> tuple:
    """(partitions, executable, build report) from an entry's built partitions: each stored lowered program
    bound to the weights, its memory plan made again and checked against the stored one, then generated into
    the executor's code; no partitioning, lowering or kernel choice again. (No program verifier here: the entry
    is byte for byte what this same hetforge source stored — sha256 and key — from a program it had lowered and
    run; the whole program, when something asks for it, is verified as before.)"""
    from hetforge.hetero.runner import assemble
    from hetforge.ir.serialize import _build_program, _dec
    from hetforge.memplan import plan_memory
    from hetforge.runtime.executors import bind_partition

    t0 = time.perf_counter()
    by_path = {w["path"]: tensors[int(w["value"])] for w in weights}
    graphs: dict[str, Any] = {}
    parts, compiled = [], []
    for sp in built["partitions"]:
        q = _build_program(sp["program"])
        for vid, ref in q.weights.items():
            t = by_path.get(ref.path)
            if t is None or tuple(t.shape) != ref.shape or t.dtype != ref.dtype:
                raise CacheEntryError(f"corrupt (partition weight '{ref.path}' is not a weight of the program)")
            q.tensors[vid] = t
        plan = plan_memory(q)
        if plan.offsets != {int(k): v for k, v in sp["offsets"].items()}:
            raise CacheEntryError("stale (a partition's memory plan differs from the one this hetforge makes)")
        backend = executor.bindings[sp["device"]].backend
        compiled.append(backend.executable(q, plan, time.perf_counter(),
                                           *bind_partition(step, backend, built["graph_inputs"], sp["inputs"])))
        parts.append(_CachedPartition(int(sp["index"]), sp["device"], list(sp["nodes"]), list(sp["inputs"]),
                                      list(sp["outputs"]), list(sp["weights"]), res, graphs))
    spec = built.get("out_spec")
    out_spec = torch.utils._pytree.treespec_loads(spec) if spec else None
    pg = PartitionedGraph(parts, list(built["graph_inputs"]), _dec(built["output_args"]), out_spec, None,
                          list(built["fixups"]))
    exe, report = assemble(pg, executor.soc_profile, executor.bindings, compiled, res.partition_costs, t0)
    return pg, exe, report


def cached_build(programs: Any, kind: str, length: int, module: torch.nn.Module, inputs: tuple,
                 step: Any = None) -> Any:
    """The runtime's built program from the cache, or a callback that stores the freshly built one: returns
    ``(build or None, store_fn or None, notes)``; the caller (:mod:`hetforge.runtime.programs`) wraps a hit in its
    ``Program`` and times it."""

    if not holds(programs):
        return None, None, []
    max_bytes()  # a bad size bound is a usage error before any work, not after a compile
    t0 = time.perf_counter()
    doc, key = _keyed(programs, kind, length, module, inputs)
    notes: list[str] = []
    try:
        got = load(key, doc, module, programs.executor, step)
    except CacheEntryError as e:
        got = None
        notes.append(f"compile cache: entry {key[:12]}… {e}: deleted, rebuilt")
        warn_once(f"compile cache entry {key[:12]}… in {cache_dir()} was {e}: deleted, and the {kind} program "
                  "is compiled again (never used)")
    if got is not None:
        res, meta = got
        b = programs.executor.build_program(res, res.extra.pop("built", None), step=step)
        secs = time.perf_counter() - t0
        b.notes.insert(0, f"compile cache: hit {key[:12]}… in {cache_dir()} ({secs:.3f} s measured, capture, passes, "
                          "placement, lowering, scheduling and memory planning skipped; no warm-up call)")
        if meta.get("passes"):
            ps = meta["passes"]
            fused = ", ".join(f"{k} x{v}" for k, v in ps["fused"].items() if v) or "none"
            b.notes.insert(1, f"passes (cached): {ps['nodes_before']} -> {ps['nodes_after']} nodes; fused ops: {fused}")
        return b, None, []

    def store_fn(b: Any) -> None:
        if b.placed is not None and store(key, doc, b.placed.compiled, [], b.nodes, b.placed.exe.costs, b.placed):
            b.notes.append(f"compile cache: stored {key[:12]}… in {cache_dir()}")

    return None, store_fn, notes
