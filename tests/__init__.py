"""The test suite: unit/ spawns nothing, process/ starts processes of ours, dist/ and e2e/
run multi-process jobs, storage/ runs the storage contract, deploy/ and repo/ check the
files beside the code, gpu/ needs a CUDA device."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
