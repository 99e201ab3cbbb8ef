#!/usr/bin/env bash
# Installs elastic-train for the systemd units next to this script. Run as root:
#   deploy/systemd/install.sh [--prefix DIR] [--root DIR] [--package SPEC] [--pip-arg ARG]...
#
#   --prefix DIR    the virtual environment          (default: /opt/elastic-train)
#   --root DIR      install under DIR instead of /   (default: /); for staging and tests:
#                   the venv's scripts name DIR/PREFIX, so to build a root file system
#                   run this script inside it (chroot DIR) instead
#   --package SPEC  what pip installs                (default: elastic-train[s3,gcs])
#   --pip-arg ARG   one more argument for pip, e.g. --pip-arg=--extra-index-url=URL
#                   (repeatable; torch's CPU wheels: https://download.pytorch.org/whl/cpu)
#
# It creates the system user and group elastic-train that elastic-train@.service runs as,
# the venv with the package, /etc/systemd/system/elastic-train@.service and
# elastic-train-store.service (ExecStart pointing into the venv), and /etc/elastic-train/ with
# example.env. Idempotent: an existing user is kept, env files are never overwritten, the
# venv and the units are brought up to date. Exit 2 with one line for a bad argument.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/opt/elastic-train
root=""
package="elastic-train[s3,gcs]"
pip_args=()
user=elastic-train
python="${PYTHON:-python3}"

say() { printf 'install.sh: %s\n' "$*" >&2; }
usage_error() {
    say "$1 (usage: install.sh [--prefix DIR] [--root DIR] [--package SPEC] [--pip-arg ARG]...)"
    exit 2
}

while (($#)); do
    case "$1" in
        --prefix=* | --root=* | --package=* | --pip-arg=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    esac
    case "$1" in
        --prefix | --root | --package | --pip-arg)
            (($# >= 2)) || usage_error "$1 needs a value"
            case "$1" in
                --prefix) prefix="$2" ;;
                --root) root="${2%/}" ;;
                --package) package="$2" ;;
                --pip-arg) pip_args+=("$2") ;;
            esac
            shift 2
            ;;
        -h | --help)
            sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
            exit 0
            ;;
        *) usage_error "unknown argument '$1'" ;;
    esac
done
[[ "$prefix" == /* ]] || usage_error "--prefix must be an absolute path, not '$prefix'"
[[ -z "$root" || "$root" == /* ]] || usage_error "--root must be an absolute path, not '$root'"
[[ "$(id -u)" == 0 ]] || usage_error "run as root: it creates a system user and writes /etc"

create_user() {
    local passwd="$root/etc/passwd"
    if grep -q "^$user:" "$passwd" 2>/dev/null || { [[ -z "$root" ]] && getent passwd "$user" >/dev/null; }; then
        say "user $user exists"
        return
    fi
    local chroot=()
    [[ -n "$root" ]] && chroot=(--root "$root")
    # No home folder: the units give the service its own state folder (StateDirectory=).
    useradd "${chroot[@]}" --system --user-group --no-create-home \
        --home-dir /var/lib/elastic-train --shell /usr/sbin/nologin \
        --comment "elastic-train supervisor" "$user"
    say "created system user $user"
}

create_venv() {
    local venv="$root$prefix"
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade \
        "${pip_args[@]}" "$package"
    [[ -x "$venv/bin/elastic-train" ]] || {
        say "$package installed no elastic-train command in $venv/bin"
        exit 1
    }
    say "installed $package in $venv"
}

install_units() {
    local unit units="$root/etc/systemd/system"
    install -d -m 0755 "$units"
    for unit in elastic-train@.service elastic-train-store.service; do
        sed "s|/opt/elastic-train/bin/elastic-train|$prefix/bin/elastic-train|g" "$here/$unit" \
            >"$units/$unit.tmp"
        chmod 0644 "$units/$unit.tmp"
        mv "$units/$unit.tmp" "$units/$unit"
    done
    say "installed the units in $units"
}

install_env_files() {
    local etc="$root/etc/elastic-train"
    install -d -m 0750 "$etc"
    chgrp "$(group_id)" "$etc"  # the service reads its env file as root, then drops to the user
    if [[ ! -e "$etc/example.env" ]]; then
        install -m 0640 "$here/example.env" "$etc/example.env"
    fi
    say "env files in $etc: copy example.env to JOB.env for elastic-train@JOB"
}

group_id() {  # numeric, from the target root's group file: chgrp resolves names on this host
    awk -F: -v g="$user" '$1 == g { print $3 }' "$root/etc/group"
}

create_user
create_venv
install_units
install_env_files
if [[ -z "$root" && -d /run/systemd/system ]]; then
    systemctl daemon-reload
fi
say "done: systemctl enable --now elastic-train@JOB (flags in /etc/elastic-train/JOB.env)"
