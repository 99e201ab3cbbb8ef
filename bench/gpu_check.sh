#!/usr/bin/env bash
# The GPU tier in one command (a machine with >= 1 CUDA GPU; about 10 minutes at most):
# every test of tests/gpu (marked `gpu`), with the figures they measure (recovery times,
# loss scale) written as JSON lines to $GPU_RESULTS and printed at the end.
#
#   bench/gpu_check.sh            # from the repository root, the venv active
#
# bench/snapshot_stall.py has no device option (it is CPU only), so no stall row on the GPU
# is run here yet.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export GPU_RESULTS="${GPU_RESULTS:-${OUT:-.}/gpu_results.jsonl}"
: >"$GPU_RESULTS"
"$PYTHON" - <<'PY'
import torch

if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible to torch; run this on a GPU machine")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {names}")
PY
status=0
timeout 600 "$PYTHON" -m pytest -m gpu tests/gpu -v -rs --timeout 300 || status=$?
echo "gpu_check: figures ($GPU_RESULTS):"
cat "$GPU_RESULTS"
exit "$status"
