#!/usr/bin/env bash
# The fast tests on the newest torch that pip offers, when it is newer than the one the
# README's test command installed (pyproject pins the range we test, see
# elastic_trainer/supervisor/torch_compat.py). A torch release that moves one of the private pieces we
# rely on then fails here the day it appears, instead of in a user's job.
#
# A machine may cap torch with a pip constraint file (pip.conf `constraint = ...`, as the CI
# machines do to install from wheels on disk); the cap is why the README's command installed
# an older release than a user's fresh machine gets, so these installs ignore it
# (PIP_CONSTRAINT=/dev/null): asked for torch==NEWEST under the cap, pip can only answer
# ResolutionImpossible.
#
# Runs inside the project venv. ELASTIC_TRAIN_NEWEST_TORCH=warn reports a failure without
# failing; --dry-run only asks pip whether the newest release would install (what
# tests/repo/test_ci.py checks).
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
[[ "${1:-}" == "--dry-run" ]] && dry_run=1

torch_version() { python -c 'import torch; print(torch.__version__.split("+")[0])'; }
installed=$(torch_version)
newest=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([^)]*\))$/\1/p')
if [[ -z "$newest" || "$newest" == "$installed" ]]; then
    echo "newest-torch: torch $installed is the newest release pip offers; nothing more to run"
    exit 0
fi

uncapped=(env PIP_CONSTRAINT=/dev/null python -m pip install -q)
if [[ $dry_run -eq 1 ]]; then
    "${uncapped[@]}" --dry-run --no-deps "torch==$newest"
    echo "newest-torch: torch $newest would install (installed: $installed)"
    exit 0
fi

echo "newest-torch: torch $newest is out (tested range ends at $installed); fast tests on it"
python -m venv .venv-newest-torch
# shellcheck disable=SC1091
. .venv-newest-torch/bin/activate
# Uncapped, the project's own range brings the newest torch it admits; a release past the
# range is then installed over it (pip warns of the conflict, which is what this tests).
"${uncapped[@]}" -e '.[test]'
if [[ $(torch_version) != "$newest" ]]; then
    "${uncapped[@]}" "torch==$newest" torchvision
fi
echo "newest-torch: testing on torch $(torch_version)"
status=0
# tests/unit: every decision and every torch_compat probe; tests/dist: FSDP2, DCP and the
# process groups on gloo, where a torch release changes behaviour rather than names;
# tests/inprocess: its ranks are threads through torch's private thread-local world.
python -m pytest -q -n 2 --dist loadfile tests/unit tests/dist tests/inprocess \
    --deselect tests/unit/test_torch_compat.py::test_installed_torch_is_in_the_tested_range \
    --deselect tests/unit/test_torch_compat.py::test_pyproject_pins_the_tested_range || status=$?
if [[ $status -ne 0 && "${ELASTIC_TRAIN_NEWEST_TORCH:-fail}" == warn ]]; then
    echo "newest-torch: FAILED on torch $newest (ELASTIC_TRAIN_NEWEST_TORCH=warn: not fatal)"
    exit 0
fi
exit $status
