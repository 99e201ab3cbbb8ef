#!/usr/bin/env bash
# Installs the system tools the deploy tests use, from Debian's packages:
#   the shellcheck linter, for deploy/**/*.sh and this script
#   systemd, which provides systemd-analyze, which verifies deploy/systemd/*.service
#   slurm-wlm, with slurmctld + slurmd for the optional localhost Slurm test
#   iproute2 (ip), for the network-namespace tests (tests/e2e/test_networks.py)
#   util-linux (unshare), for the node whose hostname does not resolve
#     (set ELASTIC_TRAIN_SKIP_SLURM=1 to leave it out)
# Idempotent and quiet: when every tool is already there it returns without touching apt.
# Runs as root without sudo (containers, CI) and uses sudo otherwise.
set -euo pipefail

packages=()
command -v shellcheck >/dev/null 2>&1 || packages+=(shellcheck)
command -v systemd-analyze >/dev/null 2>&1 || packages+=(systemd)
command -v ip >/dev/null 2>&1 || packages+=(iproute2)
command -v unshare >/dev/null 2>&1 || packages+=(util-linux)
if [[ "${ELASTIC_TRAIN_SKIP_SLURM:-0}" != 1 ]]; then
    { command -v slurmctld && command -v slurmd; } >/dev/null 2>&1 || packages+=(slurm-wlm)
fi
((${#packages[@]} == 0)) && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-system: apt-get not found; install ${packages[*]} by hand" >&2
    exit 0  # the tests that need them skip with a reason
fi

as_root=()
if [[ "$(id -u)" != 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "setup-system: not root and no sudo; install ${packages[*]} by hand" >&2
        exit 0
    fi
    as_root=(sudo -n)
fi

export DEBIAN_FRONTEND=noninteractive
apt_opts=(-y -qq -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=300 --no-install-recommends)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# apt and maintainer scripts are chatty on stderr even when all is well: show it on failure only.
if ! { "${as_root[@]}" apt-get update -qq && "${as_root[@]}" apt-get install "${apt_opts[@]}" "${packages[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup-system: could not install ${packages[*]}; the tests that need them will skip" >&2
    exit 0
fi
echo "setup-system: installed ${packages[*]}"
