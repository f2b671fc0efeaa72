#!/bin/bash
# The CUDA / Triton checks, for a machine with an NVIDIA GPU (run from the repository root).
#
# What it checks, all for real on the GPU: the torch-cuda backend and the executor's CUDA device map (the tests
# that skip without CUDA, and the placed-generation / hetero tests whose `gpu` maps to CUDA there), KForge's
# CUDA C++ and Triton platforms (a hand-written candidate of each through the guarded harness), and a placed
# generation from the CLI with the SoC's gpu on torch-cuda. Python packages the machine's image lacks are
# installed from wheels in .whl/ when that folder exists (a machine without a registry); the image's own torch
# is used. Logs go to $OUT (or ./gpu_check_out).
set -u
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
HF="python3 -c 'from hetforge.cli.main import main; main()'"

echo "== machine"
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
command -v nvcc && nvcc --version | tail -1

echo "== CUDA start under the KForge worker's limits"
python3 - <<'EOF'
import subprocess, sys
for lim in ("AS", "DATA"):
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_{lim}, (8 << 30, 8 << 30)); import torch; "
            f"torch.zeros(1, device='cuda'); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"RLIMIT_{lim} 8 GiB: rc {r.returncode}", (r.stdout + r.stderr).strip().splitlines()[-1:])
r = subprocess.run(["unshare", "-rn", sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); print('ok')"],
                   capture_output=True, text=True)
print("unshare -rn:", r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:])
EOF

echo "== tests (CUDA visible)"
HETFORGE_SLOW=1 timeout 420 python3 -m pytest -p no:cacheprovider -p no:warnings -q -rfEs -n 8 --timeout 300 \
  tests/test_backends.py tests/test_executor.py tests/test_kforge.py tests/test_hetero.py \
  tests/test_placed_generation.py 2>&1 | tee "$OUT/tests.log" | tail -40

echo "== placed generation, gpu on torch-cuda (measured on this GPU; energy modeled)"
timeout 120 bash -c "$HF run gpt2-tiny --soc jetson-orin-nano -n 16 --prompt Hello --ignore-eos" 2>&1 | tee "$OUT/run.log" | tail -8
timeout 120 bash -c "$HF run llama-tiny --soc jetson-orin-nano --backend gpu=torch-cuda -n 16 --prompt Hello --ignore-eos" 2>&1 | tee -a "$OUT/run.log" | tail -6
timeout 120 bash -c "$HF hetero llama-tiny --soc jetson-orin-nano --layout all:gpu --repeat 5" 2>&1 | tee "$OUT/hetero.log" | tail -12
echo "== done"
