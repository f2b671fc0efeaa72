"""What this host has, checked now: one row per backend with whether it can run and why (not)."""

from __future__ import annotations

import torch

from hetforge.backends.base import PEERS_HINT
from hetforge.backends.openvino import available_plugins, openvino_version


def inventory() -> list[dict]:
    """Rows ``{backend, available, detail}`` for torch-cpu, torch-cuda and each OpenVINO plugin."""
    rows = [{"backend": "torch-cpu", "available": True,
             "detail": f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads (hetforge executor)"}]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append({"backend": "torch-cuda", "available": True, "detail": names})
    else:
        rows.append({"backend": "torch-cuda", "available": False,
                     "detail": "torch.cuda.is_available() is False (no CUDA device or a CPU-only PyTorch)"})
    ver = openvino_version()
    if ver is None:
        rows.append({"backend": "openvino", "available": False, "detail": f"not installed: `{PEERS_HINT}`"})
    else:
        plugins = available_plugins()
        for p in ("CPU", "GPU", "NPU"):
            have = [x for x in plugins if x == p or x.startswith(p + ".")]
            rows.append({"backend": f"openvino:{p}", "available": bool(have),
                         "detail": f"OpenVINO {ver}: " + (", ".join(have) if have else f"no {p} plugin device")})
    return rows
