#!/usr/bin/env bash
# make arm64-check, host side: the Debian packages it needs (cross compilers, qemu-user, binfmt
# support, mmdebstrap), binfmt_misc mounted and qemu-aarch64 registered, so that aarch64 programs
# run under emulation, in a chroot too. Idempotent: installs only what is missing, registers only
# when not registered. Needs root (apt-get, mount, chroot).
set -euo pipefail

PACKAGES=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static binfmt-support mmdebstrap)
BINFMT=/proc/sys/fs/binfmt_misc

die() { echo "arm64-check: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (apt-get, binfmt_misc, mmdebstrap and chroot): run 'sudo make arm64-check'"
command -v apt-get >/dev/null && command -v dpkg-query >/dev/null \
    || die "needs a Debian-like host (apt-get, dpkg-query)"

missing=()
for p in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    [ "$status" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "arm64-check: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}"
fi

if [ ! -e "$BINFMT/status" ]; then
    modprobe binfmt_misc 2>/dev/null || true
    mount -t binfmt_misc binfmt_misc "$BINFMT" 2>/dev/null \
        || die "binfmt_misc is not mounted at $BINFMT and cannot be (a container without the
privilege to mount it: mount it on the host, 'mount -t binfmt_misc binfmt_misc $BINFMT',
or run the container privileged)"
fi
if [ "$(cat "$BINFMT/status")" != enabled ]; then
    echo 1 > "$BINFMT/status" 2>/dev/null || die "binfmt_misc is disabled ($BINFMT/status) and cannot be enabled"
fi

# update-binfmts registers the entry qemu-user-static installed in /usr/share/binfmts (fix_binary:
# the kernel opens the emulator at registration time, so a chroot needs no copy of it).
if ! grep -qx enabled "$BINFMT/qemu-aarch64" 2>/dev/null; then
    update-binfmts --enable qemu-aarch64 \
        || die "update-binfmts --enable qemu-aarch64 failed: aarch64 programs cannot run on this host"
fi
grep -qx enabled "$BINFMT/qemu-aarch64" 2>/dev/null \
    || die "qemu-aarch64 is not registered in $BINFMT after update-binfmts --enable qemu-aarch64"
interp=$(sed -n 's/^interpreter //p' "$BINFMT/qemu-aarch64")
[ -x "$interp" ] || die "qemu-aarch64's registered interpreter $interp is missing"
echo "arm64-check: host ready (qemu-aarch64 registered: $interp, flags $(sed -n 's/^flags: //p' "$BINFMT/qemu-aarch64"))"
