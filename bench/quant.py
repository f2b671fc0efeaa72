"""Weight quantization benchmark: speed and fidelity of fp32 / w8 / w4 / w8a8 next to OpenVINO, in one run.

For each model: capture at [1,1] (one-token, decode-shaped forward, no cache) and [1,128] (prefill), quantize
each graph with ``hetforge.quant.quantize_graph``, and time every system interleaved (round-robin, median +
min, all **measured**). Each hetforge row also shows the bandwidth bound: bytes of the weights a forward must
stream (tensors read by anything other than an embedding gather) ÷ a copy bandwidth measured in this run.
OpenVINO rows: the same HF model through ``ov.convert_model``, f32 inference precision, weights either f32 or
compressed to int8 / int4 by :func:`hetforge.quant.openvino.compress_weights` (NNCF's decompression pattern;
NNCF itself is not installed).

Fidelity: KL(fp32 eager ‖ system) and top-1 agreement over the 128 prefill positions. With ``demo`` in the
model list and its weights shipped, also perplexity on its held-back validation text (fp32 / w8 / w4 / w8a8).

    python bench/quant.py --models gpt2 llama-110m --reps 7 --threads 2 --out docs/bench/quant.json

A system whose first call takes longer than ``--slow-s`` seconds is timed ``--slow-reps`` times only (PyTorch's
int8/int4 weight-only CPU kernels on an AVX2-only host); for those without one-time setup the first call counts as
one of them. The table says n for every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from hetforge.frontend import capture
from hetforge.models.zoo import example_inputs, load_model
from hetforge.quant import quantize_graph
from hetforge.verify import compare_logits

warnings.filterwarnings("ignore")
SCHEMES = ("w8", "w4", "w8a8")
NO_SETUP = {"hetforge fp32", "hetforge w8", "hetforge w4"}  # first call does no packing / compiling


def copy_bandwidth(mb: int = 256, reps: int = 7) -> tuple[float, float]:
    """(median, best) GB/s of ``dst.copy_(src)`` counting bytes read + written (measured)."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates), max(rates)


def streamed_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the constants a forward reads in full (a tensor read only by an embedding gather is not)."""
    seen: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        users = {str(u.target) for u in n.users}
        if users and all("embedding" in u for u in users):
            continue
        t = gm
        for part in str(n.target).split("."):
            t = getattr(t, part)
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def openvino_systems(module: torch.nn.Module, inputs: tuple, threads: int, group_size: int) -> dict[str, Callable]:
    """OpenVINO f32 / int8-compressed / int4-compressed forwards (empty dict when OpenVINO is missing)."""
    try:
        import numpy as np
        import openvino as ov
    except ImportError:
        return {}
    from hetforge.quant.openvino import compress_weights

    core = ov.Core()
    out: dict[str, Callable] = {}
    for label, scheme in (("openvino f32", None), ("openvino int8 weights", "w8"), ("openvino int4 weights", "w4")):
        with torch.no_grad():
            model = ov.convert_model(module, example_input=inputs)
        if scheme:
            rep = compress_weights(model, scheme, group_size)
            print(f"  {label}: {rep.compressed} MatMul weights compressed, {rep.skipped} skipped", flush=True)
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                     "INFERENCE_NUM_THREADS": threads})
        req = compiled.create_infer_request()

        def fwd(ids, mask, req=req):
            req.infer([ids.numpy(), mask.numpy()], share_inputs=True)
            return torch.from_numpy(np.array(req.get_output_tensor(0).data))

        out[label] = fwd
    return out


def time_interleaved(systems: dict[str, Callable], inputs: tuple, first_s: dict[str, float], reps: int,
                     slow_s: float, slow_reps: int) -> dict[str, dict]:
    """Round-robin timing: every round calls each system once; slow systems stop after ``slow_reps``.

    ``first_s`` is each system's first call. A system slower than ``slow_s`` is timed ``slow_reps`` times; if it
    has no one-time setup (:data:`NO_SETUP`: weights prepared before the call) its first call counts as one run.
    FBGEMM (w8a8) packs its weights and OpenVINO compiles kernels on the first call, so theirs never counts.
    """
    times: dict[str, list[float]] = {k: [] for k in systems}
    want: dict[str, int] = {}
    for k in systems:
        slow = first_s[k] > slow_s
        want[k] = slow_reps if slow else reps
        if slow and k in NO_SETUP:
            times[k].append(first_s[k] * 1e3)
    with torch.no_grad():
        for _ in range(reps):
            for k, f in systems.items():
                if len(times[k]) >= want[k]:
                    continue
                t = time.perf_counter()
                f(*inputs)
                times[k].append((time.perf_counter() - t) * 1e3)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "n": len(v)} for k, v in times.items()}


def perplexity(forward: Callable, chunks: list[torch.Tensor]) -> float:
    """exp(mean next-token NLL) over fixed-length token chunks."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in chunks:
            logits = forward(ids, torch.ones_like(ids)).float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            nll += float(loss)
            count += ids.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count)))


def bench_model(name: str, args) -> dict:
    print(f"== {name}", flush=True)
    loaded = load_model(name)
    module = loaded.logits_module().eval()
    shapes = {"decode [1,1]": example_inputs(loaded, seq=1), "prefill [1,128]": example_inputs(loaded, seq=128)}
    res: dict = {"model": name, "weights": loaded.weights, "parameters": loaded.num_parameters, "shapes": {}}
    ov = ({} if args.no_openvino else
          openvino_systems(module, shapes["prefill [1,128]"], args.threads, args.group_size))
    for shape, inputs in shapes.items():
        t0 = time.perf_counter()
        cg = capture(module, inputs, name=name)
        systems: dict[str, Callable] = {"hetforge fp32": cg.gm}
        info: dict[str, dict] = {"hetforge fp32": {"weight_bytes": streamed_bytes(cg.gm)}}
        for scheme in SCHEMES:
            q = quantize_graph(cg.gm, scheme, group_size=args.group_size)
            systems[f"hetforge {scheme}"] = q.gm
            info[f"hetforge {scheme}"] = {"weight_bytes": streamed_bytes(q.gm), "quantized": len(q.report.quantized),
                                          "kept_float": [f"{e.path}: {e.reason}" for e in q.report.skipped]}
        systems.update(ov)
        print(f"  {shape}: captured + quantized in {time.perf_counter() - t0:.1f} s", flush=True)
        first_s: dict[str, float] = {}
        with torch.no_grad():
            ref = module(*inputs)
            for k, f in systems.items():  # the first call: fidelity, and the warm-up
                t = time.perf_counter()
                got = f(*inputs)
                first_s[k] = time.perf_counter() - t
                fid = compare_logits(ref, got)
                info.setdefault(k, {})["fidelity"] = {"kl_mean": fid.kl_mean, "kl_max": fid.kl_max,
                                                      "top1_agree": fid.top1_agree, "positions": fid.positions}
        timing = time_interleaved(systems, inputs, first_s, args.reps, args.slow_s, args.slow_reps)
        for k, v in timing.items():
            info[k].update(v)
            wb = info[k].get("weight_bytes")
            if wb:
                info[k]["bandwidth_bound_ms"] = wb / (args.bandwidth[0] * 1e9) * 1e3
            print(f"  {shape:16s} {k:26s} {v['median_ms']:9.1f} ms median, {v['min_ms']:9.1f} min (n={v['n']})"
                  + (f", bound {info[k]['bandwidth_bound_ms']:.1f} ms" if wb else ""), flush=True)
        res["shapes"][shape] = info
    if name == "demo":
        res["perplexity"] = demo_perplexity(loaded, module, args)
    return res


def demo_perplexity(loaded, module, args) -> dict:
    """Perplexity of the demo model on its held-back validation text: fp32 and each scheme (measured)."""
    from hetforge.models import demo

    text = demo.validation_text()
    if not text or loaded.tokenizer is None:
        return {"note": "demo model has no recorded validation split or tokenizer"}
    ids = torch.tensor(loaded.tokenizer(text)["input_ids"])
    n = min(args.ppl_chunks, len(ids) // args.ppl_len)
    chunks = [ids[i * args.ppl_len:(i + 1) * args.ppl_len][None] for i in range(n)]
    cg = capture(module, (chunks[0], torch.ones_like(chunks[0])), name="demo")
    out = {"tokens": n * args.ppl_len, "chunk_len": args.ppl_len, "fp32 eager": perplexity(module, chunks)}
    for scheme in SCHEMES:
        q = quantize_graph(cg.gm, scheme, group_size=args.group_size)
        out[scheme] = perplexity(q.gm, chunks)
        out[f"{scheme} kept_float"] = [e.path for e in q.report.skipped]
    print(f"  demo perplexity: {out}", flush=True)
    return out


def _t(d: dict) -> str:
    return f"{d['median_ms']:.1f} / {d['min_ms']:.1f} ({d['n']})"


def markdown(results: dict) -> str:
    """The results as Markdown tables (time: measured median / min ms, n; bound: modeled from measured bandwidth)."""
    bw = results["copy_bandwidth_gbs"]
    lines = [f"copy bandwidth (measured): {bw['median']:.1f} GB/s median, {bw['best']:.1f} best; "
             f"threads {results['machine']['threads']}, CPU capability {results['machine']['cpu_capability']}", ""]
    for m in results["models"]:
        if "shapes" not in m:
            lines += [f"**{m['model']}**: {m.get('note', '')}", ""]
            continue
        lines += [f"**{m['model']}** ({m['parameters'] / 1e6:.0f} M parameters, {m['weights']})", "",
                  "| system | decode [1,1] ms median / min (n) | prefill [1,128] ms median / min (n) "
                  "| weights streamed MB | bandwidth bound ms | KL mean (prefill) | top-1 agree |",
                  "|---|---|---|---|---|---|---|"]
        dec, pre = m["shapes"]["decode [1,1]"], m["shapes"]["prefill [1,128]"]
        for k in dec:
            d, p = dec[k], pre[k]
            wb = d.get("weight_bytes")
            streamed = f"{wb / 1e6:.0f} | {d['bandwidth_bound_ms']:.1f}" if wb else " | "
            lines.append(f"| {k} | {_t(d)} | {_t(p)} | {streamed} | {p['fidelity']['kl_mean']:.2e} | "
                         f"{p['fidelity']['top1_agree']:.3f} |")
        if "perplexity" in m:
            lines += ["", f"perplexity on held-back text: {json.dumps(m['perplexity'])}"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama-110m", "demo"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--slow-s", type=float, default=3.0)
    ap.add_argument("--slow-reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--ppl-len", type=int, default=128)
    ap.add_argument("--ppl-chunks", type=int, default=16)
    ap.add_argument("--no-openvino", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--from-json", default="", help="print the Markdown tables of an earlier --out file and exit")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)))
        return
    torch.set_num_threads(args.threads)
    args.bandwidth = copy_bandwidth()
    print(f"copy bandwidth (measured): {args.bandwidth[0]:.1f} GB/s median, {args.bandwidth[1]:.1f} best", flush=True)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "threads": args.threads, "torch": torch.__version__,
                           "cpu_capability": torch.backends.cpu.get_cpu_capability()},
               "copy_bandwidth_gbs": {"median": args.bandwidth[0], "best": args.bandwidth[1]},
               "group_size": args.group_size, "models": []}
    for name in args.models:
        if name == "demo":
            from hetforge.models import demo

            if not demo.available():
                print("== demo: weights not shipped yet, skipped", flush=True)
                results["models"].append({"model": "demo", "note": "weights not shipped at benchmark time"})
                continue
        results["models"].append(bench_model(name, args))
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
