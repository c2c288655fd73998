#!/usr/bin/env bash
# Run one command in the arm64 root under emulation (qemu-user through binfmt_misc):
#
#   tools/arm64/chroot.sh ROOT COMMAND [ARGS...]
#
# In a private mount namespace of its own (unshare), so that nothing mounted here is seen by,
# or can outlive, anything else: /proc (with an aarch64 /proc/cpuinfo), /sys, /dev (with a fresh
# /dev/shm for multiprocessing's semaphores) and a fresh /tmp on disk, unmounted by the EXIT trap
# (and gone with the namespace anyway if the trap never runs). The command runs as root with a
# clean environment (PIP_* and the like from the host would point at host paths): HOME=/root,
# PATH with the EdgeSync venv first, the host's CA bundle, EDGESYNC_WORKLOADS=/src/shared/workloads,
# and the variables named ARM64_* and the proxy settings passed through (the host's EDGESYNC_*
# are not: they name host paths). The network is the host's, so 127.0.0.1 is the host's loopback
# (a redis-server there is reachable).
set -euo pipefail

die() { echo "arm64-check: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: $0 ROOT COMMAND [ARGS...]"
ROOT=$(realpath "$1")
shift
[ -x "$ROOT/usr/bin/python3" ] || die "$ROOT is not an arm64 root with python3 (make arm64-check builds it)"

if [ -z "${ARM64_CHROOT_NS:-}" ]; then
    ARM64_CHROOT_NS=1 exec unshare --mount --propagation private -- "$0" "$ROOT" "$@"
fi

mounted=()
session_tmp=
cleanup() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount "${mounted[i]}" 2>/dev/null || umount -l "${mounted[i]}" 2>/dev/null \
            || echo "arm64-check: could not unmount ${mounted[i]}" >&2
    done
    if [ -n "$session_tmp" ] && ! grep -q " $ROOT/tmp " /proc/self/mounts; then
        rm -rf --one-file-system "$session_tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mnt() {  # mnt TARGET MOUNT-ARGS...
    local target=$1
    shift
    [ -e "$target" ] || mkdir -p "$target"
    mount "$@" "$target"
    mounted+=("$target")
}

mnt "$ROOT/proc" -t proc proc
# qemu-user (Debian 12's 7.2) shows an emulated program the host's /proc/cpuinfo, an x86 one:
# parsers of it for ARM (pytorch's cpuinfo, inside onnxruntime) find no ARM core and crash on
# import. The root gets an aarch64 one instead, as a phone-class core (Cortex-A55: armv8.2-a,
# fp16, dotprod, the llama.cpp build's target) would show, one entry per host CPU.
cpuinfo=$ROOT/opt/edgesync/cpuinfo
mkdir -p "$(dirname "$cpuinfo")"
for ((cpu = 0; cpu < $(nproc --all); cpu++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 38.40\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x2\nCPU part\t: 0xd05\nCPU revision\t: 0\n\n' \
        "$cpu" "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
done > "$cpuinfo"
mnt "$ROOT/proc/cpuinfo" --bind "$cpuinfo"
mnt "$ROOT/sys" -t sysfs -o ro sysfs
mnt "$ROOT/dev" --bind /dev
mnt "$ROOT/dev/pts" --bind /dev/pts
mnt "$ROOT/dev/shm" -t tmpfs -o mode=1777,nosuid,nodev shm
# /tmp: a fresh directory on disk for each session, not a tmpfs (file pages on tmpfs count as
# shared memory, not RssFile, which tests of the store's page-cache use read).
session_tmp=$(mktemp -d "$ROOT/var/tmp/arm64-check-tmp.XXXXXX")
chmod 1777 "$session_tmp"
mnt "$ROOT/tmp" --bind "$session_tmp"

# Name resolution for pip: the host's resolver; localhost for the host's servers.
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
[ -s "$ROOT/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$ROOT/etc/hosts"

# TLS: the root trusts what the host trusts (a host behind a TLS-inspecting proxy has its CA in
# its bundle, not in Debian's): the host's bundle, copied in, for pip and Python's ssl.
host_ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
ca_envs=()
if [ -s "$host_ca" ]; then
    cp -L "$host_ca" "$ROOT/etc/ssl/host-ca-certificates.crt"
    ca=/etc/ssl/host-ca-certificates.crt
    ca_envs=(PIP_CERT=$ca SSL_CERT_FILE=$ca REQUESTS_CA_BUNDLE=$ca)
fi

# Without binfmt's fix_binary flag the kernel looks for the emulator inside the root.
entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
if [ -e "$entry" ] && ! grep -q '^flags:.*F' "$entry"; then
    interp=$(sed -n 's/^interpreter //p' "$entry")
    [ -e "$ROOT$interp" ] || install -D -m 755 "$(readlink -f "$interp")" "$ROOT$interp"
fi

envs=(HOME=/root LANG=C.UTF-8 LC_ALL=C.UTF-8 "TERM=${TERM:-dumb}"
      PATH=/opt/edgesync/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      "${ca_envs[@]}")
for name in $(compgen -e); do
    case $name in
        ARM64_CHROOT_NS) ;;
        ARM64_* | http_proxy | https_proxy | no_proxy | HTTP_PROXY | HTTPS_PROXY | NO_PROXY)
            envs+=("$name=${!name}") ;;
    esac
done
# The host's EDGESYNC_* settings name host paths: none is passed; the workload data is the copy
# sync_source.sh made beside the source.
if [ -d "$ROOT/src/shared/workloads" ]; then
    envs+=(EDGESYNC_WORKLOADS=/src/shared/workloads)
fi

set +e
chroot "$ROOT" /usr/bin/env -i "${envs[@]}" "$@"
status=$?
set -e
exit $status
