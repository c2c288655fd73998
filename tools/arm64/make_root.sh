#!/usr/bin/env bash
# The arm64 root file system of make arm64-check: Debian with Python, from Debian's mirror, its
# package scripts run under emulation (about 3.5 minutes on 2 cores):
#
#   tools/arm64/make_root.sh ROOT [SUITE] [MIRROR]
#
# Built into ROOT.tmp and renamed ROOT when complete, so an interrupted build never leaves a
# half root behind a finished step. Refuses to delete anything that has a mount under it.
set -euo pipefail

die() { echo "arm64-check: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 ROOT [SUITE] [MIRROR]"
ROOT=$(realpath -m "$1")
SUITE=${2:-bookworm}
MIRROR=${3:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates

remove() {  # remove DIR: rm -rf, unless something is mounted under it or a process runs in it
    local dir=$1 p r
    [ -e "$dir" ] || return 0
    if awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        die "$dir has file systems mounted under it (an arm64-check still running?); not removing it"
    fi
    # chroot.sh's mounts live in private namespaces, invisible here: look for its processes.
    for p in /proc/[0-9]*; do
        r=$(readlink "$p/root" 2>/dev/null) || continue
        if [ "$r" = "$dir" ] || [ "${r#"$dir"/}" != "$r" ]; then
            die "process ${p#/proc/} runs in $dir (a chroot session still running?); not removing it"
        fi
    done
    rm -rf --one-file-system "$dir"
}

remove "$ROOT.tmp"
remove "$ROOT"
mkdir -p "$(dirname "$ROOT")"
mmdebstrap --arch=arm64 --variant=apt --include="$PACKAGES" "$SUITE" "$ROOT.tmp" "$MIRROR"
mv "$ROOT.tmp" "$ROOT"
echo "arm64-check: arm64 $SUITE root in $ROOT"
