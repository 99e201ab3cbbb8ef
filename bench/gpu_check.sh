#!/usr/bin/env bash
# The GPU tier in one command (a machine with >= 1 CUDA GPU; about 10 minutes at most):
# every test of tests/gpu (marked `gpu`), with the figures they measure (recovery times,
# loss scale) written as JSON lines to $GPU_RESULTS and printed at the end.
#
#   bench/gpu_check.sh            # from the repository root, the venv active
#
# Then the session's per-step cost on the GPU against the same loop with no session
# (bench/session_step_cost.py --device cuda, ResNet-18 at 224 px, batch 128).
#
# A torch outside the tested range (torch_compat.TESTED_TORCH) is named in the first line:
# GPU images often carry an older torch than pip would install, and a failure may be the
# release's, not the GPU's.
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
from elastic_trainer.supervisor.torch_compat import untested_torch

if untested := untested_torch(torch.__version__):
    print(f"gpu_check: {untested}")
PY
status=0
timeout 600 "$PYTHON" -m pytest -m gpu tests/gpu -v -rs --timeout 300 || status=$?
echo "gpu_check: the session's cost per step on the GPU:"
timeout 180 "$PYTHON" bench/session_step_cost.py --device cuda --batch 128 --image 224 \
    --steps 20 --blocks 5 || status=$?
echo "gpu_check: figures ($GPU_RESULTS):"
cat "$GPU_RESULTS"
exit "$status"
