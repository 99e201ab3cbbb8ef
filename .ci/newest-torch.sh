#!/usr/bin/env bash
# The fast tests on the newest torch that pip offers, when it is newer than the one the
# README's test command installed (pyproject pins the range we test, see
# elastic_trainer/torch_compat.py). A torch release that moves one of the private pieces we
# rely on then fails here the day it appears, instead of in a user's job.
# Runs inside the project venv; ELASTIC_TRAIN_NEWEST_TORCH=warn reports without failing.
set -euo pipefail
cd "$(dirname "$0")/.."

installed=$(python -c 'import torch; print(torch.__version__.split("+")[0])')
newest=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([^)]*\))$/\1/p')
if [[ -z "$newest" || "$newest" == "$installed" ]]; then
    echo "newest-torch: torch $installed is the newest release pip offers; nothing more to run"
    exit 0
fi

echo "newest-torch: torch $newest is out (tested range ends at $installed); fast tests on it"
python -m venv .venv-newest-torch
# shellcheck disable=SC1091
. .venv-newest-torch/bin/activate
pip install -q -e '.[test]' && pip install -q "torch==$newest" torchvision
status=0
python -m pytest -q -m "not integration" tests/unit tests/process \
    --deselect tests/unit/test_torch_compat.py::test_installed_torch_is_in_the_tested_range \
    --deselect tests/unit/test_torch_compat.py::test_pyproject_pins_the_tested_range || status=$?
if [[ $status -ne 0 && "${ELASTIC_TRAIN_NEWEST_TORCH:-fail}" == warn ]]; then
    echo "newest-torch: FAILED on torch $newest (ELASTIC_TRAIN_NEWEST_TORCH=warn: not fatal)"
    exit 0
fi
exit $status
